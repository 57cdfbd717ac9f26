"""The backend contract: registration, options, fallback, errors, dtypes, dynamic shapes, training."""
import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.testing import SeedCNN, SeedCNN2, SmallResNet


def test_backend_registered_without_import():
    code = ("import torch, torch._dynamo; assert 'fxopt' in torch._dynamo.list_backends(exclude_tags=()); "
            "import sys; assert 'fxopt' not in sys.modules or True; "
            "m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval(); x = torch.randn(1, 3, 8, 8)\n"
            "with torch.no_grad(): torch.testing.assert_close(torch.compile(m, backend='fxopt')(x), m(x))\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok" in out.stdout


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError, match="valid options are: .*conv_algorithm"):
        fxopt.Options.from_any({"no_such_option": 1})
    m = SeedCNN().eval()
    compiled = torch.compile(m, backend="fxopt", options={"colour": "blue"})
    with pytest.raises(Exception, match="unknown option.*'colour'"):
        with torch.no_grad():
            compiled(torch.randn(1, 3, 32, 32))


@pytest.mark.parametrize("name", ["fusion", "fast_math", "compile_cache", "cpu_onnxruntime", "cudnn_search"])
def test_switch_options_take_only_booleans(name):
    with pytest.raises(ValueError, match=f"{name} must be True or False"):
        fxopt.Options.from_any({name: "yes"})
    assert getattr(fxopt.Options.from_any({name: True}), name) is True


def test_unknown_pass_name_rejected():
    with pytest.raises(ValueError, match="unknown pass name"):
        fxopt.Options.from_any({"disable": ["fold_everything"]}, fxopt.PASS_NAMES)
    compiled = torch.compile(SeedCNN().eval(), backend="fxopt", options={"passes": ["fold_everything"]})
    with pytest.raises(Exception, match="unknown pass name.*'passes'"):
        with torch.no_grad():
            compiled(torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="unknown pass name"):
        fxopt.explain(SeedCNN().eval(), torch.randn(1, 3, 32, 32), options={"disable": ["fold_everything"]})


@pytest.mark.parametrize("model_cls", [SeedCNN, SeedCNN2, SmallResNet])
def test_reference_models_batches(model_cls):
    m = model_cls().eval()
    compiled = torch.compile(m, backend="fxopt")
    with torch.no_grad():
        for batch in (1, 2, 3, 8):
            x = torch.randn(batch, 3, 32, 32)
            torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)


def test_disable_and_passes_options():
    m = SmallResNet().eval()
    x = torch.randn(1, 3, 32, 32)
    r = fxopt.explain(m, x, options={"disable": ["fold_batchnorm"]})
    assert "aten._native_batch_norm_legit_no_training.default" in r.op_counts_after
    assert next(p for p in r.passes if p.name == "fold_batchnorm").status == "disabled"
    r = fxopt.explain(m, x, options={"passes": ["fold_batchnorm"]})
    assert [p.name for p in r.passes if p.status == "ran"] == ["fold_batchnorm"]


def _broken_pass(gm, ctx):
    raise RuntimeError("deliberate failure")


def test_failing_pass_warns_and_falls_back(monkeypatch):
    from fxopt import pipeline

    monkeypatch.setattr(pipeline, "PIPELINE", pipeline.PIPELINE[:2] + [("fuse_conv_epilogue", _broken_pass)])
    m = SmallResNet().eval()
    x = torch.randn(2, 3, 32, 32)
    compiled = torch.compile(m, backend="fxopt")
    with pytest.warns(fxopt.FxoptFallbackWarning, match="pass 'fuse_conv_epilogue' failed.*deliberate failure") as w:
        with torch.no_grad():
            got = compiled(x)
    assert len([x for x in w if issubclass(x.category, fxopt.FxoptFallbackWarning)]) == 1
    with torch.no_grad():
        torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-6)
    r = fxopt.explain(m, x)
    assert r.fallback and "fuse_conv_epilogue" in r.fallback


