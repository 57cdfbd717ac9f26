"""CUDA source generation (the codegen stage) from a small explicit IR (fused pointwise regions) and from
parameterised templates (pooling, global average pool, depthwise conv, Winograd F(2x2,3x3)).

Everything here is pure Python (no GPU needed); ``KernelSource.compile()`` hands the source
to ``compiler.py``.  Launch-side helpers (argument packing, shape checks) live in ``runtime/launch.py``.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .templates import (BINARY_OPS, UNARY_OPS, WINO_AT, WINO_BT, WINO_G, act_lines, bounds, c_unary,
                        ctype as _ctype, decompose as _decompose, fast_math_prefix, lit as _lit, load,
                        norm_acts as _norm_acts, prelude as _prelude, winograd_transform_code,
                        wino_decompose as _wino_decompose)

__all__ = [
    "layout_name", "TensorArg", "PointwiseOp", "PointwiseRegion", "Epilogue", "KernelSource",
    "generate_pointwise", "generate_pool2d", "generate_global_avgpool",
    "generate_depthwise_conv2d", "generate_depthwise_conv2d_nhwc_vec", "generate_winograd_input_transform",
    "generate_winograd_output_transform", "winograd_tiles", "needs_index64",
    "UNARY_OPS", "BINARY_OPS", "SUPPORTED_DTYPES", "WINO_BT", "WINO_G", "WINO_AT",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_MAX_BLOCKS = 1 << 16
_INDEX32_LIMIT = 2**31 - 1 - 2**27  # leaves room for the grid-stride step (<= 2**24 threads x 8)


def needs_index64(numel: int) -> bool:
    """Whether a kernel touching ``numel`` elements must be generated with ``index64=True``."""
    return int(numel) > _INDEX32_LIMIT


def _ident(s: str) -> str:
    return re.sub(r"\W", "_", str(s)) or "k"


def _comment(s) -> str:
    return re.sub(r"[\r\n]", " ", str(s))


def layout_name(v) -> str | None:
    """The codegen layout name ("nchw" / "nhwc") of a value's memory format (the layout pass's
    notion of it), or None (other strides, not a tensor)."""
    from fxopt.passes.layout import CL, NCHW, format_of

    return {NCHW: "nchw", CL: "nhwc"}.get(format_of(v)) if isinstance(v, torch.Tensor) else None


def _layout(layout: str) -> str:
    lay = str(layout).lower()
    if lay not in ("nchw", "nhwc"):
        raise ValueError(f"layout must be 'nchw' or 'nhwc', not {layout!r}")
    return lay


def _uname(prefix: str, *config) -> str:
    return f"{prefix}_{hashlib.sha1(repr(config).encode()).hexdigest()[:8]}"


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _idx(index64: bool) -> str:
    return "long long" if index64 else "int"


def _t_unary(op: str, a: torch.Tensor, p: tuple) -> torch.Tensor:
    """torch (float32) semantics of templates.c_unary."""
    if op in ("hardtanh", "clamp"):
        lo, hi = bounds(op, p)
        return a if lo is None and hi is None else torch.clamp(a, lo, hi)
    if op == "leaky_relu":
        return torch.where(a > 0, a, a * (p[0] if p else 0.01))
    if op == "cast":
        return a.to(p[0]).to(torch.float32)
    f = {"identity": lambda: a, "neg": lambda: -a, "relu": lambda: torch.relu(a),
         "silu": lambda: a / (1 + torch.exp(-a)),
         "gelu": lambda: 0.5 * a * (1 + torch.erf(a * 0.7071067811865476)),
         "gelu_tanh": lambda: 0.5 * a * (1 + torch.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))),
         "hardswish": lambda: a * torch.clamp(a + 3, 0, 6) / 6,
         "hardsigmoid": lambda: torch.clamp(a + 3, 0, 6) / 6,
         "sigmoid": lambda: 1 / (1 + torch.exp(-a)), "tanh": lambda: torch.tanh(a),
         "exp": lambda: torch.exp(a), "abs": lambda: torch.abs(a)}.get(op)
    if f is None:
        raise NotImplementedError(f"unknown pointwise op {op!r}")
    return f()


# ---------------------------------------------------------------------------- IR
@dataclass
class TensorArg:
    name: str
    dtype: torch.dtype = torch.float32
    broadcast: str = "full"  # "full" | "channel" (per-channel vector of length C) | "scalar"

    def __post_init__(self):
        if self.broadcast not in ("full", "channel", "scalar"):
            raise ValueError(f"TensorArg {self.name!r}: bad broadcast {self.broadcast!r}")


@dataclass
class PointwiseOp:
    op: str
    inputs: list[str]
    params: tuple = ()


@dataclass
class PointwiseRegion:
    name: str
    inputs: list[TensorArg]
    ops: list[tuple[str, PointwiseOp]]
    output: str
    out_dtype: torch.dtype = torch.float32

    def validate(self) -> None:
        seen = set()
        for a in self.inputs:
            _ctype(a.dtype)
            if a.name in seen:
                raise ValueError(f"region {self.name!r}: duplicate name {a.name!r}")
            seen.add(a.name)
        if not self.inputs:
            raise ValueError(f"region {self.name!r} has no inputs")
        _ctype(self.out_dtype)
        for ssa, op in self.ops:
            if ssa in seen:
                raise ValueError(f"region {self.name!r}: {ssa!r} defined twice")
            missing = [i for i in op.inputs if i not in seen]
            if missing:
                raise ValueError(f"region {self.name!r}: {ssa!r} uses undefined {missing}")
            if op.op in BINARY_OPS:
                if not (len(op.inputs) == 2 and not op.params or len(op.inputs) == 1 and len(op.params) == 1):
                    raise ValueError(f"{ssa!r}: {op.op} takes two values, or one value and a constant")
            elif op.op in UNARY_OPS:
                lo, hi = UNARY_OPS[op.op]
                if len(op.inputs) != 1 or not lo <= len(op.params) <= hi:
                    raise ValueError(f"{ssa!r}: bad arity for {op.op}: {op.inputs} {op.params}")
                if op.op == "cast":
                    _ctype(op.params[0])
            else:
                raise NotImplementedError(f"{ssa!r}: unknown pointwise op {op.op!r}")
            seen.add(ssa)
        if self.output not in seen:
            raise ValueError(f"region {self.name!r}: output {self.output!r} is undefined")

    def dtypes(self) -> set:
        d = {a.dtype for a in self.inputs} | {self.out_dtype}
        return d | {op.params[0] for _, op in self.ops if op.op == "cast"}

    def reference(self, tensors: Mapping[str, torch.Tensor], shape=None,
                  trace: dict | None = None) -> torch.Tensor:
        """Torch executor of the region with the kernel's semantics (fp32 math, one final
        rounding to ``out_dtype``). Tensors have logical (N, C, ...) shape in any memory
        format; "channel" args are (C,) vectors, "scalar" args hold one element; ``shape``
        is needed only without "full" inputs. ``trace`` (a dict) receives every value."""
        self.validate()
        full = [tensors[a.name] for a in self.inputs if a.broadcast == "full"]
        shape = tuple(full[0].shape) if shape is None and full else tuple(shape or ())
        env: dict[str, torch.Tensor] = {}
        for a in self.inputs:
            t = tensors[a.name].to(torch.float32)
            if a.broadcast == "channel":
                t = t.reshape((1, -1) + (1,) * (len(shape) - 2))
            elif a.broadcast == "scalar":
                t = t.reshape(())
            env[a.name] = t
        for ssa, op in self.ops:
            xs = [env[i] for i in op.inputs]
            if op.op in BINARY_OPS:
                b = xs[1] if len(xs) == 2 else torch.tensor(
                    float(op.params[0]), dtype=torch.float32, device=xs[0].device)
                env[ssa] = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[op.op](xs[0], b)
            else:
                env[ssa] = _t_unary(op.op, xs[0], tuple(op.params))
        if trace is not None:
            trace.update(env)
        return env[self.output].expand(shape).to(self.out_dtype)


@dataclass(frozen=True)
class Epilogue:
    """Fused conv epilogue: acc (+ bias[c]) (+ residual) -> activation(s), in that order."""
    bias: bool = False
    residual: bool = False
    activation: Any = None  # 'relu' | ('hardtanh', (0., 6.)) | PointwiseOp | list of those

    def code(self, indent: str, bias_expr: str, res_expr: str) -> str:
        lines = [f"{indent}acc += {bias_expr};"] if self.bias else []
        if self.residual:
            lines.append(f"{indent}acc += {res_expr};")
        act = act_lines(self.activation, "acc", indent)
        return "\n".join(lines + ([act] if act else []))

    def params(self, T_: str) -> str:
        return ("".join([f", const {T_}* __restrict__ bias"] * self.bias)
                + "".join([f", const {T_}* __restrict__ res"] * self.residual))

    def describe(self) -> str:
        return _comment(f"bias={self.bias} residual={self.residual} act={_norm_acts(self.activation)}")


@dataclass
class KernelSource:
    """Generated kernel: ``params`` are (name, C type) pairs in launch order."""
    name: str
    source: str
    params: tuple[tuple[str, str], ...]
    kind: str
    meta: dict = field(default_factory=dict)
    block: tuple[int, int, int] = (256, 1, 1)
    index64: bool = False

    @property
    def param_types(self) -> tuple[str, ...]:
        return tuple(t for _, t in self.params)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.params)

    def grid_block(self, numel: int = 0, *, N: int | None = None, C: int | None = None,
                   extent: int | None = None):
        """(grid, block) for ``numel`` work items (output elements); for global_avgpool pass N
        and C. ``extent``: the largest number of elements any argument spans (checked against
        32-bit indexing). A zero grid means: nothing to do, do not launch."""
        if not self.index64 and needs_index64(max(int(numel), int(extent or 0))):
            raise ValueError(f"{self.name}: {max(numel, extent or 0)} elements need index64=True")
        if self.kind == "global_avgpool":
            if self.meta["layout"] == "nchw":
                return (min(-(-N * C // 8), _MAX_BLOCKS * 16), 1, 1), self.block
            return (-(-C // 32), min(N, 65535), 1), self.block
        units = -(-int(numel) // self.meta.get("vec", 1))
        return (min(-(-units // self.block[0]), _MAX_BLOCKS), 1, 1), self.block

    def compile(self, arch: str | None = None, options=()):
        from fxopt.backends.cuda.compiler import compile_kernel
        return compile_kernel(self.source, self.name, arch, options, self.param_types)


# ---------------------------------------------------------------------------- pointwise
def generate_pointwise(region: PointwiseRegion, layout: str = "nchw", vector_width: int = 1,
                       index64: bool = False, block: int = 256, fast_math: bool = False) -> KernelSource:
    """One kernel for a fused pointwise region. Launch args: the inputs (in ``region.inputs``
    order), ``out``, then ``numel, C, HW`` (C = shape[1], HW = prod(shape[2:])).

    ``vector_width`` > 1 promises: every full input and the output are aligned to
    min(16, vec * itemsize) bytes, and a channel input (if any) satisfies HW % vec == 0
    (nchw) or C % vec == 0 with an aligned channel vector (nhwc); elements past the last
    full vector go through a scalar tail loop. ``fast_math`` (16-bit results only): the
    activations' exp and quotient approximate, as in the generated region kernels."""
    region.validate()
    prefix = fast_math_prefix(fast_math, [region.out_dtype], (op.op for _, op in region.ops))
    lay, vec = _layout(layout), int(vector_width)
    if vec not in (1, 2, 4, 8) or any(vec * d.itemsize > 32 for d in region.dtypes()):
        raise ValueError(f"unsupported vector width {vector_width}")
    name = f"fx_pw_{_ident(region.name)[:40]}_{lay}_v{vec}{'_i64' if index64 else ''}{'_fm' if prefix else ''}"
    var = {a.name: f"x{j}" for j, a in enumerate(region.inputs)}
    body = []
    for k, (ssa, op) in enumerate(region.ops):
        a = [var[i] for i in op.inputs]
        if op.op in BINARY_OPS:
            rhs = a[1] if len(a) == 2 else _lit(op.params[0])
            expr = f"({a[0]} {BINARY_OPS[op.op]} {rhs})"
        else:
            expr = c_unary(op.op, a[0], tuple(op.params))
        var[ssa] = f"t{k}"
        body.append(f"  const float t{k} = {expr};  // {_comment(ssa)} = {op.op}")
    body.append(f"  return {var[region.output]};")
    params, hoisted, sloads, sargs, vloads, vargs = [], [], [], [], [], []
    for j, a in enumerate(region.inputs):
        ct = _ctype(a.dtype)
        params.append((f"in{j}", f"const {ct}*"))
        cidx = "(i / HW) % C" if lay == "nchw" else "i % C"
        if a.broadcast == "scalar":
            hoisted.append(f"  const float s{j} = fx_to_f32(in{j}[0]);")
            sargs.append(f"s{j}")
            vargs.append(f"s{j}")
            continue
        sloads.append(f"    const float a{j} = fx_to_f32(in{j}[{'i' if a.broadcast == 'full' else cidx}]);")
        sargs.append(f"a{j}")
        if a.broadcast == "channel" and lay == "nchw":  # HW % vec == 0: one channel per vector
            vloads.append(f"    const float a{j} = fx_to_f32(in{j}[{cidx}]);")
            vargs.append(f"a{j}")
        else:
            off = "i" if a.broadcast == "full" else f"({cidx})"
            vloads.append(f"    const fx_vec<{ct}, {vec}> a{j} = "
                          f"*reinterpret_cast<const fx_vec<{ct}, {vec}>*>(in{j} + {off});")
            vargs.append(f"fx_to_f32(a{j}.v[k])")
    out_t = _ctype(region.out_dtype)
    params.append(("out", f"{out_t}*"))
    vector_loop = "" if vec == 1 else load("pointwise_vector_loop.cu").substitute(
        vec=vec, vector_loads="\n".join(vloads), out_t=out_t, name=name, vector_args=", ".join(vargs))
    src = load("pointwise.cu").substitute(
        prelude=_prelude(region.dtypes()), region=_comment(region.name), layout=lay, vec=vec,
        name=name, body_params=", ".join(f"float x{j}" for j in range(len(region.inputs))),
        body="\n".join(body), block=block, idx=_idx(index64),
        params=", ".join(f"{t} __restrict__ {n}" for n, t in params), hoisted="\n".join(hoisted),
        vector_loop=vector_loop, tail_start="nvec * %d" % vec if vec > 1 else "0",
        scalar_loads="\n".join(sloads), out_t=out_t, scalar_args=", ".join(sargs))
    all_params = tuple(params) + (("numel", "long long"), ("C", "long long"), ("HW", "long long"))
    return KernelSource(name, prefix + src, all_params, "pointwise",
                        {"layout": lay, "vec": vec, "region": region, "fast_math": bool(prefix)}, (block, 1, 1),
                        index64)


