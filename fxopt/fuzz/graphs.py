"""Random CNN graphs as Python source: the hypothesis strategy ``programs()``.

A ``Program`` is the model's source code (one ``nn.Module`` class, ``Model``, straight-line
``forward``), the input's shape, dtype and memory format, the weights' and input's seed, the mode
(inference, or one training step: forward, backward, SGD step) and the fxopt options. The model is
built by executing that source, so a reproducer holds exactly what was run (``repro.py``).

Layers (each drawn where legal for the running shape (C, H, W); sizes may reach 1):
convolutions (1x1 to 7x7, stride, dilation, padding incl. ``same``, groups: dense, depthwise,
grouped; 3x3 stride 1 dense often, for Winograd) with optional BatchNorm and activation; pointwise
chains (every activation fxopt fuses and more, arithmetic, clamp, where); reductions (mean, amax,
amin, sum, var over every axis incl. the batch) broadcast back; BatchNorm, InstanceNorm, GroupNorm,
LayerNorm over channels and over (C, H, W); max / avg / adaptive pools; softmax / log_softmax;
squeeze-excite; parallel convolutions of one input summed (re-parameterizable branches); ConvNeXt's
channel MLP on channels-last rows (linear, activation, linear, scale, residual); views
(transpose, channel shuffle, permute round trip, strided slice); chunk / split
+ cat, splits of any widths with an op per piece (kept, activation, conv of any width) concatenated in
any order, Res2Net's hierarchical split, a concatenation of producers of different kinds
(``graph_splits``), stack + softmax over it + weighted sum; constant / reflect / replicate pad;
nearest / bilinear upsample; residual blocks; dtype round trips; flatten + linear heads. A model may return a
second output (an intermediate, sometimes a view of it) so that aliasing and strides of several
outputs are compared.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

from hypothesis import strategies as st

from . import graph_splits

#: activations as functional source (``{x}`` is the operand)
ACTS = {
    "relu": "F.relu({x})", "relu6": "F.relu6({x})", "leaky_relu": "F.leaky_relu({x}, 0.1)", "silu": "F.silu({x})",
    "gelu": "F.gelu({x})", "gelu_tanh": "F.gelu({x}, approximate='tanh')", "hardswish": "F.hardswish({x})",
    "hardsigmoid": "F.hardsigmoid({x})", "sigmoid": "torch.sigmoid({x})", "tanh": "torch.tanh({x})",
    "mish": "F.mish({x})", "elu": "F.elu({x})", "softplus": "F.softplus({x})", "abs": "torch.abs({x})",
    "neg": "torch.neg({x})", "hardtanh": "F.hardtanh({x}, -0.5, 0.5)", "identity": "{x}",
}
ARITH = {
    "affine": "{x} * 0.5 + 0.25", "square": "{x} * {x}", "clamp": "{x}.clamp(-1.0, 1.5)",
    "where": "torch.where({x} > 0, {x}, {x} * 0.2)", "exp": "torch.exp({x}.clamp(max=4.0))",
    "rsub": "1.0 - {x}", "div": "{x} / 3.0",
}
#: layer kinds, repeats weigh the draw
KINDS = ("conv", "conv", "conv3", "pointwise", "reduce", "norm", "norm", "pool", "softmax", "se", "view",
         "split_cat", "pad", "upsample", "residual", "cast")
#: the fuzz run's kinds: also parallel convolutions summed (a graph rewrite's case, no kernel family of
#: its own: the sanitizers' sample, which looks for families, draws ``KINDS``) and a channel MLP (a
#: library product whose epilogue the executor may move into the next kernel) and branches reading
#: channel slices, concatenated (``graph_splits``: the kernels they lower to are the other kinds')
FUZZ_KINDS = KINDS + ("branches", "mlp", "split_branches")
DTYPES = ("float32", "float16", "bfloat16")
ALGORITHMS = (None, "direct", "winograd_2x2_3x3", "winograd_4x4_3x3", "fft", "gemm")


@dataclass
class Program:
    source: str
    shape: tuple
    dtype: str = "float32"
    fmt: str = "contiguous"          # contiguous | channels_last
    mode: str = "inference"          # inference | training
    seed: int = 0
    options: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)  # readable layer descriptions
    ops: list = field(default_factory=list)     # op tags for the coverage report
    target: str = "any"                          # the family target the program was drawn for

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Program":
        return cls(**{**d, "shape": tuple(d["shape"])})

    @classmethod
    def of(cls, forward: list, init: list, shape, mode: str = "inference", dtype: str = "float32",
           options: Optional[dict] = None, seed: int = 3, fmt: str = "contiguous") -> "Program":
        """A program written by hand: ``forward`` lines on ``x``, ``init`` lines making the modules
        (``self.m0 = nn.Conv2d(...)``), the input's shape; the torch executor unless ``options``."""
        return cls(render(init, forward, "x"), tuple(shape), dtype, fmt, mode, seed,
                   dict(options) if options is not None else {"executor": "torch"}, ["hand-written"])

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        return (f"Program({self.target}: {self.dtype}, {self.fmt}, {self.mode}, input {self.shape}, seed {self.seed}, "
                f"options {json.dumps(self.options)}, layers {self.layers})\n{self.source}")


