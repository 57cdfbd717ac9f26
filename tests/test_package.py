"""Packages (fxopt.package / fxopt.load), the graph JSON they hold, and the whole-compile cache.

The loading side runs in fresh processes (subprocess) in which ``torch.compile`` raises: a package
must run without it, and without importing Dynamo at all.
"""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
import fxopt.version
from fxopt.backends.cuda.compiler import nvrtc_available
from fxopt.backends.openvino import why_unavailable as why_no_openvino
from fxopt.choices import FixedChoices, RecordingCache, default_entry
from fxopt.package_file import PackageCorruptError, PackageError, PackageVersionError
from fxopt.serialize import GraphFormatError, graph_from_json, graph_to_json

RTOL = 1e-4

# CI and this project's machines have NVRTC (cuda-core); elsewhere these two tests cannot compile
needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not usable")


class Net(nn.Module):
    """conv + BN + ReLU, a residual block, max pool, global average pool, linear."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.pool, self.fc = nn.MaxPool2d(2), nn.Linear(16, 10)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)) + y)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.pool(y), 1), 1))


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = Net()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(16, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(16, generator=gen) + 0.5)
    return model.eval()


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


LOADER = textwrap.dedent("""
    import json, sys, time
    import torch

    def refuse(*a, **k):
        raise AssertionError("torch.compile called while running a package")

    torch.compile = refuse
    t0 = time.perf_counter()
    import fxopt
    from fxopt.backends.cuda import compiler
    module = fxopt.load(sys.argv[1])
    data = torch.load(sys.argv[2])
    outs = [module(x) for x in data["inputs"]]
    torch.save(outs, sys.argv[3])
    utils = sys.modules.get("torch._dynamo.utils")
    print(json.dumps({"dynamo": sorted(m for m in sys.modules if m.startswith("torch._dynamo")),
                      "frames": {k: dict(v) for k, v in utils.counters.items()} if utils else {},
                      "stats": compiler.cache_stats(), "kernels": module.timings.get("kernels"),
                      "hits": len(module.choices.hits), "misses": len(module.choices.misses),
                      "executor": module.executor, "s": time.perf_counter() - t0}))
""")


def run_loader(tmp_path, path, inputs, env_extra=None) -> tuple[list, dict]:
    script = tmp_path / "loader.py"
    script.write_text(LOADER)
    torch.save({"inputs": inputs}, tmp_path / "inputs.pt")
    env = dict(os.environ, FXOPT_CACHE_DIR=str(tmp_path / "loader-cache"), **(env_extra or {}))
    out = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "inputs.pt"),
                          str(tmp_path / "outputs.pt")], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.load(tmp_path / "outputs.pt"), json.loads(out.stdout.strip().splitlines()[-1])


def test_package_runs_in_a_fresh_process_without_dynamo(tmp_path):
    model = make_net()
    x = torch.randn(2, 3, 16, 16)
    summary = fxopt.package(model, (x,), tmp_path / "net.fxopt")
    assert summary["batch"]["dynamic"] and summary["fallback"] is None
    assert [p["name"] for p in summary["passes"] if p["changed"]][:2] == ["fold_batchnorm", "fuse_conv_epilogue"]
    inputs = [torch.randn(2, 3, 16, 16), torch.randn(5, 3, 16, 16), torch.randn(1, 3, 16, 16)]
    outs, info = run_loader(tmp_path, tmp_path / "net.fxopt", inputs)
    assert info["dynamo"] == []  # Dynamo was not even imported
    with torch.no_grad():
        for x, y in zip(inputs, outs):
            assert y.shape == (x.shape[0], 10)
            assert rel(y, model(x)) < RTOL


@needs_nvrtc
def test_package_with_the_cuda_executor_brings_its_kernels(tmp_path):
    """executor="cuda" on CPU inputs: kernels are generated and compiled (as on a GPU), the
    package carries the cubins, and the loader's lowering compiles nothing at the packaged batch."""
    model = make_net()
    x = torch.randn(2, 3, 16, 16)
    summary = fxopt.package(model, (x,), tmp_path / "net.fxopt", options={"executor": "cuda"})
    assert summary["kernels"]["count"] > 0 and summary["kernels"]["with_cubin"] == summary["kernels"]["count"]
    outs, info = run_loader(tmp_path, tmp_path / "net.fxopt", [torch.randn(2, 3, 16, 16)])
    # the batch's values come from the package (no FakeTensorMode): Dynamo is not even imported
    assert info["executor"] == "cuda" and info["dynamo"] == []
    assert info["kernels"]["installed"] == summary["kernels"]["count"]
    assert info["stats"].get("nvrtc_compiles", 0) == 0 and info["stats"].get("memory_hits", 0) > 0


