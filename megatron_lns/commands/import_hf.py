"""``megatron-lns import-hf``: Hugging Face model -> run directory for continued pretraining."""

from __future__ import annotations

import argparse

from megatron_lns.commands.arguments import add_out_dir

# The config.json classes import reads, in the order of convert/architectures'
# ARCHITECTURES, which imports torch (that the CLI does not load to parse its arguments);
# tests/convert/test_convert.py holds the two equal.
HF_CLASSES = (
    "LlamaForCausalLM",
    "StableLmForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    imp = commands.add_parser(
        "import-hf", help="Hugging Face model -> run directory for continued pretraining"
    )
    imp.add_argument("hf_dir", help=f"a local {' / '.join(HF_CLASSES)} directory")
    add_out_dir(imp, "the run directory to write (config.yaml, checkpoints/)")
    imp.add_argument("overrides", nargs="*", help="key=value settings of the run config")
    imp.add_argument(
        "--lns", action="store_true", help="the weights carry folded LNS factors (our export)"
    )
    imp.add_argument("--config", default=None, help="base YAML for the non-architecture keys")
    imp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_lns.convert import import_hf

    import_hf(args.hf_dir, args.out_dir, args.overrides, args.lns, args.config, args.overwrite)
    return 0
