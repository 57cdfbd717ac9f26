"""Names that passes and executors share, in a module that imports neither.

A pass and an executor often need the same vocabulary: the memory formats a layout region is in,
the name of the submodule that holds folded constants, the fused ops' activation names. Keeping
them here lets ``passes/`` and ``backends/`` agree without importing each other.
"""
from __future__ import annotations

import torch

#: the two memory formats fxopt's layout pass places values in
CL, NCHW = torch.channels_last, torch.contiguous_format

#: the submodule ``fold_constants`` installs; executors and packages evaluate it once
FOLDED_CONSTANTS_MODULE = "fxopt_constants"


def is_format(t: torch.Tensor, fmt) -> bool:
    """Whether ``t`` is dense in memory format ``fmt``."""
    return t.is_contiguous(memory_format=fmt)


def format_of(t: torch.Tensor):
    """``CL`` for a 4-D tensor that is channels_last and not also contiguous, ``NCHW`` for a
    contiguous one, ``None`` for anything else (a strided view)."""
    if t.dim() == 4 and is_format(t, CL) and not is_format(t, NCHW):
        return CL
    return NCHW if is_format(t, NCHW) else None
