"""An fxopt report as Model Explorer graphs (``model_explorer.graph_builder``).

Per compiled graph of the report, two graphs of one collection: ``graph<i>_optimized``, every node
of the optimized ATen graph, and ``graph<i>_before``, the graph as AOTAutograd handed it to the
passes. A node's id is its FX name; its namespace is the module it came from (``layer1/0/conv1``,
from ``nn_module_stack``), so layers fold and unfold. Nodes without a module (weights folded into
constants, views, layout conversions) take the module that reads them; the ``fxopt_constants``
module and the parameters only it reads form the ``constants`` group. The ops of one generated
kernel (a fused region of the cuda executor, ``executor_details["regions"]``, whose ``"nodes"`` name
the optimized-graph nodes it computes; a measured node group that won, ``["node_groups"]``) form a
group ``kernel <name>`` inside the deepest module holding all of them; a node that several kernels
recompute inline sits in the first one's group. Attributes: the op,
its module, the executor that runs it, the convolution algorithm with its candidates' times, the
cuda executor's measured candidates; outputs: shape, dtype, memory format (the edge label Model
Explorer shows under "tensor shape") and bytes.

The report is read through its public attributes and ``executor_details`` as a mapping, tolerating
absent keys: an executor that reports less shows less.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from fxopt.names import FOLDED_CONSTANTS_MODULE
from fxopt.passinfra import module_path

CONSTANTS_GROUP = "constants"
KERNEL_PREFIX = "kernel "


def require():
    """The ``model_explorer`` module, or an ImportError naming the extra that installs it."""
    try:
        import model_explorer
    except ImportError as e:
        raise ImportError("fxopt.view needs Google's Model Explorer: pip install 'fxopt[view]' "
                          "(the ai-edge-model-explorer package)") from e
    return model_explorer


def graph_ids(i: int) -> tuple[str, str]:
    """The ids of graph ``i``'s optimized and before-the-passes Model Explorer graphs."""
    return f"graph{i}_optimized", f"graph{i}_before"


@dataclass
class KernelGroup:
    """A generated kernel and the ops of the optimized graph it covers."""
    region: str  # the executor's node for it
    kernel: str
    ops: list
    namespace: str = ""
    choice: Optional[str] = None
    ms: dict = field(default_factory=dict)
    compiled: Optional[bool] = None

    @property
    def anchor(self) -> str:
        """The op a kernel's measured time and bytes are shown on: its last op in graph order."""
        return self.ops[-1]


def details(g) -> Any:
    """``executor_details`` of a GraphReport as a mapping (empty when absent)."""
    d = getattr(g, "executor_details", None)
    return d if d is not None else {}


def runnable_of(g) -> Optional[fx.GraphModule]:
    """The graph module the executor runs for a GraphReport (the runner's function, unwrapped)."""
    d = details(g)
    # the runners, then the typed executor record where the report keeps one (CUDA graphs off)
    for fn in [getattr(d.get(key), "fn", None) for key in ("cpu_runner", "cudagraph_runner")] + \
            [getattr(getattr(g, "lowered", None), "fn", None)]:
        for _ in range(4):
            if isinstance(fn, fx.GraphModule):
                return fn
            fn = getattr(fn, "__wrapped__", None)
    return None


