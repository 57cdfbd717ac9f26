"""ONNX export (fxopt.export_onnx) and the onnxruntime executor, on the CPU execution provider.

Relative error here is max|a - b| / max|b| (b = eager), bounded by 1e-4 in float32.
GPU tests (CUDA EP with IO binding) are marked `gpu` and skip without CUDA or the CUDA EP.
"""
import copy
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings

import fxopt
from fxopt.onnx_export import UnsupportedOpError, graph_to_onnx
from fxopt.testing import SeedCNN, SeedCNN2, check_equivalence, cnn_cases, compile_with_fxopt

ort = pytest.importorskip("onnxruntime")
RTOL = 1e-4


def rel_error(got, ref) -> float:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))


def session(model_or_path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    data = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


def run_ort(sess, *xs):
    return sess.run(None, {i.name: x.numpy() for i, x in zip(sess.get_inputs(), xs)})


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm statistics, so that folding them is really tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                    m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    return model.eval()


def _torchvision(name):
    def make():
        tv = pytest.importorskip("torchvision")
        return getattr(tv.models, name)(weights=None)
    return make


MODELS = [
    pytest.param(SeedCNN, 32, "conv1", id="SeedCNN"),
    pytest.param(SeedCNN2, 32, "conv1", id="SeedCNN2"),
    pytest.param(_torchvision("resnet18"), 64, "layer1.0.conv1", id="resnet18"),
    pytest.param(_torchvision("resnet50"), 64, "layer1.0.conv1", id="resnet50", marks=pytest.mark.slow),
    pytest.param(_torchvision("mobilenet_v2"), 64, "features.1.conv.0.0", id="mobilenet_v2"),
    pytest.param(_torchvision("efficientnet_b0"), 64, "features.1.0.block.0.0", id="efficientnet_b0",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("make,size,a_conv", MODELS)
def test_export_matches_eager(make, size, a_conv, tmp_path):
    torch.manual_seed(0)
    model = randomize_bn(make())
    path = tmp_path / "model.onnx"
    fxopt.export_onnx(model, (torch.randn(2, 3, size, size),), path)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    ops = {n.op_type for n in proto.graph.node}
    assert "BatchNormalization" not in ops and "Conv" in ops
    (inp,) = proto.graph.input
    assert inp.type.tensor_type.shape.dim[0].dim_param == "batch"
    assert not {i.name for i in proto.graph.initializer} & {inp.name}
    # module paths: in node names, metadata and doc strings
    conv = next(n for n in proto.graph.node if n.name == f"{a_conv}/Conv")
    assert {p.key: p.value for p in conv.metadata_props}["fxopt.module"] == a_conv
    assert conv.doc_string.startswith(a_conv)
    sess = session(path)
    for batch in (1, 3):
        x = torch.randn(batch, 3, size, size)
        with torch.no_grad():
            ref = model(x)
        (got,) = run_ort(sess, x)
        assert got.shape == tuple(ref.shape)
        assert rel_error(got, ref) <= RTOL, (batch, rel_error(got, ref))


class AllActivations(nn.Module):
    def __init__(self):
        super().__init__()
        acts = [nn.ReLU(), nn.ReLU6(), nn.Hardtanh(-0.5, 2.0), nn.LeakyReLU(0.2), nn.SiLU(), nn.GELU(),
                nn.GELU(approximate="tanh"), nn.Hardswish(), nn.Hardsigmoid(), nn.Sigmoid(), nn.Tanh()]
        self.convs = nn.ModuleList(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), a) for a in acts)
        self.head = nn.Linear(4 * 8 * 8, 6)
        self.act = nn.GELU()

    def forward(self, x):
        for block in self.convs:
            x = block(x) + x * 0.5 if block[-1].__class__ is nn.Tanh else block(x)
        return self.act(self.head(torch.flatten(x, 1)))


@pytest.mark.parametrize("opset", [17, 20])
def test_activations_every_opset(opset, tmp_path):
    torch.manual_seed(1)
    model = randomize_bn(AllActivations())
    x = torch.randn(2, 4, 8, 8) * 2
    proto = fxopt.onnx_export.export_onnx(model, (x,), tmp_path / "a.onnx", opset=opset)
    ops = {n.op_type for n in proto.graph.node}
    assert {"HardSwish", "HardSigmoid", "LeakyRelu", "Clip", "Gemm"} <= ops
    assert ("Gelu" in ops) == (opset >= 20) and ("Erf" in ops) == (opset < 20)
    with torch.no_grad():
        ref = model(x)
    assert rel_error(run_ort(session(proto), x)[0], ref) <= RTOL


class Pools(nn.Module):
    """Uneven adaptive pooling, ceil_mode max pooling, 'same' padding with an even kernel, a 1-D branch,
    a transposed convolution."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 4, padding="same")
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.adapt = nn.AdaptiveAvgPool2d((3, 4))
        self.conv1d = nn.Conv1d(4, 4, 3, groups=2)
        self.avg1d = nn.AvgPool1d(2)
        self.up = nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        y = self.adapt(self.pool(self.conv(x)))          # (N, 4, 3, 4)
        z = self.avg1d(self.conv1d(y.flatten(2)))       # (N, 4, 5)
        return torch.cat([y.flatten(1), z.mean(-1), self.up(y).flatten(1)], dim=1), torch.sigmoid(z)


def test_pools_padding_two_outputs(tmp_path):
    torch.manual_seed(2)
    model = Pools().eval()
    x = torch.randn(2, 3, 13, 11)
    proto = fxopt.export_onnx(model, (x,), tmp_path / "p.onnx")
    assert [o.name for o in proto.graph.output] == ["output_0", "output_1"]
    assert {"ConvTranspose", "MaxPool", "MatMul", "Pad", "AveragePool"} <= {n.op_type for n in proto.graph.node}
    sess = session(proto)
    for batch in (1, 3):
        xb = torch.randn(batch, 3, 13, 11)
        with torch.no_grad():
            refs = model(xb)
        for got, ref in zip(run_ort(sess, xb), refs):
            assert rel_error(got, ref) <= RTOL


def test_algorithm_choice_exported_as_conv(tmp_path):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1)).eval()
    x = torch.randn(2, 8, 12, 12)
    options = {"conv_algorithm": "winograd_2x2_3x3", "layout": "channels_last"}  # layout copies: no ONNX node
    proto = fxopt.export_onnx(model, (x,), tmp_path / "w.onnx", options=options)
    assert [n.op_type for n in proto.graph.node] == ["Conv", "Relu", "Conv"]
    convs = [n for n in proto.graph.node if n.op_type == "Conv"]
    assert len(convs) == 2
    assert all({p.key: p.value for p in n.metadata_props}["fxopt.conv_algorithm"] == "winograd_2x2_3x3" for n in convs)
    # no Winograd filter transform left in the file: only the weights and biases
    assert sorted(i.name for i in proto.graph.initializer) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    with torch.no_grad():
        assert rel_error(run_ort(session(proto), x)[0], model(x)) <= RTOL


class WithCumsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.cumsum(self.conv(x), dim=1)


def test_unsupported_op_raises(tmp_path):
    path = tmp_path / "never.onnx"
    with pytest.raises(UnsupportedOpError, match=r"aten\.cumsum.*node 'cumsum'") as info:
        fxopt.export_onnx(WithCumsum().eval(), (torch.randn(1, 3, 8, 8),), path)
    assert "cumsum" in info.value.op and info.value.node == "cumsum"
    assert not path.exists()


class FlattenAll(nn.Module):
    def forward(self, x):
        return F.relu(x).reshape(-1)


def test_dynamic_batch_refuses_batch_mixing_reshape(tmp_path):
    x = torch.randn(2, 3, 4)
    with pytest.raises(UnsupportedOpError, match="batch dimension"):
        fxopt.export_onnx(FlattenAll(), (x,), tmp_path / "d.onnx")
    proto = fxopt.export_onnx(FlattenAll(), (x,), tmp_path / "s.onnx", dynamic_batch=False)
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 2
    assert rel_error(run_ort(session(proto), x)[0], F.relu(x).reshape(-1)) == 0


OFFSET = torch.randn(3, 1, 1)


class TwoInputs(nn.Module):
    """Two inputs; a plain tensor attribute and a global tensor, which are constants, not inputs."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.scale = torch.randn(3, 1, 1)

    def forward(self, image, extra):
        return self.conv(image) * self.scale + extra + OFFSET


def test_inputs_are_the_callers_tensors(tmp_path):
    model, x, y = TwoInputs().eval(), torch.randn(2, 3, 5, 5), torch.randn(2, 3, 5, 5)
    proto = fxopt.export_onnx(model, (x, y), tmp_path / "two.onnx")
    assert [i.name for i in proto.graph.input] == ["image", "extra"]
    assert {"conv.weight", "conv.bias", "scale", "OFFSET"} <= {i.name for i in proto.graph.initializer}
    x3, y3 = torch.randn(3, 3, 5, 5), torch.randn(3, 3, 5, 5)
    with torch.no_grad():
        assert rel_error(run_ort(session(proto), x3, y3)[0], model(x3, y3)) <= RTOL


def test_cli_export(tmp_path):
    from fxopt.cli import main

    path = tmp_path / "cli.onnx"
    assert main(["export", "fxopt.testing:SeedCNN", "--shape", "2,3,32,32", "-o", str(path)]) == 0
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)


