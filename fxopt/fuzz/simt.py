"""The generated column reductions (and the tiled transposes of ``kernels/transpose.py``, which use
the same forms) run on the CPU, every thread of their launch grid at once.

``check_column_geometry(ks)`` executes the CUDA C of a column reduction (``kernels/column_reduction.py``,
names ``fx_red_*_cols*``) statement by statement over numpy arrays with one lane per thread of the
grid (``ks.meta["grid"]`` x ``ks.block``), branches and loops under per-thread masks, on inputs of
small distinct integers, and compares what it stores with the kernel's IR run by ``ir.evaluate``.
Values are float64 (the sums of such inputs are exact in both), so an element of a row missed or
combined twice changes a result by at least one unit. The IR runs in float64 too (its constants and
16-bit roundings as the C has them, ``fx_to_f32(fx_from<T>(v))`` rounding here as well): against its
float32 math, a row of equal values (variance 0) normalized by ``rsqrt(var + eps)`` differed by the
float32 rounding of its mean times ``eps ** -0.5`` (CPU fuzz seed 3, dc1ddf32b9: 2e-4 against a
tolerance of 1.5e-4), a difference of precision, not of the kernel's geometry. It asserts besides:

- every output element is stored exactly once, every load and store in bounds, every vector
  access at a multiple of its width;
- ``__syncthreads()`` is reached by all threads of a block or none, a warp shuffle by all threads
  of a warp or none; no thread reads shared memory another thread wrote since the last barrier,
  nor do two threads write one word between barriers;
- a split over blocks: each partial is written before its block's ``__threadfence()`` and ticket,
  the blocks of a tile draw tickets in a random order, the counters end at zero.

The C is parsed line by line (the generator's forms are few and fixed); expressions by a small
precedence parser. A line or function the emulator does not know raises ``GeometryParseError``.
"""
from __future__ import annotations

import math
import re

import numpy as np
import torch

from .geometry import GeometryParseError

__all__ = ["check_column_geometry", "is_column_kernel", "emulate"]

_TOKEN = re.compile(r"\s*(0x[0-9a-fA-F]+u?|\d+\.\d*(?:e[-+]?\d+)?f?|\d+(?:e[-+]?\d+)?[fu]?|\w+|&&|\|\||[<>=!]=|[-+*/%<>!?:()\[\],.&])")
_PREC = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<": 4, "<=": 4, ">": 4, ">=": 4, "+": 5, "-": 5, "*": 6, "/": 6, "%": 6}
_BIN = {"/": "_div({}, {})", "%": "_mod({}, {})", "&&": "({} & {})", "||": "({} | {})"}
_FUNCS = {"fx_to_f32": "_f", "fx_from": "_f", "_round_fx_half": "_round_fx_half", "_round_fx_bf16": "_round_fx_bf16",
          "fx_max_nan": "_max", "fx_min_nan": "_min", "__int_as_float": "_i2f",
          "__ldcg": "_ldcg", "__shfl_xor_sync": "_shfl", "fx_div": "_div", "fx_clamp": "np.clip", "expf": "np.exp", "fx_exp": "np.exp",
          "logf": "np.log", "sqrtf": "np.sqrt", "fabsf": "np.abs", "tanhf": "np.tanh", "log1pf": "np.log1p",
          "expm1f": "np.expm1", "powf": "np.power", "rintf": "np.rint", "floorf": "np.floor", "ceilf": "np.ceil",
          "sinf": "np.sin", "cosf": "np.cos", "rsqrtf": "_rsqrt", "erff": "_erf",
          "__fadd_rn": "np.add", "__fsub_rn": "np.subtract", "__fmul_rn": "np.multiply"}


