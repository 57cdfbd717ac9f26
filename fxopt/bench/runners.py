"""Backends and measurement for the fxopt benchmark harness.

A backend is a :class:`BackendSpec`: ``prepare(model, example_input, device,
dtype, fxopt_options) -> Prepared`` builds the callable to time, and
``context()`` is entered around preparation, the first call, the warm-up and
the timed runs (``inductor-freezing`` patches the inductor config there).
The model handed to ``prepare`` is already on the device and in the dtype, and
so is the example input; everything runs under ``torch.no_grad()``.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import os
import statistics
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .spec import BackendSpec, BackendUnavailable, Prepared, PrepareFn

__all__ = ["BACKENDS", "DEFAULT_BACKENDS", "BackendSpec", "BackendUnavailable", "Prepared",
           "LiveCell", "count_flops", "finish_cell", "flatten_outputs", "fxopt_available", "max_rel_error",
           "measure_cell", "measure_peak_tflops", "reference_output", "start_cell", "stats", "time_calls",
           "time_round"]


# ---- statistics and timing -------------------------------------------------
def _percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    n = len(sorted_xs)
    if n == 1:
        return float(sorted_xs[0])
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return float(sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo))


def stats(samples: Sequence[float]) -> Dict[str, float]:
    """median, quartiles, IQR, mean, min, max and count of ``samples``."""
    if not samples:
        raise ValueError("stats() needs at least one sample")
    xs = sorted(float(s) for s in samples)
    q1, q3 = _percentile(xs, 25), _percentile(xs, 75)
    return {
        "median": float(statistics.median(xs)), "q1": q1, "q3": q3, "iqr": q3 - q1,
        "mean": float(statistics.fmean(xs)), "min": xs[0], "max": xs[-1], "n": len(xs),
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(fn: Callable, x: torch.Tensor, device: str, iters: int) -> List[float]:
    """Per-call times in ms: CUDA events around each call on CUDA,
    ``time.perf_counter`` on the CPU."""
    if device == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        torch.cuda.synchronize()
        for i in range(iters):
            starts[i].record()
            fn(x)
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(x)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _python_workload() -> int:
    d, acc = {}, 0
    for i in range(300):
        d[i & 31] = i
        acc += d.get(i & 15, 0) ^ i
    return acc


def host_speed_us(reps: int = 25) -> float:
    """Median time of a fixed pure-Python workload (no torch, ~20-50 us): the host's speed at this
    moment. On the H100 machines of BENCHMARKS.md it moves between levels over seconds (a factor up
    to ~2, whichever core the process is pinned to), and host-bound cells move with it; recorded per
    round so that rounds can be compared in the same host state."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        _python_workload()
        ts.append(time.perf_counter_ns() - t0)
    ts.sort()
    return ts[len(ts) // 2] / 1e3


def host_ms_per_call(fn: Callable, x: torch.Tensor, calls: int = 20) -> float:
    """Host (CPU) time to issue one call, back to back without synchronizing: close to the CUDA
    time, the cell is bound by Python/launch overhead and moves with the host's speed."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e3


# ---- accuracy, FLOPs, peak -------------------------------------------------
def flatten_outputs(out: Any) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flatten_outputs(o)]
    raise TypeError(f"unsupported model output type {type(out).__name__}")


def _cat(out: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in flatten_outputs(out)])


def max_rel_error(out: Any, ref: Any) -> float:
    """||out - ref||_inf / ||ref||_inf over all outputs (in fp32)."""
    r = _cat(ref)
    o = _cat(out).to(r.device)
    if o.shape != r.shape:
        raise ValueError(f"output has {o.numel()} elements, reference {r.numel()}")
    denom = r.abs().max().item()
    num = (o - r).abs().max().item()
    if num != num:  # NaN
        return float("inf")
    return num / denom if denom > 0 else num


@contextlib.contextmanager
def _no_tf32():
    m, c = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = m, c


def reference_output(model: nn.Module, x_cpu: torch.Tensor, device: str) -> torch.Tensor:
    """fp32 eager output (TF32 off) of ``model`` on ``device``, flattened."""
    m = copy.deepcopy(model).to(device=device, dtype=torch.float32)
    with torch.no_grad(), _no_tf32():
        ref = _cat(m(x_cpu.to(device=device, dtype=torch.float32)))
    _sync(device)
    del m
    return ref


def count_flops(model: nn.Module, x_cpu: torch.Tensor) -> int:
    """FLOPs of one forward pass (torch.utils.flop_counter), on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        m, x = copy.deepcopy(model).to("meta"), x_cpu.to("meta")
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            m(x)
    except Exception:  # pragma: no cover - meta kernels missing: count for real
        m, x = copy.deepcopy(model), x_cpu
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            m(x)
    return int(fc.get_total_flops())


def measure_peak_tflops(device: str, dtype: torch.dtype, quick: bool = False) -> Dict[str, Any]:
    """Best matmul throughput on ``device``: n=8192 on CUDA (fp32 with TF32 as
    cuDNN convs use it), n=1024 (512 with quick) on the CPU."""
    if device == "cuda":
        n, iters, warm = 8192, 10, 3
    else:
        n, iters, warm = (512, 3, 1) if quick else (1024, 5, 2)
    tf32 = bool(dtype == torch.float32 and device == "cuda" and torch.backends.cudnn.allow_tf32)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for _ in range(warm):
            torch.mm(a, b)
        times = time_calls(lambda _x: torch.mm(a, b), a, device, iters)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    best_ms = min(times)
    del a, b
    what = f"{n}x{n}x{n} {str(dtype).replace('torch.', '')} matmul" + (" (TF32)" if tf32 else "")
    return {"tflops": 2 * n ** 3 / (best_ms * 1e-3) / 1e12, "what": what, "best_ms": best_ms}


# ---- backends --------------------------------------------------------------
def _eager(model, x, device, dtype, options) -> Prepared:
    return Prepared(model, x)


def _eager_channels_last(model, x, device, dtype, options) -> Prepared:
    model = model.to(memory_format=torch.channels_last)
    return Prepared(model, x.contiguous(memory_format=torch.channels_last),
                    note="channels_last weights and input")


def _inductor(mode: Optional[str] = None) -> PrepareFn:
    def prepare(model, x, device, dtype, options) -> Prepared:
        kw = {"mode": mode} if mode else {}
        return Prepared(torch.compile(model, backend="inductor", **kw), x)

    return prepare


def _freezing_ctx() -> ContextManager:
    import torch._inductor.config as inductor_config

    return inductor_config.patch(freezing=True)


def _cudnn_default_ctx(*inner: Callable[[], ContextManager]) -> Callable[[], ContextManager]:
    """PyTorch's default cuDNN setting (``cudnn.benchmark`` off: heuristics choose) around a
    peer's compile and calls, plus ``inner`` contexts: every peer is timed with the search on (the
    harness's setting) and off, and counts at its faster one."""
    @contextlib.contextmanager
    def ctx():
        old = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = False
        try:
            with contextlib.ExitStack() as stack:
                for c in inner:
                    stack.enter_context(c())
                yield
        finally:
            torch.backends.cudnn.benchmark = old
    return ctx


def fxopt_available() -> Tuple[bool, str]:
    """(True, '') when torch.compile(backend='fxopt') can be resolved."""
    try:
        _fxopt_backend()
        return True, ""
    except Exception as exc:
        return False, f"{type(exc).__name__}: {_first_line(exc)}"


def _fxopt_backend():
    """'fxopt' if registered with dynamo (entry point or import-time
    registration), else the callable from an uninstalled checkout."""
    from torch._dynamo.backends.registry import lookup_backend

    import fxopt  # noqa: F401  (may register the backend on import)

    try:
        lookup_backend("fxopt")
        return "fxopt"
    except Exception:
        from fxopt.backend import fxopt_backend  # type: ignore

        return fxopt_backend


def _fxopt(extra: Dict[str, Any]) -> PrepareFn:
    def prepare(model, x, device, dtype, options) -> Prepared:
        opts = dict(options or {})
        opts.update(extra)
        backend = _fxopt_backend()
        note = "" if backend == "fxopt" else "fxopt not registered: used fxopt.backend.fxopt_backend"
        return Prepared(torch.compile(model, backend=backend, options=opts), x, note=note)

    return prepare


def _torch_compile_floor(backend: str) -> PrepareFn:
    """``torch.compile`` with one of PyTorch's non-optimizing backends (``eager``: Dynamo alone;
    ``aot_eager``: Dynamo + AOTAutograd, as fxopt uses them): the compile time and per-call cost
    below which no ``torch.compile`` backend can go."""
    def prepare(model, x, device, dtype, options) -> Prepared:
        return Prepared(torch.compile(model, backend=backend), x, note=f"torch.compile(backend={backend!r})")

    return prepare


def _entry_floor(model, x, device, dtype, options) -> Prepared:
    """``torch.compile`` with a backend whose compiled function computes nothing: it returns the
    outputs the captured graph gave on the example input (so the accuracy check holds for that
    input only). Its time per call is torch.compile's own entry (frame hook, guards, passing the
    parameters) on this host at this moment, the floor of any backend's latency."""
    def backend(gm, example_inputs):
        with torch.no_grad():
            result = gm(*example_inputs)

        def call(*args):
            return result

        return call

    return Prepared(torch.compile(model, backend=backend), x,
                    note="torch.compile entry only: returns the outputs of the example input")


def _deploy(name: str) -> PrepareFn:
    def prepare(model, x, device, dtype, options) -> Prepared:
        from . import deploy

        return getattr(deploy, name)(model, x, device, dtype, options)

    return prepare


_ORT_NP = {torch.float32: "float32", torch.float16: "float16"}


def _export_onnx(model: nn.Module, x: torch.Tensor, path: str) -> str:
    """Legacy TorchScript exporter (opset 17); the dynamo one if it is gone."""
    try:
        torch.onnx.export(model, (x,), path, dynamo=False, opset_version=17,
                          input_names=["input"], do_constant_folding=True)
        return "torch.onnx.export(dynamo=False, opset 17)"
    except Exception as legacy:
        try:
            prog = torch.onnx.export(model, (x,), dynamo=True, opset_version=18)
            prog.save(path)
            return f"dynamo exporter, opset 18 (legacy failed: {type(legacy).__name__})"
        except Exception:
            raise legacy


def _onnxruntime(cuda_graph: bool) -> PrepareFn:
    def prepare(model, x, device, dtype, options) -> Prepared:
        try:
            import numpy as np
            import onnxruntime as ort
        except Exception as exc:
            raise BackendUnavailable(f"onnxruntime not importable ({type(exc).__name__})")
        if dtype not in _ORT_NP:
            raise BackendUnavailable(f"{str(dtype).replace('torch.', '')} not supported by the IO binding")
        if device == "cuda":
            if hasattr(ort, "preload_dlls"):
                with contextlib.suppress(Exception):
                    ort.preload_dlls()
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise BackendUnavailable("no CUDA EP")
        elif cuda_graph:
            raise BackendUnavailable("CUDA graphs need --device cuda")
        outs = [torch.empty_like(t, memory_format=torch.contiguous_format)
                for t in flatten_outputs(model(x))]
        xb = x.contiguous()
        with tempfile.TemporaryDirectory(prefix="fxopt_bench_onnx_") as td:
            path = os.path.join(td, "model.onnx")
            exporter = _export_onnx(model, xb, path)
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            so.log_severity_level = 3
            if device == "cuda":
                dev_id = xb.device.index or 0
                cuda_opts = {"device_id": str(dev_id),
                             "user_compute_stream": str(torch.cuda.current_stream().cuda_stream),
                             "cudnn_conv_algo_search": "EXHAUSTIVE"}
                if cuda_graph:
                    cuda_opts["enable_cuda_graph"] = "1"
                providers = [("CUDAExecutionProvider", cuda_opts), "CPUExecutionProvider"]
            else:
                dev_id, providers = 0, ["CPUExecutionProvider"]
            sess = ort.InferenceSession(path, so, providers=providers)
        if device == "cuda" and sess.get_providers()[0] != "CUDAExecutionProvider":
            raise BackendUnavailable("no CUDA EP (the CUDA EP failed to load)")
        np_dtype = getattr(np, _ORT_NP[dtype])
        dev_type = "cuda" if device == "cuda" else "cpu"
        binding = sess.io_binding()
        in_name = sess.get_inputs()[0].name
        binding.bind_input(in_name, dev_type, dev_id, np_dtype, list(xb.shape), xb.data_ptr())
        for meta, t in zip(sess.get_outputs(), outs):
            binding.bind_output(meta.name, dev_type, dev_id, np_dtype, list(t.shape), t.data_ptr())
        xptr = xb.data_ptr()
        single = len(outs) == 1

        def fn(inp: torch.Tensor):
            if inp.data_ptr() != xptr:
                xb.copy_(inp)
            sess.run_with_iobinding(binding)
            return outs[0] if single else tuple(outs)

        ep = sess.get_providers()[0]
        note = f"{ep}{' + CUDA graph' if cuda_graph else ''}; {exporter}"
        return Prepared(fn, xb, tracks_memory=False, note=note)

    return prepare


BACKENDS: Dict[str, BackendSpec] = {s.name: s for s in [
    BackendSpec("eager", _eager),
    BackendSpec("eager-channels-last", _eager_channels_last),
    BackendSpec("inductor", _inductor()),
    BackendSpec("inductor-reduce-overhead", _inductor("reduce-overhead")),
    BackendSpec("inductor-freezing", _inductor(), context=_freezing_ctx),
    BackendSpec("inductor-freezing-reduce-overhead", _inductor("reduce-overhead"),
                context=_freezing_ctx),
    BackendSpec("inductor-max-autotune", _inductor("max-autotune"), default=False),
    # the same peers with cuDNN's default (no algorithm search)
    BackendSpec("eager-cudnn-default", _eager, context=_cudnn_default_ctx()),
    BackendSpec("inductor-reduce-overhead-cudnn-default", _inductor("reduce-overhead"), context=_cudnn_default_ctx()),
    BackendSpec("inductor-freezing-reduce-overhead-cudnn-default", _inductor("reduce-overhead"),
                context=_cudnn_default_ctx(_freezing_ctx)),
    BackendSpec("onnxruntime", _onnxruntime(False)),
    BackendSpec("onnxruntime-cudagraph", _onnxruntime(True), needs_cuda=True),
    BackendSpec("fxopt", _fxopt({}), is_fxopt=True),
    BackendSpec("fxopt-no-cudagraphs", _fxopt({"cudagraphs": False}), is_fxopt=True),
    BackendSpec("fxopt-direct", _fxopt({"conv_algorithm": "direct"}), is_fxopt=True, default=False),
    BackendSpec("fxopt-auto", _fxopt({"conv_algorithm": "auto"}), is_fxopt=True, default=False),
    BackendSpec("fxopt-no-fusion", _fxopt({"fusion": False}), is_fxopt=True, default=False),
    BackendSpec("fxopt-ieee", _fxopt({"fast_math": False}), is_fxopt=True, default=False),
    BackendSpec("fxopt-onnxruntime", _fxopt({"executor": "onnxruntime"}), is_fxopt=True, default=False),
    # built once, loaded without torch.compile (AOTInductor builds for minutes: not run by default)
    BackendSpec("fxopt-package", _deploy("prepare_package"), is_fxopt=True, deploy=True),
    BackendSpec("aotinductor", _deploy("prepare_aotinductor"), default=False, deploy=True),
    # floors (not peers): what torch.compile costs before any optimizing backend does anything
    BackendSpec("floor-dynamo-eager", _torch_compile_floor("eager"), default=False),
    BackendSpec("floor-aot-eager", _torch_compile_floor("aot_eager"), default=False),
    BackendSpec("floor-dynamo-entry", _entry_floor, default=False),
]}

DEFAULT_BACKENDS: List[str] = [n for n, s in BACKENDS.items() if s.default]


# ---- one cell: (model, batch, dtype, backend) ------------------------------
def _first_line(exc: BaseException) -> str:
    s = str(exc).strip()
    return s.splitlines()[0][:300] if s else ""


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
    cell.update(status="error", error=f"{type(exc).__name__}: {_first_line(exc)}")
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
                cell["kernels_per_call"] = _kernels_per_call(live.prepared.fn, live.prepared.inputs)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        _fail(cell, exc, backend, error_log)
        live.prepared = live.model = None
    finally:
        _record_warnings(cell, caught)
    return live


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


def _kernels_per_call(fn: Callable, x) -> Optional[int]:
    """GPU kernels one call launches (torch.profiler; a replayed CUDA graph's kernels count one by
    one), or None where the profiler is not available."""
    try:
        from fxopt.explain import kernel_launches

        return kernel_launches(lambda inp: fn(inp), [x])
    except Exception:  # noqa: BLE001 - a count is a diagnostic, never a reason to fail a cell
        return None


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
