"""The backend's path for a graph with symbolic sizes (``fxopt.dynamic`` says why and how): the
pipeline once on the symbolic graph in fxopt's own shape environment, a ``SizeDispatcher`` that
lowers it per concrete size."""
from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Callable, Optional

import torch
import torch.fx as fx

from fxopt.dynamic import PrivateShapes, SizeDispatcher, Unsupported, release
from fxopt.lowered import Lowered
from fxopt.report import GraphReport

log = logging.getLogger("fxopt")


def _private_graph(gm: fx.GraphModule, shapes: PrivateShapes) -> fx.GraphModule:
    """A copy of ``gm`` whose values are propagated from the private fake inputs."""
    from fxopt.fakeprop import FakeProp
    from fxopt.pipeline import copy_graph_module

    copy = copy_graph_module(gm)
    with shapes.mode, torch.no_grad():
        FakeProp(copy, shapes.mode).propagate_dont_convert_inputs(*shapes.fakes)
    return copy


def compile_symbolic(compiler, gm: fx.GraphModule, fake_args: list, kind: str) -> Optional[Callable]:
    """The compiled graph for a symbolic ``gm`` (``compiler``: the ``FxoptCompiler``), or None where it
    cannot take the symbolic path (``compiler.dynamic_fallback`` then says why and the caller
    specializes it as before)."""
    from fxopt import pipeline
    from fxopt.autotune import cudnn_choosing
    from fxopt.backends import resolve_executor

    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    t0 = time.perf_counter()
    # the fake mode found through Dynamo's tracing context, or active around the compiler, is Dynamo's
    with tracing(None), unset_fake_temporarily():
        return _compile(compiler, gm, fake_args, kind, t0)


def _compile(compiler, gm: fx.GraphModule, fake_args: list, kind: str, t0: float) -> Optional[Callable]:
    from fxopt import pipeline
    from fxopt.autotune import cudnn_choosing
    from fxopt.backends import resolve_executor
    from fxopt.backends.lowering import model_tag

    try:
        shapes = PrivateShapes(fake_args)
        sym_gm = _private_graph(gm, shapes)
    except Unsupported as e:
        compiler.dynamic_fallback = str(e)
        return None
    except Exception as e:  # noqa: BLE001 - what does not propagate symbolically is specialized
        compiler.dynamic_fallback = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return None
    ctx = compiler._context(sym_gm, shapes.fakes, kind)
    if kind != "inference":  # the backward's runners read what the forward's lend, size by size
        compiler._link_training(ctx, sym_gm, kind)
    before = pipeline.copy_graph_module(sym_gm)
    with cudnn_choosing(compiler.options.cudnn_search):
        optimized, records, fallback = pipeline.run_pipeline(sym_gm, ctx, dump_prefix=f"{kind}_")
    ctx.unoptimized = before if fallback is None else None
    info = {"symbolic": list(shapes.dims), "guards": shapes.guards(), "pipeline_runs": 1,
            "pipeline_s": round(time.perf_counter() - t0, 4)}
    lower_at = _lowering(compiler, ctx, before, optimized, shapes, kind, info)
    padding, batch_pos = _padding(compiler.options, before, shapes, info, kind)
    dispatcher = SizeDispatcher(shapes, lower_at, compiler.options.max_specializations, info, padding=padding,
                                specialize_after=compiler.options.specialize_after,
                                user_cache=_user_cache(compiler.options), batch_pos=batch_pos,
                                model=model_tag(before, ctx.param_placeholders),
                                scope=f"{kind} {compiler.options!r}")
    executor = resolve_executor(compiler.options.executor, compiler.device_type, kind)
    lowered = Lowered(fn=dispatcher, executor=f"{executor} (per size)", cudagraphs="per size",
                      details={"dynamic": info})
    report = GraphReport(
        kind=kind, before=before, after=optimized, passes=records, conv_algorithms=dict(ctx.conv_algorithms),
        fallback=fallback, executor=lowered.executor, cudagraphs=lowered.cudagraphs, measurements=ctx.measurements,
        compile_ms=(time.perf_counter() - t0) * 1e3, lowered=lowered)
    report.executor_details["compile_cache"] = "off (symbolic graph)"
    report.dispatcher = dispatcher
    if kind != "inference":
        from fxopt.dynamic import SizeRunners
        from fxopt.training import training_details

        report.training = training_details(before, kind, compiler.partitioner)
        if kind == "forward":
            compiler.forward_runner = SizeRunners(dispatcher)
    return compiler.finish(gm, dispatcher, report, kind)


