"""Standalone reproducers: one Python file per failure, runnable without the fuzzer.

The file holds the model's source, the input's shape / dtype / memory format / seed, the mode and
the fxopt options; ``python repro_XXXX.py`` builds the model and input exactly as the fuzzer did,
runs eager and ``torch.compile(model, backend="fxopt", options=...)`` and asserts they agree
(values within the dtype's tolerance, or fxopt's error against the float64 model at most twice
eager's; inference: shapes, dtypes and strides; training: the outputs and every gradient). The
fuzzer judges further (the spread of rounded float64 runs, PyTorch's own compiled graph:
``check.py``), so a reproducer of a difference only those explain still fails here.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .graphs import Program

_TEMPLATE = '''"""fxopt fuzz reproducer {tag}: {error}

layers: {layers}
Run: python {fname}   (asserts eager == fxopt; exits 0 once fixed)
"""
{source}

PROGRAM = {program}
DEVICE = {device!r}


def main():
    import copy
    import contextlib

    from fxopt.tolerances import tolerance

    dtype = getattr(torch, PROGRAM["dtype"])
    torch.manual_seed(PROGRAM["seed"])
    model = Model()
    x = torch.randn(PROGRAM["shape"], generator=torch.Generator().manual_seed(PROGRAM["seed"] + 1))
    training = PROGRAM["mode"] == "training"
    if not training:
        model, x = model.to(dtype).eval(), x.to(dtype)
    else:
        model.train()
    device = DEVICE if DEVICE == "cpu" or torch.cuda.is_available() else "cpu"
    fmt = torch.channels_last if PROGRAM["fmt"] == "channels_last" else torch.contiguous_format
    model, x = model.to(device), x.to(device).contiguous(memory_format=fmt)
    options = dict(PROGRAM["options"])
    if device == "cpu" and options.get("executor") == "cuda":
        options.pop("executor")
    mine = copy.deepcopy(model)
    torch.compiler.reset()
    compiled = torch.compile(mine, backend="fxopt", options=options)
    rtol, atol = tolerance(dtype)
    rtol = max(rtol, 1e-3) if device == "cuda" and dtype == torch.float32 else rtol
    rtol, atol = max(rtol, {rtol}), max(atol, {atol})  # the chosen convolution algorithms' tolerances
    amp = torch.autocast(device, dtype=dtype) if training and dtype != torch.float32 else contextlib.nullcontext()
    grad = contextlib.nullcontext() if training else torch.no_grad()
    xe, xc = x.detach().clone().requires_grad_(training), x.detach().clone().requires_grad_(training)
    with grad, amp:
        want, got = model(xe), compiled(xc)
        ref = copy.deepcopy(model).double()(x.detach().double())
    flat = lambda o: list(o) if isinstance(o, (tuple, list)) else [o]  # noqa: E731
    for g, w, r in zip(flat(got), flat(want), flat(ref)):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        if not training:
            assert all(n == 1 or a == b for n, a, b in zip(w.shape, g.stride(), w.stride())), (g.stride(), w.stride())
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError:
            err_g = (g.detach().double() - r).abs().max().item()
            err_w = (w.detach().double() - r).abs().max().item()
            assert err_g <= 2 * err_w + atol, f"fxopt's error vs float64 {{err_g}}, eager's {{err_w}}"
    if training:
        gen = torch.Generator().manual_seed(PROGRAM["seed"] + 2)
        ws = [torch.randn(o.shape, generator=gen).to(o.device) for o in flat(want)]
        sum((o.float() * w).sum() for o, w in zip(flat(want), ws)).backward()
        sum((o.float() * w).sum() for o, w in zip(flat(got), ws)).backward()
        exact = copy.deepcopy(model).double()  # the float64 gradients, where fxopt's and eager's differ
        xr = x.detach().double().requires_grad_(True)
        sum((o * w.double()).sum() for o, w in zip(flat(exact(xr)), ws)).backward()
        grads64 = {{**{{n: p.grad for n, p in exact.named_parameters()}}, "input": xr.grad}}
        pairs = [(n, q.grad, p.grad) for (n, p), q in zip(model.named_parameters(), mine.parameters())]
        for name, g, w in pairs + [("input", xc.grad, xe.grad)]:
            try:
                torch.testing.assert_close(g, w, rtol=rtol * 10, atol=atol * 10)
            except AssertionError:
                err_g = (g.double() - grads64[name]).abs().max().item()
                err_w = (w.double() - grads64[name]).abs().max().item()
                assert err_g <= 2 * err_w + atol * 10, f"{{name}}.grad: fxopt's error vs float64 {{err_g}}, eager's {{err_w}}"
    print("eager == fxopt")


if __name__ == "__main__":
    main()
'''


def write_repro(program: Program, error: str, out_dir, device: str, tol: tuple = (0.0, 0.0)) -> Path:
    """Write ``repro_<hash>.py`` for ``program`` into ``out_dir``; returns its path. ``tol``: the
    (rtol, atol) the fuzzer compared with (the dtype's, widened by the convolution algorithms')."""
    data = json.dumps(program.to_json(), sort_keys=True)
    tag = hashlib.sha1(data.encode()).hexdigest()[:10]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"repro_{tag}.py"
    fields = {k: v for k, v in program.to_json().items() if k != "source"}
    first = (error.strip().splitlines() or ["?"])[0].replace('"""', "'''")[:300]
    path.write_text(_TEMPLATE.format(tag=tag, error=first, layers=", ".join(program.layers), fname=path.name,
                                     source=program.source.rstrip(), program=repr(fields), device=device,
                                     rtol=float(tol[0]), atol=float(tol[1])))
    return path