def _expr(text: str, pointers: set) -> str:
    """A C expression of the generated code as Python over the emulator's helpers."""
    text = re.sub(r"\((?:idx_t|int|long long|unsigned int)\)", "", text)
    # a rounding inside the math (the IR's Cast: fx_to_f32(fx_from<T>(v))) rounds as the IR does;
    # a store's fx_from<T> does not (the IR's reference outputs are float64)
    text = re.sub(r"fx_to_f32\(fx_from<(fx_half|fx_bf16)>\(", lambda m: f"fx_to_f32(_round_{m.group(1)}(", text)
    text = re.sub(r"fx_from<\w+>\(", "fx_from(", text)
    toks = _TOKEN.findall(text)
    if "".join(toks) != re.sub(r"\s+", "", text):
        raise GeometryParseError(f"cannot tokenize {text!r}")
    pos = [0]

    def peek():
        return toks[pos[0]] if pos[0] < len(toks) else None

    def take(want=None):
        t = peek()
        if want is not None and t != want:
            raise GeometryParseError(f"expected {want!r} at {t!r} in {text!r}")
        pos[0] += 1
        return t

    def primary() -> str:
        t = take()
        if t == "(":
            e = ternary()
            take(")")
            return f"({e})"
        if t in ("-", "!"):
            return f"(-{primary()})" if t == "-" else f"(~{primary()})"
        if re.fullmatch(r"0x[0-9a-fA-F]+u?", t):
            return str(int(t.rstrip("u"), 16))
        if re.fullmatch(r"[\d.]+(?:e[-+]?\d+)?[fu]?", t):
            if t.endswith("f") or "." in t:
                return repr(float(np.float32(t.rstrip("f"))))
            return t.rstrip("u")
        if t in ("threadIdx", "blockIdx", "gridDim"):
            take(".")
            return f"{t}_{take()}"
        if peek() == "(":
            if t not in _FUNCS:
                raise GeometryParseError(f"unknown function {t} in {text!r}")
            take("(")
            args = [ternary()]
            while peek() == ",":
                take(",")
                args.append(ternary())
            take(")")
            return f"{_FUNCS[t]}({', '.join(args)})"
        if peek() == "[":
            take("[")
            i = ternary()
            take("]")
            return f"_rd({t!r}, {i})"
        if peek() == ".":
            take(".")
            take("v")
            take("[")
            i = take()
            take("]")
            return f"{t}[{i}]"
        return f"_P({t!r})" if t in pointers else t

    def binary(level: int) -> str:
        left = primary()
        while peek() in _PREC and _PREC[peek()] >= level:
            o = take()
            right = binary(_PREC[o] + 1)
            left = _BIN[o].format(left, right) if o in _BIN else f"({left} {o} {right})"
        return left

    def ternary() -> str:
        c = binary(1)
        if peek() != "?":
            return c
        take("?")
        a = ternary()
        take(":")
        return f"_sel({c}, lambda: {a}, lambda: {ternary()})"  # each branch read only where taken
    out = ternary()
    if peek() is not None:
        raise GeometryParseError(f"trailing {peek()!r} in {text!r}")
    return out


_FOR = re.compile(r"^for \((?:idx_t|int) (\w+) = (.+); \1 < (.+); \1 \+= (.+)\) \{$")
_IF = re.compile(r"^if \((.+)\) \{$")
_SHARED = re.compile(r"^__shared__ (float|int) (\w+)\[(\d+)\];$")
_VLOAD = re.compile(r"^const fx_vec<\w+, (\d+)> (\w+) = \*reinterpret_cast<const fx_vec<\w+, \d+>\*>\((in\d+) \+ (.+)\);$")
_VDECL = re.compile(r"^fx_vec<\w+, (\d+)> (\w+);$")
_VSET = re.compile(r"^(\w+)\.v\[(\d+)\] = (.+);$")
_VSTORE = re.compile(r"^\*reinterpret_cast<fx_vec<\w+, (\d+)>\*>\((out\d+) \+ (.+)\) = (\w+);$")
_ATOMIC = re.compile(r"^const unsigned int (\w+) = atomicAdd\((\w+) \+ (.+), 1u\);$")
_ASSIGN = re.compile(r"^(?:const )?(?:idx_t |int |bool |float |unsigned int )?(\w+)(?:\[(.+)\])? = (.+);$")


