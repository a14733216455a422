"""Multi-process (gloo) expert, tensor and pipeline parallelism of mixture-of-experts models.

One spawn of four real ranks runs every case. The baseline is the model at EP=TP=PP=1
(data parallel over the four ranks, every rank on the same micro-batches); its weights
are saved with dist_checkpointing and loaded into each layout, so all of them compute
on the same weights. What is compared is what the optimizer sees: the gradients after
megatron DDP's ``finalize_model_grads`` (its data-parallel and expert-data-parallel
reductions and its expert-gradient scaling), re-assembled into full tensors under the
names they have at one rank (global layer and expert numbers).
"""

import pytest
import torch
import torch.distributed as dist
from helpers import (
    fixed_microbatches,
    forward_backward_at,
    tiny_config,
    worker_results,
)
from megatron.core import parallel_state

from megatron_lns.model.language_model import build_model
from megatron_lns.runtime import ParallelLayout, init_distributed
from megatron_lns.training.build import build_trainable, wrap_with_ddp
from megatron_lns.training.checkpoint import load_model_weights, save_model_weights
from megatron_lns.training.optim import OptimSettings
from megatron_lns.training.step import train_step

pytestmark = [pytest.mark.slow, pytest.mark.long]

WORLD_SIZE = 4
# The baselines' moe_layer_freq: every layer MoE, or a dense first layer (OLMoE-style).
PATTERNS = {"all_moe": 1, "mixed": [0, 1, 1, 1]}

# name -> (layout, token dispatcher, pattern). alltoall runs where it differs from
# allgather in what it sends: over expert ranks, and over expert-tensor ranks with the
# uneven per-rank token counts that the CPU layer's uneven-gather stand-in serves.
# (EP x TP runs with alltoall only: allgather's EP and TP paths each run on their own.)
CASES = {
    "ep2_allgather": (ParallelLayout(expert=2), "allgather", "all_moe"),
    "ep2_alltoall": (ParallelLayout(expert=2), "alltoall", "all_moe"),
    "ep2_tp2_alltoall": (
        ParallelLayout(tensor=2, expert=2, sequence_parallel=True),
        "alltoall",
        "all_moe",
    ),
    "ep2_tp2_etp1_alltoall": (
        ParallelLayout(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True),
        "alltoall",
        "all_moe",
    ),
    "pp2_ep2_mixed_allgather": (ParallelLayout(pipeline=2, expert=2), "allgather", "mixed"),
}


def moe_config(dispatcher: str = "allgather", **overrides):
    """The tiny test model with four experts (top-2) and a shared expert, both router
    losses switched on (their gradients must survive the parallel layouts too). With
    alltoall the shared expert overlaps the dispatch (``moe_shared_expert_overlap``: the
    same weights, another schedule)."""
    extra = dict(
        moe_token_dispatcher_type=dispatcher,
        moe_shared_expert_overlap=dispatcher == "alltoall",
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
    )
    return tiny_config(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=32,
        extra_transformer_config=extra,
        **overrides,
    )


def _global_name(chunk, name: str) -> str:
    """``name`` as it is at one rank: global layer number, global expert number."""
    if name.startswith("decoder.layers."):
        local_index, rest = name.removeprefix("decoder.layers.").split(".", 1)
        layer = chunk.decoder.layers[int(local_index)]
        name = f"decoder.layers.{layer.layer_number - 1}.{rest}"
        marker = ".mlp.experts.local_experts."
        if marker in name:
            head, tail = name.split(marker)
            local_expert, rest = tail.split(".", 1)
            name = f"{head}{marker}{layer.mlp.local_expert_indices[int(local_expert)]}.{rest}"
    return name


