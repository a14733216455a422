"""The module path SLURM batch scripts run: ``python -m megatron_lns.launch.task``.

Every ``job.sbatch`` that ``megatron-lns submit`` writes names this path, and a written
script runs again long after submission (each requeue; ``sbatch job.sbatch`` by hand),
so the path stays fixed wherever the code lives: in :mod:`megatron_lns.cluster.slurm`.
"""
