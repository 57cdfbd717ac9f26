"""Concatenation and channel splits without copy kernels, and what the copies left cost.

Why: a concatenation is a choice among its inputs by index range and a split's piece a view at an
offset, so a generated kernel reads the pieces of a tensor in place and computes the inputs of a
concatenation where it writes them (``fusion.py``'s cost model counts a kernel that reads one
piece of a split as reading that piece, and a concatenation's element as one load from one of its
inputs). What still needs a dense tensor is a library node (cuDNN reads a dense input): each piece
a library convolution reads is stored by a kernel of its own, one kernel per piece.

``merge_pieces``: the kernels that each store one piece of the same split (or slice) of the same
tensors are one kernel with one output per piece (the loop nests of the pieces as sub-kernels
of one launch, ``PointwiseKernel.parts``): the same bytes, one launch instead of one per piece.
Legal: pointwise kernels only, with the same input tensors (so none needs another's output); each
piece keeps its own dense buffer (a graph output, a piece read elsewhere, CUDA-graph capture and
the allocator see ordinary tensors). The merged kernel is named ``fx_pw_pieces_<split>``.

``copy_summary``: the regions that only move data (clone, concatenation, split, slice, views:
``COPY_OPS``) with the bytes each reads and writes per call, and the bytes every region moves
(``executor_details["copies"]``, ``fxopt explain``).

``ENABLED``: switch both changes off (the cost model counts whole values, no kernels merged) to
measure what they save.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.ir import PointwiseKernel
from .movement_rules import MULTI_VIEWS

aten = torch.ops.aten

#: copy elimination on (the slice-aware cost model in ``fusion.py`` and ``merge_pieces``)
ENABLED = True

#: ops that only move data: a region made of these is a copy
COPY_OPS = frozenset({
    "aten.clone.default", "aten.cat.default", "aten.stack.default", "aten.split.Tensor",
    "aten.split_with_sizes.default", "aten.unbind.int", "aten.slice.Tensor", "aten.select.int",
    "aten.narrow.default", "aten.view.default",
    "aten._unsafe_view.default", "aten.reshape.default", "aten.permute.default", "aten.transpose.int",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default",
    "aten.expand.default", "aten.alias.default", "aten.detach.default", "aten.flatten.using_ints",
    "aten.as_strided.default",
    "aten.channel_shuffle.default", "aten.native_channel_shuffle.default", "aten.constant_pad_nd.default",
    "aten.reflection_pad1d.default", "aten.reflection_pad2d.default", "aten.reflection_pad3d.default",
    "aten.replication_pad1d.default", "aten.replication_pad2d.default", "aten.replication_pad3d.default",
})


def _piece_source(n: fx.Node):
    """The split a piece is an item of, the node a slice takes its part of, or None."""
    if n.op != "call_function":
        return None
    if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0].target in MULTI_VIEWS:
        return n.args[0]
    if n.target in (aten.slice.Tensor, aten.narrow.default):
        return n.args[0]
    return None


def _sources(region) -> tuple:
    return tuple(sorted({s.name for s in map(_piece_source, region.covered) if s is not None}))


def merge_pieces(regions: list, region_cls) -> list:
    """``regions`` with the pointwise kernels that store pieces of the same tensor from the same
    inputs merged into one kernel each (see the module docstring); ``region_cls``: ``fusion.Region``."""
    if not ENABLED:
        return regions
    groups: dict = {}
    for r in regions:
        k = r.kernel
        if not isinstance(k, PointwiseKernel) or len(r.outputs) != 1:
            continue
        src = _sources(r)
        if src:
            groups.setdefault((frozenset(r.inputs), src), []).append(r)
    merged: dict = {}
    for members in groups.values():
        if len(members) > 1:
            merged[id(members[0])] = _merge(members, region_cls)
            merged.update((id(m), None) for m in members[1:])
    out = []
    for r in regions:
        m = merged.get(id(r), r)
        if m is not None:
            out.append(m)
    return out


def _merge(members: list, region_cls):
    inputs, in_bufs, slot = [], [], {}
    for r in members:
        for n, b in zip(r.inputs, r.kernel.inputs):
            if n not in slot:
                slot[n] = len(inputs)
                inputs.append(n)
                in_bufs.append(b)
    outputs, out_bufs, parts = [], [], []
    for r in members:
        k = r.kernel
        imap = {i: slot[n] for i, n in enumerate(r.inputs)}
        omap = {j: len(out_bufs) + j for j in range(len(k.outputs))}
        outputs += r.outputs
        out_bufs += k.outputs
        for p in (k.parts or [k]):
            memo: dict = {}
            stores = [ir.Store(omap[s.buf], s.offset, ir.remap_buffers(s.value, imap, memo)) for s in p.stores]
            parts.append(PointwiseKernel(f"{k.name}_p{len(parts)}", list(p.vars), in_bufs, out_bufs, stores, k.ops))
    src = _sources(members[0])[0]
    kernel = PointwiseKernel(f"fx_pw_pieces_{src}", [], in_bufs, out_bufs, [], [], parts)
    covered = list(dict.fromkeys(n for r in members for n in r.covered))
    ops = list(dict.fromkeys(o for r in members for o in r.ops))
    for o in outputs:
        o.meta["fxopt_copies"] = f"stored with the other pieces of {src} by {kernel.name} (one launch)"
    return region_cls(kernel, inputs, outputs, covered, ops)


# ---------------------------------------------------------------------------- what copies cost
def _loaded(k, buf: int) -> int:
    """Elements of input ``buf`` the kernel loads (at most: the loop points its loads depend on)."""
    total = 0
    for p in (k.parts or [k]) if isinstance(k, PointwiseKernel) else [k]:
        exprs = ir.kernel_exprs(p)
        loops = list(p.vars) if isinstance(p, PointwiseKernel) else list(p.outer) + list(p.reduced)
        best = 0
        for e in exprs:
            for node in ir.walk(e):
                if isinstance(node, ir.Load) and node.buf == buf:
                    used = ir.all_vars(node.offset)
                    best = max(best, math.prod(v.size for v in loops if v in used))
        total += best
    return min(total, k.inputs[buf].numel)


def traffic(k) -> tuple:
    """(bytes read, bytes written) of one run of IR kernel ``k``."""
    read = sum(_loaded(k, i) * b.dtype.itemsize for i, b in enumerate(k.inputs))
    written = sum(b.numel * b.dtype.itemsize for b in k.outputs)
    return read, written


def is_copy(ops) -> bool:
    return bool(ops) and set(ops) <= COPY_OPS


def copy_summary(regions: list) -> dict:
    """``{"copy_kernels": n, "copy_bytes": bytes, "kernels": n, "bytes": bytes, "copies": {name: bytes}}``
    per call: the regions that only move data, and all regions."""
    copies, total = {}, 0
    for r in regions:
        rd, wr = traffic(r.kernel)
        total += rd + wr
        if is_copy(r.ops):
            copies[r.kernel.name] = rd + wr
    return {"copy_kernels": len(copies), "copy_bytes": sum(copies.values()), "kernels": len(regions),
            "bytes": total, "copies": copies}
