"""Compile once, deploy anywhere: ``fxopt.package(model, inputs, path)`` and ``fxopt.load(path)``.

``package`` captures the model with ``torch.export`` (no Dynamo guards at run time), decomposes
it as AOTAutograd does for ``torch.compile`` (CompositeImplicit ops only, so the passes see the
graph they see there), runs the same pass pipeline, evaluates the weight-only subgraphs (a
package's weights are fixed), lowers the result with the executor ``torch.compile`` would use and
runs it once on the example inputs, which on CUDA measures what the executor measures (node
implementations, the CUDA-graph runner's replay decision). It then writes one file
(``fxopt.package_file``) holding:

- the optimized ATen graph as JSON (``fxopt.serialize``; why not ``torch.export.save``: loading an
  exported program imports Dynamo and rebuilds FakeTensors per node, over a second for ResNet-50);
- the weights it reads (folded BatchNorm, channels_last layouts, Winograd/FFT prepacked filters);
- the measured choices: every autotuning-cache entry the pipeline and the lowering used
  (``fxopt.choices.RecordingCache``), keyed by the device fingerprint they were measured on;
- the generated kernels: CUDA source, and the cubin for the arch and NVRTC version they were
  compiled with;
- the input signature (dtype, shape, which dimension is the batch), the output structure, the
  options, and a summary (passes, conv algorithms, kernels, choices) for ``fxopt run``.

Batch: with ``dynamic_batch`` (default) dimension 0 of every input is exported as one
``torch.export.Dim("batch", min=1)`` (traced size-obliviously, so an example batch of 1 works
too). The package is then checked against the model in eager mode at the example batch and at a
second one (1, or 2 for an example of 1); where the model does not allow a varying batch (export
specialises it, or the check differs), the batch is fixed at the example's and ``info["batch"]``
says why. A symbolic batch meets the executors so: the torch executor runs the symbolic graph for
every batch size; the cuda executor, whose kernels are generated for static shapes, and the cpu
executor, whose ways (ONNX Runtime, OpenVINO, prepacked oneDNN convolutions) are built and timed
per input signature, get a specialisation per batch size at the first call of that size: every
node's value at that size (shape, strides, dtype) from the package, which stores them as
expressions of the batch (``symbolic_vals``; packaging checks them against FakeTensor propagation at
every batch it runs and drops them on any difference), so that the loading process never builds a
FakeTensorMode, which imports Dynamo (without them: FakeTensor propagation at that size); layout
clones that size shows to be copies dropped; then lowering, up to ``cudagraph_max_signatures`` sizes (beyond: the torch
executor on CUDA, the cpu executor's symbolic graph on the CPU). Choices are looked up in the
package for every size: the example batch (and the second checked size) find theirs; other sizes
get the choices that need no measurement (``fxopt.choices.FixedChoices``: PyTorch's implementation
of each node, CUDA-graph replay, the way the packaged sizes' CPU runner chose). A package's weights
are fixed (``PassContext.fixed_weights``): runners that bake them in do not watch them per call.

``load`` reads the file, checks it (``PackageError`` and its subclasses), puts the weights on the
device (one host-to-device copy), installs the cubins where the arch and NVRTC version match
(elsewhere the executor compiles the packaged sources), and returns a ``PackagedModule``: no
``torch.compile``, Dynamo, guards or AOTAutograd wrapper; loading measures nothing. On a device
whose fingerprint (GPU, compute capability, torch, CUDA, cuDNN) differs from the one the package
was tuned on, it warns once and runs the heuristic choices (the ones above for sizes without
choices); package again on that device to tune for it.
"""
from __future__ import annotations

import dataclasses
import datetime
import time
import warnings
from typing import Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxopt.package_batch import _exported_vals, _specialise, _vals_agree, specialise_at
from fxopt.package_file import PackageCorruptError, PackageError, PackageVersionError  # noqa: F401

