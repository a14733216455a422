"""The built wheel carries the bundled configs, and the installed CLI finds them from
any working directory (not only from a checkout)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT, fresh_launch_env


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out / "dist"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (out / "dist").glob("megatron_lns-*.whl")
    site = out / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    return wheel, site


def _run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # PYTHONPATH puts the installed copy ahead of the checkout's editable install.
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=fresh_launch_env(PYTHONPATH=str(site)),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_wheel_contains_every_bundled_config(installed_wheel):
    wheel, _ = installed_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"megatron_lns/nemo_configs/{p.name}" for p in (ROOT / "nemo_configs").glob("*.yaml")
    }
    assert expected and expected <= names
    # The batch scripts of `submit` and `preprocess --submit`.
    assert {
        "megatron_lns/slurm/sbatch.template",
        "megatron_lns/slurm/preprocess.sbatch.template",
    } <= names


def test_installed_cli_resolves_bundled_configs_outside_the_repo(installed_wheel, tmp_path):
    _, site = installed_wheel
    where = _run_installed(
        site, tmp_path, "-c", "import megatron_lns; print(megatron_lns.__file__)"
    )
    assert where.stdout.strip().startswith(str(site)), where.stderr

    demo = _run_installed(site, tmp_path, "-m", "megatron_lns.cli", "demo", "--dry-run")
    assert demo.returncode == 0, demo.stderr
    assert "name: tiny_cpu_demo" in demo.stdout

    # The OLMo config is found and read: what it still lacks is the user's tokenizer.
    olmo = _run_installed(
        site,
        tmp_path,
        "-m",
        "megatron_lns.cli",
        "train",
        "nemo_configs/olmo_7b_lns_20b.yaml",
        "--dry-run",
    )
    assert olmo.returncode == 2
    assert olmo.stderr.strip() == "error: 'model.tokenizer.type' is required but not set (???)"
