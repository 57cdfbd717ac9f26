"""The cuda executor's lowering: which implementation each node of the graph runs on the GPU.

A ``fused_conv`` computes ``act(conv(x, w) + bias (+ residual))``. Run as PyTorch
would, the bias add after cuDNN is a broadcasting elementwise kernel (slow on
channels_last outputs) and each further step is one more pass over the
activation. Candidates per convolution:

- ``reference``: the torch implementation (conv with bias, then the epilogue ops);
- ``generated``: conv without bias, then ONE generated kernel (``codegen.generate_pointwise``,
  NVRTC-compiled, 16-byte vector loads where alignment allows) applying bias, residual and
  activation in place on the conv output;
- ``cudnn_fused``: ``aten.cudnn_convolution_relu`` / ``cudnn_convolution_add_relu`` for ReLU
  epilogues;
- ``generated_depthwiseconv``: for depthwise convs, one generated direct-convolution kernel with
  the whole epilogue fused (``regions.py``);
- ``generated_directconv_t<tile>``: for convs with few input channels (C_in <= 16, C_out <= 128,
  C_in*KH*KW <= 512, groups 1: stems, small CNNs), one generated direct-convolution kernel with the
  epilogue fused (``direct_conv.py``), in two output-channel tilings; at small batch also with each
  output's input channels split over lanes (``_split<lanes>``).

A ``fused_linear`` over at most 16 rows (a classifier head at small batch) gets one generated
kernel with bias and activation fused as a candidate (``generated_linear``, ``linear.py``) against
cuBLAS followed by the activation.

After the per-node choices, groups of nodes are measured as one kernel against the group as already
chosen, and one node replaces the group where it wins (``groups.py``): a max pool (indices unused)
fed by such a conv that nothing else reads (conv + epilogue + pool,
``generated_directconv_maxpool_t<tile>``); a chain of such linear layers, each reading only the
previous one's output (the whole head in one thread block, ``generated_linear_chain``,
``linear_chain.py``).

Max pooling whose indices are unused and global average pooling get a generated kernel as a
candidate too (``regions.py``). Each node with more than one candidate is timed with every
candidate once (CUDA events, median; replayed as a CUDA graph when the graph will run under
CUDA graphs, so Python launch costs do not decide; ``measure.py``), the fastest is kept, and the
decision is stored in the autotuning cache (a second compile measures nothing); ``report.executor_details
["node_choices"]`` lists them. All planned kernels start compiling at once on worker threads (NVRTC
releases the GIL); each node is measured as soon as its own kernels are ready, so measuring the
first nodes overlaps compiling the rest, and a kernel that fails to compile only withdraws its own
candidate (the report keeps its NVRTC log). Without a GPU (option ``executor="cuda"`` on CPU inputs) the
kernels are still generated and compiled with NVRTC and listed in the report; the reference runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.runtime.measure import Tuning, cache_key, with_fallback
from fxopt.backends.cuda.schedule.conv import (GeneratedEpilogue, cudnn_conv_relu, plan_conv_epilogue,
                                               plan_conv_maxpool, plan_depthwise, plan_direct_conv,
                                               with_generated_epilogue)
from fxopt.backends.cuda.schedule.groups import fuse_conv_maxpool, fuse_linear_chain
from fxopt.backends.cuda.schedule.linear import plan_linear, plan_linear_chains
from fxopt.backends.cuda.schedule.pool import plan_global_avgpool, plan_maxpool
from fxopt.ops import fused_conv_ref


PLANNERS = (plan_depthwise, plan_maxpool, plan_global_avgpool, plan_direct_conv, plan_linear)


@dataclass
class KernelRecord:
    name: str
    source: str
    compiled: bool
    error: Optional[str] = None


class PendingKernels:
    """The generated kernels of `items` (objects with .sources {variant: KernelSource} and
    .kernels, filled here) compiling with NVRTC in the background: ``ready(some)`` waits for those
    items only, so measuring the first nodes overlaps compiling the rest; ``finish()`` waits for
    all and records every kernel in the report in order. An item with a kernel that failed to
    compile gets none (its candidate is not offered); the others are unaffected."""

    def __init__(self, items: list, info: dict):
        from fxopt.backends.cuda.compiler import nvrtc_available, submit_many

        self.info = info
        self.t0 = time.perf_counter()
        self.sources = [(e, v, ks) for e in items for v, ks in e.sources.items()]
        self.available = bool(self.sources) and nvrtc_available()
        self.futures = submit_many([ks for _, _, ks in self.sources]) if self.available else []
        self._done: set = set()  # ids of items whose kernels were filled in
        self.compile_s = 0.0  # from submitting until the last kernel asked for was ready

    def ready(self, items) -> None:
        want = {id(e) for e in items} - self._done
        if not want or not self.available:
            return
        failed = set()
        for (item, vec, _), fut in zip(self.sources, self.futures):
            if id(item) in want:
                if fut.exception() is None:
                    item.kernels[vec] = fut.result()
                else:  # recorded by finish(); the item offers no candidate
                    failed.add(id(item))
        for item, _, _ in self.sources:
            if id(item) in failed:
                item.kernels.clear()
        self._done |= want
        self.compile_s = max(self.compile_s, time.perf_counter() - self.t0)

    def finish(self) -> None:
        self.ready([e for e, _, _ in self.sources])
        if not self.available:
            self.info["kernels"].extend(KernelRecord(ks.name, ks.source, False, "NVRTC unavailable")
                                        for _, _, ks in self.sources)
            return
        for (_, _, ks), fut in zip(self.sources, self.futures):
            err = fut.exception()
            self.info["kernels"].append(KernelRecord(ks.name, ks.source, err is None and fut.result().compiled,
                                                     None if err is None else str(err)))


def _compile(items: list, info: dict) -> None:
    """Compile every generated kernel of `items` now (in parallel) and record each in the report."""
    PendingKernels(items, info).finish()


def _candidates(node: fx.Node, epi: Optional[GeneratedEpilogue], regions: list) -> dict:
    reference = node.target
    candidates = {"reference": reference}
    if epi is not None and len(epi.kernels) == len(epi.sources):
        candidates["generated"] = with_generated_epilogue(epi)
    if (reference is fused_conv_ref and node.args[8] == "relu" and node.args[10] == "direct"
            and torch.backends.cudnn.is_available()):
        candidates["cudnn_fused"] = cudnn_conv_relu
    for r in regions:
        if len(r.kernels) == len(r.sources):
            candidates[f"generated_{getattr(r, 'label', type(r).__name__.lower())}"] = with_fallback(r, reference)
    return candidates


def _as_list(planned) -> list:
    return [] if planned is None else (planned if isinstance(planned, list) else [planned])


def attach_kernels(runnable: fx.GraphModule, ctx, info: dict) -> fx.GraphModule:
    """Generate kernels for fused-conv epilogues, depthwise convs, pooling and global average
    pooling; on a GPU, keep the fastest implementation of each node (measured, cached)."""
    planned, pairs = [], []
    for node in runnable.graph.nodes:
        epi = plan_conv_epilogue(node)
        regions = [r for p in PLANNERS for r in _as_list(p(node))]
        if epi is not None or regions:
            planned.append((node, epi, regions))
        pair = plan_conv_maxpool(node)
        if pair is not None:
            pairs.append((node, *pair))
    chains = plan_linear_chains(runnable.graph)
    pending = PendingKernels([e for _, e, _ in planned if e is not None] + [r for _, _, rs in planned for r in rs]
                             + [c for _, _, cs in pairs for c in cs] + [c for _, c in chains], info)
    decisions = {}
    info["node_choices"] = decisions
    on_gpu = torch.cuda.is_available() and ctx.device_type == "cuda"
    if not on_gpu:
        pending.finish()
        info["nvrtc_s"] = round(pending.compile_s, 3)
        return runnable
    from fxopt.autotune import AutotuneCache, device_fingerprint

    opt = ctx.options.autotune_cache
    cache = AutotuneCache.for_option(opt)
    tuning = Tuning(cache, device_fingerprint("cuda"), ctx.options.cudagraphs is not False, ctx)
    changed = False
    t0 = time.perf_counter()
    for node, epi, regions in planned:  # measured as soon as its own kernels are compiled
        pending.ready(([epi] if epi is not None else []) + regions)
        candidates = _candidates(node, epi, regions)
        if len(candidates) < 2:
            continue
        entry = decisions[node.name] = tuning.entry(node, candidates, cache_key(node, candidates, tuning.graphed))
        if entry["choice"] in candidates and entry["choice"] != "reference":
            node.target = candidates[entry["choice"]]
            changed = True
    pending.finish()
    info["nvrtc_s"] = round(pending.compile_s, 3)  # overlapping the measuring that follows it
    for pool, conv, fused in pairs:  # after the per-node choices: the pair is measured against them
        changed |= fuse_conv_maxpool(runnable, pool, conv, fused, tuning, decisions)
    for chain, candidate in chains:  # likewise a classifier head against its layers as chosen
        changed |= fuse_linear_chain(runnable, chain, candidate, tuning, decisions)
    info["choose_s"] = round(time.perf_counter() - t0, 3)  # measurements, or autotuning-cache hits
    if changed:
        runnable.recompile()
    return runnable
