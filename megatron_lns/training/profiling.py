"""A profiling window over training steps (NeMo's ``model.nsys_profile``).

On CUDA the window is what Nsight Systems records when launched with
``nsys profile --capture-range=cudaProfilerApi``: ``torch.cuda.profiler.start()`` at the
first step of the window and ``stop()`` after the last, an NVTX range per step
(``step N``) and, through ``torch.autograd.profiler.emit_nvtx``, one per operator.
A PyTorch profiler trace (Chrome trace format, readable in Perfetto or
chrome://tracing) is written to ``<run_dir>/profile/`` for the same window: always on
CPU, where there is nothing for nsys to record, and on CUDA when asked. Only the
listed global ranks profile; the others run the steps untouched.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_lns.config.schema import ExperimentConfig


@dataclass(frozen=True)
class ProfileWindow:
    """Steps ``start_step..end_step`` (inclusive, numbered as the trainer logs them)."""

    start_step: int
    end_step: int
    ranks: tuple[int, ...] = (0,)
    record_shapes: bool = False
    # None: a torch trace on CPU only (on CUDA, nsys records the window).
    torch_trace: bool | None = None


def profile_window(cfg: ExperimentConfig) -> ProfileWindow | None:
    p = cfg.model.nsys_profile
    if not p.enabled:
        return None
    return ProfileWindow(
        start_step=p.start_step,
        end_step=p.end_step,
        ranks=tuple(p.ranks),
        record_shapes=p.gen_shape,
        torch_trace=p.torch_trace,
    )


class StepProfiler:
    """Wrap each training step in :meth:`step`; :meth:`close` ends a window cut short."""

    def __init__(
        self, window: ProfileWindow | None, rank: int, device: torch.device, out_dir: Path
    ) -> None:
        self.window = window if window is not None and rank in window.ranks else None
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.out_dir = out_dir
        self.trace_path: Path | None = None
        self._opened = self._done = False
        self._stack = contextlib.ExitStack()
        self._profile: torch.profiler.profile | None = None
        self._first_step = self._last_step = 0

    def _wants_torch_trace(self) -> bool:
        wanted = self.window.torch_trace
        return not self.cuda if wanted is None else wanted

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        window = self.window
        if window is None or self._done or step < window.start_step:
            yield
            return
        if not self._opened:
            self._open(step)
        self._last_step = step
        with self._nvtx_range(f"step {step}"):
            yield
        if step >= window.end_step:
            self.close()

    def _open(self, step: int) -> None:
        self._opened, self._first_step = True, step
        if self.cuda:
            torch.cuda.profiler.start()
            self._stack.callback(torch.cuda.profiler.stop)
        if self._wants_torch_trace():
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(
                activities=activities, record_shapes=self.window.record_shapes
            )
            self._stack.enter_context(self._profile)
        elif self.cuda:
            # Operator ranges for nsys; the autograd profiler runs one recorder at a time,
            # so with a torch trace the trace's own operator events stand in for these.
            self._stack.enter_context(
                torch.autograd.profiler.emit_nvtx(record_shapes=self.window.record_shapes)
            )

    @contextlib.contextmanager
    def _nvtx_range(self, name: str) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()

    def close(self) -> None:
        """End the window (after its last step, or when the run stops inside it) and
        write the trace."""
        if not self._opened or self._done:
            return
        self._done = True
        self._stack.close()
        if self._profile is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            steps = f"{self._first_step}-{self._last_step}"
            path = self.out_dir / f"rank{self.rank}_steps{steps}.json"
            partial = path.with_name(path.name + ".partial")
            self._profile.export_chrome_trace(str(partial))
            os.replace(partial, path)
            self.trace_path = path
