"""fold_batchnorm: fold inference BatchNorm into the preceding convolution or linear layer.

Why: an eval-mode BatchNorm is a per-channel affine map ``y = x * s + t`` with
``s = gamma / sqrt(var + eps)`` and ``t = beta - mean * s``. Applied to the
output of a convolution (or linear layer) it can be absorbed into that layer's
weight and bias, removing a full read and write of the activation.

Matches (ATen, after AOTAutograd):
    getitem(_native_batch_norm_legit_no_training(conv, gamma, beta, mean, var, m, eps), 0)
        with conv = aten.convolution(x, w, b, ..., transposed=False, ...)  (1d/2d/3d, any groups)
        or   conv = aten.addmm(b, x, aten.t(w)) / aten.mm(x, aten.t(w))   (nn.Linear + BatchNorm1d)

Produces: the same convolution / addmm with weight ``w * s`` and bias
``(b - mean) * s + beta`` written as ATen nodes on the weights alone, so the
``fold_constants`` pass evaluates them once at compile time under freezing (and
again if a weight changes in place). The fold is done in float32 for half
types and cast back.

Illegal (left alone, with a reason): training-mode BatchNorm (it normalises by
batch statistics and updates running stats); training graphs; a transposed
convolution; a layer output that is also used elsewhere (it must stay
observable); BatchNorm outputs other than the normalised tensor in use; a
result dtype different from the BatchNorm's.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.passinfra import PassContext, PassResult, copy_meta, getitem_users, is_call, only_user, val

aten = torch.ops.aten
BN_INFERENCE = aten._native_batch_norm_legit_no_training.default


def match(bn: fx.Node, ctx: PassContext):
    """Legality check. Returns (kind, layer node, BN output getitem) or a reason string."""
    if ctx.mode != "inference":
        return "training graph: BatchNorm stays"
    items = getitem_users(bn)
    if not items or set(items) != {0}:
        return "BatchNorm statistics outputs are used"
    inp = bn.args[0]
    if only_user(inp) is not bn:
        return f"{getattr(inp, 'name', inp)} has other users"
    out_val, in_val = val(items[0]), val(inp)
    if out_val is None or in_val is None or out_val.dtype != in_val.dtype:
        return "dtype changes across BatchNorm"
    if is_call(inp, aten.convolution.default):
        if inp.args[6]:
            return "transposed convolution"
        return ("conv", inp, items[0])
    if is_call(inp, aten.addmm.default, aten.mm.default):
        wt = inp.args[2] if inp.target is aten.addmm.default else inp.args[1]
        if not is_call(wt, aten.t.default) or in_val.dim() != 2:
            return "matrix product is not a linear layer"
        return ("linear", inp, items[0])
    return f"input {getattr(inp, 'target', inp)} is not a convolution or linear layer"


def _folded_params(g: fx.Graph, bn: fx.Node, weight: fx.Node, bias, w_dtype: torch.dtype, wdim: int):
    """Emit weight-only nodes computing the folded weight and bias."""
    _, gamma, beta, mean, var, _momentum, eps = bn.args
    f32 = w_dtype in (torch.float16, torch.bfloat16)

    def up(n):
        return g.call_function(aten._to_copy.default, (n,), {"dtype": torch.float32}) if f32 and n is not None else n

    def down(n):
        return g.call_function(aten._to_copy.default, (n,), {"dtype": w_dtype}) if f32 else n

    scale = g.call_function(aten.rsqrt.default, (g.call_function(aten.add.Tensor, (up(var), eps)),))
    if gamma is not None:
        scale = g.call_function(aten.mul.Tensor, (scale, up(gamma)))
    shape = [-1] + [1] * (wdim - 1)
    new_w = g.call_function(aten.mul.Tensor, (up(weight), g.call_function(aten.view.default, (scale, shape))))
    centred = g.call_function(aten.neg.default, (up(mean),)) if bias is None else \
        g.call_function(aten.sub.Tensor, (up(bias), up(mean)))
    new_b = g.call_function(aten.mul.Tensor, (centred, scale))
    if beta is not None:
        new_b = g.call_function(aten.add.Tensor, (new_b, up(beta)))
    return down(new_w), down(new_b)


def rewrite(gm: fx.GraphModule, bn: fx.Node, kind: str, layer: fx.Node, out: fx.Node) -> fx.Node:
    g = gm.graph
    with g.inserting_before(layer):
        if kind == "conv":
            x, w, b = layer.args[:3]
            new_w, new_b = _folded_params(g, bn, w, b, val(w).dtype, val(w).dim())
            new = g.call_function(aten.convolution.default, (x, new_w, new_b, *layer.args[3:]))
        else:
            has_bias = layer.target is aten.addmm.default
            b = layer.args[0] if has_bias else None
            x, wt = layer.args[-2:]
            w = wt.args[0]
            new_w, new_b = _folded_params(g, bn, w, b, val(w).dtype, 2)
            new_t = copy_meta(g.call_function(aten.t.default, (new_w,)), wt)
            new = g.call_function(aten.addmm.default, (new_b, x, new_t))
    copy_meta(new, layer)
    copy_meta(new, bn)
    out.replace_all_uses_with(new)
    for n in (out, bn, layer):
        g.erase_node(n)
    return new


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    folded = 0
    for node in list(gm.graph.nodes):
        if getattr(node, "_erased", False) or not is_call(node, BN_INFERENCE):
            continue
        m = match(node, ctx)
        if isinstance(m, str):
            ctx.note(f"kept {node.name}: {m}")
            continue
        kind, layer, out = m
        new = rewrite(gm, node, kind, layer, out)
        ctx.note(f"folded {node.name} into {kind} {new.name}")
        folded += 1
    for node in gm.graph.nodes:
        if is_call(node, aten._native_batch_norm_legit_functional.default, aten.native_batch_norm.default):
            ctx.note(f"kept {node.name}: training-mode BatchNorm")
    if folded:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return PassResult(gm, folded > 0)

