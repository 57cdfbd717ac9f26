"""Dynamic shapes: one Dynamo graph and one pass-pipeline run for every size, lowered per size lazily.

Dynamo hands a backend a graph with symbolic sizes after it saw a second size (automatic dynamic),
under ``torch.compile(dynamic=True)`` or for dimensions marked with ``torch._dynamo.mark_dynamic``.
Every size a pass or an executor reads as an int adds a guard to Dynamo's shape environment, and a
guard such as ``Eq(s0, 2)`` specializes the graph back: Dynamo recompiles at every new size, and
after its recompile limit runs new sizes eagerly. So a symbolic inference graph takes another path,
and so do a symbolic forward and backward for the cuda executor, whose kernels need concrete sizes
(``dynamic=True``, ``mark_dynamic``, or automatic dynamic's graph of an epoch's smaller last batch;
lowered symbolically, fewer ops fused: a resnet18 backward under ``dynamic=True`` 22 regions against
31-32 static, H200). BatchNorm's cuDNN reserve-space query, which reads concrete sizes, runs with
guards suppressed in fxopt's propagation (``fxopt.fakeprop.FakeProp``), so a training graph with
BatchNorm stays symbolic (Dynamo's shape environment gets no ``Eq(s, n)``). A training graph
is never padded; its backward's CUDA-graph runners read what the forward's runner of their size
lent (``SizeRunners``); a backward whose sizes are expressions of symbols is lowered symbolically,
as before (the end of this docstring). The path:

1. ``PrivateShapes``: the graph's fake inputs rebuilt in a shape environment of fxopt's own, one
   private symbol per Dynamo symbol (the same hints), and the graph re-propagated there. What the
   passes read of the sizes adds guards to that environment, never to Dynamo's.
2. The pass pipeline runs once on that symbolic graph (``fxopt.pipeline.run_pipeline``).
3. ``SizeDispatcher`` is what Dynamo calls. At the first call of a concrete size (the values of the
   private symbols, read from the arguments) it checks the guards the passes added against that size,
   makes the optimized graph static at it with the mechanism a package uses for a batch size
   (``fxopt.package_batch.specialise_at``: every node's value evaluated from the expressions the
   symbolic graph holds, checked once against FakeTensor propagation at the first size) and lowers it with the executor (its kernels, measured
   choices and CUDA-graph runner); the result is cached per size. A size where a guard fails gets
   the passes run again at that size (the reason is recorded); it still never runs eagerly.
   At most ``max_specializations`` sizes stay lowered: the least called one that no padded size
   runs on is dropped (its CUDA graphs released) and lowered again if it comes back.
4. Buckets (``fxopt.dynamic_buckets``): every symbolic size falls in a power-of-two bucket (batch
   5..8, side 129..256). The choices the first lowering in a bucket measured are reused by every
   later lowering in it, and the first takes what the user's cache holds for another batch of its
   bucket, the static graph of Dynamo's first size's. Another graph of the same model at inputs of
   the bucket (Dynamo's graph for a new image size, sides symbolic) replays the bucket an earlier
   graph lowered while that graph lives (``dynamic_buckets.bucket_choices``), else takes what it
   measured from the user's cache (nothing measured at a second size of a bucket; with the sides
   bucketed too, the image phase of a serving loop over sides 192/224/256 compiled in 28.8 s where
   each side measuring its own took 34.7 and 43.3 s, H200, BENCHMARKS.md). A new batch bucket's first lowering takes the choices that are clear at the buckets of other batches
   measured before (``BucketChoices.neighbours``), and measures the rest without the candidates
   that lost by far there (``losers``). A later
   lowering of a bucket also takes its first's CUDA-graph decision, so the unoptimized graph at its size (the
   never-slower baseline, ``fxopt.backends.lowering.DeferredGraph``) is never made there; and its CUDA graph
   copies the inputs in from the first capture (``PassContext.per_size``: a serving loop's calls bring new
   tensors), one capture a size rather than one reading the first call's tensors and a second for the rest
   (resnet18, 19 lowerings, H100: 28 captures and 21 specializations where there were 45 and 36). Where the graph is
   batch-independent (``fxopt.batch_independence``; option ``dynamic_padding``), a new batch size does not wait for a
   lowering: it runs on the smallest lowered larger batch, padded, its outputs' first rows
   returned; larger than every lowered batch, it runs in chunks of lowered batches (the largest
   repeatedly, the rest padded), each chunk's outputs copied into their rows of outputs of the
   whole batch before the next chunk runs (a CUDA-graph replay reuses its output buffers). Only
   the first call at an image size (or a graph whose outputs cannot be joined so) lowers a size
   for a new batch: the bucket top of the largest batch called so far, which then serves every
   batch at that image size. At its ``specialize_after + 1``-th call a size's own specialization
   is lowered and takes over (a size evicted before needs that many calls more each time). When
   ``max_specializations`` sizes are lowered, a padded or chunked size is admitted only if it was
   called ``ADMIT_FACTOR`` times as often as the least called lowered size that serves no other
   (no size padded onto it, not the largest lowered batch at its image size), which it then
   replaces; else it stays padded or chunked. Sizes drawn at random (a serving loop over batch
   1-64 with the bound at 16) would otherwise keep displacing each other, each lowered again and
   again (228 evictions in 1,000 calls; over three image sizes, 713).

What cannot be rebuilt symbolically (a size that is an expression of symbols, inputs whose strides
are neither contiguous nor channels_last) takes today's path, specialized by the passes, and the
report says why (``executor_details["dynamic"]``).
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Optional

import torch
import torch.fx as fx


#: a padded size replaces a lowered one when the bound is full only if called this many times as often
ADMIT_FACTOR = 1.5


class Unsupported(Exception):
    """The graph cannot run the symbolic path (the message says why)."""


def _is_sym(x) -> bool:
    return isinstance(x, torch.SymInt) and not isinstance(x.node.maybe_as_int(), int)


def has_symbols(fake_args) -> bool:
    """Whether any input (a tensor's size or stride, or a size input) is symbolic."""
    for a in fake_args:
        if isinstance(a, torch.Tensor):
            if any(_is_sym(d) for d in (*a.shape, *a.stride())):
                return True
        elif _is_sym(a):
            return True
    return False


def _dense_strides(sizes: list, order: list) -> list:
    """Strides (sympy) of a dense tensor whose dimensions are laid out innermost-first by ``order``."""
    import sympy

    strides, acc = [None] * len(sizes), sympy.Integer(1)
    for d in order:
        strides[d] = acc
        acc = acc * sizes[d]
    return strides


class PrivateShapes:
    """Dynamo's symbolic fake inputs rebuilt in fxopt's own shape environment (module docstring)."""

    def __init__(self, fake_args: list):
        import sympy
        from torch._dynamo.source import ConstantSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        # sizes equal at the traced ones are not assumed equal; a size traced at 0 or 1 stays a symbol
        # (Dynamo hands such a graph over under backed_size_oblivious: specialized here, the values
        # stored for other sizes were those of batch 1, and batch 8 ran on them past its buffers)
        self.shape_env = ShapeEnv(duck_shape=False, specialize_zero_one=False)
        self.mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True)
        self.symbols: dict = {}  # Dynamo's symbol -> (private SymInt, private sympy symbol)
        self.where: dict = {}  # private symbol name -> (argument index, dim or None for a size input)
        self.dims: list[str] = []  # "input 0 dim 0 (s0, traced at 2)", for the report

        def private(d, at) -> object:
            if not _is_sym(d):
                return int(d)
            expr = d.node.expr
            if not isinstance(expr, sympy.Symbol):
                raise Unsupported(f"a size is an expression of symbols ({expr})")
            if expr not in self.symbols:
                hint = int(d.node.hint)
                name = f"fxopt_{expr}"
                sym = self.shape_env.create_symbol(hint, ConstantSource(name))
                self.symbols[expr] = (self.shape_env.create_symintnode(sym, hint=hint), sym)
                self.where[str(sym)] = at
                self.dims.append(f"input {at[0]} {'size input' if at[1] is None else f'dim {at[1]}'} "
                                 f"({sym}, traced at {hint})")
            return self.symbols[expr][0]

        self.fakes = []
        for i, a in enumerate(fake_args):
            if isinstance(a, torch.Tensor):
                self.fakes.append(self._tensor(a, [private(d, (i, k)) for k, d in enumerate(a.shape)]))
            elif isinstance(a, torch.SymInt):
                self.fakes.append(private(a, (i, None)))
            else:
                self.fakes.append(a)
        if not self.symbols:
            raise Unsupported("no symbolic sizes")
        # the tensor arguments with a symbolic size (their shapes name a size's bucket of inputs)
        self.symbolic_tensors = [i for i, f in enumerate(self.fakes)
                                 if isinstance(f, torch.Tensor) and any(_is_sym(d) for d in f.shape)]

    def _tensor(self, a: torch.Tensor, sizes: list) -> torch.Tensor:
        """A fake tensor in the private environment with ``a``'s dtype, device and layout."""
        if not any(_is_sym(d) for d in (*a.shape, *a.stride(), a.storage_offset())):
            with self.mode:
                t = torch.empty_strided([int(d) for d in a.shape], [int(d) for d in a.stride()], dtype=a.dtype,
                                        device=a.device)
            return t.requires_grad_(a.requires_grad) if a.requires_grad else t
        exprs = [d.node.expr if isinstance(d, torch.SymInt) else d for d in a.shape]
        strides = [s.node.expr if isinstance(s, torch.SymInt) else s for s in a.stride()]
        orders = {torch.contiguous_format: list(range(a.dim() - 1, -1, -1))}
        if a.dim() == 4:
            orders[torch.channels_last] = [1, 3, 2, 0]
        for fmt, order in orders.items():
            want = _dense_strides(exprs, order)
            if all((w - s).expand() == 0 for w, s in zip(want, strides)):
                with self.mode:
                    t = torch.empty(sizes, dtype=a.dtype, device=a.device, memory_format=fmt)
                return t.requires_grad_(a.requires_grad) if a.requires_grad else t
        raise Unsupported("an input with symbolic sizes is neither contiguous nor channels_last")

    def key(self, args) -> tuple:
        """The concrete value of every private symbol in these arguments."""
        out = []
        for name, (i, d) in self.where.items():
            a = args[i]
            out.append(int(a.shape[d]) if d is not None else int(a))
        return tuple(out)

    def describe(self, key: tuple) -> str:
        return ", ".join(f"{name}={v}" for name, v in zip(self.where, key))

    def failed_guard(self, key: tuple) -> Optional[str]:
        """The first guard the passes added (or range they refined) that these sizes break, or None."""
        import sympy

        env = self.shape_env
        values = {sym: sympy.Integer(v) for (_, sym), v in zip(self.symbols.values(), key)}
        for sym, v in values.items():
            vr = env.var_to_range.get(sym)
            if vr is not None and not (vr.lower <= v <= vr.upper):
                return f"{sym} in [{vr.lower}, {vr.upper}]"
        for g in env.guards:
            try:
                ok = bool(g.expr.xreplace(values))
            except TypeError:
                return f"{g.expr} (not decided by the sizes)"
            if not ok:
                return str(g.expr)
        for sym, rep in env.replacements.items():
            if sym in values and bool(sympy.Ne(rep.xreplace(values), values[sym])):
                return f"{sym} == {rep}"
        return None

    def guards(self) -> list[str]:
        return [str(g.expr) for g in self.shape_env.guards]


