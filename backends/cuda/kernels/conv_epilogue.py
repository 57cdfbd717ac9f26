"""The conv-epilogue family: a ``fxopt::fused_conv`` run as cuDNN's convolution without bias, then ONE
generated kernel applying bias, residual and activation in place on its output
(``GeneratedEpilogue``, ``plan_conv_epilogue``). Run as PyTorch would, the bias add after cuDNN is a
broadcasting elementwise kernel (slow on channels_last outputs) and each further step is one more
pass over the activation.

The kernel comes from a small explicit pointwise IR of its own (``PointwiseRegion``: named inputs,
each full / per-channel / scalar, and a list of ops; ``reference`` runs it with torch) through
``generate_pointwise`` (``templates/pointwise.cu``, 16-byte vector loads where alignment allows);
``launch_pointwise`` checks shapes, layouts, dtypes and the vector width's alignment."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen.c import BINARY_OPS, UNARY_OPS, bounds, c_unary, ctype as _ctype, fast_math_prefix, lit as _lit, prelude as _prelude
from fxopt.backends.cuda.codegen.source import KernelSource, c_comment, c_ident, index_type, checked_layout, layout_name
from fxopt.backends.cuda.kernels.common import check_layout, compiled_kernel, load, memory_layout_ok
from fxopt.ops import conv_by_algorithm, fused_conv_ref


def _t_unary(op: str, a: torch.Tensor, p: tuple) -> torch.Tensor:
    """torch (float32) semantics of templates.c_unary."""
    if op in ("hardtanh", "clamp"):
        lo, hi = bounds(op, p)
        return a if lo is None and hi is None else torch.clamp(a, lo, hi)
    if op == "leaky_relu":
        return torch.where(a > 0, a, a * (p[0] if p else 0.01))
    if op == "cast":
        return a.to(p[0]).to(torch.float32)
    f = {"identity": lambda: a, "neg": lambda: -a, "relu": lambda: torch.relu(a),
         "silu": lambda: a / (1 + torch.exp(-a)),
         "gelu": lambda: 0.5 * a * (1 + torch.erf(a * 0.7071067811865476)),
         "gelu_tanh": lambda: 0.5 * a * (1 + torch.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))),
         "hardswish": lambda: a * torch.clamp(a + 3, 0, 6) / 6,
         "hardsigmoid": lambda: torch.clamp(a + 3, 0, 6) / 6,
         "sigmoid": lambda: 1 / (1 + torch.exp(-a)), "tanh": lambda: torch.tanh(a),
         "exp": lambda: torch.exp(a), "abs": lambda: torch.abs(a)}.get(op)
    if f is None:
        raise NotImplementedError(f"unknown pointwise op {op!r}")
    return f()


@dataclass
class TensorArg:
    name: str
    dtype: torch.dtype = torch.float32
    broadcast: str = "full"  # "full" | "channel" (per-channel vector of length C) | "scalar"

    def __post_init__(self):
        if self.broadcast not in ("full", "channel", "scalar"):
            raise ValueError(f"TensorArg {self.name!r}: bad broadcast {self.broadcast!r}")


@dataclass
class PointwiseOp:
    op: str
    inputs: list[str]
    params: tuple = ()


@dataclass
class PointwiseRegion:
    name: str
    inputs: list[TensorArg]
    ops: list[tuple[str, PointwiseOp]]
    output: str
    out_dtype: torch.dtype = torch.float32

    def validate(self) -> None:
        seen = set()
        for a in self.inputs:
            _ctype(a.dtype)
            if a.name in seen:
                raise ValueError(f"region {self.name!r}: duplicate name {a.name!r}")
            seen.add(a.name)
        if not self.inputs:
            raise ValueError(f"region {self.name!r} has no inputs")
        _ctype(self.out_dtype)
        for ssa, op in self.ops:
            if ssa in seen:
                raise ValueError(f"region {self.name!r}: {ssa!r} defined twice")
            missing = [i for i in op.inputs if i not in seen]
            if missing:
                raise ValueError(f"region {self.name!r}: {ssa!r} uses undefined {missing}")
            if op.op in BINARY_OPS:
                if not (len(op.inputs) == 2 and not op.params or len(op.inputs) == 1 and len(op.params) == 1):
                    raise ValueError(f"{ssa!r}: {op.op} takes two values, or one value and a constant")
            elif op.op in UNARY_OPS:
                lo, hi = UNARY_OPS[op.op]
                if len(op.inputs) != 1 or not lo <= len(op.params) <= hi:
                    raise ValueError(f"{ssa!r}: bad arity for {op.op}: {op.inputs} {op.params}")
                if op.op == "cast":
                    _ctype(op.params[0])
            else:
                raise NotImplementedError(f"{ssa!r}: unknown pointwise op {op.op!r}")
            seen.add(ssa)
        if self.output not in seen:
            raise ValueError(f"region {self.name!r}: output {self.output!r} is undefined")

    def dtypes(self) -> set:
        d = {a.dtype for a in self.inputs} | {self.out_dtype}
        return d | {op.params[0] for _, op in self.ops if op.op == "cast"}

    def reference(self, tensors: Mapping[str, torch.Tensor], shape=None,
                  trace: dict | None = None) -> torch.Tensor:
        """Torch executor of the region with the kernel's semantics (fp32 math, one final
        rounding to ``out_dtype``). Tensors have logical (N, C, ...) shape in any memory
        format; "channel" args are (C,) vectors, "scalar" args hold one element; ``shape``
        is needed only without "full" inputs. ``trace`` (a dict) receives every value."""
        self.validate()
        full = [tensors[a.name] for a in self.inputs if a.broadcast == "full"]
        shape = tuple(full[0].shape) if shape is None and full else tuple(shape or ())
        env: dict[str, torch.Tensor] = {}
        for a in self.inputs:
            t = tensors[a.name].to(torch.float32)
            if a.broadcast == "channel":
                t = t.reshape((1, -1) + (1,) * (len(shape) - 2))
            elif a.broadcast == "scalar":
                t = t.reshape(())
            env[a.name] = t
        for ssa, op in self.ops:
            xs = [env[i] for i in op.inputs]
            if op.op in BINARY_OPS:
                b = xs[1] if len(xs) == 2 else torch.tensor(
                    float(op.params[0]), dtype=torch.float32, device=xs[0].device)
                env[ssa] = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[op.op](xs[0], b)
            else:
                env[ssa] = _t_unary(op.op, xs[0], tuple(op.params))
        if trace is not None:
            trace.update(env)
        return env[self.output].expand(shape).to(self.out_dtype)


def generate_pointwise(region: PointwiseRegion, layout: str = "nchw", vector_width: int = 1,
                       index64: bool = False, block: int = 256, fast_math: bool = False) -> KernelSource:
    """One kernel for a fused pointwise region. Launch args: the inputs (in ``region.inputs``
    order), ``out``, then ``numel, C, HW`` (C = shape[1], HW = prod(shape[2:])).

    ``vector_width`` > 1 promises: every full input and the output are aligned to
    min(16, vec * itemsize) bytes, and a channel input (if any) satisfies HW % vec == 0
    (nchw) or C % vec == 0 with an aligned channel vector (nhwc); elements past the last
    full vector go through a scalar tail loop. ``fast_math`` (16-bit results only): the
    activations' exp and quotient approximate, as in the generated region kernels."""
    region.validate()
    prefix = fast_math_prefix(fast_math, [region.out_dtype], (op.op for _, op in region.ops))
    lay, vec = checked_layout(layout), int(vector_width)
    if vec not in (1, 2, 4, 8) or any(vec * d.itemsize > 32 for d in region.dtypes()):
        raise ValueError(f"unsupported vector width {vector_width}")
    name = f"fx_pw_{c_ident(region.name)[:40]}_{lay}_v{vec}{'_i64' if index64 else ''}{'_fm' if prefix else ''}"
    var = {a.name: f"x{j}" for j, a in enumerate(region.inputs)}
    body = []
    for k, (ssa, op) in enumerate(region.ops):
        a = [var[i] for i in op.inputs]
        if op.op in BINARY_OPS:
            rhs = a[1] if len(a) == 2 else _lit(op.params[0])
            expr = f"({a[0]} {BINARY_OPS[op.op]} {rhs})"
        else:
            expr = c_unary(op.op, a[0], tuple(op.params))
        var[ssa] = f"t{k}"
        body.append(f"  const float t{k} = {expr};  // {c_comment(ssa)} = {op.op}")
    body.append(f"  return {var[region.output]};")
    params, hoisted, sloads, sargs, vloads, vargs = [], [], [], [], [], []
    for j, a in enumerate(region.inputs):
        ct = _ctype(a.dtype)
        params.append((f"in{j}", f"const {ct}*"))
        cidx = "(i / HW) % C" if lay == "nchw" else "i % C"
        if a.broadcast == "scalar":
            hoisted.append(f"  const float s{j} = fx_to_f32(in{j}[0]);")
            sargs.append(f"s{j}")
            vargs.append(f"s{j}")
            continue
        sloads.append(f"    const float a{j} = fx_to_f32(in{j}[{'i' if a.broadcast == 'full' else cidx}]);")
        sargs.append(f"a{j}")
        if a.broadcast == "channel" and lay == "nchw":  # HW % vec == 0: one channel per vector
            vloads.append(f"    const float a{j} = fx_to_f32(in{j}[{cidx}]);")
            vargs.append(f"a{j}")
        else:
            off = "i" if a.broadcast == "full" else f"({cidx})"
            vloads.append(f"    const fx_vec<{ct}, {vec}> a{j} = "
                          f"*reinterpret_cast<const fx_vec<{ct}, {vec}>*>(in{j} + {off});")
            vargs.append(f"fx_to_f32(a{j}.v[k])")
    out_t = _ctype(region.out_dtype)
    params.append(("out", f"{out_t}*"))
    vector_loop = "" if vec == 1 else load("pointwise_vector_loop.cu").substitute(
        vec=vec, vector_loads="\n".join(vloads), out_t=out_t, name=name, vector_args=", ".join(vargs))
    src = load("pointwise.cu").substitute(
        prelude=_prelude(region.dtypes()), region=c_comment(region.name), layout=lay, vec=vec,
        name=name, body_params=", ".join(f"float x{j}" for j in range(len(region.inputs))),
        body="\n".join(body), block=block, idx=index_type(index64),
        params=", ".join(f"{t} __restrict__ {n}" for n, t in params), hoisted="\n".join(hoisted),
        vector_loop=vector_loop, tail_start="nvec * %d" % vec if vec > 1 else "0",
        scalar_loads="\n".join(sloads), out_t=out_t, scalar_args=", ".join(sargs))
    all_params = tuple(params) + (("numel", "long long"), ("C", "long long"), ("HW", "long long"))
    return KernelSource(name, prefix + src, all_params, "pointwise",
                        {"layout": lay, "vec": vec, "region": region, "fast_math": bool(prefix)}, (block, 1, 1),
                        index64)


