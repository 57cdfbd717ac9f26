"""fxopt benchmark harness: ``python -m fxopt.bench`` / ``fxopt bench``.

Times ``torch.compile(model, backend="fxopt", options=...)`` against eager,
inductor (several modes) and onnxruntime on a set of CNNs and writes
results.json, results.md, summary.md and speedup.png into ``--out``.
``--quick --device cpu`` is the CI smoke mode.  See ``--help``.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from fxopt.modelspec import csv_list

from .environment import _device_info, _versions

__all__ = ["main", "build_parser", "parse_args", "run_benchmark", "DTYPES"]

DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32",
          "float16": "float16", "fp16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
QUICK_BACKENDS = ["eager", "inductor", "fxopt"]
# ``--device cpu`` without --models/--batch: the CPU suite, batches per model
CPU_SUITE = {"seedcnn": [1, 64], "seedcnn2": [1, 64], "resnet18": [1, 8], "resnet50": [1, 8],
             "mobilenet_v2": [1, 8]}
COLD_TAG = "FXOPT_BENCH_COLD "
# accuracy floors (max relative error) per dtype; fp32 on CUDA allows TF32
TOL_FLOOR = {("float32", "cpu"): 1e-4, ("float32", "cuda"): 1e-3,
             "float16": 1e-2, "bfloat16": 5e-2}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fxopt.bench",
        description="Benchmark torch.compile(backend='fxopt') against eager, inductor and onnxruntime.")
    p.add_argument("--models", help="comma list (default: all; --quick: seedcnn,seedcnn2; --device cpu: "
                   "the CPU suite, " + ", ".join(f"{m} b{'/'.join(map(str, b))}" for m, b in CPU_SUITE.items())
                   + ", unless --batch is given)")
    p.add_argument("--batch", help="comma list of ints (default 1,32; --quick: 2; the CPU suite: per model)")
    p.add_argument("--dtype", help="comma list of float32,float16,bfloat16 "
                   "(default float16 on cuda, float32 on cpu; --quick: float32)")
    p.add_argument("--backends", help="comma list (default: all but inductor-max-autotune; "
                   "--quick: eager,inductor,fxopt)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default cuda if available")
    p.add_argument("--quick", action="store_true", help="CI smoke mode: small models, few iterations, "
                   "checks inductor/fxopt against eager (rtol 1e-4 on cpu fp32), non-zero exit on mismatch")
    p.add_argument("--out", default="bench_out", help="output directory (default bench_out/)")
    p.add_argument("--cold", action="store_true", help="also time compile + first call in a fresh "
                   "subprocess per cell with empty TORCHINDUCTOR/FXOPT/TRITON cache dirs")
    p.add_argument("--warmup", type=int, help="warm-up calls (default 10; --quick: 2)")
    p.add_argument("--iters", type=int, help="timed calls (default 50, at least 50 unless --quick; --quick: 10)")
    p.add_argument("--rounds", type=int, help="split each cell's timed calls into this many rounds, the backends "
                   "of a row taking turns (all kept alive), so host/clock drift hits them alike "
                   "(default 5 on cuda, 1 on cpu and with --quick; 1 = each backend timed on its own)")
    p.add_argument("--same-thread", action="store_true", help="run every backend on the calling thread (CUDA "
                   "default: each backend on a thread of its own, so cuDNN's plans, which torch caches per "
                   "thread, are its own, as alone in a process)")
    p.add_argument("--fxopt-options", default=None, metavar="JSON",
                   help="JSON object passed as torch.compile(..., options=) to the fxopt backends")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for weights and inputs")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="stop starting new cells after S seconds (the rest are marked skipped)")
    p.add_argument("--train", action="store_true", help="time training steps instead (fxopt.bench.train; "
                   "its options: fxopt bench --train --help)")
    p.add_argument("--zoo", action="store_true", help="a public zoo of CNNs (timm, torchvision segmentation) in "
                   "parts, merged with --zoo-merge (fxopt.bench.zoo; its options: fxopt bench --zoo --help)")
    p.add_argument("--merge", nargs="+", metavar="RESULTS_JSON",
                   help="measure nothing: merge results.json files (or .json.gz) of runs split over several "
                   "commands on one machine into one report in --out")
    p.add_argument("--cold-timeout", type=float, default=1800.0, help=argparse.SUPPRESS)
    p.add_argument("--cold-child", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and normalise: every list option becomes a list, defaults filled."""
    from . import models as M
    from . import runners as R

    p = build_parser()
    a = p.parse_args(list(argv) if argv is not None else None)
    if a.cold_child:
        return a
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    q = a.quick
    # batches per model: the CPU suite's own, otherwise --batch for every model
    a.model_batches = (dict(CPU_SUITE) if a.device == "cpu" and not (q or a.models or a.batch) else {})
    a.models = csv_list(a.models) if a.models else (
        list(M.QUICK_MODELS) if q else list(a.model_batches) or M.model_names())
    bad = [m for m in a.models if m not in M.MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}; known: {', '.join(M.MODELS)}")
    try:
        a.batch = [int(b) for b in csv_list(a.batch)] if a.batch else ([2] if q else [1, 32])
    except ValueError:
        p.error(f"--batch must be a comma list of ints, got {a.batch!r}")
    if any(b < 1 for b in a.batch):
        p.error("--batch values must be >= 1")
    a.model_batches = {m: a.model_batches.get(m, a.batch) for m in a.models}
    dts = csv_list(a.dtype) if a.dtype else (["float32"] if q or a.device == "cpu" else ["float16"])
    bad = [d for d in dts if d not in DTYPES]
    if bad:
        p.error(f"unknown dtype(s) {bad}; use float32,float16,bfloat16")
    a.dtype = list(dict.fromkeys(DTYPES[d] for d in dts))
    a.backends = csv_list(a.backends) if a.backends else (list(QUICK_BACKENDS) if q else list(R.DEFAULT_BACKENDS))
    bad = [b for b in a.backends if b not in R.BACKENDS]
    if bad:
        p.error(f"unknown backend(s) {bad}; known: {', '.join(R.BACKENDS)}")
    if a.time_budget is not None and a.time_budget <= 0:
        p.error("--time-budget must be > 0")
    a.warmup = a.warmup if a.warmup is not None else (2 if q else 10)
    a.iters = a.iters if a.iters is not None else (10 if q else 50)
    if a.iters < 1 or a.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    a.rounds = a.rounds if a.rounds is not None else (1 if q or a.device == "cpu" else 5)
    # the CPU stays on one thread: a new calling thread would start a second OpenMP team
    a.backend_threads = a.device == "cuda" and not a.same_thread
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    if not q and a.iters < 50:
        print(f"note: --iters {a.iters} raised to 50 (the minimum outside --quick)", file=sys.stderr)
        a.iters = 50
    try:
        a.fxopt_options = json.loads(a.fxopt_options) if a.fxopt_options else {}
    except json.JSONDecodeError as exc:
        p.error(f"--fxopt-options is not valid JSON: {exc}")
    if not isinstance(a.fxopt_options, dict):
        p.error("--fxopt-options must be a JSON object")
    return a


