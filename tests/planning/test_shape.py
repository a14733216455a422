"""plan's parameter counts against the models megatron-core builds on CPU: the whole
model (dense with GQA, biases and LayerNorm, tied embeddings, MoE, hybrid), each
pipeline stage's and tensor-parallel rank's share, and the active parameters of MoE."""

import pytest
from helpers import DEMO_CONFIG, ROOT, TINY_MODEL_OVERRIDES, parameters_per_rank, run_distributed

from megatron_lns.config import validate
from megatron_lns.planning import load_for_plan
from megatron_lns.planning.shape import model_shape, padded_vocab_size, parameter_counts

VOCAB = 257  # the byte tokenizer
TINY_MOE = [
    "model.num_moe_experts=4",
    "model.moe_ffn_hidden_size=32",
    "model.moe_layer_freq=[0,1,1,1]",
    "model.moe_router_topk=2",
    "model.moe_shared_expert_intermediate_size=48",
    "model.moe_shared_expert_gate=true",
]
MODELS = {
    "dense_gqa": ["model.num_query_groups=2"],
    "gqa_bias_layernorm_tied_learned_positions": [
        "model.num_query_groups=2",
        "model.bias=true",
        "model.normalization=layernorm",
        "model.norm_affine=true",
        "model.activation=gelu",
        "model.share_embeddings_and_output_weights=true",
        "model.position_embedding_type=learned_absolute",
    ],
    "qk_layernorm_kv_channels": ["model.qk_layernorm=true", "model.kv_channels=8"],
    "moe": TINY_MOE,
}


def _cfg(*overrides, base=DEMO_CONFIG):
    tiny = TINY_MODEL_OVERRIDES if base == DEMO_CONFIG else []  # tiny_cpu_hybrid is tiny
    cfg = load_for_plan(base, [*tiny, *overrides])
    validate(cfg, check_files=False)
    return cfg


def _built_parameters(cfg, vocab=VOCAB) -> int:
    from megatron_lns.training.build import build_model_chunks, model_config, parallel_layout

    chunks = build_model_chunks(model_config(cfg, vocab), parallel_layout(cfg))
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


@pytest.mark.parametrize("name", list(MODELS))
def test_the_whole_model_has_the_parameters_megatron_builds(name, megatron_world1):
    cfg = _cfg(*MODELS[name])
    counts = parameter_counts(model_shape(cfg, VOCAB), 1)
    assert counts.total == _built_parameters(cfg)
    assert counts.per_rank == (counts.total,) and counts.per_stage == (counts.total,)


def test_the_hybrid_model_has_the_parameters_megatron_builds(megatron_world1):
    cfg = _cfg(base=ROOT / "nemo_configs" / "tiny_cpu_hybrid.yaml")
    counts = parameter_counts(model_shape(cfg, VOCAB), 1)
    assert counts.total == _built_parameters(cfg)


def test_active_parameters_are_the_model_configs_count():
    """The active count (router, topk experts, shared expert and its gate) against the
    model's own ``GPTModelConfig.parameter_counts``, counted there independently."""
    from megatron_lns.training.build import model_config

    cfg = _cfg(*TINY_MOE)
    ours = parameter_counts(model_shape(cfg, VOCAB), 1)
    theirs = model_config(cfg, VOCAB).parameter_counts()
    assert (ours.total, ours.active) == (theirs.total, theirs.active)
    # 3 MoE layers with 2 of 4 experts idle per token, each expert 3 x 64 x 32 weights.
    assert ours.total - ours.active == 3 * 2 * 3 * 64 * 32


@pytest.mark.parametrize("vocab, tp, divisible", [(257, 1, 128), (50280, 2, 128), (1000, 3, 64)])
def test_the_padded_vocabulary_is_the_models(vocab, tp, divisible):
    from megatron_lns.model import language_model as model

    assert padded_vocab_size(vocab, tp, divisible) == model.padded_vocab_size(vocab, tp, divisible)


LAYOUTS = {
    # Tied embeddings: the last stage keeps a copy of the embedding as its output layer.
    "pp2_tied": [
        "model.pipeline_model_parallel_size=2",
        "model.share_embeddings_and_output_weights=true",
    ],
    "pp2_vp2_moe": [
        *TINY_MOE,
        "model.pipeline_model_parallel_size=2",
        "model.virtual_pipeline_model_parallel_size=2",
        "model.global_batch_size=8",
    ],
    "tp2_sp_gqa_bias": [
        "model.tensor_model_parallel_size=2",
        "model.sequence_parallel=true",
        "model.num_query_groups=2",
        "model.bias=true",
        "model.activation=gelu",
    ],
}


@pytest.mark.slow
def test_each_rank_holds_the_parameters_planned_for_its_stage(tmp_path):
    configs = [_cfg("trainer.devices=2", *overrides) for overrides in LAYOUTS.values()]
    per_rank = run_distributed(parameters_per_rank, 2, tmp_path, configs, VOCAB)
    for i, (name, cfg) in enumerate(zip(LAYOUTS, configs, strict=True)):
        counts = parameter_counts(model_shape(cfg, VOCAB), cfg.model.tensor_model_parallel_size)
        built = [rank[i] for rank in per_rank]
        if cfg.model.pipeline_model_parallel_size == 2:  # rank r is stage r
            assert built == list(counts.per_rank), name
        else:  # two TP ranks of the one stage
            assert built == [counts.per_rank[0]] * 2, name


def test_alike_layers_are_counted_not_listed(capsys):
    """``plan`` of a billion layers was killed for memory (a unit per layer, planned again
    for each fix it tried): a stage keeps each kind of layer once, with its count."""
    from megatron_lns.cli import main

    def counts(layers, *overrides):
        shape = model_shape(_cfg(f"model.num_layers={layers}", *overrides), VOCAB)
        return shape, parameter_counts(shape, 1).total

    shape, _ = counts(1200)
    assert [len(stage) for stage in shape.stages] == [1]  # one kind of layer, 1200 of it
    billion = 10**9
    (_, twelve), (_, thirteen), (_, many) = counts(12), counts(13), counts(billion)
    assert many == twelve + (billion - 12) * (thirteen - twelve)
    # MoE every third layer (0, 3, ...), two pipeline stages of half a billion layers.
    moe = ["model.moe_layer_freq=3", "trainer.devices=2", "model.pipeline_model_parallel_size=2"]
    shape, _ = counts(billion, *TINY_MOE[:2], *TINY_MOE[3:], *moe)
    half, moe_layers = billion // 2, -(-billion // 2 // 3)  # ceil(5e8 / 3) in each stage
    by_kind = [{unit.moe_mlps: count for unit, count in stage} for stage in shape.stages]
    assert by_kind == [{1: moe_layers, 0: half - moe_layers}] * 2
    assert main(["plan", str(DEMO_CONFIG), f"model.num_layers={billion}", "--json"]) == 0
    assert '"fits": false' in capsys.readouterr().out
