"""Multi-process (gloo) tensor, sequence and pipeline parallel tests.

Each test spawns real ranks. The baseline runs on the same ranks at TP=1/PP=1 (as
data parallel, on identical data), its weights are saved with dist_checkpointing and
loaded into the parallel layouts, so every layout computes on the same weights.
"""

import math

import pytest
import torch
import torch.distributed as dist
from helpers import (
    TP2_LAYOUTS,
    fixed_microbatches,
    forward_backward_at,
    run_distributed,
    tiny_config,
    worker_results,
)
from megatron.core import parallel_state

from megatron_lns.runtime import ParallelLayout, init_distributed
from megatron_lns.training.build import wrap_with_ddp
from megatron_lns.training.checkpoint import load_model_weights, save_model_weights
from megatron_lns.training.step import forward_backward

pytestmark = pytest.mark.slow


def _full_grads(model, gated: bool) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, re-assembled across tensor-parallel ranks in TP=1 layout."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    grads = {}
    for name, param in model[0].module.named_parameters():
        grad = param.main_grad.detach().clone()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(parts, grad, group=tp_group)
            if gated and name.endswith("linear_fc1.weight"):
                # Each rank holds [gate_r | up_r]; TP=1 holds [gate | up].
                halves = [part.chunk(2, dim=0) for part in parts]
                grad = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                grad = torch.cat(parts, dim=param.partition_dim)
        grads[name] = grad
    return grads


def _grads_by_global_name(model) -> dict[str, torch.Tensor]:
    """This rank's gradients keyed by TP=1/PP=1 parameter names (global layer indices)."""
    grads = {}
    for chunk in model:
        layers = chunk.module.decoder.layers
        for name, param in chunk.module.named_parameters():
            if name.startswith("decoder.layers."):
                local_index, rest = name.removeprefix("decoder.layers.").split(".", 1)
                global_index = layers[int(local_index)].layer_number - 1
                name = f"decoder.layers.{global_index}.{rest}"
            grads[name] = param.main_grad.detach().clone()
    return grads


def tensor_parallel_worker(tmp: str):
    cfg = tiny_config()
    batches = fixed_microbatches(cfg.vocab_size, cfg.seq_length)
    base_ckpt, tp2_ckpt = f"{tmp}/tp1", f"{tmp}/tp2"

    model, base_loss = forward_backward_at(cfg, ParallelLayout(), batches)
    save_model_weights(model, base_ckpt)
    out = {"tp1": (base_loss, _full_grads(model, gated=True))}
    for name, layout in TP2_LAYOUTS.items():
        model, loss = forward_backward_at(cfg, layout, batches, base_ckpt)
        out[name] = (loss, _full_grads(model, gated=True))
        out[name + "_factors"] = [
            (
                layer.layer_number,
                layer.input_layernorm.output_scale,
                layer.pre_mlp_layernorm.output_scale,
            )
            for layer in model[0].module.decoder.layers
        ]
        if name == "tp2_sp":
            out["sp_flags"] = {
                n: getattr(p, "sequence_parallel", False)
                for n, p in model[0].module.named_parameters()
                if "layernorm" in n
            }
    # Reverse direction: a TP=2 checkpoint loaded at TP=1.
    save_model_weights(model, tp2_ckpt)
    _, out["tp2_ckpt_at_tp1"] = forward_backward_at(cfg, ParallelLayout(), batches, tp2_ckpt)
    return out


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return worker_results(tmp_path_factory, "tp", tensor_parallel_worker, 2)


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_tensor_parallel_matches_tp1_loss_and_gradients(tp_results, layout):
    for rank_result in tp_results:
        base_loss, base_grads = rank_result["tp1"]
        loss, grads = rank_result[layout]
        assert loss == pytest.approx(base_loss, rel=1e-5)
        assert grads.keys() == base_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, base_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_sequence_parallel_norm_params_are_marked(tp_results):
    flags = tp_results[0]["sp_flags"]
    assert flags and all(flags.values()), flags


def test_tensor_parallel_factors(tp_results):
    for rank_result in tp_results:
        for layout in ("tp2", "tp2_sp"):
            for number, attn, mlp in rank_result[layout + "_factors"]:
                assert attn == mlp == 1 / math.sqrt(number)


def test_tp2_checkpoint_loads_at_tp1(tp_results):
    for rank_result in tp_results:
        assert rank_result["tp2_ckpt_at_tp1"] == pytest.approx(rank_result["tp2"][0], rel=1e-5)


PIPELINE_LAYOUTS = {
    "pp2": (ParallelLayout(pipeline=2), {}),
    "pp2_uneven": (
        ParallelLayout(pipeline=2),
        {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 3},
    ),
    "pp2_vp2": (ParallelLayout(pipeline=2, virtual_pipeline=2), {}),
}


