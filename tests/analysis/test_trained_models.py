"""``megatron-lns analyze`` end to end on a tiny trained run: its report and plots, the
same numbers from the run's Hugging Face export and at another parallel layout, and
one-line refusals of bad inputs."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from helpers import fresh_launch_env, run_distributed, tiny_run_config

from megatron_lns.cli import main

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("angular_distance.png", "variance.png", "pruning_drop.png")


def _train(cfg):
    from megatron_lns.training.trainer import Trainer

    return Trainer(cfg).fit().valid_loss


def _analyze(inputs, out_dir, options=None):
    from megatron_lns.analysis.trained_models import analyze

    return json.loads(analyze(inputs, out_dir, **(options or {})).read_text())


@pytest.fixture(scope="module")
def cache(factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEGATRON_LNS_CACHE", str(factory.corpus_cache))
        yield


@pytest.fixture(scope="module")
def run(factory):
    """A six-step run validated on 2 held-out batches; returns (run dir, last val_loss).

    Its vocabulary is not padded: a Hugging Face export drops megatron's padding rows,
    and imported back they are zero, which changes the softmax over the padded vocabulary
    (docs/analysis.md); without padding the export computes exactly the same loss.
    """
    summary = factory.tiny_run(
        "trainer.limit_val_batches=2", "model.make_vocab_size_divisible_by=1"
    )
    return summary["run_dir"], summary["valid"]


def _by_label(report: dict) -> dict[str, dict]:
    return {entry["label"]: entry for entry in report["inputs"]}


def test_analyze_a_run_and_a_checkpoint(run, tmp_path):
    run_dir, valid_loss = run
    out = tmp_path / "out"
    older = run_dir / "checkpoints" / "iter_0000003"
    report = run_distributed(_analyze, 1, tmp_path, [run_dir, older], out)[0]

    entries = _by_label(report)
    assert list(entries) == ["lns", "lns/iter_0000003"]
    latest, early = entries["lns"], entries["lns/iter_0000003"]
    assert latest["kind"] == "run" and latest["iteration"] == 6
    assert early["kind"] == "checkpoint" and early["iteration"] == 3
    # The run's own held-out batches: the full-model loss is its last val_loss.
    assert latest["loss"] == pytest.approx(valid_loss, rel=1e-6)
    assert latest["held_out"]["batches"] == 2 and latest["num_tokens"] == 2 * 4 * 32
    assert early["loss"] != pytest.approx(latest["loss"], rel=1e-4)
    for entry in entries.values():
        rows = entry["layers"]
        assert [row["layer_number"] for row in rows] == [1, 2, 3, 4]
        for row in rows:
            assert 0.0 < row["angular_distance"] < 1.0
            assert 0.0 < row["angular_distance_last_token"] < 1.0
            assert row["output_variance"] > 0.0
            assert row["pruning_drop"] == pytest.approx(row["loss_without_layer"] - entry["loss"])
        assert entry["perplexity"] == pytest.approx(math.exp(entry["loss"]))
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert not list(tmp_path.glob(".out.partial-*"))


def test_a_hugging_face_export_gives_the_checkpoint_numbers(run, tmp_path):
    from megatron_lns.convert import export_hf

    run_dir, _ = run
    hf = export_hf(run_dir, tmp_path / "hf", progress=None)
    report = run_distributed(
        _analyze,
        1,
        tmp_path,
        [run_dir, hf],
        tmp_path / "out",
        {"config": run_dir / "config.yaml"},
    )[0]

    entries = _by_label(report)
    megatron, exported = entries["lns"], entries["hf"]
    assert exported["kind"] == "huggingface" and exported["checkpoint"] is None
    assert exported["num_tokens"] == megatron["num_tokens"]
    assert exported["loss"] == pytest.approx(megatron["loss"], rel=1e-5)
    assert exported["document_loss"] == pytest.approx(megatron["document_loss"], rel=1e-5)
    assert exported["documents"] == megatron["documents"] > 0
    for ours, theirs in zip(megatron["layers"], exported["layers"], strict=True):
        for key in ("angular_distance", "angular_distance_last_token", "output_variance"):
            assert theirs[key] == pytest.approx(ours[key], rel=1e-4)
        assert theirs["pruning_drop"] == pytest.approx(ours["pruning_drop"], abs=1e-5)


MOE_OVERRIDES = (
    "model.num_moe_experts=4",
    "model.moe_ffn_hidden_size=32",
    "model.moe_layer_freq=[0,1,1,1]",
    "model.moe_aux_loss_coeff=0.01",
    "model.moe_shared_expert_intermediate_size=48",
    "model.moe_shared_expert_gate=true",
)


def test_analyze_an_moe_run_and_its_hugging_face_export(tmp_path, cache):
    """Dense and MoE layers analysed alike; the run's Qwen2-MoE export (a dense first layer,
    a gated shared expert) gives the same numbers."""
    from megatron_lns.convert import export_hf

    cfg = tiny_run_config(
        tmp_path,
        "trainer.limit_val_batches=2",
        "model.make_vocab_size_divisible_by=1",
        *MOE_OVERRIDES,
    )
    valid_loss = run_distributed(_train, 1, tmp_path / "train", cfg)[0]
    run_dir = tmp_path / "lns"
    hf = export_hf(run_dir, tmp_path / "hf", progress=None)
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["Qwen2MoeForCausalLM"]
    report = run_distributed(
        _analyze, 1, tmp_path, [run_dir, hf], tmp_path / "out", {"config": run_dir / "config.yaml"}
    )[0]
    entries = _by_label(report)
    megatron, exported = entries["lns"], entries["hf"]
    assert megatron["loss"] == pytest.approx(valid_loss, rel=1e-6)
    assert [row["layer_number"] for row in megatron["layers"]] == [1, 2, 3, 4]
    assert exported["loss"] == pytest.approx(megatron["loss"], rel=1e-5)
    for ours, theirs in zip(megatron["layers"], exported["layers"], strict=True):
        assert 0.0 < ours["angular_distance"] < 1.0
        assert theirs["angular_distance"] == pytest.approx(ours["angular_distance"], rel=1e-4)
        assert theirs["pruning_drop"] == pytest.approx(ours["pruning_drop"], abs=1e-5)


@pytest.mark.long
def test_an_expert_parallel_run_and_its_export_with_the_runs_config(tmp_path, cache):
    """An MoE run trained at EP=2 (two ranks) and its Hugging Face export, analysed with the
    run's own config.yaml from the command line: the run at its layout (EP=2 on two
    processes), the export at EP=1 in one process (an export has no layout), the same
    losses. The vocabulary is padded (257 -> 384): the export's padding rows are restored
    (issue 32)."""
    from megatron_lns.convert import export_hf

    cfg = tiny_run_config(
        tmp_path,
        "trainer.devices=2",
        "trainer.max_steps=3",
        "trainer.limit_val_batches=2",
        "model.expert_model_parallel_size=2",
        "model.num_moe_experts=2",
        "model.moe_ffn_hidden_size=32",
        "model.moe_layer_freq=1",
        "model.moe_aux_loss_coeff=0.01",
    )
    valid_loss = run_distributed(_train, 2, tmp_path / "train", cfg)[0]
    run_dir = tmp_path / "lns"
    hf = export_hf(run_dir, tmp_path / "hf", progress=None)
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "megatron_lns.cli", "analyze", str(run_dir), str(hf),
        "--config", str(run_dir / "config.yaml"), "--no-prune", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, env=fresh_launch_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    entries = _by_label(json.loads((out / "analysis.json").read_text()))
    megatron, exported = entries["lns"], entries["hf"]
    assert megatron["loss"] == pytest.approx(valid_loss, rel=1e-6)
    assert exported["num_tokens"] == megatron["num_tokens"]
    assert abs(exported["loss"] - megatron["loss"]) < 1e-3
    assert abs(exported["document_loss"] - megatron["document_loss"]) < 1e-3


@pytest.fixture(scope="module")
def one_process(run, tmp_path_factory):
    """The run analysed in one process, without layer removal."""
    run_dir, _ = run
    root = tmp_path_factory.mktemp("one_process")
    return run_distributed(_analyze, 1, root, [run_dir], root / "out", {"prune": False})[0]


@pytest.mark.long
@pytest.mark.parametrize(
    "layout",
    [["model.pipeline_model_parallel_size=2"], ["model.data.num_workers=0"]],
    ids=["pp2", "dp2"],
)
def test_cli_on_two_processes_matches_one_process(run, one_process, tmp_path, layout):
    run_dir, _ = run
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "megatron_lns.cli", "analyze", str(run_dir), "--out", str(out),
        "--no-prune", "--labels", "two", "trainer.devices=2", *layout,
    ]  # fmt: skip
    done = subprocess.run(command, env=fresh_launch_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {out / 'analysis.json'}" in done.stdout
    # Settings after --labels are settings; nothing unmeasured is printed as nan.
    assert "pruning drop not computed" in done.stdout and "nan" not in done.stdout

    ours = _by_label(json.loads((out / "analysis.json").read_text()))["two"]
    reference = one_process["inputs"][0]
    assert ours["num_tokens"] == reference["num_tokens"]
    assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    for theirs, mine in zip(reference["layers"], ours["layers"], strict=True):
        assert mine["layer_number"] == theirs["layer_number"]
        for key in ("angular_distance", "angular_distance_last_token", "output_variance"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5)
        assert mine["pruning_drop"] is None


def _error_line(capsys, *argv: str) -> str:
    assert main(["analyze", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_more_batches_than_the_split_holds_are_capped_and_said(run, tmp_path, capfd):
    """``--batches 100000`` on a split of a few batches measured the same sequences over
    and over, for minutes."""
    from megatron_lns.data.blend import DataBlend
    from megatron_lns.data.splits import samples_in_split

    run_dir, _ = run
    options = {
        "batches": 100_000,
        "prune": False,
        "overrides": ["model.data.splits_string=999,1,0"],
    }
    report = run_distributed(_analyze, 1, tmp_path, [run_dir], tmp_path / "out", options)[0]
    (prefix,) = DataBlend.parse(["builtin:pydoc"]).resolved("byte", None, None).prefixes
    sequences = samples_in_split([prefix], "999,1,0", "valid", seq_length=32)
    held = sequences // 4  # global batches of 4
    assert 1 <= held < 100
    (entry,) = report["inputs"]
    assert entry["held_out"]["batches"] == held and entry["num_tokens"] == held * 4 * 32
    assert (
        f"analyze: lns: --batches 100000 is more than the validation split holds ({sequences} "
        f"sequences: {held} global batches of 4); measuring on {held}\n"
    ) in capfd.readouterr().out


def test_a_split_with_no_training_share_is_analysed(run, tmp_path):
    """analyze reads only held-out data: a split that is all validation (``0,100,0``) was
    refused as if it were to train on."""
    run_dir, _ = run
    options = {"batches": 1, "prune": False, "overrides": ["model.data.splits_string=0,100,0"]}
    report = run_distributed(_analyze, 1, tmp_path, [run_dir], tmp_path / "out", options)[0]
    (entry,) = report["inputs"]
    assert entry["held_out"]["splits_string"] == "0,100,0" and entry["num_tokens"] == 4 * 32
    assert entry["documents"] >= 1 and math.isfinite(entry["document_loss"])


def test_bad_inputs_are_refused_in_one_line(run, tmp_path, capsys):
    run_dir, _ = run
    out = str(tmp_path / "out")
    assert "does not exist" in _error_line(capsys, str(tmp_path / "nope"), "--out", out)
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in _error_line(capsys, str(tmp_path / "file"), "--out", out)
    assert "no complete checkpoint" in _error_line(capsys, str(tmp_path), "--out", out)
    error = _error_line(capsys, str(run_dir), "model.num_layers=8", "--out", out)
    assert "model.num_layers: analyze does not change the trained model" in error
    error = _error_line(capsys, str(run_dir), str(run_dir), "--out", out)
    assert "share the label 'lns'" in error
    error = _error_line(capsys, str(run_dir), "--labels", "a", "b", "--out", out)
    assert "2 labels for 1 inputs" in error
    assert "--batches 0" in _error_line(capsys, str(run_dir), "--batches", "0", "--out", out)
    error = _error_line(
        capsys, str(run_dir), "--config", str(run_dir / "config.yaml"), "--out", out
    )
    assert "is for Hugging Face inputs" in error

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert "does not say its held-out data" in _error_line(capsys, str(hf), "--out", out)
    assert not (tmp_path / "out").exists()

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    error = _error_line(capsys, str(run_dir), "--out", str(tmp_path / "taken"))
    assert "pass --overwrite" in error


@pytest.mark.parametrize(
    "pattern, split",
    [("*-*-|*-*-", None), ("*--|*-", None), ("*-*|-*-", 2), ("-|*-*-", 1), ("*-*-", None)],
)
def test_a_pipeline_split_inside_a_hybrid_block_is_found(pattern, split):
    """analyze measures a block on one stage: a '|' must not separate its sublayers."""
    from types import SimpleNamespace

    from megatron_lns.analysis.trained_models import block_split_by_pipeline

    model = SimpleNamespace(architecture="hybrid", hybrid_layer_pattern=pattern)
    assert block_split_by_pipeline(model) == split


def test_an_out_that_is_or_holds_an_input_is_refused(run, factory, tmp_path, capsys):
    """``analyze RUN --out RUN/checkpoints --overwrite`` replaced the checkpoints it had
    analysed with its report: only the run directory given was kept apart from OUT."""
    import shutil

    run_copy = tmp_path / "run"  # a copy: the old code replaced what --out named
    shutil.copytree(run[0], run_copy)
    checkpoints = run_copy / "checkpoints"
    (last,) = [p for p in checkpoints.iterdir() if p.name == "iter_0000006"]
    for out, says in [
        (checkpoints, f"contains the input {last}"),
        (run_copy, f"contains the input {run_copy}"),
        (last, f"contains the input {run_copy}"),
        (last / "analysis", f"is inside the input {last}"),
        (checkpoints / "iter_0000003", f"is inside the input {checkpoints}"),
    ]:
        error = _error_line(capsys, str(run_copy), "--out", str(out), "--overwrite")
        assert error.startswith("error: ") and says in error, error
    error = _error_line(capsys, str(last), "--out", str(checkpoints), "--overwrite")
    assert f"contains the input {last}" in error
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000003",
        "iter_0000006",
    ]

    data = tmp_path / "data"  # the held-out data a run is pointed at
    data.mkdir()
    prefix = factory.dataset(50)
    for ext in (".bin", ".idx"):
        shutil.copy(f"{prefix}{ext}", data / f"corpus{ext}")
    setting = f"model.data.data_prefix=[{data / 'corpus'}]"
    error = _error_line(capsys, str(run_copy), setting, "--out", str(data), "--overwrite")
    assert f"contains the input {data / 'corpus.bin'}" in error
    assert (data / "corpus.bin").is_file()
