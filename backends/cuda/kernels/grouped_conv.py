"""The grouped-conv family (a grouped conv, not depthwise, on channels_last tensors, algorithm
``direct`` or chosen automatically): ``plan_grouped_conv`` -> ``GroupedConv``, one direct kernel per
conv with the epilogue fused. For some group widths cuDNN runs a grouped conv as transforms around its
GEMM (RegNet's 24 channels per group: seven kernels).

Source of the direct grouped convolution kernel for channels_last tensors
(``generate_grouped_conv2d_nhwc``).

Why: for some group widths (RegNet's 24 channels per group, for one) cuDNN runs a grouped conv as
transforms of the input, the weight and the output around its GEMM, each with a memset: seven
kernels where one would do, and most of the conv's time. A grouped conv's reduction is short
(C_in / groups x KH x KW: 216 for RegNet's 3x3 convs) and every output channel reads only its own
group, so a direct kernel computes it in one pass.

What it generates: each thread computes one or two output pixels (``ppt``) for ``cot`` consecutive
output channels of one group, reading the pixel's input window of that group in vectors of up to 16 bytes (the threads
of a pixel read the same addresses: one transaction) and the weights from shared memory, where the
block's ``ct`` output channels are staged as ``ws[(tap * CGI + ci) * CT + channel]`` so that a
thread's ``cot`` weights of one input value are one to four 16-byte reads, used for each of its
pixels. The epilogue (bias,
residual, activation) is applied in registers and the ``cot`` outputs stored as one vector. fp32
accumulation for every dtype; every size compiled in. Which convolutions get it and the variants
measured: ``plan_grouped_conv`` below.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen.c import ctype, prelude
from fxopt.backends.cuda.codegen.epilogue import (NO_EPILOGUE, epilogue_code, epilogue_desc, epilogue_key,
                                                  epilogue_params, has_bias, has_residual)
from fxopt.backends.cuda.codegen.source import KernelSource, index_type, int_pair, unique_name, layout_name, needs_index64
from fxopt.backends.cuda.kernels.common import TemplateCandidate, load, memory_layout_ok, weight_fits, weight_layout_of
from fxopt.backends.cuda.kernels.conv import MANY_THREADS, conv_args, launch_nhwc


_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
#: floats of weights a block stages (48 KiB of static shared memory)
SMEM_FLOATS = 12288
_MAX_BLOCKS = 65535


def input_vector(cgi: int, dtype: torch.dtype) -> int:
    """Input channels per load: the largest power of two up to 16 bytes that divides the group's
    input channels (so that every group's first channel is aligned)."""
    v = 16 // dtype.itemsize
    while v > 1 and cgi % v:
        v //= 2
    return v


def channel_tile(cgo: int, reduction: int, cot: int) -> int:
    """Output channels per block: the whole group where its weights fit in shared memory, else the
    largest multiple of ``cot`` dividing the group's channels that fits (0: none does)."""
    for ct in range(cgo, 0, -1):
        if cgo % ct == 0 and ct % cot == 0 and ct * reduction <= SMEM_FLOATS:
            return ct
    return 0


def _fma(cot: int, ct: int, ppt: int) -> str:
    """The multiply-adds of one input value per pixel (``xv[u]``) into ``sum[u][0..cot)``, the weights
    ``wc[0..cot)`` read once for all pixels, as float4 where the tile allows it (every thread's first
    weight 16-byte aligned)."""
    ind = " " * 12
    if cot % 4 == 0 and ct % 4 == 0:
        lines = []
        for q in range(cot // 4):
            lines.append(f"{ind}{{ const float4 w4 = *reinterpret_cast<const float4*>(wc + {4 * q});")
            lines += [f"{ind}  sum[{u}][{4 * q + i}] += xv[{u}] * w4.{'xyzw'[i]};"
                      for u in range(ppt) for i in range(4)]
            lines.append(f"{ind}}}")
        return "\n".join(lines)
    lines = []
    for j in range(cot):
        lines.append(f"{ind}{{ const float wj = wc[{j}];")
        lines += [f"{ind}  sum[{u}][{j}] += xv[{u}] * wj;" for u in range(ppt)]
        lines.append(f"{ind}}}")
    return "\n".join(lines)


def generate_grouped_conv2d_nhwc(n: int, cin: int, cout: int, groups: int, h: int, w: int, oh: int, ow: int,
                                 k, stride=1, padding=0, dilation=1, dtype: torch.dtype = torch.float16,
                                 epilogue=None, weight_layout: str = "oihw", cot: int = 8,
                                 ppt: int = 1, block: int = 256) -> KernelSource:
    """Grouped conv on NHWC tensors (x (n, cin, h, w) -> y (n, cout, oh, ow), weight
    (cout, cin / groups, KH, KW) in ``weight_layout`` "oihw" or channels_last "ohwi"), ``cot``
    (a power of two dividing cout / groups) output channels per thread, for ``ppt`` (1 or 2) output pixels
    (the weights read from shared memory once for both). Requires 16-byte aligned x,
    y and residual, channels_last and dense (checked by the caller). Launch args: x, w, [bias],
    [res], y; grid and block in ``meta``."""
    (KH, KW), (SH, SW), (PH, PW), (DH, DW) = int_pair(k), int_pair(stride), int_pair(padding), int_pair(dilation)
    if groups < 2 or cin % groups or cout % groups:
        raise ValueError(f"grouped conv: {cin} -> {cout} channels in {groups} groups")
    if weight_layout not in ("oihw", "ohwi"):
        raise ValueError(f"grouped conv: weight_layout must be 'oihw' or 'ohwi', not {weight_layout!r}")
    cgi, cgo = cin // groups, cout // groups
    if cot < 1 or cot & (cot - 1) or cgo % cot or cot > 16:
        raise ValueError(f"grouped conv: {cot} channels per thread must be a power of two <= 16 dividing {cgo}")
    if ppt not in (1, 2):
        raise ValueError(f"grouped conv: {ppt} pixels per thread (1 or 2)")
    red = cgi * KH * KW
    ct = channel_tile(cgo, red, cot)
    if not ct:
        raise ValueError(f"grouped conv: the weights of {cot} channels ({red} each) exceed shared memory")
    lay_ct, epi, vec = ctype(dtype), NO_EPILOGUE if epilogue is None else epilogue, input_vector(cgi, dtype)
    tc = ct // cot
    if tc > block:
        raise ValueError(f"grouped conv: {tc} threads per pixel exceed the block of {block}")
    tp = block // tc
    block = tc * tp
    pixels = n * oh * ow
    index64 = needs_index64(max(n * h * w * cin, pixels * cout))
    tag = f"t{cot}" + (f"p{ppt}" if ppt > 1 else "")
    name = unique_name(f"fx_gconv{KH}x{KW}_g{groups}_c{cgi}x{cgo}_{_SHORT[dtype]}_nhwc_{tag}", n, cin, cout, groups,
                  h, w, oh, ow, KH, KW, SH, SW, PH, PW, DH, DW, epilogue_key(epi), weight_layout, cot, ppt, block, index64)
    w_at = "(idx_t)(co0 + c) * $R + ci * $KK + kk" if weight_layout == "oihw" else "(idx_t)(co0 + c) * $R + r"
    w_at = w_at.replace("$R", str(red)).replace("$KK", str(KH * KW))
    src = load("grouped_conv2d_nhwc.cu").substitute(
        prelude=prelude({dtype}), KH=KH, KW=KW, SH=SH, SW=SW, PH=PH, PW=PW, DH=DH, DW=DW, G=groups, CGI=cgi,
        CGO=cgo, CIN=cin, COUT=cout, COT=cot, CT=ct, TC=tc, TP=tp, V=vec, R=red, H=h, W=w, OH=oh, OW=ow,
        PIXELS=pixels, block=block, name=name, T=lay_ct, idx=index_type(index64), extra_params=epilogue_params(epi, lay_ct),
        epi_desc=epilogue_desc(epi), w_at=w_at, fma=_fma(cot, ct, ppt), PPT=ppt,
        ci_unroll="" if cgi // vec <= 8 else "4",
        epilogue=epilogue_code(epi, " " * 6, "fx_to_f32(bias[c])", "fx_to_f32(res[o])"))
    params = [("x", f"const {lay_ct}*"), ("w", f"const {lay_ct}*")]
    params += [("bias", f"const {lay_ct}*")] * has_bias(epi) + [("res", f"const {lay_ct}*")] * has_residual(epi)
    params += [("y", f"{lay_ct}*")]
    grid = (max(1, min(-(-pixels // (tp * ppt)), _MAX_BLOCKS)), cout // ct, 1)
    meta = {"layout": "nhwc", "k": (KH, KW), "stride": (SH, SW), "padding": (PH, PW), "dilation": (DH, DW),
            "groups": groups, "epilogue": epi, "weight_layout": weight_layout, "cot": cot, "ppt": ppt, "cout_tile": ct,
            "vec": vec, "grid": grid, "shape": (n, cin, h, w, cout, oh, ow)}
    return KernelSource(name, src, tuple(params), "grouped_conv2d_nhwc", meta, (block, 1, 1), index64)


class GroupedConv(TemplateCandidate):
    """NHWC grouped conv with every size compiled in: one output pixel x ``cot`` channels of a group
    per thread, the block's weights in shared memory, the epilogue fused
    (``generate_grouped_conv2d_nhwc``)."""

    def __init__(self, node: fx.Node, spec: dict, cot: int, ppt: int = 1):
        tag = f"t{cot}" + (f"p{ppt}" if ppt > 1 else "")
        self.label = f"groupedconv_{tag}"
        self.spec = spec
        n, cin, h, w = spec["x_shape"]
        self.out_shape = spec["out_shape"]
        super().__init__(f"gconv_{node.name}_{tag}", generate_grouped_conv2d_nhwc(
            n, cin, spec["cout"], spec["groups"], h, w, self.out_shape[2], self.out_shape[3], spec["k"],
            spec["stride"], spec["padding"], spec["dilation"], spec["dtype"], spec["epilogue"],
            spec["weight_layout"], cot, ppt))

    def __call__(self, x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None):
        s, epi = self.spec, self.spec["epilogue"]
        if self.kernel is None or not x.is_cuda or tuple(x.shape) != s["x_shape"] or x.dtype != s["dtype"]:
            return None
        if not memory_layout_ok(x, "nhwc") or x.data_ptr() % 16 or weight.dtype != x.dtype:
            return None
        if tuple(weight.shape) != s["w_shape"] or not weight_fits(weight, s["weight_layout"]):
            return None
        return launch_nhwc(self, epi, self.out_shape, x, weight, bias, residual)


def _grouped_spec(node: fx.Node) -> Optional[dict]:
    """What ``GroupedConv`` needs of a fused_conv node, or None where it does not apply."""
    c = conv_args(node)
    if c is None:
        return None
    x, w, out, groups = c["x"], c["w"], c["out"], c["groups"]
    if not isinstance(groups, int) or groups < 2 or int(w.shape[1]) < 2:
        return None  # a dense conv, or a depthwise one (its own kernels)
    if layout_name(x) != "nhwc" or layout_name(out) != "nhwc" or weight_layout_of(w) is None:
        return None  # the kernel reads and writes channels_last tensors only
    return {"x_shape": tuple(int(d) for d in x.shape), "w_shape": tuple(int(d) for d in w.shape),
            "out_shape": tuple(int(d) for d in out.shape), "cout": int(w.shape[0]), "groups": groups,
            "k": c["k"], "stride": c["stride"], "padding": c["padding"], "dilation": c["dilation"],
            "dtype": out.dtype, "weight_layout": weight_layout_of(w), "epilogue": c["epilogue"]}


def plan_grouped_conv(node: fx.Node) -> list[GroupedConv]:
    """Grouped-conv candidates for a fused_conv node: ``cot`` = the largest power of two up to 8
    dividing the group's output channels, and half of it (twice the threads: small batches); with
    many threads also ``cot`` channels for two pixels per thread (each weight read from shared
    memory once for both). [] where none applies or one channel tile's weights exceed shared memory."""
    spec = _grouped_spec(node)
    if spec is None:
        return []
    cgo, red = spec["cout"] // spec["groups"], spec["w_shape"][1] * spec["k"][0] * spec["k"][1]
    cot = 8
    while cgo % cot:
        cot //= 2
    if not channel_tile(cgo, red, cot):
        return []
    n, _, oh, ow = spec["out_shape"]
    variants = [(cot, 1)] + [(cot // 2, 1)] * (cot > 1 and bool(channel_tile(cgo, red, cot // 2)))
    variants += [(cot, 2)] * (n * oh * ow * spec["cout"] // cot >= 2 * MANY_THREADS)
    return [GroupedConv(node, spec, c, p) for c, p in variants]
