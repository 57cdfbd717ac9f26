"""The thread mapping of a generated register-row reduction kernel, run on the CPU.

``check_row_geometry(ks)`` reads the CUDA source of a kernel generated for the ``inner`` strategy
with rows kept in registers (``kernels/reduction.py``: names ``fx_red_*_rows<block>v<vec>*``)
and executes its index arithmetic for every thread of its launch grid (``ks.meta["grid"]``,
``ks.block``): the lane / row mapping, the clamped chunk indices, the vector loads, the guarded
accumulations, the warp-shuffle butterfly and the guarded stores. Values are not computed; each
accumulator carries the multiset of the values it has combined, each value as the set of the input
elements (buffer, offset) of the row it depends on. It asserts, per reduction phase and per row:

- every element of the row is combined exactly once (no element missed, none counted twice:
  the masked lanes of a partial last chunk, the clamped rows of the last block). What "once"
  means per buffer comes from the kernel's IR (``ks.meta["kernel"]``): the phase's value reads,
  at each of the row's ``row_size`` positions, its loads whose offsets depend on the reduced
  variables, each element once per position. A buffer indexed by the whole row (the row's
  values) is read once per element; one indexed by part of it is read by every position that
  shares its index: a per-channel parameter in a LayerNorm over (C, H, W) once per H x W
  position, so each of its C elements is combined H x W times. The accumulator's multiset of each
  buffer must equal that of the IR, for each row (which also makes the rows' elements of the
  row's values disjoint across rows), and each value combined must read the elements of one
  position (the row's value beside its own channel's parameter);
- every load is in bounds of its buffer's span;
- every output element is stored exactly once over the whole grid, all in bounds.

A load under a ``Where`` of the IR (a padded pooling window, a constant pad, a concatenation's
other inputs) is emitted as ``c ? in0[i] : fill``, whose ``i`` may lie outside the input where
``c`` is false: the emulator reads (checks against the span, counts as combined) the loads of the
branch each thread takes only, as C does, and the IR's side counts a ``Where``'s loads only at
the positions whose indices take that branch. A condition on loaded values (not on indices alone)
takes either branch: the loads of both are read.

The generated C is parsed line by line (its forms are few and fixed: ``const idx_t x = ...;``
declarations, ``fx_vec`` loads and stores, accumulations), each line's expression by a small
precedence parser; a line the emulator does not know raises ``GeometryParseError`` so that a
change of the generator is seen rather than silently skipped.
"""
from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache

import torch

__all__ = ["check_row_geometry", "is_row_kernel", "GeometryParseError"]


class GeometryParseError(ValueError):
    pass


_DECL = re.compile(r"^const (?:idx_t|int|bool) (\w+) = (.+);$")
_VLOAD = re.compile(r"^const fx_vec<\w+, (\d+)> (vl\w+) = \*reinterpret_cast<const fx_vec<\w+, \d+>\*>\(in(\d+) \+ (.+)\);$")
_VAL = re.compile(r"^const float (t\d+) = (.+);$")
_ACC_INIT = re.compile(r"^float (acc_\w+) = .+;$")
_ACC = re.compile(r"^(acc_\w+) = (?:(\w+) \? (.+) : \1|(.+));$")
_SHFL = re.compile(r"^for \(int o_ = (\d+); o_ > 0; o_ >>= 1\) (acc_\w+) = .+;$")
_RED = re.compile(r"^const float (red_\w+) = (acc_\w+);$")
_IF = re.compile(r"^if \((.+)\) \{$")
_VSTORE = re.compile(r"^\*reinterpret_cast<fx_vec<\w+, (\d+)>\*>\(out(\d+) \+ (.+)\) = vs_;$")
_SSTORE = re.compile(r"^out(\d+)\[(.+)\] = .+;$")


def is_row_kernel(ks) -> bool:
    return ks.kind == "fused_reduction" and "tpr" in (ks.meta.get("geometry") or {})


