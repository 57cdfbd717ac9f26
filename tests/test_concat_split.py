"""Concatenation and channel splits without copy kernels (backends/cuda/schedule/copies.py and the
slice-aware cost model of fusion.py), on the CPU: which kernels the scheduler makes for split and
concatenation blocks (Res2Net, DPN, two convs and a concatenation, split -> conv per piece ->
concatenation), where a copy must stay, every region's IR against its ATen ops, the compiled model
against eager, and a hypothesis property over random splits and concatenations."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.compiler import nvrtc_available
from fxopt.backends.cuda.schedule import copies
from fxopt.ops import fused_conv_ref
from fxopt.testing import check_fusion, compile_with_fxopt
from fxopt.testing.fusion import scheduled
from fxopt.testing.strategies import CNNCase

CL = {"layout": "channels_last"}  # as on the GPU: the layout pass converts each conv's input


# ---------------------------------------------------------------------------- the blocks
class Res2Block(nn.Module):
    """1x1 conv to scale * width channels + BN + ReLU, split, 3x3 convs on the pieces (each on its
    piece plus the previous output), concatenation, 1x1 conv + BN, residual."""

    def __init__(self, cin=16, width=6, scale=4):
        super().__init__()
        self.width = width
        self.conv1, self.bn1 = nn.Conv2d(cin, width * scale, 1, bias=False), nn.BatchNorm2d(width * scale)
        self.convs = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1, bias=False) for _ in range(scale - 1))
        self.bns = nn.ModuleList(nn.BatchNorm2d(width) for _ in range(scale - 1))
        self.conv3, self.bn3 = nn.Conv2d(width * scale, cin, 1, bias=False), nn.BatchNorm2d(cin)

    def forward(self, x):
        spx = torch.split(F.relu(self.bn1(self.conv1(x))), self.width, 1)
        outs = []
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            sp = spx[i] if i == 0 else sp + spx[i]
            sp = F.relu(bn(conv(sp)))
            outs.append(sp)
        return F.relu(self.bn3(self.conv3(torch.cat(outs + [spx[-1]], 1))) + x)


class BnActConv(nn.Module):
    def __init__(self, cin, cout, k, groups=1):
        super().__init__()
        self.bn, self.conv = nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False)

    def forward(self, x):
        return self.conv(F.relu(self.bn(x)))


class DualPathBlock(nn.Module):
    def __init__(self, cin, r=16, c=16, inc=4, groups=4, proj=False):
        super().__init__()
        self.c, self.proj = c, proj
        if proj:
            self.w = BnActConv(cin, c + 2 * inc, 1)
        self.a, self.b, self.cc = BnActConv(cin, r, 1), BnActConv(r, r, 3, groups), BnActConv(r, c + inc, 1)

    def forward(self, x):
        x_in = torch.cat(x, 1) if isinstance(x, tuple) else x
        if self.proj:
            s = self.w(x_in)
            s1, s2 = s[:, :self.c], s[:, self.c:]
        else:
            s1, s2 = x
        y = self.cc(self.b(self.a(x_in)))
        return s1 + y[:, :self.c], torch.cat([s2, y[:, self.c:]], 1)


class DPN(nn.Module):
    """Dual-path blocks: a residual path (add) and a dense path (a concatenation growing by
    ``inc`` channels per block), each block reading BN + ReLU of both concatenated."""

    def __init__(self, blocks=6, inc=4):
        super().__init__()
        self.stem = nn.Conv2d(8, 16, 3, padding=1)
        dense, bs = 2 * inc, [DualPathBlock(16, inc=inc, proj=True)]
        for _ in range(blocks - 1):
            dense += inc
            bs.append(DualPathBlock(16 + dense, inc=inc))
        dense += inc
        self.blocks, self.bn = nn.ModuleList(bs), nn.BatchNorm2d(16 + dense)

    def forward(self, x):
        t = self.stem(x)
        for b in self.blocks:
            t = b(t)
        return F.relu(self.bn(torch.cat(t, 1)))


class TwoConvCat(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(c, 12, 3, padding=1), nn.Conv2d(c, 4, 1), nn.Conv2d(16, c, 1)

    def forward(self, x):
        return self.c(torch.cat([F.relu(self.a(x)), F.relu(self.b(x))], 1))


class SplitConvCat(nn.Module):
    def __init__(self, c=16, pieces=(4, 4, 8)):
        super().__init__()
        self.pieces = pieces
        self.pre, self.post = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)
        self.convs = nn.ModuleList(nn.Conv2d(p, p, 3, padding=1) for p in pieces)

    def forward(self, x):
        ps = torch.split(F.relu(self.pre(x)), list(self.pieces), 1)
        return self.post(torch.cat([F.relu(cv(p)) for cv, p in zip(self.convs, ps)], 1))


class SKBlock(nn.Module):
    """Selective kernel: two conv paths stacked on a new dimension, their sum pooled into an attention
    over the paths (a softmax over the stack's dimension), the paths' weighted sum."""

    def __init__(self, c=16, r=4):
        super().__init__()
        self.p0 = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.p1 = nn.Sequential(nn.Conv2d(c, c, 3, padding=2, dilation=2, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.fc1, self.fc2 = nn.Conv2d(c, r, 1), nn.Conv2d(r, 2 * c, 1)

    def forward(self, x):
        s = torch.stack([self.p0(x), self.p1(x)], 1)
        a = self.fc2(torch.relu(self.fc1(s.sum(1).mean((2, 3), keepdim=True))))
        return (s * torch.softmax(a.view(x.shape[0], 2, -1, 1, 1), 1)).sum(1)


def _randomize(m):
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            with torch.no_grad():
                mod.running_mean.uniform_(-.5, .5)
                mod.running_var.uniform_(.5, 1.5)
                mod.weight.uniform_(.5, 1.5)
                mod.bias.uniform_(-.5, .5)
    return m.eval()


def _case(model, shape, dtype=torch.float32, cl=True):
    torch.manual_seed(0)
    m = _randomize(model).to(dtype)
    x = torch.randn(shape).to(dtype)
    if cl:
        m, x = m.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    return m, x


def _schedule(model, x, enabled=True):
    return scheduled(model, (x,), CL, (copies, enabled))


def _pipeline_outputs(m, x, layout):
    """The outputs of the same pipeline without the cuda executor: the strides it must hand out.
    (With option layout="channels_last" these differ from eager's for some outputs, a split's
    piece a graph returns or a DPN's last BN + ReLU, with or without this change: the layout pass
    decides them, not the scheduler.)"""
    fast = compile_with_fxopt(m, {"executor": "torch", **layout})
    with torch.no_grad():
        out = fast(x)
    return out if isinstance(out, tuple) else (out,)


def _same_layout(got, want, piped):
    """The strides the pipeline hands out (eager's, but where the layout pass decides otherwise)."""
    assert got.shape == want.shape and got.stride() == piped.stride(), (got.stride(), piped.stride())


def _named(sched, word):
    return [r.name for r in sched.regions if word in r.name]


BLOCKS = {
    "res2net": (lambda: Res2Block(), (2, 16, 6, 6)),
    "dpn": (lambda: DPN(), (2, 8, 6, 6)),
    "two_conv_cat": (lambda: TwoConvCat(), (2, 16, 6, 6)),
    "split_conv_cat": (lambda: SplitConvCat(), (2, 16, 6, 6)),
    "selective_kernel": (lambda: SKBlock(), (2, 16, 6, 6)),
}


# ---------------------------------------------------------------------------- structure
def test_res2net_reads_the_split_pieces_in_place_no_whole_tensor_copy():
    m, x = _case(Res2Block(), (2, 16, 6, 6))
    _, before = _schedule(m, x, enabled=False)
    _, after = _schedule(m, x)
    # before: the conv's epilogue stored whole, and a copy of its first piece for that piece's conv
    assert _named(before, "clone") and copies.copy_summary(before.regions)["copy_kernels"] == 1
    s = copies.copy_summary(after.regions)
    assert s["copy_kernels"] == 0 and s["bytes"] < copies.copy_summary(before.regions)["bytes"]
    # what is left: the first piece (with conv1's BN + ReLU) stored dense for its library conv;
    # the other pieces are read in place by the kernels that need them
    (piece,) = _named(after, "clone")
    (r,) = [r for r in after.regions if r.name == piece]
    assert "conv_epilogue_ref" in r.ops and len(after.regions) == len(before.regions) - 1


def test_dpn_dense_path_is_never_copied_its_readers_read_the_pieces():
    m, x = _case(DPN(), (2, 8, 6, 6))
    _, before = _schedule(m, x, enabled=False)
    _, after = _schedule(m, x)
    assert _named(before, "cat"), [r.name for r in before.regions]
    assert not _named(after, "cat") and not _named(after, "clone"), [r.name for r in after.regions]
    assert copies.copy_summary(after.regions)["copy_kernels"] == 0
    assert copies.copy_summary(after.regions)["bytes"] < copies.copy_summary(before.regions)["bytes"]


def test_pieces_library_convs_read_are_stored_by_one_kernel():
    m, x = _case(SplitConvCat(), (2, 16, 6, 6))
    gm, sched = _schedule(m, x)
    names = [r.name for r in sched.regions]
    assert not _named(sched, "clone") and len(names) == 2, names
    (pieces,) = [r for r in sched.regions if r.name.startswith("fx_pw_pieces_")]
    assert len(pieces.outputs) == 3 and len(pieces.kernel.parts) == 3
    assert all("fxopt_copies" in o.meta for o in pieces.outputs)
    # each piece its own dense buffer, written by its own part
    for j, part in enumerate(pieces.kernel.parts):
        assert {s.buf for s in part.stores} == {j}
        b = pieces.kernel.outputs[j]
        assert b.span() == b.numel
    # two convs and a concatenation: their epilogues computed where the concatenation writes them
    m, x = _case(TwoConvCat(), (2, 16, 6, 6))
    _, sched = _schedule(m, x)
    (r,) = sched.regions
    assert "conv_epilogue_ref" in r.ops and copies.copy_summary(sched.regions)["copy_kernels"] == 0


class CatOutput(nn.Module):
    """A concatenation input that is also a graph output, and a piece read by a conv and returned."""

    def __init__(self, c=8):
        super().__init__()
        self.a, self.b, self.post = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1), nn.Conv2d(2 * c, c, 1)

    def forward(self, x):
        a = F.relu(self.a(x))
        y = torch.cat([a, torch.sigmoid(self.b(x))], 1)
        p, q = torch.split(y * 2.0, [3, 13], 1)
        return self.post(y), a, p, self.post(torch.cat([q, p], 1))


def test_a_concatenation_input_that_is_an_output_keeps_its_own_tensor():
    m, x = _case(CatOutput(), (2, 8, 5, 5))
    fast = compile_with_fxopt(m, {"executor": "cuda", **CL})
    with torch.no_grad():
        got, want = fast(x), m(x)
    for g, w, p in zip(got, want, _pipeline_outputs(m, x, CL)):
        torch.testing.assert_close(g, w)
        _same_layout(g, w, p)
    # the returned input is its own tensor: writing it leaves the concatenation's reader alone
    assert all(got[1].untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in (got[0], got[2]))


def test_pieces_from_different_inputs_are_not_merged():
    class TwoSources(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.other = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 4, 1)
            self.c0, self.c1 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            p0, p1 = torch.split(F.relu(self.pre(x)), 4, 1)
            return self.c0(p0) + self.c1(p1 * self.other(x))

    m, x = _case(TwoSources(), (2, 8, 5, 5))
    _, sched = _schedule(m, x)
    assert not any(r.name.startswith("fx_pw_pieces_") for r in sched.regions), [r.name for r in sched.regions]


def test_a_stack_is_read_in_place_by_its_readers():
    """A stack is a choice among its inputs by the new dimension's index: the two reductions over it
    read the convolutions' outputs (their epilogues inlined), no kernel stores the stacked tensor
    and PyTorch's stack does not run (it did: one cat kernel and two layout copies per block)."""
    m, x = _case(SKBlock(), (2, 16, 6, 6), torch.float16)
    gm, sched = _schedule(m, x)
    assert "stack" not in sched.unfused
    stack = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.stack.default)
    assert not any(stack in r.outputs for r in sched.regions)
    convs = [n for n in gm.graph.nodes if n.target is fused_conv_ref and n.args[1].op != "placeholder"
             and int(n.meta["val"].shape[2]) == 6]  # the two paths' convolutions (not the attention's)
    assert len(convs) == 2
    readers = [r.name for r in sched.regions if set(convs) <= set(r.inputs)]
    assert sorted(readers) == ["fx_red_sum_1", "fx_red_sum_2"], readers
    assert copies.copy_summary(sched.regions)["copy_kernels"] == 0


