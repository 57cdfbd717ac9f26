"""The ONNX Runtime peer of the benchmark harness: the model exported by ``torch.onnx.export`` in an
ONNX Runtime session (CUDA EP or CPU EP), its input and outputs bound in place (IO binding), with or
without the CUDA EP's CUDA graph. On the CPU it counts at its best setting: sessions with ORT's default,
the process's and one intra-op thread (at a small model's batch 1 the calling thread alone can beat
a hand-off to a worker) are each timed briefly and the faster kept (the note says which)."""
from __future__ import annotations

import contextlib
import os
import tempfile

import torch
from torch import nn

from .measure import flatten_outputs, setting_ms
from .spec import BackendUnavailable, Prepared, PrepareFn

__all__ = ["onnxruntime_peer"]


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


def _bind(sess, xb: torch.Tensor, outs: list, dev_id: int, dtype: torch.dtype, dev_type: str):
    import numpy as np

    np_dtype = getattr(np, _ORT_NP[dtype])
    binding = sess.io_binding()
    binding.bind_input(sess.get_inputs()[0].name, dev_type, dev_id, np_dtype, list(xb.shape), xb.data_ptr())
    for meta, t in zip(sess.get_outputs(), outs):
        binding.bind_output(meta.name, dev_type, dev_id, np_dtype, list(t.shape), t.data_ptr())
    return binding


def onnxruntime_peer(cuda_graph: bool) -> PrepareFn:
    def prepare(model, x, device, dtype, options) -> Prepared:
        try:
            import numpy  # noqa: F401 - the IO binding's dtypes
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
                thread_counts = [0]  # ORT's default
            else:
                dev_id, providers = 0, ["CPUExecutionProvider"]
                thread_counts = [0] + sorted({1, max(1, torch.get_num_threads())}, reverse=True)  # 0: ORT's default
            best = None
            for threads in thread_counts:
                so.intra_op_num_threads = threads
                sess = ort.InferenceSession(path, so, providers=providers)
                if device == "cuda" and sess.get_providers()[0] != "CUDAExecutionProvider":
                    raise BackendUnavailable("no CUDA EP (the CUDA EP failed to load)")
                binding = _bind(sess, xb, outs, dev_id, dtype, "cuda" if device == "cuda" else "cpu")
                ms = setting_ms(lambda: sess.run_with_iobinding(binding)) if len(thread_counts) > 1 else 0.0
                if best is None or ms < best[0]:
                    best = (ms, threads, sess, binding)
        _, threads, sess, binding = best
        xptr = xb.data_ptr()
        single = len(outs) == 1

        def fn(inp: torch.Tensor):
            if inp.data_ptr() != xptr:
                xb.copy_(inp)
            sess.run_with_iobinding(binding)
            return outs[0] if single else tuple(outs)

        ep = sess.get_providers()[0]
        note = f"{ep}{' + CUDA graph' if cuda_graph else ''}; {exporter}"
        if device != "cuda":
            note += f"; {threads} intra-op thread{'s' if threads > 1 else ''}" if threads else "; default intra-op threads"
        return Prepared(fn, xb, tracks_memory=False, note=note)

    return prepare

