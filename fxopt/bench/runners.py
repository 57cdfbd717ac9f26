"""One benchmark cell, (model, batch, dtype, backend), from preparation to its statistics.

:func:`start_cell` prepares a backend (``fxopt.bench.peers``), makes its first call (compile time,
accuracy against the fp32 reference), warms it up and counts its kernels; :func:`time_round` times
more calls of it, the backends of a row taking turns round by round; :func:`finish_cell` turns
the samples into the cell's statistics and releases the backend. The model handed to ``prepare``
is already on the device and in the dtype, and so is the example input; everything runs under
``torch.no_grad()``. Timing and accuracy are ``fxopt.bench.measure``'s.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import queue
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from .measure import (_percentile, _sync, count_flops, flatten_outputs, host_ms_per_call, host_speed_us,
                      max_rel_error, measure_peak_tflops, reference_output, stats, time_calls)
from .peers import BACKENDS, DEFAULT_BACKENDS, first_line, fxopt_available
from .spec import BackendSpec, BackendUnavailable, Prepared

__all__ = ["BACKENDS", "DEFAULT_BACKENDS", "BackendSpec", "BackendThread", "BackendUnavailable", "Prepared",
           "LiveCell", "count_flops", "finish_cell", "flatten_outputs", "fxopt_available", "max_rel_error",
           "on_backend_thread", "measure_cell", "measure_peak_tflops", "reference_output", "start_cell",
           "start_on_own_thread", "stats", "time_calls", "time_round"]

#: kernels per backend kept in a cell's record (``top_kernels``) and shown where fxopt loses
TOP_KERNELS = 12


def _record_warnings(cell: Dict[str, Any], caught: List[warnings.WarningMessage]) -> None:
    """Re-emit caught warnings; note fallbacks (e.g. FxoptFallbackWarning) in the cell."""
    fallbacks, seen = [], set()
    for w in caught:
        msg = str(w.message).strip()
        if "fallback" in w.category.__name__.lower():
            fallbacks.append(msg.splitlines()[0][:200] if msg else "")
        if (w.category, msg) not in seen:
            seen.add((w.category, msg))
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if fallbacks:
        cell["fallback"] = fallbacks[0]
        cell["fallback_count"] = len(fallbacks)


class BackendThread:
    """One backend's own thread: its preparation, calls and timing run there while the caller waits,
    so the backends of a row still take turns, one at a time.

    Why: torch keeps cuDNN's execution plans per thread (``benchmark_cache`` in
    ``aten/src/ATen/native/cudnn/Conv_v8.cpp`` is ``thread_local``), keyed by the convolution, not by
    how the plan was chosen. On one thread a convolution keyed alike runs the plan of whichever
    backend called it first: fxopt ran the plans Inductor's search had chosen (eca_nfnet_l0 fp16 b1,
    H100) and was timed slower than alone in a process. On threads of their own each backend runs the
    plans its own first calls chose, as a user running that backend alone gets. Daemon thread: an
    interrupted run does not wait for a compile to end."""

    def __init__(self, name: str):
        self._jobs: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=f"bench-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        _thread_state()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, kwargs, box, done = job
            try:
                box.append((True, fn(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                box.append((False, exc))
            done.set()

    def __call__(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` on this thread; its result, or its exception raised here."""
        box: list = []
        done = threading.Event()
        self._jobs.put((fn, args, kwargs, box, done))
        while not done.wait(0.5):  # a timed wait, so that Ctrl-C reaches the caller
            if not self._thread.is_alive():
                raise RuntimeError(f"{self._thread.name} ended")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self, timeout: float = 5.0) -> None:
        """End the thread (after the job it runs, waiting at most ``timeout`` s for it)."""
        self._jobs.put(None)
        self._thread.join(timeout)


def _thread_state() -> None:
    """What a thread needs of torch's thread-local state before a backend runs there: Inductor's
    CUDA-graph trees (reduce-overhead) look for their managers in state that torch 2.11 stashes only
    on the main thread and copies to autograd's threads (``cudagraph_trees.get_obj`` asserts it is
    there; later torch makes it on first use, as this does: by its ``_initialize_tls`` where torch has
    it, else as that does: empty managers in the module's thread-local, stashed in torch's TLS)."""
    try:
        import collections

        from torch._inductor import cudagraph_trees

        local = cudagraph_trees.local
        if hasattr(local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
            return
        setup = getattr(cudagraph_trees, "_initialize_tls", None)
        if setup is not None:
            setup(local)
            return
        local.tree_manager_containers = {}
        local.tree_manager_locks = collections.defaultdict(threading.Lock)
        torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
        torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)
    except Exception:  # noqa: BLE001 - the thread still serves; a backend needing it fails in its cell
        pass


