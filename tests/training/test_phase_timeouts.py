"""The phases of a rank's main thread and the timeouts it learns (torch-free)."""

import pytest

from megatron_lns.runtime.fault_injection import parse_faults
from megatron_lns.training.phase_timeouts import PhaseClock, TimeoutSettings, timeouts_line

SETTINGS = TimeoutSettings(
    initial_rank_heartbeat_timeout=600,
    rank_heartbeat_timeout=180,
    checkpoint_save_timeout=420,
    safety_factor=5,
    min_timeout=30,
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _clock(settings=SETTINGS):
    clock = Clock()
    return PhaseClock(settings, clock), clock


def test_each_phase_keeps_its_configured_timeout_until_this_attempt_measured_it():
    phases, _ = _clock()
    configured = {p: phases.timeout(p).seconds for p in ("startup", "load", "step", "eval", "save")}
    assert configured == {"startup": 600, "load": 600, "step": 180, "eval": 180, "save": 420}
    assert phases.timeout("save").why == "checkpoint_save_timeout"
    assert phases.learnt() == {}


def test_learnt_timeouts_are_a_multiple_of_the_slowest_seen_between_the_floor_and_the_cap():
    phases, clock = _clock()
    clock.t = 50.0  # start-up
    phases.begin("step", 1)
    clock.t += 20.0  # a slow first step (compilation, warm-up)
    phases.begin("step", 2)
    clock.t += 2.0
    with phases.during("save"):
        clock.t += 100.0  # a slow save: 5 x 100 is more than the configured 420
    clock.t += 1.0
    phases.begin("step", 3)
    assert phases.now().phase == "step" and phases.now().step == 3
    assert phases.timeout("step").seconds == 100  # 5 x the first step, not the later ones
    assert str(phases.timeout("step")) == "100 s (5 x slowest step 20.00 s)"
    assert phases.timeout("save").seconds == 420
    assert (
        phases.timeout("save").why
        == "checkpoint_save_timeout, the cap of 5 x slowest save 100.00 s"
    )
    assert phases.timeout("eval").seconds == 180  # not measured yet
    # Start-up and load happen once: their measured time never shortens their timeout.
    assert phases.timeout("startup").seconds == 600
    assert phases.learnt() == {"step": 100, "save": 420}
    assert timeouts_line(phases.learnt()) == "step 100 s, save 420 s"


def test_waiting_for_background_saves_keeps_the_configured_timeout():
    """A commit that found the write long finished must not bound the last one, which
    waits for a whole write."""
    phases, clock = _clock()
    phases.begin("step", 1)
    with phases.during("commit"):
        clock.t += 0.01
    assert phases.timeout("commit").seconds == 420
    assert "commit" not in phases.learnt()


def test_a_fast_phase_gets_the_floor_and_the_line_says_so():
    phases, clock = _clock()
    phases.begin("step", 1)
    clock.t += 0.5
    phases.begin("step", 2)
    assert phases.timeout("step").seconds == 30
    assert str(phases.timeout("step")) == "30 s (5 x slowest step 0.50 s, min_timeout 30)"


def test_without_calculate_timeouts_the_configured_ones_stay():
    phases, clock = _clock(TimeoutSettings(rank_heartbeat_timeout=9, calculate_timeouts=False))
    phases.begin("step", 1)
    clock.t += 0.1
    phases.begin("step", 2)
    assert phases.timeout("step").seconds == 9


def test_a_phase_after_the_one_inside_it_counts_afresh():
    """After the checkpoint load the run is in start-up again, its age from the load's end:
    otherwise a long load would count twice against start-up's timeout."""
    phases, clock = _clock()
    clock.t = 10.0
    with phases.during("load"):
        clock.t = 300.0
        assert phases.now().phase == "load" and phases.now().age_s == 290
    clock.t = 301.0
    assert phases.now().phase == "startup" and phases.now().age_s == 1.0


def test_changed_timeouts_are_announced_once_and_again_only_when_they_change_much():
    phases, clock = _clock()
    phases.begin("step", 1)
    clock.t += 10
    phases.begin("step", 2)
    assert phases.changed_timeouts() == {"step": 50}
    clock.t += 12  # 60 s: 20% more, not announced
    phases.begin("step", 3)
    assert phases.changed_timeouts() == {}
    clock.t += 30  # 150 s: three times
    phases.begin("step", 4)
    assert phases.changed_timeouts() == {"step": 150}


def test_an_unknown_phase_is_refused():
    phases, _ = _clock()
    with pytest.raises(ValueError, match="unknown phase 'train'"):
        phases.begin("train")


def test_a_slow_fault_can_end_at_a_step():
    (slow,) = parse_faults("kind=slow,rank=0,step=1,until=2,seconds=1.5")
    assert [slow.hits(0, step, "step", 0) for step in (1, 2, 3)] == [True, True, False]
    (forever,) = parse_faults("kind=slow,rank=0,step=2,seconds=1")
    assert [forever.hits(0, step, "step", 0) for step in (1, 2, 50)] == [False, True, True]


def test_a_pause_of_the_whole_process_is_in_no_phase_but_a_stall_is():
    """A gap no tick of the pause meter saw (every thread stopped: Ctrl-Z, kill -STOP of
    the run, scontrol suspend) counts in no phase's age and in no measured phase; time in
    which the meter ticked (the main thread blocked, the watchdog running) all counts."""
    phases, clock = _clock()
    phases.pauses.start(0.5)  # its thread ticks in real time on the test's clock
    try:
        phases.begin("step", 4)
        clock.t = 1.5  # a thread late by less than the grace: not a pause
        assert phases.now().age_s == 1.5
        clock.t = 61.5  # 60 s that no thread saw pass: stopped, less the tick it waits
        assert phases.now().age_s == pytest.approx(2.0)
        phases.begin("save")
        assert phases.slowest["step"] == pytest.approx(2.0)  # learnt from the step, not the pause
        for _ in range(500):  # stuck in the save, the meter ticking every second
            clock.t += 1.0
            phases.pauses.paused_s()
        assert phases.now().age_s == pytest.approx(500.0)
        assert phases.now().age_s > phases.timeout("save").seconds
    finally:
        phases.pauses.stop()
    clock.t += 100.0  # stopped: no gap is judged any more
    assert phases.now().age_s == pytest.approx(600.0)
