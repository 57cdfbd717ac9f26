"""training_batchnorm_relu: training BatchNorm, its residual add and its ReLU as one fused op, forward
and backward (cuDNN's extended BatchNorm on CUDA).

Why: a convolutional network's training step spends much of its memory traffic between
convolutions: BatchNorm writes its output, a ReLU (after an add, in a residual block) reads and
writes it again, and in the backward the ReLU's gradient is one more pass before BatchNorm's.
cuDNN's extended BatchNorm fuses the add and the ReLU into its NHWC kernels in both directions
(registered by the cuda side for the ops' "cuda" dispatch key; ``ctx.target.batch_norm_relu`` says
whether the target has it, ``ctx.target.batch_norm_relu_probe`` asks it); the op pair ``fxopt::batch_norm_relu`` /
``fxopt::batch_norm_relu_backward`` (``fxopt/ops.py``) carries it through the graph.

Runs on AOTAutograd's joint graph, after ``training_batchnorm`` and ``training_layout``: forward
and backward are rewritten together (the backward reads the forward's reserve space, which holds
the ReLU's mask).

Matches (``bn`` from ``training_batchnorm``)::

    bn = _batch_norm_with_update_functional(x, w, b, rm, rv, momentum, eps)
    s = bn[0] [+ z]                              # the add only where it is bn[0]'s one user
    r = relu(s)
    t = threshold_backward(g, detach*(r), 0)     # r's one gradient
    batch_norm_backward(t, x, w, bn[4], bn[5], bn[1], bn[2], True, eps, mask, bn[3])

Produces::

    f = fxopt.batch_norm_relu(x, w, b, rm, rv, z | None, momentum, eps, reserve_bytes, backend)
    r -> f[0]; bn[1..5] -> f[1], f[2], f[3], f[4], f[5]
    d = fxopt.batch_norm_relu_backward(g, x, f[0], w, b, f[1], f[2], f[3], eps, has_z, backend)
    the backward's dx, dw, db -> d[0], d[1], d[2]; t's other readers (z's gradient) -> d[3]

Illegal (left alone, with a reason): a target without the fused kernel (``ctx.target``); not
CUDA (the ``native`` backend exists for tests only);
an input that is not 4-D float16/bfloat16 channels_last, or weight, bias and statistics that are
not float32; a configuration the target's probe finds cuDNN declining or computing
something else; symbolic sizes (the reserve space, which holds the ReLU's mask, is sized by
cuDNN per batch: probing it would specialize a dynamic graph to one batch); BatchNorm's output or
the sum read by anything but the next op; a ReLU whose gradient is not exactly one
``threshold_backward``; a backward of another form. Values are
cuDNN's (eager runs the same library's unfused kernels): equal within the float16 tolerance.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from fxopt.ops import BATCH_NORM_RELU, BATCH_NORM_RELU_BACKWARD
from fxopt.passinfra import PassContext, PassResult, copy_meta, finish, getitem_users, is_call, val

aten = torch.ops.aten
BN = aten._batch_norm_with_update_functional.default
BN_BACKWARD = aten.batch_norm_backward.default
_LOW = (torch.float16, torch.bfloat16)


@dataclass
class Match:
    bn: fx.Node
    items: dict           # bn output index -> getitem node
    add: Optional[fx.Node]
    z: Optional[fx.Node]
    relu: fx.Node
    grad: fx.Node         # threshold_backward
    backward: fx.Node     # batch_norm_backward


def _gradient_of(relu: fx.Node) -> tuple[Optional[fx.Node], Optional[str]]:
    """The one threshold_backward reading ``relu`` (through detaches), or why there is none."""
    found, stack = [], [relu]
    while stack:
        n = stack.pop()
        for u in n.users:
            if is_call(u, aten.detach.default):
                stack.append(u)
            elif is_call(u, aten.threshold_backward.default) and u.args[1] is n:
                found.append(u)
    if len(found) != 1:
        return None, f"the ReLU has {len(found)} gradients"
    t = found[0]
    if t.args[2] != 0:
        return None, "a threshold other than 0"
    return t, None


def _io_reason(m_bn: fx.Node, z: Optional[fx.Node], cuda: bool) -> Optional[str]:
    x, w, b, rm, rv = m_bn.args[:5]
    xv = val(x)
    if xv is None:
        return "no metadata"
    if z is not None:
        zv = val(z)
        if zv is None or zv.shape != xv.shape or zv.dtype != xv.dtype:
            return "the residual is not of the input's shape and dtype"
    if not cuda:
        return None
    if xv.device.type != "cuda":
        return "not CUDA"
    if xv.dim() != 4 or xv.dtype not in _LOW:
        return f"a {xv.dim()}-D {xv.dtype} input (cuDNN fuses 4-D float16/bfloat16)"
    if not xv.is_contiguous(memory_format=torch.channels_last):
        return "the input is not channels_last"
    for t in (w, b, rm, rv):
        tv = val(t) if isinstance(t, fx.Node) else None
        if tv is None or tv.dtype != torch.float32:
            return "weight, bias and running statistics must be float32 tensors"
    return None


def match(bn: fx.Node, cuda: bool = True) -> tuple[Optional[Match], Optional[str]]:
    """The pattern of the module docstring at ``bn``, or (None, why not). ``cuda=False`` leaves
    out the device, dtype and layout requirements of cuDNN (the ``native`` backend)."""
    items = getitem_users(bn)
    if items is None or 0 not in items:
        return None, "used other than through its outputs"
    out = items[0]
    if len(out.users) != 1:
        return None, "its output has several readers"
    nxt = next(iter(out.users))
    add = z = None
    if is_call(nxt, aten.add.Tensor) and len(nxt.args) == 2 and not nxt.kwargs and len(nxt.users) == 1:
        add = nxt
        z = nxt.args[1] if nxt.args[0] is out else nxt.args[0]
        if not isinstance(z, fx.Node) or z is out:
            return None, "the add is not of two tensors"
        nxt = next(iter(nxt.users))
    if not is_call(nxt, aten.relu.default):
        return None, f"followed by {getattr(nxt.target, '__name__', nxt.target)}, not a ReLU"
    relu = nxt
    grad, why = _gradient_of(relu)
    if grad is None:
        return None, why
    # in a residual block whose shortcut is another BatchNorm, both backwards read this gradient
    bws = [u for u in grad.users if is_call(u, BN_BACKWARD) and u.args[0] is grad and u.args[1] is bn.args[0]]
    if len(bws) != 1:
        return None, "the ReLU's gradient does not reach this BatchNorm's backward"
    bw = bws[0]
    if add is None and len(grad.users) != 1:
        return None, "the ReLU's gradient has other readers"
    if (bw.args[1] is not bn.args[0] or bw.args[5] is not items.get(1) or bw.args[6] is not items.get(2)
            or bw.args[7] is not True or len(bw.args) < 11 or bw.args[10] is not items.get(3)):
        return None, "the backward reads other values"
    why = _io_reason(bn, z, cuda)
    if why:
        return None, why
    return Match(bn, items, add, z, relu, grad, bw), None


def _rewrite(graph: fx.Graph, m: Match, reserve_bytes: int, backend: str) -> None:
    x, w, b, rm, rv, momentum, eps = m.bn.args
    with graph.inserting_before(m.relu):
        f = graph.call_function(BATCH_NORM_RELU, (x, w, b, rm, rv, m.z, momentum, eps, reserve_bytes, backend))
        copy_meta(f, m.bn)
        outs = [graph.call_function(operator.getitem, (f, i)) for i in range(6)]
    _same_value(outs[0], m.relu)
    m.relu.replace_all_uses_with(outs[0])
    for i in range(1, 6):
        if i in m.items:
            _same_value(outs[i], m.items[i])
            m.items[i].replace_all_uses_with(outs[i])
    bw = m.backward
    bw_eps = bw.args[8]
    # where the ReLU's gradient was: a shortcut's backward may read z's gradient before ``bw`` runs
    with graph.inserting_before(m.grad):
        d = graph.call_function(BATCH_NORM_RELU_BACKWARD, (m.grad.args[0], x, outs[0], w, b, outs[1], outs[2],
                                                           outs[3], bw_eps, m.add is not None, backend))
        copy_meta(d, bw)
        grads = [graph.call_function(operator.getitem, (d, i)) for i in range(4)]
    for u in list(bw.users):
        _same_value(grads[u.args[1]], u)
        u.replace_all_uses_with(grads[u.args[1]])
    if m.add is not None:  # what reaches z is the ReLU's gradient
        _same_value(grads[3], m.grad)
        m.grad.replace_all_uses_with(grads[3])
    # nothing reads the old nodes any more: the backward and its items, the ReLU's gradient and the
    # detaches it read, the ReLU, the add, the BatchNorm and its items
    detached = m.grad.args[1]
    for n in (*bw.users, bw, m.grad):
        graph.erase_node(n)
    while is_call(detached, aten.detach.default) and not detached.users:
        src = detached.args[0]
        graph.erase_node(detached)
        detached = src
    for n in (m.relu, m.add, *m.bn.users, m.bn):
        if n is not None:
            graph.erase_node(n)


def _same_value(new: fx.Node, old: fx.Node) -> None:
    """``new`` computes what ``old`` did: its provenance and its recorded value."""
    copy_meta(new, old)
    if "val" in old.meta:
        new.meta["val"] = old.meta["val"]


def _reserve(m: Match, backend: str, probe) -> tuple[Optional[int], Optional[str]]:
    if backend == "native":
        return 0, None
    xv = val(m.bn.args[0])
    if not all(isinstance(s, int) for s in xv.shape):  # (an isinstance test adds no guard)
        return None, ("symbolic sizes: cuDNN sizes the ReLU's mask per batch, and reading the size would "
                      "specialize the graph to it")
    return probe(tuple(xv.shape), xv.dtype, m.add is not None, xv.device.index or 0)


def run(gm: fx.GraphModule, ctx: PassContext, backend: Optional[str] = None) -> PassResult:
    """The target's fused kernel (``ctx.target.batch_norm_relu``); ``backend="native"`` (tests)
    rewrites on any device, running PyTorch's kernels."""
    backend = backend or ctx.target.batch_norm_relu
    if backend is None:
        ctx.note(f"skipped: {ctx.target.batch_norm_relu_reason}")
        return PassResult(gm, False)
    probe = ctx.target.batch_norm_relu_probe
    if backend != "native" and probe is None:
        ctx.note(f"skipped: the target has no probe for its {backend} BatchNorm + ReLU kernel")
        return PassResult(gm, False)
    changed = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, BN) or node.graph is not gm.graph:
            continue
        m, why = match(node, cuda=backend == "cudnn")
        if m is None:
            ctx.note(f"kept {node.name}: {why}")
            continue
        reserve, why = _reserve(m, backend, probe)
        if reserve is None:
            ctx.note(f"kept {node.name}: {why}")
            continue
        _rewrite(gm.graph, m, reserve, backend)
        changed += 1
    return finish(gm, ctx, changed, f"BatchNorm + ReLU pair(s) fused with their gradients ({backend})")