# ---------------------------------------------------------------------------- pooling
def generate_pool2d(kind: str, k, stride=None, padding=0, dtype: torch.dtype = torch.float32,
                    layout: str = "nchw", pre_activation=None, count_include_pad: bool = True,
                    index64: bool = False, block: int = 256) -> KernelSource:
    """max/avg pool2d (pool(act(x)), PyTorch semantics incl. ceil_mode windows). Launch args:
    x, y, N, C, H, W, OH, OW; one thread per output element."""
    if kind not in ("max", "avg"):
        raise ValueError(f"pool kind must be 'max' or 'avg', not {kind!r}")
    (KH, KW), (PH, PW) = _pair(k), _pair(padding)
    SH, SW = _pair(stride if stride is not None else k)
    if PH > KH // 2 or PW > KW // 2 or min(KH, KW, SH, SW) < 1:
        raise ValueError("pool2d: padding must be at most half the kernel size")
    lay, ct = _layout(layout), _ctype(dtype)
    acts = _norm_acts(pre_activation)
    name = _uname(f"fx_{kind}pool{KH}x{KW}_s{SH}x{SW}_{_SHORT[dtype]}_{lay}", KH, KW, SH, SW, PH, PW,
                  acts, count_include_pad, index64, block)
    decompose, in_at = _decompose(lay)
    finish = "" if kind == "max" else load("avg_finish.cu").substitute(
        KH=KH, KW=KW, PH=PH, PW=PW, count_include_pad="true" if count_include_pad else "false")
    src = load("pool2d.cu").substitute(
        prelude=_prelude({dtype}), kind=kind, KH=KH, KW=KW, SH=SH, SW=SW, PH=PH, PW=PW, layout=lay,
        act_name=_comment(acts or "none"), block=block, name=name, T=ct,
        idx=_idx(index64), decompose=decompose, in_at=in_at,
        init="(-__int_as_float(0x7f800000))" if kind == "max" else "0.f",
        act=act_lines(acts, "v", " " * 8),
        accumulate="if (v > acc || v != v) acc = v;" if kind == "max" else "acc += v;", finish=finish)
    params = (("x", f"const {ct}*"), ("y", f"{ct}*")) + tuple((n, "long long") for n in
                                                              ("N", "C", "H", "W", "OH", "OW"))
    meta = {"layout": lay, "kind": kind, "k": (KH, KW), "stride": (SH, SW), "padding": (PH, PW)}
    return KernelSource(name, src, params, "pool2d", meta, (block, 1, 1), index64)


