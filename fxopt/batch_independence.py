"""Whether a symbolic inference graph acts on every sample of its batch on its own.

A graph is *batch-independent* when its batch (one symbol, the outermost dimension of its batched
inputs) stays the outermost dimension of every value that carries it, and no op mixes samples: no
reduction, view, permute, concatenation or slice over dimension 0, no training-mode BatchNorm (it
reduces over the batch), no random op, nothing written in place. Then the first ``b`` rows of the
graph's outputs at a larger batch ``B`` (rows ``b..B`` anything) are its outputs at ``b``, which is
what lets ``fxopt.dynamic`` run a new batch size on a size already lowered (``fxopt.dynamic_buckets``).

``check(gm, batch_symbol)`` walks the graph (its nodes' ``meta["val"]`` in the symbolic shape
environment) with an allow-list of ops known to act per sample and returns a ``BatchPlan`` or a
one-line reason to decline. What it does not know declines: the graph then lowers every size.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.fx as fx

aten = torch.ops.aten

# per-sample ops: (overload packet, index of the argument carrying the batch); every other tensor
# argument must be batch-free (weights, biases, statistics)
_PER_SAMPLE = {
    aten.convolution: 0, aten._convolution: 0, aten.convolution_overrideable: 0, aten.cudnn_convolution: 0,
    aten.mkldnn_convolution: 0, aten.cudnn_convolution_relu: 0, aten.cudnn_convolution_add_relu: 0,
    aten._native_batch_norm_legit_no_training: 0, aten.native_layer_norm: 0, aten.native_group_norm: 0,
    aten.max_pool2d_with_indices: 0, aten.max_pool2d: 0, aten.max_pool1d: 0, aten.max_pool3d_with_indices: 0,
    aten.avg_pool2d: 0, aten.avg_pool1d: 0, aten.avg_pool3d: 0, aten.adaptive_avg_pool2d: 0,
    aten._adaptive_avg_pool2d: 0, aten.adaptive_avg_pool1d: 0, aten.adaptive_max_pool2d: 0,
    aten._adaptive_avg_pool3d: 0, aten.upsample_nearest2d: 0, aten.upsample_bilinear2d: 0,
    aten._upsample_nearest_exact2d: 0, aten._upsample_bilinear2d_aa: 0, aten.upsample_bicubic2d: 0,
    aten.pixel_shuffle: 0, aten.pixel_unshuffle: 0, aten.channel_shuffle: 0, aten.constant_pad_nd: 0,
    aten.reflection_pad2d: 0, aten.replication_pad2d: 0, aten.mm: 0, aten.addmm: 1, aten.linear: 0,
    aten.clone: 0, aten._to_copy: 0, aten.alias: 0, aten.detach: 0, aten.contiguous: 0,
    aten.lift_fresh_copy: 0, aten.expand: 0,
}
# ops with a dimension argument (index) that must not be the batch's
_DIM_ARG = {aten.mean: 1, aten.sum: 1, aten.amax: 1, aten.amin: 1, aten.max: 1, aten.min: 1, aten.argmax: 1,
            aten.argmin: 1, aten.var: 1, aten.std: 1, aten.prod: 1, aten.any: 1, aten.all: 1, aten.logsumexp: 1,
            aten.var_mean: 1, aten.softmax: 1, aten._softmax: 1, aten.log_softmax: 1, aten._log_softmax: 1,
            aten.cumsum: 1, aten.select: 1, aten.slice: 1, aten.narrow: 1, aten.split: 2, aten.split_with_sizes: 2,
            aten.chunk: 2, aten.unsqueeze: 1, aten.squeeze: 1, aten.transpose: 1, aten.flip: 1, aten.roll: 2,
            aten.cat: 1, aten.stack: 1, aten.unbind: 1}
_VIEWS = {aten.view, aten._unsafe_view, aten.reshape, aten.flatten}
_TRAINING_BN = {aten._native_batch_norm_legit_functional, aten._native_batch_norm_legit, aten.native_batch_norm,
                aten.batch_norm, aten.cudnn_batch_norm, aten.miopen_batch_norm, aten._batch_norm_impl_index}
_SIZE_OPS = {aten.sym_size, aten.sym_numel, aten.sym_stride, aten.sym_storage_offset}
_SCALAR_OPS = tuple(f for f in vars(operator).values() if callable(f)) + (torch.sym_max, torch.sym_min,
                                                                          torch.sym_int, torch.sym_float)

F, B, S = "free", "batch", "size"  # batch-free; batch at dim 0; the batch size as a scalar


@dataclass
class BatchPlan:
    """How a batch-independent graph is padded: the batch symbol, the arguments that carry it, the
    outputs that do."""
    symbol: str
    #: argument index -> "dim0" (a tensor whose dimension 0 is the batch) or "size" (the batch itself)
    args: dict = field(default_factory=dict)
    #: per output: whether its dimension 0 is the batch (sliced after a padded run)
    outputs: list = field(default_factory=list)


class _Decline(Exception):
    pass


def _syms(x) -> set:
    if isinstance(x, torch.SymInt):
        return {str(s) for s in x.node.expr.free_symbols}
    return set()


def _state(v, sym: str) -> Union[str, tuple, None]:
    """A value's state: F, B, S, a tuple of states, or None (nothing)."""
    if isinstance(v, (tuple, list)):
        return tuple(_state(x, sym) for x in v)
    if isinstance(v, torch.Tensor):
        where = [i for i, d in enumerate(v.shape) if sym in _syms(d)]
        if not where and not any(sym in _syms(s) for s in v.stride()):
            return F
        if where == [0] and str(v.shape[0].node.expr) == sym:
            return B
        raise _Decline(f"the batch is not the outermost dimension of a value (shape {tuple(v.shape)})")
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return S if sym in {str(s) for s in v.node.expr.free_symbols} else F
    return F if v is None or isinstance(v, (int, float, bool)) else None


