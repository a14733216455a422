"""docs/plan.md quotes what ``megatron-lns plan`` prints: each ``$ megatron-lns plan ...``
block is rerun and must print what the page shows (update the page when it changes)."""

import re
import shlex

import pytest
from helpers import ROOT

from megatron_lns.cli import main

PAGE = ROOT / "docs" / "plan.md"
BLOCK = re.compile(r"```console\n\$ (megatron-lns plan [^\n]*)\n(.*?)\n```", re.S)
EXAMPLES = BLOCK.findall(PAGE.read_text())


def test_the_page_has_its_examples():
    assert len(EXAMPLES) == 4


@pytest.mark.parametrize(
    "command, shown", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))]
)
def test_each_example_prints_what_the_page_shows(command, shown, capsys):
    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out.rstrip() == shown, f"docs/plan.md is stale: {command}"
