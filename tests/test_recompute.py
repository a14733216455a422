"""Activation recomputation changes memory, never results: selective and full (uniform
and block) recomputation give the loss and gradients of a run without it, at TP=1 and,
in real gloo ranks, at TP=2 and PP=2.

Dropout is on, so a recomputed forward that drew different random numbers than the
first one (megatron's CheckpointFunction restores the RNG states, on CPU through the
stand-ins in runtime/cpu.py) would show up as different gradients.
"""

import pytest
import torch
from helpers import FIXTURES, ROOT, fixed_microbatches, run_distributed, tiny_config
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import random as mcore_random

from megatron_lns.config import ConfigError, load_config, validate
from megatron_lns.config.hybrid_pattern import gpt_key_to_hybrid
from megatron_lns.model.language_model import build_model
from megatron_lns.runtime import ParallelLayout, init_distributed
from megatron_lns.training.build import model_config, wrap_with_ddp
from megatron_lns.training.step import forward_backward

RECOMPUTE_MODES = {
    "selective": dict(recompute_granularity="selective"),
    "full_uniform": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "full_block": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=1
    ),
}

DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
NEMO = FIXTURES / "nemo_megatron_gpt_config.yaml"
KEY = "model.activations_checkpoint_"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([f"{KEY}granularity=selective"], ("selective", None, None)),
        (
            [f"{KEY}granularity=full", f"{KEY}method=uniform", f"{KEY}num_layers=1"],
            ("full", "uniform", 1),
        ),
        (
            [f"{KEY}granularity=full", f"{KEY}method=block", f"{KEY}num_layers=2"],
            ("full", "block", 2),
        ),
    ],
)
def test_nemo_recompute_keys_reach_the_transformer_config(overrides, expected):
    cfg = load_config(DEMO, overrides)
    validate(cfg, check_files=False)
    tf = model_config(cfg, 256).transformer_config()
    assert (tf.recompute_granularity, tf.recompute_method, tf.recompute_num_layers) == expected


def test_megatron_core_names_are_the_same_settings():
    cfg = load_config(
        DEMO,
        [
            "+model.recompute_granularity=full",
            "+model.recompute_method=block",
            "+model.recompute_num_layers=2",
        ],
    )
    validate(cfg, check_files=False)
    m = cfg.model
    assert (
        m.activations_checkpoint_granularity,
        m.activations_checkpoint_method,
        m.activations_checkpoint_num_layers,
    ) == ("full", "block", 2)
    with pytest.raises(ConfigError, match=r"model.recompute_granularity='full' contradicts"):
        load_config(DEMO, [f"{KEY}granularity=selective", "+model.recompute_granularity=full"])


def test_megatron_core_names_are_overridden_as_the_keys_they_name():
    """A plain override of an alias was refused, 'no key' (did you mean another alias,
    refused alike): the defaults hold the key it names, which it sets as in YAML."""
    names = ["model.recompute_granularity=full", "model.recompute_method=block"]
    names.append("model.recompute_num_layers=2")
    cfg = load_config(DEMO, names)
    assert cfg == load_config(DEMO, [f"+{name}" for name in names])
    assert cfg.model.activations_checkpoint_num_layers == 2
    with pytest.raises(ConfigError, match=r"model.recompute_granularity='full' contradicts"):
        load_config(DEMO, [f"{KEY}granularity=selective", "model.recompute_granularity=full"])
    with pytest.raises(ConfigError, match=r"did you mean 'model.recompute_granularity'\?"):
        load_config(DEMO, ["model.recompute_granulrity=full"])


