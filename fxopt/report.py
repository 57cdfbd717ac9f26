"""What fxopt did to a model: per-pass records, op counts, conv algorithms, kernels.

``fxopt.explain(...)`` returns a ``Report``; printing it shows the pass table
and the final graph.
"""
from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Optional

import torch.fx as fx

from fxopt.lowered import ExecutorDetails, Lowered


@dataclass
class PassRecord:
    name: str
    status: str = "ran"  # ran | disabled | failed | mismatch
    changed: bool = False
    nodes_before: int = 0
    nodes_after: int = 0
    ms: float = 0.0
    notes: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    erased: list[str] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def summary(self) -> str:
        if self.error:
            return self.error
        if self.status == "disabled":
            return "disabled by options"
        changes = [n for n in self.notes if not n.startswith(("kept", "skipped"))]
        first = (changes or self.notes or [""])[0]
        more = len(changes) - 1
        return first + (f" (+{more} more)" if more > 0 else "")


def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    counts: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            counts[str(node.target)] += 1
        elif node.op == "call_module":
            counts[f"module:{node.target}"] += 1
    return dict(counts)


@dataclass
class GraphReport:
    kind: str  # inference | forward | backward
    before: fx.GraphModule
    after: fx.GraphModule
    passes: list[PassRecord]
    conv_algorithms: dict = field(default_factory=dict)
    kernels: list = field(default_factory=list)
    fallback: Optional[str] = None
    executor: str = "torch"
    cudagraphs: str = "off"
    measurements: int = 0
    compile_ms: float = 0.0
    #: executor decisions, e.g. "node_choices": node -> measured candidates and choice (cuda
    #: executor): the mapping view of ``lowered`` (a dict given here becomes its fields)
    executor_details: Mapping = field(default_factory=dict)
    #: forward/backward graphs: the partitioner and, for a backward, what it reads from its forward
    #: (``fxopt.training``)
    training: dict = field(default_factory=dict)
    #: what the executor did, typed (``fxopt.lowered.Lowered``)
    lowered: Optional[Lowered] = None

    def __post_init__(self):
        if self.lowered is None:
            info = {"executor": self.executor, "cudagraphs": self.cudagraphs, "kernels": self.kernels}
            self.lowered = Lowered.from_info(None, {**info, **dict(self.executor_details)})
        elif self.executor_details:
            view = ExecutorDetails(self.lowered)
            for k, v in dict(self.executor_details).items():
                view[k] = v
        self.executor_details = ExecutorDetails(self.lowered)


_CUDA_GRAPH_TIMES = (("optimized replay", "graph_ms"), ("without early launch", "graph_no_pdl_ms"),
                     ("multi-stream replay", "streams_graph_ms"), ("uncaptured", "plain_ms"),
                     ("unoptimized replay", "baseline_graph_ms"))


def _cuda_graph_lines(i: int, runner) -> list:
    """Per input signature of a graph's CUDA-graph runner: which way it runs and the times behind it."""
    lines = []
    for d in runner.decisions() if runner is not None else []:
        times = ", ".join(f"{name} {d[key]:.3f} ms" for name, key in _CUDA_GRAPH_TIMES if key in d)
        why = d.get("not_measured")
        lines.append(f"graph {i}: CUDA graph runs the {d['runs']}"
                     + (f": {times}" if times else "") + (f" (not measured: {why})" if isinstance(why, str) else "")
                     + (" (cached decision)" if d.get("cached") else ""))
    return lines


def _jsonable(x: Any) -> Any:
    if is_dataclass(x) and not isinstance(x, type):
        return _jsonable(asdict(x))
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


