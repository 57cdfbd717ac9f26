"""A new batch bucket's first lowering takes the choices its neighbouring buckets agree on
(``fxopt.dynamic_buckets``: ``verdict``, ``BucketChoices._neighbour``), and the CUDA-graph runner
states how clearly its decision won (``cudagraph_measure.clear_by``)."""
import gc
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxopt.autotune import AutotuneCache
from fxopt.backends.cuda.runtime.cudagraph_measure import NO_PDL, clear_by
from fxopt.dynamic_buckets import NEIGHBOUR_MARGIN, BucketChoices, verdict
from fxopt.testing.models import SmallResNet
from test_dynamic import Counting

CONV = "node|graphed=True|fused_conv|['({b}, 64, 56, 56)|nhwc|torch.float16']|['cudnn', 'generated', 'reference']"
POOL = "node|graphed=True|max_pool|['({b}, 64, 112, 112)|nhwc|torch.float16']|['generated', 'reference']"


def node(choice: str, **ms) -> dict:
    return {"choice": choice, "ms": ms, "errors": {k: 0.0 for k in ms}}


def measured(batch: int, answers: list, neighbours=()) -> BucketChoices:
    """A bucket's first lowering at ``batch`` that measured ``answers`` ([(key template, entry)])."""
    bc = BucketChoices(AutotuneCache(None), batch=batch, neighbours=neighbours)
    for key, entry in answers:
        k = key.format(b=batch)
        assert bc.get("cuda", k) is None
        bc.put("cuda", k, entry)
    return bc


def test_verdict_of_each_stored_format():
    assert verdict(node("cudnn", cudnn=1.0, generated=1.5, reference=3.0)) == ("cudnn", 1.5)
    assert verdict(node("reference", reference=2.0)) == ("reference", math.inf)  # the others failed
    assert verdict(node("reference", generated=1.0)) == ("reference", 1.0)  # chosen, not timed: not clear
    conv = {"algorithm": "direct", "candidates": {"direct": 1.0, "gemm": 0.95, "fft": None}}
    assert verdict(conv) == ("direct", 0.95)  # kept within WIN_MARGIN: not clear
    assert verdict({"runs": "optimized graph", "timings": {}, "clear_by": 2.5}) == ("optimized graph", 2.5)
    assert verdict({"runs": "generated C", "generated_c_ms": 1.0}) is None  # the cpu runner's: measured
    assert verdict({"something": 1}) is None and verdict(None) is None


def test_runner_clear_by_counts_the_margin_an_alternative_must_win_by():
    t = {"graph_ms": 0.227, "plain_ms": 1.45, "baseline_graph_ms": 0.598, "graph_no_pdl_ms": 0.2405}
    assert clear_by(t, "optimized graph", 0.05) == pytest.approx(0.2405 / 0.95 / 0.227, rel=1e-3)
    assert clear_by(dict(t, graph_no_pdl_ms=0.2008), "optimized graph", 0.05) < NEIGHBOUR_MARGIN  # a tie
    assert clear_by(t, "baseline graph", 0.05) == pytest.approx(0.227 / 0.598, rel=1e-3)
    assert clear_by({"graph_ms": 0.2}, "optimized graph", 0.05) == math.inf  # nothing else timed
    assert clear_by({}, NO_PDL, 0.05) is None


