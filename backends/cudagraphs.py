"""CUDA graphs for compiled inference graphs: capture once per input signature, replay after.

Contract (what a caller can rely on):
- Inputs are copied into static buffers before each replay; the caller's tensors are never written.
- Returned outputs are fresh tensors on every call (copied out of the graph's static outputs), so a
  later call never overwrites a tensor the caller already holds.
- Parameters and buffers are read where they live: changing them in place is seen by the next
  replay; folded weights are refreshed (in place) before each replay when a weight changed;
  replacing a parameter object (new storage) is a new signature and is captured anew.
- At most ``max_graphs`` signatures are captured; calls with further signatures run uncaptured.
- Off where unsafe: training graphs, CPU inputs, ops that synchronize with the host or allocate
  data-dependent shapes; the reason is recorded in the report.
- Measured, not assumed: after capturing a signature, replay (with its input and output copies)
  and a plain run are timed a few times with CUDA events; if the plain run is faster (large
  activations, where the copies cost more than the launches saved), that signature runs uncaptured.
- Never slower than the unoptimized graph: with a ``baseline`` (the graph as AOTAutograd handed it
  over, before any pass: PyTorch's own kernels), that graph is captured too and timed in
  alternation with the optimized one; where it is faster by more than ``margin`` the signature
  replays the baseline instead. ``decisions()`` says which one runs and the times behind it.
"""
from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from fxopt.weights import WeightWatch

aten = torch.ops.aten

#: ops whose output shape depends on data, or which synchronize with the host
UNSAFE_OPS = {
    aten.nonzero.default, aten._local_scalar_dense.default, aten.masked_select.default,
    aten.unique_consecutive.default, aten._unique2.default, aten.item.default,
}


def unsafe_reason(gm: fx.GraphModule, kind: str, device_type: str) -> Optional[str]:
    """None when CUDA graphs are safe for this graph, else why not."""
    if kind != "inference":
        return "training graph"
    if device_type != "cuda":
        return "inputs are not on CUDA"
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in UNSAFE_OPS:
            return f"{node.target} synchronizes or has a data-dependent shape"
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() > 0:
            return f"{node.name} produces a CPU tensor"
    return None


class _Entry:
    def __init__(self, graph, static_inputs, outputs):
        self.graph, self.static_inputs, self.outputs = graph, static_inputs, outputs
        self.use_graph = True
        self.runs = "optimized graph"
        self.timings: dict = {}


def _alternating_medians(fns: dict, rounds: int = 4, runs: int = 3) -> dict:
    """Median CUDA-event ms of each function, timed in alternating rounds so that a drifting host
    or clock affects every candidate alike."""
    from fxopt.autotune import cuda_event_times

    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name] += cuda_event_times(fn, runs)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def _median_ms(fn, runs: int = 5) -> float:
    return _alternating_medians({"t": fn}, rounds=1, runs=runs)["t"]


def choose(timings: dict, margin: float) -> str:
    """Which way a signature runs, from its measured times (ms): the optimized graph replayed, the
    optimized graph uncaptured, or the baseline replayed. The baseline must win by more than
    ``margin`` (a fraction): a tie keeps the optimized graph."""
    best = "optimized graph" if timings["graph_ms"] <= timings["plain_ms"] else "optimized plain"
    best_ms = min(timings["graph_ms"], timings["plain_ms"])
    base = timings.get("baseline_graph_ms")
    if base is not None and base < best_ms * (1.0 - margin):
        return "baseline graph"
    return best


