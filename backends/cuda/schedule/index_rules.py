"""Gathers at compile-time constant indices as index maps: upsampling without a gather.

AOTAutograd decomposes nearest and bilinear upsampling into index arithmetic (``arange``, ``add``,
``mul``, a clamp, a cast to int64, ``unsqueeze``) and ``aten._unsafe_index``. Where every index
tensor of an ``_unsafe_index`` / ``index`` depends only on constant-producing ops (``CONSTANT_OPS``:
no graph input, no attribute but a literal of the traced code, ``_tensor_constant``), its values
are computed once at planning time, on the CPU (the nodes run with device cpu), and each is
matched over its whole range against an exact integer map of one output coordinate ``i`` into an
input dim of extent ``n`` (``fit``): at a rational scale ``p/q`` (a ratio of the two sizes, or a
scalar of the index arithmetic as a fraction of small integers), the floor of a source position,
nearest ``i*p/q``, nearest-exact ``(2i+1)*p/(2q)`` or linear's half-pixel ``(i+0.5)*p/q - 0.5``
(the identity is nearest at scale 1; align_corners is nearest at ``(n-1)/(m-1)``), or that plus
one (linear's second neighbour), clamped below (0, or 1) and above (``n - 1``) where needed, or a
constant. A match makes the gather a view in the IR: loads of its input at those index
expressions (a clamp that binds: a choice between loads), no indirect load. The index nodes then
have no reader left in any kernel: ``constant_nodes`` tells the scheduler to give them none, the
region's reference recomputes them (``rewrite.py``) and dead code elimination drops them from the
graph; bilinear's interpolation weights (floating point, from the same ``arange``) are folded into
constants by the ``fold_constants`` pass. Anything else declines with a one-line reason and the
node runs as PyTorch runs it: an index read from a graph input (a real gather), a boolean mask, an
index depending on several output coordinates, a float rounding that no exact map reproduces.

``upsample_nearest2d`` and ``_upsample_nearest_exact2d`` (where they reach the executor
undecomposed) are the same index maps, their source indices computed as PyTorch's CPU and CUDA
kernels compute them (``UpSample.h``: a float32 scale, ``1 / scale`` where one is given, else
``in / out``; ``floorf(i * scale)`` or ``floorf((i + 0.5) * scale)`` with ``i + 0.5`` a double;
the clamp to ``n - 1``; the CPU kernel's shortcuts for ``out == in`` and ``out == 2 * in``).
Where the two kernels' float rounding gives different indices, they decline.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from fxopt.backends.cuda.ir import InRange, Ix, Where
from fxopt.backends.cuda.kernels.common import meta
from .values import Decline, Value, static_shape

aten = torch.ops.aten
prims = torch.ops.prims

#: index tensors larger than this are not evaluated at planning time
MAX_INDEX_ELEMENTS = 1 << 22
#: the largest numerator / denominator of a scale tried as a fraction
MAX_SCALE_TERM = 64


def _ops(*names) -> frozenset:
    out = set()
    for name in names:
        ns, _, rest = name.partition("::")
        packet, _, overload = rest.partition(".")
        op = getattr(getattr(getattr(torch.ops, ns), packet, None), overload or "default", None)
        if op is not None:
            out.add(op)
    return frozenset(out)


#: ops whose value is a compile-time constant when their tensor inputs are (creation, scalar
#: arithmetic, casts, views): the index arithmetic of upsampling and the like
CONSTANT_OPS = _ops(
    "aten::arange.default", "aten::arange.start", "aten::arange.start_step", "aten::full.default",
    "aten::scalar_tensor.default", "aten::zeros.default", "aten::ones.default",
    "aten::add.Tensor", "aten::add.Scalar", "aten::sub.Tensor", "aten::sub.Scalar", "aten::rsub.Scalar",
    "aten::mul.Tensor", "aten::mul.Scalar", "aten::div.Tensor", "aten::div.Scalar", "aten::div.Tensor_mode",
    "aten::div.Scalar_mode", "aten::floor_divide.default", "aten::remainder.Tensor", "aten::remainder.Scalar",
    "aten::neg.default", "aten::floor.default", "aten::ceil.default", "aten::trunc.default", "aten::round.default",
    "aten::clamp.default", "aten::clamp.Tensor", "aten::clamp_min.default", "aten::clamp_max.default",
    "aten::minimum.default", "aten::maximum.default", "aten::where.self",
    "aten::_to_copy.default", "aten::clone.default", "aten::alias.default", "aten::lift_fresh_copy.default",
    "aten::unsqueeze.default", "aten::squeeze.dim", "aten::squeeze.dims", "aten::squeeze.default",
    "aten::view.default", "aten::_unsafe_view.default", "aten::reshape.default", "aten::expand.default",
    "aten::permute.default", "aten::slice.Tensor", "aten::select.int",
    "prims::convert_element_type.default", "prims::iota.default",
)

GATHERS = (aten._unsafe_index.Tensor, aten.index.Tensor)
#: undecomposed nearest upsampling: target -> (mode, whether its scales come as one list)
UPSAMPLE = {
    aten.upsample_nearest2d.vec: ("nearest", True), aten.upsample_nearest2d.default: ("nearest", False),
    aten._upsample_nearest_exact2d.vec: ("exact", True), aten._upsample_nearest_exact2d.default: ("exact", False),
}
TARGETS = frozenset(GATHERS) | frozenset(UPSAMPLE)


# ---------------------------------------------------------------------------- constant index tensors
def why_not_constant(node: fx.Node, memo: Optional[dict] = None) -> Optional[str]:
    """None where ``node`` is a compile-time constant (a ``CONSTANT_OPS`` call whose tensor inputs
    all are), else why not."""
    memo = {} if memo is None else memo
    stack, order = [node], []
    while stack:  # iterative: index chains are short, but a graph input may lie far upstream
        n = stack.pop()
        if n in memo:
            continue
        if n.op == "placeholder":
            memo[n] = f"reads graph input {n.name}"
        elif n.op == "get_attr":
            memo[n] = None if _literal(n) is not None else f"reads attribute {n.target}"
        elif n.op != "call_function" or n.target not in CONSTANT_OPS:
            memo[n] = f"computed by {getattr(n.target, '__name__', n.target)}"
        else:
            memo[n] = None
            order.append(n)
            stack.extend(n.all_input_nodes)
    for n in reversed(order):  # inputs before their users
        bad = next((memo[a] for a in n.all_input_nodes if memo[a] is not None), None)
        if bad is not None:
            memo[n] = bad
    return memo[node]


def _literal(node: fx.Node) -> Optional[torch.Tensor]:
    """The value of a ``_tensor_constant`` attribute (a literal of the traced code, e.g. a list
    index, which nothing can change), or None for any other attribute (parameters, buffers)."""
    gm = node.graph.owning_module
    if gm is None or not str(node.target).startswith("_tensor_constant") or "." in str(node.target):
        return None
    v = getattr(gm, str(node.target), None)
    if not isinstance(v, torch.Tensor) or isinstance(v, (nn.Parameter, FakeTensor)) or v.is_meta:
        return None
    return v


def is_constant(node: fx.Node) -> bool:
    return isinstance(node, fx.Node) and why_not_constant(node) is None


def _ancestors(node: fx.Node) -> list:
    """``node`` and the nodes it is computed from, inputs first."""
    seen, order = set(), []

    def visit(n):
        if n in seen:
            return
        seen.add(n)
        for a in n.all_input_nodes:
            visit(a)
        order.append(n)
    visit(node)
    return order


def evaluate(node: fx.Node) -> torch.Tensor:
    """The value of constant ``node``, its subgraph run on the CPU."""
    nodes = _ancestors(node)
    for n in nodes:
        t = meta(n)
        if isinstance(t, torch.Tensor) and (not all(isinstance(d, int) for d in t.shape)
                                            or t.numel() > MAX_INDEX_ELEMENTS):
            raise Decline(f"index {node.name} is too large or symbolic to evaluate at planning time")
    env: dict = {}
    for n in nodes:
        if n.op == "get_attr":
            env[n] = _literal(n).detach().to("cpu")
            continue
        args = fx.node.map_arg(n.args, env.__getitem__)
        kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
        if "device" in kwargs:
            kwargs = dict(kwargs, device=torch.device("cpu"))
        if "pin_memory" in kwargs:
            kwargs = dict(kwargs, pin_memory=False)
        env[n] = n.target(*args, **kwargs)
    return env[node]


def _scalars(node: fx.Node) -> set:
    """The float and int scalars among the arguments of ``node``'s constant subgraph."""
    out = set()
    for n in _ancestors(node):
        for a in list(n.args) + list(n.kwargs.values()):
            for v in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
                    out.add(v)
    return out


