"""Fast CPU tests of the benchmark harness (fxopt.bench)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch import nn

import fxopt.bench as B
from fxopt.bench import models as M
from fxopt.bench import report as RP
from fxopt.bench import runners as R


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


@pytest.fixture
def tiny_model(monkeypatch):
    monkeypatch.setitem(M.MODELS, "tiny", M.ModelSpec(_Tiny, (3, 8, 8), "test model"))
    return "tiny"


def _seed_models_available() -> bool:
    try:
        M.build_model("seedcnn")
        return True
    except Exception:
        return False


# --------------------------------------------------------------------------
# argument parsing
# --------------------------------------------------------------------------
def test_parse_quick_defaults():
    a = B.parse_args(["--quick", "--device", "cpu"])
    assert a.models == ["seedcnn", "seedcnn2"]
    assert a.batch == [2] and a.dtype == ["float32"]
    assert a.backends == ["eager", "inductor", "fxopt"]
    assert a.iters == 10 and a.warmup == 2 and a.out == "bench_out"
    assert a.fxopt_options == {} and not a.cold


def test_parse_lists_and_options():
    a = B.parse_args(["--device", "cpu", "--models", "resnet18,replknet_block", "--batch", "1,8",
                      "--dtype", "fp16,bfloat16,float16", "--backends", "eager,onnxruntime,fxopt",
                      "--fxopt-options", '{"cudagraphs": false, "x": 1}', "--iters", "60",
                      "--warmup", "3", "--out", "o", "--cold"])
    assert a.models == ["resnet18", "replknet_block"] and a.batch == [1, 8]
    assert a.dtype == ["float16", "bfloat16"]
    assert a.backends == ["eager", "onnxruntime", "fxopt"]
    assert a.fxopt_options == {"cudagraphs": False, "x": 1}
    assert (a.iters, a.warmup, a.out, a.cold) == (60, 3, "o", True)


def test_parse_defaults_full_run():
    a = B.parse_args(["--device", "cuda", "--iters", "5"])
    assert a.iters == 50  # at least 50 timed runs outside --quick
    assert set(a.models) == set(M.MODELS)
    assert all(a.model_batches[m] == [1, 32] for m in a.models)
    assert "inductor-max-autotune" not in a.backends
    assert {"fxopt", "fxopt-no-cudagraphs", "onnxruntime-cudagraph", "eager"} <= set(a.backends)


def test_parse_cpu_suite_batches_per_model():
    a = B.parse_args(["--device", "cpu"])
    assert a.model_batches == B.CPU_SUITE and a.models == list(B.CPU_SUITE)
    assert a.model_batches["seedcnn"] == [1, 64] and a.model_batches["resnet50"] == [1, 8]
    # --models or --batch given: the plain grid
    a = B.parse_args(["--device", "cpu", "--models", "seedcnn,resnet18"])
    assert a.model_batches == {"seedcnn": [1, 32], "resnet18": [1, 32]}
    a = B.parse_args(["--device", "cpu", "--batch", "4"])
    assert set(a.models) == set(M.MODELS) and a.model_batches["seedcnn"] == [4]


@pytest.mark.parametrize("argv", [
    ["--models", "nope"], ["--backends", "eager,nope"], ["--dtype", "int8"],
    ["--batch", "a"], ["--batch", "0"], ["--fxopt-options", "{bad"], ["--fxopt-options", "[1]"],
    ["--device", "tpu"],
])
def test_parse_errors(argv):
    with pytest.raises(SystemExit):
        B.parse_args(["--device", "cpu", *argv] if "--device" not in argv else argv)


# --------------------------------------------------------------------------
# stats, accuracy
# --------------------------------------------------------------------------
def test_stats_matches_numpy():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0, 7.5]
    s = R.stats(xs)
    assert s["median"] == pytest.approx(np.median(xs))
    assert s["q1"] == pytest.approx(np.percentile(xs, 25))
    assert s["q3"] == pytest.approx(np.percentile(xs, 75))
    assert s["iqr"] == pytest.approx(np.percentile(xs, 75) - np.percentile(xs, 25))
    assert (s["min"], s["max"], s["n"]) == (1.0, 10.0, 7)
    assert R.stats([2.0]) == {"median": 2.0, "q1": 2.0, "q3": 2.0, "iqr": 0.0, "mean": 2.0,
                              "min": 2.0, "max": 2.0, "n": 1}
    with pytest.raises(ValueError):
        R.stats([])


def test_max_rel_error():
    ref = torch.tensor([1.0, -4.0, 2.0])
    assert R.max_rel_error(ref.clone(), ref) == 0.0
    assert R.max_rel_error(torch.tensor([1.0, -4.0, 2.4]), ref) == pytest.approx(0.1)
    assert R.max_rel_error((ref.half(),), ref) == 0.0
    assert R.max_rel_error(torch.tensor([float("nan"), 0, 0]), ref) == float("inf")


def test_replknet_block_shape():
    m, shape = M.build_model("replknet_block")
    assert shape == (128, 56, 56)
    assert m.large_kernel.kernel_size == (31, 31) and m.large_kernel.groups == 128
    with torch.no_grad():
        y = m(M.make_input((128, 12, 12), 1))
    assert y.shape == (1, 128, 12, 12)
    assert not m.training


# --------------------------------------------------------------------------
# report writers
# --------------------------------------------------------------------------
def _fake_results(quick=True):
    def cell(model, be, ms, **kw):
        d = {"model": model, "batch": 2, "dtype": "float32", "backend": be, "status": "ok",
             "error": None, "median_ms": ms, "iqr_ms": 0.1, "q1_ms": ms and ms - .05,
             "q3_ms": ms and ms + .05,
             "first_call_s": 1.0, "max_rel_err": 1e-6, "tflops": 0.1, "pct_peak": 10.0}
        d.update(kw)
        return d
    cells = [cell("a", "eager", 4.0), cell("a", "inductor", 2.0), cell("a", "fxopt", 1.0),
             cell("a", "onnxruntime", None, status="unavailable", error="no CUDA EP"),
             cell("b", "eager", 3.0), cell("b", "inductor", 6.0),
             cell("b", "fxopt", None, status="error", error="RuntimeError: boom")]
    return {"meta": {"device_type": "cpu", "device_name": "CPU: test", "date": "2026-01-01",
                     "command": "python -m fxopt.bench --quick", "versions": {"torch": "x"},
                     "config": {"quick": quick, "iters": 10, "warmup": 2}},
            "peak": {"float32": {"tflops": 1.0, "what": "matmul"}}, "flops": {}, "cells": cells,
            "checks": [{"model": "b", "batch": 2, "dtype": "float32", "backend": "fxopt",
                        "ok": False, "reason": "did not run"}]}


def test_report_writers(tmp_path):
    res = _fake_results()
    paths = RP.write_reports(res, str(tmp_path))
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["cells"][2]["median_ms"] == 1.0
    sp = {(s["model"]): s for s in data["speedups"]}
    assert sp["a"]["best_peer"] == "inductor" and sp["a"]["fxopt"]["fxopt"]["over_best"] == 2.0
    assert sp["a"]["fxopt"]["fxopt"]["over_peer"]["eager"] == 4.0
    md = (tmp_path / "results.md").read_text()
    assert "CPU smoke run — not a performance result" in md
    assert "2.00×" in md and "unavailable: no CUDA EP" in md and "error: RuntimeError" in md
    assert "| a | 2 | float32 |" in md and "FAILED b b2 float32 fxopt" in md
    summary = (tmp_path / "summary.md").read_text()
    assert summary.strip().splitlines()[-1].startswith("Times in ms")
    assert "png" in paths, paths
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_no_fxopt_and_cpu_label(tmp_path):
    res = _fake_results(quick=False)
    res["cells"] = [c for c in res["cells"] if c["backend"] != "fxopt"]
    RP.write_reports(res, str(tmp_path))
    md = (tmp_path / "results.md").read_text()
    assert "CPU run — not a GPU performance result" in md and "smoke" not in md
    assert (tmp_path / "speedup.png").stat().st_size > 0
    assert "cuDNN's plans" not in md and "cuDNN plans" not in md  # only a CUDA run's header speaks of them
    res["meta"]["device_type"] = "cuda"
    assert "the backends share one thread, so torch's cuDNN plans" in RP.render_markdown(res)
    res["meta"]["backend_threads"] = True
    assert "each backend on a thread of its own, so cuDNN's plans" in RP.render_markdown(res)


# --------------------------------------------------------------------------
# runners
# --------------------------------------------------------------------------
def _broken_prepare(model, x, device, dtype, options):
    raise ValueError("boom\nsecond line")


def _run_cell(backend, model_name, device="cpu", dtype=torch.float32, iters=3):
    model, shape = M.build_model(model_name)
    x = M.make_input(shape, 2)
    ref = R.reference_output(model, x, device)
    return R.measure_cell(backend, model, x, ref, device, dtype, warmup=1, iters=iters)


def test_failing_backend_recorded(monkeypatch, tiny_model):
    monkeypatch.setitem(R.BACKENDS, "broken", R.BackendSpec("broken", _broken_prepare))
    c = _run_cell("broken", tiny_model)
    assert c["status"] == "error" and c["error"] == "ValueError: boom"
    c = _run_cell("eager", tiny_model, iters=5)
    assert c["status"] == "ok" and c["n"] == 5 and c["max_rel_err"] == 0.0
    assert c["q1_ms"] <= c["median_ms"] <= c["q3_ms"]


def test_failing_backend_run_continues(monkeypatch, tiny_model, tmp_path, capsys):
    monkeypatch.setitem(R.BACKENDS, "broken", R.BackendSpec("broken", _broken_prepare))
    rc = B.main(["--quick", "--device", "cpu", "--models", tiny_model, "--backends",
                 "broken,eager,eager-channels-last", "--iters", "3", "--out", str(tmp_path)])
    assert rc == 0  # a failing peer does not fail the run
    data = json.loads((tmp_path / "results.json").read_text())
    by = {c["backend"]: c for c in data["cells"]}
    assert by["broken"]["status"] == "error" and "boom" in by["broken"]["error"]
    assert by["eager"]["status"] == "ok" and by["eager-channels-last"]["status"] == "ok"
    assert (tmp_path / "errors.log").exists()
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("Times in ms")


def _tag_backends(monkeypatch):
    """Backends tag-a and tag-b (the model, each call logged in ``order`` by its tag and the threads
    it ran on in ``seen[tag]``) and ``broken`` (fails to prepare); returns ``order, seen``."""
    import threading

    order, seen = [], {}

    def tagged(tag):
        def prepare(model, x, device, dtype, options):
            seen.setdefault(tag, set()).add(threading.get_ident())

            def fn(inp):
                seen[tag].add(threading.get_ident())
                order.append(tag)
                return model(inp)
            return R.Prepared(fn, x)
        return prepare

    monkeypatch.setitem(R.BACKENDS, "tag-a", R.BackendSpec("tag-a", tagged("a")))
    monkeypatch.setitem(R.BACKENDS, "tag-b", R.BackendSpec("tag-b", tagged("b")))
    monkeypatch.setitem(R.BACKENDS, "broken", R.BackendSpec("broken", _broken_prepare))
    return order, seen


def test_rounds_interleave_live_backends_without_recompiling(monkeypatch, tiny_model, tmp_path):
    from torch._dynamo.utils import counters

    order, _ = _tag_backends(monkeypatch)
    settled = []  # each CPU round first lets the previous backend's thread pool go idle
    monkeypatch.setattr(R, "_settle", lambda s: settled.append(s))
    counters.clear()
    rc = B.main(["--quick", "--device", "cpu", "--models", tiny_model, "--backends",
                 "tag-a,broken,inductor,tag-b,fxopt", "--iters", "7", "--warmup", "1", "--rounds", "3",
                 "--out", str(tmp_path)])
    assert rc == 0
    assert settled.count(R.CPU_SETTLE_S) == 4 * 3
    by = {c["backend"]: c for c in json.loads((tmp_path / "results.json").read_text())["cells"]}
    for be in ("tag-a", "inductor", "tag-b", "fxopt"):
        c = by[be]
        assert c["status"] == "ok" and c["rounds"] == 3 and c["n"] == 9, c  # 3 rounds of ceil(7/3)
        assert len(c["samples_ms"]) == 9 and c["max_rel_err"] <= 1e-4
        # one median per round (of that round's 3 samples) and the host speed measured before it
        assert len(c["round_medians_ms"]) == 3 and len(c["round_host_us"]) == 3
        assert all(h > 0 for h in c["round_host_us"])
        assert c["round_medians_ms"][1] == sorted(c["samples_ms"][3:6])[1]
    assert by["broken"]["status"] == "error"
    # the rounds alternate: a's calls come in three separate runs, each followed by b's
    runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert runs == ["a", "b"] * 4  # preparation and warm-up, then 3 rounds
    # inductor and fxopt stayed compiled through the rounds: one Dynamo frame compile each
    assert counters["frames"]["ok"] == 2, dict(counters["frames"])


def test_paired_speedup_compares_rounds_of_the_same_host_state():
    from fxopt.bench import report as REP
    # a host that halves its speed in rounds 2 and 3: the pooled medians compare different mixes,
    # the paired ratio compares round by round
    peer = {"round_medians_ms": [0.060, 0.064, 0.062, 0.058, 0.060]}
    fx = {"round_medians_ms": [0.045, 0.080, 0.078, 0.044, 0.046]}
    assert REP.paired_ratio(peer, fx) == pytest.approx(0.060 / 0.046)
    assert REP.paired_ratio(peer, {"round_medians_ms": [0.05, 0.05]}) is None  # rounds differ
    assert REP.paired_ratio({"round_medians_ms": [1, 1]}, {"round_medians_ms": [1, 1]}) is None  # < 3
    cell = {"model": "m", "batch": 1, "dtype": "float32", "status": "ok"}
    results = {"cells": [dict(cell, backend="onnxruntime-cudagraph", median_ms=0.060, **peer),
                         dict(cell, backend="fxopt", median_ms=0.046, round_host_us=[25, 50, 49, 24, 26], **fx)]}
    s = REP.speedups(results)[("m", 1, "float32")]["fxopt"]["fxopt"]
    assert s["paired_over_best"] == pytest.approx(0.060 / 0.046)
    lines = REP._rounds_lines(results)
    assert lines[0] == "## Rounds" and "paired speed-up 1.30×" in lines[-2] and "45/60 @25" in lines[-2]


def test_floor_rows_are_shown_but_are_not_peers():
    cell = {"model": "m", "batch": 1, "dtype": "float32", "status": "ok"}
    results = {"cells": [dict(cell, backend="eager", median_ms=0.200),
                         dict(cell, backend="floor-dynamo-entry", median_ms=0.020),
                         dict(cell, backend="floor-dynamo-eager", median_ms=0.210),
                         dict(cell, backend="fxopt", median_ms=0.100)]}
    s = RP.speedups(results)[("m", 1, "float32")]
    assert s["best_peer"] == "eager" and s["fxopt"]["fxopt"]["over_best"] == pytest.approx(2.0)
    assert set(s["fxopt"]["fxopt"]["over_peer"]) == {"eager"}
    table = "\n".join(RP._summary_table(results))
    assert "floor-dynamo-entry ms" in table and "not a peer" in table
    assert all(not R.BACKENDS[b].default and not R.BACKENDS[b].is_fxopt
               for b in ("floor-dynamo-eager", "floor-aot-eager", "floor-dynamo-entry"))


@pytest.mark.parametrize("backend", ["floor-dynamo-eager", "floor-aot-eager", "floor-dynamo-entry"])
def test_floor_backends_run_the_model_through_torch_compile(tiny_model, backend):
    torch._dynamo.reset()
    cell = _run_cell(backend, tiny_model)
    assert cell["status"] == "ok", cell
    assert cell["max_rel_err"] < 1e-5 and "torch.compile" in cell["note"]


def test_parse_rounds_defaults():
    assert B.parse_args(["--device", "cpu"]).rounds == 1
    assert B.parse_args(["--device", "cuda"]).backend_threads is True
    assert B.parse_args(["--device", "cuda", "--same-thread"]).backend_threads is False
    assert B.parse_args(["--device", "cuda", "--quick"]).rounds == 1
    assert B.parse_args(["--device", "cpu", "--rounds", "4"]).rounds == 4
    with pytest.raises(SystemExit):
        B.parse_args(["--device", "cpu", "--rounds", "0"])


class _DemoFallbackWarning(UserWarning):
    pass


def _fallback_prepare(model, x, device, dtype, options):
    def fn(inp):
        import warnings
        warnings.warn("pass 'x' failed; running the unoptimized graph", _DemoFallbackWarning)
        return model(inp)
    return R.Prepared(fn, x)


def test_fallback_warning_recorded(monkeypatch, tiny_model, tmp_path):
    monkeypatch.setitem(R.BACKENDS, "fxopt-fb", R.BackendSpec("fxopt-fb", _fallback_prepare,
                                                              is_fxopt=True))
    with pytest.warns(_DemoFallbackWarning):
        c = _run_cell("fxopt-fb", tiny_model)
    assert c["status"] == "ok" and c["fallback"].startswith("pass 'x' failed")
    assert c["fallback_count"] >= 1
    res = _fake_results()
    res["cells"][2]["fallback"] = "pass 'x' failed"
    assert "1.000 ±0.100 (fallback)" in RP.render_markdown(res)


def _wrong_prepare(model, x, device, dtype, options):
    return R.Prepared(lambda inp: model(inp) * 1.01, x)


def test_fxopt_mismatch_fails_run(monkeypatch, tiny_model, tmp_path):
    monkeypatch.setitem(R.BACKENDS, "fxopt-wrong", R.BackendSpec("fxopt-wrong", _wrong_prepare,
                                                                 is_fxopt=True))
    rc = B.main(["--quick", "--device", "cpu", "--models", tiny_model, "--backends",
                 "eager,fxopt-wrong", "--iters", "2", "--out", str(tmp_path)])
    assert rc == 1
    data = json.loads((tmp_path / "results.json").read_text())
    assert [c["ok"] for c in data["checks"]] == [False]


def test_onnxruntime_cpu(tiny_model):
    pytest.importorskip("onnxruntime")
    names = [tiny_model] + (["seedcnn"] if _seed_models_available() else [])
    for name in names:
        c = _run_cell("onnxruntime", name)
        assert c["status"] == "ok", c
        assert c["max_rel_err"] < 1e-4
        assert "CPUExecutionProvider" in c["note"]
        assert "intra-op thread" in c["note"], c["note"]  # the setting it kept, of those timed
    c = _run_cell("onnxruntime-cudagraph", tiny_model)
    assert c["status"] == "unavailable"


@pytest.mark.parametrize("peer", ["openvino-f32", "openvino"])
def test_openvino_cpu_peer_keeps_its_fastest_setting(tiny_model, peer):
    pytest.importorskip("openvino")
    c = _run_cell(peer, tiny_model)
    assert c["status"] == "ok", c
    assert "pinning" in c["note"] and " thread" in c["note"], c["note"]
    if peer == "openvino-f32":
        assert c["max_rel_err"] < 1e-4


def test_onnxruntime_no_cuda_ep_is_unavailable(monkeypatch, tiny_model):
    ort = pytest.importorskip("onnxruntime")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    model, shape = M.build_model(tiny_model)
    x = M.make_input(shape, 1)
    with pytest.raises(R.BackendUnavailable, match="no CUDA EP"):
        with torch.no_grad():
            R.BACKENDS["onnxruntime"].prepare(model, x, "cuda", torch.float32, {})


def test_flops_and_peak(tiny_model):
    model, shape = M.build_model(tiny_model)
    f1 = R.count_flops(model, M.make_input(shape, 1))
    f4 = R.count_flops(model, M.make_input(shape, 4))
    assert f1 > 0 and f4 == 4 * f1
    p = R.measure_peak_tflops("cpu", torch.float32, quick=True)
    assert p["tflops"] > 0 and "matmul" in p["what"]


# --------------------------------------------------------------------------
# end to end
# --------------------------------------------------------------------------
def _quick_backends():
    return "eager,inductor" + (",fxopt" if R.fxopt_available()[0] else "")


@pytest.mark.skipif(not _seed_models_available(), reason="fxopt.testing.models not importable")
def test_quick_cpu_end_to_end(tmp_path, capsys):
    rc = B.main(["--quick", "--device", "cpu", "--backends", _quick_backends(),
                 "--out", str(tmp_path)])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, data["checks"]
    assert {c["model"] for c in data["cells"]} == {"seedcnn", "seedcnn2"}
    ways = {"optimized graph", "baseline graph", "onnxruntime", "onnxruntime 1 thread", "openvino", "openvino 1 thread",
            "generated C", "generated C 1 thread"}
    for c in data["cells"]:
        assert c["status"] == "ok", c
        assert c["max_rel_err"] <= 1e-4 and c["n"] == 10 and math.isfinite(c["median_ms"])
        if c["backend"] == "fxopt":  # the way the cpu executor's runner chose for the compiled graph
            assert c["ran"] and set(c["ran"].split(", ")) <= ways, c
    assert all(ch["ok"] for ch in data["checks"]) and data["checks"]
    assert data["meta"]["versions"]["torch"] == torch.__version__
    assert "CPU smoke run — not a performance result" in out
    assert "| seedcnn | 2 | float32 |" in out
    for f in ("results.json", "results.md", "speedup.png", "summary.md"):
        assert os.path.getsize(tmp_path / f) > 0


@pytest.mark.skipif(not _seed_models_available(), reason="fxopt.testing.models not importable")
def test_cold_compile_subprocess(tmp_path):
    a = B.parse_args(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    res = B._cold_compile("seedcnn", 2, "float32", "eager", a)
    assert "cold_compile_s" in res, res
    assert res["cold_compile_s"] >= 0 and res["cudnn_benchmark"] is False
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True  # the run's setting reaches the fresh interpreter
    try:
        assert B._cold_compile("seedcnn", 2, "float32", "eager", a)["cudnn_benchmark"] is True
    finally:
        torch.backends.cudnn.benchmark = old
    assert "warm_cache_compile_s" not in res  # only fxopt has its own caches to keep warm


def test_cold_compile_of_fxopt_also_times_a_warm_fxopt_cache(tmp_path):
    a = B.parse_args(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    res = B._cold_compile("seedcnn", 2, "float32", "fxopt", a)
    assert res.get("cold_compile_s", -1) > 0 and res.get("warm_cache_compile_s", -1) > 0, res


def test_merge_results_of_split_runs(tmp_path):
    from fxopt.bench.report import merge_results

    def part(model, wall):
        return {"meta": {"device_name": "gpu0", "command": f"bench --models {model}", "date": "d", "wall_s": wall},
                "peak": {"float32": {"tflops": 1.0}}, "flops": {f"{model}/b1": 10},
                "cells": [{"model": model, "batch": 1, "dtype": "float32", "backend": b, "status": "ok",
                           "median_ms": ms} for b, ms in (("eager", 2.0), ("fxopt", 1.0))],
                "checks": [{"ok": True}], "errors_logged": 0}

    merged = merge_results([part("seedcnn", 3.0), part("resnet18", 4.0)])
    assert [c["model"] for c in merged["cells"]] == ["seedcnn"] * 2 + ["resnet18"] * 2
    assert merged["meta"]["wall_s"] == 7.0 and len(merged["meta"]["runs"]) == 2
    assert set(merged["flops"]) == {"seedcnn/b1", "resnet18/b1"}
    assert merged["meta"]["replaced_rows"] == [] and [c["run"] for c in merged["cells"]] == [0, 0, 1, 1]
    # a row measured again later is replaced as a whole (never mixed cell by cell)
    again = part("seedcnn", 2.0)
    again["cells"] = again["cells"][:1]
    merged = merge_results([part("seedcnn", 3.0), part("resnet18", 4.0), again])
    seed = [c for c in merged["cells"] if c["model"] == "seedcnn"]
    assert [(c["backend"], c["run"]) for c in seed] == [("eager", 2)]
    assert merged["meta"]["replaced_rows"] == [{"model": "seedcnn", "batch": 1, "dtype": "float32", "by_run": 2}]
    other = part("vgg16", 1.0)
    other["meta"]["device_name"] = "gpu1"
    with pytest.raises(ValueError, match="different devices"):
        merge_results([part("seedcnn", 1.0), other])
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p, r in zip(paths, (part("seedcnn", 1.0), part("resnet18", 1.0))):
        p.write_text(json.dumps(r))
    assert B.main(["--merge", *map(str, paths), "--out", str(tmp_path / "m")]) == 0
    assert "resnet18" in (tmp_path / "m" / "summary.md").read_text()
    # a merged report merged again keeps every run it came from; a kept .json.gz reads as well
    twice = merge_results([merge_results([part("seedcnn", 3.0), part("resnet18", 4.0), again]), part("vgg16", 1.0),
                           part("resnet18", 1.0)])
    assert len(twice["meta"]["runs"]) == 5 and twice["meta"]["wall_s"] == 11.0
    assert [(c["model"], c["run"]) for c in twice["cells"]] == [("seedcnn", 2), ("vgg16", 3), ("vgg16", 3),
                                                               ("resnet18", 4), ("resnet18", 4)]
    assert twice["meta"]["replaced_rows"][-1] == {"model": "resnet18", "batch": 1, "dtype": "float32", "by_run": 4}
    assert twice["meta"]["replaced_rows"][0]["by_run"] == 2
    import gzip
    with gzip.open(tmp_path / "m.json.gz", "wt") as f:
        json.dump(json.loads((tmp_path / "m" / "results.json").read_text()), f)
    assert B.main(["--merge", str(tmp_path / "m.json.gz"), str(paths[0]), "--out", str(tmp_path / "m2")]) == 0
    assert len(json.loads((tmp_path / "m2" / "results.json").read_text())["meta"]["runs"]) == 3


def test_longest_kernels_shown_only_where_fxopt_is_slower():
    cell = {"model": "m", "batch": 1, "dtype": "float16", "status": "ok"}
    top_peer = [["triton_poi_fused", 18, 22.4], ["cutlass_fprop", 5, 30.0]]
    top_fx = [["fx_pw_conv_epi_silu", 38, 58.5]]
    losing = {"cells": [dict(cell, backend="inductor", median_ms=0.50, kernels_per_call=149, top_kernels=top_peer),
                        dict(cell, backend="fxopt", median_ms=0.62, kernels_per_call=155, top_kernels=top_fx)]}
    lines = RP._top_kernel_lines(losing)
    text = "\n".join(lines)
    assert lines[0] == "## Longest kernels where fxopt is slower" and "### m b1 float16" in text
    assert "- fxopt (155 kernels; these 1: 58.5 µs): 58.5 µs ×38 `fx_pw_conv_epi_silu`" in text
    assert "- inductor (149 kernels; these 2: 52.4 µs)" in text
    assert "## Longest kernels" in RP.render_markdown(losing)
    winning = {"cells": [dict(c, median_ms=0.4) if c["backend"] == "fxopt" else c for c in losing["cells"]]}
    assert RP._top_kernel_lines(winning) == []
    no_profile = {"cells": [{k: v for k, v in c.items() if k != "top_kernels"} for c in losing["cells"]]}
    assert RP._top_kernel_lines(no_profile) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_few_group_conv_rows_name_the_kept_candidate_and_the_kernels(monkeypatch):
    from fxopt.bench import convs

    monkeypatch.setattr(convs, "FEW_GROUPS", [(2, 32, 14)])
    rows = convs.few_group_rows(iters=3)
    assert [r["case"] for r in rows] == ["g2x32 @14 b1", "g2x32 @14 b32"]
    for r in rows:
        assert r["rel_error"] < 1e-2 and r["eager_cudnn_ms"] > 0 and r["fxopt_ms"] > 0
        assert r["choice"] != "?" and all(r["kernels"][k] for k in ("eager", "eager_default", "fxopt"))
        assert r["eager_default_ms"] > 0