class Report:
    """The result of ``fxopt.explain``: one GraphReport per captured graph."""

    def __init__(self, graphs: list[GraphReport], kernels_per_call: Optional[dict] = None):
        self.graphs = graphs
        #: GPU kernels one call launches (a profiler count on CUDA): {"fxopt": n, "eager": m}
        self.kernels_per_call = kernels_per_call or {}

    def _first(self) -> GraphReport:
        if not self.graphs:
            raise ValueError("fxopt captured no graph (the model ran no tensor operations)")
        return self.graphs[0]

    @property
    def before(self) -> fx.GraphModule:
        return self._first().before

    @property
    def after(self) -> fx.GraphModule:
        return self._first().after

    @property
    def passes(self) -> list[PassRecord]:
        return [p for g in self.graphs for p in g.passes]

    def _sum(self, attr: str) -> dict[str, int]:
        total: collections.Counter = collections.Counter()
        for g in self.graphs:
            total.update(op_counts(getattr(g, attr)))
        return dict(total)

    @property
    def op_counts_before(self) -> dict[str, int]:
        return self._sum("before")

    @property
    def op_counts_after(self) -> dict[str, int]:
        return self._sum("after")

    @property
    def conv_algorithms(self) -> dict:
        return {k: v for g in self.graphs for k, v in g.conv_algorithms.items()}

    @property
    def kernels(self) -> list:
        return [k for g in self.graphs for k in g.kernels]

    @property
    def measurements(self) -> int:
        return sum(g.measurements for g in self.graphs)

    @property
    def fallback(self) -> Optional[str]:
        return next((g.fallback for g in self.graphs if g.fallback), None)

    def to_dict(self) -> dict:
        return _jsonable({
            "graphs": [{
                "kind": g.kind,
                "fallback": g.fallback,
                "executor": g.executor,
                "cudagraphs": g.cudagraphs,
                "measurements": g.measurements,
                "compile_ms": g.compile_ms,
                "executor_details": g.executor_details,
                "training": g.training,
                "passes": [dict(asdict(p), summary=p.summary) for p in g.passes],
                "op_counts_before": op_counts(g.before),
                "op_counts_after": op_counts(g.after),
                "conv_algorithms": g.conv_algorithms,
                "kernels": [{"name": k.name, "compiled": k.compiled, "ops": list(getattr(k, "ops", []) or []),
                             "source": k.source, **({"skipped": k.skipped} if getattr(k, "skipped", None) else {})}
                            for k in g.kernels],
                "graph_after": g.after.print_readable(print_output=False),
            } for g in self.graphs],
            "op_counts_before": self.op_counts_before,
            "op_counts_after": self.op_counts_after,
            "kernels_per_call": self.kernels_per_call,
        })

    def table(self) -> str:
        rows = [("graph", "pass", "changed", "nodes", "ms", "summary")]
        for i, g in enumerate(self.graphs):
            joint = (g.training or {}).get("joint_passes", []) if g.kind == "forward" else []
            records = [(f"{i}:joint", PassRecord(**d)) for d in joint]  # before the split, once per pair
            for label, p in records + [(f"{i}:{g.kind}", p) for p in g.passes]:
                nodes = f"{p.nodes_before}->{p.nodes_after}" if p.status == "ran" else "-"
                rows.append((label, p.name, "yes" if p.changed else ("-" if p.status != "ran" else "no"),
                             nodes, f"{p.ms:.1f}", p.summary[:90]))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def conv_table(self) -> str:
        if not self.conv_algorithms:
            return ""
        lines = ["convolution algorithms:"]
        for name, rec in self.conv_algorithms.items():
            cands = ", ".join(f"{k}={'-' if v is None else f'{v:.3f}'}" for k, v in rec.candidates.items())
            lines.append(f"  {name}: {rec.algorithm}  [{rec.shape_str}]  {cands}  ({rec.how})")
        return "\n".join(lines)

    def fusion_table(self) -> str:
        """The generated kernels of the fusion scheduler (the ATen ops each covers and what the
        executor chose for it) and the ops left to PyTorch with the reason."""
        lines = []
        for i, g in enumerate(self.graphs):
            low = g.lowered
            regions, choices = low.regions, low.node_choices
            if regions:
                lines.append(f"graph {i}: {len(regions)} fused regions")
                for node, r in regions.items():
                    chosen = choices.get(node, {}).get("choice", "not measured")
                    lines.append(f"  {node}: {chosen}  <- {', '.join(r['ops'])}")
            unfused = {k: v for k, v in low.unfused.items() if not v.startswith("no rule for fused_")}
            if unfused:
                lines.append(f"graph {i}: ops run as PyTorch runs them")
                for node, why in unfused.items():
                    lines.append(f"  {node}: {why}")
            lines += [f"graph {i}: {line}" for line in g.executor_details.get("streams") or []]
            lines += _cuda_graph_lines(i, low.cudagraph_runner)
        if self.kernels_per_call:
            lines.append("kernels launched per call: " + ", ".join(f"{k} {v}" for k, v in self.kernels_per_call.items()))
        return "\n".join(lines)

    def cpu_table(self) -> str:
        """The cpu executor's work per graph: the convolutions oneDNN runs with their post-ops,
        those left to PyTorch with the reason, and which graph runs per input signature (the
        optimized one or, where it was faster, the graph as AOTAutograd handed it)."""
        lines = []
        for i, g in enumerate(self.graphs):
            if g.executor != "cpu":
                continue
            onednn = g.lowered.details.get("onednn") or {}
            lines.append(f"graph {i}: {onednn.get('convs', 0)} convolutions as fused oneDNN calls (packed weights)")
            for node, why in (onednn.get("declined") or {}).items():
                lines.append(f"  {node}: PyTorch's ({why})")
            pools = g.lowered.details.get("pools") or {}
            if pools.get("by_slices") or pools.get("declined"):
                lines.append(f"graph {i}: {pools.get('by_slices', 0)} max pools as maxima of strided slices")
                for node, why in (pools.get("declined") or {}).items():
                    lines.append(f"  {node}: ATen's ({why})")
            runner = g.lowered.cpu_runner
            for d in runner.decisions() if runner is not None else []:
                if "optimized_ms" in d:
                    times = ", ".join(f"{name} {d[key]:.3f} ms" for name, key in
                                      (("optimized", "optimized_ms"), ("unoptimized", "baseline_ms"),
                                       ("ONNX Runtime", "onnxruntime_ms"),
                                       ("ONNX Runtime 1 thread", "onnxruntime_1t_ms"),
                                       ("OpenVINO", "openvino_ms"),
                                       ("OpenVINO 1 thread", "openvino_1t_ms"),
                                       ("generated C", "generated_c_ms"),
                                       ("generated C 1 thread", "generated_c_1t_ms")) if key in d)
                    lines.append(f"  runs the {d['runs']}: {times} ({d.get('threads')} threads"
                                 f"{', cached' if d.get('cached') else ''})")
                else:
                    lines.append(f"  runs the {d['runs']} ({d.get('why', '')})")
        return "\n".join(lines)

    def __str__(self) -> str:
        parts = [f"fxopt report: {len(self.graphs)} graph(s)", self.table()]
        if self.fallback:
            parts.append(f"FALLBACK: {self.fallback}")
        conv = self.conv_table()
        if conv:
            parts.append(conv)
        for table in (self.fusion_table(), self.cpu_table()):
            if table:
                parts.append(table)
        from fxopt.dynamic import summary_lines

        for g in self.graphs:
            parts.extend(summary_lines(g.executor_details.get("dynamic") or {}))
        for i, g in enumerate(self.graphs):
            parts.append(f"--- graph {i} ({g.kind}) after the pipeline; executor={g.executor}, cudagraphs={g.cudagraphs}")
            parts.append(g.after.print_readable(print_output=False))
        return "\n".join(parts)

    __repr__ = __str__