@pytest.mark.filterwarnings("ignore::megatron_lns.config.loader.NemoKeysIgnoredWarning")
def test_nemo_default_recompute_keys_load_from_a_nemo_config():
    """NeMo's own megatron_gpt_config.yaml sets all three to null: recomputation off."""
    cfg = load_config(NEMO, ["model.data.data_prefix=[x]", "model.tokenizer.library=byte"])
    assert cfg.model.activations_checkpoint_granularity is None
    assert model_config(cfg, 256).transformer_config().recompute_granularity is None


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([f"{KEY}granularity=partial"], f"{KEY}granularity='partial' is not one of"),
        ([f"{KEY}granularity=full", f"{KEY}method=every"], f"{KEY}method='every' is not one of"),
        ([f"{KEY}num_layers=0"], f"{KEY}num_layers must be positive, got 0"),
        ([f"{KEY}method=uniform"], f"{KEY}method='uniform' needs {KEY}granularity=full"),
        ([f"{KEY}num_layers=1"], f"{KEY}num_layers=1 needs {KEY}granularity=full"),
        (
            [f"{KEY}granularity=selective", f"{KEY}num_layers=1"],
            f"{KEY}num_layers=1 applies to {KEY}granularity=full only",
        ),
        (
            [f"{KEY}granularity=selective", f"{KEY}method=block"],
            f"{KEY}method='block' applies to {KEY}granularity=full only",
        ),
        ([f"{KEY}granularity=full"], f"{KEY}granularity=full needs {KEY}method"),
        (
            [f"{KEY}granularity=full", f"{KEY}method=uniform"],
            f"{KEY}granularity=full needs {KEY}method (uniform or block) and {KEY}num_layers",
        ),
        (
            [
                f"{KEY}granularity=full",
                f"{KEY}method=block",
                f"{KEY}num_layers=9",
                "model.pipeline_model_parallel_size=2",
                "trainer.devices=2",
            ],
            f"{KEY}num_layers (9) exceeds the layers per pipeline stage (8 = ",
        ),
    ],
)
def test_recompute_settings_that_cannot_work_are_refused_by_name(overrides, expected):
    with pytest.raises(ConfigError) as info:
        validate(load_config(DEMO, overrides), check_files=False)
    assert expected in str(info.value)


def _loss_and_grads(
    layout: ParallelLayout,
    num_microbatches: int,
    model: dict | None = None,
    regions: list | None = None,
    **recompute,
):
    """Build (same seed, same weights), run one forward/backward; this rank's results
    (and the number of checkpointed regions appended to ``regions``)."""
    cfg = tiny_config(hidden_dropout=0.1, attention_dropout=0.1, **(model or {}), **recompute)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = wrap_with_ddp(build_model(cfg, layout))
    batches = fixed_microbatches(cfg.vocab_size, cfg.seq_length, num_microbatches)
    # Every checkpointed region saves the RNG states first: count them, so that a mode
    # that silently recomputed nothing fails the test.
    saves = []
    save_states = mcore_random._get_all_rng_states
    mcore_random._get_all_rng_states = lambda: saves.append(1) or save_states()
    try:
        loss = forward_backward(model, batches).loss
    finally:
        mcore_random._get_all_rng_states = save_states
    assert bool(saves) == bool(recompute), f"{len(saves)} checkpointed regions with {recompute}"
    if regions is not None:
        regions.append(len(saves))
    assert not cfg.num_moe_experts or _moe_aux_losses_were_added()
    grads = {
        f"{index}.{name}": param.main_grad.detach().clone()
        for index, chunk in enumerate(model)
        for name, param in chunk.module.named_parameters()
    }
    return loss, grads


