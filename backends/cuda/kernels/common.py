"""What every kernel family shares: the candidate base classes (``TemplateCandidate``, and
``LibraryCandidate`` for a library call with nothing to compile), the base of a measured group of
nodes (``NodeGroup``), reading a graph node's value and static ints, the dense strides of a
layout, and the launch plumbing below the families: the compiled kernel of a source, layout /
weight checks, and the families' ``.cu`` templates (``kernels/templates/``, package data). Plain
torch: the checks run without a GPU."""
from __future__ import annotations

import functools
from importlib import resources
from string import Template
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen.source import KernelSource


def node_val(a):
    """The value recorded for a graph node (None for anything else)."""
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def ints(v, n: int = 2) -> Optional[tuple]:
    """A scalar or list of ``n`` static ints as a tuple (None when symbolic or of another length)."""
    v = list(v) if isinstance(v, (list, tuple)) else [v] * n
    return tuple(int(x) for x in v) if len(v) == n and all(isinstance(x, int) for x in v) else None


def dense_strides(layout: str, shape) -> tuple:
    """The strides of a dense (N, C, H, W) tensor in ``layout`` ("nchw" / "nhwc")."""
    n, c, h, w = shape
    return (c * h * w, h * w, w, 1) if layout == "nchw" else (h * w * c, 1, w * c, c)


class TemplateCandidate:
    """A candidate from one kernel template: ``sources`` to compile (one variant, key 0),
    ``kernels`` filled by the executor with the compiled ones, and a ``__call__`` (in the
    subclass) with the node's own signature that returns ``None`` where the run-time tensors do
    not fit what the kernel was generated for."""

    def __init__(self, name: str, source):
        self.name = name
        self.sources = {0: source}
        self.kernels: dict = {}

    @property
    def kernel(self):
        return self.kernels.get(0)


class LibraryCandidate:
    """A candidate with nothing to compile: ``fn`` (a library call with the node's signature),
    offered under the name ``key``."""

    def __init__(self, key: str, fn):
        self.key, self.fn = key, fn
        self.sources: dict = {}
        self.kernels: dict = {}

    def bind(self, reference):
        return self.fn


class NodeGroup:
    """Nodes measured as one kernel against the group as already chosen (``runtime/groups.py``): a
    family's group planner returns these. ``kind`` names the group in the autotuning key,
    ``nodes`` are the group's nodes in graph order (the new node goes after the last), ``candidates``
    the generated ones (``label``, ``sources``, ``kernels``, a ``__call__`` over ``args()`` that
    returns None where it declines) and ``keep_out`` the nodes the fusion scheduler must leave
    alone (for groups planned before it)."""

    kind = ""
    keep_out: frozenset = frozenset()

    def __init__(self, nodes: list, candidates: list):
        self.nodes, self.candidates = nodes, candidates

    def reference(self):
        """The group as its nodes' implementations are chosen now, over ``args()``."""
        raise NotImplementedError

    def args(self) -> tuple:
        raise NotImplementedError

    def meta(self) -> dict:
        raise NotImplementedError

    def replace(self, gm: fx.GraphModule, node: fx.Node) -> None:
        """Make ``node`` (computing the group) take the group's place and erase the group's nodes."""
        raise NotImplementedError


def meta(node) -> Optional[torch.Tensor]:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


@functools.lru_cache(maxsize=None)
def load(name: str) -> Template:
    """The kernel family template ``kernels/templates/<name>`` shipped with the package."""
    return Template(resources.files(__package__).joinpath("templates", name).read_text())


def compiled_kernel(ks: KernelSource, kernel):
    return kernel if kernel is not None else ks.compile()


def memory_layout_ok(t: torch.Tensor, layout: str) -> bool:
    """Dense in ``layout``: nchw = contiguous, nhwc = channels innermost (channels_last). Read from
    the sizes and strides where they are ints (as ``is_contiguous`` reads them: a dimension of size 1
    takes any stride, an empty tensor is dense); a FakeTensor's ``permute`` through its dispatch cost
    0.1-0.5 ms a call, and kernel planning asks this thousands of times a lowering."""
    order = list(range(t.dim())) if layout == "nchw" or t.dim() <= 2 else [0, *range(2, t.dim()), 1]
    sizes, strides = t.shape, t.stride()
    if not all(type(v) is int for v in (*sizes, *strides)):  # symbolic: as PyTorch decides it
        return t.is_contiguous() if order == sorted(order) else t.permute(*order).is_contiguous()
    if 0 in sizes:
        return True
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1:
            if strides[d] != expected:
                return False
            expected *= sizes[d]
    return True


def check_layout(t: torch.Tensor, layout: str, what: str, dtype=None) -> None:
    if not memory_layout_ok(t, layout):
        raise ValueError(f"{what}: expected a dense {layout} tensor, got strides {t.stride()}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{what}: expected {dtype}, got {t.dtype}")


def weight_layout_of(w: torch.Tensor) -> Optional[str]:
    """"oihw" (contiguous), "ohwi" (channels_last) or None for other strides."""
    if w.is_contiguous():
        return "oihw"
    if w.is_contiguous(memory_format=torch.channels_last):
        return "ohwi"
    return None


def weight_fits(w: torch.Tensor, weight_layout: str) -> bool:
    """The weight's memory is dense in the kernel's weight layout (a weight with 1x1 taps or one
    input channel is both)."""
    return w.is_contiguous(memory_format=torch.channels_last if weight_layout == "ohwi" else torch.contiguous_format)