class SizeDispatcher:
    """What Dynamo calls for a symbolic graph: the optimized graph lowered per concrete size, the
    least recently used dropped beyond ``max_specializations`` (module docstring).

    ``lower_at(args, key, cache) -> (Lowered, note or None)``: the executor's result for these sizes,
    its measured choices through ``cache`` (an autotuning cache, ``fxopt.dynamic_buckets``).
    ``info``: the live record the report shows (``executor_details["dynamic"]``).
    ``padding``: a ``fxopt.dynamic_buckets.Padding`` where the graph is batch-independent (a new
    batch size then runs padded on a lowered larger one, or in chunks of lowered ones where none is
    larger, until it was seen ``specialize_after`` times, then gets its own specialization), else None.
    ``user_cache``: the autotuning cache the buckets' choices are recorded into; ``model``: a name of
    the model (its weights' shapes), with the bucket of a lowering's inputs the name of what it measures
    for other graphs of that model (``fxopt.dynamic_buckets.input_buckets``); ``scope``: what else a
    graph replaying another's buckets must have the same (its kind, fxopt's options): a replay answers
    by the order of requests, which other options could change."""

    def __init__(self, shapes: PrivateShapes, lower_at: Callable, max_specializations: int, info: dict,
                 padding=None, specialize_after: int = 2, user_cache=None, batch_pos: Optional[int] = None,
                 model: str = "", scope: str = ""):
        from fxopt.autotune import AutotuneCache

        self.shapes, self.lower_at = shapes, lower_at
        self.max = max_specializations
        self.cache: collections.OrderedDict = collections.OrderedDict()  # key -> Lowered
        self.info = info
        self.padding, self.specialize_after = padding, max(1, int(specialize_after))
        self.user_cache = user_cache if user_cache is not None else AutotuneCache(None)
        self.batch_pos = batch_pos  # index of the batch in a key (None: no batch symbol known)
        self.model = model  # the model's tag (``backends.lowering.model_tag``): part of a bucket's name
        self.scope = scope  # what else a graph sharing its buckets must share (the kind of graph, the options)
        self.buckets: dict = {}  # bucket id -> BucketChoices
        self.seen: collections.Counter = collections.Counter()  # key -> calls served padded
        self.evicted: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()  # key -> calls, for admission when full
        self._padded: dict = {}  # key -> its _Padded or _Chunked while it is served so
        self.chunking_declined: Optional[str] = None  # why a larger batch is not run in chunks
        info.setdefault("specializations", {})
        info.setdefault("admissions_declined", 0)
        info.setdefault("evictions", 0)
        info["max_specializations"] = max_specializations
        info["live"] = 0
        info.setdefault("padded_calls", 0)
        info.setdefault("chunked_calls", 0)
        self._last = (None, None)
        # (record, start) of the sizes lowered during the current call: their first call's cost
        # (lowering, then the run: warm-ups, CUDA-graph capture, what it measures) is the call's
        self._started: list = []

    def __call__(self, *args):
        key = self.shapes.key(args)
        self.calls[key] += 1
        last_key, fn = self._last
        if key != last_key:
            low = self.cache.get(key)
            if low is not None:  # a lowered size: its runner, with nothing around it
                self.cache.move_to_end(key)
                self._last = (key, low.fn)
                return low.fn(*args)
            from fxopt.autotune import deferred_writes

            # a size not lowered yet: what its lowering and first call measure, written to the file once
            with deferred_writes():
                try:
                    fn = self._lookup(key, args)
                    self._last = (key, fn)
                    return fn(*args)
                finally:
                    if self._started:
                        self._first_calls()
        try:
            return fn(*args)
        finally:
            if self._started:  # a padded size got its own specialization in this call
                self._first_calls()

    def _first_calls(self) -> None:
        now = time.perf_counter()
        for rec, t0 in self._started:
            rec.setdefault("first_call_seconds", []).append(round(now - t0, 4))
        self._started = []

    def _record(self, key: tuple) -> dict:
        return self.info["specializations"].setdefault(self.shapes.describe(key), {"lowered": 0, "seconds": []})

    def _bucket_id(self, key: tuple) -> tuple:
        """Every symbolic size rounded up to a power of two: batches 5..8 share a bucket, and so do
        sides 129..256 (an image size's choices are those measured at another in its bucket)."""
        from fxopt.dynamic_buckets import bucket

        return tuple(bucket(v) for v in key)

    def _lookup(self, key: tuple, args) -> Callable:
        """What serves a size not lowered (``__call__`` takes a lowered one's runner itself)."""
        wants_own = self.seen[key] >= self.specialize_after * (1 + self.evicted[key])
        if self.padding is not None and wants_own and not self.admits(key):
            self.info["admissions_declined"] += 1
            wants_own = False
        if self.padding is not None and not wants_own:
            donor = self._donor(key)
            if donor is None and self.chunking_declined is None and self._chunks(key) is not None:
                served = self._padded[key] = _Chunked(self, key)  # nothing lowered in this call
                return served
            if donor is None:  # nothing lowered at these other sizes: one size is, to serve them all
                donor = self._top(key)
                if donor == key:
                    return self._lower(key, args, role="specialized (bucket top)").fn
                self._lower(donor, self.padding.pad_args(args, donor[self.batch_pos]), role="bucket top")
            padded = self._padded[key] = _Padded(self, key, donor)
            return padded
        return self._lower(key, args, role="specialized").fn

    def _top(self, key: tuple) -> tuple:
        """The size lowered for a batch with nothing lowered at its other sizes (a new image size):
        the bucket top of the largest batch called so far at any size, so that every later batch at
        these other sizes runs padded or in chunks on it, rather than each bucket lowering its own
        top (three image sizes times seven buckets would be more than the bound holds)."""
        from fxopt.dynamic_buckets import bucket

        p = self.batch_pos
        largest = max([k[p] for k in self.calls] + [key[p]])
        return key[:p] + (bucket(largest),) + key[p + 1:]

    def _donor(self, key: tuple) -> Optional[tuple]:
        """The smallest lowered size with a larger batch and every other size equal (None: none)."""
        p, b = self.batch_pos, key[self.batch_pos]
        same = [k for k in self.cache if k[:p] == key[:p] and k[p + 1:] == key[p + 1:] and k[p] >= b]
        return min(same, key=lambda k: k[p]) if same else None

    def _chunks(self, key: tuple) -> Optional[list]:
        """``fxopt.dynamic_buckets.chunk_plan`` of this size's batch over the lowered sizes whose
        other sizes are equal (None: a lowered size holds it, or none to chunk on)."""
        from fxopt.dynamic_buckets import chunk_plan

        p = self.batch_pos
        same = [k[p] for k in self.cache if k[:p] == key[:p] and k[p + 1:] == key[p + 1:]]
        return chunk_plan(key[p], same)

    def _victim(self) -> tuple:
        """The lowered size to drop for a new one: the least called that no padded size runs on
        (ties: the least recently used); where every one has padded sizes on it, the least called
        that is not the largest lowered batch at its other sizes (its padded sizes run on the next
        larger one)."""
        donors = {k for p in self._padded.values() for k in p.donors}
        servers = set()  # the largest lowered batch at each other size: every batch there runs on it
        if self.batch_pos is not None:
            p, largest = self.batch_pos, {}
            for k in self.cache:
                rest = k[:p] + k[p + 1:]
                if rest not in largest or k[p] > largest[rest][p]:
                    largest[rest] = k
            servers = set(largest.values())
        others = ([k for k in self.cache if k not in donors and k not in servers]
                  or [k for k in self.cache if k not in servers] or list(self.cache))
        return min(others, key=lambda k: self.calls[k])  # min keeps the first (least recent) of ties

    def _lower(self, key: tuple, args, role: str):
        while len(self.cache) >= self.max:
            old_key = self._victim()
            old = self.cache.pop(old_key)
            release(old)
            if self.padding is not None:
                self.padding.release(old_key[self.batch_pos])
            self.evicted[old_key] += 1
            self.info["evictions"] += 1
            self.info["specializations"][self.shapes.describe(old_key)]["live"] = False
        from fxopt.dynamic_buckets import bucket_choices, input_buckets

        where = getattr(self.shapes, "symbolic_tensors", None)
        at = None if where is None or not self.model else f"{self.model} {input_buckets(args[i].shape for i in where)}"
        choices, choices_from = bucket_choices(self.buckets, self._bucket_id(key), key, self.batch_pos,
                                               self.user_cache, at, self.scope)
        t0 = time.perf_counter()
        low, note = self.lower_at(list(args), key, choices)
        cost = round(time.perf_counter() - t0, 4)
        self.cache[key] = low
        rec = self._record(key)
        self._started.append((rec, t0))
        rec["lowered"] += 1
        rec["seconds"].append(cost)
        rec["live"] = True
        rec["executor"] = low.executor
        rec["runs"] = role
        rec["choices"] = choices.counts  # live: a runner's decisions come at its first call
        rec["choices_from"] = choices_from
        if note:
            rec["note"] = note
        self.info["live"] = len(self.cache)
        return low

    def admits(self, key: tuple) -> bool:
        """Whether a padded size may get its own specialization now: always while there is room;
        when ``max_specializations`` sizes are lowered, only if it was called ``ADMIT_FACTOR`` times
        as often as the least called of them that no other size is padded onto (that one is dropped
        for it). Sizes drawn at random would otherwise keep displacing each other, each lowered
        again and again: with a bare "more often", counts that grow alike keep overtaking each other
        (a loop over 191 sizes with the bound at 16 lowered 732 times in 1,000 calls)."""
        return len(self.cache) < self.max or self.calls[key] > ADMIT_FACTOR * self.calls[self._victim()]

    def _specialize(self, key: tuple, args) -> Callable:
        fn = self._lower(key, args, role="specialized").fn
        self._padded.pop(key, None)
        self._last = (key, fn)
        return fn

    def lowered(self) -> dict:
        """Size description -> the ``Lowered`` kept for it."""
        return {self.shapes.describe(k): v for k, v in self.cache.items()}


