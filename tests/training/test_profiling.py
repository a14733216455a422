"""The profiling window (model.nsys_profile): a torch profiler trace of exactly the
configured steps, written on CPU by the configured ranks only."""

import json

import pytest
import torch
from helpers import FIXTURES, ROOT

from megatron_lns.config import ConfigError, load_config, validate
from megatron_lns.training.profiling import ProfileWindow, StepProfiler, profile_window


def _run_steps(profiler: StepProfiler, steps: range) -> None:
    for step in steps:
        with profiler.step(step), torch.profiler.record_function(f"marker_step_{step}"):
            torch.ones(8, 8) @ torch.ones(8, 8)


def _markers(trace_path) -> set[str]:
    events = json.loads(trace_path.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("marker_step_")}


def test_trace_covers_exactly_the_window(tmp_path):
    profiler = StepProfiler(ProfileWindow(3, 4), 0, torch.device("cpu"), tmp_path)
    _run_steps(profiler, range(1, 7))
    profiler.close()
    assert [p.name for p in tmp_path.iterdir()] == ["rank0_steps3-4.json"]
    assert _markers(tmp_path / "rank0_steps3-4.json") == {"marker_step_3", "marker_step_4"}


def test_only_the_listed_ranks_profile(tmp_path):
    window = ProfileWindow(1, 1, ranks=(1, 3))
    for rank in range(4):
        profiler = StepProfiler(window, rank, torch.device("cpu"), tmp_path)
        _run_steps(profiler, range(1, 3))
        profiler.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank1_steps1-1.json",
        "rank3_steps1-1.json",
    ]


def test_a_run_resumed_inside_the_window_profiles_its_rest(tmp_path):
    profiler = StepProfiler(ProfileWindow(2, 5), 0, torch.device("cpu"), tmp_path)
    _run_steps(profiler, range(4, 9))
    assert _markers(tmp_path / "rank0_steps4-5.json") == {"marker_step_4", "marker_step_5"}


def test_a_run_stopped_inside_the_window_writes_what_it_profiled(tmp_path):
    profiler = StepProfiler(ProfileWindow(2, 10), 0, torch.device("cpu"), tmp_path)
    _run_steps(profiler, range(1, 4))
    profiler.close()
    assert _markers(tmp_path / "rank0_steps2-3.json") == {"marker_step_2", "marker_step_3"}


def test_no_window_no_trace(tmp_path):
    profiler = StepProfiler(None, 0, torch.device("cpu"), tmp_path)
    _run_steps(profiler, range(1, 4))
    profiler.close()
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.gpu
def test_cuda_window_with_nvtx_ranges_and_a_torch_trace(tmp_path):
    for torch_trace in (False, True):
        out = tmp_path / str(torch_trace)
        window = ProfileWindow(1, 2, record_shapes=True, torch_trace=torch_trace)
        profiler = StepProfiler(window, 0, torch.device("cuda"), out)
        for step in range(1, 4):
            with profiler.step(step):
                torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
        assert (out / "rank0_steps1-2.json").exists() == torch_trace


# --- Config: NeMo's nsys_profile section reaches the window; bad windows name the key ---

DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
NEMO = FIXTURES / "nemo_megatron_gpt_config.yaml"
P = "model.nsys_profile."


@pytest.mark.filterwarnings("ignore::megatron_lns.config.loader.NemoKeysIgnoredWarning")
def test_nemo_nsys_profile_section_becomes_the_window():
    cfg = load_config(
        NEMO,
        [
            "model.data.data_prefix=[x]",
            f"{P}enabled=true",
            f"{P}start_step=5",
            f"{P}end_step=7",
            f"{P}ranks=[0,3]",
            f"{P}gen_shape=true",
        ],
    )
    assert profile_window(cfg) == ProfileWindow(5, 7, ranks=(0, 3), record_shapes=True)
    cfg.model.nsys_profile.enabled = False
    assert profile_window(cfg) is None


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([f"{P}start_step=5", f"{P}end_step=4"], f"{P}end_step (4) is before {P}start_step (5)"),
        (
            [f"{P}start_step=50", f"{P}end_step=60", "trainer.max_steps=40"],
            f"{P}start_step (50) is after trainer.max_steps (40)",
        ),
        ([f"{P}ranks=[0,1]"], f"{P}ranks [1] are not ranks of this run (world size 1)"),
        ([f"{P}ranks=[-1]"], f"{P}ranks must be a non-empty list of global ranks"),
        ([f"{P}ranks=[]"], f"{P}ranks must be a non-empty list of global ranks"),
        ([f"{P}start_step=0"], f"{P}start_step must be positive, got 0"),
    ],
)
def test_profile_windows_that_cannot_work_are_refused_by_name(overrides, expected):
    cfg = load_config(DEMO, [f"{P}enabled=true", *overrides])
    with pytest.raises(ConfigError) as info:
        validate(cfg, check_files=False)
    assert expected in str(info.value)