def test_a_stack_is_fused_in_inference_graphs_only():
    """The cuda executor reads a stack in place in inference graphs; in a training graph the stack
    runs as PyTorch's (``movement_rules.INFERENCE_ONLY``)."""
    import fxopt

    torch.manual_seed(0)
    m, x = SKBlock(), torch.randn(2, 16, 6, 6)

    def fused_stacks(report):
        return [name for g in report.graphs for name, r in g.executor_details.get("regions", {}).items()
                if any(n.startswith("stack") for n in r["nodes"])]
    assert fused_stacks(fxopt.explain(m.eval(), x, options={"executor": "cuda"})) == ["fx_red_sum_1", "fx_red_sum_2"]
    training = fxopt.explain(m.train(), x.requires_grad_(), options={"executor": "cuda"}, training=True)
    assert any(n.target is torch.ops.aten.stack.default for g in training.graphs for n in g.after.graph.nodes)
    assert fused_stacks(training) == []


def test_merged_kernel_runs_in_the_interpreter_and_compiles():
    m, x = _case(SplitConvCat(pieces=(3, 5, 8)), (2, 16, 5, 5), torch.float16)
    scheds = check_fusion(CNNCase(m, (x,), torch.float16), CL, compile_kernels=nvrtc_available())
    assert any(r.name.startswith("fx_pw_pieces_") for s in scheds for r in s.regions)


