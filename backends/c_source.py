"""A whole CPU inference graph as one C function, for one input signature (the cpu executor's
``generated C`` way, ``backends/cpu_c.py``).

Why: at a small CNN's batch 1 a convolution is a few microseconds of arithmetic, and every engine
spends more than that between its operators (a dispatch, a layout reorder, a thread hand-off per
op). One C function of plain loops over the whole graph, compiled for this CPU, pays none of it:
the convolutions run as direct loops vectorized over the output row, the bias, a BatchNorm, a
residual add and the activation applied as each value is stored, the intermediate tensors in one
workspace planned by their lifetimes.

What it takes: the graph as AOTAutograd hands it (aten ops, float32 tensors, static sizes) whose
every node is one of ``HANDLED``: 2-D convolutions (any stride, padding, dilation, groups),
BatchNorm in inference, elementwise activations, add / sub / mul with broadcasting, max and
average pools, means over trailing dimensions, ``addmm`` / ``mm`` (linear layers) and the views
between them. Any other node, dtype or a symbolic size declines the whole graph
(:class:`Declined`, with the node and why); the cpu executor then runs its other ways. Tensors
are read through the strides they come with (a package's weights may be slices of one blob);
intermediate tensors are contiguous.

Numerics: sums run in float32 in another order than oneDNN's (within the float32 tolerance of
``fxopt.tolerances``); NaN propagates through max pools and activations as in eager. A bfloat16
graph's convolutions and linear layers round their inputs to bfloat16, as torch's do, and sum pairs
of products with AVX-512 BF16 where the compiler's target has it (``c_bf16``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxopt.backends import c_kernels
from fxopt.backends.c_emit import (AVG_POOLS, BATCH_NORM, BINARY, DTYPES, FUSED_CONV, FUSED_LINEAR, MAX_POOL, UNARY,
                                   VIEWS, Declined, Emitter, Ref, val)

aten = torch.ops.aten

HANDLED = frozenset((aten.convolution.default, FUSED_CONV, FUSED_LINEAR, BATCH_NORM, MAX_POOL, *AVG_POOLS,
                     aten.addmm.default,
                     aten.mm.default, operator.getitem, *UNARY, *BINARY, *VIEWS))

#: what the C includes and the name of the function it defines
PRELUDE = "#include <math.h>\n#include <string.h>\n#include <omp.h>\n" + c_kernels.TYPES
ENTRY = "fxopt_run"


@dataclass
class Program:
    """The C source of one signature and what its caller needs: ``workspace`` bytes, the graph's
    argument count (the pointer array ``A`` holds them, then one pointer per output), the
    outputs' shapes and dtypes (contiguous) and the multiply-adds counted twice (``flops``)."""
    source: str
    workspace: int
    n_args: int
    out_shapes: list
    flops: int
    out_dtypes: list


def generate(gm: fx.GraphModule, args: list, params=()) -> Program:
    """The C program of ``gm`` for the tensors ``args`` (its flat arguments: parameters and inputs;
    ``params``: the indices of the parameters, whose bfloat16 values are widened only at a call
    that lays weights out); raises :class:`Declined` where a node, dtype or size is not handled."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise Declined("argument count differs from the graph's placeholders")
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    for o in outs:
        val(o)  # a float32 tensor of static sizes, or Declined
    em = Emitter(gm, outs, len(args), params)
    for k, (node, a) in enumerate(zip(placeholders, args)):
        if not isinstance(a, torch.Tensor):
            if node.users:
                raise Declined(f"{node.name}: a non-tensor argument is used")
            continue
        if a.dtype not in DTYPES or a.device.type != "cpu":
            raise Declined(f"{node.name}: {a.dtype} on {a.device.type} (float32 and bfloat16 CPU tensors only)")
        if any(not isinstance(s, int) for s in (*a.shape, *a.stride())):
            raise Declined(f"{node.name}: symbolic sizes")
        if a.dtype == torch.bfloat16:
            em.widen(node, k, a, every_call=k not in set(params))
        else:
            em.refs[node] = Ref(f"((const float*)A[{k}])", tuple(a.shape), tuple(a.stride()))
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function" or node.target not in HANDLED:
            raise Declined(f"{node.name}: {node.op} {getattr(node.target, '__name__', node.target)} is not handled")
        try:
            em.node(node)
        except Declined:
            raise
        except Exception as e:  # noqa: BLE001 - an argument of a kind the emitter does not know
            raise Declined(f"{node.name}: {type(e).__name__}: {e}") from e
    em.store_outputs(len(args))
    calls = "\n    #pragma omp barrier\n".join(f"    {name}(A, W, part, parts);" for name in em.layers)
    prepare = "\n".join("    " + ln for ln in em.prepare)
    pre = "\n".join("  " + ln for ln in em.pre)
    source = (f"{PRELUDE}\n" + "\n".join(em.lines) + "\n\n"
              f"/* {len(em.layers)} layers; nt threads share each one out (a barrier between two) */\n"
              f"void {ENTRY}(void* const* restrict A, char* restrict W, int P, int nt) {{\n"
              f"  if (P) {{\n{prepare}\n  }}\n{pre}\n"
              "  if (nt > 1) {\n"
              "  #pragma omp parallel num_threads(nt)\n  {\n"
              "    const int part = omp_get_thread_num(), parts = omp_get_num_threads();\n"
              f"{calls}\n  }}\n  }} else {{\n"
              "    const int part = 0, parts = 1;\n" +
              "\n".join(f"    {name}(A, W, part, parts);" for name in em.layers) +
              "\n  }\n}\n")
    return Program(source, em.workspace_bytes(), len(args), [tuple(val(o).shape) for o in outs], em.flops,
                   [val(o).dtype for o in outs])
