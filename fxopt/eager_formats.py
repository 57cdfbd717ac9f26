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


_RANDOM = ("rand", "dropout", "bernoulli", "normal", "multinomial", "poisson", "uniform", "exponential")


def measured_output_values(gm: fx.GraphModule, example_inputs: list) -> list | None:
    """Each output's layout as eager's kernels really give it (meta tensors of its shape, strides and
    dtype): Dynamo's graph run once on its real example inputs, with grad disabled. The prediction
    from fake values (``eager_output_values``) misses where a kernel's format follows the strides of
    a dimension of size 1 that the fake and the real results disagree on (GPU fuzz be7f1a0376: a
    [1, 2, 1, 1] value, then nearest upsampling: contiguous in eager, channels_last by the
    prediction on the GPU). None where that run is not harmless or not possible: a graph that
    autograd records (training), that writes a value in place or draws random numbers, a module
    call, inputs that are not real tensors, or a run that raises."""
    from torch._subclasses.fake_tensor import is_fake

    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
        return None
    if any(isinstance(t, torch.Tensor) and is_fake(t) for t in example_inputs):
        return None
    for n in gm.graph.nodes:
        if n.op == "call_module":
            return None
        if n.op in ("call_function", "call_method"):
            schema = getattr(n.target, "_schema", None)  # an ATen overload called directly
            if schema is not None and schema.is_mutable:
                return None
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
            writes = (name.endswith("_") and not name.startswith("__")) or name == "setitem"
            if writes or any(r in name for r in _RANDOM) or n.kwargs.get("inplace") or "out" in n.kwargs:
                return None
    try:
        with torch.no_grad():
            out = gm(*example_inputs)
    except Exception:  # noqa: BLE001 - the prediction stands
        return None
    flat = list(out) if isinstance(out, (list, tuple)) else [out]
    return [torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")
            if isinstance(t, torch.Tensor) else None for t in flat]


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
    """Strides ``a`` and ``b`` agree on every dimension of size other than 1. Of symbolic sizes and
    strides only what is known holds (a symbolic size is not taken to be 1, symbolic strides agree
    where they are the same expression): nothing is guarded in their shape environment (a guard
    ``Ne(batch, 1)`` made a symbolic graph run its passes again at batch 1)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    return all(known(n == 1) or known(x == y) for n, x, y in zip(shape, a, b))


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
    returned = list(flat)
    for i, o in enumerate(flat):
        v = o.meta.get("val") if isinstance(o, fx.Node) else None
        if not isinstance(v, torch.Tensor):
            continue
        want = formats[i] if i < len(formats) else None
        # a view of another output is not copied on its own: eager's outputs alias (GPU fuzz
        # f1b43b3664: ``return x, x.transpose(2, 3)``, the transpose dense channels_last)
        if needs_format(v, want) and not (_is_view(o) and _view_root(o) in returned):  # a dense output
            flat[i] = copy_of(o, want)
            notes.append(f"output {i} ({o.name}) back to {name[want]} as eager gives it")
            continue
        target = strides[i] if i < len(strides) else None
        if target is None or same_strides(v.shape, v.stride(), target):
            continue
        if not _is_view(o) and o.op == "call_function":
            if any(_is_view(r) and _view_root(r) is o for r in returned):
                continue  # viewed by another output: copied (or not) with that view, below
            order = dense_order(tuple(v.shape), target)
            dense = {f: torch.empty(tuple(v.shape), device="meta").contiguous(memory_format=f).stride()
                     for f in (torch.channels_last, torch.contiguous_format)} if v.dim() == 4 else {}
            fmt = next((f for f, st in dense.items() if same_strides(v.shape, st, target)), None)
            if fmt is not None or order is not None:  # e.g. a pointwise op over a transposed value (2e22e3cf84)
                flat[i] = copy_of(o, fmt) if fmt is not None else _permuted_copy(g, o, order)
                notes.append(f"output {i} ({o.name}) copied into eager's strides {tuple(target)}")
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
        also = [j for j, f in enumerate(returned) if f is base]
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


def _view_root(node: fx.Node) -> fx.Node:
    while _is_view(node):
        node = node.args[0]
    return node


def dense_order(shape: tuple, strides) -> list | None:
    """The dimensions from outermost to innermost of a dense layout with ``strides`` (a permutation
    of a contiguous one; dimensions of size 1 anywhere), or None where the strides are not such."""
    if strides is None or len(strides) != len(shape) or not all(type(d) is int for d in (*shape, *strides)):
        return None
    order = sorted(range(len(shape)), key=lambda d: (-strides[d], shape[d] != 1, d))
    step = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != step:
            return None
        step *= shape[d]
    return order


def _permuted_copy(g: fx.Graph, node: fx.Node, order: list) -> fx.Node:
    """``node`` copied into the dense layout whose dimensions run in ``order`` (outermost first):
    permuted so, made contiguous, permuted back (a view of the copy, with those strides)."""
    inverse = [order.index(d) for d in range(len(order))]
    aten = torch.ops.aten
    with g.inserting_after(node):
        p = g.call_function(aten.permute.default, (node, order))
    with g.inserting_after(p):
        c = g.call_function(aten.clone.default, (p,), {"memory_format": torch.contiguous_format})
    with g.inserting_after(c):
        back = g.call_function(aten.permute.default, (c, inverse))
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        mode = getattr(v, "fake_mode", None)
        with mode if mode is not None else contextlib.nullcontext():
            p.meta["val"] = v.permute(order)
            c.meta["val"] = p.meta["val"].clone(memory_format=torch.contiguous_format)
            back.meta["val"] = c.meta["val"].permute(inverse)
    for n in (p, c, back):
        n.meta.update({k: w for k, w in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
    return back


def with_eager_strides(fn, values: list):
    """``fn`` (a compiled inference graph: its outputs one for one Dynamo's) whose outputs come out
    with the strides eager gives them (``values``: eager's, as fake tensors; None where unknown):
    an output whose strides differ in a dimension larger than 1 is copied into eager's. The graph's
    metadata promises them (``restore_output_formats``), but a kernel's real result may differ where
    its fake one does not: ATen chooses a result's format from its input's strides, size-1
    dimensions included, and those of fxopt's fused kernels need not be the fake ones (GPU fuzz
    be7f1a0376: an upsampling after a fused convolution of [1, 2, 1, 1] came out channels_last).
    An output that shares memory with an input keeps its strides; one that other outputs are views
    of is copied with them (``_relayout``: each view rebuilt on the copy, aliasing kept), or kept as
    it is where a view does not map onto the copy or would not get eager's strides.
    Static sizes only; ``fn`` itself where nothing can be compared."""
    want = [(tuple(v.shape), tuple(v.stride())) if isinstance(v, torch.Tensor)
            and dense_order(tuple(v.shape), tuple(v.stride())) is not None else None for v in values]
    if not any(w is not None for w in want):
        return fn

    def call(*args):
        outs = fn(*args)
        if not isinstance(outs, (list, tuple)) or len(outs) != len(want):
            return outs
        fixed = None
        for i, (o, w) in enumerate(zip(outs, want)):
            if w is None or not isinstance(o, torch.Tensor) or (fixed is not None and fixed[i] is not outs[i]):
                continue
            strides = o.stride()
            if (strides == w[1] or o.shape != w[0] or same_strides(w[0], strides, w[1])
                    or _shares_memory(o, (), args)):
                continue
            ptr = o.untyped_storage().data_ptr()
            views = [j for j, v in enumerate(outs) if j != i and isinstance(v, torch.Tensor)
                     and v.untyped_storage().data_ptr() == ptr]
            copies = _relayout(o, w[1], [outs[j] for j in views])
            if copies is None or not all(want[j] is None or same_strides(want[j][0], c.stride(), want[j][1])
                                         for j, c in zip(views, copies[1:])):
                continue
            fixed = list(outs) if fixed is None else fixed
            for j, c in zip([i, *views], copies):
                fixed[j] = c
        if fixed is None:
            return outs
        return tuple(fixed) if isinstance(outs, tuple) else fixed

    call.__wrapped__ = fn
    return call


def _relayout(t: torch.Tensor, strides, views: list):
    """[``t`` copied into the dense ``strides``, each of ``views`` (tensors on ``t``'s storage) as
    the same view of the copy], or None: ``t`` does not cover its whole storage, or a view does not
    map (a dtype view, a step that crosses ``t``'s dimensions)."""
    if views and (t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size()
                  or dense_order(tuple(t.shape), t.stride()) is None):
        return None
    mapped = [_mapped_view(t, strides, v) for v in views]
    if any(m is None for m in mapped):
        return None
    new = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)
    return [new] + [new.as_strided(v.shape, s, off) for v, (s, off) in zip(views, mapped)]


def _mapped_view(t: torch.Tensor, strides, v: torch.Tensor):
    """(strides, storage offset) of view ``v`` of dense ``t`` once ``t``'s elements are laid out with
    ``strides``, or None where a step of ``v`` is not a whole step of one of ``t``'s dimensions."""
    if v.dtype != t.dtype:
        return None
    dims = sorted((d for d in range(t.dim()) if t.shape[d] > 1), key=lambda d: -t.stride(d))
    at = {d: (v.storage_offset() // t.stride(d)) % t.shape[d] for d in dims}  # t's index of v's first element
    room = dict(at)
    ones = {t.stride(d): strides[d] for d in range(t.dim()) if t.shape[d] == 1}
    out = []
    for size, s in zip(v.shape, v.stride()):
        if size == 1 and s in ones:  # a size-1 dimension of t's (its stride as eager's layout has it)
            out.append(ones[s])
            continue
        k = next((d for d in dims if t.stride(d) <= s), None)
        if s == 0 or k is None:  # broadcast; or a size-1 step inside one element
            if size > 1 and s != 0:
                return None
            out.append(0 if s == 0 else 1)
            continue
        step, rest = divmod(s, t.stride(k))
        if rest:
            return None
        if size > 1:
            room[k] += step * (size - 1)
            if room[k] >= t.shape[k]:
                return None
        out.append(step * strides[k])
    return out, sum(at[d] * strides[d] for d in dims)


def _shares_memory(t: torch.Tensor, outs, args) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(isinstance(o, torch.Tensor) and o is not t and o.untyped_storage().data_ptr() == ptr
               for o in list(outs) + list(args))
