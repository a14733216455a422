"""GPU checks (marked ``gpu``; skipped without CUDA, the TE ones also without TE).

Each test runs in a fresh process so the CPU compatibility layer that CPU tests may
have installed in the pytest process cannot leak into CUDA runs.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import run_distributed, tiny_config

pytestmark = pytest.mark.gpu


def _te_available() -> bool:
    from megatron_lns.model.te import te_available

    return te_available()


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_te = pytest.mark.skipif(not _te_available(), reason="needs Transformer Engine")


def _ddp_without_overlap():
    """megatron DDP with fp32 gradient reduction and no overlap with backward."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=True)


def _logits(model, tokens):
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return model(tokens, positions, None)


def _local_backend_on_cuda_worker():
    from megatron_lns.model.language_model import build_model
    from megatron_lns.runtime import ParallelLayout, init_distributed
    from megatron_lns.runtime.cpu import cpu_compat_installed

    device = init_distributed(ParallelLayout(), device="cuda")
    assert not cpu_compat_installed()
    cfg = tiny_config(num_layers=6)
    gpu_model = build_model(cfg, device=device)[0]
    cpu_copy = build_model(cfg)[0].to(device)
    cpu_copy.load_state_dict(gpu_model.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), device=device)
    return (_logits(gpu_model, tokens) - _logits(cpu_copy, tokens)).abs().max().item()


def test_local_backend_runs_on_cuda(tmp_path):
    assert run_distributed(_local_backend_on_cuda_worker, 1, tmp_path)[0] < 1e-5


def _async_save_worker(directory, device_name="cuda"):
    """An asynchronous save takes the weights of its step (copied off the GPU before
    it returns), however they change while it is written; no helper process stays."""
    import psutil

    from megatron_lns.runtime import ParallelLayout, init_distributed
    from megatron_lns.training.build import build_trainable
    from megatron_lns.training.checkpoint import TrainingState, load_model_weights
    from megatron_lns.training.checkpoint_writer import CheckpointWriter
    from megatron_lns.training.optim import OptimSettings

    device = init_distributed(ParallelLayout(), device=device_name)
    trainable = build_trainable(
        tiny_config(), ParallelLayout(), device, OptimSettings(), 10, ddp=_ddp_without_overlap()
    )
    model, optimizer, scheduler = trainable.model, trainable.optimizer, trainable.scheduler
    saved = [p.detach().clone() for p in model[0].parameters()]
    writer = CheckpointWriter(directory, asynchronous=True)
    path = writer.save(model, optimizer, scheduler, TrainingState(1, 4), "")
    with torch.no_grad():
        for param in model[0].parameters():
            param.add_(1.0)
    writer.wait()
    writer.close()
    load_model_weights(model, path)
    same = all(torch.equal(a, b) for a, b in zip(model[0].parameters(), saved, strict=True))
    return same, [p.pid for p in psutil.Process().children(recursive=True)]


def test_async_checkpoint_save_on_cuda(tmp_path):
    same, children = run_distributed(_async_save_worker, 1, tmp_path, str(tmp_path / "ckpt"))[0]
    assert same and children == []


def _gpu_check():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_check

    return gpu_check


def _te_vs_local_worker():
    from megatron_lns.runtime import ParallelLayout, init_distributed

    device = init_distributed(ParallelLayout(), device="cuda")
    return _gpu_check().check_te_vs_local(device, smoke=False)


@needs_te
def test_te_lns_matches_local_lns_logits_and_gradients_in_bf16(tmp_path):
    """Same weights: logits and every gradient within the bf16 bounds of
    benchmarks/gpu_check.py, and TE LNS vs TE Pre-LN (the control) far outside them."""
    result = run_distributed(_te_vs_local_worker, 1, tmp_path)[0]
    assert result["status"] == "pass", result["failures"]


def _zero_centered_worker():
    from megatron_lns.runtime import ParallelLayout, init_distributed

    device = init_distributed(ParallelLayout(), device="cuda")
    return _gpu_check().check_zero_centered_gamma(device, smoke=False)


def test_deep_layer_bf16_scale_is_as_precise_as_plain_gamma(tmp_path):
    """Layer 64, bf16: local backend always, Transformer Engine when installed."""
    result = run_distributed(_zero_centered_worker, 1, tmp_path)[0]
    assert result["status"] == "pass", result["failures"]
    assert ("te_zero_centered" in result["results"]) == _te_available()


