"""Hypothesis strategies for the blocks real CNNs put between their convolutions.

``block_cases()`` draws a small network (a ``CNNCase``, as ``cnn_cases`` does) whose layers
mix convolutions with the ops the fusion scheduler fuses: LayerNorm over channels (the
permute / normalize / permute of ConvNeXt), GroupNorm, InstanceNorm, softmax over channels,
squeeze-excite gates, chunk / split + concatenation, channel shuffle, padding, spatial
transposes, activation chains (GELU, SiLU, hardswish, mish, ...), means and maxima over any
dims added back with broadcasting, per-channel scales, BatchNorm + ReLU after a concatenation
(DenseNet), pooling with padding and dtype round trips.

    from hypothesis import given
    from fxopt.testing import block_cases, check_equivalence

    @given(block_cases())
    def test_fusion(case):
        check_equivalence(case, options={"executor": "cuda"})
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

from .strategies import CNNCase, _rand_bn

_ACTS = {
    "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
    "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "mish": F.mish, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "leaky_relu": lambda x: F.leaky_relu(x, 0.2), "relu6": F.relu6, "elu": F.elu,
    "softplus": F.softplus, "abs": torch.abs, "neg": torch.neg,
}


class Block(nn.Module):
    """One drawn layer: ``kind`` selects the computation, ``p`` holds its constants."""

    def __init__(self, kind: str, p: dict, mods: dict | None = None):
        super().__init__()
        self.kind, self.p = kind, p
        self.mods = nn.ModuleDict(mods or {})

    def forward(self, x):  # noqa: C901 - one branch per kind, each a few lines
        k, p, m = self.kind, self.p, self.mods
        if k == "conv":
            return m["conv"](x)
        if k == "layernorm2d":
            return m["ln"](x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        if k == "groupnorm":
            return m["gn"](x)
        if k == "instancenorm":
            return m["inorm"](x)
        if k == "softmax":
            return torch.softmax(x, dim=p["dim"]) if not p["log"] else torch.log_softmax(x, dim=p["dim"])
        if k == "se":
            s = x.mean((2, 3), keepdim=True)
            s = torch.sigmoid(m["fc2"](F.relu(m["fc1"](s))))
            return x * s
        if k == "chunk_cat":
            a, b = torch.chunk(x, 2, dim=1) if p["chunk"] else torch.split(x, x.shape[1] // 2, dim=1)
            return torch.cat([_ACTS[p["act"]](b), a], 1)
        if k == "shuffle":
            n, c, h, w = x.shape
            g = p["groups"]
            return x.reshape(n, g, c // g, h, w).transpose(1, 2).reshape(n, c, h, w)
        if k == "pad":
            return F.pad(x, p["pad"], value=p["value"])
        if k == "transpose":
            return x.transpose(2, 3).contiguous() + p["scale"]
        if k == "act_chain":
            for a in p["acts"]:
                x = _ACTS[a](x)
            return x
        if k == "reduce_bcast":
            r = x.mean(p["dims"], keepdim=True) if p["op"] == "mean" else x.amax(p["dims"], keepdim=True)
            return x - r if p["sub"] else x * torch.sigmoid(r)
        if k == "scale":
            return x * m["scale"].weight.view(1, -1, 1, 1) + m["scale"].bias.view(1, -1, 1, 1)
        if k == "bn_relu_cat":
            y = torch.cat([x, F.relu(m["conv"](x))], 1)
            return F.relu(m["bn"](y))
        if k == "pool":
            if p["max"]:
                return F.max_pool2d(x, p["k"], p["stride"], p["pad"], ceil_mode=p["ceil"])
            return F.avg_pool2d(x, p["k"], p["stride"], p["pad"], ceil_mode=p["ceil"],
                                count_include_pad=p["count_pad"])
        if k == "cast":
            return x.to(p["dtype"]).to(x.dtype) * p["scale"]
        if k == "residual":
            return _ACTS[p["act"]](m["conv"](x) + x)
        raise ValueError(k)


class BlockNet(nn.Module):
    def __init__(self, blocks: list):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


KINDS = ("conv", "layernorm2d", "groupnorm", "instancenorm", "softmax", "se", "chunk_cat", "shuffle", "pad",
         "transpose", "act_chain", "reduce_bcast", "scale", "bn_relu_cat", "pool", "cast", "residual")


@st.composite
def block_cases(draw, dtypes=(torch.float32,), max_layers: int = 4, kinds=KINDS, min_batch: int = 1,
                max_batch: int = 3):
    """A random network of ``kinds`` layers (eval mode) with a matching random input."""
    dtype = draw(st.sampled_from(list(dtypes)))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    n = draw(st.integers(min_batch, max_batch))
    c = draw(st.sampled_from([2, 4, 8, 16]))
    h = draw(st.integers(3, 12))
    w = draw(st.integers(3, 12))
    shape0 = (n, c, h, w)
    blocks, desc = [], []
    for _ in range(draw(st.integers(1, max_layers))):
        kind = draw(st.sampled_from(list(kinds)))
        p: dict = {}
        mods: dict = {}
        if kind == "conv":
            cout = draw(st.sampled_from([c, 4, 8, 16]))
            kk = draw(st.sampled_from([1, 3]))
            mods["conv"] = nn.Conv2d(c, cout, kk, padding=kk // 2, bias=draw(st.booleans()))
            text, c = f"conv{kk}->{cout}", cout
        elif kind == "layernorm2d":
            mods["ln"] = nn.LayerNorm(c, elementwise_affine=draw(st.booleans()))
            text = "layernorm2d"
        elif kind == "groupnorm":
            g = draw(st.sampled_from([d for d in (1, 2, 4) if c % d == 0]))
            mods["gn"] = nn.GroupNorm(g, c, affine=draw(st.booleans()))
            text = f"groupnorm{g}"
        elif kind == "instancenorm":
            if h * w < 2:
                continue
            mods["inorm"] = nn.InstanceNorm2d(c, affine=draw(st.booleans()))
            text = "instancenorm"
        elif kind == "softmax":
            p = {"dim": draw(st.sampled_from([1, -1])), "log": draw(st.booleans())}
            text = f"{'log_' if p['log'] else ''}softmax{p['dim']}"
        elif kind == "se":
            r = max(1, c // 2)
            mods["fc1"], mods["fc2"] = nn.Conv2d(c, r, 1), nn.Conv2d(r, c, 1)
            text = "se"
        elif kind == "chunk_cat":
            if c % 2:
                continue
            p = {"chunk": draw(st.booleans()), "act": draw(st.sampled_from(sorted(_ACTS)))}
            text = f"{'chunk' if p['chunk'] else 'split'}-cat({p['act']})"
        elif kind == "shuffle":
            gs = [g for g in (2, 4) if c % g == 0]
            if not gs:
                continue
            p = {"groups": draw(st.sampled_from(gs))}
            text = f"shuffle{p['groups']}"
        elif kind == "pad":
            pad = tuple(draw(st.integers(0, 2)) for _ in range(4))
            p = {"pad": pad, "value": draw(st.sampled_from([0.0, -1.5]))}
            h, w = h + pad[2] + pad[3], w + pad[0] + pad[1]
            text = f"pad{pad}"
        elif kind == "transpose":
            p = {"scale": draw(st.sampled_from([0.0, 0.5]))}
            h, w = w, h
            text = "transpose_hw"
        elif kind == "act_chain":
            p = {"acts": draw(st.lists(st.sampled_from(sorted(_ACTS)), min_size=1, max_size=3))}
            text = "-".join(p["acts"])
        elif kind == "reduce_bcast":
            p = {"dims": draw(st.sampled_from([(1,), (2, 3), (1, 2, 3), (3,)])),
                 "op": draw(st.sampled_from(["mean", "amax"])), "sub": draw(st.booleans())}
            text = f"{p['op']}{p['dims']}"
        elif kind == "scale":
            mods["scale"] = nn.Linear(c, c)  # its weight rows as per-channel scale, bias as shift
            mods["scale"].weight.data = torch.rand(c, generator=gen) + 0.5
            mods["scale"].bias.data = torch.randn(c, generator=gen)
            text = "channel_scale"
        elif kind == "bn_relu_cat":
            g = draw(st.sampled_from([2, 4]))
            mods["conv"] = nn.Conv2d(c, g, 1)
            mods["bn"] = _rand_bn(nn.BatchNorm2d(c + g), gen)
            c = c + g
            text = f"cat-bn-relu(+{g})"
        elif kind == "pool":
            k = draw(st.sampled_from([2, 3]))
            if min(h, w) < k:
                continue
            p = {"max": draw(st.booleans()), "k": k, "stride": draw(st.sampled_from([1, 2])),
                 "pad": draw(st.integers(0, k // 2)), "ceil": draw(st.booleans()), "count_pad": draw(st.booleans())}
            probe = torch.zeros(1, 1, h, w)
            out = (F.max_pool2d if p["max"] else F.avg_pool2d)(probe, k, p["stride"], p["pad"], ceil_mode=p["ceil"])
            h, w = out.shape[-2:]
            text = f"{'max' if p['max'] else 'avg'}pool{k}s{p['stride']}p{p['pad']}{'c' if p['ceil'] else ''}"
        elif kind == "cast":
            p = {"dtype": draw(st.sampled_from([torch.float16, torch.bfloat16])), "scale": 2.0}
            text = f"cast({p['dtype']})"
        else:  # residual
            mods["conv"] = nn.Conv2d(c, c, 3, padding=1)
            p = {"act": draw(st.sampled_from(sorted(_ACTS)))}
            text = f"residual({p['act']})"
        blocks.append(Block(kind, p, mods))
        desc.append(text)
    if not blocks:
        blocks.append(Block("act_chain", {"acts": ["relu"]}))
        desc.append("relu")
    model = BlockNet(blocks).to(dtype).eval()
    for mod in model.modules():  # deterministic weights
        if isinstance(mod, (nn.Conv2d,)):
            with torch.no_grad():
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * mod.weight[0].numel() ** -0.5)
                if mod.bias is not None:
                    mod.bias.copy_(torch.randn(mod.bias.shape, generator=gen) * 0.1)
    x = torch.randn(shape0, generator=gen)
    return CNNCase(model, (x.to(dtype),), dtype, False, desc)
