"""fuse_conv_epilogue: convolution / linear + bias + residual add + activation -> one fused node.

Why: in eager PyTorch each of conv, bias add, residual add and activation reads
and writes the whole activation tensor. As one ``fxopt::fused_conv`` (or
``fxopt::fused_linear``) node they are a single operator whose executor can
apply the epilogue while the convolution's output is still in registers (cuDNN
fused conv+bias+add+relu, or a generated epilogue kernel), and whose
convolution algorithm can be chosen per layer (``select_conv_algorithm``).

Matches (ATen, after AOTAutograd; BatchNorm already folded by ``fold_batchnorm``):
    aten.convolution(x, w, b, stride, pad, dil, transposed=False, _, groups)
        [-> aten.add.Tensor(., residual)]        same shape and dtype, alpha 1
        [-> activation]                          relu, hardtanh (relu6), leaky_relu,
                                                 silu, gelu, hardswish, hardsigmoid, sigmoid, tanh
    aten.addmm(b, x, aten.t(w)) | aten.mm(x, aten.t(w))   (2-D x: nn.Linear)
        [-> activation]

Produces: ``fxopt::fused_conv(x, w, b, residual, stride, padding, dilation,
groups, activation, act_params, "direct", None)`` /
``fxopt::fused_linear(x, w, b, activation, act_params)``. Every convolution
becomes a fused node, with or without epilogue, so later passes see one form.

Illegal (the chain stops before the step): an intermediate value with other
users or returned from the graph (it must stay observable, e.g. saved for
backward in a training graph); a broadcasting or type-promoting residual add;
an add with alpha != 1; a transposed convolution; a non-2-D linear input.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.ops import FUSED_CONV, FUSED_LINEAR
from fxopt.passinfra import PassContext, PassResult, PatternRule, apply_rules, copy_meta, is_call, only_user, val

aten = torch.ops.aten

# ATen activation op -> (fxopt activation name, params from the node)
ACTIVATION_OPS = {
    aten.relu.default: lambda n: ("relu", []),
    aten.hardtanh.default: lambda n: ("hardtanh", [float(a) for a in (list(n.args[1:3]) + [-1.0, 1.0][len(n.args) - 1:])]),
    aten.leaky_relu.default: lambda n: ("leaky_relu", [float(n.args[1]) if len(n.args) > 1 else 0.01]),
    aten.silu.default: lambda n: ("silu", []),
    aten.gelu.default: lambda n: ("gelu_tanh" if n.kwargs.get("approximate", "none") == "tanh" else "gelu", []),
    aten.hardswish.default: lambda n: ("hardswish", []),
    aten.hardsigmoid.default: lambda n: ("hardsigmoid", []),
    aten.sigmoid.default: lambda n: ("sigmoid", []),
    aten.tanh.default: lambda n: ("tanh", []),
}


def _same_tensor_type(a, b) -> bool:
    va, vb = val(a), val(b)
    return va is not None and vb is not None and va.shape == vb.shape and va.dtype == vb.dtype


def match_residual(cur: fx.Node):
    """The residual operand if `cur`'s only user is a plain same-shape add, else None."""
    add = only_user(cur)
    if not is_call(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    other = add.args[1] if add.args[0] is cur else add.args[0]
    if other is cur or not isinstance(other, fx.Node):
        return None
    if not (_same_tensor_type(other, cur) and _same_tensor_type(add, cur)):
        return None
    return add, other


def match_activation(cur: fx.Node):
    act = only_user(cur)
    if isinstance(act, fx.Node) and act.op == "call_function" and act.target in ACTIVATION_OPS:
        if act.args[0] is cur and _same_tensor_type(act, cur):
            name, params = ACTIVATION_OPS[act.target](act)
            return act, name, params
    return None


def _fuse(gm: fx.GraphModule, anchor: fx.Node, build) -> fx.Node:
    """Walk the epilogue from `anchor`, then replace the chain by build(residual, act, params)."""
    chain, residual, act_name, act_params = [anchor], None, "none", []
    res = match_residual(anchor) if anchor.target is aten.convolution.default else None
    if res is not None:
        add, residual = res
        chain.append(add)
    act = match_activation(chain[-1])
    if act is not None:
        chain.append(act[0])
        act_name, act_params = act[1], act[2]
    last = chain[-1]
    with gm.graph.inserting_after(last):
        new = build(residual, act_name, act_params)
    for n in chain:
        copy_meta(new, n)
    if "val" in last.meta:  # later matches in this pass compare shapes through meta["val"]
        new.meta["val"] = last.meta["val"]
    last.replace_all_uses_with(new)
    for n in reversed(chain):
        gm.graph.erase_node(n)
    return new, chain


def fuse_conv(node: fx.Node, ctx: PassContext, gm: fx.GraphModule):
    x, w, b, stride, padding, dilation, transposed, _out_pad, groups = node.args
    if transposed:
        ctx.note(f"kept {node.name}: transposed convolution")
        return None
    if val(node) is None:
        return None

    def build(residual, act, params):
        return gm.graph.call_function(
            FUSED_CONV,
            (x, w, b, residual, list(stride), list(padding), list(dilation), groups, act, params, "direct", None),
        )

    new, chain = _fuse(gm, node, build)
    return f"{new.name}: {' -> '.join(str(n.target).replace('aten.', '').split('.')[0] for n in chain)}"


def fuse_linear(node: fx.Node, ctx: PassContext, gm: fx.GraphModule):
    has_bias = node.target is aten.addmm.default
    if has_bias and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
        return None
    x, wt = node.args[-2:]
    bias = node.args[0] if has_bias else None
    vx, vb = val(x), val(bias) if bias is not None else None
    if not is_call(wt, aten.t.default) or vx is None or vx.dim() != 2:
        return None
    if vb is not None and (vb.dim() != 1 or vb.dtype != vx.dtype):
        return None  # addmm with a broadcast matrix bias is not a linear layer
    w = wt.args[0]

    def build(residual, act, params):
        return gm.graph.call_function(FUSED_LINEAR, (x, w, bias, act, params))

    new, chain = _fuse(gm, node, build)
    return f"{new.name}: {' -> '.join(str(n.target).replace('aten.', '').split('.')[0] for n in chain)}"


RULES = [
    PatternRule((aten.convolution.default,), fuse_conv),
    PatternRule((aten.addmm.default, aten.mm.default), fuse_linear),
]


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    n = apply_rules(gm, ctx, RULES)
    if n:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return PassResult(gm, n > 0)
