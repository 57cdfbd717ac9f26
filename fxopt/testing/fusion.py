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
import torch.utils._pytree as pytree

from fxopt.tolerances import max_error, tolerance

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


def scheduled(model, inputs, options=None, flag=None) -> tuple:
    """(the optimized graph of ``model(*inputs)`` as the cuda executor schedules it, its ``Schedule``):
    the pipeline with ``options`` (executor torch), convolution epilogues split off as the executor
    does. ``flag``: (a module, a value) for its ``ENABLED`` switch during the call (``copies``,
    ``consumers``)."""
    from fxopt.backends import torch_ref
    from fxopt.backends.cuda.schedule.fusion import schedule
    from fxopt.backends.cuda.schedule.rewrite import split_conv_epilogues

    (report, _), = capture(model, tuple(inputs), {"executor": "torch", **(options or {})})
    gm = torch_ref.lower(report.after)
    split_conv_epilogues(gm)
    module, value = flag if flag is not None else (None, None)
    old = getattr(module, "ENABLED", None)
    if module is not None:
        module.ENABLED = value
    try:
        return gm, schedule(gm, strict=True)
    finally:
        if module is not None:
            module.ENABLED = old


def _values(gm: fx.GraphModule, inputs: list) -> dict:
    """Every node's value on ``inputs``, laid out with the strides of its metadata where this
    device's kernel gives others (torch's CPU ``native_group_norm`` keeps channels_last where its
    metadata, which the graph was planned with, and its CUDA kernel do not)."""
    vals: dict = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            v = super().run_node(n)
            fake = n.meta.get("val")
            if (isinstance(v, torch.Tensor) and isinstance(fake, torch.Tensor) and v.shape == fake.shape
                    and not v.is_sparse and not _same_strides(v, fake.stride())):
                v = torch.empty_strided(tuple(v.shape), tuple(fake.stride()), dtype=v.dtype,
                                        device=v.device).copy_(v)
            vals[n] = v
            return v
    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return vals


def check_fusion(case, options=None, compile_kernels: bool = False) -> list:
    from fxopt.backends import torch_ref
    from fxopt.backends.cuda.schedule.fusion import schedule
    from fxopt.backends.cuda.schedule.rewrite import rewrite, split_conv_epilogues
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
        rvals = _values(rewritten, example)  # as planned: see _values
        got = [rvals[n] for n in _outputs(rewritten)]
        for g, e in zip(got, expected):
            if isinstance(e, torch.Tensor):
                torch.testing.assert_close(g, e, **_same_ops_tolerance(e), equal_nan=True)
    return schedules


