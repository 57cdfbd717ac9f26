"""``fxopt diagnose compile``: where a first call's compile time goes.

    fxopt diagnose compile resnet50 --dtype float16 --device cuda [--cprofile 30] [--options JSON]
    fxopt diagnose compile resnet50 --dtype float16 --device cuda --backend aot_eager

Compiles the model in this (fresh) process and prints the first call's wall time (compile + run)
and the second call's, then, for fxopt, each compiled graph's passes with their time, the
executor's parts (``nvrtc_s``: generating and compiling kernels, ``choose_s``: measuring candidates,
...) and the CUDA-graph runner's decisions. ``--backend eager`` (Dynamo alone), ``aot_eager``
(Dynamo + AOTAutograd, fxopt's front end) or ``inductor`` time what every ``torch.compile``
backend pays before its own work, and a peer. ``--cprofile N``: the N most expensive functions of
the first call. On CUDA ``cudnn.benchmark`` is on, as in the benchmark. Empty ``FXOPT_CACHE_DIR``
for a cold compile; the same directory again for a warm one.
"""
from __future__ import annotations

import torch

from fxopt.diagnose.timing import first_call_s, profiled, sync
from fxopt.modelspec import add_model_arguments, model_and_input, options_json

HELP = "a first call's compile time, per pass"
BACKENDS = ("fxopt", "eager", "aot_eager", "inductor")


def add_arguments(p) -> None:
    add_model_arguments(p, suite=True, device="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", choices=BACKENDS, default="fxopt", help="default fxopt")
    p.add_argument("--options", type=options_json, default={}, help="fxopt options as JSON, e.g. '{\"conv_prune\": 0}'")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="profile the first call: N functions")
    p.add_argument("--sort", choices=["cumulative", "tottime"], default="cumulative", help="cProfile order")


def run(args) -> int:
    if args.options and args.backend != "fxopt":
        raise SystemExit("fxopt: --options are fxopt's: they need --backend fxopt")
    if args.device == "cuda":
        torch.backends.cudnn.benchmark = True
    model, x = model_and_input(args)
    sync(args.device)
    graphs: list = []
    if args.backend == "fxopt":
        from fxopt.testing import compile_with_fxopt

        fn = compile_with_fxopt(model, args.options, graphs)
    else:
        torch.compiler.reset()
        fn = torch.compile(model, backend=args.backend)
    with torch.no_grad():
        with profiled(args.cprofile, args.sort) as prof:
            first = first_call_s(fn, x, args.device)
        second = first_call_s(fn, x, args.device)
    print(f"{args.model} {args.dtype} {tuple(x.shape)} {args.device} {args.backend}: "
          f"first call {first:.2f} s, second {second * 1e3:.1f} ms")
    for g in graphs:
        print(f"  graph {g.kind}: fxopt compile (passes + lowering) {g.compile_ms / 1e3:.2f} s, "
              f"executor {g.executor}, cudagraphs {g.cudagraphs}")
        for r in g.passes:
            print(f"    {r.name:28s} {r.ms:8.1f} ms  {r.status}")
        for k, v in g.executor_details.items():
            if k.endswith("_s") or k.endswith("_ms"):
                print(f"    {k:28s} {v}")
        runner = g.executor_details.get("cudagraph_runner")
        if runner is not None:
            print(f"    runner decisions             {runner.decisions()}")
    if prof.text:
        print(prof.text)
    torch.compiler.reset()
    return 0
