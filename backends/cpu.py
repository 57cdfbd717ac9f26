"""The CPU executor: oneDNN's fused convolutions, and never slower than the unoptimized graph.

Why: on a CPU, ATen runs a convolution through oneDNN, re-laying out its weight on every call,
and then the bias, residual add and activation as separate passes over memory. oneDNN can do the
whole epilogue inside the convolution (post-ops) from a weight laid out once for its kernels:
PyTorch exposes that as ``torch.ops.mkldnn._convolution_pointwise`` (unary post-op) and its
``.binary`` variant (add, then the unary post-op), the path Inductor's CPU backend takes.

What it lowers: every ``fxopt::fused_conv`` node (already replaced by its reference by
``torch_ref.lower``) left at the ``direct`` algorithm whose input is a 4-D float32 / bfloat16 CPU
tensor and whose activation oneDNN has as a post-op. The node becomes a :class:`OneDnnConv`
submodule call. For a channels_last input it packs the weight
(``mkldnn._reorder_convolution_weight``) on its first call and packs again only when the weight
is replaced or changed in place (its version counter moved: optimizer step, ``load_state_dict``,
``copy_``); an NCHW input takes the weight as it is (a packed weight makes oneDNN write NHWC, and
eager gives NCHW: oneDNN lays the weight out per call, as ATen's convolution does), so it gains
the fused epilogue only. The layout pass puts conv-heavy graphs in channels_last for the packed
path. A residual runs as the
binary post-op (add, then ReLU or nothing: the unary post-ops oneDNN takes after a binary one)
in float32 when both are channels_last; otherwise (NCHW, other activations, bfloat16) the
convolution carries the bias and the add and activation follow as PyTorch ops.

Declined (kept as the reference, reason recorded): inputs whose memory format is ambiguous (both
NCHW- and NHWC-contiguous, e.g. 1x1 spatial), other ranks and dtypes, activations
without a post-op, non-direct algorithms (Winograd / FFT / GEMM chosen for the layer), a PyTorch
without ``torch.ops.mkldnn`` or with oneDNN disabled.

Max pools: a square pool whose stride is its kernel (no padding, floor mode, indices unread) with
at least ``POOL_BY_SLICES_MIN`` outputs runs as the maximum of its k*k strided slices: ATen's CPU
max pool computes the indices and runs far below memory speed (64x16x32x32 NCHW: 2.8 ms against
0.3 ms; channels_last 0.27 against 0.11 ms, 2 threads).

:class:`CpuRunner` keeps the CPU never slower than the unoptimized graph: for every new input
signature it times the optimized graph against the graph as AOTAutograd handed it (wall-clock
medians of rounds of bursts of calls, the first call of each burst not counted, more rounds where
the two fastest are close: :func:`burst_medians`; at the process's thread count) and runs the
faster one; the
baseline must win by more than ``margin``; after ``max_timed`` signatures (a varying batch size)
new ones run what most decisions chose. Decisions are kept in the autotuning cache (keyed by
both graphs' code, the signature and the CPU fingerprint, which holds the thread count) and
listed by ``decisions()``. A decision timed while another process held a core (an engine far slower
on all threads than on one: :func:`contended`) is timed once more; if it still is, this process runs
it but does not keep it for later ones (a compile's; a package's must carry one), and such a cached
decision is timed again (seedcnn2 b64 bfloat16, 2 vCPUs: the generated C took 8.0 ms a call on two
threads while it was decided, 0.9 ms since; one thread, 1.6 ms, was cached and ran in every later
process).
"""
from __future__ import annotations

import contextlib
import math
import operator
import time
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from fxopt.backends.cpu_timing import WAY_KEYS, burst_medians, contended
from fxopt.backends.engine_calls import SharedBuilds
from fxopt.lowered import Lowered
from fxopt.ops import apply_activation, fused_conv_ref

EXECUTOR = "cpu"
#: the generated C's kernels' version, in the key of the runner's cached decisions
GENERATED_C_VERSION = 4

