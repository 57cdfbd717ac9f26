"""A stored value's elementwise reader computed in the kernel that stores the value: one launch, and
the value not read back.

Why: a value that several kernels read is stored once (``fusion.py``'s cost model), and each of its
readers is a kernel of its own that loads it again. Where a reader is a pointwise kernel over the
same elements, the kernel storing the value can compute the reader's result from the value it has
in registers and store both: a pre-activation block's sum stored for the shortcut and its
activation stored for the next convolution (``x = out * alpha + shortcut``; ``silu(x) * beta``
feeds the next conv) are one kernel instead of two, and ``x`` is written once and read by the
shortcut only.

Matches (``merge_consumers``): a pointwise region ``C`` reading an output ``v`` of a pointwise
region ``P`` where, before their loops are arranged, both run the same loop nest and every load of
``v`` in ``C`` reads it at the index where ``P`` stores it (no view, broadcast or window in between).

Produces: one region over the inputs of both, storing ``P``'s outputs and then ``C``'s, with ``C``'s
loads of ``v`` replaced by ``P``'s stored expression rounded to ``v``'s dtype (the value the load
would have read). ``v`` keeps its buffer: its other readers still read it. Each merged output's
``meta["fxopt_merged"]`` says where it is computed.

Illegal: an input of ``C`` (other than ``v``) computed after ``P``'s first output in the graph (the
merged kernel would run after it, past readers of ``P``'s outputs; it includes every input made
from ``v``, a squeeze-excite gate pooled from ``v``, which needs all of ``v`` before ``C`` runs); loop nests split at
concatenation or padding boundaries (``PointwiseKernel.parts``); reductions (a different loop
structure). ``ENABLED`` switches the merge off to measure what it saves. The cuda executor merges
in inference graphs only (``fuse_regions``' ``merge_readers``): the training property under float16
autocast failed once on an H100 with it on, cause not found.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.ir import Load, PointwiseKernel, Store
from .build import rounded
from .loops import arrange

#: merge elementwise readers into the kernel storing their value (off: measure what it saves)
ENABLED = True


def _eligible(r) -> bool:
    return isinstance(r.kernel, PointwiseKernel) and r.raw is not None and not r.kernel.parts


def _why_not(p, c, pos: dict) -> str | None:
    """Why ``c`` cannot be computed in ``p``'s kernel (one line), or None. ``pos``: each node's
    position in the graph."""
    pk, ck = p.raw, c.raw
    if list(pk.vars) != list(ck.vars):
        return "different loop nests"
    for i, n in enumerate(c.inputs):
        if n not in p.outputs:
            continue
        j = p.outputs.index(n)
        stores = [s for s in pk.stores if s.buf == j]
        if len(stores) != 1:
            return f"{n.name} stored more than once"
        for s in ck.stores:
            for e in ir.walk(s.value):
                if isinstance(e, Load) and e.buf == i and e.offset != stores[0].offset:
                    return f"{n.name} read at another index (a view, broadcast or window)"
    # the merged kernel runs after all its inputs: each other input of c must exist before p's
    # first output does (else p's outputs would move past readers of theirs; and an input made
    # from p's outputs, a gate pooled from v, comes after them)
    first = min(pos[o] for o in p.outputs)
    if any(pos[n] > first for n in c.inputs if n not in p.outputs):
        return f"another input is computed after {p.name}'s outputs"
    return None


def _merged(p, c, region_cls):
    """The region computing ``p`` and ``c`` in one kernel (legality checked by ``_why_not``): ``c``'s
    loads of ``p``'s outputs are ``p``'s stored expressions, rounded to their dtypes."""
    pk, ck = p.raw, c.raw
    inputs, bufs = list(p.inputs), list(pk.inputs)
    slot = {n: k for k, n in enumerate(inputs)}
    for n, b in zip(c.inputs, ck.inputs):
        if n not in p.outputs and n not in slot:
            slot[n] = len(inputs)
            inputs.append(n)
            bufs.append(b)
    stored = {s.buf: s.value for s in pk.stores}
    values = {k: rounded(stored[p.outputs.index(n)], pk.outputs[p.outputs.index(n)].dtype, bufs)
              for k, n in enumerate(c.inputs) if n in p.outputs}
    imap = {k: slot[n] for k, n in enumerate(c.inputs) if n not in p.outputs}

    def leaf(e):
        if isinstance(e, Load):
            return values[e.buf] if e.buf in values else Load(imap[e.buf], e.offset)
        return None
    memo: dict = {}
    base = len(pk.outputs)
    stores = list(pk.stores) + [Store(base + s.buf, s.offset, ir.map_leaves(s.value, leaf, memo)) for s in ck.stores]
    kernel = PointwiseKernel(f"{pk.name}_{c.outputs[0].name}", list(pk.vars), bufs, list(pk.outputs) + list(ck.outputs),
                             stores, list(dict.fromkeys(pk.ops + ck.ops)))
    raw = dataclasses.replace(kernel)
    arrange(kernel)
    region = region_cls(kernel, inputs, list(p.outputs) + list(c.outputs),
                        list(dict.fromkeys(p.covered + c.covered)), list(dict.fromkeys(p.ops + c.ops)), raw=raw)
    read = ", ".join(n.name for n in c.inputs if n in p.outputs)
    for o in c.outputs:
        o.meta["fxopt_merged"] = f"computed by {p.name}'s kernel from {read} in registers (one launch; not read back)"
    return region


def merge_consumers(regions: list, region_cls) -> list:
    """``regions`` with each eligible reader merged into the kernel storing its value (module
    docstring), in the position of that kernel; ``region_cls``: ``fusion.Region``."""
    if not ENABLED:
        return regions
    out = list(regions)
    producer = {o: r for r in out for o in r.outputs}
    graph = next((o.graph for r in out for o in r.outputs), None)
    pos = {n: i for i, n in enumerate(graph.nodes)} if graph is not None else {}
    gone: set = set()
    for c in list(regions):
        if id(c) in gone or not _eligible(c):
            continue
        for v in c.inputs:
            p = producer.get(v)
            if p is None or p is c or not _eligible(p) or _why_not(p, c, pos) is not None:
                continue
            try:
                m = _merged(p, c, region_cls)
            except Exception:  # noqa: BLE001 - a merge that does not arrange leaves both kernels
                continue
            out = [m if r is p else r for r in out if r is not c]
            gone |= {id(p), id(c)}
            producer.update((o, m) for o in m.outputs)
            break
    return out
