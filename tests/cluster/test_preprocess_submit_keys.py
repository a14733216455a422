"""``preprocess --submit CONFIG``: the cluster: section read as ``submit`` reads it, its
``${...}`` and the overrides' resolved against the whole file, and every key
preprocessing does not use named (the list derived from ClusterConfig, so no key is
dropped silently)."""

from __future__ import annotations

import dataclasses

from helpers import DEMO_CONFIG
from test_preprocess_sbatch import _render, plain_corpus  # noqa: F401 (a fixture)

from megatron_lns.commands.preprocess_submit import PREPROCESS_CLUSTER_KEYS, ignored_keys
from megatron_lns.config.sections.cluster import ClusterConfig


def _demo_with_cluster(tmp_path, section: str):
    config = tmp_path / "demo.yaml"
    # Two devices where the defaults have one, so that the file's value shows.
    config.write_text(DEMO_CONFIG.read_text().replace("devices: 1", "devices: 2") + section)
    return config


def test_interpolations_in_the_cluster_section_resolve_against_the_whole_file(
    tmp_path,
    capsys,
    plain_corpus,  # noqa: F811
):
    section = (
        'cluster:\n  job_name_prefix: "${name}-"\n  env_vars:\n    NPROC: ${trainer.devices}\n'
    )
    code, script, err = _render(capsys, plain_corpus, _demo_with_cluster(tmp_path, section))
    assert code == 0, err
    assert "#SBATCH --job-name=tiny_cpu_demo-preprocess-corpus-" in script
    assert [line for line in script.splitlines() if "NPROC" in line] == ["export NPROC=2"]


def test_interpolations_in_overrides_resolve_as_the_same_text_in_the_file(
    tmp_path,
    capsys,
    plain_corpus,  # noqa: F811
):
    """An override's ``${name}`` was resolved against the cluster: section alone, so it
    read the defaults' name where the file's own ``${name}`` reads tiny_cpu_demo."""
    section = (
        'cluster:\n  job_name_prefix: "${name}-"\n  account: "${exp_manager.name}"\n'
        "  env_vars:\n    NPROC: ${trainer.devices}\n"
    )
    code, from_file, err = _render(capsys, plain_corpus, _demo_with_cluster(tmp_path, section))
    assert code == 0, err
    (tmp_path / "line").mkdir()
    code, from_line, err = _render(
        capsys,
        plain_corpus,
        _demo_with_cluster(tmp_path / "line", "cluster: {}\n"),
        "cluster.job_name_prefix=${name}-",
        "cluster.account=${exp_manager.name}",
        "+cluster.env_vars.NPROC=${trainer.devices}",
    )
    assert code == 0, err
    wanted = ("#SBATCH --job-name=", "#SBATCH --account=", "export NPROC=")
    for script in (from_file, from_line):
        settings = [line for line in script.splitlines() if line.startswith(wanted)]
        assert [line.split("-preprocess-")[0] for line in settings] == [
            "#SBATCH --job-name=tiny_cpu_demo",
            "#SBATCH --account=lns",
            "export NPROC=2",
        ]


def test_an_override_that_does_not_resolve_is_named(tmp_path, capsys, plain_corpus):  # noqa: F811
    config = _demo_with_cluster(tmp_path, "cluster: {}\n")
    override = "cluster.srun_args=['--x=${nope}']"
    code, script, err = _render(capsys, plain_corpus, config, override)
    assert code != 0 and script == ""
    assert err == f"error: override '{override}': Interpolation key 'nope' not found\n"


def test_spare_nodes_is_named_as_not_used(tmp_path, capsys, plain_corpus):  # noqa: F811
    config = tmp_path / "c.yaml"
    config.write_text("cluster:\n  partition: cpu\n")
    code, _, err = _render(capsys, plain_corpus, config, "cluster.spare_nodes=2")
    assert code == 0, err
    assert err.startswith("note: not used by preprocessing: cluster.spare_nodes=2 ("), err


def test_every_cluster_key_is_either_used_by_preprocessing_or_named():
    names = {field.name for field in dataclasses.fields(ClusterConfig)}
    assert names >= PREPROCESS_CLUSTER_KEYS
    named = {key.split(".")[1] for key in ignored_keys() if key.startswith("cluster.")}
    assert named | PREPROCESS_CLUSTER_KEYS == names
    assert {"spare_nodes", "gpus_per_node", "preemption_signal_lead_s"} <= named


def test_a_cluster_section_that_is_no_mapping_is_refused_in_one_line(
    tmp_path,
    capsys,
    plain_corpus,  # noqa: F811
):
    """It ended in a traceback (to_container of an int), with an override or without."""
    config = tmp_path / "c.yaml"
    config.write_text("cluster: 5\n")
    for overrides in ([], ["cluster.account=acc"]):
        code, script, err = _render(capsys, plain_corpus, config, *overrides)
        assert code != 0 and script == ""
        assert err == "error: 'cluster' must be a section of keys, not a single value (5)\n"


def test_a_file_train_reads_is_read_alike_dates_included(
    tmp_path,
    capsys,
    plain_corpus,  # noqa: F811
):
    """PyYAML's own loader made an unquoted date a ``date``, which OmegaConf refused
    ("not a supported primitive type"); train reads it as the string it is."""
    section = "cluster:\n  job_name_prefix: ${started}-\n"
    config = _demo_with_cluster(tmp_path, section)
    config.write_text("started: 2026-12-04\n" + config.read_text())
    code, script, err = _render(capsys, plain_corpus, config)
    assert code == 0, err
    assert "#SBATCH --job-name=2026-12-04-preprocess-corpus-" in script


def test_an_interpolation_reads_the_default_where_the_file_has_no_such_key(
    tmp_path,
    capsys,
    plain_corpus,  # noqa: F811
):
    """As submit reads it: ${trainer.devices} is the default (1) in a file without it."""
    config = tmp_path / "cluster_only.yaml"
    config.write_text("cluster:\n  env_vars:\n    NPROC: ${trainer.devices}\n")
    code, script, err = _render(capsys, plain_corpus, config, "cluster.account=${name}")
    assert code == 0, err
    assert [line for line in script.splitlines() if "NPROC" in line] == ["export NPROC=1"]
    assert "#SBATCH --account=megatron_gpt" in script  # the default name
    assert "partition" not in err  # only the keys given are the file's: no default named
