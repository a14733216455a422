"""GPU check for one machine with one GPU: one command, a few minutes, one results file.

    python benchmarks/gpu_check.py [--output-dir benchmarks/results]
    python benchmarks/gpu_check.py --cpu-smoke     # tiny shapes on CPU: the harness, not numbers

Runs from a checkout (no install needed) with PyTorch + CUDA, megatron-core and the
small dependencies; Transformer Engine is optional: without it the TE parts are
recorded as skipped with the reason (docs/te.md says how to set up a machine without
a package index).

1. ``te_vs_local``: the same bf16 weights in the TE LNS model and the local LNS model
   (RMSNorm, LayerNorm, zero-centred LayerNorm): logits and every gradient agree within
   ``LOGITS_RTOL`` / ``GRADS_RTOL`` (relative L2 error). Negative control on the same
   weights: TE LNS vs TE Pre-LN must differ by at least ``CONTROL_FACTOR`` times the
   tolerance, or the agreement proves nothing.
2. ``zero_centered_gamma``: the scale the norm kernel applies at layer 64 in bf16
   (``s*(1+g)``, ``g ~ N(0, 0.02)``), measured through the module with a +-1 input, is
   within bf16's rounding of a plain gamma (2^-8, relative), local and TE.
3. ``throughput``: an OLMo-7B-shaped model (hidden 4096, 32 heads, SwiGLU 11008, vocab
   50304, seq 2048, parameter-free LayerNorm) with as many layers as fit (at most OLMo's
   32) and the largest micro batch that then fits, found by probing peak memory. LNS and
   Pre-LN are the same model with the factors switched on and off, timed in alternating
   rounds. Tokens/s, model TFLOP/s, MFU against the GPU's dense BF16 peak, LNS / Pre-LN,
   for local bf16, TE bf16 and TE FP8 (delayed scaling) where available.

Writes ``gpu_check_<machine>.json`` and ``.md``. Exit status 0 when every check that
ran passed (skips allowed), 1 when one failed, 2 without CUDA unless ``--cpu-smoke``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from megatron_lns.model.language_model import GPTModelConfig, build_model  # noqa: E402
from megatron_lns.model.layer import LNSTransformerLayer  # noqa: E402
from megatron_lns.model.scaling import fold_scale_into_gamma, lns_factor  # noqa: E402
from megatron_lns.runtime import ParallelLayout, init_distributed  # noqa: E402

# bf16 keeps 8 significant bits: rounding to nearest is within 2^-8 relative.
BF16_ROUNDING = 2.0**-8
# TE vs local in bf16, relative L2 errors. Both are bf16 computations of the same
# function with differently rounding kernels (fused norm, cuBLAS, flash attention vs
# PyTorch ops), so each is about as far from fp32 as bf16 is, and from each other up to
# about twice that. Every run reports that distance for the local model (``bf16_noise``);
# on CPU, for the 8-layer shapes below (``--cpu-smoke --full-agreement-shapes``), it was
# 0.013-0.016 (logits), 0.016-0.020 (all gradients), <= 0.046 (worst tensor, a norm bias).
LOGITS_RTOL = 0.03
GRADS_RTOL = 0.04
WORST_GRAD_RTOL = 0.10
# The control must differ by at least this many tolerances.
CONTROL_FACTOR = 10.0
DEEP_LAYER = 64

# Dense (no sparsity) BF16 tensor-core peak per GPU, TFLOP/s, from NVIDIA's datasheets
# (their sparsity figures halved). First match on the device name wins.
DENSE_BF16_PEAK_TFLOPS = (
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.05),
)

OLMO_7B_SHAPE = dict(
    hidden_size=4096,
    num_attention_heads=32,
    ffn_hidden_size=11008,
    vocab_size=50304,
    seq_length=2048,
    normalization="LayerNorm",
    norm_affine=False,
    activation="swiglu",
    output_layer_init="normal",
)
OLMO_7B_LAYERS = 32
SMOKE_SHAPE = dict(
    OLMO_7B_SHAPE,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=172,
    vocab_size=256,
    seq_length=64,
)


def te_status() -> tuple[bool, str]:
    """(available, reason when not)."""
    from megatron_lns.model.te import te_available

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not te_available():
        return False, "Transformer Engine is not installed"
    return True, ""


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)


# --- 1. TE vs local, with a negative control -------------------------------------------


def agreement_config(normalization: str, zero_centered: bool, small: bool) -> GPTModelConfig:
    shape = dict(
        num_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        ffn_hidden_size=1408,
        vocab_size=1024,
        seq_length=256,
    )
    if small:
        shape = dict(
            num_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            ffn_hidden_size=128,
            vocab_size=128,
            seq_length=32,
        )
    return GPTModelConfig(
        **shape,
        normalization=normalization,
        layernorm_zero_centered_gamma=zero_centered,
        precision="bf16",
        init_method_std=0.05,
    )


def logits_and_grads(
    cfg: GPTModelConfig, state: dict, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and parameter gradients (cross-entropy on ``targets``) of ``cfg`` with ``state``."""
    from megatron_lns.model.language_model import unwrap
    from megatron_lns.training.build import build_model_chunks

    wrapped = build_model_chunks(cfg, device=tokens.device)[0]
    model = unwrap(wrapped)
    result = model.load_state_dict(state, strict=False)
    stray = [
        k for k in result.missing_keys + result.unexpected_keys if not k.endswith("_extra_state")
    ]
    if stray:
        raise RuntimeError(f"state does not fit the {cfg.backend} model: {stray}")
    logits = wrapped(tokens, _positions(tokens), None).float()
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def relative_differences(
    reference: tuple[torch.Tensor, dict], candidate: tuple[torch.Tensor, dict]
) -> dict:
    """Relative L2 differences of logits, of all gradients together, and the worst tensor."""
    ref_logits, ref_grads = reference
    logits, grads = candidate
    if set(grads) != set(ref_grads):
        raise RuntimeError(f"gradient sets differ: {sorted(set(grads) ^ set(ref_grads))}")
    diff_sq = sum(float((grads[n] - g).square().sum()) for n, g in ref_grads.items())
    norm_sq = sum(float(g.square().sum()) for g in ref_grads.values())
    per_tensor = {
        n: float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items()
    }
    worst = max(per_tensor, key=per_tensor.get)
    return {
        "logits": float((logits - ref_logits).norm() / ref_logits.norm()),
        "grads": math.sqrt(diff_sq / norm_sq),
        "worst_grad": per_tensor[worst],
        "worst_grad_name": worst,
    }


