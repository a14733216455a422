"""The model: layer specs (LNS and the other variants), norms, Transformer Engine
pieces and the megatron-core models they build."""
