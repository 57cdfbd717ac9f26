"""The fused epilogue as one IR expression (``ir.epilogue_expr``), read back by ``ir.epilogue_parts``
and rendered by ``codegen.epilogue`` as the template families' statements."""
from __future__ import annotations

import hashlib

import pytest
import torch

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.codegen.epilogue import (epilogue_body, epilogue_code, epilogue_desc, epilogue_key,
                                                 epilogue_params, has_bias, has_residual, template_epilogue)
from fxopt.backends.cuda.codegen.source import unique_name
from fxopt.backends.cuda.ir.expr import apply_op

ACTS = [("none", ()), ("relu", ()), ("hardtanh", (0.0, 6.0)), ("silu", ()), ("gelu", ()), ("gelu_tanh", ()),
        ("hardswish", ()), ("hardsigmoid", ()), ("sigmoid", ()), ("tanh", ()), ("leaky_relu", (0.1,))]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("act,params", ACTS)
def test_parts_read_back_what_the_expression_was_built_from(bias, residual, act, params):
    e = template_epilogue(bias, residual, act, list(params))
    parts = ir.epilogue_parts(e)
    assert parts.acc == ir.ACC
    assert (parts.bias is not None, parts.residual is not None) == (bias, residual)
    assert list(parts.activations) == ([] if act == "none" else [(act, params)])
    assert (has_bias(e), has_residual(e)) == (bias, residual)


def test_the_template_lines():
    e = template_epilogue(True, True, "relu")
    assert epilogue_code(e, "  ", "fx_to_f32(bias[c])", "fx_to_f32(res[o])") == (
        "  acc += fx_to_f32(bias[c]);\n  acc += fx_to_f32(res[o]);\n  acc = (acc < 0.f ? 0.f : acc);  // relu")
    e = template_epilogue(False, False, "hardtanh", [0.0, 6.0])
    assert epilogue_code(e, "", "b", "r") == "acc = fx_clamp(acc, 0.0f, 6.0f);  // hardtanh"
    assert epilogue_code(template_epilogue(), "", "b", "r") == ""
    assert epilogue_params(template_epilogue(True, True), "fx_half") == (
        ", const fx_half* __restrict__ bias, const fx_half* __restrict__ res")
    assert epilogue_desc(template_epilogue(True, False, "silu")) == "bias=True residual=False act=[('silu', ())]"


def test_a_chain_of_activations_in_order():
    e = template_epilogue(False, True, ["relu", ("clamp", (None, 4.0))])
    assert epilogue_code(e, "", "b", "r").splitlines() == [
        "acc += r;", "acc = (acc < 0.f ? 0.f : acc);  // relu", "acc = (acc > 4.0f ? 4.0f : acc);  // clamp"]


def test_the_pointwise_body_one_value_per_step():
    names = {ir.ACC: "y", ir.BIAS: "b", ir.RES: "r"}
    assert epilogue_body(template_epilogue(True, True, "hardtanh", [0, 6]), names, "") == [
        "const float t0 = (y + b);  // t_bias = add", "const float t1 = (t0 + r);  // t_res = add",
        "const float t2 = fx_clamp(t1, 0.0f, 6.0f);  // t_act = hardtanh", "return t2;"]
    assert epilogue_body(template_epilogue(False, True, ["relu", ("clamp", (None, 4.0))]), names) == [
        "  const float t0 = (y + r);  // t_res = add", "  const float t1 = (t0 < 0.f ? 0.f : t0);  // t_act = relu",
        "  const float t2 = (t1 > 4.0f ? 4.0f : t1);  // t_act1 = clamp", "  return t2;"]
    assert epilogue_body(template_epilogue(), names, "") == ["const float t0 = y;  // t_id = identity", "return t0;"]
    with pytest.raises(ValueError):  # the residual first: no chain
        epilogue_body(ir.op("add", ir.op("add", ir.ACC, ir.RES), ir.BIAS), names)


def test_an_expression_that_is_no_chain_goes_through_the_emitter():
    e = ir.op("mul", ir.op("add", ir.ACC, ir.RES), ir.BIAS)  # the residual first, then a product
    assert ir.epilogue_parts(ir.op("add", ir.op("add", ir.ACC, ir.RES), ir.BIAS)) is None
    assert epilogue_code(e, "", "b", "r").splitlines() == [
        "const float t0 = __fadd_rn(acc, r);", "const float t1 = __fmul_rn(t0, b);", "acc = t1;"]


def test_the_scheduler_and_the_templates_build_the_same_expression():
    """Over loads, as the fusion scheduler inlines a conv's epilogue: hardtanh is a float clamp
    (the region kernels' names digest the expression)."""
    y, b, r = ir.Load(0, ir.Ix()), ir.Load(1, ir.Ix()), ir.Load(2, ir.Ix())
    e = ir.epilogue_expr(y, b, r, "hardtanh", [0, 6])
    assert repr(e.params) == "(0.0, 6.0)" and e.op == "clamp"
    assert e == ir.substitute(e, {}) and ir.epilogue_parts(e, b, r).acc == y
    with pytest.raises(ValueError):
        ir.epilogue_expr(y, activation="frobnicate")


def test_the_name_digest_is_stable():
    e = template_epilogue(True, False, "relu", [])
    assert repr(epilogue_key(e)) == "Epilogue(bias=True, residual=False, activation=('relu', ()))"
    assert unique_name("k", 1, epilogue_key(e)) == "k_" + hashlib.sha1(
        b"(1, Epilogue(bias=True, residual=False, activation=('relu', ())))").hexdigest()[:8]
    assert repr(epilogue_key(template_epilogue())) == "Epilogue(bias=False, residual=False, activation=None)"


def test_values_match_torch():
    x, b, r = torch.randn(64), torch.randn(64), torch.randn(64)
    env = {ir.ACC: x, ir.BIAS: b, ir.RES: r}
    for act, p in ACTS[1:]:
        e = template_epilogue(True, True, act, list(p))
        vals = {}
        for n in ir.walk(e):
            vals[n] = env[n] if n in env else apply_op(n.op, [vals[a] for a in n.args], n.params)
        want = {"hardtanh": lambda t: torch.clamp(t, 0, 6), "leaky_relu": lambda t: torch.where(t > 0, t, 0.1 * t),
                "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}.get(
            act, getattr(torch.nn.functional, act, None))
        torch.testing.assert_close(vals[e], want(x + b + r), atol=1e-5, rtol=1e-5)
