"""fold_constants: evaluate weight-only subgraphs once, not on every call.

Why: after freezing, parameters and buffers are constants. Work that depends
only on them (BatchNorm folding arithmetic, weight layout conversion, Winograd
filter transforms, FFT kernel spectra, ``t()`` of linear weights) need not run
per call.

Matches: every pure node whose inputs are all constant (frozen parameter
placeholders, ``get_attr`` attributes, or other such nodes), and the pure
subgraphs rooted in tensor-creating ops (``arange``, ``full``...: no tensor
input) and literals of the traced code, where their sizes are static and
small: bilinear upsampling's interpolation weights, computed from ``arange``
on every call otherwise. Of the latter, values of integer or boolean dtype stay
in the graph (a gather's index arithmetic: the cuda executor reads it as an
index map, never as a table).

Produces: one ``call_module`` node ``fxopt_constants`` (a ``FoldedConstants``
module holding the weight-only subgraph) whose outputs replace the folded
values. At run time it returns cached results and re-evaluates the subgraph
when any input tensor changed in place (its version counter moved: optimizer
step, ``load_state_dict``, ``copy_``) or was replaced, so folded weights never
go stale.

Illegal: non-frozen parameters (training graphs, ``freezing=False``: only
generated constants are folded there, and none in training graphs); impure ops
(random, in-place/mutating); values that are plain placeholders already
(nothing to fold).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from fxopt.names import FOLDED_CONSTANTS_MODULE
from fxopt.passinfra import PassContext, PassResult
from fxopt.weights import WeightWatch

MODULE_NAME = FOLDED_CONSTANTS_MODULE  # the name packages and executors look for (fxopt.names)

aten = torch.ops.aten
#: ops that make a tensor from scalars alone: roots of generated constants
CREATION_OPS = frozenset((
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default, aten.zeros.default,
    aten.ones.default, aten.scalar_tensor.default, torch.ops.prims.iota.default))
#: a generated constant (and every value of its subgraph) holds at most this many elements
MAX_GENERATED_ELEMENTS = 1 << 20


class FoldedConstants(torch.nn.Module):
    """Runs a weight-only graph once and caches its outputs, keyed by the inputs' versions."""

    def __init__(self, graph_module: fx.GraphModule, input_names: list[str]):
        super().__init__()
        self.graph_module = graph_module
        self.input_names = input_names
        self._watch = None  # WeightWatch over the inputs, made on the first real call
        self.fixed = False  # the inputs never change (set by the lowering under fixed weights): evaluated once
        self._values = None
        self._fake = (None, None)  # (input metadata, fake outputs) of the last fake call
        self.evaluations = 0

    def forward(self, *tensors):
        if tensors and isinstance(tensors[0], FakeTensor):  # fake inputs come all together
            return self._fake_forward(tensors)  # metadata propagation
        if not tensors and _fake_mode_active():  # generated constants alone, traced
            return self._fake_forward(tensors)
        if self.fixed and self._values is not None:
            return self._values
        if self._watch is None:
            self._watch = WeightWatch(range(len(tensors)))
        _, changed = self._watch.check(tensors)
        if changed or self._values is None:
            with torch.no_grad():
                values = tuple(self.graph_module(*tensors))
                if self._values is not None and all(_same_layout(a, b) for a, b in zip(self._values, values)):
                    # Update in place: captured CUDA graphs keep reading these addresses.
                    for old, new in zip(self._values, values):
                        old.copy_(new)
                else:
                    self._values = values
            self.evaluations += 1
        return self._values

    def remember_fake(self, inputs: list, outputs: list) -> None:
        """The fake results the folded nodes already carry, for inputs with this metadata: the
        next metadata propagation need not trace the weight-only graph again."""
        from fxopt.fakeprop import fake_inputs_key

        if all(isinstance(t, FakeTensor) for t in list(inputs) + list(outputs)):
            key = fake_inputs_key(inputs)
            if key is not None:
                self._fake = (key, tuple(outputs))

    def _fake_forward(self, tensors):
        """Fake outputs depend only on the inputs' metadata: reuse them while it is unchanged. Under
        another fake mode (each size a symbolic graph is lowered at propagates in a mode of its own)
        the same metadata gives the same outputs, made anew in that mode (``_in_mode``) instead of
        tracing the weight-only graph again (0.1 s for resnet18's, per size)."""
        from fxopt.fakeprop import fake_inputs_key

        key = fake_inputs_key(tensors)
        if key is not None and key == self._fake[0]:
            return self._fake[1]
        if key is not None and self._fake[0] is not None and key[1] == self._fake[0][1]:
            out = _in_mode(self._fake[1], _fake_mode_of(tensors))
            if out is not None:
                self._fake = (key, out)
                return out
        out = self.graph_module(*tensors)
        self._fake = (key, out)
        return out


