"""Running one ``Program``: eager against fxopt (``torch.compile(model, backend="fxopt", options=...)``).

Compared: the outputs' structure, shapes, dtypes, strides (dims of size 1 excepted) and aliasing
(which outputs share storage with each other or with the input) exactly; values within the dtype's
tolerance (``fxopt.tolerances``; on CUDA float32 at least 1e-3 for TF32), widened to the tolerance
of every convolution algorithm the graph chose (``ConvAlgorithm.tolerance``, docs/NUMERICS.md).
Where the values differ by more, they are judged against the model run in float64 on the CPU
(``Reference64``, run only then; a reference that cannot run is the fuzzer's failure, never
skipped; why the CPU: its docstring): fxopt passes
when its error against float64 is at most twice eager's plus the absolute tolerance (eager's own
result is rounded, in 16 bits most of all). A program that rounds (16 bits; float32 on CUDA) also
has a rounding spread (``references.Spread``: under 16-bit autocast the rounded problem, parameters
and input rounded to the autocast dtype; float64 runs with every op's operands and result perturbed
by the unit roundoff; a run with every element near a kink of ``abs`` / ``relu`` / ... flipped to the
other branch): how far those lie from the exact reference is how far rounding moves a value (a
gradient through ``abs`` of a value near zero flips sign with it), and fxopt passes where its error
is at most twice the larger of eager's and that spread (the samples' largest). Last, PyTorch's own
compiled graph of the model (``CompiledPeer``: ``backend="aot_eager"``, the graph AOTAutograd hands
every backend, on PyTorch's kernels) is a further sample of how the computation rounds: fxopt
passes where its error is at most twice that one's; and last, eager's own error at inputs a few ulps
away (``references.EagerNearby``: where a value cancels before the last op, eager's error at one
input is one sample of noise; CPU fuzz 88d430b4dc). A value whose exact result is 0 (a
convolution's bias gradient before a training BatchNorm: a sum that cancels; ``CANCELLED``: float64's
result at most 1e-6 of the samples' largest error) is rounding noise in every implementation, whose
size its terms set, not its result, and one sample of that noise says little of the next: on GPU fuzz
6e42ecd3e1 (bfloat16, batch 64, H200) the bias gradient lay 0.033 / 0.106 from 0 in eager NCHW and
0.258 / 0.085 in eager channels_last, for two sets of loss weights, 7.8x apart with the same weights;
the rounded float64 runs, which round each term once, gave 0.09. There fxopt passes where its error is
at most ``NOISE_FACTOR`` (8) times the largest sample, plus the absolute tolerance (CPU fuzz, seed 7:
0.344 from fxopt, bitwise AOTAutograd's own, against eager's 0.046 and a rounded problem's 3e-14).
A training step also compares the loss, every gradient (10x), the input's gradient and the
parameters and buffers after an SGD step.

A 16-bit training step whose eager backward itself overflowed (an op of it returned inf or NaN
from finite inputs: a BatchNorm over a constant channel divides by sqrt(eps) and leaves float16's
range) has gradients that depend on how each kernel treats the infinity (``inf * 0`` where a
convolution's taps read only padding: NaN in one implementation, 0 in another; GPU fuzz
60928602b9, where float64's gradient is 0). Where fxopt's gradients then differ from eager's,
the program is recorded as such (``outcome["eager_overflow"]``, the coverage's section of that
name), not as a failure; without eager's overflow the comparison stands as above. GradScaler
skips such a step.

Where fxopt's value fails all of the above and PyTorch's compiled graph's fails them too (its
error beyond twice eager's and the spread's), or eager's own error is ``EAGER_WRONG`` times the
rounding spread plus the tolerance, PyTorch's kernels compute it wrong: recorded as upstream, not a
failure (CPU fuzz seed 196 on an AMX Xeon, oneDNN's bfloat16 kernels: ``aten.convolution_backward``
of a 7x7 stride-2 conv over a 2x1 input leaves the weight gradient's taps that read only padding
unwritten, up to 1e33 in some calls, 28da4626d8; a grouped 3x3 stride-2 conv over a 10x2 input is
10.4 off float64 in every call and garbage in some, eager's included, c781414856; float32 and
PyTorch's kernels without oneDNN are right).
Where fxopt's outputs differ from eager's in dtype exactly as PyTorch's own compiled graph does
(``backend="aot_eager"``: the decompositions every backend is handed), the program counts as an
upstream divergence (``outcome["upstream"]``, the coverage's ``upstream`` section), not a failure.

Where eager raises (bad input), fxopt must raise the same exception type: the compiled call's
exception or one it was raised from (Dynamo wraps what its fake-tensor run of the graph raised);
``outcome["eager_error"]`` then names it and the program passes.

On the CPU with ``executor="cuda"`` nothing runs on a GPU; the checkable part is checked: every
kernel generated and compiled with NVRTC (``report.kernels``), every fused region's IR run on the
CPU against its ATen ops (``fxopt.testing.check_fusion``; a training step: the whole step run with
the regions' IR in their references' place, option ``emulate_kernels``, and judged as on a GPU),
and every register-row reduction's
thread mapping emulated (``fxopt.fuzz.geometry``), every column reduction run thread by thread
(``fxopt.fuzz.simt``).
"""
from __future__ import annotations

