"""The kernel families of the cuda executor, one module each: when a family applies to a graph node,
its candidates, its source generation (from the IR, or a template of its own in ``templates/``), its
run-time checks and its launch.

``FAMILIES`` is the table the executor asks for every node's candidates: each entry's
``plan(node, options)`` returns the family's candidates for that node ([] where it does not apply),
and a node's candidates are offered in the table's order (their names are autotuning-cache keys).
``GROUPS`` is the table of the families that measure groups of nodes as one kernel after the
per-node choices (``plan(graph)`` -> ``common.NodeGroup``s), measured in the table's order. Adding a
family: one module here and one line in one of them.

Used by the executor besides: ``region`` with ``pointwise`` / ``reduction`` (the fusion scheduler's
kernels) and the pool templates of a region that is one pool (``schedule/generated.py``);
``batchnorm_train`` (cuDNN's training BatchNorm + ReLU, run by ``fxopt::batch_norm_relu``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .conv_epilogue import plan_conv_epilogue
from .conv_library import plan_cudnn_fused, plan_nchw
from .depthwise_conv import plan_depthwise, plan_depthwise_rows, plan_depthwise_vec
from .direct_conv import plan_conv_maxpool_groups, plan_direct_conv
from .grouped_conv import plan_grouped_conv
from .linear import plan_conv_as_linear, plan_linear, plan_linear_chain_groups
from .pool import plan_global_avgpool, plan_maxpool
from .winograd import plan_winograd


@dataclass(frozen=True)
class Family:
    """A kernel family's per-node planner. ``plan(node, options)``: its candidates for ``node``, each
    with ``sources`` / ``kernels`` and either ``label`` (offered as ``generated_<label>``, falling
    back to the node's reference where it declines) or ``key`` and ``bind(reference)``.
    ``alone``: whether its candidates are measured where no other family has one (else they are
    only offered beside others). ``compile_first``: its kernels go to NVRTC (and into the report)
    before the other families' kernels of every node."""
    name: str
    plan: Callable
    alone: bool = True
    compile_first: bool = False


@dataclass(frozen=True)
class GroupFamily:
    """A family measuring groups of nodes as one kernel: ``plan(graph)`` -> ``NodeGroup``s.
    ``before_fusion``: planned before the fusion scheduler, which leaves each group's ``keep_out``
    nodes alone; else planned after it, on the graph with its regions."""
    name: str
    plan: Callable
    before_fusion: bool = False


def each(planner: Callable) -> Callable:
    """A ``plan(node, options)`` from a planner of the node alone returning a candidate, a list
    of them or None."""
    def plan(node, options) -> list:
        out = planner(node)
        return [] if out is None else (out if isinstance(out, list) else [out])
    plan.__name__ = planner.__name__
    return plan


def _conv_epilogue(node, options) -> list:
    epi = plan_conv_epilogue(node, options.fast_math)
    return [] if epi is None else [epi]


#: every node's candidates, in this order
FAMILIES = (
    Family("conv_epilogue", _conv_epilogue, compile_first=True),
    Family("cudnn_fused", each(plan_cudnn_fused), alone=False),
    Family("nchw", each(plan_nchw)),
    Family("depthwise_conv", each(plan_depthwise)),
    Family("depthwise_conv_vec", each(plan_depthwise_vec)),
    Family("depthwise_conv_rows", each(plan_depthwise_rows)),
    Family("grouped_conv", each(plan_grouped_conv)),
    Family("maxpool", each(plan_maxpool)),
    Family("global_avgpool", each(plan_global_avgpool)),
    Family("direct_conv", each(plan_direct_conv)),
    Family("winograd", each(plan_winograd)),
    Family("linear", each(plan_linear)),
    Family("conv_as_linear", each(plan_conv_as_linear)),
)

#: groups of nodes measured as one kernel after the per-node choices, in this order
GROUPS = (
    GroupFamily("conv_maxpool", plan_conv_maxpool_groups, before_fusion=True),
    GroupFamily("linear_chain", plan_linear_chain_groups),
)
