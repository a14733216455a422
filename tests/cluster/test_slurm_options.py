"""cluster.sbatch_args / srun_args read as sbatch and srun read them: groups of short
options (``-QN2`` is ``-Q -N 2``) and options no job of this package can take."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import validated_demo_config

from megatron_lns.cluster.slurm.options import SBATCH_SHORT_OPTIONS, option_names
from megatron_lns.cluster.slurm.submit import prepare_job
from megatron_lns.config import ConfigError


def _script(*overrides: str) -> str:
    cfg = validated_demo_config(*overrides)
    return prepare_job(cfg, Path("/home/alice/lns"), "/opt/venv/bin/python", stamp="x").script


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        _script(*overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "arg, names",
    [
        ("-QN2", ["-Q", "-N"]),
        ("-vN2", ["-v", "-N"]),
        ("-Qt5", ["-Q", "-t"]),
        ("-pgpu", ["-p"]),
        ("-kN2", ["-k"]),  # --no-kill's optional value is the rest
        ("-HQv", ["-H", "-Q", "-v"]),
        ("--sig=B:USR1@60", ["--sig"]),
    ],
)
def test_a_group_of_short_options_is_read_as_getopt_reads_it(arg, names):
    assert option_names(arg, SBATCH_SHORT_OPTIONS) == names


# A group of short options, the one the script sets in it, and what sets that one.
GROUPS_WITH_A_SET_OPTION = {
    "-QN2": ("-N", "trainer.num_nodes"),
    "-vN2": ("-N", "trainer.num_nodes"),
    "-Qt5": ("-t", "cluster.time_limit"),
    "-Hpgpu": ("-p", "cluster.partition"),
}


@pytest.mark.parametrize("arg", list(GROUPS_WITH_A_SET_OPTION))
def test_an_option_the_script_sets_in_a_group_of_short_options_is_refused(arg):
    option, source = GROUPS_WITH_A_SET_OPTION[arg]
    message = _refusal(f"cluster.sbatch_args=[{arg}]")
    assert f"'{arg}' ({option} in a group of short options) conflicts with {option}" in message
    assert f"set from {source}" in message


def test_srun_short_option_groups_are_checked_against_srun_options():
    message = _refusal("cluster.srun_args=[-lK]")
    assert "'-lK' (-K in a group of short options) conflicts with -K" in message


def test_a_group_of_short_options_the_script_does_not_set_passes():
    assert "#SBATCH -QCgpu\n" in _script("cluster.sbatch_args=[-QCgpu]")


@pytest.mark.parametrize("arg", ["--array=0-1", "--arr=0-3", "-a0-1", "-Ha0-1"])
def test_a_job_array_is_refused_saying_why(arg):
    message = _refusal(f"cluster.sbatch_args=[{arg}]")
    assert message.startswith(f"cluster.sbatch_args: '{arg}'"), message
    assert "is refused: the tasks of a job array would share one run directory" in message


@pytest.mark.parametrize("limit", ["0", "0:00", "UNLIMITED"])
def test_a_time_limit_of_zero_is_no_limit_as_slurm_reads_it(limit):
    from megatron_lns.config.cluster import time_limit_seconds

    assert time_limit_seconds(limit) is None
    assert f"#SBATCH --time={limit}\n" in _script(f"cluster.time_limit='{limit}'")
