"""What a package holds besides its graph and weights: kernels in and out, and its summary.

- ``kernels_of``: the generated kernels a package's lowering used, each with its CUDA source and,
  where it compiled, the cubin (looked up in the compiler's cache, where the lowering left it).
- ``install_kernels``: at load, the cubins made for this arch by this NVRTC version go into the
  compiler's in-memory cache (``backends.cuda.compiler.install_cubin``); the others are compiled
  from their packaged sources by the executor when it asks for them.
- ``summarize`` / ``describe``: passes, conv algorithms, kernels and choices, as a dict stored in
  the manifest and as the text ``fxopt run`` prints.
"""
from __future__ import annotations

import collections


def kernels_of(module, writer) -> list:
    from fxopt.backends.cuda.compiler import compile_kernel, nvrtc_version

    seen, out = set(), []
    for low in module.lowerings.values():
        for rec in low.kernels:
            if (rec.name, rec.source) in seen:
                continue
            seen.add((rec.name, rec.source))
            entry = {"name": rec.name, "source": rec.source, "blob": None}
            if rec.compiled:
                try:
                    ck = compile_kernel(rec.source, rec.name)  # the lowering's own compile: a cache hit
                    entry.update(arch=ck.arch, nvrtc=list(nvrtc_version()), param_types=ck.param_types,
                                 blob=writer.add(ck.cubin))
                except Exception as e:  # noqa: BLE001 - kept as source: the loader compiles it
                    entry["error"] = f"{type(e).__name__}: {e}"
            out.append(entry)
    return out


def install_kernels(manifest: dict, data) -> dict:
    from fxopt.package_file import blob_bytes

    kernels = manifest.get("kernels") or []
    if not kernels:
        return {"installed": 0, "from_source": 0}
    try:
        from fxopt.backends.cuda.compiler import default_arch, install_cubin, nvrtc_version

        arch, nvrtc = default_arch(), list(nvrtc_version())
    except Exception:  # noqa: BLE001 - no NVRTC here: the executor runs PyTorch's kernels
        return {"installed": 0, "from_source": len(kernels), "why": "NVRTC unavailable"}
    installed = 0
    blobs = manifest["blobs"]
    for k in kernels:
        if k.get("blob") is not None and k.get("arch") == arch and k.get("nvrtc") == nvrtc:
            install_cubin(k["source"], k["name"], blob_bytes(data, blobs[k["blob"]]), arch, k.get("param_types"))
            installed += 1
    return {"installed": installed, "from_source": len(kernels) - installed, "arch": arch}


def summarize(built: dict, kernels: list) -> dict:
    module = built["module"]
    decisions = module.decisions()
    node_choices = collections.Counter(c for d in decisions.values() for c in d["node_choices"].values())
    return {
        "executor": module.executor,
        "device": str(built["device"]),
        "batch": built["info"],
        "fallback": built["fallback"],
        "passes": [{"name": r.name, "status": r.status, "changed": r.changed, "summary": r.summary}
                   for r in built["records"]],
        "conv_algorithms": {q: f"{c.algorithm} ({c.how})" for q, c in built["conv_algorithms"].items()},
        "kernels": {"count": len(kernels), "with_cubin": sum(1 for k in kernels if k.get("blob") is not None),
                    "arch": sorted({k["arch"] for k in kernels if k.get("arch")})},
        "choices": {"entries": sum(len(v) for v in built["recording"].used.values()),
                    "node_choices": dict(node_choices),
                    "runner": {b: d["runner"] for b, d in decisions.items() if d["runner"]}},
        "weights": len(built["weights"]),
        "timings": built["timings"],
    }


def describe(module) -> str:
    m = module.manifest
    s = m["summary"]
    b = s["batch"]
    lines = [f"fxopt package: fxopt {m['fxopt_version']}, torch {m['torch_version']}, created {m['created']}",
             f"  tuned on: {m['device_fingerprint']}",
             f"  running on: {module.device} (executor {module.executor})",
             f"  batch: {'dynamic (>= 1), example ' + str(b['example']) if b['dynamic'] else 'fixed at ' + str(b['example'])}"
             + (f" ({b['why_fixed']})" if b.get("why_fixed") else ""),
             f"  weights: {s['weights']} tensors; file {s.get('bytes', 0) / 2**20:.1f} MiB"]
    if s.get("fallback"):
        lines.append(f"  FALLBACK: {s['fallback']}")
    lines.append("  passes:")
    for p in s["passes"]:
        lines.append(f"    {p['name']:<22} {p['status']:<8} {'changed' if p['changed'] else '-':<8} {p['summary'][:90]}")
    algos = collections.Counter(v.split(" ")[0] for v in s["conv_algorithms"].values())
    lines.append(f"  conv algorithms: {dict(algos) or '-'}")
    k = s["kernels"]
    lines.append(f"  kernels: {k['count']} generated, {k['with_cubin']} with a cubin ({', '.join(k['arch']) or '-'})")
    c = s["choices"]
    lines.append(f"  choices: {c['entries']} autotuning entries; node implementations {c['node_choices'] or '-'}")
    runner = "CPU runner" if s.get("executor") == "cpu" else "CUDA graphs"  # whose decisions they are
    for batch, runs in c["runner"].items():
        lines.append(f"    {runner} at batch {batch}: " + "; ".join(r.get("runs", "?") for r in runs))
    if module.lowerings:
        for batch, d in module.decisions().items():
            lines.append(f"  this process, batch {batch}: executor {d['executor']}, cudagraphs {d['cudagraphs']}")
    hits, misses = len(getattr(module.choices, "hits", [])), len(getattr(module.choices, "misses", []))
    lines.append(f"  choices used here: {hits} from the package, {misses} by default (not measured)")
    lines.append(f"  load: {module.timings}")
    return "\n".join(lines)
