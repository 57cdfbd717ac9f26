"""A batch of images through the generated C a few images at a time, the tiles shared out over threads
(``backends/cpu_c.py``).

Why: the generated C is fastest where a whole image's tensors stay in the CPU's caches: seedcnn's
function runs 18 us an image at batch 1 and 36 us an image at batch 64, where each layer's output
for the batch (1.2 MB) leaves the L2 before the next layer reads it. So a batch-independent graph
is generated for a tile of 8, 4, 2 or 1 images (its sizes propagated again there; a tile of 8 keeps
a linear layer's weights in the caches across its rows) and a driver (``fxopt_tiles``) runs it per
tile by moving the batched arguments' and outputs' pointers, the tiles split over
``torch.get_num_threads()`` OpenMP threads (each tile's function on one thread), each thread with
its own workspace.

Batch-independent: every value either carries the batch as its outermost dimension (batch ``B`` at
the signature's size, the tile's at the tile's, every other dimension the same) or does not depend
on it; every op that reads a batched value gives a batched value and reads it only where the op
acts per image (a convolution's input, not its weight; the rows of a matrix product, not its
columns); every output is batched. Anything else (a mean over the batch, a transpose of a batched
value, a view that moves it) keeps the whole-batch function.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

aten = torch.ops.aten

#: per op: the argument positions that may carry the batch (the others must not)
_PER_IMAGE = {
    aten.convolution.default: {0}, aten._native_batch_norm_legit_no_training.default: {0},
    aten.max_pool2d_with_indices.default: {0}, aten.avg_pool2d.default: {0}, aten.mean.dim: {0},
    aten._adaptive_avg_pool2d.default: {0}, aten.addmm.default: {0, 1}, aten.mm.default: {0},
    aten.view.default: {0}, aten._unsafe_view.default: {0}, aten.reshape.default: {0}, aten.clone.default: {0},
    aten.alias.default: {0}, aten.detach.default: {0}, aten._to_copy.default: {0}, operator.getitem: {0},
    aten.add.Tensor: {0, 1}, aten.sub.Tensor: {0, 1}, aten.mul.Tensor: {0, 1},
}
DRIVER = "fxopt_tiles"
_SIZED_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class _Recorded(fx.Interpreter):
    """Runs the graph at a tile (a few images: cheap) and records each node's value as its
    ``meta["val"]``, for the sizes (no fake tensors: a loaded package never imports Dynamo)."""

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        n.meta["val"] = out
        return out

    def call_function(self, target, args, kwargs):
        from fxopt.ops import fused_conv_ref, fused_linear_ref

        # fxopt's ops by their Python references: the custom op's dispatch would import Dynamo
        refs = {torch.ops.fxopt.fused_conv.default: fused_conv_ref,
                torch.ops.fxopt.fused_linear.default: fused_linear_ref}
        return refs.get(target, target)(*args, **kwargs)


def tile_size(batch: int, threads: int) -> int:
    """Images a tile: 8, 4, 2 or 1, a divisor of the batch that leaves each thread a tile at least (and
    two tiles at least: a tile's sizes must tell the batch apart)."""
    return next((t for t in (8, 4, 2) if batch % t == 0 and batch // t >= max(threads, 2)), 1)


def _carries(v_big, v_one, batch: int, tile: int) -> Optional[bool]:
    """True: the value carries the batch; False: it does not depend on it; None: neither (declined)."""
    if not isinstance(v_big, torch.Tensor):
        return False
    if tuple(v_big.shape) == tuple(v_one.shape):  # at a tile a batched value has tile < B where it had B
        return False
    if v_big.dim() >= 1 and v_big.shape[0] == batch and v_one.shape[0] == tile and \
            tuple(v_big.shape[1:]) == tuple(v_one.shape[1:]):
        return True
    return None


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with a graph of its own (its nodes' meta copied shallowly, its modules and weights
    shared): a deep copy would copy the FakeTensors of the meta, which fail to copy once their fake
    mode is gone (a package's optimized graph with folded constants)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def per_tile(gm: fx.GraphModule, args: list, user: list, threads: int) -> tuple:
    """((the graph with its sizes at a tile of images, its arguments there, per argument: whether it
    is batched, the tile's images), None) where ``gm`` at ``args`` is batch-independent, else (None, why)."""
    from fxopt.backends.c_emit import FUSED_CONV, FUSED_LINEAR, UNARY

    batched = [i for i in user if isinstance(args[i], torch.Tensor) and args[i].dim() >= 1]
    if not batched:
        return None, "no batched input"
    batch = int(args[batched[0]].shape[0])
    if batch < 2 or any(int(args[i].shape[0]) != batch for i in batched):
        return None, f"batch {batch}, or inputs of other batches"
    tile = tile_size(batch, threads)
    one = _copy(gm)
    for n in one.graph.nodes:  # a view's size written as the batch (flatten(1)) becomes the tile's
        if n.op == "call_function" and n.target in _SIZED_VIEWS and len(n.args) > 1 and \
                isinstance(n.args[1], (list, tuple)) and n.args[1] and n.args[1][0] == batch:
            n.args = (n.args[0], [tile, *n.args[1][1:]], *n.args[2:])
    one.recompile()
    args_one = [a[:tile] if i in batched else a for i, a in enumerate(args)]
    try:
        with torch.no_grad():
            _Recorded(one).run(*args_one)
    except Exception as e:  # noqa: BLE001 - a size written into the graph (a view to the batch)
        return None, f"the graph does not run at {tile} images ({type(e).__name__})"
    rules = {**_PER_IMAGE, **{t: {0} for t in UNARY}, FUSED_CONV: {0, 3}, FUSED_LINEAR: {0}}
    state: dict = {}
    for n_big, n_one in zip(gm.graph.nodes, one.graph.nodes):
        if n_big.op == "output":
            outs = n_big.args[0] if isinstance(n_big.args[0], (list, tuple)) else [n_big.args[0]]
            if not all(state.get(o) for o in outs):
                return None, "an output that is not batched"
            continue
        v_big, v_one = n_big.meta.get("val"), n_one.meta.get("val")
        if n_big.op == "placeholder":
            state[n_big] = n_big in [list(gm.graph.nodes)[i] for i in batched]
            continue
        if isinstance(v_big, (tuple, list)):  # a BatchNorm's or a max pool's outputs: the first decides
            v_big, v_one = v_big[0], v_one[0]
        carries = _carries(v_big, v_one, batch, tile)
        inputs = [(k, a) for k, a in enumerate(n_big.args) if isinstance(a, fx.Node)]
        reads = {k for k, a in inputs if state.get(a)}
        if carries is None:
            return None, f"{n_big.name}: a value that neither carries the batch nor is free of it"
        if reads and (n_big.target not in rules or not reads <= rules[n_big.target] or not carries):
            return None, f"{n_big.name}: reads the batch where it does not act per image"
        if carries and not reads:
            return None, f"{n_big.name}: a batched value from no batched input"
        state[n_big] = carries
    return (one, args_one, [i in batched for i in range(len(args))], tile), None


#: bytes before each thread's workspace: its flag "weights laid out here"
SLOT_HEADER = 64


def driver(program, arg_batched: list, args: list) -> str:
    """C of ``fxopt_tiles(A, W, P, threads, tiles)``: the tile's function once per tile, the batched
    arguments' and the outputs' pointers moved by a tile each time (``args``: the tile's), the tiles
    split over ``threads`` OpenMP threads (torch's: the runtime torch loaded), each with its own slot
    of ``W`` (where its weights are laid out at its first tile)."""
    n = program.n_args + len(program.out_shapes)
    steps = []
    for i, a in enumerate(args):
        steps.append(a.stride(0) * a.shape[0] * a.element_size() if arg_batched[i] else 0)
    for shape, dtype in zip(program.out_shapes, program.out_dtypes):
        steps.append(int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
    return (f"void {DRIVER}(void* const* restrict A, char* restrict W, int P, int nt, int tiles) {{\n"
            f"  static const long long step[{n}] = {{{', '.join(map(str, steps))}}};\n"
            "  (void)P;  /* each slot's flag says whether its weights are laid out */\n"
            "  #pragma omp parallel for schedule(static) num_threads(nt)\n"
            "  for (int t = 0; t < tiles; t++) {\n"
            f"    char* slot = W + (long long)omp_get_thread_num() * {slot_bytes(program)};\n"
            f"    void* B[{n}];\n"
            f"    for (int k = 0; k < {n}; k++) B[k] = (char*)A[k] + (long long)t * step[k];\n"
            f"    fxopt_run(B, slot + {SLOT_HEADER}, !*(int*)slot, 1);\n"
            "    *(int*)slot = 1;\n"
            "  }\n}\n")


def slot_bytes(program) -> int:
    """Bytes of one thread's slot of the workspace (its flag, then the function's workspace)."""
    return SLOT_HEADER + -(-max(program.workspace, 64) // 64) * 64
