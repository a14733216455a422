"""Cluster backends: how ``megatron-lns submit`` hands a training run to a scheduler.

One subpackage per backend; SLURM (:mod:`.slurm`) is the only one.
"""
