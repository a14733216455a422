"""``megatron-lns compare``: variant names, the table, and 2 variants x 2 seeds trained for
real: reproducible in one process, seeds and variants distinct, interrupted comparisons
resume to the same curves, finished runs are not trained again."""

import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DEMO_CONFIG, ROOT, TINY_RUN_OVERRIDES, fresh_launch_env, run_distributed

from megatron_lns.analysis.comparison import (
    CompareError,
    Comparison,
    RunResult,
    Variant,
    _final_router_losses,
    check_arms,
    format_table,
    parse_variants,
    run_config,
    seeds_for,
)
from megatron_lns.analysis.depth import LayerStats
from megatron_lns.analysis.plots import trailing_mean
from megatron_lns.cli import main
from megatron_lns.config import load_config, validate

pytestmark = pytest.mark.usefixtures("private_corpus_cache")


def test_variant_names_set_only_their_keys():
    lns, post, scaled = parse_variants(["lns", "post_ln", "pre_ln+scaled_init"])
    assert lns == Variant("lns", "LNS", {"norm_scaling": "lns", "layer_variant": "pre_ln"})
    assert post.model_settings == {"norm_scaling": "none", "layer_variant": "post_ln"}
    assert scaled.label == "Pre-LN + scaled init"
    assert scaled.model_settings["output_layer_init"] == "scaled"
    cfg = load_config(DEMO_CONFIG, TINY_RUN_OVERRIDES)
    run = run_config(cfg, post, 7, Path("/out"))
    assert (run.model.seed, run.model.layer_variant, run.model.norm_scaling) == (
        7,
        "post_ln",
        "none",
    )
    assert (run.exp_manager.exp_dir, run.exp_manager.name) == ("/out/post_ln", "seed7")
    assert run.model.hidden_size == cfg.model.hidden_size and run.trainer == cfg.trainer
    assert seeds_for(cfg, 3) == [cfg.model.seed, cfg.model.seed + 1, cfg.model.seed + 2]


@pytest.mark.parametrize(
    "names, message",
    [
        (["lns", "pre-ln"], "unknown variant 'pre-ln'"),
        (["lns+xavier"], "unknown init suffix in variant 'lns+xavier'"),
        (["lns", "lns"], "variant(s) given twice: lns"),
    ],
)
def test_bad_variant_names_are_refused_by_name(names, message):
    with pytest.raises(CompareError, match=re.escape(message)):
        parse_variants(names)


