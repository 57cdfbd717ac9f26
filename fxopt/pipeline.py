"""The pass pipeline: which passes run, in which order, and how each is observed.

Every pass runs inside ``observe()``, which times it, lints the graph,
re-propagates FakeTensor metadata, records the nodes it created and erased,
optionally dumps the graph (``FXOPT_DUMP_DIR``) and optionally verifies the
result against the unoptimized graph on real inputs (``verify=True``). Any
exception falls back to the unoptimized graph with one warning naming the
pass (``strict=True`` raises instead).
"""
from __future__ import annotations

import logging
import os
import time
import warnings

import torch
import torch.fx as fx

from fxopt.passes import (dead_code, fold_batchnorm, fold_constants, fuse_conv_epilogue, layout,
                          merge_parallel_convs, output_formats, pad_channels,
                          redundant_clones, select_conv_algorithm, training_batchnorm,
                          training_batchnorm_relu, training_layout, pool_backward_layout)
from fxopt.passinfra import PassContext
from fxopt.report import PassRecord
from fxopt.tolerances import outputs_close

log = logging.getLogger("fxopt")

try:  # the class torch.fx makes for a module whose code is generated on first use (torch >= 2.3)
    from torch.fx._lazy_graph_module import _LazyGraphModule as _MODULE
except ImportError:  # pragma: no cover - a torch without it: code generated at once
    _MODULE = fx.GraphModule

# The pipeline, in order. Each entry is (name, run(gm, ctx) -> PassResult).
PIPELINE = [
    # AOTAutograd leaves unused values (e.g. BatchNorm statistics) behind: drop them first.
    ("dead_code", dead_code.run),
    # Inference BatchNorm -> conv/linear weights; must run before epilogue fusion sees the chain.
    ("fold_batchnorm", fold_batchnorm.run),
    # parallel convolutions of one input that are summed (re-parameterizable branches) -> one
    # convolution; needs their BatchNorms folded, precedes epilogue fusion (the sum's activation).
    ("merge_parallel_convs", merge_parallel_convs.run),
    # conv/linear + bias + residual + activation -> one fused node; every conv becomes fused_conv.
    ("fuse_conv_epilogue", fuse_conv_epilogue.run),
    # channels_last regions around 2-D convolutions; needs the fused nodes, precedes algorithm choice
    # so that the choice is made for the layout the conv will really see.
    ("layout", layout.run),
    # outputs in eager's memory format where a decomposition changed it (the layout pass restores
    # only the values it made NHWC).
    ("output_formats", output_formats.run),
    # channel counts that are not a multiple of 8 carried at the next multiple (16-bit tensor
    # cores); needs the channels_last layout, precedes the algorithm choice (which sees the widths).
    ("pad_channels", pad_channels.run),
    # direct / Winograd / FFT / GEMM per convolution, by measurement or cost model.
    ("select_conv_algorithm", select_conv_algorithm.run),
    # Last: everything weight-only the passes above produced is evaluated once.
    ("fold_constants", fold_constants.run),
]

# Training only: passes over AOTAutograd's joint forward+backward graph, before it is split
# (fxopt.training.Partitioner); each changes what the forward hands the backward.
JOINT_PIPELINE = [
    # the copies autograd keeps of what in-place activations overwrote: nothing overwrites them now.
    ("redundant_clones", redundant_clones.run),
    # BatchNorm as eager runs it (cuDNN and its reserve space) instead of the native kernels.
    ("training_batchnorm", training_batchnorm.run),
    # autocast's casts before convolutions write channels_last: NHWC convolutions end to end.
    ("training_layout", training_layout.run),
    # BatchNorm (+ residual add) + ReLU and their gradients as cuDNN's fused kernels; needs the
    # channels_last layout above and the reserve space of training_batchnorm's form.
    ("training_batchnorm_relu", training_batchnorm_relu.run),
    # PyTorch's CUDA avg_pool2d_backward is wrong on channels_last tensors where the pool pads:
    # it reads NCHW copies (after the layout pass, which is one way such tensors reach it).
    ("pool_backward_layout", pool_backward_layout.run),
]
PASS_NAMES = tuple(name for name, _ in PIPELINE)
JOINT_PASS_NAMES = tuple(name for name, _ in JOINT_PIPELINE)
#: what options ``passes`` and ``disable`` may name
ALL_PASS_NAMES = PASS_NAMES + JOINT_PASS_NAMES