class _Val:
    """A value the index arithmetic does not determine (a float computed from loaded values, a
    comparison of such floats): the row elements (buffer, offset) it depends on."""
    __slots__ = ("elems",)

    def __init__(self, elems: frozenset = frozenset()):
        self.elems = elems

    def _join(self, other):
        return _join(self, other)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _join
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _join  # type: ignore[assignment]
    __hash__ = None  # type: ignore[assignment]

    def __neg__(self):
        return self

    def __bool__(self):
        raise GeometryParseError("a branch of the index arithmetic on a loaded value")


_NONE = _Val()


def _join(*vals) -> _Val:
    return _Val(frozenset().union(*(v.elems for v in vals if isinstance(v, _Val))))


def _sel(c, a, b):
    """C's ``c ? a : b``: only the branch taken is evaluated (and only its loads read); both where
    ``c`` depends on loaded values."""
    if isinstance(c, _Val):
        return _join(c, a(), b())
    return a() if c else b()


def _and(a, b):
    if not isinstance(a, _Val) and not a:
        return False
    v = b()
    if not isinstance(v, _Val) and not v:
        return False
    return True if not isinstance(a, _Val) and not isinstance(v, _Val) else _join(a, v)


def _or(a, b):
    if not isinstance(a, _Val) and a:
        return True
    v = b()
    if not isinstance(v, _Val) and v:
        return True
    return False if not isinstance(a, _Val) and not isinstance(v, _Val) else _join(a, v)


def _not(a):
    return a if isinstance(a, _Val) else not a


def _div(a, b):
    """C's ``/``: integers truncated toward zero."""
    if isinstance(a, _Val) or isinstance(b, _Val) or isinstance(a, float) or isinstance(b, float):
        return _join(a, b)
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _mod(a, b):
    if isinstance(a, _Val) or isinstance(b, _Val):
        return _join(a, b)
    return a - b * _div(a, b)


_HELPERS = {"_sel": _sel, "_and": _and, "_or": _or, "_not": _not, "_div": _div, "_mod": _mod, "_fn": _join,
            "_NONE": _NONE, "__builtins__": {}}
_TOKEN = re.compile(r"\s*(0x[0-9a-fA-F]+u?|\d+\.\d*(?:e[-+]?\d+)?f?|\d+(?:e[-+]?\d+)?[fu]?|\w+|&&|\|\||[<>=!]=|"
                    r"[-+*/%<>!?:()\[\],.])")
_PREC = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<": 4, "<=": 4, ">": 4, ">=": 4, "+": 5, "-": 5, "*": 6, "/": 6, "%": 6}