def pointwise_sizes(shape) -> tuple[int, int, int]:
    """(numel, C, HW) of a logical (N, C, *spatial) shape."""
    shape = tuple(shape)
    return math.prod(shape), (shape[1] if len(shape) > 1 else 1), math.prod(shape[2:])


def vector_width_ok(region: PointwiseRegion, layout: str, vec: int, shape,
                    ptrs: Mapping[str, int], out_ptr: int) -> bool:
    """Whether a kernel generated with ``vector_width=vec`` may run on these tensors."""
    if vec == 1:
        return True
    _, C, HW = pointwise_sizes(shape)
    if out_ptr % min(16, vec * region.out_dtype.itemsize):
        return False
    for a in region.inputs:
        align = min(16, vec * a.dtype.itemsize)
        if a.broadcast == "full" and ptrs[a.name] % align:
            return False
        if a.broadcast == "channel":
            if layout == "nchw" and HW % vec:
                return False
            if layout == "nhwc" and (C % vec or ptrs[a.name] % align):
                return False
    return True


def choose_vector_width(region: PointwiseRegion, layout: str, tensors: Mapping[str, torch.Tensor],
                        out: torch.Tensor, widths=(8, 4, 2)) -> int:
    """Largest width giving at most 16-byte output vectors that the tensors allow (else 1)."""
    ptrs = {k: v.data_ptr() for k, v in tensors.items()}
    for vec in widths:
        if vec * region.out_dtype.itemsize <= 16 and vector_width_ok(
                region, layout, vec, out.shape, ptrs, out.data_ptr()):
            return vec
    return 1


