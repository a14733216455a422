"""What a checkpoint records about the run that wrote it, and what a resume reports."""

import torch
from helpers import fixed_microbatches, tiny_config
from megatron.core import dist_checkpointing

from megatron_lns.model.language_model import build_model
from megatron_lns.training import checkpoint, provenance
from megatron_lns.training.build import wrap_with_ddp
from megatron_lns.training.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from megatron_lns.training.optim import OptimSettings, build_optimizer_and_scheduler
from megatron_lns.training.resume import changes_since_checkpoint
from megatron_lns.training.step import train_step

CONFIG = "name: a\nmodel:\n  optim:\n    lr: 0.001\n  seed: 1\ntrainer:\n  max_steps: 10\n"


def _save(directory, config_yaml=CONFIG):
    model = wrap_with_ddp(build_model(tiny_config()))
    optimizer, scheduler = build_optimizer_and_scheduler(model, OptimSettings(warmup_steps=1), 10)
    train_step(model, optimizer, fixed_microbatches(128, 16))  # gives Adam its state
    path = save_checkpoint(directory, model, optimizer, scheduler, TrainingState(1, 4), config_yaml)
    return path, model, optimizer, scheduler


def test_a_checkpoint_records_versions_backend_and_config_hash(seeded, tmp_path):
    path, *_ = _save(tmp_path)
    record = provenance.saved_provenance(dist_checkpointing.load_common_state_dict(str(path)))
    assert record["versions"] == provenance.package_versions()
    assert set(record["versions"]) == {
        "megatron-lns",
        "megatron-core",
        "torch",
        "transformer-engine",
    }
    assert "+" not in record["versions"]["megatron-core"]  # no git commit of the venv's tree
    assert record["backend"] == "local"
    assert record["config_hash"] == provenance.config_hash(CONFIG)
    assert record["config_hash_covers"] == ["model", "trainer"]
    # Same config, same packages, same layout: nothing to report.
    assert changes_since_checkpoint(path, CONFIG) is None


def test_the_config_hash_covers_model_and_trainer_only():
    reordered = "trainer:\n  max_steps: 10\nmodel:\n  seed: 1\n  optim:\n    lr: 0.001\nname: b\n"
    assert provenance.config_hash(reordered) == provenance.config_hash(CONFIG)
    assert provenance.config_hash(CONFIG.replace("0.001", "0.002")) != provenance.config_hash(
        CONFIG
    )


def test_resume_reports_a_version_and_config_change_in_one_line(seeded, tmp_path, monkeypatch):
    path, *_ = _save(tmp_path)
    versions = dict(provenance.package_versions(), **{"megatron-core": "0.19.3"})
    monkeypatch.setattr(provenance, "package_versions", lambda: versions)
    saved = provenance.saved_provenance(dist_checkpointing.load_common_state_dict(str(path)))
    changed = CONFIG.replace("0.001", "0.002").replace("max_steps: 10", "max_steps: 20")
    report = changes_since_checkpoint(path, changed)
    assert report == (
        f"checkpoint iter_0000001 was written with megatron-core "
        f"{saved['versions']['megatron-core']}, this run has 0.19.3; "
        "with another config (model.optim.lr, trainer.max_steps)"
    )


def test_a_layout_change_is_reported(seeded, tmp_path, monkeypatch):
    path, *_ = _save(tmp_path)
    monkeypatch.setattr(
        "megatron_lns.training.resume.layout_record",
        lambda: {"tensor": 2, "pipeline": 1, "data": 1},
    )
    assert changes_since_checkpoint(path, CONFIG) == (
        "checkpoint iter_0000001 was written at another parallel layout (tensor=1 pipeline=1 "
        "data=1, now tensor=2 pipeline=1 data=1: RNG restarts from the seed)"
    )


def test_a_checkpoint_without_the_record_loads_and_says_so(seeded, tmp_path, monkeypatch):
    without_record = checkpoint._state_dict

    def old_state_dict(*args, **kwargs):
        sharded = without_record(*args, **kwargs)
        sharded.pop(provenance.PROVENANCE, None)
        return sharded

    monkeypatch.setattr(checkpoint, "_state_dict", old_state_dict)
    path, model, optimizer, scheduler = _save(tmp_path)
    monkeypatch.undo()
    common = dist_checkpointing.load_common_state_dict(str(path))
    assert provenance.PROVENANCE not in common
    assert load_checkpoint(path, model, optimizer, scheduler) == TrainingState(1, 4)
    assert changes_since_checkpoint(path, CONFIG) == (
        "checkpoint iter_0000001 records no provenance (written before checkpoints did): "
        "versions and config not compared"
    )


def test_weights_load_from_a_training_checkpoint_ignores_optimizer_and_rng(seeded, tmp_path):
    """``analyze`` loads the model of a full training checkpoint: strictness is about the
    model's tensors, not about the optimizer state and RNG the checkpoint also holds."""
    path, trained, *_ = _save(tmp_path)
    fresh = wrap_with_ddp(build_model(tiny_config()))
    checkpoint.load_model_weights(fresh, path)
    for (name, expected), (_, loaded) in zip(
        trained[0].named_parameters(), fresh[0].named_parameters(), strict=True
    ):
        assert torch.equal(loaded, expected), name
