"""Winograd minimal filtering F(m x m, 3 x 3) for 2-D, stride-1, dilation-1 convolutions.

Pure torch kernels used by :mod:`fxopt.conv_algorithms` (which owns the
legality rules, tolerances and cost model). Matrices are Lavin & Gray (2015):
F(2,3) uses interpolation points 0, +-1 (exact in binary); F(4,3) uses 0, +-1, +-2,
whose transforms carry entries of magnitude up to 5 (B) and 8 (A) and the factors
1/6, 1/24 (G): the output error grows roughly 10-100x over direct, which is
harmless in fp32/fp64 but makes F(4,3) unsuitable for fp16/bf16.

Shapes: a tile of alpha x alpha inputs (alpha = m + 2) yields m x m outputs. The
filter transform U = G g G^T is weight-only (precomputed once); per call we do
  V = B^T d B  (all tiles at once: Tensor.unfold view, one copy, one Kronecker GEMM)
  M = U V      (one batched matmul over the alpha^2 positions and the groups;
                an elementwise product for depthwise)
  Y = A^T M A  (one Kronecker GEMM; tiles are stitched back and the tail cropped).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

_MATRICES = {
    2: (  # (B^T, G, A^T) for F(2x2, 3x3)
        [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
        [[1, 1, 1, 0], [0, 1, -1, -1]],
    ),
    4: (  # F(4x4, 3x3), points 0, 1, -1, 2, -2, inf
        [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
         [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]],
        [[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
         [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]],
        [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
    ),
}


@functools.lru_cache(maxsize=None)
def winograd_matrices(m: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(kron(B^T, B^T), G, kron(A^T, A^T)) for F(m x m, 3 x 3).

    The 2-D transforms B^T d B and A^T M A are applied as ONE matmul each with the
    Kronecker matrices (alpha^2 x alpha^2 and m^2 x alpha^2) over all tiles at once:
    ~2-3x the flops of the separable form, but one large GEMM instead of millions of
    tiny ones. Cached per (m, dtype, device): make the first call outside CUDA-graph
    capture (``prepare`` does)."""
    bt, g, at = (torch.tensor(t, dtype=torch.float64) for t in _MATRICES[m])
    mk = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
    return mk(torch.kron(bt, bt)), mk(g), mk(torch.kron(at, at))


def winograd_filter_transform(weight: Tensor, m: int, groups: int, dtype: torch.dtype) -> Tensor:
    """U = G g G^T for every filter, laid out (alpha^2, groups, OC/groups, C/groups) in `dtype`.

    Computed in float64 (fp64 weights) or float32 (everything else) and then cast."""
    oc, cg, kh, kw = weight.shape
    if (kh, kw) != (3, 3):
        raise ValueError(f"winograd needs a 3x3 kernel, got {kh}x{kw}")
    work = torch.float64 if weight.dtype == torch.float64 else torch.float32
    _, g, _ = winograd_matrices(m, work, weight.device)
    u = g @ weight.to(work) @ g.T  # (OC, Cg, alpha, alpha)
    a = m + 2
    u = u.reshape(groups, oc // groups, cg, a * a).permute(3, 0, 1, 2)
    return u.to(dtype).contiguous()


def winograd_conv2d(x: Tensor, u: Tensor, bias: Tensor | None, padding: tuple[int, int],
                    groups: int, m: int, compute_dtype: torch.dtype) -> Tensor:
    """Cross-correlation of x (N, C, H, W) with the pre-transformed filters `u`.

    Any padding; output sizes that are not a multiple of m are handled by padding
    the input to whole tiles and cropping. Returns x.dtype; channels_last in -> out."""
    a = m + 2
    n, c, h, w = x.shape
    ph, pw = padding
    oh, ow = h + 2 * ph - 2, w + 2 * pw - 2
    th, tw = -(-oh // m), -(-ow // m)
    eh, ew = th * m - oh, tw * m - ow  # extra zero rows/cols so the tiles cover the tail
    channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    xc = F.pad(x.to(compute_dtype), (pw, pw + ew, ph, ph + eh))
    kb, _, ka = winograd_matrices(m, compute_dtype, x.device)
    tiles = xc.unfold(2, a, m).unfold(3, a, m)  # (N, C, th, tw, a, a), a view
    d = tiles.permute(4, 5, 1, 0, 2, 3).reshape(a * a, -1)  # (a^2, C*N*th*tw): the one copy of x
    cg = c // groups
    v = (kb @ d).view(a * a, groups, cg, -1)  # B^T d B for all tiles: (a^2, G, Cg, P)
    u = u.to(device=x.device, dtype=compute_dtype)
    mm = u * v if cg == 1 else u @ v  # (a^2, G, OCg, P); depthwise is an outer product
    oc = u.shape[1] * u.shape[2]
    y = (ka @ mm.reshape(a * a, -1)).view(m, m, oc, -1, th, tw)  # A^T M A: (m, m, OC, N, th, tw)
    y = y.permute(3, 2, 4, 0, 5, 1).reshape(-1, oc, th * m, tw * m)[:, :, :oh, :ow]
    if bias is not None:
        y = y + bias.to(compute_dtype).view(1, -1, 1, 1)
    y = y.to(x.dtype)
    return y.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