def _failing_at_run_time(monkeypatch):
    import fxopt.backends as backends

    real = backends.lower

    def lower(gm, ctx, kind):
        lowered = real(gm, ctx, kind)

        def broken(*args):
            raise RuntimeError("deliberate run-time failure")
        lowered.fn = broken
        return lowered
    monkeypatch.setattr(backends, "lower", lower)


def test_a_compiled_graph_failing_at_run_time_falls_back_to_eager_ops_once(monkeypatch):
    _failing_at_run_time(monkeypatch)
    m, x = SmallResNet().eval(), torch.randn(2, 3, 32, 32)
    graphs = []
    compiled = fxopt.testing.compile_with_fxopt(m, None, graphs)
    with pytest.warns(fxopt.FxoptFallbackWarning, match="failed at run time.*deliberate run-time failure") as w:
        with torch.no_grad():
            got = compiled(x)
    assert len([x for x in w if issubclass(x.category, fxopt.FxoptFallbackWarning)]) == 1
    with torch.no_grad():
        torch.testing.assert_close(got, m(x))
        with warnings.catch_warnings():
            warnings.simplefilter("error", fxopt.FxoptFallbackWarning)  # later calls: eager ops, silently
            torch.testing.assert_close(compiled(x * 2), m(x * 2))
    assert "deliberate run-time failure" in graphs[0].executor_details["runtime_fallback"]


def test_a_compiled_graph_failing_at_run_time_raises_when_strict(monkeypatch):
    _failing_at_run_time(monkeypatch)
    compiled = torch.compile(SmallResNet().eval(), backend="fxopt", options={"strict": True})
    with pytest.raises(Exception, match="deliberate run-time failure"):
        with torch.no_grad():
            compiled(torch.randn(2, 3, 32, 32))


def test_inputs_eager_rejects_too_get_eagers_error_and_keep_the_compiled_graph():
    class Gather(nn.Module):
        def forward(self, x, idx):
            return torch.relu(x).gather(1, idx) * 2

    m, x = Gather().eval(), torch.randn(2, 4)
    graphs = []
    compiled = fxopt.testing.compile_with_fxopt(m, None, graphs)
    good, bad = torch.tensor([[0, 1], [2, 3]]), torch.tensor([[0, 1], [2, 9]])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, good), m(x, good))
        with pytest.raises(RuntimeError) as want:
            m(x, bad)
        with warnings.catch_warnings():
            warnings.simplefilter("error", fxopt.FxoptFallbackWarning)
            with pytest.raises(RuntimeError) as got:
                compiled(x, bad)
    assert str(got.value) == str(want.value)
    assert "runtime_fallback" not in graphs[0].executor_details