#: fxopt activation -> (oneDNN post-op attr, algorithm); the float params pass through as scalars
POST_OPS = {
    "none": ("none", ""), "relu": ("relu", ""), "hardtanh": ("hardtanh", ""), "leaky_relu": ("leaky_relu", ""),
    "silu": ("swish", ""), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "hardswish": ("hardswish", ""),
    "hardsigmoid": ("hardsigmoid", ""), "sigmoid": ("sigmoid", ""), "tanh": ("tanh", ""),
}
DTYPES = (torch.float32, torch.bfloat16)
MAX_POOL = torch.ops.aten.max_pool2d_with_indices.default
# the overloads themselves: calling them skips the packet's overload resolution on every call
_CONV_POINTWISE = getattr(getattr(torch.ops.mkldnn, "_convolution_pointwise", None), "default", None)
_CONV_BINARY = getattr(getattr(torch.ops.mkldnn, "_convolution_pointwise", None), "binary", None)


def onednn_available() -> Optional[str]:
    """None when oneDNN's fused convolution can run here, else why not."""
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return "oneDNN not available or disabled"
    if _CONV_POINTWISE is None or _CONV_BINARY is None:
        return "this PyTorch has no mkldnn._convolution_pointwise"
    return None


def capabilities() -> dict:
    """What the cpu executor offers the passes (``fxopt.target.Target`` fields): NHWC pays for
    float32 / bfloat16 convolutions where oneDNN's fused convolution runs."""
    why = onednn_available()
    return {"cpu_channels_last": why, "cpu_channels_last_dtypes": DTYPES,
            "fused_ops": () if why else ("onednn_conv",)}


def decline_reason(node: fx.Node) -> Optional[str]:
    """Why the fused conv ``node`` stays the reference on the CPU (None: oneDNN runs it)."""
    x, w = node.args[0], node.args[1]
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    wv = w.meta.get("val") if isinstance(w, fx.Node) else None
    activation, algorithm = node.args[8], node.args[10]
    if xv is None or wv is None:
        return "no metadata"
    if algorithm != "direct":
        return f"algorithm {algorithm}"
    # meta: a package's stored value at one batch size (fxopt.package_batch), of a CPU graph
    if xv.device.type not in ("cpu", "meta") or xv.dim() != 4:
        return f"{xv.dim()}-D {xv.device.type} input"
    if xv.dtype not in DTYPES or wv.dtype != xv.dtype:
        return f"dtype {xv.dtype}"
    if xv.is_contiguous(memory_format=torch.channels_last) == xv.is_contiguous():
        return "input both (or neither) NCHW- and NHWC-contiguous"
    if activation not in POST_OPS:
        return f"activation {activation} has no oneDNN post-op"
    if dtype_unsupported(xv.dtype):
        return f"oneDNN has no {xv.dtype} here"
    return None


