"""select_conv_algorithm: choose direct / Winograd / FFT / GEMM for every convolution.

Why: no single convolution algorithm wins everywhere. cuDNN's direct and
implicit-GEMM kernels win for small kernels; FFT wins by multiples for very
large kernels (31x31 depthwise, 1-D kernels of hundreds of taps); Winograd can
win for some 3x3 layers. The right choice depends on shape, dtype, layout and
device, so it is made per convolution (a resolve rule per op, recorded in
``node.meta["fxopt_conv_algorithm"]``, as hidet's ``conv2d/resolve.py`` does).

Matches: every ``fxopt::fused_conv`` node (so ``fuse_conv_epilogue`` must run first).

Produces: the same node with its ``algorithm`` argument set and, for algorithms
with weight-only work, a ``fxopt::prepack_conv_weight`` node as its
``prepacked`` argument (folded to a constant by ``fold_constants``).

Modes (option ``conv_algorithm``, or a dict keyed by the module's qualified name
with ``"*"`` as default): ``"auto"`` measures the legal candidates (default on
CUDA; results cached, see ``fxopt.autotune``); ``"heuristic"`` uses the cost
model, no measurement (default on CPU); an algorithm name forces it where legal
(``direct`` elsewhere).

Pruning (option ``conv_prune``, default 4): in ``"auto"`` mode a candidate whose
cost-model estimate exceeds that factor times the best estimate is not measured
(recorded as rejected, with both estimates); ``direct`` always stays. Where only
``direct`` is left the conv takes it without measuring (``how="pruned"``): each
measured candidate costs a float64 reference check, warm-up and timed runs.

Illegal: training graphs (direct only: the backward graph is cuDNN's anyway);
each algorithm's own legality (``ConvAlgorithm.legal``, ``fxopt.conv_algorithms``);
an algorithm the target's executor does not run (``ctx.target.conv_algorithms``); a candidate whose
output differs from direct beyond its documented tolerance.
"""
from __future__ import annotations

import fnmatch
import math

import torch
import torch.fx as fx

from fxopt.autotune import AutotuneCache, ConvChoice, device_fingerprint, measure
from fxopt.conv_algorithms import ALGORITHMS, get_algorithm, grouped_search, legal_algorithms
from fxopt.ops import FUSED_CONV, PREPACK, conv_sig_of
from fxopt.passinfra import PassContext, PassResult, is_call, module_path, val

ARG_ALGORITHM, ARG_PREPACKED = 10, 11


def requested(ctx: PassContext, qualname: str) -> str:
    """The mode or algorithm asked for this conv: exact name, then glob patterns, then '*'."""
    opt = ctx.options.conv_algorithm
    if isinstance(opt, dict):
        if qualname in opt:
            opt = opt[qualname]
        else:
            pats = [p for p in opt if p != "*" and fnmatch.fnmatchcase(qualname, p)]
            opt = opt[pats[0]] if pats else opt.get("*", None)
    if opt is None:
        opt = "auto" if ctx.device_type == "cuda" else "heuristic"
    return opt


def _batch_hint(v: torch.Tensor) -> tuple[int, bool]:
    n = v.shape[0]
    if isinstance(n, int):
        return n, False
    hint = getattr(getattr(n, "node", None), "hint", None)
    return (int(hint) if hint is not None else 1), True


def estimates(sig, batch: int, legal: list[str]) -> dict:
    """The cost model's time (ms) of every legal algorithm for this conv."""
    return {name: get_algorithm(name).estimate_ms(sig, batch) for name in legal}


def heuristic(sig, batch: int, legal: list[str]) -> ConvChoice:
    est = estimates(sig, batch, legal)
    ok = {k: v for k, v in est.items() if v is not None and math.isfinite(v)}
    return ConvChoice(algorithm=min(ok, key=ok.get) if ok else "direct", candidates=est, how="heuristic")


def prune(sig, batch: int, legal: list[str], factor) -> tuple[list[str], dict]:
    """The candidates worth measuring, and a reason for each one left out: those whose estimate
    is more than ``factor`` times the best one (``direct`` always stays; no factor: all stay)."""
    if not factor:
        return list(legal), {}
    est = estimates(sig, batch, legal)
    best = min(est.values())
    keep, left_out = [], {}
    for name in legal:
        if name == "direct" or est[name] <= factor * best:
            keep.append(name)
        else:
            left_out[name] = f"pruned: estimate {est[name]:.3g} ms > {factor:g} x best estimate {best:.3g} ms"
    return keep, left_out


