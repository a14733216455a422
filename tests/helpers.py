"""Shared test helpers: spawning real gloo process groups, small model configs."""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import torch

from megatron_lns.model.language_model import GPTModelConfig
from megatron_lns.runtime import ParallelLayout, spawn_local
from megatron_lns.runtime.launcher_env import LAUNCHER_VARIABLES


def _run_and_record(fn: Callable[..., Any], out_dir: str, args: tuple) -> None:
    result = fn(*args)
    rank = int(os.environ["RANK"])
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


# The repository, the fixtures (configs, golden files) and the configs tests load.
ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
DEMO_CONFIG = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
# The demo config shrunk to a 4-layer model whose steps take well under a second.
TINY_MODEL_OVERRIDES = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=128",
    "model.encoder_seq_length=32",
    "model.micro_batch_size=2",
    "model.global_batch_size=4",
    "model.data.splits_string=90,10,0",
    "model.optim.sched.warmup_steps=2",
]

# A six-step run of it: validation and a checkpoint every three steps, every loss logged.
TINY_RUN_OVERRIDES = [
    *TINY_MODEL_OVERRIDES,
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=3",
]


# The six-step run on two data-parallel ranks with a checkpoint every two steps: a rank
# failing in step 3 or 4 is restarted from step 2's.
TWO_RANK_RUN_OVERRIDES = [
    *TINY_RUN_OVERRIDES,
    "trainer.devices=2",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
]

# The tiny run as a mixture-of-experts model: experts in layers 2-4 (2 of 4 routed),
# all-to-all dispatch, a load-balancing loss, the distributed optimizer.
TINY_MOE_OVERRIDES = [
    "model.num_moe_experts=4",
    "model.moe_router_topk=2",
    "model.moe_layer_freq=[0,1,1,1]",
    "model.moe_token_dispatcher_type=alltoall",
    "model.moe_aux_loss_coeff=0.01",
    "model.optim.name=distributed_fused_adam",
]


def tiny_run_config(exp_dir, *overrides: str):
    """The validated config of a tiny run writing under ``exp_dir``."""
    from megatron_lns.config import load_config, validate

    cfg = load_config(
        DEMO_CONFIG, [*TINY_RUN_OVERRIDES, f"exp_manager.exp_dir={exp_dir}", *overrides]
    )
    validate(cfg)
    return cfg


def validated_demo_config(*overrides: str):
    """The demo config with ``overrides``, validated (its data files unchecked)."""
    from megatron_lns.config import load_config, validate

    cfg = load_config(DEMO_CONFIG, list(overrides))
    validate(cfg, check_files=False)
    return cfg