class _NormChain(torch.nn.Module):
    """LayerNorm over channels, then GroupNorm and InstanceNorm: on the CPU, torch's metadata for
    group_norm (contiguous) and its kernel (channels_last kept) disagree, and a view AOTAutograd
    planned on the metadata fails at run time, aot_eager too."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(2, elementwise_affine=False)
        self.gn, self.inorm = torch.nn.GroupNorm(1, 2, affine=False), torch.nn.InstanceNorm2d(2)

    def forward(self, x):
        return self.inorm(self.gn(self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)))


def test_models_that_torchs_own_metadata_breaks_still_give_eagers_result():
    m, x = _NormChain().eval(), torch.randn(2, 2, 3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxopt.FxoptFallbackWarning)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(m, backend="fxopt")(x), m(x))


def test_failing_pass_strict_raises(monkeypatch):
    from fxopt import pipeline

    monkeypatch.setattr(pipeline, "PIPELINE", [("fold_batchnorm", _broken_pass)])
    with pytest.raises(Exception, match="deliberate failure"):
        fxopt.explain(SmallResNet().eval(), torch.randn(1, 3, 32, 32), options={"strict": True})


def _wrong_pass(gm, ctx):
    from torch.fx.passes.infra.pass_base import PassResult

    out = next(n for n in gm.graph.nodes if n.op == "output")
    val = out.args[0][0]
    with gm.graph.inserting_before(out):
        doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (val, 2.0))
    out.args = ((doubled,),)
    gm.recompile()
    return PassResult(gm, True)


def test_verify_names_the_pass_that_changed_the_result(monkeypatch):
    from fxopt import pipeline

    monkeypatch.setattr(pipeline, "PIPELINE", pipeline.PIPELINE[:2] + [("layout", _wrong_pass)])
    m = SeedCNN2().eval()
    x = torch.randn(2, 3, 32, 32)
    with pytest.warns(fxopt.FxoptFallbackWarning, match="pass 'layout'.*differs from eager"):
        r = fxopt.explain(m, x, options={"verify": True})
    assert next(p for p in r.passes if p.name == "layout").status == "mismatch"
    with pytest.raises(Exception, match="layout.*differs"):
        fxopt.explain(m, x, options={"verify": True, "strict": True})


def test_dump_dir_writes_readable_graphs(tmp_path):
    dump = tmp_path / "dump"
    fxopt.explain(SeedCNN().eval(), torch.randn(1, 3, 32, 32), options={"dump_dir": str(dump)})
    names = sorted(os.listdir(dump))
    assert names[0] == "inference_000_input.py"
    # one file per pass in pipeline order, numbered after the input
    i = 1 + fxopt.PASS_NAMES.index("fuse_conv_epilogue")
    assert f"inference_{i:03d}_fuse_conv_epilogue.py" in names
    assert "fused_conv" in (dump / f"inference_{i:03d}_fuse_conv_epilogue.py").read_text()


def test_unknown_ops_pass_through():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x, grid):
            y = F.grid_sample(torch.relu(self.conv(x)), grid, align_corners=False)
            return torch.fft.rfft2(y).abs()

    m = M().eval()
    x, grid = torch.randn(2, 2, 8, 8), torch.rand(2, 5, 5, 2) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(m, backend="fxopt")(x, grid), m(x, grid), rtol=1e-4, atol=1e-5)


def test_bad_input_raises_like_eager():
    m = SeedCNN().eval()
    compiled = torch.compile(m, backend="fxopt")
    bad = torch.randn(1, 4, 32, 32)  # 4 channels instead of 3
    with torch.no_grad():
        with pytest.raises(RuntimeError) as eager_err:
            m(bad)
        with pytest.raises(RuntimeError) as fx_err:
            compiled(bad)
    assert isinstance(fx_err.value, type(eager_err.value)) or isinstance(fx_err.value, RuntimeError)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtypes(dtype):
    from fxopt.tolerances import tolerance

    m = SmallResNet().eval().to(dtype)
    x = torch.randn(2, 3, 32, 32, dtype=dtype)
    rtol, atol = tolerance(dtype)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(m, backend="fxopt")(x), m(x), rtol=rtol, atol=atol * 10)


def test_autocast_region():
    m = SmallResNet().eval()
    x = torch.randn(2, 3, 32, 32)
    compiled = torch.compile(m, backend="fxopt")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x), m(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


def test_training_step_gradients_match():
    m = SmallResNet().train()
    m2 = copy.deepcopy(m)
    compiled = torch.compile(m2, backend="fxopt")
    x = torch.randn(4, 3, 32, 32)
    m(x).square().mean().backward()
    compiled(x).square().mean().backward()
    for (name, p), p2 in zip(m.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p2.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda s: f"{name}: {s}")
    for (name, b), b2 in zip(m.named_buffers(), m2.buffers()):
        torch.testing.assert_close(b2, b, msg=lambda s: f"{name}: {s}")


def _buffers_written_in_place(gm) -> set:
    return {n.args[0].name for n in gm.graph.nodes if n.op == "call_function"
            and n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder"}


def test_training_forward_writes_the_buffers_and_inference_graphs_return_them():
    """A training forward updates BatchNorm's running statistics itself (AOTAutograd keeps the
    copy_ into each buffer in the graph: no outputs to copy back per buffer and call); an
    inference graph (no_grad) returns them for AOTAutograd to copy back, so the CPU executor's
    timing runs cannot write them. Either way the buffers are eager's after every call."""
    from fxopt.backend import fxopt_backend

    torch.manual_seed(0)
    m = SmallResNet().train()
    ref = copy.deepcopy(m)
    reports: list = []
    compiled = torch.compile(m, backend=lambda gm, ex: fxopt_backend(gm, ex, _sink=reports))
    x = torch.randn(4, 3, 32, 32)
    for step in range(3):
        for model in (compiled, ref):
            model(x).square().mean().backward()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-4, atol=1e-5)
        for (name, b), b2 in zip(ref.named_buffers(), m.buffers()):
            torch.testing.assert_close(b2, b, msg=lambda s: f"step {step} {name}: {s}")
    forward = next(r for r in reports if r.kind == "forward")
    inference = next(r for r in reports if r.kind == "inference")
    assert len(_buffers_written_in_place(forward.after)) == len(list(m.buffers()))
    assert not _buffers_written_in_place(inference.after)


