"""How the cuda executor decides between implementations of a node: measured, and remembered.

- ``real_args``: random tensors shaped like the node's inputs (conv weights scaled down).
- ``measure``: every candidate checked against the reference (relative error) and timed: replayed
  as a CUDA graph when the graph will run under CUDA graphs (``time_graphed_ms``; Python launch
  costs then do not decide), else with CUDA events; the fastest correct one is the choice. A
  candidate whose plain runs after its check (the faster of two, between CUDA events) take more than
  ``PRUNE_FACTOR`` times the fastest one timed so far plus ``PRUNE_MARGIN_MS`` is not timed further
  (``pruned``): a plain run's span holds its kernels' time, so it cannot win, and timing it costs about
  110 of its runs (a direct 7x7 stem conv at 8 ms a run against cuDNN's 0.09: 0.9 s of a bucket's
  lowering; on resnet18 fp16 across batch 1-64, about 6 of the 8 s of kernels its measurements ran, as
  estimated from the cached timings times the runs each takes, H100).
- ``Tuning.entry``: the choice from the autotuning cache, else measured and stored, so a second
  compile measures nothing (``lookup`` and ``measured``: the two halves, for a caller that asks
  before compiling the candidates' kernels). ``cache_key`` names a node by what decides its choice: target, input
  shapes/layouts/dtypes, constant arguments and the candidates.
- ``with_fallback``: a candidate that may decline at run time (``None``) backed by the reference.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen.source import layout_name
from fxopt.ops import fused_conv_ref


def real_args(node: fx.Node) -> list:
    """Random inputs for measuring ``node``'s candidates: on the device, with the exact strides and
    storage offsets the graph's values have (a generated kernel only accepts those); vectors
    (per-channel scales, biases, BatchNorm statistics) positive, so a variance is one."""
    def real(v):
        if v.device.type == "meta":  # a loaded package's values: never measured with
            raise ValueError("measuring needs the values' device; a meta tensor has none")
        shape, stride = tuple(int(d) for d in v.shape), tuple(int(s) for s in v.stride())
        span = int(v.storage_offset()) + 1 + sum((n - 1) * abs(st) for n, st in zip(shape, stride) if n > 0)
        if v.dim() == 1 and v.is_floating_point():
            base = torch.rand(span, device=v.device, dtype=torch.float32) + 0.5
        else:
            base = torch.randn(span, device=v.device, dtype=torch.float32)
        return base.to(v.dtype).as_strided(shape, stride, int(v.storage_offset()))

    conv = node.target is fused_conv_ref
    weights = getattr(node.target, "weight_arg_indices", ())  # (K,) rows: scaled to keep values O(1)
    args = []
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node):
            t = real(a.meta["val"])
            if i in weights:
                t = t * t.shape[-1] ** -0.5
            args.append(t * 0.05 if conv and i == 1 else t)
        else:
            args.append(a)
    if conv and len(args) > 11 and args[10] != "direct" and isinstance(args[11], torch.Tensor):
        # the algorithm's prepacked weight, of THIS random weight (a random one would make the
        # reference compute another convolution than the candidates)
        from fxopt.conv_algorithms import get_algorithm
        from fxopt.ops import conv_sig_of

        args[11] = get_algorithm(args[10]).prepare(args[1], conv_sig_of(args[0], args[1], *args[4:8]))
    return args


def time_graphed_ms(fn, args, iters: int = 10, reps: int = 1) -> float:
    """Median time of `fn(*args)` replayed as a CUDA graph: how it will run under cudagraphs,
    without the per-launch Python cost that would otherwise dominate small kernels. The graph
    holds `reps` back-to-back calls (the result is per call), so the graph launch latency and
    event jitter, which are comparable to a small kernel's time, are spread over many calls."""
    from fxopt.backends.cuda.runtime.cudagraph_measure import capturing, median_ms

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # (a candidate that fails inside the capture leaves the device's generator usable: with
    # torch.cuda.graph alone every later random op and capture in the process failed, "Offset
    # increment outside graph capture": GPU fuzz 5699300038, 699e662f92)
    with capturing(graph, None):
        for _ in range(reps):
            fn(*args)
    ms = median_ms(graph.replay, runs=iters) / reps
    del graph
    return ms


def _reps(out) -> int:
    """Calls per timed graph: 10 for small outputs, fewer where 10 outputs would take > 256 MiB."""
    nbytes = max(1, sum(t.numel() * t.element_size() for t in (out if isinstance(out, (tuple, list)) else [out])
                        if isinstance(t, torch.Tensor)))
    return max(1, min(10, (256 << 20) // nbytes))


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _tensors(out) -> list:
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]


def _error(out, ref) -> float:
    """The largest relative error over the tensors a candidate returns (regions return several)."""
    from fxopt.tolerances import relative_error

    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    refs = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    if len(outs) != len(refs):
        raise ValueError(f"{len(outs)} outputs, the reference has {len(refs)}")
    # a candidate may leave outputs nobody reads unset (a max pool's indices): compare the others
    pairs = [(g, w) for g, w in zip(outs, refs) if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)]
    if not pairs:
        raise ValueError("no tensor output to compare")
    got, want = [g for g, _ in pairs], [w for _, w in pairs]
    for g, w in zip(got, want):  # what downstream views assume: same shape and strides
        if g.shape != w.shape or any(n != 1 and a != b for n, a, b in zip(g.shape, g.stride(), w.stride())):
            return float("inf")
    return max((relative_error(g, w) for g, w in zip(got, want)), default=0.0)


#: a candidate is not timed further where its plain run takes more than this times the fastest timed
#: so far, plus ``PRUNE_MARGIN_MS`` (launch gaps between a plain run's kernels; module docstring)
PRUNE_FACTOR = 10.0
PRUNE_MARGIN_MS = 0.5


