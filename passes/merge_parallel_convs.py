"""merge_parallel_convs: convolutions of one input whose results are summed become one convolution.

Why: structurally re-parameterized blocks (RepVGG, MobileOne, ACNet's asymmetric kernels, ...)
are trained as parallel branches over the same input, a kxk convolution, a 1x1 convolution, a
1xk and a kx1, an identity BatchNorm, whose results are added. In inference every branch is
linear in that input, so their sum is one convolution whose kernel is the sum of the branches'
kernels (each zero-padded to the largest, at the offset that aligns its window) and whose bias is
the sum of their biases: one convolution's read of the input and write of the output instead of
one per branch, plus the adds and the BatchNorm's pass over the activation.

Matches (ATen, inference, after ``fold_batchnorm``): a tree of ``aten.add.Tensor`` (alpha 1, no
broadcasting, every inner add used only by the tree) whose leaves include, over one input ``x``,
- ``aten.convolution(x, w_i, b_i, stride, padding_i, dilation, False, output_padding, groups)``,
  2-D, with the same stride, dilation and groups, each used only by the tree;
- at most one identity term: ``x`` itself, or the output of an inference BatchNorm of ``x`` (a
  per-channel ``x * s + t``), used only by the tree;
with at least two convolutions, or one convolution and a BatchNorm identity. A lone ``x +
conv(x)`` is left to the residual epilogue of ``fuse_conv_epilogue``.

Produces: one ``aten.convolution(x, W, B, stride, P, dilation, False, output_padding, groups)``
with the kernel K the largest per spatial dimension and P the padding of the convolution with that
kernel; branch i's kernel sits in K at offset ``(P - p_i) / dilation`` (it reads the same input
positions); the identity is the centre tap ``(P / dilation)`` of a per-group diagonal kernel
scaled by ``s``. The weights are summed in float32 and cast back once, written as ATen nodes on
the weights, so ``fold_constants`` evaluates them once (and again when a weight changes). Other
leaves of the tree stay added to the merged convolution.

Illegal (left alone, with a reason): training graphs; weights or BatchNorm statistics that are not
constants; transposed or non-2-D convolutions; differing stride, dilation, groups, dtype or output
shape; a window offset that is not a non-negative whole number of dilated taps inside K; an
identity where the convolutions change the shape (stride, channels); a term used outside the tree.

Numerics: one convolution of the summed weights instead of a sum of convolutions: the sum of the
weights is rounded once to their dtype and the products are accumulated in another order, within
the convolution tolerance of the dtype (``fxopt.tolerances``).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from fxopt.passinfra import PassContext, PassResult, copy_meta, finish, is_call, val

aten = torch.ops.aten
CONV = aten.convolution.default
ADD = aten.add.Tensor
BN_INFERENCE = aten._native_batch_norm_legit_no_training.default


def _constant(node, ctx: PassContext, memo: dict) -> bool:
    """``node`` depends on frozen parameters and attributes only (or is not a node)."""
    if not isinstance(node, fx.Node):
        return True
    if node not in memo:
        if node.op == "get_attr":
            memo[node] = True
        elif node.op == "placeholder":
            memo[node] = node.name in ctx.const_placeholders
        elif node.op == "call_function":
            memo[node] = False  # cycles cannot occur; guards the recursion's own entry
            memo[node] = all(_constant(a, ctx, memo) for a in node.all_input_nodes)
        else:
            memo[node] = False
    return memo[node]


def _tree_leaves(root: fx.Node) -> tuple[list, list]:
    """(leaves, inner adds) of the add tree at ``root``: an operand that is itself a plain add of
    the root's shape and dtype, used only by its parent, is expanded."""
    shape, dtype = val(root).shape, val(root).dtype
    leaves, inner, todo = [], [root], list(root.args[:2])
    while todo:
        a = todo.pop(0)
        v = val(a)
        if (_plain_add(a) and len(a.users) == 1 and v is not None and v.shape == shape and v.dtype == dtype):
            inner.append(a)
            todo = list(a.args[:2]) + todo
        else:
            leaves.append(a)
    return leaves, inner


def _plain_add(n) -> bool:
    return is_call(n, ADD) and n.kwargs.get("alpha", 1) == 1 and len(n.args) == 2