def on_backend_thread(threads: Optional[Dict[str, "BackendThread"]], backend: str, fn: Callable, *args, **kwargs):
    """``fn`` on ``backend``'s thread in ``threads`` (made on first use), or here where ``threads`` is
    None or holds None for ``backend``."""
    if threads is None or (backend in threads and threads[backend] is None):
        return fn(*args, **kwargs)
    if backend not in threads:
        threads[backend] = BackendThread(backend)
    return threads[backend](fn, *args, **kwargs)


def start_on_own_thread(threads: Optional[Dict[str, Optional["BackendThread"]]], backend: str,
                        start: Callable[[], "LiveCell"], on_caller: Dict[str, Optional[str]]) -> "LiveCell":
    """``start()`` (a ``start_cell``) on ``backend``'s own thread. One whose preparation fails there
    (a torch whose thread-local state it needs is not made on such threads) is started again on this
    thread, once a run: ``on_caller[backend]`` keeps the error it had on its own thread where it then
    ran here (the caller's next rows leave it here: ``threads[backend] = None``), None where it failed
    here too (its own thread again, not tried here again). Its cells say so in their note."""
    live = on_backend_thread(threads, backend, start)
    if threads is not None and threads.get(backend) is not None and backend not in on_caller \
            and live.cell["status"] == "error":
        threads.pop(backend).close()
        own, live = live.cell["error"], start()
        on_caller[backend] = (own or "an error") if live.cell["status"] == "ok" else None
        if on_caller[backend]:
            threads[backend] = None
    why = on_caller.get(backend)
    if why and live.cell["status"] == "ok":
        live.cell["note"] = "; ".join(filter(None, [live.cell.get("note"),
                                                    f"ran on the calling thread (on a thread of its own: {why[:120]})"]))
    return live


def _cleanup(device: str, reset: bool = True) -> None:
    if reset:
        torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


@dataclasses.dataclass
class LiveCell:
    """A prepared backend kept alive so that its timed calls can be spread over several rounds,
    interleaved with the other backends of the same row (host and clock drift then hit every
    backend alike instead of whichever happened to run during a slow minute)."""
    backend: str
    cell: Dict[str, Any]
    prepared: Optional[Prepared]
    model: Optional[nn.Module]
    samples: List[float] = dataclasses.field(default_factory=list)
    round_medians: List[float] = dataclasses.field(default_factory=list)  # per round, ms
    round_host_us: List[float] = dataclasses.field(default_factory=list)  # host_speed_us() before each


