"""``training/`` knows no scheduler: what it learns of the job it runs in comes through
``runtime.job.JobEnvironment``, which the launcher chooses (``docs/design.md``, "The
cluster-backend seam"). So no module under ``megatron_lns/training`` imports a cluster
backend or reads a SLURM variable."""

import ast

import pytest
from helpers import ROOT

TRAINING = ROOT / "megatron_lns" / "training"


def _scheduler_uses(path):
    """The imports of ``megatron_lns.cluster`` and the ``SLURM_*`` names in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith("SLURM_") else []
        else:
            continue
        found += [
            f"{path.name}:{node.lineno}: {name}"
            for name in names
            if name.startswith(("megatron_lns.cluster", "SLURM_"))
        ]
    return found


def test_no_training_module_imports_a_cluster_backend_or_reads_slurm_variables():
    modules = sorted(TRAINING.rglob("*.py"))
    assert len(modules) > 10
    assert [use for path in modules for use in _scheduler_uses(path)] == []


@pytest.mark.parametrize(
    "source",
    [
        "from megatron_lns.cluster.slurm.job import SlurmJob\n",
        "import megatron_lns.cluster.slurm.environment\n",
        "import os\njob = os.environ.get('SLURM_JOB_ID')\n",
        "import os\nend = os.environ['SLURM_JOB_END_TIME']\n",
    ],
)
def test_the_check_sees_a_backend_import_and_a_slurm_variable(tmp_path, source):
    (tmp_path / "module.py").write_text(source)
    assert len(_scheduler_uses(tmp_path / "module.py")) == 1