def config_error(*overrides: str) -> str:
    """The message of the ``ConfigError`` that ``validated_demo_config(*overrides)``
    raises; every refusal is one line, and this asserts it is."""
    import pytest

    from megatron_lns.config import ConfigError

    with pytest.raises(ConfigError) as info:
        validated_demo_config(*overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def cli_error_of(capsys, *args: str) -> str:
    """The one line ``megatron-lns args...`` prints for a user error (exit status 2)."""
    from megatron_lns.cli import main

    assert main(list(args)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def fit_and_summarize(cfg) -> dict[str, Any]:
    """Train ``cfg`` on this rank: its losses, validation loss, resume point, steps and
    run directory."""
    from megatron_lns.training.trainer import Trainer

    summary = Trainer(cfg).fit()
    return {
        "losses": summary.train_losses,
        "valid": summary.valid_loss,
        "resumed_from": summary.resumed_from,
        "steps": summary.steps,
        "run_dir": summary.run_dir,
    }


def train_tiny_run(exp_dir: Path, *overrides: str) -> dict[str, Any]:
    """Train ``tiny_run_config(exp_dir, *overrides)`` on one fresh rank; its summary."""
    cfg = tiny_run_config(exp_dir, *overrides)
    return run_distributed(fit_and_summarize, 1, Path(exp_dir) / "rank_results", cfg)[0]


def train_on_its_ranks(
    directory: Path, cfg, fit: Callable[[Any], Any] = fit_and_summarize
) -> list[Any]:
    """``fit(cfg)`` on ``cfg.trainer.devices`` fresh ranks (a folder of its own under
    ``directory`` for their results); each rank's result."""
    out = Path(directory) / f"r{time.monotonic_ns()}"
    return run_distributed(fit, cfg.trainer.devices, out, cfg)


def hugging_face_tokenizer_dir(directory: Path) -> Path:
    """A minimal Hugging Face tokenizer directory (``tokenizer.json`` and its config, eos
    ``</s>``), made with the ``tokenizers`` library alone: no transformers, no download."""
    import json

    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "</s>": 1, "a": 2}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return directory


def fresh_launch_env(**extra: str) -> dict[str, str]:
    """The environment of a new top-level launch: no torchrun variables.

    ``init_distributed`` writes none of them (a world of one in-process is made without
    them), but a test running inside a rank (``run_distributed``) or under torchrun has
    its launcher's, and a subprocess inheriting them would try to join that world.
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(extra)
    return env


@contextlib.contextmanager
def killed_on_exit(process: subprocess.Popen):
    """``process`` is killed if it is still running when the block ends (a failed test
    leaves nothing behind)."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_while_running(
    process: subprocess.Popen, ready: Callable[[], bool], within_s: float, what: str
) -> None:
    """Poll ``ready()`` until it holds; fail with ``process``'s stderr if it ended first, or
    saying ``what`` did not happen within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while not ready():
        assert process.poll() is None, process.communicate()[1][-2000:]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def still_running(processes: list[psutil.Process], within_s: float = 10) -> list[psutil.Process]:
    """Those of ``processes`` that have not ended within ``within_s`` seconds (a zombie,
    killed but not yet reaped, has ended)."""
    _, alive = psutil.wait_procs(processes, timeout=within_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def end_by_signal(process: subprocess.Popen, signum: int, within_s: float) -> str:
    """Send ``signum`` to ``process`` and wait for it to end of it; its stderr."""
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=within_s)
    assert process.returncode in (128 + signum, -signum), stderr[-2000:]
    return stderr


# The longest a multi-process test may run: its slowest case takes a few minutes on a
# loaded 2-core CI machine; a hang (ranks waiting on a collective) fails instead of
# stalling CI until its limit.
RANKS_TIMEOUT_S = 1200


def run_distributed(
    fn: Callable[..., Any], world_size: int, tmp_path: Path, *args: Any
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` real processes (gloo); return each rank's result."""
    out_dir = tmp_path / "rank_results"
    out_dir.mkdir(parents=True, exist_ok=True)
    spawn_local(_run_and_record, world_size, fn, str(out_dir), args, timeout_s=RANKS_TIMEOUT_S)
    results = []
    for rank in range(world_size):
        with open(out_dir / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def worker_results(tmp_path_factory, name: str, worker: Callable[[str], Any], world_size: int):
    """``worker(folder)`` on ``world_size`` real processes, ``folder`` a fresh one named
    after ``name`` (for a module-scoped fixture); each rank's result."""
    tmp = tmp_path_factory.mktemp(name)
    return run_distributed(worker, world_size, tmp, str(tmp))


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    """The ``(step, loss)`` of each training step a run logged in its metrics.jsonl."""
    import json

    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


# The tiny model's sizes (settings of the same name in GPTModelConfig and model.*).
TINY_MODEL: dict[str, Any] = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    init_method_std=0.05,
)


def tiny_config(**overrides: Any) -> GPTModelConfig:
    """A 4-layer LLaMA-style model small enough for multi-process CPU tests."""
    values: dict[str, Any] = dict(TINY_MODEL, vocab_size=128, seq_length=16)
    values.update(overrides)
    return GPTModelConfig(**values)


def byte_gpt_datasets(
    prefixes: list,
    split: str = "90,10,0",
    samples: tuple[int, int, int] = (40, 8, 0),
    weights: list[float] | None = None,
    seq_length: int = 32,
    cache=None,
    seed: int = 1,
):
    """megatron's GPT datasets (train, valid, test ``samples``) of byte-tokenized
    ``prefixes``; their index mappings cached in ``cache``."""
    from megatron_lns.data.datasets import build_gpt_datasets
    from megatron_lns.data.tokenizer import ByteTokenizer

    return build_gpt_datasets(
        [str(p) for p in prefixes],
        weights,
        split,
        seq_length,
        ByteTokenizer(),
        seed=seed,
        num_train_samples=samples[0],
        num_valid_samples=samples[1],
        num_test_samples=samples[2],
        cache_dir=None if cache is None else str(cache),
    )