def _py(text: str) -> str:
    """A C expression of the generated code as Python over ``_HELPERS``: ``?:`` evaluates the branch
    taken only, ``&&`` / ``||`` short-circuit, ``inN[i]`` is ``_ld(N, i, names of i)``, ``v.v[k]``
    is ``_vel(v, k)``, any function call combines its arguments' dependencies."""
    text = re.sub(r"\((?:idx_t|int|long long|unsigned int|float|bool)\)", "", text)
    text = re.sub(r"\b(\w+)<[\w ]+>\(", r"\1(", text)
    toks = _TOKEN.findall(text)
    if "".join(toks) != re.sub(r"\s+", "", text):
        raise GeometryParseError(f"cannot tokenize {text!r}")
    pos = [0]

    def peek():
        return toks[pos[0]] if pos[0] < len(toks) else None

    def take(want=None):
        t = peek()
        if t is None or (want is not None and t != want):
            raise GeometryParseError(f"expected {want or 'more'!r} at {t!r} in {text!r}")
        pos[0] += 1
        return t

    def primary() -> str:
        t = take()
        if t == "(":
            e = ternary()
            take(")")
            return f"({e})"
        if t == "-":
            return f"(-{primary()})"
        if t == "!":
            return f"_not({primary()})"
        if t in ("true", "false"):
            return str(t == "true")
        if re.fullmatch(r"0x[0-9a-fA-F]+u?", t):
            return str(int(t.rstrip("u"), 16))
        if re.fullmatch(r"[\d.]+(?:e[-+]?\d+)?[fu]?", t):
            if t.endswith("f") or "." in t or "e" in t:
                return repr(float(t.rstrip("f")))
            return t.rstrip("u")
        if not re.fullmatch(r"[A-Za-z_]\w*", t) or t.startswith("_") and peek() != "(":
            raise GeometryParseError(f"unexpected {t!r} in {text!r}")
        if peek() == "(":
            take("(")
            args = [] if peek() == ")" else [ternary()]
            while peek() == ",":
                take(",")
                args.append(ternary())
            take(")")
            return f"_fn({', '.join(args)})"
        if peek() == "[":
            m = re.fullmatch(r"in(\d+)", t)
            if m is None:
                raise GeometryParseError(f"a read of {t} in {text!r}")
            start = pos[0] + 1
            take("[")
            i = ternary()
            names = tuple(sorted({w for w in toks[start:pos[0]] if re.fullmatch(r"[A-Za-z_]\w*", w)}))
            take("]")
            return f"_ld({m.group(1)}, {i}, {names!r})"
        if peek() == ".":
            take(".")
            take("v")
            take("[")
            lane = take()
            take("]")
            return f"_vel({t}, {int(lane)})"
        return "_NONE" if t.startswith(("acc_", "red_")) else t  # the reductions' values: of no one element

    def binary(level: int) -> str:
        left = primary()
        while peek() in _PREC and _PREC[peek()] >= level:
            o = take()
            right = binary(_PREC[o] + 1)
            if o in ("&&", "||"):
                left = f"{'_and' if o == '&&' else '_or'}({left}, lambda: {right})"
            elif o in ("/", "%"):
                left = f"{'_div' if o == '/' else '_mod'}({left}, {right})"
            else:
                left = f"({left} {o} {right})"
        return left

    def ternary() -> str:
        c = binary(1)
        if peek() != "?":
            return c
        take("?")
        a = ternary()
        take(":")
        return f"_sel({c}, lambda: {a}, lambda: {ternary()})"
    out = ternary()
    if peek() is not None:
        raise GeometryParseError(f"trailing {peek()!r} in {text!r}")
    return out


@lru_cache(maxsize=4096)
def _code(expr: str):
    return compile(_py(expr), "<generated code>", "eval")


def _ev(expr: str, env: dict):
    """``expr`` evaluated over a thread's names ``env`` (which holds ``_HELPERS`` besides)."""
    try:
        return eval(_code(expr), env)  # noqa: S307 - the kernel's own code, translated
    except NameError as e:
        raise GeometryParseError(f"{e} in {expr!r}") from None


def _int(expr: str, env: dict) -> int:
    v = _ev(expr, env)
    if isinstance(v, (_Val, float)):
        raise GeometryParseError(f"an index computed from loaded values: {expr!r}")
    return int(v)


def _parse(source: str, name: str):
    """(tpr, rpb, rows, ops of the loop body) of the kernel ``name`` in ``source``."""
    body = source[source.index(f"{name}("):]
    lines = [ln.strip() for ln in body.splitlines()[1:]]
    lines = [ln.split("//")[0].strip() if ln.startswith("fx_pdl_begin") else ln for ln in lines]
    head = "\n".join(lines[:8])
    tpr = int(re.search(r"const int lane_ = threadIdx\.x % (\d+);", head).group(1))
    loop = re.search(r"for \(idx_t base_ = \(idx_t\)blockIdx\.x \* (\d+); base_ < (\w+);", head)
    rpb, rows = int(loop.group(1)), loop.group(2)  # rows: a number, or an extent's name (an argument)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("for (idx_t base_"))
    ops, depth = [], 0
    for ln in lines[start + 1:]:
        if not ln or ln.startswith("fx_vec<") or ln.startswith("vs_.v["):
            continue
        if ln == "}":
            if depth == 0:
                break
            depth -= 1
            ops.append(("endif",))
            continue
        for pat, kind in ((_VLOAD, "vload"), (_SHFL, "shfl"), (_RED, "red"), (_DECL, "decl"), (_VAL, "val"),
                          (_ACC_INIT, "init"), (_ACC, "acc"), (_IF, "if"), (_VSTORE, "vstore"),
                          (_SSTORE, "sstore")):
            m = pat.match(ln)
            if m:
                break
        else:
            raise GeometryParseError(f"{name}: unknown line {ln!r}")
        if kind == "if":
            depth += 1
        ops.append((kind, m))
    return tpr, rpb, rows, ops


