"""CUDA graphs for compiled graphs: capture once per input signature, replay after.

This module captures and replays (``CudaGraphRunner``); the measuring of a signature's
alternatives is ``cudagraph_measure.py``, the link between a training forward's and backward's
runners ``cudagraph_training.py``; the cuda executor's entry (``backends/cuda_entry.py``) wraps a
lowered graph in a runner.

Contract (what a caller can rely on):
- The caller's tensors are never written. The first capture of a signature reads the inputs where
  they are; a later call whose inputs sit at the same addresses replays it as it is (reading them
  there at that point of the stream is what copying them there would read); a call with inputs
  elsewhere replays a capture that copies them into static buffers first. Inputs that are memory of
  this runner's own outputs are always copied, and so are all inputs of a runner whose calls come
  with new tensors each time (``inputs_move``: a size of a symbolic graph): one capture serves them.
- A returned output is never written by a later call while the caller holds it (or a view of it).
  Where the caller has released the previous call's outputs (their storages' reference counts say
  so), a replay hands out the graph's own output buffers, without a copy; while outputs are held, a
  second capture of the graph serves the call (up to ``max_instances`` captures), and beyond that a
  capture whose outputs are never handed out runs and its outputs are copied. Outputs that share
  memory with each other or with an argument are always copied. As with any tensor released to
  PyTorch's caching allocator, work on another stream that still reads a released output must be
  ordered before the next call (``record_stream`` or an event).
- Every capture has its own memory pool: a replay writes only memory its own capture allocated, so
  no replay can overwrite another capture's outputs, whatever order signatures and captures are
  called in. One exception, in training: a backward capture that reads a forward capture's saved
  values shares that forward's pool (its temporaries and gradients reuse the memory of the
  forward's temporaries, as eager's allocator would reuse it); that forward capture then replays
  only while the caller holds none of the backward's lent gradients (else another capture serves).
- Parameters and buffers are read where they live: changing them in place is seen by the next
  replay; folded weights are refreshed (in place) before each replay when a weight changed;
  replacing a parameter object (new storage) is a new signature and is captured anew.
- At most ``max_graphs`` signatures are captured; calls with further signatures run uncaptured.
- A call that repeats the previous one (same parameter and input addresses, same signature, the
  previous outputs released, no in-place change of a parameter that feeds folded constants) replays
  the same capture after that one check; anything else takes the full path above. A backward's
  saved values read in place are checked there by address alone (``CudaGraphRunner._remember``).
- Training (``training``, a ``TrainingLink``): AOTAutograd's forward and backward graphs get a runner
  each. The forward's first ``num_fwd_outputs`` outputs (what the caller sees: the model's outputs;
  BatchNorm's running statistics are written in place, below) are copied out on every call; the
  values saved for backward are lent to AOTAutograd, which releases them when the backward has run,
  and outputs that are the forward's own arguments (parameters saved for backward) are handed back
  as they are. The backward reads the saved values in place where they are the forward capture's
  lent memory (no copy of the activations), copies the incoming gradients into static buffers and
  lends its gradients: AccumulateGrad may keep one as ``.grad`` (``zero_grad(set_to_none=True)``
  releases it); while one is held, another capture serves, as for any held output. Parameters are read in place
  in both, so the optimizer's in-place updates are seen by the next replay, and GradScaler's
  unscale and inf checks run on the returned gradients as usual.
- Inputs the graph writes in place: only parameters and buffers (read in place, at fixed
  addresses), e.g. the running statistics a training forward updates (``written``). A replay writes
  them as an uncaptured run would; the runs that are not the call's own (warm-ups, timing runs)
  leave them as they found them.
- Off where unsafe: CPU inputs, graphs that write another input in place, ops that synchronize with
  the host or allocate data-dependent shapes; the reason is recorded in the report.
- Measured, not assumed: after capturing a signature, replay (with its input and output copies)
  and a plain run are timed a few times with CUDA events; if the plain run is faster (large
  activations, where the copies cost more than the launches saved), that signature runs uncaptured.
  The decision is kept in the autotuning cache (keyed by both graphs' code, the signature and the
  device): a later compile of the same graphs replays it without measuring.
- Never slower than the unoptimized graph: with a ``baseline`` (the graph as AOTAutograd handed it
  over, before any pass: PyTorch's own kernels), that graph is captured too and timed in
  alternation with the optimized one; where it is faster by more than ``margin`` the signature
  replays the baseline instead. ``decisions()`` says which one runs and the times behind it.
- Independent branches on several streams measured too (inference, option ``streams``): the graph
  captured with its branches side by side replays instead where it is faster by more than
  ``margin`` (``stream_capture.py``).
- Programmatic dependent launch measured too (inference): where the optimized capture launched
  fxopt's kernels early (each starts while its predecessor finishes, its blocks waiting on the SM),
  the graph is captured once more with those launches plain and timed with the others; it replays
  instead where it is faster by more than ``margin`` (the waiting blocks hold SM resources that
  some graphs' kernels need), as do the further captures of that signature.
- Measuring never runs the device out of memory: the baseline's capture and the plain runs each
  need about what the optimized capture took (its growth of the memory PyTorch reserves, training's
  saved activations included); where the device has less free than they would need together, or
  one of them runs out of memory all the same (or fails otherwise: an allocation failing inside a
  capture may surface as another error), the optimized graph is replayed unmeasured, and
  ``decisions()`` says why (``not_measured``; such a decision is not cached).
- Random numbers as eager draws them: the runs that are not the call's own (warm-ups before a
  capture, the timing runs) leave the CUDA generator as they found it, and a replay reads the
  generator's seed and offset as an uncaptured kernel would, so dropout draws the masks eager
  PyTorch draws at that call.
"""
from __future__ import annotations

