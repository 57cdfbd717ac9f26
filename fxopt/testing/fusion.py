"""Checking the fusion scheduler without a GPU: ``check_fusion(case)``.

For each graph fxopt compiles for ``case`` (a ``CNNCase``), the optimized ATen graph is scheduled
into regions and, on the CPU with the case's real inputs:

- every region's IR kernel, run by ``ir.evaluate`` (the generated code's semantics: the same loads
  at the same offsets, float32 math), matches the region's ATen ops (values within the dtype's
  tolerance; shapes and strides exactly);
- the rewritten graph (each region one node running its reference) gives the graph's outputs;
- with ``compile_kernels=True`` every generated source compiles with NVRTC (for sm_90).

Returns the list of ``Schedule``s. On a GPU, ``check_equivalence(case, {"executor": "cuda"})``
runs the generated kernels themselves.
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx

from fxopt.tolerances import tolerance

#: regions checked by check_fusion in this process
REGIONS_CHECKED = 0


def capture(model, inputs, options=None) -> list:
    """[(GraphReport, real inputs)] of every graph fxopt compiles for ``model(*inputs)``."""
    from fxopt.backend import fxopt_backend

    captured: list = []

    def backend(gm, example_inputs):
        graphs: list = []
        fn = fxopt_backend(gm, example_inputs, options=options, _sink=graphs)
        captured.append((graphs, list(example_inputs)))
        return fn
    torch.compiler.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(*inputs)
    torch.compiler.reset()
    return [(g, ex) for graphs, ex in captured for g in graphs]


def _values(gm: fx.GraphModule, inputs: list) -> dict:
    vals: dict = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            v = super().run_node(n)
            vals[n] = v
            return v
    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return vals


def check_fusion(case, options=None, compile_kernels: bool = False) -> list:
    from fxopt.backends import torch_ref
    from fxopt.backends.cuda.schedule.fusion import rewrite, schedule, split_conv_epilogues
    from fxopt.backends.cuda.schedule.generated import RegionReference

    rtol, atol = tolerance(case.dtype)
    opts = dict(options or {})
    opts.setdefault("executor", "torch")
    schedules = []
    for report, example in capture(copy.deepcopy(case.model), case.inputs, opts):
        if report.fallback is not None:
            raise AssertionError(f"fxopt fell back: {report.fallback}")
        gm = torch_ref.lower(report.after)
        split_conv_epilogues(gm)  # as the cuda executor does
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example):
            continue  # AOTAutograd changed the inputs: no real values to check with
        vals = _values(gm, example)
        schedules.append(check_regions(gm, example, rtol, atol, compile_kernels, vals))
        expected = [vals[n] for n in _outputs(gm)]
        rewritten = torch_ref.lower(report.after)
        split_conv_epilogues(rewritten)
        regions = schedule(rewritten, strict=True).regions
        rewrite(rewritten, regions, [RegionReference(rewritten, r) for r in regions])
        rewritten.graph.lint()
        with torch.no_grad():
            got = rewritten(*example)
        got = list(got) if isinstance(got, (list, tuple)) else [got]
        for g, e in zip(got, expected):
            if isinstance(e, torch.Tensor):
                torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)
    return schedules


def check_regions(gm: fx.GraphModule, inputs: list, rtol: float, atol: float, compile_kernels: bool = False,
                  vals: dict | None = None):
    """Schedule ``gm`` (nodes carrying FakeTensor metadata) and check every region's IR kernel,
    run by ``ir.evaluate`` on ``inputs``, against the region's ATen ops; returns the Schedule."""
    global REGIONS_CHECKED
    from fxopt.backends.cuda.schedule import ir
    from fxopt.backends.cuda.schedule.fusion import reference_module, schedule

    vals = _values(gm, inputs) if vals is None else vals
    sched = schedule(gm, strict=True)
    for region in sched.regions:
        k = region.kernel
        ins = [vals[n] for n in region.inputs]
        outs = [torch.full(b.shape, float("nan"), dtype=b.dtype).as_strided(b.shape, b.strides)
                if _dense_fill(b) else torch.empty_strided(b.shape, b.strides, dtype=b.dtype) for b in k.outputs]
        ir.evaluate(k, ins, outs)
        ref = reference_module(gm, region)(*ins)
        for o, r, b in zip(outs, ref, k.outputs):
            torch.testing.assert_close(o, r, rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m, n=region.name: f"region {n} ({region.ops}): {m}")
            assert all(d == 1 or s == t for d, s, t in zip(o.shape, o.stride(), r.stride())), \
                f"region {region.name}: strides {o.stride()} != {r.stride()}"
        if compile_kernels:
            _compile(k)
        REGIONS_CHECKED += 1
    return sched


def _dense_fill(b) -> bool:
    return b.numel > 0 and b.span() == b.numel


def _outputs(gm: fx.GraphModule) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, fx.Node)]


def _compile(k) -> None:
    from fxopt.backends.cuda.codegen.kernel import generate_kernel, vector_width
    from fxopt.backends.cuda.compiler import compile_kernel

    for vec in sorted({vector_width(k), 1}):
        ks = generate_kernel(k, vec)
        compile_kernel(ks.source, ks.name, "sm_90", (), ks.param_types)
