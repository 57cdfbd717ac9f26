"""The executor contract: ``lower(gm, ctx, kind) -> Lowered``.

Every executor (``fxopt.backends``: torch, cpu, cuda, onnxruntime) turns an optimized graph into
something that runs and says what it did, in one typed record: the callable, the executor that runs
it, the kernels it generated, the ops it left to PyTorch and why, its per-node choices, why it fell
back, its CUDA-graph state and runner, its timings. The report (``fxopt.report``), the backend entry,
packages and benchmarks read these fields. ``details`` holds what only one executor has (oneDNN's
convolutions, ONNX Runtime's NHWC flag ...), and ``ExecutorDetails`` is the mapping view of the
whole record that ``report.graphs[i].executor_details`` has always been.

This module imports neither passes nor executors.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol


@dataclass
class Lowered:
    #: what runs the graph: called with the graph's inputs, returns its outputs
    fn: Callable
    #: the executor that runs it ("torch", "cpu", "cuda", "onnxruntime (CPUExecutionProvider)",
    #: "torch (onnxruntime not used: ...)")
    executor: str
    #: "on (...)" / "off (why)"
    cudagraphs: str = "off"
    #: generated kernels (``KernelRecord``s of the cuda executor)
    kernels: list = field(default_factory=list)
    #: op -> why it runs as PyTorch's op rather than in a generated kernel
    unfused: dict = field(default_factory=dict)
    #: node -> the candidates measured for it and the choice (cuda executor)
    node_choices: dict = field(default_factory=dict)
    #: fused region (node name) -> its kernel and ops (cuda executor)
    regions: dict = field(default_factory=dict)
    #: why the asked executor did not run the graph (it runs as ``executor`` says), or None
    fallback_reason: Optional[str] = None
    #: the runner that captures and replays CUDA graphs per input signature (``CudaGraphRunner``):
    #: its ``decisions()`` say which graph replays and the times behind it
    cudagraph_runner: Any = None
    #: the cpu executor's runner (``CpuRunner``): per input signature, which graph runs and why
    cpu_runner: Any = None
    #: whether the runner compares against the unoptimized graph (None: no runner)
    baseline_check: Optional[bool] = None
    #: seconds and milliseconds the executor spent, by name ("nvrtc_s": compiling generated kernels)
    timings: dict = field(default_factory=dict)
    #: what only this executor reports (JSON-able values or objects with their own repr)
    details: dict = field(default_factory=dict)

    @classmethod
    def from_info(cls, fn: Callable, info: dict) -> "Lowered":
        """The record for an executor that still writes an ``info`` dict of string keys (the keys of
        ``ExecutorDetails``, plus "executor", "cudagraphs" and "kernels")."""
        low = cls(fn=fn, executor=str(info.get("executor", "torch")), cudagraphs=str(info.get("cudagraphs", "off")),
                  kernels=info.get("kernels", []))
        view = ExecutorDetails(low)
        for k, v in info.items():
            if k not in ("executor", "cudagraphs", "kernels"):
                view[k] = v
        return low


#: the ``executor_details`` keys that are typed fields of ``Lowered``
_FIELD_KEYS = ("unfused", "node_choices", "regions", "cudagraph_runner", "cpu_runner", "baseline_check",
               "fallback_reason")
_TIMING_KEYS = ("nvrtc_s", "choose_s")


class ExecutorDetails(MutableMapping):
    """``report.graphs[i].executor_details``: the ``Lowered`` record as the mapping of string keys it
    has always been ("node_choices", "unfused", "regions", "cudagraph_runner", "cpu_runner",
    "baseline_check", "nvrtc_s", and each executor's own ``details``). Empty typed fields are absent;
    writing a key writes its field (other keys go to ``details``)."""

    def __init__(self, lowered: Lowered):
        self.lowered = lowered

    def _items(self) -> dict:
        low, out = self.lowered, {}
        for key in _FIELD_KEYS:
            v = getattr(low, key)
            if v is not None and not (isinstance(v, dict) and not v):
                out[key] = v
        out.update(low.timings)
        out.update(low.details)
        return out

    def __getitem__(self, key):
        return self._items()[key]

    def __setitem__(self, key, value) -> None:
        low = self.lowered
        if key in _FIELD_KEYS:
            setattr(low, key, value)
        elif key in _TIMING_KEYS:
            low.timings[key] = value
        else:
            low.details[key] = value

    def __delitem__(self, key) -> None:
        low = self.lowered
        if key not in self._items():
            raise KeyError(key)
        if key in _FIELD_KEYS:
            setattr(low, key, {} if isinstance(getattr(low, key), dict) else None)
        else:
            low.timings.pop(key, None)
            low.details.pop(key, None)

    def __iter__(self) -> Iterator:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return repr(self._items())


class Executor(Protocol):
    """What every executor module provides (``fxopt.backends.torch_ref``, ``cpu``, ``onnxrt``, and
    the cuda executor's entry ``cuda_entry``)."""

    def lower(self, gm, ctx, kind: str) -> Lowered: ...


__all__ = ["Lowered", "ExecutorDetails", "Executor"]
