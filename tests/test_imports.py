"""No import circles between fxopt's modules.

A circle makes the import order matter (a module sees its partner half-initialised) and hides which
layer owns what: the pass list in the pipeline, the options in config, the exporter's shared
helpers in one place. The graph is read from the source with ``ast``, not by importing: every
``import``/``from ... import`` anywhere in a module counts, inside functions too (a lazy import
still ties the two modules together), except under ``if TYPE_CHECKING:``. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``; ``import a.b.c`` is an edge to
``a.b.c`` alone (Python runs the packages' ``__init__`` first, but those are the packages' own edges).
Module names follow pyproject's package-dir mapping (``fxopt.passes`` is ``passes/``,
``fxopt.backends`` is ``backends/``).
"""
from __future__ import annotations

import ast
import os
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Circles inside backends/cuda/ known today, each a frozenset of module names; every entry must
# lie inside fxopt.backends.cuda and still exist. Empty this list, never grow it.
KNOWN_CUDA_CYCLES: list[frozenset[str]] = []


def package_dirs(repo: Path) -> dict[str, Path]:
    """Top-level package name -> directory, from pyproject's [tool.setuptools.package-dir]."""
    with open(repo / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {pkg: repo / d for pkg, d in mapping.items()}


def find_modules(dirs: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__) for every .py file under the mapped dirs."""
    mods: dict[str, tuple[Path, bool]] = {}
    for pkg, base in sorted(dirs.items()):
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if (Path(dirpath) / d / "__init__.py").exists())
            rel = Path(dirpath).relative_to(base).parts
            for f in filenames:
                if f.endswith(".py"):
                    parts = [pkg, *rel] + ([] if f == "__init__.py" else [f[:-3]])
                    mods[".".join(parts)] = (Path(dirpath) / f, f == "__init__.py")
    return mods


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(mods: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line" of the first such import} (modules of `mods` only)."""
    def known(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, str]] = {m: {} for m in mods}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            else:
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module
                targets = [known(f"{src}.{a.name}") if f"{src}.{a.name}" in mods else known(src)
                           for a in node.names]
            for t in targets:
                if t is not None and t != mod:
                    graph[mod].setdefault(t, f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}"
                                             f":{node.lineno}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One circle (a list of modules, first repeated last) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in comps:  # the shortest way back to the component's first module, within it
        start = min(comp)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nxt = sorted(w for w in graph[path[-1]] if w in comp)
            if start in nxt:
                out.append(path + [start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return out


def describe(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    return "\n".join(f"  {a} -> {b}  ({graph[a][b]})" for a, b in zip(cycle, cycle[1:]))


def fxopt_graph():
    return import_graph(find_modules(package_dirs(REPO)))


def test_no_import_cycles():
    graph = fxopt_graph()
    found = [c for c in cycles(graph) if frozenset(c) not in KNOWN_CUDA_CYCLES]
    assert not found, "import circles:\n" + "\n\n".join(describe(c, graph) for c in found)


def test_known_cycles_are_cuda_only_and_still_there():
    present = {frozenset(c) for c in cycles(fxopt_graph())}
    for known in KNOWN_CUDA_CYCLES:
        assert all(m.startswith("fxopt.backends.cuda.") for m in known), known
        assert known in present, f"no longer a circle, remove it from KNOWN_CUDA_CYCLES: {sorted(known)}"


def test_graph_sees_mapped_dirs_relative_and_function_level_imports():
    graph = fxopt_graph()
    assert "fxopt.passes.layout" in graph["fxopt.pipeline"]              # passes/ is fxopt.passes
    assert "fxopt.passinfra" in graph["fxopt.passes.layout"]
    assert "fxopt.fft_conv" in graph["fxopt.conv_algorithms"]  # relative import
    assert "fxopt.backends.onnxrt" in graph["fxopt.backends"]           # `from x import y` in a function
    assert "fxopt.pipeline" not in graph["fxopt.config"]


def test_a_circle_is_found_and_printed(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("import pkg.a\nfrom typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pkg import d\n")
    (pkg / "d.py").write_text("from . import c\n")
    graph = import_graph(find_modules({"pkg": pkg}))
    found = cycles(graph)
    assert found == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]], found
    text = describe(found[0], graph)
    assert "pkg.sub.b -> pkg.c" in text and "b.py:2" in text


# The cuda executor's layers, lowest first: an arrow (an import) may point down or sideways, never
# up. The IR and the C emission helpers know nothing of kernels; a kernel family knows nothing of
# the scheduler; the scheduler nothing of measuring, CUDA graphs or the executor.
CUDA_LAYERS = {"ir": 0, "compiler": 0, "codegen": 1, "kernels": 2, "schedule": 3, "runtime": 4}


def cuda_layer(module: str):
    """The layer of a module of ``fxopt.backends.cuda`` (None for the package's own ``__init__``)."""
    parts = module.split(".")
    return CUDA_LAYERS[parts[3]] if len(parts) > 3 else None


def upward_cuda_imports(graph: dict[str, dict[str, str]]) -> list[str]:
    out = []
    for mod, targets in sorted(graph.items()):
        if not mod.startswith("fxopt.backends.cuda.") or cuda_layer(mod) is None:
            continue
        for t, where in sorted(targets.items()):
            if t.startswith("fxopt.backends.cuda.") and cuda_layer(t) is not None and cuda_layer(t) > cuda_layer(mod):
                out.append(f"{where}: {mod} imports {t} (layer {mod.split('.')[3]} -> {t.split('.')[3]})")
    return out


def test_cuda_imports_run_one_way():
    graph = fxopt_graph()
    cuda = [m for m in graph if m.startswith("fxopt.backends.cuda.")]
    assert all(cuda_layer(m) is not None for m in cuda if m.count(".") > 2), "a cuda module outside the layers"
    found = upward_cuda_imports(graph)
    assert not found, "imports against the layers (runtime > schedule > kernels > codegen > ir, compiler):\n" + "\n".join(found)


def test_an_upward_cuda_import_is_named_with_its_line():
    graph = {"fxopt.backends.cuda.kernels.pool": {"fxopt.backends.cuda.runtime.measure": "backends/cuda/kernels/pool.py:7"},
             "fxopt.backends.cuda.runtime.measure": {"fxopt.backends.cuda.kernels.pool": "backends/cuda/runtime/measure.py:3"}}
    assert upward_cuda_imports(graph) == [
        "backends/cuda/kernels/pool.py:7: fxopt.backends.cuda.kernels.pool imports fxopt.backends.cuda.runtime.measure "
        "(layer kernels -> runtime)"]
