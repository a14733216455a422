"""A resume on other data under the same prefix is refused, unless the config allows it
(issue 34: never replace data a run is reading, silently)."""

import json
import shutil
import time

import pytest
from helpers import run_distributed, tiny_run_config

from megatron_lns.data.blend import DataBlend
from megatron_lns.data.metadata import dataset_identity
from megatron_lns.training.checkpoint_dirs import COMPLETE_MARKER, DATA
from megatron_lns.training.data_change import (
    DataChangedError,
    check_data,
    data_in_use,
)


def _place(source, prefix) -> str:
    """The dataset ``source`` copied to ``prefix`` (over whatever was there)."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for suffix in (".bin", ".idx", ".json"):
        shutil.copyfile(f"{source}{suffix}", f"{prefix}{suffix}")
    return str(prefix)


def _checkpoint(path, data: dict | None, iteration: int = 3):
    """A directory with only the marker a checkpoint of ``iteration`` would have."""
    path.mkdir(parents=True)
    marker = {"iteration": iteration, "consumed_samples": 12}
    if data is not None:
        marker[DATA] = data
    (path / COMPLETE_MARKER).write_text(json.dumps(marker))
    return path


def test_a_checkpoint_names_the_prefix_whose_data_changed(tmp_path, factory):
    prefix = _place(factory.dataset(50), tmp_path / "data" / "corpus")
    blend = DataBlend((prefix,))
    checkpoint = _checkpoint(tmp_path / "iter_0000003", {prefix: dataset_identity(prefix)})
    assert check_data(checkpoint, data_in_use(blend, blend), allowed=False) is None

    _place(factory.dataset(60), tmp_path / "data" / "corpus")
    data = data_in_use(blend, blend)
    with pytest.raises(DataChangedError) as refused:
        check_data(checkpoint, data, allowed=False)
    assert str(refused.value) == (
        f"dataset {prefix} changed since checkpoint {checkpoint} was written at step 3 (other "
        "token files than the ones it was trained on): restore them, or set "
        "exp_manager.resume_with_changed_data=true to continue training on the new data"
    )
    assert check_data(checkpoint, data, allowed=True) == (
        f"dataset {prefix} changed since checkpoint iter_0000003 was written at step 3; "
        "training continues on the new data (exp_manager.resume_with_changed_data=true)"
    )
    # Written before checkpoints recorded their data, or not naming this prefix: as before.
    old = _checkpoint(tmp_path / "old" / "iter_0000003", None)
    assert check_data(old, data, allowed=False) is None
    other = _checkpoint(tmp_path / "other" / "iter_0000003", {"/elsewhere": "x"})
    assert check_data(other, data, allowed=False) is None


def test_a_builtin_corpus_is_named_with_its_prepared_files(tmp_path, factory):
    prefix = _place(factory.dataset(50), tmp_path / "cache" / "pydoc_byte_0")
    (entry,) = data_in_use(DataBlend(("builtin:pydoc",)), DataBlend((prefix,)))
    checkpoint = _checkpoint(tmp_path / "iter_0000003", {"builtin:pydoc": "idx-sha256+bin-size:0"})
    with pytest.raises(DataChangedError, match=rf"^dataset builtin:pydoc \({prefix}\) changed"):
        check_data(checkpoint, [entry], allowed=False)


def _fit(cfg):
    from megatron_lns.base.errors import UserError
    from megatron_lns.training.trainer import Trainer

    try:
        summary = Trainer(cfg).fit()
    except UserError as err:
        return {"error": str(err)}
    return {"resumed_from": summary.resumed_from, "steps": summary.steps}


def _run(tmp_path, cfg):
    return run_distributed(_fit, 1, tmp_path / f"r{time.monotonic_ns()}", cfg)[0]


def _stopped_at_3_then_its_corpus_replaced(tmp_path, factory) -> tuple[str, list, dict]:
    """A run stopped at step 3 on a corpus, which is then replaced under the same prefix:
    the prefix, the run's overrides and the data its checkpoint recorded."""
    prefix = _place(factory.dataset(50), tmp_path / "data" / "corpus")
    run = [f"model.data.data_prefix=[{prefix}]"]
    stopped = _run(tmp_path, tiny_run_config(tmp_path, *run, "trainer.exit_interval=3"))
    assert stopped["steps"] == 3
    checkpoint = tmp_path / "lns" / "checkpoints" / "iter_0000003"
    recorded = json.loads((checkpoint / COMPLETE_MARKER).read_text())[DATA]
    assert recorded == {prefix: dataset_identity(prefix)}
    _place(factory.dataset(60), tmp_path / "data" / "corpus")  # another corpus, same prefix
    return prefix, run, recorded


@pytest.mark.slow
def test_a_resume_on_other_documents_is_refused_unless_allowed(tmp_path, factory, capfd):
    prefix, run, recorded = _stopped_at_3_then_its_corpus_replaced(tmp_path, factory)
    checkpoint = tmp_path / "lns" / "checkpoints" / "iter_0000003"
    refused = _run(tmp_path, tiny_run_config(tmp_path, *run))
    assert refused["error"] == (
        f"dataset {prefix} changed since checkpoint {checkpoint} was written at step 3 (other "
        "token files than the ones it was trained on): restore them, or set "
        "exp_manager.resume_with_changed_data=true to continue training on the new data"
    )
    capfd.readouterr()

    allowed = [*run, "exp_manager.resume_with_changed_data=true"]
    resumed = _run(tmp_path, tiny_run_config(tmp_path, *allowed))
    assert resumed == {"resumed_from": 3, "steps": 6}
    out = capfd.readouterr().out
    assert (
        f"dataset {prefix} changed since checkpoint iter_0000003 was written at step 3; "
        "training continues on the new data (exp_manager.resume_with_changed_data=true)"
    ) in out
    # The checkpoints written since record the new data: a later resume needs no override.
    final = tmp_path / "lns" / "checkpoints" / "iter_0000006"
    assert json.loads((final / COMPLETE_MARKER).read_text())[DATA] == {
        prefix: dataset_identity(prefix)
    }
    assert recorded[prefix] != dataset_identity(prefix)


@pytest.mark.slow
def test_a_resume_on_other_documents_and_another_seed_says_both(tmp_path, factory, capfd):
    """The settings' note overwrote the token files' one."""
    prefix, run, _ = _stopped_at_3_then_its_corpus_replaced(tmp_path, factory)
    capfd.readouterr()
    allowed = [*run, "model.seed=7", "exp_manager.resume_with_changed_data=true"]
    assert _run(tmp_path, tiny_run_config(tmp_path, *allowed))["resumed_from"] == 3
    out = capfd.readouterr().out
    assert f"dataset {prefix} changed since checkpoint iter_0000003" in out, out
    assert "the samples changed since checkpoint iter_0000003 (model.seed: 1234 -> 7)" in out
