"""The fusion scheduler (backends/cuda/ir/, schedule/, kernels/region.py) on the CPU:
index algebra, which nodes form which regions (and which do not), the IR semantics of every region
against its ATen ops, the graph rewrite, NVRTC compilation of the generated sources, and hypothesis
properties over random blocks (fxopt.testing.block_cases / cnn_cases)."""
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings

from fxopt.backends import torch_ref
from fxopt.backends.cuda.compiler import nvrtc_available
from fxopt.backends.cuda import ir
from fxopt.backends.cuda.schedule.fusion import schedule
from fxopt.backends.cuda.schedule.lowering import view_root
from fxopt.backends.cuda.schedule.rewrite import rewrite
from fxopt.backends.cuda.schedule.generated import RegionReference
from fxopt.backends.cuda.ir import FloorDiv, Ix, Mod, Var
from fxopt.testing import block_cases, check_fusion, cnn_cases
from fxopt.testing.fusion import capture

needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")
aten = torch.ops.aten


# ---------------------------------------------------------------------------- index algebra
def test_floordiv_and_mod_fold_dense_views_back_to_plain_indices():
    i, j = Var("i", 4), Var("j", 8)
    flat = Ix.of(i) * 8 + j
    assert flat.floordiv(8) == Ix.of(i)
    assert flat.mod(8) == Ix.of(j)
    assert (flat * 3 + 5).floordiv(3) == flat + 1  # (3*flat + 5) // 3 with 5 = 3 + 2
    assert Ix.of(j).floordiv(8) == Ix()  # j < 8
    # a permuted view of a (4, 8) tensor unravelled and raveled again is the identity
    back = ir.unravel(Ix.of(j) * 4 + i, (8, 4), (4, 1))
    assert back == [Ix.of(j), Ix.of(i)]


def test_floordiv_that_does_not_fold_keeps_an_atom_with_its_bounds():
    i = Var("i", 10)
    q = Ix.of(i).floordiv(3)
    assert len(q.terms) == 1 and isinstance(q.terms[0][0], FloorDiv)
    assert q.bounds() == (0, 3)
    r = (Ix.of(i) + 7).mod(5)
    assert isinstance(r.terms[0][0], Mod) and r.bounds() == (0, 4)
    # a possibly negative index: split so that the atom's argument is non-negative (C's division
    # truncates), and equal to floor division at every point
    q = (Ix.of(i) - 3).floordiv(4)
    assert all(a.arg.bounds()[0] >= 0 for a, _ in q.terms if not isinstance(a, Var))
    env = {i: torch.arange(10)}
    assert torch.equal(ir.eval_ix(q, env), torch.div(torch.arange(10) - 3, 4, rounding_mode="floor"))
    with pytest.raises(ValueError):
        (Ix.of(i) * -1).mod(4)  # no non-negative form


def test_evaluate_runs_a_handwritten_kernel_with_the_generated_codes_offsets():
    x = torch.arange(24.0).reshape(2, 3, 4)
    i, j, k = Var("i", 2), Var("j", 4), Var("k", 3)  # output (2, 4, 3) = x.permute(0, 2, 1) * 2
    load = ir.Load(0, ir.strided([Ix.of(i), Ix.of(k), Ix.of(j)], x.shape, x.stride()))
    out_buf = ir.Buffer("out", (2, 4, 3), (12, 3, 1), torch.float32)
    kern = ir.PointwiseKernel("k", [i, j, k], [ir.Buffer("x", (2, 3, 4), x.stride(), torch.float32)], [out_buf],
                              [ir.Store(0, ir.strided([Ix.of(i), Ix.of(j), Ix.of(k)], (2, 4, 3), (12, 3, 1)),
                                        ir.op("mul", load, 2.0))])
    out = torch.empty(2, 4, 3)
    ir.evaluate(kern, [x], [out])
    torch.testing.assert_close(out, x.permute(0, 2, 1) * 2)


