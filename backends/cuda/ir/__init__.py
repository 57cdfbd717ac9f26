"""The loop-level IR the fusion scheduler builds and the code generator reads.

A generated kernel is a loop nest over integer index variables whose body is an expression
tree over loads of its input tensors. Two kernel shapes exist:

- ``PointwiseKernel``: one loop over ``ranges`` (the logical shape of its outputs); every output
  is an expression of the loop variables, stored at the output's own strides. Views (permute,
  slice, expand, reshape...) are index arithmetic inside the loads, concatenation and padding
  are ``Where`` / ``InRange`` selections, never copies of their own.
- ``ReductionKernel``: an outer loop (one "row" per outer index) and an inner reduced loop.
  ``phases`` are reductions over the row (sum / max / min), each able to use the results of the
  phases before it (softmax: max, then the sum of ``exp(x - max)``; LayerNorm: the mean, then
  the sum of squared deviations); ``row_outputs`` are stored at every (outer, reduced) index
  after the last phase (the normalized tensor), ``outer_outputs`` once per row (a mean).

Index expressions (``Ix``) are affine sums ``const + sum(coef * atom)`` whose atoms are loop
variables or floor-divisions / moduli of such sums by constants; ``floordiv``/``mod`` simplify
when the bounds of the terms allow (``(8*i + j) // 8 == i`` for ``0 <= j < 8``), so a chain of
views of a dense tensor usually folds back to plain strides. Every atom's argument is known to
be non-negative, so C's truncating ``/`` and ``%`` equal floor division and modulo.

Value expressions (``Load``, ``Const``, ``Op``, ``Where``, ``InRange``, ``Cast``, ``Red``) are
immutable and hashable: equal subtrees are one node, which the code generator emits once.
All arithmetic is float32 (loads widen, stores round); ``Cast`` rounds through a dtype where
the graph converts explicitly and where a node's value is 16-bit (the scheduler rounds each such
value it computes inline, as eager rounds each op's result).

``evaluate`` runs a kernel with torch on any device, index for index as the generated code
does (the same loads at the same offsets): the CPU-testable semantics of every kernel.
"""
from __future__ import annotations


from .epilogue import ACC, BIAS, RES, ACTIVATIONS, Arg, EpilogueParts, activation_chain, epilogue_expr, epilogue_parts
from .expr import (BINARY, COMPARE, FALSE, LOGICAL, REDUCE_OPS, TRUE, UNARY, UNARY_P, BoolConst, Cast, Const, Expr,
                   InRange, Load, Op, Red, Where, op)
from .index import Atom, FloorDiv, Ix, Mod, Var, all_vars, strided, unravel
from .interp import eval_ix, evaluate
from .kernel import (Buffer, Kernel, Phase, PointwiseKernel, ReductionKernel, Store, children, index_exprs,
                     kernel_exprs, map_leaves, remap_buffers, simplify, specialize, substitute, walk)

__all__ = ["BINARY", "COMPARE", "FALSE", "LOGICAL", "REDUCE_OPS", "TRUE", "UNARY", "UNARY_P", "BoolConst", "Cast",
           "Const", "Expr", "InRange", "Load", "Op", "Red", "Where", "op", "Atom", "FloorDiv", "Ix", "Mod", "Var",
           "all_vars", "strided", "unravel", "eval_ix", "evaluate", "Buffer", "Kernel", "Phase", "PointwiseKernel",
           "ReductionKernel", "Store", "children", "index_exprs", "kernel_exprs", "map_leaves", "remap_buffers",
           "simplify", "specialize", "substitute", "walk", "ACC", "BIAS", "RES", "ACTIVATIONS", "Arg", "EpilogueParts",
           "activation_chain", "epilogue_expr", "epilogue_parts"]