def kernel_groups(g) -> list[KernelGroup]:
    """The generated kernels of a GraphReport that cover nodes of its optimized graph, in graph
    order; each node in one group at most (the first that computes it)."""
    names = [n.name for n in g.after.graph.nodes]
    order = {n: i for i, n in enumerate(names)}
    records = {getattr(k, "name", None): k for k in getattr(g, "kernels", []) or []}
    choices = details(g).get("node_choices") or {}
    groups = []
    seen: set = set()
    runnable = None
    for region, r in (details(g).get("regions") or {}).items():
        if r.get("nodes") is not None:  # the optimized-graph nodes the region computes
            ops = [o for o in r["nodes"] if o in order]
        else:  # an older report: ops by name, or by target through the executor's graph
            ops = [o for o in (r.get("ops") or []) if o in order]
            if len(ops) != len(r.get("ops") or []):
                if runnable is None:
                    runnable = runnable_of(g) or False
                ops = _region_members(g.after, runnable, region) if runnable else []
        ops = sorted(set(ops) - seen, key=order.get)
        if not ops:
            continue
        kernel = str(r.get("kernel") or region)
        c = choices.get(region) or {}
        rec = records.get(kernel) or next((k for n, k in records.items() if str(n).startswith(kernel + "_")
                                           and list(getattr(k, "nodes", None) or []) == r.get("nodes")), None)
        groups.append(KernelGroup(region, kernel, ops, choice=c.get("choice"), ms=dict(c.get("ms") or {}),
                                  compiled=getattr(rec, "compiled", None)))
        seen |= set(ops)
    for key, grp in (details(g).get("node_groups") or {}).items():  # measured groups, where one won
        c = choices.get(key) or {}
        kernels = (grp.get("kernels") or {}).get(c.get("choice"))
        ops = sorted(set(o for o in grp.get("nodes") or [] if o in order) - seen, key=order.get)
        if not kernels or not ops:
            continue
        rec = records.get(kernels[0])
        groups.append(KernelGroup(key, " + ".join(kernels), ops, choice=c.get("choice"), ms=dict(c.get("ms") or {}),
                                  compiled=getattr(rec, "compiled", None)))
        seen |= set(ops)
    for rec in getattr(g, "kernels", []) or []:  # kernels that list their ops without a region entry
        ops = sorted((o for o in (getattr(rec, "ops", None) or []) if o in order and o not in seen), key=order.get)
        if ops and len(ops) == len(getattr(rec, "ops")):
            groups.append(KernelGroup(rec.name, rec.name, ops, compiled=getattr(rec, "compiled", None)))
            seen |= set(ops)
    return sorted(groups, key=lambda k: order[k.ops[0]])


def _region_members(after: fx.GraphModule, runnable: fx.GraphModule, region: str) -> list[str]:
    """The optimized-graph nodes a region node of the executor's graph replaced: back from the
    values its outputs carry (an output keeps its original's metadata) to the nodes still in the
    executor's graph (the region's inputs). A convolution whose epilogue moved into the kernel is
    counted in it."""
    node = next((n for n in runnable.graph.nodes if n.name == region), None)
    if node is None:
        return []
    kept = {n.name for n in runnable.graph.nodes}
    by_val = {id(n.meta["val"]): n for n in after.graph.nodes if n.meta.get("val") is not None}
    todo = [by_val[id(u.meta.get("val"))] for u in node.users if id(u.meta.get("val")) in by_val]
    members: set = set()
    while todo:
        n = todo.pop()
        if n.name in members or n.name in kept or n.op in ("placeholder", "get_attr"):
            continue
        members.add(n.name)
        todo += n.all_input_nodes
    return sorted(members)


def _runs(g) -> Optional[str]:
    """Which way a graph's runner runs its (first) input signature: "optimized graph", "onnxruntime"..."""
    d = details(g)
    runner = d.get("cpu_runner") or d.get("cudagraph_runner")
    try:
        decisions = runner.decisions() if runner is not None else []
    except Exception:  # noqa: BLE001 - a runner without decisions says nothing
        decisions = []
    return decisions[0].get("runs") if decisions else None


_CONVS = ("fused_conv", "convolution", "conv2d", "_convolution")
_GEMMS = ("fused_linear", "addmm", "mm", "bmm", "linear", "matmul", "baddbmm")


def op_name(node: fx.Node) -> str:
    """A short name for a node's operation: "fused_conv", "relu", "getitem", a module's name."""
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return t._schema.name.split("::")[-1]
        return getattr(t, "__name__", str(t)).removesuffix("_ref")
    if node.op == "call_module":
        return str(node.target)
    return node.op if node.op == "output" else node.name