def test_report_counts_copy_kernels_and_bytes():
    graphs = []
    m, x = _case(Res2Block(), (2, 16, 6, 6))
    fast = compile_with_fxopt(m, {"executor": "cuda", **CL}, graphs)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), m(x))
    c = graphs[0].executor_details["copies"]
    assert c["copy_kernels"] == 0 and c["kernels"] == len(graphs[0].executor_details["regions"]) and c["bytes"] > 0


def test_traffic_counts_the_piece_a_kernel_reads():
    i, j = ir.Var("i", 4), ir.Var("j", 8)
    src = ir.Buffer("x", (4, 32), (32, 1), torch.float16)  # reads 8 of its 32 columns
    out = ir.Buffer("y", (4, 8), (8, 1), torch.float16)
    k = ir.PointwiseKernel("k", [i, j], [src], [out],
                           [ir.Store(0, ir.Ix.of(i) * 8 + j, ir.Load(0, ir.Ix.of(i) * 32 + j + 8))])
    assert copies.traffic(k) == (4 * 8 * 2, 4 * 8 * 2)


# ---------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("name", sorted(BLOCKS))
@pytest.mark.parametrize("dtype,cl", [(torch.float32, True), (torch.float16, True), (torch.float32, False)])
def test_every_region_matches_its_aten_ops_and_the_model_matches_eager(name, dtype, cl):
    mk, shape = BLOCKS[name]
    m, x = _case(mk(), shape, dtype, cl)
    scheds = check_fusion(CNNCase(m, (x,), dtype), CL if cl else {"layout": "contiguous"})
    for s in scheds:
        assert copies.copy_summary(s.regions)["copy_kernels"] == 0, [r.name for r in s.regions]
    fast = compile_with_fxopt(m, {"executor": "cuda", **(CL if cl else {})})
    with torch.no_grad():
        got, want = fast(x), m(x)
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    _same_layout(got, want, _pipeline_outputs(m, x, CL if cl else {})[0])


