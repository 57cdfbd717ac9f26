"""Report writers for the fxopt benchmark: results.json, results.md,
summary.md (header + summary table) and speedup.png.

``results`` is the dict built by :func:`fxopt.bench.run_benchmark`:
``{"meta": {...}, "peak": {dtype: {...}}, "flops": {...}, "cells": [...],
"checks": [...]}``; each cell has model, batch, dtype, backend, status
(ok | error | unavailable), error and, when ok, median_ms, q1_ms, q3_ms,
iqr_ms, first_call_s, max_rel_err, tflops, pct_peak, peak_mem_mb ...
"""
from __future__ import annotations

import gzip
import io
import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["render_markdown", "render_summary", "row_keys", "speedups",
           "write_json", "write_markdown", "write_plot", "write_reports"]

RowKey = Tuple[str, int, str]


def _is_fxopt(backend: str) -> bool:
    return backend == "fxopt" or backend.startswith("fxopt-")


def _is_floor(backend: str) -> bool:
    """``floor-*`` rows: what torch.compile itself costs (no optimizing backend), shown beside the
    others but neither a peer nor fxopt."""
    return backend.startswith("floor-")


def _is_peer(backend: str) -> bool:
    return not _is_fxopt(backend) and not _is_floor(backend)


def row_keys(results: Dict[str, Any]) -> List[RowKey]:
    seen: Dict[RowKey, None] = {}
    for c in results.get("cells", []):
        seen.setdefault((c["model"], int(c["batch"]), c["dtype"]), None)
    return list(seen)


def _backends(results: Dict[str, Any]) -> List[str]:
    seen: Dict[str, None] = {}
    for c in results.get("cells", []):
        seen.setdefault(c["backend"], None)
    return list(seen)


def _cells_by_row(results: Dict[str, Any]) -> Dict[RowKey, Dict[str, Dict[str, Any]]]:
    rows: Dict[RowKey, Dict[str, Dict[str, Any]]] = {}
    for c in results.get("cells", []):
        rows.setdefault((c["model"], int(c["batch"]), c["dtype"]), {})[c["backend"]] = c
    return rows


def _ok(c: Optional[Dict[str, Any]]) -> bool:
    return bool(c) and c.get("status") == "ok" and c.get("median_ms") is not None


