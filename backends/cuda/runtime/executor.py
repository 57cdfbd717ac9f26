"""The cuda executor's lowering: what runs on the GPU for each part of the optimized graph.

First, on a GPU, a ``fused_linear`` over many rows whose readers are all generated kernels is
measured as the bare product plus its bias/activation against the fused call (cuBLAS picks another
kernel with a bias epilogue); where the former wins its epilogue moves into the readers' kernels
(``rewrite.split_linear_epilogues``; choice ``split`` in ``node_choices``). Then the fusion
scheduler (``schedule/fusion.py``) groups every pointwise, reduction and
data-movement op it has a rule for into regions, each one generated kernel
(``kernels/region.py``), and replaces each region by one node. A region's candidates: its
``reference`` (its ATen ops as PyTorch runs them), ``generated`` (the kernel), and for a region that
is exactly one max pool or global average pool the older template kernels (``kernels/pool.py``).

Every other node gets the candidates of the kernel families' table (``kernels.FAMILIES``, asked
in its order, ``plan_nodes``). For a
``fused_conv`` (``act(conv(x, w) + bias (+ residual))``): ``reference`` (cuDNN with bias, then
the epilogue ops), ``generated`` (conv without bias, then one generated bias/residual/activation
kernel in place), ``cudnn_fused`` (cuDNN's conv + ReLU (+ add)), ``generated_depthwiseconv``
(depthwise convs, k <= 7: one direct kernel with the epilogue fused) and
``generated_directconv_t<tile>[_split<lanes>]`` (few input channels: stems, small CNNs),
``generated_groupedconv_t<channels>`` (grouped convs on channels_last tensors: one direct kernel
with the epilogue fused), ``nchw``
(a channels_last depthwise conv with a kernel of 7 or more, run channels-first with its
conversions: the layout chosen per conv, by measurement). A
``fused_linear`` over at most 16 rows gets ``generated_linear`` (bias and activation fused)
against cuBLAS followed by the activation.

After the per-node choices, groups of nodes (``kernels.GROUPS``) are measured as one kernel
against the group as already chosen (``runtime/groups.py``): a max pool fed by such a conv that
nothing else reads (left out of the fusion scheduler for that purpose: conv + epilogue + pool in
one kernel), and a chain of small linear layers (a classifier head in one thread block).

Every node or region with more than one candidate is timed with each candidate once (CUDA events,
median; replayed as a CUDA graph when the graph will run under CUDA graphs, so Python launch costs
do not decide; ``measure.py``), after checking it against the reference; the fastest correct one is
kept and stored in the autotuning cache (a second compile measures nothing, and every choice is
asked of the cache before anything compiles: where it holds the choice only the chosen candidate's
kernels compile, the others are listed as skipped; a choice to measure leaves out the candidates
the cache says lost by far at a neighbouring size, ``fxopt.dynamic_buckets``);
``report.executor_details["node_choices"]`` lists them, ``["unfused"]`` says which ops run as
PyTorch runs them and why, ``["updated_in_place"]`` how many training BatchNorms update their
running statistics in place (``running_stats.py``, the last step), and every generated kernel is in
``report.kernels`` with the ops it covers. All kernels start compiling at once on worker threads
(NVRTC releases the GIL); each node is measured as soon as its own kernels are ready, and a kernel
that fails to compile only withdraws its own candidate (the report keeps its NVRTC log). Without a
GPU (option ``executor="cuda"`` on CPU inputs) the kernels are still generated, compiled with NVRTC
and listed; the reference runs.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.runtime.measure import Tuning, cache_key, not_compiled, region_key, with_fallback
from fxopt.backends.cuda.runtime.running_stats import update_in_place
from fxopt.backends.cuda.runtime.groups import fuse_group
from fxopt.backends.cuda.kernels import FAMILIES, GROUPS
from fxopt.backends.cuda.kernels.region import GeneratedRegion, parallel_variant, tiled_variant
from fxopt.backends.cuda.schedule.copies import copy_summary
from fxopt.backends.cuda.schedule.fusion import schedule
from fxopt.backends.cuda.schedule.movement_rules import INFERENCE_ONLY
from fxopt.backends.cuda.schedule.rewrite import (linear_then_epilogue, rewrite, split_conv_epilogues,
                                                  split_linear_epilogues)
from fxopt.backends.cuda.schedule.generated import EmulatedRegion, RegionReference, template_candidates


@dataclass
class KernelRecord:
    name: str
    source: str
    compiled: bool
    error: Optional[str] = None
    #: the ATen ops a generated region kernel covers (empty for template kernels of one node)
    ops: list = field(default_factory=list)
    #: the names of the optimized graph's nodes it computes (its region's, its node's, its group's)
    nodes: list = field(default_factory=list)
    #: why it was not compiled: its candidate lost where the autotuning cache already held the choice
    skipped: Optional[str] = None


class PendingKernels:
    """The generated kernels of `items` (objects with .sources {variant: KernelSource} and
    .kernels, filled here) compiling with NVRTC in the background: ``ready(some)`` waits for those
    items only, so measuring the first nodes overlaps compiling the rest; ``finish()`` waits for
    all and records every kernel in the report in order. An item with a kernel that failed to
    compile gets none (its candidate is not offered); the others are unaffected."""

    def __init__(self, items: list, info: dict, nodes: Optional[dict] = None):
        from fxopt.backends.cuda.compiler import nvrtc_available, submit_many

        self.info = info
        self.nodes = nodes or {}  # id(item) -> the optimized graph's names of the nodes it computes
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
            self.info["kernels"].extend(KernelRecord(ks.name, ks.source, False, "NVRTC unavailable", _ops(ks),
                                                     list(self.nodes.get(id(e), [])))
                                        for e, _, ks in self.sources)
            return
        for (e, _, ks), fut in zip(self.sources, self.futures):
            err = fut.exception()
            self.info["kernels"].append(KernelRecord(ks.name, ks.source, err is None and fut.result().compiled,
                                                     None if err is None else str(err), _ops(ks),
                                                     list(self.nodes.get(id(e), []))))


def _ops(ks) -> list:
    k = ks.meta.get("kernel") if isinstance(ks.meta, dict) else None
    return list(getattr(k, "ops", []) or [])


def source_names(nodes) -> list:
    """The optimized graph's names of nodes of the executor's copy of it (names survive the copy;
    the two parts of a conv whose epilogue moved into generated kernels carry their fused conv's),
    in order, once each."""
    return list(dict.fromkeys(n.meta.get("fxopt_split_from", n.name) for n in nodes))


def region_nodes(region) -> list:
    """The optimized graph's names of the nodes a region computes: those it covers, its outputs,
    and the op an item it covers is taken from."""
    covered = set(region.covered) | set(region.outputs)
    covered |= {n.args[0] for n in list(covered) if n.target is operator.getitem
                and isinstance(n.args[0], fx.Node) and n.args[0].op == "call_function"}
    return source_names(n for n in next(iter(covered)).graph.nodes if n in covered) if covered else []


def _compile(items: list, info: dict) -> None:
    """Compile every generated kernel of `items` now (in parallel) and record each in the report."""
    PendingKernels(items, info).finish()


@dataclass
class _PlannedNode:
    node: fx.Node
    cands: list                   # every family's candidates, in the order of ``kernels.FAMILIES``
    first: list                   # those of the families that compile first

    def items(self) -> dict:
        """candidate name -> the candidate (before compiling: every candidate's name)."""
        return {getattr(c, "key", None) or f"generated_{getattr(c, 'label', type(c).__name__.lower())}": c
                for c in self.cands}

    def candidates(self) -> dict:
        """name -> implementation: the reference, then each candidate whose kernels compiled."""
        reference = self.node.target
        out = {"reference": reference}
        for name, c in self.items().items():
            if len(c.kernels) == len(c.sources):
                out[name] = c.bind(reference) if hasattr(c, "bind") else with_fallback(c, reference)
        return out


def plan_nodes(graph: fx.Graph, options) -> list:
    """Every node's candidates from the kernel families' table (``kernels.FAMILIES``), for the
    nodes where a family that is measured alone has one."""
    planned = []
    for node in graph.nodes:
        if node.op != "call_function":  # (every family plans calls: the inputs and output are not asked)
            continue
        per_family = [(f, f.plan(node, options)) for f in FAMILIES]
        if any(cs and f.alone for f, cs in per_family):
            planned.append(_PlannedNode(node, [c for _, cs in per_family for c in cs],
                                        [c for f, cs in per_family if f.compile_first for c in cs]))
    return planned


@dataclass
class _PlannedRegion:
    node: fx.Node                 # the region's node in the graph (its target: the reference)
    generated: GeneratedRegion
    reference: RegionReference
    templates: dict               # name -> (candidate, callable over the region's inputs)
    nodes: list = field(default_factory=list)  # the optimized graph's names of the nodes it computes

    def items(self) -> dict:
        """candidate name -> what compiles for it (before compiling: every candidate's name)."""
        return {"generated": self.generated, **{name: cand for name, (cand, _) in self.templates.items()}}

    def candidates(self) -> dict:
        out = {"reference": self.reference}
        if len(self.generated.kernels) == len(self.generated.sources):
            out["generated"] = with_fallback(self.generated, self.reference)
        for name, (cand, call) in self.templates.items():
            if len(cand.kernels) == len(cand.sources):
                out[name] = _fallback_call(call, self.reference, name)
        return out


def _fallback_call(call, reference, name):
    def run(*args):
        out = call(*args)
        return reference(*args) if out is None else out

    run.__name__ = name
    return run


def fuse_regions(runnable: fx.GraphModule, info: dict, skip: set, strict: bool = False,
                 fast_math: bool = False, tuning=None, merge_readers: bool = True) -> list:
    """Schedule ``runnable`` into regions and put one node per region in the graph (target: its
    reference, until a measurement chooses otherwise). ``fast_math``: option fast_math. ``tuning``
    (on a GPU): measures whether a linear layer's epilogue moves into its readers' kernels.
    ``merge_readers``: readers computed in the kernel storing their value (inference graphs only
    until the training property has passed on a GPU with it, ``schedule/consumers.py``)."""
    def measured(node):  # the fused call against the bare product plus its epilogue (autotune-cached)
        cands = {"reference": node.target, "split": linear_then_epilogue}
        return tuning.entry(node, cands, cache_key(node, cands, tuning.graphed))
    # the graph's code regenerated once, by the caller, after every rewrite (``attach_kernels``)
    info["linear_epilogues"] = split_linear_epilogues(runnable, skip, None if tuning is None else measured,
                                                      recompile=False)
    split = split_conv_epilogues(runnable, skip, recompile=False)
    sched = schedule(runnable, skip, strict=strict, merge_readers=merge_readers)
    info["unfused"] = sched.unfused
    info["conv_epilogues_moved"] = split
    info["copies"] = copy_summary(sched.regions)  # kernels that only move data, bytes per call
    if not sched.regions:
        if split or any(e.get("choice") == "split" for e in info["linear_epilogues"].values()):
            runnable.recompile()
        return []
    planned = []
    refs, gens, tmpls, names = [], [], [], []
    for r in sched.regions:
        refs.append(RegionReference(runnable, r))
        gens.append(GeneratedRegion(r, fast_math))
        tmpls.append(template_candidates(r) | parallel_variant(r, gens[-1], fast_math) | tiled_variant(r, fast_math))
        names.append(region_nodes(r))
    nodes = rewrite(runnable, sched.regions, refs, recompile=False)  # the caller recompiles (regions)
    for node, ref, gen, tm, covered in zip(nodes, refs, gens, tmpls, names):
        planned.append(_PlannedRegion(node, gen, ref, tm, covered))
    info["regions"] = {p.node.name: {"kernel": p.generated.name, "ops": p.generated.ops,
                                     "inputs": [a.name for a in p.node.args], "nodes": p.nodes} for p in planned}
    return planned


def attach_kernels(runnable: fx.GraphModule, ctx, info: dict) -> fx.GraphModule:
    """Fuse regions into generated kernels and plan the library nodes' candidates; on a GPU,
    keep the fastest implementation of each (measured, cached)."""
    by_family = {f.name: f.plan(runnable.graph) for f in GROUPS if f.before_fusion}
    skip = {n for gs in by_family.values() for g in gs for n in g.keep_out}
    if ctx.mode != "inference":
        skip |= {n for n in runnable.graph.nodes if n.op == "call_function" and n.target in INFERENCE_ONLY}
    on_gpu = torch.cuda.is_available() and ctx.device_type == "cuda"
    tuning = None
    if on_gpu:
        from fxopt.autotune import AutotuneCache, device_fingerprint

        tuning = Tuning(AutotuneCache.for_option(ctx.options.autotune_cache), device_fingerprint("cuda"),
                        ctx.options.cudagraphs is not False, ctx)
    regions = (fuse_regions(runnable, info, skip, ctx.options.strict, ctx.options.fast_math, tuning,
                            merge_readers=ctx.mode == "inference") if ctx.options.fusion else [])
    planned = plan_nodes(runnable.graph, ctx.options)
    by_family.update((f.name, f.plan(runnable.graph)) for f in GROUPS if not f.before_fusion)
    groups = [g for f in GROUPS for g in by_family[f.name]]
    first = [c for p in planned for c in p.first]
    firsts = {id(c) for c in first}
    computes = {id(c): p.nodes for p in regions for c in [p.generated] + [c for c, _ in p.templates.values()]}
    computes.update((id(c), source_names([p.node])) for p in planned for c in p.cands)
    computes.update((id(c), source_names(g.nodes)) for g in groups for c in g.candidates)
    if groups:  # group (its nodes as decisions name it) -> its nodes in the optimized graph, its kernels
        info["node_groups"] = {"+".join(n.name for n in g.nodes): {
            "kind": g.kind, "nodes": source_names(list(g.nodes) + [u for n in g.nodes for u in n.users
                                                                    if u.target is operator.getitem]),
            "kernels": {f"generated_{c.label}": [ks.name for ks in c.sources.values()] for c in g.candidates}}
            for g in groups}
    items = ([p.generated for p in regions] + [c for p in regions for c, _ in p.templates.values()]
             + first + [c for p in planned for c in p.cands if id(c) not in firsts])
    decisions = dict(info.get("linear_epilogues", {}))  # "split": the epilogue went into its readers
    info["node_choices"] = decisions
    if not on_gpu:
        pending = PendingKernels(items + [c for g in groups for c in g.candidates], info, computes)
        if getattr(ctx.options, "emulate_kernels", False) and regions:
            for p in regions:  # the kernels' IR in the references' place (option emulate_kernels)
                p.node.target = EmulatedRegion(p.generated.region, p.reference)
        if regions:
            runnable.recompile()
        pending.finish()
        info["nvrtc_s"] = round(pending.compile_s, 3)
        info["updated_in_place"] = update_in_place(runnable)
        _stream_plan(runnable, ctx, info)
        return runnable
    # what the autotuning cache holds is asked first, in the order the choices are made: where it
    # holds a choice only the chosen candidate's kernels compile (the others' were most of the NVRTC
    # time of a new size bucket whose choices come from its neighbours, fxopt.dynamic_buckets)
    known = {}  # id(planned region or node) -> (key, the cache's entry, or None: measured)
    skipped = {}  # id(candidate) -> why it is not compiled
    for p in regions + planned:
        names = ["reference", *p.items()]
        key = (region_key(p.node, p.generated, names, tuning.graphed) if isinstance(p, _PlannedRegion)
               else cache_key(p.node, names, tuning.graphed))
        entry = tuning.lookup(key)
        known[id(p)] = (key, entry)
        skipped.update(not_compiled(p.items(), entry, tuning.losers(key) if entry is None else ()))
    pending = PendingKernels([c for c in items if id(c) not in skipped], info, computes)
    changed = bool(regions)  # (a split linear layer's epilogue is in the regions of its readers)
    t0 = time.perf_counter()
    for p in regions + planned:  # measured as soon as its own kernels are compiled
        pending.ready(list(p.items().values()))
        candidates = p.candidates()
        key, entry = known[id(p)]
        if entry is None and len(candidates) < 2:
            if not any(id(c) in skipped for c in p.items().values()):
                continue  # (its candidates failed to compile: nothing to choose)
            entry = tuning.reference_kept(key)
        entry = decisions[p.node.name] = entry if entry is not None else tuning.measured(p.node, candidates, key)
        if entry["choice"] in candidates and entry["choice"] != "reference":
            p.node.target = candidates[entry["choice"]]
            changed |= isinstance(p, _PlannedNode)
    pending.finish()
    nvrtc = [pending.compile_s]

    def compile_now(cands: list, why: dict) -> None:  # a group's candidates, once its choice is known
        later = PendingKernels([c for c in cands if id(c) not in why], info, computes)
        later.finish()
        nvrtc.append(later.compile_s)
        skipped.update(why)

    for g in groups:  # after the per-node choices: each group is measured against them
        changed |= fuse_group(runnable, g, tuning, decisions, compile_now)
    info["nvrtc_s"] = round(sum(nvrtc), 3)  # overlapping the measuring that follows it
    for c in items + [c for g in groups for c in g.candidates]:
        if id(c) in skipped:
            info["kernels"].extend(KernelRecord(ks.name, ks.source, False, None, _ops(ks), list(computes.get(id(c), [])),
                                                skipped[id(c)]) for ks in c.sources.values())
    info["choose_s"] = round(time.perf_counter() - t0, 3)  # measurements, or autotuning-cache hits
    if changed:
        runnable.recompile()
    # last: training BatchNorms write their running statistics where they live (the graph stops
    # being functional here, after everything that reads it as such)
    info["updated_in_place"] = update_in_place(runnable)
    _stream_plan(runnable, ctx, info)
    return runnable


def _stream_plan(runnable: fx.GraphModule, ctx, info: dict) -> None:
    """Option ``streams``: the plan of an inference graph's branches on that many CUDA streams, listed
    in the report (``runtime/streams.py``; not run yet)."""
    if getattr(ctx.options, "streams", 0) and getattr(ctx, "mode", "inference") == "inference":
        from fxopt.backends.cuda.runtime.streams import plan_streams

        try:
            info["streams"] = plan_streams(runnable, ctx.options.streams).describe()
        except Exception as exc:  # noqa: BLE001 - a listing only: the graph runs as lowered
            if ctx.options.strict:
                raise
            info["streams"] = [f"streams: not planned ({type(exc).__name__}: {exc})"]
