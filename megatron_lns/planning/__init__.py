"""``megatron-lns plan``: will a config fit, how fast will it go, what will it cost, before
it queues. Arithmetic only: nothing here imports torch or megatron-core (the config layer
and the torch-free helpers below it are all it needs)."""

from megatron_lns.planning.gpus import DEFAULT_GPU, GPUS, gpu_named
from megatron_lns.planning.plan import Plan, make_plan, plan_text, summary_line
from megatron_lns.planning.vocab import load_for_plan, vocab_size_of

__all__ = [
    "DEFAULT_GPU",
    "GPUS",
    "Plan",
    "gpu_named",
    "load_for_plan",
    "make_plan",
    "plan_text",
    "summary_line",
    "vocab_size_of",
]
