"""How the diagnostics time things: one set of measures, so their figures compare with each other
and with the benchmark's.

- ``call_us``: a call as the benchmark times it (``fxopt.bench.runners.time_calls``: CUDA events
  around each call on CUDA, ``perf_counter`` on the CPU), median after warm-up: what the caller waits.
- ``host_us``: the host time to issue one call, calls back to back without synchronizing, the
  best of a few repeats (the host's speed drifts by tens of percent within seconds). Close to
  ``call_us``, the call is bound by Python and launches, not by the device.
- ``first_call_s``: a first call's wall time, device work included (compile + first run).
- ``profiled``: a cProfile of a block, printed as its N most expensive functions.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time

import torch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def call_us(fn, x, device: str, iters: int = 50, warmup: int = 10) -> float:
    """Median µs per call, as the benchmark measures it."""
    from fxopt.bench.runners import time_calls

    for _ in range(warmup):
        fn(x)
    return statistics.median(time_calls(fn, x, device, iters)) * 1e3


def host_us(fn, x, device: str, calls: int = 100, warmup: int = 5, repeats: int = 3) -> float:
    """µs of host time per call, back to back (best of ``repeats``)."""
    for _ in range(warmup):
        fn(x)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        best = min(best, (time.perf_counter() - t0) / calls)
        sync(device)
    return best * 1e6


def first_call_s(fn, x, device: str) -> float:
    """Seconds of one call, device work included (the first one: compile + run)."""
    sync(device)
    t0 = time.perf_counter()
    fn(x)
    sync(device)
    return time.perf_counter() - t0


class profiled:
    """``with profiled(rows, sort) as p: ...`` cProfiles the block when ``rows`` > 0; ``p.text`` is
    then its ``rows`` most expensive functions (``sort``: ``tottime`` own time, ``cumulative`` with
    callees), else empty."""

    def __init__(self, rows: int, sort: str = "tottime"):
        self.rows, self.sort, self.text = rows, sort, ""
        self._prof = cProfile.Profile() if rows > 0 else None

    def __enter__(self):
        if self._prof is not None:
            self._prof.enable()
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is None:
            return
        self._prof.disable()
        out = io.StringIO()
        pstats.Stats(self._prof, stream=out).sort_stats(self.sort).print_stats(self.rows)
        self.text = "\n".join(line[:160] for line in out.getvalue().strip().splitlines())
