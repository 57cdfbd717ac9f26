"""Whole models: torchvision CNNs through torch.compile(backend="fxopt") match eager."""
import pytest
import torch
import torchvision

import fxopt
from fxopt.tolerances import relative_error

MODELS = ["resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "vgg11_bn",
          "convnext_tiny", "regnet_y_400mf"]


def _randomize_bn(model):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


@pytest.mark.parametrize("name", MODELS)
def test_torchvision_model_matches_eager(name):
    torch.manual_seed(0)
    model = _randomize_bn(getattr(torchvision.models, name)(weights=None)).eval()
    # vgg11_bn's 133M parameters: exporting them to ONNX Runtime, the CPU runner's measured
    # alternative, costs ~5 s a compile here; that path is checked in test_onnx / test_cpu_executor
    options = {"cpu_onnxruntime": False} if name == "vgg11_bn" else None
    compiled = torch.compile(model, backend="fxopt", options=options)
    with torch.no_grad():
        for batch in (1, 3):
            x = torch.randn(batch, 3, 64, 64)
            got, want = compiled(x), model(x)
            assert relative_error(got, want) <= 1e-4, (name, batch, relative_error(got, want))


def test_resnet50_explain_folds_and_fuses():
    model = torchvision.models.resnet50(weights=None).eval()
    r = fxopt.explain(model, torch.randn(1, 3, 64, 64))
    assert r.op_counts_before["aten._native_batch_norm_legit_no_training.default"] == 53
    assert not any("batch_norm" in op for op in r.op_counts_after)
    assert r.op_counts_after["fxopt.fused_conv.default"] == 53
    assert "aten.convolution.default" not in r.op_counts_after
    assert "aten.relu.default" not in r.op_counts_after  # every conv -> BN -> ReLU became one node
    acts = [n.args[8] for n in r.after.graph.nodes if n.target is fxopt.ops.FUSED_CONV]
    assert acts.count("relu") == 49


def test_resnet18_training_step_gradients():
    import copy

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).train()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="fxopt")
    x = torch.randn(2, 3, 64, 64)
    ref(x).square().mean().backward()
    compiled(x).square().mean().backward()
    for (name, p), p2 in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p2.grad, p.grad, rtol=1e-3, atol=1e-5, msg=lambda s: f"{name}: {s}")