def fixed_microbatches(
    vocab_size: int,
    seq_length: int,
    num_microbatches: int = 2,
    micro_batch_size: int = 2,
    seed: int = 0,
):
    from megatron_lns.training.step import make_batch

    gen = torch.Generator().manual_seed(seed)
    return [
        make_batch(torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=gen))
        for _ in range(num_microbatches)
    ]


def token_inputs(cfg: GPTModelConfig, batch: int = 2, seed: int = 0):
    """Random ``(tokens, positions, targets)`` for one forward of ``cfg``'s model."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=gen)
    positions = torch.arange(cfg.seq_length).unsqueeze(0).expand(batch, -1)
    return tokens, positions, targets


# The tensor-parallel layouts a parallel test compares with TP=1: without and with
# sequence parallelism.
TP2_LAYOUTS = {
    "tp2": ParallelLayout(tensor=2),
    "tp2_sp": ParallelLayout(tensor=2, sequence_parallel=True),
}


def forward_backward_at(
    cfg: GPTModelConfig, layout: ParallelLayout, batches, checkpoint: str | None = None
):
    """On this rank (of ``run_distributed``): ``cfg``'s model at ``layout`` wrapped in
    megatron DDP, loaded from ``checkpoint`` if given, after one forward-backward of
    ``batches``; the model and the loss."""
    from megatron_lns.model.language_model import build_model
    from megatron_lns.runtime import init_distributed
    from megatron_lns.training.build import wrap_with_ddp
    from megatron_lns.training.checkpoint import load_model_weights
    from megatron_lns.training.step import forward_backward

    init_distributed(layout, device="cpu")
    model = wrap_with_ddp(build_model(cfg, layout))
    if checkpoint is not None:
        load_model_weights(model, checkpoint)
    result = forward_backward(model, batches)
    return model, result.loss


def perturb_norm_weights(model: torch.nn.Module, seed: int = 1) -> None:
    """Norm weights start at the identity; perturb them so folding is really exercised."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))


def checkpoint_keys(model: torch.nn.Module) -> dict[str, tuple]:
    """dist_checkpointing keys and global shapes of a model's sharded state dict."""
    return {
        t.key: tuple(t.global_shape)
        for t in model.sharded_state_dict().values()
        if hasattr(t, "global_shape")
    }


