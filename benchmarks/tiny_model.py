"""The demo config's model narrowed until a CPU step takes a fraction of a second: the
overrides the benchmarks that time runs rather than models train with (the tests keep
their own, in tests/helpers.py)."""

TINY_WIDTH = [
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=128",
    "model.encoder_seq_length=32",
    "model.micro_batch_size=2",
    "model.global_batch_size=4",
]
