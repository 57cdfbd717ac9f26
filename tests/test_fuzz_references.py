"""The fuzzer's float64 references (``fxopt.fuzz.references``) and its judge (``fxopt.fuzz.check.compare``):
where the references run, how far the rounded runs, the branch flips and eager at nearby inputs say
a value may move, and what is an upstream divergence (PyTorch's own compiled graph off alike)."""
import copy

import pytest
import torch

from fxopt.fuzz import check as fuzz_check
from fxopt.fuzz import references as fuzz_refs
from fxopt.fuzz.graphs import Program, render


def _bias_before_bn(dtype: str, batch: int = 16) -> Program:
    init = ["self.m0 = nn.Conv2d(3, 4, 1)", "self.m1 = nn.BatchNorm2d(4)"]
    return Program.of(["x = torch.tanh(self.m1(self.m0(x)))"], init, (batch, 3, 6, 5), "training", dtype, seed=11)


def _loss(outs, ref=False):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(outs.shape, generator=gen, dtype=torch.float64).to(outs.device)
    return ((outs.double() if ref else outs.float()) * w.to(outs.dtype if not ref else torch.float64)).sum()


def test_rounded_runs_round_the_backward_too():
    """A convolution's bias gradient before a training BatchNorm is 0 exactly: a sum of the
    BatchNorm's input gradient, which cancels. A 16-bit backward writes each of those terms rounded,
    so every implementation's sum is noise of the terms' size (GPU fuzz 6e42ecd3e1). The perturbed
    runs round every gradient the backward computes as well, so their spread has that size (rounding
    the forward alone leaves the exact BatchNorm backward's terms cancelling, to 1e-14)."""
    prog = _bias_before_bn("bfloat16")
    model, x = fuzz_check.build(prog, "cpu")
    ref = fuzz_refs.Reference64(model, x, prog)
    exact = ref.grad("m0.bias", _loss)
    assert float(exact.abs().max()) < 1e-10
    perturbed = [r for r in ref.rounded.refs if r.perturb]
    assert len(perturbed) == fuzz_refs.PERTURBED_SAMPLES
    spreads = [float((r.grad("m0.bias", _loss) - exact).abs().max()) for r in perturbed]
    # the terms: the gradient reaching the convolution's output, per channel
    m = ref.model
    xr = x.detach().double().requires_grad_(True)
    y = m.m0(xr)
    y.retain_grad()
    _loss(torch.tanh(m.m1(y)), True).backward()
    terms = y.grad.abs()
    u = fuzz_refs.unit_roundoff(torch.bfloat16, "cpu")
    worst = float(u * terms.sum((0, 2, 3)).max())  # every rounding error of one sign
    typical = float(u * terms.pow(2).sum((0, 2, 3)).sqrt().max())  # a random walk of them
    assert all(s < worst for s in spreads)
    assert max(spreads) > 0.5 * typical, (spreads, typical)  # measured: 1.0-1.5x on this program


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_float64_reference_runs_on_the_cpu():
    """A CUDA kernel wrong in eager's layout would be as wrong in float64 on the GPU (GPU fuzz
    68a548ca2f): the reference is the CPU's."""
    prog = _bias_before_bn("float32", batch=2)
    model, x = fuzz_check.build(prog, "cuda")
    ref = fuzz_refs.Reference64(model, x, prog)
    assert ref.out().device.type == "cpu" and ref.grad("m0.weight", _loss).device.type == "cpu"
    assert next(model.parameters()).device.type == "cuda"  # the model itself is left where it was


def test_a_cancelled_value_is_judged_by_the_size_of_its_noise():
    """Where float64's value is 0 (at most ``CANCELLED`` of the noise), fxopt's error may be up to
    ``NOISE_FACTOR`` times the largest sample; anywhere else twice, as before; and not beyond."""
    from fxopt.fuzz.check import NOISE_FACTOR, Mismatch, compare

    eager = torch.tensor([0.1, -0.05])
    zero = torch.tensor([1e-15, -2e-15], dtype=torch.float64)
    compare("b.grad", torch.tensor([0.4, 0.1]), eager, lambda: zero, 1e-3, 1e-3)  # 4x eager's noise
    with pytest.raises(Mismatch, match=r"exactly 0 in float64: up to 8x"):
        compare("b.grad", torch.tensor([0.1 * NOISE_FACTOR + 0.01, 0.0]), eager, lambda: zero, 1e-3, 1e-3)
    nonzero = torch.tensor([0.2, -0.05], dtype=torch.float64)  # the same differences where it is not 0
    with pytest.raises(Mismatch, match=r"error vs float64 0.3, eager.s 0.1 \(atol"):
        compare("b.grad", torch.tensor([0.5, -0.05]), torch.tensor([0.3, -0.05]), lambda: nonzero, 1e-3, 1e-3)


