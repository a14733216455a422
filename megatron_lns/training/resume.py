"""Which checkpoint a run resumes from, and what may change when it does.

* ``exp_manager.resume_from_checkpoint`` names one; otherwise, with
  ``exp_manager.resume_if_exists``, the newest complete one under ``checkpoints/``.
  A run asked for the checkpoint an earlier run of this directory already started a
  branch from continues that branch once it has saved (``rewind.py``): a requeue of the
  same command does not rewind again.
* A checkpoint that cannot be read stops the run with its name and the reason, or,
  with ``exp_manager.resume_past_unreadable``, is skipped for the next older one.
* The LR schedule and weight decay are part of the checkpoint (megatron's
  ``OptimizerParamScheduler`` state). A config whose schedule differs (``lr``,
  ``min_lr``, warmup, decay style, ``max_steps``, ``weight_decay``) is refused before
  anything is loaded, naming the keys, unless ``exp_manager.override_opt_param_scheduler``
  (Megatron-LM's ``--override-opt_param-scheduler``) says to continue with the new
  schedule from the checkpoint's step.
* A checkpoint records the identity of the data it was trained on; a resume on other
  token files under the same ``model.data.data_prefix`` entry is refused before anything
  is loaded, naming the prefix, unless ``exp_manager.resume_with_changed_data``
  (``data_change.py``).
* A save that was started but never committed (the run was killed while writing it:
  ``scancel`` past KillWait, a SIGKILL, a node failure) leaves ``iter_N.partial``; the
  next run says so and which complete checkpoint it resumes from instead
  (:func:`interrupted_save_note`), since the killed run could not.
* A resume from a checkpoint older than others of the run (a rewind) moves the newer
  ones aside before the new branch writes anything (``rewind.py``, the trainer).
* ``model.architecture`` may change from ``gpt`` to ``hybrid``: a GPT run continues in its
  hybrid twin (weights, optimizer state, schedule, data position), the way megatron-core
  moves GPT runs to ``HybridModel``; a hybrid checkpoint resumes only in the hybrid model
  with the same sublayers (``checkpoint.py``).
* A setting whose declaration says what a resume does with another value (the ``resume``
  fact, ``config/settings.py``) is compared with the checkpoint's ``config.yaml`` before
  anything is loaded (``resume_settings.py``): another model (``num_attention_heads``,
  whose tensors may fit all the same) or another optimizer state (``model.optim.name``,
  ``trainer.precision``) is refused naming the keys, and is not skipped for an older
  checkpoint: it is readable. Another sequence length or seed is refused as changed data
  is, unless ``exp_manager.resume_with_changed_data``.
* What else changed since the checkpoint was written (package versions, the config's
  model and trainer sections, the parallel layout) is reported in one line, not refused
  (:func:`changes_since_checkpoint`, ``provenance.py``). A checkpoint whose tensors do not
  fit the model is refused, and not skipped for an older one: it is readable, the model
  differs; the refusal names the model keys that changed (those declared ``shapes=True``,
  ``config.settings.shaping_keys``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_lns.config import ExperimentConfig
from megatron_lns.config.settings import (
    MODEL_TARGETS,
    OPTIMIZER_TARGETS,
    RESUME_DATA,
    RESUME_MODEL,
    RESUME_OPTIMIZER,
    declared_settings,
    shaping_keys,
)
from megatron_lns.training import provenance
from megatron_lns.training.checkpoint import (
    ArchitectureMismatchError,
    CheckpointError,
    CheckpointMismatchError,
    TrainingState,
    checkpoint_problem,
    complete_checkpoints,
    layout_record,
    load_checkpoint,
    load_strategy,
)
from megatron_lns.training.checkpoint_dirs import is_checkpoint_dir
from megatron_lns.training.checkpoint_io import read_common_state
from megatron_lns.training.data_change import (
    OVERRIDE_KEY,
    DataChangedError,
    DataInUse,
    check_data,
    data_record,
)
from megatron_lns.training.resume_settings import SavedSettings
from megatron_lns.training.rewind import branch_to_continue

# megatron scheduler state -> the config keys that set it.
SCHEDULE_KEYS = {
    "max_lr": "model.optim.lr",
    "min_lr": "model.optim.sched.min_lr",
    "lr_warmup_steps": "model.optim.sched.warmup_steps",
    "lr_decay_steps": "trainer.max_steps - model.optim.sched.constant_steps",
    "lr_decay_style": "model.optim.sched.name",
    "start_wd": "model.optim.weight_decay",
    "end_wd": "model.optim.weight_decay",
    "wd_incr_steps": "trainer.max_steps - model.optim.sched.constant_steps",
}


_PARTIAL_DIR = re.compile(r"^iter_(\d{7})\.partial$")


def interrupted_save_note(checkpoint_dir: Path, resumed_path: Path | None) -> str | None:
    """One line when a save newer than the checkpoint this run resumes from was started
    and never completed (a ``.partial`` directory a killed run left); None otherwise."""
    if not checkpoint_dir.is_dir():
        return None
    resumed_step = -1
    if resumed_path is not None and (match := re.search(r"iter_(\d+)$", resumed_path.name)):
        resumed_step = int(match.group(1))
    unfinished = [
        int(match.group(1))
        for entry in checkpoint_dir.iterdir()
        if (match := _PARTIAL_DIR.match(entry.name)) and int(match.group(1)) > resumed_step
    ]
    if not unfinished:
        return None
    killed = f"iter_{max(unfinished):07d}"
    since = (
        f"resuming from {resumed_path.name}, the newest complete checkpoint"
        if resumed_path is not None
        else "starting from scratch: there is no complete checkpoint"
    )
    return (
        f"the previous run was killed while saving {killed} (left as {killed}.partial, "
        f"never loaded); {since}"
    )


class ScheduleChangedError(CheckpointError):
    """The config's LR schedule differs from the one the checkpoint was trained with."""


