"""Dynamic shapes in a serving loop: the batch-independence check, padded runs of a new batch size on
a lowered larger one (eager's values, shapes and strides), choices measured once per bucket, the
LRU bound, the Dynamo graph count of a batch loop, and the serving benchmark on the CPU."""
import json
import random

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from fxopt.backend import fxopt_backend
from fxopt.dynamic_buckets import bucket, signature
from fxopt.testing.models import BasicBlock, SmallResNet


class Counting:
    def __init__(self, **options):
        self.options, self.reports = options, []
        counters.clear()

    @property
    def compiles(self) -> int:
        return counters["stats"]["unique_graphs"]

    def __call__(self, gm, inputs):
        return fxopt_backend(gm, inputs, options=self.options, _sink=self.reports)

    def dynamic(self) -> dict:
        infos = [r.executor_details.get("dynamic") for r in self.reports]
        infos = [i for i in infos if i and "fallback" not in i]
        assert len(infos) == 1, infos
        return infos[0]


def _run(compiled, model, sizes, side=16, channels=3, channels_last=False):
    with torch.no_grad():
        for b in sizes:
            x = torch.randn(b, channels, side, side)
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            got, want = compiled(x), model(x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert got.shape == want.shape and got.stride() == want.stride(), (b, got.stride(), want.stride())


class MeanOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y - y.mean(0, keepdim=True)


class FlattenBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x).reshape(-1)