def test_training_forward_that_writes_its_buffers_is_fused_by_the_cuda_executor():
    """The copy_ into the buffers at the end of a training forward leaves the rest of the graph to
    the fusion scheduler (regions with the ReLUs and residual adds); on the CPU the regions run as
    their references, the buffers and gradients as eager's."""
    from fxopt.backend import fxopt_backend

    torch.manual_seed(0)
    m = SmallResNet().train()
    ref = copy.deepcopy(m)
    reports: list = []
    compiled = torch.compile(m, backend=lambda gm, ex: fxopt_backend(gm, ex, options={"executor": "cuda"},
                                                                     _sink=reports))
    x = torch.randn(4, 3, 32, 32)
    for step in range(2):
        for model in (compiled, ref):
            model.zero_grad()
            model(x).square().mean().backward()
        for (name, b), b2 in zip(ref.named_buffers(), m.buffers()):
            torch.testing.assert_close(b2, b, msg=lambda s: f"step {step} {name}: {s}")
        for (name, p), p2 in zip(ref.named_parameters(), m.parameters()):
            torch.testing.assert_close(p2.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda s: f"{name}.grad: {s}")
    forward = next(r for r in reports if r.kind == "forward")
    assert len(_buffers_written_in_place(forward.after)) == len(list(m.buffers()))
    fused_ops = {op for k in forward.kernels for op in k.ops}
    assert "aten.relu.default" in fused_ops, forward.executor_details.get("unfused")
    assert not any("in place" in why for why in forward.executor_details["unfused"].values())


def test_option_executor_auto_is_the_cuda_executor_for_every_cuda_graph():
    from fxopt.backends import resolve_executor

    assert [resolve_executor("auto", "cuda", k) for k in ("inference", "forward", "backward")] == ["cuda"] * 3
    assert [resolve_executor("auto", "cpu", k) for k in ("inference", "forward", "backward")] == ["cpu", "torch", "torch"]
    assert resolve_executor("torch", "cuda", "forward") == "torch"


def test_train_eval_switch():
    m = SmallResNet()
    ref = copy.deepcopy(m)
    compiled = torch.compile(m, backend="fxopt")
    x = torch.randn(4, 3, 32, 32)
    for mode in ("eval", "train", "eval", "train", "eval"):
        m.train(mode == "train")
        ref.train(mode == "train")
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-4, atol=1e-5)
        for b, b2 in zip(m.buffers(), ref.buffers()):
            torch.testing.assert_close(b, b2)


def test_load_state_dict_is_seen():
    m = SmallResNet().eval()
    compiled = torch.compile(m, backend="fxopt")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        compiled(x)
        new = SmallResNet().eval()
        m.load_state_dict(new.state_dict())
        torch.testing.assert_close(compiled(x), new(x), rtol=1e-4, atol=1e-5)


def test_explain_report_api():
    r = fxopt.explain(SmallResNet().eval(), torch.randn(1, 3, 32, 32))
    assert isinstance(r.before, torch.fx.GraphModule) and isinstance(r.after, torch.fx.GraphModule)
    assert [p.name for p in r.passes] == list(fxopt.PASS_NAMES)
    assert r.op_counts_before["aten.convolution.default"] == 9
    assert r.op_counts_after["fxopt.fused_conv.default"] == 9
    json.dumps(r.to_dict())
    text = str(r)
    assert "fold_batchnorm" in text and "fused_conv" in text and "changed" in text


