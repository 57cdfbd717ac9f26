"""The ONNX translator: an optimized inference graph (``torch.fx``) -> ``onnx.ModelProto``.

``graph_to_onnx`` writes parameters and weight-only values (BatchNorm folded into the weights...)
as initializers computed from the real parameters, the other tensor placeholders as graph inputs
(dim 0 = ``batch`` with ``dynamic_batch``), and each runtime node through its handler in
``fxopt.onnx_ops``; nodes are named ``<module path>/<OpType>`` and carry the module path, class and
FX node in ``metadata_props`` and ``doc_string``. It runs no compiler: ``fxopt.onnx_export``
captures a model through the backend and calls it, and the ``onnxruntime`` executor
(``fxopt.backends.onnxrt``) calls it on the graph it is given.
"""
from __future__ import annotations

import math
import operator
from importlib import metadata

import onnx
import torch
import torch.fx as fx
from onnx import TensorProto, helper

from fxopt.onnx_common import (DEFAULT_OPSET, DTYPES, IR_VERSION, MIN_OPSET, OnnxExportError, UnsupportedOpError,
                               _path, _val)
from fxopt.onnx_ops import HANDLERS


def _tensor(t: torch.Tensor, name: str) -> TensorProto:
    t = t.detach().cpu().contiguous()
    if t.dtype not in DTYPES:
        raise OnnxExportError(f"constant {name!r} has dtype {t.dtype}, which has no ONNX equivalent here")
    proto = TensorProto(name=name, data_type=DTYPES[t.dtype], dims=list(t.shape))
    proto.raw_data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return proto


