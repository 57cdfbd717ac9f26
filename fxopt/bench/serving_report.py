"""The Markdown table of ``fxopt bench --serving`` (``fxopt.bench.serving``)."""
from __future__ import annotations


def _f(v, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown(meta: dict, results: list) -> str:
    lines = [f"# Serving loop: {meta.get('calls')} calls per phase, batch 1-{meta.get('max_batch')}, "
             f"seed {meta.get('seed')}",
             "",
             f"{meta.get('gpu') or meta.get('device')}, {meta.get('dtype')}, torch {meta.get('torch')}"
             f"{', backed_size_oblivious' if meta.get('size_oblivious') else ''}"
             f"{', enable_cpp_symbolic_shape_guards' if meta.get('cpp_shape_guards') else ''}; {meta.get('wall_s')} s in all.",
             "",
             "| model | backend | phase | calls | sizes | Dynamo graphs | compile s | overhead s | first call new size "
             "median / max / max without a Dynamo compile s | steady ms (median) | p99 call ms | peak GPU MB | "
             "eager calls |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            err = " ".join(r["error"].split())[:120]
            lines.append(f"| {r.get('model')} | {r['backend']} | error: {err} ||||||||||")
            continue
        for phase in ("batch", "image"):
            p = r.get(phase)
            if not p:
                continue
            calls = f"{p['calls']}" + (f" of {p['planned_calls']} (time budget)" if p.get("truncated") else "")
            lines.append(
                f"| {r['model']} | {r['backend']} | {phase} | {calls} | {p['sizes']} | {p['dynamo_graphs']} | "
                f"{_f(p['compile_s'], '{:.2f}')} | {_f(p['overhead_s'], '{:.2f}')} | "
                f"{_f(p['first_call_new_size_s_median'])} / {_f(p['first_call_new_size_s_max'])} / "
                f"{_f(p.get('first_call_new_size_s_max_no_dynamo_compile'))} | "
                f"{_f(p['steady_ms_median'])} | {_f(p.get('call_ms_p99'))} | {_f(r.get('peak_gpu_mb'), '{:.0f}')} | "
                f"{'yes' if r.get('eager_calls') else 'no'} |")
    lines += ["", "Median latency of the serving model per size against the same backend compiled statically "
              "for that size:", "",
              "| model | backend | size (batch x side) | serving ms | static ms | ratio | served as |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        for size, rec in (r.get("latency_vs_static") or {}).items():
            lines.append(f"| {r['model']} | {r['backend']} | {size} | {_f(rec.get('dynamic_ms'))} | "
                         f"{_f(rec.get('static_ms'))} | {_f(rec.get('ratio'))} | {rec.get('served_as', '-')} |")
    lines.append("")
    return "\n".join(lines)
