"""Convolution algorithm library: interchangeable ways to compute F.conv{1,2,3}d.

Every algorithm computes exactly ``F.conv{n}d(x, weight, bias, stride, padding,
dilation, groups)`` (cross-correlation, symmetric integer padding) up to its
documented tolerance (docs/NUMERICS.md), in pure torch, on CPU and CUDA.

* ``direct``          -- F.conv{n}d (cuDNN / oneDNN). Always legal; the reference.
* ``winograd_2x2_3x3``-- F(2x2,3x3): 2.25x fewer multiplies for 3x3 layers, exact
  transforms. Illegal unless 2-D, 3x3, stride 1, dilation 1 (any padding/groups).
* ``winograd_4x4_3x3``-- F(4x4,3x3), points 0,+-1,+-2: 4x fewer multiplies, but ~10-100x
  the rounding error; same legality. Never chosen by the cost model for fp16/bf16.
* ``fft``             -- rfftn/irfftn, cost independent of the kernel size: for large
  kernels (>= ~13x13 depthwise, long 1-D kernels). Illegal for stride/dilation != 1,
  symbolic spatial dims, or a kernel spectrum larger than FFT_MAX_SPECTRUM_BYTES.
* ``gemm``            -- 1x1 convs as one matmul (zero-copy for channels_last),
  everything else as im2col + (batched over groups) matmul. Always legal.
* ``blockdiag``       -- a conv of 2-8 wide groups as one dense conv with a block-diagonal
  weight: ``groups`` times the multiply-adds, no per-group slicing. CUDA only.

Precision policy (``compute_dtype``): on CPU fp16/bf16 are computed in fp32 and cast
back; on CUDA winograd/gemm run in the input dtype; fft always runs in fp32 (fp64
for fp64). Weight-only work (filter transform, kernel spectrum, reshaped weight) is
done once by ``prepare``; ``run(..., prepacked=None)`` recomputes it. Prepacked tensors
are fp32/complex64 (fp64/complex128 for fp64) whatever the device, so their shape and
dtype depend on the weight and the sig's shapes/dtype only (not on sig.device_type);
``blockdiag``'s is the weight's dtype and layout (the library convolution reads it as it is).

``estimate_ms`` is a roofline-style heuristic: sum(FLOPs / (peak * efficiency)) + bytes /
bandwidth + ops * per-op overhead, with per-device constants in ``_DEVICES``. It is meant
for ranking and pruning candidates before autotuning, not for absolute predictions.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from .fft_conv import fft_conv, fft_kernel_spectrum, fft_sizes
from .winograd import winograd_conv2d, winograd_filter_transform, winograd_matrices

__all__ = ["ConvSig", "ConvAlgorithm", "ALGORITHMS", "get_algorithm", "legal_algorithms",
           "compute_dtype", "FFT_MAX_SPECTRUM_BYTES"]

FFT_MAX_SPECTRUM_BYTES = 512 * 2**20
#: depthwise kernels from this size up (either side): see ``channels_first_candidate``
NCHW_MIN_KERNEL = 7
_DTYPE_NAMES = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def grouped_search(groups: int, channels_per_group: int) -> bool:
    """A CUDA convolution of this grouping runs cuDNN's search (``searched_grouped``): grouped, not
    depthwise. Also the autotuning key's mark (``select_conv_algorithm``)."""
    return groups > 1 and channels_per_group > 1


def searched_grouped(x: Tensor, weight: Tensor, groups: int) -> bool:
    """Whether ``library_conv`` lets cuDNN search this convolution's plan: a grouped one (2+ input
    channels a group, not depthwise) on CUDA, outside a CUDA-graph capture.

    cuDNN's heuristics pick slow plans for grouped convolutions at small batches: a 6-group 3x3
    conv of 384 channels at 14x14, batch 1, float16 channels_last took 11.8 us by heuristics, 5.3 us
    by its search (``torch.backends.cudnn.benchmark``), and 9.4 us as one dense conv over a
    block-diagonal weight (``blockdiag``) (H200, cuDNN 9.19; 2 groups of 64 at 28x28: 9.7, 5.1,
    7.2 us). The search runs once per shape; cuDNN caches its plan for the process, so later calls
    (heuristics or a capture) reuse it. Dense and depthwise convolutions keep the heuristics: the
    search cost seconds a network there and chose no faster kernels (``fxopt.autotune``)."""
    return (x.is_cuda and grouped_search(groups, weight.shape[1] if weight.dim() >= 3 else 1)
            and not torch.backends.cudnn.benchmark and torch.cuda.is_available()  # (fake CUDA tensors)
            and not torch.cuda.is_current_stream_capturing())


