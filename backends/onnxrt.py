"""The ``onnxruntime`` executor: the optimized inference graph in an ONNX Runtime session (and, on
the CPU, ``cpu_candidate``: the same as one more way the cpu executor times per signature).

``options={"executor": "onnxruntime"}``. For each input signature (shapes, dtypes, devices of the
user inputs) the optimized graph is translated to ONNX (``fxopt.onnx_graph.graph_to_onnx``, static
shapes) with the current parameter values and folded constants as initializers, and an
``InferenceSession`` is created (at most ``MAX_SESSIONS``, least recently used dropped).

- CUDA inputs and ``CUDAExecutionProvider`` available: the CUDA EP with IO binding on the torch
  tensors (no host copies), outputs allocated by torch; with ``cudagraphs`` not False, ORT's own
  CUDA graph (``enable_cuda_graph``) is captured per signature, inputs copied into static buffers.
  Where the layout pass put the graph's convolutions in channels_last (fxopt's judgement that NHWC
  convolutions are the fast ones here), the session gets ``prefer_nhwc`` too, so ORT's CUDA EP runs
  its convolutions in NHWC (the ONNX graph itself stays NCHW, as ONNX requires); a build without
  NHWC kernels ignores the option. ``Lowered.details["onnxruntime_nhwc"]`` records it.
  ORT runs on torch's current stream of session creation (``user_compute_stream``); a call made
  on another stream is ordered with it by stream waits, never by a host synchronization.
- CPU inputs: the CPU EP (``intra_op_num_threads`` = ``torch.get_num_threads()``), through one IO
  binding per session kept across calls (``_Session._run_cpu_bound``: torch tensors' memory bound
  as it is, no numpy arrays; a concurrent second caller takes ``InferenceSession.run``).
- Parameters are initializers, not inputs: when one changes in place (its ``_version`` moves:
  optimizer step, ``load_state_dict``, ``copy_``) or is replaced, every session is rebuilt.

Falls back to the torch executor (``Lowered.executor`` and ``fallback_reason`` say so, and why): training graphs; ops
without an ONNX translation (``strict=True`` raises ``UnsupportedOpError``); CUDA inputs without the
CUDA EP, onnxruntime missing, bfloat16 values (one warning each).
"""
from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends import torch_ref
from fxopt.backends.engine_calls import any_strided, bound_call, restride
from fxopt.lowered import Lowered
from fxopt.weights import ParamChanges, weights_key

MAX_SESSIONS = 8
#: CPU outputs up to this many bytes in all are written into buffers bound once and copied out
CPU_OUT_BUFFER_BYTES = 1 << 18
#: microseconds the CPU EP's workers spin after each operator before sleeping (``cpu_candidate``)
CPU_SPIN_US = 40
_WARNED: set = set()


def _warn_once(key: str, message: str) -> None:
    from fxopt.pipeline import FxoptFallbackWarning

    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, FxoptFallbackWarning, stacklevel=4)


def _torch_executor(gm: fx.GraphModule, reason: str) -> Lowered:
    return Lowered(fn=torch_ref.lower(gm), executor=f"torch (onnxruntime not used: {reason})",
                   cudagraphs="off (onnxruntime executor fell back)", fallback_reason=reason)


def _np_dtypes():
    import numpy as np

    return {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
            torch.int64: np.int64, torch.int32: np.int32, torch.int8: np.int8, torch.uint8: np.uint8,
            torch.bool: np.bool_}


_NP = _np_dtypes()


def _unbindable_dtype(gm: fx.GraphModule):
    """A value whose dtype has no NumPy / IO-binding type (bfloat16...), or None."""
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op in ("placeholder", "output") or not isinstance(v, torch.Tensor):
            continue
        if v.dtype not in _NP:
            return f"{n.name} is {v.dtype}"
    return None


def wants_nhwc(gm: fx.GraphModule) -> bool:
    """True when the layout pass ran the graph's 2-D convolutions in channels_last."""
    from fxopt.ops import FUSED_CONV
    from fxopt.names import CL, format_of

    outs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "call_function" and n.target == FUSED_CONV]
    outs = [v for v in outs if isinstance(v, torch.Tensor) and v.dim() == 4]
    return bool(outs) and all(format_of(v) == CL for v in outs)


