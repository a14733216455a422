"""plan's memory per GPU: weights + gradients + optimizer state against Megatron-LM's
theoretical formula with and without the distributed optimizer, and the pipeline
stage that holds the most (in-flight micro-batches by schedule)."""

import pytest
from helpers import DEMO_CONFIG, ROOT, TINY_MODEL_OVERRIDES, megatron_args

from megatron_lns.config import validate
from megatron_lns.planning import load_for_plan
from megatron_lns.planning.memory import GB, heaviest, stage_estimates
from megatron_lns.planning.shape import model_shape

VOCAB = 50280
OLMO = ROOT / "nemo_configs" / "olmo_7b_lns_20b.yaml"
LLAMA_1B = ROOT / "nemo_configs" / "llama_1b.yaml"
# megatron's arithmetic counts norm weights always: plan them with affine norms.
NOT_DISTRIBUTED = ["model.optim.name=fused_adam", "model.optim.overlap_param_sync=false"]


@pytest.mark.parametrize(
    "name, source, overrides",
    [
        ("llama_1b_adamw_pp1", LLAMA_1B, ["model.norm_affine=true"]),
        ("olmo_7b_gqa_not_distributed", OLMO, ["model.norm_affine=true", "model.num_query_groups=8", *NOT_DISTRIBUTED]),
        ("olmo_7b_tp1_pp1_not_distributed", OLMO, [
            "model.norm_affine=true", "model.tensor_model_parallel_size=1",
            "model.pipeline_model_parallel_size=1", "model.virtual_pipeline_model_parallel_size=null",
            "model.sequence_parallel=false", "model.overlap_p2p_comm=false", *NOT_DISTRIBUTED,
        ]),
    ],
)  # fmt: skip
def test_weights_gradients_and_optimizer_agree_with_megatrons_formula(name, source, overrides):
    """megatron's compute_weight_and_optimizer_memory: 18 bytes per parameter of the most
    loaded shard without the distributed optimizer (6 + 12 / DP with it; the MoE and
    distributed cases are in tests/test_memory_per_gpu.py)."""
    theoretical = pytest.importorskip("megatron.training.theoretical_memory_usage")
    cfg = load_for_plan(source, overrides)
    validate(cfg, check_files=False)
    ours = heaviest(stage_estimates(cfg, model_shape(cfg, VOCAB)))
    theirs = theoretical.compute_weight_and_optimizer_memory(megatron_args(cfg, VOCAB))
    m = cfg.model
    ours_bytes = (ours.weights_gb + ours.grads_gb + ours.optimizer_gb) * GB
    if m.pipeline_model_parallel_size == 1:
        assert ours_bytes == pytest.approx(theirs, rel=1e-9)
    else:  # megatron spreads the final norm's bytes over the stages; we put it on the last
        assert abs(ours_bytes - theirs) <= 18 * 2 * m.hidden_size


def _tiny(*overrides, vocab=257):
    cfg = load_for_plan(
        DEMO_CONFIG,
        [*TINY_MODEL_OVERRIDES, "trainer.devices=8", "model.global_batch_size=16", *overrides],
    )
    validate(cfg, check_files=False, world_size=8)
    return stage_estimates(cfg, model_shape(cfg, vocab))


def test_1f1b_stage_r_holds_pp_minus_r_micro_batches():
    # 4 layers over PP 4: one layer per stage; DP 2, 8 micro-batches of 2 per step.
    stages = _tiny("model.pipeline_model_parallel_size=4", "model.global_batch_size=32")
    assert [e.layer_microbatches for e in stages] == [4, 3, 2, 1]
    assert heaviest(stages).stage == 0


def test_fewer_micro_batches_than_stages_cap_what_is_in_flight():
    stages = _tiny("model.pipeline_model_parallel_size=4", "model.global_batch_size=8")
    assert [e.layer_microbatches for e in stages] == [2, 2, 2, 1]  # 2 micro-batches per step


def test_interleaved_stage_r_holds_megatrons_warmup_plus_one_chunks():
    # 8 layers, PP 2 x VP 2: chunks of 2 layers; warm-up 2(PP - r - 1) + (VP - 1)PP.
    stages = _tiny(
        "model.num_layers=8",
        "model.pipeline_model_parallel_size=2",
        "model.virtual_pipeline_model_parallel_size=2",
        "model.global_batch_size=32",
    )
    assert [e.layer_microbatches for e in stages] == [(2 + 2 + 1) * 2, (0 + 2 + 1) * 2]


def test_the_heaviest_stage_is_the_one_that_holds_the_most():
    """A hybrid pattern that puts three blocks on the last stage and one (with MoE) on the
    first:
    the last stage's GPUs hold the most although the first has a micro-batch more in
    flight."""
    cfg = load_for_plan(
        ROOT / "nemo_configs" / "tiny_cpu_hybrid.yaml",
        [
            "trainer.devices=2",
            "model.num_layers=8",
            "model.pipeline_model_parallel_size=2",
            "model.hybrid_layer_pattern=*E|*-*-*-",
            "model.global_batch_size=16",  # 2 micro-batches of 8
        ],
    )
    validate(cfg, check_files=False)
    stages = stage_estimates(cfg, model_shape(cfg, 257))
    assert [e.layer_microbatches for e in stages] == [2 * 2, 1 * 6]
    assert stages[1].total_gb > stages[0].total_gb
    assert heaviest(stages) == stages[1]


def test_the_distributed_optimizer_shards_only_the_optimizer_state():
    plain = _tiny()
    sharded = _tiny("model.optim.name=distributed_fused_adam")
    assert sharded[0].optimizer_gb == pytest.approx(plain[0].optimizer_gb / 8)
    assert sharded[0].weights_gb == plain[0].weights_gb
    assert sharded[0].optimizer_gb_replicated == plain[0].optimizer_gb


def test_an_fp32_run_keeps_4_byte_activations():
    fp32 = _tiny("trainer.precision=32")
    bf16 = _tiny("trainer.precision=bf16-mixed")
    assert fp32[0].activations_gb == pytest.approx(2 * bf16[0].activations_gb)
    assert fp32[0].weights_gb == pytest.approx(2 * bf16[0].weights_gb)


def test_tensor_parallelism_splits_its_gemms_tensors_and_sequence_parallelism_the_rest():
    """Transformer Engine's count, 4 layers of hidden 64, ffn 128 (SwiGLU), s 32, b 2, fp32:
    per token and layer the pre-norms keep 2 x 2h, attention 2q + 2kv, the MLP 3 x ffn.
    TP splits the q, k, v and ffn-wide tensors with or without SP; SP also the h-wide."""
    te = ["model.transformer_engine=true", "trainer.accelerator=gpu"]
    h, ffn, tokens, layers, fp32 = 64, 128, 32 * 2, 4, 4

    def planned_bytes(*overrides):
        return _tiny(*te, *overrides)[0].activations_gb * GB

    def expected(h_split, tp_split):
        per_token = 4 * h / h_split + (4 * h + 3 * ffn) / tp_split
        return per_token * tokens * layers * fp32

    tp2 = "model.tensor_model_parallel_size=2"
    assert planned_bytes() == pytest.approx(expected(1, 1))
    assert planned_bytes(tp2) == pytest.approx(expected(1, 2))
    assert planned_bytes(tp2, "model.sequence_parallel=true") == pytest.approx(expected(2, 2))
