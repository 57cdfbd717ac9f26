"""Data-parallel training through fxopt on the CPU: PyTorch's DistributedDataParallel and FSDP2
(``fully_shard``) with the gloo backend, 2 and 4 processes, against the same runs in eager.

One spawn per world size runs every configuration (spawning and joining a process group costs
seconds); the tests below read its results. Every process trains from the same seeded weights on
its own seeded batches (per rank), a few SGD steps (one configuration with Adam), in float32, for:

- ``ddp``: ``DistributedDataParallel(model)`` with default settings (25 MB buckets, a 1 MB first
  bucket, buffers broadcast from rank 0 before every forward), eager: the reference;
- ``ddp-inner``: ``DDP(torch.compile(model, backend="fxopt"))``;
- ``ddp-outer``: ``torch.compile(DDP(model), backend="fxopt")`` as users compile a DDP model:
  Dynamo's DDPOptimizer splits the graph at the bucket boundaries and fxopt compiles every piece
  (both models hold over 1 MB of parameters, DDP's first bucket: at least two pieces each;
  DDPOptimizer refuses buckets under 1 MB whatever the backend);
- ``fsdp``: ``fully_shard`` on every block and on the whole model, eager: the reference;
- ``fsdp-whole``: the same, then ``torch.compile(model, backend="fxopt")`` (the FSDP hooks run
  eagerly between the graphs, which break at the blocks);
- ``fsdp-block``: the same, every block compiled in place (``block.compile(backend="fxopt")``).

Checks, per configuration and rank: every step's loss and the final parameters and BatchNorm
buffers against the eager reference of the same rank; the parameters equal on every rank (the
gradients were reduced); training moved the parameters far more than the tolerance; fxopt compiled
forward and backward graphs (counted from its reports) with no fallback, and every convolution and
linear layer of the model is in exactly one of its forward graphs, so that a run in which Dynamo
fell back to eager, or ran a layer eagerly between graphs, fails.

FSDP2's hooks are ``torch._dynamo.disable``d: Dynamo breaks the graph at every sharded module and
resumes in the module's ``forward`` only where that is user code. A ``torch.nn`` layer sharded on
its own (``fully_shard(model.fc1)``, an ``nn.Sequential``) runs eagerly under any backend; so the
blocks sharded here are modules with their own ``forward`` (as a ResNet's blocks are), and SeedCNN2,
whose layers are single ``torch.nn`` modules, is sharded as one.

Tolerance: float32 on the CPU. fxopt's CPU training graphs run ATen's kernels (the torch executor),
but its passes and AOTAutograd's min-cut partition may change which kernels run (recomputed
pointwise ops, BatchNorm as one op), and gloo sums the ranks' gradients in an order that depends on
how the buckets are cut (DDPOptimizer's buckets against eager DDP's): single roundings that the
steps carry forward. Measured: bitwise equal except 4 processes through DDPOptimizer (losses 1.1e-7,
parameters 2.5e-7). ``RTOL = 1e-5`` relative (losses: per step; tensors: max |p - p_eager| /
max |p_eager| per tensor) leaves 40x above that and stays far below any real error (a missed
all-reduce or a wrong gradient moves the losses by 1e-2 or more within a step or two).
"""
from __future__ import annotations

import datetime
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist

RTOL = 1e-5  # float32, a few steps: see the module docstring
STEPS = 6
BATCH = 4  # per rank
TIMEOUT_S = 300  # a whole spawn (and gloo's collective timeout): past it the processes are killed

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available in this build")

# (name, model, optimizer, wrapping): run in this order on every rank; the eager references first
CONFIGS_2 = [
    ("seedcnn2/ddp", "seedcnn2", "sgd", "ddp"),
    ("seedcnn2/ddp-outer", "seedcnn2", "sgd", "ddp-outer"),
    ("resnet/ddp", "resnet", "sgd", "ddp"),
    ("resnet/ddp-inner", "resnet", "sgd", "ddp-inner"),
    ("resnet/ddp-outer", "resnet", "sgd", "ddp-outer"),
    ("seedcnn2/fsdp", "seedcnn2", "sgd", "fsdp"),
    ("seedcnn2/fsdp-whole", "seedcnn2", "sgd", "fsdp-whole"),
    ("resnet/fsdp", "resnet", "sgd", "fsdp"),
    ("resnet/fsdp-whole", "resnet", "sgd", "fsdp-whole"),
    ("resnet/fsdp-block", "resnet", "sgd", "fsdp-block"),
    ("resnet-adam/fsdp", "resnet", "adam", "fsdp"),
    ("resnet-adam/fsdp-block", "resnet", "adam", "fsdp-block"),
]
CONFIGS_4 = [  # 4 processes on few cores: the ResNet's DDPOptimizer pieces and FSDP2 blocks
    ("resnet/ddp", "resnet", "sgd", "ddp"),
    ("resnet/ddp-outer", "resnet", "sgd", "ddp-outer"),
    ("resnet/fsdp", "resnet", "sgd", "fsdp"),
    ("resnet/fsdp-block", "resnet", "sgd", "fsdp-block"),
]