__all__ = ["package", "load", "PackagedModule", "PackageError", "PackageVersionError", "PackageCorruptError"]


# -- capture ----------------------------------------------------------------------------------------
def _cia_decompositions() -> dict:
    """The decomposition table AOTAutograd applies for torch.compile: CompositeImplicitAutograd ops
    only (conv2d -> convolution, linear -> t + addmm, max_pool2d -> max_pool2d_with_indices...)."""
    table = torch.export.default_decompositions()
    return {op: table[op] for op in list(table.keys())
            if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")}


def _size_oblivious():
    """Trace a dynamic batch without specialising an example size of 1 (where torch has it)."""
    try:
        import torch.fx.experimental._config as sym_config

        if hasattr(sym_config, "backed_size_oblivious"):
            return sym_config.patch(backed_size_oblivious=True)
    except ImportError:
        pass
    import contextlib

    return contextlib.nullcontext()


def _export(model, inputs: tuple, dynamic: bool):
    """(exported program decomposed as for torch.compile, batch info)."""
    batches = {int(x.shape[0]) for x in inputs if x.dim() > 0}
    info = {"dynamic": False, "example": next(iter(batches)) if len(batches) == 1 else None}
    ep = None
    if dynamic and len(batches) == 1:
        batch = torch.export.Dim("batch", min=1)
        shapes = tuple({0: batch} if x.dim() > 0 else None for x in inputs)
        try:
            with _size_oblivious(), torch.no_grad():
                ep = torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)
                ep = ep.run_decompositions(_cia_decompositions())
            info.update(dynamic=True, min=1)
        except Exception as e:  # noqa: BLE001 - the model does not allow it: a fixed batch
            info["why_fixed"] = f"export: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            ep = None
    elif dynamic:
        info["why_fixed"] = f"inputs have different batch sizes {sorted(batches)}"
    if ep is None:
        with torch.no_grad():
            ep = torch.export.export(model, inputs, strict=False).run_decompositions(_cia_decompositions())
    return ep, info


def _specs(ep):
    """(weights: placeholder -> real tensor, qualified names, user input placeholders) of an
    exported program; refuses what a package cannot hold."""
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
        raise PackageError("the model writes its buffers or inputs (training-mode BatchNorm?): "
                           "a package is an inference program; call model.eval()")
    if any(s.kind != OutputKind.USER_OUTPUT for s in sig.output_specs):
        raise PackageError("the exported program has outputs other than the model's (mutations, gradients)")
    weights, names, inputs = {}, {}, []
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            inputs.append(name)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            weights[name] = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
            names[name] = spec.target
        else:
            raise PackageError(f"input {name} of kind {spec.kind.name} cannot be packaged")
    return weights, names, inputs


def _freeze(gm: fx.GraphModule, weights: dict) -> dict:
    """Evaluate fold_constants' weight-only graph once: its outputs become weight placeholders
    (``folded_<i>``); weights nothing reads any more are dropped. Returns the weights kept."""
    from fxopt.names import FOLDED_CONSTANTS_MODULE as MODULE_NAME

    g = gm.graph
    call = next((n for n in g.nodes if n.op == "call_module" and n.target == MODULE_NAME), None)
    weights = dict(weights)
    if call is not None:
        with torch.no_grad():
            values = getattr(gm, MODULE_NAME)(*[weights[a.name] for a in call.args])
        last = [n for n in g.nodes if n.op == "placeholder"][-1]
        for user in sorted(call.users, key=lambda u: u.args[1]):
            with g.inserting_after(last):
                last = g.placeholder(f"folded_{user.args[1]}")
            last.meta.update(user.meta)
            user.replace_all_uses_with(last)
            weights[last.name] = values[user.args[1]]
            g.erase_node(user)
        g.erase_node(call)
        delattr(gm, MODULE_NAME)
    for n in list(g.nodes):
        if n.op == "placeholder" and n.name in weights and not n.users:
            g.erase_node(n)
            del weights[n.name]
    gm.recompile()
    return weights


