"""fxopt fuzz on the CPU: a few deterministic graphs through the cpu and torch executors and the
cuda executor's CPU-checkable part, shrinking to a reproducer that runs, shards and their merge,
shards as processes at once (--jobs), coverage, the sanitizers' sample reaching every family."""
import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, seed, settings

from fxopt.fuzz import Coverage, Program, kernel_family, merge, programs, run_fuzz
from fxopt.fuzz import check as fuzz_check
from fxopt.fuzz import references as fuzz_refs
from fxopt.fuzz.graphs import render
from fxopt.fuzz.repro import write_repro

SMALL = dict(max_batch=2, max_size=5, max_layers=2, log=lambda *a: None)


def test_cpu_and_torch_executors_match_eager(tmp_path):
    s = run_fuzz("cpu", examples=4, seed=3, out=tmp_path, executors=("cpu", "torch"), **SMALL)
    assert s["ran"] == 4 and not s["failures"], s["failures"]
    cov = s["coverage"]
    assert cov["graphs"] == 4 and sum(cov["executors"].values()) == 4
    assert (tmp_path / "shard-0-of-1" / "coverage.json").exists()


def test_cuda_executor_checks_on_the_cpu(tmp_path):
    """Kernels generated and compiled with NVRTC, regions' IR against ATen, row geometry."""
    s = run_fuzz("cpu", examples=3, seed=5, out=tmp_path, executors=("cuda",), modes=("inference",), **SMALL)
    assert s["ran"] == 3 and not s["failures"], s["failures"]
    assert s["coverage"]["families"], "no kernel generated"


def test_programs_are_deterministic_per_seed():
    def drawn(k):
        out = []

        @seed(k)
        @settings(max_examples=5, database=None, derandomize=False)
        @given(programs(max_batch=2))
        def collect(p):
            out.append(p.source)
        collect()
        return out
    assert drawn(1) == drawn(1) and drawn(1) != drawn(2)


def _fake(program, device, graphs=None, outcome=None):
    """A backend that fails every graph with a convolution: the fuzzer must shrink to one conv."""
    if any(op.startswith("conv:") for op in program.ops):
        raise fuzz_check.Mismatch("a convolution")
    return []


def test_failure_is_shrunk_to_a_reproducer(tmp_path, monkeypatch):
    monkeypatch.setattr(fuzz_check, "run_program", _fake)
    s = run_fuzz("cpu", examples=30, seed=0, out=tmp_path, executors=("torch",), modes=("inference",), **SMALL)
    assert s["failures"], "no graph had a convolution"
    f = s["failures"][0]
    prog = Program.from_json(f["program"])
    assert len(prog.layers) == 1 and prog.layers[0].startswith("conv"), prog.layers  # shrunk
    assert prog.shape[0] == 1 and "Mismatch: a convolution" in open(f["repro"]).read()
    # one failing program per reproducer; the examples run while shrinking are counted apart
    assert s["failing_programs"] == len(s["failures"]) == s["coverage"]["failures"]
    assert s["coverage"]["shrink_runs"] >= s["coverage"]["shrink_failed"] >= 1
    assert s["ran"] == s["coverage"]["graphs"] + s["coverage"]["shrink_runs"] + len(s["failures"])
    # the program as first drawn was written before shrinking began (a killed process keeps it)
    unshrunk = list((tmp_path / "shard-0-of-1" / "unshrunk").glob("repro_*.py"))
    # (one per round at most; a round may first replay a program an earlier one found: the same file)
    assert 1 <= len(unshrunk) <= len(s["failures"]) and "Mismatch: a convolution" in unshrunk[0].read_text()


def test_reproducer_runs_without_the_fuzzer(tmp_path):
    src = "\n".join(["import torch", "import torch.nn as nn", "import torch.nn.functional as F", "",
                     "class Model(nn.Module):", "    def __init__(self):", "        super().__init__()",
                     "        self.m0 = nn.Conv2d(3, 4, 3, padding=1)", "",
                     "    def forward(self, x):", "        return F.relu(self.m0(x)).mean((2, 3), keepdim=True)", ""])
    prog = Program(src, (2, 3, 5, 4), "float32", "channels_last", "inference", 7, {"executor": "torch"}, ["conv"])
    path = write_repro(prog, "example", tmp_path, "cpu", (1e-4, 1e-5))
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and "eager == fxopt" in r.stdout, r.stderr[-2000:]


