"""``megatron-lns plan`` end to end: every bundled config, ``--json`` round trip, the
fixes of a run that does not fit (each, passed back as overrides, fits), one-line
errors, and no torch or megatron-core imported on the way."""

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
from helpers import ROOT, cli_error_of, fresh_launch_env, hugging_face_tokenizer_dir

from megatron_lns.cli import main
from megatron_lns.config import validate
from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.metadata import DatasetMetadata
from megatron_lns.data.preprocess import preprocess
from megatron_lns.planning import gpu_named, load_for_plan, make_plan

BUNDLED = sorted((ROOT / "nemo_configs").glob("*.yaml"))
OLMO = ROOT / "nemo_configs" / "olmo_7b_lns_20b.yaml"
# The OLMo-7B run squeezed onto one A100 40GB node without its parallel layout.
CROWDED = [
    "trainer.num_nodes=1",
    "model.tensor_model_parallel_size=1",
    "model.pipeline_model_parallel_size=1",
    "model.virtual_pipeline_model_parallel_size=null",
    "model.sequence_parallel=false",
    "model.overlap_p2p_comm=false",
    "model.optim.name=fused_adam",
    "model.optim.overlap_param_sync=false",
    "model.global_batch_size=64",
]


def _plan_json(capsys, *args) -> dict:
    assert main(["plan", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("config", BUNDLED, ids=[p.stem for p in BUNDLED])
def test_plan_runs_on_every_bundled_config(config, capsys):
    assert main(["plan", str(config)]) == 0
    text = capsys.readouterr().out
    assert "memory per GPU" in text and "time per step" in text
    assert ("fits:" in text) != ("DOES NOT FIT" in text)
    data = _plan_json(capsys, config)
    assert data["parameters"]["total"] > 0 and data["throughput"]["step_seconds"] > 0
    assert data["fits"] == (data["margin_gb"] >= 0)


def test_json_round_trips_the_plan(capsys):
    cfg = load_for_plan(OLMO)
    validate(cfg, check_files=False)
    plan = make_plan(cfg, 50280, gpu_named("H200"), vocab_source="--vocab-size")
    data = _plan_json(capsys, OLMO, "--gpu", "h200", "--vocab-size", 50280)
    expected = json.loads(json.dumps(asdict(plan)))
    for key, value in expected.items():
        if key == "heaviest" or key == "stages":
            continue
        assert data[key] == value, key
    assert data["heaviest"]["total_gb"] == pytest.approx(plan.heaviest.total_gb)
    assert data["margin_gb"] == pytest.approx(plan.margin_gb) and data["fits"] is plan.fits
    assert [s["parameters"] for s in data["stages"]] == [s.parameters for s in plan.stages]
    assert data["gpu"]["memory_gb"] == 141


def test_a_run_that_does_not_fit_lists_fixes_that_each_fit(capsys):
    data = _plan_json(capsys, OLMO, *CROWDED, "--gpu", "A100-40GB", "--vocab-size", 50280)
    assert not data["fits"]
    fixes = data["fixes"]
    assert fixes, "no fix found"
    assert [f["cost"] for f in fixes] == sorted(f["cost"] for f in fixes)
    for fix in fixes:
        again = _plan_json(
            capsys, OLMO, *CROWDED, *fix["overrides"], "--gpu", "A100-40GB", "--vocab-size", 50280
        )
        assert again["fits"], fix["what"]
        assert again["heaviest"]["total_gb"] == pytest.approx(fix["total_gb"])


def test_the_distributed_optimizer_is_the_free_fix(capsys):
    crowded = [*CROWDED, "model.fp8=null"]  # an A100 has no FP8
    data = _plan_json(capsys, OLMO, *crowded, "--gpu", "A100-80GB", "--vocab-size", 50280)
    assert not data["fits"] and not data["notes"]
    first = data["fixes"][0]
    assert first["cost"] == 0 and "model.optim.name=distributed_fused_adam" in first["overrides"]


def test_fp8_on_a_gpu_without_fp8_is_noted(capsys):
    data = _plan_json(capsys, OLMO, "--gpu", "A100-80GB", "--vocab-size", 50280)
    assert data["notes"] and "no FP8 tensor cores" in data["notes"][0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu", "V100"], "error: --gpu V100: not in the GPU table"),
        (["--mfu", "0"], "error: --mfu 0.0: a fraction of the peak"),
        (["--mfu", "41"], "error: --mfu 41.0: a fraction of the peak"),
        (["--nodes", "0"], "error: --nodes 0: at least 1"),
        (["--vocab-size", "0"], "error: --vocab-size 0: at least 1"),
        (["--vocab-size", "-5"], "error: --vocab-size -5: at least 1"),
    ],
)
def test_a_bad_argument_is_one_line(args, message, capsys):
    assert main(["plan", str(OLMO), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err


@pytest.mark.parametrize("override", ["trainer.num_nodes=1", "~trainer.num_nodes"])
def test_nodes_and_an_override_of_the_node_count_are_refused_together(override, capsys):
    error = cli_error_of(capsys, "plan", "tiny_cpu_demo", "--nodes", "2", override)
    assert error == (
        f"error: --nodes 2 and the override '{override}' both set trainer.num_nodes: "
        "give one of them"
    )


def test_nodes_holds_over_a_whole_trainer_override(capsys):
    plan = _plan_json(capsys, "tiny_cpu_demo", "--nodes", "2", "trainer={devices: 1}")
    assert plan["gpus"] == 2  # 2 nodes of 1 device


def test_a_placeholder_for_a_file_the_library_does_not_read_is_dropped(capsys):
    """llama_130m's SentencePiece model is unset (???): planned with a Hugging Face
    tokenizer, plan's stand-in for it is no file the user named, so it is not refused."""
    hugging_face = ["model.tokenizer.library=huggingface", "model.tokenizer.type=/t"]
    assert _plan_json(capsys, "llama_130m", *hugging_face)["vocab_size"] == 50280


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"model": 3}'])
def test_an_unreadable_tokenizer_json_is_one_line(content, tmp_path, capsys):
    (tmp_path / "tokenizer.json").write_text(content)
    tokenizer = ["model.tokenizer.library=huggingface", f"model.tokenizer.type={tmp_path}"]
    assert main(["plan", "tiny_cpu_demo", *tokenizer]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tmp_path / 'tokenizer.json'}: not a Hugging Face")
    assert "--vocab-size" in err and "\n" not in err
    assert main(["plan", "tiny_cpu_demo", *tokenizer, "--vocab-size", "300"]) == 0


@pytest.mark.parametrize(
    "text",
    [
        b"trainer:\n  devices: 1\ntrainer:\n  devices: 2\n",
        b"- 1\n",
        b"trainer:\n  name: \xff\n",
        b"a: &a [*a]\n",
        b"model: {data: 3}\n",
        b"model: [1]\n",
    ],
    ids=["duplicate key", "list", "not UTF-8", "recursive alias", "model.data=3", "model=[1]"],
)
def test_plan_refuses_a_malformed_config_as_train_does(text, tmp_path, capsys):
    """plan reads the file through train's loader, not with a second reader of its own."""
    config = tmp_path / "bad.yaml"
    config.write_bytes(text)
    refused = cli_error_of(capsys, "plan", str(config))
    assert refused == cli_error_of(capsys, "train", str(config), "--dry-run")


HEAVY = ("torch", "megatron.core", "transformers")


@pytest.mark.parametrize("config", ["olmo_7b_lns_20b", "olmoe_1b_7b_lns", "tiny_cpu_hybrid"])
def test_plan_imports_neither_torch_nor_megatron_nor_transformers(config):
    """In a fresh interpreter (this one has long imported them); the probe's negative
    control is tests/config/test_light_imports.py::test_the_probe_sees_a_heavy_import."""
    code = (
        "import runpy, sys\n"
        "sys.argv = ['megatron-lns', 'plan', sys.argv[1]]\n"
        "try:\n"
        "    runpy.run_module('megatron_lns.cli', run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    assert not exit.code, exit.code\n"
        f"print('HEAVY:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, config],
        cwd=ROOT,
        env=fresh_launch_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert "memory per GPU" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "HEAVY:"


# --- submit's check ---


def _submit_inputs(tmp_path) -> list[str]:
    """Data, tokenizer and mounts that pass submit's checks (config/data_checks.py)."""
    prefix = tmp_path / "corpus_text_document"
    preprocess(demo_documents()[:300], prefix)  # enough documents for OLMo's 998,2,0
    DatasetMetadata.path_for(prefix).unlink()  # as if made by other tools
    (tmp_path / "tokenizer").mkdir()
    hugging_face_tokenizer_dir(tmp_path / "tokenizer")
    return [
        f"model.data.data_prefix=[{prefix}]",
        f"model.tokenizer.type={tmp_path / 'tokenizer'}",
        f"exp_manager.exp_dir={tmp_path / 'runs'}",
        f"cluster.container_mounts=[{tmp_path}:{tmp_path}]",
    ]


def test_submit_prints_the_plan_and_refuses_a_job_that_does_not_fit(tmp_path, capsys):
    inputs = _submit_inputs(tmp_path)
    assert main(["submit", str(OLMO), *inputs, "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("#!/bin/bash\n")  # stdout stays the script
    assert captured.err.startswith("plan: 23.3 of 80 GB per H100")  # vocabulary 3, read
    assert "fits" in captured.err

    crowded = [*inputs, *CROWDED]
    assert main(["submit", str(OLMO), *crowded, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "DOES NOT FIT" in err.splitlines()[0]
    assert err.splitlines()[1].startswith("error: the job needs 146.8 GB per GPU")
    assert main(["submit", str(OLMO), *crowded, "--dry-run", "--skip-plan-check"]) == 0
    assert main(["submit", str(OLMO), *crowded, "--dry-run", "--gpu", "B200"]) == 0


def test_submit_checks_an_auto_job_that_asks_for_gpus(tmp_path, capsys):
    """trainer.accelerator=auto runs on the GPUs cluster.gpus_per_node asks SLURM for:
    submit sent such a job without the check a gpu job gets."""
    auto = [*_submit_inputs(tmp_path), *CROWDED, "trainer.accelerator=auto"]
    gpus = "cluster.gpus_per_node=8"  # trainer.devices, as auto requires
    assert main(["submit", str(OLMO), *auto, gpus, "--dry-run"]) == 2
    assert "error: the job needs 146.8 GB per GPU" in capsys.readouterr().err
    assert main(["submit", str(OLMO), *auto, "cluster.gpus_per_node=0", "--dry-run"]) == 0
    assert "plan:" not in capsys.readouterr().err  # a CPU job: nothing to check
    no_gpus = cli_error_of(
        capsys, "submit", "tiny_cpu_demo", "trainer.accelerator=auto", "--dry-run", "--gpu", "H100"
    )
    assert no_gpus.startswith(
        "error: --gpu H100: submit checks a job against a GPU only with trainer.accelerator=gpu, "
        "and this one has trainer.accelerator=auto and no cluster.gpus_per_node; drop --gpu"
    )


def test_submit_refuses_a_gpu_it_does_not_know_or_does_not_check(capsys):
    """--gpu names the GPU submit checks a GPU job against: a CPU job ignored it, even an
    unknown name."""
    unknown = cli_error_of(capsys, "submit", "tiny_cpu_demo", "--dry-run", "--gpu", "nonsense")
    assert unknown.startswith("error: --gpu nonsense: not in the GPU table")
    unused = cli_error_of(capsys, "submit", "tiny_cpu_demo", "--dry-run", "--gpu", "H100")
    assert unused.startswith(
        "error: --gpu H100: submit checks a job against a GPU only with trainer.accelerator=gpu, "
        "and this one has trainer.accelerator=cpu"
    )
