"""A packaged graph at one batch size: the values its nodes take there, and its specialisation.

A package's batch may be symbolic (``fxopt.packaging``, "Batch"); the cuda executor, whose kernels
are generated for static shapes, gets one specialisation per batch size. The package stores every
node's value as expressions of the batch (``symbolic_vals``, ``exported_vals``), so that the loading
process specialises without FakeTensor propagation (which imports Dynamo); packaging checks them
against propagation (``vals_agree``). Layout clones a specialisation shows to be copies are dropped
(``drop_noop_layout_clones``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx


def symbolic_vals(gm: fx.GraphModule, batch) -> Optional[dict]:
    """Per node of ``gm`` (FakeTensor values, batch symbolic or not) its value as
    ``fxopt.serialize`` writes one, sizes as expressions of the batch (``batch``: the symbol's
    name; a tuple of names: of those symbols, ``_val_json``); None when some node's value cannot be
    written so."""
    from fxopt.serialize import _val_json

    out = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "call_function", "call_module"):
            out[n.name] = _val_json(n.meta.get("val"), batch)
            if out[n.name] is None:
                return None
    return out


def _exported_vals(gm: fx.GraphModule, inputs: dict, weights: dict, dynamic: bool) -> Optional[dict]:
    """``symbolic_vals`` of the optimized graph, propagated afresh from the example ``inputs``
    (name -> tensor; dimension 0 symbolic when the batch varies) and the frozen weights; None where
    that fails. (A fresh shape environment: the export's may have specialised the batch since.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fxopt.fakeprop import FakeProp
    from fxopt.pipeline import copy_graph_module

    def fake(x, batch_dim: bool):
        if not batch_dim or x.dim() == 0:
            return mode.from_tensor(x, static_shapes=True)
        # traced at a batch of 7, its layout kept: an example batch of 1 would let ops specialise on it
        x = torch.empty_like(x[:1].expand(7, *x.shape[1:]), memory_format=torch.preserve_format)
        sizes = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (x.dim() - 1)
        return mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    try:
        mode = FakeTensorMode(shape_env=ShapeEnv() if dynamic else None)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        args = [fake(inputs[n], dynamic) if n in inputs else fake(weights[n], False) for n in names]
        first = args[names.index(next(iter(inputs)))] if inputs else None
        b = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else None
        copy = copy_graph_module(gm)
        with torch.no_grad():
            FakeProp(copy, mode).propagate_dont_convert_inputs(*args)
    except Exception:  # noqa: BLE001 - the loader then propagates FakeTensors itself
        return None
    return symbolic_vals(copy, str(b.node.expr) if isinstance(b, torch.SymInt) else None)


def _same_val(a, b, offsets: bool = True) -> bool:
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):  # (propagation gives a split's list)
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(_same_val(x, y, offsets) for x, y in zip(a, b)))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        from fxopt.eager_formats import same_strides

        # the same memory layout: a dimension of extent 1 is never stepped along, so its stride is
        # free (a 1x1 feature map's channels_last strides propagate as (C, 1, C, C) or (C, 1, 1, 1))
        return (a.shape == b.shape and a.dtype == b.dtype and same_strides(a.shape, a.stride(), b.stride())
                and (not offsets or a.storage_offset() == b.storage_offset()))
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b


def _vals_agree(stored: fx.GraphModule, propagated: fx.GraphModule) -> bool:
    """Whether the stored values equal FakeTensor propagation's, node by node (packaging checks
    every batch it runs)."""
    mine = {n.name: n.meta.get("val") for n in stored.graph.nodes}
    # a size (an int) propagation may leave unrecorded (torch 2.11 does): the tensors using it agree
    # (an input's offset into its storage is its caller's: a loaded package's weights share one)
    return all(_same_val(mine.get(n.name), n.meta.get("val"), n.op != "placeholder") for n in propagated.graph.nodes
               if n.op in ("placeholder", "call_function", "call_module")
               and not (n.meta.get("val") is None and isinstance(mine.get(n.name), int)))