@contextlib.contextmanager
def read_only(directory: Path):
    """``directory`` made read-only: by its mode bits, or, for root (whom mode bits do
    not stop), by a read-only bind mount of it onto itself."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)
        return
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@contextlib.contextmanager
def immutable(path: Path):
    """``path`` made immutable (``chattr +i``: not even root may replace it); the test is
    skipped where that cannot be done (no root, no chattr, a filesystem without it)."""
    import shutil

    import pytest

    made = (
        shutil.which("chattr") is not None
        and subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode
        == 0
    )
    if not made:
        pytest.skip("needs root and a filesystem where chattr +i works")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


# Megatron-LM's arguments for what no config here builds (multi-token prediction, latent
# attention and MoE latents, gated or experimental attention, linear-attention layers, a
# layer spec of its own), at the values its argument parser leaves them when unasked for:
# its two counting functions then count nothing for them.
_MEGATRON_FEATURES_NOT_BUILT: dict[str, Any] = {
    "mtp_num_layers": None,
    "multi_latent_attention": False,
    "moe_latent_size": None,
    "attention_output_gate": False,
    "experimental_attention_variant": None,
    "linear_key_head_dim": None,
    "linear_value_head_dim": None,
    "linear_num_key_heads": None,
    "linear_num_value_heads": None,
    "linear_conv_kernel_dim": None,
    "spec": None,
}


def megatron_args(cfg, vocab_size: int) -> SimpleNamespace:
    """Megatron-LM's argument names for the same run (megatron/training/arguments.py), as
    its ``theoretical_memory_usage`` and ``num_floating_point_operations`` read them."""
    from megatron_lns.planning.shape import padded_vocab_size

    m = cfg.model
    world = cfg.trainer.num_nodes * cfg.trainer.devices
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    hybrid = m.architecture == "hybrid" and m.hybrid_layer_pattern
    return SimpleNamespace(
        seq_length=m.encoder_seq_length,
        kv_channels=m.kv_channels or m.hidden_size // m.num_attention_heads,
        num_attention_heads=m.num_attention_heads,
        hidden_size=m.hidden_size,
        # Without GQA megatron takes one query group per head (both functions).
        group_query_attention=m.num_query_groups is not None,
        num_query_groups=m.num_query_groups,
        num_experts=m.num_moe_experts,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_layer_freq=m.moe_layer_freq,  # read only with experts
        num_layers=m.num_layers,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm",
        padded_vocab_size=padded_vocab_size(vocab_size, tp, m.make_vocab_size_divisible_by),
        untie_embeddings_and_output_weights=not m.share_embeddings_and_output_weights,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        swiglu=m.activation == "swiglu",
        moe_router_topk=m.moe_router_topk,
        add_bias_linear=m.bias,
        moe_shared_expert_gate=m.moe_shared_expert_gate,
        hybrid_layer_pattern=m.hybrid_layer_pattern if hybrid else None,
        mamba_state_dim=128,
        mamba_head_dim=64,
        mamba_num_groups=8,
        mamba_num_heads=None,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size or tp,
        expert_model_parallel_size=m.expert_model_parallel_size,
        pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp,
        world_size=world,
        data_parallel_size=world // (tp * pp * m.context_parallel_size),
        use_distributed_optimizer=m.optim.name == "distributed_fused_adam",
        **_MEGATRON_FEATURES_NOT_BUILT,
    )


@contextlib.contextmanager
def small_filesystem(directory: Path, size_kib: int, inodes: int | None = None):
    """``directory`` as a fresh tmpfs of ``size_kib`` KiB (and ``inodes`` files), for
    tests of a full disk; unmounted afterwards. Skips the test where mounting is not
    permitted (not root, or a container without CAP_SYS_ADMIN), except under CI=true."""

    if os.geteuid() != 0:
        _skip_unless_ci("a full-disk test mounts a small tmpfs, which needs root")
    directory.mkdir(parents=True, exist_ok=True)
    options = f"size={size_kib}k" + (f",nr_inodes={inodes}" if inodes else "")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        _skip_unless_ci(f"cannot mount a tmpfs for a full-disk test: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "--lazy", str(directory)], check=True)


def _skip_unless_ci(reason: str) -> None:
    """Skip where the machine cannot do it; fail under CI=true, which runs as root."""
    import pytest

    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


def fill_leaving(directory: Path, free_bytes: int) -> None:
    """Fill the filesystem of ``directory`` until about ``free_bytes`` remain free."""
    stat = os.statvfs(directory)
    fill = stat.f_bavail * stat.f_frsize - free_bytes
    if fill > 0:
        with open(directory / "filler", "wb") as f:
            f.write(b"\0" * fill)


def directory_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


def parameters_per_rank(configs: list, vocab_size: int) -> list[int]:
    """On this rank, the parameters of each config's model as megatron-core builds it
    (a rank of ``run_distributed``)."""
    from megatron_lns.runtime import init_distributed
    from megatron_lns.training.build import build_model_chunks, model_config, parallel_layout

    counts = []
    for cfg in configs:
        layout = parallel_layout(cfg)
        device = init_distributed(layout, device="cpu", seed=1)
        chunks = build_model_chunks(model_config(cfg, vocab_size), layout, device)
        counts.append(sum(p.numel() for chunk in chunks for p in chunk.parameters()))
    return counts


def bundled_config_inputs(path: Path) -> list[str]:
    """Stand-ins for the data and tokenizer a bundled config leaves to the user (``???``)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.load(path)
    overrides = []
    if OmegaConf.is_missing(raw.model.data, "data_prefix"):
        overrides.append("model.data.data_prefix=[/data/corpus_text_document]")
    for key in raw.model.tokenizer.keys():  # noqa: SIM118 - `in` skips ??? values
        if OmegaConf.is_missing(raw.model.tokenizer, key):
            overrides.append(f"model.tokenizer.{key}=/models/tokenizer")
    return overrides
