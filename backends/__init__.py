"""Executors: turn an optimized graph into something that runs.

- ``torch``: the reference executor (``torch_ref``), everywhere.
- ``cpu``: for CPU inference; the reference graph with oneDNN's fused convolutions, never slower
  than the unoptimized graph (``cpu``).
- ``cuda``: for CUDA inputs; the reference graph with generated kernels for fused regions where
  available, replayed as CUDA graphs (``cuda_entry``).
- ``onnxruntime``: the exported graph in an ONNX Runtime session (``onnxrt``).

Every executor module provides ``lower_graph(gm, ctx, kind) -> fxopt.lowered.Lowered`` (the
executor contract) and, where it offers the passes something, ``capabilities()``: the fields of the
``fxopt.target.Target`` that ``target_for`` builds for the backend entry before the pipeline runs.
"""
from __future__ import annotations

import torch.fx as fx

from fxopt.lowered import Lowered
from fxopt.names import FOLDED_CONSTANTS_MODULE
from fxopt.target import Target


def resolve_executor(choice: str, device_type: str, kind: str) -> str:
    """Option ``executor`` for a graph: "auto" is the cuda executor for CUDA inputs (inference and
    training graphs), the cpu executor for CPU inference and the torch executor for CPU training."""
    if choice == "auto":
        if device_type == "cuda":
            return "cuda"
        return "cpu" if kind == "inference" else "torch"
    return choice


def target_for(options, device_type: str, kind: str) -> Target:
    """The target of a graph of ``kind`` ("inference", "forward", "backward"; "training" for the
    joint graph) with inputs on ``device_type``: the executor option ``executor`` picks, and what it
    offers the passes (asked of the executor's module)."""
    from fxopt.conv_algorithms import ALGORITHMS

    executor = resolve_executor(options.executor, device_type, "inference" if kind == "inference" else "training")
    fields = {"device_type": device_type, "executor": executor, "conv_algorithms": tuple(ALGORITHMS),
              "cpu_channels_last": f"the {executor} executor has no NHWC convolutions"}
    if executor == "cpu":
        from fxopt.backends import cpu

        fields.update(cpu.capabilities())
    if device_type != "cuda":
        fields["batch_norm_relu_reason"] = "not CUDA (the fused BatchNorm + ReLU is cuDNN's)"
    elif executor not in ("cuda", "torch"):
        fields["batch_norm_relu_reason"] = f"the {executor} executor runs no fused BatchNorm + ReLU"
    if device_type == "cuda" and executor in ("cuda", "torch"):
        from fxopt.backends import cuda_entry

        fields.update(cuda_entry.capabilities(executor))
    return Target(**fields)


def lower(gm: fx.GraphModule, ctx, kind: str) -> Lowered:
    """The executor option ``executor`` picks for this graph, lowering it (the executor contract)."""
    executor = resolve_executor(ctx.options.executor, ctx.device_type, kind)
    folded = getattr(gm, FOLDED_CONSTANTS_MODULE, None)
    if folded is not None and ctx.fixed_weights:  # made on the first call and kept (a cached graph too)
        folded.fixed = True
    if executor == "onnxruntime":
        from fxopt.backends import onnxrt

        return onnxrt.lower_graph(gm, ctx, kind)
    if executor == "cpu":
        from fxopt.backends import cpu

        return cpu.lower_graph(gm, ctx, kind)
    if executor == "cuda" or ctx.device_type == "cuda":  # the torch executor on CUDA: CUDA graphs too
        from fxopt.backends import cuda_entry

        return cuda_entry.lower_graph(gm, ctx, kind, kernels=executor == "cuda")
    from fxopt.backends import torch_ref

    return torch_ref.lower_graph(gm, ctx, kind)
