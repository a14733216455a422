"""The package's layering: each module imports only from its own layer or below, and
no two modules import each other, however lazily (function-level imports count)."""

import ast
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "megatron_lns"

# Bottom to top, by package. A module may import from its own entry or any entry before it.
# The folders read as the flow: config -> model -> training -> convert / analysis / cluster
# -> commands. data sits below config because the config's checks read data formats.
LAYERS = [
    "base",
    "data",
    "config",
    "runtime",
    "planning",
    "model",
    "specs",  # megatron_lns.specs and .hybrid_specs: the old paths of Megatron-LM's --spec
    "hybrid_specs",
    "training",
    "convert",
    "analysis",
    "cluster",
    "launch",
    "commands",
    "cli",
]


# The process entry point of the command line may import from every layer.
ENTRY_POINTS = {"megatron_lns.cli"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ``megatron_lns`` module that ``path`` imports, anywhere in the file."""
    found = set()
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("megatron_lns"))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = _module_name(path).split(".")[: -node.level or None]
                module = ".".join([*base, module]) if module else ".".join(base)
            if module.startswith("megatron_lns"):
                found.add(module)
    found.discard(package)
    return found


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    assert top in LAYERS, f"{module} is not placed in LAYERS: decide where it belongs"
    return LAYERS.index(top)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        if name == "megatron_lns":
            continue
        targets = {m for m in _imports(path) if m in modules}
        # Importing a submodule from outside its package runs the package's __init__.
        for target in list(targets):
            package = target.rsplit(".", 1)[0]
            if package in modules and not name.startswith(package + "."):
                targets.add(package)
        graph[name] = targets - {"megatron_lns", name}
    return graph


def test_no_module_imports_from_a_layer_above_it():
    upward = [
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if module not in ENTRY_POINTS and _layer(target) > _layer(module)
    ]
    assert not upward


def test_import_graph_has_no_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles


MAX_MODULE_LINES = 600


def test_every_module_fits_in_a_readers_head():
    """No module over MAX_MODULE_LINES lines: a longer one holds more than one job."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split these modules by job: {long}"