def test_static_batch(tmp_path):
    model = make_net()
    x = torch.randn(2, 3, 16, 16)
    summary = fxopt.package(model, (x,), tmp_path / "net.fxopt", dynamic_batch=False)
    assert not summary["batch"]["dynamic"]
    module = fxopt.load(tmp_path / "net.fxopt")
    with torch.no_grad():
        assert rel(module(x), model(x)) < RTOL
    with pytest.raises(ValueError, match="shape \\[2, 3, 16, 16\\]"):
        module(torch.randn(3, 3, 16, 16))


class FixedBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x).reshape(2, 4 * 6 * 6)  # the batch size is written into the model


def test_a_model_that_fixes_its_batch_gets_a_fixed_batch(tmp_path):
    model = FixedBatch().eval()
    x = torch.randn(2, 3, 8, 8)
    summary = fxopt.package(model, (x,), tmp_path / "m.fxopt")
    assert not summary["batch"]["dynamic"] and summary["batch"]["why_fixed"]
    with torch.no_grad():
        assert rel(fxopt.load(tmp_path / "m.fxopt")(x), model(x)) < RTOL


def test_inputs_are_checked(tmp_path):
    fxopt.package(make_net(), (torch.randn(2, 3, 16, 16),), tmp_path / "net.fxopt")
    module = fxopt.load(tmp_path / "net.fxopt")
    with pytest.raises(ValueError, match="float32"):
        module(torch.randn(2, 3, 16, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        module(torch.randn(2, 3, 16))
    with pytest.raises(TypeError, match="1 input"):
        module(torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16))


def test_training_mode_batchnorm_is_refused(tmp_path):
    with pytest.raises(PackageError, match="eval"):
        fxopt.package(make_net().train(), (torch.randn(2, 3, 16, 16),), tmp_path / "net.fxopt")


@pytest.fixture(scope="module")
def packaged(tmp_path_factory):
    path = tmp_path_factory.mktemp("pkg") / "net.fxopt"
    fxopt.package(make_net(), (torch.randn(2, 3, 16, 16),), path)
    return path.read_bytes()


def _write(tmp_path, data: bytes):
    path = tmp_path / "bad.fxopt"
    path.write_bytes(data)
    return path


def test_truncated_package(tmp_path, packaged):
    for n in (10, 100, len(packaged) // 2, len(packaged) - 1):
        with pytest.raises(PackageCorruptError, match="truncated"):
            fxopt.load(_write(tmp_path, packaged[:n]))


@pytest.mark.parametrize("where", [50, -5, "middle"])
def test_corrupt_package(tmp_path, packaged, where):
    data = bytearray(packaged)
    at = len(data) // 2 if where == "middle" else where
    data[at] ^= 0x10
    with pytest.raises(PackageCorruptError, match="checksum"):
        fxopt.load(_write(tmp_path, bytes(data)))


def test_not_a_package_and_foreign_versions(tmp_path, packaged, monkeypatch):
    with pytest.raises(PackageError, match="not an fxopt package"):
        fxopt.load(_write(tmp_path, b"PK\x03\x04 a zip file"))
    data = bytearray(packaged)
    data[8] = 99  # the format version
    with pytest.raises(PackageVersionError, match="format 99"):
        fxopt.load(_write(tmp_path, bytes(data)))
    monkeypatch.setattr(fxopt.version, "__version__", "99.0")
    with pytest.raises(PackageVersionError, match="fxopt 0.1.0; this is fxopt 99.0"):
        fxopt.load(_write(tmp_path, packaged))
    assert issubclass(PackageVersionError, PackageError) and issubclass(PackageCorruptError, PackageError)


def test_another_device_warns_once_and_measures_nothing(tmp_path, monkeypatch):
    import fxopt.autotune

    fxopt.package(make_net(), (torch.randn(2, 3, 16, 16),), tmp_path / "net.fxopt", options={"executor": "cuda"})
    monkeypatch.setattr(fxopt.autotune, "device_fingerprint", lambda device_type: "another GPU")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = fxopt.load(tmp_path / "net.fxopt")
        with torch.no_grad():
            module(torch.randn(2, 3, 16, 16))
            module(torch.randn(2, 3, 16, 16))
    assert sum("was tuned on" in str(w.message) for w in caught) == 1


@needs_nvrtc
def test_stored_values_stand_for_propagation_at_every_batch(tmp_path):
    """The cuda executor's per-batch specialisation reads the values the package stores (sizes as
    expressions of the batch) instead of propagating FakeTensors: equal to propagation's at
    batches never packaged."""
    from fxopt.package_batch import _specialise, _vals_agree

    fxopt.package(make_net(), (torch.randn(1, 3, 16, 16),), tmp_path / "net.fxopt", options={"executor": "cuda"})
    module = fxopt.load(tmp_path / "net.fxopt")
    vals = module.manifest["vals"]
    assert vals["x"][0] == ["B", 3, 16, 16] and vals["view"][0] == ["B", 16]
    for batch in (1, 3, 7):
        args = list(module._template)
        args[module._input_at[0]] = torch.randn(batch, 3, 16, 16)
        stored = _specialise(module.graph, args, vals, batch)
        assert all(n.meta["val"].device.type == "meta" for n in stored.graph.nodes
                   if isinstance(n.meta.get("val"), torch.Tensor))
        assert _vals_agree(stored, _specialise(module.graph, args))


class _Split(nn.Module):
    """A channel split whose pieces are views at offsets into their input, each through a conv."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(5, 4, 1)

    def forward(self, x):
        y = torch.relu(nn.functional.conv2d(x, torch.ones(8, 3, 1, 1) * 0.1))
        p, q = torch.split(y, [3, 5], dim=1)
        return torch.cat([self.a(p), self.b(q)], 1), q


def test_stored_values_keep_the_offsets_of_views(tmp_path):
    """A value that is a view at an offset into its storage (the second piece of a split, returned) is
    stored with its offset (an expression of the batch) and rebuilt with it at every batch."""
    from fxopt.package_batch import _specialise, _vals_agree

    torch.manual_seed(0)
    model = _Split().eval()
    fxopt.package(model, (torch.randn(1, 3, 8, 8),), tmp_path / "s.fxopt", options={"executor": "cuda"})
    module = fxopt.load(tmp_path / "s.fxopt")
    vals = module.manifest["vals"]
    assert vals is not None and any(isinstance(v, list) and len(v) == 6 for v in vals.values()), vals
    for batch in (1, 2, 5):
        args = list(module._template)
        args[module._input_at[0]] = torch.randn(batch, 3, 8, 8)
        stored = _specialise(module.graph, args, vals, batch)
        assert _vals_agree(stored, _specialise(module.graph, args))
        assert any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].storage_offset() > 0
                   for n in stored.graph.nodes)
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        for got, want in zip(module(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_size_expressions_evaluate_or_refuse():
    from fxopt.serialize import eval_size

    assert eval_size(7, 3) == 7 and eval_size("B", 3) == 3
    assert eval_size("64*B + 2", 3) == 194 and eval_size("FloorDiv(B, 2)", 5) == 2
    assert eval_size("Max(1, B - 4)", 3) == 1 and eval_size("Mod(B, 4)", 6) == 2
    assert eval_size("B**2", 3) == 9  # a square image's side squared
    for bad in ("s0", "B**9", "__import__('os')", "B.real", "1.5*B", "True*B", "B +", "FloorDiv(B, 0)"):
        with pytest.raises(ValueError):
            eval_size(bad, 3)
    with pytest.raises(ValueError):  # a static graph's values name no batch
        eval_size("B", None)


@needs_nvrtc
def test_wrong_stored_values_are_dropped_when_packaging(tmp_path, monkeypatch):
    """Packaging checks the stored values against propagation at every batch it runs; values that
    differ are not written (the loader then propagates), and the package stays right."""
    import fxopt.packaging as P

    real = P._exported_vals

    def skewed(*a, **k):
        vals = real(*a, **k)
        vals["view"] = [["B", 17], [17, 1], "float32", "cpu", False]
        return vals

    monkeypatch.setattr(P, "_exported_vals", skewed)
    model = make_net()
    fxopt.package(model, (torch.randn(2, 3, 16, 16),), tmp_path / "net.fxopt", options={"executor": "cuda"})
    module = fxopt.load(tmp_path / "net.fxopt")
    assert module.manifest["vals"] is None
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        assert rel(module(x), model(x)) < RTOL


def test_measuring_refuses_meta_values():
    """A loaded package's values (meta tensors) never become measurement inputs: no memory behind them."""
    from fxopt.backends.cuda.runtime.measure import real_args

    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3, device="meta")
    node = g.call_function(torch.relu, (x,))
    with pytest.raises(ValueError, match="meta"):
        real_args(node)


def test_fixed_choices_answer_misses_without_measuring():
    entries = {"dev": {"node|a": {"choice": "generated"}}}
    fixed = FixedChoices(entries)
    assert fixed.get("dev", "node|a")["choice"] == "generated"
    assert fixed.get("dev", "node|b") == default_entry("node|b") and fixed.get("dev", "node|b")["choice"] == "reference"
    assert fixed.get("other", "node|a")["choice"] == "reference"  # another device: none applies
    assert fixed.get("dev", "cudagraph_runner|x")["runs"] == "optimized graph"
    assert fixed.hits == ["node|a"] and len(fixed.misses) == 4
    # the cpu runner: a signature not held runs what the held ones with the same ways chose most
    held = FixedChoices({"dev": {f"cpu_runner|b|h{i}|['a', 'ov']|(s{i},)": {"runs": r} for i, r in
                                 enumerate(["ov", "a", "ov"])} | {"cpu_runner|b|h|['a', 'ort']|(s,)": {"runs": "ort"}}})
    assert held.get("dev", "cpu_runner|b|h9|['a', 'ov']|(s9,)")["runs"] == "ov"
    assert held.get("dev", "cpu_runner|b|h9|['a', 'x']|(s9,)")["runs"] == "optimized graph"
    rec = RecordingCache(fxopt.autotune.AutotuneCache(None))
    rec.put("dev", "k", {"choice": "x"})
    assert rec.get("dev", "k") == {"choice": "x"} and rec.used == {"dev": {"k": {"choice": "x"}}}


def test_graph_json_round_trip_and_refusals():
    report = fxopt.explain(make_net(), torch.randn(2, 3, 16, 16))
    for gm in (report.before, report.after):
        data = json.loads(json.dumps(graph_to_json(gm)))
        assert graph_from_json(data, owner=gm).code == gm.code
    data = graph_to_json(report.after)
    node = next(n for n in data["nodes"] if n["op"] == "call_function")
    node["target"] = {"py": "os:system"}
    with pytest.raises(GraphFormatError, match="not one a graph may name"):
        graph_from_json(data, owner=report.after)
    node["target"] = {"op": "nosuchns.op.default"}
    with pytest.raises(GraphFormatError, match="not registered"):
        graph_from_json(data, owner=report.after)


@needs_nvrtc
def test_kernel_key_is_the_compilers():
    from fxopt.backends.cuda.compiler import compile_kernel, kernel_key
    src = 'extern "C" __global__ void fx_probe_key(float* x) { x[0] = 1.0f; }'
    assert compile_kernel(src, "fx_probe_key").key == kernel_key(src, "fx_probe_key")


# -- CLI -----------------------------------------------------------------------------------------
def test_cli_package_and_run(tmp_path, capsys):
    from fxopt.cli import main

    out = tmp_path / "seed.fxopt"
    assert main(["package", "fxopt.testing.models:SeedCNN2", "--shape", "2,3,32,32", "-o", str(out)]) == 0
    assert "batch dynamic" in capsys.readouterr().out
    assert main(["run", str(out), "--shape", "3,3,32,32", "--iters", "3"]) == 0
    text = capsys.readouterr().out
    assert "passes:" in text and "kernels:" in text and "choices" in text and "median" in text


@pytest.mark.parametrize("argv", [["package", "fxopt.testing.models:SeedCNN2", "-o", "x.fxopt"],
                                  ["package", "fxopt.testing.models:SeedCNN2", "--shape", "1,a", "-o", "x"],
                                  ["run", "x.fxopt"], ["run", "x.fxopt", "--shape", "1,3", "--iters", "-1"],
                                  ["package", "fxopt.testing.models:SeedCNN2", "--shape", "1,3,8,8"]])
def test_cli_argument_errors(argv):
    from fxopt.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


# -- whole-compile cache ---------------------------------------------------------------------------
COMPILER = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[3])
    from test_package import make_net
    from fxopt.backend import fxopt_backend

    graphs = []
    options = json.loads(sys.argv[2])
    model = make_net()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend=lambda gm, inp: fxopt_backend(gm, inp, options=options, _sink=graphs))
    with torch.no_grad():
        y = compiled(x)
    torch.save(y, sys.argv[1])
    print(json.dumps({"cache": graphs[0].executor_details["compile_cache"],
                      "measurements": graphs[0].measurements, "changed": [p.name for p in graphs[0].passes if p.changed]}))