def _run_thread(ops, env: dict, spans: dict, errors: list) -> dict:
    """One thread's pass over the loop body: its accumulators before the shuffles (each the
    multiset of the values it combined, a value the set of row elements it depends on), the
    shuffle starts, its stores (under their guards). Each line's C runs as C does: a ``?:`` reads
    the loads of the branch it takes only (both where its condition depends on loaded values), and
    each load it reads is checked against its buffer's span."""
    vloads: dict = {}
    accs: dict = {}
    shfl: dict = {}
    stores: list = []
    tainted = {"lane_"}
    guard: list = []

    def ld(buf: int, off, names: tuple):
        if isinstance(off, (_Val, float)):
            errors.append(f"in{buf}: an offset computed from loaded values")
            return _NONE
        _bounds(f"in{buf}", buf, off, 1, spans["in"], errors)
        return _Val(frozenset({(buf, off)})) if tainted.intersection(names) else _NONE

    def vel(name: str, lane: int):
        buf, off, row_load = vloads[name]
        return _Val(frozenset({(buf, off + lane)})) if row_load else _NONE

    env.update(_HELPERS, _ld=ld, _vel=vel)

    for op in ops:
        kind = op[0]
        if kind == "endif":
            guard.pop()
            continue
        m = op[1]
        if kind == "decl":
            env[m.group(1)] = _ev(m.group(2), env)
            if set(re.findall(r"\w+", m.group(2))) & tainted:
                tainted.add(m.group(1))
        elif kind == "vload":
            vec, name, buf = int(m.group(1)), m.group(2), int(m.group(3))
            off = _int(m.group(4), env)
            _bounds(f"in{buf}", buf, off, vec, spans["in"], errors)
            vloads[name] = (buf, off, bool(set(re.findall(r"\w+", m.group(4))) & tainted))
            env[name] = name
        elif kind == "val":
            env[m.group(1)] = _ev(m.group(2), env)
        elif kind == "init":
            accs[m.group(1)] = Counter()
        elif kind == "acc":
            ok = m.group(2) is None or env[m.group(2)]
            comb = m.group(3) if m.group(2) is not None else m.group(4)
            if ok:
                v = _ev(comb, env)
                accs[m.group(1)] = accs[m.group(1)] + Counter([v.elems if isinstance(v, _Val) else frozenset()])
        elif kind == "shfl":
            shfl[m.group(2)] = int(m.group(1))
        elif kind == "red":
            pass
        elif kind == "if":
            guard.append(bool(_ev(m.group(1), env)))
        elif kind in ("vstore", "sstore"):
            if all(guard):
                vec = int(m.group(1)) if kind == "vstore" else 1
                buf = int(m.group(2) if kind == "vstore" else m.group(1))
                off = _int(m.group(3) if kind == "vstore" else m.group(2), env)
                stores.append((buf, off, vec))
    return {"accs": accs, "shfl": shfl, "stores": stores, "row": env["row_"], "rowok": env["rowok_"]}


def _bounds(what: str, buf: int, off: int, vec: int, spans: list, errors: list) -> None:
    if off < 0 or off + vec > spans[buf]:
        errors.append(f"{what}: access [{off}, {off + vec}) outside its span {spans[buf]}")


