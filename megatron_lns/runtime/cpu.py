"""Run megatron-core 0.19 on a CPU-only machine with the gloo backend.

megatron-core is written for CUDA: it allocates with ``device="cuda"`` or
``torch.cuda.current_device()``, keeps CUDA RNG states, and checks tensor types by
their CUDA names. None of that is about the maths, so on a machine without CUDA we
stand in for each CUDA touch point with its CPU equivalent. Every stand-in below
names the megatron code it serves. Nothing here is installed when CUDA is available
unless explicitly requested, and nothing in megatron's source is edited.

The stand-ins:

* :class:`CudaToCpuMode` - a ``TorchFunctionMode`` that maps CUDA devices in tensor
  factories and ``Tensor.to`` / ``Tensor.cuda`` to the CPU, and answers
  ``Tensor.type()`` with the CUDA type name. Serves: RoPE ``inv_freq``, the default
  causal mask, pipeline ``total_num_tokens`` and p2p receive buffers, DDP grad
  buffers, ``FP32Optimizer._scale``, checkpoint preloading (devices), and the type
  assertions in ``clip_grad_by_total_norm_fp32``, ``DistributedOptimizer`` and
  ``Float16OptimizerWithFloat16Params``.
* ``torch.cuda.current_device`` / ``synchronize`` / ``empty_cache`` /
  ``current_stream`` stand-ins: used for device selection and stream sync all over
  megatron (pipeline schedules, DDP, timers). ``current_device`` returns the CPU
  device itself, because torch function modes are not active inside autograd
  backward, where tensor-parallel layers allocate their gradient buffers.
* ``torch.cuda.stream`` and the alltoall MoE dispatcher's side stream: megatron's
  ``MoEAlltoAllTokenDispatcher.__init__`` (moe/token_dispatcher.py) creates a class-wide
  ``torch.cuda.Stream()`` for its device-to-host copies of the token counts, and its
  ``_maybe_dtoh_and_synchronize`` enters ``torch.cuda.stream(...)`` and waits on the
  event it records there. On CPU the counts already live on the host: the stream is a
  :class:`_NullStream` set before any dispatcher is built, ``torch.cuda.stream`` selects
  nothing, and the recorded event is a :class:`_NullEvent`. The shared expert's stream
  for ``moe_shared_expert_overlap`` (``SharedExpertMLP.__init__``, moe/shared_experts.py,
  same pattern) is a :class:`_NullStream` too: on CPU the overlapped schedule runs in
  order.
* The alltoall dispatcher's host copies of its split sizes: ``maybe_move_tensor_to_cpu``
  (moe/moe_utils.py, called from ``_maybe_dtoh_and_synchronize``) turns a CUDA tensor
  into a NumPy array for ``all_to_all_single``'s ``input_split_sizes`` /
  ``output_split_sizes``, but returns a CPU tensor unchanged, which
  ``ProcessGroup.all_to_all_single`` does not take as a split list.
  :func:`_host_copy` makes the same NumPy array from a CPU tensor.
* Uneven gather along the first dimension: with expert tensor parallelism the alltoall
  dispatcher gathers tokens over the expert-TP ranks with per-rank counts
  (``gather_from_sequence_parallel_region(..., output_split_sizes)``), through
  ``tensor_parallel/mappings.py``'s ``_gather_along_first_dim``, which calls
  ``torch.distributed.all_gather`` with tensors of different sizes; gloo's allgather
  refuses those. :func:`_gather_uneven_along_first_dim` pads every part to the largest
  and cuts the padding off; even gathers go to megatron's code as before. (The uneven
  ``reduce_scatter`` that sums them back and the uneven ``all_to_all_single`` over
  the expert ranks, gloo's ``alltoall_base``, run on gloo as they are.)
* :class:`CpuRNGStatesTracker` - megatron's ``CudaRNGStatesTracker`` forks CUDA
  generator states (``torch.cuda.get_rng_state``) for tensor-parallel dropout and
  weight init; here the named states are CPU generator states.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}

_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is how torch spells "cuda:<int>" (torch.cuda.current_device() returns one).
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_if_cuda(device: Any) -> Any:
    return _CPU if _is_cuda_device(device) else device


class CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA placements to the CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == "cpu" and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """CPU twin of megatron's ``CudaRNGStatesTracker`` (tensor_parallel/random.py).

    Same interface (``add``, ``fork``, ``get_states``, ``set_states``, ``reset``,
    ``is_initialized``) with named CPU generator states, so tensor-parallel dropout
    and ``get_cuda_rng_tracker().fork()`` work and RNG checkpointing round-trips.
    """

    def __init__(self, *_, **__):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


_active_mode: CudaToCpuMode | None = None


def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    def initialize_rng_tracker(*_, force_reset: bool = False, **__) -> None:
        if force_reset or not isinstance(mcore_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
            mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mcore_random.initialize_rng_tracker = initialize_rng_tracker
    # model_parallel_cuda_manual_seed seeds the (lazy) CUDA generator first; on CPU the
    # data-parallel default state is the CPU generator, seeded by the caller.
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    initialize_rng_tracker(force_reset=True)
    mcore_random._get_cuda_rng_state = _no_device_rng_state
    mcore_random._set_cuda_rng_state = _set_no_device_rng_state
    fork_rng = mcore_random._fork_rng

    @contextlib.contextmanager
    def fork_rng_on_cpu():
        with fork_rng(), CudaToCpuMode():
            yield

    mcore_random._fork_rng = fork_rng_on_cpu


def _no_device_rng_state(*_, **__) -> torch.Tensor:
    """The device generator state CheckpointFunction saves: none without CUDA."""
    return torch.empty(0, dtype=torch.uint8)


def _set_no_device_rng_state(*_, **__) -> None:
    """Restoring the (absent) device generator state: nothing to do."""


def _install_moe_dispatcher_host_copies() -> None:
    """The alltoall dispatcher's device-to-host stream and the shared expert's overlap
    stream, set before any is built (each makes a ``torch.cuda.Stream()`` only while its
    class attribute is ``None``), and the dispatcher's host copies of the token counts."""
    from megatron.core.transformer.moe import shared_experts, token_dispatcher

    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NullStream()
    shared_experts.SharedExpertMLP.stream = _NullStream()
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's ``maybe_move_tensor_to_cpu`` for tensors that are already on the host:
    the NumPy array when asked for one (the split sizes of ``all_to_all_single``)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().numpy()
    return tensor