""")


def run_compiler(tmp_path, options=None, name="y.pt"):
    script = tmp_path / "compiler.py"
    script.write_text(COMPILER)
    env = dict(os.environ, FXOPT_CACHE_DIR=str(tmp_path / "shared-cache"))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / name), json.dumps(options or {}),
                          os.path.dirname(__file__)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.load(tmp_path / name), json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def first_compile(tmp_path_factory):
    """The first process's compile into an empty cache (what both cache tests start from): its output,
    its report and the cache it left; each test runs its later processes on a copy of that cache."""
    tmp = tmp_path_factory.mktemp("first-compile")
    y, info = run_compiler(tmp, name="a.pt")
    return y, info, tmp / "shared-cache"


def _copy_cache(first_compile, tmp_path) -> None:
    import shutil

    shutil.copytree(first_compile[2], tmp_path / "shared-cache")


def test_compile_cache_hit_in_a_second_process(tmp_path, first_compile):
    first, info1, _ = first_compile
    assert info1["cache"].startswith("miss (stored")
    _copy_cache(first_compile, tmp_path)
    second, info2 = run_compiler(tmp_path, name="b.pt")
    assert info2["cache"].startswith("hit") and info2["measurements"] == 0
    assert info2["changed"] == info1["changed"]
    assert torch.equal(first, second)
    with torch.no_grad():
        assert rel(second, make_net()(torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)))) < RTOL
    _, off = run_compiler(tmp_path, options={"compile_cache": False}, name="c.pt")
    assert off["cache"] == "off"


def test_compile_cache_ignores_a_corrupt_entry(tmp_path, first_compile):
    _copy_cache(first_compile, tmp_path)
    entries = list((tmp_path / "shared-cache" / "graphs").rglob("*.json"))
    assert len(entries) == 1
    blob = bytearray(entries[0].read_bytes())
    blob[len(blob) // 2] ^= 0x01  # still JSON-ish, but not what was written
    entries[0].write_bytes(bytes(blob))
    y, info = run_compiler(tmp_path, name="b.pt")
    assert info["cache"].startswith("miss (stored")  # recompiled and rewritten
    _, again = run_compiler(tmp_path, name="c.pt")
    assert again["cache"].startswith("hit")
    with torch.no_grad():
        assert rel(y, make_net()(torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)))) < RTOL


# -- benchmark rows --------------------------------------------------------------------------------
def test_bench_fxopt_package_row_and_cold_start(tmp_path):
    import fxopt.bench as B
    from fxopt.bench.report import render_markdown

    a = B.parse_args(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    res = B._cold_compile("seedcnn", 2, "float32", "fxopt-package", a)
    assert res.get("cold_compile_s", -1) > 0 and res.get("warm_cache_compile_s", -1) > 0, res
    assert 0 < res.get("load_first_call_s", -1) < res["cold_compile_s"], res
    results = {"meta": {}, "cells": [{"model": "seedcnn", "batch": 2, "dtype": "float32", "backend": "fxopt",
                                      "status": "ok", "median_ms": 1.0, "cold_compile_s": 3.0},
                                     {"model": "seedcnn", "batch": 2, "dtype": "float32",
                                      "backend": "fxopt-package", "status": "ok", "median_ms": 0.9, **res}],
               "cold_floors": [{"model": "seedcnn", "batch": 2, "dtype": "float32", "backend": "floor-aot-eager",
                                "cold_compile_s": 2.5}]}
    text = render_markdown(results)
    assert "## Cold start" in text and "| seedcnn | 2 | float32 | fxopt | 3.00 | – | – | 0.50 |" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_package_loads_without_dynamo_and_matches_eager(tmp_path):
    """On the GPU: packaged at batch 2 (kernels measured, values stored), loaded in a fresh process
    that never imports Dynamo, right at the packaged batch and at others (meta-tensor values)."""
    model = make_net().cuda().half()
    x = torch.randn(2, 3, 16, 16, device="cuda", dtype=torch.float16)
    fxopt.package(model, (x,), tmp_path / "net.fxopt")
    assert fxopt.load(tmp_path / "net.fxopt").manifest["vals"] is not None
    inputs = [torch.randn(b, 3, 16, 16, device="cuda", dtype=torch.float16) for b in (2, 5, 1)]
    outs, info = run_loader(tmp_path, tmp_path / "net.fxopt", inputs)
    assert info["executor"] == "cuda" and info["dynamo"] == []
    with torch.no_grad():
        for x, y in zip(inputs, outs):
            assert rel(y.float(), model(x).float()) < 1e-2


@pytest.mark.skipif(why_no_openvino() is not None, reason="openvino not installed")
def test_cpu_package_specialises_each_batch_with_the_runners_ways(tmp_path):
    """The cpu executor gets a static graph per batch size, so its measured ways (OpenVINO here)
    apply at every size: the packaged sizes run their recorded decision, another size the way they
    chose, nothing measured at load; a package's weights are fixed, so none is watched per call."""
    model = make_net()
    fxopt.package(model, (torch.randn(2, 3, 16, 16),), tmp_path / "net.fxopt", options={"cpu_openvino": True})
    module = fxopt.load(tmp_path / "net.fxopt")
    with torch.no_grad():
        for b in (2, 1, 3):
            x = torch.randn(b, 3, 16, 16)
            assert rel(module(x), model(x)) < RTOL
    runs = {b: d["runner"][0] for b, d in module.decisions().items()}
    assert sorted(runs) == ["1", "2", "3"] and runs["2"]["cached"] and runs["1"]["cached"]
    assert runs["2"]["steady"] and runs["1"]["steady"]  # measured while packaging, in steady bursts
    assert runs["3"]["not_measured"] and runs["3"]["runs"] in (runs["1"]["runs"], runs["2"]["runs"])
    assert module.lowerings[2].details["onednn"]["convs"] == 2  # the stored (meta) values lower as real ones
    runner = module.lowerings[2].fn.openvino
    assert runner is not None and runner._params_changed.indices == []
    from fxopt.bench.runners import _package_ran  # the benchmark's "ran" of a package cell

    assert _package_ran(module).split(", ") == sorted({d["runs"] for d in runs.values()}) and not _package_ran(rel)


