"""The optimizer's part of a checkpoint: loading it into megatron's distributed optimizer,
and into an optimizer whose parameters are grouped otherwise than the saved one's.
"""

from __future__ import annotations

import functools
from pathlib import Path

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import param_group_identifier_keys

from megatron_lns.training.checkpoint_dirs import CheckpointError

# megatron-core 0.19's distributed optimizer on torch's Adam (no Apex or Transformer
# Engine, as on the CPU) cannot load its own checkpoints; the two functions below are
# the smallest changes that let it, each a no-op where megatron uses a fused Adam.


def _distributed_parts(optimizer) -> list[DistributedOptimizer]:
    """The distributed optimizers of ``optimizer``: itself, or each part of a chained one
    (with experts, dense and expert parameters have one each)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in parts if isinstance(part, DistributedOptimizer)]


def allocate_distributed_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its Adam state before a checkpoint is loaded.

    ``DistributedOptimizer.state_dict``, which building the loading template calls
    first, reads the step count from torch Adam's per-parameter state, which exists only
    after a first step, and asserts that there is one. megatron's own
    ``_init_optimizer_states_with_dummy_values`` (its FSDP loading path) allocates the
    state with a zero-gradient step; the checkpoint then overwrites the state, the step
    count and the weights.
    """
    for part in _distributed_parts(optimizer):
        if part.optimizer is not None and not part.optimizer.state:
            part._init_optimizer_states_with_dummy_values()


# What a param group takes from the checkpoint: its parameters and step count, and what
# the LR scheduler sets at every step from the checkpoint's schedule (resume.py).
FROM_CHECKPOINT = ("params", "step", "lr", "weight_decay")


def load_optimizer_state(optimizer, state_dict: dict) -> None:
    """``optimizer.load_state_dict``, keeping torch Adam's step count out of the copy of
    the parameter states, and giving each parameter its own step count; the run's
    hyperparameters (Adam's betas and eps, SGD's momentum) stay the config's: torch
    copies the saved param groups' over them, and nothing sets them again.

    ``DistributedOptimizer.load_state_dict`` sets every parameter's ``step`` to one and
    the same tensor from the checkpoint, then copies each parameter's state tensors from
    the checkpoint's (``_set_main_param_and_optimizer_states``) by the keys of its own
    state, ``step`` among them, which the checkpoint files under no parameter: a
    ``KeyError``. And torch's Adam increments each parameter's ``step`` in place, so a
    shared one would count every parameter's update and put the bias correction of all
    later steps off.
    """
    parts = _distributed_parts(optimizer)
    for part in parts:
        part._set_main_param_and_optimizer_states = functools.partial(
            _set_states_but_step, part, type(part)._set_main_param_and_optimizer_states
        )
    configured = [
        {key: value for key, value in group.items() if key not in FROM_CHECKPOINT}
        for group in optimizer.param_groups
    ]
    try:
        optimizer.load_state_dict(state_dict)
    finally:
        for part in parts:
            del part._set_main_param_and_optimizer_states
    for group, settings in zip(optimizer.param_groups, configured, strict=True):
        group.update(settings)


def _set_states_but_step(part, set_states, model_param, tensors: dict) -> None:
    group_index, group_order = part.model_param_group_index_map[model_param]
    main_param = part.optimizer.param_groups[group_index]["params"][group_order]
    state = part.optimizer.state[main_param]
    step = state.pop("step") if "step" in state and "step" not in tensors else None
    try:
        set_states(part, model_param, tensors)
    finally:
        if step is not None:
            state["step"] = step.clone()


def parts_of(state) -> list:
    """The per-part states of a (chained) optimizer state: ``{0: ..., 1: ...}`` or one."""
    if isinstance(state, dict) and 0 in state:
        return [state[i] for i in sorted(k for k in state if isinstance(k, int))]
    return [state]