def test_cli_explain_json():
    out = subprocess.run([sys.executable, "-m", "fxopt.cli", "explain", "fxopt.testing.models:SeedCNN2",
                          "--shape", "1,3,32,32", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert data["op_counts_after"]["fxopt.fused_conv.default"] == 2


def test_inference_graphs_are_called_without_the_aot_wrapper_where_it_does_nothing():
    from fxopt.testing import compile_with_fxopt
    from fxopt.testing.models import SeedCNN

    m = SeedCNN().eval()
    x = torch.randn(2, 3, 32, 32)
    graphs = []
    compiled = compile_with_fxopt(m, None, graphs)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x))
    assert graphs[0].executor_details["aot_runtime_wrapper"] == "skipped (direct call)"
    y = compiled(x)  # grad mode changed: recompiled as a training graph, gradients flow
    assert y.requires_grad and [g.kind for g in graphs][1:] == ["forward"]
    y.sum().backward()
    assert m.conv1.weight.grad is not None

    graphs = []
    with torch.no_grad():
        compile_with_fxopt(m, {"direct_call": False}, graphs)(x)
    assert "aot_runtime_wrapper" not in graphs[0].executor_details


def test_graphs_returning_views_of_inputs_keep_the_aot_wrapper():
    from fxopt.testing import compile_with_fxopt

    class ViewOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.conv(x), x[:, :1]

    m = ViewOut().eval()
    x = torch.randn(1, 3, 8, 8)
    graphs = []
    with torch.no_grad():
        got = compile_with_fxopt(m, None, graphs)(x)
    assert graphs[0].executor_details["aot_runtime_wrapper"] == "outputs alias"
    assert got[1]._base is x or got[1].data_ptr() == x.data_ptr()  # still a view of the input
    torch.testing.assert_close(got[0], m(x)[0])


def test_parameters_frozen_also_with_inductors_global_freezing_flag():
    """With torch._inductor.config.freezing set, Dynamo keeps parameters as graph attributes and
    AOTAutograd lifts them in front of the inputs: fxopt still folds them as constants (and sees a
    weight changed in place)."""
    import torch._inductor.config as inductor_config

    from fxopt.testing import SmallResNet, compile_with_fxopt

    model = SmallResNet().eval()
    x = torch.randn(2, 3, 32, 32)
    graphs = []
    with inductor_config.patch(freezing=True), torch.no_grad():
        fast = compile_with_fxopt(model, None, graphs)
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
        (g,) = graphs
        folding = next(p for p in g.passes if p.name == "fold_constants")
        assert folding.changed, folding.notes
        bn = next(p for p in g.passes if p.name == "fold_batchnorm")
        assert bn.changed, bn.notes
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)


def test_the_executor_reports_a_typed_record_and_executor_details_is_its_view():
    """The executor contract: ``lower`` returns a ``Lowered`` whose typed fields the report reads;
    ``executor_details`` stays the mapping of string keys it was, over the same record."""
    from fxopt.lowered import Lowered

    m, x = SmallResNet().eval(), torch.randn(2, 3, 32, 32)
    graphs = []
    compiled = fxopt.testing.compile_with_fxopt(m, {"cpu_onnxruntime": False}, graphs)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-4)
    g = graphs[0]
    low = g.lowered
    assert isinstance(low, Lowered) and low.executor == g.executor == "cpu" and low.cudagraphs == g.cudagraphs
    assert low.cpu_runner is not None and g.executor_details["cpu_runner"] is low.cpu_runner
    assert low.cudagraph_runner is None and "cudagraph_runner" not in g.executor_details
    assert g.executor_details["onednn"] is low.details["onednn"] and low.baseline_check is True
    g.executor_details["note"] = "x"  # writing a key that is no field lands in details
    assert low.details["note"] == "x" and dict(g.executor_details)["note"] == "x"
    assert fxopt.report.Report(graphs).to_dict()["graphs"][0]["executor_details"]["note"] == "x"


