"""Kept so that Megatron-LM's ``--spec megatron_lns.hybrid_specs <builder>`` still finds the
spec builders, which live in :mod:`megatron_lns.model.hybrid_specs`."""

from megatron_lns.model.hybrid_specs import *  # noqa: F403
