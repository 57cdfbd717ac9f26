"""A convolution's (or linear layer's) fused epilogue as C lines: acc (+ bias[c]) (+ residual) ->
activation(s), in that order; the kernel families that fuse one take an ``Epilogue``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fxopt.backends.cuda.codegen.c import act_lines, norm_acts as _norm_acts
from fxopt.backends.cuda.codegen.source import c_comment


@dataclass(frozen=True)
class Epilogue:
    """Fused conv epilogue: acc (+ bias[c]) (+ residual) -> activation(s), in that order."""
    bias: bool = False
    residual: bool = False
    activation: Any = None  # 'relu' | ('hardtanh', (0., 6.)) | PointwiseOp | list of those

    def code(self, indent: str, bias_expr: str, res_expr: str) -> str:
        lines = [f"{indent}acc += {bias_expr};"] if self.bias else []
        if self.residual:
            lines.append(f"{indent}acc += {res_expr};")
        act = act_lines(self.activation, "acc", indent)
        return "\n".join(lines + ([act] if act else []))

    def params(self, T_: str) -> str:
        return ("".join([f", const {T_}* __restrict__ bias"] * self.bias)
                + "".join([f", const {T_}* __restrict__ res"] * self.residual))

    def describe(self) -> str:
        return c_comment(f"bias={self.bias} residual={self.residual} act={_norm_acts(self.activation)}")
