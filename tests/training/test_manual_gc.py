"""model.gc_interval: automatic collection off for the run, gc.collect() every N steps."""

import gc

import pytest
from helpers import FIXTURES, ROOT

from megatron_lns.training.manual_gc import ManualGarbageCollection


@pytest.fixture()
def collections(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *args: calls.append(args) or 0)
    assert gc.isenabled()
    yield calls
    gc.enable()


def _run(interval: int, steps: range, calls: list) -> list[int]:
    """The steps after which a collection ran."""
    manual = ManualGarbageCollection(interval)
    manual.start()
    assert gc.isenabled() == (interval == 0)
    calls.clear()
    collected_after = []
    for step in steps:
        manual.after_step(step)
        if calls:
            collected_after.append(step)
            calls.clear()
    manual.stop()
    assert gc.isenabled()
    return collected_after


def test_collects_every_interval_steps_with_automatic_gc_off(collections):
    assert _run(3, range(1, 11), collections) == [3, 6, 9]


def test_resumed_run_keeps_the_global_step_grid(collections):
    assert _run(4, range(7, 17), collections) == [8, 12, 16]


def test_interval_zero_leaves_python_gc_alone(collections):
    assert _run(0, range(1, 11), collections) == []


def test_start_collects_once_and_stop_restores_a_disabled_collector(collections):
    gc.disable()
    manual = ManualGarbageCollection(5)
    manual.start()
    assert len(collections) == 1
    manual.stop()
    assert not gc.isenabled()


@pytest.mark.filterwarnings("ignore::megatron_lns.config.loader.NemoKeysIgnoredWarning")
def test_nemo_gc_interval_is_read_and_checked():

    from megatron_lns.config import ConfigError, load_config, validate

    nemo = FIXTURES / "nemo_megatron_gpt_config.yaml"
    assert (
        load_config(nemo, ["model.gc_interval=100", "model.data.data_prefix=[x]"]).model.gc_interval
        == 100
    )
    demo = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
    with pytest.raises(ConfigError, match=r"model.gc_interval must be >= 0, got -1"):
        validate(load_config(demo, ["model.gc_interval=-1"]), check_files=False)
