"""The joint passes' layouts against what the CUDA kernels take at run time (GPU fuzz 9785f6078b,
349ac6a1e1, 5bf7573163, 4671d707b6: fp16 training on ``[1, 2, 1, 2]`` raised "view size is not
compatible" and "Expected X.is_contiguous(memory_format)"): checked on fake CUDA tensors, the
values on the CPU; the reproducers' programs themselves run on the GPU in ``test_fuzz_reproducers.py``."""
import copy

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fxopt.config import Options
from fxopt.fakeprop import view_problem
from fxopt.pipeline import run_joint_pipeline

aten = torch.ops.aten
F16, CL = torch.float16, torch.channels_last


def _record(records, name="training_layout"):
    return {r.name: r for r in records}[name]


def test_view_problem_is_atens_view_where_fake_tensors_are_laxer():
    """A ``[1, 2, 1, 2]`` channels_last value viewed as ``[1, 4]``: ATen refuses (the channels and
    the width are not adjacent in memory), FakeTensor's view (torch's reference) let it through."""
    def f(x):
        return aten.view(aten.abs(x), [1, 4])

    with FakeTensorMode():
        cl = make_fx(f)(torch.empty(1, 2, 1, 2, device="cuda").contiguous(memory_format=CL))
        nchw = make_fx(f)(torch.empty(1, 2, 1, 2, device="cuda"))
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        torch.empty_strided((1, 2, 1, 2), (4, 1, 4, 2)).view(1, 4)
    assert "view size is not compatible" in view_problem(cl)
    assert view_problem(nchw) is None
    cl.graph.lint()
    x = torch.randn(1, 2, 1, 2)
    torch.testing.assert_close(nchw(x), x.abs().reshape(1, 4))


