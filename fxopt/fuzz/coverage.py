"""What the fuzzed graphs reached: kernel families, ops, dtypes, layouts, modes, options.

Each graph adds one count to every key it exercised (a graph with three generated reductions
counts once for ``reduction:rows``). Kernel families come from the generated kernels' names
(``report.kernels``) and the cuda executor's per-node choices (``executor_details``), convolution
algorithms from ``report.conv_algorithms``. ``FAMILIES`` lists the families a long run should
reach; ``missing()`` names those it never did, so that a large number of graphs cannot hide a
family nothing reached.
"""
from __future__ import annotations

import json
import re
from collections import Counter

#: kernel-name prefix -> family (first match wins)
_NAME_FAMILIES = [
    (r"^fx_red_.*_rows\d+v", "reduction:rows"), (r"^fx_red_.*_inner\d+", "reduction:inner"),
    (r"^fx_red_.*_outer\d+", "reduction:outer"), (r"^fx_red_", "reduction:other"),
    (r"^fx_pw_conv_epi", "pointwise:conv_epilogue"), (r"^fx_pw_", "pointwise:region"),
    (r"^fx_gap_", "pool:global_avg"), (r"^fx_(max|avg)pool", "pool:window"),
    (r"^fx_gconv", "conv:grouped"), (r"^fx_dwr", "conv:depthwise_rows"), (r"^fx_dwv", "conv:depthwise_vec"),
    (r"^fx_dw", "conv:depthwise"), (r"^fx_dconv.*_maxpool", "conv:direct_maxpool"), (r"^fx_dconv", "conv:direct"),
    (r"^fx_linear_chain", "linear:chain"), (r"^fx_linear_", "linear:rows"), (r"^fx_wino_", "conv:winograd"),
]
#: the families a long GPU run must reach (CPU runs reach the kernels' generation only)
FAMILIES = ("reduction:rows", "reduction:inner", "reduction:outer", "pointwise:region", "pool:global_avg",
            "pool:window", "conv:grouped", "conv:depthwise", "conv:direct", "linear:rows", "conv:winograd",
            "algorithm:direct", "algorithm:winograd_2x2_3x3", "algorithm:winograd_4x4_3x3", "algorithm:fft",
            "algorithm:gemm")


def kernel_family(name: str) -> str:
    for pat, fam in _NAME_FAMILIES:
        if re.search(pat, name):
            return fam
    return "other:" + re.sub(r"_[0-9a-f]{8,}$", "", name)[:32]


def graph_keys(program, graphs: list) -> dict:
    """{section: set of keys} that one program exercised."""
    fams, algs, choices = set(), set(), set()
    for g in graphs:
        fams |= {kernel_family(k.name) for k in g.kernels}
        algs |= {getattr(c, "algorithm", str(c)) for c in g.conv_algorithms.values()}
        try:
            nc = g.executor_details.get("node_choices", {}) or {}
        except Exception:  # noqa: BLE001 - the details view of another executor
            nc = {}
        for d in nc.values():
            if isinstance(d, dict) and d.get("choice"):
                choices.add(str(d["choice"]))
    fams |= {f"algorithm:{a}" for a in algs}
    return {"families": fams, "choices": choices, "ops": set(program.ops),
            "dtypes": {program.dtype}, "layouts": {program.fmt}, "modes": {program.mode},
            "executors": {program.options.get("executor", "auto")},
            "cudagraphs": {str(program.options.get("cudagraphs", "default"))},
            "graph_kinds": {g.kind for g in graphs}}


class Coverage:
    SECTIONS = ("families", "choices", "ops", "dtypes", "layouts", "modes", "executors", "cudagraphs", "graph_kinds")

    def __init__(self):
        self.graphs = 0
        self.failures = 0
        self.counts = {s: Counter() for s in self.SECTIONS}

    def add(self, program, graphs: list) -> None:
        self.graphs += 1
        for sec, keys in graph_keys(program, graphs).items():
            self.counts[sec].update(keys)

    def missing(self, families=FAMILIES) -> list:
        return [f for f in families if not self.counts["families"][f]]

    def to_json(self) -> dict:
        return {"graphs": self.graphs, "failures": self.failures,
                **{s: dict(sorted(c.items())) for s, c in self.counts.items()}, "missing_families": self.missing()}

    @classmethod
    def from_json(cls, d: dict) -> "Coverage":
        cov = cls()
        cov.graphs, cov.failures = d.get("graphs", 0), d.get("failures", 0)
        for s in cls.SECTIONS:
            cov.counts[s].update(d.get(s, {}))
        return cov

    def merge(self, other: "Coverage") -> "Coverage":
        self.graphs += other.graphs
        self.failures += other.failures
        for s in self.SECTIONS:
            self.counts[s].update(other.counts[s])
        return self

    def write(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=True)

    def table(self) -> str:
        lines = [f"coverage: {self.graphs} graphs, {self.failures} failures"]
        for s in self.SECTIONS:
            items = ", ".join(f"{k} {v}" for k, v in sorted(self.counts[s].items(), key=lambda kv: (-kv[1], kv[0])))
            lines.append(f"  {s}: {items or '-'}")
        miss = self.missing()
        lines.append(f"  never reached: {', '.join(miss) if miss else 'none'}")
        return "\n".join(lines)