def _install_uneven_gather() -> None:
    from megatron.core.tensor_parallel import mappings

    gather = mappings._gather_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return _gather_uneven_along_first_dim(input_, group, output_split_sizes)

    mappings._gather_along_first_dim = gather_along_first_dim


def _gather_uneven_along_first_dim(
    input_: torch.Tensor, group: Any, output_split_sizes: Any
) -> torch.Tensor:
    """Rank r's ``output_split_sizes[r]`` rows, concatenated in rank order: every rank
    pads its rows to the largest count, gloo gathers equal parts, the padding is cut."""
    sizes = [int(n) for n in output_split_sizes]
    largest = max(sizes)
    padded = input_.new_zeros((largest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


def install_cpu_compat() -> None:
    """Install the CPU stand-ins for this process (idempotent)."""
    global _active_mode
    if _active_mode is not None:
        return
    # A device object rather than an index: backward passes (autograd Functions in
    # tensor_parallel) allocate with device=torch.cuda.current_device(), and torch
    # function modes are not active inside autograd backward.
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.device_count = lambda: 0
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    _install_moe_dispatcher_host_copies()
    _install_uneven_gather()
    _install_rng_tracker()
    _active_mode = CudaToCpuMode()
    _active_mode.__enter__()
    logger.info("megatron-core CPU compatibility layer installed")


def cpu_compat_installed() -> bool:
    return _active_mode is not None


class _NullStream:
    """Stands in for a CUDA stream: CPU work is synchronous."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, _stream: Any) -> None:
        pass

    def wait_event(self, _event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _NullEvent()


class _NullEvent:
    """Stands in for a CUDA event: what it marks has already happened on CPU."""

    def synchronize(self) -> None:
        pass

    def wait(self, _stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True
