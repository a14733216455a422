"""docs/configuration.md's key tables are what the declarations in schema.py give."""

import re

from helpers import ROOT

from megatron_lns.config.nemo_compat import NEMO_KEYS, Inert
from megatron_lns.config.reference import groups, key_table, render, shown_default, tabled_groups
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.config.settings import declared_settings

PAGE = ROOT / "docs" / "configuration.md"


def test_committed_key_tables_are_rendered_from_the_declarations():
    page = PAGE.read_text()
    assert render(page) == page, (
        "docs/configuration.md is out of date: run "
        "python -m megatron_lns.config.reference docs/configuration.md"
    )


def test_every_declared_group_has_one_table():
    tabled = tabled_groups(PAGE.read_text())
    assert sorted(tabled) == sorted(groups())
    assert len(tabled) == len(set(tabled))


def test_a_changed_declaration_shows_in_the_rendered_table():
    page = PAGE.read_text()
    stale = page.replace("| `model.num_layers` | 12 |", "| `model.num_layers` | 13 |")
    assert stale != page
    assert render(stale) == page


def test_defaults_are_shown_as_yaml_spells_them():
    assert shown_default(None) == "null"
    assert shown_default(None, "= heads") == "null (= heads)"
    assert shown_default(True) == "true"
    assert shown_default("rope") == "`rope`"
    assert shown_default(1e-5) == "1e-5"
    assert shown_default(2.0**32) == "4294967296"
    assert shown_default(0.25) == "0.25"
    assert shown_default([]) == "`[]`"
    assert "| `model.hidden_size` | 768 |" in key_table("architecture")


def _listed_keys(page: str, heading: str) -> set[str]:
    """The keys in the first column of the table that follows ``heading``."""
    table = page.split(heading, 1)[1].split("\n\n", 2)[1]
    keys = set()
    for row in table.splitlines()[2:]:
        first_column = row.split("|")[1]
        keys.update(re.findall(r"`([\w.]+)`", first_column))
    return keys


def test_the_nemo_tables_list_every_nemo_key_and_no_other():
    """The NeMo tables are written by hand (their wording is the docs'); what they list is
    NEMO_KEYS, the aliases apart (those are in the key tables' prose)."""
    page = PAGE.read_text()
    aliases = {
        f"{item.key.rpartition('.')[0]}.{alias}"
        for item in declared_settings(ExperimentConfig)
        for alias in item.setting.aliases
    }
    inert = {k for k, rule in NEMO_KEYS.items() if isinstance(rule, Inert)}
    others = set(NEMO_KEYS) - inert - aliases
    assert _listed_keys(page, "**Inert** (one warning):") == inert
    assert _listed_keys(page, "**Accepted only at the value megatron-lns runs**") == others
