"""Loading and checking a config imports neither torch nor megatron-core.

``submit`` (and ``--dry-run``) run on login nodes, where importing torch and megatron-core
costs seconds of CPU (benchmarks/cli_startup.py measures it). Each case runs in a fresh
interpreter, since this test process has long imported both.
"""

import subprocess
import sys

import pytest
from helpers import FIXTURES, ROOT, fresh_launch_env, hugging_face_tokenizer_dir

from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.metadata import DatasetMetadata
from megatron_lns.data.preprocess import preprocess

OLMO = ROOT / "nemo_configs" / "olmo_7b_lns_20b.yaml"
NEMO = FIXTURES / "nemo_megatron_gpt_config.yaml"
HEAVY = ("torch", "megatron.core", "transformers")

LOAD_AND_VALIDATE = """
import sys
from megatron_lns.config import load_config, validate
cfg = load_config(sys.argv[1], sys.argv[2:])
validate(cfg, check_files=False)
print("HEAVY:" + ",".join(m for m in {heavy!r} if m in sys.modules))
"""


def _heavy_modules_imported(code: str, *args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=fresh_launch_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    report = [line for line in done.stdout.splitlines() if line.startswith("HEAVY:")][-1]
    return [m for m in report.removeprefix("HEAVY:").split(",") if m]


OLMO_INPUTS = ["model.data.data_prefix=[/data/x]", "model.tokenizer.type=/models/t"]


@pytest.mark.parametrize(
    "config, overrides",
    [
        (OLMO, OLMO_INPUTS),
        (
            NEMO,
            # NeMo's type (GPT2BPETokenizer) is no file the byte tokenizer reads: null it.
            [
                "model.data.data_prefix=[/data/x]",
                "model.tokenizer.library=byte",
                "model.tokenizer.type=null",
            ],
        ),
    ],
    ids=["olmo_7b", "nemo"],
)
def test_loading_and_validating_a_config_imports_neither_torch_nor_megatron(config, overrides):
    code = LOAD_AND_VALIDATE.format(heavy=HEAVY)
    assert _heavy_modules_imported(code, str(config), *overrides) == []


def test_the_probe_sees_a_heavy_import():
    """The check above can fail: the same probe reports torch once something imports it."""
    code = "import sys, megatron_lns.model.language_model\n" + LOAD_AND_VALIDATE.split("\n", 2)[2]
    code = code.format(heavy=HEAVY)
    assert "torch" in _heavy_modules_imported(code, str(OLMO), *OLMO_INPUTS)


@pytest.mark.parametrize("command", ["submit", "train"])
def test_dry_runs_import_neither_torch_nor_megatron(command, tmp_path):
    """What a login node runs before a job is queued: the whole command, in a fresh
    interpreter (the same probe as benchmarks/cli_startup.py), with data and a tokenizer
    that its checks read (config/data_checks.py)."""
    prefix = tmp_path / "corpus_text_document"
    preprocess(demo_documents()[:300], prefix)  # enough documents for OLMo's 998,2,0
    DatasetMetadata.path_for(prefix).unlink()  # as if made by other tools, with this tokenizer
    (tmp_path / "tokenizer").mkdir()
    hugging_face_tokenizer_dir(tmp_path / "tokenizer")
    overrides = [
        f"model.data.data_prefix=[{prefix}]",
        f"model.tokenizer.type={tmp_path / 'tokenizer'}",
        f"exp_manager.exp_dir={tmp_path / 'runs'}",
        f"cluster.container_mounts=[{tmp_path}:{tmp_path}]",
    ]
    imported = _heavy_modules_imported(COMMAND_PROBE, command, str(OLMO), *overrides, "--dry-run")
    assert imported == []


# A whole command in a fresh interpreter, then the heavy modules it imported.
COMMAND_PROBE = (
    "import runpy, sys\n"
    "sys.argv = ['megatron-lns', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('megatron_lns.cli', run_name='__main__')\n"
    "except SystemExit as exit:\n"
    "    assert not exit.code, exit.code\n"
    f"print('HEAVY:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
)


def test_status_imports_neither_torch_nor_megatron(tmp_path):
    """``status RUN_DIR`` is asked on a login node while the run trains: it answers at once."""
    run = tmp_path / "lns"
    (run / "checkpoints" / "iter_0000002").mkdir(parents=True)
    (run / "checkpoints" / "iter_0000002" / "complete.json").write_text("{}")
    (run / "config.yaml").write_text("trainer:\n  max_steps: 10\n")
    (run / "run_progress").write_text(
        "local 0 began 0 at=100 startup_s=5 load_s=0 samples=0\n"
        "local 0 trained 2 at=110 steps=2 train_s=8 save_s=1 eval_s=0 samples=8\n"
    )
    assert _heavy_modules_imported(COMMAND_PROBE, "status", str(run)) == []
