"""ATen -> ONNX translations used by ``fxopt.onnx_graph``: one handler per op of the optimized graph.

A handler ``(emitter, node) -> None`` emits the ONNX nodes for one FX node and sets
``emitter.names[node]`` (a tuple for multi-output ops). ``HANDLERS`` maps each ATen / fxopt op to
its handler; an op missing here makes the export raise ``UnsupportedOpError``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxopt.onnx_common import DTYPES, UnsupportedOpError, _ints, _path, _val
from fxopt.ops import FUSED_CONV, FUSED_LINEAR
from fxopt.passes.fuse_conv_epilogue import ACTIVATION_OPS

aten, prims = torch.ops.aten, torch.ops.prims


# ---- handlers: (emitter, node) -> None; they set e.names[node] (a tuple for multi-output ops)
def _conv(e, n, x, w, b, res, stride, padding, dilation, groups, act, params, transposed=False, out_pad=()):
    dtype, path = _val(n).dtype, _path(n) or n.name
    if dtype == torch.bfloat16 and e.opset < 22:
        raise UnsupportedOpError(n.target, n.name, "bfloat16 Conv needs opset >= 22")
    attrs = dict(strides=_ints(stride), pads=_ints(padding) * 2, dilations=_ints(dilation), group=int(groups),
                 kernel_shape=_ints(_val(w).shape[2:]), **({"output_padding": _ints(out_pad)} if transposed else {}))
    ins = [e.ref(x), e.ref(w, hint=f"{path}.weight")] + ([e.ref(b, hint=f"{path}.bias")] if b is not None else [])
    y = e.emit(n, "ConvTranspose" if transposed else "Conv", ins, n.name if res is None and act == "none" else None,
               **attrs)
    if res is not None:
        y = e.emit(n, "Add", [y, e.ref(res)], n.name if act == "none" else None)
    e.names[n] = e.activation(n, y, act, params, dtype, n.name) if act != "none" else y


def h_fused_conv(e, n):
    _conv(e, n, *n.args[:10])


def h_convolution(e, n):
    x, w, b, stride, padding, dilation, transposed, out_pad, groups = n.args
    _conv(e, n, x, w, b, None, stride, padding, dilation, groups, "none", [], bool(transposed), out_pad)


def h_fused_linear(e, n):
    x, w, b, act, params = n.args
    path = _path(n) or n.name
    ins = [e.ref(x), e.ref(w, hint=f"{path}.weight")] + ([e.ref(b, hint=f"{path}.bias")] if b is not None else [])
    y = e.emit(n, "Gemm", ins, n.name if act == "none" else None, transB=1)
    e.names[n] = e.activation(n, y, act, params, _val(n).dtype, n.name) if act != "none" else y


def h_addmm(e, n):
    b, x, y = n.args[:3]
    e.names[n] = e.emit(n, "Gemm", [e.ref(x), e.ref(y), e.ref(b)], n.name,
                        alpha=float(n.kwargs.get("alpha", 1)), beta=float(n.kwargs.get("beta", 1)))


def h_alias(e, n):
    e.names[n] = e.ref(n.args[0])


def h_cast(e, n):
    if _val(n.args[0]).dtype == _val(n).dtype:  # layout or device conversions: nothing in ONNX
        return h_alias(e, n)
    e.names[n] = e.emit(n, "Cast", [e.ref(n.args[0])], n.name, to=DTYPES[_val(n).dtype])


def h_reshape(e, n):
    x = n.args[0]
    shape = _ints(_val(n).shape)
    e.keep_batch(n, x, bool(shape) and shape[0] == _val(x).shape[0], "this reshape")
    if e.dynamic and e.batch.get(x, False):
        shape[0] = -1
    e.names[n] = e.emit(n, "Reshape", [e.ref(x), e.ints(shape)], n.name)


def h_squeeze(e, n):
    x, shape = n.args[0], _ints(_val(n.args[0]).shape)
    dims = n.args[1] if len(n.args) > 1 else range(len(shape))
    axes = sorted({d % len(shape) for d in ([dims] if isinstance(dims, int) else dims) if shape[d] == 1})
    e.keep_batch(n, x, 0 not in axes, "squeezing dim 0")
    e.names[n] = e.emit(n, "Squeeze", [e.ref(x), e.ints(axes)], n.name) if axes else e.ref(x)


def h_unsqueeze(e, n):
    x, d = n.args[0], n.args[1] % _val(n).dim()
    e.keep_batch(n, x, d != 0, "unsqueezing at dim 0")
    e.names[n] = e.emit(n, "Unsqueeze", [e.ref(x), e.ints([d])], n.name)


def h_permute(e, n):
    x, rank = n.args[0], _val(n.args[0]).dim()
    perm = list(range(rank))
    if n.target is aten.permute.default:
        perm = [d % rank for d in n.args[1]]
    elif rank >= 2:  # t / transpose
        a, b = (n.args[1] % rank, n.args[2] % rank) if n.target is aten.transpose.int else (0, 1)
        perm[a], perm[b] = perm[b], perm[a]
    e.keep_batch(n, x, not perm or perm[0] == 0, "this transpose")
    e.names[n] = e.emit(n, "Transpose", [e.ref(x)], n.name, perm=perm)


def h_cat(e, n):
    dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % _val(n).dim()
    for t in n.args[0]:
        e.keep_batch(n, t, dim != 0, "concatenation along dim 0")
    e.names[n] = e.emit(n, "Concat", [e.ref(t) for t in n.args[0]], n.name, axis=dim)


_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div"}
_UNARY = {aten.neg.default: "Neg", aten.exp.default: "Exp", aten.sqrt.default: "Sqrt", aten.abs.default: "Abs",
          aten.reciprocal.default: "Reciprocal", aten.log.default: "Log", aten.erf.default: "Erf",
          aten.mm.default: "MatMul", aten.bmm.default: "MatMul"}


def h_binary(e, n):
    dtype = _val(n).dtype
    if n.kwargs.get("rounding_mode") is not None:
        raise UnsupportedOpError(n.target, n.name, f"rounding_mode={n.kwargs['rounding_mode']!r}")
    ins = []
    for a in n.args[:2]:
        v = _val(a)
        ins.append(e.ref(a, dtype=dtype))
        if isinstance(v, torch.Tensor) and v.dtype != dtype:
            ins[-1] = e.emit(n, "Cast", [ins[-1]], to=DTYPES[dtype])
        e.keep_batch(n, a, isinstance(v, torch.Tensor) and v.dim() == _val(n).dim(), "broadcasting")
    if n.kwargs.get("alpha", 1) != 1:
        ins[1] = e.emit(n, "Mul", [ins[1], e.scalar(n.kwargs["alpha"], dtype)])
    e.names[n] = e.emit(n, _BINARY[n.target.__name__.split(".")[0]], ins, n.name)


def h_unary(e, n):  # single-op translations, and rsqrt
    ins = [e.ref(a) for a in n.args if isinstance(a, fx.Node)]
    if n.target is aten.rsqrt.default:
        ins = [e.emit(n, "Sqrt", ins)]
    e.names[n] = e.emit(n, _UNARY.get(n.target, "Reciprocal"), ins, n.name)


def h_activation(e, n):
    name, params = ACTIVATION_OPS[n.target](n)
    e.names[n] = e.activation(n, e.ref(n.args[0]), name, params, _val(n).dtype, n.name)


def h_clamp(e, n):
    lo = n.args[1] if len(n.args) > 1 else n.kwargs.get("min")
    hi = n.args[2] if len(n.args) > 2 else n.kwargs.get("max")
    lo, hi = (None, lo) if n.target is aten.clamp_max.default else (lo, hi)
    if any(isinstance(_val(b), torch.Tensor) for b in (lo, hi)):
        raise UnsupportedOpError(n.target, n.name, "tensor bounds")
    dtype = _val(n).dtype
    e.names[n] = e.emit(n, "Clip", [e.ref(n.args[0]), e.ref(lo, dtype), e.ref(hi, dtype)], n.name)


def _pool_attrs(e, n, x, kernel, stride, padding, dilation, ceil):
    nd = 3 if "3d" in str(n.target) else 1 if "1d" in str(n.target) else 2

    def expand(v, default):
        v = default if v is None or v == [] else v
        v = [v] if isinstance(v, int) else list(v)
        return _ints(v * nd if len(v) == 1 else v)

    k = expand(kernel, None)
    s, p, d = expand(stride, k), expand(padding, 0), expand(dilation, 1)
    out = _val(n)[0] if isinstance(_val(n), (tuple, list)) else _val(n)
    sizes, want = _ints(_val(x).shape[-nd:]), _ints(out.shape[-nd:])
    got = {c: [(num + (st - 1 if c else 0)) // st + 1 for num, st in
               ((si + 2 * pi - di * (ki - 1) - 1, st) for si, ki, st, pi, di in zip(sizes, k, s, p, d))]
           for c in (False, True)}
    if got[bool(ceil)] != want:
        raise UnsupportedOpError(n.target, n.name, f"ceil_mode output size {want} differs from ONNX's {got[True]}")
    return dict(kernel_shape=k, strides=s, pads=p * 2, ceil_mode=int(bool(ceil) and got[False] != want)), d


def h_max_pool(e, n):
    x, kernel, stride, padding, dilation, ceil = (list(n.args) + [None] * 4)[:6]
    attrs, d = _pool_attrs(e, n, x, kernel, stride, padding, dilation, ceil)
    y = e.emit(n, "MaxPool", [e.ref(x)], n.name, dilations=d, **attrs)
    e.names[n] = (y, None) if "with_indices" in str(n.target) else y


def h_avg_pool(e, n):
    x, kernel, stride, padding, ceil, include_pad, divisor = (list(n.args) + [None] * 5)[:7]
    attrs, _ = _pool_attrs(e, n, x, kernel, stride, padding, None, ceil)
    if divisor is not None or attrs["ceil_mode"]:
        raise UnsupportedOpError(n.target, n.name, "divisor_override, or ceil_mode with partial windows "
                                 "(their divisors differ from ONNX's)")
    e.names[n] = e.emit(n, "AveragePool", [e.ref(x)], n.name, count_include_pad=int(include_pad is not False),
                        **attrs)


def _adaptive_matrix(n_in: int, n_out: int, dtype) -> torch.Tensor:
    """P such that x @ P is PyTorch's adaptive average pooling of x's last dim (n_in -> n_out)."""
    p = torch.zeros(n_in, n_out, dtype=torch.float64)
    for j in range(n_out):
        lo, hi = (j * n_in) // n_out, -((-(j + 1) * n_in) // n_out)
        p[lo:hi, j] = 1.0 / (hi - lo)
    return p.to(dtype)


def h_adaptive_avg_pool(e, n):
    x, nd = n.args[0], 3 if "3d" in str(n.target) else 2
    out, sizes, dtype, y = _ints(_val(n).shape[-nd:]), _ints(_val(x).shape[-nd:]), _val(n).dtype, e.ref(n.args[0])
    if out == [1] * nd and _val(x).dim() == nd + 2:
        e.names[n] = e.emit(n, "GlobalAveragePool", [y], n.name)
    elif all(s % o == 0 for s, o in zip(sizes, out)):
        k = [s // o for s, o in zip(sizes, out)]
        e.names[n] = e.emit(n, "AveragePool", [y], n.name, kernel_shape=k, strides=k)
    elif nd > 2:
        raise UnsupportedOpError(n.target, n.name, "uneven adaptive pooling in 3-D")
    else:  # uneven bins: one pooling matrix per axis, y = P_h^T @ x @ P_w
        w_steps = sizes[1] != out[1]
        if w_steps:
            pw = e.init(_adaptive_matrix(sizes[1], out[1], dtype), f"{n.name}.pool_w")
            y = e.emit(n, "MatMul", [y, pw], n.name if sizes[0] == out[0] else None)
        if sizes[0] != out[0]:
            ph = e.init(_adaptive_matrix(sizes[0], out[0], dtype).t().contiguous(), f"{n.name}.pool_h")
            y = e.emit(n, "MatMul", [ph, y], n.name)
        e.names[n] = y


def h_reduce(e, n):
    """mean/sum over dims. The mean over both spatial dims of a 4-D tensor (adaptive average pooling
    to 1x1) is GlobalAveragePool, as torch.onnx writes it. Other fp16/bf16 reductions run in fp32
    (Cast, reduce, Cast back): PyTorch accumulates them in fp32, and ORT's CUDA EP, reducing in the
    16-bit type, overflows to inf where eager does not (ResNet-50 fp16 gave NaN everywhere)."""
    x, dims = n.args[0], n.args[1] if len(n.args) > 1 else None
    keep = int(bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)))
    rank = _val(x).dim()
    dtype = _val(x).dtype
    if n.kwargs.get("dtype") not in (None, dtype):
        raise UnsupportedOpError(n.target, n.name, f"dtype={n.kwargs['dtype']}")
    axes = sorted(d % rank for d in (dims or range(rank)))
    e.batch[n] = e.batch.get(x, False) and 0 not in axes
    op = "ReduceMean" if n.target is aten.mean.dim else "ReduceSum"
    if op == "ReduceMean" and rank == 4 and axes == [2, 3]:
        y = e.emit(n, "GlobalAveragePool", [e.ref(x)], n.name if keep else None)
        e.names[n] = y if keep else e.emit(n, "Squeeze", [y, e.ints(axes)], n.name)
        return
    src, wide = e.ref(x), dtype in (torch.float16, torch.bfloat16)
    if wide:
        src = e.emit(n, "Cast", [src], to=DTYPES[torch.float32])
    name = None if wide else n.name
    if op == "ReduceMean" and e.opset < 18:
        y = e.emit(n, op, [src], name, axes=axes, keepdims=keep)
    else:
        y = e.emit(n, op, [src, e.ints(axes)], name, keepdims=keep)
    e.names[n] = e.emit(n, "Cast", [y], n.name, to=DTYPES[dtype]) if wide else y


def h_pad(e, n):
    x, pad = n.args[:2]
    value = n.args[2] if len(n.args) > 2 else n.kwargs.get("value", 0)
    rank = _val(x).dim()
    begin, end = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):
        begin[rank - 1 - i], end[rank - 1 - i] = int(pad[2 * i]), int(pad[2 * i + 1])
    e.keep_batch(n, x, begin[0] == end[0] == 0, "padding dim 0")
    e.names[n] = e.emit(n, "Pad", [e.ref(x), e.ints(begin + end), e.scalar(value, _val(n).dtype)], n.name)


def h_batch_norm(e, n):  # an inference BatchNorm fold_batchnorm left: Mul + Add with folded constants
    x, w, b, mean, var, _momentum, eps = n.args
    if not all(a is None or e.const[a] for a in (w, b, mean, var)):
        raise UnsupportedOpError(n.target, n.name, "BatchNorm statistics are not constants")
    scale = torch.rsqrt(e.value(var).double() + eps) * (e.value(w).double() if w is not None else 1)
    shift = (e.value(b).double() if b is not None else 0) - e.value(mean).double() * scale
    shape, dtype, path = [-1] + [1] * (_val(x).dim() - 2), _val(x).dtype, _path(n) or n.name
    y = e.emit(n, "Mul", [e.ref(x), e.init(scale.reshape(shape).to(dtype), f"{path}.bn_scale")])
    e.names[n] = (e.emit(n, "Add", [y, e.init(shift.reshape(shape).to(dtype), f"{path}.bn_shift")], n.name), None, None)


def h_getitem(e, n):
    src, i = n.args
    parts = e.names.get(src)
    if not isinstance(parts, tuple) or parts[i] is None:
        raise UnsupportedOpError(f"{src.target}[{i}]", n.name, "this output has no ONNX translation")
    e.names[n] = parts[i]


HANDLERS = {
    FUSED_CONV: h_fused_conv, FUSED_LINEAR: h_fused_linear, aten.convolution.default: h_convolution,
    aten.addmm.default: h_addmm, aten.clone.default: h_alias, aten.alias.default: h_alias,
    aten.detach.default: h_alias, aten._to_copy.default: h_cast, prims.convert_element_type.default: h_cast,
    aten.view.default: h_reshape, aten._unsafe_view.default: h_reshape, aten.reshape.default: h_reshape,
    aten.squeeze.dim: h_squeeze, aten.squeeze.dims: h_squeeze, aten.squeeze.default: h_squeeze,
    aten.unsqueeze.default: h_unsqueeze, aten.permute.default: h_permute, aten.t.default: h_permute,
    aten.transpose.int: h_permute, aten.cat.default: h_cat,
    aten.clamp.default: h_clamp, aten.clamp_min.default: h_clamp, aten.clamp_max.default: h_clamp,
    aten.max_pool2d_with_indices.default: h_max_pool, aten.max_pool2d.default: h_max_pool,
    aten.max_pool1d.default: h_max_pool, aten.max_pool3d_with_indices.default: h_max_pool,
    aten.avg_pool2d.default: h_avg_pool, aten.avg_pool1d.default: h_avg_pool, aten.avg_pool3d.default: h_avg_pool,
    aten._adaptive_avg_pool2d.default: h_adaptive_avg_pool, aten._adaptive_avg_pool3d.default: h_adaptive_avg_pool,
    aten.mean.dim: h_reduce, aten.sum.dim_IntList: h_reduce, aten.constant_pad_nd.default: h_pad,
    aten._native_batch_norm_legit_no_training.default: h_batch_norm, operator.getitem: h_getitem,
    aten.rsqrt.default: h_unary, **{op: h_unary for op in _UNARY}, **{op: h_activation for op in ACTIVATION_OPS},
    **{getattr(getattr(aten, b), v): h_binary for b in _BINARY for v in ("Tensor", "Scalar")},
}