def test_sandwiched_bucket_takes_what_both_neighbours_chose():
    """Buckets 2 and 8 measured; bucket 4's first lowering takes their common choices (the nearer
    one's entry), measures where they differ, and writes nothing it took to the user's cache."""
    low = measured(2, [(CONV, node("cudnn", cudnn=1.0, generated=1.02)), (POOL, node("generated", generated=1.0,
                                                                                        reference=1.05))])
    high = measured(8, [(CONV, node("cudnn", cudnn=2.0, generated=2.01)), (POOL, node("reference", generated=1.06,
                                                                                         reference=1.0))])
    user = AutotuneCache(None)
    mid = BucketChoices(user, batch=3, neighbours=[(2, low), (8, high)])
    got = mid.get("cuda", CONV.format(b=3))
    assert got["choice"] == "cudnn" and got["ms"]["cudnn"] in (1.0, 2.0)
    assert mid.get("cuda", POOL.format(b=3)) is None  # they disagree, and neither won by the margin
    assert mid.counts["from_neighbours"] == 1 and user.get("cuda", CONV.format(b=3)) is None
    mid.put("cuda", POOL.format(b=3), node("generated", generated=1.0, reference=1.2))
    later = mid.replayer()  # the bucket's later sizes replay what its first lowering had
    assert later.get("cuda", CONV.format(b=4))["choice"] == "cudnn"
    assert later.get("cuda", POOL.format(b=4))["choice"] == "generated"


@pytest.mark.parametrize("other, margin, taken", [
    (8, 1.5, True),    # adjacent and clear
    (8, 1.05, False),  # adjacent, a near tie: measured
    (16, 3.0, False),  # two buckets away: measured however clear
    (2, 1.5, True),    # adjacent below
])
def test_one_sided_neighbour_only_adjacent_and_clear(other, margin, taken):
    near = measured(other, [(CONV, node("generated", generated=1.0, cudnn=margin))])
    bc = BucketChoices(AutotuneCache(None), batch=4, neighbours=[(other, near)])
    got = bc.get("cuda", CONV.format(b=4))
    assert (got is not None and got["choice"] == "generated") == taken


def test_taken_choices_are_not_handed_on_and_requests_must_align():
    """A choice bucket 4 took from bucket 8 is no evidence for bucket 2; a bucket whose lowering asked
    for other choices before this one (another graph structure at that size) is no neighbour."""
    eight = measured(8, [(CONV, node("generated", generated=1.0, cudnn=2.0))])
    four = BucketChoices(AutotuneCache(None), batch=4, neighbours=[(8, eight)])
    assert four.get("cuda", CONV.format(b=4))["choice"] == "generated"
    two = BucketChoices(AutotuneCache(None), batch=2, neighbours=[(4, four), (8, eight)])
    assert two.get("cuda", CONV.format(b=2)) is None
    other_order = measured(8, [(POOL, node("generated", generated=1.0, reference=5.0)),
                               (CONV, node("generated", generated=1.0, cudnn=2.0))])
    bc = BucketChoices(AutotuneCache(None), batch=4, neighbours=[(8, other_order)])
    assert bc.get("cuda", CONV.format(b=4)) is None
    assert BucketChoices(AutotuneCache(None), neighbours=[(8, eight)]).get("cuda", CONV.format(b=4)) is None


RUNNER = "cudagraph_runner|{h}|baseline=True|[((({b}, 3, 224, 224), (150528, 1, 672, 3), 'torch.float16')]"


def runner(runs: str, clear: float) -> dict:
    return {"runs": runs, "timings": {"graph_ms": 0.27, "baseline_graph_ms": 0.27 * clear}, "clear_by": clear}


def test_a_runner_decision_needs_no_alignment_of_the_choices_before_it():
    """The CUDA-graph runner's decision is one per graph and input signature: taken where both
    neighbours agree even when the choices asked before it differ (a pool asked under another key);
    a node's choice after such a difference is not."""
    four = measured(4, [(POOL, node("generated", generated=1.0, reference=5.0)),
                        (RUNNER.replace("{h}", "a" * 16), runner("optimized graph", 1.03))])
    sixteen = measured(16, [(CONV, node("cudnn", cudnn=1.0, generated=1.05)),
                            (RUNNER.replace("{h}", "b" * 16), runner("optimized graph", 1.05))])
    bc = BucketChoices(AutotuneCache(None), batch=6, neighbours=[(4, four), (16, sixteen)])
    assert bc.get("cuda", CONV.format(b=6)) is None  # bucket 4 asked a pool first: one side only, a near tie
    bc.put("cuda", CONV.format(b=6), node("cudnn", cudnn=1.0, generated=1.5))
    got = bc.get("cuda", RUNNER.replace("{h}", "c" * 16).format(b=6))
    assert got is not None and got["runs"] == "optimized graph" and bc.counts["from_neighbours"] == 1
    split = measured(4, [(RUNNER.replace("{h}", "a" * 16), runner("baseline graph", 1.05))])
    bc = BucketChoices(AutotuneCache(None), batch=6, neighbours=[(4, split), (16, sixteen)])
    assert bc.get("cuda", RUNNER.replace("{h}", "c" * 16).format(b=6)) is None  # they disagree, neither adjacent-clear