def library_conv(x: Tensor, weight: Tensor, bias, stride, padding, dilation, groups: int) -> Tensor:
    """``F.conv{n}d``, with cuDNN's search for the first call of a grouped CUDA convolution
    (``searched_grouped``). The flag is process-wide while the call lasts, as in ``fxopt.autotune``."""
    conv = _CONV[weight.dim() - 2]
    if not searched_grouped(x, weight, groups):
        return conv(x, weight, bias, stride, padding, dilation, groups)
    torch.backends.cudnn.benchmark = True
    try:
        return conv(x, weight, bias, stride, padding, dilation, groups)
    finally:
        torch.backends.cudnn.benchmark = False


def _tup(v, n: int) -> tuple:
    return tuple(int(i) for i in v) if isinstance(v, (tuple, list)) else (int(v),) * n


@dataclass(frozen=True)
class ConvSig:
    """Everything known at compile time about one convolution (hashable)."""
    x_shape: tuple  # (N, C, *spatial); N may be None (symbolic batch)
    w_shape: tuple  # (OC, C // groups, *kernel)
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int
    dtype: torch.dtype
    device_type: str  # "cpu" / "cuda"
    channels_last: bool = False

    def __post_init__(self):
        n = len(self.w_shape) - 2
        fix = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731
        fix("x_shape", tuple(None if s is None else int(s) for s in self.x_shape))
        fix("w_shape", tuple(int(s) for s in self.w_shape))
        for name in ("stride", "padding", "dilation"):
            fix(name, _tup(getattr(self, name), n))
        fix("groups", int(self.groups))

    @property
    def ndim(self) -> int:
        return len(self.x_shape) - 2

    @property
    def kernel(self) -> tuple:
        return self.w_shape[2:]

    @property
    def out_spatial(self) -> tuple:
        return tuple((x + 2 * p - d * (k - 1) - 1) // s + 1 for x, k, s, p, d in
                     zip(self.x_shape[2:], self.kernel, self.stride, self.padding, self.dilation))

    def key(self) -> str:
        """e.g. 'conv2d|x=?x64x56x56|w=64x64x3x3|s=1,1|p=1,1|d=1,1|g=1|f32|cuda|cl'."""
        j = lambda t, sep="x": sep.join("?" if v is None else str(v) for v in t)  # noqa: E731
        return "|".join([f"conv{self.ndim}d", f"x={j(self.x_shape)}", f"w={j(self.w_shape)}",
                         f"s={j(self.stride, ',')}", f"p={j(self.padding, ',')}",
                         f"d={j(self.dilation, ',')}", f"g={self.groups}",
                         _DTYPE_NAMES.get(self.dtype, str(self.dtype).replace("torch.", "")),
                         self.device_type, "cl" if self.channels_last else "cf"])

    @classmethod
    def from_tensors(cls, x: Tensor, weight: Tensor, stride=1, padding=0, dilation=1, groups=1,
                     dynamic_batch: bool = False) -> "ConvSig":
        n = weight.dim() - 2
        if isinstance(padding, str):  # 'valid' / 'same' (odd effective kernels only)
            d = _tup(dilation, n)
            if padding == "valid":
                padding = 0
            elif padding == "same" and all(di * (k - 1) % 2 == 0 for di, k in zip(d, weight.shape[2:])):
                padding = tuple(di * (k - 1) // 2 for di, k in zip(d, weight.shape[2:]))
            else:
                raise ValueError(f"padding={padding!r} is not expressible as symmetric ints")
        cl = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        return cls((None if dynamic_batch else x.shape[0], *x.shape[1:]), tuple(weight.shape),
                   stride, padding, dilation, groups, x.dtype, x.device.type, cl)


def channels_first_candidate(sig: "ConvSig") -> bool:
    """A channels_last depthwise 2-D conv with a kernel of ``NCHW_MIN_KERNEL`` or more: cuDNN's
    kernels for it differ by memory format by up to 7x, so it is also run channels-first (its
    conversions included): the cuda executor's ``nchw`` candidate, and ``direct``'s time in
    ``fxopt.autotune.measure`` (else FFT could win against the slow format alone)."""
    return (sig.channels_last and sig.ndim == 2 and sig.groups > 1 and sig.w_shape[1] == 1
            and max(sig.kernel) >= NCHW_MIN_KERNEL)


def compute_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype winograd/gemm compute in: fp32 for fp16/bf16 on CPU, else `dtype`."""
    if device_type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def _prepack_dtype(dtype: torch.dtype) -> torch.dtype:
    """Real prepacked tensors are fp64 for fp64, else fp32, on every device, so that
    prepare() can be shape/dtype-probed on CPU; run() casts to compute_dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _basic_reason(sig: ConvSig) -> str | None:
    nd = sig.ndim
    if nd not in (1, 2, 3) or len(sig.w_shape) != nd + 2:
        return f"unsupported rank: x {len(sig.x_shape)}-D, w {len(sig.w_shape)}-D"
    if any(len(t) != nd for t in (sig.stride, sig.padding, sig.dilation)):
        return "stride/padding/dilation length does not match the spatial rank"
    if sig.groups < 1 or sig.x_shape[1] != sig.w_shape[1] * sig.groups or sig.w_shape[0] % sig.groups:
        return f"channel/groups mismatch: C={sig.x_shape[1]} w={sig.w_shape} groups={sig.groups}"
    if any(not isinstance(s, int) for s in sig.x_shape[2:]):
        return "symbolic spatial dims"
    if min(sig.out_spatial) < 1:
        return f"empty output {sig.out_spatial}"
    return None


def _restore_format(y: Tensor, x: Tensor) -> Tensor:
    """``y`` in the memory format F.conv gives for ``x``, with exactly F.conv's strides. An input
    that is both contiguous and channels_last (one channel, or 1x1 spatial) counts as channels_last
    when its strides are channels_last's own. ``contiguous()`` keeps whatever strides size-1
    dimensions had; F.conv's output has those of ``empty(..., memory_format)``: where only those
    differ, a view over the same memory gives them (no copy)."""
    fmt = torch.channels_last if _channels_last_input(x) else torch.contiguous_format
    y = y.contiguous(memory_format=fmt)
    if 1 in y.shape:
        want = _canonical_strides(y.shape, fmt)
        if y.stride() != want:
            y = y.as_strided(y.shape, want)
    return y


@functools.lru_cache(maxsize=1024)
def _canonical_strides(shape: tuple, fmt) -> tuple:
    """The strides ``empty(shape, memory_format=fmt)`` has (memoized: called per convolution)."""
    return torch.empty(shape, device="meta", memory_format=fmt).stride()


def _channels_last_input(x: Tensor) -> bool:
    """Whether F.conv answers ``x`` in channels_last: a different question from ``ConvSig``'s
    ``channels_last`` (the memory order of the input, where an input that is both counts as
    contiguous; their memory is the same)."""
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last):
        return False
    if not x.is_contiguous():
        return True
    return (x.stride() == _canonical_strides(x.shape, torch.channels_last)
            and x.stride() != _canonical_strides(x.shape, torch.contiguous_format))