# ---- the onnxruntime executor

def test_onnxruntime_executor_matches_eager_and_sees_new_weights():
    torch.manual_seed(4)
    tv = pytest.importorskip("torchvision")
    model = randomize_bn(tv.models.resnet18(weights=None))
    graphs = []
    compiled = compile_with_fxopt(model, {"executor": "onnxruntime"}, graphs)
    with torch.no_grad():
        for batch in (2, 3):  # the second batch size recompiles with a symbolic batch
            x = torch.randn(batch, 3, 64, 64)
            assert rel_error(compiled(x), model(x)) <= RTOL
        state = {k: v * 1.5 if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)  # in place: _version moves, sessions are rebuilt
        x = torch.randn(3, 3, 64, 64)
        assert rel_error(compiled(x), model(x)) <= RTOL
    assert graphs and all(g.fallback is None for g in graphs)
    ort = "onnxruntime (CPUExecutionProvider)"
    for g in graphs:  # the symbolic graph is lowered per size, each size by the onnxruntime executor
        if g.executor.endswith("(per size)"):
            # every size lowered, by the onnxruntime executor (a size served padded or in chunks on a
            # lowered one is not lowered itself)
            sizes = [s for s in g.executor_details["dynamic"]["specializations"].values() if s.get("lowered")]
            assert sizes and all(s["executor"] == ort for s in sizes), g.executor_details["dynamic"]
        else:
            assert g.executor == ort


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_onnxruntime_nhwc_follows_the_layout_pass(layout):
    from fxopt.backends.onnxrt import wants_nhwc

    torch.manual_seed(7)
    model = randomize_bn(fxopt.testing.SmallResNet())
    graphs = []
    compiled = compile_with_fxopt(model, {"layout": layout}, graphs)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_error(compiled(x), model(x)) <= RTOL
    assert wants_nhwc(graphs[0].after) is (layout == "channels_last")
    assert wants_nhwc(graphs[0].before) is False  # no fused convolutions before the pipeline


