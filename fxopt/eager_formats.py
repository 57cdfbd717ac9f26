"""Eager's output formats where Dynamo's fake values (meta functions) differ: CUDA upsampling of a
channels_last input (the meta's contiguous below 4 / 16 channels; eager keeps the input's format)
and pointwise ops over all-contiguous operands (eager: contiguous; the meta keeps an ambiguous
``[1, 1, 1, W]`` channels_last, which sets the next conv's format). Re-propagated from there."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.node import map_aggregate

from fxopt.names import format_of

_UPSAMPLE = {F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear}
_OPERATORS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div"}


def _is_pointwise(n: fx.Node) -> bool:
    """An out-of-place ATen op tagged pointwise."""
    name = n.target if n.op == "call_method" else _OPERATORS.get(n.target) or getattr(n.target, "__name__", None)
    if not isinstance(name, str) or name.endswith("_") or n.kwargs.get("inplace") or "out" in n.kwargs:
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
        if ops and all(t.shape == result.shape and t.is_contiguous() for t in ops):
            return result.clone(memory_format=torch.contiguous_format)
    return result


def _key(v):
    return [(t.shape, t.stride(), t.dtype) for t in _tensors(v)]


def _example(n):
    return n.meta.get("example_value") if isinstance(n, fx.Node) else n


def eager_values(gm: fx.GraphModule) -> dict:
    """node -> its value with eager's strides, where they differ from its ``example_value``."""
    changed: dict = {}
    mode = None
    if any(type(d) is not int for n in gm.graph.nodes for k in _key(n.meta.get("example_value")) for d in k[0]):
        return changed  # symbolic sizes: comparing would add guards
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
        if _key(result) != _key(ex):
            changed[n] = result
    return changed


def eager_output_formats(gm: fx.GraphModule) -> list:
    """``format_of`` each output's value as eager gives it (None: no tensor, a view)."""
    try:
        changed = eager_values(gm)
    except Exception:  # noqa: BLE001 - an op fake propagation cannot rerun: Dynamo's formats
        changed = {}
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    flat = list(out) if isinstance(out, (list, tuple)) else [out]
    formats = []
    for o in flat:
        v = changed.get(o, _example(o)) if isinstance(o, fx.Node) else None
        formats.append(format_of(v) if isinstance(v, torch.Tensor) else None)
    return formats
