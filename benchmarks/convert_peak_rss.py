"""Peak resident memory of ``import-hf`` and ``export-hf`` against model size.

Both commands convert one transformer layer at a time, so their peak should grow with
the size of a layer and of the embedding, not with the number of layers. This builds
synthetic ``LlamaForCausalLM`` directories of a few sizes (random fp32 weights written
shard by shard, one safetensors shard per layer, the byte tokenizer: nothing is
trained or downloaded), then runs, each in a fresh interpreter::

    megatron-lns import-hf HF_DIR RUN_DIR       # Hugging Face -> megatron checkpoint
    megatron-lns export-hf RUN_DIR HF_DIR2      # and back

and records the child's peak RSS (``ru_maxrss`` from ``wait4``), its peak virtual size
(``VmPeak``) and its wall time, next to the model's size, one layer's size and the
peak RSS of an idle process that has imported what the commands import::

    PYTHONPATH=. .venv/bin/python benchmarks/convert_peak_rss.py \\
        --output benchmarks/results/convert_peak_rss.json [--baseline REV]

``--baseline REV`` also runs the import of git revision REV (checked out into a
temporary directory, same interpreter) on the same models. ``tests/convert/
test_hf_import.py`` uses :func:`write_synthetic_llama` and :func:`run_cli` to import a
model under an address-space limit smaller than the model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
# (layers, hidden, ffn, heads): the same wide layer, 2, 4 and 8 of them.
SIZES = ((2, 1024, 4096, 8), (4, 1024, 4096, 8), (8, 1024, 4096, 8))

# Runs the CLI in this interpreter, its address space capped first where a limit is
# given (argv[1] > 0), and prints the peak virtual size at the end.
CHILD = """
import os, resource, sys
limit = int(sys.argv[1])
if limit > 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from megatron_lns.cli import main
try:
    code = main(sys.argv[2:])
except MemoryError:
    print("MemoryError", file=sys.stderr)
    code = 3
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(f"VMPEAK_KB:{status['VmPeak'].split()[0]}", file=sys.stderr)
sys.stderr.flush()
os._exit(code)
"""


def write_synthetic_llama(
    path: Path, layers: int, hidden: int, ffn: int, heads: int, seed: int = 0
) -> dict[str, int]:
    """A random fp32 ``LlamaForCausalLM`` directory with the byte tokenizer, written one
    shard (one layer) at a time; returns its sizes in bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from megatron_lns.convert.hf_tokenizer import byte_tokenizer_fast
    from megatron_lns.data.tokenizer import ByteTokenizer

    path.mkdir(parents=True)
    vocab = ByteTokenizer().vocab_size
    LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=ByteTokenizer().eod,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    byte_tokenizer_fast().save_pretrained(path)
    gen = torch.Generator().manual_seed(seed)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    shards: list[dict[str, tuple[int, ...]]] = [
        {"model.embed_tokens.weight": (vocab, hidden)},
        *(
            {
                **{
                    f"model.layers.{i}.{norm}.weight": (hidden,)
                    for norm in ("input_layernorm", "post_attention_layernorm")
                },
                **{f"model.layers.{i}.self_attn.{p}_proj.weight": (hidden, hidden) for p in "qkvo"},
                f"model.layers.{i}.mlp.gate_proj.weight": (ffn, hidden),
                f"model.layers.{i}.mlp.up_proj.weight": (ffn, hidden),
                f"model.layers.{i}.mlp.down_proj.weight": (hidden, ffn),
            }
            for i in range(layers)
        ),
        {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)},
    ]
    weight_map, total = {}, 0
    for n, shapes in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {key: random(*shape) for key, shape in shapes.items()}
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map |= dict.fromkeys(tensors, name)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    layer = 4 * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden)
    return {"model_bytes": total, "layer_bytes": layer, "embedding_bytes": 4 * vocab * hidden}


def _child_env(tree: Path) -> dict[str, str]:
    """The environment of a new top-level launch importing the package from ``tree``.

    A caller started by a launcher (torchrun, a test's rank) has its variables; a child
    inheriting them would try to join that world. (``init_distributed`` writes none.)"""
    from megatron_lns.runtime.launcher_env import LAUNCHER_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(PYTHONPATH=str(tree), MALLOC_ARENA_MAX="2")
    return env