def lower_graph(gm: fx.GraphModule, ctx, kind: str) -> Lowered:
    """`gm` running in ONNX Runtime, or the torch executor where it cannot."""
    if kind != "inference":
        return _torch_executor(gm, f"{kind} graph; the onnxruntime executor runs inference graphs only")
    reason = _why_not(gm, ctx, strict=ctx.options.strict)
    cuda = ctx.device_type == "cuda"
    if not reason and cuda:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            reason = f"inputs are on CUDA but onnxruntime has no CUDAExecutionProvider ({ort.get_available_providers()})"
    if reason:
        _warn_once(reason, f"fxopt: executor 'onnxruntime': {reason}; using the torch executor")
        return _torch_executor(gm, reason)
    provider = "CUDAExecutionProvider" if cuda else "CPUExecutionProvider"
    cuda_graph = cuda and ctx.options.cudagraphs is not False
    nhwc = cuda and wants_nhwc(gm)
    runner = OrtRunner(gm, ctx.param_placeholders, ctx.param_qualnames, provider, cuda_graph, nhwc=nhwc)
    examples = ctx.example_inputs
    if examples is not None and all(isinstance(a, (torch.Tensor, int)) for a in examples):
        # build the first session now: failures show at compile time
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        try:
            with unset_fake_temporarily():
                entry = runner.entry(list(examples))
            provider, cuda_graph, nhwc = entry.sess.get_providers()[0], entry.cuda_graph, entry.nhwc
        except Exception as e:  # noqa: BLE001 - export or session creation: the torch executor runs it
            if ctx.options.strict:
                raise
            reason = f"{type(e).__name__}: {e}"
            _warn_once(reason, f"fxopt: executor 'onnxruntime': {reason}; using the torch executor")
            return _torch_executor(gm, reason)
    cudagraphs = ("on (onnxruntime CUDA graph per input signature)" if cuda_graph else
                  "off (inputs are not on CUDA)" if not cuda else "off (option cudagraphs=False)"
                  if ctx.options.cudagraphs is False else "off (onnxruntime could not capture this graph)")
    return Lowered(fn=runner, executor=f"onnxruntime ({provider})", cudagraphs=cudagraphs,
                   details={"onnxruntime_nhwc": nhwc})


def _why_not(gm: fx.GraphModule, ctx, strict: bool) -> Optional[str]:
    """Why ``gm`` cannot run in ONNX Runtime here (onnxruntime missing, an op without an ONNX
    translation, a dtype without an onnxruntime binding), or None; ``strict`` raises for an op."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as e:
        return f"onnxruntime is not importable: {e}"
    from fxopt.onnx_common import UnsupportedOpError
    from fxopt.onnx_graph import find_unsupported

    bad = find_unsupported(gm, ctx.param_placeholders)
    if bad:
        err = UnsupportedOpError(bad[0][1], bad[0][0], "no ONNX translation")
        if strict:
            raise err
        return str(err)
    odd = _unbindable_dtype(gm)
    return f"dtype without an onnxruntime binding here: {odd}" if odd else None


def cpu_candidate(gm: fx.GraphModule, ctx, threads: Optional[int] = None, exports=None):
    """(the optimized CPU inference graph in ONNX Runtime sessions, None) as one more way for the
    cpu executor's runner to time per signature, or (None, why not). Its workers spin between the
    operators of a run and for ``CPU_SPIN_US`` after each (``session.intra_op.spin_duration_us``):
    a pool left spinning at ORT's default slows the process's next CPU work (2 EPYC vCPUs, ONNX
    Runtime 1.31.1, a 128x128 matmul of 26 us after each seedcnn batch-1 run: 147-153 us the pair),
    one stopped when a run returns (``session.force_spinning_stop``) wakes its workers at the next
    run (seedcnn batch 1: 38 us a run against 28 spinning), one that never spins hands each
    operator to sleeping workers (seedcnn batch 64: 1.24 ms against 1.02). The spin must outlast
    the caller's own work between two calls: at 10 us a run 3-20 us after the previous one took
    37-46 us (a package's call spends 4-10 us of Python around the run), at 40 us 28 (the pair with
    the matmul 88-95 us, 73-81 at 10 us). Export failures raise (the runner
    then leaves it out). ``threads``: its intra-op threads (default torch's thread count; 1: the
    calling thread alone, no hand-off to a worker, which at a small graph's batch 1 can be the
    faster). ``exports``: an ``engine_calls.SharedBuilds`` shared with the other thread count's
    candidate, so that a signature's graph is exported to ONNX once for both while the cpu executor's
    runner decides it (vgg11_bn at 64x64: 2.7 s an export)."""
    why = _why_not(gm, ctx, strict=False)
    if why:
        return None, why
    return OrtRunner(gm, ctx.param_placeholders, ctx.param_qualnames, "CPUExecutionProvider", False,
                     spin="short", fallback=False, threads=threads, watch=not ctx.fixed_weights, exports=exports), None


def _matches(v, a) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(v, torch.Tensor) and all(type(s) is int for s in v.shape)
                and tuple(v.shape) == tuple(a.shape) and v.dtype == a.dtype)
    return type(v) is type(a) and v == a


def specialize(gm: fx.GraphModule, args: list) -> fx.GraphModule:
    """`gm`, or a copy whose meta['val'] has the concrete shapes of `args` (dynamic-shape graphs)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if all(_matches(p.meta.get("val"), a) for p, a in zip(placeholders, args)):
        return gm
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from fxopt.pipeline import copy_graph_module

    g = copy_graph_module(gm)
    for n in g.graph.nodes:
        n.meta = dict(n.meta)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        FakeTensorProp(g, mode).propagate_dont_convert_inputs(*fakes)
    return g