@pytest.mark.skipif(why_no_openvino() is not None, reason="openvino not installed")
def test_cpu_package_checks_the_way_it_did_not_measure(tmp_path, monkeypatch):
    """A batch size not packaged runs the packaged sizes' way only after its outputs matched the
    optimized graph's there: an OpenVINO way that is wrong at that size is left for the oneDNN graph."""
    import fxopt.backends.openvino as ovb
    import fxopt.choices as choices

    model = make_net()
    fxopt.package(model, (torch.randn(2, 3, 16, 16),), tmp_path / "net.fxopt", options={"cpu_openvino": True})
    module = fxopt.load(tmp_path / "net.fxopt")
    monkeypatch.setattr(choices, "default_entry", lambda key, held=None: {"runs": "openvino", "not_measured": True})
    call = ovb.OvRunner.__call__
    monkeypatch.setattr(ovb.OvRunner, "__call__", lambda self, *a: [t * 1.5 for t in call(self, *a)])
    x = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        assert rel(module(x), model(x)) < RTOL
    (d,) = module.decisions()["5"]["runner"]
    assert d["runs"] == "optimized graph" and "relative error" in d["failed"]["openvino"], d


def test_inputs_of_a_kind_seen_go_straight_to_the_way_chosen(tmp_path, monkeypatch):
    """After the first call with inputs of one kind (shapes, strides, dtype, device), later calls
    with such inputs run the way the cpu runner chose for them without its dispatch or the checks;
    inputs of another kind (new strides, another batch) go through both, and bad inputs still get
    the checks' errors. Eager's values throughout."""
    from fxopt.backends import cpu

    model = make_net()
    fxopt.package(model, (torch.randn(2, 3, 16, 16),), tmp_path / "net.fxopt")
    module = fxopt.load(tmp_path / "net.fxopt")
    dispatched = []
    call = cpu.CpuRunner.__call__
    monkeypatch.setattr(cpu.CpuRunner, "__call__", lambda self, *a: dispatched.append(1) or call(self, *a))
    with torch.no_grad():
        x = torch.randn(2, 3, 16, 16)
        assert rel(module(x), model(x)) < RTOL and len(dispatched) == 1 and len(module._direct) == 1
        for _ in range(3):
            x = torch.randn(2, 3, 16, 16)
            assert rel(module(x), model(x)) < RTOL
        assert len(dispatched) == 1
        xc = torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)
        x3 = torch.randn(3, 3, 16, 16)
        for x in (xc, x3, xc, x3):
            assert rel(module(x), model(x)) < RTOL
        assert len(dispatched) == 3 and len(module._direct) == 3
    with pytest.raises(ValueError, match="float32"):
        module(torch.randn(2, 3, 16, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="1 input"):
        module(torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16))
    x = torch.randn(2, 3, 16, 16, requires_grad=True)  # grad mode on: the way runs without autograd
    out = module(x)
    assert not out.requires_grad and rel(out, model(x).detach()) < RTOL