def test_training_reproducer_judges_gradients_against_float64(tmp_path):
    """A training reproducer's gradients that differ from eager's by more than the tolerance are
    judged against the float64 gradients, as its outputs are (a cancelling bias gradient before a
    BatchNorm stays rounding noise: a93a79118e failed its reproducer on that alone)."""
    src = "\n".join(["import torch", "import torch.nn as nn", "", "class Model(nn.Module):",
                     "    def __init__(self):", "        super().__init__()", "        self.m0 = nn.Conv2d(2, 3, 1)",
                     "        self.m1 = nn.BatchNorm2d(3)", "",
                     "    def forward(self, x):", "        return torch.abs(self.m1(self.m0(x)))", ""])
    prog = Program(src, (4, 2, 3, 3), "float32", "contiguous", "training", 3, {"executor": "torch"}, ["conv"])
    path = write_repro(prog, "example", tmp_path, "cpu", (0.0, 0.0))
    text = path.read_text()
    assert "rtol, atol = tolerance(dtype)" in text
    path.write_text(text.replace("rtol, atol = tolerance(dtype)", "rtol, atol = 0.0, 1e-30"))  # every grad decided by float64
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and "eager == fxopt" in r.stdout, r.stderr[-2000:]
    path.write_text(path.read_text().replace("for name, g, w in pairs", "for name, g, w in [(n, g * 1.5, w) for n, g, w in pairs]"))
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode != 0 and "error vs float64" in r.stderr, r.stderr[-2000:]


def test_shards_draw_different_graphs_and_merge(tmp_path, monkeypatch):
    seen = {}

    def record(program, device, graphs=None, outcome=None):
        seen.setdefault(program.source, 0)
        seen[program.source] += 1
        return []
    monkeypatch.setattr(fuzz_check, "run_program", record)
    for i in range(2):
        s = run_fuzz("cpu", examples=10, seed=1, out=tmp_path, shard=(i, 2), executors=("torch",), **SMALL)
        assert s["ran"] == 5
    merged = merge([tmp_path], out=tmp_path / "merged", log=lambda *a: None)
    assert merged["ran"] == 10 and merged["coverage"]["graphs"] == 10 and len(merged["shards"]) == 2
    assert len(seen) > 5  # the shards' seeds differ
    from fxopt.cli import main

    assert main(["fuzz", "--merge", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "merged" / "merged.json").read_text())["ran"] == 10


def test_coverage_families_and_missing():
    names = {"fx_red_mean_rows32v4_4cd0184acc93": "reduction:rows", "fx_red_sum_inner256_0a1b2c3d4e5f": "reduction:inner",
             "fx_pw_mul_v4_4d1d69052fbd": "pointwise:region", "fx_dconv3x3_c4x8_f32_nchw_1234abcd": "conv:direct",
             "fx_dw3x3_s1x1_f16_nhwc_ab12cd34": "conv:depthwise", "fx_gconv3x3_g2_c2x2_f32_nhwc_t": "conv:grouped",
             "fx_wino_in_f32_nchw_0123abcd": "conv:winograd", "fx_linear_k2_n1_r1_f32_df727eb2": "linear:rows",
             "fx_gap_f32_nchw": "pool:global_avg", "fx_maxpool3x3_s2x2_f32_nchw": "pool:window"}
    for name, fam in names.items():
        assert kernel_family(name) == fam, name

    class G:
        kind, conv_algorithms, executor_details = "inference", {}, {}

        def __init__(self, kernels):
            self.kernels = [type("K", (), {"name": n}) for n in kernels]
    prog = Program("", (1, 1, 1, 1), ops=["reduce:mean:2,3"])
    a, b = Coverage(), Coverage()
    a.add(prog, [G(["fx_red_mean_rows32v4_4cd0184acc93"])])
    b.add(prog, [G(["fx_gap_f32_nchw", "fx_gap_f32_nchw"])])
    m = Coverage.from_json(json.loads(json.dumps(a.to_json()))).merge(b)
    assert m.graphs == 2 and m.counts["families"]["pool:global_avg"] == 1 and m.counts["ops"]["reduce:mean:2,3"] == 2
    assert "conv:winograd" in m.missing() and "reduction:rows" not in m.missing()
    assert "never reached" in m.table()