def _fake_mode_of(tensors):
    """The fake mode of ``tensors`` (all of one mode), else the one tracing now."""
    if tensors:
        return getattr(tensors[0], "fake_mode", None)
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def _in_mode(outputs, mode):
    """``outputs`` (fake tensors with static sizes, each its own fresh storage) as new fake tensors
    of ``mode`` with the same metadata, or None where one is not such a tensor."""
    if mode is None or not isinstance(outputs, (tuple, list)):
        return None
    made = []
    for o in outputs:
        if not isinstance(o, FakeTensor) or o.storage_offset() != 0 or \
                not all(type(d) is int for d in (*o.shape, *o.stride())):
            return None
        if o.fake_mode is mode:
            made.append(o)
            continue
        with mode:
            made.append(torch.empty_strided(tuple(o.shape), o.stride(), dtype=o.dtype, device=o.device,
                                            requires_grad=o.requires_grad))
    if len({id(o.untyped_storage()) for o in outputs}) != len(outputs):
        return None  # outputs sharing a storage (views of one value): traced again
    return type(outputs)(made)


def _fake_mode_active() -> bool:
    """Whether a fake tensor mode is tracing (one C call: this runs on every call of a graph with
    generated constants alone)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _same_layout(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device)


def is_pure(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags


def _static_small(node: fx.Node) -> bool:
    v = node.meta.get("val")
    return (isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape)
            and v.numel() <= MAX_GENERATED_ELEMENTS)


def constant_nodes(gm: fx.GraphModule, ctx: PassContext) -> tuple[list[fx.Node], set]:
    """The call_function nodes whose values are constants, and the constants computed from
    tensor-creating ops and literals alone (no weight among their inputs)."""
    const: set[fx.Node] = set()
    gen: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in ctx.const_placeholders:
            const.add(node)
        elif node.op == "get_attr":
            const.add(node)
            if str(node.target).startswith("_tensor_constant"):  # a literal of the traced code
                gen.add(node)
        elif node.op == "call_function" and node.target in CREATION_OPS and not node.all_input_nodes:
            if _static_small(node):  # guard: symbolic or large creations are left to run
                const.add(node)
                gen.add(node)
        elif is_pure(node) and all(a in const for a in node.all_input_nodes) and node.all_input_nodes:
            if all(a in gen for a in node.all_input_nodes):
                if not _static_small(node):  # guard: a large or symbolic generated value is computed per call
                    continue
                gen.add(node)
            const.add(node)
    return [n for n in gm.graph.nodes if n in const and n.op == "call_function"], gen


def _to_fold(gm: fx.GraphModule, ctx: PassContext) -> tuple[list, list, set]:
    """(nodes to fold in graph order, the values leaving them, every constant node). A generated
    value of integer or boolean dtype is not folded (an index stays index arithmetic)."""
    const, generated = constant_nodes(gm, ctx)
    const_set = set(const)
    frontier = []
    for n in const:
        if not any(u not in const_set for u in n.users):
            continue
        v = n.meta.get("val")
        if n in generated and not (isinstance(v, torch.Tensor) and v.is_floating_point()):
            continue  # guard: indices and masks stay in the graph
        frontier.append(n)
    needed, stack = set(), list(frontier)
    while stack:
        n = stack.pop()
        if n in needed or n not in const_set:
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in const if n in needed], frontier, const_set


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if not ctx.const_placeholders and ctx.mode != "inference":
        ctx.note("skipped: a training graph without frozen parameters")
        return PassResult(gm, False)
    if hasattr(gm, MODULE_NAME):
        ctx.note("skipped: already folded")
        return PassResult(gm, False)
    folded, frontier, const_set = _to_fold(gm, ctx)
    if not frontier:
        ctx.note("nothing weight-only to fold")
        return PassResult(gm, False)
    folded_set = set(folded)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inputs = sorted({a for n in folded for a in n.all_input_nodes if a not in folded_set}, key=order.__getitem__)
    sub = fx.Graph()
    env = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in folded:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[n] for n in frontier))
    sub_gm = fx.GraphModule(gm, sub, class_name="WeightOnlyGraph")
    module = FoldedConstants(sub_gm, [a.name for a in inputs])
    module.remember_fake([a.meta.get("val") for a in inputs], [n.meta.get("val") for n in frontier])
    gm.add_submodule(MODULE_NAME, module)

    if inputs:
        anchor = max(inputs, key=order.__getitem__)
    else:  # generated constants alone: after the last placeholder
        anchor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(anchor):
        call = gm.graph.call_module(MODULE_NAME, tuple(inputs))
    getters = []
    with gm.graph.inserting_after(call):
        for i, n in enumerate(frontier):
            getters.append(gm.graph.call_function(operator.getitem, (call, i)))
    for n, get in zip(frontier, getters):
        get.meta.update({k: v for k, v in n.meta.items() if k in ("val", "tensor_meta")})
        get.meta["fxopt_const"] = True
        # constants left in the graph (a generated index) keep reading the original
        n.replace_all_uses_with(get, delete_user_cb=lambda u: u not in const_set)
    for n in reversed(folded):
        if not n.users:
            gm.graph.erase_node(n)
    gm.recompile()
    gen = sum(1 for n in folded if n.target in CREATION_OPS)
    ctx.note(f"{len(folded)} weight-only nodes folded into {len(frontier)} constants, "
             f"evaluated once and re-evaluated only when a weight changes"
             + (f" ({gen} tensor creations among them: generated constants)" if gen else ""))
    return PassResult(gm, True)