class CudaGraphRunner:
    def __init__(self, fn: Callable, static_indices: Sequence[int], refresh: Optional[Callable] = None,
                 max_graphs: int = 8, warmup: int = 2, watched: Optional[Sequence[int]] = None,
                 baseline: Optional[Callable] = None, baseline_watched: Optional[Sequence[int]] = None,
                 margin: float = 0.03):
        """static_indices: parameter/buffer inputs (read in place, never copied); watched: those of
        them the graph reads (default all), checked on every call. baseline: the unoptimized graph
        (same arguments), a candidate per signature; baseline_watched: the parameters it reads."""
        self.fn = fn
        self.baseline, self.margin = baseline, margin
        self.baseline_watched = None if baseline_watched is None else sorted(set(baseline_watched) & set(static_indices))
        self.static = set(static_indices)
        self.watch = WeightWatch(sorted(self.static if watched is None else set(watched) & self.static))
        self.refresh = refresh
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.graphs: dict = {}
        self.pool = None
        self.uncaptured_calls = 0
        self.dynamic: Optional[list[int]] = None
        self._ptr_epochs: dict = {}  # parameter data pointers -> an id used in graph keys
        self._epoch = 0
        self._epoch_counter = itertools.count()
        self._last = (None, None)  # (key, entry) of the previous call: the common case repeats it

    def _key(self, args) -> tuple:
        key = [self._epoch]
        for i in self.dynamic:
            a = args[i]
            key.append((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a)
        return tuple(key)

    def _capture(self, args, fn: Optional[Callable] = None) -> _Entry:
        fn = self.fn if fn is None else fn
        static_inputs = {}
        call_args = list(args)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and i not in self.static:
                buf = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                buf.copy_(a)
                static_inputs[i] = buf
                call_args[i] = buf
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):  # allocator and library handles settle before capture
                fn(*call_args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*call_args)
        return _Entry(graph, static_inputs, outputs)

    def __call__(self, *args):
        if self.dynamic is None:
            self.dynamic = [i for i in range(len(args)) if i not in self.static]
        ptrs_changed, changed = self.watch.check(args)
        if changed and self.refresh is not None:
            self.refresh(args)  # re-folds constants, in place, when a weight changed
        if ptrs_changed:
            if len(self._ptr_epochs) > 64:  # parameters replaced over and over: forget old sets
                self._ptr_epochs.clear()
            epoch = self._ptr_epochs.get(self.watch.ptrs)
            if epoch is None:
                epoch = self._ptr_epochs[self.watch.ptrs] = next(self._epoch_counter)
            self._epoch = epoch
        key = self._key(args)
        last_key, entry = self._last
        if key != last_key:
            entry = self.graphs.get(key)
            if entry is None:
                if len(self.graphs) >= self.max_graphs:
                    self.uncaptured_calls += 1
                    return self.fn(*args)
                entry = self.graphs[key] = self._capture(args)
                self._decide(entry, args)
            self._last = (key, entry)
        if not entry.use_graph:
            return self.fn(*args)
        return self._replay(entry, args)

    def _replay(self, entry: _Entry, args):
        for i, buf in entry.static_inputs.items():
            buf.copy_(args[i])
        entry.graph.replay()
        return _copy_out(entry.outputs)

    def _decide(self, entry: _Entry, args) -> None:
        fns = {"graph_ms": lambda: self._replay(entry, args), "plain_ms": lambda: self.fn(*args)}
        base = None
        if self.baseline is not None:
            base = self._capture(args, self.baseline)
            fns["baseline_graph_ms"] = lambda: self._replay(base, args)
        entry.timings = _alternating_medians(fns)
        entry.runs = choose(entry.timings, self.margin)
        entry.use_graph = entry.runs != "optimized plain"
        if entry.runs == "baseline graph":
            entry.graph, entry.static_inputs, entry.outputs = base.graph, base.static_inputs, base.outputs
            self._watch_baseline_params(args)
        # a losing baseline capture is dropped on return: its memory goes back to the pool

    def _watch_baseline_params(self, args) -> None:
        """The baseline reads parameters the optimized graph folded away (BatchNorm statistics...):
        from now on the per-call watch covers them too, keeping the current graph key."""
        if self.baseline_watched is None or set(self.baseline_watched) <= set(self.watch.indices):
            return
        self.watch = WeightWatch(sorted(set(self.watch.indices) | set(self.baseline_watched)))
        self.watch.check(args)
        self._ptr_epochs[self.watch.ptrs] = self._epoch

    def decisions(self) -> list[dict]:
        """Per captured signature: the measured times (optimized replay, optimized uncaptured and,
        with a baseline, the baseline's replay) and which one runs."""
        return [dict(e.timings, use_graph=e.use_graph, runs=e.runs) for e in self.graphs.values()]


def _copy_out(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs.clone(memory_format=torch.preserve_format)
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(_copy_out(o) for o in outputs)
    return outputs