def _is_scalar(n) -> bool:  # a (Sym)Int/Float such as a batch size: concrete once shapes are
    return isinstance(_val(n), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def _const_flags(gm, param_names, factory_ok) -> dict:
    """Which nodes are weight-only: evaluated at export time and written as initializers."""
    from fxopt.passes.fold_constants import is_pure

    const = {}
    for n in gm.graph.nodes:
        ins = n.all_input_nodes
        const[n] = (n.op == "placeholder" and n.name in param_names) or n.op == "get_attr" or _is_scalar(n) or (
            n.op in ("call_module", "call_function") and all(const[a] for a in ins)
            and (n.op == "call_module" or is_pure(n)) and (bool(ins) or factory_ok(n)))
    return const


class _Emitter:
    def __init__(self, gm, args, params, input_names, dynamic_batch, opset, output_names):
        if opset < MIN_OPSET:
            raise ValueError(f"fxopt ONNX export needs opset >= {MIN_OPSET}, got {opset}")
        self.gm, self.args, self.opset, self.dynamic = gm, args, opset, dynamic_batch
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.params = {self.placeholders[i].name: q for i, q in params.items()}  # placeholder -> qualname
        self.input_names, self.output_names = input_names or [], output_names or []
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self.names, self.batch, self.values, self.init_of, self.scalars, self.renamed = {}, {}, {}, {}, {}, {}
        self.used = {n.name for n in gm.graph.nodes if n.op != "output"}
        user = [a for p, a in zip(self.placeholders, args) if p.name not in self.params
                and isinstance(a, torch.Tensor) and a.dim() > 0]
        batch = int(user[0].shape[0]) if user else None

        def factory_ok(n):  # a tensor made from nothing must not have the example batch baked in
            v = _val(n)
            return not (dynamic_batch and isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch)

        scalars = {p.name for p, a in zip(self.placeholders, args) if not isinstance(a, torch.Tensor)}
        self.const = _const_flags(gm, set(self.params) | scalars, factory_ok)

    def unique(self, base: str) -> str:
        name, i = base, 0
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name

    def value(self, n):
        """The real value of a weight-only node (evaluated once, from the real parameters)."""
        if n not in self.values:
            if n.op == "placeholder":
                v = self.args[self.placeholders.index(n)]
            elif _is_scalar(n):
                v = int(_val(n)) if isinstance(_val(n), (int, torch.SymInt)) else float(_val(n))
            elif n.op == "get_attr":
                v = operator.attrgetter(n.target)(self.gm)
            else:
                a, kw = fx.node.map_arg((n.args, n.kwargs), self.value)
                v = (self.gm.get_submodule(n.target) if n.op == "call_module" else n.target)(*a, **kw)
            self.values[n] = v
        return self.values[n]

    def init(self, t: torch.Tensor, hint: str) -> str:
        name = self.unique(hint)
        self.inits.append(_tensor(t, name))
        return name

    def scalar(self, v, dtype) -> str:
        key = (float(v) if dtype.is_floating_point else int(v), dtype)
        if key not in self.scalars:
            self.scalars[key] = self.init(torch.tensor(v, dtype=dtype), f"scalar_{len(self.scalars)}")
        return self.scalars[key]

    def ints(self, v) -> str:
        return self.init(torch.tensor(list(v), dtype=torch.int64), "shape")

    def ref(self, a, dtype=None, hint=None) -> str:
        """The ONNX name of an FX argument (weight-only values become initializers on first use)."""
        if a is None:
            return ""
        if not isinstance(a, fx.Node):
            return self.scalar(a, dtype)
        if self.const[a]:
            if a not in self.init_of:
                v = self.value(a)
                if not isinstance(v, torch.Tensor):
                    return self.scalar(v, dtype)
                self.init_of[a] = self.init(v, self.params.get(a.name) or hint or f"const_{a.name}")
            return self.init_of[a]
        if not isinstance(self.names.get(a), str):
            raise UnsupportedOpError(a.target, a.name, "its value is used in a way that has no ONNX translation")
        return self.names[a]

    def emit(self, n, op, inputs, out=None, **attrs) -> str:
        """One ONNX node for FX node `n`, named and annotated with `n`'s module path."""
        path = _path(n)
        out = out or self.unique(f"{n.name}__{op.lower()}")
        node = helper.make_node(op, inputs, [out], name=self.unique(f"{path or n.name}/{op}"), **attrs)
        stack = list((n.meta.get("nn_module_stack") or {}).values())
        meta = {"fxopt.module": path, "fxopt.fx_node": n.name, "fxopt.fx_target": str(n.target)}
        if stack:
            meta["fxopt.module_type"] = getattr(stack[-1][1], "__name__", str(stack[-1][1]))
        if n.meta.get("fxopt_conv_algorithm"):
            meta["fxopt.conv_algorithm"] = n.meta["fxopt_conv_algorithm"]
        node.metadata_props.extend(onnx.StringStringEntryProto(key=k, value=v) for k, v in meta.items())
        trace = (n.meta.get("stack_trace") or "").rstrip().splitlines()
        files = [i for i, line in enumerate(trace) if line.lstrip().startswith("File ")]
        node.doc_string = f"{path or '<top>'}: {n.name} = {n.target}" + (
            "\n" + "\n".join(s.strip() for s in trace[files[-1]:files[-1] + 2]) if files else "")
        self.nodes.append(node)
        return out

    def activation(self, n, x, name, params, dtype, out=None):
        simple = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "hardswish": "HardSwish"}
        if name == "none":
            return x if out is None else self.emit(n, "Identity", [x], out)
        if name in simple:
            return self.emit(n, simple[name], [x], out)
        if name == "hardtanh":
            return self.emit(n, "Clip", [x, self.scalar(params[0], dtype), self.scalar(params[1], dtype)], out)
        if name == "leaky_relu":
            return self.emit(n, "LeakyRelu", [x], out, alpha=float(params[0]))
        if name == "hardsigmoid":
            return self.emit(n, "HardSigmoid", [x], out, alpha=1.0 / 6, beta=0.5)
        if name == "silu":
            return self.emit(n, "Mul", [x, self.emit(n, "Sigmoid", [x])], out)
        if name not in ("gelu", "gelu_tanh"):
            raise UnsupportedOpError(f"activation {name!r}", n.name)
        if self.opset >= 20:
            return self.emit(n, "Gelu", [x], out, approximate="tanh" if name == "gelu_tanh" else "none")
        mul = lambda a, b: self.emit(n, "Mul", [a, b])  # noqa: E731
        if name == "gelu":  # 0.5 x (1 + erf(x / sqrt 2))
            inner = self.emit(n, "Erf", [mul(x, self.scalar(0.5 ** 0.5, dtype))])
        else:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
            s = self.emit(n, "Add", [x, mul(mul(mul(x, x), x), self.scalar(0.044715, dtype))])
            inner = self.emit(n, "Tanh", [mul(s, self.scalar((2 / math.pi) ** 0.5, dtype))])
        half = mul(x, self.scalar(0.5, dtype))
        return self.emit(n, "Mul", [half, self.emit(n, "Add", [inner, self.scalar(1.0, dtype)])], out)

    def run(self, graph_name: str) -> onnx.ModelProto:
        for n in self.gm.graph.nodes:
            if n.op == "placeholder" and not self.const[n]:
                self._input(n, len(self.inputs))
            elif n.op == "output":
                self._outputs(n)
            elif n.op != "placeholder" and not self.const[n]:
                handler = HANDLERS.get(n.target) if n.op == "call_function" else None
                if handler is None:
                    hint = "; training-mode BatchNorm: call model.eval()" if "functional" in str(n.target) else ""
                    raise UnsupportedOpError(n.target, n.name, "no ONNX translation" + hint)
                self.batch[n] = any(self.batch.get(a, False) for a in n.all_input_nodes)
                handler(self, n)
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)],
                                  producer_name="fxopt", producer_version=_version())
        model.ir_version = IR_VERSION
        return model

    def _vinfo(self, name, v, batch):
        if not isinstance(v, torch.Tensor) or v.dtype not in DTYPES:
            raise OnnxExportError(f"graph input/output {name!r} is not a tensor of an ONNX dtype ({v!r})")
        dims = ["batch" if batch and i == 0 else int(s) for i, s in enumerate(v.shape)]
        return helper.make_tensor_value_info(name, DTYPES[v.dtype], dims)

    def _input(self, n, k):
        v = self.args[self.placeholders.index(n)]
        name = self.unique(self.input_names[k] if k < len(self.input_names) else f"input_{k}")
        self.names[n], self.batch[n] = name, self.dynamic and isinstance(v, torch.Tensor) and v.dim() > 0
        self.inputs.append(self._vinfo(name, v, self.batch[n]))

    def _outputs(self, n):
        outs = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
        produced = {o for node in self.nodes for o in node.output}
        for i, o in enumerate(outs):
            if not isinstance(o, fx.Node) or not isinstance(_val(o), torch.Tensor):
                raise OnnxExportError(f"graph output {i} is not a tensor ({o!r})")
            want = self.unique(self.output_names[i] if i < len(self.output_names)
                               else "output" if len(outs) == 1 else f"output_{i}")
            src = self.ref(o)
            src = self.renamed.get(src, src)
            if src in produced and src not in self.renamed:  # rename the producer's output in place
                for node in self.nodes:
                    node.input[:] = [want if x == src else x for x in node.input]
                    node.output[:] = [want if x == src else x for x in node.output]
                self.renamed[src] = want
            else:  # an input, an initializer or a value already returned
                self.emit(o, "Identity", [src], want)
            self.outputs.append(self._vinfo(want, _val(o), self.batch.get(o, False)))

    def keep_batch(self, n, x, ok: bool, what: str):
        if self.dynamic and self.batch.get(x, False) and not ok:
            raise UnsupportedOpError(n.target, n.name, f"{what} moves or mixes the batch dimension; "
                                     "export with dynamic_batch=False")


