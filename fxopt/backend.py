"""The ``torch.compile`` backend: Dynamo graph -> AOTAutograd (ATen) -> pass pipeline -> executor.

Registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="fxopt", options={...})`` works after
``pip install`` without importing fxopt.

Inference (grad disabled at compile time) gets one ATen graph; parameters and
buffers that Dynamo lifted to graph inputs are identified from their Dynamo
sources and, with ``freezing`` on, treated as constants by the passes (the
``fold_constants`` pass re-evaluates folded weights when a weight changes in
place). Training gets AOTAutograd's forward and backward graphs, each through
the same pipeline, where the passes only rewrite what stays legal with
autograd (no BatchNorm folding, no fusion across values saved for backward);
the joint graph is split by the partition function of option ``partitioner``
(``fxopt.training``: min-cut rematerialization by default), and on CUDA the two are replayed as
linked CUDA graphs (``fxopt.backends.cuda.runtime.cudagraphs``).
"""
from __future__ import annotations

import logging
import re
import time
import warnings
from typing import Callable, Optional

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func

from fxopt.config import Options
from fxopt.autotune import cudnn_choosing, deferred_writes
from fxopt.eager_formats import eager_output_values, measured_output_values, output_strides, with_eager_strides
from fxopt.compile_cache import CompileCache
from fxopt.lowered import Lowered
from fxopt.names import format_of
from fxopt.passinfra import PassContext, written_in_place
from fxopt.pipeline import ALL_PASS_NAMES, FxoptFallbackWarning, PassFailure, copy_graph_module
from fxopt.report import GraphReport
from fxopt.training import Partitioner, training_details

log = logging.getLogger("fxopt")
_PARAM_SOURCE = re.compile(r"\._(parameters|buffers)\[")


def qualname_from_source(source_name: str) -> str:
    """"L['self']._modules['layer1']._modules['0']._parameters['weight']" -> "layer1.0.weight"."""
    parts = re.findall(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_]\w*)", source_name)
    return ".".join(a or b for a, b in parts)


def _graph_output_formats(gm: fx.GraphModule, key: str = "val") -> list:
    """The memory format (``fxopt.names.format_of``) of each output's ``meta[key]``."""
    from fxopt.names import format_of

    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    flat = list(out) if isinstance(out, (list, tuple)) else [out]
    formats = []
    for o in flat:
        v = o.meta.get(key) if isinstance(o, fx.Node) else None
        formats.append(format_of(v) if isinstance(v, torch.Tensor) else None)
    return formats


def _eager_output_formats(aot: list, dynamo: list) -> list:
    """The output formats eager gives: Dynamo's graph's (``example_value``: before AOTAutograd's
    decompositions, which may change a format) where its outputs are AOTAutograd's, one for one."""
    if len(aot) != len(dynamo):
        return aot
    return [d if d is not None else a for a, d in zip(aot, dynamo)]


