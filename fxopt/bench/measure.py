"""Timing, statistics and accuracy for the fxopt benchmark harness.

Per-call times (CUDA events on CUDA, ``time.perf_counter`` on the CPU) and their statistics, the
host's speed at a moment, the fp32 reference output and the relative error against it, FLOPs of a
forward pass and a device's peak matmul throughput. Used by the inference cells
(``fxopt.bench.runners``), the training benchmark and the data-parallel one.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time
from typing import Any, Callable, Dict, List, Sequence

import torch
from torch import nn

__all__ = ["count_flops", "flatten_outputs", "host_ms_per_call", "host_speed_us", "max_rel_error",
           "measure_peak_tflops", "reference_output", "stats", "time_calls"]


# ---- statistics and timing -------------------------------------------------
def _percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    n = len(sorted_xs)
    if n == 1:
        return float(sorted_xs[0])
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return float(sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo))


def stats(samples: Sequence[float]) -> Dict[str, float]:
    """median, quartiles, IQR, mean, min, max and count of ``samples``."""
    if not samples:
        raise ValueError("stats() needs at least one sample")
    xs = sorted(float(s) for s in samples)
    q1, q3 = _percentile(xs, 25), _percentile(xs, 75)
    return {
        "median": float(statistics.median(xs)), "q1": q1, "q3": q3, "iqr": q3 - q1,
        "mean": float(statistics.fmean(xs)), "min": xs[0], "max": xs[-1], "n": len(xs),
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(fn: Callable, x: torch.Tensor, device: str, iters: int) -> List[float]:
    """Per-call times in ms: CUDA events around each call on CUDA,
    ``time.perf_counter`` on the CPU."""
    if device == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        torch.cuda.synchronize()
        for i in range(iters):
            starts[i].record()
            fn(x)
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(x)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _python_workload() -> int:
    d, acc = {}, 0
    for i in range(300):
        d[i & 31] = i
        acc += d.get(i & 15, 0) ^ i
    return acc


def host_speed_us(reps: int = 25) -> float:
    """Median time of a fixed pure-Python workload (no torch, ~20-50 us): the host's speed at this
    moment. On the H100 machines of BENCHMARKS.md it moves between levels over seconds (a factor up
    to ~2, whichever core the process is pinned to), and host-bound cells move with it; recorded per
    round so that rounds can be compared in the same host state."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        _python_workload()
        ts.append(time.perf_counter_ns() - t0)
    ts.sort()
    return ts[len(ts) // 2] / 1e3


def host_ms_per_call(fn: Callable, x: torch.Tensor, calls: int = 20) -> float:
    """Host (CPU) time to issue one call, back to back without synchronizing: close to the CUDA
    time, the cell is bound by Python/launch overhead and moves with the host's speed."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e3


# ---- accuracy, FLOPs, peak -------------------------------------------------
def setting_ms(fn: Callable[[], Any], budget_s: float = 1.0, most: int = 25) -> float:
    """A peer's call timed to pick among its settings: the median of up to ``most`` single calls
    after three warm-up calls, as many as fit in about ``budget_s`` (at least five)."""
    for _ in range(3):
        fn()
    ts: List[float] = []
    end = time.perf_counter() + budget_s
    while len(ts) < most and (len(ts) < 5 or time.perf_counter() < end):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


def flatten_outputs(out: Any) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flatten_outputs(o)]
    raise TypeError(f"unsupported model output type {type(out).__name__}")


def _cat(out: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in flatten_outputs(out)])


def max_rel_error(out: Any, ref: Any) -> float:
    """||out - ref||_inf / ||ref||_inf over all outputs (in fp32)."""
    r = _cat(ref)
    o = _cat(out).to(r.device)
    if o.shape != r.shape:
        raise ValueError(f"output has {o.numel()} elements, reference {r.numel()}")
    denom = r.abs().max().item()
    num = (o - r).abs().max().item()
    if num != num:  # NaN
        return float("inf")
    return num / denom if denom > 0 else num


@contextlib.contextmanager
def _no_tf32():
    m, c = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = m, c


def reference_output(model: nn.Module, x_cpu: torch.Tensor, device: str) -> torch.Tensor:
    """fp32 eager output (TF32 off) of ``model`` on ``device``, flattened."""
    m = copy.deepcopy(model).to(device=device, dtype=torch.float32)
    with torch.no_grad(), _no_tf32():
        ref = _cat(m(x_cpu.to(device=device, dtype=torch.float32)))
    _sync(device)
    del m
    return ref


def count_flops(model: nn.Module, x_cpu: torch.Tensor) -> int:
    """FLOPs of one forward pass (torch.utils.flop_counter), on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        m, x = copy.deepcopy(model).to("meta"), x_cpu.to("meta")
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            m(x)
    except Exception:  # pragma: no cover - meta kernels missing: count for real
        m, x = copy.deepcopy(model), x_cpu
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            m(x)
    return int(fc.get_total_flops())


def measure_peak_tflops(device: str, dtype: torch.dtype, quick: bool = False) -> Dict[str, Any]:
    """Best matmul throughput on ``device``: n=8192 on CUDA (fp32 with TF32 as
    cuDNN convs use it), n=1024 (512 with quick) on the CPU."""
    if device == "cuda":
        n, iters, warm = 8192, 10, 3
    else:
        n, iters, warm = (512, 3, 1) if quick else (1024, 5, 2)
    tf32 = bool(dtype == torch.float32 and device == "cuda" and torch.backends.cudnn.allow_tf32)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for _ in range(warm):
            torch.mm(a, b)
        times = time_calls(lambda _x: torch.mm(a, b), a, device, iters)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    best_ms = min(times)
    del a, b
    what = f"{n}x{n}x{n} {str(dtype).replace('torch.', '')} matmul" + (" (TF32)" if tf32 else "")
    return {"tflops": 2 * n ** 3 / (best_ms * 1e-3) / 1e12, "what": what, "best_ms": best_ms}

