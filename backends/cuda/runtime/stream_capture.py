"""Independent branches on several CUDA streams inside the captured graph, as a measured alternative
of the CUDA-graph runner (``cudagraphs.py``; the plan and its interpreter are ``streams.py``).

What: with option ``streams`` = N > 0, an inference graph whose plan (``plan_streams(gm, N,
CAPTURE_MIN_US)``) moves at least one branch off stream 0 gets a second callable, ``MultiStream``
(``run_plan`` on those streams). For each input signature the runner captures the single-stream
graph as always and, while measuring it (``Measuring._measure``), captures ``MultiStream`` too; the
replays are timed in alternation with the other alternatives, and the multi-stream capture is kept
only where it is faster than the best single-stream way by more than the runner's margin (3 %,
``choose``).

The threshold: inside a capture a wait for another stream is an edge of the graph, not an event the
GPU records and waits on, and the choice is measured, so a branch (and the work it overlaps) is
worth a stream from ``CAPTURE_MIN_US`` of estimated work on. The planner's own ``MIN_US`` (2 us) is
for uncaptured runs: with it GoogLeNet fp16 at batch 1 had one branch off stream 0 (its 1x1 and 3x3
convolutions are each estimated under a microsecond; at batch 8 nineteen), with ``CAPTURE_MIN_US``
thirteen. The report lists the plan captured.

Why measured: branches side by side pay only where their kernels leave SMs idle (batch 1, small
late-stage convolutions: GoogLeNet's and Inception's modules); at large batches one branch fills the
GPU, and the extra dependencies and the kernels competing for SMs and the L2 can cost more than the
overlap gains. A tie keeps one stream.

Where it runs: the multi-stream callable runs only inside captures (its warm-ups before a capture
aside): node-by-node Python costs more than the overlap wins, so an uncaptured run is never chosen,
and without CUDA graphs (option ``cudagraphs=False``, or a graph unsafe to capture) the plan is only
listed ("not run"). Training graphs are not planned. Later captures of a signature (while its
outputs are held) capture the kept callable. The decision goes into ``decisions()`` (``streams``:
streams used, single_ms, multi_ms, which one is kept), the autotuning cache (keyed by the plan as
well) and the report's ``executor_details["streams"]`` lines (the plan's, then one per decided
signature), which ``fxopt explain`` prints.

Capture: ``torch.cuda.graph`` captures on its own stream; ``CudaStreams.begin()`` takes it as stream
0, and ``run_plan`` forks every side stream from it by an event before the side stream's first
node (a stream waiting on an event recorded in a capturing stream joins the capture: the pattern
PyTorch supports, ``side.wait_stream(torch.cuda.current_stream())`` inside ``torch.cuda.graph``) and
joins every side stream back into it before returning (a fork never joined fails the capture). The
side streams are made once per graph and kept: the warm-ups before a capture make cuBLAS's
per-stream workspaces on the very streams the capture then uses.

Memory (the rule the tests check, ``tests/test_stream_capture.py``): every read of a tensor on a
stream other than the one that made it is marked first (``record_stream``, the plan's
``cross_reads``), and every side stream is joined before the return. PyTorch's caching allocator
does the rest, inside a capture as outside: a freed block goes back to its allocation stream only
(reused by later work of that stream: in stream order, so along the captured graph's edges), a
block with recorded uses on other streams that is freed during a capture is not reused before the
capture ends (its end-of-life events are deferred until no capture is underway), and a side stream
allocates from the capture's private pool once it is forked into the capture (the pool serves
every stream capturing into that graph). So no tensor made or read on a side stream is reused
before the join, and the caller may release the inputs once the graph returned.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.runtime.cudagraph_measure import STREAMS, STREAMS_MS
from fxopt.backends.cuda.runtime.streams import CudaStreams, StreamPlan, plan_streams, run_plan

#: estimated microseconds from which a branch, and the work it overlaps, get a stream in a capture
CAPTURE_MIN_US = 0.5
#: the timings of the single-stream captures a multi-stream capture is compared with
SINGLE_KEYS = ("graph_ms", "graph_no_pdl_ms")


class MultiStream:
    """``gm`` run by ``run_plan`` on the plan's streams, called as ``gm`` is. The stream API
    (``make_api(n, device)``, default ``CudaStreams``) is made at the first call and kept."""

    def __init__(self, gm: fx.GraphModule, plan: StreamPlan, make_api: Optional[Callable] = None):
        self.gm, self.plan = gm, plan
        self.n = max(plan.assign.values(), default=0) + 1
        self.make_api = make_api or CudaStreams
        self.api = None

    def __call__(self, *args):
        if self.api is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
            self.api = self.make_api(self.n, device)
        return run_plan(self.gm, self.plan, self.api, args)


class StreamAlternative:
    """The multi-stream way of one graph as the runner sees it: ``fn`` (``multi``, wrapped as the
    runner's own callable is), the plan, ``key`` (part of the cached decisions' key) and ``lines``
    (the report's ``executor_details["streams"]``: the plan's lines, then one per decided
    signature, kept current in place)."""

    def __init__(self, multi: MultiStream, fn: Callable, lines: list):
        self.multi, self.fn, self.plan = multi, fn, multi.plan
        self.used = self.plan.streams_used
        digest = hashlib.sha256(repr((self.plan.branches, sorted(self.plan.waits.items()))).encode()).hexdigest()
        self.key = f"streams={self.used}:{digest[:12]}"
        self.lines = lines
        self._plan_lines = len(lines)
        self._decided: dict = {}

    def note(self, signature: str, decision: dict, cached: bool = False, why: Optional[str] = None) -> None:
        """Record the decision for ``signature`` in ``lines`` (one line per signature)."""
        used = f"{self.used} streams"
        if decision.get("multi_ms") is None:
            reason = why or decision.get("failed") or "not measured"
            text = f"not measured ({reason}): one stream"
        else:
            single, multi = decision["single_ms"], decision["multi_ms"]
            gain = (1.0 - multi / single) * 100.0 if single else 0.0
            kept = used if decision["kept"] == "multi" else "one stream"
            text = f"one stream {single:.3f} ms, {used} {multi:.3f} ms ({gain:+.1f} %): kept {kept}"
        self._decided[signature] = f"streams: inputs {signature}: {text}" + (" (cached decision)" if cached else "")
        del self.lines[self._plan_lines:]
        self.lines.extend(self._decided.values())


def stream_alternative(gm: fx.GraphModule, max_streams: int, wrap: Optional[Callable] = None,
                       lines: Optional[list] = None, make_api: Optional[Callable] = None):
    """The multi-stream alternative of the inference graph ``gm`` on up to ``max_streams`` streams
    (``wrap``: applied to the callable, as to the runner's own; ``lines``: the report's listing of
    the plan, replaced in place by the plan captured, then extended), or None where the plan keeps
    every kernel on stream 0."""
    if max_streams < 2:
        return None
    try:
        plan = plan_streams(gm, max_streams, CAPTURE_MIN_US)
    except Exception:  # noqa: BLE001 - the listing (executor.py) says why it was not planned
        return None
    if not plan.branches:
        return None
    multi = MultiStream(gm, plan, make_api)
    if lines is None:
        lines = []
    lines[:] = plan.describe()
    return StreamAlternative(multi, wrap(multi) if wrap is not None else multi, lines)


def not_run(lines: Optional[list], why: str) -> None:
    """The report says the plan was not run (no CUDA graphs: ``why``)."""
    if lines:
        lines.append(f"streams: not run (CUDA graphs off: {why}); the plan runs only inside a capture")


def stream_decision(timings: dict, runs: str, used: int) -> dict:
    """``decisions()``'s ``streams`` record: the streams the plan uses, the best single-stream
    capture's and the multi-stream capture's times (ms; None where not measured) and which is kept."""
    single = [timings[k] for k in SINGLE_KEYS if timings.get(k) is not None]
    out = {"used": used, "single_ms": min(single) if single else None, "multi_ms": timings.get(STREAMS_MS),
           "kept": "multi" if runs == STREAMS else "single"}
    if timings.get("streams_failed"):
        out["failed"] = timings["streams_failed"]
    return out


def _signature_text(args, positions) -> str:
    parts = [f"{tuple(a.shape)} {str(a.dtype).replace('torch.', '')}" for a in (args[i] for i in positions)
             if isinstance(a, torch.Tensor)]
    return ", ".join(parts[:3]) + (f" (+{len(parts) - 3} more)" if len(parts) > 3 else "")


class StreamChoice:
    """The multi-stream part of ``CudaGraphRunner`` (which provides ``streams``: a
    ``StreamAlternative`` or None, ``dynamic``, ``_capture`` and ``_replay``)."""

    streams: Optional[StreamAlternative] = None

    def _capture_streams(self, entry, args):
        """The signature captured with the branches on their streams (the inputs the optimized
        capture reads in place read in place), as an entry of its own."""
        reads = frozenset(entry.instances[0].input_ptrs or ())
        return type(entry)(self.streams.fn, self._capture(args, self.streams.fn, in_place=reads))

    def _streams_key(self) -> str:
        """The cached decisions' key part: which plan was measured (empty without one)."""
        return "" if self.streams is None else f"|{self.streams.key}"

    def _keep_streams(self, entry, args, multi) -> None:
        """After the decision: where the multi-stream capture won, it serves the signature (captured
        now for a cached decision), and later captures of the signature capture it; the report's
        lines get the decision."""
        if self.streams is None:
            return
        if entry.runs == STREAMS:
            multi = multi or self._capture_streams(entry, args)
            entry.fn, entry.instances = multi.fn, multi.instances
        why = entry.timings.get("not_measured")
        self.streams.note(_signature_text(args, self.dynamic), stream_decision(entry.timings, entry.runs,
                                                                               self.streams.used),
                          cached=bool(entry.timings.get("cached")), why=why if isinstance(why, str) else None)

    def _stream_decision(self, entry) -> dict:
        """``decisions()``'s ``streams`` entry (none without a multi-stream alternative)."""
        if self.streams is None:
            return {}
        return {"streams": stream_decision(entry.timings, entry.runs, self.streams.used)}