def _user_cache(options):
    """The autotuning cache the buckets' choices go to (in memory with ``autotune_cache=False``)."""
    from fxopt.autotune import AutotuneCache

    return AutotuneCache.for_option(options.autotune_cache)


def _padding(options, before: fx.GraphModule, shapes: PrivateShapes, info: dict, kind: str = "inference"):
    """``(Padding or None, index of the batch in a size key or None)``; the report says why not.
    Never for a training graph (padded samples would enter BatchNorm's statistics and the gradients)."""
    from fxopt import batch_independence
    from fxopt.dynamic_buckets import Padding

    names = list(shapes.where)
    dim0 = [str(a.shape[0].node.expr) for a in shapes.fakes
            if isinstance(a, torch.Tensor) and a.dim() and isinstance(a.shape[0], torch.SymInt)]
    batch_pos = next((names.index(n) for n in dim0 if n in names), None)  # the buckets' dimension
    if kind != "inference":
        info["padding_declined"] = "a training graph: every size lowered at its first call"
        return None, batch_pos
    if not options.dynamic_padding:
        info["padding_declined"] = "option dynamic_padding is off"
        return None, batch_pos
    try:
        plan, why = batch_independence.check(before, shapes.fakes)
    except Exception as e:  # noqa: BLE001 - the check failing only turns padding off
        if options.strict:
            raise
        plan, why = None, f"the check failed ({type(e).__name__}: {e})"
        warnings.warn(f"fxopt: batch_independence failed ({type(e).__name__}: {e}); no padded runs",
                      stacklevel=2)
    if plan is None:
        info["padding_declined"] = why
        return None, batch_pos
    pos = names.index(plan.symbol) if plan.symbol in names else None
    if pos is None:
        info["padding_declined"] = f"the batch {plan.symbol} is not among the sizes read from the arguments"
        return None, batch_pos
    info["padding"] = plan.symbol
    return Padding(plan), pos