def launch_pointwise(ks: KernelSource, tensors: Mapping[str, torch.Tensor], out: torch.Tensor,
                     kernel=None) -> torch.Tensor:
    region, layout, vec = ks.meta["region"], ks.meta["layout"], ks.meta["vec"]
    numel, C, HW = pointwise_sizes(out.shape)
    check_layout(out, layout, f"{region.name}: out", region.out_dtype)
    for a in region.inputs:
        t = tensors[a.name]
        if a.dtype != t.dtype:
            raise TypeError(f"{region.name}: {a.name} is {t.dtype}, kernel expects {a.dtype}")
        if a.broadcast == "full":
            if t.shape != out.shape:
                raise ValueError(f"{region.name}: {a.name} has shape {tuple(t.shape)}, out {tuple(out.shape)}")
            check_layout(t, layout, f"{region.name}: {a.name}")
        elif a.broadcast == "channel" and (t.numel() != C or not t.is_contiguous()):
            raise ValueError(f"{region.name}: channel input {a.name} must be a dense ({C},) vector")
        elif a.broadcast == "scalar" and t.numel() != 1:
            raise ValueError(f"{region.name}: scalar input {a.name} has {t.numel()} elements")
    if numel == 0:
        return out
    if not vector_width_ok(region, layout, vec, out.shape,
                           {k: v.data_ptr() for k, v in tensors.items()}, out.data_ptr()):
        raise ValueError(f"{ks.name}: tensors violate the vector-width-{vec} alignment contract")
    grid, block = ks.grid_block(numel)
    args = [tensors[a.name] for a in region.inputs] + [out, numel, C, HW]
    compiled_kernel(ks, kernel).launch(grid, block, args)
    return out