def _moe_aux_losses_were_added() -> bool:
    """The MoE runs train the router through the aux loss too (megatron's tracker has it)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    found = "load_balancing_loss" in tracker and bool(
        tracker["load_balancing_loss"]["values"].any()
    )
    tracker.clear()
    return found


MOE_MODEL = dict(
    num_moe_experts=4,
    moe_layer_freq=[0, 1, 1, 1],
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=48,
    extra_transformer_config=dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001),
)
MOE_RECOMPUTE_MODULES = {
    "moe": ["moe"],
    "shared_experts_mlp_core_attn": ["shared_experts", "mlp", "core_attn"],
}


@pytest.mark.parametrize("modules", MOE_RECOMPUTE_MODULES)
def test_moe_recompute_modules_match_no_recompute(megatron_world1, modules):
    """megatron-core's MoE recompute modules (``model.recompute_modules``) on a model with
    dense and MoE layers, shared experts and dropout: same loss and gradients. (``layernorm``
    and ``moe_act`` run in megatron's ``CheckpointWithoutOutput``, which reads Transformer
    Engine's FP8 state, so they are refused without it: tests/config/test_moe_rules.py.)"""
    layout = ParallelLayout()
    init_distributed(layout, device="cpu")
    baseline = _loss_and_grads(layout, 2, MOE_MODEL)
    extra = {
        **MOE_MODEL["extra_transformer_config"],
        "recompute_modules": MOE_RECOMPUTE_MODULES[modules],
    }
    model = {**MOE_MODEL, "extra_transformer_config": extra}
    _assert_same(baseline, _loss_and_grads(layout, 2, model, recompute_granularity="selective"))


def _assert_same(expected, actual):
    (base_loss, base_grads), (loss, grads) = expected, actual
    assert loss == pytest.approx(base_loss, rel=1e-6)
    assert grads.keys() == base_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, base_grads[name], msg=name)


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_recompute_matches_no_recompute_at_tp1(megatron_world1, mode):
    layout = ParallelLayout()
    init_distributed(layout, device="cpu")
    baseline = _loss_and_grads(layout, 2)
    _assert_same(baseline, _loss_and_grads(layout, 2, **RECOMPUTE_MODES[mode]))


@pytest.mark.parametrize("mode", ["full_uniform", "full_block"])
def test_hybrid_twin_recomputes_what_gpt_recomputes(megatron_world1, mode):
    """megatron's HybridStack counts ``recompute_num_layers`` in sublayers; the GPT twin
    (``architecture=hybrid``, no pattern) counts GPT layers, so it recomputes the same
    layers as the GPT model: in the same regions (``uniform``), or each of those layers'
    two sublayers in a region of its own (``block``, one region per module); and it
    computes the same loss and gradients (their names differ: the GPT model's layer i is
    the twin's sublayers 2i and 2i+1)."""
    layout = ParallelLayout()
    init_distributed(layout, device="cpu")
    gpt_regions, hybrid_regions = [], []
    gpt_loss, gpt_grads = _loss_and_grads(layout, 2, regions=gpt_regions, **RECOMPUTE_MODES[mode])
    hybrid_loss, hybrid_grads = _loss_and_grads(
        layout, 2, {"architecture": "hybrid"}, hybrid_regions, **RECOMPUTE_MODES[mode]
    )
    sublayers_per_region = 2 if mode == "full_block" else 1
    assert hybrid_regions == [sublayers_per_region * count for count in gpt_regions]
    assert hybrid_loss == gpt_loss
    renamed = {gpt_key_to_hybrid(name): grad for name, grad in gpt_grads.items()}
    assert renamed.keys() == hybrid_grads.keys()
    for name, grad in hybrid_grads.items():
        torch.testing.assert_close(grad, renamed[name], rtol=0, atol=0, msg=name)


def parallel_recompute_worker():
    out = {}
    for name, (layout, num_microbatches) in {
        "tp2": (ParallelLayout(tensor=2), 2),
        "pp2": (ParallelLayout(pipeline=2), 4),
    }.items():
        init_distributed(layout, device="cpu")
        out[name] = {"none": _loss_and_grads(layout, num_microbatches)}
        for mode, recompute in RECOMPUTE_MODES.items():
            out[name][mode] = _loss_and_grads(layout, num_microbatches, **recompute)
    return out


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    return run_distributed(parallel_recompute_worker, 2, tmp_path_factory.mktemp("recompute"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_recompute_matches_no_recompute_in_parallel(parallel_results, layout, mode):
    for rank_result in parallel_results:
        _assert_same(rank_result[layout]["none"], rank_result[layout][mode])