def _norm(d, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _dims(arg, ndim: int) -> Optional[list]:
    if arg is None:
        return None
    return [_norm(int(d), ndim) for d in (arg if isinstance(arg, (list, tuple)) else [arg])]


def _arg_states(node: fx.Node, states: dict) -> list:
    out = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: out.append((a, states.get(a.name, F))))
    return out


def _flat(s) -> list:
    return [x for t in s for x in _flat(t)] if isinstance(s, tuple) else [s]


def _check_node(n: fx.Node, states: dict, sym: str):
    """The node's state, or raises _Decline."""
    val = n.meta.get("val")
    inputs = _arg_states(n, states)
    flat_in = [s for _, st in inputs for s in _flat(st)]
    target = n.target
    packet = getattr(target, "overloadpacket", None)
    name = getattr(target, "__name__", str(target))
    if target is operator.getitem:
        src = states.get(n.args[0].name)
        return src[n.args[1]] if isinstance(src, tuple) else _state(val, sym)
    if packet in _TRAINING_BN:
        training = n.args[5] if len(n.args) > 5 else n.kwargs.get("training", True)
        if packet is aten._native_batch_norm_legit_functional or training is not False:
            raise _Decline("training-mode BatchNorm (its statistics reduce over the batch)")
    if isinstance(target, torch._ops.OpOverload):
        if target._schema.is_mutable:
            raise _Decline(f"{name} writes in place")
        if torch.Tag.nondeterministic_seeded in target.tags:
            raise _Decline(f"{name} is random (rows would draw different numbers at another batch)")
    out = _state(val, sym)
    if B not in flat_in and S not in flat_in:
        return out  # computes nothing of the batch (weights, constants, sizes of other dimensions)
    if packet in _SIZE_OPS and inputs and inputs[0][1] == B:  # a size (stride...) of a batched value
        if packet is aten.sym_size and _norm(n.args[1], n.args[0].meta["val"].dim()) == 0:
            return S  # the batch size itself
        if out != F:
            raise _Decline(f"{name} reads a size that depends on the batch (a padded run would read another)")
        return F  # the size of another dimension: the same at every batch
    if B not in _flat(out) and S not in _flat(out):
        raise _Decline(f"{name} reduces the batch away (dimension 0 mixed)")
    if target in _SCALAR_OPS or packet in _SIZE_OPS:
        return out if packet not in _SIZE_OPS else F
    if not isinstance(target, torch._ops.OpOverload):
        raise _Decline(f"{name} is not an ATen op known to act per sample")
    for t in _flat(out):
        if t not in (B, F, None):
            raise _Decline(f"{name} outputs the batch size as a value")
    x = n.args[0] if n.args else None
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    ndim = xv.dim() if isinstance(xv, torch.Tensor) else 0
    if packet in _TRAINING_BN:  # eval-mode BatchNorm: per sample
        return out
    if packet in _VIEWS:
        ov = val
        if inputs[0][1] != B or out != B or not _same(xv.shape[1:], ov.shape[1:]):
            raise _Decline(f"{name} reshapes the batch together with other dimensions")
        return out
    if packet is aten.permute:
        if _norm(n.args[1][0], ndim) != 0:
            raise _Decline("permute moves the batch dimension")
        return out
    if packet in _DIM_ARG:
        if packet in (aten.cat, aten.stack):
            if any(s != B for s in _flat(inputs[0][1]) if s is not None):
                raise _Decline(f"{name} joins batched and batch-free tensors")
            first = n.args[0][0].meta["val"]
            dims = _dims(n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0), first.dim())
        else:
            i = _DIM_ARG[packet]
            arg = n.args[i] if len(n.args) > i else n.kwargs.get("dim")
            if isinstance(arg, fx.Node) or (packet in (aten.split, aten.split_with_sizes, aten.chunk)
                                            and len(n.args) <= i):
                arg = n.args[i] if len(n.args) > i else 0
            if arg is None and packet in (aten.squeeze,):
                arg = [d for d in range(ndim) if d != 0]
            if arg is None or (isinstance(arg, (list, tuple)) and not arg and packet is not aten.squeeze):
                raise _Decline(f"{name} over every dimension mixes the batch")
            dims = _dims(arg, ndim + (1 if packet is aten.unsqueeze else 0))
        if 0 in dims:
            raise _Decline(f"{name} over dimension 0 mixes the batch")
        if packet is aten.transpose and 0 in _dims(n.args[2], ndim):
            raise _Decline("transpose moves the batch dimension")
        if any(s == B for _, st in inputs[1:] for s in _flat(st)):
            raise _Decline(f"{name} takes the batch in an argument other than its input")
        return out
    if packet in _PER_SAMPLE:
        i = _PER_SAMPLE[packet]
        for k, (a, st) in enumerate(inputs):
            if S in _flat(st) and packet is not aten.native_group_norm and packet is not aten.expand:
                raise _Decline(f"{name} takes the batch size as an argument")
            if B in _flat(st) and k != i:
                raise _Decline(f"{name} takes the batch in argument {k}, not its input")
        if packet is aten.constant_pad_nd and len(n.args[1]) >= 2 * ndim and any(n.args[1][-2:]):
            raise _Decline("constant_pad_nd pads the batch dimension")
        if packet is aten.mm and inputs[0][1] != B:
            raise _Decline("mm with the batch in its second operand")
        return out
    if torch.Tag.pointwise in target.tags:
        od = val.dim() if isinstance(val, torch.Tensor) else 0
        for a, st in inputs:
            v = a.meta.get("val")
            if st == B and (not isinstance(v, torch.Tensor) or v.dim() != od):
                raise _Decline(f"{name} broadcasts a batched operand against more dimensions")
            if st == S:
                raise _Decline(f"{name} computes with the batch size")
        return out
    raise _Decline(f"{name} is not known to act per sample")