def pipeline_parallel_worker(tmp: str):
    cfg = tiny_config()
    batches = fixed_microbatches(cfg.vocab_size, cfg.seq_length, num_microbatches=4)
    model, base_loss = forward_backward_at(cfg, ParallelLayout(), batches)
    save_model_weights(model, f"{tmp}/pp1")
    out = {"pp1": (base_loss, _grads_by_global_name(model))}
    for name, (layout, extra) in PIPELINE_LAYOUTS.items():
        layout_cfg = tiny_config(extra_transformer_config=extra)
        model, loss = forward_backward_at(layout_cfg, layout, batches, f"{tmp}/pp1")
        factors = []
        for vp_stage, chunk in enumerate(model):
            for index, layer in enumerate(chunk.module.decoder.layers):
                factors.append(
                    dict(
                        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                        vp_stage=vp_stage,
                        local_index=index,
                        layer_number=layer.layer_number,
                        attn=layer.input_layernorm.output_scale,
                        mlp=layer.pre_mlp_layernorm.output_scale,
                    )
                )
            final = chunk.module.decoder.final_layernorm
            if final is not None:
                factors.append(dict(final_norm_scale=final.output_scale))
        out[name] = (loss, factors, _grads_by_global_name(model))
    return out


@pytest.fixture(scope="module")
def pp_results(tmp_path_factory):
    return worker_results(tmp_path_factory, "pp", pipeline_parallel_worker, 2)


@pytest.mark.parametrize("layout", list(PIPELINE_LAYOUTS))
def test_pipeline_parallel_matches_pp1_loss_and_gradients(pp_results, layout):
    base_loss, base_grads = pp_results[0]["pp1"]
    merged = {}
    for rank_result in pp_results:
        assert rank_result[layout][0] == pytest.approx(base_loss, rel=1e-5)
        merged.update(rank_result[layout][2])
    assert merged.keys() == base_grads.keys()
    for name, grad in merged.items():
        torch.testing.assert_close(grad, base_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _expected_global_number(layout: str, pp_rank: int, vp_stage: int, local_index: int) -> int:
    """Global 1-based layer index, computed independently of megatron's offset code."""
    if layout == "pp2":  # 4 layers: rank 0 -> 1,2; rank 1 -> 3,4
        return pp_rank * 2 + local_index + 1
    if layout == "pp2_uneven":  # rank 0 -> 1; rank 1 -> 2,3,4
        return 1 if pp_rank == 0 else 2 + local_index
    # pp2_vp2, 1 layer per chunk, chunks interleaved: (r0,v0)=1 (r1,v0)=2 (r0,v1)=3 (r1,v1)=4
    return vp_stage * 2 + pp_rank + 1


@pytest.mark.parametrize("layout", list(PIPELINE_LAYOUTS))
def test_every_rank_and_chunk_uses_its_global_layer_factor(pp_results, layout):
    seen = []
    for rank_result in pp_results:
        for entry in rank_result[layout][1]:
            if "final_norm_scale" in entry:
                assert entry["final_norm_scale"] == 1.0
                continue
            number = _expected_global_number(
                layout, entry["pp_rank"], entry["vp_stage"], entry["local_index"]
            )
            assert entry["layer_number"] == number
            assert entry["attn"] == entry["mlp"] == 1 / math.sqrt(number)
            seen.append(number)
    assert sorted(seen) == [1, 2, 3, 4]


def fused_norm_sequence_parallel_worker(tmp: str):
    """The fused-norm (TE-style) path under TP=2 + SP equals TP=1: loss and gradients."""
    from test_fused_norm import _fused_model

    from megatron_lns.model.fused_norm import FusedNormScaling

    cfg = tiny_config(normalization="LayerNorm")
    batches = fixed_microbatches(cfg.vocab_size, cfg.seq_length)
    out = {}
    for name, layout in {
        "tp1": ParallelLayout(),
        "tp2_sp": ParallelLayout(tensor=2, sequence_parallel=True),
    }.items():
        init_distributed(layout, device="cpu")
        layout_cfg = tiny_config(normalization="LayerNorm")
        chunk = _fused_model(layout_cfg, layout)
        model = wrap_with_ddp([chunk])
        if name == "tp1":
            save_model_weights(model, f"{tmp}/fused")
        else:
            load_model_weights(model, f"{tmp}/fused")
        loss = forward_backward(model, batches).loss
        out[name] = (loss, _full_grads(model, gated=True))
        owners = [m for m in chunk.modules() if isinstance(m, FusedNormScaling)]
        out[name + "_sp_attr"] = all(
            getattr(m.layer_norm_weight, "sequence_parallel", None) == layout.sequence_parallel
            for m in owners
        )
    return out


def test_fused_norm_path_under_sequence_parallelism(tmp_path):
    for rank_result in run_distributed(
        fused_norm_sequence_parallel_worker, 2, tmp_path, str(tmp_path)
    ):
        base_loss, base_grads = rank_result["tp1"]
        loss, grads = rank_result["tp2_sp"]
        assert loss == pytest.approx(base_loss, rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, base_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        assert rank_result["tp1_sp_attr"] and rank_result["tp2_sp_sp_attr"]
