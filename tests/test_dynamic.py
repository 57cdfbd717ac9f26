"""Dynamic shapes (fxopt.dynamic): one Dynamo compile and one pipeline run for every size, the graph
lowered per size lazily (here without padded runs: tests/test_dynamic_serving.py has those), never eagerly; an LRU bound on the sizes kept; training's smaller last batch."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fxopt.pipeline
import fxopt.report
from fxopt.backend import fxopt_backend
from fxopt.dynamic import summary_lines
from fxopt.testing.models import BasicBlock, SeedCNN2, SmallResNet


class Counting:
    """fxopt as a backend that keeps its reports; ``compiles``: the graphs Dynamo compiled (Dynamo may
    call a backend twice for one graph: AOTAutograd restarts its analysis to make a scalar a tensor)."""

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


@pytest.fixture
def pipeline_runs(monkeypatch):
    runs = []
    real = fxopt.pipeline.run_pipeline

    def counting(gm, ctx, dump_prefix=""):
        runs.append(ctx.mode)
        return real(gm, ctx, dump_prefix=dump_prefix)

    monkeypatch.setattr(fxopt.pipeline, "run_pipeline", counting)
    return runs


def _check(compiled, model, shapes, channels=3):
    with torch.no_grad():
        for b, side in shapes:
            x = torch.randn(b, channels, side, side)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


def test_dynamic_true_compiles_once(pipeline_runs):
    torch.manual_seed(0)
    model, backend = SeedCNN2().eval(), Counting(dynamic_padding=False)  # the default (cpu) executor
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _check(compiled, model, [(2, 32), (3, 32), (2, 32)])
    assert backend.compiles == 1
    assert len(pipeline_runs) == 1
    # every pass ran on the symbolic graph (a convolution at a symbolic height and width has no
    # algorithm whose legality is decided: it keeps the library's, rather than failing the pass)
    assert [r.fallback for r in backend.reports] == [None]
    info = backend.dynamic()
    assert info["pipeline_runs"] == 1 and len(info["symbolic"]) == 2  # the batch and the image side
    assert sorted(int(k.split(",")[0].split("=")[1]) for k in info["specializations"]) == [2, 3]
    assert all(rec["lowered"] == 1 and rec["seconds"][0] > 0 for rec in info["specializations"].values())
    # a size's first call costs its lowering and then its run (what the runner measures there)
    assert all(len(rec["first_call_seconds"]) == 1 and rec["first_call_seconds"][0] >= rec["seconds"][0]
               for rec in info["specializations"].values())
    text = "\n".join(summary_lines(info))
    assert "first call with it" in text and "  lowerings: 2 in " in text and "with their first calls" in text


def test_automatic_dynamic_takes_the_symbolic_graph(pipeline_runs):
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting(executor="torch", dynamic_padding=False)
    compiled = torch.compile(model, backend=backend)
    _check(compiled, model, [(1, 32), (2, 32), (3, 32), (5, 32), (7, 32), (3, 32)])
    # the first size static, every later one through Dynamo's second, symbolic graph
    assert backend.compiles == 2
    assert len(pipeline_runs) == 2
    assert len(backend.dynamic()["specializations"]) == 4
    assert "dynamic shapes: symbolic" in str(fxopt.report.Report(backend.reports))


def test_without_dynamic_shapes_option_the_passes_specialize(pipeline_runs):
    torch.manual_seed(0)
    model, backend = BasicBlock(8, 8).eval(), Counting(executor="torch", dynamic_shapes=False)
    compiled = torch.compile(model, backend=backend)
    _check(compiled, model, [(1, 16), (2, 16), (3, 16)], channels=8)
    assert len(pipeline_runs) == backend.compiles >= 2  # the passes run once per Dynamo graph, as before
    assert all(not r.executor_details.get("dynamic") for r in backend.reports)
    assert all(r.executor == "torch" for r in backend.reports)


def test_lru_bound_evicts_and_lowers_again():
    torch.manual_seed(0)
    model, backend = BasicBlock(8, 8).eval(), Counting(executor="torch", max_specializations=2, dynamic_padding=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _check(compiled, model, [(2, 16), (3, 16), (4, 16), (2, 16), (4, 16), (3, 16)], channels=8)
    assert backend.compiles == 1
    info = backend.dynamic()
    assert info["live"] == 2 and info["max_specializations"] == 2
    assert info["evictions"] == 3  # 4 evicts 2, 2 evicts 3, 3 evicts 4
    lowered = {k.split(",")[0].split("=")[1]: v["lowered"] for k, v in info["specializations"].items()}
    assert lowered == {"2": 2, "3": 2, "4": 1}
    assert [v["live"] for v in info["specializations"].values()].count(True) == 2


def test_image_sizes_and_mark_dynamic(pipeline_runs):
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting(executor="torch", dynamic_padding=False)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 32, 32)
    for d in (0, 2, 3):
        torch._dynamo.mark_dynamic(x, d)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    _check(compiled, model, [(3, 40), (2, 24), (4, 48)])
    assert backend.compiles == 1 and len(pipeline_runs) == 1
    info = backend.dynamic()
    assert len(info["symbolic"]) >= 2 and len(info["specializations"]) == 4


def _train(model, compiled, batches, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        x, y = torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dynamic,compiles", [(None, 2), (True, 1)])
def test_training_smaller_last_batch(dynamic, compiles):
    """Two epochs of 8, 5 (drop_last=False), then a third size: automatic dynamic compiles the
    joint graph twice (the static first size, then the symbolic one, which serves every later size);
    dynamic=True once."""
    torch.manual_seed(0)
    model = SmallResNet()
    reference = copy.deepcopy(model)
    backend = Counting()
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    batches = [8, 5, 8, 5, 3]
    losses = _train(model, compiled, batches)
    want = _train(reference, reference, batches)
    assert backend.compiles == compiles
    assert sum(r.kind == "forward" for r in backend.reports) == compiles
    torch.testing.assert_close(losses, want, rtol=1e-3, atol=1e-3)


def test_symbolic_height_and_width_keep_every_pass_for_the_cuda_target():
    """``dynamic=True`` makes the height and width symbolic too: no convolution algorithm's legality
    is decided there, and the convolutions keep the library's (the pass failed before: every pass
    fell back, the unoptimized graph lowered per size). The graph is traced on a fake CUDA input."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    reports = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = SeedCNN2().eval()
        x = torch.empty(4, 3, 32, 32, device="cuda")
        torch.compiler.reset()
        options = {"executor": "cuda", "strict": True, "autotune_cache": False}
        with torch.no_grad():
            torch.compile(model, dynamic=True, backend=lambda gm, ex: fxopt_backend(
                gm, ex, options=options, _sink=reports) and gm.forward)(x)
    torch.compiler.reset()
    (report,) = reports
    assert report.fallback is None
    assert len(report.executor_details["dynamic"]["symbolic"]) == 2  # the batch; height and width (equal: one)
    assert report.conv_algorithms and {c.how for c in report.conv_algorithms.values()} == {"symbolic sizes"}
    assert all(c.algorithm == "direct" for c in report.conv_algorithms.values())


