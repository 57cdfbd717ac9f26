"""The training benchmark's report: results.md and summary.md (markdown), results.json and the
chart, from the results of ``fxopt.bench.train``."""
from __future__ import annotations

import json
import os
from typing import Any, Dict

__all__ = ["render_markdown", "write_reports"]


def _f(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "–"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def _precision(amp: str) -> str:
    return {"float16": "autocast float16 + GradScaler", "bfloat16": "autocast bfloat16, no GradScaler",
            "none": "float32 (no autocast)"}[amp]


def render_markdown(results: Dict[str, Any], summary_only: bool = False) -> str:
    from fxopt.testing.training import FINAL_LOSS_STEPS

    from .report import _cell_text, _failed_checks, _is_fxopt, speedups

    m, cfg = results["meta"], results["meta"]["config"]
    v = m.get("versions", {})
    dev = m.get("device_name", "?") + (f" (compute capability {m['capability']})" if m.get("capability") else "")
    lines = ["# fxopt training benchmark", ""]
    if m.get("device_type") == "cpu":
        lines += ["> **CPU run — not a GPU performance result.**", ""]
    timer = "CUDA events around each step" if m.get("device_type") == "cuda" else "time.perf_counter around each step"
    amp = cfg["amp"]
    loop = _precision(amp) + \
        f", Adam (lr {cfg['lr']}), cross-entropy"
    lines += [f"- device: {dev}, `{m.get('device_type')}`",
              "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
              *([f"- {len(m['runs'])} runs on this device (merged):"]
                + [f"  - {r.get('date', '?')}: `{r.get('command', '?')}`" for r in m["runs"]]
                if len(m.get("runs") or []) > 1 else [f"- date: {m.get('date')}", f"- command: `{m.get('command')}`"]),
              f"- step: zero_grad, forward + loss, backward, optimizer step ({loop}); same initial weights and "
              f"the same {cfg['data_batches']} batches (cycled) for every backend"
              + (f"; ImageNet models at {cfg['image_size']}x{cfg['image_size']}" if cfg.get("image_size") else ""),
              f"- timing: median ms per step over {cfg['iters']} steps after the first step and {cfg['warmup']} "
              f"warm-up steps" + (f", in {cfg['rounds']} rounds, the backends of a row taking turns (each round after "
                                  f"{cfg.get('rewarm')} untimed steps)" if cfg["rounds"] > 1 else "") + f" ({timer}); ± is the IQR"
              + ("; cudnn.benchmark on for every backend" if m.get("cudnn.benchmark") else ""),
              f"- losses: the first {cfg['losses']} against eager's (max relative difference, tolerance "
              f"{m.get('loss_tolerance')})" + (f"; final loss: a second training from the initial weights, "
                                               f"{cfg['final_steps']} steps of a learning task (fresh batches, labels "
                                               f"from a fixed rule), mean loss of the last {FINAL_LOSS_STEPS} steps"
                                               + (f", averaged over {cfg['final_tasks']} such trainings (one task "
                                                  f"each)" if (cfg.get('final_tasks') or 1) > 1 else "")
                                               + " within 5% of eager's"
                                               if cfg.get("final_steps") else "")
              + "; each bound is at least the row's rounding spread: the largest distance from eager of "
                f"{cfg.get('rounding_references', 0)} runs of eager with every gradient perturbed by one rounding of "
                "the precision (one seed each) and of eager-channels-last where it ran; each step starts from the "
                "same seed for every backend",
              ""]
    if m.get("fxopt_options"):
        lines.insert(-1, f"- fxopt options: `{json.dumps(m['fxopt_options'])}`")
    cells = results.get("cells", [])
    backends = list(dict.fromkeys(c["backend"] for c in cells))
    fx = [b for b in backends if _is_fxopt(b)]
    bad = _failed_checks(results)
    sp = speedups(results)
    head = ["model", "batch", "precision"] + [f"{b} ms" for b in backends] + ["best peer"] + \
           [f"{b} vs eager" for b in fx] + [f"{b} vs best peer (paired)" for b in fx]
    lines += ["## Step time", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows: Dict[tuple, Dict[str, Dict[str, Any]]] = {}
    for c in cells:
        rows.setdefault((c["model"], int(c["batch"]), c["dtype"]), {})[c["backend"]] = c
    for key, by in rows.items():
        s = sp.get(key, {})
        vals = [key[0], str(key[1]), key[2]] + [_cell_text(by.get(b), (*key, b) in bad) for b in backends]
        vals.append(f"{s['best_peer']} ({s['best_peer_ms']:.3f})" if s.get("best_peer") else "–")
        for b in fx:
            e, f = by.get("eager", {}), by.get(b, {})
            vals.append(f"{f['median_ms'] / e['median_ms']:.2f}×" if e.get("median_ms") and f.get("median_ms")
                        else "–")
        for b in fx:
            o = s.get("fxopt", {}).get(b, {})
            paired = o.get("paired_over_best")
            vals.append((f"{1 / o['over_best']:.2f}×" if o.get("over_best") else "–")
                        + (f" ({1 / paired:.2f}×)" if paired else ""))
        lines.append("| " + " | ".join(vals) + " |")
    lines += ["", "fxopt vs X = fxopt's step time / X's (<1: fxopt faster); (paired) = the median over rounds of "
              "the ratio of the two backends' round medians (the backends of a row take turns, round by round); "
              "⚠ = failed a check.", ""]
    if summary_only:
        return "\n".join(lines) + "\n"
    checks = results.get("checks", [])
    failed = [c for c in checks if not c.get("ok")]
    lines += ["## Checks", "", f"{len(checks) - len(failed)}/{len(checks)} passed."]
    lines += [f"- FAILED {c['model']} b{c['batch']} {c['dtype']} {c['backend']}: {c.get('reason')}" for c in failed]
    spreads = [c for c in cells if c.get("rounding_references")]
    if spreads:
        lines += ["", "Rounding spread per row (relative distance from eager's: first losses, and final loss where "
                  "measured): eager with gradients perturbed by one rounding (per seed), eager-channels-last, and "
                  "the bound that applied."]
        for c in spreads:
            key = (c["model"], c["batch"], c["dtype"])
            cl = next((x for x in cells if (x["model"], x["batch"], x["dtype"]) == key
                       and x["backend"] == "eager-channels-last" and x.get("status") == "ok"), None)
            chk = next((x for x in checks if (x["model"], x["batch"], x["dtype"]) == key), {})
            for what, k, bound in (("first losses", "losses_max_rel_diff", "tol"),
                                   ("final loss", "final_loss_rel_diff", "final_tol")):
                if all(r.get(k) is None for r in c["rounding_references"]):
                    continue
                lines.append(f"- {c['model']} b{c['batch']}, {what}: " + ", ".join(
                    _f(r.get(k), ".3g") for r in c["rounding_references"])
                    + (f"; eager-channels-last {_f(cl.get(k), '.3g')}" if cl else "")
                    + (f"; bound {_f(chk[bound], '.3g')}" if chk.get(bound) is not None else ""))
            if c.get("eager_mean_final_loss") is not None:
                others = [x for x in cells if (x["model"], x["batch"], x["dtype"]) == key
                          and x.get("final_loss_rel_diff_eager_mean") is not None]
                lines.append(f"- {c['model']} b{c['batch']}, final loss against eager's mean over its "
                             f"{c['eager_final_trainings']} trainings (its own and the references', "
                             f"{c['eager_mean_final_loss']:.4f}): eager's trainings "
                             + ", ".join(_f(d, ".3g") for d in c["eager_trainings_rel_diff"]) + "; "
                             + ", ".join(f"{x['backend']} {_f(x['final_loss_rel_diff_eager_mean'], '.3g')}"
                                         for x in others))
    lines += ["", "## Where a step's time goes", "",
              "| model | batch | backend | median ms | first step s | fxopt compile s | kernels/step | "
              "GPU kernel ms/step | GPU idle ms/step | host ms/step | peak mem MiB (compile / step) | "
              "losses max rel diff | final loss (eager) |", "|" + "---|" * 13]
    for c in cells:
        idle = (c["median_ms"] - c["gpu_kernel_ms"]) if c.get("median_ms") and c.get("gpu_kernel_ms") else None
        final = (f"{c['final_loss']:.4f}" + (f" ({c['eager_final_loss']:.4f})" if c.get("eager_final_loss") else "")
                 if c.get("final_loss") is not None else "–")
        lines.append("| " + " | ".join([
            c["model"], str(c["batch"]), c["backend"],
            _f(c.get("median_ms")) if c.get("status") == "ok" else f"{c.get('status')}: {c.get('error') or ''}"[:60],
            _f(c.get("first_step_s"), ".2f"), _f(c.get("fxopt_compile_s"), ".2f"),
            _f(c.get("kernels_per_step"), ".0f"), _f(c.get("gpu_kernel_ms")), _f(idle), _f(c.get("host_ms")),
            f"{_f(c.get('peak_mem_mb'), '.0f')} / {_f(c.get('step_peak_mem_mb'), '.0f')}",
            _f(c.get("losses_max_rel_diff"), ".2e"), final]) + " |")
    lines += ["", "GPU kernel ms = kernel time per step under torch.profiler; GPU idle = median − kernel time "
              "(the GPU waiting for the host); host ms = CPU time of a step outside waits for the GPU, under "
              "the profiler (an upper bound). first step = compile + one step (each backend first trained a tiny "
              "model for one step, outside the rows: one-time process costs are not counted).", ""]
    fxc = [c for c in cells if c.get("fxopt")]
    if fxc:
        lines += ["## fxopt's training graphs", "",
                  "| model | batch | backend | graphs | partitioner | saved activations (MiB) | executor | "
                  "CUDA graphs | fallbacks |", "|" + "---|" * 9]
        for c in fxc:
            g = c["fxopt"]
            kinds = ", ".join(f"{g['graphs'].count(k)} {k}" for k in dict.fromkeys(g["graphs"]))
            lines.append("| " + " | ".join([
                c["model"], str(c["batch"]), c["backend"], kinds, ", ".join(g["partitioner"]),
                f"{g['saved_activations']} ({g['saved_activation_mb']:.1f})", ", ".join(g["executors"]),
                "; ".join(g["cudagraphs"]), "; ".join(g["fallbacks"]) or "none"]) + " |")
        lines += ["", "CUDA graphs in training (`backends/cuda/runtime/cudagraphs.py`): the forward and the backward "
                  "are each captured per input signature; the values the forward saves for backward are lent to "
                  "autograd and read in place by the backward's capture, parameters are read where they live, the "
                  "batch and the incoming gradient are copied into static buffers.", ""]
    return "\n".join(lines) + "\n"


def write_reports(results: Dict[str, Any], out_dir: str) -> Dict[str, str]:
    from .report import write_json, write_plot

    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": write_json(results, os.path.join(out_dir, "results.json"))}
    for name, summary in (("results.md", False), ("summary.md", True)):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(render_markdown(results, summary_only=summary))
        paths[name] = os.path.join(out_dir, name)
    try:
        paths["png"] = write_plot(results, os.path.join(out_dir, "speedup.png"))
    except Exception as exc:  # noqa: BLE001 - a broken matplotlib must not lose the numbers
        paths["png_error"] = f"{type(exc).__name__}: {exc}"
    return paths
