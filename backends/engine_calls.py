"""What the cpu executor's external engines (``onnxrt``: ONNX Runtime, ``openvino``: OpenVINO) share
around a run: outputs given eager's strides, a call bound to one input signature, and a signature's
build (an ONNX export, an OpenVINO conversion) shared by an engine's two thread counts.

Why: both engines keep one compiled object per input signature (an ONNX Runtime session, an
OpenVINO infer request), called through the cpu executor's runner, which dispatches on signatures
itself (a look-up per call cost a package's seedcnn at batch 1 6 us). ``bound_call`` holds the
object weakly (evicted: the engine's full path builds it again) and checks watched weights per call;
where the weights are fixed, its ``fixed`` call skips every check a package already made on the
inputs' shapes, strides, dtypes and devices (the engine's run compares addresses alone).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Optional, Sequence

import torch


def restride(t: torch.Tensor, v) -> torch.Tensor:
    """An engine's outputs are contiguous: give ``t`` the strides eager's output ``v`` has."""
    if isinstance(v, torch.Tensor) and not v.is_contiguous() and t.dim() == v.dim():
        return torch.empty_strided(t.shape, v.stride(), dtype=t.dtype, device=t.device).copy_(t)
    return t


def any_strided(out_vals: Sequence) -> bool:
    """Whether an output eager gives is not contiguous (an engine's must then be restrided)."""
    return any(isinstance(v, torch.Tensor) and not v.is_contiguous() for v in out_vals)


def graph_outputs(gm) -> tuple:
    """(the output's container type, None for a single tensor; eager's output values; whether any of
    them is strided, so that an engine's outputs must be restrided) of an FX graph."""
    import torch.fx as fx

    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    vals = [o.meta.get("val") if isinstance(o, fx.Node) else None
            for o in (out if isinstance(out, (list, tuple)) else [out])]
    return (type(out) if isinstance(out, (list, tuple)) else None), vals, any_strided(vals)


def bound_call(entry, positions: Sequence[int], out_vals: Sequence, out_type: Optional[type],
               changed: Optional[Callable], on_change: Callable[[], None], full: Callable) -> Callable:
    """A call of the graph's flat arguments for one input signature: ``entry.run`` (a list of the
    tensors at ``positions`` -> the outputs) on ``entry``, held weakly; ``changed(args)``: whether a
    watched weight changed (None: the weights are fixed), and then ``on_change()`` drops every
    compiled object; ``full``: the engine's full path, taken once ``entry`` is gone."""
    ref = weakref.ref(entry)
    strided = any_strided(out_vals)

    def run(*a):
        if changed is not None and changed(a):  # every compiled object holds stale constants
            on_change()
        e = ref()
        if e is None:  # evicted (more signatures than the engine keeps), or stale
            return full(*a)
        outs = e.run([a[i] for i in positions])
        if strided:
            outs = [restride(t, v) for t, v in zip(outs, out_vals)]
        return out_type(outs) if out_type is not None else outs[0]

    run.positions = positions
    if changed is None and out_type is not None:
        def fixed(tensors: list) -> Optional[list]:
            """The outputs for ``tensors`` (those at ``positions``), each of this signature's shape,
            dtype and device and dense: only their addresses are looked at. None once ``entry`` is
            gone (the caller takes ``run``)."""
            e = ref()
            if e is None:
                return None
            outs = e.run_fixed(tensors)
            return [restride(t, v) for t, v in zip(outs, out_vals)] if strided else outs

        run.fixed = fixed  # for a caller that checked its inputs' kind itself (a package)
    return run


class SharedBuilds:
    """A signature's build (an ONNX export, an OpenVINO conversion: each holds a copy of every weight,
    a ResNet-50's 100 MB) shared by an engine's all-threads and one-thread ways while the cpu
    executor's runner decides that signature (``deciding``), and let go after it: a build outside
    a decision (after a weight changed, or an eviction) is its way's alone, never kept."""

    def __init__(self):
        self._open = False
        self._builds: dict = {}

    def get(self, sig, weights, build: Callable[[], Any]):
        """The build of ``sig`` for ``weights`` (``fxopt.weights.weights_key``): the other way's
        where it built it with the same weights in this decision, else ``build()``."""
        held = self._builds.get(sig)
        if held is not None and held[1] == weights:
            return held[0]
        value = build()
        if self._open:
            self._builds[sig] = (value, weights)
        return value

    @contextlib.contextmanager
    def deciding(self):
        self._open = True
        try:
            yield
        finally:
            self._open = False
            self._builds.clear()

    def __len__(self) -> int:
        return len(self._builds)