def _joint(shape, head: str):
    """A joint-like fp16 graph: autocast's casts into two 1x1 convolutions, then ``head``:
    ``"view"`` (flatten into a linear head, 9785f6078b) or ``"group_norm"`` (GroupNorm in float32
    and its gradient, 5bf7573163 / 349ac6a1e1)."""
    n, c, h, w = shape

    def f(w1, w2, x, g):
        c1 = aten.convolution(aten._to_copy(x, dtype=F16), aten._to_copy(w1, dtype=F16), None,
                              [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
        c2 = aten.convolution(aten.abs(c1), aten._to_copy(w2, dtype=F16), None, [1, 1], [0, 0], [1, 1], False,
                              [0, 0], 1)
        if head == "view":
            return (aten.view(aten.abs(c2), [n, c * h * w]),)
        x32 = aten._to_copy(c2, dtype=torch.float32)
        y, mean, rstd = aten.native_group_norm(x32, None, None, n, c, h * w, 1, 1e-5)
        gx = aten.native_group_norm_backward(g, x32, mean, rstd, None, n, c, h * w, 1, [True, False, False])[0]
        return y, gx

    def make(device, fmt=torch.contiguous_format):
        g = torch.randn(shape, device=device).contiguous(memory_format=fmt)
        return [torch.randn(c, c, 1, 1, device=device), torch.randn(c, c, 1, 1, device=device),
                torch.randn(shape, device=device), g]

    with FakeTensorMode():
        args = make("cuda")
        gm = make_fx(f)(*args)
    return f, gm, args, make


@pytest.mark.parametrize("shape", [(1, 2, 1, 2), (2, 4, 1, 1), (2, 4, 3, 3)])
def test_training_layout_turns_views_into_reshapes(shape):
    """A flatten of a channels_last activation: with a one-pixel height between the merged channels
    and width FakeTensor propagates the view and ATen's kernel refuses it; at 3x3 propagation
    fails. The pass applies and the flatten becomes a reshape (the view where the strides allow
    it, else one copy), so no view is left for the run to refuse, whatever strides the kernels
    give size-1 dimensions; the values are the NCHW graph's."""
    f, gm, args, make = _joint(shape, "view")
    out, records = run_joint_pipeline(gm, args, Options())
    rec = _record(records)
    assert rec.changed, rec.notes
    assert any("view(s) made reshapes" in n for n in rec.notes), rec.notes
    casts = [n for n in out.graph.nodes if n.target is aten._to_copy.default]
    assert all("memory_format" in n.kwargs for n in casts)
    assert not any(n.target in (aten.view.default, aten._unsafe_view.default) for n in out.graph.nodes)
    out.graph.lint()
    assert view_problem(out) is None
    real = make("cpu")
    torch.testing.assert_close(out(*real)[0], f(*real)[0], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("shape", [(1, 2, 1, 2), (2, 4, 3, 3)])
@pytest.mark.parametrize("g_format", [torch.contiguous_format, CL])
def test_training_layout_gives_group_norm_and_its_gradient_nchw_copies(shape, g_format):
    """The casts before the convolutions write channels_last, so GroupNorm's input (cast to float32,
    keeping the format) is channels_last: it and its gradient's channels_last arguments read one
    contiguous copy each (CUDA's kernels take NCHW only); the values are the NCHW graph's."""
    f, gm, args, make = _joint(shape, "group_norm")
    if g_format is CL:  # the incoming gradient channels_last too (from an NHWC convolution's gradient)
        mode = args[0].fake_mode
        with mode:
            args[3] = args[3].contiguous(memory_format=CL)
            gm = make_fx(f)(*args)
    out, records = run_joint_pipeline(gm, args, Options())
    rec = _record(records)
    assert rec.changed and any("GroupNorm argument(s) read a contiguous copy" in n for n in rec.notes), rec.notes
    norms = [n for n in out.graph.nodes if n.target in (aten.native_group_norm.default,
                                                        aten.native_group_norm_backward.default)]
    assert len(norms) == 2
    for n in norms:
        for i in (0,) if n.target is aten.native_group_norm.default else (0, 1):
            assert n.args[i].meta["val"].is_contiguous(), (n.name, i, n.args[i].meta["val"].stride())
    copies = [n for n in out.graph.nodes if n.target is aten.clone.default]
    assert len(copies) == 1 + (g_format is CL)  # the forward's input once (the gradient reads it too)
    out.graph.lint()
    real = make("cpu", g_format)
    for got, want in zip(out(*real), f(*real)):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


# --------------------------------------------------------------- the reproducers' own joint graphs
def _cuda_joint(model: nn.Module, shape):
    """The model's joint graph under fp16 autocast, traced by AOTAutograd on the CPU (fake CUDA
    tensors cannot run autograd's engine without a GPU) and moved to fake CUDA tensors: the graph the
    joint passes see on the GPU, up to the device's decompositions (none differ for these ops)."""
    from functorch.compile import default_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    captured = []

    def partition(joint, inputs, **kw):
        captured.append((copy.deepcopy(joint), inputs))
        return default_partition(joint, inputs, **kw)

    backend = aot_autograd(fw_compiler=lambda g, a: g, bw_compiler=lambda g, a: g, partition_fn=partition)
    torch.compiler.reset()
    with torch.autocast("cpu", dtype=F16):
        torch.compile(model.train(), backend=backend)(torch.randn(shape).requires_grad_(True))
    joint, inputs = captured[0]
    for n in joint.graph.nodes:
        if n.op == "call_function" and n.kwargs.get("device") is not None:
            n.kwargs = {**n.kwargs, "device": torch.device("cuda")}
    joint.recompile()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = [[torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda").requires_grad_(t.requires_grad)
                 if isinstance(t, torch.Tensor) else t for t in group] for group in inputs]
        FakeTensorProp(joint, mode).propagate_dont_convert_inputs(*fake)
    return joint, fake


@pytest.mark.parametrize("tag", ["9785f6078b", "5bf7573163", "349ac6a1e1"])
def test_the_reproducers_joint_graphs_run_as_the_cuda_kernels_take_them(tag, monkeypatch):
    """Each reproducer's joint graph after the joint passes: no view left (reshapes), every GroupNorm
    argument its CUDA kernel reads NCHW contiguous (copies)."""
    from test_fuzz_reproducers import gpu_reproducer

    from fxopt.backends import target_for
    from fxopt.fuzz.check import build

    # fake CUDA BatchNorm's decomposition asks cuDNN for its reserve size: none on this machine
    monkeypatch.setattr(torch._C, "_get_cudnn_batch_norm_reserve_space_size", lambda *a, **k: 0)
    model, x = build(gpu_reproducer(tag), "cpu")
    joint, fake = _cuda_joint(model, tuple(x.shape))
    opts = Options(executor="cuda")
    out, records = run_joint_pipeline(joint, fake, opts, target_for(opts, "cuda", "training"))
    rec = _record(records)
    assert rec.changed, rec.notes
    assert view_problem(out) is None
    assert not any(n.target in (aten.view.default, aten._unsafe_view.default) for n in out.graph.nodes)
    for n in out.graph.nodes:
        if n.target is aten.native_group_norm.default:
            assert n.args[0].meta["val"].is_contiguous()
        if n.target is aten.native_group_norm_backward.default:
            assert n.args[0].meta["val"].is_contiguous() and n.args[1].meta["val"].is_contiguous()
    out.graph.lint()