def checkpoints_to_try(cfg: ExperimentConfig, checkpoint_dir: Path) -> list[Path]:
    """Candidates in order of preference; empty for a fresh start."""
    em = cfg.exp_manager
    if em.resume_from_checkpoint:
        path = Path(em.resume_from_checkpoint)
        if problem := checkpoint_problem(path):
            if path.is_dir() and not is_checkpoint_dir(path):  # a run directory, say
                raise CheckpointError(
                    f"exp_manager.resume_from_checkpoint: {path} {problem}{_run_hint(path)}"
                )
            raise CheckpointError(
                f"exp_manager.resume_from_checkpoint: {path} is not a complete checkpoint "
                f"(an iter_NNNNNNN directory with complete.json): it {problem}"
            )
        branch = branch_to_continue(checkpoint_dir, path, complete_checkpoints(checkpoint_dir))
        if branch:
            return [*branch, path] if em.resume_past_unreadable else branch[:1]
        return [path]
    if not em.resume_if_exists:
        return []
    found = complete_checkpoints(checkpoint_dir)
    return found if em.resume_past_unreadable else found[:1]


# What a run refused an unreadable checkpoint says (unless it was asked to pass over them).
_PAST_UNREADABLE_HINT = (
    "; set exp_manager.resume_past_unreadable=true to resume from the newest one before it "
    "(this one is then moved aside, kept)"
)


def _run_hint(holder: Path) -> str:
    """How to resume the run whose directory, or ``checkpoints/``, ``holder`` is."""
    run = holder.parent if holder.name == "checkpoints" else holder
    if not (run / "checkpoints").is_dir():
        return ""
    return (
        "; or, to resume that run from its newest checkpoint, leave "
        f"exp_manager.resume_from_checkpoint unset and give exp_manager.exp_dir={run.parent} "
        f"exp_manager.name={run.name}"
    )


def _common_state(path: Path) -> dict:
    """The checkpoint's common state, read once: its scheduler state (none in a
    weights-only checkpoint, import-hf's) is compared before anything is loaded, and
    :func:`load_checkpoint` takes it from here."""
    if problem := checkpoint_problem(path):
        raise CheckpointError(f"checkpoint {path} {problem}")
    return read_common_state(path)


def schedule_changes(saved: dict | None, scheduler: OptimizerParamScheduler) -> list[str]:
    """``key: old -> new`` for every schedule setting that differs from the checkpoint's."""
    if saved is None:
        return []
    current = scheduler.state_dict()
    changes = {}
    for field, key in SCHEDULE_KEYS.items():
        if field in saved and saved[field] != current[field]:
            changes.setdefault(key, f"{key}: {saved[field]} -> {current[field]} ({field})")
    return list(changes.values())


