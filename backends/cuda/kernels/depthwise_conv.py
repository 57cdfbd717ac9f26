"""The depthwise-conv family (groups == C, multiplier 1, kernel 1..7, stride 1..2, algorithm
``direct``): one direct kernel with bias, residual and activation fused (cuDNN runs such a conv and
its epilogue as two kernels), reading the conv weight (C, 1, KH, KW) as it is. ``plan_depthwise``:
any layout; on channels_last tensors also ``plan_depthwise_vec`` (one pixel x a 16-byte channel
vector per thread) and ``plan_depthwise_rows`` (several pixels of a row per thread), below.

Source of the row-tiled depthwise convolution kernel for channels_last tensors
(``generate_depthwise_conv2d_nhwc_rows``).

Why: a depthwise conv does KH x KW multiply-adds per output and nothing else, so a kernel that loads
the whole input window for every output pixel (``depthwise_conv2d_nhwc_vec.cu``: one 16-byte load
per tap and pixel) spends its time in loads and conversions, not in arithmetic: ConvNeXt's 7x7
convs at batch 32 ran at a third of cuDNN's speed that way, and cuDNN's own kernel there moves far
less than the memory system allows.

What it generates: each thread computes ``tw`` consecutive output pixels of one output row for
``vec`` consecutive channels. For each kernel row it loads every input column that any of its
pixels reads exactly once (``tw + KW - 1`` loads at stride 1 instead of ``tw x KW``), converts it
to float once, and adds it into each of its pixels that reads it, the kernel row's weights held in
registers (read from shared memory once per row, not once per pixel; the staged rows are padded
so that staging them is not one bank's queue). Which columns feed which
pixel is worked out here, at generation time, for any stride and dilation, and emitted as straight
code; columns outside the image are skipped. The epilogue (bias, residual, activation) is applied
in registers and each pixel's ``vec`` outputs stored as one vector. fp32 accumulation for every
dtype; every size compiled in. Which convolutions get it and the variants measured:
``plan_depthwise_rows`` below.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen.c import ctype, ctype as _ctype, decompose as _decompose, prelude, prelude as _prelude
from fxopt.backends.cuda.codegen.epilogue import (NO_EPILOGUE, epilogue_code, epilogue_desc, epilogue_key,
                                                  epilogue_params, has_bias, has_residual, template_epilogue)
from fxopt.backends.cuda.codegen.source import KernelSource, MAX_BLOCKS as _GRID_BLOCKS, DTYPE_SHORT, index_type, checked_layout, int_pair, unique_name, layout_name, needs_index64
from fxopt.backends.cuda.kernels.common import TemplateCandidate, compiled_kernel, dense_strides, ints, load, memory_layout_ok, node_val
from fxopt.backends.cuda.kernels.conv import CONV_DTYPES, MANY_THREADS, launch_nhwc, check_conv_args
from fxopt.ops import fused_conv_ref


MAX_BLOCKS = 65535
#: channels per block at most (their weights are staged in shared memory: KH x KW x CG floats)
MAX_CG = 128


def channel_block(c: int, vec: int) -> int:
    """Channels per block: the largest multiple of ``vec`` up to ``MAX_CG`` that divides ``c`` (so no
    block has idle channel threads)."""
    return max(cg for cg in range(vec, min(c, MAX_CG) + 1, vec) if c % cg == 0)


def smem_row(cg: int) -> int:
    """Floats between two taps' rows of staged weights: ``cg`` padded by 4 where it is a multiple
    of 8, so that the staging writes of one channel's consecutive taps (one warp) spread over 8
    banks instead of one, while each thread's 4-channel reads stay 16-byte aligned."""
    return cg + 4 if cg % 8 == 0 else cg


