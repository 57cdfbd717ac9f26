"""Options of the fxopt backend: ``torch.compile(m, backend="fxopt", options={...})``.

Unknown option names raise ``ValueError`` listing the valid ones; values are
checked here so a typo fails at compile time, not somewhere inside a pass. The pass names are
the pipelines' (``fxopt.pipeline.ALL_PASS_NAMES``): the entry points hand them to ``from_any``, so
that this module, which every pass imports through ``fxopt.passinfra``, never imports the
pipeline back.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

EXECUTORS = ("auto", "torch", "cpu", "cuda", "onnxruntime")
LAYOUTS = ("auto", "channels_last", "contiguous")
PARTITIONERS = ("min_cut", "default")
CONV_ALGORITHM_MODES = ("auto", "heuristic")


@dataclass
class Options:
    #: run only these passes (by name), in pipeline order; None = all
    passes: Optional[list[str]] = None
    #: passes to skip (by name)
    disable: list[str] = field(default_factory=list)
    #: raise instead of falling back to the unoptimized graph
    strict: bool = False
    #: run the example inputs after every pass and name the first pass that changes the result
    verify: bool = False
    #: "auto" (cuda for CUDA inputs; CPU inputs: cpu for inference, torch for training), "torch",
    #: "cpu", "cuda", "onnxruntime"
    executor: str = "auto"
    #: None (auto on CUDA, heuristic on CPU) | "auto" | "heuristic" | an algorithm name
    #: | {qualified conv name, glob or "*": one of those}
    conv_algorithm: Union[str, dict, None] = None
    #: in "auto" conv_algorithm mode, measure only the candidates whose cost-model estimate is within
    #: this factor of the best estimate (direct is always a candidate; where it is the only one left
    #: nothing is measured); 0 or None = measure every legal candidate
    conv_prune: Optional[float] = 4.0
    #: autotuning cache file; None = default under the user cache dir; False = no cache (measure
    #: afresh every compile; the whole-compile cache is off too)
    autotune_cache: Union[str, bool, None] = None
    #: reuse the optimized graph and choices of an identical earlier compile (fxopt.compile_cache;
    #: off while autotune_cache is False)
    compile_cache: bool = True
    #: CUDA graphs for CUDA graphs, inference and training forward/backward (None = on when legal)
    cudagraphs: Optional[bool] = None
    #: with CUDA graphs, also capture the unoptimized graph per signature and replay it instead where
    #: it measures faster (by more than 3%): never slower than PyTorch's own kernels
    baseline_check: bool = True
    #: cpu executor: also time the optimized graph in an ONNX Runtime session (CPU EP) per input
    #: signature and run it where it is faster (needs onnxruntime; graphs it cannot export skip it)
    cpu_onnxruntime: bool = True
    #: cpu executor: also time the graph compiled by OpenVINO (CPU plugin) per input signature and run
    #: it where it is faster and its outputs match (needs openvino: pip install fxopt[openvino]; float32
    #: graphs at float32 precision, bfloat16 ones at bfloat16). Off by default: exporting, converting
    #: and compiling it adds 1-3.5 s to a small CNN's first call per signature
    cpu_openvino: bool = False
    #: cpu executor: also time the whole graph as one generated C function (``backends/cpu_c.py``:
    #: float32 and bfloat16 graphs of at most 60 MFLOP an image whose every op it handles; needs a C compiler on
    #: PATH) per input signature and run it where it is faster and its outputs match. Its compile costs a
    #: signature's first call about 0.7 s: ``FXOPT_CPU_GENERATED_C=0`` in the environment makes False the
    #: default (for many short-lived compiles, e.g. a test suite)
    cpu_generated_c: bool = field(default_factory=lambda: os.environ.get("FXOPT_CPU_GENERATED_C", "1") != "0")
    #: cuda executor on CPU inputs (no GPU): every fused region runs its kernel's IR (``ir.evaluate``:
    #: the generated code's loads, stores, roundings and float32 math) instead of its ATen reference,
    #: so a whole graph, a training step's backward included, checks the kernels' semantics on the
    #: CPU (slow: for tests and the fuzzer's CPU check). No effect where the kernels run on a GPU
    emulate_kernels: bool = False
    #: inference graphs that need nothing of AOTAutograd's runtime wrapper (no aliasing, mutation,
    #: subclasses, autocast...) are called by Dynamo directly, saving the wrapper's per-call cost
    direct_call: bool = True
    #: maximum number of captured CUDA graphs (input signatures) per compiled graph
    cudagraph_max_signatures: int = 8
    #: dynamic shapes (a graph Dynamo traced with symbolic sizes: ``dynamic=True``, automatic
    #: dynamic, ``mark_dynamic``): run the passes once on the symbolic graph and lower it per
    #: concrete size at that size's first call, without a new Dynamo compile (``fxopt.dynamic``);
    #: False: the passes specialize the graph to the size it was traced at (Dynamo recompiles)
    dynamic_shapes: bool = True
    #: dynamic shapes: sizes kept lowered at once (each with its kernels and CUDA graphs); the least
    #: recently used goes first, and a size seen again is lowered again (never run eagerly)
    max_specializations: int = 16
    #: dynamic shapes: a new batch size of a batch-independent graph first runs padded on a lowered
    #: larger batch (``fxopt.dynamic_buckets``), its own specialization lowered at its
    #: ``specialize_after + 1``-th call; False: every size is lowered at its first call
    dynamic_padding: bool = True
    specialize_after: int = 2
    #: training: how AOTAutograd splits forward and backward; "min_cut" recomputes cheap pointwise
    #: values in the backward instead of saving them, "default" saves every value it needs
    partitioner: str = "min_cut"
    #: let cuDNN search its algorithms inside fxopt's convolutions where ``torch.backends.cudnn.benchmark``
    #: is on; False (default): cuDNN's heuristics choose (fxopt measures its own candidates; the search
    #: costs seconds on first use and chose no faster kernels on the H100: BENCHMARKS.md)
    cudnn_search: bool = False
    #: "auto" (channels_last for conv-heavy graphs on CUDA), "channels_last", "contiguous"
    layout: str = "auto"
    #: "auto" (16-bit channels_last convolutions on CUDA), "on" (any dtype and device), "off": carry
    #: channel counts that are not a multiple of 8 at the next multiple (``passes/pad_channels.py``)
    pad_channels: str = "auto"
    #: cuda executor: group pointwise, reduction and data-movement ops into generated kernels
    #: (the fusion scheduler); False runs them one ATen op at a time
    fusion: bool = True
    #: cuda executor: fused-region and conv-epilogue kernels use the hardware's approximate exp and
    #: division (``__expf``, ``__fdividef``) in sigmoid, SiLU, hardswish, hardsigmoid and exp
    #: (relative error below 1.3e-5: under the float32 tolerance and a 16-bit result's rounding);
    #: other divisions, PyTorch's kernels and the other templates keep IEEE arithmetic;
    #: False: IEEE arithmetic everywhere
    fast_math: bool = True
    #: cuda executor: independent branches of an inference graph on up to this many CUDA streams
    #: (``backends/cuda/runtime/streams.py``); 0 (default): one stream. The plan is listed
    #: (``executor_details["streams"]``, ``fxopt explain``) and, under CUDA graphs, captured and timed
    #: against the single-stream capture per input signature, kept where faster by more than 3 %
    #: (``backends/cuda/runtime/stream_capture.py``)
    streams: int = 0
    #: treat parameters and buffers as constants in inference (weights refolded when they change)
    freezing: bool = True
    #: inference: the weights never change after the first call (Inductor's freezing makes the same
    #: assumption): no per-call check for replaced or in-place-changed parameters (about 0.25 µs per
    #: parameter tensor on a busy host, ~90 µs for ~400 tensors); a later change may not be seen.
    #: False (default): every call notices it and refolds / re-captures
    fixed_weights: bool = False
    #: directory for per-pass readable graph dumps (default: $FXOPT_DUMP_DIR)
    dump_dir: Optional[str] = None

    @classmethod
    def from_any(cls, options: Union["Options", dict, None],
                 pass_names: Optional[Sequence[str]] = None) -> "Options":
        """Options from a dict (or None, or Options as they are), checked; ``pass_names``: the
        pipeline's passes, which ``passes`` and ``disable`` must name (not checked without)."""
        if isinstance(options, Options):
            return options
        options = dict(options or {})
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(
                f"fxopt: unknown option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are: {', '.join(sorted(valid))}"
            )
        opts = cls(**options)
        opts.validate(pass_names)
        return opts

    def validate(self, pass_names: Optional[Sequence[str]] = None) -> None:
        for key in ("passes", "disable"):
            names = getattr(self, key)
            if names is None:
                continue
            if isinstance(names, str):
                names = [n.strip() for n in names.split(",") if n.strip()]
                setattr(self, key, names)
            bad = [n for n in names if pass_names is not None and n not in pass_names]
            if bad:
                raise ValueError(f"fxopt: unknown pass name(s) {bad} in option {key!r}; passes are: {list(pass_names)}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"fxopt: executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"fxopt: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.pad_channels not in ("auto", "on", "off"):
            raise ValueError(f"fxopt: pad_channels must be 'auto', 'on' or 'off', got {self.pad_channels!r}")
        if self.partitioner not in PARTITIONERS:
            raise ValueError(f"fxopt: partitioner must be one of {PARTITIONERS}, got {self.partitioner!r}")
        from fxopt.conv_algorithms import ALGORITHMS

        allowed = set(CONV_ALGORITHM_MODES) | set(ALGORITHMS)
        choices = self.conv_algorithm.values() if isinstance(self.conv_algorithm, dict) else [self.conv_algorithm]
        for c in choices:
            if c is not None and c not in allowed:
                raise ValueError(f"fxopt: conv_algorithm must be one of {sorted(allowed)} (or a dict of them), got {c!r}")
        if self.conv_prune is not None and not (isinstance(self.conv_prune, (int, float))
                                                and not isinstance(self.conv_prune, bool)
                                                and (self.conv_prune == 0 or self.conv_prune >= 1)):
            raise ValueError(f"fxopt: conv_prune must be 0, None or a factor >= 1, got {self.conv_prune!r}")
        if not isinstance(self.fusion, bool):
            raise ValueError(f"fxopt: fusion must be True or False, got {self.fusion!r}")
        if not isinstance(self.fast_math, bool):
            raise ValueError(f"fxopt: fast_math must be True or False, got {self.fast_math!r}")
        if not isinstance(self.compile_cache, bool):
            raise ValueError(f"fxopt: compile_cache must be True or False, got {self.compile_cache!r}")
        if not isinstance(self.cpu_onnxruntime, bool):
            raise ValueError(f"fxopt: cpu_onnxruntime must be True or False, got {self.cpu_onnxruntime!r}")
        if not isinstance(self.cpu_generated_c, bool):
            raise ValueError(f"fxopt: cpu_generated_c must be True or False, got {self.cpu_generated_c!r}")
        if not isinstance(self.cpu_openvino, bool):
            raise ValueError(f"fxopt: cpu_openvino must be True or False, got {self.cpu_openvino!r}")
        if not isinstance(self.cudnn_search, bool):
            raise ValueError(f"fxopt: cudnn_search must be True or False, got {self.cudnn_search!r}")
        if not isinstance(self.dynamic_shapes, bool):
            raise ValueError(f"fxopt: dynamic_shapes must be True or False, got {self.dynamic_shapes!r}")
        if isinstance(self.max_specializations, bool) or not isinstance(self.max_specializations, int) \
                or self.max_specializations < 1:
            raise ValueError(f"fxopt: max_specializations must be an int >= 1, got {self.max_specializations!r}")
        if not isinstance(self.dynamic_padding, bool):
            raise ValueError(f"fxopt: dynamic_padding must be True or False, got {self.dynamic_padding!r}")
        if isinstance(self.specialize_after, bool) or not isinstance(self.specialize_after, int) \
                or self.specialize_after < 1:
            raise ValueError(f"fxopt: specialize_after must be an int >= 1, got {self.specialize_after!r}")
        if isinstance(self.streams, bool) or not isinstance(self.streams, int) or not 0 <= self.streams <= 8:
            raise ValueError(f"fxopt: streams must be an int from 0 (off) to 8, got {self.streams!r}")
        if self.dump_dir is None:
            self.dump_dir = os.environ.get("FXOPT_DUMP_DIR") or None

    def pass_enabled(self, name: str) -> bool:
        if self.passes is not None and name not in self.passes:
            return False
        return name not in self.disable

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
