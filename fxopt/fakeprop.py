"""FakeTensor propagation that only recomputes what a pass could have changed.

After every pass that modified the graph, the pipeline re-propagates FakeTensors so each node's
``meta["val"]`` is current. A fake result depends on nothing but the node's op, its non-tensor
arguments and the metadata (shape, strides, offset, dtype, device) of its tensor inputs, so a node
whose op and arguments are unchanged and whose inputs' metadata is unchanged gets its previous
result back instead of running the op's fake kernel again. A placeholder fed the very same fake
input object as last time keeps its recorded value. Symbolic sizes are compared as the expressions
their shape environment holds (``SymNode.expr``: reading it adds no guard, where comparing the sizes
would), so a symbolic graph's passes recompute only what they touched too. Kept out: outputs,
``call_module`` / ``get_attr`` (their target can change behind the same name), and results that are
not plain tensors, numbers or tuples of them.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

_CACHED_OPS = ("call_function", "call_method")


class _Uncacheable(Exception):
    pass


def _sym_key(d: Any) -> Any:
    """A symbolic number as its expression in its shape environment (no guard), or raise _Uncacheable."""
    node = getattr(d, "node", None)
    env = getattr(node, "shape_env", None)
    if env is None:
        raise _Uncacheable
    return ("S", id(env), node.expr)


def meta_key(v: Any, symbolic: bool = False) -> Any:
    """A hashable summary of everything fake propagation reads from a value, or raise _Uncacheable.
    ``symbolic``: symbolic sizes as their expressions (else they raise: a caller that compares the
    key's sizes as numbers would add guards)."""
    if isinstance(v, torch.Tensor):
        dims = (*v.shape, *v.stride(), v.storage_offset())
        if not all(type(d) is int for d in dims):
            if not symbolic:
                raise _Uncacheable  # symbolic: comparing would specialize it
            dims = tuple(d if type(d) is int else _sym_key(d) for d in dims)
            return ("T", dims, v.dtype, v.device, v.requires_grad)
        return ("T", tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device, v.requires_grad)
    if isinstance(v, (tuple, list)):
        return tuple(meta_key(x, symbolic) for x in v)
    if v is None or type(v) in (int, float, bool, str, torch.dtype, torch.device, torch.memory_format,
                                torch.layout):
        return v
    if symbolic and isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _sym_key(v)
    raise _Uncacheable


def fake_inputs_key(tensors) -> Optional[tuple]:
    """The metadata of fake inputs plus their fake mode, or None where it cannot be compared."""
    try:
        modes = {id(getattr(t, "fake_mode", None)) for t in tensors}
        return (tuple(modes), meta_key(tuple(tensors)))
    except _Uncacheable:
        return None


#: ops whose fake kernel asks cuDNN for BatchNorm's reserve-space size (``torch._decomp``'s
#: ``_get_batch_norm_reserve_tensor``): the reserve is output 3 of each
_RESERVE_QUERY_OPS = (torch.ops.aten._batch_norm_with_update_functional.default,
                      torch.ops.aten._batch_norm_with_update.default,
                      torch.ops.aten._batch_norm_no_update.default)


def _symbolic(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and any(not isinstance(d, int) for d in (*v.shape, *v.stride()))


class FakeProp(FakeTensorProp):
    """FakeTensorProp that records plain-number results (a size input propagated as an int: some torch
    versions keep the node's earlier, symbolic value) and does not let BatchNorm's cuDNN reserve-space
    query specialize a symbolic size.

    The fake kernel of ``_batch_norm_with_update`` (what ``training_batchnorm`` gives a training
    BatchNorm) asks cuDNN for its reserve-space size from concrete sizes: ``Eq(s0, n)`` would join
    the shape environment and the graph would be specialized to the traced batch (Dynamo recompiles
    at every batch). cuDNN needs no reserve space for a plain BatchNorm (its size was 0 at every
    batch 1-64, fp16/fp32, either layout, cuDNN 9.19), so the query runs with the shape environment's
    guards suppressed, and where the size it returns is 0 the result holds for every size. Where it
    is not 0 (a cuDNN whose reserve may depend on the sizes), every size of the input is specialized,
    as the query would have done."""

    def run_node(self, n: fx.Node) -> Any:
        env = getattr(self._mode, "shape_env", None)
        if (env is None or n.op != "call_function" or n.target not in _RESERVE_QUERY_OPS
                or not isinstance(n.args[0], fx.Node) or not _symbolic(self.env.get(n.args[0]))):
            result = super().run_node(n)
            if type(result) in (int, float, bool):
                # a size input given as an int: torch 2.11's FakeTensorProp records no value for it and
                # would leave the graph's symbolic one (a graph made static at these sizes kept a SymInt)
                n.meta["val"] = result
            return result
        with env.suppress_guards():
            result = super().run_node(n)
        if result[3].numel() != 0:
            x = self.env[n.args[0]]
            for d in (*x.shape, *x.stride()):
                int(d)  # guards every size: the reserve's size holds for these sizes only
        return result


class CachedFakeTensorProp(FakeProp):
    """FakeTensorProp with a cache (node -> (key, result, meta val)) that outlives one propagation."""

    def __init__(self, module: fx.GraphModule, mode, cache: dict):
        super().__init__(module, mode)
        self.cache = cache
        self.hits = 0
        self._value_keys: dict = {}  # node -> meta_key of its value (or _Uncacheable), this pass
        self._inputs, self._next_input = (), 0  # this propagation's inputs, the next placeholder's index

    def _value_key(self, a: fx.Node, value_of) -> Any:
        """meta_key of a node's value, computed once per propagation (values are read by every
        user's key)."""
        k = self._value_keys.get(a)
        if k is None:
            try:
                k = ("N", meta_key(value_of(a), symbolic=True))
            except _Uncacheable:
                k = _Uncacheable
            self._value_keys[a] = k
        if k is _Uncacheable:
            raise _Uncacheable
        return k

    def _key(self, n: fx.Node, value_of=None) -> Optional[tuple]:
        value_of = value_of or self.env.__getitem__

        def leaf(a):
            return self._value_key(a, value_of) if isinstance(a, fx.Node) else meta_key(a, symbolic=True)

        try:
            return (n.op, n.target, map_aggregate(n.args, leaf), map_aggregate(n.kwargs, leaf))
        except (_Uncacheable, KeyError):
            return None

    def seed(self) -> None:
        """Fill an empty cache from the values the graph already carries (AOTAutograd's fake
        results), so the first propagation after a pass recomputes only what the pass touched."""
        for n in self.module.graph.nodes:
            val = n.meta.get("val")
            if n.op not in _CACHED_OPS or val is None or n in self.cache:
                continue
            key = self._key(n, lambda a: a.meta["val"])
            if key is not None:
                try:
                    meta_key(val, symbolic=True)
                except _Uncacheable:
                    continue
                self.cache[n] = (key, val, val)
        self._value_keys.clear()  # keyed on recorded values; propagation computes its own

    def propagate_dont_convert_inputs(self, *args):
        self._inputs, self._next_input = args, 0
        return super().propagate_dont_convert_inputs(*args)

    def _placeholder(self, n: fx.Node) -> Any:
        """A placeholder whose input is the very tensor of the last propagation keeps its recorded
        value (FakeTensorProp would snapshot it anew, for every placeholder, every time)."""
        i, self._next_input = self._next_input, self._next_input + 1
        hit = self.cache.get(n)
        if (hit is not None and hit[0] == "placeholder" and not str(n.target).startswith("*")
                and i < len(self._inputs) and hit[1] is self._inputs[i]):
            n.meta["val"] = hit[2]
            return next(self.args_iter)
        result = super().run_node(n)
        if isinstance(result, torch.Tensor) and n.meta.get("val") is not None:
            self.cache[n] = ("placeholder", result, n.meta["val"])
        return result

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "placeholder":
            return self._placeholder(n)
        key = self._key(n) if n.op in _CACHED_OPS else None
        if key is not None:
            hit = self.cache.get(n)
            if hit is not None and hit[0] == key:
                self.hits += 1
                n.meta["val"] = hit[2]
                return hit[1]
        result = super().run_node(n)
        if key is not None:
            try:
                meta_key(result, symbolic=True)
            except _Uncacheable:
                self.cache.pop(n, None)
            else:
                self.cache[n] = (key, result, n.meta.get("val"))
        return result


def propagate(gm: fx.GraphModule, inputs) -> None:
    """Plain FakeTensor propagation of ``gm`` on ``inputs`` (fake tensors, as the graph's codegen
    takes them: a joint graph's ``(primals, tangents)``), every node's ``meta["val"]`` anew."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(inputs)
    with mode:
        FakeProp(gm, mode).propagate_dont_convert_inputs(*inputs)


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def view_problem(gm: fx.GraphModule) -> Optional[str]:
    """The first ``view`` whose input, as propagated, ATen's kernel refuses (None: none). FakeTensor's
    view is laxer than ATen's where a dimension of size 1 sits among those it merges (a ``[1, 2, 1,
    2]`` channels_last value viewed as ``[1, 4]`` propagates and fails at run time), so a rewrite
    that propagates may still not run; the view is retried on the meta device, whose view is ATen's."""
    for n in gm.graph.nodes:
        why = view_refused(n)
        if why is not None:
            return f"{n.name}: {why}"
    return None


def view_refused(n: fx.Node) -> Optional[str]:
    """Why ATen's kernel refuses ``view`` node ``n`` on its input as last propagated (None: it takes
    it, or ``n`` is no view, or its sizes are symbolic)."""
    if n.op != "call_function" or n.target not in _VIEWS or not isinstance(n.args[0], fx.Node):
        return None
    src = n.args[0].meta.get("val")
    if not isinstance(src, torch.Tensor):
        return None
    try:
        meta_key(src)
        size = meta_key(tuple(n.args[1]))
    except _Uncacheable:
        return None  # symbolic: not compared (it would add guards)
    t = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="meta")
    try:
        t.view(size)
    except (RuntimeError, ValueError) as e:  # (ValueError: the meta view of newer torch versions)
        return f"{src.shape} {src.stride()} as {list(size)}: {str(e).splitlines()[0][:120]}"
    return None
