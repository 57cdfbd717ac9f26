"""Generated C as one more way the cpu executor times per input signature (option ``cpu_generated_c``).

Why: at a small CNN's batch 1 every engine spends more time between its operators than in them
(seedcnn at batch 1: ONNX Runtime 34 us a call, of which its convolutions' arithmetic is a few).
The whole graph as one C function (``backends/c_source.py``), compiled with ``-O3 -march=native``
for this CPU (``backends/c_build.py``), runs it as straight loops with no dispatch at all.

What runs: the graph as AOTAutograd handed it (``ctx.unoptimized``: aten ops, the module's exact
semantics; the optimized graph where there is none), generated and compiled at a signature's
first call. Graphs with a node the generator does not handle, or larger than ``MAX_FLOPS`` an image
(where library kernels win and a compile would be wasted), raise ``Declined`` there: the runner
(``backends/cpu.py``) records why and times its other ways. It also checks the outputs against the
reference before it may choose this way.

Weights are read where they are, at every call; a convolution that lays its weights out for its
loops does so at the first call and again only when a parameter is replaced or changed in place.
"""
from __future__ import annotations

import ctypes
import threading
import time
from collections import OrderedDict, deque
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.engine_calls import bound_call, graph_outputs, restride
from fxopt.weights import ParamChanges

#: multiply-adds (x2) an image above which the generated C is not tried: library kernels (oneDNN,
#: ONNX Runtime, OpenVINO) win on large convolutions, and the compile would be wasted
MAX_FLOPS = 60e6
MAX_PROGRAMS = 8


def why_unavailable() -> Optional[str]:
    from fxopt.backends.c_build import compiler

    return None if compiler() is not None else "no C compiler on PATH (set $CC)"