def _fail(cell: Dict[str, Any], exc: BaseException, backend: str, error_log: Optional[List[str]]) -> None:
    if isinstance(exc, BackendUnavailable):
        cell.update(status="unavailable", error=str(exc))
        return
    cell.update(status="error", error=f"{type(exc).__name__}: {first_line(exc)}")
    if error_log is not None:
        error_log.append(f"[{backend}] " + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def start_cell(backend: str, base_model: nn.Module, x_cpu: torch.Tensor, ref: Optional[torch.Tensor],
               device: str, dtype: torch.dtype, warmup: int, fxopt_options: Optional[Dict[str, Any]] = None,
               error_log: Optional[List[str]] = None, reset: bool = True) -> LiveCell:
    """Prepare, first-call (compile time, accuracy) and warm up one backend; never raises (except
    KeyboardInterrupt). ``reset=False`` keeps the other live backends' compiled code (no
    ``torch._dynamo.reset()``). Peak memory is what this backend allocated beyond what was already
    allocated when it started."""
    spec = BACKENDS[backend]
    cell: Dict[str, Any] = {"backend": backend, "status": "ok", "error": None, "note": ""}
    live = LiveCell(backend, cell, None, None)
    caught: List[warnings.WarningMessage] = []
    try:
        if spec.needs_cuda and device != "cuda":
            raise BackendUnavailable("needs --device cuda")
        _cleanup(device, reset)
        live.model = copy.deepcopy(base_model).to(device=device, dtype=dtype)
        x = x_cpu.to(device=device, dtype=dtype)
        base_mem = 0
        if device == "cuda":
            torch.cuda.synchronize()
            base_mem = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad(), spec.context(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            live.prepared = spec.prepare(live.model, x, device, dtype, fxopt_options or {})
            out = live.prepared.fn(live.prepared.inputs)
            _sync(device)
            cell["first_call_s"] = time.perf_counter() - t0
            cell["note"] = live.prepared.note
            ran = live.prepared.ran() if live.prepared.ran is not None else _package_ran(live.prepared.fn)
            if ran:
                cell["ran"] = ran
            if ref is not None:
                cell["max_rel_err"] = max_rel_error(out, ref)
            del out
            for _ in range(warmup):
                live.prepared.fn(live.prepared.inputs)
            _sync(device)
        if device == "cuda" and live.prepared.tracks_memory:
            cell["peak_mem_mb"] = (torch.cuda.max_memory_allocated() - base_mem) / 2 ** 20
        if device == "cuda":
            # counted now, before the next backend compiles: a profiler session that traces CUDA
            # graph replays after other graphs were captured and destroyed around an earlier
            # session crashed the process (SIGSEGV in the replay; torch 2.11, CUDA 13.0)
            with torch.no_grad(), spec.context(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cell["kernels_per_call"], cell["top_kernels"] = _kernels_per_call(live.prepared.fn,
                                                                                   live.prepared.inputs)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        _fail(cell, exc, backend, error_log)
        live.prepared = live.model = None
    finally:
        _record_warnings(cell, caught)
    return live


def _package_ran(fn) -> str:
    """What a package's executor runs after the first call: the CPU runner's way per batch size
    ("" for anything else)."""
    decisions = getattr(fn, "decisions", None)
    if not callable(decisions):
        return ""
    try:
        ways = {d.get("runs") for low in decisions().values() for d in low.get("runner", []) if isinstance(d, dict)}
    except Exception:  # noqa: BLE001 - a diagnostic, never a reason to fail a cell
        return ""
    return ", ".join(sorted(w for w in ways if w))


#: seconds a CPU round waits before its first call: the thread pool of the backend that ran before
#: goes idle (ONNX Runtime's workers spin after a run and, on a small machine, took the cores from the
#: next backend: seedcnn b64 on 2 cores ran 1.8 -> 4.2 ms right after ONNX Runtime; ~0.1 s ends it).
#: The wait is busy: after a sleep the machine's vCPUs ran Python up to 4x slower for the whole round.
CPU_SETTLE_S = 0.2


def _settle(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def time_round(live: LiveCell, device: str, iters: int, rewarm: int = 0,
               error_log: Optional[List[str]] = None) -> None:
    """``iters`` more timed calls of a live backend (after ``rewarm`` untimed ones, which also bring
    its compiled code to the front of Dynamo's cache; on the CPU after ``CPU_SETTLE_S`` idle)."""
    if live.prepared is None:
        return
    if device == "cpu":
        _settle(CPU_SETTLE_S)
    spec = BACKENDS[live.backend]
    try:
        with torch.no_grad(), spec.context(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reported once, at preparation
            for _ in range(rewarm):
                live.prepared.fn(live.prepared.inputs)
            host_us = host_speed_us()
            got = time_calls(live.prepared.fn, live.prepared.inputs, device, iters)
            live.samples += got
            live.round_medians.append(_percentile(sorted(got), 50))
            live.round_host_us.append(host_us)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        _fail(live.cell, exc, live.backend, error_log)
        live.prepared = live.model = None


def _kernels_per_call(fn: Callable, x, top: int = TOP_KERNELS) -> tuple:
    """GPU kernels one call launches (torch.profiler; a replayed CUDA graph's kernels count one by
    one) and its ``top`` kernels by GPU time (``[name, launches, µs]``), or ``(None, None)`` where
    the profiler is not available."""
    try:
        from fxopt.explain import kernel_profile

        return kernel_profile(lambda inp: fn(inp), [x], top)
    except Exception:  # noqa: BLE001 - a count is a diagnostic, never a reason to fail a cell
        return None, None


def finish_cell(live: LiveCell, device: str, rounds: int = 1) -> Dict[str, Any]:
    """The cell's statistics (and host time per call on CUDA); releases the backend."""
    cell = live.cell
    try:
        if live.prepared is not None and cell["status"] == "ok":
            if device == "cuda":
                with torch.no_grad(), BACKENDS[live.backend].context(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    cell["host_ms"] = host_ms_per_call(live.prepared.fn, live.prepared.inputs)
            st = stats(live.samples)
            cell.update({f"{k}_ms": v for k, v in st.items() if k != "n"})
            cell["n"] = st["n"]
            cell["rounds"] = rounds
            cell["samples_ms"] = [round(s, 5) for s in live.samples]
            cell["round_medians_ms"] = [round(s, 5) for s in live.round_medians]
            cell["round_host_us"] = [round(s, 2) for s in live.round_host_us]
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        _fail(cell, exc, live.backend, None)
    finally:
        live.prepared = live.model = None
    return cell


def measure_cell(backend: str, base_model: nn.Module, x_cpu: torch.Tensor,
                 ref: Optional[torch.Tensor], device: str, dtype: torch.dtype,
                 warmup: int, iters: int, fxopt_options: Optional[Dict[str, Any]] = None,
                 error_log: Optional[List[str]] = None) -> Dict[str, Any]:
    """Prepare, first-call, warm up and time one backend on its own (one round); never raises
    (except KeyboardInterrupt): failures are recorded in the returned cell."""
    live = start_cell(backend, base_model, x_cpu, ref, device, dtype, warmup, fxopt_options, error_log)
    time_round(live, device, iters, error_log=error_log)
    cell = finish_cell(live, device)
    _cleanup(device)
    return cell
