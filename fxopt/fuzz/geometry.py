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

The generated C is parsed line by line (its forms are few and fixed: ``const idx_t x = ...;``
declarations, ``?:`` on the whole right-hand side, ``fx_vec`` loads and stores); a line the
emulator does not know raises ``GeometryParseError`` so that a change of the generator is seen
rather than silently skipped.
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
_SCALAR_LOAD = re.compile(r"in(\d+)\[(\([^\[\]]*\))\]")
_VEC_ELEM = re.compile(r"(vl\w+)\.v\[(\d+)\]")
_T = re.compile(r"\bt\d+\b")


def is_row_kernel(ks) -> bool:
    return ks.kind == "fused_reduction" and "tpr" in (ks.meta.get("geometry") or {})


def _py(expr: str) -> str:
    """A C integer / boolean expression of the generated index code as Python."""
    e = expr.strip()
    e = re.sub(r"\((?:idx_t|int|long long)\)", "", e)
    m = re.fullmatch(r"(\w+) \? (.+) : (.+)", e)
    if m:
        return f"(({_py(m.group(2))}) if ({m.group(1)}) else ({_py(m.group(3))}))"
    return e.replace("&&", " and ").replace("||", " or ").replace("/", "//")


@lru_cache(maxsize=4096)
def _code(expr: str):
    return compile(_py(expr), "<generated index>", "eval")


def _ev(expr: str, env: dict):
    return eval(_code(expr), {}, env)  # noqa: S307 - the kernel's own index arithmetic, translated


def _parse(source: str, name: str):
    """(tpr, rpb, rows, ops of the loop body) of the kernel ``name`` in ``source``."""
    body = source[source.index(f"{name}("):]
    lines = [ln.strip() for ln in body.splitlines()[1:]]
    lines = [ln.split("//")[0].strip() if ln.startswith("fx_pdl_begin") else ln for ln in lines]
    head = "\n".join(lines[:8])
    tpr = int(re.search(r"const int lane_ = threadIdx\.x % (\d+);", head).group(1))
    loop = re.search(r"for \(idx_t base_ = \(idx_t\)blockIdx\.x \* (\d+); base_ < (\d+);", head)
    rpb, rows = int(loop.group(1)), int(loop.group(2))
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
    shuffle starts, its stores (under their guards)."""
    deps: dict = {}  # value name -> the row elements it depends on
    vloads: dict = {}
    accs: dict = {}
    shfl: dict = {}
    stores: list = []
    tainted = {"lane_"}
    guard: list = []

    def elements(text: str) -> set:
        """The row elements (buffer, offset) a value depends on, each once."""
        out = set()
        for m in _VEC_ELEM.finditer(text):
            buf, off, vec, row_load = vloads[m.group(1)]
            if row_load:
                out.add((buf, off + int(m.group(2))))
        for m in _SCALAR_LOAD.finditer(text):
            off = _ev(m.group(2), env)
            _bounds(f"in{m.group(1)}", int(m.group(1)), off, 1, spans["in"], errors)
            if set(re.findall(r"\w+", m.group(2))) & tainted:
                out.add((int(m.group(1)), off))
        for t in set(_T.findall(text)):
            out |= deps.get(t, set())
        return out

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
            off = _ev(m.group(4), env)
            _bounds(f"in{buf}", buf, off, vec, spans["in"], errors)
            vloads[name] = (buf, off, vec, bool(set(re.findall(r"\w+", m.group(4))) & tainted))
        elif kind == "val":
            deps[m.group(1)] = elements(m.group(2))
        elif kind == "init":
            accs[m.group(1)] = Counter()
        elif kind == "acc":
            ok = m.group(2) is None or env[m.group(2)]
            comb = m.group(3) if m.group(2) is not None else m.group(4)
            if ok:
                accs[m.group(1)] = accs[m.group(1)] + Counter([frozenset(elements(comb.replace(m.group(1), "")))])
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
                off = _ev(m.group(3) if kind == "vstore" else m.group(2), env)
                stores.append((buf, off, vec))
    return {"accs": accs, "shfl": shfl, "stores": stores, "row": env["row_"], "rowok": env["rowok_"]}


def _bounds(what: str, buf: int, off: int, vec: int, spans: list, errors: list) -> None:
    if off < 0 or off + vec > spans[buf]:
        errors.append(f"{what}: access [{off}, {off + vec}) outside its span {spans[buf]}")


def _expected(k) -> dict:
    """{(row, phase name): the multiset of the row's positions, each as the set of the elements
    (buffer, offset) its row loads read} for the ``ReductionKernel`` ``k``."""
    from fxopt.backends.cuda import ir
    from fxopt.backends.cuda.ir import Load, eval_ix

    rows, R, red = k.rows, k.row_size, set(k.reduced)
    vars_ = list(k.outer) + list(k.reduced)  # the row index (innermost outer variable fastest), then the position
    grids = torch.meshgrid(*[torch.arange(v.size) for v in vars_], indexing="ij")
    env = {v: g.reshape(rows, R) for v, g in zip(vars_, grids)}
    out: dict = {}
    for ph in k.phases:
        loads = sorted({e for e in ir.walk(ph.value) if isinstance(e, Load) and ir.all_vars(e.offset) & red},
                       key=repr)
        offs = [(ld.buf, eval_ix(ld.offset, env).expand(rows, R).tolist()) for ld in loads]
        for row in range(rows):
            out[(row, ph.name)] = Counter(frozenset((buf, o[row][p]) for buf, o in offs) for p in range(R))
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
    tpr, rpb, rows, ops = _parse(ks.source, ks.name)
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
            threads = [_run_thread(ops, {"lane_": t % tpr, "sub_": t // tpr, "base_": base}, spans, errors)
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