def choose(ctx: PassContext, node: fx.Node, qualname: str, cache: AutotuneCache) -> ConvChoice:
    x, w = val(node.args[0]), val(node.args[1])
    batch, symbolic = _batch_hint(x)
    stride, padding, dilation, groups = node.args[4:8]
    sig = conv_sig_of(x, w, stride, padding, dilation, groups, batch_symbolic=symbolic)
    runs = ctx.target.conv_algorithms
    legal = [a for a in legal_algorithms(sig) if a == "direct" or a in runs]
    want = requested(ctx, qualname)
    shape = f"x={tuple(x.shape)} w={tuple(w.shape)} {str(sig.dtype).replace('torch.', '')} " \
            f"{'NHWC' if sig.channels_last else 'NCHW'}"
    if want in ALGORITHMS:
        if want in legal:
            return ConvChoice(want, {n: None for n in legal}, how="forced", shape_str=shape)
        reason = ALGORITHMS[want].legal(sig) or f"the {ctx.target.executor} executor does not run it"
        ctx.note(f"{qualname}: {want} illegal ({reason}); direct")
        return ConvChoice("direct", {n: None for n in legal}, how="forced-illegal", shape_str=shape)
    if not legal:  # sizes no legality is decided at (symbolic height and width): the library's own
        return ConvChoice("direct", {}, how="symbolic sizes", shape_str=shape)
    if legal == ["direct"]:
        return ConvChoice("direct", {"direct": None}, how="only-direct", shape_str=shape)
    if want == "heuristic":
        choice = heuristic(sig, batch, legal)
        choice.shape_str = shape
        return choice
    factor = ctx.options.conv_prune
    keep, left_out = prune(sig, batch, legal, factor)
    if keep == ["direct"]:
        return ConvChoice("direct", {n: None for n in legal}, rejected=left_out, how="pruned", shape_str=shape)
    key = f"{sig.key()}|n={batch}" + (f"|prune={factor:g}" if factor else "")
    if sig.device_type == "cuda" and grouped_search(sig.groups, sig.w_shape[1]):
        key += "|searched"  # direct runs by cuDNN's search (conv_algorithms.searched_grouped)
    device = device_fingerprint(sig.device_type)
    hit = cache.get(device, key)
    if hit is not None and hit.get("algorithm") in legal:
        return ConvChoice(hit["algorithm"], hit.get("candidates", {}), hit.get("max_rel_error"),
                          hit.get("errors", {}), hit.get("rejected", {}), how="cached", shape_str=shape)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        choice = measure(sig, batch, keep, torch.device(sig.device_type, 0) if sig.device_type == "cuda"
                         else torch.device("cpu"))
    ctx.measurements += sum(1 for v in choice.candidates.values() if v is not None)
    choice.candidates = {n: choice.candidates.get(n) for n in legal}  # pruned ones: None
    choice.rejected.update(left_out)
    choice.shape_str = shape
    cache.put(device, key, choice.to_json())
    return choice


def rewrite(gm: fx.GraphModule, node: fx.Node, choice: ConvChoice) -> None:
    args = list(node.args)
    args[ARG_ALGORITHM] = choice.algorithm
    args[ARG_PREPACKED] = None
    if choice.algorithm != "direct":
        x = val(node.args[0])
        batch, symbolic = _batch_hint(x)
        x_shape = [-1 if symbolic else batch] + [int(s) for s in x.shape[1:]]
        cl = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        with gm.graph.inserting_before(node):
            args[ARG_PREPACKED] = gm.graph.call_function(
                PREPACK, (node.args[1], choice.algorithm, x_shape, *node.args[4:8], x.dtype, cl))
    node.args = tuple(args)
    node.meta["fxopt_conv_algorithm"] = choice.algorithm


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    convs = [n for n in gm.graph.nodes if is_call(n, FUSED_CONV) and val(n) is not None]
    if ctx.mode != "inference":
        ctx.note("skipped: training graph keeps direct convolutions")
        return PassResult(gm, False)
    opt = ctx.options.autotune_cache
    cache = AutotuneCache.for_option(opt)
    changed = False
    seen: dict[str, int] = {}
    progress = None
    for node in convs:
        qual = module_path(node) or node.name
        seen[qual] = seen.get(qual, 0) + 1
        if seen[qual] > 1:
            qual = f"{qual}#{seen[qual]}"
        if progress is None and requested(ctx, qual) == "auto":
            from tqdm.auto import tqdm

            progress = tqdm(total=len(convs), desc="fxopt autotune", unit="conv", leave=False, disable=None)
        choice = choose(ctx, node, qual, cache)
        if progress is not None:
            progress.update(1)
        ctx.conv_algorithms[qual] = choice
        node.meta["fxopt_conv_algorithm_how"] = choice.how  # forced, measured, cached, pruned, heuristic...
        if choice.algorithm != node.args[ARG_ALGORITHM] or choice.algorithm != "direct":
            rewrite(gm, node, choice)
            changed = changed or choice.algorithm != "direct"
        if choice.algorithm != "direct":
            ctx.note(f"{qual}: {choice.algorithm} ({choice.how})")
    if progress is not None:
        progress.close()
    if changed:
        gm.recompile()
    return PassResult(gm, changed)