def export_signature(gm, args, params) -> tuple:
    """(the graph specialized to ``args`` as a serialized ONNX model, its output values)."""
    from fxopt.onnx_graph import graph_to_onnx

    g = specialize(gm, args)
    proto = graph_to_onnx(g, args, params, dynamic_batch=False)
    out = next(n for n in g.graph.nodes if n.op == "output").args[0]
    return proto.SerializeToString(), [o.meta["val"] for o in (out if isinstance(out, (list, tuple)) else [out])]


class _Session:
    """One ORT session for one input signature."""

    def __init__(self, gm, args, params, provider, cuda_graph, nhwc=False, spin=True, threads=None,
                 export: Optional[tuple] = None):
        """export: (serialized ONNX model, output values) of this signature, exported already."""
        import onnxruntime as ort

        if export is None:
            export = export_signature(gm, args, params)
        data, self.out_vals = export
        self.restride = any_strided(self.out_vals)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"),
                           torch.device("cpu"))
        if provider == "CPUExecutionProvider":
            opts.intra_op_num_threads = threads or max(1, torch.get_num_threads())
            if not spin:  # idle workers sleep: the process's other CPU work keeps its cores
                opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
                opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
            elif spin == "short":  # workers spin between a run's operators and briefly after it
                opts.add_session_config_entry("session.intra_op.spin_duration_us", str(CPU_SPIN_US))
            providers = [provider]
        else:
            # ORT enqueues its kernels on torch's current stream: ordered with the torch work that
            # produced the inputs and reads the outputs, with no host synchronization
            self.stream = torch.cuda.current_stream(self.device)
            popts = {"device_id": str(self.device.index or 0), "user_compute_stream": str(self.stream.cuda_stream)}
            if cuda_graph:
                popts["enable_cuda_graph"] = "1"
            if nhwc:
                popts["prefer_nhwc"] = "1"
            providers = [(provider, popts)]
        self.sess = None
        while self.sess is None:
            try:
                self.sess = ort.InferenceSession(data, opts, providers=providers)
            except Exception:  # noqa: BLE001 - drop the optional settings one at a time, then give up
                # a CUDA graph needs every node on the CUDA EP; NHWC kernels are a build option
                extra = [k for k in ("prefer_nhwc", "enable_cuda_graph")
                         if provider != "CPUExecutionProvider" and k in providers[0][1]]
                if not extra:
                    raise
                providers = [(provider, {k: v for k, v in providers[0][1].items() if k != extra[0]})]
        if provider != "CPUExecutionProvider":
            cuda_graph = "enable_cuda_graph" in providers[0][1]
            nhwc = "prefer_nhwc" in providers[0][1]
        self.nhwc = nhwc
        self.cuda = provider == "CUDAExecutionProvider"
        if self.cuda and "CUDAExecutionProvider" not in self.sess.get_providers():
            raise RuntimeError(f"onnxruntime created no CUDA session (providers {self.sess.get_providers()})")
        self.cuda_graph = cuda_graph
        self.in_names = [i.name for i in self.sess.get_inputs()]
        self.out_names = [o.name for o in self.sess.get_outputs()]
        self.binding = None
        self._cpu_binding, self._cpu_lock = None, threading.Lock()

    def _bind(self, inputs, outputs):
        b = self.sess.io_binding()
        idx = self.device.index or 0
        for name, t in list(zip(self.in_names, inputs)):
            b.bind_input(name, "cuda", idx, _NP[t.dtype], tuple(t.shape), t.data_ptr())
        for name, t in zip(self.out_names, outputs):
            b.bind_output(name, "cuda", idx, _NP[t.dtype], tuple(t.shape), t.data_ptr())
        return b

    def run(self, inputs: list) -> list:
        if not self.cuda:  # read through their addresses: no autograd, no detached copies per call
            inputs = [t if t.is_contiguous() else t.contiguous() for t in inputs]
            if self._cpu_lock.acquire(blocking=False):  # another thread inside: the numpy way
                try:
                    return self._run_cpu_bound(inputs)
                finally:
                    self._cpu_lock.release()
            feeds = {n: t.detach().numpy() for n, t in zip(self.in_names, inputs)}
            return [torch.from_numpy(o) for o in self.sess.run(self.out_names, feeds)]
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):  # the stream ORT was given
            if current != self.stream:
                self.stream.wait_stream(current)
            outs = self._run_on_stream([t.detach().contiguous() for t in inputs])
        if current != self.stream:
            current.wait_stream(self.stream)
            for t in outs:
                t.record_stream(current)
        return outs

    def run_fixed(self, inputs: list) -> list:
        """``run`` for dense inputs of this session's shapes, dtypes and device (the caller checked
        them): on the CPU only their addresses are compared with the bound ones."""
        if self.cuda or not self._cpu_lock.acquire(blocking=False):  # (another thread inside)
            return self.run(inputs)
        try:
            return self._run_cpu_bound(inputs, fixed=True)
        finally:
            self._cpu_lock.release()

    def _run_cpu_bound(self, inputs: list, fixed: bool = False) -> list:
        """The CPU EP through one IO binding kept across calls: an input is bound again only when its
        address, shape or dtype moved; small outputs (``CPU_OUT_BUFFER_BYTES`` in all) are written
        into buffers bound once and copied out (a copy of a few KB costs less than binding), larger
        ones straight into new tensors bound per call. No numpy arrays, no ORT-allocated outputs.
        ``fixed``: the inputs' shapes and dtypes are this session's (checked by the caller)."""
        b = self._cpu_binding
        if b is None:
            b = self._cpu_binding = self.sess.io_binding()
            self._bound = [None] * len(self.in_names)
            nbytes = sum(v.numel() * v.element_size() for v in self.out_vals)
            self._out_bufs = None
            if nbytes <= CPU_OUT_BUFFER_BYTES:
                self._out_bufs = [torch.empty(v.shape, dtype=v.dtype) for v in self.out_vals]
                for name, t in zip(self.out_names, self._out_bufs):
                    b.bind_output(name, "cpu", 0, _NP[t.dtype], tuple(t.shape), t.data_ptr())
        for k, (name, t) in enumerate(zip(self.in_names, inputs)):
            if fixed and self._bound[k] is not None and self._bound[k][0] == t.data_ptr():
                continue
            key = (t.data_ptr(), t.shape, t.dtype)
            if self._bound[k] != key:
                b.bind_input(name, "cpu", 0, _NP[t.dtype], tuple(t.shape), t.data_ptr())
                self._bound[k] = key
        if self._out_bufs is not None:
            self.sess.run_with_iobinding(b)
            return [o.clone() for o in self._out_bufs]
        outs = [torch.empty(v.shape, dtype=v.dtype) for v in self.out_vals]
        for name, t in zip(self.out_names, outs):
            b.bind_output(name, "cpu", 0, _NP[t.dtype], tuple(t.shape), t.data_ptr())
        self.sess.run_with_iobinding(b)
        return outs

    def _run_on_stream(self, inputs: list) -> list:
        if self.cuda_graph:  # fixed addresses: static input and output buffers, bound once
            if self.binding is None:
                self.static_in = [t.clone() for t in inputs]
                self.static_out = [torch.empty(v.shape, dtype=v.dtype, device=self.device) for v in self.out_vals]
                self.binding = self._bind(self.static_in, self.static_out)
            for buf, t in zip(self.static_in, inputs):
                buf.copy_(t)
            self.sess.run_with_iobinding(self.binding)
            return [o.clone() for o in self.static_out]
        outs = [torch.empty(v.shape, dtype=v.dtype, device=self.device) for v in self.out_vals]
        self.sess.run_with_iobinding(self._bind(inputs, outs))
        return outs