import contextlib
import copy
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxopt.eager_formats import same_strides
from fxopt.tolerances import max_error

from .graphs import Program
from .references import CompiledPeer, EagerNearby, Reference64, Samples, _flat


#: the SGD step's learning rate (momentum 0.9: the first step moves a parameter by LR * its gradient)
LR = 0.05
#: a value whose float64 result is at most this fraction of its rounding noise is a sum that cancels
CANCELLED = 1e-6
#: ... and fxopt's error there may be this many times the largest sample of that noise (module docstring)
NOISE_FACTOR = 8
#: eager's own error this many times the rounding spread plus the tolerance: PyTorch's kernel is wrong
EAGER_WRONG = 10


class Mismatch(AssertionError):
    pass


class UpstreamMismatch(Mismatch):
    """fxopt's value fails the judgement and so does PyTorch's own compiled graph's (``aot_eager``),
    or eager's own is ``EAGER_WRONG`` times the rounding spread off: PyTorch's kernels compute it
    wrong (module docstring)."""


class _Overflow(TorchDispatchMode):
    """Records the first op that returned a non-finite floating value from finite inputs."""

    def __init__(self):
        super().__init__()
        self.first = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.first is None:
            outs = [t for t in _flat(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
            if any(not bool(torch.isfinite(t).all()) for t in outs):
                ins = [t for t in _flat(list(args) + list((kwargs or {}).values()))
                       if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
                if all(bool(torch.isfinite(t).all()) for t in ins):
                    self.first = str(func)
        return out


class EagerRaised(Exception):
    """Eager raised ``error`` and fxopt the same type: not a failure."""

    def __init__(self, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


def _chain(e: BaseException) -> list:
    out = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def run_both(eager_fn, compiled_fn) -> tuple:
    """(eager's result, fxopt's); where eager raises, raises ``EagerRaised`` when fxopt raised the
    same type (see the module's docstring), else ``Mismatch``."""
    try:
        want = eager_fn()
    except Exception as e:  # noqa: BLE001 - eager's error is the expected behaviour
        try:
            compiled_fn()
        except Exception as f:  # noqa: BLE001
            if any(isinstance(k, type(e)) for k in _chain(f)):
                raise EagerRaised(e) from None
            raise Mismatch(f"eager raises {type(e).__name__} ({str(e)[:200]}), fxopt "
                           f"{type(f).__name__} ({str(f)[:300]})") from None
        raise Mismatch(f"eager raises {type(e).__name__} ({str(e)[:200]}), fxopt returns") from None
    return want, compiled_fn()


def build(program: Program, device: str):
    """(model, input) of ``program`` on ``device``: inference models in the program's dtype, eval;
    training models in float32 (16-bit programs train under autocast)."""
    ns: dict = {}
    exec(compile(program.source, "<fuzz model>", "exec"), ns)  # noqa: S102 - the drawn model's own source
    torch.manual_seed(program.seed)
    model = ns["Model"]()
    x = torch.randn(program.shape, generator=torch.Generator().manual_seed(program.seed + 1))
    dtype = getattr(torch, program.dtype)
    if program.mode == "inference":
        model, x = model.to(dtype).eval(), x.to(dtype)
    else:
        model.train()
    fmt = torch.channels_last if program.fmt == "channels_last" else torch.contiguous_format
    return model.to(device), x.to(device).contiguous(memory_format=fmt)


def tolerance_for(program: Program, device: str, graphs: list) -> tuple:
    from fxopt.tolerances import tolerance

    dtype = getattr(torch, program.dtype)
    rtol, atol = tolerance(dtype)
    if device == "cuda" and dtype == torch.float32:
        rtol = max(rtol, 1e-3)
    for layer in program.layers:  # values rounded to a narrower dtype on the way carry its error:
        # rounding is not continuous, and a value one float32 ulp from eager's rounds to the other
        # neighbour in 1 of a few thousand elements (GPU fuzz 83a54d233f: a LayerNorm, then bfloat16)
        m = re.fullmatch(r"cast\((float16|bfloat16)\)", layer)
        if m:
            r, a = tolerance(getattr(torch, m.group(1)))
            rtol, atol = max(rtol, r), max(atol, a)
    for alg in algorithms_of(graphs):
        try:
            from fxopt.conv_algorithms import get_algorithm
        except ImportError:
            from fxopt.conv_algorithms import get_algorithm
        try:
            r, a = get_algorithm(alg).tolerance(dtype)
        except (KeyError, ValueError):
            continue
        rtol, atol = max(rtol, r), max(atol, a)
    return rtol, atol


def algorithms_of(graphs: list) -> list:
    return sorted({getattr(c, "algorithm", str(c)) for g in graphs for c in g.conv_algorithms.values()})


def _alias_pattern(outs: list, x: torch.Tensor) -> list:
    def key(t):
        return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
    keys = [key(t) for t in outs]
    return [(i, j) for i in range(len(outs)) for j in range(i + 1, len(outs)) if keys[i] and keys[i] == keys[j]] + \
           [(i, "input") for i, k in enumerate(keys) if k and k == key(x)]


def compare(what: str, got, want, ref64, rtol: float, atol: float, check_strides: bool = True,
            spread64=None, peer=None, nearby=None) -> None:
    """Raise Mismatch unless ``got`` matches ``want`` (see the module's docstring); ``ref64``: the
    float64 result, or a function computing it (called only where the values differ), or None;
    ``spread64``: the float64 result of the rounded problem, or a function computing it (called
    only where fxopt's error exceeds twice eager's), or None; ``peer``: PyTorch's compiled graph's
    result, or a function computing it (called only where fxopt's error exceeds both), or None;
    ``nearby``: a function giving eager's largest error per output at inputs a few ulps away
    (``EagerNearby.errors``; called only where all of the above fail), or None."""
    g, w = _flat(got), _flat(want)
    if len(g) != len(w):
        raise Mismatch(f"{what}: {len(g)} outputs, eager {len(w)}")
    for i, (a, b) in enumerate(zip(g, w)):
        if not isinstance(b, torch.Tensor):
            continue
        name = f"{what}[{i}]"
        if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            raise Mismatch(f"{name}: {getattr(a, 'shape', a)} {getattr(a, 'dtype', '')}, eager {b.shape} {b.dtype}")
        if check_strides and not same_strides(b.shape, a.stride(), b.stride()):
            raise Mismatch(f"{name}: strides {a.stride()}, eager {b.stride()}")
        try:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as e:
            if ref64 is None:
                raise Mismatch(f"{name}: {e}") from None
            c = _flat(ref64() if callable(ref64) else ref64)[i]  # the float64 reference, run only now
            err_c, err_e = max_error(a, c), max_error(b, c)
            if err_c <= 2 * err_e + atol:
                continue
            spread = err_p = None
            if spread64 is not None:  # how far rounding moves it (the operands; every op's result)
                res = spread64() if callable(spread64) else spread64
                errs = [max_error(r, c) for r in (_flat(s)[i] for s in (res if isinstance(res, Samples) else [res]))
                        if isinstance(r, torch.Tensor)]
                spread = max(errs) if errs else None
                if spread is not None and err_c <= 2 * spread + atol:
                    continue
            if peer is not None:  # how far PyTorch's own compiled graph lies from it
                r = _flat(peer() if callable(peer) else peer)[i]
                err_p = max_error(r, c) if isinstance(r, torch.Tensor) else None
                if err_p is not None and err_c <= 2 * err_p + atol:
                    continue
            if nearby is not None:  # eager's own error at inputs a few ulps away: its noise there
                errs = nearby()
                if i < len(errs) and err_c <= 2 * errs[i] + atol:
                    continue
            noise = max(v for v in (err_e, spread, err_p) if v is not None)
            cancelled = c.numel() > 0 and float(c.detach().double().abs().nan_to_num().max()) <= CANCELLED * noise
            if cancelled and err_c <= NOISE_FACTOR * noise + atol:
                continue  # its exact value is 0: noise of the terms' size in every implementation
            own = max(v for v in (err_e, spread) if v is not None)  # the noise without the peer's
            wrong = (lambda err: not err <= 2 * own + atol and not (cancelled and err <= NOISE_FACTOR * own + atol))
            eager_wrong = spread is not None and not err_e <= EAGER_WRONG * (spread + atol)
            kind = UpstreamMismatch if eager_wrong or (err_p is not None and wrong(err_p)) else Mismatch
            raise kind(f"{name}: error vs float64 {err_c:.3g}, eager's {err_e:.3g}"
                           + (f", rounding's {spread:.3g}" if spread is not None else "")
                           + (f", PyTorch's compiled graph's {err_p:.3g}" if err_p is not None else "")
                           + (f" (exactly 0 in float64: up to {NOISE_FACTOR}x)" if cancelled else "")
                           + f" (atol {atol}); vs eager: {str(e).splitlines()[1:3]}") from None


def run_program(program: Program, device: str, graphs: list | None = None, outcome: dict | None = None) -> list:
    """Run and compare ``program``; returns the GraphReports fxopt compiled (raises Mismatch);
    ``graphs`` collects them as they compile (for a failure's tolerance and coverage); ``outcome``
    gets ``eager_error`` where eager raised and fxopt raised the same."""
    from fxopt.testing import compile_with_fxopt

    model, x = build(program, device)
    if device == "cpu" and program.options.get("executor") == "cuda" and not program.options.get("emulate_kernels"):
        return check_cuda_on_cpu(program, model, x, outcome)
    eager, mine, spare = model, copy.deepcopy(model), copy.deepcopy(model)
    ref, peer = Reference64(model, x, program), CompiledPeer(model, x, program, device)
    nearby = EagerNearby(ref.source_model, ref.source_x, program)  # (copies nothing changes)
    graphs = [] if graphs is None else graphs
    compiled = compile_with_fxopt(mine, program.options, graphs)
    try:
        if program.mode == "inference":
            with torch.no_grad():
                out_e, out0 = run_both(lambda: eager(x), lambda: compiled(x))
                outs = [out0] + [compiled(x) for _ in range(device == "cuda")]  # capture, then a replay
            rtol, atol = tolerance_for(program, device, graphs)
            for k, out_c in enumerate(outs):
                if _upstream(program, device, spare, x, out_c, out_e, outcome):
                    break
                traced = _strides_as_traced(graphs, out_c, out_e)
                if traced and outcome is not None:
                    outcome["upstream"] = "output strides"
                rr = ref.rounded
                compare(f"call {k} output", out_c, out_e, ref.out, rtol, atol, peer=peer.out,
                        check_strides=not traced, spread64=rr and rr.out, nearby=nearby.errors)
                pat_c, pat_e = _alias_pattern(_flat(out_c), x), _alias_pattern(_flat(out_e), x)
                if pat_c != pat_e:
                    raise Mismatch(f"call {k}: outputs alias {pat_c}, eager's {pat_e}")
        else:
            _training_step(program, device, eager, mine, compiled, x, graphs, ref, spare, outcome, peer, nearby)
    except EagerRaised as e:
        if outcome is not None:
            outcome["eager_error"] = type(e.error).__name__
        return graphs
    except UpstreamMismatch as e:
        if outcome is not None:
            outcome["upstream"] = "PyTorch's kernels as far from float64 (eager's or its compiled graph's)"
        if not graphs:
            raise Mismatch(f"fxopt compiled no graph ({e})") from None
        return graphs
    if not graphs:
        raise Mismatch("fxopt compiled no graph")
    for g in graphs:
        if g.fallback is not None:
            raise Mismatch(f"fxopt fell back: {g.fallback}")
    return graphs


def _strides_as_traced(graphs: list, out_c, out_e) -> bool:
    """Whether fxopt's outputs have other strides than eager's (in a dimension larger than 1) exactly
    where the graph PyTorch traced records them so (its outputs' FakeTensors; one inference graph).
    PyTorch's fake propagation and its kernels disagree over the strides of a dimension of size 1
    (FakeTensor's ``view`` keeps one that ATen's recomputes; its elementwise ops lay out their result
    from those), and PyTorch's own memory-format guesses read them: a ``[1, 8, 1, 2]`` value that
    is channels_last by the metadata comes out NCHW from eager's convolution (GPU fuzz 92ad9b98c3,
    50494e0a2f). fxopt keeps the traced graph's metadata, as every backend is handed
    it: recorded as an upstream divergence (``outcome["upstream"]``), the values still compared."""
    if len(graphs) != 1 or graphs[0].kind != "inference":
        return False
    out = next((n for n in graphs[0].before.graph.nodes if n.op == "output"), None)
    if out is None:
        return False
    traced = [a.meta.get("val") if hasattr(a, "meta") else None for a in _flat(out.args[0])]
    got, want = _flat(out_c), _flat(out_e)
    if len(traced) != len(got) or len(got) != len(want):
        return False
    differs = False
    for v, a, b in zip(traced, got, want):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            continue
        if same_strides(b.shape, a.stride(), b.stride()):
            continue
        if (not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(a.shape)
                or not same_strides(a.shape, a.stride(), v.stride())):
            return False  # unlike eager's and unlike the metadata's: fxopt's own
        differs = True
    return differs


def _upstream(program, device, spare, x, out_c, out_e, outcome) -> bool:
    """Whether fxopt's outputs differ from eager's in dtype only as PyTorch's own compiled graph
    does (``torch.compile(backend="aot_eager")``: AOTAutograd's decompositions, before any backend;
    e.g. upsampling under fp16 autocast comes back fp16 where eager's is fp32). Such a program is
    recorded in ``outcome["upstream"]`` and its remaining comparisons skipped: fxopt cannot give
    eager's dtype without changing the graph PyTorch hands every backend."""
    got, want = _flat(out_c), _flat(out_e)
    if len(got) != len(want) or all(getattr(a, "dtype", None) == getattr(b, "dtype", None)
                                    for a, b in zip(got, want)):
        return False
    torch.compiler.reset()
    ref = torch.compile(spare, backend="aot_eager")
    training = program.mode == "training"
    dtype = getattr(torch, program.dtype)
    amp = (torch.autocast(device, dtype=dtype) if training and dtype != torch.float32
           else contextlib.nullcontext())
    with amp, (contextlib.nullcontext() if training else torch.no_grad()):
        out_r = _flat(ref(x.detach().clone().requires_grad_(training)))
    if [getattr(t, "dtype", None) for t in out_r] != [getattr(t, "dtype", None) for t in got]:
        return False
    if outcome is not None:
        outcome["upstream"] = "output dtype"
    return True


def _training_step(program, device, eager, mine, compiled, x, graphs, ref: Reference64, spare=None,
                   outcome=None, peer: CompiledPeer | None = None, nearby: EagerNearby | None = None) -> None:
    dtype = getattr(torch, program.dtype)
    amp = torch.autocast(device, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    xe, xc = (x.detach().clone().requires_grad_(True) for _ in range(2))
    with amp:
        out_e, out_c = run_both(lambda: eager(xe), lambda: compiled(xc))
    if spare is not None and _upstream(program, device, spare, x, out_c, out_e, outcome):
        return
    rtol, atol = tolerance_for(program, device, graphs)
    rr = ref.rounded
    compare("output", out_c, out_e, ref.out, rtol, atol, check_strides=False, spread64=rr and rr.out,
            peer=peer and peer.out, nearby=nearby and nearby.errors)
    gen = torch.Generator().manual_seed(program.seed + 2)
    ws = [torch.randn(o.shape, generator=gen).to(o.device) for o in _flat(out_e)]

    def loss(outs, ref=False):
        return sum(((o.double() if ref else o.float()) * (w.double() if ref else w).to(o.device)).sum()
                   for o, w in zip(_flat(outs), ws))
    le, lc = loss(out_e), loss(out_c)
    n = sum(o.numel() for o in _flat(out_e)) ** 0.5
    compare("loss", lc, le, lambda: ref.loss(loss), rtol, atol * max(1.0, n),
            spread64=rr and (lambda: rr.loss(loss)), peer=peer and (lambda: loss(peer.out())),
            nearby=nearby and (lambda: nearby.loss_error(loss)))
    le.backward()
    lc.backward()
    try:
        _compare_step(eager, mine, xe, xc, loss, ref, rr, peer, rtol, atol, nearby)
    except Mismatch:
        first = _overflowed(spare, x, amp, loss) if spare is not None and dtype != torch.float32 else None
        if first is None:
            raise
        if outcome is not None:  # eager's own 16-bit backward overflowed (the module's docstring)
            outcome["eager_overflow"] = first
        return
    _compare_buffers(eager, mine, ref, rr, peer, rtol, atol)


def _overflowed(model, x, amp, loss) -> str | None:
    """The first op of eager's 16-bit backward that overflowed (``_Overflow``), running the step
    again on ``model`` (``run_program``'s spare copy, taken before eager's step; a forward of it in
    ``_upstream`` leaves its parameters as they were): only where gradients differ, so that a passing
    program's step is not watched (the watch reads every op's values, scratch ones too)."""
    xr = x.detach().clone().requires_grad_(True)
    with amp:
        out = model(xr)
    watch = _Overflow()
    with watch:
        loss(out).backward()
    return watch.first


def _compare_step(eager, mine, xe, xc, loss, ref, rr, peer, rtol, atol, nearby=None) -> None:
    """The gradients and the parameters after an SGD step, fxopt's against eager's."""
    params_e, params_c = dict(eager.named_parameters()), dict(mine.named_parameters())
    for name, p in params_e.items():
        q = params_c[name].grad
        if (p.grad is None) != (q is None):
            raise Mismatch(f"{name}.grad: {q is not None}, eager {p.grad is not None}")
        if p.grad is not None:
            compare(f"{name}.grad", q, p.grad, lambda name=name: ref.grad(name, loss), rtol * 10, atol * 10,
                    check_strides=False, spread64=rr and (lambda name=name: rr.grad(name, loss)),
                    peer=peer and (lambda name=name: peer.grad(name, loss)),
                    nearby=nearby and (lambda name=name: nearby.grad_error(name, loss)))
    compare("input.grad", xc.grad, xe.grad, lambda: ref.grad("input", loss), rtol * 10, atol * 10,
            check_strides=False, spread64=rr and (lambda: rr.grad("input", loss)),
            peer=peer and (lambda: peer.grad("input", loss)),
            nearby=nearby and (lambda: nearby.grad_error("input", loss)))
    if params_e:
        before = {name: p.detach().double().clone() for name, p in params_e.items()}
        for m in (eager, mine):
            opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)
            opt.step()
        for name, p in params_e.items():
            # judged like the gradients: against the step float64 takes (the first SGD step with
            # momentum moves by lr * grad) where fxopt's and eager's parameters differ by more
            ref_step = (None if p.grad is None else
                        lambda name=name: before[name] - LR * ref.grad(name, loss).to(before[name].device))
            rr_step = (None if p.grad is None or rr is None else
                       lambda name=name: Samples(before[name] - LR * g.to(before[name].device)
                                                 for g in rr.grad(name, loss)))
            peer_step = (None if p.grad is None or peer is None else
                         lambda name=name: before[name] - LR * peer.grad(name, loss).double())
            nearby_step = (None if p.grad is None or nearby is None else  # the step moves by LR * grad
                           lambda name=name: [LR * e for e in nearby.grad_error(name, loss)])
            compare(f"{name} after the step", params_c[name], p, ref_step, rtol * 10, atol * 10, check_strides=False,
                    spread64=rr_step, peer=peer_step, nearby=nearby_step)


def _compare_buffers(eager, mine, ref, rr, peer, rtol, atol) -> None:
    bufs_c = dict(mine.named_buffers())
    for name, b in eager.named_buffers():
        # judged like the outputs: a running mean is a mean of the convolution before it, whose
        # float32 kernels differ from cuDNN's TF32 ones by up to 1e-3 of their scale, and a mean
        # that cancels keeps that error, not its relative size (GPU fuzz 6e11ef613c)
        floating = b.is_floating_point()
        compare(f"buffer {name}", bufs_c[name], b, (lambda name=name: ref.buffer(name)) if floating else None,
                rtol, atol, check_strides=False, spread64=rr and floating and (lambda name=name: rr.buffer(name)),
                peer=peer and floating and (lambda name=name: peer.buffer(name)))


def _eager_raises(program: Program, model, x) -> bool:
    """Whether eager raises on ``program``'s input (a copy of the model; a training step's forward)."""
    training, dtype = program.mode == "training", getattr(torch, program.dtype)
    amp = (torch.autocast(x.device.type, dtype=dtype) if training and dtype != torch.float32
           else contextlib.nullcontext())
    try:
        with amp, (contextlib.nullcontext() if training else torch.no_grad()):
            copy.deepcopy(model)(x.detach().clone().requires_grad_(training))
    except Exception:  # noqa: BLE001 - eager's error is the expected behaviour
        return True
    return False


def check_cuda_on_cpu(program: Program, model, x, outcome: dict | None = None) -> list:
    """The cuda executor's CPU-checkable part for ``program`` (see the module's docstring); the
    emulated runs' outcome (an upstream divergence, eager's error) goes to ``outcome``."""
    import fxopt
    from fxopt.testing import CNNCase
    from fxopt.testing.fusion import check_fusion

    from .backend_api import reduction_sources, tiled_source
    from .geometry import check_row_geometry, is_row_kernel
    from .simt import check_column_geometry, is_column_kernel

    options = {**program.options, "executor": "cuda"}
    options.pop("cudagraphs", None)
    training = program.mode == "training"
    emulated = Program.from_json({**program.to_json(), "options": {**options, "emulate_kernels": True}})
    if _eager_raises(program, model, x):  # bad input: judged by the whole run (fxopt must raise the same)
        return run_program(emulated, "cpu", outcome=outcome)
    xg = x.detach().requires_grad_(training)  # a training graph of parameter-free layers still has a backward
    report = fxopt.explain(model, xg, options=options, training=training)
    for g in report.graphs:
        if g.fallback is not None:
            raise Mismatch(f"fxopt fell back: {g.fallback}")
    bad = [(k.name, getattr(k, "error", None)) for k in report.kernels
           if not k.compiled and not getattr(k, "skipped", None)]  # (a loser the autotuning cache knew)
    if bad:
        raise Mismatch(f"kernels that did not compile: {bad[:3]}")
    if training:  # the step run with every region's kernel IR in its reference's place, judged as on a GPU
        run_program(emulated, "cpu", outcome=outcome)
    if not training:
        case = CNNCase(copy.deepcopy(model), (x,), getattr(torch, program.dtype), False, program.layers)
        check_options = {k: v for k, v in options.items() if k not in ("executor", "fast_math")}
        for sched in check_fusion(case, check_options):
            for region in sched.regions:
                if hasattr(region.kernel, "reduced"):
                    for ks in reduction_sources(region.kernel, bool(options.get("fast_math", False))):
                        if is_row_kernel(ks):
                            check_row_geometry(ks)
                        elif is_column_kernel(ks):  # small inputs: the graph's float32 math rounds
                            check_column_geometry(ks, high=4, rtol=1e-4, atol=1e-4)
                else:
                    ks = tiled_source(region.kernel, bool(options.get("fast_math", False)))
                    if ks is not None:  # a transpose's shared-memory tiles, every thread
                        check_column_geometry(ks, high=4, rtol=1e-4, atol=1e-4)
    return list(report.graphs)
