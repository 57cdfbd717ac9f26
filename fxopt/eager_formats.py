"""Eager's output formats where Dynamo's fake values (meta functions) differ: CUDA upsampling of a
channels_last input (the meta's contiguous below 4 / 16 channels; eager keeps the input's format)
and pointwise ops over all-contiguous operands (eager: contiguous; the meta keeps an ambiguous
``[1, 1, 1, W]`` channels_last, which sets the next conv's format). Re-propagated from there.

``restore_output_formats`` gives a graph's outputs those formats back (the ``output_formats``
pass; the executors' runners apply it to the unoptimized graph they may replay instead, so that
every way a signature can run hands out the same strides): a dense output in another format is
copied into eager's; an output that is a view (a transpose, a slice) of a value in another
format than eager's reads a copy of that value in eager's format instead, where replaying its
views on that format gives eager's strides."""
from __future__ import annotations

import contextlib
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


def eager_output_values(gm: fx.GraphModule) -> list:
    """Each output's value (a fake tensor) with the strides eager gives it (None: no tensor)."""
    try:
        changed = eager_values(gm)
    except Exception:  # noqa: BLE001 - an op fake propagation cannot rerun: Dynamo's formats
        changed = {}
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    flat = list(out) if isinstance(out, (list, tuple)) else [out]
    values = [changed.get(o, _example(o)) if isinstance(o, fx.Node) else None for o in flat]
    return [v if isinstance(v, torch.Tensor) else None for v in values]


def eager_output_formats(gm: fx.GraphModule) -> list:
    """``format_of`` each output's value as eager gives it (None: no tensor, a view)."""
    return [format_of(v) if v is not None else None for v in eager_output_values(gm)]


def output_strides(values: list) -> list:
    """The strides of each value (None: no tensor, or symbolic strides, which are not compared)."""
    return [tuple(v.stride()) if v is not None and all(type(s) is int for s in v.stride()) else None
            for v in values]


def needs_format(v, want) -> bool:
    """A 4-D value that is not dense in ``want`` (eager's format for it; None: a view, none)."""
    return (want is not None and isinstance(v, torch.Tensor) and v.dim() == 4 and format_of(v) is not want
            and not v.is_contiguous(memory_format=want))


def same_strides(shape, a, b) -> bool:
    """Strides ``a`` and ``b`` agree on every dimension of size other than 1."""
    return all(n == 1 or x == y for n, x, y in zip(shape, a, b))


def _is_view(n) -> bool:
    """An op whose schema returns a view of its first argument (or an item of such a list)."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return _is_view(n.args[0])
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and not schema.is_mutable and schema.returns
                and schema.returns[0].alias_info is not None and isinstance(n.args[0], fx.Node))


def _replays_to(chain: list, base: torch.Tensor, fmt, want: tuple) -> bool:
    """The views ``chain`` (output first) applied to ``base`` laid out in ``fmt`` give strides
    ``want``. Replayed on the meta device: its views check strides as the device kernels do."""
    t = torch.empty(base.shape, dtype=base.dtype, device="meta", memory_format=fmt)
    try:
        for n in reversed(chain):
            if any(isinstance(a, fx.Node) for a in _nodes_in(n.args[1:], n.kwargs)):
                return False
            t = n.target(t, *n.args[1:], **n.kwargs)
    except Exception:  # noqa: BLE001 - the view does not apply to that layout
        return False
    return isinstance(t, torch.Tensor) and same_strides(t.shape, t.stride(), want)


def _nodes_in(args, kwargs) -> list:
    found: list = []
    map_aggregate((args, kwargs), lambda a: found.append(a) if isinstance(a, fx.Node) else None)
    return found


def restore_output_formats(gm: fx.GraphModule, formats: list, strides: list = ()) -> list[str]:
    """Give ``gm``'s outputs eager's layouts (``formats``: eager's ``format_of`` per output;
    ``strides``: eager's strides per output, for the outputs that are views): inserts
    ``aten.clone(memory_format=...)`` nodes (module docstring). Returns a note per change; the
    caller recompiles ``gm`` and re-propagates its metadata."""
    g = gm.graph
    out_node = next(n for n in g.nodes if n.op == "output")
    outs = out_node.args[0]
    flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    clones: dict = {}
    notes: list[str] = []

    def copy_of(node: fx.Node, fmt) -> fx.Node:
        if (node, fmt) not in clones:
            with g.inserting_after(node):
                c = clones[node, fmt] = g.call_function(torch.ops.aten.clone.default, (node,), {"memory_format": fmt})
            c.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
            v = node.meta.get("val")
            if isinstance(v, torch.Tensor):
                mode = getattr(v, "fake_mode", None)
                with mode if mode is not None else contextlib.nullcontext():
                    c.meta["val"] = v.clone(memory_format=fmt)
        return clones[node, fmt]

    name = {torch.channels_last: "channels_last", torch.contiguous_format: "NCHW"}
    for i, o in enumerate(flat):
        v = o.meta.get("val") if isinstance(o, fx.Node) else None
        if not isinstance(v, torch.Tensor):
            continue
        want = formats[i] if i < len(formats) else None
        if needs_format(v, want):  # a dense output
            flat[i] = copy_of(o, want)
            notes.append(f"output {i} ({o.name}) back to {name[want]} as eager gives it")
            continue
        target = strides[i] if i < len(strides) else None
        if target is None or same_strides(v.shape, v.stride(), target):
            continue
        chain, base = [], o
        while _is_view(base):
            chain.append(base)
            base = base.args[0]
        b = base.meta.get("val") if chain and base.op == "call_function" else None  # not an input's view
        if not isinstance(b, torch.Tensor) or b.dim() != 4:  # memory formats are 4-D
            continue
        fmt = next((f for f in (torch.channels_last, torch.contiguous_format)
                    if not b.is_contiguous(memory_format=f) and _replays_to(chain, b, f, target)), None)
        if fmt is None:
            continue
        # the viewed value returned too (``return x, x.transpose(2, 3)``): eager's outputs alias, so
        # both read the one copy, where that copy gives the value eager's strides too; else the view
        # keeps reading the value (aliasing before strides: GPU fuzz f1b43b3664)
        also = [j for j, f in enumerate(flat) if f is base]
        laid = torch.empty(tuple(b.shape), device="meta").contiguous(memory_format=fmt).stride()
        if any(j >= len(strides) or strides[j] is None or not same_strides(b.shape, laid, strides[j]) for j in also):
            continue
        c = copy_of(base, fmt)
        for j in also:
            flat[j] = c
        chain[-1].replace_input_with(base, c)
        notes.append(f"output {i} ({o.name}) a view of {base.name} in {name[fmt]} as eager gives it"
                     + (f", and output{'s' * (len(also) > 1)} {', '.join(map(str, also))} that value" if also else ""))
    out_node.args = (type(outs)(flat) if isinstance(outs, (list, tuple)) else flat[0],)
    return notes