import contextlib
import itertools
import operator
import time
import weakref
from typing import TYPE_CHECKING, Callable, Collection, Optional, Sequence

import torch
import torch.fx as fx

from fxopt.backends.cuda.compiler import programmatic_launches, without_programmatic_launch
from fxopt.backends.cuda.runtime.cudagraph_measure import (NO_PDL, RUNS, STREAMS, STREAMS_MS, Measuring,  # noqa: F401
                                                           _describe, _reserved_bytes, _side_runs, capturing, clear_by,
                                                           refuse)
from fxopt.backends.cuda.runtime.stream_capture import StreamChoice
from fxopt.passinfra import written_in_place
from fxopt.weights import _PTRS_EQUAL, WeightWatch

if TYPE_CHECKING:
    from fxopt.backends.cuda.runtime.cudagraph_training import TrainingLink

aten = torch.ops.aten

#: ops whose output shape depends on data, or which synchronize with the host
UNSAFE_OPS = {
    aten.nonzero.default, aten._local_scalar_dense.default, aten.masked_select.default,
    aten.unique_consecutive.default, aten._unique2.default, aten.item.default,
}


def unsafe_reason(gm: fx.GraphModule, kind: str, device_type: str,
                  static: Collection[str] = ()) -> Optional[str]:
    """None when CUDA graphs are safe for this graph (inference, or a training forward or
    backward), else why not. ``static``: the placeholders that hold parameters and buffers (read
    in place by every replay), which the graph may write in place."""
    if device_type != "cuda":
        return "inputs are not on CUDA"
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name not in static and written_in_place(node):
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


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _signature(args, positions) -> tuple:
    """Shape, strides and dtype of the tensors among ``args`` at ``positions`` (other values as
    they are)."""
    return tuple((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                 for a in (args[i] for i in positions))


class _Instance:
    """One capture: the graph, its static input buffers and its static outputs.

    ``input_ptrs``: the inputs the graph reads where the caller's tensors were at capture time (all
    of them for a direct capture, the backward's saved values in training), so it only serves calls
    whose inputs are at those addresses; every other input is copied into ``static_inputs``
    (``input_ptrs`` None: a buffered capture, which serves any call).
    Each output is handed out one way (``ways``): "lend" (the static output itself, as long as the
    caller has released it before the next replay), "alias" (an output that is one of the caller's
    own arguments or a view of one, in training: returned as it is), "copy" (cloned on every call:
    ``copied`` positions, outputs sharing memory with an argument or, outside training, with each
    other, and all of them without ``lend``)."""

    def __init__(self, graph, static_inputs: dict, input_ptrs: Optional[dict], outputs, args, lend: bool = True,
                 copied: frozenset = frozenset(), training: bool = False, pool=None, pool_shared: bool = False):
        self.graph, self.static_inputs, self.input_ptrs, self.outputs = graph, static_inputs, input_ptrs, outputs
        self.footprint = 0  # bytes the capture added to what the allocator reserves (set by the runner)
        self.early_launches = False  # fxopt's kernels launched early in it (set by the runner)
        self.pool, self.pool_shared = pool, pool_shared  # the memory pool; whether another capture's
        self.sharers: list = []  # weak references to the backward captures made in this pool
        flat = _flat(outputs)
        caller = {_storage(a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in static_inputs}
        buffers = {_storage(b) for b in static_inputs.values()}
        self.out_ptrs = [_storage(t) for t in flat]
        lend = lend and _USE_COUNT is not None
        ways = []
        for pos, p in enumerate(self.out_ptrs):
            if not lend or pos in copied:
                ways.append("copy")
            elif training:  # saved values may view each other or the (buffered) batch: tracked
                ways.append("alias" if p in caller else "lend")
            else:
                shared = p in caller or p in buffers or self.out_ptrs.count(p) > 1
                ways.append("copy" if shared else "lend")
        self.ways = ways
        self.lendable = bool(flat) and all(w == "lend" for w in ways)
        # the common case, a flat tuple or list (tensors among other values, none nested): handed out
        # by one map over its tensors, then the copied ones replaced (``hand_out``); None where nested
        self._plan = None
        if type(outputs) in (tuple, list) and not any(isinstance(o, (tuple, list)) for o in outputs):
            positions = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor)]
            self._plan = (positions, [outputs[i] for i in positions],
                          [i for i, w in zip(positions, ways) if w == "copy"], len(positions) == len(outputs))
        self.handed = {p for p, w in zip(self.out_ptrs, ways) if w != "copy"}
        self._storages, seen = [], set()  # one entry per lent storage
        for t, p, w in zip(flat, self.out_ptrs, ways):
            if w == "lend" and p not in seen:
                seen.add(p)
                self._storages.append(t.untyped_storage())
        # the storages' handles (valid while ``_storages`` holds them) and our own references
        self._cdatas = [st._cdata for st in self._storages]
        self._held = [_USE_COUNT(c) for c in self._cdatas]

    def free(self) -> bool:
        """Nobody but the runner references this capture's lent outputs (nor views of them), nor
        the lent outputs of a capture sharing its pool (which a replay of this one may overwrite)."""
        if not all(map(operator.le, map(_USE_COUNT, self._cdatas), self._held)):
            return False
        return not self.sharers or all(s.free() for s in self.live_sharers())

    def live_sharers(self) -> list:
        """The backward captures in this capture's pool that still exist."""
        return [s for s in (ref() for ref in self.sharers) if s is not None]

    def serves(self, args) -> bool:
        """This capture may run the call: inputs where it reads them, outputs not held."""
        if self.input_ptrs is not None:
            for i, ptr in self.input_ptrs.items():
                if args[i].data_ptr() != ptr:
                    return False
        return self.free()

    def hand_out(self):
        """The outputs of the replay that just ran, each the way ``ways`` says."""
        if self._plan is not None:
            positions, tensors, copied, only_tensors = self._plan
            if only_tensors and not copied:
                return type(self.outputs)(map(_DETACH, tensors))
            out = list(self.outputs)
            for i, t in zip(positions, map(_DETACH, tensors)):
                out[i] = t
            for i, c in zip(copied, _copies([self.outputs[i] for i in copied])):
                out[i] = c
            return type(self.outputs)(out)
        if self.lendable:
            return _lend(self.outputs)
        copies = iter(_copies([t for t, w in zip(_flat(self.outputs), self.ways) if w == "copy"]))
        ways = iter(self.ways)
        return _map_tensors(self.outputs, lambda t: next(copies) if next(ways) == "copy" else _DETACH(t))

    def run(self, args):
        """Copy the buffered inputs in, replay, hand the outputs out."""
        for i, buf in self.static_inputs.items():
            buf.copy_(args[i])
        self.graph.replay()
        return self.hand_out()