def _regroupable(saved_parts: list, optimizer) -> bool:
    """Whether a state of other parts can be regrouped into ``optimizer``: every part on
    both sides a distributed optimizer, saved ``fully_reshardable`` (no ``chained_``
    prefix, tensors under the parameters' model keys)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return len(_distributed_parts(optimizer)) == len(parts) and all(
        isinstance(part, dict)
        and part.get("param_state_sharding_type") == "fully_reshardable"
        and isinstance(part.get("optimizer"), dict)
        for part in saved_parts
    )


def check_optimizer_parts(path: Path, saved, optimizer) -> None:
    """Refuse a checkpoint whose optimizer state is split into another number of parts,
    unless it can be regrouped (:func:`regroup_optimizer_state`), naming the layouts it
    does load at.

    megatron-core 0.19 gives expert parameters an optimizer of their own exactly when
    their gradients are reduced over the expert groups (``use_expert_pgs``: EP > 1, or
    expert TP other than TP), and a ``ChainedOptimizer`` loads only a state of as many
    parts (``Expected 2 entries``, deep in megatron otherwise). The distributed
    optimizer's parts are saved ``fully_reshardable`` (model space, one tensor per
    parameter, no ``chained_`` prefix), so their tensors load at any part count and only
    the non-tensor state (each part's param groups, step) is regrouped. Any other
    optimizer's state loads only into as many parts. Weights alone load at any layout
    (``load_model_weights``)."""
    saved_list = parts_of(saved)
    saved_parts = len(saved_list)
    parts = len(getattr(optimizer, "chained_optimizers", [optimizer]))
    if saved_parts != parts and not _regroupable(saved_list, optimizer):
        expert_parallel = (
            "model.expert_model_parallel_size > 1 or model.expert_tensor_parallel_size other "
            "than model.tensor_model_parallel_size"
        )
        written = (
            f"with expert parallelism ({expert_parallel})"
            if saved_parts > parts
            else f"without expert parallelism (neither {expert_parallel})"
        )
        raise CheckpointError(
            f"checkpoint {path}: its optimizer state has {saved_parts} part(s), this run's "
            f"optimizer {parts}: megatron-core keeps the experts' optimizer state apart only "
            "with expert parallelism, and loads a state only into as many parts (only the "
            "distributed optimizer's, model.optim.name=distributed_fused_adam on both runs, "
            f"is regrouped). It was written {written}: resume so (any TP, PP, DP, EP and "
            f"expert TP that also {'has' if saved_parts > parts else 'lacks'} it load, "
            "resharded)"
        )


def _group_identity(group: dict) -> tuple:
    """What megatron's ``DistributedOptimizer.load_state_dict`` pairs a saved param group
    with a current one by (``param_group_identifier_keys``, ``pre_`` aliases included),
    less ``is_expert_parallel``, which is the part a group is in, not its settings."""
    return tuple(
        group.get(key, group.get(f"pre_{key}"))
        for key in param_group_identifier_keys
        if key != "is_expert_parallel"
    )


def regroup_optimizer_state(path: Path, loaded, saved, optimizer):
    """A loaded optimizer state of other parts than ``optimizer``'s, as one of its parts.

    ``loaded``: what ``dist_checkpointing.load`` returned under ``optimizer``: the
    checkpoint's non-tensor state (its parts) merged with the tensors of this run's
    template (its parts, each parameter's main weight and Adam moments read by model
    key). ``saved``: the checkpoint's non-tensor optimizer state. Each part of this run
    gets its own tensors and, for each of its param groups, the saved group of the same
    settings (preferably from a part of the same kind: expert or not), marked as this
    part's; the groups carry the step (every part steps together, megatron's
    ``_synchronize_steps``) and the hyperparameters."""
    saved_parts = parts_of(saved)
    current = getattr(optimizer, "chained_optimizers", [optimizer])
    saved_groups = [
        group for part in saved_parts for group in part["optimizer"].get("param_groups", [])
    ]
    regrouped = {}
    for i, part in enumerate(current):
        tensors = (loaded if len(current) == 1 else loaded[i])["param_state"]
        groups = []
        for group in part.optimizer.param_groups:
            expert = group.get("is_expert_parallel")
            same = [g for g in saved_groups if _group_identity(g) == _group_identity(group)]
            if not same:
                raise CheckpointError(
                    f"checkpoint {path}: no optimizer param group of the checkpoint has the "
                    f"settings of this run's {_group_identity(group)} (another optimizer "
                    "setting than the run that wrote it)"
                )
            match = next((g for g in same if g.get("is_expert_parallel") == expert), same[0])
            groups.append({**match, "is_expert_parallel": expert})
        state = {
            **saved_parts[0],
            "optimizer": {**saved_parts[0]["optimizer"], "param_groups": groups},
            "param_state": tensors,
        }
        regrouped[i] = state
    return regrouped[0] if len(current) == 1 else regrouped
