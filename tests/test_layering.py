"""Passes and executors do not import each other.

A pass learns what the executor offers from ``ctx.target`` (``fxopt.target``), built by the backend
entry, which sits above both; names both sides use live in ``fxopt.names``; ``fxopt.ops`` defines the
ops and their references, and an executor registers its own kernels for them. The import graph is
read from the source with ``ast`` as ``test_imports`` reads it: every import counts, those inside
functions too (only ``if TYPE_CHECKING:`` blocks are skipped).
"""
from __future__ import annotations

import pytest

from test_imports import find_modules, fxopt_graph, import_graph, package_dirs


def _under(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _violations(graph: dict, sources: str, forbidden: str) -> list[str]:
    return [f"{mod} imports {target} ({where})" for mod, edges in sorted(graph.items()) if _under(mod, sources)
            for target, where in sorted(edges.items()) if _under(target, forbidden)]


@pytest.fixture(scope="module")
def graph():
    return fxopt_graph()


def test_passes_import_nothing_from_backends(graph):
    assert any(_under(m, "fxopt.passes") for m in graph)  # the rule reads the real tree
    bad = _violations(graph, "fxopt.passes", "fxopt.backends")
    assert not bad, "\n".join(bad)


def test_ops_imports_nothing_from_backends(graph):
    assert "fxopt.ops" in graph
    bad = _violations(graph, "fxopt.ops", "fxopt.backends")
    assert not bad, "\n".join(bad)


def test_shared_modules_import_neither_side(graph):
    """The modules both sides read (names, the target record, the executor contract, the algorithm
    references) import neither passes nor executors."""
    for mod in ("fxopt.names", "fxopt.target", "fxopt.lowered", "fxopt.conv_algorithms", "fxopt.passinfra"):
        assert mod in graph, mod
        for side in ("fxopt.passes", "fxopt.backends"):
            bad = [t for t in graph[mod] if _under(t, side)]
            assert not bad, f"{mod} imports {bad}"


def test_backends_import_nothing_from_passes(graph):
    assert any(_under(m, "fxopt.backends.cuda") for m in graph)
    bad = _violations(graph, "fxopt.backends", "fxopt.passes")
    assert not bad, "\n".join(bad)


def test_the_rule_sees_imports_inside_functions(tmp_path):
    """A lazy import in a pass is an edge as much as a module-level one (and TYPE_CHECKING ones are not)."""
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"pkg" = "pkg"\n'
                                             '"pkg.passes" = "passes"\n"pkg.backends" = "backends"\n')
    for d in ("pkg", "passes", "backends"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "backends" / "cpu.py").write_text("X = 1\n")
    (tmp_path / "passes" / "layout.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.backends import cpu\n"
        "def f():\n    from pkg.backends.cpu import X\n    return X\n")
    g = import_graph(find_modules(package_dirs(tmp_path)))
    assert _violations(g, "pkg.passes", "pkg.backends") == [
        f"pkg.passes.layout imports pkg.backends.cpu ({tmp_path / 'passes' / 'layout.py'}:5)"]
    assert not _violations(g, "pkg.backends", "pkg.passes")


def test_ops_registers_no_executor_kernel_on_import():
    """Importing fxopt.ops (and fxopt) leaves batch_norm_relu's cudnn form without a kernel until an
    executor registers one: the reference refuses it rather than silently running something else."""
    import torch

    from fxopt import ops

    x = torch.randn(2, 3, 4, 4)
    c = torch.ones(3)
    with pytest.raises(RuntimeError, match="has no kernel"):
        ops.batch_norm_relu(x, c, c * 0, c * 0, c, None, 0.1, 1e-5, 0, "cudnn")
    y = ops.batch_norm_relu(x, c, c * 0, c * 0, c, None, 0.1, 1e-5, 0, "native")[0]
    torch.testing.assert_close(y, torch.relu(torch.nn.functional.batch_norm(x, None, None, c, c * 0, True)))

