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
    graphs = f"{hashlib.sha256(code.encode()).hexdigest()[:16]}-{model_tag(runnable, ctx.param_placeholders)}"
    return cache, device_fingerprint(device_type), graphs


_LETTERS = str.maketrans("0123456789abcdef", "ghijklmnopqrstuv")


def model_tag(gm: fx.GraphModule, params) -> str:
    """A name of the model a graph runs, the same at every size: a hash of its weights' shapes and
    dtypes (parameter placeholders, constants), written in letters only, so that it stays in a key's
    signature (``fxopt.dynamic_buckets.signature`` blanks numbers and hex hashes): a runner's decision
    measured for one model is never taken for another whose inputs match."""
    import torch

    weights = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and ((n.op == "placeholder" and n.name in params) or n.op == "get_attr"):
            weights.append((tuple(int(d) for d in v.shape), str(v.dtype)))
    if not weights:  # none: the operations it calls, in order
        weights = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]
    return hashlib.sha256(repr(weights).encode()).hexdigest()[:12].translate(_LETTERS)


class DeferredGraph:
    """A graph made at its first use: the unoptimized graph at one size of a symbolic graph
    (``fxopt.dynamic_compile``), which a size whose bucket already decided between the optimized
    graph and the baseline never needs (its making and its runnable copy were a third of a
    lowering's cost). ``make()`` makes it; ``like``: a graph module with the same placeholders (read
    without making it: which parameters it reads); ``ident``: a string that names it (the runners'
    decision keys)."""

    def __init__(self, make, like: fx.GraphModule, ident: str):
        self._make, self.like, self.ident = make, like, ident
        self._gm = None

    def get(self) -> fx.GraphModule:
        if self._gm is None:
            self._gm = self._make()
        return self._gm


def unoptimized(ctx):
    """The graph as it came in (``ctx.unoptimized``), made now where it was deferred; or None."""
    u = ctx.unoptimized
    return u.get() if isinstance(u, DeferredGraph) else u


class DeferredBaseline:
    """The runnable baseline of a ``DeferredGraph``, made at its first call. ``code`` names it and
    ``graph`` lists its placeholders (those of ``like``) without making it."""

    def __init__(self, make, source: DeferredGraph):
        self._make, self.source = make, source
        self._fn = None

    def __call__(self, *args):
        if self._fn is None:
            self._fn = self._make(self.source.get())
        return self._fn(*args)

    @property
    def code(self) -> str:
        return self.source.ident

    @property
    def graph(self) -> fx.Graph:
        return self.source.like.graph


def unoptimized_baseline(gm: fx.GraphModule, ctx, deferred: bool = False):
    """The graph as it came in, runnable, for a runner to compare against (None where option
    ``baseline_check`` is off or nothing changed). An inference graph's outputs are handed out in
    the layouts eager gives them, as the optimized graph's are (``output_formats``): whichever of
    the two a signature replays, the caller sees the same strides. ``deferred``: where
    ``ctx.unoptimized`` is a ``DeferredGraph``, a ``DeferredBaseline`` (made at its first call)."""
    if not (ctx.options.baseline_check and ctx.unoptimized is not None and gm is not ctx.unoptimized):
        return None
    if isinstance(ctx.unoptimized, DeferredGraph) and deferred:
        return DeferredBaseline(lambda src: _runnable_baseline(src, ctx), ctx.unoptimized)
    return _runnable_baseline(unoptimized(ctx), ctx)


def _runnable_baseline(src: fx.GraphModule, ctx) -> fx.GraphModule:
    from fxopt.backends import torch_ref
    from fxopt.eager_formats import restore_output_formats

    runnable = torch_ref.lower(src)
    if ctx.mode == "inference" and restore_output_formats(runnable, ctx.output_formats, ctx.output_strides):
        runnable.graph.lint()
        runnable.recompile()
    return runnable
