"""The SLURM backend: the sbatch script, the per-task rank environment, submission.

The only package that knows about SLURM. ``megatron-lns submit`` renders
``slurm/sbatch.template`` from the config (:mod:`.render`) and hands it to ``sbatch``
(:mod:`.submit`, through :mod:`.sbatch`: the step every submission shares); inside the
job every ``srun`` task runs :mod:`.task` (through the fixed path
``python -m megatron_lns.launch.task``), which derives the torch.distributed environment
from SLURM's variables (:mod:`.rank_env`) and then trains exactly as
``megatron-lns train`` does. What the trainer learns of the job (its id and requeues, whether
a lock another job left is stale, the time it is given, the batch script's progress
records) is :mod:`.environment`, over :mod:`.job` and :mod:`.progress`.

``megatron-lns preprocess ... --submit`` renders its own script,
``slurm/preprocess.sbatch.template``, from the same ``cluster:`` keys with the same
functions (:mod:`.preprocess_job`).
"""
