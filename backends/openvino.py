"""OpenVINO as one more way the cpu executor times per input signature (option ``cpu_openvino``).

Why: OpenVINO's CPU plugin compiles a whole network into one graph of its own kernels (depthwise
convolutions with their epilogues, no per-op Python dispatch, its own thread pool); at batch 1 that
is where the time between oneDNN calls goes. It is an optional extra (``pip install
fxopt[openvino]``): without it, or where it refuses a graph, the cpu executor runs as before.

What runs: the graph as AOTAutograd handed it (``ctx.unoptimized``: aten ops, the module's exact
semantics; the optimized graph where there is none), its parameters bound as constants, traced
and converted by ``openvino.convert_model`` and compiled for the CPU plugin per input signature
(``PERFORMANCE_HINT=LATENCY``, ``INFERENCE_NUM_THREADS`` = torch's thread count, and a second way with
one thread where torch has more: at a small graph's batch 1 the calling thread alone can beat a hand-off
to a worker). When a parameter changes in place (its version counter moves) or is replaced, the compiled
models are rebuilt.

Precision: ``INFERENCE_PRECISION_HINT=f32`` for a graph that computes in float32 (OpenVINO's
default on a CPU with bfloat16 units is bfloat16: never used to lower a float32 model's precision);
``bf16`` only where the graph itself computes in bfloat16 (a bfloat16 model, or casts to bfloat16
from ``torch.autocast``) and the CPU has bfloat16 units. The runner (``backends/cpu.py``) checks
the outputs against the reference before it may choose this way.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.engine_calls import bound_call, graph_outputs, restride
from fxopt.weights import ParamChanges, weights_key

MAX_MODELS = 8
#: outputs up to this many bytes in all are written into buffers shared once and copied out
OUT_BUFFER_BYTES = 1 << 18
#: torch dtypes OpenVINO tensors can share (bfloat16 by its bits)
_SHAREABLE = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool, torch.uint8,
              torch.int8)


def why_unavailable() -> Optional[str]:
    """None where ``import openvino`` works, else why not."""
    try:
        import openvino  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install
        return f"openvino is not importable ({type(e).__name__}: {str(e)[:120]}); pip install fxopt[openvino]"
    return None


def cpu_has_bf16() -> bool:
    """Whether OpenVINO's CPU plugin has bfloat16 arithmetic here (AVX512-BF16 or AMX)."""
    try:
        import openvino as ov

        return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except Exception:  # noqa: BLE001
        return False


def shared_tensor(t: torch.Tensor):
    """An ``openvino.Tensor`` on ``t``'s memory (contiguous ``t``; bfloat16 by its bits)."""
    import openvino as ov

    t = t.detach()  # numpy() refuses a tensor that requires grad; the same memory
    if t.dtype == torch.bfloat16:
        return ov.Tensor(t.view(torch.int16).numpy(), list(t.shape), ov.Type.bf16)
    return ov.Tensor(t.numpy(), shared_memory=True)


def compute_dtype(gm: fx.GraphModule) -> torch.dtype:
    """The lowest floating-point precision the graph computes in (bfloat16 / float16 where any value
    is; else float32 / float64)."""
    seen = set()
    for n in gm.graph.nodes:
        vals = n.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                seen.add(v.dtype)
    for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        if d in seen:
            return d
    return torch.float32


def precision_for(gm: fx.GraphModule) -> tuple[Optional[str], Optional[str]]:
    """(OpenVINO inference precision for ``gm``, None) or (None, why OpenVINO cannot run it)."""
    d = compute_dtype(gm)
    if d == torch.bfloat16:
        return ("bf16", None) if cpu_has_bf16() else ("f32", None)
    if d == torch.float32:
        return "f32", None
    return None, f"{d} graph (OpenVINO candidate: float32 and bfloat16 graphs)"


class _Bound(torch.nn.Module):
    """``gm`` with its parameter inputs bound: what ``openvino.convert_model`` traces."""

    def __init__(self, fn, n_args: int, params: dict):
        super().__init__()
        self.fn, self.n_args, self.params = fn, n_args, params

    def forward(self, *user):
        it = iter(user)
        args = [self.params[i] if i in self.params else next(it) for i in range(self.n_args)]
        out = self.fn(*args)
        return tuple(out) if isinstance(out, (list, tuple)) else out


