"""``fxopt diagnose timeline``: the kernels of one CUDA-graph replay on a time axis, one stream
against the multi-stream plan, as a picture.

    fxopt diagnose timeline googlenet --batch 1 --dtype float16 --streams 4 --out timeline.png
        [--options JSON] [--replays 5] [--events events.json] [--force]

The model is compiled twice in this process (CUDA inference, CUDA graphs on): with ``streams`` 0
and with ``streams`` N (the other options as given, e.g. ``{"fixed_weights": true}``: streams pay
where the calls are bound by the GPU). Each runner's replay of its first signature is profiled
``--replays`` times (``torch.profiler``, the CUDA activity: the kernels inside the graph, with the
stream each ran on) and the replay with the median span is drawn: one panel per way, one row per
stream the trace names (a replayed graph's independent nodes run on streams the driver picks, so a
plan on 4 streams may show more rows; where the trace names one stream only, overlapping kernels are
packed into rows instead, and the rows say so), each
kernel a bar coloured by who wrote it (fxopt's generated kernels ``fx_*``, the libraries'
convolutions and products, the rest). The panels' titles give the span, the summed kernel time and
their ratio (the overlap), and the runner's own measured times of both captures (the decision
``fxopt explain`` lists). With the plan not kept for the signature (measured no faster), the panel
shows the kept single-stream graph unless ``--force`` captures the multi-stream plan anyway.

Kernels that programmatic dependent launch starts early appear inside their predecessor's bar;
``FXOPT_PDL=0`` in the environment draws them without that overlap. ``--events`` writes the drawn
kernels (name, stream, start and duration in µs) as JSON, so the picture can be drawn again
(``draw``) or compared.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from fxopt.diagnose.host import _recording
from fxopt.modelspec import add_model_arguments, model_and_input, options_json

HELP = "one CUDA-graph replay's kernels per stream: single stream against the multi-stream plan (a picture)"

#: (category, colour, substrings of a kernel's name, lower case); the first match wins
CATEGORIES = (
    ("fxopt generated", "#1f77b4", ("fx_",)),
    ("library conv / GEMM", "#d62728", ("cudnn", "cutlass", "gemm", "xmma", "conv", "sm90", "sm80", "nchw", "nhwc",
                                       "implicit", "wgrad", "dgrad", "fprop")),
    ("other", "#7f7f7f", ("",)),
)


@dataclass
class Kernel:
    name: str
    stream: int
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def category(name: str) -> tuple[str, str]:
    low = name.lower()
    for label, colour, keys in CATEGORIES:
        if any(k in low for k in keys):
            return label, colour
    return CATEGORIES[-1][:2]


def kernels_from_trace(trace: dict) -> list[Kernel]:
    """The kernel events of a Chrome trace (``torch.profiler``'s ``export_chrome_trace``), by start."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        args = e.get("args") or {}
        stream = args.get("stream", e.get("tid", 0))
        try:
            stream = int(stream)
        except (TypeError, ValueError):
            stream = int("".join(c for c in str(stream) if c.isdigit()) or 0)
        out.append(Kernel(str(e.get("name", "?")), stream, float(e["ts"]), float(e.get("dur", 0.0))))
    return sorted(out, key=lambda k: k.start_us)


def split_replays(kernels: list[Kernel], replays: int) -> list[list[Kernel]]:
    """``kernels`` of ``replays`` replays of one graph (each replay launches the same kernels), in
    order of start, as one list per replay."""
    if replays < 1 or len(kernels) % replays:
        raise ValueError(f"{len(kernels)} kernels are not {replays} replays of one graph")
    n = len(kernels) // replays
    return [kernels[i * n:(i + 1) * n] for i in range(replays)]


def span_us(kernels: list[Kernel]) -> float:
    return max(k.end_us for k in kernels) - min(k.start_us for k in kernels) if kernels else 0.0


def median_replay(kernels: list[Kernel], replays: int) -> list[Kernel]:
    """The replay whose span is the median of the ``replays`` profiled, its times from its start."""
    runs = sorted(split_replays(kernels, replays), key=span_us)
    run = runs[len(runs) // 2]
    t0 = min(k.start_us for k in run)
    return [Kernel(k.name, k.stream, k.start_us - t0, k.dur_us) for k in run]


def lanes(kernels: list[Kernel]) -> tuple[list[list[Kernel]], str]:
    """The rows to draw: one per stream (the streams in order of their first kernel), or, where all
    kernels report one stream, overlapping kernels packed into rows (first row free at the start)."""
    streams = list(dict.fromkeys(k.stream for k in sorted(kernels, key=lambda k: k.start_us)))
    if len(streams) > 1:
        return [[k for k in kernels if k.stream == s] for s in streams], "stream"
    rows: list[list[Kernel]] = []
    for k in sorted(kernels, key=lambda k: k.start_us):
        row = next((r for r in rows if r[-1].end_us <= k.start_us), None)
        if row is None:
            rows.append([k])
        else:
            row.append(k)
    return rows, "overlap row" if len(rows) > 1 else "stream"


def summary(kernels: list[Kernel]) -> dict:
    """Kernels, span, summed kernel time, their ratio (> 1: kernels ran at the same time), the
    streams the trace names."""
    span, busy = span_us(kernels), sum(k.dur_us for k in kernels)
    return {"kernels": len(kernels), "span_us": round(span, 2), "busy_us": round(busy, 2),
            "overlap": round(busy / span, 3) if span else 0.0, "streams": len({k.stream for k in kernels})}


def draw(panels: list[tuple[str, list[Kernel]]], path: str, title: str = "") -> None:
    """One panel per (title, kernels), a row per stream, a shared time axis in µs; the format from
    ``path``'s suffix (png, webp, svg, pdf)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = [lanes(k) for _, k in panels]
    heights = [max(1, len(r)) + 1.2 for r, _ in rows]
    fig = Figure(figsize=(11, 0.9 + 0.28 * sum(heights)))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    end = max((span_us(k) for _, k in panels), default=1.0) or 1.0
    for ax, (label, kernels), (rws, kind) in zip(axes, panels, rows):
        for i, row in enumerate(rws):
            for k in row:
                ax.broken_barh([(k.start_us, max(k.dur_us, end * 1e-3))], (i - 0.4, 0.8),
                               facecolors=category(k.name)[1], edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(len(rws)), [f"{kind} {i}" for i in range(len(rws))], fontsize=8)
        ax.set_ylim(len(rws) - 0.5, -0.5)
        ax.set_title(label, fontsize=9, loc="left")
        ax.grid(axis="x", linewidth=0.3)
    axes[-1].set_xlabel("µs from the replay's first kernel")
    axes[-1].set_xlim(0, end * 1.01)
    used = {category(k.name) for _, ks in panels for k in ks}
    fig.legend(handles=[Patch(color=c, label=lbl) for lbl, c, _ in CATEGORIES if (lbl, c) in used],
               loc="upper right", fontsize=8, ncol=3, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97 if title else 1))
    fig.savefig(path, dpi=110)


def add_arguments(p) -> None:
    add_model_arguments(p, suite=True, dtype="float16", device="cuda")
    p.add_argument("--options", type=options_json, default={}, help="fxopt options as JSON (both compiles)")
    p.add_argument("--streams", type=int, default=4, help="the multi-stream compile's option (default 4)")
    p.add_argument("--replays", type=int, default=5, help="replays profiled per way (the median span is drawn)")
    p.add_argument("--out", default="timeline.png", help="the picture (.png, .webp, .svg; default timeline.png)")
    p.add_argument("--events", default=None, metavar="JSON", help="also write the drawn kernels as JSON")
    p.add_argument("--force", action="store_true", help="capture the multi-stream plan even where the runner "
                   "kept one stream")


def profile_replays(replay, replays: int) -> list[Kernel]:
    """The kernels of ``replays`` replays (a synchronisation after each), from the profiler's trace."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return kernels_from_trace(json.load(f))


def _way(model, x, options: dict, force: bool) -> tuple[object, dict, Optional[str]]:
    """Compile, call, and return the replay of the first signature, its decision, and a note."""
    from fxopt.testing import compile_with_fxopt

    graphs: list = []
    compiled = compile_with_fxopt(model, options, graphs)
    for _ in range(3):
        compiled(x)
    runner = graphs[0].executor_details.get("cudagraph_runner") if graphs else None
    if runner is None or not runner.graphs:
        raise SystemExit("fxopt diagnose timeline: no CUDA-graph replay (CUDA inference with CUDA graphs only)")
    entry = next(iter(runner.graphs.values()))
    decision = runner.decisions()[0]
    note = None
    if force and runner.streams is not None and decision.get("streams", {}).get("kept") == "single":
        _recording(runner)  # the flat arguments Dynamo and AOTAutograd hand the runner
        compiled(x)
        args = runner.last_args
        runner.__class__ = type(runner).__mro__[1]
        entry = runner._capture_streams(entry, args)
        note = "forced: measured no faster, not kept"
    return entry.instances[0].graph.replay, decision, note


def _label(name: str, kernels: list[Kernel], decision: dict, note: Optional[str]) -> str:
    s = summary(kernels)
    text = (f"{name}: span {s['span_us']:.1f} µs, kernels {s['kernels']} summing {s['busy_us']:.1f} µs "
            f"(x{s['overlap']:.2f})")
    st = decision.get("streams")
    if st and st.get("multi_ms") is not None:
        text += f"; runner's timing: one stream {st['single_ms'] * 1e3:.1f} µs, {st['used']} streams " \
                f"{st['multi_ms'] * 1e3:.1f} µs, kept {st['kept']}"
    return text + (f" [{note}]" if note else "")


def run(args) -> int:
    if args.device != "cuda" or not torch.cuda.is_available():
        raise SystemExit("fxopt diagnose timeline: needs a CUDA device (--device cuda)")
    torch.backends.cudnn.benchmark = True
    model, x = model_and_input(args)
    panels, record = [], {}
    with torch.no_grad():
        for name, n in (("one stream", 0), (f"up to {args.streams} streams", args.streams)):
            replay, decision, note = _way(model, x, {**args.options, "streams": n}, args.force and n > 0)
            kernels = median_replay(profile_replays(replay, args.replays), args.replays)
            panels.append((_label(name, kernels, decision, note), kernels))
            record[name] = {"summary": summary(kernels), "decision": decision.get("streams"),
                            "kernels": [asdict(k) for k in kernels]}
            print(f"  {panels[-1][0]}")
    torch.compiler.reset()
    title = (f"{args.model} {args.dtype} {tuple(x.shape)}, {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}: one CUDA-graph replay")
    draw(panels, args.out, title)
    print(f"{title}\n  picture: {args.out}")
    if args.events:
        with open(args.events, "w") as f:
            json.dump({"title": title, "ways": record}, f)
        print(f"  events: {args.events}")
    return 0
