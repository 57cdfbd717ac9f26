"""Library candidates of a ``fxopt::fused_conv``: nothing to generate or compile.

- ``plan_cudnn_fused`` -> ``cudnn_conv_relu`` (candidate ``cudnn_fused``):
  ``aten.cudnn_convolution_relu`` / ``cudnn_convolution_add_relu`` for ReLU epilogues.
- ``plan_nchw`` -> ``conv_in_nchw`` (candidate ``nchw``, where ``plan_conv_in_nchw``): a depthwise conv with a large kernel
  (``conv_algorithms.channels_first_candidate``: ConvNeXt, large-kernel CNNs) in a channels_last
  graph, computed channels-first (input, weight and residual converted, the result converted back):
  the layout chosen for that conv alone, measured with its conversions against the conv as the
  layout pass left it."""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen.source import layout_name
from fxopt.backends.cuda.kernels.common import LibraryCandidate, node_val
from fxopt.backends.cuda.kernels.conv import CONV_DTYPES
from fxopt.conv_algorithms import channels_first_candidate
from fxopt.ops import conv_sig_of, fused_conv_ref


def cudnn_conv_relu(x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                    algorithm="direct", prepacked=None):
    """fused_conv with a ReLU epilogue, as one cuDNN fused operator."""
    if residual is None:
        return torch.ops.aten.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
    return torch.ops.aten.cudnn_convolution_add_relu(x, weight, residual, 1.0, bias, stride, padding, dilation,
                                                     groups)


#: few, wide groups: cuDNN's channels_last kernels for a conv of 2-8 groups slice each group's
#: channels out on every call (``nhwcSliceCKernel``), its channels-first kernels do not; the
#: channels-first candidate is measured against them (its conversions included)
FEW_GROUPS = range(2, 9)
#: input channels per group from which a group counts as wide
WIDE_GROUP = 16


def few_wide_groups(w: torch.Tensor, groups: int) -> bool:
    """A 2-D conv of 2-8 groups with at least ``WIDE_GROUP`` input channels each."""
    return groups in FEW_GROUPS and w.dim() == 4 and int(w.shape[1]) >= WIDE_GROUP


def plan_conv_in_nchw(node: fx.Node) -> bool:
    """Whether ``conv_in_nchw`` is a candidate for this node: a conv run by the library (``direct``)
    whose input and output are channels_last and that ``channels_first_candidate`` names (a
    depthwise conv with a large kernel; the layout pass chose channels_last for the whole graph)
    or that has few, wide groups (``few_wide_groups``)."""
    if node.op != "call_function" or node.target is not fused_conv_ref:
        return False
    x, w, out = node_val(node.args[0]), node_val(node.args[1]), node.meta.get("val")
    if x is None or w is None or out is None or x.dim() != 4 or out.dtype not in CONV_DTYPES:
        return False  # only 2-D convolutions in fp32/fp16/bf16
    if node.args[10] != "direct" or not isinstance(node.args[7], int) or layout_name(out) != "nhwc":
        return False  # another algorithm, or a channels-first result: nothing to choose
    return few_wide_groups(w, node.args[7]) or channels_first_candidate(conv_sig_of(x, w, *node.args[4:8]))


def conv_in_nchw(x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None):
    """fused_conv computed channels-first, the result handed back channels_last. The weight is
    converted at each call, so folded weights refreshed in place are seen."""
    res = None if residual is None else residual.contiguous()
    y = fused_conv_ref(x.contiguous(), weight.contiguous(), bias, res, stride, padding, dilation, groups,
                       activation, act_params, algorithm, None)
    return y.contiguous(memory_format=torch.channels_last)


def plan_cudnn_fused(node: fx.Node) -> Optional[LibraryCandidate]:
    """cuDNN's conv + ReLU (+ add) for a fused conv with a ReLU epilogue run by the library."""
    if (node.target is fused_conv_ref and node.args[8] == "relu" and node.args[10] == "direct"
            and torch.backends.cudnn.is_available()):
        return LibraryCandidate("cudnn_fused", cudnn_conv_relu)
    return None


def plan_nchw(node: fx.Node) -> Optional[LibraryCandidate]:
    """The conv computed channels-first, where ``plan_conv_in_nchw`` says so."""
    return LibraryCandidate("nchw", conv_in_nchw) if plan_conv_in_nchw(node) else None