def graph_to_onnx(gm: fx.GraphModule, args: list, params: dict, *, input_names=None, output_names=None,
                  dynamic_batch: bool = False, opset: int = DEFAULT_OPSET, name: str = "fxopt") -> onnx.ModelProto:
    """Translate an optimized inference graph to ONNX.

    `args`: the real value of every placeholder; `params`: placeholder index -> qualified name of the
    parameters and buffers (initializers, as is every weight-only value computed from them); the other
    tensor placeholders are the graph inputs. Node meta['val'] must hold concrete shapes.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        return _Emitter(gm, list(args), params, input_names, dynamic_batch, opset, output_names).run(name)


def find_unsupported(gm: fx.GraphModule, param_placeholders) -> list[tuple[str, str]]:
    """(node name, op) of each runtime op without a translation (shape-dependent refusals aside)."""
    const = _const_flags(gm, set(param_placeholders), lambda n: True)
    return [(n.name, str(n.target)) for n in gm.graph.nodes if n.op not in ("placeholder", "output")
            and not const[n] and (n.op != "call_function" or n.target not in HANDLERS)]


def _version() -> str:
    """fxopt's installed version (read from the package metadata: the package root imports the
    whole compiler, which imports this module)."""
    try:
        return metadata.version("fxopt")
    except metadata.PackageNotFoundError:
        return "unknown"
