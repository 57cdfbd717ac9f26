"""The zoo benchmark's report (``fxopt bench --zoo`` / ``--zoo-merge``): per-cell table, summary
(geometric mean of fxopt's speed-up over the best peer, minimum, cells below 1.0x, lowest 10) and a
chart of the distribution; the parts' ``zoo.json`` merged into one.

A zoo document is the harness's results (``meta``, ``peak``, ``flops``, ``cells``, ``checks``: what
``fxopt.bench.report`` reads) plus ``zoo``, one record per (model, cell) (``fxopt.bench.zoo.cell_record``)
and ``left``, the cells not measured yet.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence

from .report import _fmt, _header, _short, merge_results, read_results, write_markdown

__all__ = ["geomean", "merge_parts", "render_zoo_markdown", "summarize", "write_chart", "write_zoo_reports"]

BELOW = 1.0  # a cell "below" is one where fxopt is slower than the best peer


def geomean(xs: Sequence[float]) -> Optional[float]:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _counted(r: Dict[str, Any]) -> bool:
    """In the speed-up statistics: measured and not failing the accuracy check."""
    return r.get("status") == "ok" and r.get("speedup") is not None and r.get("accuracy_ok") is not False


def summarize(records: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Counts by status, and over the counted cells: geomean, min, cells below 1.0x, the lowest 10,
    the geomean per cell kind."""
    counted = [r for r in records if _counted(r)]
    sp = [r["speedup"] for r in counted]
    low = sorted(counted, key=lambda r: r["speedup"])
    by_cell: Dict[str, List[float]] = {}
    for r in counted:
        by_cell.setdefault(r["cell"], []).append(r["speedup"])
    return {
        "cells": len(records), "counted": len(counted),
        "ok": sum(r.get("status") == "ok" for r in records),
        "skipped": sum(r.get("status") == "skipped" for r in records),
        "failed": sum(r.get("status") == "failed" for r in records),
        "accuracy_failed": sum(r.get("accuracy_ok") is False for r in records),
        "accuracy_unchecked": sum(str(r.get("accuracy_reason", "")).startswith("not checkable") for r in records),
        "peer_failed": sum(bool(r.get("peers_failed")) for r in counted),
        "geomean": geomean(sp), "min": low[0]["speedup"] if low else None,
        "min_cell": f"{low[0]['model']} {low[0]['cell']}" if low else None,
        "below_1": sum(x < BELOW for x in sp), "max": max(sp) if sp else None,
        "lowest": [{k: r.get(k) for k in ("model", "cell", "speedup", "best_peer")} for r in low[:10]],
        "by_cell": {c: {"n": len(v), "geomean": geomean(v), "below_1": sum(x < BELOW for x in v)}
                    for c, v in sorted(by_cell.items())},
    }


def _x(v: Optional[float]) -> str:
    return f"{v:.2f}×" if v is not None else "–"


def _accuracy(r: Dict[str, Any]) -> str:
    if r.get("accuracy_ok") is None:
        return "not checkable" if str(r.get("accuracy_reason", "")).startswith("not checkable") else "–"
    err = f"{_fmt(r.get('max_rel_err'), '.1e')} ≤ {_fmt(r.get('tol'), '.0e')}" if r["accuracy_ok"] else \
        _short(r.get("accuracy_reason"), 40)
    return ("ok " if r["accuracy_ok"] else "✗ ") + err