def _parse(source: str, name: str, pointers: set) -> list:
    """The kernel body as a tree: [(kind, ...)], loops and branches holding their bodies."""
    body = source[source.index(f"{name}("):].splitlines()[1:]
    root: list = []
    stack = [root]
    for raw in body:
        ln = raw.strip()
        if not ln or ln.startswith(("#pragma", "fx_pdl_begin", "typedef", "//")):
            continue
        if ln == "}":
            if len(stack) == 1:
                break
            stack.pop()
            continue
        m = _FOR.match(ln)
        if m:
            node = ("for", m.group(1), *(compile(_expr(m.group(i), pointers), ln, "eval") for i in (2, 3, 4)), [])
            stack[-1].append(node)
            stack.append(node[-1])
            continue
        m = _IF.match(ln)
        if m:
            node = ("if", compile(_expr(m.group(1), pointers), ln, "eval"), [])
            stack[-1].append(node)
            stack.append(node[-1])
            continue
        if ln in ("__syncthreads();", "__threadfence();"):
            stack[-1].append((ln[2:-3],))
            continue
        for pat, kind in ((_SHARED, "shared"), (_VLOAD, "vload"), (_VDECL, "vdecl"), (_VSTORE, "vstore"),
                          (_VSET, "vset"), (_ATOMIC, "atomic"), (_ASSIGN, "assign")):
            m = pat.match(ln)
            if m:
                break
        else:
            raise GeometryParseError(f"{name}: unknown line {ln!r}")
        g = list(m.groups())
        code = {"vload": [3], "vset": [2], "vstore": [2], "atomic": [2], "assign": [1, 2]}.get(kind, [])
        for i in code:
            g[i] = None if g[i] is None else compile(_expr(g[i], pointers), ln, "eval")
        stack[-1].append((kind, *g))
    return root


class _Ptr:
    def __init__(self, name, off=0):
        self.name, self.off = name, off

    def __add__(self, off):
        return _Ptr(self.name, self.off + off)