class OrtRunner:
    """The compiled callable: the graph's flat args in (parameters included), the graph's outputs out."""

    def __init__(self, gm, param_placeholders, qualnames, provider, cuda_graph, max_sessions=MAX_SESSIONS,
                 nhwc=False, spin=True, fallback=True, threads=None, watch=True, exports=None):
        """spin: ORT's CPU workers spin between runs (True, its default), never (False), or within a
        run and ``CPU_SPIN_US`` after it ("short"); fallback: signatures ONNX
        export refuses run on the torch executor (with a warning) instead of raising; watch: whether
        the weights may change between calls (False: a package's, fixed); exports: an
        ``engine_calls.SharedBuilds`` shared with runners of the same graph (or None): an export is
        reused only with the same weight tensors, unchanged, within one decision of the runner."""
        self.gm, self.provider, self.cuda_graph, self.max_sessions = gm, provider, cuda_graph, max_sessions
        self.nhwc, self.spin, self.fallback, self.threads = nhwc, spin, fallback, threads
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.params = {i: qualnames.get(n.name, n.name) for i, n in enumerate(placeholders)
                       if n.name in param_placeholders}
        self.user = [i for i in range(len(placeholders)) if i not in self.params]
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self.out_type = type(out) if isinstance(out, (list, tuple)) else None
        self.sessions: OrderedDict = OrderedDict()
        # whether a weight changed since the last call (none watched where they are fixed)
        self._params_changed = ParamChanges(self.params if watch else [])
        self._torch = None  # the torch executor, for signatures ONNX export refuses
        self.builds = 0  # sessions created (for tests and reports)
        self.exports = exports

    def entry(self, args) -> _Session:
        if self._params_changed(args):  # a weight changed: every session holds stale initializers
            self.sessions.clear()
        sig = tuple((tuple(args[i].shape), args[i].dtype, args[i].device) if isinstance(args[i], torch.Tensor)
                    else args[i] for i in self.user)
        entry = self.sessions.get(sig)
        if entry is None:
            export = None
            if self.exports is not None:  # the other thread count's, where it exported these weights
                export = self.exports.get(sig, weights_key(args, self.params),
                                          lambda: export_signature(self.gm, list(args), self.params))
            entry = _Session(self.gm, list(args), self.params, self.provider, self.cuda_graph, self.nhwc, self.spin,
                             self.threads, export)
            self.builds += 1
            self.sessions[sig] = entry
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(sig)
        return entry

    def bound(self, args):
        """A call for the signature of ``args`` alone, for a caller that dispatches on signatures
        itself (``backends/cpu.CpuRunner``): the session looked up once, not at every call (a
        package's seedcnn at batch 1 spent 6 us a call above its session's run in ``__call__``).
        Watched weights are checked at every call: once one changed, the sessions are dropped and
        the calls take ``__call__``, which builds them again. Only where the session runs on the
        CPU; it holds the session weakly: once evicted, its calls take ``__call__``. None elsewhere."""
        from fxopt.onnx_common import OnnxExportError

        if self.provider != "CPUExecutionProvider":
            return None
        try:
            entry = self.entry(args)
        except OnnxExportError:
            return None
        positions = [i for i in self.user if isinstance(args[i], torch.Tensor)]
        changed = self._params_changed if self._params_changed.indices else None
        return bound_call(entry, positions, entry.out_vals, self.out_type, changed, self.sessions.clear, self)

    def __call__(self, *args):
        from fxopt.onnx_common import OnnxExportError

        try:
            entry = self.entry(args)
        except OnnxExportError as e:
            if not self.fallback:
                raise
            _warn_once(str(e), f"fxopt: executor 'onnxruntime': {e}; running these inputs with the torch executor")
            if self._torch is None:
                self._torch = torch_ref.lower(self.gm)
            return self._torch(*args)
        outs = entry.run([args[i] for i in self.user if isinstance(args[i], torch.Tensor)])
        if entry.restride:
            outs = [restride(t, v) for t, v in zip(outs, entry.out_vals)]
        return self.out_type(outs) if self.out_type is not None else outs[0]