# ---------------------------------------------------------------- cost model
@dataclass(frozen=True)
class _Device:
    peak: dict  # FLOP/s: "f64", "f32" (no tensor cores), "tf32", "f16" (also bf16)
    bytes_per_s: float  # DRAM bandwidth
    op_ms: float  # fixed cost per torch op (eager dispatch + kernel launch)
    eff: dict  # fraction of the peak each kind of arithmetic reaches
    dw_fast_taps: int  # vendor depthwise kernels are fast up to this many 2-D taps (1-D: its sqrt)


# The H100 (cuDNN with TF32 on, cuBLAS fp32 matmul without TF32): calibrated roughly against eager
# timings (2026-11). The CPU: fitted (2026-11-24) to 79 convolutions measured by `auto` with every
# candidate (conv_prune=0) on 2 threads of an x86 CPU with oneDNN, channels_last as the cpu executor
# runs them (resnet18 b1/b8, mobilenet_v2 b1, resnet50 b1, the seed CNNs b64): the efficiency of
# each kind of arithmetic scaled to minimise the measured time of the heuristic's picks, then the
# mean |log(measured / estimated)| (0.58 -> 0.46). With these constants the heuristic picks `direct`
# for all 79 (within 10 % of the measured best in 72), 176 ms in all; the old constants' picks 205 ms
# (Winograd for 3x3 layers); the measured best 155 ms (what `conv_algorithm="auto"` finds, at a
# compile-time cost).
_DEVICES = {
    "cpu": _Device({"f64": 100e9, "f32": 200e9, "tf32": 200e9, "f16": 200e9}, 20e9, 0.01,
                   {"direct": 0.84, "direct_dw": 0.4, "direct_dw_slow": 0.04, "gemm": 0.36, "gemm_dw": 0.018,
                    "wino_gemm": 0.25, "wino_dw": 0.015, "wino_tr": 0.15, "fft_1d": 0.075, "fft_nd": 0.025,
                    "fft_mm": 0.035, "fft_dw": 0.025}, 13 * 13),
    "cuda": _Device({"f64": 60e12, "f32": 60e12, "tf32": 400e12, "f16": 800e12}, 2.5e12, 0.01,
                    {"direct": 0.3, "direct_dw": 0.1, "direct_dw_slow": 0.1, "gemm": 0.5, "gemm_dw": 0.05,
                     "wino_gemm": 0.4, "wino_dw": 0.05, "wino_tr": 0.2, "fft_1d": 0.05, "fft_nd": 0.05,
                     "fft_mm": 0.3, "fft_dw": 0.1}, 1 << 30),
}