def plain_ms(fn, args, runs: int = 2) -> float:
    """The fastest of ``runs`` plain calls of ``fn(*args)``, each between two CUDA events."""
    from fxopt.autotune import cuda_event_times

    return min(cuda_event_times(lambda: fn(*args), runs))


def measure(node: fx.Node, candidates: dict, graphed: bool) -> dict:
    from fxopt.autotune import time_ms

    args = real_args(node)
    xs = [args[0], torch.randn_like(args[0]), torch.randn_like(args[0])]
    result = {"ms": {}, "errors": {}}
    with torch.no_grad():
        ref = candidates["reference"](*args)
        reps = _reps(ref)
        low = any(t.dtype != torch.float32 for t in _tensors(ref))
        for name, fn in candidates.items():
            try:
                err = _error(fn(*args), ref)
                result["errors"][name] = err
                if not err <= (1e-2 if low else 1e-3):  # NaN fails too
                    continue
                if result["ms"]:
                    bound = PRUNE_FACTOR * min(result["ms"].values()) + PRUNE_MARGIN_MS
                    once = plain_ms(fn, args)
                    if once > bound:
                        result.setdefault("pruned", {})[name] = round(once, 4)
                        continue
                if graphed:
                    result["ms"][name] = time_graphed_ms(fn, args, reps=reps)
                else:
                    result["ms"][name] = time_ms(lambda x: fn(x, *args[1:]), xs, "cuda")
            except Exception as e:  # noqa: BLE001 - a failing candidate is not chosen
                result["errors"][name] = f"{type(e).__name__}: {e}"
    result["choice"] = min(result["ms"], key=result["ms"].get) if result["ms"] else "reference"
    return result


def with_fallback(candidate, reference):
    """The candidate, or the reference where the candidate declines (returns None) at run time."""
    def run(*args):
        out = candidate(*args)
        return reference(*args) if out is None else out

    run.__name__ = f"fx_{candidate.name}"
    return run


def cache_key(node: fx.Node, candidates: dict, graphed: bool) -> str:
    metas = []
    for a in node.args:
        v = a.meta.get("val") if isinstance(a, fx.Node) else None
        metas.append(f"{tuple(v.shape)}|{layout_name(v)}|{v.dtype}" if isinstance(v, torch.Tensor)
                     else ("node" if isinstance(a, fx.Node) else repr(a)))
    target = ("fused_conv" if node.target is fused_conv_ref
              else node.target.__name__ if inspect.isfunction(node.target) else str(node.target))
    return f"node|graphed={graphed}|{target}|{metas}|{sorted(candidates)}"


def region_key(node: fx.Node, generated, candidates: dict, graphed: bool) -> str:
    """A fused region by what decides its choice: the generated sources (shapes, strides, dtypes
    and ops are all in them but for the extents they take as arguments, added) and the candidates."""
    import hashlib

    src = "\n".join(sorted(f"{ks.source}{ks.meta.get('extents', '')}" for ks in generated.sources.values()))
    return f"region|graphed={graphed}|{hashlib.sha256(src.encode()).hexdigest()[:24]}|{sorted(candidates)}"


def not_compiled(items: dict, entry: Optional[dict], losers) -> dict:
    """id(candidate) -> why its kernels are not compiled: the autotuning cache chose another one
    (``entry``), or, to be measured, it lost by far where a neighbouring size measured it."""
    if entry is not None:
        return {id(c): f"not compiled: the autotuning cache chose {entry.get('choice')}"
                for name, c in items.items() if name != entry.get("choice")}
    return {id(c): "not compiled: it lost by far where a neighbouring size measured it"
            for name, c in items.items() if name in losers}


@dataclass
class Tuning:
    """Where measured choices come from: the autotuning cache, else a measurement (stored)."""
    cache: Any
    device: str
    graphed: bool
    ctx: Any
    done: dict = field(default_factory=dict)  # key -> entry measured by this Tuning

    def lookup(self, key: str) -> Optional[dict]:
        """The cache's choice for ``key``; None: to be ``measured`` (asked before the candidates'
        kernels compile: where the choice is known only the chosen one's need to)."""
        return self.cache.get(self.device, key)

    def measured(self, node: fx.Node, candidates: dict, key: str) -> dict:
        """``node``'s candidates measured, the result stored under ``key`` (a key asked twice before
        either was measured, identical regions of one graph: measured once, stored for both asks)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        entry = self.done.get(key)
        if entry is None:
            with unset_fake_temporarily():
                entry = self.done[key] = measure(node, candidates, self.graphed)
            self.ctx.measurements += len(entry["ms"])
        self.cache.put(self.device, key, entry)
        return entry

    def reference_kept(self, key: str) -> dict:
        """The reference as ``key``'s choice, stored unmeasured where every other candidate was left
        out as a loser (``losers``): a later size of the bucket asks no more."""
        entry = {"choice": "reference", "ms": {}, "errors": {},
                 "not_measured": "every other candidate lost by far at a neighbouring size"}
        self.cache.put(self.device, key, entry)
        return entry

    def losers(self, key: str) -> set:
        """Candidates of ``key``'s choice (just asked, missed) not worth compiling to measure: those the
        cache knows lost by far at a neighbouring size (``fxopt.dynamic_buckets``; other caches: none)."""
        losers = getattr(self.cache, "losers", None)
        return losers(self.device, key) if losers is not None else set()

    def entry(self, node: fx.Node, candidates: dict, key: str) -> dict:
        entry = self.lookup(key)
        return entry if entry is not None else self.measured(node, candidates, key)
