"""The cpu executor's runner and decisions timed while another process held a core
(``backends/cpu_timing.contended``): timed once more, and, if still so, run in this process but not
kept for later ones; such a decision found in the cache is timed again (a package's is kept: it must
carry one)."""
from __future__ import annotations

import time

import pytest
import torch

from fxopt.autotune import AutotuneCache
from fxopt.backends import cpu
from fxopt.backends.cpu_timing import CONTENDED_MS, CONTENDED_RATIO, contended

pytestmark = pytest.mark.skipif(cpu.onednn_available() is not None, reason=str(cpu.onednn_available()))


def _slow(ms, tag: str, calls: list = None):
    """A way taking ``ms`` (a number or a function giving it) a call; every way's output is the same."""
    def fn(*args):
        if calls is not None:
            calls.append(tag)
        time.sleep((ms() if callable(ms) else ms) / 1e3)
        return "same"

    return fn


def test_contended_needs_both_a_ratio_and_milliseconds():
    far = {"generated_c_ms": 8.0, "generated_c_1t_ms": 1.6, "threads": 2}
    assert "generated C took 8 ms" in contended(far)
    # a tiny graph's hand-off: twice as slow on two threads, but by microseconds
    assert contended({"onnxruntime_ms": 0.1, "onnxruntime_1t_ms": 0.03}) is None
    # slower on all threads by milliseconds, but within the ratio (a large graph on a busy core)
    assert contended({"openvino_ms": 30.0, "openvino_1t_ms": 20.0}) is None
    assert contended({"openvino_ms": CONTENDED_RATIO * 2.0 + 0.01, "openvino_1t_ms": 2.0}) is not None
    assert CONTENDED_MS > 0 and contended({"optimized_ms": 9.0, "baseline_ms": 1.0}) is None
    assert contended({"generated_c_ms": 5.0}) is None  # one of the pair missing


def _runner(cache, all_threads_ms, calls=None):
    return cpu.CpuRunner(_slow(30, "optimized"), None, static_indices=[], rounds=2, margin=0.1,
                         decisions_cache=cache, generated_c=_slow(all_threads_ms, "all", calls),
                         generated_c_1t=_slow(4, "one", calls))


def test_a_decision_timed_in_a_busy_moment_is_timed_again_and_not_kept(tmp_path):
    cache = (AutotuneCache.for_option(str(tmp_path / "tune.json")), "cpu-test", "code")
    state = {"ms": 40.0}
    first = _runner(cache, lambda: state["ms"])
    first._measure = _once_busy(first._measure, state)  # quiet again for the second timing
    first(torch.ones(2))
    d = first.decisions()[0]
    assert d["runs"] == "generated C" and "contended_first" in d and "not_cached" not in d
    calls = []
    again = _runner(cache, 1, calls)
    again(torch.ones(2))
    assert calls == ["all"]  # the quiet decision was kept: no timing
    assert again.decisions()[0]["cached"] is True

    other = (AutotuneCache.for_option(str(tmp_path / "busy.json")), "cpu-test", "code")
    busy = _runner(other, 40)
    busy(torch.ones(2))  # busy both times: one thread runs here ...
    d = busy.decisions()[0]
    assert d["runs"] == "generated C 1 thread" and "another process held a core" in d["not_cached"]
    calls = []
    later = _runner(other, 1, calls)  # ... and a later process times it again
    later(torch.ones(2))
    assert later.decisions()[0]["runs"] == "generated C" and "cached" not in later.decisions()[0] and len(calls) > 2


def _once_busy(measure, state):
    def wrapped(args):
        out = measure(args)
        state["ms"] = 1.0
        return out

    return wrapped


def test_a_busy_decision_found_in_the_cache_is_timed_again_and_a_package_keeps_its_own(tmp_path):
    cache = (AutotuneCache.for_option(str(tmp_path / "tune.json")), "cpu-test", "code")
    first = _runner(cache, 1)
    first(torch.ones(2))
    key = first._cache_key(first._signature((torch.ones(2),)))
    cache[0].put(cache[1], key, {"runs": "generated C 1 thread", "generated_c_ms": 40.0, "generated_c_1t_ms": 4.0,
                                 "optimized_ms": 30.0, "threads": 2})
    calls = []
    again = _runner(cache, 1, calls)
    again(torch.ones(2))
    assert again.decisions()[0]["runs"] == "generated C" and len(calls) > 2 and "cached" not in again.decisions()[0]

    steady = cpu.CpuRunner(_slow(30, "optimized"), None, static_indices=[], rounds=2, margin=0.1,
                           decisions_cache=cache, generated_c=_slow(40, "all"), generated_c_1t=_slow(4, "one"),
                           steady=True)
    steady(torch.ones(2))
    d = steady.decisions()[0]
    assert d["runs"] == "generated C 1 thread" and "contended_first" in d
    assert "not_cached" not in d and cache[0].get(cache[1], steady._cache_key(steady._signature((torch.ones(2),))))
