"""model.enable_megatron_timers: megatron-core's own timers, reported on every rank at
the same steps (a pipeline-parallel run and its resume neither hang nor drop a stage's
timers), to the console and as max-over-ranks metrics; NeMo's kwargs honoured."""

import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import megatron.core
import pytest
from helpers import DEMO_CONFIG, FIXTURES, run_distributed, tiny_run_config

from megatron_lns.config import ConfigError, load_config, validate
from megatron_lns.config.loader import NemoKeysIgnoredWarning
from megatron_lns.training.timers import TIMER_NAMES, MegatronTimers, TimerSettings, timer_settings

NEMO = FIXTURES / "nemo_megatron_gpt_config.yaml"
K = "model.megatron_timer_kwargs."
NEMO_READY = [
    "model.data.data_prefix=[x]",
    "model.tokenizer.library=byte",
    "model.tokenizer.type=null",
]


def test_every_timer_megatron_core_starts_is_reported():
    """A report names a fixed list (identical on every rank); a timer megatron-core
    starts but the list lacks would go unreported."""
    source = Path(megatron.core.__file__).parent
    started = set()
    for path in source.rglob("*.py"):
        started.update(re.findall(r"timers\(\s*['\"]([^'\"]+)['\"]", path.read_text()))
    assert "forward-backward" in started and "all-grads-sync" in started
    assert started <= set(TIMER_NAMES), started - set(TIMER_NAMES)


# --- Config ---


def _nemo(*overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NemoKeysIgnoredWarning)
        cfg = load_config(NEMO, [*NEMO_READY, *overrides])
    validate(cfg, check_files=False)
    return cfg


def test_nemo_timer_section_is_honoured():
    assert timer_settings(_nemo()) is None  # NeMo's default: enable_megatron_timers False
    cfg = _nemo("model.enable_megatron_timers=true", f"{K}barrier=true")
    # NeMo's YAML: log_every_n_steps 10, log_mode minmax.
    assert timer_settings(cfg) == TimerSettings(10, "minmax", barrier=True)
    cfg = _nemo("model.enable_megatron_timers=true", f"{K}log_mode=max")
    assert timer_settings(cfg).log_option == "max"


def test_defaults_and_nemo_codes_log_option_spelling():
    cfg = load_config(
        DEMO_CONFIG, ["model.enable_megatron_timers=true", "trainer.log_every_n_steps=7"]
    )
    assert timer_settings(cfg) == TimerSettings(7, "minmax", barrier=False)
    cfg = load_config(DEMO_CONFIG, ["model.enable_megatron_timers=true", f"{K}log_option=all"])
    assert timer_settings(cfg).log_option == "all"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            [f"{K}log_mode=minmax", f"{K}log_option=max"],
            f"{K}log_option='max' contradicts {K}log_mode='minmax': they are the same setting",
        ),
        ([f"{K}log_every_n_steps=0"], f"{K}log_every_n_steps must be positive, got 0"),
        ([f"{K}log_mode=mean"], f"{K}log_mode='mean' is not one of"),
        (
            ["trainer.max_steps=20", f"{K}log_every_n_steps=25"],
            f"model.enable_megatron_timers=true reports every 25 steps ({K}log_every_n_steps), "
            "more than trainer.max_steps (20): no report would be made",
        ),
        (
            ["trainer.max_steps=20", "trainer.log_every_n_steps=30"],
            "model.enable_megatron_timers=true reports every 30 steps "
            "(trainer.log_every_n_steps), more than trainer.max_steps (20)",
        ),
    ],
)
def test_timer_kwargs_that_cannot_work_are_refused_by_name(overrides, expected):
    cfg = load_config(DEMO_CONFIG, ["model.enable_megatron_timers=true", *overrides])
    with pytest.raises(ConfigError) as info:
        validate(cfg, check_files=False)
    assert expected in str(info.value)