def _decided(cond, env: dict, shape: tuple, memo: dict) -> tuple:
    """(known, value) of the bool IR expression ``cond`` at each row position: known where the
    indices alone decide it (``InRange`` and constants, joined by and / or / not, as C's
    short-circuit ``&&`` / ``||`` decide them), unknown where it depends on loaded values."""
    from fxopt.backends.cuda.ir import BoolConst, InRange, Op, eval_ix

    hit = memo.get(cond)
    if hit is not None:
        return hit
    none = torch.zeros(shape, dtype=torch.bool)
    if isinstance(cond, InRange):
        ix = eval_ix(cond.index, env).expand(shape)
        out = (~none, (ix >= cond.lo) & (ix < cond.hi))
    elif isinstance(cond, BoolConst):
        out = (~none, none | cond.value)
    elif isinstance(cond, Op) and cond.op in ("and", "or") and len(cond.args) == 2:
        (ka, va), (kb, vb) = (_decided(a, env, shape, memo) for a in cond.args)
        if cond.op == "and":
            out = ((ka & kb) | (ka & ~va) | (kb & ~vb), va & vb)
        else:
            out = ((ka & kb) | (ka & va) | (kb & vb), va | vb)
    elif isinstance(cond, Op) and cond.op == "not":
        ka, va = _decided(cond.args[0], env, shape, memo)
        out = (ka, ~va)
    else:
        out = (none, none)
    memo[cond] = out
    return out


def _reached(root, env: dict, shape: tuple) -> dict:
    """{Load: where (a bool per row position) the generated code reads it} for the expression
    ``root``: a ``Where``'s branch is read where its condition takes it, both where the condition
    depends on loaded values (the emitted ``c ? a : b``)."""
    from fxopt.backends.cuda import ir
    from fxopt.backends.cuda.ir import Load, Where

    reach = {root: torch.ones(shape, dtype=torch.bool)}
    memo: dict = {}
    for e in reversed(list(ir.walk(root))):  # every node before its operands
        m = reach[e]
        if isinstance(e, Where):
            known, val = _decided(e.cond, env, shape, memo)
            parts = [(e.cond, m), (e.a, m & (~known | val)), (e.b, m & (~known | ~val))]
        else:
            parts = [(c, m) for c in ir.children(e)]
        for c, cm in parts:
            reach[c] = reach[c] | cm if c in reach else cm
    return {e: m for e, m in reach.items() if isinstance(e, Load)}


def _expected(k) -> dict:
    """{(row, phase name): the multiset of the row's positions, each as the set of the elements
    (buffer, offset) its row loads read there} for the ``ReductionKernel`` ``k``: a load under a
    ``Where`` branch only where the branch is taken (a padded window's position outside the input
    reads nothing)."""
    from fxopt.backends.cuda import ir
    from fxopt.backends.cuda.ir import eval_ix

    rows, R, red = k.rows, k.row_size, set(k.reduced)
    vars_ = list(k.outer) + list(k.reduced)  # the row index (innermost outer variable fastest), then the position
    grids = torch.meshgrid(*[torch.arange(v.size) for v in vars_], indexing="ij")
    env = {v: g.reshape(rows, R) for v, g in zip(vars_, grids)}
    out: dict = {}
    for ph in k.phases:
        reached = _reached(ph.value, env, (rows, R))
        loads = sorted((ld for ld in reached if ir.all_vars(ld.offset) & red), key=repr)
        offs = [(ld.buf, eval_ix(ld.offset, env).expand(rows, R).tolist(), reached[ld].tolist()) for ld in loads]
        for row in range(rows):
            out[(row, ph.name)] = Counter(frozenset((buf, o[row][p]) for buf, o, at in offs if at[row][p])
                                          for p in range(R))
    return out


def _per_element(values: Counter) -> Counter:
    """A multiset of values (sets of elements) as the multiset of their elements."""
    out: Counter = Counter()
    for elems, n in values.items():
        for e in elems:
            out[e] += n
    return out