def _lowering(compiler, ctx, before: fx.GraphModule, optimized: fx.GraphModule, shapes: PrivateShapes,
              kind: str, info: dict) -> Callable:
    """``lower_at(args, key) -> (Lowered, note)`` for the dispatcher."""
    from fxopt import pipeline
    from fxopt.autotune import cudnn_choosing
    from fxopt.backends import lower
    from fxopt.backends.lowering import DeferredGraph, placeholder_indices
    from fxopt.package_batch import ValueMemo, _vals_agree, from_vals, specialise_at, symbolic_vals

    # each node's value stored once as expressions of the symbols and evaluated per size, as a
    # package's are, instead of FakeTensor propagation per size (0.1 s a graph for resnet18 on an
    # H200's host, twice a lowering); the first size checks them against propagation
    symbols = tuple(shapes.where)
    stored: dict = {}
    memos: dict = {}  # graph name -> what its sizes share (one FakeTensorMode, the values without a size)

    def specialised(gm: fx.GraphModule, name: str, args: list, key: tuple) -> fx.GraphModule:
        at = {f"B{i}": v for i, v in enumerate(key)}
        if name not in stored:
            vals = symbolic_vals(gm, symbols)
            static = specialise_at(gm, args)[0]
            try:
                if vals is not None and not _vals_agree(from_vals(gm, vals, at, fake=True), static):
                    vals = None
            except (KeyError, ValueError, TypeError, RuntimeError):
                vals = None
            stored[name] = vals
            info.setdefault("specialised_by", {})[name] = ("stored values (checked against propagation at "
                                                           f"{shapes.describe(key)})" if vals is not None
                                                           else "FakeTensor propagation per size")
            return static
        if stored[name] is None:
            return specialise_at(gm, args)[0]
        return specialise_at(gm, args, stored[name], at, fake=True, memo=memos.setdefault(name, ValueMemo()))[0]

    params = set(placeholder_indices(before, ctx.param_placeholders))

    def deferred_base(args: list, key: tuple) -> DeferredGraph:
        """The unoptimized graph at these sizes, made where a runner measures it (or the lowering
        fails): the batch's arguments kept as their shapes only (none held alive meanwhile), the
        parameters as they are (the model holds them anyway; nothing of their size made again)."""
        kept = [_Described(a) if isinstance(a, torch.Tensor) and i not in params else a for i, a in enumerate(args)]

        def make() -> fx.GraphModule:
            with torch.no_grad():
                return specialised(before, "unoptimized", [_Described.made(a) for a in kept], key)

        return DeferredGraph(make, like=before, ident=f"{before.code}\n# at {shapes.describe(key)}")

    def lower_at(args: list, key: tuple, choices=None):
        why = shapes.failed_guard(key)
        note = None
        if why is None:  # (values stored as expressions hold where no guard of the passes fails)
            base = deferred_base(args, key)
            with torch.no_grad():
                static = specialised(optimized, "optimized", args, key)
            c = dataclasses.replace(ctx, unoptimized=base if ctx.unoptimized is not None else None,
                                    fake_cache={}, notes={}, per_size=kind == "inference")
        else:  # the passes decided on a size these sizes break: they run again at these sizes
            with torch.no_grad():
                base = specialise_at(before, args)[0]
            saved, compiler.example_inputs = compiler.example_inputs, args[len(args) - compiler.n_inputs:]
            try:
                c = compiler._context(base, [n.meta.get("val") for n in base.graph.find_nodes(op="placeholder")],
                                      kind)
            finally:
                compiler.example_inputs = saved
            c.training_link = ctx.training_link
            c.param_placeholders |= ctx.param_placeholders
            c.per_size = kind == "inference"
            with cudnn_choosing(compiler.options.cudnn_search):
                static, _, fb = pipeline.run_pipeline(pipeline.copy_graph_module(base), c)
            c.unoptimized = base if fb is None else None
            info["pipeline_runs"] = info.get("pipeline_runs", 1) + 1
            note = f"passes ran again at this size (the symbolic graph assumed {why})"
        if choices is not None:  # the measured choices of this size's bucket (fxopt.dynamic_buckets)
            c = dataclasses.replace(c, options=dataclasses.replace(c.options, autotune_cache=choices))
        try:
            with cudnn_choosing(compiler.options.cudnn_search):
                return lower(static, c, kind), note
        except Exception as e:  # noqa: BLE001 - a size that does not lower runs the unoptimized graph
            if compiler.options.strict:
                raise
            from fxopt.pipeline import FxoptFallbackWarning

            warnings.warn(f"fxopt: lowering failed at {shapes.describe(key)} ({type(e).__name__}: {e}); running "
                          "the unoptimized graph at that size", FxoptFallbackWarning, stacklevel=2)
            return Lowered(fn=base.get() if isinstance(base, DeferredGraph) else base, executor="torch",
                           cudagraphs="off (fallback)",
                           fallback_reason=f"lowering failed: {type(e).__name__}: {e}"), \
                f"lowering failed: {type(e).__name__}"

    return lower_at


class _Described:
    """A tensor argument kept as its shape, strides, dtype and device (``made()``: an empty one)."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.stride, self.dtype, self.device = tuple(t.shape), t.stride(), t.dtype, t.device
        self.requires_grad = t.requires_grad

    @staticmethod
    def made(a):
        if not isinstance(a, _Described):
            return a
        return torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device=a.device, requires_grad=a.requires_grad)


__all__ = ["compile_symbolic", "release"]