def paired_ratio(peer: Dict[str, Any], fx: Dict[str, Any]) -> Optional[float]:
    """Median over rounds of peer round median / fxopt round median. The backends of a row take
    turns round by round, so round r of each ran in about the same host state: a drifting host
    (a host-bound cell moves with it) shifts both sides of each ratio alike. None with < 3 rounds."""
    a, b = peer.get("round_medians_ms") or [], fx.get("round_medians_ms") or []
    if len(a) != len(b) or len(a) < 3:
        return None
    r = sorted(x / y for x, y in zip(a, b) if y > 0)
    return r[len(r) // 2] if len(r) % 2 else (r[len(r) // 2 - 1] + r[len(r) // 2]) / 2


def speedups(results: Dict[str, Any]) -> Dict[RowKey, Dict[str, Any]]:
    """Per row: best peer (fastest backend that is neither fxopt nor a floor row) and, per fxopt variant,
    its speed-up over the best peer and over each peer."""
    out: Dict[RowKey, Dict[str, Any]] = {}
    for key, cells in _cells_by_row(results).items():
        peers = {b: c["median_ms"] for b, c in cells.items() if _is_peer(b) and _ok(c)}
        best = min(peers, key=peers.get) if peers else None
        entry: Dict[str, Any] = {"best_peer": best,
                                 "best_peer_ms": peers.get(best) if best else None,
                                 "fxopt": {}}
        for b, c in cells.items():
            if _is_fxopt(b) and _ok(c):
                entry["fxopt"][b] = {
                    "over_best": (peers[best] / c["median_ms"]) if best else None,
                    "over_peer": {p: ms / c["median_ms"] for p, ms in peers.items()},
                    "paired_over_best": paired_ratio(cells[best], c) if best else None,
                }
        out[key] = entry
    return out


# --------------------------------------------------------------------------
# json
# --------------------------------------------------------------------------
def _jsonable(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    return o


def write_json(results: Dict[str, Any], path: str) -> str:
    data = dict(results)
    data["speedups"] = [
        {"model": k[0], "batch": k[1], "dtype": k[2], **v} for k, v in speedups(results).items()
    ]
    with open(path, "w") as f:
        json.dump(_jsonable(data), f, indent=1)
        f.write("\n")
    return path


# --------------------------------------------------------------------------
# markdown
# --------------------------------------------------------------------------
def _fmt(v: Any, spec: str = ".3f", none: str = "–") -> str:
    if v is None:
        return none
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def _short(s: Optional[str], n: int = 48) -> str:
    s = (s or "").replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= n else s[: n - 1] + "…"


def _cell_text(c: Optional[Dict[str, Any]], failed: bool = False) -> str:
    if not c:
        return "–"
    if c.get("status") in ("unavailable", "skipped"):
        return f"{c['status']}: {_short(c.get('error'), 40)}"
    if c.get("status") != "ok":
        return f"error: {_short((c.get('error') or '').split(':')[0], 40)}"
    txt = f"{c['median_ms']:.3f} ±{c.get('iqr_ms', 0.0):.3f}"
    return txt + (" (fallback)" if c.get("fallback") else "") + (" ⚠" if failed else "")


def _header(results: Dict[str, Any]) -> List[str]:
    m = results.get("meta", {})
    cfg = m.get("config", {})
    lines = ["# fxopt benchmark", ""]
    if m.get("device_type") == "cpu":
        if cfg.get("quick"):
            lines += ["> **CPU smoke run — not a performance result.**", ""]
        else:
            lines += ["> **CPU run — not a GPU performance result.**", ""]
    v = m.get("versions", {})
    dev = m.get("device_name", "?")
    if m.get("capability"):
        dev += f" (compute capability {m['capability']})"
    lines.append(f"- device: {dev}, `{m.get('device_type', '?')}`")
    lines.append("- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    runs = m.get("runs") or []
    if len(runs) > 1:  # a merged report: every run's date and command
        lines.append(f"- {len(runs)} runs on this device (merged):")
        lines += [f"  - {r.get('date', '?')}: `{r.get('command', '?')}`" for r in runs]
    else:
        lines.append(f"- date: {m.get('date', '?')}")
        if m.get("command"):
            lines.append(f"- command: `{m['command']}`")
    timer = "CUDA events around each call" if m.get("device_type") == "cuda" else "time.perf_counter around each call"
    rounds = cfg.get("rounds") or 1
    rewarm = cfg.get("rewarm", 3)  # results written before the per-round warm-up was recorded: 3
    spread = (f" in {rounds} rounds, the backends of a row taking turns (all kept compiled; each round "
              f"after {rewarm} untimed calls)" if rounds > 1 else ", each backend on its own")
    lines.append(f"- timing: median ms of {cfg.get('iters', '?')} timed calls after "
                 f"{cfg.get('warmup', '?')} warm-up calls{spread} ({timer}); ± is the IQR; "
                 "accuracy: max relative error ‖out−ref‖∞/‖ref‖∞ vs fp32 eager (TF32 off)"
                 + ("; cudnn.benchmark on for every backend" if m.get("cudnn.benchmark") else "")
                 + _plans_line(m))
    for dt, p in (results.get("peak") or {}).items():
        if p.get("tflops"):
            lines.append(f"- measured peak {dt}: {p['tflops']:.2f} TFLOP/s ({p.get('what', '')})")
        elif p.get("error"):
            lines.append(f"- measured peak {dt}: failed ({_short(p['error'], 80)})")
    if m.get("fxopt_options"):
        lines.append(f"- fxopt options: `{json.dumps(m['fxopt_options'])}`")
    lines.append("")
    return lines


def _failed_checks(results: Dict[str, Any]) -> set:
    return {(c["model"], int(c["batch"]), c["dtype"], c["backend"])
            for c in results.get("checks", []) if not c.get("ok")}


def _summary_table(results: Dict[str, Any]) -> List[str]:
    backends = _backends(results)
    fx = [b for b in backends if _is_fxopt(b)]
    sp = speedups(results)
    bad = _failed_checks(results)
    head = ["model", "batch", "dtype"] + [f"{b} ms" for b in backends] + ["best peer"] + \
           [f"{b} speed-up" for b in fx]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = _cells_by_row(results)
    for key in row_keys(results):
        cells = rows[key]
        s = sp.get(key, {})
        best = s.get("best_peer")
        vals = [key[0], str(key[1]), key[2]]
        vals += [_cell_text(cells.get(b), (*key, b) in bad) for b in backends]
        vals.append(f"{best} ({s['best_peer_ms']:.3f})" if best else "–")
        for b in fx:
            o = s.get("fxopt", {}).get(b, {}).get("over_best")
            vals.append(f"{o:.2f}×" if o else "–")
        lines.append("| " + " | ".join(vals) + " |")
    lines.append("")
    fb = any(c.get("fallback") for c in results.get("cells", []))
    lines.append("Times in ms (median ±IQR); speed-up = best peer median / fxopt median (>1: fxopt faster)"
                 + ("; (fallback) = the backend warned that it fell back (see Details)" if fb else "")
                 + ("; ⚠ = failed the accuracy check" if bad else "")
                 + ("; floor-* = torch.compile with a non-optimizing backend (what every backend pays; not a peer)"
                    if any(_is_floor(b) for b in backends) else "") + ".")
    return lines


def _details_table(results: Dict[str, Any]) -> List[str]:
    head = ["model", "batch", "dtype", "backend", "status", "median ms", "IQR ms", "host ms/call", "first call s",
            "cold compile s", "max rel err", "TFLOP/s", "% peak", "peak mem MiB", "note / error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in results.get("cells", []):
        lines.append("| " + " | ".join([
            c["model"], str(c["batch"]), c["dtype"], c["backend"], c.get("status", "?"),
            _fmt(c.get("median_ms")), _fmt(c.get("iqr_ms")), _fmt(c.get("host_ms")), _fmt(c.get("first_call_s"), ".2f"),
            (_fmt(c.get("cold_compile_s"), ".2f") + (f" (warm fxopt cache {c['warm_cache_compile_s']:.2f})"
                                                     if c.get("warm_cache_compile_s") is not None else ""))
            if c.get("cold_compile_s") is not None else _short(c.get("cold_error"), 30) or "–",
            _fmt(c.get("max_rel_err"), ".2e"), _fmt(c.get("tflops"), ".3f"),
            _fmt(c.get("pct_peak"), ".1f"), _fmt(c.get("peak_mem_mb"), ".0f"),
            _short(c.get("error") or (f"fallback ×{c.get('fallback_count')}: {c['fallback']}"
                                      if c.get("fallback") else "; ".join(
                                          filter(None, [c.get("note"), c.get("ran") and f"ran {c['ran']}"]))), 90),
        ]) + " |")
    return lines


def _checks_lines(results: Dict[str, Any]) -> List[str]:
    checks = results.get("checks", [])
    if not checks:
        return []
    bad = [c for c in checks if not c.get("ok")]
    lines = ["## Accuracy checks", "",
             f"{len(checks) - len(bad)}/{len(checks)} passed."]
    for c in bad:
        lines.append(f"- FAILED {c['model']} b{c['batch']} {c['dtype']} {c['backend']}: "
                     f"{c.get('reason', '')}")
    lines.append("")
    return lines


def _rounds_lines(results: Dict[str, Any]) -> List[str]:
    """Per row and fxopt variant: each round's median next to the best peer's and the host speed
    measured before fxopt's round (rounds interleave the backends, so round r is one host state)."""
    lines: List[str] = []
    cells_by_row = _cells_by_row(results)
    for key, s in speedups(results).items():
        best = s.get("best_peer")
        for b, fx in s.get("fxopt", {}).items():
            c, p = cells_by_row[key][b], cells_by_row[key].get(best, {}) if best else {}
            a, q = c.get("round_medians_ms") or [], p.get("round_medians_ms") or []
            if fx.get("paired_over_best") is None:
                continue
            host = c.get("round_host_us") or []
            rows = " · ".join(f"{x * 1e3:.0f}/{y * 1e3:.0f}" + (f" @{h:.0f}" if i < len(host) else "")
                              for i, (x, y, h) in enumerate(zip(a, q, host + [0.0] * len(a))))
            lines.append(f"- {key[0]} b{key[1]} {key[2]} {b} vs {best}: paired speed-up "
                         f"{fx['paired_over_best']:.2f}× (µs per round, fxopt/{best} @ host-speed µs: {rows})")
    if lines:
        lines = ["## Rounds", "", "Paired speed-up = median over rounds of (best peer's round median / "
                 "fxopt's round median); host speed = a fixed Python workload timed before fxopt's "
                 "round (larger = slower host).", ""] + lines + [""]
    return lines


def _cold_lines(results: Dict[str, Any]) -> List[str]:
    """--cold: per row and backend, the first call in a fresh process with empty caches, again with
    warm caches, and (built once, loaded without torch.compile) load + first call; each
    torch.compile backend's own work = its first call minus floor-aot-eager's (same command)."""
    cold = [c for c in results.get("cells", []) + results.get("cold_floors", [])
            if c.get("cold_compile_s") is not None or c.get("cold_error")]
    if not cold:
        return []
    lines = ["## Cold start", "",
             "| model | batch | dtype | backend | first call cold s | warm caches s | load + first call s "
             "| own work cold s (− floor-aot-eager) |", "|---|---|---|---|---|---|---|---|"]
    floor = {(c["model"], c["batch"], c["dtype"]): c.get("cold_compile_s") for c in cold
             if c["backend"] == "floor-aot-eager"}
    for c in cold:
        f = floor.get((c["model"], c["batch"], c["dtype"]))
        own = (c["cold_compile_s"] - f if f is not None and c.get("cold_compile_s") is not None
               and not _is_floor(c["backend"]) and c["backend"] not in ("fxopt-package", "aotinductor", "eager",
                                                                       "eager-channels-last") else None)
        lines.append("| " + " | ".join([
            c["model"], str(c["batch"]), c["dtype"], c["backend"],
            _fmt(c.get("cold_compile_s"), ".2f") if c.get("cold_compile_s") is not None
            else _short(c.get("cold_error"), 40), _fmt(c.get("warm_cache_compile_s"), ".2f"),
            _fmt(c.get("load_first_call_s"), ".2f"), _fmt(own, ".2f")]) + " |")
    lines += ["", "fxopt-package / aotinductor: first call = build the package + load + first call; "
              "load + first call = a fresh process loading the package built before.", ""]
    return lines


def render_summary(results: Dict[str, Any]) -> str:
    """Header and summary table (the table last)."""
    return "\n".join(_header(results) + ["## Summary", ""] + _summary_table(results)) + "\n"


def _kernel_lines(results: Dict[str, Any]) -> List[str]:
    """GPU kernels per call (profiler count) per row and backend, where they were counted."""
    rows: Dict[tuple, Dict[str, int]] = {}
    for c in results.get("cells", []):
        if c.get("kernels_per_call") is not None:
            rows.setdefault((c["model"], c["batch"], c["dtype"]), {})[c["backend"]] = c["kernels_per_call"]
    if not rows:
        return []
    backends = sorted({b for r in rows.values() for b in r})
    lines = ["## Kernels per call", "", "GPU kernels one call launches (torch.profiler; a CUDA graph's kernels "
             "counted one by one).", "",
             "| model | batch | dtype | " + " | ".join(backends) + " |", "|---|---|---|" + "---|" * len(backends)]
    for (m, b, d), r in rows.items():
        lines.append(f"| {m} | {b} | {d} | " + " | ".join(str(r.get(k, "–")) for k in backends) + " |")
    return lines + [""]


def _top_kernel_lines(results: Dict[str, Any]) -> List[str]:
    """Where fxopt is slower than the best peer: each backend's longest kernels of one call."""
    cells, sp = _cells_by_row(results), speedups(results)
    lines: List[str] = []
    for key, entry in sp.items():
        losing = [b for b, v in entry["fxopt"].items() if v["over_best"] is not None and v["over_best"] < 1.0]
        shown = [b for b in losing + [entry["best_peer"]] if b and cells[key].get(b, {}).get("top_kernels")]
        if not losing or not shown:
            continue
        lines += [f"### {key[0]} b{key[1]} {key[2]}", ""]
        for b in shown:
            c = cells[key][b]
            total = sum(r[2] for r in c["top_kernels"])
            lines.append(f"- {b} ({c.get('kernels_per_call')} kernels; these {len(c['top_kernels'])}: "
                         f"{total:.1f} µs): " + "; ".join(f"{us:.1f} µs ×{n} `{name[:70]}`"
                                                          for name, n, us in c["top_kernels"]))
        lines.append("")
    return (["## Longest kernels where fxopt is slower", "",
             "GPU µs of one call (torch.profiler), fxopt's and the best peer's.", ""] + lines) if lines else []


def _plans_line(m: Dict[str, Any]) -> str:
    """How a CUDA run's backends came by cuDNN's plans (torch caches them per thread)."""
    if m.get("device_type") != "cuda":
        return ""
    if m.get("backend_threads"):
        return ("; each backend on a thread of its own, so cuDNN's plans (cached per thread) are the ones its "
                "own first calls chose")
    return ("; the backends share one thread, so torch's cuDNN plans: a convolution keyed alike runs "
            "the plan of the backend that called it first")


def render_markdown(results: Dict[str, Any]) -> str:
    lines = _header(results) + ["## Summary", ""] + _summary_table(results) + [""]
    lines += _checks_lines(results)
    lines += _rounds_lines(results)
    lines += _kernel_lines(results)
    lines += _top_kernel_lines(results)
    lines += _cold_lines(results)
    lines += ["## Details", ""] + _details_table(results)
    return "\n".join(lines) + "\n"


def write_markdown(results: Dict[str, Any], path: str) -> str:
    with open(path, "w") as f:
        f.write(render_markdown(results))
    return path


# --------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------
def write_plot(results: Dict[str, Any], path: str) -> str:
    """Grouped bars: speed-up of fxopt over each peer per model row (log y)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    sp = speedups(results)
    keys = row_keys(results)
    multi = len({(k[1], k[2]) for k in keys}) > 1
    fx_name = next((b for b in ("fxopt", "fxopt-no-cudagraphs") if any(
        b in s["fxopt"] for s in sp.values())), None)
    if fx_name is None:
        fx_name = next((b for s in sp.values() for b in s["fxopt"]), None)
    groups = [k for k in keys if fx_name and fx_name in sp[k]["fxopt"]]
    peers = [b for b in _backends(results) if _is_peer(b)
             and any(b in sp[k]["fxopt"][fx_name]["over_peer"] for k in groups)]
    fig, ax = plt.subplots(figsize=(min(24.0, max(6.0, 0.35 * len(groups) * max(1, len(peers)) + 2)), 4.8))
    if not groups or not peers:
        ax.text(0.5, 0.5, "no fxopt speed-ups to plot", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
    else:
        from matplotlib.ticker import FuncFormatter, LogLocator

        width = 0.8 / len(peers)
        vals_all: List[float] = []
        for i, p in enumerate(peers):
            xs, vals = [], []
            for g, k in enumerate(groups):
                v = sp[k]["fxopt"][fx_name]["over_peer"].get(p)
                if v is not None and math.isfinite(v) and v > 0:
                    xs.append(g + (i - (len(peers) - 1) / 2) * width)
                    vals.append(v)
            vals_all += vals
            # bars grow from the 1.0 line: up = fxopt faster, down = slower
            ax.bar(xs, [v - 1.0 for v in vals], width, bottom=1.0, label=p)
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=1)
        lo, hi = min(vals_all + [1.0]), max(vals_all + [1.0])
        ax.set_ylim(lo / 1.3, hi * 1.3)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{k[0]}\nb{k[1]} {k[2]}" if multi else k[0] for k in groups],
                           rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"speed-up of {fx_name}\n(peer ms / {fx_name} ms, >1: {fx_name} faster)")
        ax.legend(fontsize=7, ncol=2)
    m = results.get("meta", {})
    title = f"{fx_name or 'fxopt'} vs peers — {m.get('device_name', '?')}"
    if m.get("device_type") == "cpu":
        title += " (CPU: not a GPU result)"
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    # a bar chart has a few colours: as a 256-colour palette it is the same picture in ~40 % of the
    # bytes, which matters for the charts kept under benchmarks/results/ (Pillow comes with matplotlib)
    from PIL import Image

    Image.open(buf).convert("RGB").quantize(colors=256, method=0, dither=0).save(path, optimize=True)  # median cut
    return path


def merge_results(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One result from several runs of the same suite (a long suite split over several commands
    on one machine kind): cells, checks, FLOPs and peaks side by side; ``meta`` is the first run's,
    with every run's command, date, device, versions and wall time under ``meta["runs"]``.
    A row (model, batch, dtype) measured again by a later run is replaced as a whole, never
    mixed cell by cell, so every row stays one side-by-side measurement; each cell keeps the
    index of its run under ``"run"``, and ``meta["replaced_rows"]`` lists what was replaced.
    A part that is itself a merge contributes its runs one by one (an update of a merged report
    keeps every command it came from)."""
    if not parts:
        raise ValueError("merge_results needs at least one result")
    devices = {p["meta"].get("device_name") for p in parts}
    if len(devices) > 1:
        raise ValueError(f"refusing to merge runs from different devices: {sorted(map(str, devices))}")
    meta = dict(parts[0]["meta"])
    meta["runs"], meta["replaced_rows"] = [], []
    meta["wall_s"] = round(sum(p["meta"].get("wall_s") or 0 for p in parts), 2)
    out: Dict[str, Any] = {"meta": meta, "peak": {}, "flops": {}, "cells": [], "checks": [], "errors_logged": 0}

    def row(c: Dict[str, Any]) -> RowKey:
        return (c.get("model"), c.get("batch"), c.get("dtype"))

    for p in parts:
        offset = len(meta["runs"])
        runs = p["meta"].get("runs") or []
        if len(runs) > 1:  # a merged report
            meta["runs"] += runs
            meta["replaced_rows"] += [{**r, "by_run": offset + r["by_run"]} for r in p["meta"].get("replaced_rows", [])]
        else:
            meta["runs"].append({k: p["meta"].get(k) for k in ("command", "date", "device_name", "versions", "wall_s")})
        cells = [{**c, "run": offset + (c.get("run", 0) if len(runs) > 1 else 0)} for c in p.get("cells", [])]
        rows = {row(c) for c in cells}
        by_run = {row(c): c["run"] for c in cells}
        again = sorted({row(c) for c in out["cells"]} & rows, key=str)
        meta["replaced_rows"] += [{"model": m, "batch": b, "dtype": d, "by_run": by_run[(m, b, d)]}
                                  for m, b, d in again]
        out["cells"] = [c for c in out["cells"] if row(c) not in rows]
        out["checks"] = [c for c in out["checks"] if row(c) not in rows]
        out["peak"].update(p.get("peak", {}))
        out["flops"].update(p.get("flops", {}))
        out["cells"].extend(cells)
        out["checks"].extend(p.get("checks", []))
        out["errors_logged"] += p.get("errors_logged", 0)
    return out


def read_results(path: str) -> Dict[str, Any]:
    """A results.json, or one kept gzip-compressed (``results.json.gz``)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def write_reports(results: Dict[str, Any], out_dir: str) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": write_json(results, os.path.join(out_dir, "results.json")),
        "md": write_markdown(results, os.path.join(out_dir, "results.md")),
    }
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(render_summary(results))
    paths["summary"] = os.path.join(out_dir, "summary.md")
    try:
        paths["png"] = write_plot(results, os.path.join(out_dir, "speedup.png"))
    except Exception as exc:  # a broken matplotlib must not lose the numbers
        paths["png_error"] = f"{type(exc).__name__}: {exc}"
    return paths