@settings(deadline=None)  # the profile's examples: 25 in CI, 400 with --hypothesis-profile=thorough
@given(st.lists(st.sampled_from(["cudnn", "generated", "reference"]), min_size=1, max_size=6),
       st.lists(st.sampled_from(["cudnn", "generated", "reference"]), min_size=1, max_size=6),
       st.floats(1.0, 3.0), st.floats(1.0, 3.0))
def test_a_taken_choice_is_one_a_neighbour_measured_and_clear_or_agreed(lows, highs, m_low, m_high):
    """Whatever two neighbours measured, a taken choice is what both chose, or what the adjacent one
    chose by at least the margin; every other ask is left to measuring."""
    def entry(choice, m):
        return node(choice, **{c: (1.0 if c == choice else m) for c in ("cudnn", "generated", "reference")})

    n = min(len(lows), len(highs))
    keys = [CONV.replace("fused_conv", f"conv{i}") for i in range(n)]
    low = measured(2, [(k, entry(c, m_low)) for k, c in zip(keys, lows)])
    high = measured(16, [(k, entry(c, m_high)) for k, c in zip(keys, highs)])
    bc = BucketChoices(AutotuneCache(None), batch=4, neighbours=[(2, low), (16, high)])
    for k, lc, hc in zip(keys, lows, highs):
        got = bc.get("cuda", k.format(b=4))
        if lc == hc:
            assert got is not None and got["choice"] == lc
        elif m_low >= NEIGHBOUR_MARGIN:  # bucket 2 is adjacent to 4; 16 is not
            assert got is not None and got["choice"] == lc
        else:
            assert got is None
            bc.put("cuda", k.format(b=4), entry(lc, 1.5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bucket_between_measured_ones_measures_less_and_equals_eager(tmp_path):
    """Batches 2 and 8 lowered first (buckets 2 and 8 measured); batch 3's (bucket 4) first lowering
    takes choices from them and measures fewer; every size equals eager."""
    torch.manual_seed(0)
    model = SmallResNet().cuda().eval().half()
    backend = Counting(dynamic_padding=False, autotune_cache=str(tmp_path / "a.json"))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for b in (2, 8, 3, 4):
            x = torch.randn(b, 3, 32, 32, device="cuda").half().contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(compiled(x), model(x), rtol=2e-2, atol=2e-2)
    recs = backend.dynamic()["specializations"]
    three = next(v for k, v in recs.items() if k.split(",")[0].endswith("=3"))  # the batch's symbol first
    eight = next(v for k, v in recs.items() if k.split(",")[0].endswith("=8"))
    assert three["choices"]["from_neighbours"] >= 1, recs
    assert three["choices"]["measured"] < eight["choices"]["measured"], recs


def test_answers_measured_after_later_asks_go_to_their_own_asks():
    """The cuda executor asks for every choice before compiling, then measures the misses: each
    measured entry answers the earliest open ask of its signature, and a later lowering of the
    bucket gets the i-th answer for its i-th ask, whatever order they were measured in."""
    bc = BucketChoices(AutotuneCache(None), batch=5)
    a, b = CONV.format(b=5), CONV.replace("fused_conv", "other").format(b=5)
    assert bc.get("cuda", a) is None and bc.get("cuda", b) is None and bc.get("cuda", a) is None
    bc.put("cuda", a, node("first", first=1.0))
    bc.put("cuda", b, node("b", b=1.0))
    bc.put("cuda", a, node("second", second=1.0))
    later = bc.replayer()
    got = [later.get("cuda", k.format(b=6)) for k in (CONV, CONV.replace("fused_conv", "other"), CONV)]
    assert [e["choice"] for e in got] == ["first", "b", "second"] and later.counts["reused"] == 3



def test_losers_of_a_missed_ask_are_those_far_behind_at_the_nearest_measured_bucket():
    """A choice that is not clear at the neighbours is measured, but without the candidates that took
    10x the fastest one's time (or were pruned) at the nearest bucket that measured it, within 8x."""
    from fxopt.dynamic_buckets import LOSER_FACTOR

    key = CONV.replace("'reference']", "'reference', 'slow', 'slower']")
    entry = dict(node("cudnn", cudnn=1.0, generated=1.05, slow=LOSER_FACTOR * 1.0, reference=30.0),
                 pruned={"slower": 40.0})
    near = measured(8, [(key, entry)])
    far = measured(64, [(key, node("cudnn", cudnn=1.0, generated=50.0))])
    bc = BucketChoices(AutotuneCache(None), batch=3, neighbours=[(8, near), (64, far)])
    assert bc.get("cuda", key.format(b=3)) is None  # 8 is not adjacent to 4 and the margin is small
    assert bc.losers("cuda", key.format(b=3)) == {"slow", "slower"}  # never the reference
    assert bc.losers("cuda", POOL.format(b=3)) == set()  # not the ask that just missed
    alone = BucketChoices(AutotuneCache(None), batch=3, neighbours=[(64, far)])
    assert alone.get("cuda", key.format(b=3)) is None and alone.losers("cuda", key.format(b=3)) == set()  # 16x away


def test_a_key_asked_twice_before_measuring_is_measured_once(monkeypatch):
    """Identical regions of one graph share a key: both are asked before either is measured; the
    second takes the first's measurement (one measurement, both asks answered)."""
    from fxopt.backends.cuda.runtime import measure

    calls = []
    monkeypatch.setattr(measure, "measure", lambda n, cands, graphed: calls.append(1) or node("generated",
                                                                                             generated=1.0))

    class Ctx:
        measurements = 0

    bc = BucketChoices(AutotuneCache(None), batch=4)
    tuning = measure.Tuning(bc, "cuda", True, Ctx)
    key = CONV.format(b=4)
    assert tuning.lookup(key) is None and tuning.lookup(key) is None
    first, second = tuning.measured(None, {}, key), tuning.measured(None, {}, key)
    assert first is second and len(calls) == 1 and Ctx.measurements == 1
    assert bc.counts["measured"] == 1 and bc.counts["cached"] == 1
    later = bc.replayer()
    assert later.get("cuda", CONV.format(b=3))["choice"] == later.get("cuda", CONV.format(b=3))["choice"] == "generated"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_compile_whose_choices_are_cached_compiles_only_the_chosen_kernels(tmp_path):
    """The second compile with the same autotuning cache measures nothing and compiles no kernel of
    a candidate that lost (listed as skipped, with the choice); it equals eager."""
    import fxopt

    torch.manual_seed(0)
    model = SmallResNet().cuda().eval().half().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 32, 32, device="cuda").half().contiguous(memory_format=torch.channels_last)
    opts = {"autotune_cache": str(tmp_path / "a.json"), "compile_cache": False}
    first = fxopt.explain(model, x, options=opts)
    second = fxopt.explain(model, x, options=opts)
    assert first.graphs[0].measurements > 0 and second.graphs[0].measurements == 0
    skipped = [k for k in second.kernels if getattr(k, "skipped", None)]
    assert skipped and all("autotuning cache chose" in k.skipped and not k.compiled for k in skipped)
    assert sum(k.compiled for k in second.kernels) < sum(k.compiled for k in first.kernels)
    compiled = torch.compile(model, backend="fxopt", options=opts)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=2e-2, atol=2e-2)