# ---------------------------------------------------------------------------- structure
class ConvNeXtBlock(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.ln = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(F.gelu(self.fc1(self.ln(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


def _schedule_of(model, x, **opts):
    (report, example), = capture(model, (x,), {"executor": "torch", **opts})
    gm = torch_ref.lower(report.after)
    return gm, example, schedule(gm, strict=True)


def _regions_by_ops(sched):
    return [sorted(r.ops) for r in sched.regions]


def test_convnext_block_layernorm_is_one_kernel_with_the_permute_and_the_residual_is_one_kernel():
    _, _, sched = _schedule_of(ConvNeXtBlock().eval(), torch.randn(2, 8, 6, 6))
    ops = _regions_by_ops(sched)
    (ln,) = [r for r in sched.regions if "aten.native_layer_norm.default" in r.ops]
    # the conv's output is read through the permute's strides (a view torch makes for free)
    assert [n.target for n in ln.inputs if n.op == "call_function"] == [aten.permute.default]
    assert any("aten.gelu.default" in o for o in ops)
    residual = [o for o in ops if "aten.add.Tensor" in o]
    assert len(residual) == 1 and "aten.mul.Tensor" in residual[0] and "aten.permute.default" in residual[0]
    assert all(isinstance(r.kernel, (ir.PointwiseKernel, ir.ReductionKernel)) for r in sched.regions)


class DenseLayer(nn.Module):
    def __init__(self, c=6, g=4):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(3, g, 1)
        self.bn = nn.BatchNorm2d(c + g)
        self.conv = nn.Conv2d(c + g, 8, 1)

    def forward(self, x):
        return self.conv(F.relu(self.bn(torch.cat([self.a(x), self.b(x)], 1))))


def test_concatenation_batchnorm_and_relu_before_a_conv_are_one_kernel_that_writes_once():
    gm, _, sched = _schedule_of(DenseLayer().eval(), torch.randn(2, 3, 5, 5))
    (region,) = sched.regions
    assert {"aten.cat.default", "aten.relu.default", "aten._native_batch_norm_legit_no_training.default"} <= set(
        region.ops)
    assert isinstance(region.kernel, ir.PointwiseKernel) and len(region.outputs) == 1


class ShuffleBlock(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        y = torch.cat([a, torch.relu(b)], 1)
        n, c, h, w = y.shape
        return y.reshape(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w) * 2.0


def test_split_concatenation_and_channel_shuffle_are_index_arithmetic_in_one_kernel():
    _, _, sched = _schedule_of(ShuffleBlock().eval(), torch.randn(2, 8, 3, 3))
    (region,) = sched.regions
    assert {"aten.cat.default", "aten.transpose.int", "aten.mul.Tensor"} <= set(region.ops)
    # the chunks of the graph input are read in place (views torch makes for free): no copies
    assert {view_root(n).op for n in region.inputs} == {"placeholder"}


class ShuffleUnits(nn.Module):
    """ShuffleNet-v2 units: each shuffled tensor feeds the next unit's conv (one half) and its
    concatenation (the other half), so two kernels need it."""

    def __init__(self, c=16, units=3):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c // 2, c // 2, 1) for _ in range(units))

    def forward(self, x):
        for conv in self.convs:
            a, b = x.chunk(2, dim=1)
            y = torch.cat([a, F.relu(conv(b))], 1)
            n, c, h, w = y.shape
            x = y.reshape(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)
        return x


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_value_two_kernels_share_is_stored_once_at_the_end_of_its_chain(layout):
    """Of a chain of data movement (concatenation, the layout pass's copies, the shuffle) that
    two kernels need, only its last value is stored: each unit's concatenation and shuffle are one
    kernel, not one stored copy per op."""
    from fxopt.backends.cuda.schedule.rewrite import split_conv_epilogues

    gm, _, _ = _schedule_of(ShuffleUnits().eval(), torch.randn(2, 16, 6, 6), layout=layout)
    split_conv_epilogues(gm)  # as the cuda executor does: each ReLU moves into the concatenation
    sched = schedule(gm, strict=True)
    cats = [r for r in sched.regions if "aten.cat.default" in r.ops]
    assert len(cats) == 3 and all("aten.transpose.int" in r.ops for r in cats), _regions_by_ops(sched)
    assert len(sched.regions) <= 2 * 3 + 1, _regions_by_ops(sched)  # + a copy per conv input, + the input's


class LayerNormThenGroupNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.gn = nn.LayerNorm(4, elementwise_affine=False), nn.GroupNorm(2, 4, affine=False)

    def forward(self, x):
        return self.gn(self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


def test_region_strides_are_checked_against_eager_or_where_torch_disagrees_with_itself_its_metadata(monkeypatch):
    """The group norm gets a channels_last input: its CPU kernel keeps that layout, its metadata
    (and its CUDA kernel) do not; the generated kernel writes what the metadata says. A kernel
    writing other strides than both fails the check."""
    from fxopt.backends.cuda.schedule import build
    from fxopt.testing.strategies import CNNCase

    case = CNNCase(LayerNormThenGroupNorm().eval(), (torch.randn(2, 4, 3, 5),), torch.float32)
    assert check_fusion(case)
    real = build._out_buffer

    def transposed(n):  # H and W swapped in memory: the same values, other (dense) strides
        b = real(n)
        if len(b.shape) != 4 or b.shape[1] != 4:
            return b
        _, c, h, w = b.shape
        return ir.Buffer(b.name, b.shape, (c * h * w, h * w, 1, h), b.dtype)
    monkeypatch.setattr(build, "_out_buffer", transposed)
    with pytest.raises(AssertionError, match="strides"):
        check_fusion(case)


class SoftmaxGate(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=1) * x.amax((2, 3), keepdim=True)


def test_softmax_is_one_reduction_kernel_and_a_reduction_feeding_a_pointwise_op_is_stored_once():
    _, _, sched = _schedule_of(SoftmaxGate().eval(), torch.randn(2, 4, 3, 5))
    kinds = sorted(type(r.kernel).__name__ for r in sched.regions)
    assert kinds == ["PointwiseKernel", "ReductionKernel", "ReductionKernel"]
    soft = next(r for r in sched.regions if "aten._softmax.default" in r.ops)
    assert len(soft.kernel.phases) == 2 and soft.kernel.row_stores  # max, then sum of exp; then the output


class SqueezeExcite(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.fc1, self.fc2 = nn.Conv2d(c, c // 2, 1), nn.Conv2d(c // 2, c, 1)
        self.out = nn.Conv2d(c, c, 1)

    def forward(self, x):
        y = F.silu(self.conv(x))
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(y.mean((2, 3), keepdim=True)))))
        return self.out(y * s)


def test_a_conv_epilogue_read_only_by_generated_kernels_moves_into_them():
    from fxopt.backends.cuda.schedule.rewrite import split_conv_epilogues
    from fxopt.ops import conv_epilogue_ref, fused_conv_ref

    (report, _), = capture(SqueezeExcite().eval(), (torch.randn(2, 8, 6, 6),), {"executor": "torch"})
    gm = torch_ref.lower(report.after)
    # the SiLU conv (read by the mean and the multiply) and the sigmoid gate conv (read by the multiply)
    assert split_conv_epilogues(gm) == 2
    epis = {n.args[3]: n for n in gm.graph.nodes if n.target is conv_epilogue_ref}
    assert set(epis) == {"silu", "sigmoid"}
    epi = epis["silu"]
    assert epi.args[0].target is fused_conv_ref and epi.args[0].args[8] == "none" and epi.args[0].args[2] is None
    sched = schedule(gm, strict=True)
    inlined = [r for r in sched.regions if "conv_epilogue_ref" in r.ops]
    assert {type(r.kernel).__name__ for r in inlined} == {"PointwiseKernel", "ReductionKernel"}
    assert epi not in {o for r in sched.regions for o in r.outputs}  # computed where read, never stored
    # the first gate conv (read by a conv) and the last conv (the output) keep their epilogues
    assert sum(n.target is fused_conv_ref and (n.args[2] is not None or n.args[8] != "none")
               for n in gm.graph.nodes) == 2


class _RowNorms(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln = nn.LayerNorm(c)

    def forward(self, x):
        return torch.softmax(self.ln(x), -1)


def _row_kernels(c, dtype=torch.float16, hw=5):
    (report, _), = capture(_RowNorms(c).eval().to(dtype), (torch.randn(2, hw, hw, c).to(dtype),), {"executor": "torch"})
    gm = torch_ref.lower(report.after)
    return [r.kernel for r in schedule(gm, strict=True).regions if isinstance(r.kernel, ir.ReductionKernel)]


@pytest.mark.parametrize("c, vec, tpr, iters, tail", [(96, 8, 16, 1, True), (384, 8, 32, 2, True),
                                                      (768, 8, 32, 3, False), (40, 8, 8, 1, True),
                                                      (7, 1, 8, 1, True), (1000, 8, 32, 4, True)])
def test_rows_that_fit_in_registers_are_loaded_once_in_vectors(c, vec, tpr, iters, tail):
    """LayerNorm and softmax over the channels of a channels-last row: each thread loads its
    ``iters`` x ``vec`` values once (16-byte loads where the row allows) and keeps them for every
    phase and the output; a partial last chunk is guarded, never read out of bounds."""
    from fxopt.backends.cuda.kernels.region import generate_kernel, vector_width
    from fxopt.backends.cuda.kernels.reduction import row_plan

    kernels = _row_kernels(c)
    assert kernels
    for k in kernels:
        assert vector_width(k) == vec
        plan = row_plan(k, vec)
        assert (plan.vec, plan.tpr, plan.iters) == (vec, tpr, iters) and plan.tpr * plan.iters * vec >= c
        src = generate_kernel(k, vec).source
        row_input = next(ld.buf for ph in k.phases for ld in ir.walk(ph.value) if isinstance(ld, ir.Load))
        if vec > 1:  # the row arrives in vector loads only, each once
            assert src.count(f"(in{row_input} + ") == iters and f"in{row_input}[" not in src
        else:
            assert src.count(f"in{row_input}[") == iters
        assert ("ok0_" in src or f"ok{iters - 1}_" in src) == tail
        assert src.count("__shfl_xor_sync") == len(k.phases)


def test_rows_too_long_for_registers_keep_the_strided_loops():
    from fxopt.backends.cuda.kernels.region import generate_kernel, vector_width
    from fxopt.backends.cuda.kernels.reduction import row_plan

    for k in _row_kernels(4096, hw=2):
        assert row_plan(k, 8) is None and vector_width(k) == 1
        src = generate_kernel(k, 1).source
        assert "_rows" not in src and "for (idx_t r_ = lane_" in src


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_register_rows_compile_for_every_width(dtype):
    from fxopt.backends.cuda.kernels.region import generate_kernel, vector_width
    from fxopt.backends.cuda.compiler import compile_ptx

    for c in (40, 384):
        for k in _row_kernels(c, dtype):
            for vec in {vector_width(k), 1}:
                ks = generate_kernel(k, vec)
                assert ks.meta["vec"] == vec and (vec == 1) == (not ks.meta["aligned"])
                assert ".entry" in compile_ptx(ks.source, ks.name, "sm_90")


@needs_nvrtc
def test_fast_math_approximates_exp_and_division_in_every_float_dtype():
    from fxopt.backends.cuda.kernels.region import generate_kernel
    from fxopt.backends.cuda.compiler import compile_ptx
    from fxopt.backends.cuda.schedule.rewrite import split_conv_epilogues

    for dtype in (torch.bfloat16, torch.float32):
        (report, _), = capture(SqueezeExcite().eval().to(dtype), (torch.randn(2, 8, 6, 6).to(dtype),),
                               {"executor": "torch"})
        gm = torch_ref.lower(report.after)
        split_conv_epilogues(gm)
        gate = next(r for r in schedule(gm, strict=True).regions if "aten.mul.Tensor" in r.ops)
        ieee, fast = generate_kernel(gate.kernel, 1), generate_kernel(gate.kernel, 1, fast_math=True)
        assert not ieee.meta["fast_math"] and "#define FXOPT_FAST_MATH" not in ieee.source
        assert fast.meta["fast_math"] and fast.source.startswith("#define FXOPT_FAST_MATH 1\n")
        assert fast.name != ieee.name  # both may live in one process and one profile
        ptx_ieee, ptx_fast = (compile_ptx(k.source, k.name, "sm_90") for k in (ieee, fast))
        # SiLU's and the sigmoid's quotients: IEEE division (div.rn) unless fast; exp is ex2.approx in both,
        # with expf's extra range reduction only in the IEEE kernel
        assert "div.rn.f32" in ptx_ieee and "div.rn.f32" not in ptx_fast
        assert ptx_fast.count("ex2.approx") >= 2
        if dtype == torch.bfloat16:  # (float32's cheaper body gets unrolled further: PTX lines say little there)
            assert len(ptx_fast.splitlines()) < len(ptx_ieee.splitlines())


def test_a_graph_with_in_place_ops_is_not_fused():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4, 4)
    y = g.call_function(aten.relu.default, (x,))
    y.meta["val"] = torch.randn(4, 4)
    z = g.call_function(aten.add_.Tensor, (y, x))
    z.meta["val"] = torch.randn(4, 4)
    g.output((z,))
    sched = schedule(fx.GraphModule(torch.nn.Module(), g))
    assert sched.regions == [] and all("in place" in why for why in sched.unfused.values()) and sched.unfused


def _writes_graph(tail_ok: bool = True, dst_is_input: bool = True, read_after: bool = False):
    """x, buf -> relu(x) * 2 + x, and buf <- mean(x) (the shape of a training forward writing a
    BatchNorm buffer); variants move the write before a read or into a non-input."""
    g = fx.Graph()
    x, buf = g.placeholder("x"), g.placeholder("buf")
    x.meta["val"], buf.meta["val"] = torch.randn(4, 4), torch.randn(4)
    mean = g.call_function(aten.mean.dim, (x, [0]))
    mean.meta["val"] = torch.randn(4)
    new = g.call_function(aten.clone.default, (mean,))
    new.meta["val"] = torch.randn(4)
    r = g.call_function(aten.relu.default, (x,))
    r.meta["val"] = torch.randn(4, 4)
    dst = buf if dst_is_input else g.call_function(aten.zeros.default, ([4],), {"device": torch.device("cpu")})
    dst.meta["val"] = torch.randn(4)

    def write():
        w = g.call_function(aten.copy_.default, (dst, new))
        w.meta["val"] = torch.randn(4)
    if not tail_ok:
        write()
    m = g.call_function(aten.mul.Tensor, (r, 2.0))
    m.meta["val"] = torch.randn(4, 4)
    src = buf if read_after else x
    out = g.call_function(aten.add.Tensor, (m, src))
    out.meta["val"] = torch.randn(4, 4)
    if tail_ok:
        write()
    g.output((out,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_copies_into_inputs_after_every_other_op_do_not_stop_fusion_and_stay_last():
    gm = _writes_graph()
    x, buf = torch.randn(4, 4), torch.randn(4)
    want_buf, want = x.mean(0), torch.relu(x) * 2 + x
    sched = schedule(gm, strict=True)
    assert {"aten.relu.default", "aten.mul.Tensor", "aten.add.Tensor"} in [set(r.ops) for r in sched.regions]
    assert list(sched.unfused.values()) == ["no rule for aten.copy_.default"], sched.unfused
    rewrite(gm, sched.regions, [RegionReference(gm, r) for r in sched.regions])
    gm.graph.lint()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert calls[-1].target is aten.copy_.default  # the write is still the last op
    got, = gm(x, buf)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(buf, want_buf)


@pytest.mark.parametrize("variant", ["write_before_other_ops", "write_into_a_non_input"])
def test_other_in_place_writes_still_leave_the_graph_unfused(variant):
    gm = _writes_graph(tail_ok=variant != "write_before_other_ops", dst_is_input=variant != "write_into_a_non_input")
    sched = schedule(gm)
    assert sched.regions == [] and sched.unfused
    assert all("in place" in why for why in sched.unfused.values()), sched.unfused


def test_integer_tensors_are_left_to_pytorch_with_a_reason():
    class M(nn.Module):
        def forward(self, x):
            return (x.long() + 1).float() * 2

    _, _, sched = _schedule_of(M().eval(), torch.randn(3, 4))
    assert any("int64" in why or "conversion" in why for why in sched.unfused.values())


def test_many_declined_nodes_settle_in_one_round_each():
    """Every node whose rule declines in a round is left to PyTorch at once: a training forward
    of a deep network increments one int64 counter per BatchNorm (more than the scheduler's
    rounds), and the float work around them is still fused."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4, 4)
    outs = [g.call_function(aten.mul.Tensor, (g.call_function(aten.relu.default, (x,)), 2.0))]
    outs[0].args[0].meta["val"] = outs[0].meta["val"] = torch.randn(4, 4)
    for i in range(80):
        c = g.placeholder(f"c{i}")
        c.meta["val"] = torch.zeros((), dtype=torch.int64)
        outs.append(g.call_function(aten.add.Tensor, (c, 1)))
        outs[-1].meta["val"] = torch.zeros((), dtype=torch.int64)
    g.output(tuple(outs))
    sched = schedule(fx.GraphModule(torch.nn.Module(), g), max_rounds=3)
    assert _regions_by_ops(sched) == [["aten.mul.Tensor", "aten.relu.default"]], sched.unfused
    assert sum("int64" in why for why in sched.unfused.values()) == 80


def test_scheduling_a_rewritten_graph_again_changes_nothing():
    gm, example, sched = _schedule_of(ConvNeXtBlock().eval(), torch.randn(1, 8, 4, 4))
    rewrite(gm, sched.regions, [RegionReference(gm, r) for r in sched.regions])
    again = schedule(gm, strict=True)
    assert again.regions == []
    gm.graph.lint()


# ---------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("model,shape", [(ConvNeXtBlock(), (2, 8, 5, 7)), (DenseLayer(), (2, 3, 6, 4)),
                                         (ShuffleBlock(), (3, 8, 2, 5)), (SoftmaxGate(), (2, 6, 4, 3)),
                                         (SqueezeExcite(), (2, 8, 5, 5))],
                         ids=["convnext", "dense", "shuffle", "softmax", "squeeze_excite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_region_computes_what_its_aten_ops_compute(model, shape, dtype):
    from fxopt.testing.strategies import CNNCase

    case = CNNCase(model.eval().to(dtype), (torch.randn(shape).to(dtype),), dtype)
    sched = check_fusion(case)
    assert sched and sched[0].regions


@needs_nvrtc
def test_generated_sources_compile_for_sm90():
    from fxopt.testing.strategies import CNNCase

    for model, shape in ((ConvNeXtBlock(), (2, 8, 5, 7)), (DenseLayer(), (2, 3, 6, 4)), (SoftmaxGate(), (2, 6, 4, 3))):
        for dtype in (torch.float32, torch.bfloat16):
            check_fusion(CNNCase(model.eval().to(dtype), (torch.randn(shape).to(dtype),), dtype),
                         compile_kernels=True)


def test_compiled_model_with_the_cuda_executor_on_cpu_runs_the_region_references_and_reports_kernels():
    model = ConvNeXtBlock().eval()
    x = torch.randn(2, 8, 5, 5)
    graphs = []
    from fxopt.testing import compile_with_fxopt

    fast = compile_with_fxopt(model, {"executor": "cuda"}, graphs)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
    (g,) = graphs
    regions = g.executor_details["regions"]
    assert regions and all(r["ops"] for r in regions.values())
    covered = {op for r in regions.values() for op in r["ops"]}
    assert "aten.native_layer_norm.default" in covered
    if nvrtc_available():
        fused = [k for k in g.kernels if k.ops]
        assert fused and all(k.compiled for k in fused)
        assert any("native_layer_norm" in " ".join(k.ops) for k in fused)


def test_option_fusion_false_leaves_the_graph_one_op_at_a_time():
    graphs = []
    from fxopt.testing import compile_with_fxopt

    fast = compile_with_fxopt(ConvNeXtBlock().eval(), {"executor": "cuda", "fusion": False}, graphs)
    with torch.no_grad():
        fast(torch.randn(1, 8, 4, 4))
    assert "regions" not in graphs[0].executor_details


# ---------------------------------------------------------------------------- properties
@given(block_cases(dtypes=(torch.float32, torch.float16, torch.bfloat16)))
def test_property_every_region_of_random_blocks_matches_its_aten_ops(case):
    check_fusion(case)


@given(cnn_cases(ndims=(1, 2), dtypes=(torch.float32, torch.float16)))
def test_property_every_region_of_random_cnns_matches_its_aten_ops(case):
    check_fusion(case)


@needs_nvrtc
@given(block_cases(max_layers=3))
@settings(max_examples=8)
def test_property_regions_of_random_blocks_compile(case):
    check_fusion(case, compile_kernels=True)


def test_getitem_of_rewritten_regions_carry_the_outputs_metadata():
    gm, _, sched = _schedule_of(SoftmaxGate().eval(), torch.randn(2, 4, 3, 5))
    metas = {o.name: o.meta["val"].shape for r in sched.regions for o in r.outputs}
    nodes = rewrite(gm, sched.regions, [RegionReference(gm, r) for r in sched.regions])
    for node in nodes:
        items = [u for u in node.users if u.target is operator.getitem]
        assert items and all(isinstance(u.meta.get("val"), torch.Tensor) for u in items)
    assert metas


def test_explain_lists_each_fused_kernels_ops_and_the_ops_left_to_pytorch():
    import fxopt

    class M(nn.Module):
        def forward(self, x):
            return (x.long() + 1).float() * torch.softmax(x, 1)

    report = fxopt.explain(M().eval(), torch.randn(2, 4, 3, 3), options={"executor": "cuda"})
    text = report.fusion_table()
    assert "aten._softmax.default" in text and "fused regions" in text
    assert "ops run as PyTorch runs them" in text and "int64" in text
    assert "kernels_per_call" in report.to_dict()


def test_report_says_which_way_each_cuda_graph_runs_and_the_times_behind_it():
    import fxopt

    class Runner:
        def __init__(self, decisions):
            self._d = decisions

        def decisions(self):
            return self._d

    report = fxopt.explain(ConvNeXtBlock().eval(), torch.randn(2, 8, 5, 5), options={"executor": "cuda"})
    (g,) = report.graphs
    g.executor_details["cudagraph_runner"] = Runner([
        {"runs": "optimized graph, no early launch", "graph_ms": 0.486, "graph_no_pdl_ms": 0.446, "plain_ms": 9.6,
         "baseline_graph_ms": 0.687},
        {"runs": "optimized graph", "cached": True, "graph_ms": 2.2},
        {"runs": "optimized graph", "not_measured": "out of memory while measuring"}])
    lines = [ln for ln in report.fusion_table().splitlines() if "CUDA graph" in ln]
    assert lines == [
        "graph 0: CUDA graph runs the optimized graph, no early launch: optimized replay 0.486 ms, without early "
        "launch 0.446 ms, uncaptured 9.600 ms, unoptimized replay 0.687 ms",
        "graph 0: CUDA graph runs the optimized graph: optimized replay 2.200 ms (cached decision)",
        "graph 0: CUDA graph runs the optimized graph (not measured: out of memory while measuring)"]
    assert lines[0] in str(report)


def test_bench_report_has_a_kernels_per_call_table():
    from fxopt.bench.report import _kernel_lines

    cells = [{"model": "m", "batch": 1, "dtype": "float16", "backend": b, "kernels_per_call": n}
             for b, n in (("fxopt", 12), ("inductor", 20))]
    lines = _kernel_lines({"cells": cells})
    assert "| m | 1 | float16 | 12 | 20 |" in lines
    assert _kernel_lines({"cells": [dict(cells[0], kernels_per_call=None)]}) == []
