"""ONNX export of the graph fxopt optimized: ``fxopt.export_onnx(model, example_inputs, path)``.

The model is captured as ``torch.compile(model, backend="fxopt")`` captures it (Dynamo ->
AOTAutograd -> passes, under ``no_grad``) and the optimized inference graph is written as standard
ONNX (opset 20 by default, 17+ accepted): parameters and folded weight-only values (BatchNorm folded
into the weights...) as initializers computed from the real parameters, user inputs as graph inputs
(dim 0 = ``batch`` with ``dynamic_batch``). ``fused_conv`` -> ``Conv`` [+ ``Add``] [+ activation],
``fused_linear`` -> ``Gemm(transB=1)`` [+ activation]; Winograd/FFT/GEMM choices are a plain ``Conv``
(kept in the node's ``fxopt.conv_algorithm`` metadata). Nodes are named ``<module path>/<OpType>``
("layer1.0.conv1/Conv") and carry the module path, class and FX node in ``metadata_props`` and
``doc_string``. An op without an exact translation raises ``UnsupportedOpError`` (op and node named):
no model is written then.

This module is the front half (capture through the backend, check, save); the translator is
``fxopt.onnx_graph`` (``graph_to_onnx``, re-exported here), the per-op translations are in
``fxopt.onnx_ops``, and what those two share is in ``fxopt.onnx_common``. See docs/ONNX.md.
"""
from __future__ import annotations

import re

import onnx
import torch

from fxopt.onnx_common import DEFAULT_OPSET, MIN_OPSET, OnnxExportError, UnsupportedOpError
from fxopt.onnx_graph import find_unsupported, graph_to_onnx

__all__ = ["export_onnx", "capture", "graph_to_onnx", "find_unsupported", "OnnxExportError", "UnsupportedOpError",
           "DEFAULT_OPSET", "MIN_OPSET"]


def _classify(gm, inputs, user_inputs, qualnames):
    """(constants: placeholder index -> name, user input names) of a Dynamo graph.

    The user inputs are the caller's own tensors (Dynamo passes them through); everything else
    (parameters, buffers, tensor attributes, globals) is written as a constant."""
    from fxopt.backend import qualname_from_source

    consts, names = {}, []
    for i, (node, v) in enumerate(zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs)):
        src = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", "") or node.name
        name = re.sub(r"\W+", "_", re.sub(r"^[LG]\['(.*?)'\]", r"\1", src)).strip("_") or f"input_{i}"
        if any(v is u for u in user_inputs):
            names.append(name)
        else:
            consts[i] = qualnames.get(i) or qualname_from_source(src) or name
    return consts, names


def capture(model, example_inputs, options=None):
    """Capture `model` as the backend does: (GraphReport, real graph inputs, constants, user input names)."""
    from fxopt.backend import FxoptCompiler, fxopt_backend
    from fxopt.config import Options
    from fxopt.pipeline import ALL_PASS_NAMES

    opts = Options.from_any(options, ALL_PASS_NAMES)
    graphs, calls = [], []

    def backend(gm, inputs):  # a capturing backend sees the real inputs, parameters included
        first = len(graphs)
        compiled = fxopt_backend(gm, inputs, options=opts, _sink=graphs)
        qualnames = FxoptCompiler(opts, gm, inputs).params
        calls.append((list(inputs), first, *_classify(gm, inputs, example_inputs, qualnames)))
        return compiled

    try:
        with torch.no_grad():
            torch.compile(model, backend=backend, dynamic=False)(*example_inputs)
    finally:
        torch.compiler.reset()
    if len(calls) != 1:
        raise OnnxExportError(f"the model was captured as {len(calls)} graphs (graph breaks); ONNX export needs "
                              "one graph: remove the graph breaks (torch._dynamo.explain shows them)")
    inputs, first, params, names = calls[0]
    report = graphs[first]
    if report.fallback:
        import warnings

        warnings.warn(f"fxopt ONNX export: the pipeline fell back ({report.fallback}); exporting the "
                      "unoptimized graph", stacklevel=3)
    if sum(1 for n in report.after.graph.nodes if n.op == "placeholder") != len(inputs):
        raise OnnxExportError("AOTAutograd changed the graph inputs; they cannot be mapped to the model's")
    return report, inputs, params, names


def export_onnx(model, example_inputs, path, options=None, dynamic_batch=True, *, opset: int = DEFAULT_OPSET,
                check: bool = True) -> onnx.ModelProto:
    """Run the fxopt pipeline on `model` and write its optimized inference graph to `path` as ONNX.

    `example_inputs`: the positional inputs (a tuple, or one tensor). With `dynamic_batch`, dim 0 of
    the inputs (and of the outputs that carry it) is the symbolic ``batch``; an op that moves or mixes
    it raises UnsupportedOpError (use ``dynamic_batch=False``). Give an example batch > 1 if the model
    reshapes: with 1, a flatten and a squeeze look alike. Returns the ModelProto (`path` may be None).
    """
    example_inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    report, inputs, params, names = capture(model, example_inputs, options)
    proto = graph_to_onnx(report.after, inputs, params, input_names=names, dynamic_batch=dynamic_batch,
                          opset=opset, name=type(model).__name__)
    large = proto.ByteSize() > 2**31 - 2**26  # protobuf's 2 GB limit: weights go to an external file
    if check and not large:
        onnx.checker.check_model(proto, full_check=True)
    if path is not None:
        onnx.save_model(proto, str(path), save_as_external_data=large)
    return proto
