"""Kept so that Megatron-LM's ``--spec megatron_lns.specs <builder>`` still finds the
spec builders, which live in :mod:`megatron_lns.model.specs`."""

from megatron_lns.model.specs import *  # noqa: F403
