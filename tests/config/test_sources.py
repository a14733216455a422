"""One config loader for every command: a YAML file, a bundled config's name, or a
directory that keeps a run's config.yaml (run directory, checkpoint), with overrides."""

from pathlib import Path

import pytest
from helpers import ROOT

from megatron_lns.cli import main
from megatron_lns.config import ConfigError, to_yaml
from megatron_lns.config.sources import RUN_CONFIG, config_file, load_run_config

DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"


def _stored_run(directory: Path, *overrides: str) -> Path:
    """A directory holding the resolved config of the demo, as a run leaves it."""
    directory.mkdir(parents=True)
    (directory / RUN_CONFIG).write_text(to_yaml(load_run_config(DEMO, overrides)))
    return directory


def test_a_file_a_bundled_name_and_a_run_directory_load_the_same_config(tmp_path):
    run_dir = _stored_run(tmp_path / "run")
    from_file = load_run_config(DEMO, ["model.num_layers=6"])
    assert load_run_config("tiny_cpu_demo", ["model.num_layers=6"]) == from_file
    assert load_run_config(run_dir, ["model.num_layers=6"]) == from_file
    assert load_run_config(str(run_dir / RUN_CONFIG), ["model.num_layers=6"]) == from_file
    assert from_file.model.num_layers == 6


def test_a_directory_without_a_run_config_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_run_config(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / RUN_CONFIG} is missing:")
    assert "\n" not in message


def test_errors_in_a_stored_config_name_its_file(tmp_path):
    run_dir = _stored_run(tmp_path / "run")
    with pytest.raises(ConfigError, match=rf"^{run_dir / RUN_CONFIG}: override 'model.nope=1'"):
        load_run_config(run_dir, ["model.nope=1"])
    with pytest.raises(ConfigError, match=r"^override 'model.nope=1'"):
        load_run_config(DEMO, ["model.nope=1"])


def test_a_bundled_name_wins_over_a_directory_that_holds_no_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny_cpu_demo").mkdir()
    assert config_file("tiny_cpu_demo").samefile(DEMO)


def test_train_dry_run_takes_a_run_directory(tmp_path, capsys):
    run_dir = _stored_run(tmp_path / "run", "model.num_layers=6")
    assert main(["train", str(run_dir), "model.hidden_size=64", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "num_layers: 6" in out and "hidden_size: 64" in out


def _experiment(exp_dir: Path, *names: str) -> list[Path]:
    """``exp_dir`` holding runs ``names`` (``name`` or ``name/time``), each with a
    complete checkpoint, as ``exp_manager.exp_dir`` does."""
    runs = []
    for name in names:
        checkpoint = _stored_run(exp_dir / name / "checkpoints" / "iter_0000003")
        (checkpoint / "complete.json").write_text("{}\n")
        (exp_dir / name / RUN_CONFIG).write_text((checkpoint / RUN_CONFIG).read_text())
        runs.append(exp_dir / name)
    return runs


def test_an_experiment_directory_given_for_a_run_names_the_runs_inside(tmp_path, capsys):
    [run] = _experiment(tmp_path / "exp", "lns")
    hint = f"; {tmp_path / 'exp'} is no run directory but holds the run {run}: give that one"
    assert main(["export-hf", str(tmp_path / "exp"), str(tmp_path / "hf")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: no complete checkpoint") and line.endswith(hint)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ConfigError) as info:
        load_run_config(tmp_path / "exp")
    assert str(info.value).endswith(hint)


def test_an_experiment_directory_of_several_runs_names_them(tmp_path):
    runs = _experiment(tmp_path / "exp", "a/t1", "a/t2", "b", "c", "d")
    with pytest.raises(ConfigError) as info:
        load_run_config(tmp_path / "exp")
    assert str(info.value).endswith(
        f"holds the runs {runs[0]}, {runs[1]}, {runs[2]} and 2 more: give one of them"
    )
    with pytest.raises(ConfigError) as info:
        load_run_config(tmp_path / "empty")  # not even a directory: a bundled name
    assert "holds the run" not in str(info.value)