def node_executors(g) -> dict[str, str]:
    """Node name -> what runs it: generated, cuDNN, cuBLAS, oneDNN, ONNX Runtime, ATen (PyTorch's
    own kernel), reference (fxopt's PyTorch implementation of a fused op)."""
    executor = str(getattr(g, "executor", "torch"))
    runs = _runs(g)
    d = details(g)
    out = {}
    if executor.startswith("onnxruntime") or runs == "onnxruntime":
        whole = "ONNX Runtime"
    elif runs == "baseline graph":
        whole = "unoptimized graph"
    else:
        whole = None
    declined = (d.get("onednn") or {}).get("declined") or {}
    choices = d.get("node_choices") or {}
    in_kernel = {o: k for k in kernel_groups(g) for o in k.ops}
    for node in g.after.graph.nodes:
        if node.op not in ("call_function", "call_module"):
            continue
        name = op_name(node)
        if node.op == "call_function" and node.target is operator.getitem:
            continue
        if whole is not None:
            out[node.name] = whole
        elif node.name in in_kernel:
            k = in_kernel[node.name]
            out[node.name] = "reference" if k.choice in (None, "reference") else "generated"
        elif executor == "cpu" and name == "fused_conv":
            out[node.name] = "reference" if node.name in declined or d.get("onednn") is None else "oneDNN"
        elif executor == "cuda" and (name in _CONVS or name in _GEMMS):
            choice = (choices.get(node.name) or {}).get("choice")
            if choice and choice.startswith("generated"):
                out[node.name] = "generated"
            else:
                out[node.name] = "cuDNN" if name in _CONVS else "cuBLAS"
        elif name in ("fused_conv", "fused_linear", "batch_norm_relu"):
            out[node.name] = "reference"
        else:
            out[node.name] = "ATen"
    return out


def tensors(v) -> list:
    """The tensors in a node's value (a tensor, or a tuple/list of them)."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in tensors(x)]
    return []


def nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.numel()) * t.element_size()
    except Exception:  # noqa: BLE001 - a symbolic size without a hint
        return 0


def memory_format(t: torch.Tensor) -> str:
    try:
        if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
            return "channels_last"
        if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
            return "channels_last_3d"
        return "contiguous" if t.is_contiguous() else f"strided {tuple(t.stride())}"
    except Exception:  # noqa: BLE001 - symbolic strides
        return "unknown"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _short(v: Any, limit: int = 120) -> str:
    text = str(v)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _common_prefix(namespaces: list[str]) -> str:
    parts = [ns.split("/") if ns else [] for ns in namespaces]
    if not parts:
        return ""
    out = []
    for items in zip(*parts):
        if any(x != items[0] for x in items):
            break
        out.append(items[0])
    return "/".join(out)


def _is_weight(node: fx.Node) -> bool:
    """A placeholder read only by one node and not as its first argument (a weight or bias: it sits
    with that node; the model's inputs stay at the top)."""
    users = list(node.users)
    return len(users) == 1 and node not in users[0].args[:1] and node in users[0].all_input_nodes


def module_namespaces(gm: fx.GraphModule) -> dict[str, str]:
    """Node name -> its module namespace (``layer1/0/conv1``); nodes without a module take the
    common module of their users; the folded-constants module and what only it reads: ``constants``."""
    nodes = list(gm.graph.nodes)
    ns: dict[str, str] = {}
    for node in reversed(nodes):
        if node.op == "output":
            ns[node.name] = ""
            continue
        if node.op == "call_module" and node.target == FOLDED_CONSTANTS_MODULE:
            ns[node.name] = CONSTANTS_GROUP
            continue
        path = module_path(node) if node.op in ("call_function", "call_module") else ""
        if path:
            ns[node.name] = path.replace(".", "/")
            continue
        users = [ns[u.name] for u in node.users if u.name in ns]
        if node.op == "placeholder":
            ns[node.name] = CONSTANTS_GROUP if users and all(u == CONSTANTS_GROUP for u in users) else \
                (users[0] if _is_weight(node) else "")
        else:
            ns[node.name] = _common_prefix([u for u in users if u != CONSTANTS_GROUP] or users)
    return ns


def _conv_attrs(node: fx.Node, conv_algorithms: dict) -> list[tuple[str, str]]:
    path = module_path(node)
    rec = conv_algorithms.get(path) or conv_algorithms.get(node.name)
    if rec is None:
        algo = node.meta.get("fxopt_conv_algorithm")
        return [("conv algorithm", str(algo))] if algo else []
    out = [("conv algorithm", f"{rec.algorithm} ({rec.how})")]
    cands = getattr(rec, "candidates", {}) or {}
    if cands:
        out.append(("conv candidates (ms)", ", ".join(
            f"{k}={'-' if v is None else f'{v:.4f}'}" for k, v in sorted(cands.items(), key=lambda kv: kv[1] or 1e30))))
    if getattr(rec, "shape_str", ""):
        out.append(("conv problem", rec.shape_str))
    for k, why in (getattr(rec, "rejected", {}) or {}).items():
        out.append((f"conv rejected {k}", _short(why)))
    return out


def _ms(ms: dict) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in sorted(ms.items(), key=lambda kv: kv[1]) if isinstance(v, (int, float)))


