"""The fusion scheduler: which nodes of the optimized ATen graph form one generated kernel.

Why: run one ATen op at a time, every pointwise op, normalization, concatenation, pad or cast
is a kernel launch and a round trip of the whole tensor through memory. Here every op with a
rule in ``lowering.py`` is computed inside the kernel that needs its value, and a tensor is
written to memory only where something other than a generated kernel reads it.

How (``schedule``):

1. Classify each node: *library* (convolutions, matrix products, anything without a rule: it
   reads and writes real tensors), *view* (aliases its input; torch computes it for free),
   *fusible* (pointwise, data movement, window ops: a value computed at any index) or
   *reduction* (a rule giving a ``RowSpec``).
2. Decide what is stored ("realized"): a fusible value read as a tensor (by a library node, a
   graph output, or through views by those), every reduction result, and a fusible value
   several kernels need where recomputing it in each costs more bytes than storing it once
   (``_cheaper_to_store``: with ``L`` input tensors and ``k`` kernels, ``k * L`` reads against
   ``L + 1 + k``; of a chain the same kernels share, only the value nearest them, e.g. a channel
   shuffle after its concatenation and layout copies). Everything else is computed inline where
   it is used.
3. One kernel per realized fusible value (a ``PointwiseKernel`` over its shape) and per reduction
   (a ``ReductionKernel``: LayerNorm, softmax, GroupNorm, a mean... with its pointwise prologue
   inlined). Every node whose rule declines is made a library node and the decisions are redone.
4. ``arrange`` orders each kernel's loops by the memory order of what it writes (reductions:
   of their largest input) and merges adjacent loops that every access walks contiguously,
   so a kernel over dense tensors is one flat loop; reductions pick the thread mapping
   ("inner": threads across the reduced index; "outer": threads across rows, when the rows are
   what is contiguous, e.g. a spatial mean of a channels_last tensor).

Produces ``Region``s: the IR kernel, the graph nodes it reads and writes, the nodes it covers
(for the reference implementation and the report). ``rewrite`` replaces each region by one
node. Illegal / declined: graphs with in-place ops (the order of reads and writes would
matter) other than a tail of ``copy_`` into graph inputs (``_in_place_writes``), symbolic sizes,
dtypes other than float32/float16/bfloat16 in memory; every such node stays as PyTorch runs it,
with the reason in ``Schedule.unfused``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.ir import Buffer, Ix, Load, Phase, PointwiseKernel, ReductionKernel, Store, Var
from .lowering import (FLOATS, Decline, Value, is_view, meta, reduction_rule, static_shape, value_rule)

aten = torch.ops.aten
#: kernel inputs and outputs the generated code can read and write
_MEMORY_DTYPES = FLOATS


@dataclass
class Region:
    """One generated kernel: ``kernel`` (IR), the graph values it reads (``inputs``, in kernel
    argument order) and writes (``outputs``), and every node it covers."""
    kernel: object
    inputs: list
    outputs: list
    covered: list
    ops: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.kernel.name


@dataclass
class Schedule:
    regions: list
    #: node name -> why it runs as PyTorch runs it (for ops that are not library calls by design)
    unfused: dict


def _target_name(node: fx.Node) -> str:
    t = node.target
    return getattr(t, "__name__", str(t)) if not isinstance(t, torch._ops.OpOverload) else str(t)


def _is_mutating(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _in_place_writes(graph: fx.Graph) -> Optional[str]:
    """Why in-place ops make the graph's schedule illegal, or None. Legal: none, or only
    ``copy_`` of a computed value into a graph input, all after every other op (a training forward
    writing BatchNorm's running statistics into its buffers, as AOTAutograd emits it). Every read
    then precedes every write, wherever the scheduler computes the reads, and each ``copy_`` stays
    a library node (its source a stored tensor)."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    first = next((i for i, n in enumerate(nodes) if _is_mutating(n)), None)
    if first is None:
        return None
    tail = nodes[first:]
    written = {n.args[0] for n in tail if n.target is aten.copy_.default}
    for n in tail:
        if n.target is not aten.copy_.default:
            return f"the graph mutates tensors in place ({_target_name(n)} before other ops end)" \
                if _is_mutating(n) else "the graph mutates tensors in place before its last op"
        dst, src = n.args[0], n.args[1]
        if dst.op != "placeholder" or n.users:
            return "the graph mutates tensors in place (a copy_ into a non-input, or one that is read)"
        if not isinstance(src, fx.Node) or view_root(src) in written:
            return "the graph mutates tensors in place (a copy_ reads a tensor another one writes)"
    return None


def _container_items(node: fx.Node) -> Optional[list]:
    """getitem users of a node that returns several tensors (None if used otherwise)."""
    if not node.users or any(u.op != "call_function" or u.target is not operator.getitem for u in node.users):
        return None
    return list(node.users)


def view_root(node: fx.Node) -> fx.Node:
    """The node whose memory a chain of views aliases."""
    while is_view(node):
        src = node.args[0]
        if node.target is operator.getitem:
            src = src.args[0]  # split / unbind -> their input
        node = src
    return node


class _Classes:
    """Per-node class: "library", "view", "fusible", "reduction", "container", "input", "output"."""

    def __init__(self, gm: fx.GraphModule, skip: set):
        self.cls: dict = {}
        self.why: dict = {}
        for n in gm.graph.nodes:
            self.cls[n] = self._classify(n, skip)

    def _classify(self, n: fx.Node, skip: set) -> str:
        if n.op in ("placeholder", "get_attr"):
            return "input"
        if n.op == "output":
            return "output"
        if n.op != "call_function":
            return "library"
        if n in skip:
            self.why[n] = "left to a measured template group"
            return "library"
        if is_view(n):
            return "view"
        if n.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int):
            return "view"  # a list of views: its items are the views
        if reduction_rule(n) is not None:
            return "reduction"
        if value_rule(n) is not None:
            v = meta(n)
            if v is None:
                self.why[n] = "no metadata"
                return "library"
            return "fusible"
        items = _container_items(n)
        if items is not None and all(value_rule(u) is not None for u in items):
            return "container"
        if n.target is not operator.getitem:
            self.why[n] = f"no rule for {_target_name(n)}"
        return "library"

    def demote(self, n: fx.Node, why: str) -> None:
        self.cls[n] = "library"
        self.why[n] = why
        if n.target is operator.getitem and self.cls.get(n.args[0]) == "container":
            self.cls[n.args[0]] = "library"  # the other items need the op's real outputs
            for u in n.args[0].users:
                self.cls[u] = "library"


