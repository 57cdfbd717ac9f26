"""What the executors' lowerings share: placeholder positions, the folded-constants refresher, and
where a runner (CUDA-graph or CPU) keeps its decisions."""
from __future__ import annotations

import hashlib

import torch.fx as fx

from fxopt.names import FOLDED_CONSTANTS_MODULE


def placeholder_indices(gm: fx.GraphModule, names) -> list[int]:
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return [placeholders.index(n) for n in names if n in placeholders]


def read_params(gm: fx.GraphModule, params) -> list[int]:
    """The positions of the parameter placeholders ``gm`` reads (parameters nothing reads, e.g.
    BatchNorm's num_batches_tracked in eval, need no per-call check)."""
    read = {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.users}
    return placeholder_indices(gm, [p for p in params if p in read])


def constants_refresher(gm: fx.GraphModule):
    """(a function(args) that brings folded constants up to date, the indices of the inputs they
    are folded from), or (None, [])."""
    call = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == FOLDED_CONSTANTS_MODULE), None)
    if call is None:
        return None, []
    idx = placeholder_indices(gm, [a.name for a in call.args])
    module = getattr(gm, FOLDED_CONSTANTS_MODULE)
    return (lambda args: module(*[args[i] for i in idx])), idx


def decisions_cache(ctx, runnable: fx.GraphModule, baseline, device_type: str = "cuda") -> tuple | None:
    """Where a runner (CUDA-graph or CPU) keeps its decisions: the autotuning cache, keyed by the
    device and the code of the graphs it decides between (None with ``autotune_cache=False``)."""
    from fxopt.autotune import AutotuneCache, device_fingerprint

    opt = ctx.options.autotune_cache
    if opt is False:
        return None
    code = runnable.code + ("" if baseline is None else baseline.code)
    cache = AutotuneCache.for_option(opt)
    return cache, device_fingerprint(device_type), hashlib.sha256(code.encode()).hexdigest()[:16]


def unoptimized_baseline(gm: fx.GraphModule, ctx):
    """The graph as it came in, runnable, for a runner to compare against (None where option
    ``baseline_check`` is off or nothing changed). An inference graph's outputs are handed out in
    the layouts eager gives them, as the optimized graph's are (``output_formats``): whichever of
    the two a signature replays, the caller sees the same strides."""
    from fxopt.backends import torch_ref
    from fxopt.eager_formats import restore_output_formats

    if ctx.options.baseline_check and ctx.unoptimized is not None and gm is not ctx.unoptimized:
        runnable = torch_ref.lower(ctx.unoptimized)
        if ctx.mode == "inference" and restore_output_formats(runnable, ctx.output_formats, ctx.output_strides):
            runnable.graph.lint()
            runnable.recompile()
        return runnable
    return None
