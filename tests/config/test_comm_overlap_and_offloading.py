"""Tensor-parallel communication overlap (TE userbuffers), activation offloading and
SHARP: each key reaches megatron-core (or Transformer Engine's ``initialize_ub``) with the
user's value, and every combination that cannot work is refused by name.

Transformer Engine cannot be installed on this CPU machine, so the userbuffer call is
checked against a stand-in with ``initialize_ub``'s signature in TE 2.8-2.18.
"""

import enum
import inspect
import sys
import types
import warnings

import pytest
import torch
from helpers import DEMO_CONFIG, FIXTURES, run_distributed

from megatron_lns.config import ConfigError, load_config, validate
from megatron_lns.config.fast_paths import MachineFacts
from megatron_lns.config.loader import NemoKeysIgnoredWarning
from megatron_lns.config.performance import resolved_fast_paths
from megatron_lns.runtime import ParallelLayout
from megatron_lns.training.build import (
    initialize_tp_comm_overlap,
    model_config,
    parallel_layout,
)
from megatron_lns.training.machine import check_environment

NEMO = FIXTURES / "nemo_megatron_gpt_config.yaml"
TP_OVERLAP = [
    "model.transformer_engine=true",
    "model.tensor_model_parallel_size=2",
    "model.sequence_parallel=true",
    "+model.ub_tp_comm_overlap=true",
]
OFFLOADING = ["model.transformer_engine=true", "+model.cpu_offloading=true"]
# The kernels' facts do not matter here; TE's fused kernels cannot be configured without TE.
NO_KERNELS = MachineFacts(cuda=False)


def _cfg(*overrides, world_size=2, check_files=False):
    cfg = load_config(DEMO_CONFIG, list(overrides))
    validate(cfg, world_size=world_size, check_files=check_files)
    return cfg


def _transformer_config(cfg, training=True):
    """The TransformerConfig of a training run of ``cfg``, or (``training`` false) of the
    model built to convert or analyse its weights."""
    fast = resolved_fast_paths(cfg, NO_KERNELS) if training else None
    return model_config(cfg, 256, fast).transformer_config(parallel_layout(cfg), cpu_init=True)


# --- Tensor-parallel communication overlap ---


def test_tp_comm_overlap_reaches_the_transformer_config_of_training_runs():
    cfg = _cfg(*TP_OVERLAP, "+model.ub_tp_comm_bootstrap_backend=gloo")
    tf = _transformer_config(cfg)
    assert tf.tp_comm_overlap and tf.tp_comm_bootstrap_backend == "gloo"
    assert not _transformer_config(_cfg()).tp_comm_overlap
    # A model built to convert or analyse weights has no userbuffers to overlap with.
    assert not _transformer_config(cfg, training=False).tp_comm_overlap


def _te_initialize_ub(
    shape,
    tp_size,
    use_fp8=False,
    quantization_modes=None,
    dtype=torch.bfloat16,
    ub_cfgs=None,
    bootstrap_backend=None,
):
    """The signature of Transformer Engine's ``initialize_ub`` (TE 2.8-2.18)."""


class _StandInTE:
    """``transformer_engine.pytorch.module.base`` as the userbuffer call sees it."""

    def __init__(self):
        self.calls = []
        base = types.ModuleType("transformer_engine.pytorch.module.base")

        class UserBufferQuantizationMode(enum.Enum):
            NONE = "none"
            FP8 = "fp8"

        def initialize_ub(*args, **kwargs):
            """Records the call's arguments by name, defaults included; raises as TE's
            would for a call its signature does not take."""
            call = inspect.signature(_te_initialize_ub).bind(*args, **kwargs)
            call.apply_defaults()
            self.calls.append(call.arguments)

        base.UserBufferQuantizationMode = UserBufferQuantizationMode
        base.initialize_ub = initialize_ub
        self.modes = UserBufferQuantizationMode
        self.modules = {
            "transformer_engine": types.ModuleType("transformer_engine"),
            "transformer_engine.pytorch": types.ModuleType("transformer_engine.pytorch"),
            "transformer_engine.pytorch.module": types.ModuleType(
                "transformer_engine.pytorch.module"
            ),
            "transformer_engine.pytorch.module.base": base,
        }
        self.modules["transformer_engine.pytorch.module"].base = base


@pytest.fixture
def stand_in_te(monkeypatch):
    te = _StandInTE()
    for name, module in te.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return te


