"""The schedule stage: which nodes form one kernel, and the candidates measured for each."""
from __future__ import annotations

from typing import Optional

import torch.fx as fx


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
