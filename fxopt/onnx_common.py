"""What the two halves of the ONNX exporter share: the translator (``fxopt.onnx_graph``) and the
per-op handlers (``fxopt.onnx_ops``) both import from here, so neither imports the other back.

ONNX element types of torch dtypes, the exporter's errors, and the small accessors of FX nodes
the handlers use.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from onnx import TensorProto

from fxopt.passinfra import module_path

DEFAULT_OPSET, MIN_OPSET = 20, 17
IR_VERSION = 10  # ONNX 1.16 (node metadata_props); onnxruntime >= 1.17
DTYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16,
          torch.float64: TensorProto.DOUBLE, torch.int64: TensorProto.INT64, torch.int32: TensorProto.INT32,
          torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8, torch.bool: TensorProto.BOOL}


class OnnxExportError(RuntimeError):
    """The model cannot be written as ONNX as captured (graph breaks, non-tensor outputs...)."""


class UnsupportedOpError(OnnxExportError):
    """An op of the optimized graph has no exact ONNX translation."""

    def __init__(self, op, node: str, reason: str = ""):
        self.op, self.node = str(op), node
        super().__init__(f"fxopt ONNX export: op {self.op} (node {node!r}) is not supported"
                         + (f": {reason}" if reason else ""))


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _ints(v):
    return [int(s) for s in v]


def _path(n) -> str:
    """The qualified name of the module `n` came from ("layer1.0.conv1")."""
    return module_path(n)
