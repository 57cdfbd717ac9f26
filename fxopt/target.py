"""What the passes may assume about where a graph will run: the target.

A pass decides things that depend on the executor: whether channels_last pays (the cpu executor's
oneDNN convolutions take NHWC), which convolution algorithms can run, whether a fused training
BatchNorm kernel exists. Rather than importing executors (or reading option ``executor``), a pass
reads ``ctx.target``. The backend entry (``fxopt.backend``, and the package and export paths that run
the pipeline) builds it before the pipeline runs by asking each executor for its capabilities
(``fxopt.backends.target_for``): it sits above both passes and executors, so neither imports the other.

A ``Target`` is a plain frozen record; ``Target.generic`` is the conservative one (no fused kernels,
NCHW on the CPU) that a ``PassContext`` built without a target gets.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass(frozen=True)
class Target:
    #: "cpu" or "cuda": where the graph's inputs live
    device_type: str = "cpu"
    #: the executor that will run the graph ("torch", "cpu", "cuda", "onnxruntime"), resolved from
    #: option ``executor`` for this device and graph kind
    executor: str = "torch"
    #: layout='auto' on the CPU: None where the executor's convolutions run faster in channels_last
    #: (the cpu executor's oneDNN convolutions with packed weights), else why NCHW stays
    cpu_channels_last: Optional[str] = "no NHWC convolutions in this executor"
    #: the dtypes of the convolutions that NHWC pays for on the CPU (empty: none)
    cpu_channels_last_dtypes: tuple = ()
    #: the convolution algorithms the executor can run (``fxopt.conv_algorithms.ALGORITHMS`` names);
    #: select_conv_algorithm considers only these
    conv_algorithms: tuple = ("direct",)
    #: the fused ops the executor provides kernels for beyond fxopt's references (names, e.g.
    #: "onednn_conv", "cudnn_batch_norm_relu"), for reports and passes
    fused_ops: tuple = ()
    #: ``fxopt::batch_norm_relu``'s backend for training graphs: "cudnn" where the executor
    #: registered cuDNN's extended BatchNorm, None where there is none (with the reason below)
    batch_norm_relu: Optional[str] = None
    batch_norm_relu_reason: str = "no fused BatchNorm + ReLU kernel in this executor"
    #: (shape, dtype, with_add, device_index) -> (reserve bytes, None) where the fused kernel runs
    #: that configuration, or (None, why not)
    batch_norm_relu_probe: Optional[Callable] = field(default=None, compare=False, repr=False)

    @classmethod
    def generic(cls, device_type: str = "cpu", executor: str = "torch") -> "Target":
        """The target that assumes nothing beyond fxopt's reference ops."""
        from fxopt.conv_algorithms import ALGORITHMS

        return cls(device_type=device_type, executor=executor, conv_algorithms=tuple(ALGORITHMS))

    def cpu_channels_last_reason(self, dtypes) -> Optional[str]:
        """Why layout='auto' keeps NCHW on the CPU for convolutions of these dtypes (None: NHWC pays)."""
        if self.cpu_channels_last:
            return self.cpu_channels_last
        if not any(d in self.cpu_channels_last_dtypes for d in dtypes):
            names = " / ".join(str(d).replace("torch.", "") for d in self.cpu_channels_last_dtypes)
            return f"no {names} convolution for the {self.executor} executor's NHWC kernels"
        return None

    def describe(self) -> dict:
        """A JSON-able summary for reports."""
        return {"device_type": self.device_type, "executor": self.executor,
                "cpu_channels_last": self.cpu_channels_last or "yes",
                "conv_algorithms": list(self.conv_algorithms), "fused_ops": list(self.fused_ops),
                "batch_norm_relu": self.batch_norm_relu or f"none ({self.batch_norm_relu_reason})"}