@pytest.mark.parametrize("bad", ["1/1", "2/2", "x"])
def test_shard_option_is_checked(bad):
    from fxopt.cli import main

    with pytest.raises((SystemExit, ValueError)):
        main(["fuzz", "--device", "cpu", "--examples", "0", "--shard", bad])


def test_time_budget_ends_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(fuzz_check, "run_program", lambda program, device, graphs=None, outcome=None: [])
    s = run_fuzz("cpu", examples=100000, time_budget=0.3, out=tmp_path, executors=("torch",), **SMALL)
    assert 0 < s["ran"] < 100000 and not s["failures"] and s["seconds"] < 30


def test_cast_program_passes_and_its_float64_reference_runs():
    prog = Program.of(["x = x.to(torch.float16).to(x.dtype) * 2.0", "x = self.m0(torch.flatten(x, 1))"],
                    ["self.m0 = nn.Linear(6, 2)"], (2, 1, 2, 3))
    assert fuzz_check.run_program(prog, "cpu")
    model, x = fuzz_check.build(prog, "cpu")
    ref = fuzz_refs.Reference64(model, x, prog)
    out = ref.out()
    assert out.dtype == torch.float64 and torch.allclose(out.float(), model(x), atol=1e-2)
    calls = []

    def lazy():
        calls.append(1)
        return out
    y = model(x)
    fuzz_check.compare("same", y, y, lazy, 1e-5, 1e-6)
    assert not calls  # not run where fxopt matches eager
    with pytest.raises(fuzz_check.Mismatch, match="vs float64"):
        fuzz_check.compare("off", y + 1.0, y, lazy, 1e-5, 1e-6)
    assert calls == [1]


def test_a_value_pytorchs_compiled_graph_gets_as_wrong_is_an_upstream_divergence(monkeypatch):
    """fxopt far from float64 where eager is not: a failure, unless PyTorch's own compiled graph is
    as far (CPU fuzz 28da4626d8: bfloat16 ``aten.convolution_backward`` left taps unwritten); then
    the program is recorded as upstream and passes."""
    exact = torch.zeros(3, dtype=torch.float64)
    eager, garbage = torch.tensor([0.01, 0.0, 0.0]), torch.tensor([3e33, 0.0, 0.0])
    with pytest.raises(fuzz_check.UpstreamMismatch):
        fuzz_check.compare("g", garbage, eager, exact, 1e-2, 1e-1, peer=torch.tensor([1e29, 0.0, 0.0]))
    with pytest.raises(fuzz_check.Mismatch) as e:
        fuzz_check.compare("g", garbage, eager, exact, 1e-2, 1e-1, peer=eager)
    assert type(e.value) is fuzz_check.Mismatch  # the peer right: fxopt's own
    with pytest.raises(fuzz_check.UpstreamMismatch):  # eager itself 10x beyond the rounding spread
        fuzz_check.compare("y", garbage, torch.tensor([10.4, 0.0, 0.0]), exact, 1e-2, 2e-2, spread64=exact + 0.0066)
    prog = Program.of(["x = self.m0(x)"], ["self.m0 = nn.Conv2d(1, 2, 1)"], (1, 1, 2, 2), mode="training")

    def upstream(program, device, eager, mine, compiled, x, *a, **k):
        compiled(x)  # fxopt compiles the graph, then the step's judgement finds PyTorch's as wrong
        raise fuzz_check.UpstreamMismatch("m0.weight.grad[0]: ...")
    monkeypatch.setattr(fuzz_check, "_training_step", upstream)
    outcome: dict = {}
    graphs = fuzz_check.run_program(prog, "cpu", outcome=outcome)
    assert outcome["upstream"].startswith("PyTorch's kernels") and len(graphs) == 1


def test_eager_error_is_a_pass_when_fxopt_raises_the_same_type():
    prog = Program.of(["x = self.m0(x)"], ["self.m0 = nn.BatchNorm2d(1)"], (1, 1, 1, 1), mode="training")
    outcome = {}
    fuzz_check.run_program(prog, "cpu", outcome=outcome)
    assert outcome == {"eager_error": "ValueError"}
    cov = Coverage()
    cov.add(prog, [], eager_error=outcome["eager_error"])
    assert cov.eager_errors == 1 and "eager errors: 1" in cov.table()