def test_parameters_after_the_step_are_judged_against_float64_like_the_gradients():
    """Where fxopt's parameters after the SGD step differ from eager's by more than the tolerance,
    the step float64 takes decides (before - LR * float64 gradient), as for the gradients."""
    from fxopt.fuzz.check import LR, Mismatch, compare

    before = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    grad64 = torch.tensor([0.5, 0.25, -1.0], dtype=torch.float64)
    exact = before - LR * grad64
    eager = (exact + torch.tensor([3e-3, 0.0, 0.0], dtype=torch.float64)).float()  # eager's own rounding
    close = (exact + torch.tensor([4e-3, 0.0, 0.0], dtype=torch.float64)).float()
    wrong = (exact + torch.tensor([0.05, 0.0, 0.0], dtype=torch.float64)).float()
    compare("p after the step", close, eager, lambda: exact, 1e-5, 1e-5)
    with pytest.raises(Mismatch, match="error vs float64"):
        compare("p after the step", wrong, eager, lambda: exact, 1e-5, 1e-5)
    with pytest.raises(Mismatch):
        compare("p after the step", close, eager, None, 1e-5, 1e-5)  # no reference: eager's tolerance decides


def test_buffers_after_a_training_step_are_judged_against_float64_like_the_outputs():
    """A training BatchNorm's running mean, where it differs from eager's by more than the tolerance,
    is judged against the float64 model's after its forward (GPU fuzz 6e11ef613c: a mean that cancels,
    of a float32 convolution that eager ran in TF32)."""
    prog = Program.of(["x = self.m1(self.m0(x))"], ["self.m0 = nn.Conv2d(2, 3, 1)", "self.m1 = nn.BatchNorm2d(3)"],
                    (4, 2, 3, 3), mode="training")
    assert fuzz_check.run_program(prog, "cpu")
    model, x = fuzz_check.build(prog, "cpu")
    ref = fuzz_refs.Reference64(model, x, prog)
    mean64 = ref.buffer("m1.running_mean")
    assert mean64.dtype == torch.float64
    with torch.no_grad():
        conv = torch.nn.functional.conv2d(x.double(), model.m0.weight.double(), model.m0.bias.double())
    exact = 0.1 * conv.mean((0, 2, 3))  # momentum 0.1 from zeros
    torch.testing.assert_close(mean64, exact)
    eager = (exact + 2e-4).float()  # eager's own error
    close = (exact - 3e-4).float()
    fuzz_check.compare("buffer m1.running_mean", close, eager, lambda: mean64, 1e-5, 1e-5, check_strides=False)
    with pytest.raises(fuzz_check.Mismatch, match="error vs float64"):
        fuzz_check.compare("buffer m1.running_mean", (exact + 5e-2).float(), eager, lambda: mean64, 1e-5, 1e-5)


def test_a_float32_program_through_a_16_bit_cast_is_judged_at_that_dtypes_tolerance():
    """A value rounded to bfloat16 on the way carries bfloat16's error: one float32 ulp before the
    cast moves it to the other bfloat16 neighbour (GPU fuzz 83a54d233f, 1 of 4096 elements)."""
    from fxopt.tolerances import tolerance

    plain = Program.of(["x = x * 2.0"], [], (1, 2, 2, 2))
    through = Program.of(["x = x.to(torch.bfloat16).to(x.dtype) * 2.0"], [], (1, 2, 2, 2))
    through.layers = ["batchnorm", "cast(bfloat16)", "batchnorm"]
    assert fuzz_check.tolerance_for(plain, "cuda", []) == (1e-3, tolerance(torch.float32)[1])
    assert fuzz_check.tolerance_for(through, "cuda", []) == tolerance(torch.bfloat16)
    through.layers = ["cast(float32)"]  # a float16 program's round trip through float32 rounds nothing
    assert fuzz_check.tolerance_for(through, "cpu", []) == tolerance(torch.float32)


