"""Dynamic shapes in a serving loop: the batch-independence check, padded runs of a new batch size on
a lowered larger one (eager's values, shapes and strides), choices measured once per bucket, the
LRU bound, the Dynamo graph count of a batch loop, and the serving benchmark on the CPU."""
import json
import random

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from fxopt.dynamic import summary_lines
from fxopt.dynamic_buckets import bucket, signature
from fxopt.testing.models import BasicBlock, SmallResNet
from test_dynamic import Counting



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


class FlattenHead(nn.Module):
    """Per sample: a conv, then flatten(1) (its graph reads the sizes of the other dimensions) and a
    linear layer."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1, stride=4), nn.Linear(64, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class ScaledByNumel(nn.Module):
    """Every value divided by the tensor's element count, which grows with the batch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y / y.numel()


class Spatial(nn.Module):
    """A per-sample CNN whose outputs keep their spatial dimensions (one a permuted view of a value
    no other output shares: outputs sharing memory decline padding)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return y, y.permute(0, 2, 3, 1).sum(-1), (y * 2.0).permute(0, 2, 3, 1)


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


class OutputAndItsView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return y, y[:, :2]


def test_batch_independence_accepts_sizes_of_other_dimensions():
    """flatten(1) reads the other dimensions' sizes: the same at every batch, so padded runs stay legal."""
    torch.manual_seed(0)
    info = _info(FlattenHead().eval(), [2, 3, 5, 3])
    assert info.get("padding") and "padding_declined" not in info, info.get("padding_declined")
    assert info["padded_calls"] + info["chunked_calls"] > 0


@pytest.mark.parametrize("model,why", [
    (ScaledByNumel(), "batch size"),
    (OutputAndItsView(), "share memory"),
    (MeanOverBatch(), "dimension 0"),
    (FlattenBatch(), "batch"),
    (SmallResNet().train(), "training-mode BatchNorm"),
])
def test_batch_independence_declines(model, why):
    torch.manual_seed(0)
    info = _info(model, [2, 3, 5])
    assert "padding" not in info or info.get("padding_declined")
    assert why in info["padding_declined"], info["padding_declined"]
    # declined: every size lowered at its first call, as before (no padded or chunked runs)
    assert all(rec["lowered"] >= 1 for rec in info["specializations"].values())
    assert info["padded_calls"] == 0 and info["chunked_calls"] == 0


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
    info = backend.dynamic()  # 3, 2, 3 padded onto 4; 7, 5, 6 chunked (nothing lowered holds them)
    assert info["padded_calls"] == 3 and info["chunked_calls"] == 3


def test_specialized_after_k_calls_and_choices_reused():
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting(specialize_after=2)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _run(compiled, model, [2, 5, 5, 5, 5, 6, 6, 6, 4], side=32)
    info = backend.dynamic()
    recs = {int(k.split(",")[0].split("=")[1]): v for k, v in info["specializations"].items()}
    assert 8 not in recs  # no bucket top lowered: a batch larger than every lowered one runs in chunks
    assert recs[5]["chunked_calls"] == 2 and recs[5]["lowered"] == 1 and recs[5]["runs"] == "specialized"
    assert recs[6]["chunked_calls"] == 2 and recs[6]["lowered"] == 1
    assert recs[4]["padded_calls"] == 1 and recs[4]["lowered"] == 0 and recs[4]["padded_from"] == [5]
    # the second lowering in bucket 8 (batch 6) measured nothing: its choices came from batch 5's
    assert recs[5]["choices_from"] == "measured here (first of its bucket)"
    assert recs[5]["choices"]["measured"] + recs[5]["choices"]["cached"] >= 1
    assert recs[6]["choices"]["measured"] == 0 and recs[6]["choices_from"] == "its bucket's first lowering"
    assert recs[6]["choices"]["reused"] >= 1


