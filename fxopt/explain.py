"""``fxopt.explain(model, *inputs)``: run the pipeline on a model and report what it did."""
from __future__ import annotations

import torch

from fxopt.config import Options
from fxopt.pipeline import ALL_PASS_NAMES
from fxopt.report import Report


def explain(model, *example_inputs, options=None, training: bool = False, dynamic: bool = False) -> Report:
    """Capture `model` on `example_inputs`, run the fxopt pipeline and return a Report.

    Inference (the default) runs under ``torch.no_grad()``, as ``torch.compile`` would for
    inference; ``training=True`` captures the forward and backward graphs instead.
    ``dynamic=True`` compiles with symbolic sizes (``torch.compile(dynamic=True)``) and runs the
    inputs and, where their batch can grow, the batch plus one: the report then says which
    dimensions are symbolic and which sizes were specialized at what cost (``fxopt.dynamic``).
    No ``torch.compile`` call is needed from the caller, and the model is not modified.
    Capturing goes through Dynamo, whose per-code caches are cleared afterwards
    (``torch.compiler.reset()``): models compiled earlier recompile on their next call.
    """
    from fxopt.backend import fxopt_backend

    opts = Options.from_any(options, ALL_PASS_NAMES)
    graphs: list = []

    def capture(gm, inputs):
        return fxopt_backend(gm, inputs, options=opts, _sink=graphs)

    compiled = torch.compile(model, backend=capture, dynamic=dynamic)
    counts = {}
    try:
        _run(compiled, example_inputs, training)
        if dynamic and all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in example_inputs):
            _run(compiled, [torch.cat([t, t[:1]]) for t in example_inputs], training)
        if not training and _on_cuda(example_inputs):
            counts = {"fxopt": kernel_launches(compiled, example_inputs),
                      "eager": kernel_launches(model, example_inputs)}
    finally:
        torch.compiler.reset()
    return Report(graphs, counts)


def _on_cuda(inputs) -> bool:
    return torch.cuda.is_available() and any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)


def kernel_launches(fn, inputs) -> int:
    """GPU kernels one inference call of ``fn`` runs (torch.profiler's CUDA kernel events; those
    of a replayed CUDA graph count one by one), after two warm-up calls."""
    return kernel_profile(fn, inputs)[0]


def kernel_profile(fn, inputs, top: int = 0) -> tuple[int, list]:
    """``(kernels, rows)`` of one inference call of ``fn`` after two warm-up calls: the GPU kernels it
    launches (torch.profiler's CUDA kernel events, a replayed CUDA graph's one by one) and its
    ``top`` kernels by GPU time, ``[name, launches, µs]`` each, the longest first."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(2):
            fn(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*inputs)
            torch.cuda.synchronize()
    per: dict = {}
    for e in prof.events():
        if getattr(e, "device_type", None) is None or e.device_type.name != "CUDA" \
                or e.name.startswith(("Memcpy", "Memset")):
            continue
        row = per.setdefault(e.name, [e.name, 0, 0.0])
        row[1] += 1
        row[2] += getattr(e, "device_time", 0.0) or 0.0
    rows = sorted(per.values(), key=lambda r: -r[2])[:top]
    return sum(r[1] for r in per.values()), [[n, k, round(us, 1)] for n, k, us in rows]


def _run(compiled, example_inputs, training: bool) -> None:
    if training:
        out = compiled(*example_inputs)
        tensors = [t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
        sum(t.float().sum() for t in tensors if t.requires_grad).backward()
    else:
        with torch.no_grad():
            compiled(*example_inputs)