def _peak_key(dtype: torch.dtype, device_type: str, tensor_cores: bool, tf32: bool) -> str:
    if dtype == torch.float64:
        return "f64"
    if device_type != "cuda" or not tensor_cores:
        return "f32"
    if dtype in (torch.float16, torch.bfloat16):
        return "f16"
    return "tf32" if tf32 else "f32"


def _cost(sig: ConvSig, items: list, nbytes: float, n_ops: int) -> float:
    """items: (flops, kind, dtype it runs in, uses tensor cores / BLAS, TF32 flag)."""
    dev = _DEVICES["cpu" if sig.device_type == "cpu" else "cuda"]
    t = sum(fl / (dev.peak[_peak_key(dt, sig.device_type, tc, tf)] * dev.eff[kind])
            for fl, kind, dt, tc, tf in items)
    return 1e3 * (t + nbytes / dev.bytes_per_s) + n_ops * dev.op_ms


def _sizes(sig: ConvSig, batch: int):
    c, oc, g = sig.x_shape[1], sig.w_shape[0], sig.groups
    return batch, c, oc, g, c // g, math.prod(sig.x_shape[2:]), math.prod(sig.out_spatial), math.prod(sig.kernel)


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------- algorithms
@runtime_checkable
class ConvAlgorithm(Protocol):
    name: str

    def legal(self, sig: ConvSig) -> str | None: ...
    def prepare(self, weight: Tensor, sig: ConvSig) -> Tensor | None: ...
    def run(self, x: Tensor, weight: Tensor, prepacked: Tensor | None, bias: Tensor | None,
            sig: ConvSig) -> Tensor: ...
    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]: ...
    def estimate_ms(self, sig: ConvSig, batch: int) -> float: ...


class _Base:
    name = "?"
    # (rtol, atol) vs `direct` in the same dtype, for O(1) activations and fan-in-scaled
    # weights (outputs O(1)). fp32 covers cuDNN's default TF32 `direct` (~1.5e-3 abs);
    # measured errors in docs/NUMERICS.md.
    _TOL = {torch.float64: (1e-9, 1e-10), torch.float32: (1e-3, 3e-3),
            torch.float16: (1e-2, 5e-3), torch.bfloat16: (2e-2, 2e-2)}

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        return self._TOL.get(dtype, self._TOL[torch.float32])

    def prepare(self, weight: Tensor, sig: ConvSig) -> Tensor | None:
        return None

    def estimate_ms(self, sig: ConvSig, batch: int) -> float:
        """Heuristic runtime in ms for `batch` images; inf when illegal."""
        return math.inf if self.legal(sig) is not None else self._estimate(sig, int(batch))

    def __repr__(self) -> str:
        return f"<ConvAlgorithm {self.name}>"