def _node(me, node: fx.Node, namespace: str, attrs: list[tuple[str, str]]) -> Any:
    gb = me.graph_builder
    v = node.meta.get("val")
    outs = tensors(v) if node.op != "output" else []
    outputs = []
    for i, t in enumerate(outs):
        fmt = memory_format(t)
        outputs.append(gb.MetadataItem(id=str(i), attrs=[
            gb.KeyValue("shape", f"{_dtype(t)}{list(t.shape)} {fmt}"),
            gb.KeyValue("dtype", _dtype(t)),
            gb.KeyValue("memory_format", fmt),
            gb.KeyValue("stride", str(tuple(t.stride())) if fmt != "unknown" else "?"),
            gb.KeyValue("bytes", str(nbytes(t))),
            gb.KeyValue("__tensor_tag", node.name if len(outs) == 1 else f"{node.name}:{i}"),
        ]))
    edges = []
    for j, arg in enumerate(node.all_input_nodes):
        src_out = "0"
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
            src_out = str(node.args[1])
        edges.append(gb.IncomingEdge(sourceNodeId=arg.name, sourceNodeOutputId=src_out, targetNodeInputId=str(j)))
    return gb.GraphNode(id=node.name, label=op_name(node), namespace=namespace,
                        attrs=[gb.KeyValue(k, v) for k, v in attrs], incomingEdges=edges, outputsMetadata=outputs)


def _consts(node: fx.Node) -> str:
    """The non-tensor arguments of a node (strides, paddings, activation names)."""
    parts = [_short(a, 60) for a in node.args if not isinstance(a, fx.Node)
             and not (isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a))]
    parts += [f"{k}={_short(v, 40)}" for k, v in node.kwargs.items() if not isinstance(v, fx.Node)]
    return _short(", ".join(parts), 200)


