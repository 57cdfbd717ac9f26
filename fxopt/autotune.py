"""Measured choice between convolution algorithms, and the cache that remembers it.

Timing: real shape, dtype and layout on the target device; warm-up runs, then
the median of several timed runs (CUDA events on GPU, perf_counter on CPU),
rotating between input sets so caches don't flatter. A candidate whose output
differs from the float64 convolution beyond its documented tolerance (checked on
the first ``CHECK_BATCH`` images of the batch) is rejected.

The cache is a readable JSON file (``autotune_cache`` option; default
``<user cache dir>/fxopt/autotune.json``) keyed by a device fingerprint (GPU
name, compute capability, torch / cuDNN / CUDA versions and how cuDNN chose its
algorithms; or CPU model and thread count) and the convolution's full signature.
It can be copied to another machine with the same GPU and software and gives
the same choices there. A
corrupt file is ignored with a warning and rewritten; writes are atomic
(temporary file + ``os.replace``), so concurrent processes never corrupt it.
Within ``deferred_writes`` (a compile, a new size's lowering) the entries are kept in memory and
the file is rewritten once at the end, not at every entry.

cuDNN's own choice: while fxopt compiles a graph (measuring candidates) and while
the compiled graph runs outside a CUDA-graph replay, ``torch.backends.cudnn.benchmark``
is off (``cudnn_choosing`` / ``cudnn_choice``) unless the option ``cudnn_search``
is set: cuDNN then picks each convolution's algorithm by its heuristics (a grouped
convolution's first call excepted: searched, ``conv_algorithms.library_conv``). fxopt
measures its own candidates per convolution anyway, and cuDNN's exhaustive search
on each shape's first use cost seconds per network while choosing no faster kernels
on the H100 (ResNet-50 fp16 batch 1 channels_last: first call 3.60 s with the search
vs 0.33 s, replay 0.942 vs 0.880 ms; BENCHMARKS.md has the other networks). The flag
is process-wide, so a convolution another thread starts meanwhile also uses
heuristics. torch caches one cuDNN plan per convolution key and thread, however it
was chosen: a shape fxopt ran first is not searched later on that thread, and a
shape that eager or Inductor searched earlier on the calling thread runs their
searched plan in fxopt's graph too. Searched plans made fxopt slower: fp16 batch 1,
cudnn.benchmark on, each model alone in a fresh process on an H100 (2026-12-06),
µs a call with heuristics / with option ``cudnn_search``: eca_nfnet_l0 502 / 513,
resnet50 324 / 362, efficientnet_b0 365 / 404, regnety_016 631 / 669,
mobilenetv3_large_100 239 / 275, dla34 287 / 295.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import os
import platform
import statistics
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from fxopt.tolerances import relative_error, tolerance

CACHE_VERSION = 1
#: a non-direct algorithm is chosen only when it takes less than this fraction of direct's time
WIN_MARGIN = 0.9
#: images of the measuring batch on which each candidate's accuracy is checked
CHECK_BATCH = 4


@dataclass
class ConvChoice:
    algorithm: str
    candidates: dict  # name -> median ms (measured or estimated) or None (illegal / rejected)
    max_rel_error: Optional[float] = None  # of the chosen algorithm vs direct, when measured
    errors: dict = field(default_factory=dict)  # name -> relative error vs direct
    rejected: dict = field(default_factory=dict)  # name -> reason
    how: str = "heuristic"  # measured | cached | pruned | heuristic | forced | only-direct | symbolic sizes
    shape_str: str = ""

    def to_json(self) -> dict:
        return {"algorithm": self.algorithm, "candidates": self.candidates, "errors": self.errors,
                "rejected": self.rejected, "max_rel_error": self.max_rel_error}


def device_fingerprint(device_type: str) -> str:
    torch_v = torch.__version__.split("+")[0]
    if device_type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        # how cuDNN chooses its algorithms while these times are taken (see cudnn_choosing)
        choice = "search" if torch.backends.cudnn.benchmark else "heuristics"
        return (f"{props.name}|sm{props.major}{props.minor}|torch{torch_v}|cuda{torch.version.cuda}"
                f"|cudnn{torch.backends.cudnn.version()}-{choice}")
    return f"cpu|{platform.machine()}|{platform.processor() or 'unknown'}|torch{torch_v}|threads{torch.get_num_threads()}"


class cudnn_choosing:
    """Context: ``torch.backends.cudnn.benchmark`` off inside (restored after) unless ``search``,
    so that cuDNN picks its algorithms by heuristics while fxopt compiles, measures and runs."""

    def __init__(self, search: bool):
        self.search, self.turned_off = search, False

    def __enter__(self):
        self.turned_off = not self.search and torch.backends.cudnn.benchmark
        if self.turned_off:
            torch.backends.cudnn.benchmark = False
        return self

    def __exit__(self, *exc) -> None:
        if self.turned_off:
            torch.backends.cudnn.benchmark = True


def cudnn_choice(fn, search: bool):
    """``fn`` (a compiled graph, called outside a CUDA-graph replay: warm-up, capture, plain runs)
    with cuDNN choosing as ``cudnn_choosing(search)`` says."""
    if search:
        return fn

    @functools.wraps(fn, updated=())  # a graph module's __dict__ stays its own
    def run(*args, **kwargs):
        with cudnn_choosing(False):
            return fn(*args, **kwargs)

    return run


def default_cache_path() -> str:
    """$FXOPT_CACHE_DIR/autotune.json, else under the user cache directory."""
    root = os.environ.get("FXOPT_CACHE_DIR")
    if not root:
        try:
            import platformdirs

            root = platformdirs.user_cache_dir("fxopt")
        except ImportError:  # a declared dependency; keep working where it is missing
            root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fxopt")
    return os.path.join(root, "autotune.json")


class AutotuneCache:
    def __init__(self, path: Optional[str]):
        self.path = path
        self._data: Optional[dict] = None

    @classmethod
    def for_option(cls, opt) -> "AutotuneCache":
        """The cache the ``autotune_cache`` option names: False = in memory only, a path, else the
        default file; a cache object (``fxopt.choices``: a package's choices, a recording) is used as it is."""
        if isinstance(opt, AutotuneCache):
            return opt
        return cls(None if opt is False else (opt if isinstance(opt, str) else default_cache_path()))

    def _load(self) -> dict:
        if self._data is not None:
            return self._data
        self._data = {"version": CACHE_VERSION, "entries": {}}
        if self.path and os.path.exists(self.path):
            try:
                with open(self.path) as f:
                    data = json.load(f)
                if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
                    raise ValueError("unexpected format or version")
                if not isinstance(data.get("entries"), dict):
                    raise ValueError("no entries")
                self._data = data
            except (OSError, ValueError) as e:
                warnings.warn(f"fxopt: ignoring unreadable autotune cache {self.path} ({e}); it will be rewritten")
        return self._data

    def get(self, device: str, key: str) -> Optional[dict]:
        entry = self._load()["entries"].get(device, {}).get(key)
        if entry is None and self.path:  # put by another instance for this file, not written yet
            entry = _PENDING.get(self.path, {}).get(device, {}).get(key)
        return entry

    def keys(self, device: str) -> list:
        """Every key held for ``device`` (those put by another instance and not written yet too)."""
        held = list(self._load()["entries"].get(device, {}))
        return held + [k for k in (_PENDING.get(self.path, {}).get(device, {}) if self.path else {}) if k not in held]

    def put(self, device: str, key: str, entry: dict) -> None:
        self._load()["entries"].setdefault(device, {})[key] = entry
        if not self.path:
            return
        with _LOCK:
            if _DEFERRING[0]:  # written once, when the outermost ``deferred_writes`` ends
                _PENDING.setdefault(self.path, {}).setdefault(device, {})[key] = entry
                return
        self._data = _write(self.path, {device: {key: entry}}, self._data)


def _write(path: str, entries: dict, mine: Optional[dict] = None) -> dict:
    """``entries`` ({device: {key: entry}}) merged into the file with what other processes wrote
    meanwhile (and ``mine``, an instance's data), replaced atomically; the merged data."""
    on_disk = AutotuneCache(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = on_disk._load()
    for source in ((mine or {}).get("entries", {}), entries):
        for dev, es in source.items():
            merged["entries"].setdefault(dev, {}).update(es)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".autotune.", dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(fd, "w") as f:
        json.dump(merged, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return merged


#: file -> {device: {key: entry}} put while writes were deferred, not yet in the file
_PENDING: dict = {}
_DEFERRING = [0]  # depth of nested ``deferred_writes``
_ATEXIT = [False]  # whether ``flush_pending`` is registered to run at the process's exit
_LOCK = threading.Lock()


def flush_pending() -> None:
    """Write what ``put`` deferred (each file once)."""
    with _LOCK:
        pending = dict(_PENDING)
        _PENDING.clear()
    for path, entries in pending.items():
        try:
            _write(path, entries)
        except OSError as e:
            warnings.warn(f"fxopt: could not write the autotune cache {path} ({e})")


@contextlib.contextmanager
def deferred_writes():
    """Inside (a compile, a new size's lowering and first call), what ``put`` adds to a cache file
    is kept in memory, visible to every cache of that file in the process, and written once when
    the outermost context ends (and at the process's exit, should it end inside). Each ``put``
    rewrote the whole file: 42 of them in a size's first lowering cost 0.55 s."""
    with _LOCK:
        _DEFERRING[0] += 1
        if not _ATEXIT[0]:
            atexit.register(flush_pending)
            _ATEXIT[0] = True
    try:
        yield
    finally:
        with _LOCK:
            _DEFERRING[0] -= 1
            outermost = _DEFERRING[0] == 0
        if outermost:
            flush_pending()


def cuda_event_times(call, n: int) -> list:
    """ms of `n` calls of `call()`, each between two CUDA events and waited for (no overlap)."""
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def wall_times(call, n: int) -> list:
    """ms of `n` calls of `call()` by ``time.perf_counter`` (the CPU's counterpart of
    ``cuda_event_times``)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def alternating_medians(fns: dict, rounds: int, runs: int, device_type: str) -> dict:
    """Median ms of each function, timed in alternating rounds of ``runs`` calls so that a drifting
    host or clock affects every candidate alike (CUDA events on CUDA, wall clock on the CPU)."""
    timer = cuda_event_times if device_type == "cuda" else wall_times
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name] += timer(fn, runs)
    return {name: statistics.median(ts) for name, ts in times.items()}


def time_ms(fn, inputs: list, device_type: str, warmup: int = 3, iters: int = 10) -> float:
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    times = []
    if device_type == "cuda":
        rotated = iter([inputs[i % len(inputs)] for i in range(iters)])
        times = cuda_event_times(lambda: fn(next(rotated)), iters)
    else:
        rotated = iter([inputs[i % len(inputs)] for i in range(iters)])
        times = wall_times(lambda: fn(next(rotated)), iters)
    return statistics.median(times)


def measure(sig, batch: int, candidates: list[str], device: torch.device) -> ConvChoice:
    """Time every candidate on random data of the conv's shape; reject inaccurate ones. On CUDA,
    ``direct`` takes the faster memory format where ``channels_first_candidate`` holds."""
    from fxopt.conv_algorithms import channels_first_candidate, get_algorithm

    # generated where it is used: at large batches, random inputs made on the host cost seconds
    gen = torch.Generator(device=device).manual_seed(0)
    x_shape = (batch, *sig.x_shape[1:])
    fmt = torch.channels_last if sig.channels_last else torch.contiguous_format

    def rand(shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(sig.dtype)

    inputs = [rand(x_shape).contiguous(memory_format=fmt) for _ in range(3)]
    weight = rand(sig.w_shape) * (1.0 / max(1, sig.w_shape[1] * int(torch.tensor(sig.kernel).prod())) ** 0.5)
    if len(sig.w_shape) == 4:  # the weight's layout in the graph (the layout pass gives it the input's)
        weight = weight.contiguous(memory_format=fmt)
    bias = rand((sig.w_shape[0],))
    # Accuracy does not depend on the batch size (images are independent): it is checked on the
    # first CHECK_BATCH images, so the float64 reference stays cheap at large batches.
    check = inputs[0][:CHECK_BATCH]
    with torch.no_grad():
        # The reference is the float64 convolution: on CUDA, fp32 `direct` itself runs in TF32, so
        # comparing with it would reject candidates that are more accurate than it.
        sig64 = dataclasses.replace(sig, dtype=torch.float64)
        reference = get_algorithm("direct").run(check.double(), weight.double(), None, bias.double(), sig64)
        direct_err = relative_error(get_algorithm("direct").run(check, weight, None, bias, sig), reference)
        # Accepted: within fxopt's promise for the dtype, or no worse than 4x direct's own error.
        bound = max(tolerance(sig.dtype)[0], 4 * direct_err)
        choice = ConvChoice(algorithm="direct", candidates={}, how="measured")
        for name in candidates:
            algo = get_algorithm(name)
            try:
                packed = algo.prepare(weight, sig)
                out = algo.run(check, weight, packed, bias, sig)
                err = relative_error(out, reference)
                choice.errors[name] = err
                if not err <= bound:  # also rejects NaN
                    choice.rejected[name] = f"relative error {err:.2e} > {bound:.1e}"
                    choice.candidates[name] = None
                    continue
                choice.candidates[name] = time_ms(lambda x: algo.run(x, weight, packed, bias, sig), inputs,
                                                   device.type)
                if name == "direct" and sig.device_type == "cuda" and channels_first_candidate(sig):
                    cl = torch.channels_last
                    choice.candidates[name] = min(choice.candidates[name], time_ms(
                        lambda x: algo.run(x.contiguous(), weight, packed, bias, sig).contiguous(memory_format=cl),
                        inputs, device.type))
            except Exception as e:  # noqa: BLE001 - a failing candidate is simply not chosen
                choice.rejected[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                choice.candidates[name] = None
    timed = {k: v for k, v in choice.candidates.items() if v is not None}
    if timed:
        best = min(timed, key=timed.get)
        # Never worse: another algorithm must beat direct clearly, not within timing noise
        # (an isolated timing flatters it a little: no layout changes or cache contention around it).
        direct = timed.get("direct")
        if direct is None or timed[best] < WIN_MARGIN * direct:
            choice.algorithm = best
    choice.max_rel_error = choice.errors.get(choice.algorithm, 0.0)
    return choice
