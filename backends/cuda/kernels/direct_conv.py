"""The direct-conv family: convs with a small reduction (C_in <= 16, C_out <= 128, C_in*KH*KW <= 512,
groups 1: stems and small CNNs; wider convs are GEMMs that cuDNN runs better), algorithm ``direct`` or
one chosen automatically: ``plan_direct_conv`` -> ``DirectConv`` (two output-channel tilings, and with
few output pixels the smallest one with each output's input channels split over 2-8 lanes), and
``plan_conv_maxpool``: such a conv with the max pool that alone reads it, as one kernel (measured
against the pair as chosen separately, ``conv_maxpool_chain``, by ``runtime/groups.py``).

Source of the direct convolution kernel for convs with a small reduction (C_in x KH x KW),
optionally with the following max pool fused in (``generate_direct_conv2d``).

One thread per output pixel (per pooled pixel: it evaluates the conv at every position of the pool
window and keeps the max) computes ``pool(act(conv(x, w) + bias (+ residual)))`` for a tile of
output channels whose weights sit in shared memory, and writes only the final tensor. NCHW or
NHWC, fp32/fp16/bf16 with fp32 accumulation, weights (C_out, C_in, KH, KW) or channels_last
(C_out, KH, KW, C_in). Which convolutions get it: ``plan_direct_conv``; launching it:
``launch_direct_conv2d``.
"""
from __future__ import annotations

import operator
from string import Template
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen.c import ctype, prelude
from fxopt.backends.cuda.codegen.epilogue import (NO_EPILOGUE, epilogue_code, epilogue_desc, epilogue_key,
                                                  epilogue_params, has_bias, has_residual)
from fxopt.backends.cuda.codegen.source import KernelSource, index_type, checked_layout, int_pair, unique_name, layout_name, needs_index64
from fxopt.backends.cuda.kernels.common import NodeGroup, compiled_kernel, dense_strides, ints, load, memory_layout_ok, node_val, weight_fits, weight_layout_of
from fxopt.backends.cuda.kernels.conv import conv_args, check_conv_args
from fxopt.backends.cuda.kernels.pool import pool2d_output_size

aten = torch.ops.aten


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
MAX_REDUCTION = 512  # C_in * KH * KW
MAX_CIN, MAX_COUT = 16, 128  # stems and small CNNs; wider convs are GEMMs that cuDNN runs better
SMEM_FLOATS = 12288  # 48 KiB of weights per block
#: multiply-adds a thread's fully unrolled reduction holds (tile x C_in x KH x KW): beyond this NVRTC
#: takes seconds per kernel (a 7x7 stem: ~9 s with 16 channels per block, ~2.5 s with 8) for no measured gain
MAX_UNROLLED = 600
_MAX_GRID = 65535


