"""The conv-epilogue family: a ``fxopt::fused_conv`` run as cuDNN's convolution without bias, then ONE
generated kernel applying bias, residual and activation in place on its output
(``GeneratedEpilogue``, ``plan_conv_epilogue``). Run as PyTorch would, the bias add after cuDNN is a
broadcasting elementwise kernel (slow on channels_last outputs) and each further step is one more
pass over the activation.

The kernel computes the fused epilogue's IR expression (``ir.epilogue_expr`` over ``ir.ACC``,
``ir.BIAS``, ``ir.RES``: act(y + bias[c] (+ res))), read in order by ``codegen.epilogue.epilogue_body``;
its inputs (``epilogue_inputs``: y and the residual full, the bias one value per channel) follow from
the expression. ``generate_conv_epilogue`` renders it (``templates/pointwise.cu``, 16-byte vector
loads where alignment allows), ``launch_conv_epilogue`` checks shapes, layouts, dtypes and the vector
width's alignment, and ``epilogue_reference`` is its semantics with torch."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.codegen.c import ctype as _ctype, fast_math_prefix, prelude as _prelude
from fxopt.backends.cuda.codegen.epilogue import epilogue_body, has_bias, has_residual, template_epilogue
from fxopt.backends.cuda.codegen.source import (KernelSource, made_once, c_comment, c_ident, index_type, checked_layout,
                                                layout_name)
from fxopt.backends.cuda.ir import ACC, BIAS, RES
from fxopt.backends.cuda.ir.expr import apply_op
from fxopt.backends.cuda.kernels.common import check_layout, compiled_kernel, load, memory_layout_ok
from fxopt.ops import conv_by_algorithm, fused_conv_ref


@dataclass(frozen=True)
class EpilogueInput:
    """A tensor the kernel reads: its key in a launch's tensors, the epilogue leaf it provides, and
    how it spans the (N, C, *spatial) output: ``full``, or ``channel`` (a dense (C,) vector)."""
    name: str
    leaf: ir.Expr
    broadcast: str


Y, BIAS_IN, RES_IN = EpilogueInput("y", ACC, "full"), EpilogueInput("bias", BIAS, "channel"), EpilogueInput("res", RES, "full")


def epilogue_inputs(e) -> tuple[EpilogueInput, ...]:
    """The kernel's inputs in launch order: the convolution's output, then the bias and the
    residual where epilogue ``e`` adds them."""
    return (Y,) + (BIAS_IN,) * has_bias(e) + (RES_IN,) * has_residual(e)


def epilogue_reference(e, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The kernel's semantics with torch: the inputs widened to float32 (the bias as (1, C, 1, ...)),
    the expression's ops as the IR defines them (``ir.expr.apply_op``, as ``ir.interp`` evaluates
    them), one rounding to ``dtype`` at the end."""
    y = tensors["y"]
    env = {}
    for a in epilogue_inputs(e):
        t = tensors[a.name].to(torch.float32)
        env[a.leaf] = t.reshape((1, -1) + (1,) * (y.dim() - 2)) if a.broadcast == "channel" else t
    vals: dict = {}
    for n in ir.walk(e):
        vals[n] = env[n] if n in env else apply_op(n.op, [vals[a] for a in n.args], n.params).to(torch.float32)
    return vals[e].expand(y.shape).to(dtype)


