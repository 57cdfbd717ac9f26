"""CUDA graphs for compiled inference graphs: capture once per input signature, replay after.

Contract (what a caller can rely on):
- The caller's tensors are never written. The first capture of a signature reads the inputs where
  they are; a later call whose inputs sit at the same addresses replays it as it is (reading them
  there at that point of the stream is what copying them there would read); a call with inputs
  elsewhere replays a capture that copies them into static buffers first. Inputs that are memory of
  this runner's own outputs are always copied.
- A returned output is never written by a later call while the caller holds it (or a view of it).
  Where the caller has released the previous call's outputs (their storages' reference counts say
  so), a replay hands out the graph's own output buffers, without a copy; while outputs are held, a
  second capture of the graph serves the call (up to ``max_instances`` captures), and beyond that a
  capture whose outputs are never handed out runs and its outputs are copied. Outputs that share
  memory with each other or with an argument are always copied. As with any tensor released to
  PyTorch's caching allocator, work on another stream that still reads a released output must be
  ordered before the next call (``record_stream`` or an event).
- Parameters and buffers are read where they live: changing them in place is seen by the next
  replay; folded weights are refreshed (in place) before each replay when a weight changed;
  replacing a parameter object (new storage) is a new signature and is captured anew.
- At most ``max_graphs`` signatures are captured; calls with further signatures run uncaptured.
- A call that repeats the previous one (same parameter and input addresses, same signature, the
  previous outputs released, no in-place change of a parameter that feeds folded constants) replays
  the same capture after that one check; anything else takes the full path above.
- Off where unsafe: training graphs, CPU inputs, graphs that write an input in place, ops that
  synchronize with the host or allocate data-dependent shapes; the reason is recorded in the report.
- Measured, not assumed: after capturing a signature, replay (with its input and output copies)
  and a plain run are timed a few times with CUDA events; if the plain run is faster (large
  activations, where the copies cost more than the launches saved), that signature runs uncaptured.
  The decision is kept in the autotuning cache (keyed by both graphs' code, the signature and the
  device): a later compile of the same graphs replays it without measuring.
- Never slower than the unoptimized graph: with a ``baseline`` (the graph as AOTAutograd handed it
  over, before any pass: PyTorch's own kernels), that graph is captured too and timed in
  alternation with the optimized one; where it is faster by more than ``margin`` the signature
  replays the baseline instead. ``decisions()`` says which one runs and the times behind it.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from fxopt.passinfra import written_in_place
from fxopt.weights import _PTRS_EQUAL, WeightWatch

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
        if node.op == "placeholder" and written_in_place(node):
            return f"input {node.name} is written in place"
        if node.op == "call_function" and node.target in UNSAFE_OPS:
            return f"{node.target} synchronizes or has a data-dependent shape"
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() > 0:
            return f"{node.name} produces a CPU tensor"
    return None


#: the reference count of a tensor storage (what Inductor's CUDA-graph trees use to tell whether
#: the caller still holds an output); without it outputs are always copied out
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
_DETACH = torch.Tensor.detach


def _map_tensors(outputs, fn):
    """``outputs`` (a tensor or nested lists/tuples) with ``fn`` applied to every tensor."""
    if isinstance(outputs, torch.Tensor):
        return fn(outputs)
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(_map_tensors(o, fn) for o in outputs)
    return outputs


def _flat(outputs) -> list:
    flat: list = []
    _map_tensors(outputs, flat.append)
    return flat


class _Instance:
    """One capture: the graph, its static input buffers and its static outputs.

    ``input_ptrs`` (direct captures): the graph reads the inputs where the caller's tensors were at
    capture time, so it only serves calls whose inputs are at those addresses (no copy); a buffered
    capture (``input_ptrs`` None) serves any call, copying the inputs into ``static_inputs``.
    ``lendable``: the outputs may be handed to the caller as they are (distinct storages, none shared
    with an argument), as long as the caller has released them before the next replay."""

    def __init__(self, graph, static_inputs: dict, input_ptrs: Optional[dict], outputs, args, lend: bool = True):
        self.graph, self.static_inputs, self.input_ptrs, self.outputs = graph, static_inputs, input_ptrs, outputs
        flat = _flat(outputs)
        arg_storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        arg_storages |= {b.untyped_storage().data_ptr() for b in static_inputs.values()}
        self.out_ptrs = [t.untyped_storage().data_ptr() for t in flat]
        self.lendable = (lend and _USE_COUNT is not None and bool(flat) and len(set(self.out_ptrs)) == len(flat)
                         and not set(self.out_ptrs) & arg_storages)
        self._storages = [t.untyped_storage() for t in flat] if self.lendable else []
        self._held = [_USE_COUNT(st._cdata) for st in self._storages]  # our own references

    def free(self) -> bool:
        """Nobody but the runner references this capture's outputs (nor views of them)."""
        return all(_USE_COUNT(st._cdata) <= n for st, n in zip(self._storages, self._held))

    def serves(self, args) -> bool:
        """This capture may run the call: inputs where it reads them, outputs not held."""
        if self.input_ptrs is not None:
            for i, ptr in self.input_ptrs.items():
                if args[i].data_ptr() != ptr:
                    return False
        return self.free()


