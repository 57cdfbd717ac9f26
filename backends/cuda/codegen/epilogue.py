"""A fused epilogue (``ir.epilogue_expr``: act(acc + bias (+ residual)) over the ``ir.ACC``,
``ir.BIAS`` and ``ir.RES`` leaves) as C for the template families: ``epilogue_code`` renders the
chain as statements on ``acc`` (``acc += bias;``, ``acc += res;``, then one line per activation,
commented with its name), ``epilogue_params`` / ``epilogue_desc`` / ``has_bias`` / ``has_residual``
say what the kernel takes, and ``epilogue_key`` is what the kernels' names digest of it. An
expression that is no such chain goes through the general ``Emitter``. ``epilogue_body`` renders the
chain as the conv-epilogue kernel's pointwise body instead: one ``const float`` per step
(``t_bias``, ``t_res``, ``t_act``), then ``return``."""
from __future__ import annotations

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.codegen.c import act_lines, c_unary
from fxopt.backends.cuda.codegen.emit import Emitter
from fxopt.backends.cuda.codegen.source import c_comment
from fxopt.backends.cuda.ir import ACC, BIAS, RES

#: the epilogue of a kernel without one: the accumulator as it is
NO_EPILOGUE = ACC


def _parts(e):
    parts = ir.epilogue_parts(e)
    return parts if parts is not None and parts.acc == ACC else None


def has_bias(e) -> bool:
    return BIAS in set(ir.walk(e))


def has_residual(e) -> bool:
    return RES in set(ir.walk(e))


def epilogue_code(e, indent: str, bias_expr: str, res_expr: str) -> str:
    """Statements applying epilogue ``e`` to ``acc`` in place (``bias_expr`` / ``res_expr``: the
    C of the bias and residual reads)."""
    parts = _parts(e)
    if parts is None:
        em = Emitter(None, indent, {ACC: "acc", BIAS: bias_expr, RES: res_expr})
        value = em.emit([e])[0]
        return "\n".join(em.lines + [f"{indent}acc = {value};"])
    lines = [f"{indent}acc += {bias_expr};"] if parts.bias is not None else []
    if parts.residual is not None:
        lines.append(f"{indent}acc += {res_expr};")
    act = act_lines(list(parts.activations), "acc", indent)
    return "\n".join(lines + ([act] if act else []))


def epilogue_body(e, names: dict, indent: str = "  ") -> list[str]:
    """The lines of a pointwise function's body computing epilogue ``e`` (a chain): one SSA value
    per step, commented with its step and op (``const float t0 = (x0 + x1);  // t_bias = add``, then
    ``t_res = add``, then ``t_act = <activation>`` per activation, ``t_id = identity`` where there is
    no step), then ``return``. ``names``: the C variable of each leaf (``ir.ACC``, ``ir.BIAS``,
    ``ir.RES``)."""
    parts = _parts(e)
    if parts is None:
        raise ValueError(f"not an epilogue chain over ir.ACC: {e!r}")
    lines, cur = [], names[ACC]

    def step(label: str, op: str, expr: str) -> None:
        nonlocal cur
        t = f"t{len(lines)}"
        lines.append(f"{indent}const float {t} = {expr};  // {c_comment(label)} = {op}")
        cur = t

    if parts.bias is not None:
        step("t_bias", "add", f"({cur} + {names[BIAS]})")
    if parts.residual is not None:
        step("t_res", "add", f"({cur} + {names[RES]})")
    for k, (name, p) in enumerate(parts.activations):
        step("t_act" if k == 0 else f"t_act{k}", name, c_unary(name, cur, tuple(p)))
    if not lines:
        step("t_id", "identity", c_unary("identity", cur))
    return lines + [f"{indent}return {cur};"]


def epilogue_params(e, T_: str) -> str:
    """The kernel parameters the epilogue reads (after the others): bias, then the residual."""
    return (f", const {T_}* __restrict__ bias" * has_bias(e)
            + f", const {T_}* __restrict__ res" * has_residual(e))


def _activation(e):
    parts = _parts(e)
    if parts is None:
        return repr(e)
    acts = list(parts.activations)
    return None if not acts else acts[0] if len(acts) == 1 else acts


def epilogue_desc(e) -> str:
    """A comment's text: ``bias=True residual=False act=[('relu', ())]``."""
    parts = _parts(e)
    acts = list(parts.activations) if parts is not None else repr(e)
    return c_comment(f"bias={has_bias(e)} residual={has_residual(e)} act={acts}")


class _Text(str):
    """Text that ``source.unique_name`` digests as it is written."""

    def __repr__(self) -> str:
        return str(self)


def epilogue_key(e) -> _Text:
    """What a kernel's name digests of its epilogue (in the form the names always digested, so
    that the names, which key the autotuning and compile caches, stay)."""
    return _Text(f"Epilogue(bias={has_bias(e)}, residual={has_residual(e)}, activation={_activation(e)!r})")


def template_epilogue(bias: bool = False, residual: bool = False, activation=None, params=()):
    """``ir.epilogue_expr`` over the template leaves: ``activation`` a fused activation name (with
    ``params``), None, or a chain as ``ir.activation_chain`` reads it."""
    return ir.epilogue_expr(ACC, BIAS if bias else None, RES if residual else None, activation, params)
