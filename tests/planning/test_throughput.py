"""plan's model FLOPs against Megatron-LM's own ``num_floating_point_operations`` (GPT
dense with GQA, MoE with a shared expert, the hybrid model's pattern), and the time
arithmetic that follows from them."""

import pytest
from helpers import DEMO_CONFIG, ROOT, TINY_MODEL_OVERRIDES, megatron_args

from megatron_lns.config import validate
from megatron_lns.planning import gpu_named, load_for_plan
from megatron_lns.planning.shape import model_shape
from megatron_lns.planning.throughput import flops_per_token, throughput

VOCAB = 50280
OLMO = ROOT / "nemo_configs" / "olmo_7b_lns_20b.yaml"
OLMOE = ROOT / "nemo_configs" / "olmoe_1b_7b_lns.yaml"
HYBRID = ROOT / "nemo_configs" / "tiny_cpu_hybrid.yaml"
TINY_MOE_SHARED = [
    *TINY_MODEL_OVERRIDES,
    "model.num_query_groups=2",
    "model.num_moe_experts=4",
    "model.moe_ffn_hidden_size=32",
    "model.moe_layer_freq=[0,1,1,1]",
    "model.moe_router_topk=2",
    "model.moe_shared_expert_intermediate_size=48",
]


@pytest.mark.parametrize(
    "name, source, overrides",
    [
        ("olmo_7b", OLMO, []),
        ("olmoe", OLMOE, []),
        ("tiny_gqa_moe_shared_expert", DEMO_CONFIG, TINY_MOE_SHARED),
        ("hybrid_pattern", HYBRID, []),
    ],
)
def test_flops_are_megatrons_num_floating_point_operations(name, source, overrides):
    training = pytest.importorskip("megatron.training.training")
    cfg = load_for_plan(source, overrides)
    validate(cfg, check_files=False)
    shape = model_shape(cfg, VOCAB)
    batch = cfg.model.global_batch_size
    theirs = training.num_floating_point_operations(megatron_args(cfg, VOCAB), batch)
    ours = flops_per_token(shape, cfg.model.encoder_seq_length)
    assert ours * batch * cfg.model.encoder_seq_length == pytest.approx(theirs, rel=1e-12)


def test_olmo_7b_flops_are_six_n_plus_attention():
    """By hand: 32 layers of 4 x 4096^2 attention and 3 x 4096 x 11008 SwiGLU MLP weights,
    the 50304-row output layer, and 6 x 32 x 4096 x 2048 for attention's scores."""
    cfg = load_for_plan(OLMO)
    n = 32 * (4 * 4096**2 + 3 * 4096 * 11008) + 4096 * 50304
    expected = 6 * n + 6 * 32 * 4096 * 2048
    assert flops_per_token(model_shape(cfg, VOCAB), 2048) == expected


def test_step_time_is_the_steps_flops_at_the_stated_mfu():
    cfg = load_for_plan(OLMO)
    shape = model_shape(cfg, VOCAB)
    h100 = gpu_named("H100")
    t = throughput(cfg, shape, h100, 128, mfu=0.5)
    tokens = 2048 * 2048
    assert t.flops_per_step == t.flops_per_token * tokens
    assert t.step_seconds == pytest.approx(t.flops_per_step / (128 * 989.5e12 * 0.5))
    assert t.tokens_per_second_per_gpu == pytest.approx(tokens / t.step_seconds / 128)
    assert t.gpu_hours == pytest.approx(t.step_seconds * 4769 * 128 / 3600)
    # Twice the MFU, half the time.
    assert throughput(cfg, shape, h100, 128, mfu=1.0).step_seconds == pytest.approx(
        t.step_seconds / 2
    )


@pytest.mark.parametrize(
    "source, overrides", [(OLMO, []), (DEMO_CONFIG, TINY_MOE_SHARED), (HYBRID, [])]
)
def test_flops_are_those_the_trainer_reports_mfu_with(source, overrides):
    """The trainer's TFLOP/s use ``GPTModelConfig.flops_per_token``: the same count, but
    for the router's GEMM (h x experts per MoE sublayer), which megatron leaves out."""
    from megatron_lns.training.build import model_config

    cfg = load_for_plan(source, overrides)
    shape = model_shape(cfg, VOCAB)
    trainers = model_config(cfg, VOCAB).flops_per_token()
    moe_sublayers = sum(unit.moe_mlps * count for unit, count in shape.unit_counts)
    router = 6.0 * moe_sublayers * shape.hidden * shape.moe_experts
    assert flops_per_token(shape, cfg.model.encoder_seq_length) == trainers - router