class OvRunner:
    """The compiled callable: the graph's flat args in (parameters included), its outputs out, with
    one OpenVINO compiled model per signature of the user inputs. Conversion failures raise."""

    def __init__(self, gm: fx.GraphModule, param_indices, precision: str, max_models: int = MAX_MODELS,
                 watch: bool = True, threads: Optional[int] = None, conversions: Optional[dict] = None):
        """threads: ``INFERENCE_NUM_THREADS`` (default torch's thread count); conversions: an
        ``engine_calls.SharedBuilds`` shared with the other thread count's runner, so that a signature's
        graph is exported and converted once for both while the cpu executor's runner decides it."""
        from fxopt.backends import torch_ref

        self.gm, self.fn, self.precision, self.max_models = gm, torch_ref.lower(gm), precision, max_models
        self.threads, self.conversions = threads, conversions
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.n_args = len(placeholders)
        self.params = sorted(param_indices)
        self.user = [i for i in range(self.n_args) if i not in set(self.params)]
        self.out_type, self.out_vals, self.restride = graph_outputs(gm)
        self.models: OrderedDict = OrderedDict()
        # whether a weight changed since the last call (``watch`` False: the weights are fixed)
        self._params_changed = ParamChanges(self.params if watch else [])
        self.builds = 0
        self._last: Optional[tuple] = None  # (signature, request) of the previous call

    def _convert(self, args):
        import openvino as ov

        # dense copies: OpenVINO's converter read a bfloat16 constant that is a strided view (a package's
        # weights: slices of one blob, convolution filters channels_last) as if it were dense (relative
        # error 0.5 against the reference, caught by the runner's check); its constants are its own copies
        params = {i: args[i].detach().contiguous() if isinstance(args[i], torch.Tensor) else args[i]
                  for i in self.params}
        example = tuple(args[i] for i in self.user)
        with torch.no_grad():
            # torch.export keeps the aten ops (TorchScript tracing records some OpenVINO has no rule for)
            ep = torch.export.export(_Bound(self.fn, self.n_args, params), example, strict=False)
            ov_model = ov.convert_model(ep)
        # the exported program's inputs come out dynamic: this signature's shapes
        ov_model.reshape({port: ov.PartialShape(list(t.shape)) for port, t in zip(ov_model.inputs, example)})
        return ov_model

    def _compile(self, args):
        import openvino as ov

        if self.conversions is None:
            ov_model = self._convert(args)
        else:  # the other thread count's, where it converted these weights in this decision
            sig = tuple((tuple(args[i].shape), args[i].dtype) if isinstance(args[i], torch.Tensor) else args[i]
                        for i in self.user)
            ov_model = self.conversions.get(sig, weights_key(args, self.params), lambda: self._convert(args))
        cfg = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": self.threads or max(1, torch.get_num_threads()),
               "INFERENCE_PRECISION_HINT": self.precision}
        compiled = ov.Core().compile_model(ov_model, "CPU", cfg)
        self.builds += 1
        shapes = [tuple(int(d) for d in o.get_shape()) for o in compiled.outputs]
        return compiled.create_infer_request(), shapes

    def request(self, args) -> "_Request":
        if self._params_changed(args):  # a weight changed: every compiled model holds stale constants
            self.models.clear()
            self._last = None
        sig = tuple((a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in map(args.__getitem__, self.user))
        last = self._last
        if last is not None and last[0] == sig:  # the common case: the previous call's signature
            return last[1]
        req = self.models.get(sig)
        if req is None:
            req = self.models[sig] = _Request(*self._compile(args), self.out_vals)
            while len(self.models) > self.max_models:
                self.models.popitem(last=False)
        else:
            self.models.move_to_end(sig)
        self._last = (sig, req)  # one attribute: concurrent callers never see a pair of two calls
        return req

    def bound(self, args):
        """A call for the signature of ``args`` alone, for a caller that dispatches on signatures itself
        (``backends/cpu.CpuRunner``): the compiled model looked up once, not at every call (no
        signature per call). Watched weights are checked at every call: once one changed, the compiled
        models are dropped and the calls take ``__call__``, which compiles them again. It holds the
        request weakly: once evicted, its calls take ``__call__``."""
        positions = [i for i in self.user if isinstance(args[i], torch.Tensor)]
        changed = self._params_changed if self._params_changed.indices else None
        return bound_call(self.request(args), positions, self.out_vals, self.out_type, changed, self._drop, self)

    def _drop(self) -> None:
        self.models.clear()
        self._last = None

    def __call__(self, *args):
        req = self.request(args)
        # no per-call detach (an aten call): shared_tensor detaches where it binds a new input
        outs = req.run([t for t in map(args.__getitem__, self.user) if isinstance(t, torch.Tensor)])
        if self.restride:
            outs = [restride(t, v) for t, v in zip(outs, self.out_vals)]
        return self.out_type(outs) if self.out_type is not None else outs[0]


class _Request:
    """One compiled model's infer request, reused across calls. An input tensor is shared with
    OpenVINO again only when its address, shape or dtype moved (the ``openvino.Tensor`` keeps the
    torch tensor alive, so an unchanged address is the same memory). Small outputs
    (``OUT_BUFFER_BYTES`` in all) are written into torch buffers shared once and copied out (a few
    KB copy for less than sharing a new tensor), larger ones straight into new tensors shared per
    call. A lock keeps concurrent callers off the shared request and buffers."""

    def __init__(self, infer_request, shapes, out_vals):
        self.req, self.shapes = infer_request, shapes
        self.dtypes = [v.dtype for v in out_vals]
        self.bound: list = []
        self.lock = threading.Lock()
        nbytes = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                     for s, d in zip(shapes, self.dtypes))
        self.out_bufs = None
        if nbytes <= OUT_BUFFER_BYTES:
            self.out_bufs = [torch.empty(s, dtype=d) for s, d in zip(shapes, self.dtypes)]
            for k, t in enumerate(self.out_bufs):
                self.req.set_output_tensor(k, shared_tensor(t))

    def run(self, inputs: list) -> list:
        return self.run_fixed([t if t.is_contiguous() else t.contiguous() for t in inputs], fixed=False)

    def run_fixed(self, inputs: list, fixed: bool = True) -> list:
        """``run`` for dense inputs; ``fixed``: of this request's shapes and dtypes (checked by the
        caller), so that only their addresses are compared with the shared ones."""
        with self.lock:
            if len(self.bound) != len(inputs):
                self.bound = [None] * len(inputs)
            for k, t in enumerate(inputs):
                if fixed and self.bound[k] is not None and self.bound[k][0] == t.data_ptr():
                    continue
                key = (t.data_ptr(), t.shape, t.dtype)
                if self.bound[k] != key:
                    self.req.set_input_tensor(k, shared_tensor(t))
                    self.bound[k] = key
            if self.out_bufs is not None:
                self.req.infer()
                return [o.clone() for o in self.out_bufs]
            outs = [torch.empty(s, dtype=d) for s, d in zip(self.shapes, self.dtypes)]
            for k, t in enumerate(outs):
                self.req.set_output_tensor(k, shared_tensor(t))
            self.req.infer()
            return outs


