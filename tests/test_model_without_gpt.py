"""The version guard: a megatron-core release without ``GPTModel`` (deprecated in 0.19 in
favour of ``HybridModel``) ends a GPT run in one ``error:`` line that names the fix, and
a hybrid run still trains.

The release is simulated in a fresh interpreter: ``megatron.core.models.gpt`` is a
package with its submodules (the layer specs, which megatron-core's own hybrid specs
import too) but without ``GPTModel``, and ``gpt_model`` cannot be imported.
"""

import json
import subprocess
import sys

import pytest
from helpers import DEMO_CONFIG, ROOT, TINY_RUN_OVERRIDES, fresh_launch_env

WITHOUT_GPT_MODEL = """
import json, pathlib, sys, types
import megatron.core.models as models

package = types.ModuleType("megatron.core.models.gpt")
package.__path__ = [str(pathlib.Path(models.__file__).parent / "gpt")]
sys.modules[package.__name__] = package
sys.modules["megatron.core.models.gpt.gpt_model"] = None  # importing it raises ImportError
models.gpt = package

from megatron_lns.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    print("EXIT", code, flush=True)
    print("EXIT", code, file=sys.stderr, flush=True)
"""


@pytest.mark.slow
def test_without_gpt_model_a_gpt_run_names_the_fix_and_a_hybrid_run_trains(tmp_path):
    """One interpreter runs both commands: the GPT one refused before any rank or run
    directory, then the same run as a hybrid model."""
    run = [
        "train",
        str(DEMO_CONFIG),
        *TINY_RUN_OVERRIDES,
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "model.optim.sched.warmup_steps=1",
    ]
    gpt = [*run, f"exp_manager.exp_dir={tmp_path / 'gpt'}"]
    hybrid = [*run, "model.architecture=hybrid", f"exp_manager.exp_dir={tmp_path / 'hybrid'}"]
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_GPT_MODEL, json.dumps([gpt, hybrid])],
        cwd=ROOT,
        env=fresh_launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    gpt_err, hybrid_err = done.stderr.split("EXIT 2\n", 1)
    errors = [line for line in gpt_err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in gpt_err, gpt_err
    assert "has no GPTModel" in errors[0] and "set model.architecture=hybrid" in errors[0]
    assert not (tmp_path / "gpt").exists()

    assert "EXIT 0" in hybrid_err and "Traceback" not in hybrid_err, hybrid_err[-3000:]
    # Any import of GPTModel on the hybrid path (model, training, checkpoints) would
    # have failed this run.
    assert "[lns] step      2  loss" in done.stdout