def test_explain_lists_the_choices_taken_from_neighbouring_buckets():
    from fxopt.dynamic import summary_lines

    info = {"symbolic": ["input 0 dim 0 (s0, traced at 8)"], "live": 2, "max_specializations": 16,
            "specializations": {"s0=3": {"lowered": 1, "seconds": [0.2], "live": True, "runs": "specialized",
                                         "choices": {"measured": 2, "cached": 0, "reused": 0, "from_sibling": 0,
                                                     "from_neighbours": 21}},
                                "s0=8": {"lowered": 1, "seconds": [1.1], "live": True, "runs": "specialized",
                                         "choices": {"measured": 23, "cached": 0, "reused": 0}},
                                "s0=5, s1=192": {"lowered": 1, "seconds": [0.05], "live": True, "runs": "specialized",
                                                 "choices": {"measured": 0, "cached": 0, "reused": 26},
                                                 "choices_from": "another graph's lowering of its bucket"}}}
    lines = summary_lines(info)
    three = next(line for line in lines if "s0=3" in line)
    eight = next(line for line in lines if "s0=8" in line)
    image = next(line for line in lines if "s1=192" in line)
    assert "2 measured" in three and "21 from neighbouring buckets" in three
    assert "neighbouring" not in eight and "another graph" not in eight
    assert "26 reused (another graph's lowering of its bucket)" in image