def _same_ops_tolerance(e: torch.Tensor) -> dict:
    """How far the rewritten graph's value may lie from the original's: the same ATen ops, but an op
    may get its input with other strides after the rewrite, and torch's CPU kernels round the last
    bits of a strided view differently from a dense one (a vectorized and a scalar loop: GELU of a
    channel chunk of a channels_last tensor, 1-2 units in the last place of the tensor's largest
    value; CPU fuzz seed 2066, 5e739dc93a). So a few units in the last place, at the scale of the
    tensor's largest value; exact for integers and bools."""
    if not e.is_floating_point() or e.numel() == 0:
        return {"rtol": 0, "atol": 0}
    ulps = 4 * torch.finfo(e.dtype).eps
    finite = e[torch.isfinite(e)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return {"rtol": ulps, "atol": ulps * scale}


def evaluate_regions(model, inputs, options=None) -> list:
    """[(region, IR outputs, eager's values of its outputs)] of every fused region of every graph fxopt
    compiles for ``model(*inputs)`` (``options``: default the torch executor), each region's IR kernel
    run by ``ir.evaluate`` on eager's values of its inputs."""
    from fxopt.backends import torch_ref
    from fxopt.backends.cuda import ir
    from fxopt.backends.cuda.schedule.fusion import schedule
    from fxopt.backends.cuda.schedule.rewrite import split_conv_epilogues

    out = []
    for report, example in capture(copy.deepcopy(model), inputs, options or {"executor": "torch"}):
        gm = torch_ref.lower(report.after)
        split_conv_epilogues(gm)
        vals = _values(gm, example)
        for region in schedule(gm, strict=True).regions:
            k = region.kernel
            got = [torch.empty_strided(b.shape, b.strides, dtype=b.dtype) for b in k.outputs]
            ir.evaluate(k, [vals[n] for n in region.inputs], got)
            out.append((region, got, [vals[n] for n in region.outputs]))
    return out


def check_regions(gm: fx.GraphModule, inputs: list, rtol: float, atol: float, compile_kernels: bool = False,
                  vals: dict | None = None):
    """Schedule ``gm`` (nodes carrying FakeTensor metadata) and check every region's IR kernel,
    run by ``ir.evaluate`` on ``inputs``, against the region's ATen ops; returns the Schedule."""
    global REGIONS_CHECKED
    from fxopt.backends.cuda import ir
    from fxopt.backends.cuda.schedule.fusion import schedule
    from fxopt.backends.cuda.schedule.rewrite import reference_module

    vals = _values(gm, inputs) if vals is None else vals
    rtol0, atol0 = rtol, atol
    sched = schedule(gm, strict=True)
    for region in sched.regions:
        k = region.kernel
        ins = [vals[n] for n in region.inputs]  # laid out as the kernel's buffers say (_values)
        outs = [torch.full(b.shape, float("nan"), dtype=b.dtype).as_strided(b.shape, b.strides)
                if _dense_fill(b) else torch.empty_strided(b.shape, b.strides, dtype=b.dtype) for b in k.outputs]
        ir.evaluate(k, ins, outs)
        module = reference_module(gm, region)
        ref = module(*ins)
        planned = wide = exact = as32 = None
        for i, (o, r, b) in enumerate(zip(outs, ref, k.outputs)):
            rtol, atol = _through_narrower(region, o.dtype, rtol0, atol0)
            try:
                torch.testing.assert_close(o, r, rtol=rtol, atol=atol, equal_nan=True,
                                           msg=lambda m, n=region.name: f"region {n} ({region.ops}): {m}")
            except AssertionError:
                # a 16-bit region computes in float32 within each op (rounding each op's value, as
                # eager does) where eager's kernels may do an op's inner steps otherwise; where they
                # lose more than the tolerance (an ill-conditioned LayerNorm over two values), the
                # kernel must match the same ops run in float32. That reference is fed the region's
                # 16-bit inputs, so it cannot see a rounding the kernel leaves out between a stored
                # value and its recomputation (tests/test_fp16_rounding.py checks that bitwise)
                if o.dtype != torch.float32:
                    wide = _float32_reference(module, ins) if wide is None else wide
                if o.dtype == torch.float32 or wide is None or not _close(o, wide[i].to(o.dtype), rtol, atol):
                    # ill-conditioned both ways (an InstanceNorm over four close values: eager's float16
                    # CPU kernel off by 0.004, the float32 ops by 0.007, as they skip the rounding of the
                    # value it normalizes; in float32 eager's kernel 1.8e-5 off): the kernel must match
                    # the ops each computed exactly and rounded to its dtype
                    exact = _rounded_reference(module, ins) if exact is None else exact
                    if exact is None:
                        raise
                    if o.dtype == torch.float32:  # float32 roundings alone exceed the tolerance: no worse than
                        # twice eager's error against the exact ops (the fuzzer's judgement of a whole model)
                        err, eager_err = (max_error(t, exact[i]) for t in (o, r))
                        assert _close(o, exact[i], rtol, atol) or err <= 2 * eager_err + atol, (
                            f"region {region.name} ({region.ops}): its error against the ops each computed in "
                            f"float64 {err:.3g}, eager's {eager_err:.3g}")
                    elif not _close(o, exact[i].to(o.dtype), rtol, atol):
                        # a float32 result on a 16-bit rounding boundary rounds one way in float64, the
                        # other in the kernel's float32, and a normalization of close values scales
                        # that ulp beyond the tolerance (CPU fuzz 3711c98f78: a sigmoid's 1 ulp, an
                        # InstanceNorm over 55 values near 1, 0.0035): the ops each in float32, rounded
                        as32 = _rounded_reference(module, ins, torch.float32) if as32 is None else as32
                        if as32 is None or not _close(o, as32[i].to(o.dtype), rtol, atol):
                            torch.testing.assert_close(
                                o, exact[i].to(o.dtype), rtol=rtol, atol=atol, equal_nan=True,
                                msg=lambda m, n=region.name: f"region {n} ({region.ops}), each op in float64 (and "
                                                             f"in float32) rounded to its dtype: {m}")
            if not _same_strides(o, r.stride()):
                # where torch's own metadata for these ops differs from its kernels on this device
                # (CPU group_norm keeps channels_last, its metadata and CUDA kernel do not), the
                # metadata is what the graph was planned with and what the kernel must write: for
                # inputs with exactly the kernel's strides, those of size-1 dimensions included (a
                # concatenation's layout follows them: a one-channel input of channels_last strides
                # gave channels_last, the same memory with contiguous strides contiguous, CPU fuzz
                # 38252fbc90)
                planned = _fake_strides(module, [_planned_input(t, b) for t, b in zip(ins, k.inputs)]) \
                    if planned is None else planned
                assert planned[i] != tuple(r.stride()) and _same_strides(o, planned[i]), \
                    f"region {region.name}: strides {o.stride()} != {r.stride()}"
        if compile_kernels:
            _compile(k)
        REGIONS_CHECKED += 1
    return sched


def _through_narrower(region, dtype: torch.dtype, rtol: float, atol: float) -> tuple:
    """The tolerance of a region's output of ``dtype``: where a value it computes passes through a
    narrower floating dtype (a cast to float16 and back), that dtype's too, as the fuzzer judges a
    whole model (``fxopt.fuzz.check.tolerance_for``): rounding is not continuous, and a value one
    float32 unit from eager's (another ``erff``) rounds to the other neighbour (CPU fuzz 54134b36bd:
    GELU, then float16, 4.9e-4 after a doubling)."""
    for n in region.covered:
        v = n.meta.get("val") if isinstance(n, fx.Node) else None
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype.itemsize < dtype.itemsize:
            r, a = tolerance(v.dtype)
            rtol, atol = max(rtol, r), max(atol, a)
    return rtol, atol


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    try:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError:
        return False
    return True


def _float32_reference(module, inputs: list):
    """The region's ops on its 16-bit inputs widened to float32 (explicit casts in it still cast),
    or None where they do not run so."""
    wide = [t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16) else t
            for t in inputs]
    try:
        return list(module(*wide))
    except Exception:  # noqa: BLE001 - an op that needs its 16-bit dtype: no float32 reference
        return None


