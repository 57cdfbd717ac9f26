"""Independent branches of an inference graph on several CUDA streams: the plan and its interpreter.

``plan_streams(gm, max_streams)`` reads the lowered graph's compute nodes (every node but
placeholders, get_attr and the output) and their dependencies: data edges, and for a tensor written
in place (an op whose schema writes an argument, ``fxopt.passinfra.written_in_place``) an edge from
every earlier reader and writer of its memory to the write and from the write to every later reader
and writer. Views of inputs and the folded constants count as inputs (``host_nodes``). The nodes
fall into chains: a node continues the chain of a predecessor whose chain
still ends there (the lowest-numbered such chain: a join goes back to the main chain), so the first
successor of a fork continues its chain and every other successor starts a new one. Chain 0 runs on
stream 0 (the caller's stream). Another chain gets a side stream only where it is worth an event:
its estimated time (``work_us``: FLOPs of convolutions and matrix products, bytes of every op, from
``node.meta["val"]``) and that of the nodes it can overlap with (neither its ancestors nor its
descendants) are both at least ``min_us``; a side stream is reused by a later chain once all its
earlier chains are that chain's ancestors, else the least loaded one takes it. The others stay on
stream 0.

Ordering: a node waits for a predecessor on another stream through an event recorded after that
predecessor, unless its stream already knows that predecessor done (a vector clock per stream
follows every wait). Every side stream first waits for stream 0 before the first node off it (the
inputs were written there, the folded weights refreshed; a CUDA-graph capture forks its side
streams that way) and joins stream 0 before the graph returns (``joins``: the side streams' last
nodes stream 0 does not already know).

Memory: a tensor made on stream s and read on stream t is released to PyTorch's caching allocator
on s; ``cross_reads`` lists each such read (and each output made on a side stream, read on stream
0 by the caller), and ``run_plan`` calls ``tensor.record_stream`` for it, so its memory is not reused
before t's work on it is done.

``run_plan(gm, plan, streams, args)`` runs the graph node by node as ``gm(*args)`` would (same
values), through a stream API (``CudaStreams``: torch.cuda streams and events; the tests pass one that
records the order of its calls). Every side stream is joined into stream 0 before ``run_plan``
returns, including one whose last action was a fork (after the folded constants, with no node of
its own after it): a CUDA-graph capture fails on a stream forked into it and never joined back
(``cudaErrorStreamCaptureUnjoined``), and the caller may release the inputs once the graph returned.
Not on by default: option ``streams`` (0 = off) plans, lists the plan in the report
(``executor_details["streams"]``, shown by ``fxopt explain``) and, under CUDA graphs, captures it as
a measured alternative of the single-stream graph (``stream_capture.py``).
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxopt.names import FOLDED_CONSTANTS_MODULE
from fxopt.passinfra import storage_root

#: the cost model's device: FLOPs and bytes per microsecond (roughly an H100 at half precision,
#: derated: the model only decides whether a branch is big enough to be worth an event)
FLOPS_PER_US = 2.0e8
BYTES_PER_US = 2.0e6
#: a branch goes to a side stream only where it and the work it overlaps each take this long
MIN_US = 2.0
MATMULS = ("mm", "addmm", "bmm", "matmul", "linear", "fused_linear")


@dataclass
class StreamPlan:
    #: node name -> stream (0: the caller's stream)
    assign: dict = field(default_factory=dict)
    #: node name -> the nodes on other streams it waits for (an event recorded after each)
    waits: dict = field(default_factory=dict)
    #: nodes after which an event is recorded
    records: set = field(default_factory=set)
    #: side streams' last nodes stream 0 waits for before the graph returns
    joins: list = field(default_factory=list)
    #: reading node (or the output node) -> [(producer, the reader's stream)]: tensors made on
    #: another stream, each marked with ``record_stream`` before the read
    cross_reads: dict = field(default_factory=dict)
    #: estimated microseconds per node (the cost model)
    work_us: dict = field(default_factory=dict)
    #: the chains moved off stream 0: (stream, [node names])
    branches: list = field(default_factory=list)

    @property
    def streams_used(self) -> int:
        return len(set(self.assign.values()) | {0})

    def describe(self) -> list:
        """Lines for ``fxopt explain``: which nodes run beside which."""
        if not self.branches:
            return ["streams: no independent branch worth a stream; every kernel on stream 0"]
        lines = [f"streams: {self.streams_used} used, {len(self.branches)} branches off stream 0, "
                 f"{sum(map(len, self.waits.values()))} waits, {len(self.joins)} joins at the output"]
        waiters = {}
        for v, us in self.waits.items():
            for u in us:
                waiters.setdefault(u, []).append(v)
        for s, names in self.branches:
            us = sum(self.work_us.get(n, 0.0) for n in names)
            span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} ({len(names)} nodes)"
            joined = waiters.get(names[-1]) or (["the output"] if names[-1] in self.joins else [])
            lines.append(f"  stream {s}: {span}, ~{us:.1f} us" + (f"; joined by {', '.join(joined)}" if joined else ""))
        return lines


def _nodes(gm: fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]


def _tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors(x)


def _arg_nodes(n: fx.Node) -> list:
    out = []
    fx.map_arg((n.args, n.kwargs), lambda a: out.append(a))
    return list(dict.fromkeys(out))


def work_us(n: fx.Node) -> float:
    """Estimated microseconds of ``n``: bytes read and written, plus the FLOPs of a convolution
    (weight as second argument) or a matrix product; views and getitem cost nothing."""
    if n.op != "call_function":
        return 0.0
    if _is_view(n):
        return 0.0
    out = list(_tensors(n.meta.get("val")))
    ins = [list(_tensors(a.meta.get("val"))) for a in _arg_nodes(n)]
    nbytes = sum(t.numel() * t.element_size() for t in out) + sum(
        t.numel() * t.element_size() for ts in ins for t in ts)
    name = getattr(n.target, "__name__", str(n.target)).lower().split(".")[0]
    flops = 0.0
    if out and len(ins) > 1 and all(ins[:2]):
        if "conv" in name:  # (x, weight [C_out, C_in / groups, *kernel], ...)
            flops = 2.0 * out[0].numel() * ins[1][0].numel() / max(ins[1][0].shape[0], 1)
        elif name in MATMULS:  # the reduced size: the last of x's (addmm: of its second argument)
            flops = 2.0 * out[0].numel() * ins[1 if name == "addmm" else 0][0].shape[-1]
    return flops / FLOPS_PER_US + nbytes / BYTES_PER_US


def _root(n: fx.Node) -> fx.Node:
    """The node whose memory ``n`` is: through views, and through an in-place op (its result is
    the argument it wrote)."""
    while True:
        n = storage_root(n)
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if (schema is not None and schema.is_mutable and schema.returns and schema.returns[0].alias_info is not None
                and n.args and isinstance(n.args[0], fx.Node)):
            n = n.args[0]
            continue
        return n


def _written(n: fx.Node) -> list:
    """The argument nodes ``n`` writes in place (by its schema)."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            out += [x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, fx.Node)]
    return out