def test_output_strides_as_the_traced_graph_records_them_are_an_upstream_divergence():
    """fxopt's output with the strides of the traced graph's metadata where eager's kernels gave
    others (a size-1 dimension's stride FakeTensor keeps: GPU fuzz 92ad9b98c3) is upstream; strides
    unlike both are fxopt's own."""
    import types

    import torch.fx as fx

    from fxopt.fuzz.check import _strides_as_traced

    def graph(strides):
        g = fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(torch.ops.aten.abs.default, (x,))
        y.meta["val"] = torch.empty_strided((1, 8, 1, 2), strides)
        g.output((y,))
        return [types.SimpleNamespace(kind="inference", before=fx.GraphModule(torch.nn.Module(), g))]
    eager = torch.empty_strided((1, 8, 1, 2), (16, 2, 2, 1))
    mine = torch.empty_strided((1, 8, 1, 2), (16, 1, 16, 8))
    assert _strides_as_traced(graph((16, 1, 16, 8)), (mine,), (eager,))
    assert not _strides_as_traced(graph((16, 2, 2, 1)), (mine,), (eager,))  # metadata as eager: fxopt's
    assert not _strides_as_traced(graph((16, 1, 16, 8)), (eager,), (eager,))  # nothing differs
    assert not _strides_as_traced(graph((16, 1, 16, 8)) * 2, (mine,), (eager,))  # several graphs: not judged


def test_a_dtype_difference_pytorchs_own_compiled_graph_shares_is_recorded_as_upstream():
    """fxopt's output dtype unlike eager's, but as torch.compile(backend="aot_eager") gives it: an
    upstream divergence (recorded, not a failure); a dtype aot_eager does not give is not."""
    from types import SimpleNamespace

    from fxopt.fuzz.check import _upstream

    model, x = torch.nn.Conv2d(2, 2, 1).eval(), torch.randn(1, 2, 3, 3)
    program = SimpleNamespace(mode="inference", dtype="float32")
    with torch.no_grad():
        same = model(x)  # float32, as aot_eager gives it
    eager_like = same.double()  # stands for an eager result of another dtype
    outcome = {}
    assert _upstream(program, "cpu", copy.deepcopy(model), x, same, eager_like, outcome)
    assert outcome == {"upstream": "output dtype"}
    outcome = {}
    assert not _upstream(program, "cpu", copy.deepcopy(model), x, same.half(), eager_like, outcome)
    assert not _upstream(program, "cpu", copy.deepcopy(model), x, same, same, outcome) and not outcome


def test_rounding_spread_judges_values_that_rounding_the_operands_moves():
    """fuzz 6df02bf9b4: a weight gradient through abs() of values near zero flips sign when the
    operands are rounded to 16 bits; eager happened to keep the signs (error 0.0112 against float64),
    fxopt's equals the rounded problem's (4.04). The rounded problem's distance from float64 (the
    spread) bounds it; a value off by more than twice that spread still fails."""
    from fxopt.fuzz.check import Mismatch, compare

    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    eager = torch.tensor([1.0112, 2.0])
    mine = torch.tensor([5.04, 2.0])
    rounded = torch.tensor([5.04, 2.0], dtype=torch.float64)  # what the rounded operands give
    with pytest.raises(Mismatch, match="error vs float64 4.04, eager's 0.0112 "):
        compare("w.grad", mine, eager, lambda: exact, 1e-3, 1e-2)  # no spread: eager's error decides
    compare("w.grad", mine, eager, lambda: exact, 1e-3, 1e-2, spread64=lambda: rounded)
    with pytest.raises(Mismatch, match="rounding's 4.04"):
        compare("w.grad", torch.tensor([13.0, 2.0]), eager, lambda: exact, 1e-3, 1e-2, spread64=lambda: rounded)
    calls = []
    compare("w.grad", eager + 0.001, eager, lambda: exact, 1e-3, 1e-2, spread64=lambda: calls.append(1))
    assert not calls  # computed only where eager's error does not already cover fxopt's