class _RoundedOps(fx.Interpreter):
    """Runs each op of a module in float64 (or ``wide``) on its inputs and rounds its result to the
    dtype the op gives on them: eager's roundings between ops, none inside one."""

    def __init__(self, module, wide: torch.dtype = torch.float64):
        super().__init__(module)
        self.wide = wide

    def run_node(self, n: fx.Node):
        if n.op not in ("call_function", "call_method"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        narrow = getattr(self, n.op)(n.target, args, kwargs)
        widen = (lambda a: a.to(self.wide) if isinstance(a, torch.Tensor) and a.dtype in _FLOATS else a)
        wide_args, wide_kwargs = pytree.tree_map(widen, (args, kwargs))
        wide = getattr(self, n.op)(n.target, wide_args, wide_kwargs)
        return pytree.tree_map(lambda w, t: w.to(t.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                               and isinstance(w, torch.Tensor) else t, wide, narrow)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _rounded_reference(module: fx.GraphModule, inputs: list, wide: torch.dtype = torch.float64):
    """The region's ops each computed in float64 (or ``wide``) and rounded to its dtype
    (:class:`_RoundedOps`), or None where an op does not run so."""
    try:
        return list(_RoundedOps(module, wide).run(*inputs))
    except Exception:  # noqa: BLE001 - an op without a float64 kernel here
        return None


def _same_strides(t: torch.Tensor, strides) -> bool:
    return all(d == 1 or s == w for d, s, w in zip(t.shape, t.stride(), strides))


def _fake_strides(module, inputs: list) -> list:
    """The strides torch's FakeTensor propagation gives the module's outputs for these inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
        return [tuple(t.stride()) for t in module(*fakes)]


def _planned_input(t, b):
    """``t`` as the kernel's input buffer ``b`` plans it: its strides exactly (a view of the same memory
    where they differ only in size-1 dimensions)."""
    if isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(b.shape) and tuple(t.stride()) != tuple(b.strides) \
            and _same_strides(t, b.strides):
        return t.as_strided(t.shape, b.strides)
    return t


def _dense_fill(b) -> bool:
    return b.numel > 0 and b.span() == b.numel


def _outputs(gm: fx.GraphModule) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, fx.Node)]


def _compile(k) -> None:
    from fxopt.backends.cuda.kernels.region import generate_kernel, vector_width
    from fxopt.backends.cuda.compiler import compile_kernel

    for vec in sorted({vector_width(k), 1}):
        ks = generate_kernel(k, vec)
        compile_kernel(ks.source, ks.name, "sm_90", (), ks.param_types)