class _Machine:
    def __init__(self, ks, inputs: list, seed: int):
        k = ks.meta["kernel"]
        (gx, gy, _), block = ks.meta["grid"], ks.block[0]
        self.block, self.nblocks, n = block, gx * gy, gx * gy * block
        t = np.arange(n)
        b = t // block
        self.env: dict = {"threadIdx_x": t % block, "blockIdx_x": b % gx, "blockIdx_y": b // gx, "gridDim_x": gx,
                          "gridDim_y": gy, "np": np}
        self.env.update((f"fx_n{i}", int(v)) for i, v in enumerate(ks.meta.get("extents", ())))  # arguments
        self.tid, self.blk = t, b
        self.mem = {f"in{i}": _flat_memory(x, buf) for i, (x, buf) in enumerate(zip(inputs, k.inputs))}
        self.out = {f"out{j}": np.full(max(1, b_.span()), np.nan) for j, b_ in enumerate(k.outputs)}
        self.count = {name: np.zeros(len(v), np.int64) for name, v in self.out.items()}
        parts, tickets = ks.meta.get("scratch", (1, 1))
        self.mem["ws_"], self.mem["cnt_"] = np.full(parts, np.nan), np.zeros(tickets, np.int64)
        self.shared: dict = {}
        self.epoch = np.zeros(self.nblocks, np.int64)
        self.unfenced = np.zeros(n, bool)
        self.ticketed: dict = {}
        self.ws_block = np.full(parts, -1)
        self.rng = np.random.default_rng(seed)
        self.errors: list = []
        self.mask = np.ones(n, bool)
        h = {"_rd": self.read, "_P": _Ptr, "_ldcg": lambda p: self.read(p.name, p.off), "_sel": self.select,
             "_div": lambda a, b: (a // b) if _ints(a, b) else np.divide(a, b), "_f": lambda x: x,
             "_round_fx_half": lambda x: _rounded(x, torch.float16), "_round_fx_bf16": lambda x: _rounded(x, torch.bfloat16),
             "_mod": lambda a, b: a % b, "_max": lambda a, b: np.where((a > b) | (a != a), a, b),
             "_min": lambda a, b: np.where((a < b) | (a != a), a, b),
             "_i2f": lambda i: float(np.array(i, np.uint32).view(np.float32)), "_rsqrt": lambda a: 1 / np.sqrt(a),
             "_erf": np.vectorize(math.erf, otypes=[float]), "_shfl": self.shuffle}
        self.env.update(h)

    def shuffle(self, mask, val, lane_mask):
        """``__shfl_xor_sync(mask, val, lane_mask)``: lane ``l`` gets lane ``l ^ lane_mask``'s value;
        every warp that reaches it, whole (the full mask, blocks of whole warps)."""
        if int(mask) != 0xFFFFFFFF or self.block % 32 or not 0 < int(lane_mask) < 32:
            self.err(f"__shfl_xor_sync({mask:#x}, ., {lane_mask}) in blocks of {self.block} threads")
        warps = self.mask.reshape(-1, 32) if self.block % 32 == 0 else self.mask[None]
        if (warps.any(1) != warps.all(1)).any():
            self.err("__shfl_xor_sync reached by part of a warp")
        val = np.broadcast_to(np.asarray(val, np.float64), self.mask.shape)
        return val[np.minimum(self.tid ^ int(lane_mask), len(self.tid) - 1)]

    def select(self, cond, a, b):
        """C's ``cond ? a() : b()``: each branch evaluated under the mask of the threads that take it."""
        m, c = self.mask, np.broadcast_to(np.asarray(cond, bool), self.mask.shape)
        self.mask = m & c
        va = a()
        self.mask = m & ~c
        vb = b()
        self.mask = m
        return np.where(c, va, vb)

    def err(self, msg: str) -> None:
        if len(self.errors) < 8:
            self.errors.append(msg)

    def ev(self, code):
        v = eval(code, self.env)  # noqa: S307 - the kernel's own expressions, translated
        return np.broadcast_to(v, self.mask.shape) if not isinstance(v, _Ptr) else v

    def _index(self, name: str, idx, width: int = 1) -> np.ndarray:
        idx = np.broadcast_to(np.asarray(idx), self.mask.shape)
        size = self.shared[name][0].shape[1] if name in self.shared else len(self.out.get(name, self.mem.get(name, [])))
        m = self.mask
        bad = m & ((idx < 0) | (idx + width > size))
        if bad.any():
            self.err(f"{name}: access [{idx[bad][0]}, {idx[bad][0] + width}) outside its {size} elements")
        if width > 1 and (m & (idx % width != 0)).any():
            self.err(f"{name}: a {width}-wide access at an offset not a multiple of {width}")
        return np.clip(idx, 0, max(0, size - width))

    def read(self, name: str, idx):
        idx = self._index(name, idx)
        if name in self.shared:
            val, ep, who, rep, rwho = self.shared[name]
            m, now = self.mask, self.epoch[self.blk]
            race = m & (ep[self.blk, idx] == now) & (who[self.blk, idx] != self.tid) & (who[self.blk, idx] >= 0)
            if race.any():
                self.err(f"{name}[{idx[race][0]}] read by thread {self.tid[race][0]} after another thread wrote it "
                         "without a barrier between")
            b, i, t = self.blk[m], idx[m], self.tid[m]
            other = (rep[b, i] == now[m]) & (rwho[b, i] != t)
            cells, first = np.unique(b * val.shape[1] + i, return_index=True)
            many = np.zeros(len(b), bool)
            many[np.setdiff1d(np.arange(len(b)), first)] = True
            rep[b, i], rwho[b, i] = now[m], np.where(other | many, -2, t)
            return val[self.blk, idx]
        if name == "ws_":  # a block sees the partials of the blocks that drew their tickets before its own
            writer = self.ws_block[idx]
            mine = np.array([self.ticketed.get(int(b), -1) for b in self.blk])
            theirs = np.array([self.ticketed.get(int(b), 1 << 40) for b in writer])
            late = self.mask & ((writer < 0) | (theirs > mine))
            if late.any():
                self.err(f"ws_[{idx[late][0]}]: a partial read by block {self.blk[late][0]} before its writer's ticket")
        return self.mem[name][idx]

    def write(self, name: str, idx, val) -> None:
        idx, m = self._index(name, idx), self.mask
        val = np.broadcast_to(val, m.shape)
        if name in self.shared:
            arr, ep, who, rep, rwho = self.shared[name]
            b, i, t = self.blk[m], idx[m], self.tid[m]
            cells = b * arr.shape[1] + i
            if len(np.unique(cells)) < len(cells) or ((ep[b, i] == self.epoch[b]) & (who[b, i] != t)).any():
                self.err(f"{name}: two threads write one word between barriers")
            if ((rep[b, i] == self.epoch[b]) & (rwho[b, i] != t) & (rwho[b, i] != -1)).any():
                self.err(f"{name}: a word written while another thread may still read it (no barrier between)")
            arr[b, i], ep[b, i], who[b, i] = val[m], self.epoch[b], self.tid[m]
        elif name in self.out:
            np.add.at(self.count[name], idx[m], 1)
            self.out[name][idx[m]] = val[m]
        else:
            if name == "ws_":
                done = [blk for blk in np.unique(self.blk[m]) if int(blk) in self.ticketed]
                if done:
                    self.err(f"block {done[0]} wrote a partial after drawing its ticket")
                self.unfenced |= m
                self.ws_block[idx[m]] = self.blk[m]
            self.mem[name][idx[m]] = val[m]

    def assign(self, name: str, val) -> None:
        old = self.env.get(name)
        if isinstance(old, np.ndarray) and old.shape == self.mask.shape and not self.mask.all():
            val = np.where(self.mask, val, old)
        self.env[name] = np.array(val)

    def run(self, nodes: list) -> None:
        for node in nodes:
            if not self.mask.any():
                return
            getattr(self, "_" + node[0])(*node[1:])

    def _for(self, var, start, stop, step, body) -> None:
        outer = self.mask
        self.assign(var, self.ev(start))
        self.mask = outer & (self.env[var] < self.ev(stop))
        while self.mask.any():
            self.run(body)
            self.env[var] = np.where(self.mask, self.env[var] + self.ev(step), self.env[var])
            self.mask = self.mask & (self.env[var] < self.ev(stop))
        self.mask = outer

    def _if(self, cond, body) -> None:
        outer = self.mask
        self.mask = outer & self.ev(cond).astype(bool)
        self.run(body)
        self.mask = outer

    def _syncthreads(self) -> None:
        per = self.mask.reshape(self.nblocks, self.block)
        if (per.any(1) != per.all(1)).any():
            self.err("__syncthreads() reached by part of a block")
        self.epoch += per.any(1)

    def _threadfence(self) -> None:
        self.unfenced &= ~self.mask

    def _shared(self, ctype, name, size) -> None:
        init = np.nan if ctype == "float" else 0
        shape = (self.nblocks, int(size))
        self.shared[name] = (np.full(shape, init), np.full(shape, -1), np.full(shape, -1), np.full(shape, -1),
                             np.full(shape, -1))

    def _vload(self, width, name, buf, off) -> None:
        w = int(width)
        idx = self._index(buf, self.ev(off), w)
        self.assign(name, np.stack([self.mem[buf][idx + i] for i in range(w)]))

    def _vdecl(self, width, name) -> None:
        self.env[name] = np.full((int(width),) + self.mask.shape, np.nan)

    def _vset(self, name, lane, val) -> None:
        self.env[name][int(lane)] = np.where(self.mask, self.ev(val), self.env[name][int(lane)])

    def _vstore(self, width, buf, off, name) -> None:
        w, o = int(width), self.ev(off)
        self._index(buf, o, w)
        for i in range(w):
            self.write(buf, o + i, self.env[name][i])

    def _atomic(self, name, ptr, off) -> None:
        where = np.flatnonzero(self.mask)
        addr = self.ev(off)[where]
        blocks = self.blk[where]
        if self.unfenced[np.isin(self.blk, blocks)].any():
            self.err("a block drew its ticket before its partials were fenced")
        old = np.zeros(len(self.mask), np.int64)
        for j in self.rng.permutation(len(where)):  # the blocks' tickets in a random order
            old[where[j]] = self.mem[ptr][addr[j]]
            self.mem[ptr][addr[j]] += 1
            self.ticketed[int(blocks[j])] = int(old[where[j]])
        self.assign(name, old)

    def _assign(self, name, idx, val) -> None:
        v = self.ev(val)
        if idx is None:
            self.assign(name, v)
        else:
            self.write(name, self.ev(idx), v)


def _flat_memory(x: torch.Tensor, buf) -> np.ndarray:
    """The memory an input buffer spans, as float64: its elements where its strides put them, NaN
    in the gaps between them (a split's piece read in place leaves gaps; a read of one is a bug
    the NaN carries into the results)."""
    mem = torch.full((max(1, buf.span()),), float("nan"), dtype=torch.float64)
    mem.as_strided(tuple(buf.shape), tuple(buf.strides)).copy_(x.detach())
    return mem.numpy()


def _rounded(x, dtype: torch.dtype):
    """``x`` (float64, any shape) rounded to ``dtype`` as a Cast of the IR rounds it."""
    return torch.from_numpy(np.asarray(x, np.float64)).to(torch.float32).to(dtype).to(torch.float64).numpy()


def _ints(a, b) -> bool:
    return np.asarray(a).dtype.kind in "iub" and np.asarray(b).dtype.kind in "iub"


def is_column_kernel(ks) -> bool:
    return ks.kind == "fused_reduction" and "bx" in (ks.meta.get("geometry") or {})


def emulate(ks, inputs: list, seed: int = 0):
    """(the outputs' memory as flat float64 arrays, stores per element, errors) of ``ks`` on ``inputs``."""
    pointers = {p for p, t in ks.params if t.endswith("*")}
    tree = _parse(ks.source, ks.name, pointers)
    m = _Machine(ks, inputs, seed)
    m.run(tree)
    if m.mem["cnt_"].any():
        m.err("ticket counters not reset for the next launch")
    return m.out, m.count, m.errors


def check_column_geometry(ks, seed: int = 0, high: int = 0, rtol: float = 1e-7, atol: float = 0.0) -> dict:
    """Emulate ``ks`` on inputs of distinct-ish integers in [1, high] (default: as large as keeps a
    row's sum exact in float32, so that the default ``rtol`` tells one element more or less) and
    compare with ``ir.evaluate`` (``rtol``, and ``atol`` times the largest result or input: kernels
    whose float32 math rounds, exp, division, differences); raises AssertionError naming the first
    violations. Returns a summary."""
    from fxopt.backends.cuda import ir

    k = ks.meta["kernel"]
    cap = {torch.float16: 2048, torch.bfloat16: 256}
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for b in k.inputs:
        hi = high or max(1, min(cap.get(b.dtype, 1 << 14), (1 << 22) // max(1, k.row_size)))
        flat = torch.randint(1, hi + 1, (max(1, b.span()),), generator=gen).to(b.dtype)
        inputs.append(flat.as_strided(b.shape, b.strides))
    outs, count, errors = emulate(ks, inputs, seed)
    in_scale = max((float(t.abs().max()) for t in inputs if t.numel()), default=0.0)
    wants = [torch.empty_strided(b.shape, b.strides, dtype=torch.float64) for b in k.outputs]
    ir.evaluate(k, inputs, wants, compute=torch.float64)  # the emulation's precision: see the docstring
    for j, (b, want) in enumerate(zip(k.outputs, wants)):
        ref = want.as_strided((max(1, b.span()),), (1,)).numpy()
        written = np.zeros(len(ref), bool)
        written[torch.arange(len(ref)).as_strided(b.shape, b.strides).reshape(-1).numpy()] = True
        c = count[f"out{j}"]
        if (c[written] != 1).any():
            bad = np.flatnonzero(written & (c != 1))
            errors.append(f"out{j}: element {bad[0]} stored {c[bad[0]]} times ({len(bad)} such)")
        got = outs[f"out{j}"]
        # ``atol`` scales with the largest result, or the largest input where that is larger: a row of
        # equal values normalized gives 0 in the IR and its float64 rounding times rsqrt(eps) here (CPU
        # fuzz a257513b80: 1.8e-14 against 0, inputs up to 4)
        scale = max(np.nanmax(np.abs(np.where(np.isinf(ref), 0, ref[written])), initial=0), in_scale)
        tol = rtol * np.abs(ref) + atol * scale
        off = written & ~((np.abs(got - ref) <= tol) | (got == ref) | (np.isnan(got) & np.isnan(ref)))
        if off.any():
            i = np.flatnonzero(off)[0]
            errors.append(f"out{j}: {off.sum()} elements differ from the IR's, first [{i}]: {got[i]} != {ref[i]}")
    if errors:
        raise AssertionError(f"{ks.name} (grid {ks.meta['grid']}, block {ks.block[0]}): " + "; ".join(errors[:5]))
    return {"threads": int(np.prod(ks.meta["grid"])) * ks.block[0], "geometry": ks.meta["geometry"]}
