"""Host-side glue for generated kernels: shape/layout checks, argument packing in the
order the generators document, vector-width selection, weight preparation and the
Winograd F(2x2,3x3) pipeline.  Everything up to ``CompiledKernel.launch`` is plain torch,
so the checks run (and are tested) without a GPU.  Empty outputs never launch.

Each ``launch_*`` takes the KernelSource and optionally its CompiledKernel (``kernel``);
without it ``ks.compile()`` is used (memoised by ``compiler.py``).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import torch
import torch.nn.functional as F

from fxopt.backends.cuda.codegen import KernelSource, PointwiseRegion, needs_index64, winograd_tiles
from fxopt.backends.cuda.codegen.templates import WINO_AT, WINO_BT, WINO_G

__all__ = [
    "memory_layout_ok", "pointwise_sizes", "vector_width_ok", "choose_vector_width",
    "launch_pointwise", "pool2d_output_size", "launch_pool2d", "launch_global_avgpool",
    "prepare_depthwise_weight", "check_conv_args", "launch_depthwise_conv2d", "winograd_filter_transform",
    "launch_winograd_input", "winograd_gemm", "launch_winograd_output", "winograd_conv2d",
    "winograd_conv2d_reference", "weight_layout_of", "weight_fits", "launch_direct_conv2d", "launch_linear",
]


def _kernel(ks: KernelSource, kernel):
    return kernel if kernel is not None else ks.compile()


def memory_layout_ok(t: torch.Tensor, layout: str) -> bool:
    """Dense in ``layout``: nchw = contiguous, nhwc = channels innermost (channels_last)."""
    if layout == "nchw" or t.dim() <= 2:
        return t.is_contiguous()
    return t.permute(0, *range(2, t.dim()), 1).is_contiguous()


def _check(t: torch.Tensor, layout: str, what: str, dtype=None) -> None:
    if not memory_layout_ok(t, layout):
        raise ValueError(f"{what}: expected a dense {layout} tensor, got strides {t.stride()}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{what}: expected {dtype}, got {t.dtype}")


def pointwise_sizes(shape) -> tuple[int, int, int]:
    """(numel, C, HW) of a logical (N, C, *spatial) shape."""
    shape = tuple(shape)
    return math.prod(shape), (shape[1] if len(shape) > 1 else 1), math.prod(shape[2:])


def vector_width_ok(region: PointwiseRegion, layout: str, vec: int, shape,
                    ptrs: Mapping[str, int], out_ptr: int) -> bool:
    """Whether a kernel generated with ``vector_width=vec`` may run on these tensors."""
    if vec == 1:
        return True
    _, C, HW = pointwise_sizes(shape)
    if out_ptr % min(16, vec * region.out_dtype.itemsize):
        return False
    for a in region.inputs:
        align = min(16, vec * a.dtype.itemsize)
        if a.broadcast == "full" and ptrs[a.name] % align:
            return False
        if a.broadcast == "channel":
            if layout == "nchw" and HW % vec:
                return False
            if layout == "nhwc" and (C % vec or ptrs[a.name] % align):
                return False
    return True


def choose_vector_width(region: PointwiseRegion, layout: str, tensors: Mapping[str, torch.Tensor],
                        out: torch.Tensor, widths=(8, 4, 2)) -> int:
    """Largest width giving at most 16-byte output vectors that the tensors allow (else 1)."""
    ptrs = {k: v.data_ptr() for k, v in tensors.items()}
    for vec in widths:
        if vec * region.out_dtype.itemsize <= 16 and vector_width_ok(
                region, layout, vec, out.shape, ptrs, out.data_ptr()):
            return vec
    return 1


def launch_pointwise(ks: KernelSource, tensors: Mapping[str, torch.Tensor], out: torch.Tensor,
                     kernel=None) -> torch.Tensor:
    region, layout, vec = ks.meta["region"], ks.meta["layout"], ks.meta["vec"]
    numel, C, HW = pointwise_sizes(out.shape)
    _check(out, layout, f"{region.name}: out", region.out_dtype)
    for a in region.inputs:
        t = tensors[a.name]
        if a.dtype != t.dtype:
            raise TypeError(f"{region.name}: {a.name} is {t.dtype}, kernel expects {a.dtype}")
        if a.broadcast == "full":
            if t.shape != out.shape:
                raise ValueError(f"{region.name}: {a.name} has shape {tuple(t.shape)}, out {tuple(out.shape)}")
            _check(t, layout, f"{region.name}: {a.name}")
        elif a.broadcast == "channel" and (t.numel() != C or not t.is_contiguous()):
            raise ValueError(f"{region.name}: channel input {a.name} must be a dense ({C},) vector")
        elif a.broadcast == "scalar" and t.numel() != 1:
            raise ValueError(f"{region.name}: scalar input {a.name} has {t.numel()} elements")
    if numel == 0:
        return out
    if not vector_width_ok(region, layout, vec, out.shape,
                           {k: v.data_ptr() for k, v in tensors.items()}, out.data_ptr()):
        raise ValueError(f"{ks.name}: tensors violate the vector-width-{vec} alignment contract")
    grid, block = ks.grid_block(numel)
    args = [tensors[a.name] for a in region.inputs] + [out, numel, C, HW]
    _kernel(ks, kernel).launch(grid, block, args)
    return out


def pool2d_output_size(H: int, W: int, k, stride=None, padding=0, ceil_mode: bool = False):
    """PyTorch's pooling output size (incl. ceil_mode's last-window rule)."""
    def one(n, k, s, p):
        o = (n + 2 * p - k + ((s - 1) if ceil_mode else 0)) // s + 1
        return o - 1 if ceil_mode and (o - 1) * s >= n + p else o
    kh, kw = (k, k) if isinstance(k, int) else k
    stride = k if stride is None else stride
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    return one(H, kh, sh, ph), one(W, kw, sw, pw)


def launch_pool2d(ks: KernelSource, x: torch.Tensor, out: torch.Tensor, kernel=None) -> torch.Tensor:
    lay = ks.meta["layout"]
    _check(x, lay, f"{ks.name}: x")
    _check(out, lay, f"{ks.name}: out", x.dtype)
    N, C, H, W = x.shape
    OH, OW = out.shape[2:]
    if out.numel() == 0:
        return out
    grid, block = ks.grid_block(out.numel(), extent=x.numel())
    _kernel(ks, kernel).launch(grid, block, [x, out, N, C, H, W, OH, OW])
    return out


def launch_global_avgpool(ks: KernelSource, x: torch.Tensor, out: torch.Tensor | None = None,
                          kernel=None) -> torch.Tensor:
    """(N, C, H, W) -> (N, C)."""
    _check(x, ks.meta["layout"], f"{ks.name}: x")
    N, C = x.shape[:2]
    HW = math.prod(x.shape[2:])
    out = torch.empty((N, C), dtype=x.dtype, device=x.device) if out is None else out
    if out.numel() == 0:
        return out
    grid, block = ks.grid_block(x.numel(), N=N, C=C)
    _kernel(ks, kernel).launch(grid, block, [x, out, N, C, HW])
    return out


def prepare_depthwise_weight(w: torch.Tensor, layout: str) -> torch.Tensor:
    """(C, 1, KH, KW) conv weight -> (C, KH, KW) for ckk kernels (the nchw default), (KH, KW, C)
    for kkc kernels (the nhwc default); ``layout`` is the kernel's layout or weight layout."""
    C, _, KH, KW = w.shape
    w = w.reshape(C, KH, KW)
    return (w if layout in ("nchw", "ckk") else w.permute(1, 2, 0)).contiguous()


