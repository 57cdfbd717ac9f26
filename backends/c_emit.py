"""The loops of the generated C (``backends/c_source.py``): one emitter per aten op, the epilogues
they absorb, and the workspace of the intermediate tensors.

Each producer (a convolution, a linear layer, a pool, an elementwise op) takes the chain of its
single consumers that are elementwise (a BatchNorm in inference, an activation, an add / sub / mul
of a tensor computed before it or of a number) as its epilogue: the values are transformed as they
are stored, and only the chain's last tensor is written. Intermediate tensors are contiguous, in a
workspace where a tensor's bytes are reused once its last reader (views included) has run; the
graph's outputs are written straight into the caller's output tensors where they are computed.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

import fxopt.ops  # noqa: F401 - registers fxopt::fused_conv and fxopt::fused_linear
from fxopt.backends import c_bf16, c_kernels
from fxopt.backends.c_kernels import (Declined, activation_of, flit, split_range,  # noqa: F401 (Declined: re-export)
                                      unary_expr)

aten = torch.ops.aten

ALIGN = 64  # bytes: each workspace tensor starts on a cache line
MAX_OCB = 8  # output channels a convolution accumulates together per input row it reads


@dataclass
class Ref:
    """A tensor in C: ``base`` (a C pointer expression) and its sizes and element strides."""
    base: str
    shape: tuple
    strides: tuple

    def at(self, idx: list) -> str:
        """The C expression of the element at index expressions ``idx`` (size-1 dimensions and
        stride 0 drop their term: broadcasting)."""
        terms = [f"({i})*{s}" if s != 1 else f"({i})" for i, s, n in zip(idx, self.strides, self.shape)
                 if s != 0 and n != 1]
        return f"{self.base}[{' + '.join(terms) or '0'}]"

    def broadcast_to(self, rank: int) -> "Ref":
        pad = rank - len(self.shape)
        return Ref(self.base, (1,) * pad + tuple(self.shape), (0,) * pad + tuple(self.strides))

    @property
    def contiguous(self) -> bool:
        return all(s == c for s, c, n in zip(self.strides, contiguous_strides(self.shape), self.shape) if n != 1)


#: a tensor's base pointer in the generated C: a graph argument or output, or a workspace offset
_BASE = re.compile(r"\(\((?:const )?float\*\)(?:A\[\d+\]|\(W \+ \d+\))\)")


def contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


UNARY = (aten.relu.default, aten.hardtanh.default, aten.leaky_relu.default, aten.sigmoid.default,
         aten.silu.default, aten.tanh.default, aten.hardswish.default, aten.hardsigmoid.default, aten.gelu.default)
BINARY = {aten.add.Tensor: "+", aten.sub.Tensor: "-", aten.mul.Tensor: "*"}
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
         aten.alias.default, aten.t.default, aten.detach.default, aten._to_copy.default)
#: what a graph's tensors may hold; the C computes in float32 (a bfloat16 input is widened where it is
#: read, a bfloat16 output rounded to nearest even where it is written), but for a bfloat16 graph's
#: convolutions and linear layers, which sum bfloat16 pairs where the CPU can (``c_bf16``)
DTYPES = (torch.float32, torch.bfloat16)
BATCH_NORM = aten._native_batch_norm_legit_no_training.default
FUSED_CONV = torch.ops.fxopt.fused_conv.default
FUSED_LINEAR = torch.ops.fxopt.fused_linear.default
MAX_POOL = aten.max_pool2d_with_indices.default
AVG_POOLS = (aten.avg_pool2d.default, aten._adaptive_avg_pool2d.default, aten.mean.dim)


def val(node) -> torch.Tensor:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(v, torch.Tensor):
        raise Declined(f"{getattr(node, 'name', node)}: no tensor value")
    if v.dtype not in DTYPES:
        raise Declined(f"{node.name}: {v.dtype} (float32 and bfloat16 only)")
    if any(not isinstance(s, int) for s in v.shape):
        raise Declined(f"{node.name}: symbolic sizes")
    return v


def _pair(x, default=None) -> list:
    if x is None or (isinstance(x, (list, tuple)) and len(x) == 0):
        return list(default)
    x = list(x) if isinstance(x, (list, tuple)) else [x]
    return x * 2 if len(x) == 1 else x


class Emitter:
    """Walks a graph's nodes in order and writes each one's loops (``node``), its epilogue absorbed."""

    def __init__(self, gm: fx.GraphModule, outputs: list, n_args: int, params=()):
        self.refs: dict = {}  # node -> Ref of its value
        self.lines: list = []  # the layers' functions
        self.layers: list = []  # their names, in order
        self.prepare: list = []  # lines of a call that lays weights out (P)
        self.pre: list = []  # lines of every call, before the layers
        self.flops = 0
        nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(nodes)}
        self.absorbed: set = set()
        self.outputs = outputs
        placeholders = [n for n in nodes if n.op == "placeholder"]
        self.params = {placeholders[i] for i in params}  # fixed between calls that lay weights out
        # the node that owns each value's memory (a view's is its source's) and its last reader
        self.owner: dict = {}
        self.last_use: dict = {}
        for n in nodes:
            if n.op == "call_function" and (n.target in VIEWS or n.target is operator.getitem):
                self.owner[n] = self.owner.get(n.args[0], n.args[0])
            else:
                self.owner[n] = n
            for a in n.all_input_nodes:
                o = self.owner.get(a, a)
                self.last_use[o] = max(self.last_use.get(o, -1), self.order[n])
        # outputs written in place where a value of theirs is computed (its own buffer, one output)
        self.in_place: dict = {}
        for k, o in enumerate(outputs):
            if isinstance(o, fx.Node) and o.op == "call_function" and o.target not in VIEWS \
                    and o.target is not operator.getitem and o not in self.in_place \
                    and val(o).dtype == torch.float32:
                self.in_place[o] = f"((float*)A[{n_args + k}])"
        self.keep = {self.owner.get(o, o) for o in outputs if isinstance(o, fx.Node)}  # read at the end
        self.free: list = []  # (offset, bytes) free in the workspace
        self.top = 0
        self.live: dict = {}  # owner node -> (offset, bytes)

    # -- workspace ---------------------------------------------------------------------------------
    def _alloc(self, node: fx.Node, shape) -> Ref:
        if node in self.in_place:
            return Ref(self.in_place[node], tuple(shape), contiguous_strides(shape))
        node = self.owner.get(node, node)  # a getitem's readers are counted on its source
        nbytes = -(-4 * math.prod(shape) // ALIGN) * ALIGN or ALIGN
        for i, (off, size) in enumerate(self.free):
            if size >= nbytes:
                self.free[i:i + 1] = [(off + nbytes, size - nbytes)] if size > nbytes else []
                break
        else:
            off = self.top
            self.top += nbytes
        self.live[node] = (off, nbytes)
        return Ref(f"((float*)(W + {off}))", tuple(shape), contiguous_strides(shape))

    def _release(self, at: int) -> None:
        for n, (off, size) in list(self.live.items()):
            if self.last_use.get(n, -1) <= at and n not in self.keep:
                del self.live[n]
                self.free.append((off, size))
        self.free.sort()
        merged: list = []
        for off, size in self.free:  # coalesce neighbours
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((off, size))
        self.free = merged

    # -- epilogues -----------------------------------------------------------------------------------
    def _epilogue(self, node: fx.Node) -> tuple[list, fx.Node]:
        """The elementwise consumers ``node``'s loops absorb and the node whose value they store."""
        ops, cur, start = [], node, self.order[node]
        shape = tuple(val(node).shape)
        while cur not in self.outputs and len(cur.users) == 1:
            u = next(iter(cur.users))
            if u.target in UNARY and u.args[0] is cur:
                ops.append(("unary", u))
                cur = u
            elif u.target is BATCH_NORM and u.args[0] is cur and len(shape) >= 2 and len(u.users) == 1:
                g = next(iter(u.users))
                if g.target is not operator.getitem or g.args[1] != 0:
                    break
                ops.append(("bn", u))
                self.absorbed.add(g)
                cur = g
            elif u.target in BINARY and tuple(val(u).shape) == shape:
                other = u.args[1] if u.args[0] is cur else u.args[0]
                if other is cur or (isinstance(other, fx.Node) and (
                        self.order[other] > start or other not in self.refs or val(other).dim() > len(shape))):
                    break  # computed after this producer starts (or its own value twice)
                if not isinstance(other, (fx.Node, int, float)) or isinstance(other, bool):
                    break
                ops.append(("binary", u, other, u.args[0] is cur))
                cur = u
            else:
                break
        for op in ops:
            self.absorbed.add(op[1])
        return ops, cur

    def _prologue(self, ops: list, channels: int) -> list:
        """BatchNorms' per-channel scale and shift, computed at the start of the producer's block."""
        lines = []
        for j, op in enumerate(ops):
            if op[0] != "bn":
                continue
            _, w, b, mean, var = op[1].args[:5]
            eps = op[1].args[6]
            r = {k: self.refs[x] for k, x in (("w", w), ("b", b), ("m", mean), ("v", var)) if x is not None}
            sc = f"{r['w'].at(['c'])} / sqrtf({r['v'].at(['c'])} + {flit(eps)})" if "w" in r \
                else f"1.f / sqrtf({r['v'].at(['c'])} + {flit(eps)})"
            sh = f"- {r['m'].at(['c'])} * bs{j}[c]" + (f" + {r['b'].at(['c'])}" if "b" in r else "")
            lines += [f"float bs{j}[{channels}], bt{j}[{channels}];",
                      f"for (int c = 0; c < {channels}; c++) {{ bs{j}[c] = {sc}; bt{j}[c] = {sh}; }}"]
        return lines

    def _apply(self, ops: list, v: str, idx: list, channel: str) -> list:
        lines = []
        for j, op in enumerate(ops):
            if op[0] == "unary":
                lines.append(f"{v} = {unary_expr(*activation_of(op[1]), v)};")
            elif op[0] == "act":  # a fused op's own activation
                if op[1] != "none":
                    lines.append(f"{v} = {unary_expr(op[1], op[2], v)};")
            elif op[0] == "residual":  # a fused conv's own residual, of the output's shape
                lines.append(f"{v} = {v} + {op[1].at(idx)};")
            elif op[0] == "bn":
                lines.append(f"{v} = {v} * bs{j}[{channel}] + bt{j}[{channel}];")
            else:
                _, u, other, left = op
                o = flit(other) if not isinstance(other, fx.Node) else \
                    self.refs[other].broadcast_to(len(idx)).at(idx)
                alpha = u.kwargs.get("alpha", 1)
                if alpha != 1 and u.target is not aten.mul.Tensor:
                    o = f"({o}) * {flit(alpha)}" if left else o
                    v_term = v if left else f"{v} * {flit(alpha)}"
                else:
                    v_term = v
                sym = BINARY[u.target]
                lines.append(f"{v} = {v_term} {sym} ({o});" if left else f"{v} = ({o}) {sym} {v_term};")
        return lines

    # -- nodes ---------------------------------------------------------------------------------------
    def node(self, node: fx.Node) -> None:
        t = node.target
        if node in self.absorbed:
            pass
        elif t in VIEWS:
            self._view(node)
        elif t is operator.getitem:
            if node.args[1] != 0 or node.args[0] not in self.refs:
                raise Declined(f"{node.name}: an output of {node.args[0]} other than the first is read")
            self.refs[node] = self.refs[node.args[0]]
        elif t in (aten.convolution.default, FUSED_CONV):
            self._conv(node)
        elif t in (aten.addmm.default, aten.mm.default, FUSED_LINEAR):
            self._matmul(node)
        elif t is MAX_POOL or t in AVG_POOLS:
            self._pool(node)
        else:  # elementwise (a BatchNorm too) not absorbed by a producer
            self._pointwise(node)
        self._release(self.order[node])

    def _block(self, title: str, body: list, split: bool = False, prepare: list = (), every_call: bool = False) -> None:
        """``body`` as a layer: a function of its own, each tensor it reads or writes through a local
        restrict pointer (what lets the compiler keep values in registers across stores). Every
        thread calls each layer in turn (``part`` of ``parts``): a ``split`` body shares its work out
        by ``part`` itself, any other runs on part 0. ``prepare``: lines run before the layers, at a
        call that lays weights out (``P``), or at ``every_call``."""
        text = "\n".join(body)
        bases = list(dict.fromkeys(_BASE.findall(text)))
        decls = []
        for k, base in enumerate(bases):
            text = text.replace(base, f"p{k}")
            decls.append(f"{'const float' if base.startswith('((const') else 'float'}* restrict p{k} = {base};")
        lines = decls + text.split("\n")
        if not split:
            lines = ["if (part != 0) return;"] + lines
        name = f"L{len(self.layers)}"
        self.layers.append(name)
        self.lines += [f"/* {title} */",
                       f"static void __attribute__((noinline)) {name}(void* const* restrict A, char* restrict W, "
                       "int part, int parts) {", "  (void)parts;", *["  " + ln for ln in lines], "}"]
        if prepare:
            (self.pre if every_call else self.prepare).extend(
                [f"{{ /* {title} */", *["  " + ln for ln in prepare], "}"])

    def _view(self, node: fx.Node) -> None:
        src = self.refs.get(node.args[0])
        if src is None:
            raise Declined(f"{node.name}: a view of a value with no tensor")
        shape = tuple(val(node).shape)
        if node.target is aten.t.default:
            self.refs[node] = Ref(src.base, shape, tuple(reversed(src.strides)))
        elif node.target in (aten.clone.default, aten.alias.default, aten.detach.default):
            self.refs[node] = src
        elif node.target is aten._to_copy.default:  # a cast: every value is a float32 in the C
            if set(node.kwargs) - {"dtype", "layout", "device", "memory_format"} or \
                    node.kwargs.get("dtype", torch.float32) not in DTYPES:
                raise Declined(f"{node.name}: a copy to {dict(node.kwargs)}")
            self.refs[node] = src
        elif src.contiguous:
            self.refs[node] = Ref(src.base, shape, contiguous_strides(shape))
        else:
            raise Declined(f"{node.name}: a reshape of a strided tensor")

    def _conv(self, node: fx.Node) -> None:
        own: list = []  # a fused conv's residual and activation, before the consumers' epilogue
        if node.target is FUSED_CONV:  # any algorithm: what it computes is the convolution
            x, w, b, residual, stride, padding, dilation, groups, act, act_params = node.args[:10]
            transposed = False
            if residual is not None:
                own.append(("residual", self.refs[residual].broadcast_to(4)))
            own.append(("act", act, tuple(act_params)))
        else:
            x, w, b, stride, padding, dilation, transposed, _, groups = node.args[:9]
        if transposed or val(node).dim() != 4:
            raise Declined(f"{node.name}: a transposed or non-2-D convolution")
        X, Wt = self.refs[x], self.refs[w]
        bias = f" + {self.refs[b].at(['oc'])}" if b is not None else ""
        n, c, h, wd = X.shape
        oc, icg, kh, kw = Wt.shape
        _, _, oh, ow = val(node).shape
        (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
        p = dict(n=n, c=c, h=h, w=wd, oc=oc, icg=icg, kh=kh, kw=kw, oh=oh, ow=ow, sh=sh, sw=sw, ph=ph, pw=pw,
                 dh=dh, dw=dw, groups=groups, ocg=oc // groups,
                 lo=[max(0, -(-(pw - j * dw) // sw)) for j in range(kw)],
                 hi=[min(ow, (wd - 1 + pw - j * dw) // sw + 1) for j in range(kw)])
        ops, last = self._epilogue(node)
        ops = own + ops
        Y = self._alloc(last, (n, oc, oh, ow))
        self.flops += 2 * n * oc * oh * ow * icg * kh * kw
        epi = lambda v, idx: self._apply(ops, v, idx, "oc")  # noqa: E731
        # a weight laid out before the layers must be an argument (a parameter: at calls that lay weights
        # out; an input: at every call), not a value the layers compute
        layout = c_kernels.choose_conv(p) if w.op == "placeholder" else "rows"
        prepare: list = []
        if layout == "channels":
            prepare, loops = c_kernels.conv_channels(p, X, Wt, bias, Y, epi,
                                                     self._scratch(c_kernels.conv_workspace(p)))
        else:
            ocb = max(d for d in range(1, MAX_OCB + 1) if p["ocg"] % d == 0)
            loops = c_kernels.conv_rows(p, X, Wt, bias, Y, epi, ocb)
            if self._bf16(node, w) and p["sw"] == 1:  # bfloat16 channel pairs (c_bf16), float32 where not
                xq, wq = self._scratch(c_bf16.channels_bytes(p)), self._scratch(c_bf16.weights_bytes(p))
                self._block(f"{node.name}: input as bfloat16 channel pairs",
                            c_bf16.guarded(c_bf16.pack_channels(p, X, xq), []), split=True)
                prepare = c_bf16.guarded(c_bf16.pair_weights(p, Wt, wq), [])
                loops = c_bf16.guarded(c_kernels.conv_rows(p, X, Wt, bias, Y, epi, ocb, (xq, wq)), loops)
                layout += " (bfloat16 pairs)"
        self._block(f"{node.name}: convolution along {layout}{self._names(ops)}", self._prologue(ops, oc) + loops,
                    split=True, prepare=prepare, every_call=self.owner.get(w, w) not in self.params)
        self.refs[last] = Y

    def _bf16(self, node: fx.Node, w) -> bool:
        """Whether a bfloat16 node's weight ``w`` is an argument, which ``c_bf16`` lays out before the
        layers (a parameter's at a call that lays weights out, an input's at every call)."""
        return val(node).dtype == torch.bfloat16 and self.owner.get(w, w).op == "placeholder"

    def _scratch(self, nbytes: int) -> str:
        """A C pointer to ``nbytes`` of workspace of the node being emitted (never reused)."""
        off = self.top
        self.top += -(-nbytes // ALIGN) * ALIGN
        return f"((float*)(W + {off}))"

    def _matmul(self, node: fx.Node) -> None:
        addmm = node.target is aten.addmm.default
        own: list = []
        if node.target is FUSED_LINEAR:  # x W^T + b, then its activation
            m1, w, bias, act, act_params = node.args[:5]
            M1, Wr = self.refs[m1], self.refs[w]
            if len(M1.shape) != 2:
                raise Declined(f"{node.name}: a linear layer of a {len(M1.shape)}-D input")
            M2 = Ref(Wr.base, tuple(reversed(Wr.shape)), tuple(reversed(Wr.strides)))
            own.append(("act", act, tuple(act_params)))
        else:
            bias, m1, m2 = (node.args[:3]) if addmm else (None, *node.args[:2])
            M1, M2 = self.refs[m1], self.refs[m2]
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        nb, k = M1.shape
        no = M2.shape[1]
        ops, last = self._epilogue(node)
        ops = own + ops
        Y = self._alloc(last, (nb, no))
        self.flops += 2 * nb * k * no
        s1, s2 = M1.strides, M2.strides
        Bv = "" if bias is None or beta == 0 else \
            f" + {flit(beta) + ' * ' if beta != 1 else ''}{self.refs[bias].broadcast_to(2).at(['b', 'o'])}"
        scale = f" * {flit(alpha)}" if alpha != 1 else ""
        body, prepare = self._prologue(ops, no), []
        split = s1[1] == 1 and s2[0] == 1
        weight = w if node.target is FUSED_LINEAR else m2
        epi = lambda v, idx: self._apply(ops, v, idx, "o")  # noqa: E731
        if split and self._bf16(node, weight):  # bfloat16 rows summed in pairs (c_bf16), float32 where not
            kp = c_kernels.padded(k)
            xq, wq = self._scratch(2 * nb * kp), self._scratch(2 * no * kp)
            self._block(f"{node.name}: rows as bfloat16", c_bf16.guarded(c_bf16.pack_rows(nb, k, M1, xq), []),
                        split=True)
            prepare = c_bf16.guarded(c_bf16.row_weights(k, no, M2, wq), [])
            body += c_bf16.guarded(c_kernels.linear_rows(nb, k, no, M1, M2, Bv, scale, Y, epi, (xq, wq)),
                                   c_kernels.linear_rows(nb, k, no, M1, M2, Bv, scale, Y, epi))
        elif split:  # rows of m1 and columns of m2 dense (a transposed weight)
            body += c_kernels.linear_rows(nb, k, no, M1, M2, Bv, scale, Y, epi)
        else:  # any strides: a row of sums
            body += [f"for (int b = 0; b < {nb}; b++) {{",
                     f"  float acc[{no}];", f"  for (int o = 0; o < {no}; o++) acc[o] = 0.f;",
                     f"  for (int i = 0; i < {k}; i++) {{", f"    const float a = {M1.at(['b', 'i'])};",
                     "    #pragma omp simd", f"    for (int o = 0; o < {no}; o++) acc[o] += a * {M2.at(['i', 'o'])};",
                     "  }", f"  for (int o = 0; o < {no}; o++) {{", f"    float v = acc[o]{scale}{Bv};",
                     *["    " + ln for ln in self._apply(ops, "v", ["b", "o"], "o")],
                     f"    {Y.at(['b', 'o'])} = v;", "  }", "}"]
        self._block(f"{node.name}: {getattr(node.target, '__name__', 'mm')}{self._names(ops)}", body, split=split,
                    prepare=prepare, every_call=self.owner.get(weight, weight) not in self.params)
        self.refs[last] = Y

    def _pool(self, node: fx.Node) -> None:
        X = self.refs[node.args[0]]
        if len(X.shape) != 4 and node.target is not aten.mean.dim:
            raise Declined(f"{node.name}: a pool of a {len(X.shape)}-D tensor")
        t = node.target
        if t is aten.mean.dim:
            dims = sorted(d % len(X.shape) for d in node.args[1])
            r = len(dims)
            if dims != list(range(len(X.shape) - r, len(X.shape))) or node.kwargs.get("dtype") is not None:
                raise Declined(f"{node.name}: a mean over dimensions {node.args[1]} (trailing ones only)")
        if t is MAX_POOL:
            users = list(node.users)
            if any(u.target is not operator.getitem or u.args[1] != 0 for u in users) or len(users) != 1:
                raise Declined(f"{node.name}: a max pool whose indices are read")
            ops, last = self._epilogue(users[0])
            self.absorbed.add(users[0])
        else:
            ops, last = self._epilogue(node)
        out_shape = tuple(val(node if t is not MAX_POOL else next(iter(node.users))).shape)
        Y = self._alloc(last, out_shape)
        if t is aten.mean.dim:
            inner = math.prod(X.shape[len(X.shape) - r:])
            outer = X.shape[:len(X.shape) - r]
            idx = [f"i{d}" for d in range(len(outer))]
            red = [f"j{d}" for d in range(r)]
            rloops = " ".join(f"for (int {j} = 0; {j} < {s}; {j}++)" for j, s in zip(red, X.shape[len(outer):]))
            flat = " + ".join(f"{i} * {s}" for i, s in zip(idx, contiguous_strides(outer))) or "0"
            body = self._prologue(ops, outer[1] if len(outer) > 1 else 1) + self._shared_loops(idx, outer) + [
                "  float s = 0.f;", f"  {rloops} s += {X.at(idx + red)};",
                f"  float v = s / {flit(inner)};",
                *["  " + ln for ln in self._apply(ops, "v", idx + ["0"] * (len(out_shape) - len(idx)),
                                                   idx[1] if len(idx) > 1 else "0")],
                f"  {Y.base}[{flat}] = v;"] + ["}"] * max(1, len(idx) - 1)
            self._block(f"{node.name}: mean{self._names(ops)}", body, split=True)
            self.refs[last] = Y
            return
        n, c, h, w = X.shape
        _, _, oh, ow = out_shape
        xs = X.strides
        if t is aten._adaptive_avg_pool2d.default:
            win = ["const int h0 = (oh * %d) / %d, h1 = ((oh + 1) * %d + %d - 1) / %d;" % (h, oh, h, oh, oh),
                   "const int w0 = (ow * %d) / %d, w1 = ((ow + 1) * %d + %d - 1) / %d;" % (w, ow, w, ow, ow)]
            div = "(float)((h1 - h0) * (w1 - w0))"
            init, step, fin = "0.f", "s += xv;", f"s / {div}"
        else:
            k = _pair(node.args[1])
            s = _pair(node.args[2] if len(node.args) > 2 else None, k)
            p = _pair(node.args[3] if len(node.args) > 3 else 0)
            if t is MAX_POOL:
                d = _pair(node.args[4] if len(node.args) > 4 else 1)
                win = [f"const int h0 = oh * {s[0]} - {p[0]}, w0 = ow * {s[1]} - {p[1]};"]
                init, step, fin = "-INFINITY", "if (xv > s || isnan(xv)) s = xv;", "s"
            else:
                d = [1, 1]
                cip = node.args[5] if len(node.args) > 5 else True
                override = node.args[6] if len(node.args) > 6 else None
                win = [f"int h0 = oh * {s[0]} - {p[0]}, w0 = ow * {s[1]} - {p[1]};",
                       f"int h1 = h0 + {k[0]} < {h + p[0]} ? h0 + {k[0]} : {h + p[0]};",
                       f"int w1 = w0 + {k[1]} < {w + p[1]} ? w0 + {k[1]} : {w + p[1]};",
                       "const int all = (h1 - h0) * (w1 - w0);",
                       "h0 = h0 < 0 ? 0 : h0; w0 = w0 < 0 ? 0 : w0;",
                       f"h1 = h1 > {h} ? {h} : h1; w1 = w1 > {w} ? {w} : w1;"]
                div = flit(override) if override else ("(float)all" if cip else "(float)((h1 - h0) * (w1 - w0))")
                init, step, fin = "0.f", "s += xv;", f"(h0 >= h1 || w0 >= w1) ? 0.f : s / {div}"
        if t is aten._adaptive_avg_pool2d.default or t is aten.avg_pool2d.default:
            taps = ["for (int ih = h0; ih < h1; ih++) for (int iw = w0; iw < w1; iw++) {"]
        else:
            taps = [f"for (int i = 0; i < {k[0]}; i++) for (int j = 0; j < {k[1]}; j++) {{",
                    f"  const int ih = h0 + i * {d[0]}, iw = w0 + j * {d[1]};",
                    f"  if (ih < 0 || ih >= {h} || iw < 0 || iw >= {w}) continue;"]
        body = self._prologue(ops, c) + self._shared_loops(["n", "c"], (n, c)) + [  # the planes shared out
            f"for (int oh = 0; oh < {oh}; oh++) for (int ow = 0; ow < {ow}; ow++) {{",
            *["  " + ln for ln in win], f"  float s = {init};", *["  " + ln for ln in taps],
            f"    const float xv = {X.base}[n * {xs[0]} + c * {xs[1]} + ih * {xs[2]} + iw * {xs[3]}];",
            f"    {step}", "  }", f"  float v = {fin};",
            *["  " + ln for ln in self._apply(ops, "v", ["n", "c", "oh", "ow"], "c")],
            f"  {Y.base}[((n * {c} + c) * {oh} + oh) * {ow} + ow] = v;", "}", "}"]
        self._block(f"{node.name}: {getattr(t, '__name__', t)}{self._names(ops)}", body, split=True)
        self.refs[last] = Y

    def _pointwise(self, node: fx.Node) -> None:
        shape = tuple(val(node).shape)
        ops, last = self._epilogue(node)
        rank = len(shape)
        idx = [f"i{d}" for d in range(rank)]
        t = node.target
        src = self.refs.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        if t in UNARY or t is BATCH_NORM:
            if src is None:
                raise Declined(f"{node.name}: its input has no tensor")
            first = [("unary", node)] if t in UNARY else [("bn", node)]
            if t is BATCH_NORM:
                g = [u for u in node.users]
                if len(g) != 1 or g[0].target is not operator.getitem or g[0].args[1] != 0 or rank < 2:
                    raise Declined(f"{node.name}: a BatchNorm whose statistics are read")
                ops, last = self._epilogue(g[0])
                self.absorbed.add(g[0])
            ops = first + ops
            init = f"float v = {src.broadcast_to(rank).at(idx)};"
        else:  # a binary op
            a, b = node.args[:2]
            ra = self.refs[a].broadcast_to(rank).at(idx) if isinstance(a, fx.Node) else flit(a)
            alpha = node.kwargs.get("alpha", 1)
            rb = self.refs[b].broadcast_to(rank).at(idx) if isinstance(b, fx.Node) else flit(b)
            if alpha != 1 and t is not aten.mul.Tensor:
                rb = f"({rb}) * {flit(alpha)}"
            init = f"float v = ({ra}) {BINARY[t]} ({rb});"
        Y = self._alloc(last, shape)
        flat = " + ".join(f"{i} * {s}" for i, s in zip(idx, Y.strides)) or "0"
        channel = idx[1] if rank > 1 else "0"
        body = self._prologue(ops, shape[1] if rank > 1 else 1) + self._shared_loops(idx, shape) + [
            f"  {init}", *["  " + ln for ln in self._apply(ops, "v", idx, channel)],
            f"  {Y.base}[{flat}] = v;"] + ["}"] * max(1, rank - 1)
        self._block(f"{node.name}: {getattr(t, '__name__', t)}{self._names(ops)}", body, split=True)
        self.refs[last] = Y

    @staticmethod
    def _shared_loops(idx: list, shape) -> list:
        """C opening loops over ``idx`` < ``shape`` (one ``{`` each, closed by the caller's ``}``
        lines: one per entry of ``idx`` after the first two, and one), this thread's share of the
        first two dimensions' positions (``part`` of ``parts``)."""
        if not idx:
            return ["if (part == 0) {"]
        head = 2 if len(idx) > 1 else 1
        rows = math.prod(shape[:head])
        lines = split_range("q", rows, 1) + ["for (int q = q_0; q < q_1; q++) {"]
        lines.append(f"  const int {idx[0]} = q / {shape[1]}, {idx[1]} = q % {shape[1]};" if head == 2
                     else f"  const int {idx[0]} = q;")
        return lines + [f"for (int {i} = 0; {i} < {n}; {i}++) {{" for i, n in zip(idx[head:], shape[head:])]

    @staticmethod
    def _names(ops: list) -> str:
        return "".join(f" + {op[1].name}" for op in ops if isinstance(op[1], fx.Node))

    def store_outputs(self, n_args: int) -> None:
        """Copies each output not computed in place into the caller's tensor."""
        for k, o in enumerate(self.outputs):
            ref = self.refs.get(o)
            if ref is None:
                raise Declined(f"output {k} is not a tensor")
            if o in self.in_place and ref.base == self.in_place[o]:
                continue  # computed in place
            shape = tuple(ref.shape)
            idx = [f"i{d}" for d in range(len(shape))]
            loops = " ".join(f"for (int {i} = 0; {i} < {s}; {i}++)" for i, s in zip(idx, shape))
            flat = " + ".join(f"{i} * {s}" for i, s in zip(idx, contiguous_strides(shape))) or "0"
            if val(o).dtype == torch.bfloat16:
                store = f"((unsigned short*)A[{n_args + k}])[{flat}] = to_bf16({ref.at(idx)});"
            else:
                store = f"((float*)A[{n_args + k}])[{flat}] = {ref.at(idx)};"
            self._block(f"output {k}", [f"{loops} {store}"])

    def widen(self, node: fx.Node, k: int, t: torch.Tensor, every_call: bool) -> None:
        """A bfloat16 argument ``k`` widened into float32 workspace (the graph reads that): a
        parameter's at a call that lays weights out (``P``), an input's at every call."""
        shape = tuple(t.shape)
        dst = Ref(self._scratch(4 * max(1, t.numel())), shape, contiguous_strides(shape))
        src = Ref(f"((const unsigned short*)A[{k}])", shape, tuple(t.stride()))
        idx = [f"i{d}" for d in range(len(shape))]
        loops = " ".join(f"for (int {i} = 0; {i} < {n}; {i}++)" for i, n in zip(idx, shape))
        widen = [f"{{ /* {node.name}: bfloat16 -> float32 */",
                 f"  {loops} {dst.at(idx)} = from_bf16({src.at(idx)});", "}"]
        (self.pre if every_call else self.prepare).extend(widen)
        self.refs[node] = dst

    def workspace_bytes(self) -> int:
        return self.top
