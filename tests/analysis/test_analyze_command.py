"""``megatron-lns analyze`` without a model: its command line, its printed summary, the
configs it accepts, and the windows of its once-per-document loss (issue 32)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import DEMO_CONFIG

from megatron_lns.analysis.depth import DepthReport, LayerDiagnostics
from megatron_lns.analysis.documents import document_batches, rolling_windows
from megatron_lns.cli import main


def test_settings_after_labels_are_settings_not_labels(tmp_path, monkeypatch):
    """``--labels x trainer.devices=2``: argparse's nargs="+" gave the setting to the
    labels ("2 labels for 1 inputs")."""
    from megatron_lns.analysis import trained_models

    calls = []
    monkeypatch.setattr(
        trained_models, "analyze", lambda inputs, out, **kw: calls.append((inputs, kw))
    )
    run = tmp_path / "run"
    run.mkdir()
    argv = ["analyze", str(run), "--labels", "x", "trainer.devices=2", "--out", "o"]
    assert main([*argv, "model.tensor_model_parallel_size=2"]) == 0
    ((inputs, options),) = calls
    assert inputs == [str(run)] and options["labels"] == ["x"]
    assert options["overrides"] == ["trainer.devices=2", "model.tensor_model_parallel_size=2"]


def test_expert_parallel_sizes_are_layout_settings():
    from megatron_lns.analysis.trained_models import AnalysisError, check_overrides

    check_overrides(["model.expert_model_parallel_size=1", "model.expert_tensor_parallel_size=1"])
    with pytest.raises(AnalysisError, match=r"model\.num_moe_experts: analyze does not change"):
        check_overrides(["model.num_moe_experts=8"])


def test_the_summary_says_not_computed_for_what_was_not_measured():
    """``--no-prune`` printed "pruning drop nan"."""
    from megatron_lns.analysis.trained_models import summary_line

    row = LayerDiagnostics(layer_number=1, output_variance=2.0, angular_distance=0.25)
    report = DepthReport(loss=2.5, num_tokens=64, layers=[row])
    result = {"document_loss": 2.75, "documents": 3, "document_tokens": 60, "context_length": 32}
    line = summary_line("lns", report, result)
    assert "pruning drop not computed" in line
    assert "held-out loss 2.5000" in line and "once per document 2.7500 (3 documents" in line
    unmeasured = DepthReport(loss=math.nan, num_tokens=0, layers=[row])
    line = summary_line("lns", unmeasured, {"document_loss": None})
    assert "nan" not in line.lower() and "none" not in line.lower()


def test_a_split_without_a_training_share_is_valid_for_held_out_data(tmp_path):
    """analyze reads only held-out data: ``0,100,0`` is refused for training, not here."""
    from megatron_lns.config import ConfigError, load_config, validate

    cfg = load_config(
        DEMO_CONFIG, [f"exp_manager.exp_dir={tmp_path}", "model.data.splits_string=0,100,0"]
    )
    with pytest.raises(ConfigError, match=r"model\.data\.splits_string must be three"):
        validate(cfg, check_files=False)
    validate(cfg, check_files=False, held_out_only=True)
    bad = load_config(
        DEMO_CONFIG, [f"exp_manager.exp_dir={tmp_path}", "model.data.splits_string=1,0,0"]
    )
    with pytest.raises(ConfigError, match=r"model\.data\.splits_string"):
        validate(bad, check_files=False, held_out_only=True)


def test_rolling_windows_are_lm_evals():
    """A document of 2L + 3 tokens: two full windows from the prefix on, the last three
    tokens scored right-aligned after the L tokens before them."""
    doc = list(range(10, 21))  # 11 tokens, L = 4
    windows = rolling_windows(doc, 0, 4)
    assert windows == [
        ([0, 10, 11, 12, 13], 4),
        ([13, 14, 15, 16, 17], 4),
        ([16, 17, 18, 19, 20], 3),
    ]
    assert rolling_windows([5, 6], 0, 4) == [([0, 5, 6], 2)]
    scored = [t for tokens, n in windows for t in tokens[len(tokens) - n :]]
    assert scored == doc  # every token once, in order


@pytest.mark.parametrize("dp", [1, 2])
def test_document_batches_score_whole_documents_once_over_data_parallel_ranks(dp):
    docs = [[1] * 3, [2] * 9, [3] * 2, [4] * 5]  # 1, 3, 1, 2 windows of L = 4
    ranks = [document_batches(iter(docs), 0, 4, 5, 1, 2 // dp, dp, rank) for rank in range(dp)]
    assert {(r.documents, r.tokens) for r in ranks} == {(3, 14)}  # 5 windows: docs 1-3
    masks = [mb["loss_mask"] for r in ranks for batch in r.batches for mb in batch]
    assert sum(float(m.sum()) for m in masks) == 14
    assert all(mb["tokens"].shape == (1, 4) for r in ranks for b in r.batches for mb in b)
    assert len({len(r.batches) for r in ranks}) == 1  # every rank runs as many passes


@pytest.mark.parametrize(
    ("text", "holds"),
    [("- a\n- b\n", "a list"), ("hello\n", "a single value"), ("", "nothing")],
    ids=["list", "word", "empty"],
)
def test_a_config_that_is_not_a_mapping_is_one_line(tmp_path, text, holds):
    """analyze --config of a YAML list ended in an omegaconf ConfigTypeError traceback;
    a file of one word was read as a mapping, and analyze then asked for the --config
    that had been given. It is read as import-hf reads its --config."""
    from megatron_lns.analysis.trained_models import AnalysisError, _hf_base

    config = tmp_path / "base.yaml"
    config.write_text(text)
    message = rf"^--config {config} is not a mapping of config sections \(it holds {holds}\)$"
    with pytest.raises(AnalysisError, match=message):
        _hf_base(config, tmp_path / "hf")


def test_a_base_config_is_read_as_omegaconf_reads_it(tmp_path):
    """PyYAML's own loader takes 2024-13-45 for a date, and refused it as invalid; the
    training loader, and OmegaConf, read it as the string it is."""
    from megatron_lns.convert.hf_import import read_base_config_file

    config = tmp_path / "base.yaml"
    config.write_text("note: 2024-13-45\nmodel: {}\n")
    assert read_base_config_file(config).note == "2024-13-45"


def _strict_json(text: str):
    """``text`` parsed as strict JSON: Python's bare NaN / Infinity are refused."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_non_finite_loss_is_said_and_written_as_strict_json(tmp_path):
    """A model that computes NaN was reported as "held-out loss not computed", and
    analysis.json held bare ``NaN``, which strict JSON parsers reject."""
    from megatron_lns.analysis.trained_models import _report_from_dict, summary_line
    from megatron_lns.base import json_numbers

    rows = [LayerDiagnostics(n, math.nan, math.nan, math.nan, math.nan, math.nan) for n in (1, 2)]
    for pruned in (False, True):
        report = DepthReport(loss=math.nan, num_tokens=64, layers=rows, pruned=pruned)
        documents = {"document_loss": math.inf, "documents": 3, "document_tokens": 60,
                     "context_length": 32}  # fmt: skip
        result = _strict_json(json_numbers.dumps(report.to_dict() | documents))
        assert result["loss"] == "NaN" and result["document_loss"] == "Infinity"
        drop = result["layers"][0]["pruning_drop"]
        assert drop == ("NaN" if pruned else None)  # null: not measured (--no-prune)
        line = summary_line("lns", _report_from_dict(result), result)
        assert "held-out loss NaN (non-finite)" in line and "ppl NaN (non-finite)" in line
        assert "once per document Infinity (non-finite)" in line
        assert "variance growth L/1 NaN (non-finite)" in line
        assert f"pruning drop {'NaN (non-finite)' if pruned else 'not computed'}" in line
