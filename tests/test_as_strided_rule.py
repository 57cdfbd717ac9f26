"""``as_strided`` in generated kernels (``movement_rules._as_strided``), on the CPU: an index map where
its input fills its storage (the restride of a pooled value that AOTAutograd leaves between a
global mean and a LayerNorm), declined where the input is part of its storage; the kernels' IR
against eager."""
import torch
import torch.nn as nn

from fxopt.backends import torch_ref
from fxopt.backends.cuda.schedule.fusion import schedule
from fxopt.backends.cuda.schedule.lowering import view_root
from fxopt.testing import CNNCase, check_fusion
from fxopt.testing.fusion import capture, evaluate_regions


class PoolNorm(nn.Module):
    """ConvNeXt's head: a global mean kept 4-D, its restride, a LayerNorm over channels."""

    def __init__(self, c=12):
        super().__init__()
        self.ln = nn.LayerNorm(c)

    def forward(self, x):
        m = x.relu().mean((2, 3), keepdim=True)
        m = torch.as_strided(m, m.shape, (m.shape[1], 1, m.shape[1], m.shape[1]))
        return self.ln(m.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) * 2.0


class Strided(nn.Module):
    """Every other column of every third row of a dense intermediate, and a slice's restride."""

    def __init__(self, part=False):
        super().__init__()
        self.part = part

    def forward(self, x):
        y = torch.sigmoid(x) + 1.0
        if self.part:  # a view that does not start its storage: its as_strided is PyTorch's
            y = y[:, 1:]
            return torch.as_strided(y, (2, 2, 2, 2), (24, 12, 6, 2)) * 3.0
        return torch.as_strided(y, (2, 2, 3), (36, 12, 2), 1) * 3.0


def _ops(model, x):
    (report, _), = capture(model.eval(), (x,), {"executor": "torch"})
    gm = torch_ref.lower(report.after)
    return gm, schedule(gm, strict=True)


def test_a_restride_of_a_pooled_value_fuses_with_the_layernorm_that_reads_it():
    torch.manual_seed(0)
    model, x = PoolNorm(), torch.randn(3, 12, 4, 5)
    gm, sched = _ops(model, x)
    assert any(n.target is torch.ops.aten.as_strided.default for n in gm.graph.nodes)
    assert not [k for k in sched.unfused if "as_strided" in k]  # before its rule: "no rule for aten.as_strided"
    mean = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mean.dim)
    norm = next(r for r in sched.regions if "aten.native_layer_norm.default" in r.ops)
    # the LayerNorm's kernel reads the mean's buffer through the restride and the permute (views, no op)
    assert mean in {view_root(n) for n in norm.inputs}
    check_fusion(CNNCase(model, (x,), torch.float32, False, ["pool-norm"]))


def test_an_as_strided_inside_a_dense_intermediate_is_an_index_map():
    torch.manual_seed(1)
    model, x = Strided(), torch.randn(2, 3, 12)
    gm, sched = _ops(model, x)
    sig = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sigmoid.default)
    assert not sched.unfused and len(sched.regions) == 1 and sig in sched.regions[0].covered
    for region, got, want in evaluate_regions(model, (x,)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    check_fusion(CNNCase(model, (x,), torch.float32, False, ["strided"]))


def test_an_as_strided_of_a_part_of_its_storage_is_left_to_pytorch():
    torch.manual_seed(2)
    model, x = Strided(part=True), torch.randn(2, 4, 12)
    gm, sched = _ops(model, x)
    strided = [n for n in gm.graph.nodes if n.target is torch.ops.aten.as_strided.default]
    if strided:  # (AOTAutograd may fold the slice into the as_strided's offset: then it is the dense case)
        src = strided[0].args[0].meta["val"]
        covered = {n for r in sched.regions for n in r.covered}
        assert (strided[0] in covered) == (src.storage_offset() == 0 and src.is_contiguous())
    check_fusion(CNNCase(model, (x,), torch.float32, False, ["strided-part"]))