def test_paused_hides_the_timers_from_megatron_and_gives_them_back():
    timers = MegatronTimers(TimerSettings(1))
    model_config = SimpleNamespace(timers=None)
    optimizer = SimpleNamespace(chained_optimizers=[SimpleNamespace(config=SimpleNamespace())])
    timers.install(model_config, optimizer)
    inner = optimizer.chained_optimizers[0].config
    assert model_config.timers is timers.timers and inner.timers is timers.timers
    with timers.paused():
        assert model_config.timers is None and inner.timers is None
    assert model_config.timers is timers.timers and inner.timers is timers.timers


def test_without_timers_nothing_is_installed_or_reported():
    timers = MegatronTimers(None)
    model_config = SimpleNamespace(timers=None)
    timers.install(model_config, SimpleNamespace(config=SimpleNamespace(timers=None)))
    assert model_config.timers is None
    assert timers.step_done(10, True) is None


# --- Runs ---


def _fit(cfg):
    from megatron_lns.training.trainer import Trainer

    Trainer(cfg).fit()


def _timer_rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return {r["step"]: r for r in rows if any(k.endswith("-time") for k in r)}


def _tensorboard_tags(run_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in (run_dir / "tensorboard").glob("events.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags.update(accumulator.Tags()["scalars"])
    return tags


@pytest.mark.slow
def test_pipeline_parallel_run_reports_both_stages_timers_and_resumes(
    tmp_path, capfd, private_corpus_cache
):
    timers_on = ["model.enable_megatron_timers=true", "trainer.log_every_n_steps=1"]
    run = [
        *timers_on,
        "model.pipeline_model_parallel_size=2",
        "trainer.devices=2",
        "trainer.max_steps=6",
    ]
    # Stops after step 4 (checkpointed), as a time-sliced job does.
    stopped = [*run, f"{K}log_every_n_steps=2", "trainer.exit_interval=4"]
    run_distributed(_fit, 2, tmp_path, tiny_run_config(tmp_path, *stopped))
    out = capfd.readouterr().out
    reports = re.findall(r"step (\d+): megatron timers, per step of the last (\d+)", out)
    assert reports == [("2", "2"), ("4", "2")]  # once per interval, on one rank
    table = out.split("step 4: megatron timers", 1)[1]
    # The first stage sends activations and receives gradients, the last the reverse:
    # each stage's timers reach the one table.
    for name in ("forward-backward", "forward-compute", "backward-compute", "all-grads-sync"):
        assert f"    {name} ." in table
    for name in ("forward-send", "forward-recv", "backward-send", "backward-recv", "optimizer"):
        assert f"    {name} ." in table

    run_dir = tmp_path / "lns"
    rows = _timer_rows(run_dir)
    assert sorted(rows) == [2, 4]
    for row in rows.values():
        assert row["forward-backward-time"] > 0 and row["backward-recv-time"] > 0
        assert row["optimizer-time"] > 0 and row["all-grads-sync-time"] > 0
    assert {"forward-backward-time", "forward-recv-time", "optimizer-time"} <= _tensorboard_tags(
        run_dir
    )

    # Resumed from the checkpoint of step 4 with an interval of 5: the grid of global
    # step numbers holds, and the first report covers the one step since the resume.
    resumed = [*run, f"{K}log_every_n_steps=5"]
    run_distributed(_fit, 2, tmp_path / "resume", tiny_run_config(tmp_path, *resumed))
    out = capfd.readouterr().out
    assert "(step 4)" in out
    reports = re.findall(r"step (\d+): megatron timers, per step of the last (\d+)", out)
    assert reports == [("5", "1")]


@pytest.mark.slow
def test_a_run_without_timers_reports_none(tmp_path, capfd, private_corpus_cache):
    run_distributed(_fit, 1, tmp_path, tiny_run_config(tmp_path, "trainer.max_steps=3"))
    assert "megatron timers" not in capfd.readouterr().out
    assert _timer_rows(tmp_path / "lns") == {}
    assert not any(tag.endswith("-time") for tag in _tensorboard_tags(tmp_path / "lns"))