def _tensor_readers(node: fx.Node, cls: dict) -> bool:
    """Whether something reads ``node``'s value as a tensor: a library node, the output, or
    through views one of those."""
    for u in node.users:
        c = cls[u]
        if c in ("library", "output", "input"):
            return True
        if c == "view" and _tensor_readers(u, cls):
            return True
    return False


class _Plan:
    """The realized set and kernel membership, recomputed until every rule accepts its node."""

    def __init__(self, gm: fx.GraphModule, classes: _Classes):
        self.gm, self.c = gm, classes

    def realized(self) -> set:
        cls = self.c.cls
        out = set()
        for n, c in cls.items():
            if c == "fusible" and not is_view(n) and _tensor_readers(n, cls):
                out.add(n)
            elif c == "reduction":
                out.add(n)
        # fusible values that several kernels need: stored once where recomputing costs more. Of a
        # chain that the same kernels share, only the value nearest them is stored (the values
        # before it then feed only its kernel): a node is decided again once nothing stored in
        # this round lies downstream of it
        changed = True
        while changed:
            changed = False
            owners = self._owners(out)
            shadowed: set = set()
            for n in reversed(list(self.gm.graph.nodes)):
                if cls.get(n) not in ("fusible", "view", "container") or n in out:
                    continue
                if any(u in shadowed for u in n.users):
                    shadowed.add(n)
                    continue
                ks = owners.get(n, ())
                if (cls[n] == "fusible" and not is_view(n) and len(ks) > 1
                        and _cheaper_to_store(n, len(ks), cls, out)):
                    out.add(n)
                    shadowed.add(n)
                    changed = True
        return out

    def _owners(self, realized: set) -> dict:
        """For every fusible node: the set of kernels (realized nodes) that compute it inline."""
        cls = self.c.cls
        owners: dict = {}
        for n in reversed(list(self.gm.graph.nodes)):
            if cls.get(n) not in ("fusible", "view", "container"):
                continue
            ks = set()
            for u in n.users:
                cu = cls[u]
                if u in realized:
                    ks.add(u)
                elif cu in ("fusible", "view", "container"):
                    ks |= owners.get(u, set())
            if n in realized:
                ks = {n}
            owners[n] = ks
        return owners


