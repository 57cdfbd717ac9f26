"""pad_channels: carry channel counts that are not a multiple of 8 at the next multiple of 8.

Why: tensor-core convolutions on 16-bit channels_last tensors read and write whole groups of 8
channels. Given 27, 38 or 61 channels, cuDNN pads the activation on every call
(``nhwcAddPaddingKernel``), transforms it (``tensorTransformGeneric``) or falls back to GEMM
kernels that load one or two elements at a time (``align1`` / ``align2``), and every generated
kernel over such a tensor is vectorized two lanes wide instead of eight. Padding the weights once
at compile time and carrying the activations at the padded width removes all of these.

Matches (inference, frozen weights): 2-D ``fxopt::fused_conv`` in channels_last whose output
channels are not a multiple of 8 (the seeds: 16-bit dtypes on CUDA in ``"auto"``; any dtype and
device with ``pad_channels="on"``). From each seed the wider value flows forward through
- convolutions that read it (weights zero over the extra input channels; their own output widened
  too where it is not a multiple of 8), depthwise convolutions (groups widened with it),
- pointwise ops whose other operands are equally wide, scalars, or constants per channel (padded
  once at compile time), spatial means and pools, a channel slice reaching the end (``x[:, k:]``),
  and a concatenation whose last part is wide and the total its multiple of 8.

Produces: ``aten.constant_pad_nd`` on the weights and biases (folded once by ``fold_constants``),
widened ``groups``, ``slice`` ends moved to the wide end; every other consumer (views, matrix
products, channel reductions, unknown ops) and every graph output reads the true channels through
one ``aten.slice`` view per value (an output also gets eager's memory format back through a
copy). ``node.meta["fxopt_channels"] = (true, carried)`` marks each wide value.

What the extra channels hold: a convolution's are exactly ``act(0 + residual's)``, and every op
after it is evaluated on that one number at compile time; a value is carried wide only while
it is finite (a zero weight times a finite number is zero), so the true channels are exactly
those of the graph before the pass.

A seed is declined (kept at its true width, with a note) where its wide value would reach a
convolution through such a slice: the library copies a strided operand on every call. Trial runs on
copies of the graph find these seeds before the graph itself is rewritten.

Illegal (left alone, with a reason): training graphs, weights that are not constants, symbolic
channel counts, channels-first convolutions, grouped convolutions other than depthwise (their
input is read through the slice), and (``"auto"``) other devices, dtypes, or executors.
"""
from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx as fx

from fxopt.names import CL, format_of
from fxopt.ops import FUSED_CONV, apply_activation
from fxopt.passinfra import PassContext, PassResult, copy_meta, finish, is_call, val

aten = torch.ops.aten
ALIGN = 8
SLICE = aten.slice.Tensor
PAD = aten.constant_pad_nd.default
#: elementwise ops evaluated on the extra channels' value (other args: scalars or equally wide)
POINTWISE = {
    aten.relu.default, aten.hardtanh.default, aten.leaky_relu.default, aten.silu.default, aten.gelu.default,
    aten.hardswish.default, aten.hardsigmoid.default, aten.sigmoid.default, aten.tanh.default,
    aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.clamp.default,
    aten.clamp_min.default, aten.clamp_max.default, aten.neg.default, aten.abs.default,
    aten.elu.default, aten.mish.default, aten.softplus.default,
}
#: the extra channels' value must stay this small (transform-based convolutions sum it)
LIMIT = 1e3


def _round8(c: int) -> int:
    return (c + ALIGN - 1) // ALIGN * ALIGN


class Wide:
    """A value carried at ``width`` channels whose first ``true`` are the graph's; the others all
    hold ``fill``."""

    def __init__(self, true: int, width: int, fill: float, seeds: frozenset = frozenset()):
        self.true, self.width, self.fill = true, width, fill
        self.seeds = seeds  # the convolutions whose widened output this value carries


def should_run(gm: fx.GraphModule, ctx: PassContext) -> Optional[str]:
    """None when the pass applies, else the reason it does not."""
    choice = ctx.options.pad_channels
    if choice == "off":
        return "pad_channels='off'"
    if ctx.mode != "inference":
        return "training graph"
    if choice == "auto":
        if ctx.device_type != "cuda":
            return "pad_channels='auto' pads for CUDA's tensor cores only"
        if ctx.target.executor not in ("cuda", "torch"):
            return f"executor {ctx.target.executor!r} pads channels itself"
    return None