class FxoptFallbackWarning(UserWarning):
    """fxopt could not optimize a graph and runs it as PyTorch would."""


class PassFailure(RuntimeError):
    """Raised with strict=True when a pass fails or changes the result."""

    def __init__(self, pass_name: str, message: str):
        super().__init__(f"fxopt pass {pass_name!r}: {message}")
        self.pass_name = pass_name


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A structural copy (nodes and meta, and how the graph packs its inputs and outputs) sharing
    attributes, to keep as the fallback."""
    return module_of(gm, copy_graph(gm))


def copy_graph(gm: fx.GraphModule) -> fx.Graph:
    """``gm``'s graph copied (nodes and meta, and how it packs its inputs and outputs), to change before
    ``module_of`` makes its module: the code is generated once, not for the copy and again after."""
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    g._codegen = gm.graph._codegen
    return g


def module_of(gm: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A module of ``graph`` (a ``copy_graph`` of ``gm``'s) sharing ``gm``'s attributes. Its Python
    code is generated when it is first called or read (torch.fx's ``_LazyGraphModule``, as Inductor's
    passes use it), not at every copy and ``recompile``: most copies a compile makes are rewritten
    again or only read as graphs (three of a resnet18's per size, 3 ms each on a 2-vCPU host)."""
    return _MODULE(gm, graph, class_name=type(gm).__name__)


def count_nodes(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))


def _dump(gm: fx.GraphModule, dump_dir: str, index: int, name: str, prefix: str) -> None:
    os.makedirs(dump_dir, exist_ok=True)
    path = os.path.join(dump_dir, f"{prefix}{index:03d}_{name}.py")
    with open(path, "w") as f:
        f.write(gm.print_readable(print_output=False, include_stride=True, include_device=True))


def _fallback(ctx: PassContext, name: str, message: str) -> None:
    if ctx.options.strict:
        raise PassFailure(name, message)
    warnings.warn(
        f"fxopt: pass {name!r} failed ({message}); running the unoptimized graph", FxoptFallbackWarning, stacklevel=2
    )