def test_userbuffers_are_sized_for_one_micro_batch_with_the_users_settings(stand_in_te, tmp_path):
    settings = tmp_path / "ub_cfg.yaml"
    settings.write_text(
        "qkv_fprop: {method: ring_exchange, aggregate: 0}\n"
        "proj_fprop: {method: pipeline, num_sm: 24, num_splits: 4}\n"
    )
    cfg = _cfg(
        *TP_OVERLAP,
        "model.micro_batch_size=2",
        "model.global_batch_size=4",
        f"+model.ub_tp_comm_overlap_cfg={settings}",
        "trainer.precision=bf16-mixed",
        check_files=True,
    )
    initialize_tp_comm_overlap(cfg)
    (call,) = stand_in_te.calls
    m = cfg.model
    assert call["shape"] == [m.encoder_seq_length * 2, m.hidden_size]
    assert call["tp_size"] == 2 and call["dtype"] == torch.bfloat16
    assert call["quantization_modes"] == [stand_in_te.modes.NONE] and not call["use_fp8"]
    assert call["ub_cfgs"] == {
        "qkv_fprop": {"method": "ring_exchange", "aggregate": 0},
        "proj_fprop": {"method": "pipeline", "num_sm": 24, "num_splits": 4},
    }
    assert call["bootstrap_backend"] == "nccl"


def test_userbuffers_follow_context_parallelism_fp8_and_an_inline_mapping(stand_in_te):
    cfg = _cfg(
        *TP_OVERLAP,
        "+model.context_parallel_size=2",
        "model.fp8=delayed",
        "trainer.precision=bf16-mixed",
        "+model.ub_tp_comm_overlap_cfg={fc2_dgrad: {method: ring_exchange}}",
        world_size=4,
    )
    initialize_tp_comm_overlap(cfg)
    (call,) = stand_in_te.calls
    seq, mbs = cfg.model.encoder_seq_length, cfg.model.micro_batch_size
    assert call["shape"] == [seq * mbs // 2, cfg.model.hidden_size]
    assert call["quantization_modes"] == [stand_in_te.modes.FP8]
    assert call["ub_cfgs"] == {"fc2_dgrad": {"method": "ring_exchange"}}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.tensor_model_parallel_size=2", "+model.ub_tp_comm_overlap=true"],
            "model.ub_tp_comm_overlap=true needs model.transformer_engine=true",
        ),
        (
            [
                "model.transformer_engine=true",
                "model.tensor_model_parallel_size=2",
                "+model.ub_tp_comm_overlap=true",
            ],
            "model.ub_tp_comm_overlap=true needs model.sequence_parallel=true",
        ),
        (
            ["+model.ub_tp_comm_overlap_cfg={qkv_fprop: {method: bulk}}"],
            "model.ub_tp_comm_overlap_cfg is set but model.ub_tp_comm_overlap=false",
        ),
        (
            [*TP_OVERLAP, "+model.ub_tp_comm_overlap_cfg={qkv_forward: {method: bulk}}"],
            "model.ub_tp_comm_overlap_cfg: unknown GEMM names ['qkv_forward'] (Transformer "
            "Engine would ignore them)",
        ),
        (
            [*TP_OVERLAP, "+model.ub_tp_comm_overlap_cfg={qkv_fprop: bulk}"],
            "model.ub_tp_comm_overlap_cfg: the settings of ['qkv_fprop'] must be mappings",
        ),
        (
            [*TP_OVERLAP, "+model.ub_tp_comm_bootstrap_backend=ucc"],
            "model.ub_tp_comm_bootstrap_backend='ucc' is not one of",
        ),
    ],
)
def test_tp_comm_overlap_combinations_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        _cfg(*overrides)
    assert str(info.value).startswith(message), info.value


def test_a_userbuffer_settings_file_is_checked_with_the_other_files(tmp_path):
    missing = tmp_path / "absent.yaml"
    overrides = [*TP_OVERLAP, f"+model.ub_tp_comm_overlap_cfg={missing}"]
    _cfg(*overrides)  # files unchecked: the path is read where the job runs
    with pytest.raises(ConfigError, match=rf"^model.ub_tp_comm_overlap_cfg: {missing} does not"):
        _cfg(*overrides, check_files=True)
    broken = tmp_path / "broken.yaml"
    broken.write_text("qkv_fprop: {method: [\n")
    with pytest.raises(ConfigError, match=r"^model.ub_tp_comm_overlap_cfg: .* is not valid YAML"):
        _cfg(*TP_OVERLAP, f"+model.ub_tp_comm_overlap_cfg={broken}", check_files=True)
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- qkv_fprop\n")
    with pytest.raises(ConfigError, match=r"must map GEMM names to their settings"):
        _cfg(*TP_OVERLAP, f"+model.ub_tp_comm_overlap_cfg={a_list}", check_files=True)


# --- Activation offloading ---


def test_offloading_reaches_the_transformer_config_with_nemos_default_layer_count():
    tf = _transformer_config(_cfg(*OFFLOADING))
    assert tf.cpu_offloading and tf.cpu_offloading_activations
    assert tf.cpu_offloading_num_layers == tf.num_layers - 1 and not tf.cpu_offloading_weights
    tf = _transformer_config(_cfg(*OFFLOADING, "+model.cpu_offloading_num_layers=2"))
    assert tf.cpu_offloading_num_layers == 2
    assert not _transformer_config(_cfg()).cpu_offloading
    # Forward-only uses of the weights (conversion, analyze) offload nothing.
    assert not _transformer_config(_cfg(*OFFLOADING), training=False).cpu_offloading


