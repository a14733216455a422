"""Checkpoint commit protocol and refusal of partial, corrupt or mismatched checkpoints."""

import shutil

import pytest
from helpers import fixed_microbatches, tiny_config

from megatron_lns.base.disk import DiskFullError
from megatron_lns.model.language_model import build_model
from megatron_lns.training.build import wrap_with_ddp
from megatron_lns.training.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    TrainingState,
    latest_complete_checkpoint,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
    save_model_weights,
)
from megatron_lns.training.checkpoint_io import extra_state_may_differ, key_filter
from megatron_lns.training.optim import OptimSettings, build_optimizer_and_scheduler
from megatron_lns.training.step import train_step


def _setup(**overrides):
    cfg = tiny_config(**overrides)
    model = wrap_with_ddp(build_model(cfg))
    optimizer, scheduler = build_optimizer_and_scheduler(model, OptimSettings(warmup_steps=1), 10)
    return cfg, model, optimizer, scheduler


def test_save_commits_atomically_and_latest_skips_partial(seeded, tmp_path):
    cfg, model, optimizer, scheduler = _setup()
    train_step(model, optimizer, fixed_microbatches(cfg.vocab_size, cfg.seq_length))
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainingState(1, 4), "a: 1\n")
    assert path.name == "iter_0000001"
    assert (path / "complete.json").is_file() and (path / "config.yaml").read_text() == "a: 1\n"
    # A later save that died before its commit: a .partial directory, never chosen.
    partial = tmp_path / "iter_0000002.partial"
    shutil.copytree(path, partial)
    (partial / "complete.json").unlink()
    # A complete-looking directory without the marker is not chosen either.
    unmarked = tmp_path / "iter_0000003"
    shutil.copytree(path, unmarked)
    (unmarked / "complete.json").unlink()
    assert latest_complete_checkpoint(tmp_path) == path
    with pytest.raises(CheckpointError, match="iter_0000003 is not a complete checkpoint"):
        load_checkpoint(unmarked, model, optimizer, scheduler)
    state = load_checkpoint(path, model, optimizer, scheduler)
    assert (state.iteration, state.consumed_samples) == (1, 4)


def test_an_sgd_run_resumes(seeded, tmp_path):
    """megatron-core gives SGD no state-making function, which loading calls: every resume
    of an sgd run ended in a TypeError traceback."""
    cfg = tiny_config()
    model = wrap_with_ddp(build_model(cfg))
    sgd = OptimSettings(name="sgd", warmup_steps=1)
    optimizer, scheduler = build_optimizer_and_scheduler(model, sgd, 10)
    train_step(model, optimizer, fixed_microbatches(cfg.vocab_size, cfg.seq_length))
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainingState(1, 4), "a: 1\n")
    state = load_checkpoint(path, model, optimizer, scheduler)
    assert (state.iteration, state.consumed_samples) == (1, 4)


def test_a_resume_on_cpu_warns_nothing_of_torchs_sharded_tensor(seeded, tmp_path):
    """torch deprecates the ShardedTensor megatron's checkpoints load through; on CPU the
    warning names the CUDA-to-CPU redirect as its caller, which every process quiets."""
    import warnings

    from megatron_lns.base.third_party_noise import quiet_third_party_noise

    cfg, model, optimizer, scheduler = _setup()
    train_step(model, optimizer, fixed_microbatches(cfg.vocab_size, cfg.seq_length))
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainingState(1, 4), "")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what pytest's own filters would hide
        quiet_third_party_noise()
        load_checkpoint(path, model, optimizer, scheduler)
    shown = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught]
    assert [w for w in shown if "ShardedTensor" in w or "FutureWarning" in w] == []


def test_corrupt_checkpoint_is_a_clear_error(seeded, tmp_path):
    _, model, optimizer, scheduler = _setup()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainingState(1, 4), "")
    for shard in path.glob("*.distcp"):
        shard.write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match=f"could not load checkpoint {path}"):
        load_checkpoint(path, model, optimizer, scheduler)


