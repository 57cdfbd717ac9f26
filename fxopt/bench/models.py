"""Model registry for the fxopt benchmark harness.

Each entry maps a name to a :class:`ModelSpec`: a zero-argument factory that
returns a freshly initialised ``nn.Module`` (random weights) and the per-sample
input shape ``(C, H, W)``.  :func:`build_model` seeds the RNG, builds the model,
puts it in eval mode and gives every BatchNorm non-trivial running statistics
and affine parameters (a freshly initialised BN is the identity in eval mode,
which would make BN folding look free and hide numerical errors).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

__all__ = [
    "ModelSpec",
    "ModelUnavailable",
    "MODELS",
    "QUICK_MODELS",
    "RepLKBlock",
    "build_model",
    "make_input",
    "model_names",
]


class ModelUnavailable(RuntimeError):
    """The model cannot be built in this environment (missing dependency)."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    factory: Callable[[], nn.Module]
    input_shape: Tuple[int, int, int]
    description: str = ""
    randomize_bn: bool = True


# --------------------------------------------------------------------------
# RepLKNet-style large-kernel block
# --------------------------------------------------------------------------
class RepLKBlock(nn.Module):
    """A RepLKNet (Ding et al., 2022) large-kernel block in its deploy-free form.

    x -> BN -> 1x1 conv (+BN) -> ReLU -> 31x31 depthwise conv (+BN) -> ReLU
      -> 1x1 conv -> BN, then the residual add with x.
    """

    def __init__(self, channels: int = 128, kernel_size: int = 31) -> None:
        super().__init__()
        c = channels
        self.prelkb_bn = nn.BatchNorm2d(c)
        self.pw1 = nn.Conv2d(c, c, 1, bias=False)
        self.pw1_bn = nn.BatchNorm2d(c)
        self.pw1_act = nn.ReLU()
        self.large_kernel = nn.Conv2d(
            c, c, kernel_size, padding=kernel_size // 2, groups=c, bias=False
        )
        self.large_kernel_bn = nn.BatchNorm2d(c)
        self.lk_act = nn.ReLU()
        self.pw2 = nn.Conv2d(c, c, 1, bias=False)
        self.pw2_bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.prelkb_bn(x)
        out = self.pw1_act(self.pw1_bn(self.pw1(out)))
        out = self.lk_act(self.large_kernel_bn(self.large_kernel(out)))
        out = self.pw2_bn(self.pw2(out))
        return x + out


# --------------------------------------------------------------------------
# factories
# --------------------------------------------------------------------------
def _seed_models_module():
    try:
        from fxopt.testing import models as seed_models  # type: ignore
    except Exception as exc:  # pragma: no cover - depends on the other module
        raise ModelUnavailable(
            f"fxopt.testing.models is not importable ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc
    return seed_models


def _seedcnn() -> nn.Module:
    return _seed_models_module().SeedCNN()


def _seedcnn2() -> nn.Module:
    return _seed_models_module().SeedCNN2()


def _torchvision(name: str) -> Callable[[], nn.Module]:
    def factory() -> nn.Module:
        try:
            import torchvision  # noqa: F401
            from torchvision import models as tvm
        except Exception as exc:
            raise ModelUnavailable(
                f"torchvision is not importable ({type(exc).__name__})"
            ) from exc
        kwargs = {"init_weights": True} if name in ("googlenet", "inception_v3") else {}
        return getattr(tvm, name)(weights=None, **kwargs)

    factory.__name__ = f"torchvision_{name}"
    return factory


_IMAGENET = (3, 224, 224)

MODELS: Dict[str, ModelSpec] = {
    "seedcnn": ModelSpec(_seedcnn, (3, 32, 32), "fxopt.testing.models.SeedCNN"),
    "seedcnn2": ModelSpec(_seedcnn2, (3, 32, 32), "fxopt.testing.models.SeedCNN2"),
    "resnet18": ModelSpec(_torchvision("resnet18"), _IMAGENET, "torchvision resnet18"),
    "resnet50": ModelSpec(_torchvision("resnet50"), _IMAGENET, "torchvision resnet50"),
    "mobilenet_v2": ModelSpec(
        _torchvision("mobilenet_v2"), _IMAGENET, "torchvision mobilenet_v2"
    ),
    "mobilenet_v3_large": ModelSpec(
        _torchvision("mobilenet_v3_large"), _IMAGENET, "torchvision mobilenet_v3_large"
    ),
    "efficientnet_b0": ModelSpec(
        _torchvision("efficientnet_b0"), _IMAGENET, "torchvision efficientnet_b0"
    ),
    "vgg16": ModelSpec(_torchvision("vgg16"), _IMAGENET, "torchvision vgg16"),
    "convnext_tiny": ModelSpec(
        _torchvision("convnext_tiny"), _IMAGENET, "torchvision convnext_tiny"
    ),
    # CNNs whose time is outside their convolutions: concatenations (densenet121, googlenet,
    # squeezenet1_1), channel shuffle / split (shufflenet_v2_x1_0), squeeze-excite gates
    # (regnet_y_1_6gf, efficientnet_v2_s), grouped convs (resnext50_32x4d), inverted residuals
    # (mnasnet1_0), LayerNorm + Linear blocks (convnext_tiny)
    **{name: ModelSpec(_torchvision(name), _IMAGENET, f"torchvision {name}") for name in (
        "densenet121", "googlenet", "shufflenet_v2_x1_0", "squeezenet1_1", "mnasnet1_0", "regnet_y_1_6gf",
        "resnext50_32x4d", "efficientnet_v2_s")},
    "replknet_block": ModelSpec(
        lambda: RepLKBlock(128, 31), (128, 56, 56),
        "RepLKNet-style block, 128 ch, 31x31 depthwise, 56x56",
    ),
}

# the CI smoke set (``--quick``)
QUICK_MODELS: List[str] = ["seedcnn", "seedcnn2"]


def model_names() -> List[str]:
    return list(MODELS)


def _randomize_bn(model: nn.Module, gen: torch.Generator) -> None:
    for mod in model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
            n = mod.num_features
            with torch.no_grad():
                mod.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
                mod.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
                if mod.affine:
                    mod.weight.copy_(torch.rand(n, generator=gen) + 0.5)
                    mod.bias.copy_(torch.randn(n, generator=gen) * 0.1)


def build_model(name: str, seed: int = 0) -> Tuple[nn.Module, Tuple[int, int, int]]:
    """Build model ``name`` (fp32, CPU, eval mode) with seeded random weights."""
    try:
        spec = MODELS[name]
    except KeyError:
        raise KeyError(
            f"unknown model {name!r}; known: {', '.join(MODELS)}"
        ) from None
    torch.manual_seed(seed)
    model = spec.factory()
    if spec.randomize_bn:
        gen = torch.Generator().manual_seed(seed + 1)
        _randomize_bn(model, gen)
    model.eval()
    return model, spec.input_shape


def make_input(shape: Tuple[int, ...], batch: int, seed: int = 0) -> torch.Tensor:
    """A seeded fp32 CPU input of shape ``(batch, *shape)``."""
    gen = torch.Generator().manual_seed(seed + 12345)
    return torch.randn((batch, *shape), generator=gen)