def check_conv_args(ks: KernelSource, x: torch.Tensor, out: torch.Tensor, bias, residual) -> None:
    """What every generated convolution with a fused epilogue requires: x, out (and the residual)
    dense in the kernel's layout with one dtype; bias/residual given exactly when the epilogue has them."""
    lay, epi = ks.meta["layout"], ks.meta["epilogue"]
    _check(x, lay, f"{ks.name}: x")
    _check(out, lay, f"{ks.name}: out", x.dtype)
    if (bias is not None) != epi.bias or (residual is not None) != epi.residual:
        raise ValueError(f"{ks.name}: bias/residual do not match the kernel's epilogue {epi}")
    if residual is not None:
        _check(residual, lay, f"{ks.name}: residual", x.dtype)


def launch_depthwise_conv2d(ks: KernelSource, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                            bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                            kernel=None) -> torch.Tensor:
    """``w`` from prepare_depthwise_weight; bias/residual as the kernel's Epilogue requires."""
    check_conv_args(ks, x, out, bias, residual)
    N, C, H, W = x.shape
    OH, OW = out.shape[2:]
    if out.numel() == 0:
        return out
    args = [x, w] + [t for t in (bias, residual) if t is not None] + [out, N, C, H, W, OH, OW]
    grid, block = ks.grid_block(out.numel(), extent=x.numel())
    _kernel(ks, kernel).launch(grid, block, args)
    return out


def _mat(rows, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=like.dtype, device=like.device)