def _tensor_parallel_full(name: str, param: torch.nn.Parameter, tensor: torch.Tensor):
    """``tensor`` (a shard of ``param``) gathered over the ranks that split ``param``:
    the tensor-parallel group, or for expert weights the expert-tensor-parallel group."""
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    if getattr(param, "allreduce", True):
        group = parallel_state.get_tensor_model_parallel_group()
    else:  # an expert weight
        group = parallel_state.get_expert_tensor_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    if name.endswith("linear_fc1.weight"):  # SwiGLU: each rank holds [gate_r | up_r]
        halves = [part.chunk(2, dim=0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=param.partition_dim)


def full_tensors(model, of: str) -> dict[str, torch.Tensor]:
    """This rank's parameters' gradients (``of="grad"``) or values (``"param"``), whole
    and under their one-rank names."""
    out = {}
    for chunk in model:
        bare = chunk.module
        for name, param in bare.named_parameters():
            tensor = param.main_grad if of == "grad" else param.data
            out[_global_name(bare, name)] = _tensor_parallel_full(
                name, param, tensor.detach().clone()
            )
    return out


def _logits(model, batch) -> torch.Tensor:
    """The full-vocabulary logits of a one-stage model (gathered over tensor parallelism)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    with torch.no_grad():
        logits = model[0](batch["tokens"], batch["position_ids"], None)
    return gather_from_tensor_model_parallel_region(logits)


def _one_optimizer_step(cfg, layout, batches, checkpoint):
    """The whole parameters and the gradient norm after one step of the distributed
    optimizer. Adam's eps is far above the gradients, so its first update is close to
    lr x gradient (with megatron's default eps it is lr x sign(gradient), which turns
    rounding in near-zero gradients into whole steps): any difference in the gradients,
    their clipping norm over expert and dense shards, or the sharding shows."""
    init_distributed(layout, device="cpu")
    settings = OptimSettings(lr=0.1, min_lr=0.1, eps=1.0, use_distributed_optimizer=True)
    trainable = build_trainable(cfg, layout, torch.device("cpu"), settings, total_steps=4)
    load_model_weights(trainable.model, checkpoint)
    result = train_step(trainable.model, trainable.optimizer, batches)
    return full_tensors(trainable.model, of="param"), result.grad_norm


def moe_parallel_worker(tmp: str):
    batches = fixed_microbatches(128, 16)
    out = {}
    for pattern in ("mixed", "all_moe"):  # the all-MoE model stays for the next lines
        cfg = moe_config(moe_layer_freq=PATTERNS[pattern])
        model, loss = forward_backward_at(cfg, ParallelLayout(), batches)
        save_model_weights(model, f"{tmp}/base_{pattern}")
        out[f"base_{pattern}"] = (loss, full_tensors(model, of="grad"))
    out["base_params"] = full_tensors(model, of="param")
    out["base_logits"] = _logits(model, batches[0])

    for name, (layout, dispatcher, pattern) in CASES.items():
        cfg = moe_config(dispatcher, moe_layer_freq=PATTERNS[pattern])
        model, loss = forward_backward_at(cfg, layout, batches, f"{tmp}/base_{pattern}")
        out[name] = (loss, full_tensors(model, of="grad"))
        if name.startswith("ep2_tp2"):
            out[f"{name}_logits"] = _logits(model, batches[0])
        if name == "ep2_allgather":  # an EP=2 checkpoint for the layouts below
            save_model_weights(model, f"{tmp}/ep2")

    for name, layout in {
        "ep1": ParallelLayout(),
        "tp2": ParallelLayout(tensor=2, sequence_parallel=True),
    }.items():
        init_distributed(layout, device="cpu")
        model = wrap_with_ddp(build_model(moe_config(), layout))
        load_model_weights(model, f"{tmp}/ep2")
        out[f"ep2_ckpt_at_{name}_logits"] = _logits(model, batches[0])

    # The distributed optimizer shards expert weights over the expert-data-parallel
    # ranks and the others over all data-parallel ranks.
    for name, layout in {"ep1": ParallelLayout(), "ep2": ParallelLayout(expert=2)}.items():
        out[f"dist_opt_{name}"] = _one_optimizer_step(
            moe_config(), layout, batches, f"{tmp}/base_all_moe"
        )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return worker_results(tmp_path_factory, "moe_parallel", moe_parallel_worker, WORLD_SIZE)


def _assert_same_tensors(ranks_tensors: list[dict], base: dict, rtol=1e-4, atol=1e-6):
    """Every rank's whole tensors equal the baseline's, and together the ranks hold all."""
    seen = set()
    for tensors in ranks_tensors:
        for name, tensor in tensors.items():
            torch.testing.assert_close(tensor, base[name], rtol=rtol, atol=atol, msg=name)
        seen |= tensors.keys()
    assert seen == base.keys()


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_layouts_match_one_rank_loss_and_gradients(results, case):
    base_loss, base_grads = results[0][f"base_{CASES[case][2]}"]
    assert any(".mlp.experts." in name for name in base_grads)
    for rank_result in results:
        assert rank_result[case][0] == pytest.approx(base_loss, rel=1e-5)
    _assert_same_tensors([r[case][1] for r in results], base_grads)


def test_alltoall_at_ep2_tp2_computes_the_one_rank_logits(results):
    for rank_result in results:
        torch.testing.assert_close(
            rank_result["ep2_tp2_alltoall_logits"], rank_result["base_logits"], rtol=1e-4, atol=1e-6
        )


@pytest.mark.parametrize("layout", ["ep1", "tp2"])
def test_ep2_checkpoint_loads_at_another_layout(results, layout):
    for rank_result in results:
        torch.testing.assert_close(
            rank_result[f"ep2_ckpt_at_{layout}_logits"], rank_result["base_logits"]
        )


def test_distributed_optimizer_step_at_ep2_equals_ep1(results):
    params, grad_norm = results[0]["dist_opt_ep1"]
    before = results[0]["base_params"]  # the experts moved: the step did something
    assert any(not torch.equal(params[n], before[n]) for n in params if ".experts." in n)
    for rank_result in results:
        assert rank_result["dist_opt_ep2"][1] == pytest.approx(grad_norm, rel=1e-5)
    _assert_same_tensors([r["dist_opt_ep2"][0] for r in results], params)
