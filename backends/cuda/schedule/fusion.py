"""The fusion scheduler: which nodes of the optimized ATen graph form one generated kernel.

Why: run one ATen op at a time, every pointwise op, normalization, concatenation, pad or cast
is a kernel launch and a round trip of the whole tensor through memory. Here every op with a
rule in ``lowering.py`` is computed inside the kernel that needs its value, and a tensor is
written to memory only where something other than a generated kernel reads it.

How (``schedule``):

1. Classify each node: *library* (convolutions, matrix products, anything without a rule: it
   reads and writes real tensors), *view* (aliases its input; torch computes it for free),
   *fusible* (pointwise, data movement, window ops: a value computed at any index),
   *reduction* (a rule giving a ``RowSpec``) or *const* (the index arithmetic that only gathers
   lowered as index maps read, ``index_rules.py``: evaluated at planning time, no kernel).
2. Decide what is stored ("realized"): a fusible value read as a tensor (by a library node, a
   graph output, or through views by those), every reduction result, and a fusible value
   several kernels need where recomputing it in each costs more bytes than storing it once
   (``_cheaper_to_store``: with ``L`` input tensors and ``k`` kernels, ``k * L`` reads against
   ``L + 1 + k``; of a chain the same kernels share, only the value nearest them, e.g. a channel
   shuffle after its concatenation and layout copies). ``k`` counts each kernel by the share of
   the value it reads (``_shares``: kernels reading one piece of a split each read that piece) and
   a concatenation costs per element the loads of the input it comes from (``_loads``), so split
   pieces are read in place and concatenations are not stored to be shared (``copies.py``).
   Everything else is computed inline where it is used.
3. One kernel per realized fusible value (a ``PointwiseKernel`` over its shape) and per reduction
   (a ``ReductionKernel``: LayerNorm, softmax, GroupNorm, a mean... with its pointwise prologue
   inlined), built by ``build.py``. Every node whose rule declines is made a library node and the
   decisions are redone.
4. ``arrange`` (``loops.py``) orders each kernel's loops by the memory order of what it writes (reductions:
   of their largest input) and merges adjacent loops that every access walks contiguously,
   so a kernel over dense tensors is one flat loop; reductions pick the thread mapping
   ("inner": threads across the reduced index; "outer": threads across rows, when the rows are
   what is contiguous, e.g. a spatial mean of a channels_last tensor).
5. The kernels that each store one piece of the same split from the same inputs (for library
   convolutions) become one kernel with one output per piece (``copies.merge_pieces``).
6. A pointwise kernel reading a stored value at the indices where another pointwise kernel stores
   it is computed in that kernel, from the value in registers (``consumers.merge_consumers``).

Produces ``Region``s: the IR kernel, the graph nodes it reads and writes, the nodes it covers
(for the reference implementation and the report). ``rewrite.py`` replaces each region by one
node and gives its reference module. Illegal / declined: graphs with in-place ops (the order of reads and writes would
matter) other than a tail of ``copy_`` into graph inputs (``_in_place_writes``), symbolic sizes,
dtypes other than float32/float16/bfloat16 in memory; every such node stays as PyTorch runs it,
with the reason in ``Schedule.unfused``.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.ir import PointwiseKernel
from fxopt.backends.cuda.kernels.common import meta
from .build import Builder, pointwise_kernel, reduction_kernel
from .index_rules import TARGETS as INDEX_TARGETS, constant_nodes, decline_reason
from .loops import arrange
from .lowering import container_items, is_view, target_name, value_rule, view_root
from .movement_rules import MULTI_VIEWS
from . import consumers, copies
from .reduction_rules import reduction_rule
from .values import Decline

aten = torch.ops.aten


@dataclass
class Region:
    """One generated kernel: ``kernel`` (IR), the graph values it reads (``inputs``, in kernel
    argument order) and writes (``outputs``), and every node it covers."""
    kernel: object
    inputs: list
    outputs: list
    covered: list
    ops: list = field(default_factory=list)
    #: a pointwise kernel as built, before ``arrange`` ordered and merged its loops (``consumers.py``)
    raw: object = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.kernel.name


@dataclass
class Schedule:
    regions: list
    #: node name -> why it runs as PyTorch runs it (for ops that are not library calls by design)
    unfused: dict



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
            return f"the graph mutates tensors in place ({target_name(n)} before other ops end)" \
                if _is_mutating(n) else "the graph mutates tensors in place before its last op"
        dst, src = n.args[0], n.args[1]
        if dst.op != "placeholder" or n.users:
            return "the graph mutates tensors in place (a copy_ into a non-input, or one that is read)"
        if not isinstance(src, fx.Node) or view_root(src) in written:
            return "the graph mutates tensors in place (a copy_ reads a tensor another one writes)"
    return None



class _Classes:
    """Per-node class: "library", "view", "fusible", "reduction", "container", "input", "output",
    "const" (read only by gathers lowered as index maps: no kernel, ``_mark_constants``)."""

    def __init__(self, gm: fx.GraphModule, skip: set):
        self.gm = gm
        self.cls: dict = {}
        self.why: dict = {}
        self._before_const: dict = {}
        for n in gm.graph.nodes:
            self.cls[n] = self._classify(n, skip)
        self._mark_constants()

    def _mark_constants(self) -> None:
        """Class "const" for the constant index nodes that only fusible gathers read (their
        classes before kept, for when such a gather is demoted)."""
        for n, c in self._before_const.items():
            self.cls[n] = c
        accepted = {n for n, c in self.cls.items() if c == "fusible" and n.target in INDEX_TARGETS}
        consts = constant_nodes(self.gm.graph, accepted) if accepted else set()
        self._before_const = {n: self.cls[n] for n in consts}
        for n in consts:
            self.cls[n] = "const"

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
        if n.target in INDEX_TARGETS and value_rule(n) is None:
            self.why[n] = decline_reason(n) or f"no rule for {target_name(n)}"
            return "library"
        if value_rule(n) is not None:
            v = meta(n)
            if v is None:
                self.why[n] = "no metadata"
                return "library"
            return "fusible"
        items = container_items(n)
        if items is not None and all(value_rule(u) is not None for u in items):
            return "container"
        if n.target is not operator.getitem:
            self.why[n] = f"no rule for {target_name(n)}"
        return "library"

    def demote(self, n: fx.Node, why: str) -> None:
        gather = self.cls.get(n) == "fusible" and n.target in INDEX_TARGETS
        self.cls[n] = "library"
        self.why[n] = why
        if gather:  # its index tensors are read as tensors now
            self._mark_constants()
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


#: reductions whose result is one of the values they reduce
SELECTING = (torch.ops.aten.amax.default, torch.ops.aten.amin.default)


def _selected_from(gm: fx.GraphModule, cls: dict) -> set:
    """The values a max / min reduction selects from that something else reads too: stored once,
    and read by the reduction and the others alike. Computed inline in two kernels, they may round
    differently (a generated kernel's ``tanhf`` against PyTorch's, whichever each region's
    measurement keeps), and a comparison ``x == x.amax(1)`` (amax's gradient: the count of the
    maxima; a mask) finds no maximum: the gradient came out NaN (GPU fuzz a93a79118e, float32
    training, GELU then amax over channels)."""
    out = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in SELECTING or not isinstance(n.args[0], fx.Node):
            continue
        root = view_root(n.args[0])
        if cls.get(root) == "fusible" and not is_view(root) and (len(root.users) > 1 or len(n.args[0].users) > 1):
            out.add(root)
    return out


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
        out |= _selected_from(self.gm, cls)
        # fusible values that several kernels need: stored once where recomputing costs more. Of a
        # chain that the same kernels share, only the value nearest them is stored (the values
        # before it then feed only its kernel): a node is decided again once nothing stored in
        # this round lies downstream of it
        changed = True
        while changed:
            changed = False
            owners = self._owners(out)
            share = _shares(self.gm, cls, out)
            shadowed: set = set()
            for n in reversed(list(self.gm.graph.nodes)):
                if cls.get(n) not in ("fusible", "view", "container") or n in out:
                    continue
                if any(u in shadowed for u in n.users):
                    shadowed.add(n)
                    continue
                ks = owners.get(n, ())
                if (cls[n] == "fusible" and not is_view(n) and len(ks) > 1
                        and _cheaper_to_store(n, share.get(n, len(ks)) if copies.ENABLED else len(ks), cls, out)):
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


def _loads(n: fx.Node, cls: dict, realized: set, memo: dict) -> float:
    """Loads from memory per element that computing ``n`` inline costs (window ops count their
    window; each input tensor of an inline subtree counts once per use; a concatenation's element
    comes from one of its inputs: their loads weighted by their share of its elements)."""
    if n in memo:
        return memo[n]
    weights = _cat_weights(n) if copies.ENABLED else None
    total = 0
    for a in dict.fromkeys(n.all_input_nodes):
        if cls[a] == "const":
            continue  # index arithmetic folded into the index map: no load
        if cls[a] in ("fusible", "view", "container") and a not in realized:
            cost = _loads(a, cls, realized, memo)
        else:
            cost = 1
        total += cost * weights.get(a, 1) if weights is not None else cost
    memo[n] = total * _window(n)
    return memo[n]


def _cat_weights(n: fx.Node) -> Optional[dict]:
    """For a concatenation: each input's share of its elements (None for other nodes)."""
    if n.op != "call_function" or n.target is not aten.cat.default:
        return None
    out = meta(n)
    total = out.numel() if out is not None else 0
    if not total:
        return None
    weights: dict = {}
    for a in n.args[0]:
        t = meta(a) if isinstance(a, fx.Node) else None
        if t is None:
            return None
        weights[a] = weights.get(a, 0) + t.numel() / total
    return weights