# ---- what every rank runs -------------------------------------------------------------------------
class Stem(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class Head(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc = torch.nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


class ResNetBN(torch.nn.Module):
    """A small ResNet with BatchNorm for 3x16x16 images: a stem, two basic blocks, a head (each a
    module with its own forward: FSDP2 shards and fsdp-block compiles them apart); the second block
    is wide (192 channels at 8x8) so that the parameters pass DDP's 1 MB first bucket."""

    def __init__(self):
        from fxopt.testing.models import BasicBlock

        super().__init__()
        self.stem, self.layer1 = Stem(), BasicBlock(8, 8)
        self.layer2, self.head = BasicBlock(8, 192, stride=2), Head(192)

    def forward(self, x):
        return self.head(self.layer2(self.layer1(self.stem(x))))


def _model(name: str):
    """(model, its blocks: what FSDP2 shards apart and fsdp-block compiles, input shape).
    SeedCNN2's layers are single torch.nn modules: FSDP2 shards it as one (see ``_wrap``)."""
    from fxopt.testing.models import SeedCNN2

    torch.manual_seed(0)  # the same weights on every rank
    if name == "seedcnn2":
        return SeedCNN2(), [], (3, 32, 32)
    m = ResNetBN()
    return m, [m.stem, m.layer1, m.layer2, m.head], (3, 16, 16)


def _wrap(model, blocks, how: str):
    """The module to train, wrapped as configuration ``how`` says."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if how.startswith("ddp"):
        if how == "ddp-inner":
            return DDP(torch.compile(model, backend="fxopt"))
        return torch.compile(DDP(model), backend="fxopt") if how == "ddp-outer" else DDP(model)
    for b in blocks:
        fully_shard(b)
    fully_shard(model)
    if how == "fsdp-whole":
        return torch.compile(model, backend="fxopt")
    if how == "fsdp-block":
        for b in blocks:
            b.compile(backend="fxopt")
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective), a plain tensor's own."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(model_name: str, opt_name: str, how: str, rank: int, reports: list) -> dict:
    from fxopt.testing.training import make_batches

    torch.compiler.reset()
    model, blocks, shape = _model(model_name)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    trained = _wrap(model, blocks, how)
    params = list(model.parameters())
    opt = (torch.optim.Adam(params, lr=1e-3) if opt_name == "adam"
           else torch.optim.SGD(params, lr=0.05, momentum=0.9))
    batches = make_batches(2, BATCH, shape, 10, seed=1000 * rank)
    del reports[:]
    losses = []
    for step in range(STEPS):
        x, y = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(trained(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params_out = {k: _full(v) for k, v in model.named_parameters()}
    return {"losses": losses, "params": params_out, "initial": initial,
            "buffers": {k: _full(v) for k, v in model.named_buffers() if v.is_floating_point()},
            "graphs": [r.kind for r in reports], "fallbacks": [r.fallback for r in reports if r.fallback],
            "executors": sorted({r.executor for r in reports}),
            "compiled_ops": {op: sum(_count(r.before, op) for r in reports if r.kind == "forward") for op in COUNTED},
            "model_ops": {"convolution": sum(isinstance(m, torch.nn.Conv2d) for m in model.modules()),
                          "addmm": sum(isinstance(m, torch.nn.Linear) for m in model.modules())},
            "compile_s": sum(r.compile_ms for r in reports) / 1e3}


COUNTED = ("convolution", "addmm")  # a Conv2d's and a Linear's op in AOTAutograd's forward graphs


def _count(gm, op: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] == op)


def _worker(rank: int, world: int, port: int, out_dir: str, configs: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      OMP_NUM_THREADS="1", FXOPT_CACHE_DIR=os.path.join(out_dir, f"cache{rank}"))
    torch.set_num_threads(1)
    from fxopt import backend

    reports: list = []
    real_init = backend.FxoptCompiler.__init__

    def init(self, options, gm, example_inputs, sink=None):  # every compile's report, whoever asked
        real_init(self, options, gm, example_inputs, sink=reports if sink is None else sink)

    backend.FxoptCompiler.__init__ = init
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        results = {"started": time.time()}
        for name, model_name, opt_name, how in configs:
            t0 = time.perf_counter()
            results[name] = _train(model_name, opt_name, how, rank, reports)
            results[name]["seconds"] = time.perf_counter() - t0
        results["finished"] = time.time()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as fh:
            fh.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


# ---- the spawn, once per world size ----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, configs: list, out_dir: str) -> list:
    """Every rank's results (a list by rank); kills the processes past ``TIMEOUT_S``."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(world, _free_port(), out_dir, configs), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} processes still running after {TIMEOUT_S} s")
    except Exception as e:
        errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.startswith("error")]
        raise AssertionError(f"the {world}-process run failed: {e}\n" + "\n".join(errors)) from e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


_RUNS: dict = {}


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def world(request, tmp_path_factory):
    n = request.param
    if n not in _RUNS:
        t0 = time.perf_counter()
        _RUNS[n] = _spawn(n, CONFIGS_2 if n == 2 else CONFIGS_4, str(tmp_path_factory.mktemp(f"dist{n}")))
        print(f"\n{n} processes: {time.perf_counter() - t0:.1f} s")
    return n, (CONFIGS_2 if n == 2 else CONFIGS_4), _RUNS[n]


# ---- checks ---------------------------------------------------------------------------------------
def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (|a - b| where b is 0)."""
    num, den = (a - b).abs().max().item(), b.abs().max().item()
    return num / den if den else num


def compare(run: dict, ref: dict, rtol: float = RTOL) -> list:
    """What differs between a run and its eager reference beyond ``rtol``."""
    bad = [f"loss {i}: {a!r} vs eager {b!r}" for i, (a, b) in enumerate(zip(run["losses"], ref["losses"]))
           if not abs(a - b) <= rtol * abs(b)]
    for kind in ("params", "buffers"):
        assert run[kind].keys() == ref[kind].keys()
        bad += [f"{kind} {k}: rel diff {d:.3g}" for k in ref[kind]
                if not (d := rel_diff(run[kind][k], ref[kind][k])) <= rtol]
    return bad


def compiled_problems(run: dict, min_forward: int = 1) -> list:
    """Why a run does not show fxopt compiling its training graphs: fewer forward or backward
    graphs than expected (none: Dynamo ran the model eagerly), a convolution or linear layer of
    the model missing from fxopt's forward graphs (it ran eagerly between graphs) or there twice,
    or a fallback."""
    fw, bw = run["graphs"].count("forward"), run["graphs"].count("backward")
    out = []
    if fw < min_forward or bw < min_forward:
        out.append(f"fxopt compiled {fw} forward and {bw} backward graphs, expected at least {min_forward} each")
    if run["graphs"].count("inference"):
        out.append("fxopt compiled inference graphs in training")
    out += [f"fxopt's forward graphs hold {n} {op} ops, the model {run['model_ops'][op]}"
            for op, n in run["compiled_ops"].items() if n != run["model_ops"][op]]
    out += [f"fallback: {f}" for f in run["fallbacks"]]
    return out


def _reference(name: str) -> str:
    return name.split("/")[0] + "/" + name.split("/")[1].split("-")[0]


def test_compiled_runs_match_eager_on_every_rank(world):
    n, configs, ranks = world
    bad = []
    for name, *_ in configs:
        ref = _reference(name)
        if ref == name:
            continue
        for r, res in enumerate(ranks):
            bad += [f"{name} rank {r}: {p}" for p in compare(res[name], res[ref])]
    assert not bad, "\n".join(bad)


def test_ranks_hold_the_same_parameters(world):
    """The gradients were averaged over the ranks: every rank steps to the same parameters (the
    BatchNorm buffers stay per rank: each updates them from its own batch)."""
    n, configs, ranks = world
    for name, *_ in configs:
        for r in range(1, n):
            for k, v in ranks[0][name]["params"].items():
                assert torch.equal(ranks[r][name]["params"][k], v), f"{name}: rank {r}'s {k} differs from rank 0's"
    # the ranks trained on different batches: their losses differ
    assert ranks[0][configs[0][0]]["losses"] != ranks[1][configs[0][0]]["losses"]


def test_training_moved_far_beyond_the_tolerance(world):
    """The comparison means something: every reference's parameters moved by much more than RTOL."""
    n, configs, ranks = world
    for name, *_ in configs:
        if _reference(name) == name:
            res = ranks[0][name]
            moved = max(rel_diff(res["params"][k], res["initial"][k]) for k in res["params"])
            assert moved > 1000 * RTOL, f"{name}: parameters moved by {moved:.3g} only"
            assert res["losses"][0] != res["losses"][-1]


def test_fxopt_compiled_every_run(world):
    """A compiled configuration whose graphs Dynamo ran eagerly (or fxopt fell back) fails here."""
    n, configs, ranks = world
    # ddp-outer: DDPOptimizer's pieces (over 1 MB of parameters); fsdp-block: one graph per block
    minimum = {"ddp-outer": 2, "fsdp-block": 4}
    bad = []
    for name, _, _, how in configs:
        if _reference(name) == name:
            assert all(not res[name]["graphs"] for res in ranks), f"eager {name} compiled graphs"
            continue
        for r, res in enumerate(ranks):
            bad += [f"{name} rank {r}: {p}" for p in compiled_problems(res[name], minimum.get(how, 1))]
            assert res[name]["executors"] == ["torch"], res[name]["executors"]
    assert not bad, "\n".join(bad)


def test_the_checks_catch_an_eager_run_and_a_drift():
    """No spawn: a run without fxopt graphs, with a layer that ran eagerly or with a fallback fails
    ``compiled_problems``; a
    parameter 1e-4 off fails ``compare``."""
    run = {"graphs": [], "fallbacks": [], "losses": [1.0], "params": {"w": torch.ones(3)}, "buffers": {},
           "compiled_ops": {"convolution": 1}, "model_ops": {"convolution": 1}}
    assert compiled_problems(run)
    assert compiled_problems({**run, "graphs": ["forward", "backward"], "compiled_ops": {"convolution": 0}})
    assert compiled_problems({**run, "graphs": ["forward", "backward"], "fallbacks": ["lowering failed"]})
    assert not compiled_problems({**run, "graphs": ["forward", "backward"]})
    assert not compare(run, run)
    assert compare({**run, "params": {"w": torch.ones(3) + 1e-4}}, run)
    assert compare({**run, "losses": [1.0001]}, run)


def test_bench_fsdp_shards_the_blocks_with_their_own_forward():
    """``fxopt.bench.fsdp`` (the GPU benchmark) shards a ResNet's blocks, never a ``torch.nn``
    layer alone (it would run eagerly under torch.compile); its arguments default to DDP and FSDP2."""
    import torchvision

    from fxopt.bench.fsdp import parse_args, shard_blocks
    from fxopt.testing.models import SeedCNN2

    blocks = shard_blocks(torchvision.models.resnet18())
    assert [type(b).__name__ for b in blocks] == ["BasicBlock"] * 8
    assert shard_blocks(SeedCNN2()) == []
    assert [type(b).__name__ for b in shard_blocks(ResNetBN())] == ["Stem", "BasicBlock", "BasicBlock", "Head"]
    a = parse_args(["--device", "cpu", "--model", "seedcnn2"])
    assert a.modes == ["ddp", "fsdp"] and a.amp == "none" and a.batch == 64


def test_bench_fsdp_counts_the_convolutions_a_step_calls_op_by_op():
    """What ran eagerly shows as ``aten::conv2d`` calls (an ``nn.Conv2d``, a Dynamo graph run as Python);
    a graph replay calls none."""
    from fxopt.bench.fsdp import _conv_calls

    conv = torch.nn.Conv2d(2, 3, 3)

    class Step:
        def step(self, x, y):
            conv(x).sum().backward()

    got = _conv_calls(Step(), (torch.randn(1, 2, 5, 5), None), "cpu")
    assert got == {"aten::conv2d": 1, "aten::convolution": 1}, got

    class Nothing:
        def step(self, x, y):
            x.sum()

    assert _conv_calls(Nothing(), (torch.randn(1, 2, 5, 5), None), "cpu") == {"aten::conv2d": 0, "aten::convolution": 0}