def test_training_reference_has_a_rounded_problem_under_16_bit_autocast():
    prog = Program.of(["x = torch.abs(self.m0(x))"], ["self.m0 = nn.Conv2d(2, 2, 1)"], (1, 2, 2, 2), mode="training",
                    dtype="float16")
    model, x = fuzz_check.build(prog, "cpu")
    ref = fuzz_refs.Reference64(model, x, prog)
    spread = ref.rounded
    assert spread is not None and len(spread.refs) == 1 + fuzz_refs.PERTURBED_SAMPLES
    rr = spread.refs[0]  # the operands rounded, nothing else
    assert rr.rounded is None and rr.perturb == 0.0
    w, wr = model.m0.weight, rr.model.m0.weight
    assert wr.dtype == w.dtype and torch.equal(wr, w.to(torch.float16).to(w.dtype)) and not torch.equal(wr, w)
    assert torch.equal(rr.x, x.to(torch.float16).to(x.dtype))
    loss = lambda outs, ref=False: outs.double().sum()  # noqa: E731
    g, gr = ref.grad("m0.weight", loss), spread.grad("m0.weight", loss)
    assert isinstance(gr, fuzz_refs.Samples) and len(gr) == len(spread.refs) + 1  # and the branch-flip run
    assert all(t.dtype == torch.float64 and t.shape == g.shape for t in gr)
    f32 = Program.of(["x = self.m0(x)"], ["self.m0 = nn.Conv2d(2, 2, 1)"], (1, 2, 2, 2), mode="training")
    assert fuzz_refs.Reference64(model, x, f32).rounded is None  # float32 on the CPU: nothing rounds


def test_rounding_every_op_moves_a_gradient_through_abs_near_its_kink():
    """The perturbed float64 runs (every op's result times 1 + d, |d| <= the unit roundoff) flip
    the branch of ``abs`` at a value within rounding of 0, as any implementation's rounding may:
    the gradient's spread then covers a flip, where the exact reference alone does not."""
    x = torch.tensor([[1e-4, 0.5, -0.7, 2.0]], dtype=torch.float64, requires_grad=True)
    grads = []
    for k in range(8):
        x.grad = None
        with fuzz_refs.RoundEveryOp(2.0 ** -8, k):
            y = torch.abs(x * 3.0 - 3e-4)  # 0 exactly, up to rounding
        y.sum().backward()
        grads.append(x.grad.clone())
        far = torch.tensor([3.0, -3.0, 3.0], dtype=torch.float64)  # far from the kink: scaled by rounding only
        torch.testing.assert_close(x.grad[0, 1:], far, rtol=4 * 2.0 ** -8, atol=0)
    assert {float(torch.sign(g[0, 0])) for g in grads} == {1.0, -1.0}  # both branches among the samples
    z = torch.ones(3, dtype=torch.float64)
    with fuzz_refs.RoundEveryOp(2.0 ** -8, 0):
        w = z.add_(1.0)  # in place: untouched
    assert w is z and torch.equal(z, torch.full((3,), 2.0, dtype=torch.float64))


def test_rounding_the_operands_of_a_sum_moves_a_cancelling_result_by_the_terms_scale():
    """A difference of nearly equal terms rounds at the terms' scale (each operand within the unit
    roundoff), not at its result's: the perturbed runs move it so."""
    a = torch.full((4096,), 1.0, dtype=torch.float64)
    b = a - 1e-6
    with fuzz_refs.RoundEveryOp(2.0 ** -11, 0):
        d = torch.sub(a, b)
    moved = (d - 1e-6).abs().max().item()
    assert 2.0 ** -13 < moved <= 2 * 2.0 ** -11 + 1e-9  # at the terms' scale: ~ u * 1, not u * 1e-6