def test_sizes_after_the_first_take_their_values_from_stored_expressions(monkeypatch):
    """Every size is specialised from the symbolic graph's values (expressions of the batch, the
    height and width) evaluated at that size, not by FakeTensor propagation; the first size checks
    them against propagation. The values equal propagation's at every size."""
    from fxopt import package_batch

    calls = []
    real = package_batch.specialise_at
    codegen = []
    generate = torch.fx.GraphModule.recompile
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", lambda self: codegen.append(1) or generate(self))

    memos = []

    def spy(gm, args, vals=None, batch=None, fake=False, memo=None):
        codegen.clear()
        static, counts = real(gm, args, vals, batch, fake, memo)
        memos.append(memo)
        calls.append(vals is not None)
        if vals is not None:  # the same values and sizes folded as propagation gives at these sizes,
            # no code generated (the sizes folded before the module is made, whose code is generated
            # where it is first called or read: ``pipeline.module_of``)
            assert len(codegen) == 0, len(codegen)
            propagated, counts_p = real(gm, args)
            assert package_batch._vals_agree(static, propagated)
            assert counts["sizes_folded"] == counts_p["sizes_folded"] > 0 and static.code == propagated.code
        return static, counts

    monkeypatch.setattr(package_batch, "specialise_at", spy)
    torch.manual_seed(0)
    # the cpu executor compares with the unoptimized graph at every size: both graphs are made
    model, backend = SmallResNet().eval(), Counting(executor="cpu", dynamic_padding=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _check(compiled, model, [(2, 32), (3, 40), (5, 24), (4, 32)])
    assert calls == [False, False] + [True] * 6  # optimized and unoptimized graph, per size
    # one memo per graph, shared by its sizes: one FakeTensorMode, the values without a size made once
    shared = [m for m in memos if m is not None]
    assert len(shared) == 6 and len({id(m) for m in shared}) == 2
    for m in {id(m): m for m in shared}.values():
        assert m.mode is not None and m.fixed[True]
        sized = [v for v in torch.utils._pytree.tree_leaves(list(m.fixed[True].values()))
                 if isinstance(v, torch.Tensor)]
        assert all(v.fake_mode is m.mode for v in sized)
        assert sized and all(v.shape[0] != 4 or v.dim() < 4 for v in sized)  # (no batch among them)
    info = backend.dynamic()
    assert set(info["specialised_by"]) == {"unoptimized", "optimized"}
    assert all(how.startswith("stored values") for how in info["specialised_by"].values())
    assert any("values per size: " in line for line in fxopt.dynamic.summary_lines(info))


def test_stored_values_agree_where_only_strides_of_extent_one_differ():
    """A 1x1 feature map in channels_last propagates with strides (C, 1, C, C) or (C, 1, 1, 1): the
    same memory, so the stored values are used (before, a network whose last stage was 1x1 at the
    first size fell back to FakeTensor propagation for every size: 150 ms a size for resnet18)."""
    from fxopt.package_batch import _same_val

    a = torch.empty_strided((2, 512, 1, 1), (512, 1, 1, 1))
    assert _same_val(a, torch.empty_strided((2, 512, 1, 1), (512, 1, 512, 512)))
    assert not _same_val(a, torch.empty_strided((2, 512, 1, 1), (1, 2, 1, 1)))  # the channels step differs
    assert not _same_val(torch.empty(2, 4, 3, 3), torch.empty(2, 4, 3, 3).contiguous(memory_format=torch.channels_last))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
                          nn.ReLU()).eval().to(memory_format=torch.channels_last)
    backend = Counting(executor="torch", dynamic_padding=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for b, side in ((2, 4), (3, 4), (5, 3)):  # the output 1x1 at each
            x = torch.randn(b, 3, side, side).contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(compiled(x), model(x))
    assert all(how.startswith("stored values") for how in backend.dynamic()["specialised_by"].values())


@pytest.mark.parametrize("executor", ["torch", "cpu"])
def test_a_symbolic_graph_traced_at_batch_1_keeps_the_batch_symbolic(executor):
    """Under backed_size_oblivious Dynamo hands over the symbolic graph traced at batch 1: the batch
    stays a symbol in fxopt's own shape environment (once it was specialized to 1 there, so the values
    stored for every other size were batch 1's: batch 8 then ran the generated C of batch 1 past its
    buffers, a heap corruption). Every size equals eager."""
    import torch.fx.experimental._config as fc

    torch.manual_seed(0)
    model = SmallResNet().eval()
    backend = Counting(executor=executor)
    with fc.patch(backed_size_oblivious=True):
        compiled = torch.compile(model, backend=backend)
        _check(compiled, model, [(7, 32), (1, 32), (8, 32), (3, 32), (1, 32)])
    info = backend.dynamic()
    assert any("traced at 1" in d for d in info["symbolic"]), info["symbolic"]
    assert all(how.startswith("stored values") for how in info["specialised_by"].values())


def test_comparing_strides_guards_no_symbolic_size():
    """``same_strides`` on symbolic sizes adds no guard to their shape environment: a symbolic size is
    not taken to be 1, symbolic strides agree where they are the same expression. Comparing an
    output's strides once guarded ``Ne(batch, 1)``, and batch 1 ran the pass pipeline again."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fxopt.eager_formats import same_strides

    env = ShapeEnv(duck_shape=False, specialize_zero_one=False)
    b = env.create_symintnode(env.create_symbol(6, ConstantSource("b")), hint=6)
    assert same_strides((b, 1000), (1000, 1), (1000, 1))
    assert not same_strides((b, 1000), (1000, 1), (1, 6))  # differs where the batch may be > 1
    assert same_strides((b, 4, 1, 1), (4 * b, 1, 1, 1)[::-1][::-1], (4 * b, 1, 1, 1))
    assert same_strides((2, 1, 3), (3, 7, 1), (3, 1, 1))  # a dimension of size 1: any stride
    assert not env.guards, [str(g.expr) for g in env.guards]


def test_batch_1_of_a_symbolic_graph_runs_no_pass_again():
    """Batch 1 of a symbolic graph traced at 6 is lowered from it like any size (the torch executor:
    no convolution's fake guards the batch there)."""
    import torch.fx.experimental._config as fc

    torch.manual_seed(0)
    model = SmallResNet().eval()
    backend = Counting(executor="torch", dynamic_padding=False)
    with fc.patch(backed_size_oblivious=True):
        compiled = torch.compile(model, backend=backend)
        _check(compiled, model, [(6, 32), (5, 32), (1, 32), (2, 32)])
    info = backend.dynamic()
    assert info["pipeline_runs"] == 1, info
    assert not any("> 1" in g or "Ne(" in g for g in info["guards"]), info["guards"]  # (s48 < 16: CPU conv's)
    assert not any("passes ran again" in str(rec.get("note", "")) for rec in info["specializations"].values())


def test_a_size_makes_the_unoptimized_graph_only_where_it_is_run(monkeypatch):
    """A size's unoptimized graph (the never-slower baseline) is deferred: the torch executor, which
    compares with no baseline, never makes it; it is made (once) where asked."""
    from fxopt import package_batch
    from fxopt.backends.lowering import DeferredGraph

    made = []
    real = package_batch.specialise_at
    monkeypatch.setattr(package_batch, "specialise_at", lambda gm, *a, **k: made.append(gm) or real(gm, *a, **k))
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting(executor="torch", dynamic_padding=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _check(compiled, model, [(2, 32), (3, 40), (5, 24)])
    info = backend.dynamic()
    assert set(info["specialised_by"]) == {"optimized"}  # the unoptimized graph never made
    assert len(made) == 3 and len({id(g) for g in made}) == 1

    # where it is made (the cpu executor compares with it at every size): the parameters are the
    # model's own, the batch a stand-in of its shape (the call's batch is not kept alive for it)
    seen, batches = [], []
    monkeypatch.setattr(package_batch, "specialise_at",
                        lambda gm, args, *a, **k: seen.append((gm, args)) or real(gm, args, *a, **k))
    torch._dynamo.reset()
    backend = Counting(executor="cpu", dynamic_padding=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for b in (2, 3, 5):
        x = torch.randn(b, 3, 32, 32)
        batches.append(x)  # kept alive: no stand-in can take its memory
        with torch.no_grad():
            compiled(x)
    ptrs = {p.data_ptr() for p in model.parameters()}
    before = [r.before for r in backend.reports if r.executor_details.get("dynamic")][0]
    deferred = [a for gm, a in seen if gm is before]  # the unoptimized graph's specialisations
    tensors = [t for a in deferred for t in a if isinstance(t, torch.Tensor)]
    assert len(deferred) >= 2 and any(t.data_ptr() in ptrs for t in tensors)
    assert not any(t.data_ptr() in {x.data_ptr() for x in batches} for t in tensors)

    calls = []
    lazy = DeferredGraph(lambda: calls.append(1) or "graph", like=None, ident="x")
    assert calls == [] and lazy.get() == "graph" and lazy.get() == "graph" and calls == [1]


def test_size_expressions_of_several_symbols():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fxopt.serialize import _val_from_json, _val_json, eval_size

    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.empty(2, 3, 5, 7), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.DYNAMIC]))
    names = tuple(str(d.node.expr) for d in (x.shape[0], x.shape[2], x.shape[3]))
    with mode:
        y = x.reshape(x.shape[0], -1).contiguous()
    v = _val_json(y, names)
    assert v is not None and _val_json(y, names[0]) is None  # one symbol named: the others cannot be written
    t = _val_from_json(v, None, {"B0": 4, "B1": 6, "B2": 9})
    assert t.shape == (4, 3 * 6 * 9) and t.stride() == (3 * 6 * 9, 1) and t.device.type == "meta"
    z = _val_json(x, names)
    assert z[1][0] in ("3*B1*B2", "3*B2*B1")
    with mode:
        piece = y[:, 2:]  # a view at an offset: the offset is kept (as an expression too)
    p = _val_json(piece, names)
    assert len(p) == 6 and _val_from_json(p, None, {"B0": 4, "B1": 6, "B2": 9}).storage_offset() == 2
    assert eval_size("3*B1**2", {"B1": 5}) == 75 and eval_size("B*2", 3) == 6
    with pytest.raises(ValueError):
        eval_size("B**99", 2)  # an exponent no size has
    with pytest.raises(ValueError):
        eval_size("B0 + C", {"B0": 1})


def test_stored_values_rebuild_as_the_fake_tensors_the_mode_makes():
    """A size's stored values rebuilt as FakeTensors (the quick way: meta tensors wrapped on their
    device) are those ``empty_strided`` under the mode makes: sizes, strides, dtype, device, grad, mode;
    ops run on them; under an active mode, and for a view at an offset, the mode makes them itself."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from fxopt.serialize import _val_from_json

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    stored = [[["B", 64, 7, 7], [3136, 1, 448, 64], "float16", "cuda:0", False],
              [[4, "2*B"], ["2*B", 1], "float32", "cpu", True]]
    for v in stored:
        quick = _val_from_json(v, mode, 3)
        with mode:
            slow = _val_from_json(v, mode, 3)  # a mode active: made under it
            made = torch.empty_strided(quick.shape, quick.stride(), dtype=quick.dtype, device=quick.device)
        for t in (quick, slow):
            assert type(t) is FakeTensor and t.fake_mode is mode
            assert (t.shape, t.stride(), t.dtype, t.device, t.requires_grad) == \
                (made.shape, made.stride(), made.dtype, made.device, v[4])
        with mode:
            assert (quick + slow).shape == quick.shape
    view = _val_from_json([[2, 3], [3, 1], "float32", "cpu", False, 5], mode, None)
    assert type(view) is FakeTensor and view.storage_offset() == 5


def test_a_size_that_breaks_a_guard_of_the_passes_runs_them_again_from_propagated_values(monkeypatch):
    """A pass that reads the batch as an int (here: the wrapper, after the pipeline) pins the symbol to
    the traced size in fxopt's shape environment; every other size then runs the passes again, from
    the unoptimized graph specialised by FakeTensor propagation (the stored expressions hold only where
    no such guard fails) and gives eager's results."""
    real = fxopt.pipeline.run_pipeline
    pinned = []

    def pinning(gm, ctx, dump_prefix=""):
        out = real(gm, ctx, dump_prefix=dump_prefix)
        if not pinned:
            v = next(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"
                     and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 4
                     and isinstance(n.meta["val"].shape[0], torch.SymInt))
            pinned.append(int(v.shape[0]))  # a guard: the batch is what it was traced at
        return out

    monkeypatch.setattr(fxopt.pipeline, "run_pipeline", pinning)
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting(executor="torch", dynamic_padding=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _check(compiled, model, [(2, 32), (3, 32), (5, 32), (2, 32)])
    info = backend.dynamic()
    assert pinned == [2] and info["pipeline_runs"] == 3  # once symbolic, again at 3 and at 5
    notes = [rec.get("note") or "" for rec in info["specializations"].values()]
    assert sum("passes ran again" in n for n in notes) == 2


def test_kernels_generated_once_across_sizes_and_keyed_exactly():
    """Kernel sources that name no size (a Winograd transform, a conv epilogue) are generated once:
    a symbolic graph's later sizes reuse them. The key is exact: parameters equal as values but
    written differently (-0.0 and 0.0, 1 and 1.0) get sources of their own."""
    from fxopt.backends.cuda.codegen.source import made_once
    from fxopt.backends.cuda.kernels import conv_epilogue, winograd

    made = []
    gen = made_once(lambda v, dtype=torch.float16: made.append(v) or f"src {v!r} {dtype}")
    assert gen(0.0) is gen(0.0) and gen(-0.0) == "src -0.0 torch.float16" and gen(1) != gen(1.0)
    assert gen(True) == "src True torch.float16" and gen(0.0, dtype=torch.float32) != gen(0.0)
    assert [repr(v) for v in made] == ["0.0", "-0.0", "1", "1.0", "True", "0.0"]

    caches = [winograd.generate_winograd_output_transform.cache, conv_epilogue.generate_conv_epilogue.cache]
    for c in caches:
        c.clear()
    torch.manual_seed(0)
    model = SmallResNet().eval()
    backend = Counting(executor="cuda", emulate_kernels=True, dynamic_padding=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _check(compiled, model, [(2, 32), (3, 32)])
    sizes = [len(c) for c in caches]
    assert sizes[1] > 0  # the epilogues of the convolutions were generated
    _check(compiled, model, [(5, 32), (4, 40)])
    assert backend.dynamic()["live"] >= 3 and [len(c) for c in caches] == sizes  # nothing generated anew
    before = {id(ks) for ks in caches[1].values()}
    _check(compiled, model, [(6, 40)])  # its expanded block's output passes 1 MiB: the wider geometry
    new = [ks.name for ks in caches[1].values() if id(ks) not in before]
    assert new and not any("_b128" in n for n in new), new  # only epilogues of the other geometry