def generate_global_avgpool(dtype: torch.dtype = torch.float32, layout: str = "nchw",
                            index64: bool = False) -> KernelSource:
    """Global average pool + flatten: (N, C, H, W) -> (N, C). Launch args: x, y, N, C, HW;
    ``grid_block(N=..., C=...)``."""
    lay, ct = _layout(layout), _ctype(dtype)
    name = f"fx_gap_{_SHORT[dtype]}_{lay}{'_i64' if index64 else ''}"
    tmpl = load("global_avgpool_nchw.cu") if lay == "nchw" else load("global_avgpool_nhwc.cu")
    src = tmpl.substitute(prelude=_prelude({dtype}), name=name, T=ct, idx=_idx(index64))
    params = (("x", f"const {ct}*"), ("y", f"{ct}*"), ("N", "long long"), ("C", "long long"),
              ("HW", "long long"))
    return KernelSource(name, src, params, "global_avgpool", {"layout": lay}, (32, 8, 1), index64)


# ---------------------------------------------------------------------------- depthwise conv
def generate_depthwise_conv2d(k, stride=1, padding=0, dtype: torch.dtype = torch.float32,
                              layout: str = "nchw", epilogue: Epilogue | None = None,
                              dilation=1, index64: bool = False, block: int = 256,
                              weight_layout: str | None = None) -> KernelSource:
    """Direct depthwise conv (groups == C, multiplier 1) with fused bias/residual/activation.
    Launch args: x, w, [bias], [res], y, N, C, H, W, OH, OW. Weight layout: ``"ckk"`` (C, KH, KW),
    which is the conv weight (C, 1, KH, KW) itself, or ``"kkc"`` (KH, KW, C); default ckk for
    nchw, kkc for nhwc (see launch.prepare_depthwise_weight)."""
    (KH, KW), (SH, SW), (PH, PW), (DH, DW) = _pair(k), _pair(stride), _pair(padding), _pair(dilation)
    if not (1 <= KH <= 7 and 1 <= KW <= 7 and 1 <= SH <= 2 and 1 <= SW <= 2 and min(PH, PW) >= 0):
        raise ValueError("depthwise conv: kernel 1..7, stride 1..2, padding >= 0")
    lay, ct, epi = _layout(layout), _ctype(dtype), epilogue or Epilogue()
    wl = weight_layout or ("ckk" if lay == "nchw" else "kkc")
    if wl not in ("ckk", "kkc"):
        raise ValueError(f"depthwise conv: weight_layout must be 'ckk' or 'kkc', not {wl!r}")
    name = _uname(f"fx_dw{KH}x{KW}_s{SH}x{SW}_{_SHORT[dtype]}_{lay}", KH, KW, SH, SW, PH, PW, DH, DW,
                  epi, index64, block, wl)
    decompose, in_at = _decompose(lay)
    w_at = "(c * $KH + kh) * $KW + kw" if wl == "ckk" else "(idx_t)(kh * $KW + kw) * C + c"
    src = load("depthwise_conv2d.cu").substitute(
        prelude=_prelude({dtype}), KH=KH, KW=KW, SH=SH, SW=SW, PH=PH, PW=PW, DH=DH, DW=DW,
        layout=lay, weight_layout="(C, KH, KW)" if wl == "ckk" else "(KH, KW, C)",
        epi_desc=epi.describe(), block=block, name=name, T=ct, extra_params=epi.params(ct),
        idx=_idx(index64), decompose=decompose, in_at=in_at,
        w_at=w_at.replace("$KH", str(KH)).replace("$KW", str(KW)),
        epilogue=epi.code(" " * 4, "fx_to_f32(bias[c])", "fx_to_f32(res[o])"))
    params = [("x", f"const {ct}*"), ("w", f"const {ct}*")]
    params += [("bias", f"const {ct}*")] * epi.bias + [("res", f"const {ct}*")] * epi.residual
    params += [("y", f"{ct}*")] + [(n, "long long") for n in ("N", "C", "H", "W", "OH", "OW")]
    meta = {"layout": lay, "k": (KH, KW), "stride": (SH, SW), "padding": (PH, PW),
            "dilation": (DH, DW), "epilogue": epi, "weight_layout": wl}
    return KernelSource(name, src, tuple(params), "depthwise_conv2d", meta, (block, 1, 1), index64)