def check_row_geometry(ks, max_errors: int = 5) -> dict:
    """Emulate ``ks`` (a register-row reduction ``KernelSource``) over its whole launch; raises
    AssertionError naming the first violations. Returns a summary (rows, threads, phases)."""
    k = ks.meta["kernel"]
    from fxopt.backends.cuda.codegen.ir_kernel import extent

    tpr, rpb, rows, ops = _parse(ks.source, ks.name)
    extents = {extent(i): int(v) for i, v in enumerate(ks.meta.get("extents", ()))}  # the arguments' values
    rows = extents[rows] if rows in extents else int(rows)
    block, grid = ks.block[0], ks.meta["grid"][0]
    R = k.row_size
    errors: list = []
    if block != tpr * rpb:
        errors.append(f"block {block} != threads per row {tpr} x rows per block {rpb}")
    if 32 % tpr:
        errors.append(f"{tpr} threads per row straddle a warp")
    if rows != k.rows:
        errors.append(f"the loop runs over {rows} rows, the kernel has {k.rows}")
    spans = {"in": [b.span() for b in k.inputs], "out": [b.span() for b in k.outputs]}
    per_row: dict = {}
    stored: Counter = Counter()
    for b in range(grid):
        base = b * rpb
        while base < rows:
            threads = [_run_thread(ops, {"lane_": t % tpr, "sub_": t // tpr, "base_": base, **extents}, spans, errors)
                       for t in range(block)]
            for w0 in range(0, block, 32):
                warp = threads[w0:w0 + 32]
                for acc in warp[0]["accs"]:
                    vals = [th["accs"][acc] for th in warp]
                    o = warp[0]["shfl"].get(acc, 0)
                    if o and 2 * o != tpr:
                        errors.append(f"{acc}: the shuffle butterfly starts at {o} for {tpr} threads per row")
                    while o:
                        vals = [vals[i] + vals[(i ^ o) % len(vals)] for i in range(len(vals))]
                        o //= 2
                    for th, v in zip(warp, vals):
                        if th["rowok"]:
                            per_row.setdefault((th["row"], acc), []).append(v)
            for th in threads:
                for buf, off, vec in th["stores"]:
                    _bounds(f"out{buf}", buf, off, vec, spans["out"], errors)
                    stored.update((buf, off + i) for i in range(vec))
            base += grid * rpb
    phases = sorted({acc for _, acc in per_row})
    seen_rows = {r for r, _ in per_row}
    if phases and seen_rows != set(range(rows)):
        errors.append(f"rows never reduced: {sorted(set(range(rows)) - seen_rows)[:8]}")
    expected = _expected(k)
    for (row, acc), vals in sorted(per_row.items()):
        want = expected.get((row, acc[len("acc_"):]))
        if want is None:
            errors.append(f"row {row}, {acc}: no such phase in the kernel")
            continue
        flat_want = _per_element(want)
        for v in vals:  # every thread of the row holds the whole row after the butterfly
            if v == want:
                continue
            flat = _per_element(v)
            for buf in sorted({b for b, _ in flat} | {b for b, _ in flat_want}):  # each buffer read along the row
                mine = Counter({e: c for e, c in flat.items() if e[0] == buf})
                need = Counter({e: c for e, c in flat_want.items() if e[0] == buf})
                if mine == need:
                    continue
                dup = [e for e, c in mine.items() if c > need[e]]  # more often than the row's positions read it
                miss = [e for e, c in need.items() if mine[e] < c]
                errors.append(f"row {row}, {acc}: {sum(mine.values())} elements of in{buf} combined for a row "
                              f"of {R} that reads {sum(need.values())}" + (f", counted twice: {dup[:4]}" if dup else "")
                              + (f", missed: {miss[:4]}" if miss else ""))
            if not v and want:
                errors.append(f"row {row}, {acc}: no element combined")
            elif flat == flat_want:  # the right elements, paired wrongly (a parameter of another channel)
                odd = sorted(sorted(e) for e in (v - want))
                errors.append(f"row {row}, {acc}: values that combine elements of no single position of the row: "
                              f"{odd[:2]}")
    twice = [e for e, c in stored.items() if c > 1]
    if twice:
        errors.append(f"output elements stored more than once: {twice[:4]}")
    for i, b in enumerate(k.outputs):
        if b.span() == b.numel:
            written = {off for buf, off in stored if buf == i}
            if len(written) != b.numel:
                errors.append(f"out{i}: {len(written)} of {b.numel} elements stored")
    if errors:
        raise AssertionError(f"{ks.name} (grid {grid}, block {block}): " + "; ".join(errors[:max_errors]))
    return {"rows": rows, "row_size": R, "threads": grid * block, "phases": phases}