def _run_real(gm: fx.GraphModule, inputs: list):
    """Run `gm` on real tensors, outside the FakeTensorMode that compilation runs under."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        return gm(*inputs)


def _verify(gm: fx.GraphModule, inputs: list, reference) -> str | None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    got = _run_real(gm, inputs)
    with unset_fake_temporarily():
        return outputs_close(got, reference)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, dump_prefix: str = ""):
    """Run the enabled passes on `gm`. Returns (graph module, records, fallback reason or None)."""
    original = copy_graph_module(gm)
    records: list[PassRecord] = []
    opts = ctx.options
    reference = None
    if opts.verify and ctx.example_inputs is not None:
        reference = _run_real(original, ctx.example_inputs)
    if opts.dump_dir:
        _dump(gm, opts.dump_dir, 0, "input", dump_prefix)
    ctx.seed_meta(gm)
    for index, (name, fn) in enumerate(PIPELINE, start=1):
        if not opts.pass_enabled(name):
            records.append(PassRecord(name=name, status="disabled"))
            continue
        before_names = {n.name for n in gm.graph.nodes}
        nodes_before = count_nodes(gm)
        ctx.current_pass = name
        t0 = time.perf_counter()
        try:
            result = fn(gm, ctx)
            gm = result.graph_module
            gm.graph.lint()
            if result.modified:
                ctx.refresh_meta(gm)
        except Exception as e:  # noqa: BLE001 - the contract is: any failure falls back
            if opts.strict:
                raise PassFailure(name, f"{type(e).__name__}: {e}") from e
            _fallback(ctx, name, f"{type(e).__name__}: {e}")
            records.append(PassRecord(name=name, status="failed", error=f"{type(e).__name__}: {e}"))
            return original, records, f"pass {name} failed: {type(e).__name__}: {e}"
        ms = (time.perf_counter() - t0) * 1e3
        after_names = {n.name for n in gm.graph.nodes}
        notes = ctx.notes.get(name, [])
        records.append(PassRecord(
            name=name, status="ran", changed=bool(result.modified), nodes_before=nodes_before,
            nodes_after=count_nodes(gm), ms=ms, notes=list(notes),
            created=sorted(after_names - before_names), erased=sorted(before_names - after_names),
        ))
        log.debug("pass %s: changed=%s %.2f ms\n%s", name, result.modified, ms,
                  gm.print_readable(print_output=False) if log.isEnabledFor(logging.DEBUG) else "")
        if opts.dump_dir:
            _dump(gm, opts.dump_dir, index, name, dump_prefix)
        if reference is not None and result.modified:
            problem = _verify(gm, ctx.example_inputs, reference)
            if problem:
                records[-1].status = "mismatch"
                records[-1].error = problem
                if opts.strict:
                    raise PassFailure(name, f"output differs from eager: {problem}")
                _fallback(ctx, name, f"output differs from eager: {problem}")
                return original, records, f"pass {name} changed the result: {problem}"
    return gm, records, None


def run_joint_pipeline(joint: fx.GraphModule, joint_inputs, options, target=None):
    """The ``JOINT_PIPELINE`` passes on AOTAutograd's joint graph. Each pass works on a copy that
    replaces the graph only when FakeTensor propagation through the whole rewritten graph succeeds
    and every view in it is one ATen's kernel takes on the propagated strides
    (``fxopt.fakeprop.view_problem``; a layout that does not propagate, say, is a declined rewrite,
    with the reason in the record); ``ctx.fake_inputs`` holds the joint inputs for a pass's own
    propagation;
    a pass that raises falls back with one warning naming it (``strict=True`` raises).
    ``target`` (``fxopt.target.Target``): what the passes may assume of the executor, built by the
    backend entry; None assumes nothing beyond fxopt's reference ops (``Target.generic``).
    Returns (the joint graph, records)."""
    from torch.utils._pytree import tree_leaves

    from fxopt.fakeprop import propagate, view_problem

    leaves = [t for t in tree_leaves(joint_inputs) if isinstance(t, torch.Tensor)]
    device = "cuda" if any(t.device.type == "cuda" for t in leaves) else "cpu"
    ctx = PassContext(options=options, mode="training", device_type=device, target=target)
    ctx.fake_inputs = list(joint_inputs)  # as the joint graph takes them: (primals, tangents)
    records: list[PassRecord] = []
    for name, fn in JOINT_PIPELINE:
        if not options.pass_enabled(name):
            records.append(PassRecord(name=name, status="disabled"))
            continue
        ctx.current_pass = name
        nodes_before, t0 = count_nodes(joint), time.perf_counter()
        candidate = copy_graph_module(joint)
        try:
            result = fn(candidate, ctx)
            if result.modified:
                result.graph_module.graph.lint()
        except Exception as e:  # noqa: BLE001 - the contract is: any failure falls back
            if options.strict:
                raise PassFailure(name, f"{type(e).__name__}: {e}") from e
            _fallback_joint(name, f"{type(e).__name__}: {e}")
            records.append(PassRecord(name=name, status="failed", error=f"{type(e).__name__}: {e}"))
            continue
        changed = bool(result.modified)
        if changed:
            try:
                propagate(result.graph_module, joint_inputs)
                problem = view_problem(result.graph_module)
            except Exception as e:  # noqa: BLE001 - a rewrite whose values do not propagate is declined
                changed = False
                ctx.note(f"declined: the rewritten graph does not propagate ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160]})")
            else:
                if problem is None:
                    joint = result.graph_module
                else:  # FakeTensor's view let it through, ATen's kernel would not
                    changed = False
                    ctx.note(f"declined: a view of the rewritten graph would fail at run time ({problem})")
        records.append(PassRecord(name=name, status="ran", changed=changed, nodes_before=nodes_before,
                                  nodes_after=count_nodes(joint), ms=(time.perf_counter() - t0) * 1e3,
                                  notes=list(ctx.notes.get(name, []))))
    return joint, records


def _fallback_joint(name: str, message: str) -> None:
    warnings.warn(f"fxopt: joint-graph pass {name!r} failed ({message}); the joint graph is kept as traced",
                  FxoptFallbackWarning, stacklevel=3)
