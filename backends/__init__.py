"""Executors: turn an optimized graph into something that runs.

- ``torch``: the reference executor (``torch_ref``), everywhere.
- ``cpu``: for CPU inference; the reference graph with oneDNN's fused convolutions, never slower
  than the unoptimized graph (``cpu``).
- ``cuda``: for CUDA inputs; the reference graph with generated kernels for fused regions where
  available, replayed as CUDA graphs (``cudagraphs``).
- ``onnxruntime``: the exported graph in an ONNX Runtime session (``onnxrt``).
"""
from __future__ import annotations

import torch.fx as fx

from fxopt.backends import torch_ref
from fxopt.backends.cuda.runtime.cudagraphs import CudaGraphRunner, unsafe_reason
from fxopt.autotune import cudnn_choice
from fxopt.passinfra import written_in_place


def resolve_executor(choice: str, device_type: str, kind: str) -> str:
    """Option ``executor`` for a graph: "auto" is the cuda executor for CUDA inputs (inference and
    training graphs), the cpu executor for CPU inference and the torch executor for CPU training."""
    if choice == "auto":
        if device_type == "cuda":
            return "cuda"
        return "cpu" if kind == "inference" else "torch"
    return choice


def _placeholder_indices(gm: fx.GraphModule, names) -> list[int]:
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return [placeholders.index(n) for n in names if n in placeholders]


def _constants_refresher(gm: fx.GraphModule):
    """(a function(args) that brings folded constants up to date, the indices of the inputs they
    are folded from), or (None, [])."""
    from fxopt.passes.fold_constants import MODULE_NAME

    call = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == MODULE_NAME), None)
    if call is None:
        return None, []
    idx = _placeholder_indices(gm, [a.name for a in call.args])
    module = getattr(gm, MODULE_NAME)
    return (lambda args: module(*[args[i] for i in idx])), idx


def _decisions_cache(ctx, runnable: fx.GraphModule, baseline, device_type: str = "cuda") -> tuple | None:
    """Where a runner (CUDA-graph or CPU) keeps its decisions: the autotuning cache, keyed by the
    device and the code of the graphs it decides between (None with ``autotune_cache=False``)."""
    import hashlib

    from fxopt.autotune import AutotuneCache, device_fingerprint

    opt = ctx.options.autotune_cache
    if opt is False:
        return None
    code = runnable.code + ("" if baseline is None else baseline.code)
    cache = AutotuneCache.for_option(opt)
    return cache, device_fingerprint(device_type), hashlib.sha256(code.encode()).hexdigest()[:16]


def lower(gm: fx.GraphModule, ctx, kind: str):
    """Returns (callable, info) where info has executor, cudagraphs and kernels."""
    executor = resolve_executor(ctx.options.executor, ctx.device_type, kind)
    info = {"executor": executor, "cudagraphs": "off", "kernels": []}
    if executor == "onnxruntime":
        from fxopt.backends.onnxrt import lower_onnxruntime

        return lower_onnxruntime(gm, ctx, kind, info)
    runnable = torch_ref.lower(gm)
    if executor == "cpu":
        return _lower_cpu(gm, runnable, ctx, kind, info)
    if executor == "cuda":
        from fxopt.backends.cuda.runtime.executor import attach_kernels

        runnable = attach_kernels(runnable, ctx, info)
    want = ctx.options.cudagraphs
    training = kind != "inference"
    reason = unsafe_reason(gm, kind, ctx.device_type, ctx.param_placeholders)
    if training and ctx.training_link is None and not reason:
        reason = "training graph compiled without its forward/backward link"
    # cuDNN chooses as the user set it in training (fxopt measures no conv algorithms there); in
    # inference by its heuristics unless option cudnn_search (fxopt.autotune.cudnn_choice)
    search = ctx.options.cudnn_search or training
    uncaptured = cudnn_choice(runnable, search)
    if want is False:
        info["cudagraphs"] = "off (option cudagraphs=False)"
        return uncaptured, info
    if reason:
        info["cudagraphs"] = f"off ({reason})"
        return uncaptured, info
    static = _placeholder_indices(gm, ctx.param_placeholders)
    # parameters nothing reads (e.g. BatchNorm's num_batches_tracked in eval) need no per-call check
    read = [n.name for n in runnable.graph.nodes if n.op == "placeholder" and n.users]
    watched = _placeholder_indices(runnable, [p for p in ctx.param_placeholders if p in read])
    baseline = baseline_watched = None
    if ctx.options.baseline_check and ctx.unoptimized is not None and gm is not ctx.unoptimized:
        baseline = torch_ref.lower(ctx.unoptimized)
        read = [n.name for n in baseline.graph.nodes if n.op == "placeholder" and n.users]
        baseline_watched = _placeholder_indices(baseline, [p for p in ctx.param_placeholders if p in read])
    refresh, folded_from = _constants_refresher(runnable)
    runner = CudaGraphRunner(uncaptured, static, refresh=refresh, versioned=folded_from,
                             max_graphs=ctx.options.cudagraph_max_signatures, watched=watched,
                             baseline=None if baseline is None else cudnn_choice(baseline, search),
                             baseline_watched=baseline_watched,
                             decisions_cache=_decisions_cache(ctx, runnable, baseline),
                             training=ctx.training_link if training else None,
                             written=_placeholder_indices(gm, [n.name for n in gm.graph.nodes
                                                               if n.op == "placeholder" and written_in_place(n)]))
    info["cudagraphs"] = f"on (up to {ctx.options.cudagraph_max_signatures} signatures)"
    info["baseline_check"] = baseline is not None
    info["cudagraph_runner"] = runner  # its decisions() say, per signature, replay vs plain timings
    return runner, info


def _lower_cpu(gm: fx.GraphModule, runnable: fx.GraphModule, ctx, kind: str, info: dict):
    """The CPU executor (``fxopt.backends.cpu``): oneDNN convolutions, and the faster of the
    optimized and the unoptimized graph per input signature."""
    from fxopt.backends import cpu

    if kind != "inference" or ctx.device_type != "cpu":
        raise ValueError(f"fxopt: the cpu executor runs CPU inference graphs, not a {ctx.device_type} {kind} graph")
    runnable = cpu.lower_pools(cpu.lower_onednn(runnable, info), info)
    info["cudagraphs"] = "off (CPU)"
    baseline = None
    if ctx.options.baseline_check and ctx.unoptimized is not None and gm is not ctx.unoptimized:
        baseline = torch_ref.lower(ctx.unoptimized)
    ort, why = None, "option cpu_onnxruntime=False"
    if ctx.options.cpu_onnxruntime:
        from fxopt.backends.onnxrt import cpu_candidate

        ort, why = cpu_candidate(gm, ctx)
    info["onnxruntime_candidate"] = "timed per signature" if ort is not None else f"none ({why})"
    runner = cpu.CpuRunner(runnable, baseline, _placeholder_indices(gm, ctx.param_placeholders),
                           decisions_cache=_decisions_cache(ctx, runnable, baseline, "cpu"), onnxruntime=ort)
    info["baseline_check"] = baseline is not None
    info["cpu_runner"] = runner  # its decisions() say, per signature, which graph runs and the times
    return runner, info
