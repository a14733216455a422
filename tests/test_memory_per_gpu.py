"""benchmarks/memory_per_gpu.py on MoE configs: parameters per GPU against built models at
EP / TP x ETP layouts, weights + gradients + optimizer state against megatron's own
arithmetic, and the OLMoE config quoting its current numbers."""

import sys

import pytest
from helpers import ROOT, megatron_args, parameters_per_rank, run_distributed

from megatron_lns.config import validate

sys.path.insert(0, str(ROOT / "benchmarks"))
import memory_per_gpu as memory

OLMOE = ROOT / "nemo_configs" / "olmoe_1b_7b_lns.yaml"
OLMO = ROOT / "nemo_configs" / "olmo_7b_lns_20b.yaml"
OLMO_TOKENIZER_VOCAB = 50280  # the OLMo / GPT-NeoX tokenizer, padded to 50304
DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
TINY_MOE = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.ffn_hidden_size=96",
    "model.num_attention_heads=4",
    "model.encoder_seq_length=16",
    "model.num_moe_experts=4",
    "model.moe_ffn_hidden_size=32",
    "model.moe_layer_freq=[0,1,1,1]",
    "model.moe_shared_expert_intermediate_size=48",
    "model.moe_shared_expert_gate=true",
    "trainer.devices=2",
]
LAYOUTS = {
    "ep2": ["model.expert_model_parallel_size=2"],
    "tp2_etp1_ep2": [
        "model.expert_model_parallel_size=2",
        "model.tensor_model_parallel_size=2",
        "model.expert_tensor_parallel_size=1",
        "model.sequence_parallel=true",
    ],
}
TINY_VOCAB = 100


def _olmoe(nodes):
    cfg = memory.load_for_estimate(OLMOE, [f"trainer.num_nodes={nodes}"])
    validate(cfg, check_files=False)
    return cfg


@pytest.mark.slow
def test_parameters_per_gpu_are_those_of_the_built_model(tmp_path):
    configs = []
    for overrides in LAYOUTS.values():
        cfg = memory.load_for_estimate(DEMO, [*TINY_MOE, *overrides])
        validate(cfg, check_files=False)
        configs.append(cfg)
    per_rank = run_distributed(parameters_per_rank, 2, tmp_path, configs, TINY_VOCAB)
    for i, cfg in enumerate(configs):
        expected = memory.estimate(cfg, TINY_VOCAB).parameters
        assert [counts[i] for counts in per_rank] == [expected, expected], list(LAYOUTS)[i]


@pytest.mark.parametrize(
    "name, make",
    [
        ("olmoe_8_gpus", lambda: _olmoe(1)),
        ("olmoe_64_gpus", lambda: _olmoe(8)),
        (
            "olmoe_64_gpus_ep4",
            lambda: memory.load_for_estimate(
                OLMOE, ["trainer.num_nodes=8", "model.expert_model_parallel_size=4"]
            ),
        ),
        # megatron's arithmetic counts norm weights (and LayerNorm biases) always.
        (
            "olmo_7b_affine_norms",
            lambda: memory.load_for_estimate(OLMO, ["model.norm_affine=true"]),
        ),
    ],
)
def test_weights_gradients_and_optimizer_state_agree_with_megatron(name, make):
    """megatron-lm's compute_weight_and_optimizer_memory: bf16 weights, fp32 gradients,
    fp32 main weights and Adam moments, sharded as the distributed optimizer shards them
    (dense over DP, experts over expert-DP). Those are the benchmark's bytes for these
    configs (grad_sync_dtype fp32); its norms and embedding count the same parameters."""
    theoretical = pytest.importorskip("megatron.training.theoretical_memory_usage")
    cfg = make()
    ours = memory.estimate(cfg, OLMO_TOKENIZER_VOCAB)
    args = megatron_args(cfg, OLMO_TOKENIZER_VOCAB)
    theirs = theoretical.compute_weight_and_optimizer_memory(args) / memory.GB
    # With PP > 1 megatron spreads the final norm's bytes over the stages (we put it on the
    # last stage): that share of one norm is the only difference allowed.
    m = cfg.model
    final_norm_gb = 2 * m.hidden_size * 18 / m.pipeline_model_parallel_size / memory.GB
    ours_gb = ours.weights_gb + ours.grads_gb + ours.optimizer_gb
    if m.pipeline_model_parallel_size == 1:
        assert ours_gb == pytest.approx(theirs, rel=1e-9)
    else:
        assert abs(ours_gb - theirs) <= final_norm_gb


def test_olmoe_config_quotes_its_current_memory_arithmetic_at_8_and_64_gpus():
    text = OLMOE.read_text()
    for nodes in (1, 8):
        cfg = _olmoe(nodes)
        block = memory.comment_block(cfg, OLMO_TOKENIZER_VOCAB)
        assert block in text, f"rerun benchmarks/memory_per_gpu.py (trainer.num_nodes={nodes})"
        estimate = memory.estimate(cfg, OLMO_TOKENIZER_VOCAB)
        assert estimate.total_gb < 80  # an H100
        # 8 of each layer's 64 experts (3 x 2048 x 1024 weights each) on every GPU.
        assert estimate.expert_parameters == 16 * 8 * 3 * 2048 * 1024
    m = _olmoe(1).model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (16, 2048, 16)
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (64, 8, 1024)
    assert m.moe_router_pre_softmax and m.moe_token_dispatcher_type == "alltoall"
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (0.01, 0.001)
    assert m.expert_model_parallel_size == 8 and m.norm_scaling == "lns"


def test_expert_optimizer_state_shards_over_the_expert_data_parallel_ranks():
    """8 GPUs at EP 8: each expert's state lives on one GPU; 64 GPUs: sharded 8 ways."""
    small, large = (memory.estimate(_olmoe(n), OLMO_TOKENIZER_VOCAB) for n in (1, 8))
    assert small.expert_parameters == large.expert_parameters
    dense = small.parameters - small.expert_parameters
    bytes_8 = 12 * (dense / 8 + small.expert_parameters / 1)
    bytes_64 = 12 * (dense / 64 + small.expert_parameters / 8)
    assert small.optimizer_gb == pytest.approx(bytes_8 / memory.GB)
    assert large.optimizer_gb == pytest.approx(bytes_64 / memory.GB)


def test_a_dense_config_prints_no_moe_lines():
    block = memory.comment_block(memory.load_for_estimate(OLMO), OLMO_TOKENIZER_VOCAB)
    assert "experts" not in block and "active" not in block
    assert block in OLMO.read_text()
