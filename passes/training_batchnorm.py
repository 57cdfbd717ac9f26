"""training_batchnorm: BatchNorm in training runs the kernels eager PyTorch runs (cuDNN on CUDA).

Why: AOTAutograd traces a training-mode BatchNorm as
``_native_batch_norm_legit_functional`` and its gradient as ``native_batch_norm_backward``;
both always run PyTorch's native kernels. Eager PyTorch runs ``_batch_norm_with_update``, which
picks a backend per call (cuDNN where it applies, as for fp16 activations with fp32 weights
under autocast) and hands the backward cuDNN's reserve space. On the H100 the native kernels
took about half of ResNet-50's training step (fp16, batch 64: ~15 ms of BatchNorm per step
against ~4 ms for cuDNN's), and their different rounding made the losses drift from eager's.

Runs on AOTAutograd's *joint* graph (before the partition into forward and backward), because
the reserve space is a new value the backward reads from the forward.

Matches:
    bn = _native_batch_norm_legit_functional(x, w, b, running_mean, running_var, True, momentum, eps)
    out, save_mean, save_rstd, new_mean, new_var = bn[0..4]
    [native_batch_norm_backward(g, x, w, rm, rv, save_mean, save_rstd, True, eps, mask)]

Produces:
    bn = _batch_norm_with_update_functional(x, w, b, running_mean, running_var, momentum, eps)
    out, save_mean, save_rstd, reserve, new_mean, new_var = bn[0..5]
    [batch_norm_backward(g, x, w, None, None, save_mean, save_rstd, True, eps, mask, reserve)]

The backward of a training BatchNorm never reads running statistics (AOTAutograd hands it the new
ones): passing none, the forward keeps none for it, and the cuda executor can let BatchNorm update
its buffers in place (``backends/cuda/runtime/running_stats.py``).

The same values as eager's (the ops eager dispatches to, with the same backend choice); on a
device or dtype where cuDNN does not apply, both run the native kernels as before.

Illegal (left alone, with a reason): evaluation-mode BatchNorm (``training=False``); no affine
weight (``batch_norm_backward`` needs one); a statistic used by anything but the backward node
and the graph outputs; a backward with another form than the one above.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from fxopt.passinfra import PassContext, PassResult, copy_meta, finish, is_call

aten = torch.ops.aten

BN_FUNCTIONAL = aten._native_batch_norm_legit_functional.default
BN_BACKWARD = aten.native_batch_norm_backward.default
BN_WITH_UPDATE = aten._batch_norm_with_update_functional.default
BN_BACKWARD_RESERVE = aten.batch_norm_backward.default


def _outputs(node: fx.Node) -> Optional[dict[int, fx.Node]]:
    """index -> getitem user, or None when the node is used other than through getitem."""
    outs: dict[int, fx.Node] = {}
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem:
            return None
        outs[u.args[1]] = u
    return outs


def _backward_of(node: fx.Node, outs: dict[int, fx.Node]) -> tuple[Optional[fx.Node], Optional[str]]:
    """(the native_batch_norm_backward reading this BatchNorm's statistics or None, why not legal)."""
    users = set()
    for i in (1, 2):
        if i in outs:
            users |= {u for u in outs[i].users if u.op != "output"}
    if not users:
        return None, None
    if len(users) != 1:
        return None, "its statistics have several users"
    bw = users.pop()
    if not is_call(bw, BN_BACKWARD):
        return None, f"its statistics are read by {bw.target}"
    if bw.args[5] is not outs.get(1) or bw.args[6] is not outs.get(2) or bw.args[7] is not True:
        return None, "the backward reads other statistics"
    return bw, None


def illegal_reason(node: fx.Node) -> Optional[str]:
    """Why this BatchNorm must stay as AOTAutograd traced it, or None."""
    x, w, b, rm, rv, training, momentum, eps = node.args
    if training is not True:
        return "evaluation mode"
    if w is None:
        return "no affine weight"
    outs = _outputs(node)
    if outs is None:
        return "used other than through its outputs"
    return _backward_of(node, outs)[1]


def _rewrite(graph: fx.Graph, node: fx.Node) -> None:
    x, w, b, rm, rv, _, momentum, eps = node.args
    outs = _outputs(node)
    bw, _ = _backward_of(node, outs)
    with graph.inserting_before(node):
        new = graph.call_function(BN_WITH_UPDATE, (x, w, b, rm, rv, momentum, eps))
        copy_meta(new, node)
    items = {}
    with graph.inserting_after(new):
        for old_i, new_i in ((0, 0), (1, 1), (2, 2), (3, 4), (4, 5)):
            if old_i in outs:
                items[new_i] = graph.call_function(operator.getitem, (new, new_i))
                copy_meta(items[new_i], outs[old_i])
                outs[old_i].replace_all_uses_with(items[new_i])
                graph.erase_node(outs[old_i])
        reserve = graph.call_function(operator.getitem, (new, 3))
    if bw is not None:
        g, bx, bw_w, _, _, sm, sr, _, beps, mask = bw.args
        with graph.inserting_before(bw):  # a training backward reads no running statistics
            new_bw = graph.call_function(BN_BACKWARD_RESERVE,
                                         (g, bx, bw_w, None, None, items[1], items[2], True, beps, mask, reserve))
            copy_meta(new_bw, bw)
        bw.replace_all_uses_with(new_bw)
        graph.erase_node(bw)
    graph.erase_node(node)


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    changed = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, BN_FUNCTIONAL):
            continue
        why = illegal_reason(node)
        if why:
            ctx.note(f"kept {node.name}: {why}")
            continue
        _rewrite(gm.graph, node)
        changed += 1
    return finish(gm, ctx, changed, "BatchNorm(s) run as eager runs them (with cuDNN's reserve space where it applies)")