class _Served:
    """A size served on lowered sizes of other batches (padded or in chunks) until it was seen
    ``specialize_after`` times: then its own specialization is lowered in that call (if admitted)
    and takes over. Synchronously, not in a background thread: a CUDA-graph capture forbids work
    that other threads launch meanwhile, and measuring beside a serving thread would time both."""

    donors: tuple = ()

    def __init__(self, dispatcher: SizeDispatcher, key: tuple):
        self.d, self.key = dispatcher, key
        self.b = key[dispatcher.batch_pos]
        self.rec = dispatcher._record(key)

    def __call__(self, *args):
        d = self.d
        d.seen[self.key] += 1
        if d.seen[self.key] > d.specialize_after * (1 + d.evicted[self.key]):
            if d.admits(self.key):
                return d._specialize(self.key, args)(*args)
            d.info["admissions_declined"] += 1
        return self.run(args)

    def again(self, args):
        """This call dispatched anew (what it ran on was evicted, or another way serves it now)."""
        d = self.d
        if d._padded.get(self.key) is self:
            del d._padded[self.key]
        d._last = (None, None)
        d.seen[self.key] -= 1
        return d(*args)

    def _runs(self, how: str) -> None:
        if "runs" not in self.rec or self.rec.get("live") is not True:
            self.rec["runs"] = how


