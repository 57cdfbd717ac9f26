"""The memory formats eager gives a Dynamo graph's outputs, where its fake values say otherwise.

Dynamo's ``example_value`` comes from torch's meta functions and Python decompositions, and a few
of them lay out a result differently from the eager kernel the model really runs:

- upsampling (``F.interpolate``: nearest, nearest-exact, bilinear, bicubic) on CUDA: the meta
  function and decomposition make the output contiguous for a channels_last input with fewer than
  4 (nearest) or 16 (linear) channels, a speed heuristic of the CUDA kernel; the eager op's output
  is allocated in its input's suggested format all the same (the kernel copies into it).
- a pointwise op whose tensor operands all have the result's shape and are all contiguous: eager's
  TensorIterator gives a contiguous result even where an operand is also channels_last (a tensor
  with size-1 dimensions can be both, e.g. ``[1, 1, 1, W]``), where the meta function keeps the
  operand's strides. Only the strides of such ambiguous values differ, but the next op may decide
  its format by them (a convolution's output is channels_last when its input's strides are).

``eager_output_formats`` re-propagates the graph's fake values from the first such node on, with
eager's strides at those nodes, and returns every output's ``fxopt.names.format_of``. A graph
without such nodes costs one walk; anything the propagation cannot run keeps Dynamo's formats.
"""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.node import map_aggregate

from fxopt.names import format_of

log = logging.getLogger(__name__)

_UPSAMPLE = {F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear}
_OPERATORS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
              operator.neg: "neg", operator.abs: "abs", operator.pow: "pow"}


def _aten_name(n: fx.Node):
    """The ATen op name a Dynamo-level call resolves to (None for what is unknown or in place)."""
    if n.op == "call_method":
        name = n.target
    elif n.op == "call_function":
        name = _OPERATORS.get(n.target) or getattr(n.target, "__name__", None)
    else:
        return None
    if not isinstance(name, str) or name.endswith("_") or n.kwargs.get("inplace") or n.kwargs.get("out") is not None:
        return None
    return name


def _is_pointwise(n: fx.Node) -> bool:
    name = _aten_name(n)
    if not name:
        return False
    try:
        packet = getattr(torch.ops.aten, name)
        return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())
    except Exception:  # noqa: BLE001 - no such ATen op
        return False


def _tensors(args) -> list:
    found: list = []
    map_aggregate(args, lambda a: found.append(a) if isinstance(a, torch.Tensor) else None)
    return found


def _eager_value(n: fx.Node, args: tuple, kwargs: dict, result):
    """``result`` (the node's fake value) restrided as the eager kernel lays it out."""
    if not isinstance(result, torch.Tensor) or result.dim() != 4:
        return result
    if n.op == "call_function" and n.target in _UPSAMPLE:
        x = args[0] if args else kwargs.get("input")
        mode = kwargs.get("mode", args[3] if len(args) > 3 else "nearest")
        if isinstance(x, torch.Tensor) and x.dim() == 4 and x.device.type == "cuda" and mode != "area":
            from torch._prims_common import suggest_memory_format
            fmt = suggest_memory_format(x)
            if not result.is_contiguous(memory_format=fmt):
                return result.contiguous(memory_format=fmt)
        return result
    if _is_pointwise(n):
        ops = _tensors((args, kwargs))
        dense = result.clone(memory_format=torch.contiguous_format)  # is_contiguous() ignores size-1 dims
        if ops and all(t.shape == result.shape and t.is_contiguous() for t in ops) \
                and result.stride() != dense.stride():
            return dense
    return result


def _same_meta(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b))
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)


def _example(n):
    return n.meta.get("example_value") if isinstance(n, fx.Node) else n


def eager_values(gm: fx.GraphModule) -> dict:
    """node -> its value with eager's strides, for the nodes whose strides differ from their
    ``example_value`` (empty where none do)."""
    changed: dict = {}
    mode = None
    if any(not all(type(d) is int for d in (*t.shape, *t.stride())) for n in gm.graph.nodes
           for t in _tensors(n.meta.get("example_value"))):
        return changed  # symbolic sizes: comparing strides would add guards
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        inputs_changed = any(a in changed for a in n.all_input_nodes)
        if not inputs_changed and not (n.target in _UPSAMPLE or _is_pointwise(n)):
            continue
        fetch = lambda a: changed.get(a, _example(a)) if isinstance(a, fx.Node) else a  # noqa: E731
        args, kwargs = map_aggregate(n.args, fetch), map_aggregate(n.kwargs, fetch)
        ex = n.meta.get("example_value")
        if mode is None:
            mode = next((t.fake_mode for t in _tensors((args, kwargs, ex)) if hasattr(t, "fake_mode")), None)
            if mode is None:
                return changed
        with mode:
            if inputs_changed:
                fn = getattr(args[0], n.target) if n.op == "call_method" else n.target
                result = fn(*args[1:], **kwargs) if n.op == "call_method" else fn(*args, **kwargs)
            else:
                result = ex
            result = _eager_value(n, args, kwargs, result)
        if not _same_meta(result, ex):
            changed[n] = result
    return changed


def eager_output_formats(gm: fx.GraphModule) -> list:
    """The memory format (``format_of``) of each of ``gm``'s outputs as eager gives it (None for
    a non-tensor or a view); Dynamo's ``example_value`` corrected by ``eager_values``."""
    try:
        changed = eager_values(gm)
    except Exception as e:  # noqa: BLE001 - an op the fake propagation cannot rerun: Dynamo's formats
        log.info("fxopt: eager output formats from Dynamo's values (%s: %s)", type(e).__name__, e)
        changed = {}
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    flat = list(out) if isinstance(out, (list, tuple)) else [out]
    formats = []
    for o in flat:
        v = changed.get(o, _example(o)) if isinstance(o, fx.Node) else None
        formats.append(format_of(v) if isinstance(v, torch.Tensor) else None)
    return formats