def _symbolic(gm: fx.GraphModule) -> bool:
    """Whether an input of ``gm`` is a symbolic size or a tensor of symbolic sizes or strides."""
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and not all(
                isinstance(d, int) for d in (*v.shape, *v.stride()))):
            return True
    return False


def cpu_candidate(gm: fx.GraphModule, ctx, threads: Optional[int] = None, conversions=None):
    """(an :class:`OvRunner` of the graph as AOTAutograd handed it, None) for the cpu executor's
    runner to time per signature, or (None, why not): openvino missing, a dtype it has no
    candidate for, symbolic shapes or non-tensor outputs. ``threads`` / ``conversions``: see
    :class:`OvRunner`."""
    why = why_unavailable()
    if why:
        return None, why
    from fxopt.backends.lowering import placeholder_indices, unoptimized

    src = unoptimized(ctx)
    src = gm if src is None else src
    if _symbolic(src):  # the export would specialize nothing: it fails after export and conversion
        return None, "symbolic sizes (OpenVINO candidate: static graphs)"
    precision, why = precision_for(src)
    if why:
        return None, why
    out = next(n for n in src.graph.nodes if n.op == "output").args[0]
    outs = out if isinstance(out, (list, tuple)) else [out]
    if not outs or not all(isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)
                           and o.meta["val"].dtype in _SHAREABLE for o in outs):
        return None, "an output that is not a tensor of a dtype OpenVINO shares"
    return OvRunner(src, placeholder_indices(src, ctx.param_placeholders), precision,
                    watch=not ctx.fixed_weights, threads=threads, conversions=conversions), None