def test_checkpoint_of_another_shape_is_refused_not_partially_loaded(seeded, tmp_path):
    small = build_model(tiny_config(vocab_size=128))
    save_model_weights(small, tmp_path / "w")
    with pytest.raises(
        CheckpointError,
        match=r"'embedding.word_embeddings.weight' has shape \(128, 64\), this model expects \(256, 64\)",
    ):
        load_model_weights(build_model(tiny_config(vocab_size=256)), tmp_path / "w")


def test_not_a_checkpoint(seeded, tmp_path):
    with pytest.raises(CheckpointError, match="is not a megatron distributed checkpoint"):
        load_model_weights(build_model(tiny_config()), tmp_path)
    assert latest_complete_checkpoint(tmp_path / "missing") is None


def test_a_tensor_the_checkpoint_lacks_or_holds_in_excess_is_an_error_naming_it(seeded, tmp_path):
    save_model_weights(build_model(tiny_config(qk_layernorm=True)), tmp_path / "qk")
    save_model_weights(build_model(tiny_config()), tmp_path / "plain")
    key = r"'decoder\.layers\.self_attention\.[kq]_layernorm\.weight' and 1 more"
    with pytest.raises(CheckpointMismatchError, match=key + " that the checkpoint holds and this"):
        load_model_weights(build_model(tiny_config()), tmp_path / "qk")
    with pytest.raises(CheckpointMismatchError, match=key + " that this model has and the check"):
        load_model_weights(build_model(tiny_config(qk_layernorm=True)), tmp_path / "plain")


@pytest.mark.parametrize("saved, loaded", [(True, False), (False, True)])
def test_a_full_checkpoint_is_loaded_strictly_too(seeded, tmp_path, saved, loaded):
    cfg, model, optimizer, scheduler = _setup(qk_layernorm=saved)
    train_step(model, optimizer, fixed_microbatches(cfg.vocab_size, cfg.seq_length))
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainingState(1, 4), "")
    _, model, optimizer, scheduler = _setup(qk_layernorm=loaded)
    side = "the checkpoint holds" if saved else "this model has"
    key = r"'decoder\.layers\.self_attention\.[kq]_layernorm\.weight' and \d+ more"
    with pytest.raises(CheckpointMismatchError, match=f"{key} that {side}") as err:
        load_checkpoint(path, model, optimizer, scheduler)
    assert "\n" not in str(err.value)


def test_only_extra_state_may_differ_and_only_when_the_backend_changed():
    same = key_filter(extra_state_may_differ=False)
    changed = key_filter(extra_state_may_differ=True, also=("rng_state",))
    key = "decoder.layers.self_attention.linear_qkv._extra_state"
    assert not same(key) and changed(key) and changed("rng_state")
    assert not changed("decoder.layers.self_attention.linear_qkv.weight")
    record = {"provenance": {"backend": "te"}}
    model = build_model(tiny_config())
    assert extra_state_may_differ(record, model)
    assert not extra_state_may_differ({"provenance": {"backend": "local"}}, model)
    assert extra_state_may_differ({}, model)  # written before the backend was recorded