def test_lowered_views_run_as_reshapes_on_strides_other_than_traced():
    """A view traced on contiguous strides meets a channels_last value at run time (GPU fuzz seeds 41,
    51, 63): the runnable graph runs it as a reshape, the same view where the strides allow one."""
    from fxopt.backends import torch_ref

    g = fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(torch.ops.aten.view.default, (x, [2, 48])),))
    runnable = torch_ref.lower(fx.GraphModule(torch.nn.Module(), g))
    cl = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        cl.view(2, 48)
    (got,) = runnable(cl)
    torch.testing.assert_close(got, cl.reshape(2, 48), rtol=0, atol=0)
    plain = torch.randn(2, 3, 4, 4)
    (same,) = runnable(plain)
    assert same.data_ptr() == plain.data_ptr()  # where the strides allow it: the view itself


def test_group_norm_gradient_runs_on_a_channels_last_gradient():
    """The lowered graph hands GroupNorm's gradient its ``dY`` and ``X`` contiguous: ATen's CUDA
    kernel views them as NCHW (GPU fuzz c0a961fbcc, fp16 training, [1, 2, 1, 2]: "view size is not
    compatible"); the values are those of the op on the tensors as they were."""
    import torch.fx as fx

    from fxopt.backends.torch_ref import group_norm_backward_nchw, lower

    aten = torch.ops.aten
    g = fx.Graph()
    dy, x, mean, rstd, w = (g.placeholder(n) for n in ("dy", "x", "mean", "rstd", "w"))
    out = g.call_function(aten.native_group_norm_backward.default, (dy, x, mean, rstd, w, 2, 4, 6, 2,
                                                                     [True, True, True]))
    g.output(out)
    runnable = lower(fx.GraphModule(torch.nn.Module(), g))
    assert [n.target for n in runnable.graph.nodes if n.op == "call_function"] == [group_norm_backward_nchw]
    xs = torch.randn(2, 4, 2, 3)
    dys = torch.randn(2, 4, 2, 3).contiguous(memory_format=torch.channels_last)
    _, mean_, rstd_ = aten.native_group_norm.default(xs, None, None, 2, 4, 6, 2, 1e-5)
    weight = torch.rand(4)
    got = runnable(dys, xs, mean_, rstd_, weight)
    want = aten.native_group_norm_backward.default(dys.contiguous(), xs, mean_, rstd_, weight, 2, 4, 6, 2,
                                                   [True, True, True])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_group_norm_gradient_on_the_cpu_gets_the_layout_eagers_formula_gives():
    """On the CPU eager's gradient formula hands GroupNorm's backward ``dY`` and ``X`` dense in the
    format ``X`` suggests (channels_last stays), and its kernel sums in that layout's order: the
    lowered graph's gradients equal eager's bit for bit (a contiguous copy sums otherwise; under
    bfloat16 autocast, where GroupNorm runs in float32, a step's bias gradient went from 0.05 to 0.43
    off: CPU fuzz e171964d6b)."""
    from fxopt.backends.torch_ref import group_norm_backward_nchw

    gen = torch.Generator().manual_seed(0)
    for fmt in (torch.channels_last, torch.contiguous_format):
        x = (torch.randn(8, 12, 7, 5, generator=gen) * 3).contiguous(memory_format=fmt)
        w, b = torch.rand(12, generator=gen), torch.randn(12, generator=gen)
        dy = torch.randn(8, 12, 7, 5, generator=gen).contiguous(memory_format=fmt)
        xe, we, be = (t.clone().requires_grad_(True) for t in (x, w, b))
        torch.nn.functional.group_norm(xe, 3, we, be, 1e-5).backward(dy)
        _, mean, rstd = torch.ops.aten.native_group_norm.default(x, w, b, 8, 12, 35, 3, 1e-5)
        got = group_norm_backward_nchw(dy, x, mean, rstd, w, 8, 12, 35, 3, [True, True, True])
        for g, want in zip(got, (xe.grad, we.grad, be.grad)):
            assert torch.equal(g, want), fmt