# -- the runnable package ---------------------------------------------------------------------------
#: executors that get one static graph per batch size (up to ``cudagraph_max_signatures``): the cuda
#: executor's kernels are generated for static shapes; the cpu executor's alternatives (ONNX Runtime,
#: OpenVINO, prepacked oneDNN convolutions) are built and timed per input signature
_PER_BATCH = ("cuda", "cpu")
#: kinds of inputs (shapes, strides, dtypes, devices) whose chosen call a package remembers
MAX_DIRECT = 64


def _input_key(inputs: Sequence) -> tuple:
    """What a package's checks and its runner's choice depend on: each input's shape, strides, dtype
    and device (None for a non-tensor, which the checks refuse)."""
    return tuple([(x.shape, x.stride(), x.dtype, x.device) if isinstance(x, torch.Tensor) else None for x in inputs])


class PackagedModule(torch.nn.Module):
    """A package ready to run: ``module(*inputs)`` returns what the model returned. Runs under
    ``torch.no_grad()``; inputs must match the packaged dtype, rank and non-batch sizes."""

    def __init__(self, graph: fx.GraphModule, weights: dict, manifest: dict, options, device: torch.device):
        super().__init__()
        from fxopt.backends import resolve_executor

        self.graph, self.manifest, self.options, self.device = graph, manifest, options, device
        order = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
        self.input_specs = manifest["inputs"]
        self._template = [weights.get(n) for n in order]
        self._input_at = [order.index(s["placeholder"]) for s in self.input_specs]
        self._weight_names = set(weights)
        self.out_spec = pytree.treespec_loads(manifest["out_spec"]) if manifest.get("out_spec") else None
        self._one_output = self.out_spec is not None and self.out_spec.is_leaf()  # the model returns a tensor
        self.executor = resolve_executor(options.executor, device.type, "inference")
        self.lowerings: dict = {}  # batch size (None: every size) -> what the executor made (fxopt.lowered)
        self.check_vals = False  # packaging sets it: stored values checked against propagation
        self.timings: dict = {}
        self._last_checked: Optional[tuple] = None  # (the inputs' shapes, dtypes, devices; their batch)
        self._direct: dict = {}  # _input_key -> the call its runner chose for such inputs (checked ones)
        # _input_key -> (an engine's ``fixed`` call, the inputs it takes): the chosen way where it is
        # an external engine's with fixed weights reading dense inputs of the package's alone
        self._fixed: dict = {}

    def extra_repr(self) -> str:
        b = self.manifest["batch"]
        return (f"device={self.device}, executor={self.executor}, "
                f"batch={'dynamic' if b['dynamic'] else 'fixed at ' + str(b['example'])}")

    def _check(self, inputs: Sequence) -> Optional[int]:
        key = tuple((x.shape, x.dtype, x.device.type) if isinstance(x, torch.Tensor) else None for x in inputs)
        last = self._last_checked
        if last is not None and last[0] == key:  # the previous call's shapes: checked then
            return last[1]
        batch = self._check_new(inputs)
        self._last_checked = (key, batch)
        return batch

    def _check_new(self, inputs: Sequence) -> Optional[int]:
        if len(inputs) != len(self.input_specs):
            raise TypeError(f"fxopt package: expected {len(self.input_specs)} input tensor(s), got {len(inputs)}")
        batch = None
        for i, (x, spec) in enumerate(zip(inputs, self.input_specs)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"fxopt package: input {i} must be a tensor, got {type(x).__name__}")
            want = spec["shape"]
            shape_ok = x.dim() == len(want) and all(w is None or w == s for w, s in zip(want, x.shape))
            if not shape_ok or str(x.dtype).replace("torch.", "") != spec["dtype"]:
                shown = ["batch" if w is None else w for w in want]
                raise ValueError(f"fxopt package: input {i} must be {spec['dtype']} of shape {shown} "
                                 f"(batch >= 1), got {str(x.dtype).replace('torch.', '')} {list(x.shape)}")
            if x.device.type != self.device.type:
                raise ValueError(f"fxopt package: input {i} is on {x.device}; the package runs on {self.device}")
            if None in want:
                n = int(x.shape[want.index(None)])
                if batch is not None and n != batch:
                    raise ValueError(f"fxopt package: inputs have different batch sizes ({batch} and {n})")
                batch = n
        if batch is not None and batch < 1:
            raise ValueError("fxopt package: the batch size must be at least 1")
        return batch

    def _lower(self, batch: Optional[int], args: list):
        from fxopt.autotune import cudnn_choosing
        from fxopt.backends import lower, target_for
        from fxopt.passinfra import PassContext

        t0 = time.perf_counter()
        options, gm, key = self.options, self.graph, None
        if self.executor in _PER_BATCH:
            if len(self.lowerings) < options.cudagraph_max_signatures:
                vals = self.manifest.get("vals")
                if self.check_vals:  # packaging (which measures): FakeTensors, the stored values checked
                    gm, counts = specialise_at(self.graph, args)
                    if vals is not None and not _vals_agree(_specialise(self.graph, args, vals, batch), gm):
                        self.manifest["vals"] = None
                else:
                    gm, counts = specialise_at(self.graph, args, vals, batch)
                self.timings[f"layout_clones_removed_b{batch}"] = counts["layout_clones_removed"]
                key = batch
            elif self.executor == "cuda":  # beyond the bound: one symbolic graph with PyTorch's kernels
                options = dataclasses.replace(options, executor="torch", cudagraphs=False)
            # (the cpu executor beyond the bound: the symbolic graph, its oneDNN convolutions, no alternatives)
        ctx = PassContext(options=options, mode="inference", device_type=self.device.type,
                          target=target_for(options, self.device.type, "inference"))
        ctx.param_placeholders = set(self._weight_names)
        ctx.fixed_weights = ctx.package = True  # a package's weights are its own and fixed
        with cudnn_choosing(options.cudnn_search):
            lowered = lower(gm, ctx, "inference")
        self.lowerings[key] = lowered
        self.timings[f"lower_b{batch}_s" if key is not None else "lower_s"] = round(time.perf_counter() - t0, 4)
        return lowered.fn

    def forward(self, *inputs):
        key = _input_key(inputs)
        fixed = self._fixed.get(key)
        if fixed is not None:  # checked inputs straight to an engine: no arguments list, no grad mode
            outs = fixed[0]([inputs[j] for j in fixed[1]])
            if outs is not None:
                return self._result(outs)
            self._fixed.pop(key, None)  # the engine let its compiled object go: the runner's way
        runner = self._direct.get(key)
        args = list(self._template)
        for at, x in zip(self._input_at, inputs):
            args[at] = x
        first = runner is None
        if first:  # inputs of a kind not seen yet: checked, and the lowering of their batch size
            batch = self._check(inputs)
            lowered = self.lowerings.get(batch if self.executor in _PER_BATCH else None) or self.lowerings.get(None)
            runner = lowered.fn if lowered is not None else self._lower(batch, args)
        if torch.is_grad_enabled():
            with torch.no_grad():
                out = runner(*args)
        else:
            out = runner(*args)
        if first and len(self._direct) < MAX_DIRECT:
            # a runner that dispatches on its inputs (the cpu executor's) names the way it chose for
            # them: later calls with inputs of this kind go straight to it
            chosen_call = getattr(runner, "chosen_call", None)
            way = chosen_call(args) if chosen_call is not None else None
            if way is not None:
                self._direct[key] = way
                self._fixed_call(key, way, inputs)
        return self._result(out)

    def _fixed_call(self, key, way, inputs) -> None:
        """Remember ``way``'s ``fixed`` call for inputs of ``key`` where it has one (an external
        engine's, weights fixed) and reads dense inputs of the package alone."""
        fixed, positions = getattr(way, "fixed", None), getattr(way, "positions", None)
        if fixed is None or positions is None or not all(p in self._input_at for p in positions):
            return
        pick = [self._input_at.index(p) for p in positions]
        if all(inputs[j].is_contiguous() for j in pick):  # dense at these shapes and strides: always
            self._fixed[key] = (fixed, pick)

    def _result(self, out):
        if self._one_output:
            return out[0]
        out = list(out)
        return pytree.tree_unflatten(out, self.out_spec) if self.out_spec is not None else tuple(out)

    def decisions(self) -> dict:
        """Per specialised batch size: the executor's node choices and the CUDA-graph runner's
        decisions (what ran, from the package or by default)."""
        out = {}
        for key, low in self.lowerings.items():
            out["any" if key is None else str(key)] = {
                "executor": low.executor, "cudagraphs": low.cudagraphs,
                "node_choices": {k: v.get("choice") for k, v in low.node_choices.items()},
                "runner": low.fn.decisions() if hasattr(low.fn, "decisions") else []}
        return out

    def summary(self) -> str:
        from fxopt.package_summary import describe

        return describe(self)