def test_nemos_offloading_keys_and_their_sum_interpolation_are_read():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NemoKeysIgnoredWarning)
        cfg = load_config(
            NEMO,
            [
                "model.data.data_prefix=[x]",
                "model.tokenizer.library=byte",
                "model.tokenizer.type=null",
                "model.cpu_offloading=true",
                "model.cpu_offloading_weights=false",
            ],
        )
    validate(cfg, check_files=False)
    # NeMo's YAML: cpu_offloading_num_layers: ${sum:${.num_layers},-1}
    assert cfg.model.cpu_offloading_num_layers == cfg.model.num_layers - 1 == 11
    assert _transformer_config(cfg).cpu_offloading


def test_memory_arithmetic_keeps_only_the_layers_not_offloaded():
    from test_performance import _memory_module

    estimate = _memory_module().estimate
    base = _cfg("model.transformer_engine=true", "model.num_layers=8", world_size=1)
    offloaded = _cfg(*OFFLOADING, "model.num_layers=8", "+model.cpu_offloading_num_layers=6")
    kept, held = estimate(offloaded, 256), estimate(base, 256)
    assert (held.layer_microbatches, kept.layer_microbatches) == (8, 2)
    assert kept.activations_gb == pytest.approx(held.activations_gb * 2 / 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["+model.cpu_offloading=true"],
            "model.cpu_offloading=true needs model.transformer_engine=true",
        ),
        (
            [*OFFLOADING, "model.pipeline_model_parallel_size=2"],
            "model.cpu_offloading=true needs model.pipeline_model_parallel_size=1",
        ),
        (
            [*OFFLOADING, "+model.activations_checkpoint_granularity=selective"],
            "model.cpu_offloading=true and model.activations_checkpoint_granularity=selective "
            "cannot be combined",
        ),
        (
            [*OFFLOADING, "+model.cpu_offloading_num_layers=0"],
            "model.cpu_offloading_num_layers=0 must be between 1 and model.num_layers - 1",
        ),
        (
            [*OFFLOADING, "model.num_layers=4", "+model.cpu_offloading_num_layers=4"],
            "model.cpu_offloading_num_layers=4 must be between 1 and model.num_layers - 1 (3)",
        ),
        (
            [*OFFLOADING, "+model.cpu_offloading_weights=true"],
            "model.cpu_offloading_weights=true: Transformer Engine no longer offloads weights",
        ),
        (
            [*OFFLOADING, "+model.cpu_offloading_activations=false"],
            "model.cpu_offloading=true with model.cpu_offloading_activations=false offloads "
            "nothing",
        ),
    ],
)
def test_offloading_combinations_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        _cfg(*overrides)
    assert str(info.value).startswith(message), info.value


# --- SHARP ---


def test_sharp_reaches_the_layout_and_is_refused_without_nccl():
    cfg = _cfg("+model.sharp=true")
    assert parallel_layout(cfg).sharp and not parallel_layout(_cfg()).sharp
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^model.sharp=true needs NCCL on CUDA GPUs"):
            check_environment(cfg)
    with pytest.raises(ConfigError, match=r"^model.sharp=true needs NCCL"):
        check_environment(_cfg("+model.sharp=true", "trainer.accelerator=cpu"))


def _init_with_sharp_on_a_simulated_cuda_rank():
    """init_distributed's call into megatron, with the device and megatron's group
    creation stood in (SHARP groups need NCCL); returns the arguments megatron got."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_lns.runtime import distributed

    dist.init_process_group("gloo")
    received = {}
    parallel_state.initialize_model_parallel = lambda **kwargs: received.update(kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed = lambda seed: None
    distributed.resolve_device = lambda device: torch.device("cuda", 0)
    distributed.init_distributed(ParallelLayout(sharp=True))
    return received["use_sharp"]


def test_sharp_reaches_megatrons_model_parallel_initialisation(tmp_path):
    assert run_distributed(_init_with_sharp_on_a_simulated_cuda_rank, 1, tmp_path) == [True]


def _sharp_on_gloo():
    from megatron_lns.runtime import init_distributed

    try:
        init_distributed(ParallelLayout(sharp=True), device="cpu")
    except ValueError as err:
        return str(err)
    return None


def test_sharp_on_gloo_is_refused_by_the_runtime(tmp_path):
    assert run_distributed(_sharp_on_gloo, 1, tmp_path) == [
        "SHARP needs NCCL on CUDA GPUs; this run uses gloo"
    ]
