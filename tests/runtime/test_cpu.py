"""The CPU compatibility layer: what it maps, that it stays off on CUDA, and that
megatron's optimizer (with gradient clipping) works through it."""

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import fixed_microbatches, tiny_config

from megatron_lns.model.language_model import build_model
from megatron_lns.runtime.cpu import CpuRNGStatesTracker, CudaToCpuMode
from megatron_lns.training.build import wrap_with_ddp
from megatron_lns.training.optim import OptimSettings, build_optimizer_and_scheduler
from megatron_lns.training.step import forward_backward, train_step


def test_mode_maps_cuda_placements_to_cpu():
    with CudaToCpuMode():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(2, device=0).device.type == "cpu"
        x = torch.ones(2)
        assert x.cuda() is x
        assert x.to("cuda").device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert x.type(torch.float64).dtype == torch.float64


def test_rng_tracker_forks_named_cpu_states():
    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    torch.manual_seed(0)
    outer_before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer_before)
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the named state advanced
    replay = CpuRNGStatesTracker()
    replay.add("model-parallel-rng", 7)
    with replay.fork():
        assert torch.equal(torch.rand(3), a)
    with pytest.raises(ValueError, match="seed 7 already exists"):
        tracker.add("other", 7)


def test_compat_layer_stays_off_when_cuda_is_available():
    script = textwrap.dedent(
        """
        import torch
        original = torch.cuda.current_device
        torch.cuda.is_available = lambda: True
        torch.cuda.set_device = lambda index: None
        from megatron_lns.runtime import cpu_compat_installed, resolve_device
        assert resolve_device("auto").type == "cuda"
        assert not cpu_compat_installed()
        assert torch.cuda.current_device is original
        assert torch.overrides._get_current_function_mode_stack() == []
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_explicit_cuda_without_cuda_is_a_clear_error(monkeypatch):
    from megatron_lns.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        resolve_device("cuda")


def _params(model):
    return [p for chunk in model for p in chunk.module.parameters()]


def test_optimizer_step_clips_gradients_to_max_norm(seeded):
    cfg = tiny_config()
    model = wrap_with_ddp(build_model(cfg))
    clip, lr = 1e-3, 0.5
    settings = OptimSettings(name="sgd", lr=lr, min_lr=lr, clip_grad=clip, decay_style="constant")
    optimizer, _ = build_optimizer_and_scheduler(model, settings, total_steps=10)
    before = [p.detach().clone() for p in _params(model)]
    result = train_step(model, optimizer, fixed_microbatches(cfg.vocab_size, cfg.seq_length))
    assert result.update_successful
    assert result.grad_norm > 100 * clip  # clipping is active
    update = torch.cat(
        [(b - p.detach()).flatten() for b, p in zip(before, _params(model), strict=True)]
    )
    # SGD without momentum: the update is lr * clipped gradient, whose norm is the clip value.
    assert update.norm().item() == pytest.approx(lr * clip, rel=1e-3)


def test_reported_grad_norm_is_the_unclipped_global_norm(seeded):
    cfg = tiny_config()
    model = wrap_with_ddp(build_model(cfg))
    settings = OptimSettings(name="sgd", lr=0.0, min_lr=0.0, clip_grad=1e-6, decay_style="constant")
    optimizer, _ = build_optimizer_and_scheduler(model, settings, total_steps=10)
    batches = fixed_microbatches(cfg.vocab_size, cfg.seq_length)
    result = train_step(model, optimizer, batches)
    # Recompute the gradient norm with plain autograd on an unwrapped copy.
    fresh = build_model(cfg)[0]
    fresh.load_state_dict(model[0].module.state_dict())
    for batch in batches:
        loss = fresh(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
        (loss / len(batches)).backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in fresh.parameters())).item()
    assert result.grad_norm == pytest.approx(norm, rel=1e-4)


def test_forward_only_records_no_autograd_graph(seeded):
    cfg = tiny_config()
    model = wrap_with_ddp(build_model(cfg))
    grad_modes = []
    model[0].module.register_forward_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    batches = fixed_microbatches(cfg.vocab_size, cfg.seq_length)
    forward_only = forward_backward(model, batches, forward_only=True)
    assert grad_modes == [False, False]
    training = forward_backward(model, batches)
    assert grad_modes[2:] == [True, True]
    assert forward_only.loss == pytest.approx(training.loss, rel=1e-6)


def test_warmup_not_shorter_than_decay_is_a_clear_error(seeded):
    model = wrap_with_ddp(build_model(tiny_config()))
    with pytest.raises(ValueError, match=r"warmup_steps \(10\) must be smaller"):
        build_optimizer_and_scheduler(model, OptimSettings(warmup_steps=10), total_steps=10)
