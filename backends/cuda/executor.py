"""The cuda executor's lowering step: generated kernels for fused regions (work in progress)."""
from __future__ import annotations


def attach_kernels(runnable, ctx, info):
    """Return `runnable` with generated kernels attached where a template covers a region."""
    return runnable