# -- package --------------------------------------------------------------------------------------
def _as_tuple(example_inputs) -> tuple:
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise TypeError("fxopt.package: example_inputs must be a tensor or a tuple of positional tensors")
    return inputs


def _other_batch(inputs: tuple, info: dict) -> Optional[tuple]:
    if not info["dynamic"]:
        return None
    b = info["example"]
    return tuple(x[:1] if b > 1 else torch.cat([x, x]) if x.dim() > 0 else x for x in inputs)


def _close(got: list, ref: list) -> Optional[str]:
    """Whole-tensor agreement (max |got - ref| / max |ref|) within fxopt's tolerance for the
    dtype (TF32's on CUDA float32, as eager runs it), shapes and dtypes equal."""
    from fxopt.tolerances import tolerance, whole_tensors_differ

    def rtol_of(b: torch.Tensor) -> float:
        rtol = tolerance(b.dtype)[0]
        return max(rtol, 1e-3) if b.is_cuda and b.dtype == torch.float32 else rtol

    return whole_tensors_differ(got, ref, rtol_of)


def _check_against(model, module: PackagedModule, inputs: tuple) -> Optional[str]:
    with torch.no_grad():
        ref = model(*inputs)
        try:
            got = module(*inputs)
        except Exception as e:  # noqa: BLE001 - reported as the reason the batch is fixed
            return f"{type(e).__name__}: {e}"
        return _close(pytree.tree_leaves(got), pytree.tree_leaves(ref))


