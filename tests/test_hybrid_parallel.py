"""The GPT-equivalent hybrid LNS model is the GPT LNS model: same weights, same loss,
logits and gradients, at every parallel layout, with and without MoE sublayers.

One spawn of two real (gloo) ranks runs every case. Each model's weights are made once at
TP=PP=1: the GPT model's (norm weights perturbed, so the folded LNS factor matters) are
copied into the hybrid twin under ``hybrid_pattern.gpt_key_to_hybrid`` names, and both
are saved with dist_checkpointing. Each case then builds both architectures at its layout
from those checkpoints and compares what each computes: the loss, the logits (one-stage
layouts) and every gradient after megatron DDP's reductions, whole and under GPT names.

Comparing the two architectures at the same layout isolates the hybrid model from the
parallel reductions (tests/test_model_parallel.py checks those against TP=1), so the
tolerance is fp32 rounding (:data:`SAME`); on one CPU the two are bitwise equal.

The negative control (in-process) is the same hybrid model with megatron's sublayer
``layer_number`` as LNS's depth: it must fail this comparison.
"""

import math

import pytest
import torch
from helpers import (
    fixed_microbatches,
    perturb_norm_weights,
    tiny_config,
    worker_results,
)
from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker, set_moe_metrics_tracker
from test_moe_parallel import full_tensors

from megatron_lns.config import hybrid_pattern
from megatron_lns.model.language_model import build_model, unwrap
from megatron_lns.runtime import ParallelLayout, init_distributed
from megatron_lns.training.build import wrap_with_ddp
from megatron_lns.training.checkpoint import load_model_weights, save_model_weights
from megatron_lns.training.moe_metrics import MoEMetrics
from megatron_lns.training.step import forward_backward

WORLD_SIZE = 2
# fp32, same layout, same kernels: the two architectures may differ by rounding only.
SAME = dict(rtol=1e-6, atol=1e-9)

MODELS = {
    "dense": {},
    # E sublayers in blocks 2 and 4; the router losses put the router into the gradients.
    "moe": dict(
        num_moe_experts=4,
        moe_layer_freq=[0, 1, 0, 1],
        extra_transformer_config=dict(
            moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3
        ),
    ),
}

# name -> (model, layout). The hybrid model's pipeline layouts are '|' segments at the GPT
# model's stage boundaries (GPTModelConfig.hybrid_stack_pattern).
CASES = {
    "dense_tp1": ("dense", ParallelLayout()),
    "dense_tp2_sp": ("dense", ParallelLayout(tensor=2, sequence_parallel=True)),
    "dense_pp2": ("dense", ParallelLayout(pipeline=2)),
    "dense_pp2_vp2": ("dense", ParallelLayout(pipeline=2, virtual_pipeline=2)),
    "moe_tp1": ("moe", ParallelLayout()),
    "moe_ep2": ("moe", ParallelLayout(expert=2)),
}
ONE_STAGE = [case for case, (_, layout) in CASES.items() if layout.pipeline == 1]


def model_config(model: str, architecture: str):
    return tiny_config(architecture=architecture, **MODELS[model])


def gpt_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A hybrid model's tensors under the GPT model's names."""
    return {hybrid_pattern.hybrid_key_to_gpt(name): t for name, t in tensors.items()}


def logits(model, batch) -> torch.Tensor:
    """Full-vocabulary logits of a one-stage model (gathered over tensor parallelism)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    with torch.no_grad():
        out = model[0](batch["tokens"], batch["position_ids"], None)
    return gather_from_tensor_model_parallel_region(out)


def sublayer_factors(model) -> list[tuple[int, float, float]]:
    """(sublayer number, the layer's factor, its norm's factor) for every sublayer here."""
    factors = []
    for chunk in model:
        for layer in unwrap(chunk).decoder.layers:
            (owner,) = layer.pre_norm_owners()
            factors.append((layer.layer_number, layer.norm_output_scale, owner.output_scale))
    return factors


def save_weights(tmp: str) -> None:
    """Each model's GPT weights and their hybrid copy, saved at TP=PP=1."""
    init_distributed(ParallelLayout(), device="cpu")
    for model in MODELS:
        gpt = build_model(model_config(model, "gpt"))
        perturb_norm_weights(gpt[0])
        hybrid = build_model(model_config(model, "hybrid"))
        copied = {hybrid_pattern.gpt_key_to_hybrid(k): v for k, v in gpt[0].state_dict().items()}
        hybrid[0].load_state_dict(copied, strict=True)
        save_model_weights(wrap_with_ddp(gpt), f"{tmp}/{model}_gpt")
        save_model_weights(wrap_with_ddp(hybrid), f"{tmp}/{model}_hybrid")


