"""Extents as arguments (``backends/cuda/codegen/ir_kernel.py``): a region's kernel at two batch
sizes is one source (one compilation), the batch's extents passed at launch; the kernel still
computes the region at each size (IR emulation and, for the forms the CPU emulators read, the
generated C itself)."""
import copy

import pytest
import torch

from fxopt.backends import torch_ref
from fxopt.backends.cuda.kernels.region import generate_kernel, vector_width
from fxopt.backends.cuda.schedule.fusion import schedule
from fxopt.backends.cuda.schedule.rewrite import split_conv_epilogues
from fxopt.testing.fusion import capture
from fxopt.testing.models import SmallResNet


def _sources(model, batch: int, layout: str) -> list:
    x = torch.randn(batch, 3, 16, 16)
    out = []
    for report, _ in capture(copy.deepcopy(model), [x], {"executor": "torch", "layout": layout}):
        gm = torch_ref.lower(report.after)
        split_conv_epilogues(gm)
        out += [generate_kernel(r.kernel, vector_width(r.kernel)) for r in schedule(gm, strict=True).regions]
    return out


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_a_new_batch_size_generates_the_same_sources(layout):
    torch.manual_seed(0)
    model = SmallResNet().eval()
    a, b = _sources(model, 2, layout), _sources(model, 5, layout)
    assert a and len(a) == len(b)
    for ka, kb in zip(a, b):
        assert ka.name == kb.name and ka.source == kb.source
        assert ka.meta["extents"] and [e * 5 for e in ka.meta["extents"]] == [e * 2 for e in kb.meta["extents"]]
        assert "fx_n0" in ka.source and ka.param_types[-1] == "long long"


def test_the_name_is_a_digest_of_the_source():
    torch.manual_seed(0)
    ks = _sources(SmallResNet().eval(), 3, "channels_last")
    names = {k.name for k in ks}
    assert all(k.name in k.source and "FXNAMESLOT" not in k.source for k in ks)
    assert len(names) == len({k.source for k in ks})  # one name per distinct source