class _Entry:
    def __init__(self, fn, instance: _Instance):
        self.fn, self.instances = fn, [instance]
        self.private: Optional[_Instance] = None  # never lent: for calls while all are held
        self.use_graph = True
        self.runs = "optimized graph"
        self.timings: dict = {}


def _alternating_medians(fns: dict, rounds: int = 4, runs: int = 3) -> dict:
    """Median CUDA-event ms of each function, in alternating rounds (``fxopt.autotune``)."""
    from fxopt.autotune import alternating_medians

    return alternating_medians(fns, rounds, runs, "cuda")


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
                 margin: float = 0.03, max_instances: int = 3, versioned: Optional[Sequence[int]] = None,
                 decisions_cache: Optional[tuple] = None):
        """static_indices: parameter/buffer inputs (read in place, never copied); watched: those of
        them the graph reads (default all), checked on every call for replacement; versioned: those
        whose in-place changes ``refresh`` must see (default: all watched ones when there is a
        ``refresh``, none without). baseline: the unoptimized graph (same arguments), a candidate per
        signature; baseline_watched: the parameters it reads. decisions_cache: (AutotuneCache, device,
        graph key): a signature decided before (same graphs, same device) is not measured again, and
        a losing baseline is then not even captured."""
        self.fn = fn
        self.decisions_cache = decisions_cache
        self.baseline, self.margin = baseline, margin
        self.baseline_watched = (None if baseline_watched is None
                                 else sorted(set(baseline_watched) & set(static_indices)))
        self.static = set(static_indices)
        indices = sorted(self.static if watched is None else set(watched) & self.static)
        if refresh is None:
            versioned = []
        self.versioned = indices if versioned is None else sorted(set(versioned) & self.static)
        self.watch = WeightWatch(indices, self.versioned)
        self.refresh = refresh
        self.max_graphs = max_graphs
        self.max_instances = max_instances
        self.warmup = warmup
        self.graphs: dict = {}
        self.pool = None
        self.uncaptured_calls = 0
        self.dynamic: Optional[list[int]] = None
        self._ptr_epochs: dict = {}  # parameter data pointers -> an id used in graph keys
        self._epoch = 0
        self._epoch_counter = itertools.count()
        self._last = (None, None)  # (key, entry) of the previous call: the common case repeats it
        self._lent_ptrs: set = set()  # output storages of all captures
        # the previous call, when it replayed a capture reading its inputs in place: (capture, key,
        # data pointers expected at indices, indices, parameter versions, outputs a flat tuple); a
        # call that finds all of them unchanged and the capture's outputs released replays it
        # without further work
        self._fast: Optional[tuple] = None

    def _key(self, args) -> tuple:
        key = [self._epoch]
        for i in self.dynamic:
            a = args[i]
            key.append((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a)
        return tuple(key)

    def _capture(self, args, fn: Callable, lend: bool = True, direct: bool = False) -> _Instance:
        """Capture ``fn`` on ``args``: reading the inputs where they are (direct) or from static
        buffers that each replay fills."""
        static_inputs, input_ptrs = {}, ({} if direct else None)
        call_args = list(args)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and i not in self.static:
                if direct:
                    input_ptrs[i] = a.data_ptr()
                    continue
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
        inst = _Instance(graph, static_inputs, input_ptrs, outputs, args, lend)
        self._lent_ptrs.update(inst.out_ptrs)
        return inst

    def _may_read_directly(self, args) -> bool:
        """Inputs that are not memory of this runner's captures (a lent output fed back in could be
        rewritten by a replay): a direct capture may read them in place."""
        return not any(isinstance(args[i], torch.Tensor) and args[i].untyped_storage().data_ptr() in self._lent_ptrs
                       for i in self.dynamic)

    def __call__(self, *args):
        fast = self._fast
        if fast is not None:
            inst, key, ptr_list, indices, versions, flat = fast
            if (_PTRS_EQUAL(list(args), ptr_list, indices) and inst.free() and self._key(args) == key
                    and (not versions or self.watch.current_versions(args) == versions)):
                inst.graph.replay()
                return tuple(map(_DETACH, inst.outputs)) if flat else _lend(inst.outputs)
            self._fast = None
        return self._call(args)

    def _call(self, args):
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
                t0 = time.perf_counter()
                entry = self.graphs[key] = _Entry(self.fn, self._capture(args, self.fn,
                                                                         direct=self._may_read_directly(args)))
                self._decide(entry, args)
                entry.timings["capture_and_decide_s"] = round(time.perf_counter() - t0, 3)
            self._last = (key, entry)
        if not entry.use_graph:
            return self.fn(*args)
        return self._replay(entry, args, key)

    def _replay(self, entry: _Entry, args, key=None):
        for inst in entry.instances:  # the first capture that reads these inputs, outputs released
            if inst.serves(args):
                if key is not None and inst.input_ptrs is not None and inst.lendable:
                    self._remember(inst, key, args)
                break
        else:  # all busy, or inputs elsewhere: a buffered capture, up to max_instances, else the
            # capture whose outputs are never lent (copied out on every call)
            if len(entry.instances) < self.max_instances:
                inst = self._capture(args, entry.fn)
                entry.instances.append(inst)
            else:
                if entry.private is None:
                    entry.private = self._capture(args, entry.fn, lend=False)
                inst = entry.private
        for i, buf in inst.static_inputs.items():
            buf.copy_(args[i])
        inst.graph.replay()
        return _lend(inst.outputs) if inst.lendable else _copy_out(inst.outputs)

    def _remember(self, inst: _Instance, key: tuple, args) -> None:
        """Let the next call replay ``inst`` after one check of data pointers (parameters and
        inputs, one C++ call), the signature key and the watched versions."""
        if _PTRS_EQUAL is None or not all(isinstance(args[i], torch.Tensor) for i in self.dynamic):
            return  # symbolic sizes among the arguments: the full path decides
        ptr_list: list = [None] * len(args)
        for i, p in zip(self.watch.indices, self.watch.ptrs):
            ptr_list[i] = p
        for i, p in inst.input_ptrs.items():
            ptr_list[i] = p
        indices = sorted(set(self.watch.indices) | set(inst.input_ptrs))
        flat = type(inst.outputs) is tuple and all(isinstance(o, torch.Tensor) for o in inst.outputs)
        self._fast = (inst, key, ptr_list, indices, self.watch.versions if self.watch.version_indices else (), flat)

    def _decision_key(self, args) -> Optional[str]:
        if self.decisions_cache is None:
            return None
        sig = [(tuple(a.shape), a.stride(), str(a.dtype)) if isinstance(a, torch.Tensor) else repr(a)
               for a in (args[i] for i in self.dynamic)]
        return f"cudagraph_runner|{self.decisions_cache[2]}|baseline={self.baseline is not None}|{sig}"

    def _decide(self, entry: _Entry, args) -> None:
        key, base = self._decision_key(args), None
        cached = self.decisions_cache[0].get(self.decisions_cache[1], key) if key else None
        if cached is not None and cached.get("runs") in ("optimized graph", "optimized plain", "baseline graph"):
            entry.timings, entry.runs = dict(cached["timings"], cached=True), cached["runs"]
        else:
            fns = {"graph_ms": lambda: self._replay(entry, args), "plain_ms": lambda: self.fn(*args)}
            if self.baseline is not None:
                base = self._capture_baseline(entry, args)
                fns["baseline_graph_ms"] = lambda: self._replay(base, args)
            entry.timings = _alternating_medians(fns)
            entry.runs = choose(entry.timings, self.margin)
            if key:
                self.decisions_cache[0].put(self.decisions_cache[1], key,
                                            {"runs": entry.runs, "timings": dict(entry.timings)})
        entry.use_graph = entry.runs != "optimized plain"
        if entry.runs == "baseline graph":
            base = base or self._capture_baseline(entry, args)  # a cached decision: captured now
            entry.fn, entry.instances = base.fn, base.instances
            self._watch_baseline_params(args)
        # a losing baseline capture is dropped on return: its memory goes back to the pool

    def _capture_baseline(self, entry: _Entry, args) -> _Entry:
        direct = entry.instances[0].input_ptrs is not None
        return _Entry(self.baseline, self._capture(args, self.baseline, direct=direct))

    def _watch_baseline_params(self, args) -> None:
        """The baseline reads parameters the optimized graph folded away (BatchNorm statistics...):
        from now on the per-call watch covers them too, keeping the current graph key."""
        if self.baseline_watched is None or set(self.baseline_watched) <= set(self.watch.indices):
            return
        self.watch = WeightWatch(sorted(set(self.watch.indices) | set(self.baseline_watched)), self.versioned)
        self.watch.check(args)
        self._ptr_epochs[self.watch.ptrs] = self._epoch

    def decisions(self) -> list[dict]:
        """Per captured signature: the measured times (optimized replay, optimized uncaptured and,
        with a baseline, the baseline's replay) and which one runs."""
        return [dict(e.timings, use_graph=e.use_graph, runs=e.runs, captures=len(e.instances),
                     outputs="lent" if e.instances[0].lendable else "copied",
                     inputs="read in place" if e.instances[0].input_ptrs is not None else "copied")
                for e in self.graphs.values()]


def _lend(outputs):
    """The static outputs as new tensor objects over the same memory (so that the caller holding
    one shows in the storage's reference count)."""
    return _map_tensors(outputs, torch.Tensor.detach)


def _copy_out(outputs):
    return _map_tensors(outputs, lambda t: t.clone(memory_format=torch.preserve_format))