def run_cli(args: list[str], tree: Path = ROOT, limit_as: int | None = None) -> dict:
    """``megatron-lns ARGS`` in a fresh interpreter importing the package from ``tree``,
    its address space (RLIMIT_AS) capped at ``limit_as`` bytes where given. Returns its
    exit code, peak RSS, peak virtual size, wall time and the end of its output."""
    env = _child_env(tree)
    argv = [sys.executable, "-c", CHILD, str(limit_as or 0), *args]
    start = time.perf_counter()
    # cwd=tree: ``python -c`` puts the working directory first on sys.path.
    child = subprocess.Popen(
        argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    tags = dict(line.split(":", 1) for line in output.splitlines() if line.startswith("VMPEAK_KB:"))
    return {
        "returncode": child.returncode,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "vm_peak_bytes": int(tags["VMPEAK_KB"]) * 1024 if "VMPEAK_KB" in tags else None,
        "limit_as_bytes": limit_as,
        "wall_s": round(wall, 2),
        "output_tail": output[-2000:],
    }


def idle_rss(tree: Path = ROOT) -> int:
    """Peak RSS of a process that imports what the commands import and stops."""
    code = (
        "import megatron_lns.cli, megatron_lns.convert.hf_import, megatron_lns.convert.hf_export\n"
        "import transformers, tokenizers\n"
        "from transformers import AutoConfig, PreTrainedTokenizerFast\n"
    )
    env = _child_env(tree)
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=tree, env=env, stderr=subprocess.DEVNULL
    )
    _, _, usage = os.wait4(child.pid, 0)
    return usage.ru_maxrss * 1024


@contextlib.contextmanager
def _checkout(rev: str) -> Iterator[Path]:
    """The package as it was at ``rev``, unpacked into a temporary directory (``git
    archive``: the repository itself is only read)."""
    with tempfile.TemporaryDirectory(prefix="convert-rss-baseline-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp)


def _measure(args: argparse.Namespace, tmp: Path, baseline: Path | None) -> dict:
    rows = []
    for layers, hidden, ffn, heads in SIZES:
        name = f"{layers}x{hidden}x{ffn}"
        hf = tmp / f"hf-{name}"
        sizes = write_synthetic_llama(hf, layers, hidden, ffn, heads)
        row = {"layers": layers, "hidden": hidden, "ffn": ffn, **sizes}
        run = tmp / f"run-{name}"
        row["import"] = run_cli(["import-hf", str(hf), str(run)])
        row["export"] = run_cli(["export-hf", str(run), str(tmp / f"hf2-{name}")])
        if baseline is not None:
            row["import_baseline"] = run_cli(
                ["import-hf", str(hf), str(tmp / f"run-old-{name}")], tree=baseline
            )
        for key in ("import", "export", "import_baseline"):
            if key in row:
                if row[key]["returncode"] != 0:
                    raise SystemExit(f"{key} of {name} failed:\n{row[key]['output_tail']}")
                del row[key]["output_tail"]
        rows.append(row)
        print(json.dumps(_summary(row)), flush=True)
        for path in tmp.iterdir():  # a few hundred MB each: keep one model at a time
            subprocess.run(["rm", "-rf", str(path)], check=True)
    return {"models": rows}


def _summary(row: dict) -> dict:
    out = {
        "model_MiB": round(row["model_bytes"] / MIB),
        "layer_MiB": round(row["layer_bytes"] / MIB),
    }
    for key in ("import", "export", "import_baseline"):
        if key in row:
            out[f"{key}_peak_rss_MiB"] = round(row[key]["peak_rss_bytes"] / MIB)
            out[f"{key}_wall_s"] = row[key]["wall_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--baseline", default=None, help="git revision whose import to run too")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="convert-rss-")))
        baseline = stack.enter_context(_checkout(args.baseline)) if args.baseline else None
        idle = idle_rss()
        result = {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "git_revision": subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
            ).stdout.strip(),
            "baseline_revision": args.baseline,
            "idle_peak_rss_bytes": idle,
            "note": "peak RSS of the child (ru_maxrss); model_bytes = the fp32 safetensors",
            **_measure(args, tmp, baseline),
        }
        result["summary"] = [_summary(row) for row in result["models"]]
        result["summary_idle_peak_rss_MiB"] = round(idle / MIB)
    text = json.dumps(result, indent=2) + "\n"
    if args.output:
        args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
