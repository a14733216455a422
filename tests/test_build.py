"""One build seam: only ``model.py`` constructs megatron's ``GPTModel``, and only
``build.py`` wraps chunks in ``Float16Module`` or megatron DDP or builds the optimizer
(``optim.py`` defines it). Everything else, the commands, benchmarks and GPU tests
included, builds through ``build.py``, so a rule of the stack (which precision gets
``Float16Module``, which DDP settings, which params dtype the optimizer gets) is
written once. The scan is of calls, lazy imports and aliases included."""

import ast

from helpers import ROOT

SCANNED = [ROOT / "megatron_lns", ROOT / "benchmarks", ROOT / "tests" / "gpu"]

# megatron class -> the modules (relative to ROOT) that may construct it.
MEGATRON_CLASSES = {
    "GPTModel": {"megatron_lns/model/language_model.py"},
    "DistributedDataParallel": {"megatron_lns/training/build.py"},
    "Float16Module": {"megatron_lns/training/build.py"},
}
# Functions that build an optimizer -> the modules that may call them.
OPTIMIZER_BUILDERS = dict.fromkeys(
    ("build_optimizer_and_scheduler", "build_optimizer", "get_megatron_optimizer"),
    frozenset({"megatron_lns/training/build.py", "megatron_lns/training/optim.py"}),
)


def _import_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it was imported as, for every import in the file."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr, names: dict[str, str]) -> str | None:
    """The dotted name a call's callee refers to (``mdist.DistributedDataParallel`` ->
    ``megatron.core.distributed.DistributedDataParallel``); None for other callees."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([names.get(node.id, node.id), *reversed(attrs)])


def seam_violations(source: str, module: str) -> list[str]:
    """``module:line: name`` for every construction or call in ``source`` that belongs
    in the build seam (or, for ``GPTModel``, in ``model.py``)."""
    tree = ast.parse(source)
    names = _import_names(tree)
    found = []
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    for node in sorted(calls, key=lambda call: (call.lineno, call.col_offset)):
        dotted = _dotted(node.func, names)
        if dotted is None:
            continue
        leaf = dotted.rsplit(".", 1)[-1]
        # A class of the same name from elsewhere (torch's DistributedDataParallel) is
        # not megatron's; an unresolved one (no import seen) is taken to be.
        if leaf in MEGATRON_CLASSES and (dotted == leaf or dotted.startswith("megatron.")):
            allowed = MEGATRON_CLASSES[leaf]
        elif leaf in OPTIMIZER_BUILDERS:
            allowed = OPTIMIZER_BUILDERS[leaf]
        else:
            continue
        if module not in allowed:
            found.append(f"{module}:{node.lineno}: {leaf}")
    return found


def test_only_the_build_seam_assembles_models_and_optimizers():
    violations = []
    for directory in SCANNED:
        for path in sorted(directory.rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            violations += seam_violations(path.read_text(), module)
    assert not violations, "build these through megatron_lns/training/build.py: " + ", ".join(
        violations
    )


def test_the_scan_finds_each_kind_of_violation():
    source = """
import megatron.core.models.gpt as gpt_models
import torch
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron_lns.training.optim import build_optimizer_and_scheduler


def build(config, chunk):
    from megatron.core.transformer.module import Float16Module
    from megatron.core.optimizer import get_megatron_optimizer

    model = gpt_models.GPTModel(config=config)
    wrapped = DDP(config=config, module=Float16Module(config, chunk))
    build_optimizer_and_scheduler([wrapped], None, 10)
    get_megatron_optimizer(config, [wrapped])
"""
    found = seam_violations(source, "megatron_lns/analyze.py")
    assert [v.rsplit(": ", 1)[1] for v in found] == [
        "GPTModel",
        "DistributedDataParallel",
        "Float16Module",
        "build_optimizer_and_scheduler",
        "get_megatron_optimizer",
    ]
    assert found[0].startswith("megatron_lns/analyze.py:12:")


def test_the_scan_allows_the_seam_and_other_libraries():
    wrapping = """
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.module import Float16Module

DistributedDataParallel(config=None, module=Float16Module(None, None))
"""
    assert seam_violations(wrapping, "megatron_lns/training/build.py") == []
    assert len(seam_violations(wrapping, "benchmarks/gpu_check.py")) == 2
    assert (
        seam_violations(
            "from megatron.core.models.gpt import GPTModel\nGPTModel()\n",
            "megatron_lns/model/language_model.py",
        )
        == []
    )
    elsewhere = """
from collections.abc import Sequence

import torch
from megatron.core.distributed import DistributedDataParallel

torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))


def step(model: Sequence[DistributedDataParallel]) -> None:
    pass
"""
    assert seam_violations(elsewhere, "megatron_lns/training/step.py") == []
