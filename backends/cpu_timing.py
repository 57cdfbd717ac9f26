"""How the cpu executor's runner (``backends/cpu.py``) times the ways a signature can run: bursts of
each way's calls in rounds (:func:`burst_medians`), and whether a decision was timed while another
process held a core (:func:`contended`)."""
from __future__ import annotations

import math
import statistics
from typing import Optional

#: the ways a signature can run: decision name -> timing key
WAY_KEYS = {"optimized graph": "optimized_ms", "baseline graph": "baseline_ms", "onnxruntime": "onnxruntime_ms",
            "onnxruntime 1 thread": "onnxruntime_1t_ms", "openvino": "openvino_ms",
            "openvino 1 thread": "openvino_1t_ms", "generated C": "generated_c_ms",
            "generated C 1 thread": "generated_c_1t_ms"}

#: a burst of calls per way and round lasts about this long (at least BURST_MIN calls, at most BURST_MAX)
BURST_MS, BURST_MIN, BURST_MAX = 5.0, 3, 20
#: a compile's burst first runs about this long of calls it does not count (at least two)
BURST_WARM_MS = 10.0
#: a way this many times slower than the fastest after a round is timed no more
OUT_OF_RACE = 3.0
#: steady bursts (packages): calls not counted, then calls timed, each about this long (at most
#: STEADY_MAX calls each)
STEADY_WARM_MS, STEADY_MS, STEADY_MAX = 20.0, 20.0, 50
#: an engine on all threads more than CONTENDED_RATIO times slower than on one, and by more than
#: CONTENDED_MS, was timed while another process held a core: the same work shared out over the
#: threads is never that much slower (a hand-off costs microseconds; the largest ratio of the
#: cached decisions of a 2-vCPU host's 369 such pairs was 1.96, for a 0.03 ms graph)
CONTENDED_RATIO, CONTENDED_MS = 2.5, 0.5


def contended(timings: dict) -> Optional[str]:
    """Why ``timings`` (a decision's) were taken while another process held a core, or None."""
    for many in ("onnxruntime", "openvino", "generated C"):
        a, b = timings.get(WAY_KEYS[many]), timings.get(WAY_KEYS[f"{many} 1 thread"])
        if a is not None and b is not None and a > CONTENDED_RATIO * b and a - b > CONTENDED_MS:
            return f"{many} took {a:.3g} ms a call on {timings.get('threads', 'all')} threads, {b:.3g} on one"
    return None


def burst_medians(fns: dict, first_ms: dict, rounds: int, close: float, max_rounds: Optional[int] = None,
                  steady: bool = False) -> tuple:
    """({key: median ms per call}, rounds run) of the functions ``fns``, timed in rounds in which
    each runs a burst of consecutive calls (``first_ms``: one call's time, for the burst's size). The
    first ``BURST_WARM_MS`` of a burst (at least two calls) are not counted, then about ``BURST_MS``
    is timed: a burst's first calls pay for the previous way's threads (a oneDNN / OpenMP pool still
    spinning while ONNX Runtime's or OpenVINO's starts, and the reverse: measured up to 10x one call
    on a loaded 2-core host) and wake the way's own workers, which a steady stream of calls of one
    way never sees (seedcnn2 b64 float32, 2 vCPUs, ONNX Runtime 1.07-1.11 ms in a loop of its own,
    OpenVINO 1.23-1.25: one call left out, OpenVINO won in 6 of 6 fresh compiles; 5 ms, in 2 of 6;
    10 ms, in 0 of 6, and in 2 of 6 in a busier hour, when one call left out still gave 6 of 6). A way
    ``OUT_OF_RACE`` times slower than the fastest after a round is timed no more (its median so far
    stands): it cannot win, and on a loaded host the oneDNN graphs' calls can take 100x their time.
    Where the two fastest are within ``close`` (relative) after ``rounds`` rounds, as many rounds
    again (up to ``max_rounds``, default twice ``rounds``): a close call on a loaded host gets more
    samples. ``steady`` (packages, measured once for every later process): each burst first runs
    about ``STEADY_WARM_MS`` of calls it does not count, then times about ``STEADY_MS`` (seedcnn b64
    float32 on a loaded 2-vCPU host: ONNX Runtime 0.97-1.87 ms in a loop of its own, 1.96-2.65 in 5
    ms bursts beside OpenVINO with one call left out, which then won at 1.25-2.06)."""
    from fxopt.autotune import wall_times

    def calls(ms: float, k: str, low: int, high: int) -> int:
        return max(low, min(high, math.ceil(ms / max(first_ms.get(k, 1.0), 1e-3))))

    if steady:
        skip = {k: calls(STEADY_WARM_MS, k, 2, STEADY_MAX) for k in fns}
        sizes = {k: skip[k] + calls(STEADY_MS, k, BURST_MIN, STEADY_MAX) for k in fns}
    else:  # about BURST_WARM_MS of calls not counted (at least two), then about BURST_MS timed
        skip = {k: calls(BURST_WARM_MS, k, 2, BURST_MAX) for k in fns}
        sizes = {k: skip[k] + calls(BURST_MS, k, BURST_MIN - 1, BURST_MAX - 1) for k in fns}
    times: dict = {k: [] for k in fns}
    active = set(fns)
    max_rounds = max_rounds or 2 * rounds
    done, target = 0, rounds
    while done < target:
        for k, fn in fns.items():
            if k in active:
                times[k] += wall_times(fn, sizes[k])[skip[k]:]
        done += 1
        medians = {k: statistics.median(ts) for k, ts in times.items()}
        best = min(medians.values())
        active = {k for k in active if medians[k] <= best * OUT_OF_RACE}
        ranked = sorted(medians.values())
        if done == target and len(ranked) > 1 and ranked[1] <= ranked[0] * (1.0 + close):
            target = min(max_rounds, target + rounds)
    return medians, done
