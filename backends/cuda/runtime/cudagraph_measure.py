"""Measuring a captured signature against its alternatives (``cudagraphs.py``'s contract: "Measured,
not assumed", "Never slower than the unoptimized graph", "Programmatic dependent launch measured
too", "Measuring never runs the device out of memory", "Random numbers as eager draws them").

``Measuring`` is the part of ``CudaGraphRunner`` that captures the alternatives of a signature (the
unoptimized baseline, the capture without early launches) and times them against the optimized
replay and the plain run; ``CudaGraphRunner._decide`` (``cudagraphs.py``) chooses from the times
(``choose``) and keeps the decision.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Sequence

import torch

from fxopt.weights import WeightWatch


@contextlib.contextmanager
def _side_runs(written: Sequence[torch.Tensor] = ()):
    """Runs that are not the call's own (warm-ups before a capture, timing runs) leave the CUDA
    generator (seed and offset) of the current device as they found it, and the inputs the graph
    writes in place (``written``: BatchNorm's running statistics in a training forward) as they
    were: each is copied before and copied back after, on the current stream."""
    state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    saved = [t.clone() for t in written]
    try:
        yield
    finally:
        for t, v in zip(written, saved):
            t.copy_(v)
        if state is not None:
            torch.cuda.set_rng_state(state)


@contextlib.contextmanager
def capturing(graph, pool):
    """``torch.cuda.graph(graph, pool=pool)``, except that a capture that fails (an operation a
    capture does not permit, an allocation failing inside it) leaves the CUDA generators usable.
    A capture registers the device's default generator, which counts its offsets inside the graph
    from then on; a capture whose end fails never hands the generator back, and every later random
    op or capture in the process fails ("Offset increment outside graph capture"). An empty capture
    after the failure hands it back; the generator's seed and offset are those from before."""
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    except BaseException:
        _release_generators()
        raise


def _release_generators() -> None:
    if torch.cuda.is_current_stream_capturing():
        return  # inside another capture: its end hands the generators back
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass
        except Exception:  # noqa: BLE001 - the original error is the one raised
            pass


def _reserved_bytes() -> int:
    """Memory PyTorch's caching allocator holds on the current device (0 without CUDA)."""
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


def _free_bytes() -> float:
    """Memory a new allocation can get on the current device: free on the device, plus what the
    caching allocator holds unused (it releases that before failing); unbounded without CUDA."""
    if not torch.cuda.is_available():
        return float("inf")
    return torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def _alternating_medians(fns: dict, rounds: int = 4, runs: int = 3) -> dict:
    """Median CUDA-event ms of each function, in alternating rounds (``fxopt.autotune``)."""
    from fxopt.autotune import alternating_medians

    return alternating_medians(fns, rounds, runs, "cuda")


def median_ms(fn, runs: int = 5) -> float:
    return _alternating_medians({"t": fn}, rounds=1, runs=runs)["t"]


NO_PDL = "optimized graph, no early launch"
#: the optimized graph captured with its branches on several streams (``stream_capture.py``)
STREAMS = "optimized graph, multi-stream"
STREAMS_MS = "streams_graph_ms"
RUNS = ("optimized graph", "optimized plain", "baseline graph", NO_PDL, STREAMS)
#: each way to run, the timing it is chosen by; the ways ``choose`` lets win only past its margin
_TIMING_OF = {"optimized graph": "graph_ms", "optimized plain": "plain_ms", "baseline graph": "baseline_graph_ms",
              NO_PDL: "graph_no_pdl_ms", STREAMS: STREAMS_MS}
_PAST_MARGIN = ("baseline graph", NO_PDL, STREAMS)


def clear_by(timings: dict, runs: str, margin: float):
    """How clearly ``runs`` won (stored with the decision; ``fxopt.dynamic_buckets.verdict``): the
    fastest alternative's time over the chosen way's, where the chosen way is the optimized graph an
    alternative that must win past ``margin`` counted at its time over ``1 - margin``; None where the
    way's time was not measured."""
    mine = timings.get(_TIMING_OF.get(runs, ""))
    if not isinstance(mine, (int, float)) or mine <= 0:
        return None
    alts = []
    for way, name in _TIMING_OF.items():
        t = timings.get(name)
        if way != runs and isinstance(t, (int, float)) and t > 0:
            alts.append(t / (1.0 - margin) if runs == "optimized graph" and way in _PAST_MARGIN else t)
    return round(min(alts) / mine, 4) if alts else float("inf")


def refuse(runner, key, error: Exception, args):
    """A signature whose capture failed (an operation a capture does not permit, a library that
    fails inside one: GPU fuzz seeds 51, 62, 63) runs uncaptured from then on, as the graph's own
    plain call: the warm-up runs before the capture left the inputs and the CUDA generator as they
    were (``_side_runs``) and the failed capture handed the generator back (``capturing``), so the
    call is the one the caller made. One warning per runner; the reason is in ``runner.refused``.
    An error of the plain call itself is the caller's."""
    why = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
    if not runner.refused:
        warnings.warn(f"fxopt: capturing a CUDA graph failed ({why}); this input signature runs uncaptured",
                      stacklevel=3)
    runner.refused[key] = why
    runner.uncaptured_calls += 1
    return runner.fn(*args)


def _describe(ways: list, names: dict) -> str:
    """"lent" where all are lent, else e.g. "12 lent, 2 copied"."""
    counts = {w: ways.count(w) for w in names if w in ways}
    if len(counts) <= 1:
        return names[next(iter(counts))] if counts else "none"
    return ", ".join(f"{n} {names[w]}" for w, n in counts.items())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}"


