"""What a benchmark backend is: a :class:`BackendSpec` whose ``prepare`` returns a :class:`Prepared`
callable, or raises :class:`BackendUnavailable` where it cannot run. Shared by the harness
(``fxopt.bench.runners``) and the backends (``fxopt.bench.peers``, ``fxopt.bench.ort_peer``,
``fxopt.bench.deploy``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Dict, Optional

import torch
from torch import nn


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (reported as ``unavailable: <reason>``)."""


@dataclasses.dataclass
class Prepared:
    fn: Callable[[torch.Tensor], Any]
    inputs: torch.Tensor
    tracks_memory: bool = True  # torch's caching allocator sees its memory
    note: str = ""
    #: what ran after the first call (the cpu executor's way per graph), or None
    ran: Optional[Callable[[], str]] = None


PrepareFn = Callable[[nn.Module, torch.Tensor, str, torch.dtype, Dict[str, Any]], Prepared]


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    name: str
    prepare: PrepareFn
    context: Callable[[], ContextManager] = contextlib.nullcontext
    default: bool = True
    needs_cuda: bool = False
    is_fxopt: bool = False
    deploy: bool = False  # built once, loaded without torch.compile (fxopt.bench.deploy)