@made_once
def generate_conv_epilogue(name: str, e, dtype: torch.dtype, layout: str = "nchw", vector_width: int = 1,
                           index64: bool = False, block: int = 256, fast_math: bool = False) -> KernelSource:
    """The kernel of epilogue ``e`` (a chain: ``ir.epilogue_expr`` over ``ir.ACC``, ``ir.BIAS``,
    ``ir.RES``) over ``dtype`` tensors, named after ``name``. Launch args: the inputs (in
    ``epilogue_inputs`` order), ``out``, then ``numel, C, HW`` (C = shape[1], HW = prod(shape[2:])).

    ``vector_width`` > 1 promises: every full input and the output are aligned to
    min(16, vec * itemsize) bytes, and the bias (if any) satisfies HW % vec == 0 (nchw) or
    C % vec == 0 with an aligned vector (nhwc); elements past the last full vector go through a
    scalar tail loop. ``fast_math``: the activations' exp and quotient
    approximate, as in the generated region kernels."""
    inputs = epilogue_inputs(e)
    var = {a.leaf: f"x{j}" for j, a in enumerate(inputs)}
    body = epilogue_body(e, var)
    prefix = fast_math_prefix(fast_math, (n.op for n in ir.walk(e) if isinstance(n, ir.Op)))
    lay, vec = checked_layout(layout), int(vector_width)
    if vec not in (1, 2, 4, 8) or vec * dtype.itemsize > 32:
        raise ValueError(f"unsupported vector width {vector_width}")
    kname = (f"fx_pw_{c_ident(name)[:40]}_{lay}_v{vec}{f'_b{block}' if block != 256 else ''}"
             f"{'_i64' if index64 else ''}{'_fm' if prefix else ''}")
    ct = _ctype(dtype)
    params, sloads, sargs, vloads, vargs = [], [], [], [], []
    for j, a in enumerate(inputs):
        params.append((f"in{j}", f"const {ct}*"))
        cidx = "(i / HW) % C" if lay == "nchw" else "i % C"
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
    params.append(("out", f"{ct}*"))
    vector_loop = "" if vec == 1 else load("pointwise_vector_loop.cu").substitute(
        vec=vec, vector_loads="\n".join(vloads), out_t=ct, name=kname, vector_args=", ".join(vargs))
    src = load("pointwise.cu").substitute(
        prelude=_prelude({dtype}), region=c_comment(name), layout=lay, vec=vec,
        name=kname, body_params=", ".join(f"float x{j}" for j in range(len(inputs))),
        body="\n".join(body), block=block, idx=index_type(index64),
        params=", ".join(f"{t} __restrict__ {n}" for n, t in params),
        vector_loop=vector_loop, tail_start="nvec * %d" % vec if vec > 1 else "0",
        scalar_loads="\n".join(sloads), out_t=ct, scalar_args=", ".join(sargs))
    all_params = tuple(params) + (("numel", "long long"), ("C", "long long"), ("HW", "long long"))
    return KernelSource(kname, prefix + src, all_params, "pointwise",
                        {"layout": lay, "vec": vec, "epilogue": e, "inputs": inputs, "dtype": dtype,
                         "fast_math": bool(prefix)}, (block, 1, 1), index64)


def pointwise_sizes(shape) -> tuple[int, int, int]:
    """(numel, C, HW) of a logical (N, C, *spatial) shape."""
    shape = tuple(shape)
    return math.prod(shape), (shape[1] if len(shape) > 1 else 1), math.prod(shape[2:])


def vector_width_ok(inputs, dtype: torch.dtype, layout: str, vec: int, shape, ptrs: Mapping[str, int],
                    out_ptr: int) -> bool:
    """Whether a kernel generated with ``vector_width=vec`` may run on these tensors (``inputs``:
    ``epilogue_inputs``, all of ``dtype``; ``ptrs``: their data pointers by name)."""
    if vec == 1:
        return True
    _, C, HW = pointwise_sizes(shape)
    align = min(16, vec * dtype.itemsize)
    if out_ptr % align:
        return False
    for a in inputs:
        if a.broadcast == "full" and ptrs[a.name] % align:
            return False
        if a.broadcast == "channel":
            if layout == "nchw" and HW % vec:
                return False
            if layout == "nhwc" and (C % vec or ptrs[a.name] % align):
                return False
    return True


def choose_vector_width(inputs, dtype: torch.dtype, layout: str, tensors: Mapping[str, torch.Tensor],
                        out: torch.Tensor, widths=(8, 4, 2)) -> int:
    """Largest width giving at most 16-byte output vectors that the tensors allow (else 1)."""
    ptrs = {k: v.data_ptr() for k, v in tensors.items()}
    for vec in widths:
        if vec * dtype.itemsize <= 16 and vector_width_ok(inputs, dtype, layout, vec, out.shape, ptrs, out.data_ptr()):
            return vec
    return 1