def generate_depthwise_conv2d_nhwc_vec(n: int, c: int, h: int, w: int, oh: int, ow: int, k, stride=1, padding=0,
                                       dilation=1, dtype: torch.dtype = torch.float16,
                                       epilogue: Epilogue | None = None, block: int = 256) -> KernelSource:
    """Depthwise conv on NHWC tensors with every size compiled in, each thread computing one output
    pixel for ``vec`` consecutive channels (16-byte vector loads of the input per tap and one
    vector store), the block's weights staged in shared memory. Requires C % vec == 0 and 16-byte
    aligned x / y / residual (checked by the caller). Launch args: x, w (C, KH, KW), [bias], [res],
    y; grid and block in ``meta``."""
    (KH, KW), (SH, SW), (PH, PW), (DH, DW) = _pair(k), _pair(stride), _pair(padding), _pair(dilation)
    ct, epi = _ctype(dtype), epilogue or Epilogue()
    vec = 16 // dtype.itemsize
    if c % vec:
        raise ValueError(f"depthwise conv (vector): {c} channels are not a multiple of {vec}")
    cg = min(64, c)
    cg -= cg % vec
    tc = cg // vec
    tp = max(1, block // tc)
    block = tc * tp
    pixels = n * oh * ow
    index64 = needs_index64(max(n * h * w * c, pixels * c))
    name = _uname(f"fx_dwv{KH}x{KW}_s{SH}x{SW}_{_SHORT[dtype]}_nhwc", n, c, h, w, oh, ow, KH, KW, SH, SW, PH, PW,
                  DH, DW, epi, block, index64)
    src = load("depthwise_conv2d_nhwc_vec.cu").substitute(
        prelude=_prelude({dtype}), KH=KH, KW=KW, KK=KH * KW, SH=SH, SW=SW, PH=PH, PW=PW, DH=DH, DW=DW, VEC=vec,
        CG=cg, TC=tc, TP=tp, C=c, H=h, W=w, OH=oh, OW=ow, PIXELS=pixels, block=block, name=name, T=ct,
        idx=_idx(index64), extra_params=epi.params(ct), epi_desc=epi.describe(),
        epilogue=epi.code(" " * 6, "fx_to_f32(bias[c])", "fx_to_f32(res[o])"))
    params = [("x", f"const {ct}*"), ("w", f"const {ct}*")]
    params += [("bias", f"const {ct}*")] * epi.bias + [("res", f"const {ct}*")] * epi.residual + [("y", f"{ct}*")]
    grid = (max(1, min(-(-pixels // tp), _MAX_BLOCKS)), -(-c // cg), 1)
    meta = {"layout": "nhwc", "k": (KH, KW), "stride": (SH, SW), "padding": (PH, PW), "dilation": (DH, DW),
            "epilogue": epi, "vec": vec, "grid": grid, "shape": (n, c, h, w, oh, ow)}
    return KernelSource(name, src, tuple(params), "depthwise_conv2d_nhwc_vec", meta, (block, 1, 1), index64)


# ---------------------------------------------------------------------------- Winograd
def winograd_tiles(H: int, W: int, padding: int = 1) -> tuple[int, int, int, int]:
    """(OH, OW, TH, TW) of a stride-1 3x3 conv computed with 2x2 output tiles."""
    OH, OW = H + 2 * padding - 2, W + 2 * padding - 2
    return OH, OW, -(-OH // 2), -(-OW // 2)


def generate_winograd_input_transform(dtype: torch.dtype = torch.float32, layout: str = "nchw",
                                      padding: int = 1, transform_dtype: torch.dtype | None = None,
                                      index64: bool = False, block: int = 256) -> KernelSource:
    """V = B^T d B for every 4x4 input tile. V is (16, C, P) for nchw, (16, P, C) for nhwc.
    Launch args: x, V, N, C, H, W, TH, TW; ``grid_block(P * C)``."""
    lay, ct, vt = _layout(layout), _ctype(dtype), _ctype(transform_dtype or dtype)
    name = _uname(f"fx_wino_in_{_SHORT[dtype]}_{lay}", padding, transform_dtype, index64, block)
    at = ("((n * C + c) * H + (h0 + {i})) * W + (w0 + {j})" if lay == "nchw"
          else "((n * H + (h0 + {i})) * W + (w0 + {j})) * C + c")
    loads = [f"    const bool rv{i} = h0 + {i} >= 0 && h0 + {i} < H, cv{i} = w0 + {i} >= 0 && w0 + {i} < W;"
             for i in range(4)]
    loads += [f"    const float d{i}_{j} = rv{i} && cv{j} ? fx_to_f32(x[{at.format(i=i, j=j)}]) : 0.f;"
              for i in range(4) for j in range(4)]
    code = winograd_transform_code(WINO_BT, [[f"d{i}_{j}" for j in range(4)] for i in range(4)], "v")
    tr = [f"    const float {n} = {e};" for n, e in code]
    tr += [f"    V[(idx_t){i * 4 + j} * total + o] = fx_from<{vt}>(v{i}_{j});" for i in range(4) for j in range(4)]
    src = load("winograd_input.cu").substitute(
        prelude=_prelude({dtype, transform_dtype or dtype}), PAD=int(padding), layout=lay,
        v_layout="C][P" if lay == "nchw" else "P][C", block=block, name=name, T=ct, VT=vt,
        idx=_idx(index64), decompose=_wino_decompose(lay, "C"),
        loads="\n".join(loads), transform="\n".join(tr))
    params = (("x", f"const {ct}*"), ("V", f"{vt}*")) + tuple((n, "long long") for n in
                                                              ("N", "C", "H", "W", "TH", "TW"))
    return KernelSource(name, src, params, "winograd_input", {"layout": lay, "padding": int(padding)},
                        (block, 1, 1), index64)


def generate_winograd_output_transform(dtype: torch.dtype = torch.float32, layout: str = "nchw",
                                       epilogue: Epilogue | None = None,
                                       transform_dtype: torch.dtype | None = None,
                                       index64: bool = False, block: int = 256) -> KernelSource:
    """Y = A^T m A per tile, then bias + residual + activation. M is (16, K, P) for nchw,
    (16, P, K) for nhwc. Launch args: M, [bias], [res], y, N, K, OH, OW, TH, TW;
    ``grid_block(P * K)``."""
    lay, ct, mt, epi = _layout(layout), _ctype(dtype), _ctype(transform_dtype or dtype), epilogue or Epilogue()
    name = _uname(f"fx_wino_out_{_SHORT[dtype]}_{lay}", epi, transform_dtype, index64, block)
    loads = [f"    const float m{i}_{j} = fx_to_f32(M[(idx_t){i * 4 + j} * total + o]);"
             for i in range(4) for j in range(4)]
    if epi.bias:
        loads.append("    const float bk = fx_to_f32(bias[c]);")
    code = winograd_transform_code(WINO_AT, [[f"m{i}_{j}" for j in range(4)] for i in range(4)], "r")
    at = "((n * K + c) * OH + oh) * OW + ow" if lay == "nchw" else "((n * OH + oh) * OW + ow) * K + c"
    stores = []
    for i in range(2):
        for j in range(2):
            stores.append(f"    {{\n      const int oh = th * 2 + {i}, ow = tw * 2 + {j};\n"
                          f"      if (oh < OH && ow < OW) {{\n        const idx_t oi = {at};\n"
                          f"        float acc = r{i}_{j};\n{epi.code(' ' * 8, 'bk', 'fx_to_f32(res[oi])')}\n"
                          f"        y[oi] = fx_from<{ct}>(acc);\n      }}\n    }}")
    src = load("winograd_output.cu").substitute(
        prelude=_prelude({dtype, transform_dtype or dtype}), layout=lay,
        m_layout="K][P" if lay == "nchw" else "P][K", epi_desc=epi.describe(), block=block,
        name=name, MT=mt, T=ct, extra_params=epi.params(ct), idx=_idx(index64),
        decompose=_wino_decompose(lay, "K"), loads="\n".join(loads),
        transform="\n".join(f"    const float {n} = {e};" for n, e in code), stores="\n".join(stores))
    params = [("M", f"const {mt}*")] + [("bias", f"const {ct}*")] * epi.bias
    params += [("res", f"const {ct}*")] * epi.residual + [("y", f"{ct}*")]
    params += [(n, "long long") for n in ("N", "K", "OH", "OW", "TH", "TW")]
    return KernelSource(name, src, tuple(params), "winograd_output", {"layout": lay, "epilogue": epi},
                        (block, 1, 1), index64)