class _Entry:
    def __init__(self, fn, instance: _Instance):
        self.fn, self.instances = fn, [instance]
        self.private: Optional[_Instance] = None  # never lent: for calls while all are held
        self.use_graph = True
        self.runs = "optimized graph"
        self.timings: dict = {}
        self.pdl = True  # its captures may launch kernels early (programmatic dependent launch)


def choose(timings: dict, margin: float) -> str:
    """Which way a signature runs, from its measured times (ms): the optimized graph replayed (with
    or without programmatic dependent launch), the optimized graph uncaptured, or the baseline
    replayed. The capture without early launches and the baseline must win by more than ``margin``
    (a fraction): a tie keeps the optimized graph."""
    if "plain_ms" not in timings:  # not measured
        return "optimized graph"
    best = "optimized graph" if timings["graph_ms"] <= timings["plain_ms"] else "optimized plain"
    best_ms = min(timings["graph_ms"], timings["plain_ms"])
    plain_launch = timings.get("graph_no_pdl_ms")
    if plain_launch is not None and plain_launch < best_ms * (1.0 - margin):
        best, best_ms = NO_PDL, plain_launch
    multi = timings.get(STREAMS_MS)  # the branches on several streams: past the margin too
    if multi is not None and multi < best_ms * (1.0 - margin):
        best, best_ms = STREAMS, multi
    base = timings.get("baseline_graph_ms")
    if base is not None and base < best_ms * (1.0 - margin):
        return "baseline graph"
    return best