class _Padded(_Served):
    """A batch size run on the smallest lowered larger one (``fxopt.dynamic_buckets.Padding``)."""

    def __init__(self, dispatcher: SizeDispatcher, key: tuple, donor: tuple):
        super().__init__(dispatcher, key)
        self.donor, self.donors = donor, (donor,)
        self.to = donor[dispatcher.batch_pos]
        rec = self.rec
        rec.setdefault("padded_calls", 0)
        rec.setdefault("padded_from", [])
        if self.to not in rec["padded_from"]:
            rec["padded_from"].append(self.to)

    def run(self, args):
        d = self.d
        low = d.cache.get(self.donor)
        if low is None:  # the larger size was evicted meanwhile
            return self.again(args)
        d.cache.move_to_end(self.donor)
        self.rec["padded_calls"] += 1
        d.info["padded_calls"] += 1
        self._runs(f"padded to batch {self.to}")
        return d.padding.slice_outputs(low.fn(*d.padding.pad_args(args, self.to)), self.b)


class _Chunked(_Served):
    """A batch size larger than every lowered one, run in chunks of lowered sizes, the chunks'
    outputs joined (``fxopt.dynamic_buckets.chunk_plan``, ``ChunkOutputs``): nothing is lowered in
    its first calls. The plan is made again at each call from the sizes lowered then; where a
    lowered size holds the batch meanwhile, it runs padded there. Where the first chunk's outputs
    cannot be joined (their batch not outermost in memory), chunks are declined for the graph and
    the call dispatched again (its bucket's top size lowered, as without chunks)."""

    def __init__(self, dispatcher: SizeDispatcher, key: tuple):
        super().__init__(dispatcher, key)
        self.rec.setdefault("chunked_calls", 0)

    def run(self, args):
        from fxopt.dynamic_buckets import ChunkOutputs, describe_chunks

        d, p = self.d, self.d.batch_pos
        runs = d._chunks(self.key)
        if runs is None:
            return self.again(args)
        keys = [self.key[:p] + (to,) + self.key[p + 1:] for _, _, to in runs]
        self.donors = tuple(set(keys))
        joined = ChunkOutputs(d.padding.plan.outputs, self.b)
        for (start, rows, to), k in zip(runs, keys):
            d.cache.move_to_end(k)
            outs = d.cache[k].fn(*d.padding.chunk_args(args, start, rows, to))
            why = joined.add(outs, start, rows, to)  # copied out before the next chunk runs
            if why is not None:
                d.chunking_declined = d.info["chunking_declined"] = why
                self.donors = ()
                return self.again(args)
        self.rec["chunked_calls"] += 1
        self.rec["chunked_as"] = describe_chunks(runs)
        d.info["chunked_calls"] += 1
        self._runs(f"chunked into {self.rec['chunked_as']}")
        return joined.result()