def test_bad_arguments_end_the_command_with_one_line(capsys):
    assert main(["compare", str(DEMO_CONFIG), "--variants", "lns", "nope", "--dry-run"]) == 2
    assert main(["compare", str(DEMO_CONFIG), "--seeds", "0", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: unknown variant 'nope'")
    assert err[1] == "error: --seeds must be at least 1, got 0"


def test_seeds_past_numpys_range_are_refused_before_any_arm_trains(capsys):
    """The second arm's seed 2**32 failed in megatron's data shuffling after the first arm
    had trained, blamed on a cached index mapping."""
    top = ["compare", str(DEMO_CONFIG), f"model.seed={2**32 - 1}", "--dry-run"]
    assert main([*top, "--seeds", "1"]) == 0
    capsys.readouterr()
    assert main([*top, "--seeds", "2"]) == 2
    assert capsys.readouterr().err == (
        f"error: --seeds 2 from model.seed={2**32 - 1} reaches seed {2**32}: seeds must be "
        "an integer in [0, 2**32); lower model.seed or --seeds\n"
    )


def test_hybrid_comparisons_keep_the_architecture_in_every_arm_and_refuse_gpt_only_ones(capsys):
    hybrid = [*TINY_RUN_OVERRIDES, "model.architecture=hybrid"]
    cfg = load_config(
        DEMO_CONFIG, [*hybrid, "model.num_layers=7", "model.hybrid_layer_pattern='*-*--*-'"]
    )
    for variant in parse_variants(["lns", "pre_ln+scaled_init"]):
        run = run_config(cfg, variant, 1, Path("/out"))
        assert run.model.architecture == "hybrid" and run.model.hybrid_layer_pattern == "*-*--*-"
    check_arms(cfg, parse_variants(["lns", "pre_ln+scaled_init"]))
    for names, refused in (
        (["lns", "post_ln"], "post_ln"),
        (["lns+depth_scaled_init"], "lns\\+depth_scaled_init"),
    ):
        with pytest.raises(CompareError, match=f"variant {refused}: model.*gpt only"):
            check_arms(cfg, parse_variants(names))
    assert main(["compare", str(DEMO_CONFIG), *hybrid, "--variants", "mix_ln", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: variant mix_ln: model.layer_variant=mix_ln is built for model.architecture=gpt "
        "only; the hybrid stack has Pre-LN sublayers, with or without LNS"
    ]


def test_table_reports_mean_and_spread_and_keeps_diverged_runs_out_of_them():
    stats = [LayerStats(n, float(n), 0.1 * n) for n in range(1, 9)]
    runs = [
        RunResult("lns", 1, 6, held_out_loss=1.0, train_loss=1.5, tokens_per_second=100.0,
                  layer_stats=stats),
        RunResult("lns", 2, 6, held_out_loss=2.0, train_loss=2.5, tokens_per_second=300.0,
                  layer_stats=stats),
        RunResult("lns", 3, 4, diverged="step 4: loss nan"),
    ]  # fmt: skip
    assert runs[0].variance_growth == 8.0
    assert runs[0].deep_angular_distance == pytest.approx((0.7 + 0.8) / 2)
    table = format_table(Comparison(parse_variants(["lns"]), [1, 2, 3], {"lns": runs}))
    row = table.splitlines()[-1]
    ppl = f"{(math.exp(1) + math.exp(2)) / 2:.4f}"
    assert row.startswith("| LNS | 3 | 1 | 200 | 2.0000 ± 0.7071 | 1.5000 ± 0.7071 | " + ppl)


def test_columns_no_run_measured_are_dashes_over_several_seeds():
    runs = [RunResult("lns", seed, 6, train_loss=2.0 + seed) for seed in (1, 2)]  # no validation
    row = format_table(Comparison(parse_variants(["lns"]), [1, 2], {"lns": runs})).splitlines()[-1]
    assert row == "| LNS | 2 | 0 | - | 3.5000 ± 0.7071 | - | - | - | - |"


def test_router_losses_are_columns_only_where_a_run_logged_them():
    stats = [LayerStats(n, float(n), 0.1 * n) for n in range(1, 5)]

    def run(seed, **losses):
        return RunResult(
            "lns",
            seed,
            6,
            held_out_loss=1.0,
            train_loss=1.5,
            tokens_per_second=100.0,
            layer_stats=stats,
            router_losses=losses,
        )

    dense = format_table(Comparison(parse_variants(["lns"]), [1], {"lns": [run(1)]}))
    assert "load-balancing loss" not in dense and dense.splitlines()[1].count("|") == 10
    runs = {
        "lns": [run(1, **{"moe/load_balancing_loss": 1.1}),
                run(2, **{"moe/load_balancing_loss": 1.3})],
        "pre_ln": [run(1, **{"moe/load_balancing_loss": 1.5})],
    }  # fmt: skip
    table = format_table(Comparison(parse_variants(["lns", "pre_ln"]), [1, 2], runs))
    header, rule, lns, pre_ln = table.splitlines()
    assert header.endswith("| load-balancing loss |") and "z-loss" not in header
    assert rule.count("|") == header.count("|")
    assert lns.endswith("| 1.2000 ± 0.1414 |") and pre_ln.endswith("| 1.5000 |")


def test_final_router_losses_average_the_steps_logged_at_the_end():
    records = [
        {"step": 1, "loss": 3.0},
        {"step": 10, "moe/load_balancing_loss": 2.0, "moe/z_loss": 5.0},
        {"step": 30, "moe/load_balancing_loss": 1.4, "moe/z_loss": 4.0},
        {"step": 30, "val_loss": 2.5},
        {"step": 40, "moe/load_balancing_loss": 1.2, "moe/z_loss": 3.0},
    ]
    final = _final_router_losses(records)  # steps 21-40: the logs of steps 30 and 40
    assert final == {"moe/load_balancing_loss": pytest.approx(1.3), "moe/z_loss": 3.5}
    assert _final_router_losses(records[:1]) == {}  # a dense run logs none


def test_trailing_mean_smooths_over_the_steps_before():
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2).tolist() == [1.0, 2.0, 4.0, 6.0]
    assert trailing_mean([2.0, 4.0], 1).tolist() == [2.0, 4.0]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _compare(cfg, out, variants=("lns", "pre_ln"), seeds=2):
    from megatron_lns.analysis.comparison import parse_variants, run_comparison

    comparison = run_comparison(cfg, parse_variants(variants), seeds, Path(out))
    return comparison.stopped


def _compare_twice(cfg, out):
    _compare(cfg, Path(out) / "first")
    _compare(cfg, Path(out) / "again")


@pytest.mark.long
@pytest.mark.slow
def test_two_variants_two_seeds_reproducible_distinct_and_tabulated(tmp_path):
    cfg = load_config(DEMO_CONFIG, TINY_RUN_OVERRIDES)
    validate(cfg)
    run_distributed(_compare_twice, 1, tmp_path, cfg, str(tmp_path))
    first, again = tmp_path / "first", tmp_path / "again"
    curves = {}
    for variant in ("lns", "pre_ln"):
        for seed in (1234, 1235):
            run = f"{variant}/seed{seed}"
            curves[run] = _losses(first / run)
            assert [step for step, _ in curves[run]] == list(range(1, 7))
            # A second comparison in the same process: nothing leaks from run to run.
            assert _losses(again / run) == curves[run]
    assert curves["lns/seed1234"] != curves["lns/seed1235"]  # seeds differ
    assert curves["lns/seed1234"] != curves["pre_ln/seed1234"]  # variants differ
    report = json.loads((first / "comparison.json").read_text())
    assert report["seeds"] == [1234, 1235]
    for variant in ("lns", "pre_ln"):
        runs = report["variants"][variant]["runs"]
        assert [r["seed"] for r in runs] == [1234, 1235]
        assert all(math.isfinite(r["held_out_loss"]) and len(r["layer_stats"]) == 4 for r in runs)
    table = (first / "comparison.md").read_text()
    assert "| LNS | 2 | 0 |" in table and "±" in table
    # Each arm starts after the one before it ended: a later arm's start-up counted every
    # earlier arm's time from the process's start.
    runs = ("lns/seed1234", "pre_ln/seed1234", "lns/seed1235", "pre_ln/seed1235")  # in order
    arms = [_attempt_span(first / run) for run in runs]
    assert all(start >= ended - 0.02 for (_, ended), (start, _) in itertools.pairwise(arms)), arms
    for png in ("loss_curves.png", "depth_profiles.png"):
        assert (first / png).stat().st_size > 0


def _attempt_span(run_dir: Path) -> tuple[float, float]:
    """When the run's one attempt started (its start-up included) and ended."""
    text = (run_dir / "run_progress").read_text()
    began = re.search(r" began \d+ at=([0-9.]+) startup_s=([0-9.]+)", text)
    ended = re.search(r" ended \d+ .*?at=([0-9.]+)", text)
    return float(began[1]) - float(began[2]), float(ended[1])


def _interrupted_then_resumed(cfg, stopping_cfg, out):
    reference, resumed = Path(out) / "reference", Path(out) / "resumed"
    _compare(cfg, reference, variants=("lns",))
    stopped = _compare(stopping_cfg, resumed, variants=("lns",))
    assert not (resumed / "comparison.md").exists()
    finished = _compare(cfg, resumed, variants=("lns",))
    metrics = resumed / "lns" / "seed1234" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    _compare(cfg, resumed, variants=("lns",))  # everything finished: nothing is trained
    return stopped, finished, before == metrics.stat().st_mtime_ns


@pytest.mark.slow
def test_an_interrupted_comparison_resumes_to_the_same_curves(tmp_path):
    cfg = load_config(DEMO_CONFIG, TINY_RUN_OVERRIDES)
    stopping = load_config(DEMO_CONFIG, [*TINY_RUN_OVERRIDES, "trainer.exit_interval=3"])
    stopped, finished, untouched = run_distributed(
        _interrupted_then_resumed, 1, tmp_path, cfg, stopping, str(tmp_path)
    )[0]
    assert stopped and not finished and untouched
    for seed in (1234, 1235):
        run = f"lns/seed{seed}"
        assert _losses(tmp_path / "resumed" / run) == _losses(tmp_path / "reference" / run)
    reference = json.loads((tmp_path / "reference" / "comparison.json").read_text())
    resumed = json.loads((tmp_path / "resumed" / "comparison.json").read_text())
    # Everything but the throughput, which is timing.
    for ref_run, resumed_run in zip(*(r["variants"]["lns"]["runs"] for r in (reference, resumed)),
                                    strict=True):  # fmt: skip
        assert {**ref_run, "tokens_per_second": 0} == {**resumed_run, "tokens_per_second": 0}


MOE_CONFIG = ROOT / "nemo_configs" / "tiny_cpu_moe.yaml"
# tiny_cpu_moe shrunk: a dense layer and three MoE layers of 4 experts, four steps.
TINY_MOE_OVERRIDES = [
    "model.num_layers=4",
    "model.moe_layer_freq=[0,1,1,1]",
    "model.num_moe_experts=4",
    "model.moe_ffn_hidden_size=32",
    "model.ffn_hidden_size=96",
    "model.encoder_seq_length=16",
    "model.micro_batch_size=4",
    "model.global_batch_size=4",
    "model.optim.sched.warmup_steps=1",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
]


@pytest.mark.slow
def test_compare_runs_lns_against_pre_ln_on_an_moe_config(tmp_path):
    """The command as a user runs it (its own process: one rank, in-process)."""
    out = tmp_path / "out"
    args = ["compare", str(MOE_CONFIG), *TINY_MOE_OVERRIDES, "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "megatron_lns.cli", *args],
        capture_output=True, text=True, timeout=600, env=fresh_launch_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout
    report = json.loads((out / "comparison.json").read_text())
    assert list(report["variants"]) == ["lns", "pre_ln"]
    for variant in ("lns", "pre_ln"):
        stored = load_config(out / variant / "seed1234" / "config.yaml")
        assert (stored.model.num_moe_experts, stored.model.moe_router_topk) == (4, 2)
        (run,) = report["variants"][variant]["runs"]
        assert run["steps"] == 4 and math.isfinite(run["held_out_loss"])
        assert len(run["layer_stats"]) == 4  # the dense layer and the three MoE layers
        # The router losses the trainer logged, at the end of training.
        assert set(run["router_losses"]) == {"moe/load_balancing_loss", "moe/z_loss"}
        assert all(math.isfinite(v) and v > 0 for v in run["router_losses"].values())
    # Same seed and init, different norms: the arms differ from the first step on.
    assert _losses(out / "lns" / "seed1234")[0] != _losses(out / "pre_ln" / "seed1234")[0]
    table = (out / "comparison.md").read_text()
    assert table.splitlines()[0].endswith("| load-balancing loss | router z-loss |")
    assert "| LNS | 1 | 0 |" in table and "| Pre-LN | 1 | 0 |" in table
    assert table.strip() in printed


def _finished_arm(out: Path, overrides=TINY_RUN_OVERRIDES) -> Path:
    """``out`` as a comparison of the lns arm alone (one seed) leaves it when it has
    finished: the run's config, its result and its metrics, without its checkpoints."""
    from megatron_lns.analysis.comparison import RESULT_FILE, Variant, run_config
    from megatron_lns.config import to_yaml

    cfg = load_config(DEMO_CONFIG, list(overrides))
    validate(cfg, check_files=False)
    run_dir = out / "lns" / "seed1234"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(run_config(cfg, Variant.parse("lns"), 1234, out)))
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in range(1, 7))
    )
    result = RunResult("lns", 1234, steps=6, held_out_loss=4.5, train_loss=4.6)
    (run_dir / RESULT_FILE).write_text(json.dumps(result.to_json()))
    return run_dir