def test_bucket_choices_without_padding():
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting(dynamic_padding=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _run(compiled, model, [5, 6, 7], side=32)
    recs = list(backend.dynamic()["specializations"].values())
    assert [r["choices"]["measured"] for r in recs[1:]] == [0, 0]
    assert all(r["choices"]["reused"] >= 1 for r in recs[1:])


def test_image_sizes_of_a_bucket_share_its_choices():
    """Every symbolic size is bucketed: sides 20, 28 and 32 share bucket 32, so only the first
    lowering there measures; side 40 (bucket 64) measures again. Every call gives eager's results."""
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting(dynamic_padding=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for b, side in [(5, 32), (6, 28), (7, 20), (5, 40)]:
            x = torch.randn(b, 3, side, side)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    infos = [r.executor_details["dynamic"] for r in backend.reports if r.executor_details.get("dynamic")]
    recs = {k: v for i in infos for k, v in i["specializations"].items()}
    by_side = {}
    for k, v in recs.items():
        vals = dict(p.split("=") for p in k.split(", "))
        by_side[max(int(x) for x in list(vals.values())[1:])] = v
    assert set(by_side) >= {28, 20, 40}, recs
    for side in (28, 20):
        assert by_side[side]["choices"]["measured"] == 0 and by_side[side]["choices"]["reused"] >= 1, by_side[side]
        assert by_side[side]["choices_from"] == "its bucket's first lowering"
    assert by_side[40]["choices_from"] == "measured here (first of its bucket)"


def test_lru_bound_with_padding():
    torch.manual_seed(0)
    model, backend = BasicBlock(8, 8).eval(), Counting(executor="torch", max_specializations=2, specialize_after=1)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _run(compiled, model, [2, 3, 3, 5, 5, 6, 6, 9, 9, 3, 3, 2], channels=8)
    info = backend.dynamic()
    assert info["live"] <= 2 and info["evictions"] >= 1 and info["chunked_calls"] >= 1
    assert sum(r.get("live") is True for r in info["specializations"].values()) <= 2


def test_a_buckets_first_lowering_takes_the_choices_held_for_another_of_its_batches():
    """The user's cache holds choices measured at batch 50 (the static graph Dynamo compiled for the
    first size, or an earlier process): the first lowering of bucket 64 at batch 41 takes them
    rather than measuring; a key at batch 20 (bucket 32), or differing in another number, is not
    taken; the bucket's later lowerings replay what it took."""
    from fxopt.autotune import AutotuneCache
    from fxopt.dynamic_buckets import BucketChoices, sibling_batch

    key = "node|graphed=True|fused_conv|['(41, 64, 56, 56)|channels_last|torch.float16']|{}"
    at = lambda b, h="0123456789abcdef": key.replace("(41,", f"({b},").format(h)  # noqa: E731
    assert sibling_batch(at(41), at(50, "fedcba9876543210"), 41) == 50
    assert sibling_batch(at(41), at(20), 41) is None  # another bucket
    assert sibling_batch(at(41), at(50).replace("64, 56", "32, 56"), 41) is None  # another conv
    user = AutotuneCache(None)
    user.put("cuda", at(44), {"choice": "generated_t1"})
    user.put("cuda", at(33), {"choice": "cudnn"})
    user.put("cuda", at(20), {"choice": "winograd"})
    first = BucketChoices(user, batch=41)
    assert first.get("cuda", at(41))["choice"] == "generated_t1"  # 44 is nearer than 33
    assert first.counts["from_sibling"] == 1 and user.get("cuda", at(41)) is None  # the user's cache as it was
    assert first.replayer().get("cuda", at(45))["choice"] == "generated_t1"
    assert BucketChoices(user, batch=12).get("cuda", at(12)) is None  # bucket 16 holds nothing
    assert BucketChoices(user).get("cuda", at(41)) is None  # no batch: nothing looked for


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_static_graphs_choices_seed_the_symbolic_graphs_bucket(tmp_path):
    """Dynamo compiles batch 5 as a static graph, then a symbolic one at batch 6: bucket 8's first
    lowering takes the static graph's per-node choices from the user's cache (the CPU's runner keys
    name the symbolic graph's size arguments, so this is the cuda executor's)."""
    torch.manual_seed(0)
    model = SmallResNet().cuda().eval()
    backend = Counting(dynamic_padding=False, autotune_cache=str(tmp_path / "a.json"))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for b in (5, 6, 7):
            x = torch.randn(b, 3, 32, 32, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-3, atol=1e-3)
    first = [v for v in backend.dynamic()["specializations"].values()
             if v["choices_from"] == "measured here (first of its bucket)"]
    assert first and first[0]["choices"]["from_sibling"] >= 1, first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sizes_specialised_from_stored_values_measure_and_run_on_the_gpu(tmp_path):
    """After the symbolic graph's first size, every size's values come from the stored expressions as
    FakeTensors on the GPU: a bucket's first lowering measures its candidates on them (batch 12: bucket
    16), a later one reuses them (batch 3: bucket 4 measured; 7: bucket 8's), all equal to eager."""
    torch.manual_seed(0)
    model = SmallResNet().cuda().eval().half()
    backend = Counting(dynamic_padding=False, autotune_cache=str(tmp_path / "a.json"))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for b in (6, 12, 3, 7):
            x = torch.randn(b, 3, 32, 32, device="cuda").half().contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(compiled(x), model(x), rtol=2e-2, atol=2e-2)
    info = backend.dynamic()
    assert all(how.startswith("stored values") for how in info["specialised_by"].values()), info["specialised_by"]
    measured = [v for v in info["specializations"].values()
                if v.get("choices_from") == "measured here (first of its bucket)"]
    assert len(measured) >= 2, info["specializations"]


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
    lazy = r["fxopt_size_lowerings_s"]  # what the sizes' lowerings cost, Dynamo's compiles apart
    assert lazy["count"] >= 1 and 0 < lazy["median"] <= lazy["max"] <= lazy["total"]
    first = r["fxopt_size_first_calls_s"]  # the same with each one's first call (warm-ups, capture, decisions)
    assert first["count"] == lazy["count"] and first["total"] >= lazy["total"] and first["max"] >= lazy["max"]
    # the static twin compiled beside the serving model served its own calls, timed alternately with it
    vs = r["latency_vs_static"]["2x32"]
    assert vs["static_ms"] > 0 and vs["dynamic_ms"] > 0 and "static_skipped" not in vs
    # the worst first call that compiled no Dynamo graph, the p99 of every call, how a size is served
    assert 0 <= p["first_call_new_size_s_max_no_dynamo_compile"] <= p["first_call_new_size_s_max"]
    assert 0 < p["call_ms_p99"] <= p["first_call_new_size_s_max"] * 1e3
    assert r["latency_vs_static"]["2x32"]["served_as"]
    md = (tmp_path / "serving.md").read_text()
    assert "| seedcnn2 | fxopt | batch |" in md and "served as" in md


def test_serving_bench_runs_each_backend_in_a_process_of_its_own(tmp_path):
    import os

    from fxopt.bench import serving

    rc = serving.main(["--models", "seedcnn,seedcnn2", "--device", "cpu", "--calls", "4", "--max-batch", "3",
                       "--phases", "batch", "--sample", "2", "--iters", "1", "--backends", "fxopt",
                       "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "serving.json").read_text())["results"]
    assert [r["model"] for r in results] == ["seedcnn", "seedcnn2"] and all(r["batch"]["calls"] == 4 for r in results)
    pids = {r["process"] for r in results}
    assert len(pids) == 2 and os.getpid() not in pids


def test_serving_bench_image_phase_cpu():
    from fxopt.bench import serving

    torch.manual_seed(0)
    model = SmallResNet().eval()
    plans = {"image": serving.plan(10, 4, [24, 32], seed=1)}
    import time

    r = serving.run_backend("fxopt", model, (3, 32, 32), torch.device("cpu"), torch.float32, plans, [(2, 24)], 2,
                            {"executor": "torch"}, time.perf_counter() + 120)
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


class StridedSpatial(nn.Module):
    """Per sample, three outputs (one a permuted view of a value no other output shares); strided and
    dilated convolutions only, so
    that PyTorch's CPU convolution backend choice reads no batch size (no ``s0 <= 15`` guard: one
    Dynamo graph for batches 2-64)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, stride=2)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=2, dilation=2)

    def forward(self, x):
        y = torch.relu(self.conv2(torch.relu(self.conv(x))))
        return y, y.permute(0, 2, 3, 1).sum(-1), (y * 2.0).permute(0, 2, 3, 1)


def _lowerings(info) -> int:
    return sum(r["lowered"] for r in info["specializations"].values())


@pytest.mark.parametrize("executor", ["torch", "cpu"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_larger_batches_run_in_chunks_equal_eager(executor, channels_last):
    """A batch larger than every lowered one runs as chunks of lowered sizes at its first calls
    (nothing lowered in them), its own specialization lowered at its ``specialize_after + 1``-th
    call; every call gives eager's values, shapes and strides (a channels_last model's outputs too)."""
    torch.manual_seed(0)
    model = StridedSpatial().eval()
    if channels_last:  # channels_last weights: eager's outputs are channels_last
        model = model.to(memory_format=torch.channels_last)
    backend = Counting(executor=executor)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    first, lowerings = set(), {}
    with torch.no_grad():
        for b in [2, 3, 40, 17, 64, 5, 40, 40, 64, 64, 33]:
            x = torch.randn(b, 3, 16, 16)
            before = _lowerings(backend.dynamic()) if backend.reports else 0
            got, want = compiled(x), model(x)
            lowerings.setdefault(b, []).append(_lowerings(backend.dynamic()) - before)
            assert want[0].is_contiguous(memory_format=torch.channels_last if channels_last
                                         else torch.contiguous_format)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
                assert g.shape == w.shape and g.stride() == w.stride(), (b, g.stride(), w.stride())
            first.add(b)
    assert backend.compiles == 1
    info = backend.dynamic()
    recs = {int(k.split("=")[1].split(",")[0]): v for k, v in info["specializations"].items()}
    # first calls of 40, 64 and 33 lowered nothing; 40 and 64 lowered at their third call
    assert lowerings[40] == [0, 0, 1] and lowerings[64] == [0, 0, 1] and lowerings[33] == [0]
    assert recs[40]["chunked_calls"] == 2 and recs[64]["chunked_calls"] == 2
    assert recs[40]["chunked_as"] == "20 runs of sizes " + ", ".join(["2"] * 20)
    assert recs[64]["chunked_as"] == "2 runs of sizes 40, 24 (padded to 40)"
    assert recs[17]["runs"] == "chunked into 9 runs of sizes 2, 2, 2, 2, 2, 2, 2, 2, 1 (padded to 2)"
    assert recs[33]["runs"] == "padded to batch 40" and recs[33]["lowered"] == 0
    assert 4 not in recs and 64 in recs  # no bucket top lowered for 3
    lines = "\n".join(summary_lines(info))
    assert "chunked into 9 runs of sizes" in lines and "calls chunked" in lines


class _Shapes:
    """The batch of argument 0 as the only size (what ``PrivateShapes`` gives the dispatcher)."""
    where = {"s0": (0, 0)}

    def key(self, args):
        return (int(args[0].shape[0]),)

    def describe(self, key):
        return f"s0={key[0]}"


def _dispatcher(runner, **kw):
    from types import SimpleNamespace

    from fxopt.batch_independence import BatchPlan
    from fxopt.dynamic import SizeDispatcher
    from fxopt.dynamic_buckets import Padding

    lowered = []

    def lower_at(args, key, choices):
        lowered.append(key[0])
        return SimpleNamespace(fn=runner(key[0]), executor="fake"), None

    d = SizeDispatcher(_Shapes(), lower_at, kw.pop("max_specializations", 16), {},
                       padding=Padding(BatchPlan("s0", {0: "dim0"}, [True, True])), batch_pos=0, **kw)
    return d, lowered


def _reference(x):
    y = (x * 2 + 1).contiguous(memory_format=torch.channels_last)
    return y, y.permute(0, 2, 3, 1)


def test_chunks_copied_out_of_a_runner_that_reuses_its_outputs():
    """A runner that hands out the same output tensors at every call (as a CUDA-graph replay does),
    the second a view of the first: every chunk's rows are copied out before the next chunk runs."""

    def runner(n):
        out = torch.empty(n, 3, 2, 2).to(memory_format=torch.channels_last)

        def fn(x):
            out.copy_(x * 2 + 1)
            return out, out.permute(0, 2, 3, 1)
        return fn

    d, lowered = _dispatcher(runner, specialize_after=2)
    torch.manual_seed(0)
    for b in [2, 7, 3, 7, 4, 7, 5]:
        x = torch.randn(b, 3, 2, 2)
        got, want = d(x), _reference(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
            assert g.stride() == w.stride()
    # 7: chunked twice (2+2+2+1), lowered at its third call; 3 and 4 chunked on 2, then 5 padded on 7
    assert lowered == [2, 7]
    recs = d.info["specializations"]
    assert recs["s0=7"]["chunked_calls"] == 2 and recs["s0=7"]["runs"] == "specialized"
    assert recs["s0=4"]["runs"] == "chunked into 2 runs of sizes 2, 2"
    assert recs["s0=3"]["chunked_calls"] == 1 and recs["s0=5"]["padded_calls"] == 1


def test_chunks_declined_where_the_batch_is_not_outermost():
    """An output whose batch is not its outermost dimension in memory: the chunks are declined, the
    bucket's top size lowered as without chunks, the result still right."""

    def runner(n):
        def fn(x):
            y = torch.empty(3, 2, 2, n).permute(3, 0, 1, 2)
            y.copy_(x * 2 + 1)
            return y, y.clone()
        return fn

    d, lowered = _dispatcher(runner)
    for b in [2, 6, 5]:
        x = torch.randn(b, 3, 2, 2)
        got = d(x)
        torch.testing.assert_close(got[0], x * 2 + 1)
        torch.testing.assert_close(got[1], x * 2 + 1)
    assert lowered == [2, 8] and "outermost" in d.chunking_declined
    assert d.info["chunked_calls"] == 0 and d.info["padded_calls"] == 2


def _image_loop(compiled, model, calls):
    with torch.no_grad():
        for b, side in calls:
            x = torch.randn(b, 8, side, side)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


def test_image_sizes_each_lowered_once_no_thrash():
    """Batches and image sizes drawn at random, more sizes than the bound holds: an image size's
    first call lowers one size (the bucket top of the largest batch called so far) that every later
    batch there runs on, padded; that size is not dropped for a size that only some calls use, and a
    padded size replaces a lowered one only if called ``ADMIT_FACTOR`` times as often. Before, each
    image size lowered its own top per bucket and the bound kept dropping them: the lowered sizes
    displaced each other on nearly every call. Every call gives eager's results."""
    torch.manual_seed(0)
    model = BasicBlock(8, 8).eval()
    backend = Counting(executor="torch", max_specializations=4, specialize_after=1)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    rnd = random.Random(1)
    calls = [(2, 8), (3, 8)] + [(rnd.randint(2, 12), rnd.choice([6, 8, 10])) for _ in range(70)]
    _image_loop(compiled, model, calls)
    # PyTorch's CPU convolution reads the batch (``s0 < 16``): Dynamo may compile a second graph
    infos = [r.executor_details["dynamic"] for r in backend.reports if r.executor_details.get("dynamic")]
    assert infos and all(i["live"] <= 4 for i in infos)
    evictions, lowered = sum(i["evictions"] for i in infos), sum(_lowerings(i) for i in infos)
    assert evictions <= 6 and lowered <= 14, (evictions, lowered)
    # at most one size lowered per image size for lack of any other there, and none lowered again
    tops = [k.split(", ", 1)[1] for i in infos for k, r in i["specializations"].items()
            if r.get("runs") == "bucket top"]
    assert len(tops) == len(set(tops)), tops
    assert all(r["lowered"] == 1 for i in infos for r in i["specializations"].values() if r.get("runs") == "bucket top")