def test_eager_error_is_a_failure_when_fxopt_does_not_raise_it():
    def eager():
        raise ValueError("bad input")

    def wrapped():
        try:
            raise ValueError("bad input")
        except ValueError as e:
            raise RuntimeError("wrapped by the tracer") from e
    with pytest.raises(fuzz_check.EagerRaised):
        fuzz_check.run_both(eager, wrapped)
    with pytest.raises(fuzz_check.Mismatch, match="fxopt returns"):
        fuzz_check.run_both(eager, lambda: 1)
    with pytest.raises(fuzz_check.Mismatch, match="fxopt TypeError"):
        fuzz_check.run_both(eager, lambda: (_ for _ in ()).throw(TypeError("other")))
    assert fuzz_check.run_both(lambda: 1, lambda: 2) == (1, 2)


def test_training_programs_have_no_batchnorm_over_one_value():
    @seed(4)
    @settings(max_examples=60, database=None, deadline=None)
    @given(programs(modes=("training",), max_batch=2, max_size=2))
    def draw(p):
        model, x = fuzz_check.build(p, "cpu")
        model(x)  # eager runs it: no BatchNorm with one value per channel
    draw()


def test_family_targets_reach_grouped_and_winograd_programs():
    import re

    from fxopt.fuzz.graphs import TARGETS

    seen = {}

    @seed(0)
    @settings(max_examples=150, database=None, deadline=None)
    @given(programs(max_batch=4, max_size=8, max_layers=2))
    def draw(p):
        convs = [tuple(map(int, m.groups())) for m in
                 re.finditer(r"nn.Conv2d\((\d+), (\d+), (\d+), stride=(\d+), .*dilation=(\d+), groups=(\d+)", p.source)]
        if p.target == "grouped":  # what the grouped kernel needs: channels_last, 2+ channels a group
            assert p.fmt == "channels_last" and p.options.get("conv_algorithm") in (None, "direct")
            assert any(g > 1 and cin // g >= 2 for cin, _, _, _, _, g in convs), p
        if p.target == "winograd":  # an inference 3x3 stride-1 conv: a Winograd algorithm forced, or the
            # algorithm left to choose (the generated F(2x2, 3x3) candidate then competes)
            assert p.mode == "inference" and p.options.get("conv_algorithm", "winograd_").startswith("winograd_")
            assert any(k == 3 and s == 1 and d == 1 for _, _, k, s, d, _ in convs), p
        seen[p.target] = seen.get(p.target, 0) + 1
        seen[p.dtype] = seen.get(p.dtype, 0) + 1
        seen[p.fmt] = seen.get(p.fmt, 0) + 1
    draw()
    assert seen.get("grouped", 0) >= 3 and seen.get("winograd", 0) >= 3, seen
    assert len(set(TARGETS) & seen.keys()) >= 6, seen
    for k in ("float32", "float16", "bfloat16", "contiguous", "channels_last"):
        assert seen.get(k, 0) >= 60 // 6, seen


def test_jobs_run_the_shards_at_once_and_merge(tmp_path, capsys):
    from fxopt.cli import main

    out = tmp_path / "fz"
    rc = main(["fuzz", "--device", "cpu", "--jobs", "2", "--examples", "4", "--seed", "3", "--executor", "torch",
               "--progress", "0", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    merged = json.loads((out / "merged.json").read_text())
    assert merged["ran"] == 4 and len(merged["shards"]) == 2 and not merged["failures"]
    for i in range(2):  # each shard: its own directory, its whole output in log.txt, its lines echoed
        s = json.loads((out / f"shard-{i}-of-2" / "summary.json").read_text())
        assert s["shard"] == [i, 2] and s["ran"] == 2 and s["seed"] == 3
        assert "progress" in (out / f"shard-{i}-of-2" / "log.txt").read_text()
        assert f"[shard {i}/2] progress {i}/2:" in text and f"[shard {i}/2] 2 examples in" in text
    assert "2 shards, 4 examples, 4 programs passed, 0 failing programs" in text
    with pytest.raises(SystemExit):
        main(["fuzz", "--device", "cpu", "--jobs", "2", "--shard", "0/2", "--out", str(out)])


def test_jobs_fail_where_a_shard_writes_no_summary(tmp_path):
    from fxopt.fuzz.parallel import run_jobs, shard_command

    assert shard_command(1, 4, ["--seed", "2"], 3, 30)[-6:] == ["--shard", "1/4", "--threads", "3", "--progress", "30"]
    lines = []
    rc = run_jobs(2, tmp_path, ["--device", "cpu", "--examples", "2", "--executor", "no-such-executor"], threads=1,
                  log=lines.append)
    assert rc == 1 and any("ended without a summary" in ln for ln in lines), lines
    assert "invalid choice" in (tmp_path / "shard-0-of-2" / "log.txt").read_text()


def test_sanitizer_sample_runs_the_programs_after_one_that_ends_cuda_in_a_new_process(tmp_path, monkeypatch):
    """Under racecheck one program's failure left the process unable to run CUDA work and every later
    program of the sample failed with it; those now run in a fresh process (which the sanitizer
    follows), from the next program on, with the same flags and what is left of the time budget."""
    import json
    import subprocess

    import fxopt.fuzz.check as check
    import fxopt.fuzz.sample as sample

    prog = Program.of(["x = torch.abs(x)"], [], (1, 1, 1, 2)).to_json()
    path = tmp_path / "sample.json"
    path.write_text(json.dumps([{"program": prog, "families": ["pointwise:region"], "shared": True}] * 3))
    ran, spawned = [], []

    def fails(program, device):
        ran.append(device)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(check, "run_program", fails)
    monkeypatch.setattr(sample, "_quick_timing", lambda: None)
    monkeypatch.setattr(sample, "_cuda_usable", lambda: False)
    monkeypatch.setattr(subprocess, "run", lambda cmd, check=False: spawned.append(cmd))
    lines = []
    assert sample.run(str(path), shared_only=True, device="cuda", log=lines.append, time_budget=100.0) == 1
    assert len(ran) == 1 and len(spawned) == 1  # the first program here, the rest in the new process
    cmd = spawned[0]
    assert cmd[1:5] == ["-m", "fxopt.fuzz.sample", "run", str(path)] and cmd[cmd.index("--start") + 1] == "1"
    assert "--shared-only" in cmd and 0 < float(cmd[cmd.index("--time-budget") + 1]) <= 100.0
    assert any("in a new process" in ln for ln in lines)
    ran.clear()
    monkeypatch.setattr(sample, "_cuda_usable", lambda: True)  # usable still: every program here
    assert sample.run(str(path), device="cuda", log=lines.append, start_at=1) == 1 and len(ran) == 2
    ran.clear()  # --inference-only leaves the training programs out, and passes itself on
    train = {**prog, "mode": "training"}
    path.write_text(json.dumps([{"program": p, "families": ["pointwise:region"], "shared": True}
                                for p in (train, prog, train)]))
    monkeypatch.setattr(sample, "_cuda_usable", lambda: False)
    spawned.clear()
    assert sample.run(str(path), device="cuda", log=lines.append, inference_only=True) == 1 and len(ran) == 1
    assert not spawned and "ran 1 of 1 programs" in lines[-1]


def test_sanitizer_sample_selects_every_family():
    """The cuda executor's planning on CPU tensors reaches every kernel family the coverage lists
    (but those no executor launches), grouped convs and the generated Winograd pipeline included."""
    from fxopt.fuzz.coverage import FAMILIES, NOT_LAUNCHED
    from fxopt.fuzz.sample import select

    chosen = select(per_family=1, max_draws=150, seed=0, log=lambda *a: None)
    reached = {f for e in chosen for f in e["families"]}
    assert not [f for f in FAMILIES if f not in reached and f not in NOT_LAUNCHED]
    assert "conv:grouped" in reached and "conv:winograd" in reached and "conv:winograd" not in NOT_LAUNCHED
    assert any(e["shared"] for e in chosen)
    sizes = [len(e["families"]) for e in chosen]  # ordered: the first program covers the most families
    assert sizes[0] == max(sizes)
    # every family also in an inference program with shared memory or shuffles (racecheck runs those)
    racecheck = {f for e in chosen if e["shared"] and e["program"]["mode"] == "inference" for f in e["families"]}
    assert not [f for f in FAMILIES if f not in racecheck and f not in NOT_LAUNCHED]


def test_every_program_has_an_op():  # fuzz 41f274c6f9: "y = x; x = x" is no graph for Dynamo
    @seed(0)
    @settings(max_examples=150, database=None, deadline=None)
    @given(programs(kinds=("pointwise",), max_layers=1, max_batch=1, max_size=2, targets=("any",)))
    def draw(p):
        lines = {ln.strip() for ln in p.source.split("def forward", 1)[1].splitlines()[1:]}
        assert lines - {"", "y = x", "x = x", "return x", "return x, y"}, p.source
    draw()


def test_a_time_budget_alone_draws_until_it_is_spent():
    """``--time-budget`` without ``--examples`` is not cut at the default count of graphs."""
    from argparse import Namespace

    from fxopt.cli import BUDGETED_FUZZ_EXAMPLES, DEFAULT_FUZZ_EXAMPLES, fuzz_examples

    assert fuzz_examples(Namespace(examples=None, time_budget=None)) == DEFAULT_FUZZ_EXAMPLES
    assert fuzz_examples(Namespace(examples=None, time_budget=60.0)) == BUDGETED_FUZZ_EXAMPLES > 10 ** 6
    assert fuzz_examples(Namespace(examples=7, time_budget=60.0)) == 7
    assert fuzz_examples(Namespace(examples=0, time_budget=None)) == 0


@pytest.mark.parametrize("executor", ["cpu", "torch", "cuda"])
def test_splits_of_any_width_and_concatenations_match_eager(executor):
    """graph_splits' structures, both layouts, every dtype: eager's results through the executor (the
    cuda executor's CPU-checkable part: kernels generated and compiled, regions' IR against ATen)."""
    seen = set()

    @seed(11)
    @settings(max_examples=8 if executor == "cuda" else 12, database=None, deadline=None)
    @given(programs(kinds=("split_branches", "split_branches", "conv"), max_layers=3, max_batch=2, max_size=6, targets=("any",),
                    modes=("inference",) if executor != "torch" else ("inference", "training"),
                    executor=executor, cudagraphs=(None,)))
    def check(p):
        fuzz_check.run_program(p, "cpu")
        seen.update(op for op in p.ops if op.startswith("cat:"))
    check()
    assert len(seen & {"cat:pieces", "cat:hierarchical", "cat:producers"}) >= 2, seen


def test_region_strides_are_judged_against_the_kernels_planned_inputs():
    """CPU fuzz 38252fbc90: a concatenation's layout follows its inputs' strides of size-1 dimensions;
    the check plans with the kernel's input strides (fusion._planned_input)."""
    prog = Program(render(["self.m0 = nn.Conv2d(1, 1, 3, padding=1, bias=False)", "self.m1 = nn.Linear(2, 1)",
                           "self.m2 = nn.Linear(1, 2, bias=False)", "self.m3 = nn.Linear(4, 1)",
                           "self.m4 = nn.Linear(1, 1)"],
                          ["x = x - x.mean((1,), keepdim=True)", "p0, p1 = torch.split(x, [1, 1], dim=1)",
                           "p1 = torch.abs(self.m0(p1))", "x = torch.cat([p0, p1], 1)", "y = x",
                           "x = F.max_pool2d(x, 1, 1, 0, ceil_mode=False)",
                           "x = (self.m2(F.gelu(self.m1(x.permute(0, 2, 3, 1))))).permute(0, 3, 1, 2)",
                           "x = self.m4(F.gelu(self.m3(torch.flatten(x, 1))))"], "x, y"),
                   (1, 2, 1, 2), "float32", "channels_last", "inference", 0,
                   {"conv_algorithm": "winograd_2x2_3x3", "executor": "cuda", "autotune_cache": False},
                   ["38252fbc90"])
    assert fuzz_check.run_program(prog, "cpu")


def test_an_emulated_normalization_of_equal_values_is_judged_at_the_inputs_scale():
    """CPU fuzz a257513b80: rows of equal values normalized, 0 in the IR, 1.8e-14 emulated; every
    result 0, the tolerance scales with the largest input."""
    prog = Program(render(["self.m0 = nn.LayerNorm(1, elementwise_affine=False)",
                           "self.m1 = nn.Conv2d(1, 2, 1, stride=1, padding=0, dilation=1, groups=1, bias=False)",
                           "self.m2 = nn.Conv2d(2, 1, 1)", "self.m3 = nn.Conv2d(1, 2, 1)",
                           "self.m4 = nn.InstanceNorm2d(2, affine=False)"],
                          ["x = self.m0(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)",
                           "x = F.hardtanh(self.m1(x), -0.5, 0.5)", "x = F.pad(x, (0, 0, 1, 1), mode='reflect')",
                           "x = x * torch.sigmoid(self.m3(F.hardswish(self.m2(x.mean((2, 3), keepdim=True)))))",
                           "x = self.m4(x)"], "x"),
                   (1, 1, 2, 2), "float32", "contiguous", "inference", 0,
                   {"executor": "cuda", "autotune_cache": False}, ["a257513b80"])
    assert fuzz_check.run_program(prog, "cpu")


def test_an_emulated_elu_is_the_generated_sources_expm1():
    """CPU fuzz 8e92f16233 (seed 2071): the IR's ELU computed ``exp(x) - 1`` where the generated CUDA
    computes ``expm1f(x)``; near 0 that loses the low bits, and a cast to float16 after it rounded to
    the other neighbour (one float16 unit, 2.4e-4 after a doubling; eager's error 0). The evaluator
    now computes what the source does, to the float32 unit near 0 as far as 1e-6."""
    from fxopt.backends.cuda.ir import expr

    x = -torch.logspace(-6, 0, 200, dtype=torch.float32)
    got, exact = expr.UNARY_P["elu"](x, 1.0), torch.expm1(x.double())
    assert ((got.double() - exact).abs() / exact.abs()).max() < 2 ** -22
    prog = Program(render(["self.m0 = nn.Conv2d(8, 8, 2, stride=1, padding=0, dilation=1, groups=2, bias=False)",
                           "self.m1 = nn.BatchNorm2d(8)", "_random_stats(self.m1)", "self.m2 = nn.Conv2d(8, 4, 1)",
                           "self.m3 = nn.Conv2d(4, 8, 1)"],
                          ["x = F.elu(self.m1(self.m0(x)))", "x = x.to(torch.float16).to(x.dtype) * 2.0", "y = x",
                           "x = x * torch.sigmoid(self.m3(F.hardswish(self.m2(x.mean((2, 3), keepdim=True)))))"],
                          "x, y"),
                   (5, 8, 3, 8), "float32", "channels_last", "inference", 3,
                   {"executor": "cuda", "autotune_cache": False}, ["8e92f16233"])
    assert fuzz_check.run_program(prog, "cpu")


def test_a_region_through_a_narrower_dtype_is_judged_at_its_tolerance():
    """CPU fuzz 54134b36bd (seed 2072): a float32 region computing GELU, a cast to float16 and back,
    then a doubling; the kernel's GELU one float32 unit from torch's rounded to the other float16
    neighbour (4.9e-4, eager's 0). A region's output carries the tolerance of the narrowest dtype its
    values pass through, as the fuzzer's whole-model check does; without such a cast it does not."""
    import types

    import torch.fx as fx

    from fxopt.testing.fusion import _through_narrower
    from fxopt.tolerances import tolerance

    g = fx.Graph()
    nodes = [g.placeholder(n) for n in ("a", "b")]
    nodes[0].meta["val"], nodes[1].meta["val"] = torch.empty(2), torch.empty(2, dtype=torch.float16)
    assert _through_narrower(types.SimpleNamespace(covered=nodes[:1]), torch.float32, 1e-4, 1e-5) == (1e-4, 1e-5)
    assert _through_narrower(types.SimpleNamespace(covered=nodes), torch.float32, 1e-4, 1e-5) == tolerance(torch.float16)
    assert _through_narrower(types.SimpleNamespace(covered=nodes), torch.float16, 0.0, 0.0) == (0.0, 0.0)
    prog = Program(render(["self.m0 = nn.Conv2d(16, 8, 3, stride=1, padding=1, dilation=1, groups=2, bias=False)",
                           "self.m1 = nn.Conv2d(8, 8, 3, stride=1, padding='same', dilation=1, groups=1, bias=True)",
                           "self.m2 = nn.BatchNorm2d(8)", "_random_stats(self.m2)", "self.m3 = nn.Linear(8, 8)",
                           "self.m4 = nn.Linear(8, 8, bias=True)", "self.m5 = nn.Parameter(torch.rand(8) + 0.5)"],
                          ["x = torch.abs(self.m0(x))", "x = x.to(torch.bfloat16).to(x.dtype) * 2.0",
                           "x = F.gelu(self.m2(self.m1(x)))", "x = x.to(torch.float16).to(x.dtype) * 2.0",
                           "x = (self.m5 * self.m4(F.gelu(self.m3(x.permute(0, 2, 3, 1))))).permute(0, 3, 1, 2)"],
                          "x"),
                   (2, 16, 12, 10), "float32", "channels_last", "inference", 1698,
                   {"conv_algorithm": "direct", "executor": "cuda", "autotune_cache": False}, ["54134b36bd"])
    assert fuzz_check.run_program(prog, "cpu")