def winograd_filter_transform(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """U = G g G^T of a (K, C, 3, 3) weight, as a (16, K, C) tensor (index i*4+j)."""
    K, C = w.shape[:2]
    g = w.to(torch.float64)
    G = _mat(WINO_G, g)
    U = G @ g @ G.T  # K, C, 4, 4
    return U.permute(2, 3, 0, 1).reshape(16, K, C).to(dtype or w.dtype).contiguous()


def launch_winograd_input(ks: KernelSource, x: torch.Tensor, V: torch.Tensor | None = None,
                          dtype: torch.dtype | None = None, kernel=None) -> torch.Tensor:
    """V: (16, C, P) for nchw, (16, P, C) for nhwc, P = N * TH * TW."""
    lay = ks.meta["layout"]
    _check(x, lay, f"{ks.name}: x")
    N, C, H, W = x.shape
    _, _, TH, TW = winograd_tiles(H, W, ks.meta["padding"])
    P = N * TH * TW
    if V is None:
        shape = (16, C, P) if lay == "nchw" else (16, P, C)
        V = torch.empty(shape, dtype=dtype or x.dtype, device=x.device)
    if V.numel() == 0:
        return V
    grid, block = ks.grid_block(P * C, extent=max(x.numel(), V.numel()))
    _kernel(ks, kernel).launch(grid, block, [x, V, N, C, H, W, TH, TW])
    return V


def winograd_gemm(U: torch.Tensor, V: torch.Tensor, layout: str) -> torch.Tensor:
    """M[xi] = U[xi] @ V[xi]: (16, K, P) for nchw; (16, P, K) for nhwc."""
    return torch.bmm(U, V) if layout == "nchw" else torch.bmm(V, U.transpose(1, 2))


def launch_winograd_output(ks: KernelSource, M: torch.Tensor, out: torch.Tensor,
                           bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                           kernel=None) -> torch.Tensor:
    lay, epi = ks.meta["layout"], ks.meta["epilogue"]
    _check(out, lay, f"{ks.name}: out")
    if (bias is not None) != epi.bias or (residual is not None) != epi.residual:
        raise ValueError(f"{ks.name}: bias/residual do not match the kernel's epilogue {epi}")
    if residual is not None:
        _check(residual, lay, f"{ks.name}: residual", out.dtype)
    N, K, OH, OW = out.shape
    TH, TW = -(-OH // 2), -(-OW // 2)
    if out.numel() == 0:
        return out
    M = M.contiguous()
    args = [M] + [t for t in (bias, residual) if t is not None] + [out, N, K, OH, OW, TH, TW]
    grid, block = ks.grid_block(N * TH * TW * K, extent=max(M.numel(), out.numel()))
    _kernel(ks, kernel).launch(grid, block, args)
    return out


def winograd_conv2d(ks_in: KernelSource, ks_out: KernelSource, x: torch.Tensor, U: torch.Tensor,
                    bias=None, residual=None, out=None) -> torch.Tensor:
    """Full stride-1 3x3 conv: input transform kernel, torch.bmm, output transform kernel.
    ``U`` from winograd_filter_transform (in the transform dtype)."""
    N, C, H, W = x.shape
    OH, OW, _, _ = winograd_tiles(H, W, ks_in.meta["padding"])
    K = U.shape[1]
    if out is None:
        fmt = torch.channels_last if ks_out.meta["layout"] == "nhwc" else torch.contiguous_format
        out = torch.empty((N, K, OH, OW), dtype=x.dtype, device=x.device, memory_format=fmt)
    V = launch_winograd_input(ks_in, x, dtype=U.dtype)
    return launch_winograd_output(ks_out, winograd_gemm(U, V, ks_in.meta["layout"]), out, bias, residual)


def winograd_conv2d_reference(x: torch.Tensor, w: torch.Tensor, padding: int = 1) -> torch.Tensor:
    """Torch emulation of the F(2x2,3x3) pipeline (same matrices, tiles, zero padding)."""
    N, C, H, W = x.shape
    OH, OW, TH, TW = winograd_tiles(H, W, padding)
    xp = F.pad(x, (padding, padding + 2 * TW - OW, padding, padding + 2 * TH - OH))
    tiles = xp.unfold(2, 4, 2).unfold(3, 4, 2)  # N, C, TH, TW, 4, 4
    BT, AT = _mat(WINO_BT, x), _mat(WINO_AT, x)
    V = BT @ tiles @ BT.T
    U = winograd_filter_transform(w).to(x.dtype).reshape(4, 4, *w.shape[:2]).permute(2, 3, 0, 1)
    M = torch.einsum("nchwij,kcij->nkhwij", V, U)
    Y = AT @ M @ AT.T  # N, K, TH, TW, 2, 2
    return Y.permute(0, 1, 2, 4, 3, 5).reshape(N, -1, 2 * TH, 2 * TW)[:, :, :OH, :OW]


# ---------------------------------------------------------------------------- direct conv
_MAX_GRID_Y = 65535


def weight_layout_of(w: torch.Tensor) -> Optional[str]:
    """"oihw" (contiguous), "ohwi" (channels_last) or None for other strides."""
    if w.is_contiguous():
        return "oihw"
    if w.is_contiguous(memory_format=torch.channels_last):
        return "ohwi"
    return None


def weight_fits(w: torch.Tensor, weight_layout: str) -> bool:
    """The weight's memory is dense in the kernel's weight layout (a weight with 1x1 taps or one
    input channel is both)."""
    return w.is_contiguous(memory_format=torch.channels_last if weight_layout == "ohwi" else torch.contiguous_format)


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
    _kernel(ks, kernel).launch(grid, ks.block, args)
    return out


# ---------------------------------------------------------------------------- linear rows
_MAX_GRID = 2 ** 31 - 1


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.data_ptr() % nbytes == 0


def launch_linear(ks: KernelSource, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                  bias: torch.Tensor | None = None, kernel=None) -> torch.Tensor:
    """``out`` (M, N) = act(x @ w.T + bias); checks sizes, dtypes, contiguity and alignment."""
    m = ks.meta
    K, N, dt = m["k"], m["n"], m["dtype"]
    if x.dim() != 2 or x.shape[1] != K or tuple(w.shape) != (N, K) or tuple(out.shape) != (x.shape[0], N):
        raise ValueError(f"{ks.name}: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} "
                         f"do not match K={K}, N={N}")
    if x.shape[0] > m["rows"]:
        raise ValueError(f"{ks.name}: {x.shape[0]} rows, generated for at most {m['rows']}")
    if (bias is not None) != m["epilogue"].bias:
        raise ValueError(f"{ks.name}: bias {'missing' if bias is None else 'unexpected'}")
    tensors = [("x", x), ("w", w), ("out", out)] + ([("bias", bias)] if bias is not None else [])
    for what, t in tensors:
        if t.dtype != dt or not t.is_contiguous():
            raise ValueError(f"{ks.name}: {what} must be a contiguous {dt} tensor")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{ks.name}: bias of shape {tuple(bias.shape)}, expected ({N},)")
    vbytes = m["vec"] * x.element_size()
    if not (_aligned(x, vbytes) and _aligned(w, vbytes)):
        raise ValueError(f"{ks.name}: x and w must be {vbytes}-byte aligned")
    if out.numel() == 0:
        return out
    per_block = ks.block[0] // 32 * m["features_per_warp"]
    grid = (min(-(-N // per_block), _MAX_GRID), 1, 1)
    args = [x, w] + ([bias] if bias is not None else []) + [out, int(x.shape[0])]
    _kernel(ks, kernel).launch(grid, ks.block, args)
    return out


# ---------------------------------------------------------------------------- fused regions
def buffer_fits(t: torch.Tensor, shape: tuple, strides: tuple, dtype: torch.dtype) -> bool:
    """``t`` has the shape, dtype and (for dims of size > 1) strides a generated kernel expects."""
    if t.dtype != dtype or tuple(t.shape) != shape:
        return False
    return all(n == 1 or s == e for n, s, e in zip(shape, t.stride(), strides))


def launch_fused(ks: KernelSource, inputs, outputs, kernel=None) -> None:
    """Launch a kernel generated from the loop-level IR (``codegen/kernel.py``): its inputs and
    outputs in the order of the kernel's buffers; sizes are compiled in."""
    k = ks.meta["kernel"]
    if len(inputs) != len(k.inputs) or len(outputs) != len(k.outputs):
        raise ValueError(f"{ks.name}: {len(inputs)} inputs / {len(outputs)} outputs, "
                         f"expected {len(k.inputs)} / {len(k.outputs)}")
    for t, b in zip(list(inputs) + list(outputs), k.inputs + k.outputs):
        if not buffer_fits(t, b.shape, b.strides, b.dtype):
            raise ValueError(f"{ks.name}: {b.name} is {tuple(t.shape)} {t.stride()} {t.dtype}, the kernel was "
                             f"generated for {b.shape} {b.strides} {b.dtype}")
    if not vector_aligned(ks, inputs, outputs):
        raise ValueError(f"{ks.name}: a vector-accessed tensor is not aligned")
    if any(b.numel == 0 for b in k.outputs) or ks.meta.get("work", 1) == 0:
        return
    _kernel(ks, kernel).launch(ks.meta["grid"], ks.block, list(inputs) + list(outputs))


def vector_aligned(ks: KernelSource, inputs, outputs) -> bool:
    """The tensors a vector variant reads or writes 16 bytes (at most) at a time are aligned."""
    for kind, i, nbytes in ks.meta.get("aligned", ()):
        t = inputs[i] if kind == "in" else outputs[i]
        if t.data_ptr() % nbytes:
            return False
    return True
