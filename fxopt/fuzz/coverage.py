"""What the fuzzed graphs reached: kernel families, ops, dtypes, layouts, modes, options.

Each graph adds one count to every key it exercised (a graph with three generated reductions
counts once for ``reduction:rows``). Kernel families come from the generated kernels' names
(``report.kernels``) and the cuda executor's per-node choices (``executor_details``), convolution
algorithms from ``report.conv_algorithms``. ``FAMILIES`` lists the families a long run should
reach; ``missing()`` names those it never did, so that a large number of graphs cannot hide a
family nothing reached.

The counts are the search's: ``graphs`` programs drawn and passed (``eager_errors`` of them where
eager raised and fxopt raised the same), ``failures`` distinct failing programs (one reproducer
each); the examples hypothesis ran while shrinking a failure are counted apart (``shrink_runs``, of
which ``shrink_failed`` failed), not in the coverage.
"""
from __future__ import annotations

import json
import re
from collections import Counter

#: kernel-name prefix -> family (first match wins)
_NAME_FAMILIES = [
    (r"^fx_red_.*_cols\d+v\d+(s\d+)?t?w\d+_", "reduction:outer_heavy"), (r"^fx_pw_.*_tile\d+", "pointwise:tiled"),
    (r"^fx_red_.*_rows\d+v", "reduction:rows"), (r"^fx_red_.*_inner\d+", "reduction:inner"),
    (r"^fx_red_.*_(outer|cols)\d+", "reduction:outer"), (r"^fx_red_", "reduction:other"),
    (r"^fx_pw_conv_epi", "pointwise:conv_epilogue"), (r"^fx_pw_", "pointwise:region"),
    (r"^fx_gap_", "pool:global_avg"), (r"^fx_(max|avg)pool", "pool:window"),
    (r"^fx_gconv", "conv:grouped"), (r"^fx_dwr", "conv:depthwise_rows"), (r"^fx_dwv", "conv:depthwise_vec"),
    (r"^fx_dw", "conv:depthwise"), (r"^fx_dconv.*_maxpool", "conv:direct_maxpool"), (r"^fx_dconv", "conv:direct"),
    (r"^fx_linear_chain", "linear:chain"), (r"^fx_linear_", "linear:rows"), (r"^fx_wino_", "conv:winograd"),
]
#: the families a long GPU run must reach (CPU runs reach the kernels' generation only)
FAMILIES = ("reduction:rows", "reduction:inner", "reduction:outer", "reduction:outer_heavy", "pointwise:region",
            "pointwise:tiled", "pool:global_avg",
            "pool:window", "conv:grouped", "conv:depthwise", "conv:direct", "linear:rows", "conv:winograd",
            "algorithm:direct", "algorithm:winograd_2x2_3x3", "algorithm:winograd_4x4_3x3", "algorithm:fft",
            "algorithm:gemm")
#: families no executor launches today, with why (a run cannot reach them; they stay listed as never reached)
NOT_LAUNCHED: dict = {}


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
            "dtypes": {program.dtype}, "targets": {getattr(program, "target", "any")}, "layouts": {program.fmt}, "modes": {program.mode},
            "executors": {program.options.get("executor", "auto")},
            "cudagraphs": {str(program.options.get("cudagraphs", "default"))},
            "graph_kinds": {g.kind for g in graphs}}


class Coverage:
    SECTIONS = ("families", "targets", "choices", "ops", "dtypes", "layouts", "modes", "executors", "cudagraphs",
                "graph_kinds", "eager_error_types", "upstream", "eager_overflow")

    TOTALS = ("graphs", "eager_errors", "failures", "shrink_runs", "shrink_failed")

    def __init__(self):
        self.graphs = self.eager_errors = self.failures = self.shrink_runs = self.shrink_failed = 0
        self.counts = {s: Counter() for s in self.SECTIONS}

    def add(self, program, graphs: list, eager_error: str | None = None, upstream: str | None = None,
            eager_overflow: str | None = None) -> None:
        self.graphs += 1
        self.eager_errors += bool(eager_error)
        keys = graph_keys(program, graphs)
        if eager_error:
            keys["eager_error_types"] = {eager_error}
        if upstream:  # fxopt as PyTorch's own compiled graph, both unlike eager (check._upstream)
            keys["upstream"] = {upstream}
        if eager_overflow:  # eager's own 16-bit backward overflowed, fxopt's gradients differ (check.py)
            keys["eager_overflow"] = {eager_overflow}
        for sec, ks in keys.items():
            self.counts[sec].update(ks)

    def missing(self, families=FAMILIES) -> list:
        return [f for f in families if not self.counts["families"][f]]

    def to_json(self) -> dict:
        return {**{t: getattr(self, t) for t in self.TOTALS},
                **{s: dict(sorted(c.items())) for s, c in self.counts.items()}, "missing_families": self.missing()}

    @classmethod
    def from_json(cls, d: dict) -> "Coverage":
        cov = cls()
        for t in cls.TOTALS:
            setattr(cov, t, d.get(t, 0))
        for s in cls.SECTIONS:
            cov.counts[s].update(d.get(s, {}) if isinstance(d.get(s), dict) else {})
        return cov

    def merge(self, other: "Coverage") -> "Coverage":
        for t in self.TOTALS:
            setattr(self, t, getattr(self, t) + getattr(other, t))
        for s in self.SECTIONS:
            self.counts[s].update(other.counts[s])
        return self

    def write(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=True)

    def table(self) -> str:
        lines = [f"coverage of the search: {self.graphs} programs passed (eager errors: {self.eager_errors}, "
                 f"fxopt raising the same), {self.failures} failing programs (one reproducer each); "
                 f"shrinking ran {self.shrink_runs} more examples ({self.shrink_failed} failed), not counted below"]
        for s in self.SECTIONS:
            items = ", ".join(f"{k} {v}" for k, v in sorted(self.counts[s].items(), key=lambda kv: (-kv[1], kv[0])))
            lines.append(f"  {s}: {items or '-'}")
        miss = self.missing()
        lines.append(f"  never reached: {', '.join(miss) if miss else 'none'}")
        lines += [f"    {f}: {NOT_LAUNCHED[f]}" for f in miss if f in NOT_LAUNCHED]
        return "\n".join(lines)