#: ops whose value is a part of their input's (a kernel reading them reads only that part)
_NARROWING = (aten.slice.Tensor, aten.select.int, aten.narrow.default)


def _part_of(u: fx.Node, n: fx.Node) -> float:
    """The share of ``n``'s elements that ``u`` reads where ``u`` is a part of ``n`` (a split's
    piece, a slice), else 1."""
    src = u.args[0] if u.target is operator.getitem and isinstance(u.args[0], fx.Node) else None
    if not (u.target in _NARROWING or (src is not None and src.target in MULTI_VIEWS)):
        return 1.0
    a, b = meta(u), meta(n if src is None else src.args[0])
    if a is None or b is None or not b.numel():
        return 1.0
    return min(1.0, a.numel() / b.numel())


def _shares(gm: fx.GraphModule, cls: dict, realized: set) -> dict:
    """For every fusible node: the share of its elements the kernels computing it inline read, summed
    over those kernels (a kernel reading one piece of a split reads that piece only). Equal to the
    number of kernels where each reads the whole value."""
    part: dict = {}
    for n in reversed(list(gm.graph.nodes)):
        c = cls.get(n)
        if c not in ("fusible", "view", "container"):
            continue
        if n in realized:
            part[n] = {n: 1.0}
            continue
        ks: dict = {}
        for u in n.users:
            if u in realized or cls[u] in ("fusible", "view", "container"):
                f = _part_of(u, n)
                for k, w in part.get(u, {}).items():
                    ks[k] = min(1.0, ks.get(k, 0.0) + w * f)
        part[n] = ks
    return {n: sum(ks.values()) for n, ks in part.items()}