def optimized_graph(g, i: int, conv_algorithms: Optional[dict] = None) -> Any:
    """Graph ``i`` of a report, after the passes, as a ``graph_builder.Graph``."""
    me = require()
    gb = me.graph_builder
    conv_algorithms = dict(getattr(g, "conv_algorithms", {}) or {}) if conv_algorithms is None else conv_algorithms
    ns = module_namespaces(g.after)
    executors = node_executors(g)
    groups = kernel_groups(g)
    choices = details(g).get("node_choices") or {}
    unfused = details(g).get("unfused") or {}
    declined = (details(g).get("onednn") or {}).get("declined") or {}
    in_kernel = {}
    grouped = {k.kernel for k in groups}
    own_kernels: dict[str, list] = {}  # a node's candidate kernels of its own (per-node templates)
    for rec in getattr(g, "kernels", []) or []:
        nodes = list(getattr(rec, "nodes", None) or [])
        if len(nodes) == 1 and rec.name not in grouped:
            own_kernels.setdefault(nodes[0], []).append(rec.name)
    group_attrs: dict[str, dict[str, str]] = {}
    for k in groups:
        k.namespace = "/".join(p for p in (_common_prefix([ns[o] for o in k.ops]), KERNEL_PREFIX + k.kernel) if p)
        for o in k.ops:
            in_kernel[o] = k
        group_attrs[k.namespace] = {"kernel": k.kernel, "region node": k.region, "ops": str(len(k.ops)),
                                    "executor": executors.get(k.anchor, "generated"),
                                    "choice": str(k.choice or "not measured"), "candidates (ms)": _ms(k.ms) or "-",
                                    "compiled": str(k.compiled)}
    nodes = []
    for node in g.after.graph.nodes:
        attrs = [("op", str(node.target) if node.op != "placeholder" else "placeholder")]
        path = module_path(node) if node.op in ("call_function", "call_module") else ""
        if path:
            attrs.append(("module", path))
        if node.name in executors:
            attrs.append(("executor", executors[node.name]))
        if node.op in ("call_function", "call_module") and _consts(node):
            attrs.append(("args", _consts(node)))
        k = in_kernel.get(node.name)
        if k is not None:
            attrs += [("kernel", k.kernel), ("kernel choice", str(k.choice or "not measured"))]
        if node.name in own_kernels:
            attrs.append(("generated kernels", _short(", ".join(own_kernels[node.name]), 200)))
        c = choices.get(node.name)
        if c:
            attrs.append(("choice", str(c.get("choice"))))
            if c.get("ms"):
                attrs.append(("candidates (ms)", _ms(c["ms"])))
        if node.name in unfused:
            attrs.append(("not fused", _short(unfused[node.name], 200)))
        if node.name in declined:
            attrs.append(("not oneDNN", _short(declined[node.name], 200)))
        if op_name(node) in _CONVS:
            attrs += _conv_attrs(node, conv_algorithms)
        if node.meta.get("fxopt_const"):
            attrs.append(("folded constant", "evaluated once"))
        nodes.append(_node(me, node, k.namespace if k is not None else ns[node.name], attrs))
    opt_id, before_id = graph_ids(i)
    runs = _runs(g)
    group_attrs[""] = {"graph": opt_id, "kind": str(getattr(g, "kind", "")), "executor": str(getattr(g, "executor", "")),
                       "cudagraphs": str(getattr(g, "cudagraphs", "")), "runs": str(runs or "-"),
                       "fallback": str(getattr(g, "fallback", None) or "-"), "kernels": str(len(groups)),
                       "compared with": before_id}
    return gb.Graph(id=opt_id, nodes=nodes, groupNodeAttributes=group_attrs,
                    groupNodeConfigs=[gb.GroupNodeConfig(namespaceRegex=f".*{KERNEL_PREFIX}.*",
                                                         backgroundColor="#fff3e0", borderColor="#ef6c00")])


def before_graph(g, i: int) -> Any:
    """Graph ``i`` of a report as AOTAutograd handed it to the passes, as a ``graph_builder.Graph``."""
    me = require()
    ns = module_namespaces(g.before)
    nodes = []
    for node in g.before.graph.nodes:
        attrs = [("op", str(node.target) if node.op != "placeholder" else "placeholder")]
        if node.op in ("call_function", "call_module") and _consts(node):
            attrs.append(("args", _consts(node)))
        nodes.append(_node(me, node, ns[node.name], attrs))
    opt_id, before_id = graph_ids(i)
    return me.graph_builder.Graph(id=before_id, nodes=nodes,
                                  groupNodeAttributes={"": {"graph": before_id, "before the passes of": opt_id}})


def collection(report, label: str = "fxopt") -> Any:
    """The report's graphs as one ``graph_builder.GraphCollection``: per compiled graph, the
    optimized graph then the graph before the passes."""
    me = require()
    graphs = []
    for i, g in enumerate(report.graphs):
        graphs += [optimized_graph(g, i), before_graph(g, i)]
    return me.graph_builder.GraphCollection(label=label, graphs=graphs)