def _is_view(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return n.target is operator.getitem or (schema is not None and not schema.is_mutable and bool(schema.returns)
                                            and schema.returns[0].alias_info is not None)


def host_nodes(gm: fx.GraphModule) -> set:
    """Nodes that read only inputs and count as inputs: getitem and views of inputs (no GPU work;
    the kernels reading them read the inputs' memory) and the folded constants (``fxopt_constants``:
    cached, refreshed on stream 0 after a weight changed, before the side streams fork or, run after
    they forked, followed by a fork again). They run on stream 0 where they stand and order nothing."""
    host = set()
    for n in _nodes(gm):
        if all(a in host or a.op in ("placeholder", "get_attr") for a in _arg_nodes(n)) and (
                (n.op == "call_function" and _is_view(n))
                or (n.op == "call_module" and n.target == FOLDED_CONSTANTS_MODULE)):
            host.add(n)
    return host


def dependencies(gm: fx.GraphModule) -> dict:
    """Compute node (every node but ``host_nodes``) -> the compute nodes it must follow: its data
    inputs, and around writes in place the earlier readers and writers of the same memory (and the
    write before later ones)."""
    host = host_nodes(gm)
    nodes = [n for n in _nodes(gm) if n not in host]
    compute = set(nodes)
    deps = {n: [a for a in _arg_nodes(n) if a in compute] for n in nodes}
    if not any(_written(n) for n in nodes):  # functional: the data edges are all
        return deps
    writer, readers = {}, {}  # memory root -> its last writer, the readers since
    for n in nodes:
        roots = {_root(a) for a in _arg_nodes(n)}
        writes = {_root(a) for a in _written(n)}
        for r in roots:
            extra = [writer[r]] if r in writer else []
            if r in writes:
                extra += readers.get(r, [])
            deps[n] += [x for x in extra if x is not n and x not in deps[n] and x in compute]
        for r in roots - writes:
            readers.setdefault(r, []).append(n)
        for r in writes:
            writer[r], readers[r] = n, []
        writer.setdefault(n, n)  # a new tensor: its maker is its first writer
    return deps


def plan_streams(gm: fx.GraphModule, max_streams: int = 4, min_us: float = MIN_US) -> StreamPlan:
    """The stream plan of ``gm`` on at most ``max_streams`` streams (module docstring)."""
    deps = dependencies(gm)
    nodes = list(deps)
    idx = {n: i for i, n in enumerate(nodes)}
    cost = {n: work_us(n) for n in nodes}
    plan = StreamPlan(assign={n.name: 0 for n in _nodes(gm)}, work_us={n.name: round(c, 3) for n, c in cost.items()})
    if max_streams < 2 or len(nodes) < 2:
        return plan
    anc = [0] * len(nodes)  # bit sets of ancestors / descendants, by index
    for n in nodes:
        for p in deps[n]:
            anc[idx[n]] |= anc[idx[p]] | (1 << idx[p])
    desc = [0] * len(nodes)
    for n in reversed(nodes):
        for p in deps[n]:
            desc[idx[p]] |= desc[idx[n]] | (1 << idx[n])
    chain_of, chains, open_tail = {}, [], set()  # open_tail: nodes whose chain still ends there
    for n in nodes:
        free = [p for p in deps[n] if p in open_tail]
        if free:
            p = min(free, key=lambda q: chain_of[q])
            open_tail.discard(p)
            c = chain_of[p]
        else:
            c = len(chains)
            chains.append([])
        chain_of[n] = c
        chains[c].append(n)
        open_tail.add(n)
    full = (1 << len(nodes)) - 1
    last_on: dict = {s: [] for s in range(1, max_streams)}  # side stream -> last nodes of its chains
    load = {s: 0.0 for s in range(1, max_streams)}
    stream_of_chain = {0: 0}
    for c, members in enumerate(chains[1:], start=1):
        first, last = idx[members[0]], idx[members[-1]]
        own = sum(cost[m] for m in members)
        mine = 0
        for m in members:
            mine |= 1 << idx[m]
        beside = full & ~(anc[first] | desc[last] | mine)
        overlap = 0.0
        while beside and overlap < min_us:
            low = beside & -beside
            overlap += cost[nodes[low.bit_length() - 1]]
            beside ^= low
        if own < min_us or overlap < min_us:
            stream_of_chain[c] = 0
            continue
        free_s = [s for s in last_on if all(anc[first] >> idx[x] & 1 for x in last_on[s])]
        s = free_s[0] if free_s else min(load, key=load.get)
        stream_of_chain[c] = s
        last_on[s].append(members[-1])
        load[s] += own
        plan.branches.append((s, [m.name for m in members]))
    for n in nodes:
        plan.assign[n.name] = stream_of_chain[chain_of[n]]
    if not plan.branches:
        return plan
    _order(plan, nodes, deps, max_streams)
    _cross_reads(plan, gm, nodes)
    return plan


def _order(plan: StreamPlan, nodes: list, deps: dict, n_streams: int) -> None:
    """Waits (vector clocks: a stream waits only for what it does not know done), events, joins."""
    clock = {s: [-1] * n_streams for s in range(n_streams)}  # stream -> last known position per stream
    pos, after = {}, {}
    count = [0] * n_streams
    for n in nodes:
        t = plan.assign[n.name]
        for p in sorted(deps[n], key=lambda q: -pos.get(q, -1)):
            s = plan.assign[p.name]
            if s == t or clock[t][s] >= pos[p]:
                continue
            plan.waits.setdefault(n.name, []).append(p.name)
            plan.records.add(p.name)
            clock[t] = [max(a, b) for a, b in zip(clock[t], after[p])]
        pos[n] = count[t]
        count[t] += 1
        clock[t][t] = pos[n]
        after[n] = list(clock[t])
    for s in range(1, n_streams):
        on_s = [n for n in nodes if plan.assign[n.name] == s]
        if on_s and clock[0][s] < pos[on_s[-1]]:
            plan.joins.append(on_s[-1].name)
            plan.records.add(on_s[-1].name)
            clock[0] = [max(a, b) for a, b in zip(clock[0], after[on_s[-1]])]


def _cross_reads(plan: StreamPlan, gm: fx.GraphModule, nodes: list) -> None:
    compute = set(nodes)  # host nodes' values are the inputs' memory: no read of theirs is listed
    for n in nodes + [m for m in gm.graph.nodes if m.op == "output"]:
        t = plan.assign.get(n.name, 0)
        reads = [(a.name, t) for a in _arg_nodes(n) if a in compute and plan.assign[a.name] != t]
        if reads:
            plan.cross_reads[n.name] = reads


class CudaStreams:
    """The stream API ``run_plan`` uses, on torch.cuda: stream 0 is the current stream at
    ``begin()``, the side streams are made once (a CUDA-graph capture of ``run_plan`` forks them
    from the capturing stream by the start event)."""

    def __init__(self, n: int, device=None):
        self.device = device
        self.side = [torch.cuda.Stream(device) for _ in range(n - 1)]
        self.main = None

    def begin(self) -> None:
        self.main = torch.cuda.current_stream(self.device)

    def stream(self, i: int):
        return self.main if i == 0 else self.side[i - 1]

    def use(self, i: int):
        return torch.cuda.stream(self.stream(i))

    def record(self, i: int, name: str):
        ev = torch.cuda.Event()
        ev.record(self.stream(i))
        return ev

    def wait(self, i: int, event) -> None:
        self.stream(i).wait_event(event)

    def record_stream(self, tensor: torch.Tensor, i: int) -> None:
        tensor.record_stream(self.stream(i))


def run_plan(gm: fx.GraphModule, plan: StreamPlan, streams, args):
    """Run ``gm`` on ``args`` node by node on the plan's streams (``streams``: ``CudaStreams`` or an
    object with the same methods); the values are those of ``gm(*args)``."""
    env, events = {}, {}
    args_iter = iter(args)
    last_use, by_name = {}, {n.name: n for n in gm.graph.nodes}
    for n in gm.graph.nodes:
        for a in _arg_nodes(n):
            last_use[a] = n
    streams.begin()
    side = sorted({s for s in plan.assign.values() if s})
    forked = False
    dangling = set()  # side streams whose last action is a fork: joined by an event of their own

    def fork(name):  # every side stream waits for what stream 0 has run so far
        ev = streams.record(0, name)
        for t in side:
            streams.wait(t, ev)
        dangling.update(side)

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(args_iter)
            continue
        if n.op == "get_attr":
            env[n] = operator.attrgetter(n.target)(gm)
            continue
        s = plan.assign.get(n.name, 0)
        if s and not forked:
            fork("start")
            forked = True
        if n.op == "output":
            for j in plan.joins:
                streams.wait(0, events[j])
            for t in sorted(dangling):
                streams.wait(0, streams.record(t, f"join {t}"))
        dangling.discard(s)
        ctx = streams.use(s) if side else contextlib.nullcontext()
        with ctx:
            for w in plan.waits.get(n.name, ()):
                streams.wait(s, events[w])
            for p, t in plan.cross_reads.get(n.name, ()):
                for x in _tensors(env[by_name[p]]):
                    streams.record_stream(x, t)
            a, kw = fx.map_arg((n.args, n.kwargs), lambda x: env[x])
            if n.op == "output":
                return a[0]
            if n.op == "call_function":
                env[n] = n.target(*a, **kw)
            elif n.op == "call_method":
                env[n] = getattr(a[0], n.target)(*a[1:], **kw)
            else:
                env[n] = gm.get_submodule(n.target)(*a, **kw)
            if n.name in plan.records:
                events[n.name] = streams.record(s, n.name)
        if forked and n.op == "call_module" and n.target == FOLDED_CONSTANTS_MODULE:
            fork(n.name)  # it refreshed folded weights (after a weight changed) on stream 0
        for x in _arg_nodes(n):  # released after the last read, as fx's interpreter does
            if last_use.get(x) is n:
                env.pop(x, None)