def _window(n: fx.Node) -> int:
    """Elements of its input a window op reads per output element (1 for other ops)."""
    src = n.args[0] if n.target is operator.getitem and isinstance(n.args[0], fx.Node) else n
    if src.op != "call_function" or src.target not in (aten.max_pool2d_with_indices.default,
                                                       aten.avg_pool2d.default, aten._adaptive_avg_pool2d.default):
        return 1
    out, x = meta(n), meta(src.args[0])
    if src.target is aten._adaptive_avg_pool2d.default:
        return max(1, x.numel() // max(1, out.numel())) if out is not None and x is not None else 1
    k = src.args[1]
    k = list(k) if isinstance(k, (list, tuple)) else [k]
    return int(k[0]) * int(k[-1])


def _loads(n: fx.Node, cls: dict, realized: set, memo: dict) -> int:
    """Loads from memory per element that computing ``n`` inline costs (window ops count their
    window; each input tensor of an inline subtree counts once per use)."""
    if n in memo:
        return memo[n]
    total = 0
    for a in dict.fromkeys(n.all_input_nodes):
        if cls[a] in ("fusible", "view", "container") and a not in realized:
            total += _loads(a, cls, realized, memo)
        else:
            total += 1
    memo[n] = total * _window(n)
    return memo[n]


def _cheaper_to_store(n: fx.Node, k: int, cls: dict, realized: set) -> bool:
    """``k`` kernels computing ``n`` inline read ``k * L`` elements per element of ``n``; storing it
    costs ``L`` reads, one write and ``k`` reads."""
    loads = _loads(n, cls, realized, {})
    return loads + 1 + k < k * loads


# ---------------------------------------------------------------------------- building kernels
class _Builder:
    """Lowers the nodes of one kernel: inline values through their rules, everything else as
    kernel inputs."""

    def __init__(self, classes: _Classes, realized: set, own: set):
        self.c, self.realized, self.own = classes, realized, own
        self.inputs: list = []
        self.buffers: list = []
        self._slot: dict = {}
        self._memo: dict = {}
        self.covered: list = []
        self.failing: Optional[fx.Node] = None  # the node whose rule declined

    def inline(self, n: fx.Node) -> bool:
        c = self.c.cls.get(n)
        if c == "view":
            return self.inline(view_root(n))
        if c in ("fusible", "container"):
            return n not in self.realized or n in self.own
        return False

    def value_of(self, n: fx.Node) -> Value:
        hit = self._memo.get(n)
        if hit is not None:
            return hit
        if not self.inline(n):
            v = self._memo[n] = self.leaf(n)
            return v
        try:
            rule = value_rule(n)
            if rule is None:
                raise Decline(f"no rule for {_target_name(n)}")
            v = rule(n, self.value_of)
        except Exception:
            self.failing = self.failing or n
            raise
        self.covered.append(n)

        def load(idx, inner=v.load, node=n):
            try:
                return inner(idx)
            except Exception:
                self.failing = self.failing or node  # the innermost node whose rule declined
                raise
        v = self._memo[n] = Value(v.shape, v.dtype, load)
        return v

    def leaf(self, n: fx.Node) -> Value:
        t = meta(n)
        if t is None:
            raise Decline(f"{n.name} has no tensor metadata")
        if t.dtype not in _MEMORY_DTYPES:
            raise Decline(f"input {n.name} is {t.dtype}")
        if t.device.type not in ("cuda", "cpu", "meta"):  # meta: a loaded package's values
            raise Decline(f"input on {t.device}")
        shape, strides = static_shape(t), tuple(int(s) for s in t.stride())
        slot = self._slot.get(n)
        if slot is None:
            slot = self._slot[n] = len(self.inputs)
            self.inputs.append(n)
            self.buffers.append(Buffer(n.name, shape, strides, t.dtype))
        return Value(shape, t.dtype, lambda idx, s=slot: Load(s, ir.strided(idx, shape, strides)))


def _out_buffer(n: fx.Node) -> Buffer:
    t = meta(n)
    if t is None or t.dtype not in _MEMORY_DTYPES:
        raise Decline(f"output {n.name} of dtype {None if t is None else t.dtype}")
    shape = static_shape(t)
    strides = tuple(int(s) for s in t.stride())
    if not _dense(shape, strides):
        raise Decline(f"output {n.name} is not dense")
    return Buffer(n.name, shape, strides, t.dtype)


def _dense(shape, strides) -> bool:
    dims = sorted(((s, n) for n, s in zip(shape, strides) if n != 1), key=lambda t: t[0])
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


def _vars(shape: tuple, prefix: str) -> tuple[list, list]:
    """(loop variables for the non-size-1 dims, the logical index with 0 for size-1 dims)."""
    vs, idx = [], []
    for d, n in enumerate(shape):
        if n == 1:
            idx.append(Ix())
        else:
            v = Var(f"{prefix}{d}", int(n))
            vs.append(v)
            idx.append(Ix.of(v))
    return vs, idx


def _pointwise_kernel(name: str, n: fx.Node, b: _Builder) -> PointwiseKernel:
    out = _out_buffer(n)
    v = b.value_of(n)
    if v.shape != out.shape:
        raise Decline("value shape differs from its metadata")
    vs, idx = _vars(out.shape, "i")
    value = v.load(idx)
    if value.kind != "float":
        raise Decline("a boolean value stored")
    store = Store(0, ir.strided(idx, out.shape, out.strides), value)
    return PointwiseKernel(name, vs, b.buffers, [out], [store])


def _reduction_kernel(name: str, n: fx.Node, b: _Builder) -> tuple[ReductionKernel, list]:
    spec = reduction_rule(n)(n, b.value_of)
    b.covered.append(n)
    vs, idx = _vars(spec.shape, "i")
    outer = [v for v in vs if int(v.name[1:]) not in spec.reduced]
    reduced = [v for v in vs if int(v.name[1:]) in spec.reduced]
    phases = [Phase(pn, pop, fn(idx)) for pn, pop, fn in spec.phases]
    outs, bufs, row, outer_st = [], [], [], []
    zero = {v: Ix() for v in reduced}
    for o in spec.outputs:
        node = n if o.item is None else next((u for u in n.users if u.args[1] == o.item), None)
        if node is None:
            continue
        buf = _out_buffer(node)
        slot = len(bufs)
        bufs.append(buf)
        outs.append(node)
        oidx = o.index(idx)
        if o.kind == "row":
            row.append(Store(slot, ir.strided(oidx, buf.shape, buf.strides), o.value(idx)))
        else:
            off = ir.strided(oidx, buf.shape, buf.strides).substitute(zero)
            outer_st.append(Store(slot, off, o.value(idx)))
    if not outs:
        raise Decline("no output of the reduction is used")
    for s in outer_st:
        if any(v in ir.all_vars(ix) for ix in _store_ixs(s) for v in reduced):
            raise Decline("a per-row output depends on the reduced index")
    k = ReductionKernel(name, outer, reduced, b.buffers, bufs, phases, row, outer_st)
    return k, outs


def _store_ixs(s: Store) -> list:
    out = [s.offset]
    for e in ir.walk(s.value):
        if isinstance(e, Load):
            out.append(e.offset)
        elif isinstance(e, ir.InRange):
            out.append(e.index)
    return out


# ---------------------------------------------------------------------------- loop order and merging
def _substitute(k, mapping: dict) -> None:
    memo: dict = {}
    if isinstance(k, PointwiseKernel):
        k.stores = [Store(s.buf, s.offset.substitute(mapping), ir.substitute(s.value, mapping, memo)) for s in k.stores]
        return
    k.phases = [Phase(p.name, p.op, ir.substitute(p.value, mapping, memo)) for p in k.phases]
    k.row_stores = [Store(s.buf, s.offset.substitute(mapping), ir.substitute(s.value, mapping, memo)) for s in k.row_stores]
    k.outer_stores = [Store(s.buf, s.offset.substitute(mapping), ir.substitute(s.value, mapping, memo))
                      for s in k.outer_stores]


def _mergeable(a: Var, b: Var, ixs: list) -> bool:
    """Loops a (outer) and b (inner) walk every access as one loop of a.size * b.size."""
    for ix in ixs:
        if a in ix.vars_inside_atoms() or b in ix.vars_inside_atoms():
            return False
        if ix.coef(a) != ix.coef(b) * b.size:
            return False
    return True


def _merge_run(vs: list, k, prefix: str) -> list:
    """Merge adjacent loops of ``vs`` (outermost first) where every access allows it."""
    vs = list(vs)
    i = len(vs) - 1
    while i > 0:
        a, b = vs[i - 1], vs[i]
        if _mergeable(a, b, ir.index_exprs(k)):
            m = Var(f"{prefix}{a.name}_{b.name}", a.size * b.size)
            _substitute(k, {a: Ix(), b: Ix.of(m)})
            vs[i - 1:i + 1] = [m]
        i -= 1
    return vs


def _order(vs: list, ix: Ix) -> list:
    """Loops sorted by the stride ``ix`` gives them, largest first (stable)."""
    return sorted(vs, key=lambda v: -abs(ix.coef(v)))


def _main_load(k) -> Optional[Load]:
    best, size = None, -1
    for p in k.phases:
        for e in ir.walk(p.value):
            if isinstance(e, Load) and k.inputs[e.buf].numel > size:
                best, size = e, k.inputs[e.buf].numel
    return best


def _rename(k, vs_lists: list) -> None:
    """Short loop names (v0, v1, ... / o0, r0 ...) for the generated code."""
    mapping = {}
    for vs, prefix in vs_lists:
        for j, v in enumerate(vs):
            mapping[v] = Var(f"{prefix}{j}", v.size)
    _substitute(k, {a: Ix.of(b) for a, b in mapping.items()})
    return mapping


#: at most this many sub-kernels when a loop nest is split at concatenation / padding boundaries
MAX_PARTS = 64


def _split_points(k: PointwiseKernel) -> dict:
    """Per loop variable, the values where a range test on it (``v + c`` in [lo, hi)) flips."""
    pts: dict = {}
    for e in ir.kernel_exprs(k):
        for node in ir.walk(e):
            if isinstance(node, ir.InRange) and len(node.index.terms) == 1:
                v, coef = node.index.terms[0]
                if isinstance(v, Var) and coef == 1:
                    for b in (node.lo - node.index.const, node.hi - node.index.const):
                        if 0 < b < v.size:
                            pts.setdefault(v, set()).add(b)
    return pts


def split(k: PointwiseKernel) -> list:
    """Sub-kernels of ``k`` over boxes of its loop nest cut at the points where its range tests
    flip, each with the tests decided: a concatenation becomes one plain copy per input, padding
    an unconditional interior and thin borders. [] when nothing is worth splitting."""
    pts = _split_points(k)
    if not pts:
        return []
    chosen, parts = [], 1
    for v in sorted(pts, key=lambda v: len(pts[v])):
        n = len(pts[v]) + 1
        if parts * n <= MAX_PARTS:
            chosen.append(v)
            parts *= n
    if not chosen:
        return []
    segments = []
    for v in chosen:
        edges = [0] + sorted(pts[v]) + [v.size]
        segments.append([(v, a, b) for a, b in zip(edges, edges[1:])])
    out = []
    for box in _product(segments):
        mapping, new_vars = {}, {}
        for v, a, b in box:
            nv = Var(f"{v.name}p{a}", b - a) if b - a > 1 else None
            mapping[v] = (Ix.of(nv) if nv is not None else Ix()) + a
            new_vars[v] = nv
        memo: dict = {}
        stores = [Store(s.buf, s.offset.substitute(mapping), ir.specialize(s.value, mapping, memo)) for s in k.stores]
        vs = [new_vars.get(v, v) for v in k.vars]
        out.append(PointwiseKernel(f"{k.name}_p{len(out)}", [v for v in vs if v is not None], k.inputs, k.outputs,
                                   stores, k.ops))
    return out


def _product(lists: list) -> list:
    out = [[]]
    for options in lists:
        out = [acc + [o] for acc in out for o in options]
    return out


def _arrange_pointwise(k: PointwiseKernel) -> None:
    vs = _order(k.vars, k.stores[0].offset)
    vs = _merge_run(vs, k, "m")
    mapping = _rename(k, [(vs, "x")])
    k.vars = [mapping[v] for v in vs]


def arrange(k) -> None:
    """Order the loops of ``k`` by memory order and merge the contiguous ones (in place); split a
    pointwise loop nest at concatenation / padding boundaries first."""
    if isinstance(k, PointwiseKernel):
        k.parts = split(k)
        for part in k.parts:
            _arrange_pointwise(part)
        if not k.parts:
            _arrange_pointwise(k)
        return
    main = _main_load(k)
    key = main.offset if main is not None else (k.row_stores or k.outer_stores)[0].offset
    outer = _merge_run(_order(k.outer, key), k, "m")
    reduced = _merge_run(_order(k.reduced, key), k, "m")
    mapping = _rename(k, [(outer, "o"), (reduced, "r")])
    k.outer, k.reduced = [mapping[v] for v in outer], [mapping[v] for v in reduced]
    main = _main_load(k)
    if main is not None and k.reduced and main.offset.coef(k.reduced[-1]) == 1:
        k.strategy = "inner"
    elif main is not None and k.outer and main.offset.coef(k.outer[-1]) == 1:
        k.strategy = "outer"
    else:
        k.strategy = "inner"


# ---------------------------------------------------------------------------- the schedule
def _ops_of(nodes: list) -> list:
    """The ATen ops a region covers (an item of a multi-output op counts as that op)."""
    out = []
    for n in nodes:
        if n.op != "call_function":
            continue
        src = n.args[0] if n.target is operator.getitem else n
        if isinstance(src, fx.Node) and src.op == "call_function":
            out.append(_target_name(src))
    return list(dict.fromkeys(out))


def schedule(gm: fx.GraphModule, skip: set = frozenset(), max_rounds: int = 50, strict: bool = False) -> Schedule:
    """The regions of ``gm`` (see the module docstring). ``skip``: nodes left as they are.
    A rule that fails with anything else than ``Decline`` leaves its node to PyTorch too (with
    the error as the reason), unless ``strict``."""
    graph = gm.graph
    why = _in_place_writes(graph)
    if why:
        return Schedule([], {n.name: why for n in graph.nodes if n.op == "call_function"})
    classes = _Classes(gm, set(skip))
    for _ in range(max_rounds):
        realized = _Plan(gm, classes).realized()
        regions, failed = [], {}
        for n in graph.nodes:
            if n not in realized:
                continue
            c = classes.cls[n]
            b = _Builder(classes, realized, {n})
            try:
                if c == "reduction":
                    k, outs = _reduction_kernel(f"fx_red_{n.name}", n, b)
                else:
                    k, outs = _pointwise_kernel(f"fx_pw_{n.name}", n, b), [n]
                arrange(k)
            except Exception as e:  # noqa: BLE001 - a rule's failure only costs its node's fusion
                if strict and not isinstance(e, (Decline, ValueError)):
                    raise
                failed.setdefault(b.failing or n, str(e) if isinstance(e, (Decline, ValueError))
                                  else f"{type(e).__name__}: {e}")
                continue
            covered = list(dict.fromkeys(b.covered))
            regions.append(Region(k, b.inputs, outs, covered, _ops_of(covered)))
        if not failed:
            break
        for node, reason in failed.items():  # these run as PyTorch runs them; decide again
            classes.demote(node, reason)
    else:
        return Schedule([], {"*": "the scheduler did not settle"})
    for r in regions:
        r.kernel.ops = r.ops
    unfused = {n.name: w for n, w in classes.why.items() if classes.cls[n] == "library"}
    return Schedule(regions, unfused)



# ---------------------------------------------------------------------------- conv epilogues
def _only_fusible_readers(node: fx.Node, skip: set) -> bool:
    """Every reader of ``node`` (through views) is an op a generated kernel computes."""
    if not node.users:
        return False
    for u in node.users:
        if u in skip or u.op != "call_function":
            return False
        if is_view(u) or u.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int):
            if not _only_fusible_readers(u, skip):
                return False
        elif value_rule(u) is None and reduction_rule(u) is None:
            items = _container_items(u)
            if items is None or any(value_rule(i) is None for i in items):
                return False
    return True