class Measuring:
    """The measuring half of ``CudaGraphRunner`` (which provides ``fn``, ``baseline``, ``training``,
    ``watch``, ``streams``, ``_capture``, ``_capture_streams``, ``_replay`` and ``writes``)."""

    def _measure(self, entry, args) -> tuple:
        """Time the optimized replay against the plain run, the replay without early launches, the
        baseline's replay and the multi-stream replay into ``entry.timings``: (the baseline's capture
        or None, the capture without early launches or None, the multi-stream capture or None, why
        the others were not timed or None). A multi-stream capture that fails is left out alone
        (``timings["streams_failed"]``): the other alternatives are timed all the same."""
        early = self.training is None and entry.instances[0].early_launches
        multi_on = getattr(self, "streams", None) is not None
        need = entry.instances[0].footprint * (1 + (self.baseline is not None) + early + multi_on)
        free = _free_bytes()
        if need > free:
            entry.timings = {}
            return None, None, None, (f"the plain run and the other captures would need about {need / 2**20:.0f} "
                                      f"MiB, {free / 2**20:.0f} MiB free")
        base = plain = multi = None
        failed = None
        fns = {"graph_ms": lambda: self._replay(entry, args), "plain_ms": lambda: self.fn(*args)}
        try:
            if early:
                plain = self._capture_without_early_launch(entry, args)
                fns["graph_no_pdl_ms"] = lambda: self._replay(plain, args)
            if self.baseline is not None:
                base = self._capture_baseline(entry, args)
                fns["baseline_graph_ms"] = lambda: self._replay(base, args)
            if multi_on:
                try:
                    multi = self._capture_streams(entry, args)
                    fns[STREAMS_MS] = lambda: self._replay(multi, args)
                except torch.OutOfMemoryError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a capture on several streams refused: one stream
                    failed = _first_line(exc)
            with _side_runs(self.writes(args)):
                entry.timings = _alternating_medians(fns)
            if failed:
                entry.timings["streams_failed"] = failed
        except torch.OutOfMemoryError:
            base = plain = multi = fns = None  # the other captures' and the plain runs' memory go back
            entry.timings = {}
            torch.cuda.empty_cache()
            return None, None, None, "out of memory while measuring the plain run and the other captures"
        except Exception as exc:  # noqa: BLE001 - e.g. an allocation failing inside a capture, raised as
            # another error: the optimized capture, made and checked before, is kept
            base = plain = multi = fns = None
            entry.timings = {}
            return None, None, None, f"measuring failed ({_first_line(exc)})"
        return base, plain, multi, None

    def _capture_without_early_launch(self, entry, args):
        reads = frozenset(entry.instances[0].input_ptrs or ())
        plain = type(entry)(self.fn, self._capture(args, self.fn, in_place=reads, pdl=False))
        plain.pdl = False
        return plain

    def _capture_baseline(self, entry, args):
        reads = frozenset(entry.instances[0].input_ptrs or ())
        return type(entry)(self.baseline, self._capture(args, self.baseline, in_place=reads))

    def _watch_baseline_params(self, args) -> None:
        """The baseline reads parameters the optimized graph folded away (BatchNorm statistics...):
        from now on the per-call watch covers them too, keeping the current graph key."""
        if self.baseline_watched is None or set(self.baseline_watched) <= set(self.watch.indices):
            return
        self.watch = WeightWatch(sorted(set(self.watch.indices) | set(self.baseline_watched)), self.versioned)
        self.watch.check(args)
        self._ptr_epochs[self.watch.ptrs] = self._epoch