def _same(a, b) -> bool:
    """Whether two symbolic shapes hold as many elements."""
    import sympy

    def numel(s):
        out = sympy.Integer(1)
        for d in s:
            out = out * (d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(int(d)))
        return out

    return sympy.simplify(numel(a) - numel(b)) == 0


def check(gm: fx.GraphModule, fakes: list) -> tuple[Optional[BatchPlan], str]:
    """``(plan, "")`` when ``gm`` (symbolic ``meta["val"]``s; ``fakes``: its inputs in that shape
    environment) is batch-independent, else ``(None, reason)``."""
    dim0 = {str(a.shape[0].node.expr) for a in fakes
            if isinstance(a, torch.Tensor) and a.dim() and isinstance(a.shape[0], torch.SymInt)
            and not isinstance(a.shape[0].node.maybe_as_int(), int)}
    if len(dim0) != 1:
        return None, ("no input has a symbolic dimension 0" if not dim0
                      else f"inputs' dimension 0 are different symbols ({', '.join(sorted(dim0))})")
    sym = dim0.pop()
    if not sym.isidentifier():
        return None, f"the batch is an expression ({sym})"
    plan = BatchPlan(sym)
    states: dict = {}
    try:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(fakes):
            return None, "the graph's inputs differ from the arguments"
        for i, (n, a) in enumerate(zip(placeholders, fakes)):
            st = states[n.name] = _state(a, sym)
            if st == B:
                plan.args[i] = "dim0"
            elif st == S:
                if str(a.node.expr) != sym:
                    return None, f"an input size is an expression of the batch ({a})"
                plan.args[i] = "size"
        for n in gm.graph.nodes:
            if n.op == "call_function":
                states[n.name] = _check_node(n, states, sym)
            elif n.op == "get_attr":
                states[n.name] = F
            elif n.op == "call_module":
                raise _Decline(f"module call {n.target}")
            elif n.op == "output":
                outs = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
                for o in outs:
                    st = states.get(o.name, F) if isinstance(o, fx.Node) else F
                    if st not in (B, F, None):
                        raise _Decline("an output is the batch size or a tuple")
                    plan.outputs.append(st == B)
    except _Decline as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - a graph the check cannot read is not padded
        return None, f"not checked ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    if not any(plan.outputs):
        return None, "no output carries the batch"
    shared = _outputs_sharing_memory(gm)
    if shared:
        return None, f"outputs {shared} share memory (padded or chunked runs would hand out separate tensors)"
    return plan, ""


def _outputs_sharing_memory(gm: fx.GraphModule) -> str:
    """The names of two graph outputs whose values share storage (one a view of the other, or both
    of one tensor, by their fake tensors' storages), or "" where none do."""
    from torch.multiprocessing.reductions import StorageWeakRef

    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    seen: dict = {}
    for o in (out if isinstance(out, (list, tuple)) else [out]):
        v = o.meta.get("val") if isinstance(o, fx.Node) else None
        if not isinstance(v, torch.Tensor):
            continue
        try:
            ref = StorageWeakRef(v.untyped_storage())
        except Exception:  # noqa: BLE001 - a value without a storage to compare shares none
            continue
        if ref in seen and seen[ref] != o.name:
            return f"{seen[ref]} and {o.name}"
        seen.setdefault(ref, o.name)
    return ""
