"""The package's structure, read from its source: layers, import direction, module size.

The folders show the data flow and imports only point down, so a newcomer can read the package
bottom-up and test the lower layers without a cluster.  These tests keep it so.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "downpour_dask"

#: Each layer may import only from layers with a lower rank (and from its own folder).
RANKS = {
    "_version": 0,
    "core": 0,
    "data": 1,
    "log": 1,
    "checkpoint": 1,
    "progress": 2,
    "liveplot": 2,
    "report": 2,
    "runtime": 2,
    "simulate": 2,
    "ps": 3,
    "base": 4,
    "publishing": 4,
    "inputs": 4,
    "live": 5,
    "downpour": 6,
    "sandblaster": 6,
    "runs": 7,
    "cli": 8,
    "__init__": 9,
    "__main__": 10,
}
#: Layers that must run without Dask: plain numpy (and pyarrow/pandas for data files).
NO_DASK = ("core", "data", "log", "checkpoint", "progress", "liveplot", "report", "simulate")
#: Third-party imports that may be deferred into a function: optional extras.  matplotlib draws
#: plots; the two JAX modules of core import jax at their top, and ``models.from_jax`` / ``cnn`` /
#: ``jax_mlp`` / ``from_config`` reach them only when a JAX model is built, so that
#: ``import downpour_dask`` works without the optional ``jax`` extra.
OPTIONAL = ("matplotlib", "downpour_dask.core.jax_model", "downpour_dask.core.jax_nets")
#: The package's own imports deferred on purpose, by the module that defers them: the command
#: answers ``downpour-dask --version`` before importing the estimators, and with them Dask.
DEFERRED = {"downpour_dask.cli": ("downpour_dask.cli.app",)}
MAX_LINES = 400


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _layer(module: str) -> str:
    """``downpour_dask.ps.wire`` -> ``ps``; ``downpour_dask.log`` -> ``log``; names imported
    from the package itself (``from downpour_dask import models``) -> the name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(absolute module imported, whether the import sits inside a function) for every import."""
    tree = ast.parse(path.read_text())
    package = _name(path).rsplit(".", 1)[0]  # a package's __init__ counts as inside it
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, nested) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                found.append((module, nested))
                # ``from .core import models``: the names may be modules themselves
                found.extend((f"{module}.{alias.name}", nested) for alias in child.names)
            visit(child, inner)

    visit(tree, False)
    return found


MODULES = _modules()
IDS = [_name(p) for p in MODULES]


@pytest.mark.parametrize("path", MODULES, ids=IDS)
def test_imports_point_down_the_layers(path):
    here = _layer(_name(path))
    upward = [
        module
        for module, _ in _imports(path)
        if module.startswith("downpour_dask.")
        and _layer(module) in RANKS
        and _layer(module) != here
        and RANKS[_layer(module)] >= RANKS[here]
    ]
    assert not upward, f"{_name(path)} ({here}, rank {RANKS[here]}) imports upward: {upward}"


@pytest.mark.parametrize("path", MODULES, ids=IDS)
def test_no_import_is_hidden_inside_a_function(path):
    hidden = [
        module
        for module, nested in _imports(path)
        if nested and not module.startswith(OPTIONAL) and module != "__future__"
        and not module.startswith(DEFERRED.get(_name(path).removesuffix(".__init__"), ("-",)))
    ]
    assert not hidden, f"{_name(path)} imports inside a function: {hidden}"


@pytest.mark.parametrize("path", [p for p in MODULES if _layer(_name(p)) in NO_DASK], ids=str)
def test_numpy_core_and_data_layer_import_no_dask(path):
    dask = [m for m, _ in _imports(path) if m.split(".")[0] in ("dask", "distributed")]
    assert not dask, f"{_name(path)} imports {dask}"


def test_the_parameter_server_knows_nothing_of_the_algorithms():
    for path in (PACKAGE / "ps").glob("*.py"):
        above = [
            m for m, _ in _imports(path) if _layer(m) in ("downpour", "sandblaster", "base")
        ]
        assert not above, f"{_name(path)} imports {above}"


def test_no_import_loop_inside_a_layer():
    graph = {
        _name(p): {m for m, _ in _imports(p) if m in IDS or f"{m}.__init__" in IDS}
        for p in MODULES
    }
    state: dict[str, int] = {}

    def walk(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError(f"import loop: {' -> '.join([*trail, node, nxt])}")
            if nxt not in state:
                walk(nxt, [*trail, node])
        state[node] = 2

    for node in graph:
        if node not in state:
            walk(node, [])


#: What a worker process loads to run a fit's tasks and actors.  Kept free of scikit-learn: its
#: import (with SciPy's parts it pulls) is a second of CPU in every new worker process, and a
#: replica needs none of it.
WORKER_SIDE = (
    "downpour_dask.downpour.tasks",
    "downpour_dask.downpour.sparse_task",
    "downpour_dask.ps.shard",
    "downpour_dask.ps.table",
    "downpour_dask.sandblaster.tasks",
    "downpour_dask.sandblaster.shard",
)


def test_what_runs_on_workers_imports_no_scikit_learn():
    paths = dict(zip(IDS, MODULES))
    imported = {name: [m for m, nested in _imports(path) if not nested]
                for name, path in paths.items()}
    todo, loaded = list(WORKER_SIDE), set()
    while todo:
        name = todo.pop()
        parts = name.split(".")
        # importing a module runs its packages' __init__ first
        chain = [".".join(parts[:i]) + ".__init__" for i in range(1, len(parts))]
        for module in [*chain, name]:
            if module in paths and module not in loaded:
                loaded.add(module)
                todo.extend(m if m in paths else f"{m}.__init__" for m in imported[module])
    assert len(loaded) > len(WORKER_SIDE)  # the walk followed the imports
    sklearn = {m: [i for i in imported[m] if i.split(".")[0] == "sklearn"] for m in loaded}
    assert not {m: found for m, found in sklearn.items() if found}


@pytest.mark.parametrize("path", MODULES, ids=IDS)
def test_modules_are_short_and_say_what_they_own(path):
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"{_name(path)} has {lines} lines; split it (at most {MAX_LINES})"
    if text.strip():
        assert ast.get_docstring(ast.parse(text)), f"{_name(path)} has no module docstring"
