"""What every pass sees: the context, the result type, and small graph helpers.

A pass is ``run(gm, ctx) -> PassResult(gm, modified)`` (the shape of
``torch.fx.passes.infra.pass_base.PassResult``) plus ``ctx.note(...)`` lines
that say what it changed and why it declined elsewhere.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult  # noqa: F401  (re-exported)

from fxopt.config import Options
from fxopt.target import Target

aten = torch.ops.aten


def written_in_place(node: fx.Node) -> bool:
    """A user of ``node`` is an op whose schema mutates an argument (copy_, add_, ...)."""
    return any(getattr(getattr(u.target, "_schema", None), "is_mutable", False) for u in node.users)


def _aliases_input(node: fx.Node) -> bool:
    """The op's schema says it returns a view of its first argument (``view``, ``t``, ``split`` ...)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and not schema.is_mutable and schema.returns
                and schema.returns[0].alias_info is not None)


def storage_root(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` is, through any op whose schema returns a view of its input
    (and ``getitem`` of a split). The CUDA scheduler's ``view_root`` follows only the views its
    lowering computes as index arithmetic."""
    while node.op == "call_function":
        src = node.args[0] if node.target is operator.getitem else node
        if not (isinstance(src, fx.Node) and src.op == "call_function" and _aliases_input(src)
                and isinstance(src.args[0], fx.Node)):
            break
        node = src.args[0]
    return node


@dataclass
class PassContext:
    options: Options
    #: "inference" (no autograd at run time) or "training" (forward/backward graphs)
    mode: str = "inference"
    #: names of placeholders that hold parameters / buffers and are constant (freezing)
    const_placeholders: set[str] = field(default_factory=set)
    #: names of placeholders that hold parameters / buffers (constant or not)
    param_placeholders: set[str] = field(default_factory=set)
    #: the parameter inputs can never change (a package's weights, option ``fixed_weights``):
    #: executors that bake them into a compiled model (ONNX Runtime, OpenVINO), CUDA-graph runners
    #: and folded constants need not watch them for changes per call
    fixed_weights: bool = False
    #: lowering a package (its decisions stand for every later load: the cpu executor times its ways
    #: in steady bursts, ``backends/cpu_timing.burst_medians``)
    package: bool = False
    #: placeholder name -> qualified module attribute ("layer1.0.conv1.weight")
    param_qualnames: dict[str, str] = field(default_factory=dict)
    device_type: str = "cpu"
    #: what the passes may assume of the executor (built by the backend entry before the pipeline
    #: runs; None here: ``Target.generic`` for ``device_type``, which assumes no executor kernels)
    target: Optional[Target] = None
    #: per-pass notes (pass name -> list of lines), filled through note()
    notes: dict[str, list[str]] = field(default_factory=dict)
    #: qualified conv name -> selection record (select_conv_algorithm)
    conv_algorithms: dict[str, Any] = field(default_factory=dict)
    #: number of candidate timings actually measured in this compile
    measurements: int = 0
    current_pass: str = ""
    #: FakeTensors for the graph's placeholders (for re-propagating metadata)
    fake_inputs: Optional[list] = None
    #: real example inputs, when known (verify, autotuning)
    example_inputs: Optional[list] = None
    #: memory format of each graph output as eager produces it (layout restores these)
    output_formats: list = field(default_factory=list)
    #: eager's strides of each graph output (None where unknown): the outputs that are views keep them
    output_strides: list = field(default_factory=list)
    #: the graph as it came in, before any pass (the executor's never-slower baseline); for one size
    #: of a symbolic graph a ``fxopt.backends.lowering.DeferredGraph`` (made where it is measured)
    unoptimized: Any = None
    #: a lowering of one size of a symbolic inference graph (``fxopt.dynamic_compile``): its calls
    #: come with new input tensors (a serving loop's), so a CUDA-graph capture copies them in from
    #: the first rather than reading the first call's where they are (one capture a size, not two)
    per_size: bool = False
    #: training graphs on CUDA: how the CUDA-graph runner links forward and backward
    #: (``fxopt.backends.cuda.runtime.cudagraph_training.TrainingLink``); None in inference
    training_link: Any = None
    #: fake results of the last propagation, reused where nothing they depend on changed
    fake_cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.target is None:
            self.target = Target.generic(self.device_type)

    def _fake_prop(self, gm: fx.GraphModule):
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode

        from fxopt.fakeprop import CachedFakeTensorProp

        mode = detect_fake_mode(self.fake_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
        return CachedFakeTensorProp(gm, mode, self.fake_cache), mode

    def seed_meta(self, gm: fx.GraphModule) -> None:
        """Remember the fake results the graph carries before any pass, so that the first
        re-propagation recomputes only what that pass changed (and what depends on it)."""
        if self.fake_inputs is not None and not self.fake_cache:
            self._fake_prop(gm)[0].seed()

    def refresh_meta(self, gm: fx.GraphModule) -> None:
        """Re-run FakeTensor propagation so every node's meta['val'] is current."""
        if self.fake_inputs is None:
            return
        prop, mode = self._fake_prop(gm)
        if not self.fake_cache:
            prop.seed()
        # AOTAutograd traces an inference graph with grad off: propagating the same way keeps the
        # results' requires_grad as recorded, so unchanged nodes downstream of a rewrite stay cached
        grad = self.mode != "inference"
        with mode, torch.set_grad_enabled(grad):
            prop.propagate_dont_convert_inputs(*self.fake_inputs)

    def note(self, line: str) -> None:
        self.notes.setdefault(self.current_pass, []).append(line)


def val(node: Any) -> Optional[torch.Tensor]:
    """The FakeTensor recorded for a node (None when unknown or not a tensor)."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def only_user(node: fx.Node) -> Optional[fx.Node]:
    """The single user of `node`, or None when it has zero or several users."""
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def is_call(node: Any, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def module_path(node: fx.Node) -> str:
    """The qualified name of the nn.Module a node came from ('' when unknown)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return _clean_path(path)
    return ""


def _clean_path(path: str) -> str:
    """Dynamo's module path ("L['self'].layer1[0].conv1", "L['fn']._modules['0']") -> "layer1.0.conv1"."""
    path = re.sub(r"^L\['[^']*'\]", "", path)  # the root: L['self'], L['fn'], L['mod'], ...
    if path.startswith("self."):
        path = path[len("self."):]
    path = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).replace("['", ".").replace("']", "")
    return path.strip(".")


def copy_meta(new: fx.Node, old: fx.Node, **extra) -> fx.Node:
    """Carry the provenance of `old` (module stack, stack trace...) onto `new`."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr", "original_aten", "from_node"):
        if key in old.meta and key not in new.meta:
            new.meta[key] = old.meta[key]
    new.meta.update(extra)
    return new


def getitem_users(node: fx.Node) -> dict[int, fx.Node]:
    """For a tuple-producing node: index -> getitem user (None if used otherwise)."""
    out = {}
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem:
            return None
        out[u.args[1]] = u
    return out


class PatternRule:
    """A local rewrite: `anchor` ops to look at and a handler that returns None to decline.

    ``handler(node, ctx) -> str | None``: performs the rewrite at `node` and
    returns a one-line summary, or returns None (having changed nothing).
    Legality checks live in the handler's `match_*` helper, apart from the rewrite.
    """

    def __init__(self, anchors: tuple, handler: Callable):
        self.anchors = anchors
        self.handler = handler


def apply_rules(gm: fx.GraphModule, ctx: PassContext, rules: list[PatternRule]) -> int:
    count = 0
    for node in list(gm.graph.nodes):
        if getattr(node, "_erased", False) or node.op != "call_function":
            continue  # erased by an earlier rewrite
        for rule in rules:
            if node.target in rule.anchors:
                summary = rule.handler(node, ctx, gm)
                if summary:
                    ctx.note(summary)
                    count += 1
                    break
    return count


def finish(gm: fx.GraphModule, ctx: PassContext, changed: int, what: str) -> PassResult:
    """A pass's end: after ``changed`` rewrites, the graph linted and recompiled and a note
    "``changed`` ``what``"; the result says whether anything changed."""
    if changed:
        gm.graph.lint()
        gm.recompile()
        ctx.note(f"{changed} {what}")
    return PassResult(gm, changed > 0)