def test_onnxruntime_executor_falls_back():
    from fxopt.backends import onnxrt

    onnxrt._WARNED.clear()  # warnings are given once per process
    torch.manual_seed(5)
    model = WithCumsum().eval()
    x = torch.randn(2, 3, 8, 8)
    graphs = []
    with pytest.warns(fxopt.FxoptFallbackWarning, match="cumsum"):
        compiled = compile_with_fxopt(model, {"executor": "onnxruntime"}, graphs)
        with torch.no_grad():
            out = compiled(x)
    torch.testing.assert_close(out, model(x).detach(), rtol=1e-4, atol=1e-5)
    assert graphs[0].executor.startswith("torch (onnxruntime not used") and "cumsum" in graphs[0].executor
    with pytest.raises(Exception, match="cumsum"):
        with torch.no_grad():
            compile_with_fxopt(model, {"executor": "onnxruntime", "strict": True})(x)
    # training graphs run on the torch executor, with the reason recorded
    graphs = []
    train = SeedCNN()
    compile_with_fxopt(train, {"executor": "onnxruntime"}, graphs)(torch.randn(2, 3, 32, 32)).sum().backward()
    assert {g.kind for g in graphs} == {"forward", "backward"}
    assert all("inference graphs only" in g.executor for g in graphs)
    assert train.conv1.weight.grad is not None


