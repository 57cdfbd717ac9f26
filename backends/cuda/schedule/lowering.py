"""ATen ops as loop-level IR: which rule computes a node at a logical index.

Every op the fusion scheduler can put in a generated kernel has a rule. A rule turns a node into
a ``Value`` (``values.py``): its shape and dtype and a ``load(index)`` giving the expression of the
element at a logical index (one ``Ix`` per dim) in terms of its inputs' ``load``s (Inductor's
inner functions over indices). There are three kinds, one module each:

- pointwise (``pointwise_rules.py``): arithmetic, activations, comparisons, ``where``, dtype
  casts, eval BatchNorm, a convolution's epilogue; inputs broadcast by index;
- views and data movement (``movement_rules.py``): view/reshape/permute/transpose/expand/
  slice/select/squeeze/unsqueeze/split/chunk/unbind/channel shuffle/repeat are index maps,
  ``cat`` a choice among its inputs by index range, ``constant_pad_nd`` a range test;
  window ops (max / average pooling) unroll their window; a gather at compile-time constant
  indices (nearest upsampling, ``index_rules.py``) is an index map too, where its indices are one;
- reductions (``reduction_rules.py``, ``reduction_rule``): sum / mean / amax / amin / var /
  var_mean / std, softmax and log-softmax, LayerNorm, GroupNorm, batch-statistics BatchNorm
  (instance norm). A rule returns a ``RowSpec``: the (virtual) input index space, which of its
  dims are reduced, the reduction phases, and each output's value and where it is stored.

A rule raises ``Decline`` (with the node left to PyTorch) for what it does not cover: other
dtypes than float32/float16/bfloat16 in memory, symbolic sizes, rounding modes, indices
that are used. ``Args.value(node)`` asks the scheduler how each input is available: computed
inline (its own rule, recursively) or read from a tensor (a kernel input).
"""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
import torch.fx as fx

from fxopt.ops import conv_epilogue_ref

from .index_rules import TARGETS as INDEX_TARGETS, accepts as index_map_accepts, index_value
from .movement_rules import MOVEMENT, MOVEMENT_ITEMS, MULTI_VIEWS, VIEWS, split_item
from .pointwise_rules import CONV_EPILOGUE, POINTWISE, POINTWISE_ITEMS
from .reduction_rules import adaptive_is_global

aten = torch.ops.aten


def value_rule(node: fx.Node) -> Optional[Callable]:
    """The rule computing ``node`` inline (pointwise, view, data movement), or None."""
    if node.op != "call_function":
        return None
    t = node.target
    if t is conv_epilogue_ref:
        return CONV_EPILOGUE
    if t is operator.getitem:
        src = node.args[0]
        if not isinstance(src, fx.Node) or src.op != "call_function":
            return None
        if src.target in MULTI_VIEWS:
            return split_item
        return POINTWISE_ITEMS.get((src.target, node.args[1])) or MOVEMENT_ITEMS.get((src.target, node.args[1]))
    if t is aten._adaptive_avg_pool2d.default and adaptive_is_global(node):
        return None  # a reduction
    if t in INDEX_TARGETS:  # an index map where its indices are one (else a gather PyTorch runs)
        return index_value if index_map_accepts(node) else None
    return POINTWISE.get(t) or VIEWS.get(t) or MOVEMENT.get(t)


def is_view(node: fx.Node) -> bool:
    """A node whose value aliases its input (torch computes it without a kernel)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and src.target in MULTI_VIEWS
    return node.target in VIEWS



def view_root(node: fx.Node) -> fx.Node:
    """The node whose memory a chain of views aliases."""
    while is_view(node):
        src = node.args[0]
        if node.target is operator.getitem:
            src = src.args[0]  # split / unbind -> their input
        node = src
    return node


def container_items(node: fx.Node) -> Optional[list]:
    """getitem users of a node that returns several tensors (None if used otherwise)."""
    if not node.users or any(u.op != "call_function" or u.target is not operator.getitem for u in node.users):
        return None
    return list(node.users)


def target_name(node: fx.Node) -> str:
    """The name of a node's op, for reasons and reports."""
    t = node.target
    return getattr(t, "__name__", str(t)) if not isinstance(t, torch._ops.OpOverload) else str(t)