def test_the_branch_flip_run_flips_every_element_the_perturbed_runs_bring_near_a_kink():
    """GPU fuzz 736f3d759a (fp16 training): one element of 504 lay within rounding of abs's kink; fxopt's
    weight gradient took the other branch there (2.96 from float64, eager 0.054), one perturbed run in
    12 did. The flip run finds it whatever the draws: every element within FLIP_BAND times the runs'
    largest movement of a kink takes the other branch; the others keep theirs."""
    prog = Program.of(["x = torch.abs(self.m0(x))"], ["self.m0 = nn.Conv2d(2, 2, 1, bias=False)"], (1, 2, 1, 2),
                    mode="training", dtype="float16")
    model, x = fuzz_check.build(prog, "cpu")
    with torch.no_grad():  # output [0, 0, 0, 0] = 0.7 - (0.7 - 1e-5): within rounding of 0; the others far from it
        model.m0.weight.copy_(torch.tensor([[1.0, -1.0], [1.0, 1.0]]).view(2, 2, 1, 1))
        x.copy_(torch.tensor([[0.7, 0.5], [0.7 - 1e-5, 2.0]]).view(1, 2, 1, 2))
    ref = fuzz_refs.Reference64(model, x, prog)
    loss = lambda outs, ref=False: outs.double().sum()  # noqa: E731
    exact = ref.grad("input", loss)
    flip = ref.rounded.flipped()
    assert flip is not None and flip.flip is not None and len(flip.flip) == len(ref.kinks) == 1
    arg = ref.kinks[0]
    near = arg.abs() <= flip.flip[0]
    assert near.view(-1).tolist() == [True, False, False, False], arg  # the cancelling element only
    g = flip.grad("input", loss)
    torch.testing.assert_close(exact[0, :, 0, 0], torch.tensor([2.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(g[0, :, 0, 0], torch.tensor([0.0, 2.0], dtype=torch.float64))  # the other branch
    torch.testing.assert_close(g[0, :, 0, 1], exact[0, :, 0, 1])  # far from the kink: unchanged
    # a program without a piecewise op has no flip run
    prog2 = Program.of(["x = torch.tanh(self.m0(x))"], ["self.m0 = nn.Conv2d(4, 4, 1)"], (1, 4, 3, 3), mode="training",
                     dtype="float16")
    model2, x2 = fuzz_check.build(prog2, "cpu")
    ref2 = fuzz_refs.Reference64(model2, x2, prog2)
    ref2.out()
    assert ref2.rounded.flipped() is None


def test_a_16_bit_inference_program_has_a_rounding_spread():
    """GPU fuzz 95116b2fe4 (fp16 inference): a LayerNorm over 2 channels amplifies the rounding before it
    (fxopt 0.035 from float64, eager 0.009); the perturbed runs show how far rounding moves it. float32 on
    the CPU rounds nothing: no spread."""
    prog = Program.of(["x = torch.abs(self.m0(x))"], ["self.m0 = nn.Conv2d(2, 2, 1)"], (1, 2, 2, 2), dtype="float16")
    model, x = fuzz_check.build(prog, "cpu")
    ref = fuzz_refs.Reference64(model, x, prog)
    assert ref.rounded is not None and len(ref.rounded.refs) == fuzz_refs.PERTURBED_SAMPLES
    assert all(r.perturb == 2.0 ** -11 for r in ref.rounded.refs)
    outs = ref.rounded.out()
    assert isinstance(outs, fuzz_refs.Samples) and all(o.dtype == torch.float64 for o in outs)
    f32 = Program.of(["x = self.m0(x)"], ["self.m0 = nn.Conv2d(2, 2, 1)"], (1, 2, 2, 2))
    assert fuzz_refs.Reference64(model.float(), x.float(), f32).rounded is None


def test_compare_takes_the_largest_spread_of_the_samples():
    from fxopt.fuzz.check import Mismatch, compare
    from fxopt.fuzz.references import Samples

    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    eager = torch.tensor([1.01, 2.0])
    mine = torch.tensor([4.0, 2.0])
    samples = Samples([exact.clone(), torch.tensor([3.5, 2.0], dtype=torch.float64)])
    compare("w.grad", mine, eager, lambda: exact, 1e-3, 1e-2, spread64=lambda: samples)  # 3.0 <= 2 * 2.5
    with pytest.raises(Mismatch, match="rounding's 2.5"):
        compare("w.grad", torch.tensor([9.0, 2.0]), eager, lambda: exact, 1e-3, 1e-2, spread64=lambda: samples)


def test_compare_takes_eagers_error_at_nearby_inputs_and_only_then():
    """Where fxopt's error is beyond twice eager's at the program's input, eager's largest error at inputs
    a few ulps away (``EagerNearby``) decides: within twice that, it passes; a value further off still
    fails, and the nearby runs are not made where eager's own error already covers fxopt's."""
    from fxopt.fuzz.check import Mismatch, compare

    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    eager, mine = torch.tensor([1.001, 2.0]), torch.tensor([1.05, 2.0])
    compare("output", mine, eager, lambda: exact, 1e-3, 1e-4, nearby=lambda: [0.03])  # 0.05 <= 2 * 0.03
    with pytest.raises(Mismatch):
        compare("output", mine, eager, lambda: exact, 1e-3, 1e-4, nearby=lambda: [0.02])
    calls = []
    compare("output", torch.tensor([1.0015, 2.0]), eager, lambda: exact, 1e-4, 1e-4, nearby=lambda: calls.append(1))
    assert not calls


def test_eager_nearby_samples_eagers_noise_at_a_cancellation():
    """CPU fuzz 88d430b4dc's model: at the program's input eager's error is one sample of noise; the
    nearby inputs give eager's errors against float64 at each (the output's and every gradient's)."""
    from fxopt.fuzz.references import EagerNearby
    from test_fuzz_reproducers import gpu_reproducer

    prog = gpu_reproducer("88d430b4dc")
    model, x = fuzz_check.build(prog, "cpu")
    nearby = EagerNearby(copy.deepcopy(model), x.clone(), prog)
    state = {k: v.clone() for k, v in nearby.model.state_dict().items()}
    out_errs = nearby.errors()
    assert len(out_errs) == 2 and out_errs[0] > 1e-4 and out_errs[1] < 1e-6  # the normalized one; y is benign
    ws = [torch.randn(o.shape, generator=torch.Generator().manual_seed(2)) for o in model(x)]
    loss = lambda outs, ref=False: sum(((o.double() if ref else o.float()) * (w.double() if ref else w)).sum()  # noqa: E731
                                       for o, w in zip(outs, ws))
    assert nearby.grad_error("m0.weight", loss)[0] > 1e-3 and nearby.grad_error("input", loss)
    assert nearby.grad_error("no such parameter", loss) == [] and len(nearby.loss_error(loss)) == 1
    assert torch.equal(nearby.x, x)  # each run on a copy of its own: what it was given untouched
    assert all(torch.equal(v, state[k]) for k, v in nearby.model.state_dict().items())  # (BatchNorm's stats too)


def test_a_sum_that_cancels_is_judged_against_pytorchs_compiled_graph_too():
    """CPU fuzz (seed 7): a conv's bias gradient before a training BatchNorm, exactly 0, comes out
    0.344 from fxopt against eager's 0.046 and the rounded problem's 3e-14 (bfloat16): fxopt's is
    AOTAutograd's own rounding (torch.compile(backend="aot_eager") gives it), eager's kernels round
    otherwise. Judged also against that compiled graph's error; a value off by more still fails."""
    from fxopt.fuzz.check import Mismatch, compare
    from fxopt.fuzz.references import CompiledPeer

    exact, eager = torch.zeros(3, dtype=torch.float64), torch.tensor([-0.04, 0.044, 0.046])
    mine = torch.tensor([-0.011, 0.080, 0.344])
    compare("b.grad", mine, eager, lambda: exact, 0.5, 0.1, spread64=lambda: exact + 3e-14)  # 0 exactly: 8x
    mine = torch.tensor([-0.011, 0.080, 0.6])  # beyond 8x eager's: the compiled graph's error decides
    with pytest.raises(Mismatch, match="error vs float64 0.6, eager's 0.046"):
        compare("b.grad", mine, eager, lambda: exact, 0.5, 0.1, spread64=lambda: exact + 3e-14)
    compare("b.grad", mine, eager, lambda: exact, 0.5, 0.1, spread64=lambda: exact, peer=lambda: mine.clone())
    with pytest.raises(Mismatch, match="PyTorch's compiled graph's 0.05"):
        compare("b.grad", mine, eager, lambda: exact, 0.5, 0.1, peer=lambda: eager + 0.004)
    prog = Program(render(["self.m0 = nn.Conv2d(16, 3, 3, stride=1, padding=1, dilation=1, groups=1, bias=True)",
                           "self.m1 = nn.BatchNorm2d(3)", "_random_stats(self.m1)", "self.m2 = nn.BatchNorm2d(3)",
                           "_random_stats(self.m2)"],
                          ["x = F.gelu(self.m1(self.m0(x)), approximate='tanh')",
                           "x = x.to(torch.float16).to(x.dtype) * 2.0", "x = self.m2(x)",
                           "x = x.to(torch.float16).to(x.dtype) * 2.0"], "x"),
                   (8, 16, 1, 3), "bfloat16", "channels_last", "training", 2,
                   {"autotune_cache": False, "conv_algorithm": "winograd_2x2_3x3", "executor": "torch"}, ["74dd6704d3"])
    assert fuzz_check.run_program(prog, "cpu")
    model, x = fuzz_check.build(prog, "cpu")
    peer, mine_ = CompiledPeer(model, x, prog, "cpu"), copy.deepcopy(model)
    loss = lambda out: (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum()  # noqa: E731
    from fxopt.testing import compile_with_fxopt

    compiled = compile_with_fxopt(mine_, prog.options)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss(compiled(x.detach().clone().requires_grad_(True))).backward()
    torch.testing.assert_close(mine_.m0.bias.grad, peer.grad("m0.bias", loss), rtol=0, atol=1e-3)
