"""docs/configuration.md's key tables are what the declarations in schema.py give."""

from pathlib import Path

from megatron_lns.config.reference import groups, key_table, render, shown_default, tabled_groups

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


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