def dtype_unsupported(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _without_ints(sig: tuple) -> tuple:
    """A runner's call signature without the sizes passed as ints (``_cache_key``)."""
    return tuple(a for a in sig if type(a) is not int)


class OneDnnConv(torch.nn.Module):
    """One fused convolution as one oneDNN call, with its weight packed once (see the module doc)."""

    def __init__(self, stride, padding, dilation, groups: int, activation: str, act_params: Sequence[float],
                 nhwc: bool = True):
        super().__init__()
        self.nhwc = nhwc  # the input's memory format at compile time
        self.stride, self.padding, self.dilation = list(stride), list(padding), list(dilation)
        self.groups, self.activation, self.act_params = groups, activation, list(act_params)
        self.conv_args = (self.padding, self.stride, self.dilation, groups)  # oneDNN's argument order
        self.attr, self.algorithm = POST_OPS[activation]
        # after the binary add oneDNN fuses ReLU or nothing ("" = no unary post-op)
        self.binary_unary = {"relu": "relu", "none": ""}.get(activation)
        self._packed = None
        self._packed_for: Optional[tuple] = None  # (weight object id, data pointer, version)
        self.packs = 0  # how many times the weight was packed

    def packed_weight(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        state = (id(weight), weight.data_ptr(), weight._version)
        if state != self._packed_for:
            self._packed = torch.ops.mkldnn._reorder_convolution_weight(
                weight.detach(), self.padding, self.stride, self.dilation, self.groups, list(x.shape))
            self._packed_for, self.packs = state, self.packs + 1
        return self._packed

    def forward(self, x, weight, bias, residual):
        cl, nchw = x.is_contiguous(memory_format=torch.channels_last), x.is_contiguous()
        if cl == nchw or cl != self.nhwc:
            # the strides the compile saw changed (e.g. a size-1 dimension): the reference
            return fused_conv_ref(x, weight, bias, residual, self.stride, self.padding, self.dilation, self.groups,
                                  self.activation, self.act_params)
        # NCHW: the weight as it is (a packed one would make oneDNN write NHWC)
        w = self.packed_weight(x, weight) if cl else weight.contiguous()
        args = self.conv_args
        if residual is None:
            return _CONV_POINTWISE(x, w, bias, *args, self.attr, self.act_params,
                                                           self.algorithm)
        if cl and self.binary_unary is not None and x.dtype == torch.float32 and \
                residual.is_contiguous(memory_format=torch.channels_last) and residual.shape[0] == x.shape[0]:
            unary = self.binary_unary or None
            return _CONV_BINARY(
                x, residual, w, bias, *args, "add", 1.0, unary, [], None if unary is None else "")
        y = _CONV_POINTWISE(x, w, bias, *args, "none", [], "")
        return apply_activation(y + residual, self.activation, self.act_params)


def outputs_differ(got, ref, dtype: torch.dtype) -> Optional[str]:
    """None where every output of ``got`` has ``ref``'s shape and dtype, NaNs where ``ref`` has
    them, and a max-norm relative error (``fxopt.tolerances.relative_error``) within the rtol of
    ``dtype`` (the lowest precision the graph computes in), else what differs."""
    from fxopt.tolerances import tolerance, whole_tensors_differ

    rtol = tolerance(dtype)[0]
    why = whole_tensors_differ(list(got) if isinstance(got, (list, tuple)) else [got],
                               list(ref) if isinstance(ref, (list, tuple)) else [ref], lambda b: rtol)
    return None if why is None else f"{why} ({str(dtype).replace('torch.', '')})"


def _replace(graph: fx.Graph, node: fx.Node, op: str, target, args: tuple) -> None:
    """``node`` replaced by a new ``op`` node of ``target(*args)`` carrying its metadata."""
    with graph.inserting_before(node):
        new = graph.create_node(op, target, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _recompiled(gm: fx.GraphModule) -> fx.GraphModule:
    gm.graph.lint()
    gm.recompile()
    return gm


def lower_onednn(runnable: fx.GraphModule, info: dict) -> fx.GraphModule:
    """Replaces the fused convs oneDNN can run by :class:`OneDnnConv` calls, in place; records in
    ``info["onednn"]`` how many it took and why each other one stayed."""
    convs = [n for n in runnable.graph.nodes if n.op == "call_function" and n.target is fused_conv_ref]
    why_not = onednn_available()
    taken, declined = 0, {}
    for node in convs:
        reason = why_not or decline_reason(node)
        if reason is not None:
            declined[node.name] = reason
            continue
        x, w, b, r, stride, padding, dilation, groups, activation, act_params = node.args[:10]
        name = f"fxopt_onednn_{taken}"
        nhwc = node.args[0].meta["val"].is_contiguous(memory_format=torch.channels_last)
        runnable.add_submodule(name, OneDnnConv(stride, padding, dilation, groups, activation, act_params, nhwc))
        _replace(runnable.graph, node, "call_module", name, (x, w, b, r))
        taken += 1
    info["onednn"] = {"convs": taken, "declined": declined}
    return _recompiled(runnable) if taken else runnable


#: output elements from which a max pool runs as maxima of strided slices (below: ATen's kernel, one
#: call against k*k-1; at 1x6x14x14 ATen 9 us vs 18, at 64x6x14x14 ATen 390-800 us vs 93, 2 threads)
POOL_BY_SLICES_MIN = 16384


def max_pool_by_slices(x: torch.Tensor, k: int) -> torch.Tensor:
    """``max_pool2d(x, k, stride=k)`` as the elementwise maximum of the k*k strided slices of ``x``
    (no padding, floor mode). Same values (NaN propagates as in the pool) and the pool's memory
    format: ATen's CPU max pool computes indices nobody reads and runs far below memory speed."""
    h, w = (x.shape[2] // k) * k, (x.shape[3] // k) * k
    out = None
    for i in range(k):
        for j in range(k):
            s = x[:, :, i:h:k, j:w:k]
            out = s if out is None else torch.maximum(out, s)
    return out


def pool_decline_reason(node: fx.Node) -> Optional[str]:
    """Why a ``max_pool2d_with_indices`` stays ATen's on the CPU (None: maxima of slices)."""
    x = node.args[0]
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    kernel, stride = list(node.args[1]), list(node.args[2]) if len(node.args) > 2 and node.args[2] else []
    padding = node.args[3] if len(node.args) > 3 else 0
    dilation = node.args[4] if len(node.args) > 4 else 1
    ceil_mode = node.args[5] if len(node.args) > 5 else False
    if xv is None or xv.dim() != 4 or not xv.is_floating_point():
        return "not a 4-D floating-point input"
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        return "its indices are read"
    k = kernel * 2 if len(kernel) == 1 else kernel
    if k[0] != k[1] or (stride and list(stride) * (2 // len(stride)) != k):
        return "kernel not square or stride not the kernel"
    if any(p != 0 for p in ([padding] * 2 if isinstance(padding, int) else padding)) or ceil_mode or \
            any(d != 1 for d in ([dilation] * 2 if isinstance(dilation, int) else dilation)):
        return "padding, dilation or ceil mode"
    try:
        n_out = int(xv.shape[0]) * int(xv.shape[1]) * (int(xv.shape[2]) // k[0]) * (int(xv.shape[3]) // k[0])
    except (TypeError, ValueError):  # a symbolic size without a hint
        return "symbolic sizes"
    if n_out < POOL_BY_SLICES_MIN:
        return f"small ({n_out} outputs < {POOL_BY_SLICES_MIN}: ATen's kernel is faster)"
    return None


def lower_pools(runnable: fx.GraphModule, info: dict) -> fx.GraphModule:
    """Replaces large square max pools (stride = kernel, indices unread) by
    :func:`max_pool_by_slices`; records in ``info["pools"]`` how many and why each other stayed."""
    pools = [n for n in runnable.graph.nodes if n.op == "call_function" and n.target is MAX_POOL]
    taken, declined = 0, {}
    for node in pools:
        reason = pool_decline_reason(node)
        if reason is not None:
            declined[node.name] = reason
            continue
        k = list(node.args[1])[0]
        for user in list(node.users):  # the getitem [0] nodes
            _replace(runnable.graph, user, "call_function", max_pool_by_slices, (node.args[0], k))
        runnable.graph.erase_node(node)
        taken += 1
    info["pools"] = {"by_slices": taken, "declined": declined}
    return _recompiled(runnable) if taken else runnable


def lower_graph(gm: fx.GraphModule, ctx, kind: str) -> Lowered:
    """The cpu executor: oneDNN convolutions and sliced max pools, and the faster of the optimized
    and the unoptimized graph (and, with option ``cpu_onnxruntime``, the graph in ONNX Runtime)
    per input signature."""
    from fxopt.backends import torch_ref
    from fxopt.backends.lowering import decisions_cache, placeholder_indices, unoptimized, unoptimized_baseline

    if kind != "inference" or ctx.device_type != "cpu":
        raise ValueError(f"fxopt: the cpu executor runs CPU inference graphs, not a {ctx.device_type} {kind} graph")
    details: dict = {}
    runnable = lower_pools(lower_onednn(torch_ref.lower(gm), details), details)
    baseline = unoptimized_baseline(gm, ctx)
    ort, ort1, why = None, None, "option cpu_onnxruntime=False"
    shared: list = []  # each engine's builds shared by its two thread counts while a signature is decided
    if ctx.options.cpu_onnxruntime:
        from fxopt.backends.onnxrt import cpu_candidate

        exports = SharedBuilds()  # one ONNX export per signature for both thread counts
        shared.append(exports)
        ort, why = cpu_candidate(gm, ctx, exports=exports)
        if ort is not None and torch.get_num_threads() > 1:
            ort1 = cpu_candidate(gm, ctx, threads=1, exports=exports)[0]
    details["onnxruntime_candidate"] = "timed per signature" if ort is not None else f"none ({why})"
    ov, ov1, why = None, None, "option cpu_openvino=False"
    if ctx.options.cpu_openvino:
        from fxopt.backends import openvino

        conversions = SharedBuilds()  # one export and conversion per signature for both thread counts
        shared.append(conversions)
        ov, why = openvino.cpu_candidate(gm, ctx, conversions=conversions)
        if ov is not None and torch.get_num_threads() > 1:
            ov1 = openvino.cpu_candidate(gm, ctx, threads=1, conversions=conversions)[0]
    details["openvino_candidate"] = (f"timed per signature (inference precision {ov.precision})" if ov is not None
                                     else f"none ({why})")
    gen, gen1, why = None, None, "option cpu_generated_c=False"
    if ctx.options.cpu_generated_c:
        from fxopt.backends import cpu_c

        gen, why = cpu_c.cpu_candidate(gm, ctx)
        if gen is not None and torch.get_num_threads() > 1:
            gen1 = cpu_c.cpu_candidate(gm, ctx, threads=1)[0]
    details["generated_c_candidate"] = "timed per signature" if gen is not None else f"none ({why})"
    from fxopt.backends.openvino import compute_dtype

    runner = CpuRunner(runnable, baseline, placeholder_indices(gm, ctx.param_placeholders),
                       decisions_cache=decisions_cache(ctx, runnable, baseline, "cpu"), onnxruntime=ort,
                       onnxruntime_1t=ort1, rounds=3, steady=bool(ctx.package),
                       openvino=ov, openvino_1t=ov1, check_dtype=compute_dtype(unoptimized(ctx) or gm),
                       shared_builds=shared, generated_c=gen, generated_c_1t=gen1)
    # the runner's decisions() say, per signature, which graph runs and the times
    return Lowered(fn=runner, executor=EXECUTOR, cudagraphs="off (CPU)", cpu_runner=runner,
                   baseline_check=baseline is not None, details=details)


class CpuRunner:
    """Runs the optimized graph, or whichever alternative (the unoptimized graph, the graph in an
    ONNX Runtime session) measures faster for a signature."""

    #: the ways a signature can run: decision name -> timing key
    KEYS = WAY_KEYS

    def __init__(self, fn: Callable, baseline: Optional[Callable], static_indices: Sequence[int],
                 decisions_cache: Optional[tuple] = None, margin: float = 0.03, rounds: int = 3, close: float = 0.1,
                 max_timed: int = 8, onnxruntime: Optional[Callable] = None, openvino: Optional[Callable] = None,
                 check_dtype: torch.dtype = torch.float32, onnxruntime_1t: Optional[Callable] = None,
                 steady: bool = False, openvino_1t: Optional[Callable] = None, shared_builds: Sequence = (),
                 generated_c: Optional[Callable] = None, generated_c_1t: Optional[Callable] = None):
        """fn / baseline: the optimized and unoptimized graphs (same arguments); onnxruntime: the
        optimized graph in ONNX Runtime (same arguments), or None; static_indices: the parameter
        inputs (not part of the signature); decisions_cache: (AutotuneCache, device, code hash) or
        None; max_timed: signatures timed at most (a varying batch size would pay the timing calls
        for every new size); later ones run the way most decisions chose. An alternative must be
        faster than the optimized graph by more than ``margin``; openvino: the graph compiled by
        OpenVINO (same arguments), or None. ONNX Runtime and OpenVINO must first give the reference's
        outputs (the baseline graph's, else the optimized graph's) within the tolerance of
        ``check_dtype`` (the lowest precision the graph computes in), or they are left out.
        onnxruntime_1t / openvino_1t: the ONNX Runtime / OpenVINO way with one thread (no hand-off), or None.
        rounds / close / steady: see :func:`burst_medians` (steady: a package's decisions, which stand
        for every later load, timed in bursts long enough for each way to run as a stream of calls does).
        shared_builds: ``engine_calls.SharedBuilds`` of the engines' ways, open while a signature is
        decided (its ways built, timed, checked) and emptied after. generated_c / generated_c_1t: the
        graph as one generated C function (``backends/cpu_c.py``) on torch's threads / on the
        calling thread alone, or None."""
        self.fn, self.baseline, self.onnxruntime, self.openvino = fn, baseline, onnxruntime, openvino
        self.onnxruntime_1t, self.openvino_1t = onnxruntime_1t, openvino_1t
        self.generated_c, self.generated_c_1t = generated_c, generated_c_1t
        self.check_dtype = check_dtype
        self.margin, self.rounds, self.max_timed, self.close = margin, rounds, max_timed, close
        self.steady = steady
        self.shared_builds = list(shared_builds)
        self.static = set(static_indices)
        self._dynamic: Optional[list] = None  # the indices of the other arguments, from the first call
        self.decisions_cache = decisions_cache
        self._chosen: dict = {}  # signature -> the function that runs it
        self._decisions: dict = {}  # signature -> timings and which runs

    @property
    def ways(self) -> dict:
        """The ways a signature can run, by decision name (the optimized graph first)."""
        ways = {"optimized graph": self.fn, "baseline graph": self.baseline, "onnxruntime": self.onnxruntime,
                "onnxruntime 1 thread": self.onnxruntime_1t, "openvino": self.openvino,
                "openvino 1 thread": self.openvino_1t, "generated C": self.generated_c,
                "generated C 1 thread": self.generated_c_1t}
        return {k: v for k, v in ways.items() if v is not None}

    def _signature(self, args) -> tuple:
        if self._dynamic is None:
            self._dynamic = [i for i in range(len(args)) if i not in self.static]
        return tuple((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                     for a in map(args.__getitem__, self._dynamic))

    def __call__(self, *args):
        sig = self._signature(args)
        fn = self._chosen.get(sig)
        if fn is not None:
            return fn(*args)
        return self._decide(sig, args)

    def chosen_call(self, args) -> Optional[Callable]:
        """The call chosen for the signature of ``args`` (None before its first call), for a caller
        that dispatches on its inputs' kind itself (``fxopt.packaging.PackagedModule``)."""
        return self._chosen.get(self._signature(args))

    def _cache_key(self, sig) -> Optional[str]:
        if self.decisions_cache is None:
            return None
        # decisions timed by burst_medians and chosen by _choose (those of single alternating calls, which a
        # loaded host could get wrong, are not reused; nor those before OpenVINO got dense weights, "ov2", or
        # before ONNX Runtime's workers spun 40 us after a run, "ortspin40", or before OpenVINO had a way with
        # one thread, "ov1t", or before a compile's bursts left out BURST_WARM_MS of each way's calls, "warm10"); a
        # package's steady bursts are kept apart from a compile's short ones
        from fxopt.choices import cpu_runner_key

        kind = "steady-bursts-ov2-ortspin40-ov1t" if self.steady else "bursts-ties2-ov2-ortspin40-ov1t-warm10"
        if self.generated_c is not None:  # decisions of an earlier generated C (other kernels) are not reused
            kind += f"-genc{GENERATED_C_VERSION}"
        # (sizes passed as ints, a symbolic graph's, left out: the tensors' shapes hold them, and a graph with
        # more sizes symbolic asks the same decision; fxopt.dynamic_buckets)
        return cpu_runner_key(kind, self.decisions_cache[2], self.ways, _without_ints(sig))

    def _decide(self, sig, args):
        with contextlib.ExitStack() as stack:
            for shared in self.shared_builds:
                stack.enter_context(shared.deciding())
            return self._decide_open(sig, args)

    def _decide_open(self, sig, args):
        if len(self.ways) == 1:
            self._chosen[sig] = self.fn
            self._decisions[sig] = {"runs": "optimized graph", "why": "no alternative"}
            return self.fn(*args)
        key = self._cache_key(sig)
        cached = self.decisions_cache[0].get(self.decisions_cache[1], key) if key else None
        timed = [d["runs"] for d in self._decisions.values() if "optimized_ms" in d]
        if cached is not None and not self.steady and contended(cached):  # timed in a busy moment: again
            cached = None
        if cached is not None and cached.get("runs") in self.ways:
            self._decisions[sig] = dict(cached, cached=True)
            if cached.get("not_measured"):  # another signature's way (a package's other size): checked here once
                self._decisions[sig].update(self._checked(cached["runs"], args))
        elif len(timed) >= self.max_timed:
            runs = max(self.ways, key=timed.count)  # a tie: the optimized graph (first)
            self._decisions[sig] = {"runs": runs, "why": f"{len(timed)} signatures timed already: the majority"}
            self._decisions[sig].update(self._checked(runs, args))
        else:
            decision = self._measure(args)
            why = contended(decision)
            if why:  # a moment when another process held a core: timed once more
                decision = dict(self._measure(args), contended_first=why)
                why = contended(decision)
            self._decisions[sig] = decision
            if why and not self.steady:  # this process runs it; a later one times the signature again
                decision["not_cached"] = f"timed while another process held a core: {why}"
            elif key:
                self.decisions_cache[0].put(self.decisions_cache[1], key, dict(decision))
        way = self.ways[self._decisions[sig]["runs"]]
        bound = getattr(way, "bound", None)  # ONNX Runtime's session of this signature, looked up once
        self._chosen[sig] = (bound(args) if bound is not None else None) or way
        return self._chosen[sig](*args)

    def _checked(self, runs: str, args) -> dict:
        """``{}`` where the way ``runs`` gives the optimized graph's outputs for ``args`` within the
        tolerance (ONNX Runtime and OpenVINO must, as in :meth:`_measure`), else the optimized graph
        instead, with why."""
        if runs in ("optimized graph", "baseline graph"):
            return {}
        try:
            wrong = outputs_differ(self.ways[runs](*args), self.fn(*args), self.check_dtype)
        except Exception as e:  # noqa: BLE001 - the way failed at this signature
            wrong = f"{type(e).__name__}: {str(e)[:200]}"
        return {} if not wrong else {"runs": "optimized graph", "failed": {runs: wrong}}

    def _measure(self, args) -> dict:
        """Every way's wall-clock median (:func:`burst_medians`, after two warm-up calls each: folded
        constants, packed weights, primitives, ONNX Runtime's session, OpenVINO's compiled model);
        the fastest runs. A way that fails (export, conversion, session creation) or whose outputs
        differ from the reference's beyond the tolerance is left out, with the reason."""
        fns, failed, reference, first_ms = {}, {}, None, {}
        ways = self.ways
        order = [n for n in ("baseline graph", "optimized graph") if n in ways] + \
            [n for n in ways if n not in ("baseline graph", "optimized graph")]
        for name, way in ((n, ways[n]) for n in order):
            try:
                out = way(*args)
                if name in ("baseline graph", "optimized graph") and reference is None:
                    reference = out
                elif name not in ("baseline graph", "optimized graph"):
                    wrong = outputs_differ(out, reference, self.check_dtype)
                    if wrong:
                        raise ValueError(f"outputs differ from the reference: {wrong}")
                bound = getattr(way, "bound", None)  # timed as it would run: ONNX Runtime's session looked up once
                call = (bound(args) if bound is not None else None) or way
                t0 = time.perf_counter()
                call(*args)
                first_ms[self.KEYS[name]] = (time.perf_counter() - t0) * 1e3
                fns[self.KEYS[name]] = (lambda w=call: w(*args))
            except Exception as e:  # noqa: BLE001 - only the optimized graph must run
                if name == "optimized graph":
                    raise
                failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
        timings, rounds = burst_medians(fns, first_ms, self.rounds, self.close, steady=self.steady)
        return {"runs": self._choose(timings), **timings, "rounds": rounds, "threads": torch.get_num_threads(),
                **({"steady": True} if self.steady else {}), **({"failed": failed} if failed else {})}

    def _choose(self, timings: dict) -> str:
        """The way that runs: the baseline graph where it beats the optimized graph by more than
        ``margin`` (and ONNX Runtime with one thread where it beats ONNX Runtime with all by more
        than ``margin``, OpenVINO's the same); then ONNX Runtime / OpenVINO where faster by more than
        ``margin`` than that one, or, with more than one thread, where no slower than it by more than ``margin``: their
        thread pools let the calling thread take the work of a worker that another process holds
        off its core, where the torch graphs' OpenMP regions wait for it (on a loaded 2-core host
        measured 1.7 ms -> 10-70 ms per call for a tie of 1.69 ms at the first call)."""
        runs, ms = "optimized graph", timings["optimized_ms"]
        if timings.get("baseline_ms", math.inf) < ms * (1.0 - self.margin):
            runs, ms = "baseline graph", timings["baseline_ms"]
        runtimes = {n: timings[self.KEYS[n]] for n in ("onnxruntime", "onnxruntime 1 thread", "openvino",
                                                        "openvino 1 thread", "generated C", "generated C 1 thread")
                    if self.KEYS[n] in timings}
        for many in ("onnxruntime", "openvino", "generated C"):
            one = f"{many} 1 thread"
            if many in runtimes and runtimes.get(one, 0.0) >= runtimes[many] * (1.0 - self.margin):
                # one thread must win by the margin: a tie on a loaded host turns 2x slower when it is quiet
                del runtimes[one]
        generated = {n: runtimes.pop(n) for n in ("generated C", "generated C 1 thread") if n in runtimes}
        best = min(runtimes, key=runtimes.get, default=None)
        slack = (1.0 + self.margin) if torch.get_num_threads() > 1 else (1.0 - self.margin)
        if best is not None and runtimes[best] < ms * slack:
            runs, ms = best, runtimes[best]
        # the generated C shares its work out on torch's OpenMP threads (as the torch graphs do): it must
        # win by the margin
        best = min(generated, key=generated.get, default=None)
        if best is not None and generated[best] < ms * (1.0 - self.margin):
            runs = best
        return runs

    def decisions(self) -> list[dict]:
        """Per input signature seen: the measured times and which graph runs."""
        return [dict(d) for d in self._decisions.values()]
