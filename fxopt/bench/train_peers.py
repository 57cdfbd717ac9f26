"""The backends the training benchmark trains with (:data:`TRAIN_BACKENDS`): eager (also with
channels_last weights), Inductor in its modes, fxopt with its options, and ``torch.compile``'s
AOTAutograd floor. Each wraps the model every backend trains (a deep copy of the same seeded model)
into the module the reference loop calls."""
from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["DEFAULT_BACKENDS", "TRAIN_BACKENDS"]


def _eager(model, options, sink):
    return model


def _inductor(mode: Optional[str] = None):
    def wrap(model, options, sink):
        import torch

        return torch.compile(model, backend="inductor", **({"mode": mode} if mode else {}))

    return wrap


def _eager_channels_last(model, options, sink):
    """Eager with the model's weights in channels_last (the hand-tuned layout for convolutions on
    tensor cores): the first convolution turns the activations channels_last, the rest follow."""
    import torch

    return model.to(memory_format=torch.channels_last)


def _floor_aot_eager(model, options, sink):
    import torch

    return torch.compile(model, backend="aot_eager")


def _fxopt(extra: Dict[str, Any]):
    def wrap(model, options, sink):
        import torch

        from fxopt.backend import fxopt_backend

        opts = {**(options or {}), **extra}

        def backend(gm, example_inputs):  # backend="fxopt", keeping its reports
            return fxopt_backend(gm, example_inputs, options=opts, _sink=sink)

        return torch.compile(model, backend=backend)

    return wrap


#: name -> (wrap(model, fxopt options, report sink) -> the module to train, run by default)
TRAIN_BACKENDS: Dict[str, tuple] = {
    "eager": (_eager, True),
    "eager-channels-last": (_eager_channels_last, False),
    "inductor": (_inductor(), True),
    "inductor-reduce-overhead": (_inductor("reduce-overhead"), True),
    "inductor-max-autotune": (_inductor("max-autotune"), False),
    "fxopt": (_fxopt({}), True),
    "fxopt-default-partition": (_fxopt({"partitioner": "default"}), False),
    "fxopt-torch-executor": (_fxopt({"executor": "torch"}), False),  # ATen kernels, CUDA graphs
    "floor-aot-eager": (_floor_aot_eager, False),
}
DEFAULT_BACKENDS = [n for n, (_, default) in TRAIN_BACKENDS.items() if default]