def resume(
    cfg: ExperimentConfig,
    checkpoint_dir: Path,
    model: list,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    data: Sequence[DataInUse] = (),
    say: Callable[[str], None] = print,
) -> tuple[TrainingState, Path | None]:
    """Load the checkpoint this run resumes from; a fresh state when there is none. The
    state records ``data``, the data this run reads (``data_change.py``); ``say`` prints
    the line of a data change that the config allows."""
    candidates = checkpoints_to_try(cfg, checkpoint_dir)
    override = cfg.exp_manager.override_opt_param_scheduler
    for index, path in enumerate(candidates):
        try:
            common = _common_state(path)
            saved = common.get("scheduler")
            # Each change the override allows is said: the token files' and the settings'.
            data_notes = [check_data(path, data, cfg.exp_manager.resume_with_changed_data)]
            settings = SavedSettings.read(path, cfg)
            data_notes.append(_check_settings(path, settings, saved is None))
            changes = schedule_changes(saved, scheduler)
            if changes and not override:
                raise ScheduleChangedError(
                    f"checkpoint {path} was trained with another LR schedule ("
                    + "; ".join(changes)
                    + "): restore those values, or set "
                    "exp_manager.override_opt_param_scheduler=true to continue with the new "
                    "schedule from the checkpoint's step"
                )
            scheduler.override_opt_param_scheduler = override
            # megatron matches saved optimizer param groups by their LR bounds, so the
            # template must carry the checkpoint's until the state is in.
            if saved is not None:
                _set_param_group_lr_bounds(optimizer, saved["max_lr"], saved["min_lr"])
            try:
                state = load_checkpoint(
                    path,
                    model,
                    optimizer,
                    scheduler,
                    load_strategy(cfg.model.dist_ckpt_parallel_load),
                    common,
                )
            except CheckpointError as err:
                raise named_by_config_keys(err, path, cfg, settings) from err
        except CheckpointError as err:
            if isinstance(err, (ScheduleChangedError, CheckpointMismatchError, DataChangedError)):
                raise
            if index + 1 == len(candidates):
                if cfg.exp_manager.resume_past_unreadable:
                    raise
                raise CheckpointError(f"{err}{_PAST_UNREADABLE_HINT}") from err
            print(f"warning: skipping unreadable checkpoint: {err}", flush=True)
            continue
        _set_param_group_lr_bounds(optimizer, scheduler.max_lr, scheduler.min_lr)
        scheduler.step(increment=0)  # the LR of the resumed step under this schedule
        for note in filter(None, data_notes):
            say(note)
        state.data = data_record(data)
        return state, path
    return TrainingState(data=data_record(data)), None


def _another_model(path: Path, changes: list[str]) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"checkpoint {path} was written by another model ({'; '.join(changes)}): a run "
        "resumes with the model it trained; restore those values, or start a new run "
        "(another exp_manager.name)"
    )


def _check_settings(path: Path, settings: SavedSettings, weights_only: bool) -> str | None:
    """Refuse a resume from ``path`` with another model, optimizer state, or (without the
    override) sequence length or seed (``resume_settings.py``); the line that says the
    samples changed where the override allows it. A weights-only checkpoint (import-hf)
    holds no optimizer state and no data position: only its model counts."""
    if changes := settings.changed(RESUME_MODEL):
        raise _another_model(path, changes)
    if weights_only:
        return None
    if changes := settings.changed(RESUME_OPTIMIZER):
        raise CheckpointMismatchError(
            f"checkpoint {path} was written with another optimizer state ({'; '.join(changes)})"
            ": its Adam moments, fp32 main weights and param groups load only into the "
            "optimizer that wrote them; restore those values, or start a new run (another "
            "exp_manager.name)"
        )
    changes = settings.changed(RESUME_DATA)
    if not changes:
        return None
    changed = "; ".join(changes)
    if settings.cfg.exp_manager.resume_with_changed_data:
        return (
            f"the samples changed since checkpoint {path.name} ({changed}); training "
            f"continues on the samples they give ({OVERRIDE_KEY}=true)"
        )
    raise DataChangedError(
        f"checkpoint {path} was written with other samples ({changed}): the sequence length "
        "cuts the samples and the seed orders them, so the run would not read what it would "
        f"have read after this step; restore those values, or set {OVERRIDE_KEY}=true to "
        "continue training on the samples they give"
    )


def named_by_config_keys(
    err: CheckpointError, path: Path, cfg: ExperimentConfig, settings: SavedSettings | None = None
) -> CheckpointError:
    """A checkpoint that did not load, named by the keys that shape parameters and changed
    since it was written, when any did: megatron's error names its tensors (a kilobyte of
    them for a changed layer_variant), not the key. Failing that, by the config keys that
    changed, if any did, and so not skipped as unreadable. ``err`` as it is otherwise, and
    when it names the setting to change already (another architecture). ``settings``:
    the checkpoint's and ``cfg``'s, where the resume has read them already."""
    if isinstance(err, ArchitectureMismatchError):
        return err
    if settings is None:
        settings = SavedSettings.read(path, cfg)
    if changes := settings.changed_values(shaping_keys(type(cfg))):
        return _another_model(path, changes)
    built = [
        item.key
        for item in declared_settings(type(cfg))
        if item.setting.target_class in MODEL_TARGETS + OPTIMIZER_TARGETS
    ]
    if changes := settings.changed_values(built):
        # Not skipped as unreadable: it may load under the settings it was written with.
        return CheckpointMismatchError(
            f"{err}; it was written with other settings of the model or optimizer "
            f"({'; '.join(changes)}): restore those values to resume from it"
        )
    return err


def _set_param_group_lr_bounds(optimizer: MegatronOptimizer, max_lr: float, min_lr: float) -> None:
    for group in optimizer.param_groups:
        if "max_lr" in group:
            group["max_lr"] = max_lr
        if "min_lr" in group:
            group["min_lr"] = min_lr


def changes_since_checkpoint(path: Path, config_yaml: str) -> str | None:
    """One line on what differs between the run that wrote ``path`` and this one (run
    config ``config_yaml``, this process's packages and layout); None when nothing does."""
    common = dist_checkpointing.load_common_state_dict(str(path))
    return provenance.changes_since(path, common, config_yaml, layout_record())
