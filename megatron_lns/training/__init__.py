"""The training loop's building blocks, all megatron-core parts wired together."""