@pytest.mark.slow
def test_rerunning_a_finished_comparison_prints_its_table_without_training(tmp_path):
    out = tmp_path / "cmp"
    run_dir = _finished_arm(out)
    done = subprocess.run(
        [sys.executable, "-m", "megatron_lns.cli", "compare", str(DEMO_CONFIG),
         *TINY_RUN_OVERRIDES, "--variants", "lns", "--out", str(out)],
        cwd=ROOT, env=fresh_launch_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "| LNS | 1 | 0 |" in done.stdout and "4.5000" in done.stdout
    assert not (run_dir / "checkpoints").exists()  # nothing was trained


@pytest.mark.slow
def test_each_runs_lines_say_its_variant_and_seed(tmp_path):
    """Every run's lines were prefixed ``[seed1234]``: LNS and Pre-LN lines could not be
    told apart."""
    short = ["trainer.max_steps=2", "trainer.val_check_interval=2",
             "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
             "model.optim.sched.warmup_steps=1"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "megatron_lns.cli", "compare", str(DEMO_CONFIG),
         *TINY_RUN_OVERRIDES, *short, "--variants", "lns", "pre_ln", "--out", str(tmp_path)],
        cwd=ROOT, env=fresh_launch_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    prefixes = [line.split("]")[0] + "]" for line in done.stdout.splitlines() if line[:1] == "["]
    assert set(prefixes) == {"[lns seed1234]", "[pre_ln seed1234]"}
    assert prefixes.count("[lns seed1234]") == prefixes.count("[pre_ln seed1234]") >= 3


def test_a_comparison_into_an_out_of_other_settings_is_refused_naming_the_keys(tmp_path, capsys):
    out = tmp_path / "cmp"
    _finished_arm(out)
    args = ["compare", str(DEMO_CONFIG), *TINY_RUN_OVERRIDES]
    arms = ["--variants", "lns", "pre_ln", "--out", str(out)]
    assert main([*args, "model.hidden_size=32", "model.optim.lr=0.01", *arms]) == 2
    assert main([*args, "trainer.limit_val_batches=2", *arms, "--dry-run"]) == 2
    # What a resume may change without changing what an arm trains is accepted.
    assert main([*args, "trainer.exit_interval=3", "trainer.log_every_n_steps=2", *arms,
                 "--dry-run"]) == 0  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (
        f"error: {out / 'lns' / 'seed1234'} was trained with other settings than this "
        "comparison's (model.hidden_size, model.optim.lr): rerun with the settings it was "
        "started with, or choose another --out"
    )
    assert err[1].endswith("(trainer.limit_val_batches): rerun with the settings it was "
                           "started with, or choose another --out")  # fmt: skip
    assert not (out / "pre_ln").exists()


@pytest.mark.parametrize("command", ["compare", "demo"])
def test_overrides_of_the_keys_each_arm_sets_are_refused_by_name(command, capsys):
    config = [str(DEMO_CONFIG)] if command == "compare" else ["--config", str(DEMO_CONFIG)]
    ours = ["model.layer_variant=post_ln", "+model.norm_scaling=none", "exp_manager.name=mine"]
    assert main([command, *config, *TINY_RUN_OVERRIDES, *ours, "--dry-run"]) == 2
    [err] = capsys.readouterr().err.strip().splitlines()
    assert err == (
        "error: model.layer_variant, model.norm_scaling, exp_manager.name: "
        f"{command} sets these for each arm (the layers by the variant, the run's name by its "
        "seed); choose the arms with `compare --variants` instead"
    )


@pytest.mark.parametrize("command", ["compare", "demo"])
def test_an_exp_dir_override_is_refused_by_name_when_out_places_the_arms(command, tmp_path, capsys):
    """With --out, each arm's exp_dir is <out>/<variant>: a command-line exp_dir was
    dropped without a word. The YAML's exp_dir is the base --out replaces, as meant, and
    without --out the override is honoured (the comparison goes under it)."""
    config = [str(DEMO_CONFIG)] if command == "compare" else ["--config", str(DEMO_CONFIG)]
    args = [command, *config, *TINY_RUN_OVERRIDES, "--dry-run"]
    out = tmp_path / "cmp"
    assert main([*args, f"exp_manager.exp_dir={tmp_path}/mine", "--out", str(out)]) == 2
    [err] = capsys.readouterr().err.strip().splitlines()
    assert err == (
        f"error: exp_manager.exp_dir={tmp_path}/mine: {command} sets exp_manager.exp_dir "
        f"from --out (each arm's run directory is {out}/<variant>); choose --out instead"
    )
    assert main([*args, "--out", str(out)]) == 0
    assert main([*args, f"exp_manager.exp_dir={tmp_path}/mine"]) == 0
    assert not out.exists()


@pytest.mark.parametrize(
    "text, error",
    [
        ('{"variant": "lns", "seed"', "JSONDecodeError"),
        ('{"variant": "lns", "layer_stats": []}', "TypeError"),
    ],
)
def test_an_unreadable_result_redoes_its_arm_with_a_warning_naming_it(
    tmp_path, capsys, text, error
):
    """A result half-written by a killed comparison (or missing a key) crashed the resume
    with a traceback; its arm is now trained (resumed) and measured again."""
    from megatron_lns.analysis.comparison import RESULT_FILE, _finished

    run_dir = _finished_arm(tmp_path / "cmp")
    cfg = load_config(DEMO_CONFIG, TINY_RUN_OVERRIDES)
    assert _finished(cfg, run_dir).held_out_loss == 4.5
    (run_dir / RESULT_FILE).write_text(text)
    assert _finished(cfg, run_dir) is None
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: {run_dir / RESULT_FILE} cannot be read ({error}")


def test_a_diverged_runs_numbers_are_strict_json_read_back_on_resume(tmp_path):
    """compare_result.json and comparison.json of a diverged run held bare ``NaN``, which
    strict JSON parsers reject; the resume reads the strings written now."""
    from megatron_lns.analysis.comparison import RESULT_FILE, _finished, _write_outputs

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    run_dir = _finished_arm(tmp_path / "cmp")
    stats = [LayerStats(1, math.inf, math.nan, math.nan), LayerStats(2, 1.0, 0.5, 0.5)]
    diverged = RunResult("lns", 1234, 4, train_loss=math.nan, layer_stats=stats,
                         diverged="step 5: loss nan", router_losses={"moe/z_loss": math.nan})  # fmt: skip
    text = json.dumps(diverged.to_json(), allow_nan=False)
    assert json.loads(text, parse_constant=refuse)["held_out_loss"] == "NaN"
    (run_dir / RESULT_FILE).write_text(text)
    cfg = load_config(DEMO_CONFIG, TINY_RUN_OVERRIDES)
    again = _finished(cfg, run_dir)
    assert (
        again.diverged
        and math.isnan(again.train_loss)
        and again.layer_stats[0].output_variance == math.inf
    )
    assert math.isnan(again.router_losses["moe/z_loss"])
    comparison = Comparison(parse_variants(["lns"]), [1234], {"lns": [again]})
    _write_outputs(comparison, tmp_path / "cmp", title="t")
    report = json.loads((tmp_path / "cmp" / "comparison.json").read_text(), parse_constant=refuse)
    assert report["variants"]["lns"]["runs"][0]["train_loss"] == "NaN"
    assert "| LNS | 1 | 1 |" in format_table(comparison)


@pytest.mark.slow
def test_an_arm_in_use_by_another_comparison_is_refused_with_advice_compare_takes(tmp_path):
    """The refusal said "choose another exp_manager.name", which compare refuses as an
    override: it now says --out (or to wait for the other comparison)."""
    import socket

    from megatron_lns.training.run_dir import LOCK_NAME

    run_dir = tmp_path / "cmp" / "lns" / "seed1234"
    run_dir.mkdir(parents=True)  # process 1 always runs: the lock is a live one
    (run_dir / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": socket.gethostname()}))
    done = subprocess.run(
        [sys.executable, "-m", "megatron_lns.cli", "compare", str(DEMO_CONFIG),
         *TINY_RUN_OVERRIDES, "--variants", "lns", "--out", str(tmp_path / "cmp")],
        cwd=ROOT, env=fresh_launch_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert f"{run_dir} is in use by process 1 on" in line and "exp_manager.name" not in line
    assert (
        f"wait for the comparison writing {tmp_path / 'cmp'} to end, or choose another --out"
        in line
    )
    assert "Traceback" not in done.stderr