def _cold_compile(model: str, batch: int, dtype: str, backend: str, a) -> Dict[str, Any]:
    """Compile + first call in a fresh interpreter with empty caches. For fxopt backends, a
    second fresh interpreter then reuses that first one's fxopt caches (NVRTC cubins, autotuning
    choices; Inductor/Triton caches stay empty): ``warm_cache_compile_s``."""
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    # the fresh interpreter measures under the run's cuDNN setting (on CUDA: benchmark on for every
    # backend): where cuDNN searches its algorithms, the first call of each backend pays the search
    spec = {"model": model, "batch": batch, "dtype": dtype, "backend": backend,
            "device": a.device, "seed": a.seed, "fxopt_options": a.fxopt_options,
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)}
    with tempfile.TemporaryDirectory(prefix="fxopt_bench_cold_") as td:
        env = dict(os.environ)
        for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("FXOPT_CACHE_DIR", "fxopt"),
                         ("TRITON_CACHE_DIR", "triton")):
            env[var] = os.path.join(td, sub)
        env["PYTHONPATH"] = os.pathsep.join([pkg_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        from .runners import BACKENDS
        deploy = BACKENDS[backend].deploy
        if deploy:  # the artefact the children build, and the last one only loads
            from .deploy import ARTEFACT_ENV, LOAD_ONLY_ENV
            env[ARTEFACT_ENV] = os.path.join(td, "artefact")
        res = _cold_child_run(spec, env, a.cold_timeout)
        if (BACKENDS[backend].is_fxopt or deploy) and "cold_compile_s" in res:
            if BACKENDS[backend].is_fxopt:
                for sub in ("inductor", "triton"):  # only fxopt's own caches stay warm
                    shutil.rmtree(os.path.join(td, sub), ignore_errors=True)
            warm = _cold_child_run(spec, env, a.cold_timeout)
            if "cold_compile_s" in warm:
                res["warm_cache_compile_s"] = warm["cold_compile_s"]
        if deploy and "cold_compile_s" in res:  # deploying: load + first call in a fresh process
            loaded = _cold_child_run(spec, dict(env, **{LOAD_ONLY_ENV: "1"}), a.cold_timeout)
            res["load_first_call_s"] = loaded.get("cold_compile_s")
            res["load_dynamo_imported"] = loaded.get("dynamo_imported")
        return res


COLD_FLOORS = ("floor-dynamo-eager", "floor-aot-eager")


def _cold_floors(model: str, batch: int, dtype: str, a) -> List[Dict[str, Any]]:
    """With --cold, the two floors' compile + first call in fresh processes for every row, in the
    same command as the backends (what any torch.compile backend pays before its own work)."""
    return [{"model": model, "batch": batch, "dtype": dtype, "backend": f,
             **_cold_compile(model, batch, dtype, f, a)} for f in COLD_FLOORS if f not in a.backends]


def _cold_child_run(spec: Dict[str, Any], env: Dict[str, str], timeout: float) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "fxopt.bench", "--cold-child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"cold_error": f"timeout after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(COLD_TAG):
            return json.loads(line[len(COLD_TAG):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"cold_error": f"child exited {proc.returncode}: {tail[:200]}"}


def _cold_child(spec_json: str) -> int:
    import torch
    from .deploy import LOAD_ONLY_ENV
    from . import models as M
    from . import runners as R
    s = json.loads(spec_json)
    torch.backends.cudnn.benchmark = bool(s.get("cudnn_benchmark", False))
    res: Dict[str, Any] = {"cudnn_benchmark": torch.backends.cudnn.benchmark}
    try:
        spec = R.BACKENDS[s["backend"]]
        dtype = getattr(torch, s["dtype"])
        if spec.deploy and os.environ.get(LOAD_ONLY_ENV) == "1":
            # deploying: nothing but torch and the input before the clock starts (no model built)
            model, shape = None, M.MODELS[s["model"]].input_shape
        else:
            model, shape = M.build_model(s["model"], s["seed"])
            model = model.to(device=s["device"], dtype=dtype)
        x = M.make_input(shape, s["batch"], s["seed"]).to(device=s["device"], dtype=dtype)
        if s["device"] == "cuda":
            torch.cuda.synchronize()
        with torch.no_grad(), spec.context():
            t0 = time.perf_counter()
            prep = spec.prepare(model, x, s["device"], dtype, s["fxopt_options"])
            prep.fn(prep.inputs)
            if s["device"] == "cuda":
                torch.cuda.synchronize()
            res["cold_compile_s"] = time.perf_counter() - t0
        res["dynamo_imported"] = "torch._dynamo" in sys.modules
    except R.BackendUnavailable as exc:
        res["cold_error"] = f"unavailable: {exc}"
    except Exception as exc:
        res["cold_error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    print(COLD_TAG + json.dumps(res), flush=True)
    return 0


def _tolerance(dtype: str, device: str) -> float:
    return TOL_FLOOR.get((dtype, device), TOL_FLOOR.get(dtype, 1e-2))


def _checks(cells: List[Dict[str, Any]], quick: bool, device: str) -> List[Dict[str, Any]]:
    """fxopt (and, with --quick, inductor) must run and agree with fp32 eager."""
    out = []
    for c in cells:
        b = c["backend"]
        if not (b.startswith("fxopt") or (quick and b.startswith("inductor"))):
            continue
        if c["status"] in ("unavailable", "skipped"):
            continue
        chk = {k: c[k] for k in ("model", "batch", "dtype", "backend")}
        tol = _tolerance(c["dtype"], device)
        eager = next((e for e in cells if e["backend"] == "eager" and e["status"] == "ok"
                      and all(e[k] == c[k] for k in ("model", "batch", "dtype"))), None)
        if eager is not None and eager.get("max_rel_err") is not None and not quick:
            tol = max(tol, 4 * eager["max_rel_err"])
        chk["tol"] = tol
        if c["status"] != "ok":
            chk.update(ok=False, reason=f"did not run: {c.get('error')}")
        elif c.get("max_rel_err") is None:
            chk.update(ok=False, reason="no accuracy measurement")
        else:
            chk["max_rel_err"] = c["max_rel_err"]
            chk["ok"] = c["max_rel_err"] <= tol
            if not chk["ok"]:
                chk["reason"] = f"max rel err {c['max_rel_err']:.3e} > {tol:.1e}"
        out.append(chk)
    return out


def run_benchmark(a: argparse.Namespace, argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    import torch
    from tqdm import tqdm
    from . import models as M
    from . import runners as R
    from .report import write_json

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False")
    if a.device == "cuda":
        # As the peers' reference figures were taken (../shared/anchors-h100.md): cuDNN picks
        # its kernels by measurement, for every backend alike.
        torch.backends.cudnn.benchmark = True
    if a.rounds > 1:
        # every torch.compile backend of a row stays compiled at once: one Dynamo cache entry each
        # for the model's forward, more than the default limit of 8 with the optional backends
        cfg = torch._dynamo.config
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, knob):
                setattr(cfg, knob, max(getattr(cfg, knob), 64))
    prog = "fxopt bench" if os.path.basename(sys.argv[0] or "") == "fxopt" else "python -m fxopt.bench"
    cmd = f"{prog} " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": cmd, "device_type": a.device, **_device_info(a.device), "versions": _versions(),
            "fxopt_options": a.fxopt_options, "cudnn.benchmark": torch.backends.cudnn.benchmark,
            "backend_threads": a.backend_threads, "tf32": {
                "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32},
            "config": {k: getattr(a, k) for k in ("models", "batch", "model_batches", "dtype", "backends", "quick",
                                                   "warmup", "iters", "rounds", "cold", "seed", "time_budget")}}
    meta["config"]["rewarm"] = a.warmup  # untimed calls at the start of every round
    fx_ok, fx_why = R.fxopt_available()
    meta["fxopt_available"] = fx_ok if fx_ok else f"no ({fx_why})"
    results: Dict[str, Any] = {"meta": meta, "peak": {}, "flops": {}, "cells": [], "checks": []}
    errors: List[str] = []
    for dt in a.dtype:
        try:
            results["peak"][dt] = R.measure_peak_tflops(a.device, getattr(torch, dt), quick=a.quick)
        except Exception as exc:
            results["peak"][dt] = {"tflops": None, "error": f"{type(exc).__name__}: {exc}"}
    total = sum(map(len, a.model_batches.values())) * len(a.dtype) * len(a.backends)
    bar = tqdm(total=total, desc="fxopt bench", unit="cell", file=sys.stderr, mininterval=0.5)
    os.makedirs(a.out, exist_ok=True)
    partial = os.path.join(a.out, "results.json")
    t_start = time.perf_counter()
    # backends prepared again on this thread after failing on their own: why (None: failed here too)
    on_caller: Dict[str, Optional[str]] = {}
    try:
        for name in a.models:
            try:
                base, shape = M.build_model(name, a.seed)
            except Exception as exc:
                err = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
                for b in a.model_batches[name]:
                    for dt in a.dtype:
                        for be in a.backends:
                            results["cells"].append({"model": name, "batch": b, "dtype": dt, "backend": be,
                                                     "status": "error", "error": f"model: {err}"})
                bar.update(len(a.model_batches[name]) * len(a.dtype) * len(a.backends))
                continue
            for b in a.model_batches[name]:
                x_cpu = M.make_input(shape, b, a.seed)
                try:
                    ref = R.reference_output(base, x_cpu, a.device)
                except Exception as exc:
                    ref = None
                    errors.append(f"[{name} b{b} reference] {type(exc).__name__}: {exc}")
                try:
                    flops = R.count_flops(base, x_cpu)
                except Exception:
                    flops = None
                results["flops"][f"{name}/b{b}"] = flops
                for dt in a.dtype:
                    peak = (results["peak"].get(dt) or {}).get("tflops")
                    lives = []
                    # each backend on a thread of its own (CUDA): its own cuDNN plans (runners.BackendThread)
                    threads: Optional[Dict[str, Any]] = ({be: None for be, why in on_caller.items() if why}
                                                         if a.backend_threads else None)
                    for be in a.backends:
                        bar.set_postfix_str(f"{name} b{b} {dt} {be}")
                        if a.time_budget and time.perf_counter() - t_start > a.time_budget:
                            lives.append({"backend": be, "status": "skipped", "error": "time budget"})
                            bar.update(1)
                            continue
                        start = functools.partial(R.start_cell, be, base, x_cpu, ref, a.device, getattr(torch, dt),
                                                  a.warmup, a.fxopt_options, errors, reset=not lives or a.rounds == 1)
                        live = R.start_on_own_thread(threads, be, start, on_caller)
                        if a.rounds == 1:  # each backend timed on its own, then released
                            R.on_backend_thread(threads, be, R.time_round, live, a.device, a.iters, error_log=errors)
                            live = R.on_backend_thread(threads, be, R.finish_cell, live, a.device)
                        lives.append(live)
                        bar.update(1)
                    per_round = -(-a.iters // a.rounds)
                    for r in range(a.rounds if a.rounds > 1 else 0):
                        for live in lives:
                            if isinstance(live, R.LiveCell):
                                R.on_backend_thread(threads, live.backend, R.time_round, live, a.device, per_round,
                                                    rewarm=a.warmup, error_log=errors)
                    for live in lives:
                        cell = (R.on_backend_thread(threads, live.backend, R.finish_cell, live, a.device, a.rounds)
                                if isinstance(live, R.LiveCell) else live)
                        cell = {"model": name, "batch": b, "dtype": dt, **cell, "gflop": flops and flops / 1e9}
                        if cell["status"] == "ok" and flops:
                            cell["tflops"] = flops / (cell["median_ms"] * 1e-3) / 1e12
                            cell["pct_peak"] = 100.0 * cell["tflops"] / peak if peak else None
                        if a.cold and cell["status"] not in ("unavailable", "skipped"):
                            cell.update(_cold_compile(name, b, dt, cell["backend"], a))
                        results["cells"].append(cell)
                    if a.cold:
                        results.setdefault("cold_floors", []).extend(_cold_floors(name, b, dt, a))
                    del lives
                    for be, thread in (threads or {}).items():  # its own Dynamo / CUDA-graph state, then ends
                        if thread is None:  # a backend on this thread (on_caller)
                            continue
                        thread(R._cleanup, a.device)
                        thread.close()
                    R._cleanup(a.device)
                    write_json({**results, "partial": True}, partial)
    except KeyboardInterrupt:
        meta["interrupted"] = True
        print("\ninterrupted: writing the results so far", file=sys.stderr)
    finally:
        bar.close()
    results["checks"] = _checks(results["cells"], a.quick, a.device)
    results["errors_logged"] = len(errors)
    if errors:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "errors.log"), "w") as f:
            f.write("\n\n".join(errors) + "\n")
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--serving" in argv:  # the varying-size serving loop: fxopt bench --serving --help
        from .serving import main as serving_main

        return serving_main([x for x in argv if x != "--serving"])
    if "--zoo" in argv or "--zoo-merge" in argv:  # the public zoo of CNNs: fxopt bench --zoo --help
        from .zoo import main as zoo_main

        return zoo_main(argv, harness=sys.modules[__name__])
    if "--train" in argv:  # the training-step benchmark has its own options: fxopt bench --train --help
        from .train import main as train_main

        return train_main([x for x in argv if x != "--train"])
    a = parse_args(argv)
    if a.cold_child:
        return _cold_child(a.cold_child)
    from .report import merge_results, read_results, render_summary, write_reports

    if a.merge:
        parts = [read_results(path) for path in a.merge]
        paths = write_reports(merge_results(parts), a.out)
        print(f"merged {len(parts)} runs into {', '.join(v for k, v in paths.items() if not k.endswith('_error'))}",
              file=sys.stderr)
        return 0

    t0 = time.perf_counter()

    def _on_term(signum, frame):  # a killed run still writes what it has
        raise KeyboardInterrupt
    with contextlib.suppress(ValueError):  # not in the main thread
        signal.signal(signal.SIGTERM, _on_term)
    results = run_benchmark(a, argv)
    results["meta"]["wall_s"] = round(time.perf_counter() - t0, 2)
    paths = write_reports(results, a.out)
    failed = [c for c in results["checks"] if not c.get("ok")]
    print(f"wrote {', '.join(v for k, v in paths.items() if not k.endswith('_error'))} "
          f"in {results['meta']['wall_s']:.1f} s", file=sys.stderr)
    if "png_error" in paths:
        print(f"speedup.png failed: {paths['png_error']}", file=sys.stderr)
    for c in results["cells"]:
        if c.get("fallback"):
            print(f"FALLBACK: {c['model']} b{c['batch']} {c['dtype']} {c['backend']}: {c['fallback']}",
                  file=sys.stderr)
    for c in failed:
        print(f"CHECK FAILED: {c['model']} b{c['batch']} {c['dtype']} {c['backend']}: {c.get('reason')}",
              file=sys.stderr)
    sys.stdout.write(render_summary(results))
    sys.stdout.flush()
    if results["meta"].get("interrupted"):
        return 130
    return 1 if failed else 0