def test_a_choice_whose_other_candidates_all_lost_keeps_the_reference_for_the_bucket():
    """Every candidate but the reference left out as a loser: the reference is stored as the choice
    (marked unmeasured), and the bucket's later sizes take it without measuring."""
    from fxopt.backends.cuda.runtime import measure

    class Ctx:
        measurements = 0

    bc = BucketChoices(AutotuneCache(None), batch=4)
    tuning = measure.Tuning(bc, "cuda", True, Ctx)
    key = CONV.format(b=4)
    assert tuning.lookup(key) is None
    kept = tuning.reference_kept(key)
    assert kept["choice"] == "reference" and "not_measured" in kept and Ctx.measurements == 0
    assert bc.replayer().get("cuda", CONV.format(b=3))["choice"] == "reference"


def test_input_buckets_name_a_size_by_its_inputs_bucketed():
    from fxopt.dynamic_buckets import input_buckets

    assert input_buckets([(5, 3, 192, 192)]) == input_buckets([(6, 3, 224, 224)]) == "[(8, 4, 256, 256)]"
    assert input_buckets([(5, 3, 192, 192)]) != input_buckets([(9, 3, 192, 192)])
    assert input_buckets([(2, 8), (5, 3, 32, 32)]) == input_buckets([(5, 3, 32, 32), (2, 8)])  # in order


def test_a_first_lowering_takes_what_another_graph_measured_at_inputs_of_its_bucket():
    """A choice stored with the bucket of the inputs it was measured at serves the first lowering of
    another graph (the same request: its key's signature) at inputs of that bucket; not one of
    another bucket, and a key of another signature not at all."""
    user = AutotuneCache(None)
    at = "[(8, 4, 256, 256)]"
    first = BucketChoices(user, batch=6, at=at)
    key = CONV.format(b=6)
    assert first.get("cuda", key) is None
    first.put("cuda", key, node("generated", generated=1.0, cudnn=1.01))
    assert user.get("cuda", key)["input_buckets"] == at  # stored with its bucket
    other = CONV.format(b=5).replace("56, 56", "48, 48")  # another graph: batch 5 at side 192
    got = BucketChoices(user, batch=5, at=at)
    assert got.get("cuda", other)["choice"] == "generated" and got.counts["from_sibling"] == 1
    assert BucketChoices(user, batch=5, at="[(8, 4, 128, 128)]").get("cuda", other) is None
    assert BucketChoices(user, batch=5, at=at).get("cuda", POOL.format(b=5)) is None