def check_te_vs_local(device: torch.device, smoke: bool, small: bool | None = None) -> dict:
    """TE LNS vs local LNS on the same weights, and TE LNS vs TE Pre-LN as the control.

    In ``--cpu-smoke`` (no TE) the local backend stands in for TE, which exercises the
    harness only; the status then says ``smoke``.
    """
    from megatron_lns.model.specs import local_to_fused_state_dict

    has_te, reason = te_status()
    if not has_te and not smoke:
        return {"status": "skip", "reason": reason}
    candidate = "te" if has_te else "local"
    tolerance = {"logits": LOGITS_RTOL, "grads": GRADS_RTOL, "worst_grad": WORST_GRAD_RTOL}
    cases, failures = {}, []
    for normalization, zero_centered in (
        ("RMSNorm", False),
        ("LayerNorm", False),
        ("LayerNorm", True),
    ):
        name = normalization + ("_zero_centered" if zero_centered else "")
        cfg = agreement_config(normalization, zero_centered, smoke if small is None else small)
        torch.manual_seed(0)
        local = build_model(cfg, device=device)[0]
        with torch.no_grad():  # norms away from the identity, so folding matters
            for param_name, param in local.named_parameters():
                if "layernorm" in param_name:
                    param.add_(0.2 * torch.randn_like(param))
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in local.state_dict().items()}
        del local
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen).to(device)
        targets = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen).to(device)
        other = GPTModelConfig(**{**cfg.to_dict(), "backend": candidate})
        other_pre_ln = GPTModelConfig(**{**other.to_dict(), "norm_scaling": "none"})
        other_state = local_to_fused_state_dict(state) if candidate == "te" else state
        reference = logits_and_grads(cfg, state, tokens, targets)
        if candidate == "te":
            reference = (reference[0], local_to_fused_state_dict(reference[1]))
        lns = logits_and_grads(other, other_state, tokens, targets)
        pre_ln = logits_and_grads(other_pre_ln, other_state, tokens, targets)
        fp32 = GPTModelConfig(**{**cfg.to_dict(), "precision": "fp32"})
        exact = logits_and_grads(
            fp32,
            {k: v.float() if torch.is_tensor(v) else v for k, v in state.items()},
            tokens,
            targets,
        )
        if candidate == "te":
            exact = (exact[0], local_to_fused_state_dict(exact[1]))
        agreement = relative_differences(reference, lns)
        control = relative_differences(lns, pre_ln)
        # For judging the bounds: how far bf16 is from fp32 on the same weights (local).
        bf16_noise = relative_differences(exact, reference)
        cases[name] = {"agreement": agreement, "control": control, "bf16_noise": bf16_noise}
        for key, bound in tolerance.items():
            if agreement[key] > bound:
                failures.append(
                    f"{name}: {candidate} vs local {key} {agreement[key]:.3g} > {bound}"
                )
        for key in ("logits", "grads"):
            if control[key] < CONTROL_FACTOR * tolerance[key]:
                failures.append(
                    f"{name}: control {key} {control[key]:.3g} < "
                    f"{CONTROL_FACTOR:g} x {tolerance[key]}"
                )
    status = "smoke" if candidate == "local" else ("fail" if failures else "pass")
    return {
        "status": status,
        "candidate": candidate,
        "tolerance": tolerance,
        "control_factor": CONTROL_FACTOR,
        "cases": cases,
        "failures": failures,
    }