class ThreadCount:
    """Which thread count runs a signature's next call: all of torch's threads, or one.

    Why: a layer shared out over two threads ends at a barrier, so it runs at the slower thread's
    speed. Where two vCPUs are at times one core's two hardware threads, or a neighbour takes one,
    both threads run at half speed and the barriers come on top: measured on a 2-vCPU VM,
    seedcnn2 at batch 1 took 39 us a call on two threads and 61 on one in one minute, 71 on two
    and 62 on one in the next. A choice made once is wrong for one of the two.

    How: every call is timed (two clock reads); the count with the lower median of its last
    ``WINDOW`` calls runs, and every ``EVERY`` calls the other runs ``PROBE`` calls to be timed
    again. Each probe that finds it slower by more than ``FAR`` doubles that interval, up to
    ``RARE`` (a probe costs its slowness on the mean); a probe that finds the two close sets it
    back, and a switch probes the count it left after ``SOON`` calls. Both counts compute the
    same outputs bit for bit (each thread has its own rows, planes or outputs; no sum is split
    between threads). A batch run in tiles keeps all threads: each thread's images are its own
    to the end, with no barrier between layers."""

    WINDOW, EVERY, RARE, PROBE, FAR = 3, 64, 1024, 2, 1.3  # a probe's two calls outvote one older
    SOON = 16  # the first probe after a switch (a burst that sent the calls away may be over)

    def __init__(self):
        self.times = {True: deque(maxlen=self.WINDOW), False: deque(maxlen=self.WINDOW)}  # all threads?
        self.ran = {True: 0, False: 0}  # calls run on all threads / on one
        self.calls, self.best, self.every, self.probed, self.next_probe = 0, True, self.EVERY, False, 0

    def pick(self) -> bool:
        """True: the next call runs on all threads; False: on one."""
        calls = self.calls = self.calls + 1
        if calls <= 2 * self.WINDOW:  # first all threads' calls are timed, then one thread's
            return calls <= self.WINDOW
        if calls % 8 == 0 or calls == 2 * self.WINDOW + 1:
            self._decide(calls)
        if self.next_probe <= calls < self.next_probe + self.PROBE:
            self.probed = True
            return not self.best
        return self.best

    def _decide(self, calls: int) -> None:
        every, one = (sorted(self.times[k])[self.WINDOW // 2] for k in (True, False))
        best, far = every <= one, max(every, one) > self.FAR * min(every, one)
        if best != self.best or not self.next_probe:  # a switch (or the first decision): probe soon
            self.every, self.next_probe, self.probed = self.EVERY, calls + self.SOON, False
        elif self.probed and calls >= self.next_probe + self.PROBE:  # a probe ended: the next one
            self.every = min(2 * self.every, self.RARE) if far else self.EVERY
            self.next_probe, self.probed = self.next_probe + self.every, False  # every-th call from the last
        self.best = best

    def took(self, every: bool, seconds: float) -> None:
        self.times[every].append(seconds)
        self.ran[every] += 1


class _Entry:
    """One signature's compiled function, its workspace and the pointers it is called with (the
    graph's arguments, then the outputs). A lock keeps concurrent callers off the shared workspace."""

    def __init__(self, fn, program, args: list, user: list, threads: Optional[int] = None, out_shapes=None,
                 workspace: Optional[torch.Tensor] = None):
        self.fn, self.user, self.threads = fn, user, threads
        self.shapes = [torch.Size(s) for s in (out_shapes or program.out_shapes)]
        self.dtypes = list(program.out_dtypes)
        # torch.empty(*ints, dtype=) is the cheapest way to a new tensor (0.9 us against 2.5 for a Size);
        # a 0-d output's size is () itself
        self._outs = [(tuple(int(v) for v in s) or ((),), d) for s, d in zip(self.shapes, self.dtypes)]
        self.n_args = program.n_args
        self.ws = workspace if workspace is not None else torch.empty(max(program.workspace, 64), dtype=torch.uint8)
        self.ws_ptr = self.ws.data_ptr()
        self.ptrs = (ctypes.c_void_p * (self.n_args + len(self.shapes)))()
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                self.ptrs[i] = a.data_ptr()
        self.keep = [a for a in args if isinstance(a, torch.Tensor)]  # the parameters stay where they are
        self.prepare = 1  # lay the weights out at the first call
        self.pace = ThreadCount()  # torch's threads or one, call by call (where no count is asked for)
        self.lock = threading.Lock()

    def run(self, inputs: list) -> list:
        """As ``run_fixed``: the function reads its inputs through the strides it was generated for."""
        return self.run_fixed(inputs)

    def run_fixed(self, inputs: list) -> list:
        """The outputs for the user tensors ``inputs`` (of this signature's shapes and strides)."""
        outs = [torch.empty(*s, dtype=d) for s, d in self._outs]
        ptrs, n = self.ptrs, self.n_args
        with self.lock:
            for i, t in zip(self.user, inputs):
                ptrs[i] = t.data_ptr()
            for k, o in enumerate(outs):
                ptrs[n + k] = o.data_ptr()
            self._call()
        return outs

    def _call(self) -> None:
        nt = self.threads or torch.get_num_threads()
        if nt == 1 or self.prepare or self.threads is not None or self.pace is None:  # a count asked for, or a call
            # laying weights out, or tiles (each image on one thread, one wait at the end: no barrier between layers)
            self._run(nt)
        else:
            every = self.pace.pick()
            t0 = time.perf_counter()
            self._run(nt if every else 1)
            self.pace.took(every, time.perf_counter() - t0)
        self.prepare = 0

    def _run(self, nt: int) -> None:
        self.fn(self.ptrs, self.ws_ptr, self.prepare, nt)


class _Tiled(_Entry):
    """A signature whose images run a tile at a time (``backends/c_tiles.py``): the driver called once,
    its OpenMP threads each with a slot of the workspace (zeroed: no weights laid out yet)."""

    def __init__(self, fn, program, args: list, user: list, batch: int, tile: int, threads: Optional[int]):
        from fxopt.backends.c_tiles import slot_bytes

        self.tiles, self.slots = batch // tile, max(1, torch.get_num_threads())
        super().__init__(fn, program, args, user, threads, [(batch, *s[1:]) for s in program.out_shapes],
                         torch.zeros(slot_bytes(program) * self.slots, dtype=torch.uint8))
        self.pace = None  # the threads' images apart to the end: one thread is never the faster

    def _run(self, nt: int) -> None:
        self.fn(self.ptrs, self.ws_ptr, 0, min(nt, self.slots), self.tiles)


class CRunner:
    """The callable way: the graph's flat arguments in (parameters included), its outputs out, one
    compiled C function per signature of all the arguments (their strides included)."""

    def __init__(self, gm: fx.GraphModule, param_indices, watch: bool = True, max_programs: int = MAX_PROGRAMS,
                 threads: Optional[int] = None):
        """threads: how many threads share each layer (and the tiles of a batch) out (default
        torch's thread count at each call)."""
        self.gm, self.max_programs, self.threads = gm, max_programs, threads
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.n_args = len(placeholders)
        self.params = sorted(param_indices)
        self.user = [i for i in range(self.n_args) if i not in set(self.params)]
        self.out_type, self.out_vals, self.restride = graph_outputs(gm)
        self.entries: OrderedDict = OrderedDict()
        self._params_changed = ParamChanges(self.params if watch else [])
        self.sources: dict = {}  # signature -> the C source (for explain and tests)
        self.builds = 0  # functions generated (a weight change makes them again)
        self.why_not_tiled: dict = {}  # signature -> why its images do not run one at a time (None: they do)

    def entry(self, args) -> _Entry:
        if self._params_changed(args):  # a weight replaced or changed: lay out again, read new addresses
            self.entries.clear()
        sig = tuple((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        e = self.entries.get(sig)
        if e is None:
            from fxopt.backends import c_tiles
            from fxopt.backends.c_build import build
            from fxopt.backends.c_emit import Declined
            from fxopt.backends.c_source import ENTRY, generate

            user = [i for i in self.user if isinstance(args[i], torch.Tensor)]
            tiling, why = c_tiles.per_tile(self.gm, list(args), user, torch.get_num_threads())
            self.why_not_tiled[sig] = why
            if tiling is not None:
                one, args_one, arg_batched, tile = tiling
                program = generate(one, args_one, self.params)
            else:
                program = generate(self.gm, list(args), self.params)
            first = args[user[0]] if user else None
            batch = int(first.shape[0]) if first is not None and first.dim() else 1
            images = tile if tiling is not None else max(1, batch)
            if program.flops / images > MAX_FLOPS:
                raise Declined(f"{program.flops / images / 1e6:.0f} MFLOP an image (generated C tried up to "
                               f"{MAX_FLOPS / 1e6:.0f}: library kernels win above)")
            self.builds += 1
            if tiling is not None:
                source = program.source + c_tiles.driver(program, arg_batched, args_one)
                e = _Tiled(build(source, c_tiles.DRIVER, extra_ints=2), program, list(args), user,
                           int(args[user[0]].shape[0]), tile, self.threads)
            else:
                source = program.source
                e = _Entry(build(source, ENTRY, extra_ints=1), program, list(args), user, self.threads)
            self.sources[sig] = source
            self.entries[sig] = e
            while len(self.entries) > self.max_programs:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end(sig)
        return e

    def bound(self, args):
        """A call for the signature of ``args`` alone (``engine_calls.bound_call``): the function looked
        up once; watched weights checked at every call (a change drops every function: the calls then
        take ``__call__``, which builds them again from the compile cache)."""
        positions = [i for i in self.user if isinstance(args[i], torch.Tensor)]
        changed = self._params_changed if self._params_changed.indices else None
        return bound_call(self.entry(args), positions, self.out_vals, self.out_type, changed,
                          self.entries.clear, self)

    def __call__(self, *args):
        e = self.entry(args)
        outs = e.run([args[i] for i in e.user])
        if self.restride:
            outs = [restride(t, v) for t, v in zip(outs, self.out_vals)]
        return self.out_type(outs) if self.out_type is not None else outs[0]


def cpu_candidate(gm: fx.GraphModule, ctx, threads: Optional[int] = None):
    """(a :class:`CRunner` of the graph as AOTAutograd handed it, None) for the cpu executor's runner
    to time per signature, or (None, why not): no C compiler, or a dtype other than float32."""
    why = why_unavailable()
    if why:
        return None, why
    from fxopt.backends.lowering import placeholder_indices, unoptimized

    src = unoptimized(ctx)
    src = gm if src is None else src
    dtypes = {n.meta["val"].dtype for n in src.graph.nodes
              if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
    if dtypes - {torch.float32, torch.bfloat16}:
        return None, f"dtypes {sorted(str(d) for d in dtypes)} (generated C: float32 and bfloat16)"
    return CRunner(src, placeholder_indices(src, ctx.param_placeholders), watch=not ctx.fixed_weights,
                   threads=threads), None
