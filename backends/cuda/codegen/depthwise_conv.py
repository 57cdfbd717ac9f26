"""Source of the row-tiled depthwise convolution kernel for channels_last tensors
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
``schedule/conv.py`` (``plan_depthwise_rows``).
"""
from __future__ import annotations

import torch

from . import Epilogue, KernelSource, _idx, _pair, _uname, needs_index64
from .templates import ctype, load, prelude

_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_MAX_BLOCKS = 65535
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
                                        epilogue: Epilogue | None = None, vec: int = 4, tw: int = 4,
                                        block: int = 256) -> KernelSource:
    """Depthwise conv on NHWC tensors (x (n, c, h, w) -> y (n, c, oh, ow), weight (C, 1, KH, KW) read as
    (C, KH, KW)), ``tw`` output pixels along a row x ``vec`` channels per thread. ``vec`` (a power of
    two) must divide ``c`` and make a load of 4 to 16 bytes. Requires x, y and residual channels_last,
    dense and aligned to ``vec`` elements (checked by the caller). Launch args: x, w, [bias], [res],
    y; grid and block in ``meta``."""
    (KH, KW), (SH, SW), (PH, PW), (DH, DW) = _pair(k), _pair(stride), _pair(padding), _pair(dilation)
    nbytes = vec * dtype.itemsize
    if vec < 1 or vec & (vec - 1) or c % vec or not 4 <= nbytes <= 16:
        raise ValueError(f"depthwise conv (rows): {vec} channels per thread must divide {c} and load 4-16 bytes")
    if not 1 <= tw <= 16:
        raise ValueError(f"depthwise conv (rows): {tw} pixels per thread (1..16)")
    T, epi = ctype(dtype), epilogue or Epilogue()
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
    name = _uname(f"fx_dwr{KH}x{KW}_s{SH}x{SW}_{_SHORT[dtype]}_nhwc_v{vec}w{tw}", n, c, h, w, oh, ow, KH, KW, SH,
                  SW, PH, PW, DH, DW, epi, vec, tw, block, index64)
    src = load("depthwise_conv2d_nhwc_rows.cu").substitute(
        prelude=prelude({dtype}), KH=KH, KW=KW, KK=KH * KW, SH=SH, SW=SW, PH=PH, PW=PW, DH=DH, DW=DW, VEC=vec,
        TW=tw, CG=cg, S=stride_s, TC=tc, TP=tp, C=c, H=h, W=w, OH=oh, OW=ow, OWT=owt, TILES=tiles, COLS=len(taps),
        block=block, name=name, T=T, idx=_idx(index64), extra_params=epi.params(T), epi_desc=epi.describe(),
        load_weights=_load_weights(vec), columns=_columns(taps, vec, T, w, c),
        epilogue=epi.code(" " * 8, "fx_to_f32(bias[c])", "fx_to_f32(res[o])"))
    params = [("x", f"const {T}*"), ("w", f"const {T}*")]
    params += [("bias", f"const {T}*")] * epi.bias + [("res", f"const {T}*")] * epi.residual + [("y", f"{T}*")]
    grid = (max(1, min(-(-tiles // tp), _MAX_BLOCKS)), c // cg, 1)
    meta = {"layout": "nhwc", "k": (KH, KW), "stride": (SH, SW), "padding": (PH, PW), "dilation": (DH, DW),
            "epilogue": epi, "vec": vec, "tw": tw, "grid": grid, "shape": (n, c, h, w, oh, ow)}
    return KernelSource(name, src, tuple(params), "depthwise_conv2d_nhwc_rows", meta, (block, 1, 1), index64)