def from_vals(gm: fx.GraphModule, vals: dict, batch, fake: bool = False) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes carry the values ``vals`` (``symbolic_vals``) take at ``batch``
    (``serialize.eval_size``), as meta tensors (``fake``: FakeTensors on their devices); raises
    KeyError / ValueError / TypeError / RuntimeError where a value cannot be rebuilt."""
    return _from_vals(gm, vals, batch, fake)[0]


def _size_free(v) -> bool:
    """Whether a stored value (``_val_json``) is the same at every size: no expression in it, and no
    tensor that requires grad (whose autograd state a graph could change)."""
    if isinstance(v, dict):
        return type(v["i"]) is int if "i" in v else all(_size_free(t) for t in v["t"])
    shape, stride, _dtype, _device, grad, *offset = v
    return not grad and all(type(d) is int for d in (*shape, *stride, *offset))


class ValueMemo:
    """What the sizes of one graph share when their values are rebuilt (``specialise_at(memo=...)``):
    one FakeTensorMode, and the values that are the same at every size (``_size_free``: a resnet18's
    weights, four fifths of its values), made once (they were two thirds of a size's
    specialisation). Rebuilding holds ``lock``: the mode is not shared by two threads at once."""

    def __init__(self):
        import threading

        self.mode, self.fixed, self.lock = None, {}, threading.Lock()


def _from_vals(gm: fx.GraphModule, vals: dict, batch, fake: bool = False, fold: bool = False,
               memo: Optional[ValueMemo] = None):
    """``from_vals``, and with ``fold`` the sizes folded (``_fold_graph``) before the module is made:
    its code is generated once (each generation of a resnet18's costs about as much as rebuilding its
    values). ``memo``: a ``ValueMemo`` the sizes of ``gm`` share (``vals`` are always ``gm``'s).
    Returns (the module, how many sizes were folded)."""
    if memo is None:
        return _made_from_vals(gm, vals, batch, fake, fold, None)
    with memo.lock:
        return _made_from_vals(gm, vals, batch, fake, fold, memo)


def _made_from_vals(gm: fx.GraphModule, vals: dict, batch, fake: bool, fold: bool, memo: Optional[ValueMemo]):
    from fxopt.pipeline import copy_graph, module_of
    from fxopt.serialize import _val_from_json

    mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = memo.mode if memo is not None else None
        if mode is None:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            if memo is not None:
                memo.mode = mode
    fixed = memo.fixed.setdefault(fake, {}) if memo is not None else {}
    at = {}
    for name, v in vals.items():
        val = fixed.get(name)
        if val is None:
            val = _val_from_json(v, mode, batch)
            if memo is not None and _size_free(v):
                fixed[name] = val
        at[name] = val
    g = copy_graph(gm)
    for n in g.nodes:
        if n.op in ("placeholder", "call_function", "call_module"):
            n.meta["val"] = at[n.name]
    folded = _fold_graph(g) if fold else 0
    return module_of(gm, g), folded


def _specialise(gm: fx.GraphModule, args: list, vals: Optional[dict] = None,
                batch: Optional[int] = None, fake: bool = False) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes carry their values at these (static) shapes in ``meta["val"]``:
    from the package's ``vals`` (``symbolic_vals``) as meta tensors where given (no propagation:
    FakeTensorMode imports Dynamo, seconds of a fresh process's first call; ``fake``: as FakeTensors),
    else by FakeTensor propagation."""
    from fxopt.pipeline import copy_graph_module

    if vals is not None:
        try:
            return from_vals(gm, vals, batch, fake)
        except (KeyError, ValueError, TypeError, RuntimeError):
            pass
    static = copy_graph_module(gm)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxopt.fakeprop import FakeProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad():
        FakeProp(static, mode).propagate_dont_convert_inputs(*fakes)
    return static


def _is_size_op(target) -> bool:
    import operator

    aten = torch.ops.aten
    return (target in (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
                       aten.sym_storage_offset.default, torch.sym_max, torch.sym_min, torch.sym_int,
                       torch.sym_float, torch.sym_sum)
            or any(target is f for f in vars(operator).values()))


def _fold_sizes(gm: fx.GraphModule) -> int:
    """``_fold_graph`` on ``gm``'s graph, its code generated again where that changed it."""
    folded = _fold_graph(gm.graph)
    if folded:
        gm.recompile()
    return folded


def _fold_graph(graph: fx.Graph) -> int:
    """In a graph specialised at static sizes: every use of a size input (a ``SymInt`` placeholder:
    Dynamo passes the sizes of a symbolic graph as inputs) and of size arithmetic (``sym_size``,
    ``operator.mul`` on sizes) replaced by its int, the arithmetic erased (placeholders stay: the
    callers' arguments). Returns how many nodes were folded (a size input none reads is none)."""
    folded = 0
    for n in list(graph.nodes):
        v = n.meta.get("val")
        if type(v) is not int or not (n.op == "placeholder" or (n.op == "call_function" and _is_size_op(n.target))):
            continue
        if n.op == "placeholder" and not n.users:
            continue
        for user in list(n.users):
            user.args = fx.node.map_arg(user.args, lambda a: v if a is n else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a: v if a is n else a)
        if n.op != "placeholder":
            graph.erase_node(n)
        folded += 1
    return folded


def specialise_at(gm: fx.GraphModule, args: list, vals: Optional[dict] = None,
                  batch: Optional[int] = None, fake: bool = False,
                  memo: Optional[ValueMemo] = None) -> tuple[fx.GraphModule, dict]:
    """A graph optimized with symbolic sizes, made static at the sizes of ``args``: one mechanism for
    a package's batch (``fxopt.packaging``) and for ``torch.compile``'s dynamic shapes
    (``fxopt.dynamic``). Every node's value at these sizes (``_specialise``), the size inputs and
    size arithmetic folded into ints (``_fold_sizes``), and the layout clones these sizes show to be
    copies removed (``_drop_noop_layout_clones``). ``fake``: the stored ``vals`` rebuilt as FakeTensors
    on their devices (which the executor's measurements read), not meta tensors; ``memo``: what the sizes of
    ``gm`` share (``ValueMemo``). Returns (graph, counts)."""
    static, folded = None, 0
    if vals is not None:  # the sizes folded before the module is made: its code generated once
        try:
            static, folded = _from_vals(gm, vals, batch, fake, fold=True, memo=memo)
        except (KeyError, ValueError, TypeError, RuntimeError):
            pass
    if static is None:
        static = _specialise(gm, args, None, batch, fake)
    folded += _fold_sizes(static)
    return static, {"sizes_folded": folded, "layout_clones_removed": _drop_noop_layout_clones(static)}


_LAYOUT_FORMATS = (torch.channels_last, torch.contiguous_format)


def _drop_noop_layout_clones(gm: fx.GraphModule) -> int:
    """After a batch size is specialised: remove ``aten.clone(x, memory_format=f)`` where ``x``
    already has layout ``f`` at that size. The layout pass puts such clones where a symbolic batch
    leaves a convolution's output layout undecided (``torch.compile`` sees static shapes and has none);
    at a static size they are copies of a tensor nothing writes to. Left alone: a clone of an input or
    read by the output (a caller could see the aliasing), and every clone of a graph with an op that
    writes in place. Returns how many were removed."""
    aten = torch.ops.aten
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    if any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable for n in nodes):
        return 0
    removed = 0
    for n in nodes:
        if n.target is not aten.clone.default or set(n.kwargs) != {"memory_format"}:
            continue
        src, fmt = n.args[0], n.kwargs["memory_format"]
        if fmt not in _LAYOUT_FORMATS or not isinstance(src, fx.Node) or src.op == "placeholder":
            continue
        if any(u.op == "output" for u in n.users):
            continue
        v, sv = n.meta.get("val"), src.meta.get("val")
        if not (isinstance(v, torch.Tensor) and isinstance(sv, torch.Tensor) and sv.is_contiguous(memory_format=fmt)
                and v.shape == sv.shape and v.stride() == sv.stride() and v.dtype == sv.dtype):
            continue
        n.replace_all_uses_with(src)
        gm.graph.erase_node(n)
        removed += 1
    if removed:
        gm.recompile()
    return removed