def _cheaper_to_store(n: fx.Node, k: float, cls: dict, realized: set) -> bool:
    """``k`` kernels computing ``n`` inline read ``k * L`` elements per element of ``n``; storing it
    costs ``L`` reads, one write and ``k`` reads. ``k``: the kernels' shares of ``n`` (``_shares``;
    kernels that each read one piece of a split read it once in all)."""
    loads = _loads(n, cls, realized, {})
    return loads + 1 + k < k * loads


# ---------------------------------------------------------------------------- the schedule
def _ops_of(nodes: list) -> list:
    """The ATen ops a region covers (an item of a multi-output op counts as that op)."""
    out = []
    for n in nodes:
        if n.op != "call_function":
            continue
        src = n.args[0] if n.target is operator.getitem else n
        if isinstance(src, fx.Node) and src.op == "call_function":
            out.append(target_name(src))
    return list(dict.fromkeys(out))


def schedule(gm: fx.GraphModule, skip: set = frozenset(), max_rounds: int = 50, strict: bool = False,
             merge_readers: bool = True) -> Schedule:
    """The regions of ``gm`` (see the module docstring). ``skip``: nodes left as they are.
    ``merge_readers``: step 6 (``consumers.merge_consumers``).
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
            b = Builder(classes, realized, {n})
            try:
                if c == "reduction":
                    k, outs = reduction_kernel(f"fx_red_{n.name}", n, b)
                else:
                    k, outs = pointwise_kernel(f"fx_pw_{n.name}", n, b), [n]
                raw = dataclasses.replace(k) if isinstance(k, PointwiseKernel) else None
                arrange(k)
            except Exception as e:  # noqa: BLE001 - a rule's failure only costs its node's fusion
                if strict and not isinstance(e, (Decline, ValueError)):
                    raise
                failed.setdefault(b.failing or n, str(e) if isinstance(e, (Decline, ValueError))
                                  else f"{type(e).__name__}: {e}")
                continue
            covered = list(dict.fromkeys(b.covered))
            regions.append(Region(k, b.inputs, outs, covered, _ops_of(covered), raw=raw))
        if not failed:
            break
        for node, reason in failed.items():  # these run as PyTorch runs them; decide again
            classes.demote(node, reason)
    else:
        return Schedule([], {"*": "the scheduler did not settle"})
    regions = copies.merge_pieces(regions, Region)
    if merge_readers:
        regions = consumers.merge_consumers(regions, Region)
    for r in regions:
        r.kernel.ops = r.ops
    unfused = {n.name: w for n, w in classes.why.items() if classes.cls[n] == "library"}
    return Schedule(regions, unfused)