# --- 2. zero-centred gamma at a deep layer in bf16 -------------------------------------


def _norm_module(backend: str, zero_centered: bool, hidden: int, device: torch.device):
    """The module applying a pre-norm, bf16 parameters; TE's has an identity GEMM."""
    cfg = GPTModelConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        vocab_size=128,
        seq_length=16,
        normalization="RMSNorm",
        layernorm_zero_centered_gamma=zero_centered,
        precision="bf16",
    )
    tf = cfg.transformer_config()
    if backend == "local":
        from megatron_lns.model.norms import LocalNorm

        return LocalNorm(tf, hidden).to(device), "weight"
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

    from megatron_lns.model.fused_norm import with_norm_scaling

    module = with_norm_scaling(TELayerNormColumnParallelLinear)(
        hidden,
        hidden,
        config=tf,
        init_method=torch.nn.init.zeros_,
        gather_output=False,
        bias=False,
        skip_bias_add=False,
        is_expert=False,
        tp_comm_buffer_name="qkv",
    ).to(device)
    with torch.no_grad():
        module.weight.copy_(torch.eye(hidden))  # the GEMM passes the norm output through
    return module, "layer_norm_weight"


def effective_scale_error(backend: str, zero_centered: bool, device: torch.device) -> dict:
    """Worst relative error of the scale the kernel applies, against ``s*(1+g)`` exactly."""
    hidden, scale = 256, lns_factor(DEEP_LAYER)
    module, weight_name = _norm_module(backend, zero_centered, hidden, device)
    g = 0.02 * torch.randn(hidden, generator=torch.Generator().manual_seed(3))
    weight = getattr(module, weight_name)
    with torch.no_grad():
        weight.copy_(g if zero_centered else 1 + g)
    module.output_scale = scale
    x = torch.tensor([1.0, -1.0] * (hidden // 2), dtype=torch.bfloat16, device=device)
    x = x.expand(16, 1, hidden).contiguous()  # [sequence, batch, hidden]; x_hat = +-1
    with torch.no_grad():
        out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    effective = (out.double() * x.double()).cpu()
    stored = weight.detach().double().cpu()
    exact = scale * (1 + stored if zero_centered else stored)
    error = float(((effective - exact) / exact).abs().max())
    # What the kernel would apply had the factor been folded as s*g + (s-1) (TE casts to
    # bf16 before adding 1): the defect this check guards against, for scale.
    folded = fold_scale_into_gamma(stored.float(), scale, zero_centered).to(torch.bfloat16)
    folded_effective = folded.double() + 1 if zero_centered else folded.double()
    folded_error = float(((folded_effective - exact) / exact).abs().max())
    return {"max_relative_error": error, "folded_form_error": folded_error}


def check_zero_centered_gamma(device: torch.device, smoke: bool) -> dict:
    has_te, reason = te_status()
    backends = ["local"] + (["te"] if has_te else [])
    results, failures = {}, []
    for backend in backends:
        for zero_centered in (True, False):
            name = f"{backend}_{'zero_centered' if zero_centered else 'plain'}"
            results[name] = effective_scale_error(backend, zero_centered, device)
            if results[name]["max_relative_error"] > BF16_ROUNDING + 1e-5:
                failures.append(f"{name}: {results[name]['max_relative_error']:.4g} > 2^-8")
    report = {
        "status": "fail" if failures else ("smoke" if smoke else "pass"),
        "layer": DEEP_LAYER,
        "bound": BF16_ROUNDING,
        "results": results,
        "failures": failures,
    }
    if not has_te:
        report["te_skipped"] = reason
    return report


# --- 3. throughput ---------------------------------------------------------------------


def set_norm_scaling(model: list[torch.nn.Module], norm_scaling: str) -> None:
    """Switch every layer between LNS and Pre-LN in place (the factor is a plain float)."""
    for chunk in model:
        for layer in chunk.modules():
            if isinstance(layer, LNSTransformerLayer):
                layer.norm_scaling = norm_scaling
                for owner in layer.pre_norm_owners():
                    owner.output_scale = layer.norm_output_scale


def _batches(cfg: GPTModelConfig, micro_batch: int, count: int, device: torch.device):
    from megatron_lns.training.step import make_batch

    gen = torch.Generator().manual_seed(0)
    return [
        {
            k: v.to(device)
            for k, v in make_batch(
                torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length + 1), generator=gen)
            ).items()
        }
        for _ in range(count)
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _peak_memory(cfg: GPTModelConfig, micro_batch: int, device: torch.device) -> int:
    """Peak bytes of two training steps (optimizer state included) of ``cfg``."""
    from megatron_lns.training.benchmark import trainable_for_timing
    from megatron_lns.training.step import train_step

    _release(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    trainable = trainable_for_timing(cfg, ParallelLayout(), device)
    model, optimizer = trainable.model, trainable.optimizer
    batches = _batches(cfg, micro_batch, 1, device)
    for _ in range(2):
        train_step(model, optimizer, batches)
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del trainable, model, optimizer, batches
    _release(device)
    return peak


def fit_layers_and_micro_batch(base: dict, device: torch.device, max_layers: int) -> dict:
    """Layers and micro batch that fit 90% of free memory, from four probe runs.

    Peak memory is modelled as ``base + a*L + b*L*mb + c*mb`` (``a``: a layer's
    parameters, gradients and optimizer state; ``b``: its activations per sample; ``c``:
    embedding/logit activations per sample), measured at L in {2, 4}, mb in {1, 2}.
    Layers come first (up to ``max_layers``), then the largest micro batch.
    """
    peaks = {
        (layers, mb): _peak_memory(GPTModelConfig(num_layers=layers, **base), mb, device)
        for layers in (2, 4)
        for mb in (1, 2)
    }
    b = max(0.0, (peaks[4, 2] - peaks[4, 1] - peaks[2, 2] + peaks[2, 1]) / 2)
    a = (peaks[4, 1] - peaks[2, 1]) / 2 - b
    c = max(0.0, peaks[2, 2] - peaks[2, 1] - 2 * b)
    fixed = peaks[2, 1] - 2 * a - 2 * b - c
    if a <= 0:
        raise RuntimeError(f"memory probes gave no per-layer growth: {peaks}")
    _release(device)
    budget = 0.9 * torch.cuda.mem_get_info(device)[0]
    layers = min(max_layers, int((budget - fixed - c) // (a + b)))
    micro_batch = max(1, int((budget - fixed - a * layers) // (b * layers + c))) if layers else 0
    return {
        "layers": layers,
        "micro_batch": micro_batch,
        "budget_gib": budget / 2**30,
        "model_gib": {
            "fixed": fixed / 2**30,
            "per_layer": a / 2**30,
            "per_layer_per_sample": b / 2**30,
            "per_sample": c / 2**30,
        },
        "probe_peaks_gib": {f"L{k[0]}_mb{k[1]}": v / 2**30 for k, v in peaks.items()},
    }


def time_lns_vs_pre_ln(
    cfg: GPTModelConfig,
    micro_batch: int,
    num_microbatches: int,
    device: torch.device,
    warmup: int,
    rounds: int,
    steps_per_round: int,
) -> dict:
    """Median step times of one model with LNS on and off, in alternating rounds."""
    from megatron_lns.training.benchmark import trainable_for_timing
    from megatron_lns.training.step import train_step

    trainable = trainable_for_timing(cfg, ParallelLayout(), device)
    model, optimizer = trainable.model, trainable.optimizer
    batches = _batches(cfg, micro_batch, num_microbatches, device)
    seconds: dict[str, list[float]] = {"lns": [], "pre_ln": []}
    losses = []
    modes = {"lns": "lns", "pre_ln": "none"}
    for name in modes:
        set_norm_scaling(model, modes[name])
        for _ in range(warmup):
            losses.append(train_step(model, optimizer, batches).loss)
    for round_index in range(rounds):
        order = list(modes) if round_index % 2 == 0 else list(reversed(modes))
        for name in order:
            set_norm_scaling(model, modes[name])
            for _ in range(steps_per_round):
                _sync(device)
                start = time.perf_counter()
                losses.append(train_step(model, optimizer, batches).loss)
                _sync(device)
                seconds[name].append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del trainable, model, optimizer, batches
    _release(device)
    return {
        "seconds": seconds,
        "losses_finite": all(map(math.isfinite, losses)),
        "peak_memory_gib": peak,
    }


def dense_bf16_peak_tflops(
    device: torch.device, override: float | None
) -> tuple[float | None, str]:
    if override:
        return override, "--peak-tflops"
    if device.type != "cuda":
        return None, "no datasheet peak for a CPU"
    name = torch.cuda.get_device_name(device)
    for key, peak in DENSE_BF16_PEAK_TFLOPS:
        if key in name:
            return peak, f"NVIDIA datasheet, dense BF16 ({key})"
    return None, f"no datasheet peak known for {name}; pass --peak-tflops"


def measure_setting(backend: str, fp8: str | None, device: torch.device, args) -> dict:
    shape = SMOKE_SHAPE if args.cpu_smoke else OLMO_7B_SHAPE
    base = dict(shape, backend=backend, fp8=fp8, precision="bf16")
    if args.cpu_smoke:
        fit = {"layers": 2, "micro_batch": 1, "note": "fixed in --cpu-smoke"}
    elif args.layers and args.micro_batch:
        fit = {"layers": args.layers, "micro_batch": args.micro_batch, "note": "given"}
    else:
        fit = fit_layers_and_micro_batch(base, device, args.layers or OLMO_7B_LAYERS)
    layers, micro_batch = fit["layers"], fit["micro_batch"]
    if layers < 1:
        return {"status": "skip", "reason": "not even one layer fits", "fit": fit}
    attempts = []
    while True:
        cfg = GPTModelConfig(num_layers=layers, **base)
        try:
            timing = time_lns_vs_pre_ln(
                cfg,
                micro_batch,
                args.num_microbatches,
                device,
                args.warmup,
                args.rounds,
                args.steps_per_round,
            )
            break
        except torch.OutOfMemoryError:
            attempts.append({"layers": layers, "micro_batch": micro_batch, "error": "OOM"})
            _release(device)
            if micro_batch > 1:
                micro_batch -= 1
            elif layers > 2 and len(attempts) < 4:
                layers -= 2
            else:
                return {"status": "fail", "reason": "out of memory", "attempts": attempts}
    tokens_per_step = micro_batch * args.num_microbatches * cfg.seq_length
    peak, peak_source = dense_bf16_peak_tflops(device, args.peak_tflops)
    flops_per_token = cfg.flops_per_token()
    result = {
        "status": "pass" if timing["losses_finite"] else "fail",
        "layers": layers,
        "micro_batch": micro_batch,
        "num_microbatches": args.num_microbatches,
        "fit": fit,
        "oom_retries": attempts,
        "peak_memory_gib": timing["peak_memory_gib"],
        "losses_finite": timing["losses_finite"],
        "dense_bf16_peak_tflops": peak,
        "peak_source": peak_source,
        "model_flops_per_token": flops_per_token,
    }
    for name, samples in timing["seconds"].items():
        median = statistics.median(samples)
        tokens_per_second = tokens_per_step / median
        tflops = tokens_per_second * flops_per_token / 1e12
        result[name] = {
            "median_step_s": median,
            "step_s": samples,
            "tokens_per_s_per_gpu": tokens_per_second,
            "model_tflops_per_gpu": tflops,
            "mfu": tflops / peak if peak else None,
        }
    result["lns_over_pre_ln_step_time"] = (
        result["lns"]["median_step_s"] / result["pre_ln"]["median_step_s"]
    )
    if args.cpu_smoke:
        result["status"] = "smoke"
    return result


def check_throughput(device: torch.device, args) -> dict:
    has_te, reason = te_status()
    settings: dict[str, dict] = {}
    fp8_capable = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    for name, backend, fp8, available, why in (
        ("local_bf16", "local", None, True, ""),
        ("te_bf16", "te", None, has_te, reason),
        (
            "te_fp8_delayed",
            "te",
            "delayed",
            has_te and fp8_capable,
            reason or "FP8 needs compute capability >= 8.9",
        ),
    ):
        if not available:
            settings[name] = {"status": "skip", "reason": why}
            continue
        print(f"throughput: {name} ...", flush=True)
        try:
            settings[name] = measure_setting(backend, fp8, device, args)
        except Exception as error:  # record and go on: the other settings still count
            settings[name] = {
                "status": "fail",
                "reason": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc(),
            }
    return settings


# --- report ----------------------------------------------------------------------------


def machine_description(device: torch.device) -> dict:
    import megatron.core

    info = {
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": getattr(megatron.core, "__version__", "unknown"),
        "transformer_engine": None,
    }
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["compute_capability"] = f"{capability[0]}.{capability[1]}"
        info["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    else:
        info["gpu"] = None
    if te_status()[0]:
        import transformer_engine

        info["transformer_engine"] = getattr(transformer_engine, "__version__", "unknown")
    return info


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# GPU check: {m['gpu'] or 'CPU smoke (harness only)'} on {m['host']}",
        "",
        f"torch {m['torch']}, CUDA {m['cuda']}, megatron-core {m['megatron_core']}, "
        f"Transformer Engine {m['transformer_engine'] or 'not installed'}; "
        f"`{report['command']}`",
        "",
        "## TE vs local (same bf16 weights; relative L2 errors)",
        "",
    ]
    agreement = report["te_vs_local"]
    if agreement["status"] == "skip":
        lines.append(f"skipped: {agreement['reason']}")
    else:
        tol = agreement["tolerance"]
        lines += [
            f"status **{agreement['status']}**; bounds: logits {tol['logits']}, gradients "
            f"{tol['grads']} (worst tensor {tol['worst_grad']}); the control must exceed "
            f"{agreement['control_factor']:g}x the bound",
            "",
            "| case | logits | gradients | worst tensor | control logits | control gradients |",
            "|---|---|---|---|---|---|",
        ]
        for name, case in agreement["cases"].items():
            a, c = case["agreement"], case["control"]
            lines.append(
                f"| {name} | {a['logits']:.2e} | {a['grads']:.2e} | {a['worst_grad']:.2e} "
                f"(`{a['worst_grad_name']}`) | {c['logits']:.2e} | {c['grads']:.2e} |"
            )
    zc = report["zero_centered_gamma"]
    lines += [
        "",
        f"## Effective norm scale at layer {zc['layer']} in bf16 (bound 2^-8 = {zc['bound']:.4f})",
        "",
        f"status **{zc['status']}**"
        + (f"; TE skipped: {zc['te_skipped']}" if "te_skipped" in zc else ""),
        "",
        "| module | max relative error | folded s*g+(s-1) would give |",
        "|---|---|---|",
    ]
    for name, r in zc["results"].items():
        lines.append(f"| {name} | {r['max_relative_error']:.2e} | {r['folded_form_error']:.2e} |")
    lines += [
        "",
        "## Throughput, OLMo-7B shape (LNS and Pre-LN on the same model, alternating rounds)",
        "",
        "| setting | layers | micro batch x count | tokens/s/GPU (LNS) | model TFLOP/s (LNS) "
        "| MFU (LNS) | tokens/s/GPU (Pre-LN) | LNS / Pre-LN step time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["throughput"].items():
        if "lns" not in s:
            lines.append(f"| {name} | {s['status']}: {s.get('reason', '')} |||||||")
            continue
        lns, pre = s["lns"], s["pre_ln"]
        mfu = f"{lns['mfu']:.1%}" if lns["mfu"] is not None else "n/a"
        lines.append(
            f"| {name} | {s['layers']} | {s['micro_batch']} x {s['num_microbatches']} "
            f"| {lns['tokens_per_s_per_gpu']:.0f} | {lns['model_tflops_per_gpu']:.1f} | {mfu} "
            f"| {pre['tokens_per_s_per_gpu']:.0f} | {s['lns_over_pre_ln_step_time']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--output-dir", help="default: benchmarks/results (a temporary folder with --cpu-smoke)"
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes on CPU: exercises the harness; its numbers mean nothing",
    )
    parser.add_argument(
        "--full-agreement-shapes",
        action="store_true",
        help="with --cpu-smoke: the GPU run's 8-layer shapes for part 1 (bf16 noise, control)",
    )
    parser.add_argument("--layers", type=int, default=None, help="at most this many layers")
    parser.add_argument(
        "--micro-batch", type=int, default=None, help="with --layers: skip the memory probe"
    )
    parser.add_argument("--num-microbatches", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps-per-round", type=int, default=None)
    parser.add_argument(
        "--peak-tflops", type=float, help="dense BF16 peak of this GPU if not in the table"
    )
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    defaults = (1, 1, 1, 1) if args.cpu_smoke else (4, 3, 4, 3)
    for key, default in zip(
        ("num_microbatches", "warmup", "rounds", "steps_per_round"), defaults, strict=True
    ):
        if getattr(args, key) is None:
            setattr(args, key, default)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("error: no CUDA device; this check needs a GPU (or use --cpu-smoke)", file=sys.stderr)
        return 2
    if args.output_dir is None:
        args.output_dir = (
            tempfile.mkdtemp(prefix="gpu_check_smoke_")
            if args.cpu_smoke
            else str(ROOT / "benchmarks" / "results")
        )

    started = time.time()
    device = init_distributed(ParallelLayout(), device="cpu" if args.cpu_smoke else "cuda")
    report = {
        "command": "python benchmarks/gpu_check.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine_description(device),
    }
    print("te_vs_local ...", flush=True)
    report["te_vs_local"] = check_te_vs_local(
        device, args.cpu_smoke, small=args.cpu_smoke and not args.full_agreement_shapes
    )
    print("zero_centered_gamma ...", flush=True)
    report["zero_centered_gamma"] = check_zero_centered_gamma(device, args.cpu_smoke)
    report["throughput"] = {} if args.skip_throughput else check_throughput(device, args)
    report["wall_seconds"] = time.time() - started

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    machine = report["machine"]["gpu"] or "cpu_smoke"
    stem = "gpu_check_" + "".join(c if c.isalnum() else "_" for c in machine)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (out / f"{stem}.md").write_text(text)
    print(text)
    print(f"wrote {out / stem}.json and .md in {report['wall_seconds']:.0f}s")
    statuses = [report["te_vs_local"]["status"], report["zero_centered_gamma"]["status"]]
    statuses += [s["status"] for s in report["throughput"].values()]
    return 1 if "fail" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
