"""The few internals of the CUDA backend the fuzzer uses on the CPU, imported lazily by name: the
region code generator moved from ``codegen/`` (``kernel.py``, ``row_reduction.py``, ``schedule/ir.py``)
to kernel families (``kernels/region.py``, ``kernels/reduction.py``, ``ir/``); both layouts are tried,
the newer first."""
from __future__ import annotations

import importlib

_WHERE = {
    "generate_kernel": ("fxopt.backends.cuda.kernels.region", "fxopt.backends.cuda.codegen.kernel"),
    "vector_width": ("fxopt.backends.cuda.kernels.pointwise", "fxopt.backends.cuda.kernels.region",
                     "fxopt.backends.cuda.codegen.kernel"),
    "row_plan": ("fxopt.backends.cuda.kernels.reduction", "fxopt.backends.cuda.codegen.row_reduction"),
    "row_vector_width": ("fxopt.backends.cuda.kernels.reduction", "fxopt.backends.cuda.codegen.row_reduction"),
    "schedule": ("fxopt.backends.cuda.schedule.fusion",),
    "split_conv_epilogues": ("fxopt.backends.cuda.schedule.rewrite", "fxopt.backends.cuda.schedule.fusion"),
    "ReductionKernel": ("fxopt.backends.cuda.ir", "fxopt.backends.cuda.ir.kernel", "fxopt.backends.cuda.schedule.ir"),
    "lower": ("fxopt.backends.torch_ref",),
    "generate_tiled": ("fxopt.backends.cuda.kernels.transpose",),
    "element_work": ("fxopt.backends.cuda.kernels.column_reduction",),
    "underfilled": ("fxopt.backends.cuda.kernels.column_reduction",),
    "LATENCY_WORK": ("fxopt.backends.cuda.kernels.column_reduction",),
}


def get(name: str):
    """The object ``name`` from the first module of its candidates that has it."""
    errors = []
    for mod in _WHERE[name]:
        try:
            obj = getattr(importlib.import_module(mod), name, None)
        except ImportError as e:
            errors.append(f"{mod}: {e}")
            continue
        if obj is not None:
            return obj
        errors.append(f"{mod}: no {name}")
    raise ImportError(f"{name} not found: " + "; ".join(errors))


def reduction_kernels(model, inputs, options=None) -> list:
    """[(region name, ReductionKernel)] of every reduction region the fusion scheduler forms for
    ``model(*inputs)`` (on the inputs' device; nothing runs on a GPU)."""
    from fxopt.testing.fusion import capture

    schedule, lower, split = get("schedule"), get("lower"), get("split_conv_epilogues")
    out = []
    for report, _ in capture(model, inputs, {"executor": "torch", **(options or {})}):
        gm = lower(report.after)
        split(gm)
        for region in schedule(gm, strict=True).regions:
            if hasattr(region.kernel, "reduced"):
                out.append((region.name, region.kernel))
    return out


def reduction_sources(k, fast_math: bool = False) -> list:
    """The KernelSources a region kernel ``k`` is generated as: its widest vector width and scalar,
    and a column reduction's other plans as well: of heavy math, planned for that (``element_work``),
    and under-filled, the latency plan (``underfilled``)."""
    generate_kernel, vector_width = get("generate_kernel"), get("vector_width")
    widths = sorted({vector_width(k), 1}, reverse=True)
    out = [generate_kernel(k, vec, fast_math) for vec in widths]
    if getattr(k, "strategy", None) != "outer":
        return out
    works = [w for w in [get("element_work")(k)] if w > 1]
    try:
        if get("underfilled")(k, vector_width(k)):
            works.append(get("LATENCY_WORK"))
    except ImportError:  # a backend without latency plans
        pass
    return out + [generate_kernel(k, vec, fast_math, w) for w in works for vec in widths]


def tiled_source(k, fast_math: bool = False):
    """The shared-memory-tile candidate of a transposing pointwise kernel ``k``, or None."""
    return get("generate_tiled")(k, fast_math)