class CudaGraphRunner(StreamChoice, Measuring):
    def __init__(self, fn: Callable, static_indices: Sequence[int], refresh: Optional[Callable] = None,
                 max_graphs: int = 8, warmup: int = 2, watched: Optional[Sequence[int]] = None,
                 baseline: Optional[Callable] = None, baseline_watched: Optional[Sequence[int]] = None,
                 margin: float = 0.03, max_instances: int = 3, versioned: Optional[Sequence[int]] = None,
                 decisions_cache: Optional[tuple] = None, training: Optional[TrainingLink] = None,
                 written: Sequence[int] = (), streams=None, inputs_move: bool = False):
        """static_indices: parameter/buffer inputs (read in place, never copied); watched: those of
        them the graph reads (default all), checked on every call for replacement; versioned: those
        whose in-place changes ``refresh`` must see (default: all watched ones when there is a
        ``refresh``, none without). baseline: the unoptimized graph (same arguments), a candidate per
        signature; baseline_watched: the parameters it reads. decisions_cache: (AutotuneCache, device,
        graph key): a signature decided before (same graphs, same device) is not measured again, and
        a losing baseline is then not even captured. training: a ``TrainingLink`` for AOTAutograd's
        forward and backward graphs (module docstring). written: the inputs (among the static ones)
        the graph writes in place, restored after the runs that are not the call's own. streams: a
        ``stream_capture.StreamAlternative``, measured per signature (inference). inputs_move: the
        calls come with new input tensors (a size of a symbolic graph, served): the first capture of
        a signature copies them into static buffers too (inference), as every later call needs."""
        if not set(written) <= set(static_indices):
            raise ValueError(f"inputs {sorted(set(written) - set(static_indices))} are written in place but not static")
        self.fn, self.training = fn, training
        self.inputs_move = inputs_move
        self.written = sorted(written)
        self.decisions_cache = decisions_cache
        self.baseline, self.margin = baseline, margin
        self.streams = streams
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
        self.uncaptured_calls = 0
        self.refused: dict = {}  # signature -> why its capture failed (it runs uncaptured: ``refuse``)
        self.dynamic: Optional[list[int]] = None
        self._ptr_epochs: dict = {}  # parameter data pointers -> an id used in graph keys
        self._epoch = 0
        self._epoch_counter = itertools.count()
        self._last = (None, None)  # (key, entry) of the previous call: the common case repeats it
        self._lent_ptrs: set = set()  # output storages of all captures
        # the previous call's capture: (capture, key, data pointers expected at indices, indices,
        # parameter versions); a call that finds all of them unchanged and the capture's outputs
        # released replays it without further work
        self._fast: Optional[tuple] = None

    def release(self) -> int:
        """Drop every captured graph (and with them their memory pools, once the outputs lent to
        callers are gone); later calls capture again. Returns how many were dropped."""
        n = len(self.graphs)
        self.graphs.clear()
        self._last, self._fast = (None, None), None
        return n

    def _key(self, args) -> tuple:
        return (self._epoch, *_signature(args, self.dynamic))

    def _capture(self, args, fn: Callable, lend: bool = True, in_place: Sequence[int] = (),
                 share: bool = False, pdl: bool = True) -> _Instance:
        """Capture ``fn`` on ``args``, in a memory pool of its own (``share``, a backward: in the pool
        of the forward capture it reads, where that one shares with no other): the inputs at
        ``in_place`` are read where they are, the others from static buffers that each replay fills.
        ``pdl`` False: fxopt's kernels launched without programmatic dependent launch."""
        reserved = _reserved_bytes()
        static_inputs, input_ptrs = {}, {}
        call_args = list(args)
        for i in self.dynamic:
            a = args[i]
            if not isinstance(a, torch.Tensor):
                continue
            if i in in_place:
                input_ptrs[i] = a.data_ptr()
                continue
            buf = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
            buf.copy_(a)
            static_inputs[i] = call_args[i] = buf
        link = self.training
        lender = link.lender(args, in_place) if share and link is not None else None
        launches = programmatic_launches()
        with contextlib.nullcontext() if pdl else without_programmatic_launch():
            graph, outputs, pool = self._record(fn, call_args, None if lender is None else lender.pool)
        early = programmatic_launches() > launches
        inst = _Instance(graph, static_inputs, input_ptrs or None, outputs, args, lend,
                         copied=link.copied(outputs) if link is not None else frozenset(), training=link is not None,
                         pool=pool, pool_shared=lender is not None)
        if lender is not None:
            lender.sharers.append(weakref.ref(inst))
        inst.footprint = max(0, _reserved_bytes() - reserved)
        inst.early_launches = early
        self._lent_ptrs.update(inst.out_ptrs)
        return inst

    def _record(self, fn: Callable, call_args: list, pool=None):
        """(CUDA graph, its static outputs, its memory pool): ``fn`` warmed up on a side stream, then
        captured in ``pool`` (a new one by default)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), _side_runs(self.writes(call_args)):
            for _ in range(self.warmup):  # allocator and library handles settle before capture
                fn(*call_args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with capturing(graph, pool):
            outputs = fn(*call_args)
        return graph, outputs, pool

    def writes(self, args) -> list:
        """The arguments the graph writes in place."""
        return [args[i] for i in self.written]

    def _first_capture_reads(self, args) -> frozenset:
        """Which inputs the first capture of a signature reads in place. Inference: all of them,
        unless one is memory of this runner's captures (a lent output fed back in could be
        rewritten by a replay) or the calls come with new inputs each time (``inputs_move``).
        Training: the backward's saved values the forward lent; the forward's batch is copied (a new
        batch every step)."""
        if self.training is not None:
            return self.training.read_in_place(args, self.dynamic)
        if self.inputs_move or any(isinstance(args[i], torch.Tensor) and _storage(args[i]) in self._lent_ptrs
                                   for i in self.dynamic):
            return frozenset()
        return frozenset(self.dynamic)

    def handed_storages(self) -> set:
        """The storages of every output this runner's captures hand out without a copy."""
        return set().union(*(inst.handed for e in self.graphs.values() for inst in e.instances))

    def lent_storages(self) -> set:
        """The storages of the outputs this runner's captures lend (their own memory; not the
        caller's arguments they return)."""
        return {p for e in self.graphs.values() for inst in e.instances
                for p, w in zip(inst.out_ptrs, inst.ways) if w == "lend"}

    def __call__(self, *args):
        fast = self._fast
        if fast is not None:
            inst, signature, ptr_list, indices, versions, checked = fast
            if (_PTRS_EQUAL(list(args), ptr_list, indices) and inst.free()
                    and _signature(args, checked) == signature
                    and (not versions or self.watch.current_versions(args) == versions)):
                return inst.run(args)
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
                if len(self.graphs) >= self.max_graphs or key in self.refused:
                    self.uncaptured_calls += 1
                    return self.fn(*args)
                t0 = time.perf_counter()
                try:
                    inst = self._capture(args, self.fn, share=True, in_place=self._first_capture_reads(args))
                except Exception as e:  # noqa: BLE001 - a capture that fails: the signature runs uncaptured
                    return refuse(self, key, e, args)
                entry = self.graphs[key] = _Entry(self.fn, inst)
                self._decide(entry, args)
                entry.timings["capture_and_decide_s"] = round(time.perf_counter() - t0, 3)
            self._last = (key, entry)
        if not entry.use_graph:
            return self.fn(*args)
        return self._replay(entry, args, key)

    def _replay(self, entry: _Entry, args, key=None):
        for inst in entry.instances:  # the first capture that reads these inputs, outputs released
            if inst.serves(args):
                if key is not None:
                    self._remember(inst, args)
                break
        else:  # all busy, or inputs elsewhere: another capture, up to max_instances (reading in
            # place what a first capture would, in training; buffered otherwise), else the
            # capture whose outputs are never lent (copied out on every call)
            if len(entry.instances) < self.max_instances:
                reads = self._first_capture_reads(args) if self.training is not None else ()
                inst = self._capture(args, entry.fn, in_place=reads, share=True, pdl=entry.pdl)
                entry.instances.append(inst)
            else:
                if entry.private is None:
                    entry.private = self._capture(args, entry.fn, lend=False, pdl=entry.pdl)
                inst = entry.private
        return inst.run(args)

    def _remember(self, inst: _Instance, args) -> None:
        """Let the next call replay ``inst`` after one check of data pointers (parameters and
        inputs read in place, one C++ call), the signature of the other inputs and the watched
        versions. A backward's saved values read in place are checked by address alone: an address
        in memory the forward's captures lend is that capture's output, with the shape, strides and
        dtype it was captured with (each capture allocates from a pool of its own, which no other
        allocation can take while the capture lives, and AOTAutograd hands the backward its saved
        values as the forward returned them)."""
        if _PTRS_EQUAL is None or not all(isinstance(args[i], (torch.Tensor, int)) for i in self.dynamic):
            return  # a symbolic value among the arguments: the full path decides (a size as an int, as a
            # dynamic-shape graph's specialization gets them, is compared by value as the signature's part)
        ptr_list: list = [None] * len(args)
        for i, p in zip(self.watch.indices, self.watch.ptrs):
            ptr_list[i] = p
        in_place = inst.input_ptrs or {}
        for i, p in in_place.items():
            ptr_list[i] = p
        indices = sorted(set(self.watch.indices) | set(in_place))
        checked = self.dynamic
        if in_place and self.training is not None and self.training.forward is not None:
            lent = self.training.forward.lent_storages()
            checked = [i for i in self.dynamic if i not in in_place or _storage(args[i]) not in lent]
        self._fast = (inst, _signature(args, checked), ptr_list, indices,
                      self.watch.versions if self.watch.version_indices else (), checked)

    def _decision_key(self, args) -> Optional[str]:
        if self.decisions_cache is None:
            return None
        sig = [(tuple(a.shape), a.stride(), str(a.dtype)) if isinstance(a, torch.Tensor) else repr(a)
               for a in (args[i] for i in self.dynamic) if type(a) is not int]  # (sizes: in the shapes)
        return (f"cudagraph_runner|{self.decisions_cache[2]}|baseline={self.baseline is not None}|{sig}"
                + self._streams_key())

    def _decide(self, entry: _Entry, args) -> None:
        key, base, plain, multi = self._decision_key(args), None, None, None
        cached = self.decisions_cache[0].get(self.decisions_cache[1], key) if key else None
        if cached is not None and cached.get("runs") in RUNS:
            entry.timings, entry.runs = dict(cached["timings"], cached=True), cached["runs"]
        else:
            base, plain, multi, why = self._measure(entry, args)
            entry.runs = choose(entry.timings, self.margin)
            if why:
                entry.timings["not_measured"] = why
            elif key:
                self.decisions_cache[0].put(self.decisions_cache[1], key, {"runs": entry.runs, "timings": dict(
                    entry.timings), "clear_by": clear_by(entry.timings, entry.runs, self.margin)})
        entry.use_graph = entry.runs != "optimized plain"
        if entry.runs == NO_PDL:
            plain = plain or self._capture_without_early_launch(entry, args)  # a cached decision: captured now
            entry.instances, entry.pdl = plain.instances, False
        if entry.runs == "baseline graph":
            base = base or self._capture_baseline(entry, args)  # a cached decision: captured now
            entry.fn, entry.instances = base.fn, base.instances
            self._watch_baseline_params(args)
        self._keep_streams(entry, args, multi)
        # a losing baseline (or multi-stream) capture is dropped on return: its memory goes back to the pool

    def decisions(self) -> list[dict]:
        """Per captured signature: the measured times (optimized replay, optimized uncaptured and,
        with a baseline, the baseline's replay) and which one runs."""
        return [dict(e.timings, use_graph=e.use_graph, runs=e.runs, captures=len(e.instances),
                     outputs=_describe(e.instances[0].ways, {"lend": "lent", "alias": "own arguments",
                                                             "copy": "copied"}),
                     inputs=_describe(["in place"] * len(e.instances[0].input_ptrs or {})
                                      + ["copy"] * len(e.instances[0].static_inputs),
                                      {"in place": "read in place", "copy": "copied"}),
                     pool="the forward capture's" if e.instances[0].pool_shared else "own",
                     **self._stream_decision(e))
                for e in self.graphs.values()]


def _lend(outputs):
    """The static outputs as new tensor objects over the same memory (so that the caller holding
    one shows in the storage's reference count)."""
    return _map_tensors(outputs, torch.Tensor.detach)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.preserve_format)


def _copies(tensors: list) -> list:
    """Copies of ``tensors``, where outputs that share memory with each other (an output and a view
    of it, as eager returns them) share one copy of that memory, so they stay views of each other."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(_storage(t), []).append(t)
    shared = {}
    for ptr, ts in groups.items():
        if len(ts) > 1:
            shared[ptr] = ts[0].untyped_storage().clone()
    out = []
    for t in tensors:
        st = shared.get(_storage(t))
        if st is None:
            out.append(_copy(t))
        else:
            out.append(torch.empty((), dtype=t.dtype, device=t.device).set_(st, t.storage_offset(), t.size(), t.stride()))
    return out


def _copy_out(outputs):
    return _map_tensors(outputs, _copy)
