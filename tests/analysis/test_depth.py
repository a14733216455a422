"""Depth diagnostics on constructed cases: a layer that is the identity, a known rescaling
of the residual stream, and the statistics against a direct computation."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import fixed_microbatches, tiny_config

from megatron_lns.analysis.depth import (
    depth_diagnostics,
    held_out_loss,
    layer_removed,
    layer_statistics,
)
from megatron_lns.config.hybrid_pattern import gpt_key_to_hybrid
from megatron_lns.model.language_model import build_model

NUM_LAYERS = 4


@pytest.fixture()
def model(seeded):
    return build_model(tiny_config(num_layers=NUM_LAYERS, norm_scaling="none"))


@pytest.fixture()
def batches():
    cfg = tiny_config()
    return [fixed_microbatches(cfg.vocab_size, cfg.seq_length, seed=seed) for seed in range(2)]


def _zero_branches(layer: torch.nn.Module) -> None:
    """The attention and MLP output projections at zero: the layer adds nothing to the
    residual stream, so its output is its input."""
    with torch.no_grad():
        layer.self_attention.linear_proj.weight.zero_()
        layer.mlp.linear_fc2.weight.zero_()


def test_identity_layer_has_zero_angular_distance_and_zero_pruning_drop(model, batches):
    _zero_branches(model[0].decoder.layers[1])  # global layer 2
    report = depth_diagnostics(model, batches)

    assert [row.layer_number for row in report.layers] == [1, 2, 3, 4]
    identity = report.layers[1]
    assert identity.angular_distance < 1e-6
    assert identity.angular_distance_last_token < 1e-6
    assert identity.pruning_drop == pytest.approx(0.0, abs=1e-12)
    for row in (report.layers[0], report.layers[2], report.layers[3]):
        assert row.angular_distance > 1e-3
        assert row.pruning_drop != pytest.approx(0.0, abs=1e-6)
    assert report.num_tokens == 2 * 2 * 2 * 16
    assert report.loss == pytest.approx(held_out_loss(model, batches)[0], abs=1e-12)
    assert report.perplexity == pytest.approx(math.exp(report.loss))


def test_removing_a_layer_is_undone_afterwards(model, batches):
    full, _ = held_out_loss(model, batches)
    with layer_removed(model, 3):
        without, _ = held_out_loss(model, batches)
    assert without != pytest.approx(full, abs=1e-6)
    assert held_out_loss(model, batches)[0] == full


def test_known_rescaling_gives_the_expected_variance_profile(model, batches):
    """Layer l outputs its input times c_l, so after layer l the stream is the embedding
    times c_1...c_l and its variance grows by the square of that product."""
    factors = [2.0, 0.5, 3.0, -4.0]

    def scale(factor):
        def hook(module, args, kwargs, output):
            return (kwargs["hidden_states"] * factor, *output[1:])

        return hook

    for layer, factor in zip(model[0].decoder.layers, factors, strict=True):
        layer.register_forward_hook(scale(factor), with_kwargs=True)
    report = depth_diagnostics(model, batches, prune=False)

    first = report.layers[0].output_variance
    product = 1.0
    for row, factor in zip(report.layers, factors, strict=True):
        product *= factor
        assert row.output_variance / first == pytest.approx((product / factors[0]) ** 2)
    assert report.variance_growth() == pytest.approx((2.0 * 0.5 * 3.0 * -4.0 / 2.0) ** 2)
    # A positive factor keeps the direction, a negative one reverses it.
    for row in report.layers[:3]:
        assert row.angular_distance < 1e-6 and row.angular_distance_last_token < 1e-6
    assert report.layers[3].angular_distance == pytest.approx(1.0, abs=1e-6)
    assert math.isnan(report.layers[0].pruning_drop)
    assert report.to_dict()["layers"][0]["pruning_drop"] is None


def test_statistics_match_a_direct_computation(model, batches):
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def record(module, args, kwargs, output):
        pair = (kwargs["hidden_states"].detach().double(), output[0].detach().double())
        seen.setdefault(module.layer_number, []).append(pair)

    for layer in model[0].decoder.layers:
        layer.register_forward_hook(record, with_kwargs=True)
    microbatches = [mb for batch in batches for mb in batch]
    stats = layer_statistics(model, microbatches)

    for row in stats:
        inputs = torch.cat([x for x, _ in seen[row.layer_number]], dim=1)  # [s, b, h]
        outputs = torch.cat([y for _, y in seen[row.layer_number]], dim=1)
        cosine = (inputs * outputs).sum(-1) / (inputs.norm(dim=-1) * outputs.norm(dim=-1))
        distance = torch.arccos(cosine.clamp(-1, 1)) / math.pi
        assert row.output_variance == pytest.approx(outputs.var(unbiased=False).item())
        assert row.angular_distance == pytest.approx(distance.mean().item())
        assert row.angular_distance_last_token == pytest.approx(distance[-1].mean().item())


def _diagnostics_at(layout, weights, save: bool) -> dict:
    """Diagnostics of the tiny model at ``layout``; its weights saved to or loaded from
    ``weights`` (a distributed checkpoint, so any layout loads them)."""
    from megatron_lns.runtime import init_distributed
    from megatron_lns.training.checkpoint import load_model_weights, save_model_weights

    init_distributed(layout, device="cpu")
    chunks = build_model(tiny_config(num_layers=NUM_LAYERS, norm_scaling="none"), layout)
    if save:
        save_model_weights(chunks, weights)
    else:
        load_model_weights(chunks, weights)
    cfg = tiny_config()
    batches = [fixed_microbatches(cfg.vocab_size, cfg.seq_length, seed=s) for s in range(2)]
    return depth_diagnostics(chunks, batches).to_dict()


@pytest.mark.slow
def test_tensor_and_sequence_parallel_give_the_one_process_report(tmp_path):
    """Under sequence parallelism each TP rank holds a slice of the sequence and only the
    last one holds the last token: the sums must still cover every token once."""
    from helpers import run_distributed

    from megatron_lns.runtime import ParallelLayout

    weights = tmp_path / "weights"
    single = run_distributed(_diagnostics_at, 1, tmp_path / "one", ParallelLayout(), weights, True)
    tp2 = ParallelLayout(tensor=2, sequence_parallel=True)
    ranks = run_distributed(_diagnostics_at, 2, tmp_path / "two", tp2, weights, False)

    assert ranks[0] == ranks[1]
    reference, report = single[0], ranks[0]
    assert report["num_tokens"] == reference["num_tokens"]
    assert report["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    for ours, theirs in zip(report["layers"], reference["layers"], strict=True):
        for key in theirs:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


def test_a_gpt_equivalent_hybrid_model_gives_the_gpt_models_report(seeded, batches):
    """A hybrid model's rows are its blocks (attention + MLP sublayers): on the GPT model's
    weights it reports exactly what the GPT model reports, pruning included."""
    gpt = build_model(tiny_config(num_layers=NUM_LAYERS))
    hybrid = build_model(tiny_config(num_layers=NUM_LAYERS, architecture="hybrid"))
    state = {gpt_key_to_hybrid(key): value for key, value in gpt[0].state_dict().items()}
    hybrid[0].load_state_dict(state)
    expected = depth_diagnostics(gpt, batches[:1]).to_dict()
    assert [row["layer_number"] for row in expected["layers"]] == [1, 2, 3, 4]
    assert depth_diagnostics(hybrid, batches[:1]).to_dict() == expected


def test_a_hybrid_block_runs_from_its_first_sublayers_input_to_its_last_ones_output(
    seeded, batches
):
    """``*--*-``: block 1 is an attention and two MLPs. Zeroing all three makes the block
    the identity; zeroing only the MLPs does not (the attention still changes the stream)."""
    model = build_model(
        tiny_config(architecture="hybrid", num_layers=5, hybrid_layer_pattern="*--*-")
    )
    attention, mlp_1, mlp_2 = model[0].decoder.layers[:3]
    with torch.no_grad():
        mlp_1.mlp.linear_fc2.weight.zero_()
        mlp_2.mlp.linear_fc2.weight.zero_()
    partly = depth_diagnostics(model, batches)
    assert [row.layer_number for row in partly.layers] == [1, 2]
    assert partly.layers[0].angular_distance > 1e-3
    assert partly.layers[0].pruning_drop != pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        attention.self_attention.linear_proj.weight.zero_()
    identity = depth_diagnostics(model, batches).layers[0]
    assert identity.angular_distance < 1e-6
    assert identity.pruning_drop == pytest.approx(0.0, abs=1e-12)