def _dtype_ok(ctx: PassContext, dtype) -> bool:
    return ctx.options.pad_channels == "on" or dtype in (torch.float16, torch.bfloat16)


def _fill_of(target, args, kwargs, dtype) -> Optional[float]:
    """The op applied to the extra channels' numbers (0-dim tensors), None if not finite/small."""
    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            out = target(*args, **kwargs)
            f = float(out.to(dtype)) if isinstance(out, torch.Tensor) else float(out)
    except Exception:  # noqa: BLE001 - an op that refuses scalars is not carried
        return None
    return f if math.isfinite(f) and abs(f) <= LIMIT else None


def _scalar(f: float) -> torch.Tensor:
    return torch.tensor(f, dtype=torch.float32)


class Padder:
    def __init__(self, gm: fx.GraphModule, ctx: PassContext, declined: frozenset = frozenset()):
        from fxopt.passes.fold_constants import constant_nodes

        self.gm, self.g, self.ctx = gm, gm.graph, ctx
        consts, _ = constant_nodes(gm, ctx)
        self.const = set(consts) | {n for n in gm.graph.nodes
                                    if n.op == "get_attr" or (n.op == "placeholder"
                                                              and n.name in ctx.const_placeholders)}
        self.wide: dict[fx.Node, Wide] = {}
        self.narrow: dict[fx.Node, fx.Node] = {}  # wide value -> its slice to the true channels
        self.widened = 0
        self.declined = declined  # convolutions whose output stays at its true width
        self.copies: set[str] = set()  # seeds whose wide value a convolution reads through a slice

    # -- helpers ---------------------------------------------------------------------------
    def call(self, target, args, before: fx.Node, like: fx.Node) -> fx.Node:
        with self.g.inserting_before(before):
            return copy_meta(self.g.call_function(target, tuple(args)), like)

    def padded_const(self, node: fx.Node, spec: list, user: fx.Node) -> fx.Node:
        return self.call(PAD, (node, spec, 0.0), user, user)

    def true_view(self, node: fx.Node) -> fx.Node:
        """The slice of a wide value to its true channels (one per value)."""
        if node not in self.narrow:
            with self.g.inserting_after(node):
                s = copy_meta(self.g.call_function(SLICE, (node, 1, 0, self.wide[node].true)), node)
            s.meta["fxopt_channels_slice"] = True
            self.narrow[node] = s
        return self.narrow[node]

    def narrow_inputs(self, node: fx.Node) -> None:
        """``node`` reads the true channels of every wide input."""
        for a in list(node.all_input_nodes):
            if a in self.wide:
                node.replace_input_with(a, self.true_view(a))

    # -- per op ----------------------------------------------------------------------------
    def conv(self, n: fx.Node) -> Optional[Wide]:
        """Widen a convolution's weights where it reads a wide input or writes an unaligned output;
        where it cannot, it reads its inputs' true channels."""
        wide = self._conv(n)
        if wide is None or wide.width == wide.true:
            keep = {n.args[0]} if wide is not None else set()  # weights widened for the wide input
            for a in (n.args[0], n.args[3]):
                if isinstance(a, fx.Node) and a in self.wide and a not in keep:
                    self.copies |= self.wide[a].seeds  # the library copies a strided operand
                    n.replace_input_with(a, self.true_view(a))
            return None
        return wide

    def _conv(self, n: fx.Node) -> Optional[Wide]:
        x, w, b, res = n.args[0], n.args[1], n.args[2], n.args[3]
        groups = n.args[7]
        out, wv = val(n), val(w)
        if out is None or wv is None or out.dim() != 4 or w not in self.const or (b is not None and b not in self.const):
            return None  # guard: not a 2-D convolution of constant weights
        if not all(isinstance(s, int) for s in (*wv.shape, out.shape[1])):
            return None  # guard: symbolic channels
        if not out.is_contiguous(memory_format=CL) or not _dtype_ok(self.ctx, out.dtype):
            return None  # guard: only channels_last (16-bit) convolutions need aligned channels
        c_out, c_in_g = int(wv.shape[0]), int(wv.shape[1])
        xin = self.wide.get(x)
        rin = self.wide.get(res) if isinstance(res, fx.Node) else None
        if groups == 1:
            pad_in = xin.width - xin.true if xin else 0
            width = c_out if n.name in self.declined else _round8(c_out)
            if res is not None and not (rin and rin.width == width):
                width = c_out  # guard: a residual of the true width keeps the output true
            if not pad_in and width == c_out:
                return None
            n.replace_input_with(w, self.padded_const(w, [0, 0, 0, 0, 0, pad_in, 0, width - c_out], n))
        elif xin and groups == c_out == xin.true and c_in_g == 1:  # depthwise, multiplier 1
            width = xin.width
            if res is not None and not (rin and rin.width == width):
                return None  # guard: a residual of the true width: read the input's true channels
            n.replace_input_with(w, self.padded_const(w, [0, 0, 0, 0, 0, 0, 0, width - c_out], n))
            n.update_arg(7, width)
        else:
            return None  # guard: grouped convolutions read the true channels
        self.widened += 1
        if width == c_out:
            return Wide(c_out, c_out, 0.0)  # only the weight's input channels grew
        if b is not None:
            n.replace_input_with(b, self.padded_const(b, [0, width - c_out], n))
        r_fill = rin.fill if res is not None else 0.0
        fill = _fill_of(apply_activation, (_scalar(r_fill), n.args[8], n.args[9]), {}, out.dtype)
        if fill is None:  # guard: an activation of a finite number that is not finite (none known)
            raise RuntimeError(f"pad_channels: {n.args[8]} of the extra channels is not finite")
        n.meta["fxopt_channels"] = (c_out, width)
        return Wide(c_out, width, fill, frozenset({n.name}) | (rin.seeds if rin else frozenset()))

    def pointwise(self, n: fx.Node) -> Optional[Wide]:
        out = val(n)
        wide_in = [self.wide[a] for a in n.all_input_nodes if a in self.wide]
        if out is None or out.dim() < 2 or any(int(out.shape[1]) != w.true for w in wide_in):
            return None  # guard: broadcast over the channels
        widths = {w.width for w in wide_in}
        if len(widths) != 1:
            return None  # guard: operands carried at different widths
        (width,) = widths
        args, padded = [], {}
        for a in n.args:
            if not isinstance(a, fx.Node):
                args.append(a)
                continue
            if a in self.wide:
                args.append(_scalar(self.wide[a].fill))
                continue
            av = val(a)
            cdim = 1 - (out.dim() - av.dim()) if av is not None else -1
            if a not in self.const or cdim < 0 or int(av.shape[cdim]) != int(out.shape[1]):
                return None  # guard: a runtime operand of the true width (or broadcast over channels)
            spec = [0, 0] * (av.dim() - 1 - cdim) + [0, width - int(out.shape[1])]
            padded[a] = spec
            args.append(_scalar(0.0))
        fill = _fill_of(n.target, args, dict(n.kwargs), out.dtype)
        if fill is None:
            return None  # guard: the extra channels would not stay finite
        for a, spec in padded.items():
            n.replace_input_with(a, self.padded_const(a, spec, n))
        return Wide(int(out.shape[1]), width, fill, frozenset().union(*(w.seeds for w in wide_in)))

    def spatial(self, n: fx.Node) -> Optional[Wide]:
        """Means over spatial dims, pools: the extra channels keep their value."""
        x = n.args[0]
        src = self.wide[x]
        if n.target is aten.mean.dim:
            dims = [d % val(x).dim() for d in n.args[1]]
            if min(dims) < 2:
                return None  # guard: a mean over the channels (or the batch)
        if n.target is aten.avg_pool2d.default and src.fill != 0.0:
            pads = n.args[4] if len(n.args) > 4 else [0]
            if any(pads):
                return None  # guard: counting the zero border changes a nonzero fill per position
        return Wide(src.true, src.width, src.fill, src.seeds)

    def slice_(self, n: fx.Node) -> Optional[Wide]:
        x, dim = n.args[0], n.args[1] if len(n.args) > 1 else 0
        src = self.wide[x]
        start = n.args[2] if len(n.args) > 2 else 0
        end = n.args[3] if len(n.args) > 3 else None
        step = n.args[4] if len(n.args) > 4 else 1
        if dim != 1 or step != 1 or not isinstance(start, int) or start < 0 or start >= src.true:
            return None
        if end is not None and end < src.true:
            return "true"  # a slice within the true channels reads them as before
        n.args = (x, dim, start, src.width)
        return Wide(src.true - start, src.width - start, src.fill, src.seeds)

    def cat(self, n: fx.Node) -> Optional[Wide]:
        parts = n.args[0]
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        if dim not in (1, -3) or val(n) is None or val(n).dim() != 4:
            return None
        if any(p in self.wide for p in parts[:-1]) or parts[-1] not in self.wide:
            return None
        last = self.wide[parts[-1]]
        true = int(val(n).shape[1])
        width = true - last.true + last.width
        if width % ALIGN:
            return None  # guard: would stay unaligned
        return Wide(true, width, last.fill, last.seeds)

    # -- the walk --------------------------------------------------------------------------
    def run(self) -> int:
        for n in list(self.g.nodes):
            if n.op == "output":
                self.outputs(n)
                continue
            if n.op != "call_function" or n.meta.get("fxopt_channels_slice"):
                continue
            reads_wide = any(a in self.wide for a in n.all_input_nodes)
            wide = None
            if is_call(n, FUSED_CONV):
                wide = self.conv(n)
            elif not reads_wide:
                continue
            elif n.target in POINTWISE:
                wide = self.pointwise(n)
            elif n.target in (aten.mean.dim, aten._adaptive_avg_pool2d.default, aten.avg_pool2d.default,
                              aten.max_pool2d_with_indices.default) and n.args[0] in self.wide \
                    and len([a for a in n.all_input_nodes if a in self.wide]) == 1:
                wide = self.spatial(n)
            elif n.target is operator.getitem and n.args[0] in self.wide:
                wide = self.wide[n.args[0]]
            elif n.target is SLICE and n.args[0] in self.wide:
                wide = self.slice_(n)
                if wide == "true":
                    continue
            elif n.target is aten.cat.default:
                wide = self.cat(n)
            if wide is not None:
                self.wide[n] = wide
                n.meta["fxopt_channels"] = (wide.true, wide.width)
            elif reads_wide and not is_call(n, FUSED_CONV):  # a convolution narrowed its own
                self.narrow_inputs(n)
        return self.widened

    def outputs(self, out: fx.Node) -> None:
        outs = out.args[0]
        flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for i, o in enumerate(flat):
            if isinstance(o, fx.Node) and o in self.wide:
                fmt = format_of(val(o)) or CL
                view = self.true_view(o)
                with self.g.inserting_before(out):
                    flat[i] = copy_meta(self.g.call_function(aten.clone.default, (view,), {"memory_format": fmt}), o)
        out.args = (type(outs)(flat) if isinstance(outs, (list, tuple)) else flat[0],)