def _identity_of(leaf, x: fx.Node):
    """``(None, None)`` where ``leaf`` is ``x``; ``(bn, getitem)`` where it is an inference
    BatchNorm's output of ``x``; None otherwise."""
    if leaf is x:
        return (None, None)
    if (isinstance(leaf, fx.Node) and leaf.op == "call_function" and leaf.target is operator.getitem
            and leaf.args[1] == 0 and is_call(leaf.args[0], BN_INFERENCE) and leaf.args[0].args[0] is x):
        bn = leaf.args[0]
        if all(u.target is operator.getitem and (u is leaf or not u.users) for u in bn.users):
            return (bn, leaf)
    return None


def match(root: fx.Node, ctx: PassContext, memo: dict):
    """Legality check. Returns (x, convs, identity, other leaves, inner adds, K, P), a reason, or
    None where the sum is not of convolutions at all."""
    rv = val(root)
    if rv is None or rv.dim() != 4 or not all(isinstance(a, fx.Node) for a in root.args[:2]):
        return None  # not a sum of two 4-D activations: nothing to say
    leaves, inner = _tree_leaves(root)
    users = {id(n) for n in inner}
    convs_by_x: dict = {}
    for leaf in leaves:
        if is_call(leaf, CONV) and len(leaf.users) == 1 and id(next(iter(leaf.users))) in users:
            convs_by_x.setdefault(leaf.args[0], []).append(leaf)
    if not convs_by_x:
        return None  # no convolution among the summed terms
    x, convs = max(convs_by_x.items(), key=lambda kv: len(kv[1]))
    convs = list(dict.fromkeys(convs))
    if len(convs) != sum(1 for leaf in leaves if leaf in convs):
        return "a convolution is summed twice"
    identity = None
    for leaf in leaves:
        idn = _identity_of(leaf, x) if leaf not in convs else None
        if idn is not None and (leaf is x or len(leaf.users) == 1):
            identity = (leaf,) + idn
            break
    bn_identity = identity is not None and identity[1] is not None
    if len(convs) < 2 and not bn_identity:
        return "one convolution and no BatchNorm identity: left to the residual epilogue"
    c0 = convs[0]
    stride, dilation, groups = c0.args[3], c0.args[5], c0.args[8]
    for c in convs:
        v, w = val(c), val(c.args[1])
        if c.args[6] or w is None or w.dim() != 4:
            return f"{c.name} is transposed or not 2-D"
        if list(c.args[3]) != list(stride) or list(c.args[5]) != list(dilation) or c.args[8] != groups:
            return f"{c.name}: stride, dilation or groups differ"
        if v is None or v.shape != rv.shape or v.dtype != rv.dtype or w.dtype != val(c0.args[1]).dtype:
            return f"{c.name}: shape or dtype differs from the sum's"
        if not all(_constant(a, ctx, memo) for a in c.args[1:3]):
            return f"{c.name}: weights are not constants"
    kernel = [max(val(c.args[1]).shape[2 + d] for c in convs) for d in range(2)]
    widest = [next(c for c in convs if val(c.args[1]).shape[2 + d] == kernel[d]) for d in range(2)]
    pad = [list(widest[d].args[4])[d] for d in range(2)]
    for c in convs:
        for d in range(2):
            off, rem = divmod(pad[d] - list(c.args[4])[d], dilation[d])
            if rem or off < 0 or off + val(c.args[1]).shape[2 + d] > kernel[d]:
                return f"{c.name}: its window does not align with the widest kernel's"
    if identity is not None:
        xv = val(x)
        ok = (xv is not None and xv.shape == rv.shape and xv.dtype == rv.dtype and list(stride) == [1, 1]
              and all(pad[d] % dilation[d] == 0 and pad[d] // dilation[d] < kernel[d] for d in range(2)))
        if identity[1] is not None:
            ok = ok and all(_constant(a, ctx, memo) for a in identity[1].args[1:5])
        if not ok:
            if not bn_identity or len(convs) >= 2:
                identity = None  # the convolutions still merge; the identity stays added
            else:
                return "the identity does not line up with the convolutions (stride, channels, padding)"
    others = [leaf for leaf in leaves if leaf not in convs and (identity is None or leaf is not identity[0])]
    return x, convs, identity, others, inner, kernel, pad


class _Emit:
    """Weight-only ATen nodes, in float32 for 16-bit weights and cast back once."""

    def __init__(self, g: fx.Graph, dtype: torch.dtype):
        self.g, self.dtype = g, dtype
        self.wide = dtype in (torch.float16, torch.bfloat16)

    def call(self, target, *args, **kwargs):
        return self.g.call_function(target, args, kwargs)

    def up(self, n):
        return self.call(aten._to_copy.default, n, dtype=torch.float32) if self.wide and n is not None else n

    def down(self, n):
        return self.call(aten._to_copy.default, n, dtype=self.dtype) if self.wide else n

    def placed(self, w, size, kernel, offset):
        """``w`` zero-padded to ``kernel``, its window starting at ``offset``."""
        spec = [offset[1], kernel[1] - size[1] - offset[1], offset[0], kernel[0] - size[0] - offset[0]]
        return w if not any(spec) else self.call(aten.constant_pad_nd.default, w, spec, 0.0)

    def add(self, a, b):
        return b if a is None else (a if b is None else self.call(ADD, a, b))


def rewrite(gm: fx.GraphModule, root: fx.Node, x, convs, identity, others, inner, kernel, pad) -> fx.Node:
    g = gm.graph
    c0, wv = convs[0], val(convs[0].args[1])
    cout, cin_g, groups = wv.shape[0], wv.shape[1], c0.args[8]
    dilation = c0.args[5]
    with g.inserting_before(root):
        e = _Emit(g, wv.dtype)
        weight = bias = None
        for c in convs:
            size = val(c.args[1]).shape[2:]
            off = [(pad[d] - list(c.args[4])[d]) // dilation[d] for d in range(2)]
            weight = e.add(weight, e.placed(e.up(c.args[1]), size, kernel, off))
            bias = e.add(bias, e.up(c.args[2]))
        if identity is not None:
            _, bn, _ = identity
            if bn is None:
                scale, shift = e.call(aten.new_ones.default, e.up(c0.args[1]), [cout]), None
            else:
                _, gamma, beta, mean, var, _m, eps = bn.args
                scale = e.call(aten.rsqrt.default, e.call(ADD, e.up(var), eps))
                if gamma is not None:
                    scale = e.call(aten.mul.Tensor, scale, e.up(gamma))
                shift = e.call(aten.mul.Tensor, e.call(aten.neg.default, e.up(mean)), scale)
                if beta is not None:
                    shift = e.call(ADD, shift, e.up(beta))
            diag = e.call(aten.diag_embed.default, e.call(aten.view.default, scale, [groups, cout // groups]))
            tap = e.call(aten.view.default, diag, [cout, cin_g, 1, 1])
            centre = [pad[d] // dilation[d] for d in range(2)]
            weight = e.add(weight, e.placed(tap, (1, 1), kernel, centre))
            bias = e.add(bias, shift)
        weight, bias = e.down(weight), None if bias is None else e.down(bias)
        widest = max(convs, key=lambda c: val(c.args[1]).shape[2:].numel())
        new = g.call_function(CONV, (x, weight, bias, c0.args[3], list(pad), list(dilation), False,
                                     c0.args[7], groups))
        copy_meta(new, widest)
        out = new
        for o in others:
            out = copy_meta(g.call_function(ADD, (out, o)), root)
    root.replace_all_uses_with(out)
    dead = list(inner) + list(convs)
    if identity is not None and identity[2] is not None:
        dead += [identity[2], identity[1]]
    for n in dead:  # users first: the inner adds, then what they summed
        if not n.users:
            g.erase_node(n)
    return new


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.mode != "inference":
        return PassResult(gm, False)
    merged, memo = 0, {}
    for node in reversed(list(gm.graph.nodes)):
        if getattr(node, "_erased", False) or not _plain_add(node):
            continue
        if any(_plain_add(u) for u in node.users) and len(node.users) == 1:
            continue  # an inner add: its tree's root takes it
        m = match(node, ctx, memo)
        if m is None:
            continue
        if isinstance(m, str):
            ctx.note(f"kept {node.name}: {m}")
            continue
        x, convs, identity = m[0], m[1], m[2]
        new = rewrite(gm, node, *m)
        what = "+".join(c.name for c in convs) + ("" if identity is None else f"+identity({identity[0].name})")
        ctx.note(f"merged {what} over {x.name} into {new.name} (kernel {m[5][0]}x{m[5][1]})")
        merged += 1
    if merged:
        gm.graph.eliminate_dead_code()  # the identity BatchNorms' unused statistics outputs
    return finish(gm, ctx, merged, "sums of parallel convolutions merged")