# ---------------------------------------------------------------------------- property
class RandomSplitCat(nn.Module):
    """A conv's output split into pieces of the given widths, each piece through a producer of some
    kind, concatenated (and a piece and the concatenation returned too where ``outputs``)."""

    def __init__(self, widths, kinds, outputs):
        super().__init__()
        c = sum(widths)
        self.widths, self.kinds, self.outputs = list(widths), list(kinds), outputs
        self.pre = nn.Conv2d(4, c, 1)
        self.convs = nn.ModuleList(nn.Conv2d(w, w, 3, padding=1) for w in widths)
        out_c = sum(2 * w if k == "cat" else w for w, k in zip(widths, kinds))
        self.post = nn.Conv2d(out_c, 4, 1)

    def forward(self, x):
        ps = torch.split(F.relu(self.pre(x)), self.widths, 1)
        outs = []
        for p, k, conv in zip(ps, self.kinds, self.convs):
            if k == "conv":
                outs.append(conv(p))
            elif k == "pointwise":
                outs.append(torch.sigmoid(p * 2.0 - 1.0))
            elif k == "pool":
                outs.append(F.max_pool2d(p, 3, 1, 1))
            elif k == "cat":
                outs.append(torch.cat([p, F.relu(conv(p))], 1))
            else:
                outs.append(p)
        y = torch.cat(outs, 1)
        if self.outputs:
            return self.post(y), y, ps[0]
        return self.post(y)


@settings(max_examples=6, deadline=None)
@given(widths=st.lists(st.integers(1, 7), min_size=1, max_size=4),
       kinds=st.lists(st.sampled_from(["conv", "pointwise", "pool", "cat", "piece"]), min_size=4, max_size=4),
       outputs=st.booleans(), cl=st.booleans(), half=st.booleans())
def test_property_random_splits_and_concatenations_match_eager(widths, kinds, outputs, cl, half):
    dtype = torch.float16 if half else torch.float32
    m, x = _case(RandomSplitCat(widths, kinds[:len(widths)], outputs), (2, 4, 5, 5), dtype, cl)
    layout = CL if cl else {"layout": "contiguous"}
    check_fusion(CNNCase(m, (x,), dtype), layout)
    fast = compile_with_fxopt(m, {"executor": "cuda", **layout})
    with torch.no_grad():
        got, want = fast(x), m(x)
    got, want = (got, want) if outputs else ((got,), (want,))
    tol = 2e-2 if half else 1e-4
    for g, w, p in zip(got, want, _pipeline_outputs(m, x, layout)):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
        assert g.shape == w.shape
        _same_layout(g, w, p)
