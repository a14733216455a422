"""cluster.env_vars reach the batch script as the user wrote them: YAML's booleans and
integers as YAML spells them; what cannot be exported as written is refused by name."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from helpers import config_error, validated_demo_config

from megatron_lns.cluster.slurm.submit import prepare_job


def _exports(*overrides: str) -> dict[str, str]:
    cfg = validated_demo_config(*overrides)
    script = prepare_job(cfg, Path("/home/alice/lns"), "/opt/venv/bin/python", stamp="x").script
    lines = [
        line[len("export ") :]
        for line in script.splitlines()
        if line.startswith("export ") and "=" in line
    ]
    return dict(shlex.split(line)[0].split("=", 1) for line in lines)


def test_yaml_booleans_and_integers_are_exported_as_yaml_spells_them():
    exports = _exports(
        "+cluster.env_vars.B=true",
        "+cluster.env_vars.C=false",
        "+cluster.env_vars.N=8",
        "+cluster.env_vars.Q='1.50'",
    )
    assert {name: exports[name] for name in "BCNQ"} == {
        "B": "true",
        "C": "false",
        "N": "8",
        "Q": "1.50",
    }


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "+cluster.env_vars.LD_LIBRARY_PATH=/opt/x:$LD_LIBRARY_PATH",
            "cluster.env_vars.LD_LIBRARY_PATH='/opt/x:$LD_LIBRARY_PATH': '$' would not expand",
        ),
        ("+cluster.env_vars.F=1.50", "cluster.env_vars.F=1.5: a YAML number whose spelling"),
        ("+cluster.env_vars.Z=null", "cluster.env_vars.Z is null"),
    ],
)
def test_a_value_that_would_not_be_exported_as_written_is_refused(override, message):
    assert config_error(override).startswith(message)
