"""Generated-kernel candidates for a ``fxopt::fused_conv`` node (``act(conv(x, w) + bias (+ residual))``).

Run as PyTorch would, the bias add after cuDNN is a broadcasting elementwise kernel (slow on
channels_last outputs) and each further step is one more pass over the activation. The candidates
(each an object with ``sources`` to compile, ``kernels`` filled by the executor, and a ``__call__``
with the node's own signature that returns ``None`` where the tensors it gets at run time do not fit
what it was generated for, so that the reference runs):

- ``plan_conv_epilogue`` -> ``GeneratedEpilogue``: conv without bias, then ONE generated kernel
  (``codegen.generate_pointwise``, 16-byte vector loads where alignment allows) applying bias,
  residual and activation in place on the conv output.
- ``cudnn_conv_relu``: ``aten.cudnn_convolution_relu`` / ``cudnn_convolution_add_relu`` for ReLU
  epilogues (a library candidate, nothing to compile).
- ``plan_depthwise`` -> ``DepthwiseConv``: groups == C_in == C_out, kernel 1..7, stride 1..2,
  algorithm ``direct``: one direct depthwise kernel with bias, residual and activation fused (cuDNN
  runs such a conv and its epilogue as two kernels). It reads the conv weight (C, 1, KH, KW) as it
  is, so folded weights refreshed in place are seen by CUDA graph replays. On channels_last tensors
  also ``plan_depthwise_vec`` (one pixel x a 16-byte channel vector per thread) and, where that
  kernel has threads to spare, ``plan_depthwise_rows`` (several pixels of a row per thread, each
  input column loaded once for all of them: ``codegen/depthwise_conv.py``).
- ``plan_grouped_conv`` -> ``GroupedConv``: a grouped conv (not depthwise) on channels_last tensors,
  algorithm ``direct`` or chosen automatically: one direct kernel per conv with the epilogue fused
  (``codegen/grouped_conv.py``), in two channels-per-thread variants (a third with two pixels per
  thread where the grid has threads to spare). For some group widths cuDNN
  runs a grouped conv as transforms around its GEMM (RegNet's 24 channels per group: seven kernels).
- ``plan_direct_conv`` -> ``DirectConv``: convs with a small reduction (C_in <= 16, C_out <= 128,
  C_in*KH*KW <= 512, groups 1: stems and small CNNs; wider convs are GEMMs that cuDNN runs better,
  and each candidate costs an NVRTC compilation and a measurement), algorithm ``direct`` or one chosen
  automatically (measured against it; never where the user forced an algorithm): one generated
  direct convolution with the epilogue fused (``codegen/direct_conv.py``), in two output-channel
  tilings; with few output pixels (a small batch, where a thread's serial reduction is the time)
  the smallest tiling also with each output's input channels split over 2-8 lanes of a warp.
- ``plan_conv_in_nchw`` -> ``conv_in_nchw``: a depthwise conv with a large kernel
  (``conv_algorithms.channels_first_candidate``: ConvNeXt, large-kernel CNNs) in a channels_last graph, computed channels-first (input,
  weight and residual converted, the result converted back): the layout chosen for that conv alone,
  measured with its conversions against the conv as the layout pass left it. Nothing to compile.
- ``plan_conv_maxpool``: a ``max_pool2d_with_indices`` whose indices nobody reads, fed by such a
  conv (no residual) used only there: the conv, its epilogue and the pool as one kernel; measured
  against the pair as chosen separately (``conv_maxpool_chain``) by ``groups.fuse_conv_maxpool``.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen import Epilogue, layout_name, needs_index64
from fxopt.backends.cuda.codegen.direct_conv import (MAX_CIN, MAX_COUT, MAX_REDUCTION, MAX_UNROLLED, SMEM_FLOATS,
                                                     cout_tile, generate_direct_conv2d, split_lanes)
from fxopt.backends.cuda.codegen.depthwise_conv import generate_depthwise_conv2d_nhwc_rows
from fxopt.backends.cuda.codegen.grouped_conv import channel_tile, generate_grouped_conv2d_nhwc
from fxopt.backends.cuda.schedule import TemplateCandidate, dense_strides, ints, node_val
from fxopt.backends.cuda.runtime.launch import (launch_depthwise_conv2d, launch_direct_conv2d, launch_pointwise,
                                                memory_layout_ok, pool2d_output_size, vector_width_ok, weight_fits,
                                                weight_layout_of)
from fxopt.backends.conv_algorithms import channels_first_candidate
from fxopt.ops import conv_by_algorithm, conv_sig_of, fused_conv_ref

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------- epilogue after cuDNN
def cudnn_conv_relu(x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                    algorithm="direct", prepacked=None):
    """fused_conv with a ReLU epilogue, as one cuDNN fused operator."""
    if residual is None:
        return torch.ops.aten.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
    return torch.ops.aten.cudnn_convolution_add_relu(x, weight, residual, 1.0, bias, stride, padding, dilation,
                                                     groups)


class GeneratedEpilogue:
    """conv without bias, then one generated kernel: out = act(y + bias[c] + residual), in place."""

    def __init__(self, name: str, dtype: torch.dtype, layout: str, has_bias: bool, has_residual: bool,
                 activation: str, act_params, vector_width: int, fast_math: bool = False):
        from fxopt.backends.cuda.codegen import PointwiseOp, PointwiseRegion, TensorArg, generate_pointwise

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


# ---------------------------------------------------------------------------- one conv channels-first


def plan_conv_in_nchw(node: fx.Node) -> bool:
    """Whether ``conv_in_nchw`` is a candidate for this node: a conv run by the library (``direct``)
    whose input and output are channels_last and that ``channels_first_candidate`` names (a
    depthwise conv with a large kernel; the layout pass chose channels_last for the whole graph)."""
    if node.op != "call_function" or node.target is not fused_conv_ref:
        return False
    x, w, out = node_val(node.args[0]), node_val(node.args[1]), node.meta.get("val")
    if x is None or w is None or out is None or x.dim() != 4 or out.dtype not in _DTYPES:
        return False  # only 2-D convolutions in fp32/fp16/bf16
    if node.args[10] != "direct" or not isinstance(node.args[7], int) or layout_name(out) != "nhwc":
        return False  # another algorithm, or a channels-first result: nothing to choose
    return channels_first_candidate(conv_sig_of(x, w, *node.args[4:8]))


def conv_in_nchw(x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None):
    """fused_conv computed channels-first, the result handed back channels_last. The weight is
    converted at each call, so folded weights refreshed in place are seen."""
    res = None if residual is None else residual.contiguous()
    y = fused_conv_ref(x.contiguous(), weight.contiguous(), bias, res, stride, padding, dilation, groups,
                       activation, act_params, algorithm, None)
    return y.contiguous(memory_format=torch.channels_last)


#: threads of a one-pixel-per-thread kernel (output pixels x channel vectors) from which variants with
#: more pixels per thread are measured too: below, fewer threads would leave SMs idle
MANY_THREADS = 1 << 16


# ---------------------------------------------------------------------------- depthwise conv
class DepthwiseConv(TemplateCandidate):
    def __init__(self, node: fx.Node, layout: str, out: torch.Tensor, k, stride, padding, dilation):
        from fxopt.backends.cuda.codegen import generate_depthwise_conv2d

        bias, res, act, act_params = node.args[2], node.args[3], node.args[8], node.args[9]
        activation = None if act == "none" else (act, tuple(act_params))
        self.epilogue = Epilogue(bias is not None, res is not None, activation)
        self.layout, self.out_meta = layout, out
        self.k, self.stride, self.padding, self.dilation = k, stride, padding, dilation
        self.x_shape = tuple(node_val(node.args[0]).shape[1:])
        super().__init__(f"dw_{node.name}", generate_depthwise_conv2d(
            k, stride, padding, out.dtype, layout, self.epilogue, dilation, weight_layout="ckk"))

    def __call__(self, x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None):
        if self.kernel is None or not memory_layout_ok(x, self.layout) or not _ckk(weight):
            return None  # not the layout this kernel was generated for: the reference runs
        if tuple(x.shape[1:]) != self.x_shape or x.dtype != self.out_meta.dtype or weight.dtype != x.dtype:
            return None
        if residual is not None and not memory_layout_ok(residual, self.layout):
            return None
        out = torch.empty_strided((x.shape[0], *self.out_meta.shape[1:]),
                                  dense_strides(self.layout, (x.shape[0], *self.out_meta.shape[1:])),
                                  dtype=x.dtype, device=x.device)
        return launch_depthwise_conv2d(self.sources[0], x, weight, out, bias, residual, kernel=self.kernel)


class _DepthwiseNhwc(TemplateCandidate):
    """A channels_last depthwise conv kernel with every size compiled in: ``source`` for a fused_conv
    node, run where the tensors are what it was generated for (the input aligned to ``align`` bytes)."""

    def __init__(self, name: str, node: fx.Node, out: torch.Tensor, align: int, generate):
        bias, res, act, act_params = node.args[2], node.args[3], node.args[8], node.args[9]
        self.epilogue = Epilogue(bias is not None, res is not None, None if act == "none" else (act, tuple(act_params)))
        self.x_shape, self.out_shape, self.dtype = tuple(node_val(node.args[0]).shape), tuple(out.shape), out.dtype
        self.align = align
        n, c, h, w = self.x_shape
        super().__init__(name, generate(n, c, h, w, out.shape[2], out.shape[3], self.epilogue))

    def __call__(self, x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None):
        if self.kernel is None or not x.is_cuda or tuple(x.shape) != self.x_shape or x.dtype != self.dtype:
            return None
        if not memory_layout_ok(x, "nhwc") or not _ckk(weight) or weight.dtype != x.dtype or x.data_ptr() % self.align:
            return None
        return _launch_nhwc(self, self.epilogue, self.out_shape, x, weight, bias, residual)


class DepthwiseConvVec(_DepthwiseNhwc):
    """NHWC depthwise conv: one output pixel x 8 (fp16/bf16) or 4 (fp32) channels per thread, 16-byte
    vector loads, weights staged in shared memory (``codegen.generate_depthwise_conv2d_nhwc_vec``)."""
    label = "depthwiseconv_vec"

    def __init__(self, node: fx.Node, out: torch.Tensor, k, stride, padding, dilation):
        from fxopt.backends.cuda.codegen import generate_depthwise_conv2d_nhwc_vec

        super().__init__(f"dwv_{node.name}", node, out, 16, lambda n, c, h, w, oh, ow, epi: (
            generate_depthwise_conv2d_nhwc_vec(n, c, h, w, oh, ow, k, stride, padding, dilation, out.dtype, epi)))


class DepthwiseConvRows(_DepthwiseNhwc):
    """NHWC depthwise conv, ``tw`` output pixels of a row x ``vec`` channels per thread, each input
    column loaded once per kernel row for all of them (``codegen/depthwise_conv.py``)."""

    def __init__(self, node: fx.Node, out: torch.Tensor, k, stride, padding, dilation, vec: int, tw: int):
        self.label = f"depthwiseconv_rows_v{vec}w{tw}"
        super().__init__(f"dwr_{node.name}_v{vec}w{tw}", node, out, vec * out.dtype.itemsize,
                         lambda n, c, h, w, oh, ow, epi: generate_depthwise_conv2d_nhwc_rows(
                             n, c, h, w, oh, ow, k, stride, padding, dilation, out.dtype, epi, vec, tw))


def _launch_nhwc(cand: TemplateCandidate, epi: Epilogue, out_shape: tuple, x, weight, bias, residual):
    """Launch a channels_last conv template (its grid in the source's meta) with a new NHWC output of
    ``out_shape``, after checking the epilogue's operands: present as compiled, of x's dtype, dense
    (None where not: the reference runs)."""
    if (bias is not None) != epi.bias or (residual is not None) != epi.residual:
        return None
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return None
    if residual is not None and (not memory_layout_ok(residual, "nhwc") or residual.dtype != x.dtype
                                 or tuple(residual.shape) != out_shape):
        return None
    out = torch.empty_strided(out_shape, dense_strides("nhwc", out_shape), dtype=x.dtype, device=x.device)
    if out.numel():
        ks = cand.sources[0]
        cand.kernel.launch(ks.meta["grid"], ks.block, [x, weight] + [t for t in (bias, residual) if t is not None]
                           + [out])
    return out


def _ckk(w: torch.Tensor) -> bool:
    """A (C, 1, KH, KW) weight whose memory is (C, KH, KW) dense (contiguous or channels_last)."""
    c, _, kh, kw = w.shape
    return (w.stride(3) == 1 or kw == 1) and (w.stride(2) == kw or kh == 1) and (w.stride(0) == kh * kw or c == 1)


def _depthwise_spec(node: fx.Node) -> Optional[dict]:
    """What the depthwise kernels need of a fused_conv node: a plain depthwise 2-D conv (channel
    multiplier 1) in fp32/fp16/bf16 with static sizes, algorithm ``direct``, a kernel up to 7 and a
    stride up to 2, input and output in one layout; keys layout, out, k, stride, padding, dilation."""
    if node.op != "call_function" or node.target is not fused_conv_ref:
        return None
    x, w, out = node_val(node.args[0]), node_val(node.args[1]), node.meta.get("val")
    if x is None or w is None or out is None or x.dim() != 4 or out.dtype not in _DTYPES:
        return None  # only 2-D convolutions in fp32/fp16/bf16
    if not all(isinstance(d, int) for d in (*x.shape[1:], *w.shape, *out.shape[1:])):
        return None  # symbolic sizes
    groups, algorithm = node.args[7], node.args[10]
    if algorithm != "direct" or not isinstance(groups, int) or w.shape[1] != 1:
        return None  # not a plain depthwise conv
    if not (groups == x.shape[1] == w.shape[0] == out.shape[1]):
        return None  # channel multiplier != 1
    k, stride, padding, dilation = ints(w.shape[2:]), ints(node.args[4]), ints(node.args[5]), ints(node.args[6])
    if None in (k, stride, padding, dilation) or max(k) > 7 or max(stride) > 2:
        return None  # outside the templates' range
    layout = layout_name(out)
    if layout is None or layout_name(x) != layout:
        return None
    for t in (node.args[2], node.args[3]):
        if t is not None and (node_val(t) is None or node_val(t).dtype != out.dtype):
            return None
    return {"layout": layout, "out": out, "k": k, "stride": stride, "padding": padding, "dilation": dilation}


def plan_depthwise(node: fx.Node) -> Optional[DepthwiseConv]:
    d = _depthwise_spec(node)
    if d is None:
        return None
    return DepthwiseConv(node, d["layout"], d["out"], d["k"], d["stride"], d["padding"], d["dilation"])


def _depthwise_nhwc_spec(node: fx.Node) -> Optional[dict]:
    """``_depthwise_spec`` where the layout is channels_last, the channels a multiple of a 16-byte
    vector and the batch static (the vectorized kernels' domain)."""
    d = _depthwise_spec(node)
    if d is None or d["layout"] != "nhwc":
        return None
    x, out = node_val(node.args[0]), d["out"]
    if x.shape[1] % (16 // out.dtype.itemsize) or not isinstance(x.shape[0], int):
        return None
    return d


def plan_depthwise_vec(node: fx.Node) -> Optional[DepthwiseConvVec]:
    """The vectorized NHWC variant of a depthwise conv (``_depthwise_nhwc_spec``)."""
    d = _depthwise_nhwc_spec(node)
    if d is None:
        return None
    return DepthwiseConvVec(node, d["out"], d["k"], d["stride"], d["padding"], d["dilation"])


def plan_depthwise_rows(node: fx.Node) -> list[DepthwiseConvRows]:
    """Row-tiled variants of a vectorized NHWC depthwise conv, where its one-pixel kernel would have
    threads to spare (``MANY_THREADS``): 8-byte channel vectors for 4 and for 8 pixels per thread, and
    4-byte ones for 8 pixels (wide, small images: more threads). 16-byte vectors, with twice the
    registers per thread, were slower than these on every conv measured. [] elsewhere (at small sizes
    the one-pixel kernel's parallelism wins, and each variant costs a compilation and a measurement)."""
    d = _depthwise_nhwc_spec(node)
    if d is None:
        return []
    out = d["out"]
    n, c, oh, ow = (int(s) for s in out.shape)
    full = 16 // out.dtype.itemsize
    if n * oh * ow * c // full < 2 * MANY_THREADS or ow < 4:
        return []
    return [DepthwiseConvRows(node, out, d["k"], d["stride"], d["padding"], d["dilation"], v, tw)
            for v, tw in ((full // 2, 4), (full // 2, 8), (full // 4, 8))]


# ---------------------------------------------------------------------------- grouped conv
def _conv_args(node: fx.Node) -> Optional[dict]:
    """What every generated conv kernel needs of a fused_conv node, where one may compete: a 2-D conv
    in fp32/fp16/bf16 throughout (bias and residual too) with static sizes, run by ``direct`` or by an
    algorithm chosen automatically (measured against; never one the user forced). Keys: x, w, out (the
    values), groups, k, stride, padding, dilation, epilogue; None otherwise."""
    if node.op != "call_function" or node.target is not fused_conv_ref or len(node.args) < 11:
        return None
    x, w, out = node_val(node.args[0]), node_val(node.args[1]), node.meta.get("val")
    if x is None or w is None or out is None or x.dim() != 4 or w.dim() != 4 or out.dtype not in _DTYPES:
        return None  # only 2-D convolutions in fp32/fp16/bf16
    if not all(isinstance(d, int) for d in (*x.shape, *w.shape, *out.shape)):
        return None  # symbolic sizes
    if w.dtype != x.dtype or out.dtype != x.dtype:
        return None  # mixed dtypes
    if node.args[10] != "direct" and node.meta.get("fxopt_conv_algorithm_how", "forced").startswith("forced"):
        return None  # an algorithm the user asked for; one chosen automatically is measured against
    k, stride, padding, dilation = ints(w.shape[2:]), ints(node.args[4]), ints(node.args[5]), ints(node.args[6])
    if None in (k, stride, padding, dilation):
        return None
    for t in (node.args[2], node.args[3]):
        if t is not None and (node_val(t) is None or node_val(t).dtype != out.dtype):
            return None  # a bias or residual of another dtype
    act = node.args[8]
    return {"x": x, "w": w, "out": out, "groups": node.args[7], "k": k, "stride": stride, "padding": padding,
            "dilation": dilation, "epilogue": Epilogue(node.args[2] is not None, node.args[3] is not None,
                                                       None if act == "none" else (act, tuple(node.args[9])))}


class GroupedConv(TemplateCandidate):
    """NHWC grouped conv with every size compiled in: one output pixel x ``cot`` channels of a group
    per thread, the block's weights in shared memory, the epilogue fused
    (``codegen/grouped_conv.py``)."""

    def __init__(self, node: fx.Node, spec: dict, cot: int, ppt: int = 1):
        tag = f"t{cot}" + (f"p{ppt}" if ppt > 1 else "")
        self.label = f"groupedconv_{tag}"
        self.spec = spec
        n, cin, h, w = spec["x_shape"]
        self.out_shape = spec["out_shape"]
        super().__init__(f"gconv_{node.name}_{tag}", generate_grouped_conv2d_nhwc(
            n, cin, spec["cout"], spec["groups"], h, w, self.out_shape[2], self.out_shape[3], spec["k"],
            spec["stride"], spec["padding"], spec["dilation"], spec["dtype"], spec["epilogue"],
            spec["weight_layout"], cot, ppt))

    def __call__(self, x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None):
        s, epi = self.spec, self.spec["epilogue"]
        if self.kernel is None or not x.is_cuda or tuple(x.shape) != s["x_shape"] or x.dtype != s["dtype"]:
            return None
        if not memory_layout_ok(x, "nhwc") or x.data_ptr() % 16 or weight.dtype != x.dtype:
            return None
        if tuple(weight.shape) != s["w_shape"] or not weight_fits(weight, s["weight_layout"]):
            return None
        return _launch_nhwc(self, epi, self.out_shape, x, weight, bias, residual)


def _grouped_spec(node: fx.Node) -> Optional[dict]:
    """What ``GroupedConv`` needs of a fused_conv node, or None where it does not apply."""
    c = _conv_args(node)
    if c is None:
        return None
    x, w, out, groups = c["x"], c["w"], c["out"], c["groups"]
    if not isinstance(groups, int) or groups < 2 or int(w.shape[1]) < 2:
        return None  # a dense conv, or a depthwise one (its own kernels)
    if layout_name(x) != "nhwc" or layout_name(out) != "nhwc" or weight_layout_of(w) is None:
        return None  # the kernel reads and writes channels_last tensors only
    return {"x_shape": tuple(int(d) for d in x.shape), "w_shape": tuple(int(d) for d in w.shape),
            "out_shape": tuple(int(d) for d in out.shape), "cout": int(w.shape[0]), "groups": groups,
            "k": c["k"], "stride": c["stride"], "padding": c["padding"], "dilation": c["dilation"],
            "dtype": out.dtype, "weight_layout": weight_layout_of(w), "epilogue": c["epilogue"]}


def plan_grouped_conv(node: fx.Node) -> list[GroupedConv]:
    """Grouped-conv candidates for a fused_conv node: ``cot`` = the largest power of two up to 8
    dividing the group's output channels, and half of it (twice the threads: small batches); with
    many threads also ``cot`` channels for two pixels per thread (each weight read from shared
    memory once for both). [] where none applies or one channel tile's weights exceed shared memory."""
    spec = _grouped_spec(node)
    if spec is None:
        return []
    cgo, red = spec["cout"] // spec["groups"], spec["w_shape"][1] * spec["k"][0] * spec["k"][1]
    cot = 8
    while cgo % cot:
        cot //= 2
    if not channel_tile(cgo, red, cot):
        return []
    n, _, oh, ow = spec["out_shape"]
    variants = [(cot, 1)] + [(cot // 2, 1)] * (cot > 1 and bool(channel_tile(cgo, red, cot // 2)))
    variants += [(cot, 2)] * (n * oh * ow * spec["cout"] // cot >= 2 * MANY_THREADS)
    return [GroupedConv(node, spec, c, p) for c, p in variants]


# ---------------------------------------------------------------------------- direct conv (+ max pool)
#: outputs (batch x pixels) up to which the split-channel variant is measured too: beyond, the grid
#: has enough threads to hide a thread's serial reduction, and the variant costs compile time
FEW_PIXELS = 1 << 14


def _conv_spec(node: fx.Node) -> Optional[dict]:
    """What the template needs of a fused_conv node, or None where it does not apply."""
    c = _conv_args(node)
    if c is None or c["groups"] != 1:
        return None  # see _conv_args; or grouped
    x, w, out, k = c["x"], c["w"], c["out"], c["k"]
    cin, cout = int(w.shape[1]), int(w.shape[0])
    if cin * k[0] * k[1] > MAX_REDUCTION or cin > MAX_CIN or cout > MAX_COUT:
        return None  # a wide conv: a GEMM that cuDNN runs better (and measuring it costs compile time)
    layout, wl = layout_name(out), weight_layout_of(w)
    if layout is None or layout_name(x) != layout or wl is None:
        return None
    return {"cin": cin, "cout": cout, "k": k, "stride": c["stride"], "padding": c["padding"],
            "dilation": c["dilation"], "layout": layout, "weight_layout": wl, "dtype": out.dtype,
            "x_shape": tuple(x.shape[1:]), "epilogue": c["epilogue"]}


class DirectConv:
    """Candidate for a fused_conv node (same signature); ``pool`` set: for the conv + max pool
    composite (``conv_maxpool_chain`` signature)."""

    def __init__(self, name: str, spec: dict, conv_size: tuple, tile: int, pool: Optional[tuple] = None,
                 split: int = 1):
        lanes = f"_split{split}" if split > 1 else ""
        self.name, self.spec, self.pool = f"{name}_t{tile}{lanes}", spec, pool
        self.label = f"directconv{'_maxpool' if pool else ''}_t{tile}{lanes}"
        self.conv_size = tuple(int(d) for d in conv_size)
        self.sources = {0: generate_direct_conv2d(
            spec["cin"], spec["cout"], spec["k"], spec["stride"], spec["padding"], spec["dilation"], spec["dtype"],
            spec["layout"], spec["epilogue"], spec["weight_layout"], pool, tile, split=split)}
        self.kernels: dict = {}

    def run(self, x, weight, bias, residual):
        s, ks, kernel = self.spec, self.sources[0], self.kernels.get(0)
        if kernel is None or not x.is_cuda or tuple(x.shape[1:]) != s["x_shape"] or x.dtype != s["dtype"]:
            return None
        if (not memory_layout_ok(x, s["layout"]) or weight.dtype != x.dtype
                or not weight_fits(weight, s["weight_layout"])):
            return None
        if (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous())) or (
                residual is not None and not memory_layout_ok(residual, s["layout"])):
            return None
        ch, cw = self.conv_size
        oh, ow = (ch, cw) if self.pool is None else pool2d_output_size(ch, cw, *self.pool[:3], self.pool[3])
        shape = (x.shape[0], s["cout"], oh, ow)
        out = torch.empty_strided(shape, dense_strides(s["layout"], shape), dtype=x.dtype, device=x.device)
        if needs_index64(max(x.numel(), out.numel(), x.shape[0] * s["cout"] * ch * cw)):
            return None
        return launch_direct_conv2d(ks, x, weight, out, bias, residual, (ch, cw), kernel)

    def __call__(self, x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None, *pool_args):
        return self.run(x, weight, bias, residual)


def _tiles(spec: dict, out: torch.Tensor) -> list[int]:
    """Two tile sizes to measure: the heuristic's (enough threads) and all channels (up to 16, as
    long as the unrolled reduction stays within ``MAX_UNROLLED``)."""
    n, _, oh, ow = (int(d) for d in out.shape)
    reduction = spec["cin"] * spec["k"][0] * spec["k"][1]
    full = min(spec["cout"], 16)
    while full > 1 and full * reduction > min(SMEM_FLOATS, MAX_UNROLLED):
        full = -(-full // 2)
    return sorted({cout_tile(n * oh * ow, spec["cout"], reduction), full})


def _variants(spec: dict, out: torch.Tensor) -> list[tuple[int, int]]:
    """(tile, split) candidates: each tile of ``_tiles``; with few output pixels (a small batch: a
    thread's serial reduction is the time) the smallest tile (most threads) also with its input
    channels split over ``split_lanes`` lanes."""
    tiles = _tiles(spec, out)
    n, _, oh, ow = (int(d) for d in out.shape)
    split = split_lanes(spec["cin"]) if n * oh * ow <= FEW_PIXELS else 1
    return [(t, 1) for t in tiles] + [(tiles[0], split)] * (split > 1)


def plan_direct_conv(node: fx.Node) -> list[DirectConv]:
    """Direct-conv candidates (the variants of ``_variants``) for a fused_conv node; [] where none applies."""
    spec = _conv_spec(node)
    if spec is None:
        return []
    out = node.meta["val"]
    return [DirectConv(f"dconv_{node.name}", spec, out.shape[2:], t, split=sp) for t, sp in _variants(spec, out)]


# ---------------------------------------------------------------------------- conv + max pool
def pool_params(node: fx.Node) -> Optional[tuple]:
    """(k, stride, padding, ceil_mode) of a max_pool2d_with_indices node whose indices are unused
    and whose dilation is 1, else None."""
    if node.op != "call_function" or node.target is not aten.max_pool2d_with_indices.default:
        return None
    if not node.users or any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        return None  # the indices are used
    args = list(node.args) + [None] * (6 - len(node.args))
    k = ints(args[1])
    stride = ints(args[2]) if args[2] else k
    padding = ints(args[3] if args[3] is not None else 0)
    dilation = ints(args[4] if args[4] is not None else 1)
    if None in (k, stride, padding) or dilation != (1, 1):
        return None
    if padding[0] > k[0] // 2 or padding[1] > k[1] // 2:
        return None  # eager raises; let it
    return k, stride, padding, bool(args[5]) if args[5] is not None else False


def conv_maxpool_chain(conv_impl, pool_impl):
    """The reference of the fused pair: the conv and the pool as the executor chose them."""
    def chain(x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
              algorithm, prepacked, kernel_size, pool_stride, pool_padding, pool_dilation, ceil_mode):
        y = conv_impl(x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                      algorithm, prepacked)
        return pool_impl(y, kernel_size, pool_stride, pool_padding, pool_dilation, ceil_mode)[0]

    chain.__name__ = "conv_maxpool_chain"
    return chain


def plan_conv_maxpool(pool: fx.Node) -> Optional[tuple[fx.Node, list[DirectConv]]]:
    """(conv node, fused candidates) for a max pool fed by an eligible conv used only there."""
    pp = pool_params(pool)
    conv = pool.args[0] if pp is not None else None
    if not isinstance(conv, fx.Node) or len(conv.users) != 1:
        return None
    spec = _conv_spec(conv)
    if spec is None or spec["epilogue"].residual:
        return None
    out = node_val(pool)
    out = out[0] if isinstance(out, (tuple, list)) else None
    if out is None or out.dtype != spec["dtype"]:
        return None
    conv_size = conv.meta["val"].shape[2:]
    return conv, [DirectConv(f"dconv_pool_{conv.name}", spec, conv_size, t, pool=pp, split=sp)
                  for t, sp in _variants(spec, out)]