class Direct(_Base):
    """F.conv{n}d; the reference every other algorithm is checked against."""
    name = "direct"

    def legal(self, sig: ConvSig) -> str | None:
        return _basic_reason(sig)

    def run(self, x, weight, prepacked, bias, sig):
        return library_conv(x, weight, bias, sig.stride, sig.padding, sig.dilation, sig.groups)

    def _estimate(self, sig, batch):
        n, c, oc, g, cg, xs, os_, ks = _sizes(sig, batch)
        fl = 2.0 * n * oc * cg * ks * os_
        nbytes = _esize(sig.dtype) * (n * c * xs + n * oc * os_ + oc * cg * ks)
        if cg > 1:
            return _cost(sig, [(fl, "direct", sig.dtype, True, torch.backends.cudnn.allow_tf32)], nbytes, 1)
        dev = _DEVICES["cpu" if sig.device_type == "cpu" else "cuda"]
        slow = ks > (dev.dw_fast_taps if sig.ndim > 1 else math.isqrt(dev.dw_fast_taps) + 1)
        return _cost(sig, [(fl, "direct_dw_slow" if slow else "direct_dw", sig.dtype, False, False)], nbytes, 1)


class Winograd(_Base):
    """F(m x m, 3 x 3); see fxopt.winograd."""

    def __init__(self, m: int, tol: dict):
        self.m, self.name, self._TOL = m, f"winograd_{m}x{m}_3x3", tol

    def legal(self, sig: ConvSig) -> str | None:
        if (r := _basic_reason(sig)) is not None:
            return r
        if sig.ndim != 2 or sig.kernel != (3, 3):
            return f"{self.name} needs a 2-D 3x3 kernel, got {sig.kernel}"
        if sig.stride != (1, 1) or sig.dilation != (1, 1):
            return f"{self.name} needs stride 1 and dilation 1, got {sig.stride}/{sig.dilation}"
        return None

    def prepare(self, weight, sig):
        winograd_matrices(self.m, compute_dtype(sig.dtype, weight.device.type), weight.device)  # warm cache
        return winograd_filter_transform(weight, self.m, sig.groups, _prepack_dtype(sig.dtype))

    def run(self, x, weight, prepacked, bias, sig):
        cd = compute_dtype(x.dtype, x.device.type)
        u = prepacked if prepacked is not None else winograd_filter_transform(weight, self.m, sig.groups, cd)
        return _restore_format(winograd_conv2d(x, u, bias, sig.padding, sig.groups, self.m, cd), x)

    def _estimate(self, sig, batch):
        if self.m >= 4 and sig.dtype in (torch.float16, torch.bfloat16):
            return math.inf  # F(4,3) loses ~2 more digits: never pick it in half precision
        n, c, oc, g, cg, xs, os_, ks = _sizes(sig, batch)
        a, m = self.m + 2, self.m
        tiles = n * math.prod(-(-o // m) for o in sig.out_spatial)
        cd, tf32 = compute_dtype(sig.dtype, sig.device_type), torch.backends.cuda.matmul.allow_tf32
        items = [(2.0 * a * a * tiles * oc * cg, "wino_dw" if cg == 1 else "wino_gemm", cd, cg > 1, tf32),
                 (2.0 * a * a * tiles * (a * a * c + m * m * oc), "wino_tr", cd, True, tf32)]
        nbytes = _esize(cd) * (n * c * xs + 4 * a * a * tiles * (c + oc) + 3 * n * oc * os_)
        return _cost(sig, items, nbytes, 10)


class FFTConv(_Base):
    """rfftn-based cross-correlation; see fxopt.fft_conv."""
    name = "fft"

    def legal(self, sig: ConvSig) -> str | None:
        if (r := _basic_reason(sig)) is not None:
            return r
        if any(s != 1 for s in sig.stride) or any(d != 1 for d in sig.dilation):
            return f"fft needs stride 1 and dilation 1, got {sig.stride}/{sig.dilation}"
        nbytes = self._spectrum_bytes(sig)
        if nbytes > FFT_MAX_SPECTRUM_BYTES:
            return f"kernel spectrum would take {nbytes / 2**20:.0f} MiB > {FFT_MAX_SPECTRUM_BYTES // 2**20} MiB"
        return None

    @staticmethod
    def _spectrum_bytes(sig: ConvSig) -> int:
        sizes = fft_sizes(sig.x_shape[2:], sig.kernel, sig.padding)
        fp = math.prod(sizes[:-1]) * (sizes[-1] // 2 + 1)
        return sig.w_shape[0] * sig.w_shape[1] * fp * (16 if sig.dtype == torch.float64 else 8)

    def prepare(self, weight, sig):
        return fft_kernel_spectrum(weight, sig.x_shape[2:], sig.padding, sig.groups)

    def run(self, x, weight, prepacked, bias, sig):
        spec = prepacked if prepacked is not None else fft_kernel_spectrum(
            weight, tuple(x.shape[2:]), sig.padding, sig.groups)
        return _restore_format(fft_conv(x, spec, bias, sig.kernel, sig.padding, sig.groups), x)

    def _estimate(self, sig, batch):
        n, c, oc, g, cg, xs, os_, ks = _sizes(sig, batch)
        sizes = fft_sizes(sig.x_shape[2:], sig.kernel, sig.padding)
        lp = math.prod(sizes)
        fp = lp // sizes[-1] * (sizes[-1] // 2 + 1)
        work = torch.float64 if sig.dtype == torch.float64 else torch.float32
        items = [(2.5 * lp * math.log2(max(lp, 2)) * n * (c + oc), "fft_1d" if sig.ndim == 1 else "fft_nd",
                  work, False, False),
                 (8.0 * fp * n * oc * cg, "fft_dw" if cg == 1 else "fft_mm", work, cg > 1, False)]
        cplx = 2 * _esize(work)
        nbytes = 4 * n * (c * xs + oc * os_) + cplx * fp * (3 * n * (c + oc) + oc * cg)
        return _cost(sig, items, nbytes, 10)


class Gemm(_Base):
    """1x1 convs as a single matmul, everything else as im2col + batched matmul."""
    name = "gemm"

    def legal(self, sig: ConvSig) -> str | None:
        return _basic_reason(sig)

    @staticmethod
    def _is_1x1(sig: ConvSig) -> bool:
        return all(k == 1 for k in sig.kernel) and all(p == 0 for p in sig.padding)

    def prepare(self, weight, sig):
        g = sig.groups
        w = weight.reshape(g, weight.shape[0] // g, -1)  # (G, OCg, Cg*prod(k))
        return w.to(_prepack_dtype(sig.dtype)).contiguous()

    def run(self, x, weight, prepacked, bias, sig):
        cd = compute_dtype(x.dtype, x.device.type)
        w = (prepacked if prepacked is not None else self.prepare(weight, sig)).to(device=x.device, dtype=cd)
        nd, g = sig.ndim, sig.groups
        oc = w.shape[0] * w.shape[1]
        if self._is_1x1(sig):
            xs = x[(slice(None), slice(None), *(slice(None, None, s) for s in sig.stride))].to(cd)
            out_sp = tuple(xs.shape[2:])
            xl = xs.movedim(1, -1)  # (N, *S, C): a plain view of channels_last memory
            if g == 1 and xl.is_contiguous():
                y = (xl @ w[0].mT).movedim(-1, 1)  # no copy of x; output is channels_last
            else:
                y = (w @ xs.reshape(-1, g, xs.shape[1] // g, math.prod(out_sp))).reshape(-1, oc, *out_sp)
        else:
            pad = [p for pp in reversed(sig.padding) for p in (pp, pp)]
            cols = F.pad(x.to(cd), pad) if any(sig.padding) else x.to(cd)
            for i, (k, s, d) in enumerate(zip(sig.kernel, sig.stride, sig.dilation)):
                cols = cols.unfold(2 + i, (k - 1) * d + 1, s)[..., ::d]  # (N, C, *O, *K)
            out_sp = tuple(cols.shape[2:2 + nd])
            cols = cols.unflatten(1, (g, -1))  # (N, G, Cg, *O, *K)
            perm = (0, 1, 2, *range(3 + nd, 3 + 2 * nd), *range(3, 3 + nd))
            cols = cols.permute(perm).reshape(cols.shape[0], g, w.shape[2], -1)  # im2col copy
            y = (w @ cols).reshape(-1, oc, *out_sp)
        if bias is not None:
            y = y + bias.to(cd).view(1, -1, *([1] * nd))
        return _restore_format(y.to(x.dtype), x)

    def _estimate(self, sig, batch):
        n, c, oc, g, cg, xs, os_, ks = _sizes(sig, batch)
        cd = compute_dtype(sig.dtype, sig.device_type)
        fl = 2.0 * n * oc * cg * ks * os_
        zero_copy = self._is_1x1(sig) and sig.stride == (1,) * sig.ndim
        cols = 0 if zero_copy else 2 * n * c * ks * os_
        nbytes = _esize(cd) * (n * c * xs + cols + n * oc * os_ + oc * cg * ks)
        items = [(fl, "gemm_dw" if cg == 1 else "gemm", cd, cg > 1, torch.backends.cuda.matmul.allow_tf32)]
        return _cost(sig, items, nbytes, 2 if zero_copy else 5)


#: groups ``blockdiag`` runs as one dense convolution, and the input channels a group has at least
BLOCKDIAG_GROUPS = range(2, 9)
BLOCKDIAG_MIN_GROUP = 16


class BlockDiag(_Base):
    """A grouped conv of 2-8 wide groups as one dense conv whose weight is block-diagonal (zeros
    between the groups): ``groups`` times the multiply-adds in one library call that slices
    nothing. cuDNN's channels_last kernels for such convs slice each group's channels out on every
    call (``nhwcSliceCKernel``: 232 launches a call in eca_nfnet_l0 at batch 1, H200); at small
    batches those launches, not the arithmetic, take the time. The zeros add exactly 0 (the
    grouped conv's sums, in the library's order). CUDA only: on the CPU the extra arithmetic is
    never repaid. Chosen only where measured faster than ``direct`` (``fxopt.autotune``)."""
    name = "blockdiag"

    def legal(self, sig: ConvSig) -> str | None:
        why = _basic_reason(sig)
        if why is not None:
            return why
        if sig.device_type != "cuda":
            return "CUDA only (on the CPU the extra arithmetic is never repaid)"
        if sig.groups not in BLOCKDIAG_GROUPS:
            return f"{sig.groups} groups (2-8 only)"
        if sig.w_shape[1] < BLOCKDIAG_MIN_GROUP:
            return f"{sig.w_shape[1]} input channels a group (at least {BLOCKDIAG_MIN_GROUP})"
        return None

    def prepare(self, weight, sig):
        g = sig.groups
        ocg, cg = weight.shape[0] // g, weight.shape[1]
        full = weight.new_zeros((weight.shape[0], cg * g, *weight.shape[2:]))
        for i in range(g):
            full[i * ocg:(i + 1) * ocg, i * cg:(i + 1) * cg] = weight[i * ocg:(i + 1) * ocg]
        if sig.channels_last and full.dim() == 4:
            full = full.contiguous(memory_format=torch.channels_last)
        return full

    def run(self, x, weight, prepacked, bias, sig):
        w = prepacked if prepacked is not None else self.prepare(weight, sig)
        w = w.to(device=x.device, dtype=x.dtype)
        return _restore_format(_CONV[sig.ndim](x, w, bias, sig.stride, sig.padding, sig.dilation, 1), x)

    def _estimate(self, sig, batch):
        n, c, oc, g, cg, xs, os_, ks = _sizes(sig, batch)
        fl = 2.0 * n * oc * c * ks * os_
        nbytes = _esize(sig.dtype) * (n * c * xs + n * oc * os_ + oc * c * ks)
        return _cost(sig, [(fl, "direct", sig.dtype, True, torch.backends.cudnn.allow_tf32)], nbytes, 1)


# Winograd in fp16/bf16 on CUDA computes in the input dtype; the transforms amplify
# rounding (F(4,3): |B| entries up to 5, |A| up to 8), hence the wide half-precision bounds.
_W2_TOL = {**_Base._TOL, torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 8e-2)}
_W4_TOL = {**_Base._TOL, torch.float16: (5e-2, 2.5e-1), torch.bfloat16: (2.5e-1, 2.0)}

ALGORITHMS: dict[str, ConvAlgorithm] = {
    a.name: a for a in (Direct(), Winograd(2, _W2_TOL), Winograd(4, _W4_TOL), FFTConv(), Gemm(), BlockDiag())}


def get_algorithm(name: str) -> ConvAlgorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"unknown conv algorithm {name!r}; valid names: {sorted(ALGORITHMS)}") from None


def legal_algorithms(sig: ConvSig) -> list[str]:
    """Names of the algorithms whose legal(sig) is None, in ALGORITHMS order."""
    return [name for name, a in ALGORITHMS.items() if a.legal(sig) is None]