def test_a_save_onto_a_full_disk_is_one_line_and_leaves_the_last_checkpoint(
    seeded, tmp_path, capfd
):
    """A synchronous save that the disk cannot hold: one line naming the checkpoint and
    the space, its partial files removed, the previous checkpoint still the newest."""
    from helpers import directory_bytes, fill_leaving, small_filesystem

    from megatron_lns.training.checkpoint_writer import CheckpointWriter

    cfg, model, optimizer, scheduler = _setup()
    train_step(model, optimizer, fixed_microbatches(cfg.vocab_size, cfg.seq_length))
    with small_filesystem(tmp_path / "disk", 4096) as disk:
        writer = CheckpointWriter(disk / "checkpoints")
        first = writer.save(model, optimizer, scheduler, TrainingState(1, 4), "a: 1\n")
        fill_leaving(disk, directory_bytes(first) // 2)
        with pytest.raises(DiskFullError) as info:
            writer.save(model, optimizer, scheduler, TrainingState(2, 8), "a: 1\n")
        message = str(info.value)
        assert message.startswith(
            f"cannot write {disk / 'checkpoints' / 'iter_0000002'}: no space left on device ("
        )
        assert message.endswith(
            "needed); iter_0000002.partial removed, a rerun resumes from iter_0000001 once "
            "space is freed"
        )
        assert "\n" not in message and "Errno" not in capfd.readouterr().err
        assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["iter_0000001"]
        assert latest_complete_checkpoint(disk / "checkpoints") == first
        assert load_checkpoint(first, model, optimizer, scheduler).iteration == 1


def _start_a_save_at_step_5(root: str, out_dir: str) -> None:
    """On each rank of a world of two: start a save whose directory only rank 0 makes;
    record what each rank raised."""
    import os
    from pathlib import Path

    import torch.distributed as dist

    from megatron_lns.training.checkpoint_io import prepare_partial

    dist.init_process_group("gloo")
    try:
        prepare_partial(root, 5)
        outcome = "saved"
    except DiskFullError as err:
        outcome = str(err)
    (Path(out_dir) / f"rank{os.environ['RANK']}").write_text(outcome)


@pytest.mark.slow  # two fresh ranks: about 20 s on a loaded 2-core machine
def test_a_write_only_rank_0_makes_fails_on_every_rank_not_in_a_collective(tmp_path):
    """Rank 0 alone creates ``iter_N.partial`` (and commits): when the disk refuses it,
    every rank raises the same error instead of waiting for rank 0 in a barrier."""
    from helpers import small_filesystem

    from megatron_lns.runtime import spawn_local

    with small_filesystem(tmp_path / "disk", 64, inodes=3) as disk:
        (disk / "checkpoints").mkdir()
        (disk / "filler").touch()  # the last inode
        spawn_local(_start_a_save_at_step_5, 2, str(disk / "checkpoints"), str(tmp_path),
                    timeout_s=300)  # fmt: skip
        outcomes = {(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)}
        partial = disk / "checkpoints" / "iter_0000005.partial"
        [outcome] = outcomes  # the same on both ranks
        assert outcome.startswith(f"cannot write {partial}: no space left on device (")


def _save_with_rank_0s_file_on_a_full_disk(
    disk: str, file: str, asynchronous: bool, out_dir: str
) -> None:
    """On each rank of a world of two: a save whose ``file``, which megatron's rank 0
    writes alone between two collectives, finds the disk full (filled just before)."""
    import os
    from pathlib import Path

    from helpers import fill_leaving
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    from megatron_lns.runtime import ParallelLayout, init_distributed
    from megatron_lns.training.checkpoint_writer import CheckpointWriter

    init_distributed(ParallelLayout(), device="cpu")
    cfg, model, optimizer, scheduler = _setup()
    train_step(model, optimizer, fixed_microbatches(cfg.vocab_size, cfg.seq_length))
    if os.environ["RANK"] == "0":
        owner, name = {
            ".metadata": (FileSystemWriterAsync, "finish"),
            "metadata.json": (serialization, "save_config"),
        }[file]
        write = getattr(owner, name)

        def onto_a_full_disk(*args, **kwargs):
            fill_leaving(Path(disk), 0)
            return write(*args, **kwargs)

        setattr(owner, name, onto_a_full_disk)
    writer = CheckpointWriter(Path(disk) / "checkpoints", asynchronous)
    try:
        writer.save(model, optimizer, scheduler, TrainingState(1, 4), "")
        writer.wait()  # an asynchronous save is committed here
        outcome = "saved"
    except DiskFullError as err:
        outcome = str(err)
    finally:
        writer.close()
    (Path(out_dir) / f"rank{os.environ['RANK']}").write_text(outcome)


@pytest.mark.slow  # two fresh ranks with a model: about 30 s on a loaded 2-core machine
@pytest.mark.parametrize(
    "file, asynchronous", [(".metadata", False), ("metadata.json", False), (".metadata", True)]
)
def test_a_file_only_rank_0_writes_of_a_save_fails_it_on_every_rank(tmp_path, file, asynchronous):
    """torch's ``.metadata`` and megatron's ``metadata.json`` are written by rank 0 alone
    between two collectives: when the disk refuses one, every rank ends the save with the
    same line instead of the others waiting for rank 0; nothing of it is left."""
    from helpers import small_filesystem

    from megatron_lns.runtime import spawn_local

    with small_filesystem(tmp_path / "disk", 8192) as disk:
        spawn_local(_save_with_rank_0s_file_on_a_full_disk, 2, str(disk), file, asynchronous,
                    str(tmp_path), timeout_s=240)  # fmt: skip
        outcomes = {(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)}
        [outcome] = outcomes  # the same on both ranks
        assert outcome.startswith(
            f"cannot write {disk / 'checkpoints' / 'iter_0000001'}: no space left on device ("
        )
        assert outcome.endswith(
            "; iter_0000001.partial removed, a rerun starts afresh once space is freed"
        )
        assert list((disk / "checkpoints").iterdir()) == []


@pytest.mark.parametrize(("saved", "parts"), [(2, 1), (1, 2)])
def test_an_optimizer_state_of_other_parts_names_the_layouts_that_load_it(saved, parts):
    """megatron-core chains the experts' optimizer apart with expert parallelism only (EP
    > 1, or expert TP other than TP); the refusal says which layouts do load the state."""
    from types import SimpleNamespace

    from megatron_lns.training.checkpoint import CheckpointError
    from megatron_lns.training.checkpoint_optimizer import check_optimizer_parts

    state = {i: {} for i in range(saved)} if saved > 1 else {"optimizer": {}}
    optimizer = SimpleNamespace(chained_optimizers=[object()] * parts)
    with pytest.raises(CheckpointError) as refused:
        check_optimizer_parts("ckpt", state, optimizer)
    message = str(refused.value)
    assert "\n" not in message
    assert f"its optimizer state has {saved} part(s), this run's optimizer {parts}" in message
    written = "with expert parallelism (" if saved > 1 else "without expert parallelism ("
    assert written in message
    assert "model.expert_model_parallel_size > 1 or model.expert_tensor_parallel_size" in message
    assert message.endswith(f"that also {'has' if saved > 1 else 'lacks'} it load, resharded)")
    check_optimizer_parts("ckpt", state, SimpleNamespace(chained_optimizers=[0] * saved))


def test_a_distributed_optimizer_state_of_other_parts_is_regrouped_by_group_settings():
    """Each param group of this run takes the saved group of its settings, preferably from
    a part of its kind (expert or not), marked as its own; a group of settings the
    checkpoint lacks is refused, naming them."""
    from types import SimpleNamespace

    from megatron_lns.training.checkpoint import CheckpointError
    from megatron_lns.training.checkpoint_optimizer import regroup_optimizer_state

    def group(expert, **settings):
        return {"is_expert_parallel": expert, "lr_mult": 1.0, "max_lr": 1e-3, **settings}

    def part(*groups):
        return SimpleNamespace(optimizer=SimpleNamespace(param_groups=list(groups)))

    saved = {
        i: {
            "optimizer": {"param_groups": [group(bool(i), step=3, lr=0.5 + i)]},
            "param_state_sharding_type": "fully_reshardable",
        }
        for i in range(2)
    }
    into_one = {**saved, "param_state": {0: "tensors"}}
    one = SimpleNamespace(chained_optimizers=[part(group(False, params=[0]))])
    state = regroup_optimizer_state("ckpt", into_one, saved, one)
    assert state["param_state"] == {0: "tensors"}
    assert state["param_state_sharding_type"] == "fully_reshardable"
    assert state["optimizer"]["param_groups"] == [group(False, step=3, lr=0.5)]

    two = SimpleNamespace(chained_optimizers=[part(group(False)), part(group(True))])
    loaded = {**saved[0], 0: {"param_state": "dense"}, 1: {"param_state": "experts"}}
    state = regroup_optimizer_state("ckpt", loaded, saved[0], two)
    assert [state[i]["param_state"] for i in range(2)] == ["dense", "experts"]
    assert [state[i]["optimizer"]["param_groups"] for i in range(2)] == [
        [group(False, step=3, lr=0.5)],
        [group(True, step=3, lr=0.5)],
    ]

    other = SimpleNamespace(chained_optimizers=[part(group(False, max_lr=2e-3))])
    with pytest.raises(CheckpointError, match="no optimizer param group of the checkpoint"):
        regroup_optimizer_state("ckpt", into_one, saved, other)