def column_taps(tw: int, kw: int, sw: int, dw: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """For a tile of ``tw`` output pixels: each input column (offset from the first pixel's window
    start) with the (pixel, tap) pairs that read it, in column order."""
    cols: dict[int, list] = {}
    for u in range(tw):
        for t in range(kw):
            cols.setdefault(u * sw + t * dw, []).append((u, t))
    return sorted(cols.items())


def _columns(taps, vec: int, T: str, w: int, c: int) -> str:
    """Per input column of a kernel row: load it (if inside the image), convert it, add it into each
    (pixel, tap) that reads it."""
    ind = " " * 6
    lines = []
    for col, uses in taps:
        lines.append(f"{ind}if ((unsigned)(iw0 + {col}) < (unsigned){w}) {{")
        lines.append(f"{ind}  const fx_vec<{T}, {vec}> v = *reinterpret_cast<const fx_vec<{T}, {vec}>*>("
                     f"xr + (idx_t)(iw0 + {col}) * {c});")
        lines.append(f"{ind}  float xv[{vec}];")
        lines.append("#pragma unroll")
        lines.append(f"{ind}  for (int j = 0; j < {vec}; ++j) xv[j] = fx_to_f32(v.v[j]);")
        for u, t in uses:
            lines.append("#pragma unroll")
            lines.append(f"{ind}  for (int j = 0; j < {vec}; ++j) sum[{u}][j] += xv[j] * wr[{t}][j];")
        lines.append(f"{ind}}}")
    return "\n".join(lines)


def _load_weights(vec: int) -> str:
    ind = " " * 8
    if vec % 4 == 0:
        return "\n".join(f"{ind}{{ const float4 w4 = *reinterpret_cast<const float4*>(wp + {4 * q});\n"
                         f"{ind}  wr[kw][{4 * q}] = w4.x; wr[kw][{4 * q + 1}] = w4.y; "
                         f"wr[kw][{4 * q + 2}] = w4.z; wr[kw][{4 * q + 3}] = w4.w; }}" for q in range(vec // 4))
    return "\n".join(f"{ind}wr[kw][{j}] = wp[{j}];" for j in range(vec))


def generate_depthwise_conv2d_nhwc_rows(n: int, c: int, h: int, w: int, oh: int, ow: int, k, stride=1, padding=0,
                                        dilation=1, dtype: torch.dtype = torch.float16,
                                        epilogue=None, vec: int = 4, tw: int = 4,
                                        block: int = 256) -> KernelSource:
    """Depthwise conv on NHWC tensors (x (n, c, h, w) -> y (n, c, oh, ow), weight (C, 1, KH, KW) read as
    (C, KH, KW)), ``tw`` output pixels along a row x ``vec`` channels per thread. ``vec`` (a power of
    two) must divide ``c`` and make a load of 4 to 16 bytes. Requires x, y and residual channels_last,
    dense and aligned to ``vec`` elements (checked by the caller). Launch args: x, w, [bias], [res],
    y; grid and block in ``meta``."""
    (KH, KW), (SH, SW), (PH, PW), (DH, DW) = int_pair(k), int_pair(stride), int_pair(padding), int_pair(dilation)
    nbytes = vec * dtype.itemsize
    if vec < 1 or vec & (vec - 1) or c % vec or not 4 <= nbytes <= 16:
        raise ValueError(f"depthwise conv (rows): {vec} channels per thread must divide {c} and load 4-16 bytes")
    if not 1 <= tw <= 16:
        raise ValueError(f"depthwise conv (rows): {tw} pixels per thread (1..16)")
    T, epi = ctype(dtype), NO_EPILOGUE if epilogue is None else epilogue
    cg = channel_block(c, vec)
    stride_s = smem_row(cg)
    if KH * KW * stride_s > 12288:
        raise ValueError(f"depthwise conv (rows): a {KH}x{KW} kernel's weights exceed shared memory")
    tc = cg // vec
    tp = max(1, block // tc)
    block = tc * tp
    owt = -(-ow // tw)
    tiles = n * oh * owt
    index64 = needs_index64(max(n * h * w * c, n * oh * ow * c))
    taps = column_taps(tw, KW, SW, DW)
    name = unique_name(f"fx_dwr{KH}x{KW}_s{SH}x{SW}_{DTYPE_SHORT[dtype]}_nhwc_v{vec}w{tw}", n, c, h, w, oh, ow, KH, KW, SH,
                  SW, PH, PW, DH, DW, epilogue_key(epi), vec, tw, block, index64)
    src = load("depthwise_conv2d_nhwc_rows.cu").substitute(
        prelude=prelude({dtype}), KH=KH, KW=KW, KK=KH * KW, SH=SH, SW=SW, PH=PH, PW=PW, DH=DH, DW=DW, VEC=vec,
        TW=tw, CG=cg, S=stride_s, TC=tc, TP=tp, C=c, H=h, W=w, OH=oh, OW=ow, OWT=owt, TILES=tiles, COLS=len(taps),
        block=block, name=name, T=T, idx=index_type(index64), extra_params=epilogue_params(epi, T), epi_desc=epilogue_desc(epi),
        load_weights=_load_weights(vec), columns=_columns(taps, vec, T, w, c),
        epilogue=epilogue_code(epi, " " * 8, "fx_to_f32(bias[c])", "fx_to_f32(res[o])"))
    params = [("x", f"const {T}*"), ("w", f"const {T}*")]
    params += [("bias", f"const {T}*")] * has_bias(epi) + [("res", f"const {T}*")] * has_residual(epi) + [("y", f"{T}*")]
    grid = (max(1, min(-(-tiles // tp), MAX_BLOCKS)), c // cg, 1)
    meta = {"layout": "nhwc", "k": (KH, KW), "stride": (SH, SW), "padding": (PH, PW), "dilation": (DH, DW),
            "epilogue": epi, "vec": vec, "tw": tw, "grid": grid, "shape": (n, c, h, w, oh, ow)}
    return KernelSource(name, src, tuple(params), "depthwise_conv2d_nhwc_rows", meta, (block, 1, 1), index64)


def generate_depthwise_conv2d(k, stride=1, padding=0, dtype: torch.dtype = torch.float32,
                              layout: str = "nchw", epilogue=None,
                              dilation=1, index64: bool = False, block: int = 256,
                              weight_layout: str | None = None) -> KernelSource:
    """Direct depthwise conv (groups == C, multiplier 1) with fused bias/residual/activation.
    Launch args: x, w, [bias], [res], y, N, C, H, W, OH, OW. Weight layout: ``"ckk"`` (C, KH, KW),
    which is the conv weight (C, 1, KH, KW) itself, or ``"kkc"`` (KH, KW, C); default ckk for
    nchw, kkc for nhwc (see launch.prepare_depthwise_weight)."""
    (KH, KW), (SH, SW), (PH, PW), (DH, DW) = int_pair(k), int_pair(stride), int_pair(padding), int_pair(dilation)
    if not (1 <= KH <= 7 and 1 <= KW <= 7 and 1 <= SH <= 2 and 1 <= SW <= 2 and min(PH, PW) >= 0):
        raise ValueError("depthwise conv: kernel 1..7, stride 1..2, padding >= 0")
    lay, ct, epi = checked_layout(layout), _ctype(dtype), NO_EPILOGUE if epilogue is None else epilogue
    wl = weight_layout or ("ckk" if lay == "nchw" else "kkc")
    if wl not in ("ckk", "kkc"):
        raise ValueError(f"depthwise conv: weight_layout must be 'ckk' or 'kkc', not {wl!r}")
    name = unique_name(f"fx_dw{KH}x{KW}_s{SH}x{SW}_{DTYPE_SHORT[dtype]}_{lay}", KH, KW, SH, SW, PH, PW, DH, DW,
                  epilogue_key(epi), index64, block, wl)
    decompose, in_at = _decompose(lay)
    w_at = "(c * $KH + kh) * $KW + kw" if wl == "ckk" else "(idx_t)(kh * $KW + kw) * C + c"
    src = load("depthwise_conv2d.cu").substitute(
        prelude=_prelude({dtype}), KH=KH, KW=KW, SH=SH, SW=SW, PH=PH, PW=PW, DH=DH, DW=DW,
        layout=lay, weight_layout="(C, KH, KW)" if wl == "ckk" else "(KH, KW, C)",
        epi_desc=epilogue_desc(epi), block=block, name=name, T=ct, extra_params=epilogue_params(epi, ct),
        idx=index_type(index64), decompose=decompose, in_at=in_at,
        w_at=w_at.replace("$KH", str(KH)).replace("$KW", str(KW)),
        epilogue=epilogue_code(epi, " " * 4, "fx_to_f32(bias[c])", "fx_to_f32(res[o])"))
    params = [("x", f"const {ct}*"), ("w", f"const {ct}*")]
    params += [("bias", f"const {ct}*")] * has_bias(epi) + [("res", f"const {ct}*")] * has_residual(epi)
    params += [("y", f"{ct}*")] + [(n, "long long") for n in ("N", "C", "H", "W", "OH", "OW")]
    meta = {"layout": lay, "k": (KH, KW), "stride": (SH, SW), "padding": (PH, PW),
            "dilation": (DH, DW), "epilogue": epi, "weight_layout": wl}
    return KernelSource(name, src, tuple(params), "depthwise_conv2d", meta, (block, 1, 1), index64)


def generate_depthwise_conv2d_nhwc_vec(n: int, c: int, h: int, w: int, oh: int, ow: int, k, stride=1, padding=0,
                                       dilation=1, dtype: torch.dtype = torch.float16,
                                       epilogue=None, block: int = 256) -> KernelSource:
    """Depthwise conv on NHWC tensors with every size compiled in, each thread computing one output
    pixel for ``vec`` consecutive channels (16-byte vector loads of the input per tap and one
    vector store), the block's weights staged in shared memory. Requires C % vec == 0 and 16-byte
    aligned x / y / residual (checked by the caller). Launch args: x, w (C, KH, KW), [bias], [res],
    y; grid and block in ``meta``."""
    (KH, KW), (SH, SW), (PH, PW), (DH, DW) = int_pair(k), int_pair(stride), int_pair(padding), int_pair(dilation)
    ct, epi = _ctype(dtype), NO_EPILOGUE if epilogue is None else epilogue
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
    name = unique_name(f"fx_dwv{KH}x{KW}_s{SH}x{SW}_{DTYPE_SHORT[dtype]}_nhwc", n, c, h, w, oh, ow, KH, KW, SH, SW, PH, PW,
                  DH, DW, epilogue_key(epi), block, index64)
    src = load("depthwise_conv2d_nhwc_vec.cu").substitute(
        prelude=_prelude({dtype}), KH=KH, KW=KW, KK=KH * KW, SH=SH, SW=SW, PH=PH, PW=PW, DH=DH, DW=DW, VEC=vec,
        CG=cg, TC=tc, TP=tp, C=c, H=h, W=w, OH=oh, OW=ow, PIXELS=pixels, block=block, name=name, T=ct,
        idx=index_type(index64), extra_params=epilogue_params(epi, ct), epi_desc=epilogue_desc(epi),
        epilogue=epilogue_code(epi, " " * 6, "fx_to_f32(bias[c])", "fx_to_f32(res[o])"))
    params = [("x", f"const {ct}*"), ("w", f"const {ct}*")]
    params += [("bias", f"const {ct}*")] * has_bias(epi) + [("res", f"const {ct}*")] * has_residual(epi) + [("y", f"{ct}*")]
    grid = (max(1, min(-(-pixels // tp), _GRID_BLOCKS)), -(-c // cg), 1)
    meta = {"layout": "nhwc", "k": (KH, KW), "stride": (SH, SW), "padding": (PH, PW), "dilation": (DH, DW),
            "epilogue": epi, "vec": vec, "grid": grid, "shape": (n, c, h, w, oh, ow)}
    return KernelSource(name, src, tuple(params), "depthwise_conv2d_nhwc_vec", meta, (block, 1, 1), index64)


def prepare_depthwise_weight(w: torch.Tensor, layout: str) -> torch.Tensor:
    """(C, 1, KH, KW) conv weight -> (C, KH, KW) for ckk kernels (the nchw default), (KH, KW, C)
    for kkc kernels (the nhwc default); ``layout`` is the kernel's layout or weight layout."""
    C, _, KH, KW = w.shape
    w = w.reshape(C, KH, KW)
    return (w if layout in ("nchw", "ckk") else w.permute(1, 2, 0)).contiguous()


def launch_depthwise_conv2d(ks: KernelSource, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                            bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                            kernel=None) -> torch.Tensor:
    """``w`` from prepare_depthwise_weight; bias/residual as the kernel's epilogue requires."""
    check_conv_args(ks, x, out, bias, residual)
    N, C, H, W = x.shape
    OH, OW = out.shape[2:]
    if out.numel() == 0:
        return out
    args = [x, w] + [t for t in (bias, residual) if t is not None] + [out, N, C, H, W, OH, OW]
    grid, block = ks.grid_block(out.numel(), extent=x.numel())
    compiled_kernel(ks, kernel).launch(grid, block, args)
    return out


class DepthwiseConv(TemplateCandidate):
    def __init__(self, node: fx.Node, layout: str, out: torch.Tensor, k, stride, padding, dilation):
        bias, res, act, act_params = node.args[2], node.args[3], node.args[8], node.args[9]
        self.epilogue = template_epilogue(bias is not None, res is not None, act, act_params)
        self.layout, self.out_meta = layout, out
        self.k, self.stride, self.padding, self.dilation = k, stride, padding, dilation
        self.x_shape = tuple(node_val(node.args[0]).shape[1:])
        super().__init__(f"dw_{node.name}", generate_depthwise_conv2d(
            k, stride, padding, out.dtype, layout, self.epilogue, dilation, weight_layout="ckk"))

    def __call__(self, x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None):
        if self.kernel is None or not memory_layout_ok(x, self.layout) or not _ckk(weight):
            return None  # not the layout this kernel was generated for: the reference runs
        if tuple(x.shape[1:]) != self.x_shape or x.dtype != self.out_meta.dtype or weight.dtype != x.dtype:
            return None
        if residual is not None and not memory_layout_ok(residual, self.layout):
            return None
        out = torch.empty_strided((x.shape[0], *self.out_meta.shape[1:]),
                                  dense_strides(self.layout, (x.shape[0], *self.out_meta.shape[1:])),
                                  dtype=x.dtype, device=x.device)
        return launch_depthwise_conv2d(self.sources[0], x, weight, out, bias, residual, kernel=self.kernel)


class _DepthwiseNhwc(TemplateCandidate):
    """A channels_last depthwise conv kernel with every size compiled in: ``source`` for a fused_conv
    node, run where the tensors are what it was generated for (the input aligned to ``align`` bytes)."""

    def __init__(self, name: str, node: fx.Node, out: torch.Tensor, align: int, generate):
        bias, res, act, act_params = node.args[2], node.args[3], node.args[8], node.args[9]
        self.epilogue = template_epilogue(bias is not None, res is not None, act, act_params)
        self.x_shape, self.out_shape, self.dtype = tuple(node_val(node.args[0]).shape), tuple(out.shape), out.dtype
        self.align = align
        n, c, h, w = self.x_shape
        super().__init__(name, generate(n, c, h, w, out.shape[2], out.shape[3], self.epilogue))

    def __call__(self, x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None):
        if self.kernel is None or not x.is_cuda or tuple(x.shape) != self.x_shape or x.dtype != self.dtype:
            return None
        if not memory_layout_ok(x, "nhwc") or not _ckk(weight) or weight.dtype != x.dtype or x.data_ptr() % self.align:
            return None
        return launch_nhwc(self, self.epilogue, self.out_shape, x, weight, bias, residual)


class DepthwiseConvVec(_DepthwiseNhwc):
    """NHWC depthwise conv: one output pixel x 8 (fp16/bf16) or 4 (fp32) channels per thread, 16-byte
    vector loads, weights staged in shared memory (``codegen.generate_depthwise_conv2d_nhwc_vec``)."""
    label = "depthwiseconv_vec"

    def __init__(self, node: fx.Node, out: torch.Tensor, k, stride, padding, dilation):
        super().__init__(f"dwv_{node.name}", node, out, 16, lambda n, c, h, w, oh, ow, epi: (
            generate_depthwise_conv2d_nhwc_vec(n, c, h, w, oh, ow, k, stride, padding, dilation, out.dtype, epi)))


class DepthwiseConvRows(_DepthwiseNhwc):
    """NHWC depthwise conv, ``tw`` output pixels of a row x ``vec`` channels per thread, each input
    column loaded once per kernel row for all of them (``generate_depthwise_conv2d_nhwc_rows``)."""

    def __init__(self, node: fx.Node, out: torch.Tensor, k, stride, padding, dilation, vec: int, tw: int):
        self.label = f"depthwiseconv_rows_v{vec}w{tw}"
        super().__init__(f"dwr_{node.name}_v{vec}w{tw}", node, out, vec * out.dtype.itemsize,
                         lambda n, c, h, w, oh, ow, epi: generate_depthwise_conv2d_nhwc_rows(
                             n, c, h, w, oh, ow, k, stride, padding, dilation, out.dtype, epi, vec, tw))


def _ckk(w: torch.Tensor) -> bool:
    """A (C, 1, KH, KW) weight whose memory is (C, KH, KW) dense (contiguous or channels_last)."""
    c, _, kh, kw = w.shape
    return (w.stride(3) == 1 or kw == 1) and (w.stride(2) == kw or kh == 1) and (w.stride(0) == kh * kw or c == 1)


def _depthwise_spec(node: fx.Node) -> Optional[dict]:
    """What the depthwise kernels need of a fused_conv node: a plain depthwise 2-D conv (channel
    multiplier 1) in fp32/fp16/bf16 with static sizes, algorithm ``direct``, a kernel up to 7 and a
    stride up to 2, input and output in one layout; keys layout, out, k, stride, padding, dilation."""
    if node.op != "call_function" or node.target is not fused_conv_ref:
        return None
    x, w, out = node_val(node.args[0]), node_val(node.args[1]), node.meta.get("val")
    if x is None or w is None or out is None or x.dim() != 4 or out.dtype not in CONV_DTYPES:
        return None  # only 2-D convolutions in fp32/fp16/bf16
    if not all(isinstance(d, int) for d in (*x.shape[1:], *w.shape, *out.shape[1:])):
        return None  # symbolic sizes
    groups, algorithm = node.args[7], node.args[10]
    if algorithm != "direct" or not isinstance(groups, int) or w.shape[1] != 1:
        return None  # not a plain depthwise conv
    if not (groups == x.shape[1] == w.shape[0] == out.shape[1]):
        return None  # channel multiplier != 1
    k, stride, padding, dilation = ints(w.shape[2:]), ints(node.args[4]), ints(node.args[5]), ints(node.args[6])
    if None in (k, stride, padding, dilation) or max(k) > 7 or max(stride) > 2:
        return None  # outside the templates' range
    layout = layout_name(out)
    if layout is None or layout_name(x) != layout:
        return None
    for t in (node.args[2], node.args[3]):
        if t is not None and (node_val(t) is None or node_val(t).dtype != out.dtype):
            return None
    return {"layout": layout, "out": out, "k": k, "stride": stride, "padding": padding, "dilation": dilation}


def plan_depthwise(node: fx.Node) -> Optional[DepthwiseConv]:
    d = _depthwise_spec(node)
    if d is None:
        return None
    return DepthwiseConv(node, d["layout"], d["out"], d["k"], d["stride"], d["padding"], d["dilation"])


def _depthwise_nhwc_spec(node: fx.Node) -> Optional[dict]:
    """``_depthwise_spec`` where the layout is channels_last, the channels a multiple of a 16-byte
    vector and the batch static (the vectorized kernels' domain)."""
    d = _depthwise_spec(node)
    if d is None or d["layout"] != "nhwc":
        return None
    x, out = node_val(node.args[0]), d["out"]
    if x.shape[1] % (16 // out.dtype.itemsize) or not isinstance(x.shape[0], int):
        return None
    return d


def plan_depthwise_vec(node: fx.Node) -> Optional[DepthwiseConvVec]:
    """The vectorized NHWC variant of a depthwise conv (``_depthwise_nhwc_spec``)."""
    d = _depthwise_nhwc_spec(node)
    if d is None:
        return None
    return DepthwiseConvVec(node, d["out"], d["k"], d["stride"], d["padding"], d["dilation"])


def plan_depthwise_rows(node: fx.Node) -> list[DepthwiseConvRows]:
    """Row-tiled variants of a vectorized NHWC depthwise conv, where its one-pixel kernel would have
    threads to spare (``MANY_THREADS``): 8-byte channel vectors for 4 and for 8 pixels per thread, and
    4-byte ones for 8 pixels (wide, small images: more threads). 16-byte vectors, with twice the
    registers per thread, were slower than these on every conv measured. [] elsewhere (at small sizes
    the one-pixel kernel's parallelism wins, and each variant costs a compilation and a measurement)."""
    d = _depthwise_nhwc_spec(node)
    if d is None:
        return []
    out = d["out"]
    n, c, oh, ow = (int(s) for s in out.shape)
    full = 16 // out.dtype.itemsize
    if n * oh * ow * c // full < 2 * MANY_THREADS or ow < 4:
        return []
    return [DepthwiseConvRows(node, out, d["k"], d["stride"], d["padding"], d["dilation"], v, tw)
            for v, tw in ((full // 2, 4), (full // 2, 8), (full // 4, 8))]
