"""The backends the benchmark harness times, by name (:data:`BACKENDS`): eager PyTorch, Inductor
in its modes, fxopt with its options, fxopt's deployment package, and the floors (``torch.compile``
with PyTorch's non-optimizing backends). ONNX Runtime lives in ``fxopt.bench.ort_peer``, OpenVINO in ``fxopt.bench.ov_peer``, the
deployment backends in ``fxopt.bench.deploy``.

A backend is a :class:`BackendSpec`: ``prepare(model, example_input, device, dtype,
fxopt_options) -> Prepared`` builds the callable to time, and ``context()`` is entered around
preparation, the first call, the warm-up and the timed runs (``inductor-freezing`` patches the
inductor config there).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch

from .ort_peer import onnxruntime_peer
from .ov_peer import openvino_peer
from .spec import BackendSpec, Prepared, PrepareFn

__all__ = ["BACKENDS", "DEFAULT_BACKENDS", "first_line", "fxopt_available"]


def first_line(exc: BaseException) -> str:
    """An exception's message, its first line, at most 300 characters."""
    s = str(exc).strip()
    return s.splitlines()[0][:300] if s else ""


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
        return False, f"{type(exc).__name__}: {first_line(exc)}"


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
        from fxopt.backend import fxopt_backend

        opts = dict(options or {})
        opts.update(extra)
        note = "" if _fxopt_backend() == "fxopt" else "fxopt not registered: used fxopt.backend.fxopt_backend"
        reports: list = []  # the graphs' reports (the entry "fxopt" is this function without them)
        compiled = torch.compile(model, backend=functools.partial(fxopt_backend, _sink=reports), options=opts)
        return Prepared(compiled, x, note=note, ran=lambda: compiled_ran(reports))

    return prepare


def compiled_ran(reports: list) -> str:
    """The cpu executor's ways that run the compiled graphs' input signatures ("" elsewhere)."""
    ways = set()
    try:
        for r in reports:
            runner = getattr(getattr(r, "lowered", None), "cpu_runner", None)
            ways.update(d.get("runs") for d in (runner.decisions() if runner is not None else []))
    except Exception:  # noqa: BLE001 - a diagnostic, never a reason to fail a cell
        return ""
    return ", ".join(sorted(w for w in ways if w))


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
    BackendSpec("inductor-cudnn-default", _inductor(), context=_cudnn_default_ctx(), default=False),
    BackendSpec("inductor-freezing-cudnn-default", _inductor(), context=_cudnn_default_ctx(_freezing_ctx), default=False),
    BackendSpec("inductor-reduce-overhead-cudnn-default", _inductor("reduce-overhead"), context=_cudnn_default_ctx()),
    BackendSpec("inductor-freezing-reduce-overhead-cudnn-default", _inductor("reduce-overhead"),
                context=_cudnn_default_ctx(_freezing_ctx)),
    BackendSpec("onnxruntime", onnxruntime_peer(False)),
    BackendSpec("onnxruntime-cudagraph", onnxruntime_peer(True), needs_cuda=True),
    # CPU only: float32 arithmetic, and OpenVINO's default precision (bfloat16 on CPUs with bf16 units)
    BackendSpec("openvino-f32", openvino_peer("f32")),
    BackendSpec("openvino", openvino_peer(None)),
    BackendSpec("fxopt", _fxopt({}), is_fxopt=True),
    BackendSpec("fxopt-no-cudagraphs", _fxopt({"cudagraphs": False}), is_fxopt=True),
    BackendSpec("fxopt-direct", _fxopt({"conv_algorithm": "direct"}), is_fxopt=True, default=False),
    BackendSpec("fxopt-auto", _fxopt({"conv_algorithm": "auto"}), is_fxopt=True, default=False),
    BackendSpec("fxopt-no-fusion", _fxopt({"fusion": False}), is_fxopt=True, default=False),
    BackendSpec("fxopt-ieee", _fxopt({"fast_math": False}), is_fxopt=True, default=False),
    BackendSpec("fxopt-onnxruntime", _fxopt({"executor": "onnxruntime"}), is_fxopt=True, default=False),
    # independent branches on up to four CUDA streams, kept per signature where measured faster
    BackendSpec("fxopt-streams", _fxopt({"streams": 4}), is_fxopt=True, default=False),
    # built once, loaded without torch.compile (AOTInductor builds for minutes: not run by default)
    BackendSpec("fxopt-package", _deploy("prepare_package"), is_fxopt=True, deploy=True),
    BackendSpec("aotinductor", _deploy("prepare_aotinductor"), default=False, deploy=True),
    # floors (not peers): what torch.compile costs before any optimizing backend does anything
    BackendSpec("floor-dynamo-eager", _torch_compile_floor("eager"), default=False),
    BackendSpec("floor-aot-eager", _torch_compile_floor("aot_eager"), default=False),
    BackendSpec("floor-dynamo-entry", _entry_floor, default=False),
]}

DEFAULT_BACKENDS: List[str] = [n for n, s in BACKENDS.items() if s.default]