class GeneratedEpilogue:
    """conv without bias, then one generated kernel: out = act(y + bias[c] + residual), in place.
    Candidate ``generated`` of a fused conv (``bind``: the conv node's implementation)."""

    key = "generated"

    def __init__(self, name: str, dtype: torch.dtype, layout: str, has_bias: bool, has_residual: bool,
                 activation: str, act_params, vector_width: int, fast_math: bool = False):
        inputs, ops, cur = [TensorArg("y", dtype, "full")], [], "y"
        if has_bias:
            inputs.append(TensorArg("bias", dtype, "channel"))
            ops.append(("t_bias", PointwiseOp("add", [cur, "bias"])))
            cur = "t_bias"
        if has_residual:
            inputs.append(TensorArg("res", dtype, "full"))
            ops.append(("t_res", PointwiseOp("add", [cur, "res"])))
            cur = "t_res"
        if activation != "none":
            ops.append(("t_act", PointwiseOp(activation, [cur], tuple(act_params))))
            cur = "t_act"
        if not ops:
            ops.append(("t_id", PointwiseOp("identity", [cur])))
            cur = "t_id"
        self.region = PointwiseRegion(name, inputs, ops, cur, dtype)
        self.layout = layout
        widths = sorted({vector_width, 1}, reverse=True)
        self.sources = {v: generate_pointwise(self.region, layout, v, fast_math=fast_math) for v in widths}
        self.kernels: dict = {}

    def __call__(self, y, bias, residual):
        tensors = {"y": y}
        if bias is not None:
            tensors["bias"] = bias
        if residual is not None:
            tensors["res"] = residual
        if not all(memory_layout_ok(t, self.layout) for k, t in tensors.items() if k != "bias"):
            return None  # unexpected layout at run time: the caller runs the reference
        ptrs = {k: t.data_ptr() for k, t in tensors.items()}
        for vec, ks in self.sources.items():
            if vec == 1 or vector_width_ok(self.region, self.layout, vec, y.shape, ptrs, y.data_ptr()):
                return launch_pointwise(ks, tensors, y, kernel=self.kernels.get(vec))
        return None

    def bind(self, reference):
        return with_generated_epilogue(self)


def with_generated_epilogue(epilogue: GeneratedEpilogue):
    def fused_conv_generated(x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                             algorithm="direct", prepacked=None):
        y = conv_by_algorithm(x, weight, None, stride, padding, dilation, groups, algorithm, prepacked)
        out = epilogue(y, bias, residual)
        if out is None:
            return fused_conv_ref(x, weight, bias, residual, stride, padding, dilation, groups, activation,
                                  act_params, algorithm, prepacked)
        return out

    fused_conv_generated.__name__ = f"fused_conv_{epilogue.region.name}"
    return fused_conv_generated


def plan_conv_epilogue(node: fx.Node, fast_math: bool = False) -> Optional[GeneratedEpilogue]:
    """A generated epilogue for this fused conv node, or None when it does not apply
    (``fast_math``: option fast_math)."""
    if node.op != "call_function" or node.target is not fused_conv_ref:
        return None
    out, x = node.meta.get("val"), node.args[0].meta.get("val")
    bias, res = node.args[2], node.args[3]
    if out is None or x is None or out.dim() != 4 or out.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    layout = layout_name(out)
    if layout is None or not isinstance(out.shape[0], int):
        return None
    for t in (bias, res):
        if t is not None and (t.meta.get("val") is None or t.meta["val"].dtype != out.dtype):
            return None
    if bias is None and res is None and node.args[8] == "none":
        return None  # nothing to fuse
    c = int(out.shape[1])
    hw = int(out.shape[2]) * int(out.shape[3])
    vec = max(v for v in (8, 4, 2, 1) if v * out.dtype.itemsize <= 16 and (c if layout == "nhwc" else hw) % v == 0)
    # named by what it computes, not by the node: convs with the same epilogue share one kernel
    # (one NVRTC compilation, see compiler.compile_many)
    params = "_".join(f"{float(p):g}".replace("-", "m").replace(".", "p") for p in node.args[9])
    name = (f"conv_epi_{'b' * (bias is not None)}{'r' * (res is not None)}_{node.args[8]}"
            + (f"_{params}" if params else ""))
    return GeneratedEpilogue(name, out.dtype, layout, bias is not None, res is not None, node.args[8],
                             node.args[9], vec, fast_math)