def render_zoo_markdown(doc: Dict[str, Any]) -> str:
    recs = doc.get("zoo", [])
    s = summarize(recs)
    lines = ["# fxopt zoo benchmark"] + _header(doc)[1:]
    peers = sorted({", ".join(r.get("peers") or []) for r in recs if r.get("peers")})
    lines += [f"- peers: {p}" for p in peers] + [""]
    lines += ["## Summary", "",
              f"- cells: {s['cells']} ({s['ok']} measured, {s['skipped']} skipped, {s['failed']} failed; "
              f"{s['accuracy_failed']} failing the accuracy check, left out of the statistics"
              + (f"; {s['accuracy_unchecked']} whose accuracy is not checkable" if s.get("accuracy_unchecked") else "")
              + ")"
              + (f"; {len(doc['left'])} not measured yet" if doc.get("left") else ""),
              f"- geometric mean of fxopt's speed-up over the best peer: **{_x(s['geomean'])}** over "
              f"{s['counted']} cells",
              f"- minimum: {_x(s['min'])} ({s['min_cell'] or '–'}); maximum: {_x(s['max'])}",
              f"- cells below 1.0×: **{s['below_1']}** of {s['counted']}"
              + (f"; {s['peer_failed']} measured while a peer failed (its speed-up over the peers that ran; the "
                 "note names the failed peer)" if s.get("peer_failed") else ""), ""]
    if s["by_cell"]:
        lines += ["| cell | cells | geomean | below 1.0× |", "|---|---|---|---|"]
        lines += [f"| {c} | {v['n']} | {_x(v['geomean'])} | {v['below_1']} |" for c, v in s["by_cell"].items()]
        lines.append("")
    if s["lowest"]:
        lines += ["Lowest 10: " + ", ".join(f"{r['model']} {r['cell']} {_x(r['speedup'])} (vs {r['best_peer']})"
                                            for r in s["lowest"]), ""]
    lines += ["## Cells", "", "Speed-up = best peer's median ms / fxopt's median ms (>1: fxopt faster); accuracy: "
              "fxopt's max relative error against fp32 eager and the harness's tolerance for the dtype.", "",
              "| model | family | cell | input | best peer | peer ms | fxopt ms | speed-up | accuracy | note |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        note = r.get("reason") or (f"fallback: {r['fxopt_fallback']}" if r.get("fxopt_fallback") else "")
        if r.get("status") == "ok" and r.get("peers_failed"):
            note = "; ".join(filter(None, [note, "peer failed: " + ", ".join(
                f"{b} ({e.split(':')[0]})" for b, e in sorted(r["peers_failed"].items()))]))
        lines.append("| " + " | ".join([
            r["model"], r.get("family", ""), r["cell"], "x".join(map(str, r.get("input", []))),
            r.get("best_peer") or "–", _fmt(r.get("best_peer_ms")), _fmt(r.get("fxopt_ms")),
            _x(r.get("speedup")) if r.get("status") == "ok" else r.get("status", "?"), _accuracy(r),
            _short(note, 70)]) + " |")
    varied = [r for r in recs if r.get("variants")]
    if varied:  # --variants: fxopt's variants timed in the same rows
        names = sorted({b for r in varied for b in r["variants"]})
        lines += ["", "Variants (`--variants`): ms, and fxopt's ms over the variant's (> 1: the variant is faster).", "",
                  "| model | cell | fxopt ms | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
        for r in varied:
            cells = []
            for b in names:
                v = r["variants"].get(b) or {}
                cells.append(f"{_fmt(v.get('ms'))} ({_x(v.get('over_fxopt'))})" if v.get("ms") else v.get("status", "–"))
            lines.append(f"| {r['model']} | {r['cell']} | {_fmt(r.get('fxopt_ms'))} | " + " | ".join(cells) + " |")
    if doc.get("left"):
        lines += ["", "Not measured yet: " + ", ".join(doc["left"])]
    lines += ["", "Per-backend times, errors and kernel counts: results.md.", ""]
    return "\n".join(lines)


def write_chart(doc: Dict[str, Any], path: str) -> str:
    """Two panels: a histogram of the speed-ups (log scale, stacked by cell kind) and every cell's
    speed-up in ascending order; lines at 1.0x and at the geometric mean."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    recs = [r for r in doc.get("zoo", []) if _counted(r)]
    s = summarize(doc.get("zoo", []))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 1.6]})
    if not recs:
        for ax in (ax1, ax2):
            ax.text(0.5, 0.5, "no speed-ups measured", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
    else:
        kinds = sorted({r["cell"] for r in recs})
        logs = [math.log2(r["speedup"]) for r in recs]
        lo, hi = min(logs + [0.0]) - 0.1, max(logs + [0.0]) + 0.1
        bins = [lo + (hi - lo) * i / 24 for i in range(25)]
        ax1.hist([[math.log2(r["speedup"]) for r in recs if r["cell"] == k] for k in kinds], bins=bins,
                 stacked=True, label=kinds)
        for v, style in ((0.0, "-"), (math.log2(s["geomean"]), "--")):
            ax1.axvline(v, color="black", linestyle=style, linewidth=1)
        ticks = [t for t in range(math.floor(lo), math.ceil(hi) + 1)]
        ax1.set_xticks(ticks)
        ax1.set_xticklabels([f"{2.0 ** t:g}×" for t in ticks])
        ax1.set_xlabel("speed-up over the best peer (log scale)")
        ax1.set_ylabel("cells")
        ax1.legend(fontsize=8)
        order = sorted(recs, key=lambda r: r["speedup"])
        colors = {k: f"C{i}" for i, k in enumerate(kinds)}
        ax2.scatter(range(len(order)), [r["speedup"] for r in order], c=[colors[r["cell"]] for r in order], s=12)
        ax2.set_yscale("log", base=2)
        ax2.axhline(1.0, color="black", linewidth=1)
        ax2.axhline(s["geomean"], color="black", linestyle="--", linewidth=1, label=f"geomean {s['geomean']:.2f}×")
        lo2, hi2 = min(order[0]["speedup"], 1.0) / 1.1, max(order[-1]["speedup"], 1.0) * 1.1
        ax2.set_ylim(lo2, hi2)
        ax2.set_yticks([t for t in (0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 4, 6, 8) if lo2 <= t <= hi2])
        ax2.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×"))
        ax2.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax2.set_xlabel(f"cells, ascending ({s['below_1']} of {s['counted']} below 1.0×)")
        ax2.legend(fontsize=8)
    m = doc.get("meta", {})
    title = f"fxopt vs the best peer over the zoo — {m.get('device_name', '?')}"
    fig.suptitle(title + (" (CPU: not a GPU result)" if m.get("device_type") == "cpu" else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _read(path: str) -> Dict[str, Any]:
    if os.path.isdir(path):
        path = os.path.join(path, "zoo.json")
    return read_results(path)  # a raw file kept gzipped in the tree reads as well


def measured_at(doc: Dict[str, Any]) -> str:
    """When a part was measured: the latest of its runs' dates (ISO 8601, so they sort as text)."""
    meta = doc.get("meta", {})
    return max([str(meta.get("date") or "")] + [str(r.get("date") or "") for r in meta.get("runs") or []])


def merge_parts(paths: Sequence[str]) -> Dict[str, Any]:
    """The parts (directories holding zoo.json, or the files, gzipped or not) as one document: the
    harness's results through ``fxopt.bench.report.merge_results`` (one device, every part's
    command), the zoo records by (model, cell). The parts are taken in the order they were measured
    (``measured_at``; the order given where dates tie), so a cell measured again keeps its latest
    record whatever order the paths come in: screens of one zoo over several sessions merge into
    the zoo's current state."""
    parts = sorted((_read(p) for p in paths), key=measured_at)
    doc = merge_results(parts)
    recs: Dict[tuple, Dict[str, Any]] = {}
    for p in parts:
        for r in p.get("zoo", []):
            recs.pop((r["model"], r["cell"]), None)
            recs[(r["model"], r["cell"])] = r
    doc["zoo"] = list(recs.values())
    done = {f"{m} {c}" for m, c in recs}
    doc["left"] = sorted({x for p in parts for x in p.get("left", [])} - done)
    return doc


def write_atomic(doc: Dict[str, Any], path: str) -> None:
    from .report import _jsonable

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable(doc), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def write_zoo_reports(doc: Dict[str, Any], out_dir: str) -> Dict[str, str]:
    """zoo.json (with the summary), zoo.md, zoo.png and the harness's per-backend results.md."""
    os.makedirs(out_dir, exist_ok=True)
    doc = {**doc, "summary": summarize(doc.get("zoo", []))}
    paths = {"json": os.path.join(out_dir, "zoo.json"), "md": os.path.join(out_dir, "zoo.md")}
    write_atomic(doc, paths["json"])
    with open(paths["md"], "w") as f:
        f.write(render_zoo_markdown(doc))
    harness = {k: v for k, v in doc.items() if k not in ("zoo", "left", "summary")}
    paths["details"] = write_markdown(harness, os.path.join(out_dir, "results.md"))
    try:
        paths["png"] = write_chart(doc, os.path.join(out_dir, "zoo.png"))
    except Exception as exc:  # a broken matplotlib must not lose the numbers
        paths["png_error"] = f"chart failed: {type(exc).__name__}: {exc}"
    return paths