def package(model: torch.nn.Module, example_inputs, path, options=None, dynamic_batch: bool = True) -> dict:
    """Optimize ``model`` for ``example_inputs`` and write it to ``path`` (see the module doc).
    Returns the package's summary (what ``fxopt.load(path).manifest["summary"]`` holds)."""
    from fxopt.config import Options

    inputs = _as_tuple(example_inputs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError("fxopt.package: model must be an nn.Module")
    opts = Options.from_any(options)
    if opts.executor == "onnxruntime":
        raise PackageError("the onnxruntime executor is not packaged: use fxopt.export_onnx for ONNX Runtime")
    t0 = time.perf_counter()
    built = _build(model, inputs, opts, dynamic_batch)
    if built["problem"] is not None and built["info"]["dynamic"]:
        why = built["problem"]
        warnings.warn(f"fxopt.package: the batch is fixed at {built['info']['example']}: with a varying batch "
                      f"the program differs from the model ({why})", stacklevel=2)
        built = _build(model, inputs, opts, False)
        built["info"]["why_fixed"] = f"checked against the model at another batch: {why}"
    if built["problem"] is not None:
        raise PackageError(f"the packaged program differs from the model at the example inputs: {built['problem']}")
    built["timings"]["total_s"] = round(time.perf_counter() - t0, 3)
    return _write(path, built, opts)


def _build(model, inputs: tuple, opts, dynamic: bool) -> dict:
    """Export, optimize, freeze and round-trip the program; run it (measuring, recording) and
    check it against the model. Returns what ``_write`` needs."""
    from fxopt.autotune import AutotuneCache, cudnn_choosing
    from fxopt.backend import _graph_output_formats
    from fxopt.backends import target_for
    from fxopt.choices import RecordingCache
    from fxopt.passinfra import PassContext
    from fxopt.pipeline import run_pipeline
    from fxopt.serialize import graph_from_json, graph_to_json

    timings = {}
    t = time.perf_counter()
    ep, info = _export(model, inputs, dynamic)
    timings["export_s"] = round(time.perf_counter() - t, 3)
    weights, qualnames, input_names = _specs(ep)
    recording = RecordingCache(AutotuneCache.for_option(opts.autotune_cache))
    run_opts = dataclasses.replace(opts, autotune_cache=recording)
    device = next(iter({x.device for x in inputs}))
    gm = ep.graph_module
    ctx = PassContext(options=run_opts, mode="inference", device_type=device.type,
                      target=target_for(run_opts, device.type, "inference"))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ctx.fake_inputs = [n.meta.get("val") for n in placeholders]
    for n in placeholders:
        if n.name in weights:
            ctx.param_placeholders.add(n.name)
            ctx.const_placeholders.add(n.name)
            ctx.param_qualnames[n.name] = qualnames[n.name]
    if opts.verify:
        real = dict(weights, **dict(zip(input_names, inputs)))
        ctx.example_inputs = [real[n.name] for n in placeholders]
    ctx.output_formats = _graph_output_formats(gm)
    t = time.perf_counter()
    with _size_oblivious() if info["dynamic"] else _null(), torch.no_grad(), cudnn_choosing(opts.cudnn_search):
        optimized, records, fallback = run_pipeline(gm, ctx)
    timings["passes_s"] = round(time.perf_counter() - t, 3)
    kept = _freeze(optimized, weights)
    graph_json = graph_to_json(optimized)
    specs = []
    for name, x in zip(input_names, inputs):
        v = next(n for n in optimized.graph.nodes if n.op == "placeholder" and n.name == name).meta.get("val")
        shape = [d if isinstance(d, int) else None for d in (v.shape if v is not None else x.shape)]
        specs.append({"placeholder": name, "dtype": str(x.dtype).replace("torch.", ""), "shape": shape})
    try:
        out_spec = pytree.treespec_dumps(ep.call_spec.out_spec)
    except Exception:  # noqa: BLE001 - an output structure pytree cannot name: a flat tuple
        out_spec = None
    manifest = {"inputs": specs, "batch": info, "out_spec": out_spec, "graph": graph_json}
    # the program as load() will see it: lowered, run (measured and recorded), checked
    module = PackagedModule(graph_from_json(graph_json), kept, manifest, run_opts, device)
    if module.executor in _PER_BATCH:  # each batch's values at load without propagation, checked below
        with _size_oblivious() if info["dynamic"] else _null():
            manifest["vals"] = _exported_vals(optimized, dict(zip(input_names, inputs)), kept, info["dynamic"])
        module.check_vals = True
    t = time.perf_counter()
    problem = _check_against(model, module, inputs)
    timings["lower_and_first_call_s"] = round(time.perf_counter() - t, 3)
    other = _other_batch(inputs, info)
    if problem is None and other is not None:
        problem = _check_against(model, module, other)
    return {"info": info, "manifest": manifest, "weights": kept, "qualnames": qualnames, "module": module,
            "records": records, "fallback": fallback, "conv_algorithms": dict(ctx.conv_algorithms),
            "recording": recording, "problem": problem, "timings": timings, "device": device}


def _null():
    import contextlib

    return contextlib.nullcontext()


def _write(path, built: dict, opts) -> dict:
    from fxopt.version import __version__
    from fxopt.autotune import device_fingerprint
    from fxopt.package_file import Writer

    from fxopt.package_summary import kernels_of, summarize

    writer = Writer()
    manifest = dict(built["manifest"])
    weights = []
    for name, t in built["weights"].items():
        weights.append({"placeholder": name, "name": built["qualnames"].get(name, name),
                        "blob": writer.add_tensor(t)})
    device = built["device"]
    with_cuda = built["module"].executor == "cuda"
    kernels = kernels_of(built["module"], writer) if with_cuda else []
    saved = {k: v for k, v in dataclasses.asdict(dataclasses.replace(opts, autotune_cache=None)).items()
             if k not in ("autotune_cache", "dump_dir", "verify")}
    from fxopt.autotune import cudnn_choosing

    with cudnn_choosing(opts.cudnn_search):
        fingerprint = device_fingerprint(device.type)
    manifest.update({
        "fxopt_version": __version__, "torch_version": torch.__version__,
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": str(device), "device_fingerprint": fingerprint, "options": saved, "weights": weights,
        "kernels": kernels, "choices": built["recording"].used,
    })
    manifest["summary"] = summarize(built, kernels)
    size = writer.write(str(path), manifest)
    manifest["summary"]["bytes"] = size
    return manifest["summary"]


# -- load -------------------------------------------------------------------------------------------
def load(path, device=None) -> PackagedModule:
    """The package at ``path`` as a module (see the module doc). ``device``: where to run
    (default: the device it was packaged on when available, else the CPU)."""
    from fxopt.version import __version__
    from fxopt.autotune import cudnn_choosing, device_fingerprint
    from fxopt.choices import FixedChoices
    from fxopt.config import Options
    from fxopt.package_file import blob_tensor, read
    from fxopt.serialize import GraphFormatError, graph_from_json

    t0 = time.perf_counter()
    manifest, data = read(str(path), expected_version=__version__)
    t_read = time.perf_counter()
    if isinstance(manifest.get("summary"), dict):
        manifest["summary"]["bytes"] = data.numel()
    try:
        packaged = torch.device(manifest["device"])
        if device is None:
            device = packaged if packaged.type != "cuda" or torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        options = Options.from_any(manifest["options"])
        blobs = manifest["blobs"]
        on_device = data.to(device) if device.type != "cpu" else data
        weights = {w["placeholder"]: blob_tensor(on_device, blobs[w["blob"]]) for w in manifest["weights"]}
        graph = graph_from_json(manifest["graph"])
    except GraphFormatError as e:
        raise PackageError(f"{path}: {e}") from e
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise PackageCorruptError(f"{path}: the manifest is not one this fxopt wrote ({type(e).__name__}: {e})") from e
    t_graph = time.perf_counter()
    choices = FixedChoices(manifest.get("choices") or {})
    module = PackagedModule(graph, weights, manifest, dataclasses.replace(options, autotune_cache=choices), device)
    if module.executor == "cuda":
        with cudnn_choosing(options.cudnn_search):
            here = device_fingerprint(device.type)
        if here != manifest.get("device_fingerprint"):
            warnings.warn(f"fxopt.load: {path} was tuned on {manifest.get('device_fingerprint')}; this is {here}: "
                          "running the heuristic choices (PyTorch's kernels per node, CUDA graphs replayed); "
                          "package the model on this device to tune it", stacklevel=2)
        from fxopt.package_summary import install_kernels

        module.timings["kernels"] = install_kernels(manifest, data)
    module.choices = choices
    module.timings.update(read_s=round(t_read - t0, 4), graph_and_weights_s=round(t_graph - t_read, 4),
                          load_s=round(time.perf_counter() - t0, 4))
    return module