class SizeRunners:
    """The CUDA-graph runners of a symbolic forward graph's specializations, as its backward's
    ``TrainingLink`` reads a forward runner (``backends/cuda/runtime/cudagraph_training.py``): the
    storages they hand out and lend, and their captures, over every size lowered now. A size
    evicted since its forward ran is not among them: its backward copies what it reads."""

    def __init__(self, dispatcher: "SizeDispatcher"):
        self.dispatcher = dispatcher

    def _runners(self) -> list:
        runners = (getattr(low, "cudagraph_runner", None) for low in self.dispatcher.cache.values())
        return [r for r in runners if r is not None]

    @property
    def graphs(self) -> dict:
        return {(i, k): e for i, r in enumerate(self._runners()) for k, e in r.graphs.items()}

    def handed_storages(self) -> set:
        return set().union(*(r.handed_storages() for r in self._runners()))

    def lent_storages(self) -> set:
        return set().union(*(r.lent_storages() for r in self._runners()))


def release(lowered) -> None:
    """Drop what a specialization holds on the device: its CUDA graphs and their memory pools."""
    runner = getattr(lowered, "cudagraph_runner", None)
    if runner is not None and hasattr(runner, "release"):
        runner.release()


def summary_lines(info: dict) -> list[str]:
    """The report's lines for one graph's dynamic-shape record."""
    if not info:
        return []
    if info.get("fallback"):
        return [f"dynamic shapes: specialized by the passes ({info['fallback']})"]
    lines = [f"dynamic shapes: symbolic {'; '.join(info.get('symbolic', []))}; passes ran once; "
             f"{info.get('live', 0)} of at most {info.get('max_specializations')} sizes lowered, "
             f"{info.get('evictions', 0)} evicted",
             "  padding: " + (f"on (batch {info['padding']}), {info.get('padded_calls', 0)} calls padded, "
                              f"{info.get('chunked_calls', 0)} chunked"
                              + (f" (chunks declined: {info['chunking_declined']})"
                                 if info.get("chunking_declined") else "")
                              if info.get("padding") and not info.get("padding_declined")
                              else f"off ({info.get('padding_declined', 'not asked')})")]
    if info.get("specialised_by"):
        lines.append("  values per size: " + "; ".join(f"{g}: {how}" for g, how in info["specialised_by"].items()))
    recs = info.get("specializations", {}).values()
    lowered = [t for rec in recs for t in rec["seconds"]]
    if lowered:
        first = [t for rec in recs for t in rec.get("first_call_seconds", ())]
        lines.append(f"  lowerings: {len(lowered)} in {sum(lowered):.3f} s"
                     + (f"; with their first calls {sum(first):.3f} s" if first else ""))
    for size, rec in info.get("specializations", {}).items():
        secs = ", ".join(f"{s:.3f}" for s in rec["seconds"])
        first = rec.get("first_call_seconds")
        if first:
            secs += "; first call with it " + ", ".join(f"{s:.3f}" for s in first)
        how = rec.get("runs", "specialized")
        line = f"  {size}: {how}"
        if rec["lowered"]:
            ch = rec.get("choices", {})
            line += (f"; lowered {rec['lowered']}x ({secs} s){'' if rec.get('live') else ' (evicted)'}; choices "
                     f"{ch.get('measured', 0)} measured, {ch.get('cached', 0)} cached, {ch.get('reused', 0)} reused"
                     + (" (another graph's lowering of its bucket)" if rec.get("choices_from", "").startswith(
                         "another graph") else "")
                     + (f", {ch['from_sibling']} measured at other sizes of the bucket" if ch.get("from_sibling") else "")
                     + (f", {ch['from_neighbours']} from neighbouring buckets" if ch.get("from_neighbours") else ""))
        if rec.get("padded_calls"):
            line += f"; {rec['padded_calls']} calls padded to batch {', '.join(map(str, rec['padded_from']))}"
        if rec.get("chunked_calls"):
            line += f"; {rec['chunked_calls']} calls chunked" + ("" if how.startswith("chunked") else
                                                                 f" (last into {rec['chunked_as']})")
        lines.append(line + (f"; {rec['note']}" if rec.get("note") else ""))
    return lines
