"""Optimized FX graphs as plain JSON: what a package and the whole-compile cache store.

Why not ``torch.export.save`` / ``torch.export.load``: loading an exported program imports
Dynamo's tracer (``torch._dynamo``, ~1.2 s on a 2-core host) and rebuilds a FakeTensor for every
node (0.75 s for ResNet-50), before any weight is read: a package could not load in under a
second, and the loading process would import what it must not need. Nor pickle: a package is a
file people pass around, and unpickling runs whatever the file says.

What is stored: per node its name, op (placeholder / call_function / call_module / get_attr /
output), target, args and kwargs, and the few ``meta`` entries fxopt's reports and executors
read (the module path, the conv algorithm chosen). Targets are named, never pickled:
``torch.ops`` overloads by ``namespace.op.overload`` ("aten.convolution.default",
"fxopt.fused_conv.default") and Python functions of ``operator``, ``math`` and ``torch``'s
``sym_*`` helpers by ``module:name``; nothing else is resolved on reading, so reading a graph
runs no code the file names. Arguments are JSON with tagged objects for what JSON lacks (node
references, tuples, dtypes, devices, memory formats, layouts). A ``call_module`` of
``fold_constants``' weight-only graph (``FoldedConstants``) is stored with its subgraph.
``meta["val"]`` is stored on request (``graph_to_json(vals=True)``, the whole-compile cache: static
values rebuilt as FakeTensors; packages: sizes as expressions of the batch, rebuilt as meta tensors at
each batch size, ``eval_size``); otherwise a reader that needs it propagates it (``FakeTensorProp``).

Anything else (a tensor literal in an argument, an unnamed Python callable, another submodule)
raises ``GraphFormatError`` when writing: the caller then does not store the graph.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import math
import operator
import re
from typing import Any, Optional

import torch
import torch.fx as fx

#: bumped when the JSON layout changes (readers refuse other versions)
GRAPH_FORMAT = 1
#: meta entries kept (module provenance for reports and dict-valued options; fxopt's own marks)
META_KEYS = ("nn_module_stack", "fxopt_conv_algorithm", "fxopt_conv_algorithm_how", "fxopt_const")
#: modules whose functions may be graph targets (resolved by name on reading)
PY_MODULES = {"_operator": operator, "operator": operator, "math": math, "torch": torch}


class GraphFormatError(ValueError):
    """A graph that cannot be written as JSON, or JSON that is not a graph of this format."""


_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)}
_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
            "channels_last_3d": torch.channels_last_3d, "preserve_format": torch.preserve_format}
_LAYOUTS = {"strided": torch.strided}


def target_name(target: Any) -> dict:
    if isinstance(target, torch._ops.OpOverload):
        return {"op": f"{target.namespace}.{target._opname}.{target._overloadname}"}
    module = getattr(target, "__module__", None)
    name = getattr(target, "__name__", None)
    if module in PY_MODULES and name and getattr(PY_MODULES[module], name, None) is target:
        return {"py": f"{module}:{name}"}
    raise GraphFormatError(f"target {target!r} cannot be named (only torch.ops overloads and "
                           f"functions of {sorted(PY_MODULES)})")


def resolve_target(spec: dict):
    if "op" in spec:
        ns, rest = spec["op"].split(".", 1)
        name, overload = rest.rsplit(".", 1)
        try:
            return getattr(getattr(getattr(torch.ops, ns), name), overload)
        except (AttributeError, RuntimeError) as e:
            raise GraphFormatError(f"operator {spec['op']} is not registered in this process "
                                   f"(another torch version, or a library that defines it is not imported)") from e
    if "py" in spec:
        module, name = spec["py"].split(":", 1)
        fn = getattr(PY_MODULES.get(module), name, None) if module in PY_MODULES else None
        if fn is None or (module == "torch" and not name.startswith("sym_")):
            raise GraphFormatError(f"function {spec['py']} is not one a graph may name")
        return fn
    raise GraphFormatError(f"bad target {spec!r}")


def encode_arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return {"n": a.name}
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if isinstance(a, float):
        return a if math.isfinite(a) else {"f": repr(a)}
    if isinstance(a, list):
        return [encode_arg(x) for x in a]
    if isinstance(a, tuple):
        return {"t": [encode_arg(x) for x in a]}
    if isinstance(a, dict):
        if not all(isinstance(k, str) for k in a):
            raise GraphFormatError(f"dict argument with non-string keys: {a!r}")
        return {"d": {k: encode_arg(v) for k, v in a.items()}}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).replace("torch.", "")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).replace("torch.", "")}
    if isinstance(a, torch.layout):
        return {"layout": str(a).replace("torch.", "")}
    raise GraphFormatError(f"argument {type(a).__name__} {a!r} has no JSON form")


def decode_arg(a: Any, env: dict) -> Any:
    if isinstance(a, list):
        return [decode_arg(x, env) for x in a]
    if not isinstance(a, dict):
        return a
    (tag, v), = a.items()
    if tag == "n":
        return env[v]
    if tag == "t":
        return tuple(decode_arg(x, env) for x in v)
    if tag == "d":
        return {k: decode_arg(x, env) for k, x in v.items()}
    if tag == "f":
        return float(v)
    table = {"dtype": _DTYPES, "memory_format": _FORMATS, "layout": _LAYOUTS}.get(tag)
    if table is not None:
        if v not in table:
            raise GraphFormatError(f"unknown {tag} {v!r}")
        return table[v]
    if tag == "device":
        return torch.device(v)
    raise GraphFormatError(f"unknown tagged argument {a!r}")


def _meta(node: fx.Node) -> dict:
    out = {}
    for key in META_KEYS:
        v = node.meta.get(key)
        if v is None:
            continue
        if key == "nn_module_stack":  # {id: (path, type)} -> [[id, path, type name]]
            v = [[k, p, getattr(t, "__qualname__", str(t))] for k, (p, t) in v.items()]
        out[key] = v
    return out


def _unmeta(meta: dict) -> dict:
    out = dict(meta)
    if "nn_module_stack" in out:
        out["nn_module_stack"] = {k: (p, t) for k, p, t in out["nn_module_stack"]}
    return out


def _val_json(v, batch=None) -> Any:
    """A node's value as JSON: a tensor's shape, strides, dtype, device and requires_grad (or a tuple
    of them, or an int), enough to rebuild it; else None. Sizes are ints, or with ``batch`` (the name
    of the batch's symbol) expressions of ``B`` where they depend on it and on nothing else; with a
    tuple of symbol names, expressions of ``B0``, ``B1``, ... (those symbols in that order)."""
    names = {batch: "B"} if isinstance(batch, str) else {b: f"B{i}" for i, b in enumerate(batch or ())}

    def size(d):
        if isinstance(d, int):
            return d
        free = {str(f) for f in d.node.expr.free_symbols} if isinstance(d, torch.SymInt) else None
        if not names or free is None or free - set(names):
            raise ValueError(d)
        return re.sub(r"\b[A-Za-z_]\w*\b", lambda m: names.get(m.group(0), m.group(0)), str(d.node.expr))

    try:
        if isinstance(v, torch.Tensor):
            offset = size(v.storage_offset())  # a view into its storage: where it starts (else left out)
            return [[size(d) for d in v.shape], [size(s) for s in v.stride()], str(v.dtype).replace("torch.", ""),
                    str(v.device), bool(v.requires_grad)] + ([offset] if offset != 0 else [])
        if isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool):
            return {"i": size(v)}
    except ValueError:
        return None
    if isinstance(v, (tuple, list)) and v and all(isinstance(t, torch.Tensor) for t in v):
        parts = [_val_json(t, batch) for t in v]
        return None if None in parts else {"t": parts}
    return None


def _small_power(a: int, b: int) -> int:
    if not 0 <= b <= 8:  # a size is a product of a few sizes (a file's expression must not run away)
        raise ValueError(f"size exponent {b}")
    return a ** b


_SIZE_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _small_power}
_SIZE_CALLS = {"FloorDiv": operator.floordiv, "Mod": operator.mod, "PythonMod": operator.mod,
               "Max": max, "Min": min}


@functools.lru_cache(maxsize=8192)
def _parsed(e: str) -> ast.Expression:
    return ast.parse(e, mode="eval")


def eval_size(e, batch) -> int:
    """A size ``_val_json`` wrote, at this batch: an int, or an expression of ``B`` with integers,
    + - * // % **, and sympy's FloorDiv/Mod/Max/Min; anything else raises ValueError. ``batch``: B's
    value, or a dict of the values of ``B0``, ``B1``, ... (``_val_json`` with several symbols)."""
    if isinstance(e, int):
        return e
    values = batch if isinstance(batch, dict) else {"B": batch} if batch is not None else {}

    def ev(t):
        if isinstance(t, ast.Expression):
            return ev(t.body)
        if isinstance(t, ast.Constant) and type(t.value) is int:
            return t.value
        if isinstance(t, ast.Name) and t.id in values:
            return values[t.id]
        if isinstance(t, ast.BinOp) and type(t.op) in _SIZE_OPS:
            return _SIZE_OPS[type(t.op)](ev(t.left), ev(t.right))
        if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.USub):
            return -ev(t.operand)
        if isinstance(t, ast.Call) and isinstance(t.func, ast.Name) and t.func.id in _SIZE_CALLS and not t.keywords:
            return _SIZE_CALLS[t.func.id](*map(ev, t.args))
        raise ValueError(f"size expression {e!r}")

    try:
        return int(ev(_parsed(str(e))))
    except (SyntaxError, ArithmeticError, RecursionError) as exc:
        raise ValueError(f"size expression {e!r}") from exc


def _fake_empty(mode, shape, stride, dtype, device: str):
    """A FakeTensor of ``mode`` with these sizes, made as the mode makes its kernels' results: a meta
    tensor wrapped on its device (a fifth of the cost of ``empty_strided`` under the mode, which a
    size's lowering pays for every node of two graphs); None where that is not possible here (a
    mode active already, a torch without the converter)."""
    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if type(meta) is not torch.Tensor:
        return None
    try:
        return mode.fake_tensor_converter.from_meta_and_device(mode, meta, torch.device(device))
    except (AttributeError, TypeError):
        return None


def _val_from_json(v, mode, batch: Optional[int] = None):
    """The value ``_val_json`` wrote, at ``batch``: a FakeTensor of ``mode``, or with ``mode`` None a
    meta tensor (an int, a tuple of them)."""
    if isinstance(v, dict):
        return eval_size(v["i"], batch) if "i" in v else tuple(_val_from_json(t, mode, batch) for t in v["t"])
    shape, stride, dtype, device, grad, *offset = v
    shape, stride = [eval_size(d, batch) for d in shape], [eval_size(s, batch) for s in stride]
    offset = eval_size(offset[0], batch) if offset else 0
    t = _fake_empty(mode, shape, stride, _DTYPES[dtype], device) if mode is not None and not offset else None
    if t is not None:
        return t.requires_grad_(grad) if grad else t
    with contextlib.nullcontext() if mode is None else mode:
        dev = "meta" if mode is None else torch.device(device)
        if offset:  # a view at that offset of a storage holding it
            span = 0 if 0 in shape else 1 + sum((n - 1) * abs(st) for n, st in zip(shape, stride))
            t = torch.empty(offset + span, dtype=_DTYPES[dtype], device=dev).as_strided(shape, stride, offset)
        else:
            t = torch.empty_strided(shape, stride, dtype=_DTYPES[dtype], device=dev)
    return t.requires_grad_(grad) if grad else t


def rebuild_vals(gm: fx.GraphModule, data: dict, mode) -> bool:
    """Put back the FakeTensors ``graph_to_json(..., vals=True)`` described, in ``mode``; True when
    every node that produces a tensor got one (else the caller propagates them itself)."""
    stored = {e["name"]: e["val"] for e in data["nodes"] if "val" in e}
    complete = True
    for n in gm.graph.nodes:
        if n.name in stored:
            n.meta["val"] = _val_from_json(stored[n.name], mode)
        elif n.op not in ("output", "get_attr"):
            complete = False
    for name, sub in data.get("modules", {}).items():
        call = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == name), None)
        if call is not None and "val" in call.meta:
            gm.get_submodule(name).remember_fake([a.meta.get("val") for a in call.args], list(call.meta["val"]))
    return complete


def graph_to_json(gm: fx.GraphModule, vals: bool = False) -> dict:
    """The JSON form of ``gm``'s graph (and of a ``FoldedConstants`` submodule's graph). With
    ``vals``, static tensor metadata per node too (``rebuild_vals``)."""
    from fxopt.passes.fold_constants import FoldedConstants

    nodes, modules = [], {}
    for n in gm.graph.nodes:
        entry = {"name": n.name, "op": n.op}
        if n.op == "call_function":
            entry["target"] = target_name(n.target)
        elif n.op in ("call_module", "get_attr"):
            entry["target"] = n.target
            if n.op == "call_module":
                sub = gm.get_submodule(n.target)
                if not isinstance(sub, FoldedConstants):
                    raise GraphFormatError(f"submodule {n.target} ({type(sub).__name__}) has no JSON form")
                modules[n.target] = {"graph": graph_to_json(sub.graph_module), "inputs": list(sub.input_names)}
        elif n.op == "placeholder":
            entry["target"] = n.target
        entry["args"] = encode_arg(tuple(n.args))
        entry["kwargs"] = encode_arg(dict(n.kwargs))
        meta = _meta(n)
        if meta:
            entry["meta"] = meta
        if vals and n.op != "output":
            v = _val_json(n.meta.get("val"))
            if v is not None:
                entry["val"] = v
        nodes.append(entry)
    return {"format": GRAPH_FORMAT, "nodes": nodes, "modules": modules}


def graph_from_json(data: dict, owner: Optional[torch.nn.Module] = None,
                    attributes: Optional[dict] = None) -> fx.GraphModule:
    """The GraphModule of ``graph_to_json``'s output. ``get_attr`` targets are taken from
    ``attributes`` (name -> tensor) or else from ``owner``; runs nothing the file names."""
    from fxopt.passes.fold_constants import FoldedConstants

    if not isinstance(data, dict) or data.get("format") != GRAPH_FORMAT:
        raise GraphFormatError(f"not a graph of format {GRAPH_FORMAT}")
    root = torch.nn.Module()
    for name, sub in data.get("modules", {}).items():
        root.add_module(name, FoldedConstants(graph_from_json(sub["graph"], owner, attributes), list(sub["inputs"])))
    graph, env = fx.Graph(), {}
    for entry in data["nodes"]:
        op, name = entry["op"], entry["name"]
        args = decode_arg(entry.get("args", {"t": []}), env)
        kwargs = decode_arg(entry.get("kwargs", {"d": {}}), env)
        if op in ("placeholder", "call_module"):
            target = entry["target"]
        elif op == "call_function":
            target = resolve_target(entry["target"])
        elif op == "get_attr":
            target = entry["target"]
            value = (attributes or {}).get(target)
            if value is None and owner is not None:
                value = operator.attrgetter(target)(owner)
            if value is None:
                raise GraphFormatError(f"attribute {target} is missing")
            _set_attr(root, target, value)
        elif op == "output":
            target = "output"
        else:
            raise GraphFormatError(f"unknown node op {op!r}")
        node = graph.create_node(op, target, tuple(args), kwargs, name=name)
        node.meta.update(_unmeta(entry.get("meta", {})))
        env[name] = node
    graph.lint()
    return fx.GraphModule(root, graph, class_name="FxoptGraph")


def _set_attr(root: torch.nn.Module, target: str, value) -> None:
    *path, leaf = target.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, torch.nn.Module())
        mod = getattr(mod, p)
    if isinstance(value, torch.nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(leaf, value)
    else:
        setattr(mod, leaf, value)