def equivalence_worker(tmp: str) -> dict:
    save_weights(tmp)
    batches = fixed_microbatches(128, 16, num_microbatches=4)
    out = {}
    for case, (model, layout) in CASES.items():
        for architecture in ("gpt", "hybrid"):
            init_distributed(layout, device="cpu")
            # The routers' process-global loss tracker is sized by the first model that
            # records (4 GPT layers, 8 hybrid sublayers): a fresh one per model.
            set_moe_metrics_tracker(MoEMetricsTracker())
            chunks = wrap_with_ddp(build_model(model_config(model, architecture), layout))
            load_model_weights(chunks, f"{tmp}/{model}_{architecture}")
            moe_metrics = MoEMetrics.for_model(chunks, unwrap(chunks[0]).config)
            if moe_metrics:
                moe_metrics.start_step()
            loss = forward_backward(chunks, batches).loss
            grads = full_tensors(chunks, of="grad")
            result = dict(loss=loss, grads=grads)
            if moe_metrics:  # what a training step logs: router losses, expert load
                result["moe_metrics"] = moe_metrics.report(len(batches))[0]
            if architecture == "hybrid":
                result["grads"] = gpt_names(grads)
                result["factors"] = sublayer_factors(chunks)
            if layout.pipeline == 1:
                result["logits"] = logits(chunks, batches[0])
            out[case, architecture] = result
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return worker_results(tmp_path_factory, "hybrid_parallel", equivalence_worker, WORLD_SIZE)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_model_has_the_gpt_models_loss_and_gradients(results, case):
    gpt_grads, hybrid_grads = {}, {}
    for rank_result in results:
        gpt, hybrid = rank_result[case, "gpt"], rank_result[case, "hybrid"]
        torch.testing.assert_close(hybrid["loss"], gpt["loss"], **SAME)
        for name, grad in hybrid["grads"].items():
            torch.testing.assert_close(grad, gpt["grads"][name], **SAME, msg=name)
        gpt_grads.update(gpt["grads"])
        hybrid_grads.update(hybrid["grads"])
    # Together the ranks hold every gradient of both models, under the same names.
    assert hybrid_grads.keys() == gpt_grads.keys()
    if CASES[case][0] == "moe":
        assert any(".mlp.router." in name for name in gpt_grads)


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case, (model, _) in CASES.items() if model == "moe"])
def test_hybrid_model_logs_the_gpt_models_moe_metrics(results, case):
    """The router losses are averaged over the MoE layers and the expert load taken over
    them: the hybrid model's attention sublayers must not count as MoE layers."""
    for rank_result in results:
        gpt, hybrid = rank_result[case, "gpt"], rank_result[case, "hybrid"]
        assert set(gpt["moe_metrics"]) >= {"moe/load_balancing_loss", "moe/z_loss"}
        assert hybrid["moe_metrics"] == pytest.approx(gpt["moe_metrics"], rel=SAME["rtol"])


@pytest.mark.slow
@pytest.mark.parametrize("case", ONE_STAGE)
def test_hybrid_model_has_the_gpt_models_logits(results, case):
    for rank_result in results:
        gpt, hybrid = rank_result[case, "gpt"], rank_result[case, "hybrid"]
        torch.testing.assert_close(hybrid["logits"], gpt["logits"], **SAME)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_scales_each_sublayer_by_its_block(results, case):
    """Sublayers 2l-1 (attention) and 2l (MLP/MoE) of the GPT twin are block l, whichever
    stage and virtual chunk builds them."""
    seen = []
    for rank_result in results:
        for number, layer_factor, norm_factor in rank_result[case, "hybrid"]["factors"]:
            block = (number + 1) // 2
            assert layer_factor == norm_factor == 1 / math.sqrt(block), number
            seen.append(number)
    tensor_or_expert_copies = len(seen) // 8
    assert sorted(seen) == sorted(list(range(1, 9)) * tensor_or_expert_copies)


# -- negative control: megatron's layer_number as the depth ----------------------------------


def _logit_difference_from_gpt() -> tuple[float, float]:
    """The dense GPT model and its hybrid twin on the same weights (one rank): the largest
    difference between their logits, and the largest GPT logit (the tolerance's scale)."""
    gpt = build_model(tiny_config())[0]
    perturb_norm_weights(gpt)
    hybrid = build_model(tiny_config(architecture="hybrid"))[0]
    copied = {hybrid_pattern.gpt_key_to_hybrid(k): v for k, v in gpt.state_dict().items()}
    hybrid.load_state_dict(copied, strict=True)
    batch = fixed_microbatches(128, 16)[0]
    args = (batch["tokens"], batch["position_ids"], None)
    with torch.no_grad():
        gpt_logits, hybrid_logits = gpt(*args), hybrid(*args)
    return (hybrid_logits - gpt_logits).abs().max().item(), gpt_logits.abs().max().item()


def test_layer_number_as_depth_fails_the_equivalence(seeded, monkeypatch):
    same, scale = _logit_difference_from_gpt()
    tolerance = SAME["atol"] + SAME["rtol"] * scale
    assert same <= tolerance
    # The trap of issue 20: sublayers numbered 1..2L, so block l's attention and MLP get
    # 1/sqrt(2l-1) and 1/sqrt(2l) instead of 1/sqrt(l).
    monkeypatch.setattr(
        hybrid_pattern,
        "block_numbers",
        lambda pattern: tuple(range(1, len(hybrid_pattern.sublayers(pattern)) + 1)),
    )
    wrong, _ = _logit_difference_from_gpt()
    assert wrong > 1e4 * tolerance, wrong