def launch_conv_epilogue(ks: KernelSource, tensors: Mapping[str, torch.Tensor], out: torch.Tensor,
                         kernel=None) -> torch.Tensor:
    """Run ``generate_conv_epilogue``'s kernel ``ks`` on ``tensors`` (by input name) into ``out``."""
    inputs, dtype, layout, vec = ks.meta["inputs"], ks.meta["dtype"], ks.meta["layout"], ks.meta["vec"]
    numel, C, HW = pointwise_sizes(out.shape)
    check_layout(out, layout, f"{ks.name}: out", dtype)
    for a in inputs:
        t = tensors[a.name]
        if t.dtype != dtype:
            raise TypeError(f"{ks.name}: {a.name} is {t.dtype}, kernel expects {dtype}")
        if a.broadcast == "full":
            if t.shape != out.shape:
                raise ValueError(f"{ks.name}: {a.name} has shape {tuple(t.shape)}, out {tuple(out.shape)}")
            check_layout(t, layout, f"{ks.name}: {a.name}")
        elif t.numel() != C or not t.is_contiguous():
            raise ValueError(f"{ks.name}: channel input {a.name} must be a dense ({C},) vector")
    if numel == 0:
        return out
    if not vector_width_ok(inputs, dtype, layout, vec, out.shape, {a.name: tensors[a.name].data_ptr() for a in inputs},
                           out.data_ptr()):
        raise ValueError(f"{ks.name}: tensors violate the vector-width-{vec} alignment contract")
    grid, block = ks.grid_block(numel)
    compiled_kernel(ks, kernel).launch(grid, block, [tensors[a.name] for a in inputs] + [out, numel, C, HW])
    return out


class GeneratedEpilogue:
    """conv without bias, then one generated kernel: out = act(y + bias[c] + residual), in place.
    Candidate ``generated`` of a fused conv (``bind``: the conv node's implementation); ``epilogue``
    is the IR expression (``codegen.epilogue.template_epilogue``), ``name`` what the kernels are
    named after."""

    key = "generated"

    def __init__(self, name: str, epilogue, dtype: torch.dtype, layout: str, vector_width: int,
                 fast_math: bool = False, block: int = 256):
        self.name, self.epilogue, self.dtype, self.layout = name, epilogue, dtype, layout
        self.inputs = epilogue_inputs(epilogue)
        widths = sorted({vector_width, 1}, reverse=True)
        self.sources = {v: generate_conv_epilogue(name, epilogue, dtype, layout, v, block=block, fast_math=fast_math)
                        for v in widths}
        self.kernels: dict = {}

    def reference(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return epilogue_reference(self.epilogue, tensors, self.dtype)

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
            if vec == 1 or vector_width_ok(self.inputs, self.dtype, self.layout, vec, y.shape, ptrs, y.data_ptr()):
                return launch_conv_epilogue(ks, tensors, y, kernel=self.kernels.get(vec))
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

    fused_conv_generated.__name__ = f"fused_conv_{epilogue.name}"
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
    vec, block = small_geometry(out.numel() * out.dtype.itemsize, out.dtype.itemsize)
    vec = max(v for v in (8, 4, 2, 1) if v <= vec and (c if layout == "nhwc" else hw) % v == 0)
    # named by what it computes, not by the node: convs with the same epilogue share one kernel
    # (one NVRTC compilation, see compiler.compile_many)
    params = "_".join(f"{float(p):g}".replace("-", "m").replace(".", "p") for p in node.args[9])
    name = (f"conv_epi_{'b' * (bias is not None)}{'r' * (res is not None)}_{node.args[8]}"
            + (f"_{params}" if params else ""))
    epilogue = template_epilogue(bias is not None, res is not None, node.args[8], node.args[9])
    return GeneratedEpilogue(name, epilogue, out.dtype, layout, vec, fast_math, block)


#: an epilogue over at most this many bytes runs 8-byte vectors in blocks of 128 threads
SMALL_EPILOGUE_BYTES = 1 << 20


def small_geometry(nbytes: int, itemsize: int) -> tuple[int, int]:
    """(widest vector, threads a block) of the epilogue of an output of ``nbytes``: 16-byte vectors
    in blocks of 256; over at most ``SMALL_EPILOGUE_BYTES``, 8-byte vectors in blocks of 128, four
    times the blocks, so that a batch-1 activation spreads over more of the GPU. Alone, bias + SiLU
    in place, fp16 channels_last, batch 1, 100 launches in a CUDA graph (one H200, 2026-12-06), µs
    16-byte/256 against 8-byte/128: [1, 384, 7, 7] 1.17 / 0.91, [1, 384, 28, 28] 1.46 / 1.20,
    [1, 128, 56, 56] (802 KB) 1.52 / 1.34; [1, 64, 112, 112] (1.6 MB) 1.58 / 2.29."""
    if nbytes <= SMALL_EPILOGUE_BYTES:
        return max(1, 8 // itemsize), 128
    return max(1, 16 // itemsize), 256