def _fp8_training_worker(steps):
    from megatron_lns.data.blend import builtin_dataset_prefix
    from megatron_lns.data.datasets import build_gpt_datasets, micro_batch_loader
    from megatron_lns.data.tokenizer import ByteTokenizer
    from megatron_lns.runtime import ParallelLayout, init_distributed
    from megatron_lns.training.build import build_trainable
    from megatron_lns.training.optim import OptimSettings
    from megatron_lns.training.step import train_step

    device = init_distributed(ParallelLayout(), device="cuda")
    cfg = tiny_config(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        ffn_hidden_size=512,
        vocab_size=384,
        seq_length=128,
        backend="te",
        precision="bf16",
        fp8="delayed",
        fp8_amax_history_len=16,
    )
    settings = OptimSettings(lr=1e-3, min_lr=1e-4, warmup_steps=20)
    trainable = build_trainable(
        cfg, ParallelLayout(), device, settings, steps, ddp=_ddp_without_overlap()
    )
    model, optimizer, scheduler = trainable.model, trainable.optimizer, trainable.scheduler
    splits = build_gpt_datasets(
        [str(builtin_dataset_prefix("pydoc", "byte", None, None))],
        None,
        "100,0,0",
        128,
        ByteTokenizer(),
        0,
        steps * 16,
        0,
    )
    loader = micro_batch_loader(splits.train, 0, 16, 1, 0)
    losses = []
    for _ in range(steps):
        batch = {k: v.to(device) for k, v in next(loader).items()}
        losses.append(train_step(model, optimizer, [batch]).loss)
        scheduler.step(1)
    return losses


@needs_te
@pytest.mark.skipif(not _fp8_capable(), reason="FP8 needs compute capability >= 8.9")
def test_fp8_training_lowers_the_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_LNS_CACHE", str(tmp_path / "cache"))
    losses = run_distributed(_fp8_training_worker, 1, tmp_path, 300)[0]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20 - 1.0


def _step_time_worker(backend):
    from megatron_lns.runtime import ParallelLayout, init_distributed
    from megatron_lns.training.benchmark import lns_vs_pre_ln

    device = init_distributed(ParallelLayout(), device="cuda")
    base = dict(
        num_layers=8,
        hidden_size=1024,
        num_attention_heads=16,
        ffn_hidden_size=2816,
        vocab_size=32000,
        seq_length=2048,
        precision="bf16",
        backend=backend,
        output_layer_init="normal",
    )
    times = lns_vs_pre_ln(base, device, 2, 2, rounds=7, steps_per_round=5)
    return times["lns"].median / times["pre_ln"].median


@needs_te
def test_te_lns_step_time_within_one_percent_of_pre_ln(tmp_path):
    ratio = run_distributed(_step_time_worker, 1, tmp_path, "te")[0]
    assert ratio < 1.01, ratio


def _offloading_worker():
    """One forward and backward of an fp32 TE model with and without activation
    offloading, from the same weights: the relative loss difference, the largest gradient
    difference relative to the largest gradient, and whether the offloaded model's block
    holds TE's offload context. Offloading copies activations out and back, so the two
    differ by no more than kernel nondeterminism."""
    from megatron_lns.model.language_model import build_model
    from megatron_lns.runtime import ParallelLayout, init_distributed

    device = init_distributed(ParallelLayout(), device="cuda")
    # Transformer Engine offloads tensors of at least 2**20 elements: seq 256 x batch 8 x
    # hidden 512 activations are.
    shape = dict(
        num_layers=4,
        hidden_size=512,
        num_attention_heads=8,
        num_query_groups=8,
        ffn_hidden_size=1024,
        vocab_size=512,
        seq_length=256,
        backend="te",
    )
    plain = build_model(tiny_config(**shape), device=device)[0]
    offloaded = build_model(
        tiny_config(**shape, cpu_offloading=True, cpu_offloading_num_layers=3), device=device
    )[0]
    offloaded.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, shape["vocab_size"], (8, shape["seq_length"]), device=device)
    losses, grads = [], []
    for model in (plain, offloaded):
        loss = _logits(model, tokens).float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad for name, p in model.named_parameters()})
    largest = max(g.abs().max().item() for g in grads[0].values())
    grad_difference = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])
    has_context = offloaded.decoder.config._cpu_offloading_context is not None
    return abs(losses[0] - losses[1]) / abs(losses[0]), grad_difference / largest, has_context


@needs_te
def test_cpu_offloading_gives_the_same_loss_and_gradients(tmp_path):
    loss_difference, grad_difference, has_context = run_distributed(
        _offloading_worker, 1, tmp_path
    )[0]
    assert has_context
    assert loss_difference < 1e-6 and grad_difference < 1e-5