def _declined(gm: fx.GraphModule, ctx: PassContext) -> frozenset:
    """The seeds not to widen: those whose wide value some convolution would read through a slice
    (the library copies a strided operand on every call). Found by trial runs on copies of the graph;
    declining one seed can strand another (a concat no longer wide), so until none is left."""
    declined: frozenset = frozenset()
    for _ in range(4):
        g = fx.Graph()
        g.output(g.graph_copy(gm.graph, {}))
        trial = Padder(fx.GraphModule(gm, g), ctx, declined)
        trial.run()
        if not trial.copies - declined:
            return declined
        declined |= trial.copies
    return declined


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    reason = should_run(gm, ctx)
    if reason:
        ctx.note(f"skipped: {reason}")
        return PassResult(gm, False)
    declined = _declined(gm, ctx)
    padder = Padder(gm, ctx, declined)
    changed = padder.run()
    for name in sorted(declined):
        ctx.note(f"{name}: output kept at its true width (a convolution would read it through a copy)")
    if not changed:
        return finish(gm, ctx, 0, "")
    for n, w in padder.wide.items():
        ctx.note(f"{n.name}: {w.true} channels carried as {w.width}")
    gm.graph.eliminate_dead_code()
    res = finish(gm, ctx, changed, "convolutions on channels padded to a multiple of 8")
    from fxopt.passes.layout import views_in_eagers_format

    views_in_eagers_format(gm, ctx)
    return res
