"""The kernel families of the cuda executor, one module each: when a family applies to a graph node,
its candidates, its source generation (from the IR, or a template of its own in ``templates/``), its
run-time checks and its launch. ``PLANNERS`` lists the families' per-node planners; the executor asks
each of them for a node's candidates. Adding a family: one module here and one line in ``PLANNERS``.

Families planned here: ``depthwise_conv``, ``grouped_conv``, ``pool``, ``direct_conv``, ``linear``.
Used by the executor besides: ``conv_epilogue`` (a convolution's generated epilogue after cuDNN),
``conv_library`` (cuDNN's fused conv + ReLU, a conv computed channels-first), ``region`` with
``pointwise`` / ``reduction`` (the fusion scheduler's kernels), the groups ``direct_conv.plan_conv_maxpool``
and ``linear.plan_linear_chains``; ``winograd`` (the F(2x2, 3x3) transform kernels) and
``batchnorm_train`` (cuDNN's training BatchNorm + ReLU, run by ``fxopt::batch_norm_relu``).
"""
from __future__ import annotations

from .depthwise_conv import plan_depthwise, plan_depthwise_rows, plan_depthwise_vec
from .direct_conv import plan_direct_conv
from .grouped_conv import plan_grouped_conv
from .linear import plan_conv_as_linear, plan_linear
from .pool import plan_global_avgpool, plan_maxpool

#: per-node candidates of library nodes (and of pools the fusion scheduler left alone), in this order
PLANNERS = (plan_depthwise, plan_depthwise_vec, plan_depthwise_rows, plan_grouped_conv, plan_maxpool,
            plan_global_avgpool, plan_direct_conv, plan_linear, plan_conv_as_linear)