def test_a_graph_with_its_sides_symbolic_reuses_the_batch_graphs_choices(tmp_path):
    """Dynamo's graph for a new image size (sides symbolic) is another graph: its first lowering at
    inputs of a bucket the batch graph lowered replays that bucket and measures nothing (the cpu
    executor's runner decision); in a later process, whose batch graph is gone, it takes what the
    user's cache holds at inputs of that bucket. Every result equals eager's."""
    torch.manual_seed(0)
    model = SmallResNet().eval()
    backend = Counting(executor="cpu", dynamic_padding=False, autotune_cache=str(tmp_path / "at.json"))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for b, side in [(2, 32), (3, 32), (6, 32), (5, 28), (7, 28)]:
            x = torch.randn(b, 3, side, side)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    infos = [r.executor_details["dynamic"] for r in backend.reports if r.executor_details.get("dynamic")]
    assert len(infos) == 2, infos  # the batch's graph, then the sides'
    sides = infos[1]["specializations"]
    five = next(v for k, v in sides.items() if "=5" in k)
    assert five["choices"]["measured"] == 0 and five["choices_from"] == "another graph's lowering of its bucket"
    # a graph with other options (which may order its requests otherwise) does not replay them
    other = Counting(executor="cpu", dynamic_padding=False, autotune_cache=str(tmp_path / "at.json"),
                     specialize_after=3)
    with torch.no_grad():
        torch.compile(model, backend=other, dynamic=True)(torch.randn(5, 3, 28, 28))
    (rec,) = other.dynamic()["specializations"].values()
    assert rec["choices_from"].startswith("measured here"), rec
    torch.compiler.reset()
    del compiled
    gc.collect()  # the batch graph's dispatcher and its buckets go
    backend = Counting(executor="cpu", dynamic_padding=False, autotune_cache=str(tmp_path / "at.json"))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for b, side in [(5, 28), (7, 28)]:
            x = torch.randn(b, 3, side, side)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    five = next(v for k, v in backend.dynamic()["specializations"].items() if "=5" in k)
    assert five["choices"]["measured"] == 0 and five["choices"]["from_sibling"] >= 1, five


def test_a_runners_key_names_its_model_apart_from_the_sizes():
    """The runners' keys carry a tag of the model's weights that a key's signature keeps: the same at
    every batch, another for another model whose inputs match (its decision is not taken there)."""
    from fxopt.backends.lowering import model_tag
    from fxopt.dynamic_buckets import signature

    def graph(batch: int, cout: int) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        x, w = g.placeholder("x"), g.placeholder("w")
        x.meta["val"] = torch.empty(batch, 3, 8, 8, device="meta")
        w.meta["val"] = torch.empty(cout, 3, 3, 3, device="meta")
        g.output(g.call_function(torch.conv2d, (x, w)))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    a, b, c = (model_tag(graph(2, 8), {"w"}), model_tag(graph(5, 8), {"w"}), model_tag(graph(2, 16), {"w"}))
    assert a == b != c and signature(a) == a
    user = AutotuneCache(None)
    key = RUNNER.replace("{h}", "a" * 16 + "-" + a)
    first = BucketChoices(user, batch=6)
    assert first.get("cuda", key.format(b=6)) is None
    first.put("cuda", key.format(b=6), runner("optimized graph", 2.0))
    same = BucketChoices(user, batch=5)
    assert same.get("cuda", RUNNER.replace("{h}", "b" * 16 + "-" + a).format(b=5)) is not None
    other = BucketChoices(user, batch=5)
    assert other.get("cuda", RUNNER.replace("{h}", "b" * 16 + "-" + c).format(b=5)) is None
