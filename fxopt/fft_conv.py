"""FFT convolution (stride 1, dilation 1, any kernel size, any groups, 1-3 spatial dims).

Pure torch kernels used by :mod:`fxopt.conv_algorithms`. The cost is
O(L log L) per channel independent of the kernel size, so it wins for large kernels
(31x31 / 51x51 depthwise, 1-D kernels with hundreds of taps).

Zero padding is folded into the transform instead of materialised: x is zero-
extended (at the end only) to the FFT size L, and the kernel is placed at the
circular offset -padding, so that the circular cross-correlation
    y_c[o] = sum_j x[(o + j) mod L] * w[j + p],   j in [-p, K-1-p]
equals the padded linear cross-correlation for o in [0, O) whenever
    L >= max(X + p, K, O)         (X input size, p padding, O output size)
(negative indices wrap into x's zero tail, positive ones never reach the wrap).
L is the next 7-smooth ("fast") size. Correlation = product with conj(W).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.lru_cache(maxsize=4096)
def next_fast_len(n: int) -> int:
    """Smallest integer >= n whose only prime factors are 2, 3, 5, 7."""
    n = max(int(n), 1)
    while True:
        r = n
        for p in (2, 3, 5, 7):
            while r % p == 0:
                r //= p
        if r == 1:
            return n
        n += 1


def fft_sizes(x_spatial, w_spatial, padding) -> tuple[int, ...]:
    """FFT size per spatial dim (see module docstring for the bound)."""
    out = []
    for x, k, p in zip(x_spatial, w_spatial, padding):
        o = x + 2 * p - k + 1
        out.append(next_fast_len(max(x + p, k, o)))
    return tuple(out)


def fft_work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def fft_kernel_spectrum(weight: Tensor, x_spatial, padding, groups: int) -> Tensor:
    """conj(rfftn(kernel placed at offset -padding, s=L)), laid out for `fft_conv`.

    Layout: depthwise-like (C/groups == 1): (G, OC/G, F); otherwise (F, G, C/G, OC/G),
    F = prod of the half-spectrum dims. complex64 (complex128 for fp64 weights)."""
    nd = weight.dim() - 2
    oc, cg = weight.shape[:2]
    ks = tuple(weight.shape[2:])
    sizes = fft_sizes(x_spatial, ks, padding)
    wd = weight.to(fft_work_dtype(weight.dtype))
    wp = wd.new_zeros((oc, cg, *sizes))
    wp[(slice(None), slice(None), *(slice(0, k) for k in ks))] = wd
    dims = tuple(range(2, 2 + nd))
    wp = torch.roll(wp, shifts=tuple(-p for p in padding), dims=dims)
    spec = torch.fft.rfftn(wp, s=sizes, dim=dims).conj()
    spec = spec.reshape(groups, oc // groups, cg, -1)
    if cg == 1:
        return spec[:, :, 0].contiguous()
    return spec.permute(3, 0, 2, 1).contiguous()


def fft_conv(x: Tensor, spec: Tensor, bias: Tensor | None, w_spatial, padding, groups: int) -> Tensor:
    """Cross-correlation of x (N, C, *S) with a spectrum from `fft_kernel_spectrum`.

    Computes in fp32 (fp64 for fp64 input); returns x.dtype (possibly a cropped view)."""
    nd = x.dim() - 2
    xs = tuple(x.shape[2:])
    c = x.shape[1]
    sizes = fft_sizes(xs, w_spatial, padding)
    outs = tuple(s + 2 * p - k + 1 for s, k, p in zip(xs, w_spatial, padding))
    dims = tuple(range(2, 2 + nd))
    work = fft_work_dtype(x.dtype)
    spec = spec.to(x.device)
    xf = torch.fft.rfftn(x.to(work), s=sizes, dim=dims)  # (N, C, *Fs)
    fs = xf.shape[2:]
    cg = c // groups
    if spec.dim() == 3:  # C/groups == 1: per-channel products, broadcast over the multiplier
        ocg = spec.shape[1]
        yf = xf.reshape(-1, groups, 1, spec.shape[-1]) * spec
    else:  # channel contraction as a complex matmul per frequency
        ocg = spec.shape[-1]
        xm = xf.reshape(-1, groups, cg, spec.shape[0]).permute(3, 1, 0, 2)  # (F, G, N, Cg)
        yf = (xm @ spec).permute(2, 1, 3, 0)  # (N, G, OCg, F)
    yf = yf.reshape(-1, groups * ocg, *fs)
    y = torch.fft.irfftn(yf, s=sizes, dim=dims)
    y = y[(slice(None), slice(None), *(slice(0, o) for o in outs))]
    if bias is not None:
        y = y + bias.to(work).view(1, -1, *([1] * nd))
    return y.to(x.dtype)
