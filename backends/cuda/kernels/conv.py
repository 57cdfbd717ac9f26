"""What the generated convolution families share: which ``fused_conv`` nodes a generated kernel may
compete for (``conv_args``), the check of a fused epilogue's operands (``check_conv_args``), and the
launch of a channels_last template with every size compiled in (``launch_nhwc``)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen.epilogue import has_bias, has_residual, template_epilogue
from fxopt.backends.cuda.codegen.source import KernelSource
from fxopt.backends.cuda.kernels.common import TemplateCandidate, check_layout, dense_strides, ints, memory_layout_ok, node_val
from fxopt.ops import fused_conv_ref


CONV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: threads of a one-pixel-per-thread kernel (output pixels x channel vectors) from which variants with
#: more pixels per thread are measured too: below, fewer threads would leave SMs idle
MANY_THREADS = 1 << 16


def conv_args(node: fx.Node) -> Optional[dict]:
    """What every generated conv kernel needs of a fused_conv node, where one may compete: a 2-D conv
    in fp32/fp16/bf16 throughout (bias and residual too) with static sizes, run by ``direct`` or by an
    algorithm chosen automatically (measured against; never one the user forced). Keys: x, w, out (the
    values), groups, k, stride, padding, dilation, epilogue; None otherwise."""
    if node.op != "call_function" or node.target is not fused_conv_ref or len(node.args) < 11:
        return None
    x, w, out = node_val(node.args[0]), node_val(node.args[1]), node.meta.get("val")
    if x is None or w is None or out is None or x.dim() != 4 or w.dim() != 4 or out.dtype not in CONV_DTYPES:
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
    epilogue = template_epilogue(node.args[2] is not None, node.args[3] is not None, node.args[8], node.args[9])
    return {"x": x, "w": w, "out": out, "groups": node.args[7], "k": k, "stride": stride, "padding": padding,
            "dilation": dilation, "epilogue": epilogue}


def check_conv_args(ks: KernelSource, x: torch.Tensor, out: torch.Tensor, bias, residual) -> None:
    """What every generated convolution with a fused epilogue requires: x, out (and the residual)
    dense in the kernel's layout with one dtype; bias/residual given exactly when the epilogue has them."""
    lay, epi = ks.meta["layout"], ks.meta["epilogue"]
    check_layout(x, lay, f"{ks.name}: x")
    check_layout(out, lay, f"{ks.name}: out", x.dtype)
    if (bias is not None) != has_bias(epi) or (residual is not None) != has_residual(epi):
        raise ValueError(f"{ks.name}: bias/residual do not match the kernel's epilogue {epi}")
    if residual is not None:
        check_layout(residual, lay, f"{ks.name}: residual", x.dtype)


def launch_nhwc(cand: TemplateCandidate, epi, out_shape: tuple, x, weight, bias, residual):
    """Launch a channels_last conv template (its grid in the source's meta) with a new NHWC output of
    ``out_shape``, after checking the epilogue's operands: present as compiled, of x's dtype, dense
    (None where not: the reference runs)."""
    if (bias is not None) != has_bias(epi) or (residual is not None) != has_residual(epi):
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