def split_conv_epilogues(gm: fx.GraphModule, skip: set = frozenset()) -> int:
    """Split each fused conv with an epilogue (bias, residual, activation) whose readers are all
    generated kernels into the bare convolution and ``conv_epilogue_ref``: the scheduler then
    computes the epilogue inside those kernels, where they read the conv's output, instead of in a
    pass of its own over the whole activation (one write and one read less; a squeeze-excite block
    reads a SiLU conv's output twice and writes it never)."""
    from fxopt.ops import conv_epilogue_ref, fused_conv_ref

    g, count = gm.graph, 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not fused_conv_ref or len(node.args) < 10:
            continue
        args = list(node.args)
        bias, res, act, params = args[2], args[3], args[8], args[9]
        if bias is None and res is None and act == "none":
            continue  # nothing to move
        if meta(node) is None or not _only_fusible_readers(node, skip):
            continue
        with g.inserting_before(node):
            conv = g.call_function(fused_conv_ref, tuple(args[:2] + [None, None] + args[4:8] + ["none", []] + args[10:]))
            epi = g.call_function(conv_epilogue_ref, (conv, bias, res, act, list(params)))
        conv.meta = dict(node.meta)
        epi.meta = dict(node.meta)
        node.replace_all_uses_with(epi)
        g.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


