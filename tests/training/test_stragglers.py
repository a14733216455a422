"""The straggler report: compute time per step (the step less its waits for other ranks)
compared across ranks, the slow ones named with their hosts; a healthy interval names
nobody."""

import json
import socket
from types import SimpleNamespace

import pytest
from helpers import run_distributed, tiny_run_config

from megatron_lns.training.stragglers import (
    StragglerReport,
    WaitClock,
    attempt_summary,
    find_stragglers,
)

HOSTS = ["h0", "h1", "h2", "h3"]


# --- Naming (no processes) ---


def test_a_rank_over_the_median_by_more_than_the_fraction_is_named():
    finding = find_stragglers([0.10, 0.11, 0.30, 0.10], HOSTS, 0.2, (51, 100))
    assert finding.median_s == pytest.approx(0.105)
    assert [r.rank for r in finding.stragglers] == [2]
    assert finding.line() == (
        "stragglers over steps 51-100: rank 2 (host h2) 0.3 s/step compute, "
        "2.86x the median 0.105 s"
    )
    assert finding.metrics()["straggler/compute_s_rank2"] == 0.30
    assert finding.metrics()["straggler/slowest_over_median"] == pytest.approx(0.3 / 0.105)


def test_ranks_within_the_fraction_are_not_named():
    # 0.12 is exactly 20% over the median 0.1: not more than it.
    finding = find_stragglers([0.10, 0.10, 0.12], HOSTS[:3], 0.2, (1, 50))
    assert finding.stragglers == () and finding.line() is None


def test_two_ranks_compare_with_their_mean_and_a_zero_median_names_nobody():
    finding = find_stragglers([0.1, 0.5], HOSTS[:2], 0.2, (1, 10))
    assert finding.median_s == pytest.approx(0.3) and [r.rank for r in finding.stragglers] == [1]
    assert find_stragglers([0.0, 0.0, 0.1], HOSTS[:3], 0.2, (1, 10)).stragglers == ()


def test_the_attempt_summary_counts_the_reports_naming_each_rank():
    slow = find_stragglers([0.1, 0.3], HOSTS[:2], 0.2, (1, 10))
    slower = find_stragglers([0.1, 0.5], HOSTS[:2], 0.2, (11, 20))
    even = find_stragglers([0.1, 0.1], HOSTS[:2], 0.2, (21, 30))
    assert attempt_summary([slow, slower, even], 10, 30) == (
        "straggler report, 3 report(s) over steps 1-30: "
        "rank 1 (host h1) named in 2, up to 1.67x the median"
    )
    assert attempt_summary([even], 10, 10) == (
        "straggler report, 1 report(s) over steps 21-30: no straggler "
        "(slowest rank 1.00x the median)"
    )
    assert "none made in this attempt (3 steps, one every 10" in attempt_summary([], 10, 3)


class _Timer:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def start(self, barrier=False):
        self.calls.append(("start", self.name, barrier))

    def stop(self, barrier=False):
        self.calls.append(("stop", self.name, barrier))


def test_the_wait_clock_times_waits_once_and_hands_every_timer_on():
    calls = []
    clock = WaitClock(lambda name, log_level=None: _Timer(calls, name), cuda=False)
    outer = clock("all-grads-sync", log_level=1)
    outer.start(barrier=True)
    clock("embedding-grads-all-reduce", log_level=1).start()  # nested: counted once
    clock("embedding-grads-all-reduce").stop()
    outer.stop()
    compute = clock("forward-compute", log_level=2)
    compute.start()
    compute.stop()
    assert clock.take() > 0 and clock.take() == 0.0
    assert ("start", "all-grads-sync", True) in calls  # megatron's barrier, when it has one
    assert ("stop", "forward-compute", False) in calls


def test_without_megatron_timers_no_barrier_and_nothing_but_waits_is_timed():
    clock = WaitClock(None, cuda=False)
    clock("forward-backward", log_level=1).start(barrier=True)  # a no-op: no barrier
    clock("forward-backward").stop()
    assert clock.take() == 0.0


def test_switched_off_nothing_is_installed_or_gathered():
    cfg = SimpleNamespace(exp_manager=SimpleNamespace(create_straggler_detection_callback=False))
    model = [SimpleNamespace(config=SimpleNamespace(timers=None))]
    # No process group here: gathering anything would raise.
    report = StragglerReport.for_run(cfg, model, None, None, print)
    assert not report.enabled and model[0].config.timers is None
    with report.step():
        pass
    report.step_done(50, True)
    report.summary()


# --- A 2-rank run ---


def _fit_and_findings(cfg):
    from megatron_lns.training.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.fit()
    return trainer.stragglers.findings


@pytest.mark.long
def test_a_rank_slowed_is_named_with_its_host_and_a_healthy_interval_names_nobody(
    tmp_path, capfd, monkeypatch, private_corpus_cache
):
    # Steps 1-4 healthy, 5-8 with rank 1 sleeping 2 s in each: far above a tiny step's
    # compute (tens of ms), so that a threshold high enough never to name a rank of a
    # healthy interval on a loaded machine (a rank 1.8x the mean of two, i.e. 9 times
    # the other) still names it.
    monkeypatch.setenv("MEGATRON_LNS_INJECT_FAULT", "kind=slow,rank=1,step=5,seconds=2")
    cfg = tiny_run_config(
        tmp_path,
        "trainer.devices=2",
        "trainer.max_steps=8",
        "trainer.val_check_interval=8",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=8",
        "exp_manager.straggler_detection_params.report_every_n_steps=4",
        "exp_manager.straggler_detection_params.slower_than_median=0.8",
    )
    healthy, slowed = run_distributed(_fit_and_findings, 2, tmp_path, cfg)[0]
    out = capfd.readouterr().out

    assert (healthy.first_step, healthy.last_step, healthy.stragglers) == (1, 4, ())
    assert "stragglers over steps 1-4" not in out
    host = socket.gethostname()
    assert [(r.rank, r.host) for r in slowed.stragglers] == [(1, host)]
    assert slowed.ranks[1].compute_s > 2.0 > slowed.ranks[0].compute_s
    assert f"stragglers over steps 5-8: rank 1 (host {host}) " in out
    assert "straggler report, 2 report(s) over steps 1-8: rank 1 (host" in out

    rows = [json.loads(line) for line in (tmp_path / "lns" / "metrics.jsonl").open()]
    logged = {r["step"]: r for r in rows if "straggler/slowest_over_median" in r}
    assert sorted(logged) == [4, 8]
    assert logged[8]["straggler/compute_s_rank1"] > 2.0