# ---- differential: eager vs fxopt vs ONNX Runtime on the exported optimized graph

@settings(max_examples=15)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(1, 2)))
def test_differential_eager_fxopt_onnxruntime(case):
    check_equivalence(case, options=None)  # fxopt (default executor) == eager
    (x,) = case.inputs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # padding='same' with even kernels warns in eager
        proto = fxopt.export_onnx(case.model, (x,), None)
    sess = session(proto)
    other = torch.randn((x.shape[0] % 3) + 1, *x.shape[1:])  # a different batch size: dynamic batch
    for inp in (x, other):
        with torch.no_grad():
            ref = case.model(inp)
        (got,) = run_ort(sess, inp)
        assert got.shape == tuple(ref.shape)
        assert rel_error(got, ref) <= RTOL, (case, rel_error(got, ref))


def test_graph_to_onnx_static_from_report():
    """graph_to_onnx on an explain() graph: parameters as given, folded constants computed from them."""
    model = randomize_bn(copy.deepcopy(fxopt.testing.SmallResNet()))
    x = torch.randn(2, 3, 32, 32)
    report, inputs, params, names = fxopt.onnx_export.capture(model, (x,))
    proto = graph_to_onnx(report.after, inputs, params, input_names=names)
    onnx.checker.check_model(proto, full_check=True)
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 2
    with torch.no_grad():
        assert rel_error(run_ort(session(proto), x)[0], model(x)) <= RTOL


# ---- GPU: CUDA execution provider with IO binding (skipped here without CUDA)

def _cuda_ep():
    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ep(), reason="needs CUDA and onnxruntime's CUDAExecutionProvider")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cudagraphs", [None, False])
def test_onnxruntime_executor_cuda_io_binding(cudagraphs, dtype):
    torch.manual_seed(6)
    model = randomize_bn(fxopt.testing.SmallResNet()).cuda().to(dtype)
    tol = 1e-3 if dtype == torch.float32 else 1e-2  # fp32: ORT's CUDA EP and eager both convolve in TF32
    graphs = []
    compiled = compile_with_fxopt(model, {"executor": "onnxruntime", "cudagraphs": cudagraphs}, graphs)
    with torch.no_grad():
        outs = []
        for _ in range(3):  # replays: fresh outputs every call, inputs read every call
            x = torch.randn(4, 3, 32, 32, device="cuda", dtype=dtype)
            out = compiled(x)
            assert out.device.type == "cuda"
            # read on torch's stream right away (no host sync in between): ORT's work is ordered before
            assert rel_error(out.float().cpu(), model(x).float().cpu()) <= tol
            outs.append((out, model(x)))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # a call from another stream is ordered too
            x = torch.randn(4, 3, 32, 32, device="cuda", dtype=dtype)
            out = compiled(x)
            assert rel_error(out.float().cpu(), model(x).float().cpu()) <= tol
        for out, ref in outs:
            assert rel_error(out.float().cpu(), ref.float().cpu()) <= tol
        model.load_state_dict({k: v * 1.5 if v.is_floating_point() else v for k, v in model.state_dict().items()})
        x = torch.randn(4, 3, 32, 32, device="cuda", dtype=dtype)
        assert rel_error(compiled(x).float().cpu(), model(x).float().cpu()) <= tol
    assert graphs[0].executor == "onnxruntime (CUDAExecutionProvider)"
    assert graphs[0].cudagraphs.startswith("on" if cudagraphs is None else "off")
    # the layout pass chose channels_last on CUDA, so the session asks ORT for NHWC convolutions
    assert graphs[0].executor_details["onnxruntime_nhwc"] is True
