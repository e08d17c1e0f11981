"""The layering of docs/ARCHITECTURE.md, checked from the code's own imports (module level and inside
functions: a deferred import is still a dependency).

Layers, bottom up: ``base/``; ``collectives/`` and ``gpu/`` side by side (neither imports the other); ``hpczeco/``
(maths and API); ``drivers/`` (programs, the CLI). ``devtools/`` is not installed and may import anything.
No file imports a layer above its own (the one exception: ``hpczeco/__main__.py`` runs ``drivers/cli.py``);
``gpu/`` and ``base/`` never import mpi4py; no two files import each other, directly or around a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"base": "hpczeco.base", "collectives": "hpczeco.collectives", "gpu": "hpczeco.gpu",
            "drivers": "hpczeco.drivers", "hpczeco": "hpczeco"}
LEVEL = {"base": 0, "collectives": 1, "gpu": 1, "hpczeco": 2, "drivers": 3}
ALLOWED_UP = {("hpczeco/__main__.py", "drivers/cli.py")}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every installed Python file."""
    out = {}
    for folder, pkg in PACKAGES.items():
        for f in sorted((REPO / folder).rglob("*.py")):
            rel = f.relative_to(REPO / folder).with_suffix("")
            parts = [] if rel.parts == ("__init__",) else list(rel.parts)
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([pkg, *parts])
            if folder == "hpczeco" and any(name.startswith(p + ".") or name == p for p in
                                           ("hpczeco.base", "hpczeco.collectives", "hpczeco.gpu", "hpczeco.drivers")):
                continue
            out[name] = f
    return out


MODULES = _modules()


def _layer(path: Path) -> str:
    return path.relative_to(REPO).parts[0]


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``path`` imports (resolving relative imports and ``from pkg import module``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # the longest prefix that is a project module
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a package's own __init__ is not a dependency
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _rel(name: str) -> str:
    return str(MODULES[name].relative_to(REPO))


def test_the_graph_is_read():
    assert len(MODULES) > 100
    assert "hpczeco.gpu.gla_varlen" in GRAPH["hpczeco.gla.chunk"]  # a relative import inside a function body too
    assert "hpczeco.collectives.timed" in GRAPH["hpczeco.zeco"]


def test_no_import_runs_up_a_layer():
    up = []
    for name, deps in GRAPH.items():
        src = _layer(MODULES[name])
        for d in deps:
            dst = _layer(MODULES[d])
            pair = (_rel(name), _rel(d))
            if LEVEL[dst] > LEVEL[src] and pair not in ALLOWED_UP:
                up.append(pair)
            elif LEVEL[dst] == LEVEL[src] and src != dst:  # collectives/ and gpu/ stand side by side
                up.append(pair)
    assert not up, f"imports running up (or across) a layer: {sorted(up)}"


@pytest.mark.parametrize("folder", ["gpu", "base"])
def test_no_mpi_below_collectives(folder):
    speaking = []
    for name, path in MODULES.items():
        if _layer(path) == folder and "mpi4py" in path.read_text():
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(m.split(".")[0] == "mpi4py" for m in mods):
                    speaking.append(_rel(name))
    assert not speaking, f"{folder}/ imports mpi4py: {speaking}"


def test_no_import_circle():
    """Tarjan's strongly connected components of the file graph: every component is one file."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(_rel(c) for c in comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("package, internals", [
    ("hpczeco", {"zeco", "gla", "SCANS"}),
    ("hpczeco.collectives", {"agree_fast", "local_error", "collective_check", "relay_recv", "relay_send",
                             "check_blocks", "check_topology", "check_transport_name"}),
    ("hpczeco.gla", {"check_gla_call", "split_forward", "ForwardSplit", "Geom", "run_units"}),
    ("hpczeco.torch", {"ChunkGLAFunction", "ZeCOGLAFunction", "check_tensors"}),
])
def test_package_exports_name_what_users_call(package, internals):
    """Each package's ``__all__`` lists what users call, every entry resolves, and the library's internals are
    not among them (they are imported from their submodules)."""
    import importlib

    if package == "hpczeco.torch":
        pytest.importorskip("torch")
    mod = importlib.import_module(package)
    assert mod.__all__ and len(set(mod.__all__)) == len(mod.__all__)
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name
    assert not internals & set(mod.__all__), internals & set(mod.__all__)
    if package != "hpczeco":  # the lazy package has the subpackages as attributes once imported
        assert not internals & set(vars(mod)) - {"zeco", "gla"}, internals & set(vars(mod))