def cout_tile(pixels: int, cout: int, reduction: int) -> int:
    """Output channels per block: all of them (each input value read once per pixel) unless that
    leaves too few threads to fill the GPU, at most 16 (registers), weights within shared memory and
    the unrolled reduction within ``MAX_UNROLLED``."""
    tile = min(cout, 16)
    while tile > 1 and (pixels * -(-cout // tile) < (1 << 17) or tile * reduction > min(SMEM_FLOATS, MAX_UNROLLED)):
        tile = -(-tile // 2)
    return tile


def _x_at(layout: str, CI: int) -> str:
    return f"((n * {CI} + ci) * H + ih) * W + iw" if layout == "nchw" else f"((n * H + ih) * W + iw) * {CI} + ci"


def _split_code(split: int, values: list[str]) -> dict:
    """Template pieces for ``split`` lanes per output (1: one thread per output). The lanes of a
    group are consecutive in a warp; each sums its share of the input channels, then xor shuffles
    within the group give every lane the total, and lane 0 of the group stores."""
    if split == 1:
        return {"split_setup": "  const idx_t first = (idx_t)blockIdx.x * blockDim.x + threadIdx.x;\n"
                               "  const idx_t step = (idx_t)gridDim.x * blockDim.x;",
                "store_guard": "", "ci0": "0", "cistep": "1", "reduce": "", "split_desc": ""}
    shuffles = [f"{v} += __shfl_xor_sync(group, {v}, o, {split});" for v in values]
    reduce = "\n".join(["#pragma unroll", f"    for (int o = {split // 2}; o > 0; o >>= 1) {{"]
                       + [f"      {line}" for line in shuffles] + ["    }"])
    return {"split_setup": "\n".join([
                f"  const int s = (int)(threadIdx.x % {split});  // this lane's share of the input channels",
                f"  const unsigned group = ((1u << {split}) - 1u) << ((threadIdx.x & 31u) & ~{split - 1}u);",
                f"  const idx_t first = ((idx_t)blockIdx.x * blockDim.x + threadIdx.x) / {split};",
                f"  const idx_t step = (idx_t)gridDim.x * blockDim.x / {split};"]),
            "store_guard": " && s == 0", "ci0": "s", "cistep": str(split), "reduce": reduce,
            "split_desc": f" Each output's input channels are split over {split} lanes (a small batch's latency)."}


def split_lanes(cin: int) -> int:
    """Lanes per output of the split variant: the power of two covering C_in, at most 8."""
    return min(8, 1 << max(0, int(cin) - 1).bit_length())


def _loops(layout: str, CI: int, KH: int, KW: int, DH: int, DW: int, COT: int, CIKK: int,
           split: int = 1) -> str:
    """The reduction loop nest: over C_in outermost for NCHW, innermost for NHWC (contiguous reads);
    with ``split`` lanes per output, lane ``s`` of the group takes input channels s, s + split, ..."""
    ci_loop = [f"for (int ci = {'s' if split > 1 else 0}; ci < {CI}; ci += {split}) {{"]
    kh_loop = ["#pragma unroll", f"for (int kh = 0; kh < {KH}; ++kh) {{",
               f"  const int ih = hs + kh * {DH};", "  if (ih < 0 || ih >= H) continue;"]
    kw_loop = ["#pragma unroll", f"for (int kw = 0; kw < {KW}; ++kw) {{",
               f"  const int iw = wsx + kw * {DW};", "  if (iw < 0 || iw >= W) continue;"]
    body = [f"const float xv = fx_to_f32(x[{_x_at(layout, CI)}]);",
            f"const float* wr = ws + (ci * {KH} + kh) * {KW} + kw;",
            "#pragma unroll", f"for (int j = 0; j < {COT}; ++j) sum[j] += xv * wr[j * {CIKK}];"]
    nest = [ci_loop, kh_loop, kw_loop] if layout == "nchw" else [kh_loop, kw_loop, ci_loop]
    lines, depth = [], 0
    for loop in nest:
        lines += ["  " * depth + ln for ln in loop]
        depth += 1
    lines += ["  " * depth + ln for ln in body]
    lines += ["  " * d + "}" for d in range(depth - 1, -1, -1)]
    return "\n".join(" " * 8 + ln for ln in lines)


#: a pool-window patch of at most this many values per input channel is held in registers
MAX_PATCH = 64


def generate_direct_conv2d(cin: int, cout: int, k, stride=1, padding=0, dilation=1,
                           dtype: torch.dtype = torch.float32, layout: str = "nchw",
                           epilogue=None, weight_layout: str = "oihw",
                           pool: Optional[tuple] = None, cout_tile_: int | None = None,
                           index64: bool = False, block: int = 128, split: int = 1) -> KernelSource:
    """Launch args: x, w, [bias], [res], y, N, H, W, CH, CW, OH, OW (CH, CW: conv output size;
    OH, OW: final output size, = CH, CW without pool). ``pool``: (k, stride, padding) of a max
    pool applied after the epilogue. ``split`` (1, 2, 4 or 8): lanes per output sharing its input
    channels. Grid: (pixel blocks, ceil(C_out / tile)), see launch."""
    (KH, KW), (SH, SW), (PH, PW), (DH, DW) = int_pair(k), int_pair(stride), int_pair(padding), int_pair(dilation)
    CI, CO, CIKK = int(cin), int(cout), int(cin) * KH * KW
    if min(CI, CO, KH, KW, SH, SW, DH, DW) < 1 or min(PH, PW) < 0:
        raise ValueError("direct conv: sizes must be positive, padding >= 0")
    if CIKK > MAX_REDUCTION:
        raise ValueError(f"direct conv: C_in*KH*KW = {CIKK} > {MAX_REDUCTION}")
    if weight_layout not in ("oihw", "ohwi"):
        raise ValueError(f"direct conv: weight_layout must be 'oihw' or 'ohwi', not {weight_layout!r}")
    lay, ct, epi = checked_layout(layout), ctype(dtype), NO_EPILOGUE if epilogue is None else epilogue
    COT = int(cout_tile_ or min(CO, 16))
    if COT * CIKK > SMEM_FLOATS or not 1 <= COT <= 16:
        raise ValueError(f"direct conv: tile of {COT} output channels does not fit")
    (PKH, PKW), (PSH, PSW), (PPH, PPW) = ((1, 1), (1, 1), (0, 0)) if pool is None else (
        int_pair(pool[0]), int_pair(pool[1]), int_pair(pool[2]))
    if pool is not None and (has_residual(epi) or PPH > PKH // 2 or PPW > PKW // 2):
        raise ValueError("direct conv + max pool: no residual, pool padding <= half the window")
    if split not in (1, 2, 4, 8):
        raise ValueError(f"direct conv: split {split} must be 1, 2, 4 or 8 lanes")
    name = unique_name(f"fx_dconv{KH}x{KW}_c{CI}x{CO}_{_SHORT[dtype]}_{lay}" + ("_maxpool" if pool else "")
                  + (f"_split{split}" if split > 1 else ""),
                  CI, CO, KH, KW, SH, SW, PH, PW, DH, DW, epilogue_key(epi), weight_layout, pool, COT, index64, block, split)
    out_at = ("((n * $CO + co) * OH + oh) * OW + ow" if lay == "nchw"
              else "((n * OH + oh) * OW + ow) * $CO + co").replace("$CO", str(CO))
    res_at = ("((n * $CO + co) * CH + ch) * CW + cw" if lay == "nchw"
              else "((n * CH + ch) * CW + cw) * $CO + co").replace("$CO", str(CO))
    w_at = ("(idx_t)co * $CIKK + r" if weight_layout == "oihw"
            else "((idx_t)co * $KK + r % $KK) * $CI + r / $KK")
    w_at = w_at.replace("$CIKK", str(CIKK)).replace("$KK", str(KH * KW)).replace("$CI", str(CI))
    pool_desc = "no pool" if pool is None else f"max pool {PKH}x{PKW} stride ({PSH}, {PSW}) padding ({PPH}, {PPW})"
    patch = ((PKH - 1) * SH + (KH - 1) * DH + 1) * ((PKW - 1) * SW + (KW - 1) * DW + 1)
    pool_desc += ", input patch in registers" if pool is not None and patch <= MAX_PATCH else ""
    epilogue = epilogue_code(epi, " " * 10, "fx_to_f32(bias[co])", f"fx_to_f32(res[{res_at}])")
    # a pool window whose input patch fits in registers loads it once per input channel
    body = "direct_conv2d_patch.cu" if pool is not None and patch <= MAX_PATCH else "direct_conv2d_window.cu"
    patch_values = [f"sum[{a}][{b}][{j}]" for a in range(PKH) for b in range(PKW) for j in range(COT)]
    sp = _split_code(split, patch_values if body == "direct_conv2d_patch.cu" else [f"sum[{j}]" for j in range(COT)])
    src = Template(load("direct_conv2d.cu").safe_substitute(body=load(body).template)).substitute(
        R=(PKH - 1) * SH + (KH - 1) * DH + 1, C=(PKW - 1) * SW + (KW - 1) * DW + 1,
        x_at=_x_at(lay, CI), split_desc=sp["split_desc"], split_setup=sp["split_setup"],
        store_guard=sp["store_guard"], ci0=sp["ci0"], cistep=sp["cistep"],
        reduce_patch=sp["reduce"] if body == "direct_conv2d_patch.cu" else "",
        reduce_window=sp["reduce"].replace("\n", "\n    ") if body != "direct_conv2d_patch.cu" else "",
        prelude=prelude({dtype}), KH=KH, KW=KW, CI=CI, CO=CO, COT=COT, CIKK=CIKK, SH=SH, SW=SW, PH=PH, PW=PW,
        DH=DH, DW=DW, layout=lay, weight_layout=weight_layout, epi_desc=epilogue_desc(epi), pool_desc=pool_desc,
        block=block, name=name, T=ct, extra_params=epilogue_params(epi, ct), idx=index_type(index64), w_at=w_at,
        best_init="(-__int_as_float(0x7f800000))" if pool else "0.f",
        PKH=PKH, PKW=PKW, PSH=PSH, PSW=PSW, PPH=PPH, PPW=PPW,
        loops=_loops(lay, CI, KH, KW, DH, DW, COT, CIKK, split),
        epilogue=epilogue,
        combine="if (acc > best[j] || acc != acc) best[j] = acc;" if pool else "best[j] = acc;",
        out_at=out_at)
    params = [("x", f"const {ct}*"), ("w", f"const {ct}*")]
    params += [("bias", f"const {ct}*")] * has_bias(epi) + [("res", f"const {ct}*")] * has_residual(epi)
    params += [("y", f"{ct}*")] + [(n, "long long") for n in ("N", "H", "W", "CH", "CW", "OH", "OW")]
    meta = {"layout": lay, "cin": CI, "cout": CO, "k": (KH, KW), "stride": (SH, SW), "padding": (PH, PW),
            "dilation": (DH, DW), "epilogue": epi, "weight_layout": weight_layout, "pool": pool,
            "cout_tile": COT, "split": split}
    return KernelSource(name, src, tuple(params), "direct_conv2d", meta, (block, 1, 1), index64)


_MAX_GRID_Y = 65535


def launch_direct_conv2d(ks: KernelSource, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                         bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                         conv_size: tuple | None = None, kernel=None) -> torch.Tensor:
    """``out``: the final (pooled) output; ``conv_size``: (CH, CW) before the pool (default:
    out's size)."""
    m = ks.meta
    check_conv_args(ks, x, out, bias, residual)
    if tuple(w.shape) != (m["cout"], m["cin"], *m["k"]) or not weight_fits(w, m["weight_layout"]):
        raise ValueError(f"{ks.name}: weight {tuple(w.shape)} / strides {w.stride()} do not match the kernel")
    if x.shape[1] != m["cin"] or out.shape[1] != m["cout"]:
        raise ValueError(f"{ks.name}: channels {x.shape[1]} -> {out.shape[1]}, kernel {m['cin']} -> {m['cout']}")
    N, _, H, W = x.shape
    OH, OW = out.shape[2:]
    CH, CW = conv_size or (OH, OW)
    if out.numel() == 0:
        return out
    if not ks.index64 and needs_index64(max(x.numel(), out.numel(), N * CH * CW * m["cout"])):
        raise ValueError(f"{ks.name}: tensors need index64=True")
    threads = N * OH * OW * m["split"]  # split: lanes per output
    grid = (min(-(-threads // ks.block[0]), _MAX_GRID_Y), -(-m["cout"] // m["cout_tile"]), 1)
    args = [x, w] + [t for t in (bias, residual) if t is not None] + [out, N, H, W, CH, CW, OH, OW]
    compiled_kernel(ks, kernel).launch(grid, ks.block, args)
    return out


#: outputs (batch x pixels) up to which the split-channel variant is measured too: beyond, the grid
#: has enough threads to hide a thread's serial reduction, and the variant costs compile time
FEW_PIXELS = 1 << 14


def _conv_spec(node: fx.Node) -> Optional[dict]:
    """What the template needs of a fused_conv node, or None where it does not apply."""
    c = conv_args(node)
    if c is None or c["groups"] != 1:
        return None  # see conv_args; or grouped
    x, w, out, k = c["x"], c["w"], c["out"], c["k"]
    cin, cout = int(w.shape[1]), int(w.shape[0])
    if cin * k[0] * k[1] > MAX_REDUCTION or cin > MAX_CIN or cout > MAX_COUT:
        return None  # a wide conv: a GEMM that cuDNN runs better (and measuring it costs compile time)
    layout, wl = layout_name(out), weight_layout_of(w)
    if layout is None or layout_name(x) != layout or wl is None:
        return None
    return {"cin": cin, "cout": cout, "k": k, "stride": c["stride"], "padding": c["padding"],
            "dilation": c["dilation"], "layout": layout, "weight_layout": wl, "dtype": out.dtype,
            "x_shape": tuple(x.shape[1:]), "epilogue": c["epilogue"]}


class DirectConv:
    """Candidate for a fused_conv node (same signature); ``pool`` set: for the conv + max pool
    composite (``conv_maxpool_chain`` signature)."""

    def __init__(self, name: str, spec: dict, conv_size: tuple, tile: int, pool: Optional[tuple] = None,
                 split: int = 1):
        lanes = f"_split{split}" if split > 1 else ""
        self.name, self.spec, self.pool = f"{name}_t{tile}{lanes}", spec, pool
        self.label = f"directconv{'_maxpool' if pool else ''}_t{tile}{lanes}"
        self.conv_size = tuple(int(d) for d in conv_size)
        self.sources = {0: generate_direct_conv2d(
            spec["cin"], spec["cout"], spec["k"], spec["stride"], spec["padding"], spec["dilation"], spec["dtype"],
            spec["layout"], spec["epilogue"], spec["weight_layout"], pool, tile, split=split)}
        self.kernels: dict = {}

    def run(self, x, weight, bias, residual):
        s, ks, kernel = self.spec, self.sources[0], self.kernels.get(0)
        if kernel is None or not x.is_cuda or tuple(x.shape[1:]) != s["x_shape"] or x.dtype != s["dtype"]:
            return None
        if (not memory_layout_ok(x, s["layout"]) or weight.dtype != x.dtype
                or not weight_fits(weight, s["weight_layout"])):
            return None
        if (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous())) or (
                residual is not None and not memory_layout_ok(residual, s["layout"])):
            return None
        ch, cw = self.conv_size
        oh, ow = (ch, cw) if self.pool is None else pool2d_output_size(ch, cw, *self.pool[:3], self.pool[3])
        shape = (x.shape[0], s["cout"], oh, ow)
        out = torch.empty_strided(shape, dense_strides(s["layout"], shape), dtype=x.dtype, device=x.device)
        if needs_index64(max(x.numel(), out.numel(), x.shape[0] * s["cout"] * ch * cw)):
            return None
        return launch_direct_conv2d(ks, x, weight, out, bias, residual, (ch, cw), kernel)

    def __call__(self, x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None, *pool_args):
        return self.run(x, weight, bias, residual)


def _tiles(spec: dict, out: torch.Tensor) -> list[int]:
    """Two tile sizes to measure: the heuristic's (enough threads) and all channels (up to 16, as
    long as the unrolled reduction stays within ``MAX_UNROLLED``)."""
    n, _, oh, ow = (int(d) for d in out.shape)
    reduction = spec["cin"] * spec["k"][0] * spec["k"][1]
    full = min(spec["cout"], 16)
    while full > 1 and full * reduction > min(SMEM_FLOATS, MAX_UNROLLED):
        full = -(-full // 2)
    return sorted({cout_tile(n * oh * ow, spec["cout"], reduction), full})


def _variants(spec: dict, out: torch.Tensor) -> list[tuple[int, int]]:
    """(tile, split) candidates: each tile of ``_tiles``; with few output pixels (a small batch: a
    thread's serial reduction is the time) the smallest tile (most threads) also with its input
    channels split over ``split_lanes`` lanes."""
    tiles = _tiles(spec, out)
    n, _, oh, ow = (int(d) for d in out.shape)
    split = split_lanes(spec["cin"]) if n * oh * ow <= FEW_PIXELS else 1
    return [(t, 1) for t in tiles] + [(tiles[0], split)] * (split > 1)


def plan_direct_conv(node: fx.Node) -> list[DirectConv]:
    """Direct-conv candidates (the variants of ``_variants``) for a fused_conv node; [] where none applies."""
    spec = _conv_spec(node)
    if spec is None:
        return []
    out = node.meta["val"]
    return [DirectConv(f"dconv_{node.name}", spec, out.shape[2:], t, split=sp) for t, sp in _variants(spec, out)]


def pool_params(node: fx.Node) -> Optional[tuple]:
    """(k, stride, padding, ceil_mode) of a max_pool2d_with_indices node whose indices are unused
    and whose dilation is 1, else None."""
    if node.op != "call_function" or node.target is not aten.max_pool2d_with_indices.default:
        return None
    if not node.users or any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        return None  # the indices are used
    args = list(node.args) + [None] * (6 - len(node.args))
    k = ints(args[1])
    stride = ints(args[2]) if args[2] else k
    padding = ints(args[3] if args[3] is not None else 0)
    dilation = ints(args[4] if args[4] is not None else 1)
    if None in (k, stride, padding) or dilation != (1, 1):
        return None
    if padding[0] > k[0] // 2 or padding[1] > k[1] // 2:
        return None  # eager raises; let it
    return k, stride, padding, bool(args[5]) if args[5] is not None else False


def conv_maxpool_chain(conv_impl, pool_impl):
    """The reference of the fused pair: the conv and the pool as the executor chose them."""
    def chain(x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
              algorithm, prepacked, kernel_size, pool_stride, pool_padding, pool_dilation, ceil_mode):
        y = conv_impl(x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                      algorithm, prepacked)
        return pool_impl(y, kernel_size, pool_stride, pool_padding, pool_dilation, ceil_mode)[0]

    chain.__name__ = "conv_maxpool_chain"
    return chain


def plan_conv_maxpool(pool: fx.Node) -> Optional[tuple[fx.Node, list[DirectConv]]]:
    """(conv node, fused candidates) for a max pool fed by an eligible conv used only there."""
    pp = pool_params(pool)
    conv = pool.args[0] if pp is not None else None
    if not isinstance(conv, fx.Node) or len(conv.users) != 1:
        return None
    spec = _conv_spec(conv)
    if spec is None or has_residual(spec["epilogue"]):
        return None
    out = node_val(pool)
    out = out[0] if isinstance(out, (tuple, list)) else None
    if out is None or out.dtype != spec["dtype"]:
        return None
    conv_size = conv.meta["val"].shape[2:]
    return conv, [DirectConv(f"dconv_pool_{conv.name}", spec, conv_size, t, pool=pp, split=sp)
                  for t, sp in _variants(spec, out)]


class ConvMaxpool(NodeGroup):
    """A conv and the max pool that alone reads it, measured as one ``DirectConv`` with the pool
    (``conv_maxpool_chain``: the pair as chosen separately, is the reference). The pool and its
    items stay out of the fusion scheduler; the pool's values are the group's output."""

    kind = "conv_maxpool"

    def __init__(self, conv: fx.Node, pool: fx.Node, candidates: list):
        super().__init__([conv, pool], candidates)
        self.keep_out = frozenset({pool, *pool.users})

    def reference(self):
        conv, pool = self.nodes
        return conv_maxpool_chain(conv.target, pool.target)

    def args(self) -> tuple:
        conv, pool = self.nodes
        a = list(pool.args) + [None] * (6 - len(pool.args))  # max_pool2d_with_indices' defaults filled in
        pool_args = (a[1], a[2] or a[1], a[3] if a[3] is not None else 0, a[4] if a[4] is not None else 1,
                     bool(a[5]))
        return tuple(conv.args) + (None,) * (12 - len(conv.args)) + pool_args

    def meta(self) -> dict:
        pool = self.nodes[1]
        return dict(pool.meta, val=pool.meta["val"][0])

    def replace(self, gm: fx.GraphModule, node: fx.Node) -> None:
        conv, pool = self.nodes
        for user in list(pool.users):  # getitem(pool, 0): the values
            user.replace_all_uses_with(node)
            gm.graph.erase_node(user)
        gm.graph.erase_node(pool)
        gm.graph.erase_node(conv)


def plan_conv_maxpool_groups(graph: fx.Graph) -> list[ConvMaxpool]:
    """Every conv + max pool pair of ``graph`` that ``plan_conv_maxpool`` takes."""
    out = []
    for node in graph.nodes:
        pair = plan_conv_maxpool(node)
        if pair is not None:
            out.append(ConvMaxpool(pair[0], node, pair[1]))
    return out