def direct_call_blocker(gm: fx.GraphModule, n_inputs: int) -> Optional[str]:
    """Why an inference graph must keep AOTAutograd's runtime wrapper, or None when the compiled
    graph may be handed to Dynamo directly (saving the wrapper's per-call cost). The wrapper does
    nothing for such a graph: its inputs are Dynamo's (no deduplication or synthetic bases), no
    input is mutated outside the graph, no output aliases an input or intermediate, no effect
    tokens, RNG functionalization, tensor subclasses or autocast; running with grad disabled is
    kept by the direct call."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    if meta is None:
        return "no AOTAutograd metadata"
    try:
        from torch._functorch._aot_autograd.schemas import SubclassCreationMeta
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        checks = (
            (len(placeholders) != n_inputs, "AOTAutograd changed the inputs"),
            (meta.num_mutated_inp_runtime_indices > 0, "inputs mutated at run time"),
            (meta.num_outputs_aliased > 0 or meta.num_intermediate_bases > 0, "outputs alias"),
            (len(out) != len(meta.output_info), "extra graph outputs"),
            (bool(meta.tokens) or meta.is_rng_op_functionalized or getattr(meta, "num_graphsafe_rng_states", 0),
             "effect tokens or functionalized RNG"),
            (any(isinstance(m, SubclassCreationMeta) for m in
                 list(meta.subclass_inp_meta) + list(meta.subclass_fw_graph_out_meta)), "tensor subclasses"),
            (getattr(meta, "grad_enabled_mutation", None) is not None, "the graph changes grad mode"),
            (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"), "autocast"),
        )
    except (AttributeError, ImportError, TypeError) as e:  # another torch's metadata: keep the wrapper
        return f"unreadable AOTAutograd metadata ({type(e).__name__})"
    return next((why for bad, why in checks if bad), None)


def direct_call(fn: Callable, eager: Optional[Callable] = None, report=None) -> Callable:
    """Dynamo's compiled function for a graph that needs no AOTAutograd runtime wrapper: runs
    with grad disabled, as AOTAutograd runs inference graphs.

    ``eager`` (Dynamo's graph: the model's own ops, as PyTorch runs them): where the compiled
    graph raises at run time on inputs Dynamo's guards admitted and ``eager`` does not, that call
    and every later one runs ``eager`` instead, with one ``FxoptFallbackWarning`` naming the error
    (recorded in ``report.executor_details["runtime_fallback"]``); where ``eager`` raises too, its
    error is the caller's. Such an inference graph writes no input, so the failed call changed
    nothing. E.g. torch's metadata for CPU ``native_group_norm`` says
    contiguous where its kernel keeps channels_last, and a ``view`` planned on that metadata fails.
    """
    state = [fn]

    def call(*args):
        f = state[0]
        try:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    return f(*args)
            return f(*args)
        except Exception as e:
            if eager is None or f is eager:
                raise
            with torch.no_grad():  # inputs eager rejects too: eager's error, and the graph stays
                out = eager(*args)
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            warnings.warn(f"fxopt: the compiled graph failed at run time ({why}); running this graph as "
                          "PyTorch's own ops from now on", FxoptFallbackWarning, stacklevel=2)
            if report is not None:
                report.executor_details["runtime_fallback"] = why
            state[0] = eager
            return out

    call.fxopt_direct = True
    return call


class FxoptCompiler:
    """Compiles the ATen graphs AOTAutograd hands over for one Dynamo graph."""

    def __init__(self, options: Options, dynamo_gm: fx.GraphModule, example_inputs: list,
                 sink: Optional[list] = None):
        self.options = options
        self.sink = sink
        self.direct: Optional[Callable] = None  # the inference graph, when it may skip AOT's wrapper
        self.forward_params: set[str] = set()  # training: the forward's parameter placeholders
        self.forward_runner = None  # training: the forward graph's CUDA-graph runner, if any
        self.dynamic_fallback: Optional[str] = None  # why a symbolic graph was specialized by the passes
        placeholders = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
        self.n_inputs = len(placeholders)
        self.params: dict[int, str] = {}
        for i, (node, ex) in enumerate(zip(placeholders, example_inputs)):
            grapharg = node.meta.get("grapharg")
            source = grapharg.source.name if grapharg is not None and grapharg.source is not None else ""
            if isinstance(ex, torch.nn.Parameter) or _PARAM_SOURCE.search(source):
                self.params[i] = qualname_from_source(source) or node.name
        self.example_inputs = example_inputs
        self.eager = dynamo_gm  # what a compiled inference graph that fails at run time falls back to
        # Dynamo's example_value with eager's strides where its meta functions give others
        eager = measured_output_values(dynamo_gm, example_inputs) or eager_output_values(dynamo_gm)
        self.eager_formats = [format_of(v) if v is not None else None for v in eager]
        self.eager_strides = output_strides(eager)
        self.eager_values = eager
        # Parameters Dynamo kept as graph attributes (it does so with Inductor's global freezing
        # flag set): AOTAutograd lifts them in front of the inputs, in this order
        self.lifted = list({**dict(dynamo_gm.named_parameters(remove_duplicate=False)),
                            **dict(dynamo_gm.named_buffers(remove_duplicate=False))}.items())
        devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
        self.device_type = "cuda" if "cuda" in devices else "cpu"
        from fxopt.backends import target_for

        # splits training graphs (fxopt.training), after the joint-graph passes for this target
        self.partitioner = Partitioner(options.partitioner, options,
                                       target=target_for(options, self.device_type, "training"))

    def _context(self, gm: fx.GraphModule, fake_args: list, kind: str) -> PassContext:
        from fxopt.backends import target_for

        mode = "inference" if kind == "inference" else "training"
        ctx = PassContext(options=self.options, mode=mode, device_type=self.device_type,
                          target=target_for(self.options, self.device_type, kind),
                          fixed_weights=mode == "inference" and self.options.fixed_weights)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        ctx.fake_inputs = list(fake_args)
        lifted = len(self.lifted) if len(placeholders) == len(self.lifted) + self.n_inputs else 0
        # the graph's inputs are Dynamo's (parameters at their positions); a backward's are saved
        # values and gradients, whatever their number: its parameters come by name (_link_training)
        if kind != "backward" and len(placeholders) == self.n_inputs + lifted:
            params = {i + lifted: qual for i, qual in self.params.items()}
            params.update({i: name for i, (name, _) in enumerate(self.lifted[:lifted])})
            for i, qual in params.items():
                node = placeholders[i]
                ctx.param_placeholders.add(node.name)
                ctx.param_qualnames[node.name] = qual
                if mode == "inference" and self.options.freezing and not written_in_place(node):
                    ctx.const_placeholders.add(node.name)
            if mode == "inference":
                ctx.example_inputs = [t for _, t in self.lifted[:lifted]] + list(self.example_inputs)
        elif mode == "inference":
            log.info("fxopt: AOTAutograd changed the inputs (%d -> %d); parameters stay runtime inputs",
                     self.n_inputs, len(placeholders))
        ctx.output_formats = _graph_output_formats(gm)
        if mode == "inference":
            ctx.output_formats = _eager_output_formats(ctx.output_formats, self.eager_formats)
            if len(self.eager_strides) == len(ctx.output_formats):  # AOTAutograd's outputs are Dynamo's
                ctx.output_strides = list(self.eager_strides)
        return ctx

    def compile(self, gm: fx.GraphModule, fake_args: list, kind: str) -> Callable:
        from fxopt.backends import lower, resolve_executor

        # training graphs too where generated kernels need concrete sizes (the cuda executor's)
        if self.options.dynamic_shapes and (kind == "inference" or resolve_executor(
                self.options.executor, self.device_type, kind) == "cuda"):
            from fxopt.dynamic import has_symbols

            if has_symbols(fake_args):  # one pipeline run, lowered per size (fxopt.dynamic)
                from fxopt.dynamic_compile import compile_symbolic

                compiled = compile_symbolic(self, gm, fake_args, kind)
                if compiled is not None:
                    return compiled
        t0 = time.perf_counter()
        ctx = self._context(gm, fake_args, kind)
        if ctx.mode == "training":
            self._link_training(ctx, gm, kind)
        before = copy_graph_module(gm)
        # how the convolutions measured now use cuDNN; measured choices written to the cache file once
        with cudnn_choosing(self.options.cudnn_search), deferred_writes():
            cache = CompileCache(gm, ctx, kind)  # an identical earlier compile's graph and choices
            optimized, records, fallback = cache.run(gm, ctx, fake_args, dump_prefix=f"{kind}_")
            ctx.unoptimized = before if fallback is None else None
            try:
                lowered = lower(optimized, ctx, kind)
            except Exception as e:  # noqa: BLE001 - lowering failures fall back too
                if self.options.strict:
                    raise PassFailure("lowering", f"{type(e).__name__}: {e}") from e
                warnings.warn(f"fxopt: lowering failed ({type(e).__name__}: {e}); running the unoptimized graph",
                              FxoptFallbackWarning, stacklevel=2)
                fallback = f"lowering failed: {type(e).__name__}: {e}"
                optimized, lowered = before, Lowered(fn=before, executor="torch", cudagraphs="off (fallback)",
                                                     fallback_reason=fallback)
            cache.store(optimized, records, fallback, ctx)
        compiled = lowered.fn
        if kind == "inference" and ctx.output_strides:  # what the kernels really give, as eager does
            compiled = with_eager_strides(compiled, self.eager_values)
        if kind == "forward":
            self.forward_runner = lowered.cudagraph_runner
        report = GraphReport(
            kind=kind, before=before, after=optimized, passes=records, conv_algorithms=dict(ctx.conv_algorithms),
            kernels=lowered.kernels, fallback=fallback, executor=lowered.executor, cudagraphs=lowered.cudagraphs,
            measurements=ctx.measurements, compile_ms=(time.perf_counter() - t0) * 1e3, lowered=lowered,
        )
        if kind != "inference":  # how AOTAutograd split the joint graph (fxopt.training)
            report.training = training_details(before, kind, self.partitioner)
        report.executor_details["compile_cache"] = cache.status
        if self.dynamic_fallback is not None:
            report.executor_details["dynamic"] = {"fallback": self.dynamic_fallback}
        return self.finish(gm, compiled, report, kind)

    def finish(self, gm: fx.GraphModule, compiled: Callable, report: GraphReport, kind: str) -> Callable:
        """The compiled graph as AOTAutograd takes it, its report handed on."""
        if kind == "inference" and self.options.direct_call:
            why = direct_call_blocker(gm, self.n_inputs)
            report.executor_details["aot_runtime_wrapper"] = why or "skipped (direct call)"
            eager = None if self.options.strict else self.eager
            self.direct = direct_call(compiled, eager, report) if why is None else None
        if self.sink is not None:
            self.sink.append(report)
        self.example_inputs = None if kind == "inference" else self.example_inputs
        return make_boxed_func(compiled)

    def _link_training(self, ctx: PassContext, gm: fx.GraphModule, kind: str) -> None:
        """The backward reads the forward's parameters under the same placeholder names
        (``primals_N``), and its CUDA-graph runner reads the values the forward's runner lent in
        place (``TrainingLink``): the forward's outputs before its saved values are what the caller
        sees (AOTAutograd's ``num_fwd_outputs``)."""
        from fxopt.backends.cuda.runtime.cudagraph_training import TrainingLink

        if kind == "forward":
            self.forward_params = set(ctx.param_placeholders)
            ctx.training_link = TrainingLink(num_fwd_outputs=self._num_fwd_outputs())
        else:
            names = {n.name for n in gm.graph.find_nodes(op="placeholder")}
            ctx.param_placeholders |= names & self.forward_params
            ctx.training_link = TrainingLink(forward=self.forward_runner)

    def _num_fwd_outputs(self) -> Optional[int]:
        if self.partitioner.num_fwd_outputs is not None:
            return self.partitioner.num_fwd_outputs
        from torch._guards import TracingContext

        meta = getattr(TracingContext.try_get(), "fw_metadata", None)
        return getattr(meta, "num_forward_returns", None)

    def inference(self, gm, args):
        return self.compile(gm, args, "inference")

    def forward(self, gm, args):
        return self.compile(gm, args, "forward")

    def backward(self, gm, args):
        return self.compile(gm, args, "backward")


def _autograd_graph(example_inputs: list) -> bool:
    """AOTAutograd's own test for a forward/backward pair rather than an inference graph: grad
    mode on and an input that requires grad (Dynamo compiles under the frame's grad mode)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def fxopt_backend(gm: fx.GraphModule, example_inputs: list, options=None, mode=None, _sink=None):
    """The Dynamo backend entry point (``backend="fxopt"``)."""
    from torch._dynamo.backends.common import aot_autograd

    opts = Options.from_any(options, ALL_PASS_NAMES)
    if mode not in (None, "default"):
        log.info("fxopt: torch.compile mode=%r is ignored; use options", mode)
    compiler = FxoptCompiler(opts, gm, example_inputs, sink=_sink)
    compiled = aot_autograd(
        fw_compiler=compiler.forward,
        bw_compiler=compiler.backward,
        inference_compiler=compiler.inference,
        partition_fn=compiler.partitioner,
        # training: buffers the model updates in place (BatchNorm's running statistics) are
        # written by the forward graph itself (aten.copy_ at its end, one CUDA-graph replay)
        # rather than returned, copied out and copied back by AOTAutograd's wrapper, two
        # launches per buffer per call; inference graphs keep them as outputs
        keep_inference_input_mutations=_autograd_graph(example_inputs),
    )(gm, example_inputs)
    return compiler.direct or compiled
