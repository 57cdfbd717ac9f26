"""The OpenVINO peers of the benchmark harness (CPU): the model converted by
``openvino.convert_model`` and compiled for the CPU plugin with ``PERFORMANCE_HINT=LATENCY`` and the
process's thread count, the input and output shared with torch tensors (no copies).

- ``openvino-f32``: ``INFERENCE_PRECISION_HINT=f32`` (float32 arithmetic for a float32 model).
- ``openvino``: OpenVINO's default inference precision, which on a CPU with bfloat16 units
  (AVX512-BF16, AMX) is bfloat16 even for a float32 model; the cell's note names the precision the
  compiled model runs at. Its accuracy is checked against float32 eager like any peer's: a float32
  cell it runs in bfloat16 fails the float32 tolerance and says so.

Each peer counts at its best setting: it is compiled with and without CPU pinning
(``ENABLE_CPU_PINNING``), with the process's thread count and with one thread
(``INFERENCE_NUM_THREADS``: at a small model's batch 1 the calling thread alone can beat a hand-off),
each timed briefly, and the fastest kept (the note says which).
"""
from __future__ import annotations

import torch

from .measure import flatten_outputs, setting_ms
from .spec import BackendUnavailable, Prepared, PrepareFn

__all__ = ["openvino_peer", "openvino_version"]


def openvino_version():
    try:
        import openvino

        return openvino.__version__.split("-")[0]
    except Exception:
        return None


def _compile(core, ov_model, precision, pinning: bool, threads: int):
    cfg = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads, "ENABLE_CPU_PINNING": pinning}
    if precision:
        cfg["INFERENCE_PRECISION_HINT"] = precision
    return core.compile_model(ov_model, "CPU", cfg)


def openvino_peer(precision):
    """The peer's prepare function; ``precision``: "f32", or None for OpenVINO's default."""
    def prepare(model, x, device, dtype, options) -> Prepared:
        if device != "cpu":
            raise BackendUnavailable("OpenVINO runs on --device cpu here")
        try:
            import openvino as ov

            from fxopt.backends.openvino import shared_tensor
        except Exception as exc:
            raise BackendUnavailable(f"openvino not importable ({type(exc).__name__})")
        with torch.no_grad():
            outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in flatten_outputs(model(x))]
            ov_model = ov.convert_model(model, example_input=x)
        core = ov.Core()
        xb = x.contiguous()
        best = None
        for threads in sorted({1, max(1, torch.get_num_threads())}, reverse=True):
            for pinning in (True, False):
                compiled = _compile(core, ov_model, precision, pinning, threads)
                req = compiled.create_infer_request()
                req.set_input_tensor(shared_tensor(xb))
                for i, t in enumerate(outs):
                    req.set_output_tensor(i, shared_tensor(t))
                ms = setting_ms(req.infer)
                if best is None or ms < best[0]:
                    best = (ms, pinning, threads, compiled, req)
        _, pinning, threads, compiled, req = best
        xptr = xb.data_ptr()
        single = len(outs) == 1

        def fn(inp: torch.Tensor):
            if inp.data_ptr() != xptr:
                xb.copy_(inp)
            req.infer()
            return outs[0] if single else tuple(outs)

        hint = compiled.get_property("INFERENCE_PRECISION_HINT")
        ran = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)
        note = (f"OpenVINO {openvino_version()} CPU, LATENCY hint, inference precision {ran}, pinning {pinning}, "
                f"{threads} thread{'s' if threads > 1 else ''}")
        return Prepared(fn, xb, tracks_memory=False, note=note)

    return prepare