# ---------------------------------------------------------------------------- index maps of one coordinate
@dataclass(frozen=True)
class Map1:
    """``min(max((i * a + b) // d, lo), hi)`` of an output coordinate ``i`` (``lo`` / ``hi`` None:
    no clamp on that side)."""
    a: int
    b: int
    d: int
    hi: Optional[int] = None
    lo: Optional[int] = None

    def ix(self, i) -> Ix:
        # a negative numerator (bilinear's first source position, ``(i + 0.5) * s - 0.5`` below 0)
        # is shifted by whole multiples of ``d``, so that the floor division stays non-negative
        s = -(self.b // self.d) if self.b < 0 else 0
        return (Ix.of(i) * self.a + (self.b + s * self.d)).floordiv(self.d) - s

    def raw(self, m: int) -> list:
        return [(i * self.a + self.b) // self.d for i in range(m)]

    def values(self, m: int) -> list:
        out = self.raw(m)
        if self.lo is not None:
            out = [max(v, self.lo) for v in out]
        return out if self.hi is None else [min(v, self.hi) for v in out]


def _ratios(n: int, m: int, scalars=()) -> list:
    """Candidate scales (input positions per output position) as fractions: the ratios of the sizes
    (``n / m``; ``(n - 1) / (m - 1)``, align_corners), 1, and each scalar of the index arithmetic and
    its reciprocal as a fraction of small integers."""
    sizes = [Fraction(n, max(m, 1)), Fraction(1)] + ([Fraction(n - 1, m - 1)] if m > 1 and n > 1 else [])
    out = []
    for s in sorted(scalars):
        f = Fraction(s).limit_denominator(MAX_SCALE_TERM)
        if f > 0:
            out += [f, 1 / f]
    out = [f for f in out if f.numerator <= MAX_SCALE_TERM ** 2 and f.denominator <= MAX_SCALE_TERM]
    return list(dict.fromkeys(sizes + out))


def _bases(r: Fraction) -> list:
    """``(a, b, d)`` of the source positions ``(i * a + b) / d`` at scale ``r = p / q``: nearest
    ``i * r``, nearest-exact ``(i + 0.5) * r`` and linear's half-pixel ``(i + 0.5) * r - 0.5``."""
    p, q = r.numerator, r.denominator
    return [(p, 0, q), (2 * p, p, 2 * q), (2 * p, p - q, 2 * q)]


def fit(seq: list, n: int, ratios: list) -> Optional[Map1]:
    """An exact ``Map1`` giving ``seq`` (source indices into an extent ``n``, one per output
    coordinate) at every coordinate, or None: a constant, or the floor of a source position at one
    of ``ratios`` (``_bases``), or that plus one (linear interpolation's second neighbour), clamped
    below to 0 (plus one: 1) and above to ``n - 1`` where that is needed."""
    m = len(seq)
    if m == 0:
        return None
    if all(v == seq[0] for v in seq):
        return Map1(0, seq[0], 1)
    for r in ratios:
        for a0, b0, d0 in _bases(r):
            for k in (0, 1):
                a, b, d = a0, b0 + k * d0, d0
                g = math.gcd(math.gcd(a, abs(b)), d)
                f = Map1(a // g, b // g, d // g)
                raw = f.raw(m)
                lows = [None] + ([k] if min(raw) < k else [])
                for lo in lows:
                    cand = Map1(f.a, f.b, f.d, n - 1 if max(raw) >= n else None, lo)
                    if cand.values(m) == seq:
                        return cand
    return None


@dataclass
class IndexMap:
    """The element of the gather's output at ``idx`` is its input's at ``dims``: per input dim
    ("out", axis) for an output coordinate, ("map", axis, Map1) for a map of one, ("const", c)."""
    shape: tuple
    dims: list

    def load(self, base: Value, idx: list):
        src, clamps = [], []
        for k, d in enumerate(self.dims):
            if d[0] == "out":
                src.append(Ix.of(idx[d[1]]))
            elif d[0] == "const":
                src.append(Ix.of(d[1]))
            else:
                f = d[2]
                e = f.ix(idx[d[1]])
                src.append(e)
                elo, ehi = e.bounds()
                lo = f.lo if f.lo is not None and elo < f.lo else None
                hi = f.hi if f.hi is not None and ehi > f.hi else None
                if lo is not None or hi is not None:
                    clamps.append((k, lo, hi))
        return _choose(base, src, clamps)


def _choose(base: Value, src: list, clamps: list):
    """``base`` at ``src`` with each clamped coordinate replaced by its bound where it passes it."""
    if not clamps:
        return base.load(src)
    (k, lo, hi), rest = clamps[0], clamps[1:]
    e = src[k]
    elo, ehi = e.bounds()
    out = _choose(base, src, rest)
    if hi is not None:
        out = Where(InRange(e, elo, hi + 1), out, _choose(base, src[:k] + [Ix.of(hi)] + src[k + 1:], rest))
    if lo is not None:
        out = Where(InRange(e, lo, ehi + 1), out, _choose(base, src[:k] + [Ix.of(lo)] + src[k + 1:], rest))
    return out


# ---------------------------------------------------------------------------- the plans
def _gather_plan(node: fx.Node) -> IndexMap:
    x, indices = node.args[0], list(node.args[1])
    xt, out = meta(x), meta(node)
    if xt is None or out is None:
        raise Decline("no metadata")
    xs, shape = static_shape(xt), static_shape(out)
    if len(indices) > len(xs):
        raise Decline("more indices than dims")
    pos = [k for k, t in enumerate(indices) if t is not None]
    if not pos:
        raise Decline("no index tensor")
    memo: dict = {}
    for k in pos:
        t = indices[k]
        if not isinstance(t, fx.Node):
            raise Decline("an index that is not a tensor")
        why = why_not_constant(t, memo)
        if why is not None:
            raise Decline(f"index {t.name} is not a compile-time constant ({why}): a real gather")
        tm = meta(t)
        if tm is None or tm.dtype not in (torch.int64, torch.int32):
            raise Decline(f"index {t.name} is {None if tm is None else tm.dtype}, not an integer index")
    bshape = tuple(torch.broadcast_shapes(*[tuple(meta(indices[k]).shape) for k in pos]))
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    rest = [k for k in range(len(xs)) if k not in pos]
    if adjacent:
        first = pos[0]
        expect = xs[:first] + bshape + xs[pos[-1] + 1:]
        axis = {k: (k if k < first else k - len(pos) + len(bshape)) for k in rest}
        bstart = first
    else:
        expect = bshape + tuple(xs[k] for k in rest)
        axis = {k: len(bshape) + i for i, k in enumerate(rest)}
        bstart = 0
    if tuple(expect) != shape:
        raise Decline("the gather's shape differs from its metadata")
    if math.prod(bshape) == 0:
        raise Decline("an empty index")
    dims: list = [None] * len(xs)
    for k in rest:
        dims[k] = ("out", axis[k])
    for k in pos:
        t, n = indices[k], xs[k]
        v = evaluate(t).to(torch.int64).expand(bshape)
        v = torch.where(v < 0, v + n, v)
        if bool(((v < 0) | (v >= n)).any()):
            raise Decline(f"index {t.name} is out of range")
        varying = [j for j, b in enumerate(bshape) if b > 1 and not bool((v == v.narrow(j, 0, 1)).all())]
        if len(varying) > 1:
            raise Decline(f"index {t.name} depends on several output coordinates")
        if not varying:
            dims[k] = ("const", int(v.reshape(-1)[0]))
            continue
        j = varying[0]
        seq = v.movedim(j, 0).reshape(bshape[j], -1)[:, 0].tolist()
        f = fit(seq, n, _ratios(n, bshape[j], _scalars(t)))
        if f is None:
            raise Decline(f"index {t.name} is not a nearest, linear or identity map of the output coordinate "
                          f"(values {seq[:8]}{'...' if len(seq) > 8 else ''})")
        dims[k] = ("map", bstart + j, f)
    return IndexMap(shape, dims)


def _kernel_indices(mode: str, n: int, m: int, scale) -> tuple[list, list]:
    """The source indices PyTorch's (CPU, CUDA) kernels use for output positions 0..m-1."""
    if scale is not None and scale > 0:
        s = torch.tensor(1.0 / scale, dtype=torch.float64).to(torch.float32)  # static_cast<float>(1.0 / scale)
    else:
        s = torch.tensor(float(n), dtype=torch.float32) / m  # static_cast<float>(in) / out
    i = torch.arange(m)
    if mode == "nearest":
        src = (i.to(torch.float32) * s).floor()
    else:  # (dst_index + 0.5) is a double, the product a double, rounded to float for floorf
        src = ((i.to(torch.float64) + 0.5) * s.to(torch.float64)).to(torch.float32).floor()
    cuda = src.to(torch.int64).clamp(max=n - 1).tolist()
    cpu = cuda
    if mode == "nearest" and m == n:
        cpu = list(range(m))
    elif mode == "nearest" and m == 2 * n:
        cpu = [v >> 1 for v in range(m)]
    return cpu, cuda


def _upsample_plan(node: fx.Node) -> IndexMap:
    mode, vec = UPSAMPLE[node.target]
    xt, out = meta(node.args[0]), meta(node)
    if xt is None or out is None:
        raise Decline("no metadata")
    xs, shape = static_shape(xt), static_shape(out)
    if len(xs) != 4 or shape[:2] != xs[:2]:
        raise Decline("not a 4-d upsampling")
    if vec:
        factors = node.args[2] if len(node.args) > 2 else node.kwargs.get("scale_factors")
        scales = list(factors) if factors else [None, None]
    else:
        a = list(node.args[2:4]) + [None] * (2 - len(node.args[2:4]))
        scales = [a[0] if a[0] is not None else node.kwargs.get("scales_h"),
                  a[1] if a[1] is not None else node.kwargs.get("scales_w")]
    dims: list = [("out", 0), ("out", 1)]
    for d, scale in zip((2, 3), scales):
        n, m = xs[d], shape[d]
        if m == 0:
            raise Decline("an empty output")
        cpu, cuda = _kernel_indices(mode, n, m, scale)
        if cpu != cuda:
            raise Decline(f"the CPU and CUDA kernels round the source index of dim {d} differently")
        f = fit(cuda, n, _ratios(n, m, [scale] if scale else []))
        if f is None:
            raise Decline(f"the source index of dim {d} is not an exact map of the output coordinate")
        dims.append(("map", d, f))
    return IndexMap(shape, dims)


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def index_map(node: fx.Node) -> IndexMap:
    """The index map of a gather at constant indices or an undecomposed nearest upsampling; raises
    ``Decline`` with the reason where there is none. Computed once per node (and arguments)."""
    xt = meta(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    ids = lambda a: ("node", id(a))  # noqa: E731 - no reference from the cache to the graph
    key = (node.target, fx.node.map_arg(node.args, ids), fx.node.map_arg(tuple(node.kwargs.items()), ids),
           None if xt is None else tuple(xt.shape))
    hit = _CACHE.get(node)
    if hit is not None and hit[0] == key:
        plan = hit[1]
    else:
        try:
            with unset_fake_temporarily():  # real CPU tensors, also while a compile traces
                plan = _gather_plan(node) if node.target in GATHERS else _upsample_plan(node)
        except Decline as e:
            plan = str(e)  # the reason, not the exception: its traceback would hold the graph
        except Exception as e:  # noqa: BLE001 - an index subgraph that does not run on the CPU
            plan = f"index arithmetic does not evaluate: {type(e).__name__}: {e}".splitlines()[0]
        _CACHE[node] = (key, plan)
    if isinstance(plan, str):
        raise Decline(plan)
    return plan


def decline_reason(node: fx.Node) -> Optional[str]:
    """Why ``node`` (one of ``TARGETS``) is no index map, or None where it is one."""
    try:
        index_map(node)
    except Decline as e:
        return str(e)
    return None


def accepts(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in TARGETS and decline_reason(node) is None


def index_value(node: fx.Node, value_of) -> Value:
    """The rule: the gather as loads of its input at the index map's positions."""
    plan = index_map(node)
    base = value_of(node.args[0])
    if tuple(base.shape) != tuple(static_shape(meta(node.args[0]))):
        raise Decline("the input's value differs from its metadata")
    return Value(plan.shape, meta(node).dtype, lambda idx: plan.load(base, idx))


def constant_nodes(graph: fx.Graph, accepted: set) -> set:
    """The constant nodes that only index maps in ``accepted`` read (through other such nodes):
    computed at planning time, no kernel of their own."""
    out: set = set()
    memo: dict = {}
    for n in reversed(list(graph.nodes)):
        if (n.op == "call_function" and n.users and all(u in accepted or u in out for u in n.users)
                and why_not_constant(n, memo) is None):
            out.add(n)
    return out