class Spatial(nn.Module):
    """A per-sample CNN whose outputs keep their spatial dimensions (one a permuted view)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return y, y.permute(0, 2, 3, 1).sum(-1), y.permute(0, 2, 3, 1)


def _info(model, sizes, **options):
    backend = Counting(executor="torch", **options)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for b in sizes:
            x = torch.randn(b, 3, 16, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    return backend.dynamic()


def test_batch_independence_accepts_a_per_sample_cnn():
    torch.manual_seed(0)
    info = _info(SmallResNet().eval(), [2, 3])
    assert info.get("padding") and "padding_declined" not in info


@pytest.mark.parametrize("model,why", [
    (MeanOverBatch(), "dimension 0"),
    (FlattenBatch(), "batch"),
    (SmallResNet().train(), "training-mode BatchNorm"),
])
def test_batch_independence_declines(model, why):
    torch.manual_seed(0)
    info = _info(model, [2, 3, 5])
    assert "padding" not in info or info.get("padding_declined")
    assert why in info["padding_declined"], info["padding_declined"]
    # declined: every size lowered at its first call, as before
    assert all(rec["lowered"] >= 1 for rec in info["specializations"].values())


@pytest.mark.parametrize("channels_last", [False, True])
def test_padded_runs_equal_eager(channels_last):
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting()  # the cpu executor
    compiled = torch.compile(model, backend=backend, dynamic=True)
    sizes = [2] + random.Random(0).choices(range(1, 13), k=30)
    _run(compiled, model, sizes, side=32, channels_last=channels_last)
    assert backend.compiles == (2 if 1 in sizes[1:] else 1)  # batch 1: Dynamo's 0/1 specialization
    info = backend.dynamic()
    if channels_last:  # Dynamo restrides a channels_last input (as_strided): no padded runs, said why
        assert "as_strided" in info["padding_declined"] and info["padded_calls"] == 0
        return
    assert info["padded_calls"] > 0
    padded = [r for r in info["specializations"].values() if r.get("padded_calls")]
    assert padded and all(r["padded_from"] for r in padded)


def test_padded_outputs_keep_eager_strides():
    torch.manual_seed(0)
    model, backend = Spatial().eval(), Counting(executor="torch", specialize_after=100)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for b in [4, 3, 2, 3, 7, 5, 6]:
            x = torch.randn(b, 3, 8, 8)
            got, want = compiled(x), model(x)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)
                assert g.shape == w.shape and g.stride() == w.stride()
    assert backend.dynamic()["padded_calls"] >= 4


def test_specialized_after_k_calls_and_choices_reused():
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting(specialize_after=2)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _run(compiled, model, [2, 5, 5, 5, 5, 6], side=32)
    info = backend.dynamic()
    recs = {int(k.split(",")[0].split("=")[1]): v for k, v in info["specializations"].items()}
    assert recs[8]["runs"] == "bucket top" and recs[8]["lowered"] == 1
    assert recs[5]["padded_calls"] == 2 and recs[5]["lowered"] == 1 and recs[5]["runs"] == "specialized"
    assert recs[6]["padded_calls"] == 1 and recs[6]["lowered"] == 0
    # the second lowering in bucket 8 (batch 5) measured nothing: its choices came from batch 8's
    assert recs[5]["choices"]["measured"] == 0 and recs[5]["choices_from"] == "its bucket's first lowering"
    assert recs[8]["choices"]["measured"] + recs[8]["choices"]["cached"] >= 1
    assert recs[5]["choices"]["reused"] >= 1


def test_bucket_choices_without_padding():
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting(dynamic_padding=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _run(compiled, model, [5, 6, 7], side=32)
    recs = list(backend.dynamic()["specializations"].values())
    assert [r["choices"]["measured"] for r in recs[1:]] == [0, 0]
    assert all(r["choices"]["reused"] >= 1 for r in recs[1:])


def test_lru_bound_with_padding():
    torch.manual_seed(0)
    model, backend = BasicBlock(8, 8).eval(), Counting(executor="torch", max_specializations=2, specialize_after=1)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _run(compiled, model, [2, 3, 3, 5, 5, 6, 6, 9, 9, 3, 3, 2], channels=8)
    info = backend.dynamic()
    assert info["live"] <= 2 and info["evictions"] >= 3
    assert sum(r.get("live") is True for r in info["specializations"].values()) <= 2


def test_bucket_and_signature():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 64, 64]
    a = "node|graphed=True|fused_conv|['(5, 64, 56, 56)|channels_last|torch.float16']|['a', 'b']"
    assert signature(a) == signature(a.replace("(5,", "(8,"))
    assert signature("region|graphed=True|0123456789abcdef01234567|['x']") == \
        signature("region|graphed=True|fedcba9876543210fedcba98|['x']")


@pytest.mark.parametrize("first,oblivious,graphs", [(1, False, 2), (4, False, 3), (4, True, 2)])
def test_dynamo_graphs_of_a_batch_loop(first, oblivious, graphs):
    """Automatic dynamic: the first size static, then one symbolic graph for batches >= 2; batch 1
    after that is Dynamo's own third graph (its 0/1 specialization), the same with backend="eager";
    under backed_size_oblivious batch 1 shares the symbolic graph."""
    import contextlib

    torch.manual_seed(0)
    model = BasicBlock(8, 8).eval()
    ctx = torch.fx.experimental._config.patch(backed_size_oblivious=True) if oblivious else contextlib.nullcontext()
    counts = {}
    for name in ("fxopt", "eager"):
        torch._dynamo.reset()
        backend = Counting(executor="torch") if name == "fxopt" else "eager"
        counters.clear()
        compiled = torch.compile(model, backend=backend)
        with ctx:
            _run(compiled, model, [first, 2, 3, 1, 6, 5, 1, 7], channels=8)
        counts[name] = counters["stats"]["unique_graphs"]
    assert counts == {"fxopt": graphs, "eager": graphs}


def test_serving_bench_cpu(tmp_path):
    from fxopt.bench import serving

    rc = serving.main(["--models", "seedcnn2", "--device", "cpu", "--calls", "12", "--max-batch", "6",
                       "--phases", "batch", "--sample", "2", "--iters", "2", "--backends", "fxopt",
                       "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "serving.json").read_text())
    r = data["results"][0]
    p = r["batch"]
    assert p["calls"] == 12 and p["dynamo_graphs"] >= 1 and p["first_call_new_size_s_max"] is not None
    assert p["calls_not_served_by_fxopt"] == 0 and r["eager_calls"] is False
    assert r["latency_vs_static"]["2x32"]["static_ms"] > 0
    assert "| seedcnn2 | fxopt | batch |" in (tmp_path / "serving.md").read_text()


def test_serving_bench_image_phase_cpu():
    from fxopt.bench import serving

    torch.manual_seed(0)
    model = SmallResNet().eval()
    plans = {"image": serving.plan(10, 4, [24, 32], seed=1)}
    import time

    r = serving.run_backend("fxopt", model, (3, 32, 32), torch.device("cpu"), torch.float32, plans, [(2, 24)], 2,
                            {"executor": "torch"}, time.perf_counter() + 120, {})
    assert r["image"]["calls"] == 10 and r["eager_calls"] is False
    assert r["latency_vs_static"]["2x24"]["ratio"] > 0


def test_a_full_bound_admits_only_sizes_called_more_often_no_thrash():
    """With the bound reached, sizes drawn at random stay padded unless called more often than the
    least called lowered size: a random loop over more sizes than the bound lowers each size about
    once, not again and again; every call gives eager's results."""
    torch.manual_seed(0)
    model = BasicBlock(8, 8).eval()
    backend = Counting(executor="torch", max_specializations=3, specialize_after=1)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    rnd = random.Random(0)
    sizes = [2, 3] + [rnd.choice([2, 3, 5, 6, 7, 9, 10, 12]) for _ in range(60)]
    _run(compiled, model, sizes, side=8, channels=8)
    info = backend.dynamic()
    lowered = sum(r["lowered"] for r in info["specializations"].values())
    assert info["live"] <= 3
    assert info["admissions_declined"] > 0 and info["padded_calls"] > 0
    # 8 sizes and the bucket tops 4 and 16, each lowered about once (the least-recently-used rule
    # without admission lowered 23 times, 20 evictions, in this loop)
    assert lowered <= 14 and info["evictions"] <= 11, (lowered, info["evictions"])
