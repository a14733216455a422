"""LayerNorm Scaling (LNS) for megatron-core pretraining.

LNS multiplies the output of both pre-norms of transformer block ``l`` (global,
1-based) by ``1/sqrt(l)``; the final norm is never scaled. See docs/design.md.
"""

__version__ = "0.1.0"