# ---------------------------------------------------------------------------- graph rewrite
def reference_module(gm: fx.GraphModule, region: Region) -> fx.GraphModule:
    """The region's nodes as PyTorch runs them: a module from its inputs to the tuple of its
    outputs (the reference every generated kernel is measured and checked against)."""
    covered = set(region.covered) | set(region.outputs)
    for n in list(covered):
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            covered.add(n.args[0])  # the op whose item it is
    g = fx.Graph()
    env: dict = {}
    for i, n in enumerate(region.inputs):
        env[n] = g.placeholder(f"in{i}")
        env[n].meta = dict(n.meta)

    def arg(a):
        if a not in env:
            raise Decline(f"{a.name} is neither computed by the region nor one of its inputs")
        return env[a]
    for n in gm.graph.nodes:
        if n in covered and n not in env:
            env[n] = g.node_copy(n, arg)
    g.output(tuple(env[o] for o in region.outputs))
    return fx.GraphModule(gm, g, class_name="RegionReference")


def rewrite(gm: fx.GraphModule, regions: list, targets: list) -> list:
    """Replace each region by one node calling ``targets[i](*inputs) -> tuple of outputs``,
    placed after its last input; the outputs' users read its items. Returns the new nodes."""
    g = gm.graph
    replaced: dict = {}
    nodes = []
    for region, target in zip(regions, targets):
        inputs = [replaced.get(n, n) for n in region.inputs]
        pos = {n: i for i, n in enumerate(g.nodes)}
        anchor = max(inputs, key=lambda n: pos[n]) if inputs else None
        where = g.inserting_after(anchor) if anchor is not None else g.inserting_before(region.outputs[0])
        with where:
            node = g.create_node("call_function", target, tuple(inputs), {}, name=region.name)
        node.meta["val"] = tuple(meta(o) for o in region.outputs)
        node.meta["fxopt_region"] = region.name
        prev = node
        for i, o in enumerate(region.outputs):
            with g.inserting_after(prev):
                item = g.call_function(operator.getitem, (node, i))
            item.meta = dict(o.meta)
            o.replace_all_uses_with(item)
            replaced[o] = item
            prev = item
        nodes.append(node)
    g.eliminate_dead_code()
    g.lint()
    gm.recompile()
    return nodes
