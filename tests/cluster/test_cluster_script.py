"""``slurm/test-cluster/cluster.sh`` keeps to its own cluster: ``start`` refuses a port in
use (rather than run its tests on the cluster that holds it), picks free ports by
itself, and says "SLURM is up" only when its own daemons answer there; ``stop`` kills
only the processes that its ``start`` started."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import ROOT

SCRIPT = ROOT / "slurm" / "test-cluster" / "cluster.sh"
PORT_VARIABLES = ("SLURM_TEST_CTLD_PORT", "SLURM_TEST_SLURMD_PORT")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="cluster.sh start needs root")


def _cluster_sh(
    command: str, cluster_dir: Path, *args: str, **ports: int
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in PORT_VARIABLES}
    env.update({name: str(port) for name, port in ports.items()})
    return subprocess.run(
        [str(SCRIPT), command, str(cluster_dir), *args], env=env, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _listener():
    """A port held by another program (as another cluster's slurmctld would hold it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        yield s.getsockname()[1]


def _start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _alive(process: subprocess.Popen) -> bool:
    return process.poll() is None


@pytest.fixture()
def unrelated_process():
    process = subprocess.Popen(["sleep", "300"])
    yield process
    process.kill()
    process.wait()


@needs_root
@pytest.mark.parametrize("held", PORT_VARIABLES)
def test_start_refuses_a_port_in_use_and_starts_nothing(tmp_path, held):
    with _listener() as port:
        ports = {name: port if name == held else _free_port() for name in PORT_VARIABLES}
        result = _cluster_sh("start", tmp_path / "cluster", **ports)
    assert result.returncode != 0
    assert result.stderr == (
        f"cluster.sh: port {port} ({held}) is already in use: another cluster or program "
        f"listens there; choose a free port, or unset {held} to pick one\n"
    )
    assert not (tmp_path / "cluster" / "run" / "daemons").exists()


def test_stop_leaves_alone_the_process_a_stale_pid_file_names(tmp_path, unrelated_process):
    run = tmp_path / "cluster" / "run"
    run.mkdir(parents=True)
    (run / "slurmctld.pid").write_text(f"{unrelated_process.pid}\n")
    result = _cluster_sh("stop", tmp_path / "cluster")
    assert result.returncode == 0, result.stderr
    assert _alive(unrelated_process)


@pytest.mark.parametrize(
    ("recorded_as", "same_start", "stopped"),
    [("slurmctld", True, False), ("sleep", False, False), ("sleep", True, True)],
    ids=["another-command", "another-start-time", "the-recorded-process"],
)
def test_stop_kills_a_recorded_pid_only_while_it_is_the_same_process(
    tmp_path, unrelated_process, recorded_as, same_start, stopped
):
    pid = unrelated_process.pid
    started = _start_time(pid) if same_start else "1"
    run = tmp_path / "cluster" / "run"
    run.mkdir(parents=True)
    (run / "daemons").write_text(f"{recorded_as} {pid} {started}\n")
    assert _cluster_sh("stop", tmp_path / "cluster").returncode == 0
    if stopped:
        unrelated_process.wait(timeout=30)
    else:
        assert _alive(unrelated_process)


@pytest.mark.slow  # ~16 s on 2 busy cores, most of it slurmd's exit
@needs_root
@pytest.mark.skipif(shutil.which("slurmctld") is None, reason="SLURM is not installed")
def test_a_cluster_on_free_ports_is_its_own_and_stops_completely():
    # Under /tmp, readable by the munge user (pytest's tmp_path is private to root).
    base = Path(tempfile.mkdtemp(prefix="megatron-lns-cluster-test."))
    base.chmod(0o755)
    cluster, other = base / "cluster", base / "other"
    pids: list[int] = []
    try:
        started = _cluster_sh("start", cluster)
        assert started.returncode == 0, started.stderr
        ports = dict(line.split("=") for line in (cluster / "ports.env").read_text().split())
        ctld, slurmd = int(ports["SLURM_TEST_CTLD_PORT"]), int(ports["SLURM_TEST_SLURMD_PORT"])
        assert f"SLURM is up on ports {ctld}/{slurmd}" in started.stderr
        conf = (cluster / "slurm.conf").read_text()
        assert f"SlurmctldPort={ctld}\n" in conf and f"SlurmdPort={slurmd}\n" in conf
        env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf")}
        ping = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True)
        assert "is UP" in ping.stdout, ping
        # A second cluster asked for the first one's port does not attach to it.
        refused = _cluster_sh("start", other, SLURM_TEST_CTLD_PORT=ctld)
        assert refused.returncode != 0 and "already in use" in refused.stderr
        daemons = [line.split() for line in (cluster / "run" / "daemons").read_text().split("\n")]
        pids = [int(fields[1]) for fields in daemons if fields]
        assert [fields[0] for fields in daemons if fields] == ["munged", "slurmctld", "slurmd"]
    finally:
        stopped = _cluster_sh("stop", cluster)
        shutil.rmtree(base, ignore_errors=True)
    assert stopped.returncode == 0, stopped.stderr
    assert not [pid for pid in pids if _running(pid)]


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs: a daemon that has exited but that this machine's init
    has not reaped yet (a zombie) has stopped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


@needs_root
@pytest.mark.skipif(shutil.which("slurmctld") is None, reason="SLURM is not installed")
def test_nodes_in_namespaces_have_their_own_names_and_addresses_and_are_removed_at_stop():
    base = Path(tempfile.mkdtemp(prefix="megatron-lns-cluster-test."))
    base.chmod(0o755)
    cluster = base / "cluster"
    # Another's namespace, of the same form as the cluster's: stop leaves it alone. Named
    # for this process: one left by a test killed before its cleanup must not fail this.
    other = f"lnsot{os.getpid()}n1"
    subprocess.run(["ip", "netns", "add", other], check=True)
    pids: list[int] = []
    try:
        started = _cluster_sh("start", cluster, "--nodes", "2")
        assert started.returncode == 0, started.stderr
        made = [line.split() for line in (cluster / "run" / "network").read_text().splitlines()]
        namespaces = [name for kind, name in made if kind == "netns"]
        links = [name for kind, name in made if kind == "link"]
        assert len(namespaces) == 2 and len(links) == 3  # the bridge and two veths
        assert all(len(name) <= 15 for name in links)
        daemons = [line.split() for line in (cluster / "run" / "daemons").read_text().splitlines()]
        pids = [int(fields[1]) for fields in daemons]
        assert [fields[3] for fields in daemons if fields[0] == "slurmd"] == namespaces
        env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf")}
        probe = subprocess.run(
            ["srun", "--nodes=2", "sh", "-c", "echo $(hostname) $(getent hosts $(hostname))"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert probe.returncode == 0, probe.stderr
        rows = sorted(line.split() for line in probe.stdout.splitlines())
        # Each node: its own hostname, resolving to its own address (not 127.0.0.1).
        assert [row[0] for row in rows] == namespaces and len({row[1] for row in rows}) == 2
        assert all(row[2] == row[0] and not row[1].startswith("127.") for row in rows), rows
    finally:
        stopped = _cluster_sh("stop", cluster)
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        subprocess.run(["ip", "netns", "del", other])
        shutil.rmtree(base, ignore_errors=True)
    assert stopped.returncode == 0, stopped.stderr
    assert other in netns and not any(name in netns for name in namespaces)
    for link in links:
        assert subprocess.run(["ip", "link", "show", link], capture_output=True).returncode != 0
    assert not (cluster / "run" / "network").exists()
    assert not [pid for pid in pids if _running(pid)]