class _Builder:
    """Accumulates the model's __init__ and forward lines while tracking the shape."""

    def __init__(self, draw, c: int, h: int, w: int, training: bool, batch: int = 2):
        self.draw, self.c, self.h, self.w, self.training, self.batch = draw, c, h, w, training, batch
        self.init: list = []
        self.fwd: list = []
        self.desc: list = []
        self.ops: set = set()
        self.n = 0
        self.head = False

    def mod(self, expr: str) -> str:
        name = f"self.m{self.n}"
        self.n += 1
        self.init.append(f"{name} = {expr}")
        return name

    def act(self, x: str = "x", pool=None) -> str:
        a = self.draw(st.sampled_from(sorted(pool or ACTS)))
        self.ops.add(f"act:{a}")
        return ACTS[a].format(x=x), a

    def bn_ok(self, hw: int) -> bool:
        """Whether a BatchNorm over ``hw`` pixels per sample is valid: training needs more than one
        value per channel (eager raises otherwise)."""
        return not self.training or self.batch * hw > 1

    def bn(self, c: int) -> str:
        m = self.mod(f"nn.BatchNorm2d({c})")
        self.init.append(f"_random_stats({m})")
        self.ops.add("batchnorm")
        return m


def _out(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _conv(b: _Builder, three: bool, want: str | None = None) -> None:
    """A conv layer; ``want`` ("dense", "depthwise", "grouped"): that kind where the channels allow it."""
    draw, c = b.draw, b.c
    k = 3 if three else draw(st.sampled_from([1, 1, 2, 3, 3, 5, 7]))
    s = 1 if three else draw(st.sampled_from([1, 1, 2]))
    d = 1 if three or k == 1 else draw(st.sampled_from([1, 1, 2]))
    eff = d * (k - 1) + 1
    same = s == 1 and draw(st.booleans())
    p = (eff - 1) // 2 if three else (0 if same else draw(st.integers(0, eff // 2)))
    oh, ow = (b.h, b.w) if same else (_out(b.h, k, s, p, d), _out(b.w, k, s, p, d))
    if (oh < 1 or ow < 1) and want:  # a target's conv: one that fits (3x3 'same', or 1x1 on one pixel)
        k = 3 if min(b.h, b.w) >= 2 else 1
        s, d, same, p, oh, ow = 1, 1, True, k // 2, b.h, b.w
    if oh < 1 or ow < 1:
        return
    cout = draw(st.sampled_from([c, 1, 2, 3, 4, 5, 6, 7, 8, 12]))
    kind = want or ("dense" if three and draw(st.booleans()) else
                    draw(st.sampled_from(["dense", "dense", "depthwise", "grouped"])))
    g = 1
    wide = [q for q in range(2, c // 2 + 1) if c % q == 0]  # groups of 2+ channels each
    if kind == "depthwise":
        g, cout = c, c * draw(st.sampled_from([1, 1, 2]))
    elif kind == "grouped" and want and wide:  # the grouped kernel's own case: 2+ channels a group
        g = draw(st.sampled_from(wide))
        cout = g * draw(st.sampled_from([c // g, 1, 2, 3, 4]))
    elif kind == "grouped":
        common = [q for q in range(2, c + 1) if c % q == 0 and cout % q == 0]
        g = draw(st.sampled_from(common)) if common else 1
    kind = "dense" if g == 1 else ("depthwise" if g == c else "grouped")
    pad = "'same'" if same else str(p)
    bias = draw(st.booleans())
    m = b.mod(f"nn.Conv2d({c}, {cout}, {k}, stride={s}, padding={pad}, dilation={d}, groups={g}, bias={bias})")
    y = f"{m}(x)"
    text = f"conv{k}x{k} s{s} d{d} p{pad.strip(chr(39))} g{g} {c}->{cout}"
    if b.bn_ok(oh * ow) and draw(st.booleans()):
        y = f"{b.bn(cout)}({y})"
        text += "-bn"
    y, a = b.act(y)
    b.fwd.append(f"x = {y}")
    b.desc.append(f"{text}-{a}")
    b.ops.add(f"conv:{kind}:{k}x{k}" + (":strided" if s > 1 else "") + (":dilated" if d > 1 else ""))
    b.c, b.h, b.w = cout, oh, ow


def _pointwise(b: _Builder) -> None:
    names = b.draw(st.lists(st.sampled_from(sorted(ACTS) + sorted(ARITH)), min_size=1, max_size=3))
    y = "x"
    for nm in names:
        y = (ACTS.get(nm) or ARITH[nm]).format(x=f"({y})" if nm in ARITH else y)
        b.ops.add(f"act:{nm}" if nm in ACTS else f"pointwise:{nm}")
    b.fwd.append(f"x = {y}")
    b.desc.append("-".join(names))


def _reduce(b: _Builder) -> None:
    draw = b.draw
    dims = draw(st.sampled_from([(1,), (2,), (3,), (2, 3), (1, 2, 3), (0,), (0, 2, 3)]))
    op = draw(st.sampled_from(["mean", "amax", "amin", "sum", "var"]))
    if op == "var" and all({0: 1, 1: b.c, 2: b.h, 3: b.w}[d] == 1 for d in dims):
        op = "mean"  # the variance of one value is NaN (unbiased)
    r = f"x.{op}({dims}, keepdim=True)"
    combine = draw(st.sampled_from(["sub", "gate", "add"]))
    b.fwd.append({"sub": f"x = x - {r}", "gate": f"x = x * torch.sigmoid({r})", "add": f"x = x + 0.1 * {r}"}[combine])
    b.desc.append(f"{op}{dims}-{combine}")
    b.ops.add(f"reduce:{op}:{','.join(map(str, dims))}")


def _norm(b: _Builder) -> None:
    draw, c = b.draw, b.c
    kind = draw(st.sampled_from(["batch", "instance", "group", "layer_c", "layer_chw"]))
    affine = draw(st.booleans())
    if kind == "batch":
        if not b.bn_ok(b.h * b.w):
            return
        b.fwd.append(f"x = {b.bn(c)}(x)")
    elif kind == "instance":
        if b.h * b.w < 2:
            return
        b.fwd.append(f"x = {b.mod(f'nn.InstanceNorm2d({c}, affine={affine})')}(x)")
    elif kind == "group":
        g = draw(st.sampled_from([d for d in range(1, c + 1) if c % d == 0]))
        b.fwd.append(f"x = {b.mod(f'nn.GroupNorm({g}, {c}, affine={affine})')}(x)")
    elif kind == "layer_c":
        m = b.mod(f"nn.LayerNorm({c}, elementwise_affine={affine})")
        b.fwd.append(f"x = {m}(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)")
    else:
        m = b.mod(f"nn.LayerNorm([{c}, {b.h}, {b.w}], elementwise_affine={affine})")
        b.fwd.append(f"x = {m}(x)")
    b.desc.append(f"{kind}norm")
    b.ops.add(f"norm:{kind}")


def _pool(b: _Builder, window: bool = False) -> None:
    """A pool; ``window``: a max or average pool of a 2x2 or 3x3 window (the window pools' kernels)."""
    draw = b.draw
    kind = draw(st.sampled_from(["max", "max", "avg"] if window else ["max", "avg", "adaptive", "global"]))
    if kind == "global":
        b.fwd.append("x = F.adaptive_avg_pool2d(x, 1)")
        b.h = b.w = 1
    elif kind == "adaptive":
        oh, ow = draw(st.integers(1, b.h)), draw(st.integers(1, b.w))
        b.fwd.append(f"x = F.adaptive_avg_pool2d(x, ({oh}, {ow}))")
        b.h, b.w = oh, ow
    else:
        k = draw(st.integers(2 if window else 1, 3))
        s = draw(st.integers(1, 2))
        p = draw(st.integers(0, k // 2))
        ceil = draw(st.booleans())
        oh, ow = _pool_out(b.h, k, s, p, ceil), _pool_out(b.w, k, s, p, ceil)
        if oh < 1 or ow < 1:
            return
        if kind == "max":
            b.fwd.append(f"x = F.max_pool2d(x, {k}, {s}, {p}, ceil_mode={ceil})")
        else:
            cp = draw(st.booleans())
            b.fwd.append(f"x = F.avg_pool2d(x, {k}, {s}, {p}, ceil_mode={ceil}, count_include_pad={cp})")
        b.h, b.w = oh, ow
        kind += f"{k}s{s}p{p}" + ("c" if ceil else "")
    b.desc.append(f"{kind}pool")
    b.ops.add(f"pool:{kind.rstrip('0123456789spc')}")


def _pool_out(n: int, k: int, s: int, p: int, ceil: bool) -> int:
    if k > n + 2 * p:
        return 0
    o = (n + 2 * p - k + ((s - 1) if ceil else 0)) // s + 1
    return o - 1 if ceil and (o - 1) * s >= n + p else o


def _view(b: _Builder) -> None:
    kind = b.draw(st.sampled_from(["transpose", "shuffle", "permute", "slice", "flatten"]))
    if kind == "transpose":
        b.fwd.append("x = x.transpose(2, 3)" + (".contiguous()" if b.draw(st.booleans()) else "") + " * 1.5")
        b.h, b.w = b.w, b.h
    elif kind == "shuffle":
        gs = [g for g in (2, 3, 4) if b.c % g == 0]
        if not gs:
            return
        g = b.draw(st.sampled_from(gs))
        b.fwd.append(f"x = x.reshape(x.shape[0], {g}, {b.c // g}, {b.h}, {b.w}).transpose(1, 2)"
                     f".reshape(x.shape[0], {b.c}, {b.h}, {b.w})")
    elif kind == "permute":
        b.fwd.append("x = torch.relu(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)")
    elif kind == "slice":
        if b.w < 2:
            return
        b.fwd.append("x = x[:, :, :, ::2] + 0.5")
        b.w = (b.w + 1) // 2
    else:
        b.fwd.append(f"x = x.flatten(2).unflatten(2, ({b.h}, {b.w})) - 0.25")
    b.desc.append(kind)
    b.ops.add(f"view:{kind}")


def _split_cat(b: _Builder) -> None:
    kind = b.draw(st.sampled_from(["chunk", "split_w", "self", "stack"]))
    y, a = b.act("a")
    if kind == "chunk":
        if b.c % 2:
            return
        b.fwd += ["a, c = torch.chunk(x, 2, dim=1)", f"x = torch.cat([{y}, c], 1)"]
    elif kind == "split_w":
        if b.w < 2:
            return
        b.fwd += [f"a, c = torch.split(x, [1, {b.w - 1}], dim=3)", f"x = torch.cat([c, {y}], 3)"]
    elif kind == "stack":  # selective kernel: paths stacked, a softmax over them, their weighted sum
        b.fwd += ["a = x", f"s = torch.stack([x, {y}], 1)",
                  "x = (s * torch.softmax(s.mean((3, 4), keepdim=True), 1)).sum(1)"]
    else:
        b.fwd += ["a = x", f"x = torch.cat([x, {y}], 1)"]
        b.c *= 2
    b.desc.append(f"{kind}-cat({a})")
    b.ops.add(f"cat:{kind}")


def _pad(b: _Builder) -> None:
    draw = b.draw
    mode = draw(st.sampled_from(["constant", "constant", "reflect", "replicate"]))
    pads = [draw(st.integers(0, 2)) for _ in range(4)]
    if mode == "reflect":
        pads = [min(p, (b.w if i < 2 else b.h) - 1) for i, p in enumerate(pads)]
    val = f", value={draw(st.sampled_from([0.0, -1.5]))}" if mode == "constant" else ""
    b.fwd.append(f"x = F.pad(x, {tuple(pads)}, mode='{mode}'{val})")
    b.w, b.h = b.w + pads[0] + pads[1], b.h + pads[2] + pads[3]
    b.desc.append(f"pad{tuple(pads)}{mode}")
    b.ops.add(f"pad:{mode}")


def _upsample(b: _Builder) -> None:
    mode = b.draw(st.sampled_from(["nearest", "bilinear"]))
    extra = f", align_corners={b.draw(st.booleans())}" if mode == "bilinear" else ""
    if b.draw(st.booleans()):
        b.fwd.append(f"x = F.interpolate(x, scale_factor=2, mode='{mode}'{extra})")
        b.h, b.w = b.h * 2, b.w * 2
    else:  # to a size: scales that are not whole numbers, down as well as up
        b.h, b.w = b.draw(st.integers(1, 2 * b.h + 3)), b.draw(st.integers(1, 2 * b.w + 3))
        b.fwd.append(f"x = F.interpolate(x, size=({b.h}, {b.w}), mode='{mode}'{extra})")
    b.desc.append(f"upsample-{mode}")
    b.ops.add(f"upsample:{mode}")


def _softmax(b: _Builder) -> None:
    dim, log = b.draw(st.sampled_from([1, -1])), b.draw(st.booleans())
    b.fwd.append(f"x = torch.{'log_' if log else ''}softmax(x, dim={dim})")
    b.desc.append(f"{'log_' if log else ''}softmax{dim}")
    b.ops.add(f"softmax:{'log' if log else 'plain'}")


def _se(b: _Builder) -> None:
    r = max(1, b.c // 2)
    fc1, fc2 = b.mod(f"nn.Conv2d({b.c}, {r}, 1)"), b.mod(f"nn.Conv2d({r}, {b.c}, 1)")
    y, a = b.act(f"{fc1}(x.mean((2, 3), keepdim=True))", pool=("relu", "silu", "hardswish"))
    b.fwd.append(f"x = x * torch.sigmoid({fc2}({y}))")
    b.desc.append(f"se({a})")
    b.ops.add("se")


def _branches(b: _Builder) -> None:
    """Parallel convolutions of ``x`` (kxk, 1x1, 1xk, kx1, each maybe with BatchNorm), an identity term
    maybe (``x`` or a BatchNorm of ``x``), summed, then an activation: RepVGG / MobileOne / ACNet
    blocks, which ``merge_parallel_convs`` makes one convolution in inference."""
    draw, c = b.draw, b.c
    k = draw(st.sampled_from([3, 5])) if min(b.h, b.w) >= 5 else 3
    s, d = draw(st.sampled_from([1, 1, 2])), draw(st.sampled_from([1, 1, 2]))
    g = draw(st.sampled_from([q for q in (1, 1, 2, 3, c) if c % q == 0]))
    shapes = draw(st.lists(st.sampled_from([(k, k), (1, 1), (1, k), (k, 1), (k, k)]), min_size=1, max_size=3))
    terms = []
    for kh, kw in shapes:
        bias = not draw(st.booleans())
        m = b.mod(f"nn.Conv2d({c}, {c}, ({kh}, {kw}), {s}, ({d * (kh - 1) // 2}, {d * (kw - 1) // 2}), {d}, {g}, "
                  f"bias={bias})")
        terms.append(f"{b.bn(c)}({m}(x))" if b.bn_ok(b.h * b.w) and draw(st.booleans()) else f"{m}(x)")
    ident = draw(st.sampled_from(["none", "x", "bn"])) if s == 1 else "none"
    if ident == "bn" and b.bn_ok(b.h * b.w):
        terms.append(f"{b.bn(c)}(x)")
    elif ident == "x":
        terms.append("x")
    y, a = b.act(" + ".join(terms))
    b.fwd.append(f"x = {y}")
    b.h, b.w = (b.h - 1) // s + 1, (b.w - 1) // s + 1
    b.desc.append(f"branches(s{s} d{d} g{g}: {' + '.join(f'{kh}x{kw}' for kh, kw in shapes)}"
                  f"{'' if ident == 'none' else ' + ' + ident})-{a}")
    b.ops.add("branches")


def _mlp(b: _Builder) -> None:
    """ConvNeXt's channel MLP over N*H*W channels-last rows (more than 16: the executor measures each
    linear layer with its bias fused against the bare product with the bias and activation moved
    into the kernel that reads it): permute, Linear(C, hidden), activation, Linear(hidden, C),
    maybe a per-channel scale, permute back, maybe a residual."""
    draw, c = b.draw, b.c
    hidden = draw(st.sampled_from(sorted({1, 3, 8, 4 * c})))
    l1 = b.mod(f"nn.Linear({c}, {hidden})")
    l2 = b.mod(f"nn.Linear({hidden}, {c}, bias={draw(st.booleans())})")
    y, a = b.act(f"{l1}(x.permute(0, 2, 3, 1))", pool=("gelu", "gelu_tanh", "relu", "silu", "hardswish", "identity"))
    z = f"{l2}({y})"
    scale = draw(st.booleans())
    if scale:
        z = f"{b.mod(f'nn.Parameter(torch.rand({c}) + 0.5)')} * {z}"
    residual = draw(st.booleans())
    b.fwd.append(f"x = {'x + ' if residual else ''}({z}).permute(0, 3, 1, 2)")
    b.desc.append(f"mlp({c}-{hidden}-{a}{'-scale' if scale else ''}{'+x' if residual else ''})")
    b.ops.add("mlp")


def _residual(b: _Builder) -> None:
    if not b.bn_ok(b.h * b.w):
        return
    k = b.draw(st.sampled_from([1, 3]))
    m = b.mod(f"nn.Conv2d({b.c}, {b.c}, {k}, padding={k // 2}, bias=False)")
    y, a = b.act(f"{b.bn(b.c)}({m}(x)) + x")
    b.fwd.append(f"x = {y}")
    b.desc.append(f"residual(conv{k}-bn)+{a}")
    b.ops.add("residual")


def _cast(b: _Builder, dtype: str) -> None:
    """A round trip through another dtype, back to the operand's own (``x.dtype``: the float64
    reference model stays float64, an autocast region keeps its dtype)."""
    other = b.draw(st.sampled_from([d for d in ("float16", "bfloat16", "float32") if d != dtype]))
    b.fwd.append(f"x = x.to(torch.{other}).to(x.dtype) * 2.0")
    b.desc.append(f"cast({other})")
    b.ops.add("cast")


def _head(b: _Builder) -> None:
    kind = b.draw(st.sampled_from(["flatten", "pooled"]))
    feat = b.c * b.h * b.w if kind == "flatten" else b.c
    hidden = b.draw(st.sampled_from([1, 3, 8, 16]))
    l1, l2 = b.mod(f"nn.Linear({feat}, {hidden})"), b.mod(f"nn.Linear({hidden}, {b.draw(st.integers(1, 7))})")
    src = "torch.flatten(x, 1)" if kind == "flatten" else "x.mean((2, 3))"
    y, a = b.act(f"{l1}({src})", pool=("relu", "gelu", "hardswish", "identity", "silu"))
    b.fwd.append(f"x = {l2}({y})")
    b.desc.append(f"{kind}-linear-{a}-linear")
    b.ops.add(f"linear:{kind}")
    b.head = True


_PRELUDE = '''import torch
import torch.nn as nn
import torch.nn.functional as F


def _random_stats(bn):
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
'''


def render(init: list, fwd: list, ret: str) -> str:
    lines = [_PRELUDE, "", "class Model(nn.Module):", "    def __init__(self):", "        super().__init__()"]
    lines += [f"        {ln}" for ln in init] or ["        pass"]
    lines += ["", "    def forward(self, x):"] + [f"        {ln}" for ln in fwd] + [f"        return {ret}", ""]
    return "\n".join(lines)


#: family targets, drawn first: each shapes the program so that a kernel family or algorithm that a
#: free draw reaches rarely is reached in a fair share of the programs ("any": the free draw)
TARGETS = ("any", "any", "any", "grouped", "winograd", "depthwise", "pool", "reduction", "linear", "cast")


def _target(draw, b: _Builder, target: str, dtype: str) -> None:
    """The target's layer, first in the program (the input was drawn to suit it)."""
    if target == "grouped":
        _conv(b, draw(st.booleans()), want="grouped")
    elif target == "winograd":
        _conv(b, True, want=draw(st.sampled_from(["dense", "dense", "grouped"])))
    elif target == "depthwise":
        _conv(b, False, want="depthwise")
    elif target == "pool":
        _pool(b, window=True)
    elif target == "reduction":
        _reduce(b)  # (the "linear" target: the head, at the end)
    elif target == "cast":
        _cast(b, dtype)


@st.composite
def programs(draw, dtypes=DTYPES, modes=("inference", "training"), max_layers: int = 5, max_batch: int = 64,
             max_size: int = 12, algorithms=ALGORITHMS, cudagraphs=(None, False), executor=None, kinds=KINDS,
             targets=TARGETS):
    """A random ``Program``; ``cudagraphs``: values of the option to draw (None: the default);
    ``targets``: the family targets to draw from (``TARGETS``)."""
    target = draw(st.sampled_from(list(targets)))
    dtype = draw(st.sampled_from(list(dtypes)))
    # the grouped kernel reads channels_last tensors; Winograd and the window pools' kernels are
    # inference's (training convolutions are cuDNN's; a training max pool keeps its indices)
    mode = "inference" if target in ("winograd", "pool") and "inference" in modes else draw(st.sampled_from(list(modes)))
    fmt = "channels_last" if target == "grouped" else draw(st.sampled_from(["contiguous", "channels_last"]))
    n = draw(st.sampled_from(sorted({min(v, max_batch) for v in (1, 1, 2, 3, 4, 5, 8, 17, 64)})))
    if target == "grouped":
        c = draw(st.sampled_from([4, 6, 8, 12, 16]))
    else:
        c = draw(st.integers(1, 7) | st.sampled_from([8, 12, 16]))
    lo = {"pool": 4, "grouped": 2}.get(target, 1)  # (1x1 pixels: layouts coincide, the conv is a matmul)
    h, w = draw(st.integers(lo, max(lo, max_size))), draw(st.integers(lo, max(lo, max_size)))
    b = _Builder(draw, c, h, w, mode == "training", n)
    shape = (n, c, h, w)
    aux = None
    _target(draw, b, target, dtype)
    for i in range(draw(st.integers(0 if b.fwd else 1, max_layers))):
        kind = draw(st.sampled_from(list(kinds)))
        if kind in ("conv", "conv3"):
            _conv(b, kind == "conv3")
        elif kind == "cast":
            _cast(b, dtype)
        else:
            {"pointwise": _pointwise, "reduce": _reduce, "norm": _norm, "pool": _pool, "softmax": _softmax,
             "se": _se, "view": _view, "split_cat": _split_cat, "split_branches": graph_splits.draw, "pad": _pad,
             "upsample": _upsample, "residual": _residual, "branches": _branches, "mlp": _mlp}[kind](b)
        if aux is None and i == 0 and draw(st.integers(0, 5)) == 0:
            aux = draw(st.sampled_from(["y", "y.transpose(2, 3)", "y[:, :1]"]))
            b.fwd.append("y = x")
            b.ops.add("outputs:two")
    # a graph of no op (an alias, or a pointwise chain of identities only): Dynamo hands fxopt nothing
    while not [line for line in b.fwd if line not in ("y = x", "x = x")]:
        _pointwise(b)
    if target == "linear" or draw(st.integers(0, 3)) == 0:
        _head(b)
    options = {}
    if target == "winograd":  # None: the generated F(2x2, 3x3) candidate competes (never beside a forced algorithm)
        algorithm = draw(st.sampled_from(["winograd_2x2_3x3", "winograd_4x4_3x3", None]))
    elif target == "grouped":  # the grouped kernel is the direct algorithm's
        algorithm = draw(st.sampled_from([None, "direct"]))
    else:
        algorithm = draw(st.sampled_from(list(algorithms)))
    if algorithm:
        options["conv_algorithm"] = algorithm
    graphs = draw(st.sampled_from(list(cudagraphs)))
    if graphs is not None:
        options["cudagraphs"] = graphs
    if executor:
        options["executor"] = executor
    if dtype != "float32" and draw(st.booleans()):
        options["fast_math"] = False
    ret = "x" if aux is None else f"x, {aux}"
    return Program(render(b.init, b.fwd, ret), shape, dtype, fmt, mode, draw(st.integers(0, 2**16)), options,
                   b.desc, sorted(b.ops), target)
