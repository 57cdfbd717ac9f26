"""Size buckets for dynamic shapes: measured choices shared within a bucket, padded runs.

Sizes fall in power-of-two buckets (``bucket(5) == 8``: batches 5..8 share a bucket; each symbolic
size is bucketed so, an image's sides as well: 192, 224 and 256 share one).

- ``BucketChoices``: the choices the first lowering in a bucket measured (or read from the
  autotuning cache), in the order it asked for them, handed to every later lowering in the bucket.
  Every choice fxopt measures goes through the autotuning cache (``fxopt.choices``) under a key that
  names the shapes; a lowering at another size of the bucket asks for the same choices in the same
  order under keys that differ only in their numbers (and hashes of generated sources), so a key's
  *signature* (numbers and hashes blanked) finds the bucket's entry: nothing is measured at a second
  size of a bucket. A key without such an entry goes to the user's cache and is measured there as
  before. The first lowering's keys are recorded exact, so the user's cache serves it in a later
  process. The first lowering itself takes what the user's cache holds for another batch of its
  bucket (``sibling_batch``: the static graph Dynamo compiled for the first size, or a lowering of an
  earlier process) before measuring: the bucket's choices, measured at another of its sizes. What a
  bucket measures is stored with the bucket of its inputs (``input_buckets``: the symbolic inputs'
  shapes, every size bucketed), and the same request from another graph at inputs of that bucket
  takes it: Dynamo's later graph with the sides symbolic too, or a later process.
- Neighbouring buckets (``BucketChoices.neighbours``): where neither holds a choice, the first
  lowering of a new batch bucket takes it unmeasured from the buckets of other batches (the other
  sizes' buckets equal) that measured it, where that choice is clear: the nearest measured buckets
  below and above both chose it, or the adjacent one (half or twice the batch) chose it by at least
  ``NEIGHBOUR_MARGIN`` over every other timed alternative (``verdict``). A choice is the same
  request only where both lowerings asked for the same choices in the same order up to it (their
  keys' signatures). Choices taken so are never handed on to a third bucket, nor written to the
  user's cache: a later process measures them at their own size. A CUDA-graph runner's decision
  (whether the optimized graph or the unoptimized baseline runs, one per graph and input signature)
  needs no such alignment: the choices before it may differ (resnet18 fp16, H100: batch 6's lowering
  asked a pool's choice with another key than batch 4's, and measured the baseline again, 0.15 s).
  Why: the choices hardly move with the batch (resnet18 fp16 on an H100, batch 1-34: the same for
  every convolution, pool and fused region; only the linear head moved, by margins under 1.2x),
  while measuring them is most of a bucket's first lowering.
- ``Padding``: a batch-independent graph (``fxopt.batch_independence``) run at a larger lowered
  size: the batch copied into a buffer of that size (rows past it zero, or finite values of an
  earlier call), the lowered graph run, the batched outputs' first rows returned: a view where the
  batch is the outermost dimension of the output in memory (its strides those of a fresh tensor),
  else a copy with the same layout.
- Chunks (``chunk_plan``, ``Padding.chunk_args``, ``ChunkOutputs``): a batch larger than every
  lowered size of a batch-independent graph, run as chunks of lowered sizes (the largest lowered
  size repeatedly, the rest padded onto the smallest lowered size that holds it), each chunk's
  batched outputs copied into the rows of an output of the whole batch right after its run (a
  CUDA-graph replay reuses its output buffers). That output has the strides of the first chunk's
  (its batch outermost, the other strides the same); where the first chunk's output is not laid
  out so, the chunks are declined and the batch's bucket top is lowered instead.
"""
from __future__ import annotations

import collections
import copy
import re
import weakref
from typing import Optional, Sequence

import torch

from fxopt.autotune import AutotuneCache
from fxopt.choices import RUNNER_PREFIX


def bucket(n: int) -> int:
    """The top of ``n``'s bucket: the smallest power of two >= n."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


_HASH = re.compile(r"[0-9a-f]{12,}")
_NUM = re.compile(r"\d+")


def signature(key: str) -> str:
    """A cache key with its numbers and hashes blanked: the same choice at another size."""
    return _NUM.sub("N", _HASH.sub("H", key))


#: a choice is taken unmeasured from an adjacent bucket where it won there by at least this factor
NEIGHBOUR_MARGIN = 1.1
#: a candidate that took this many times the fastest one's time at the nearest bucket measuring the
#: same choice (within ``LOSER_REACH`` times the batch) is not compiled to be measured again (the
#: cuda executor's measuring stops timing such a candidate anyway: ``PRUNE_FACTOR``)
LOSER_FACTOR = 10.0
LOSER_REACH = 8


def verdict(entry) -> Optional[tuple]:
    """``(choice, clear_by)`` of a stored choice: what it chose, and the next fastest timed
    alternative's time over the chosen one's (inf where nothing else was timed: the others failed
    their accuracy check or could not run). For a node's, region's or group's choice (``ms`` and
    ``choice``), a convolution algorithm's (``candidates`` and ``algorithm``) and a CUDA-graph
    runner's (``runs``, with the ``clear_by`` it stores itself); None for anything else (a runner's
    decision without ``clear_by`` too)."""
    if not isinstance(entry, dict):
        return None
    if "runs" in entry:  # (the cpu executor's runner states no clear_by: its choices are measured)
        clear = entry.get("clear_by")
        return (entry["runs"], float(clear)) if isinstance(clear, (int, float)) else None
    if isinstance(entry.get("ms"), dict) and "choice" in entry:
        choice, times = entry["choice"], entry["ms"]
    elif isinstance(entry.get("candidates"), dict) and "algorithm" in entry:
        choice, times = entry["algorithm"], entry["candidates"]
    else:
        return None
    times = {k: float(v) for k, v in times.items() if isinstance(v, (int, float)) and v > 0}
    if choice not in times:
        return choice, 1.0
    others = [v for k, v in times.items() if k != choice]
    return choice, (min(others) / times[choice] if others else float("inf"))


#: the field of a stored choice naming the bucket of the inputs it was measured at (``input_buckets``)
AT_FIELD = "input_buckets"


def input_buckets(shapes) -> str:
    """The bucket of a lowering's inputs: the shapes of its tensor arguments that have a symbolic
    size, every size bucketed, in order (resnet18 at 5x3x192x192 and at 6x3x224x224:
    ``"[(8, 4, 256, 256)]"``). Choices measured at inputs of one bucket serve every size in it."""
    return repr(sorted(tuple(bucket(int(d)) for d in s) for s in shapes))


def stamped(entry, at: Optional[str]):
    """``entry`` with the bucket of the inputs it was measured at (a copy; as it is without one)."""
    if at is None or not isinstance(entry, dict) or entry.get(AT_FIELD) == at:
        return entry
    return dict(entry, **{AT_FIELD: at})


def sibling_batch(key: str, other: str, batch: int) -> Optional[int]:
    """The batch ``other`` names where it is ``key`` at another batch of the same bucket: every number
    of ``key`` that differs in ``other`` is ``batch`` there and one same ``B`` here, ``bucket(B) ==
    bucket(batch)`` (hashes of generated sources may differ); else None."""
    if signature(key) != signature(other):
        return None
    found = None
    for a, b in zip(_NUM.findall(_HASH.sub("H", key)), _NUM.findall(_HASH.sub("H", other))):
        if a == b:
            continue
        if int(a) != batch or (found is not None and int(b) != found) or bucket(int(b)) != bucket(batch):
            return None
        found = int(b)
    return found


class BucketChoices(AutotuneCache):
    """The autotuning cache of one bucket's lowerings (module docstring). ``inner``: the user's cache;
    ``batch``: the first lowering's batch, to take what ``inner`` holds at another batch of the bucket
    (None: not looked for). The first lowering records; ``replayer()`` gives a later lowering's view."""

    def __init__(self, inner: AutotuneCache, batch: Optional[int] = None, neighbours: Sequence = (),
                 at: Optional[str] = None):
        super().__init__(None)
        self.inner, self.batch = inner, batch
        # the lowering's symbolic inputs' shapes, every size bucketed (``input_buckets``): stored with
        # what it measures, and what finds the same bucket's choices measured under another graph
        self.at = at
        self.counts = {"measured": 0, "cached": 0, "reused": 0, "from_sibling": 0, "from_neighbours": 0}
        self._by_signature: dict = {}  # device -> {signature: [inner's keys]}, built at the first miss
        # the buckets of other batches measured before: [(their batch bucket, their BucketChoices)]
        self.neighbours = list(neighbours) if batch is not None else []
        self.sequence: list = []  # (device, signature) of every choice asked for, in order
        self.asked: collections.Counter = collections.Counter()  # (device, signature) -> asks so far
        # ((device, signature), i-th ask of it) -> the entry given or measured for it: what a later
        # lowering's i-th ask of that signature gets (``_Replay``), and a neighbour's evidence
        self.answers: dict = {}
        self.derived: set = set()  # the answers taken from neighbours (never handed on)
        self._open: dict = collections.defaultdict(list)  # signature -> its asks missed, to be measured
        self._last: Optional[tuple] = None  # (ask, asks so far) of the last ask that missed

    def __deepcopy__(self, memo):  # options are copied with dataclasses.asdict: one cache
        return self

    def get(self, device: str, key: str) -> Optional[dict]:
        sig = (device, signature(key))
        ask = (sig, self.asked[sig])
        self.asked[sig] += 1
        self.sequence.append(sig)
        entry = self.inner.get(device, key)
        if entry is not None:
            self.counts["cached"] += 1
        else:
            entry = self._sibling(device, key)
        if entry is None:
            entry = self._neighbour(ask)
            if entry is not None:
                self.counts["from_neighbours"] += 1
                self.derived.add(ask)
        if entry is not None:
            self.answers[ask] = copy.deepcopy(entry)
        else:  # measured by the caller, which puts it (maybe after other asks: all asked before compiling)
            self._open[sig].append(ask)
            self._last = (ask, len(self.sequence))
        return entry

    def losers(self, device: str, key: str) -> set:
        """The candidates of the ask that just missed (``key``) that lost by ``LOSER_FACTOR`` or more
        (or were pruned) at the nearest bucket within ``LOSER_REACH`` that measured the same ask:
        the caller need not compile them to measure here."""
        if self._last is None or not self.neighbours or self._last[0][0] != (device, signature(key)):
            return set()
        (ask, n), mine, best = self._last, bucket(self.batch), None
        for b, other in self.neighbours:
            entry = other.answers.get(ask)
            if entry is None or ask in other.derived or other.sequence[:n] != self.sequence[:n]:
                continue
            reach = max(b / mine, mine / b)
            if reach <= LOSER_REACH and (best is None or reach < best[0]) and isinstance(entry.get("ms"), dict):
                best = (reach, entry)
        if best is None:
            return set()
        times = {k: v for k, v in best[1]["ms"].items() if isinstance(v, (int, float)) and v > 0}
        out = set(best[1].get("pruned") or ())
        if times:
            out |= {k for k, v in times.items() if v >= LOSER_FACTOR * min(times.values())}
        return out - {"reference"}

    def _neighbour(self, ask: tuple) -> Optional[dict]:
        """The choice of neighbouring buckets for this ask, where it is clear (module docstring)."""
        if not self.neighbours:
            return None
        mine, n = bucket(self.batch), len(self.sequence)
        # a CUDA-graph runner's decision (the optimized graph, or the baseline) is one per graph and
        # input signature, named by its signature: it needs no alignment of the choices before it
        whole = ask[0][1].startswith(RUNNER_PREFIX)
        below = above = None  # (batch bucket, entry, verdict) of the nearest measured on each side
        for b, other in self.neighbours:
            entry = other.answers.get(ask)
            if entry is None or ask in other.derived or (not whole and other.sequence[:n] != self.sequence):
                continue
            v = verdict(entry)
            if v is None:
                continue
            if b < mine and (below is None or b > below[0]):
                below = (b, entry, v)
            elif b > mine and (above is None or b < above[0]):
                above = (b, entry, v)
        if below is not None and above is not None and below[2][0] == above[2][0]:
            nearest = min((below, above), key=lambda c: max(c[0] / mine, mine / c[0]))
            return copy.deepcopy(nearest[1])
        for side in (below, above):
            if side is not None and max(side[0] / mine, mine / side[0]) <= 2 and side[2][1] >= NEIGHBOUR_MARGIN:
                return copy.deepcopy(side[1])
        return None

    def _sibling(self, device: str, key: str) -> Optional[dict]:
        """What the user's cache holds for ``key`` at the nearest other batch of this bucket; else
        what it holds for the same request measured at inputs of this bucket (``at``) under another
        graph (a symbolic graph of the same model Dynamo made later, with the sides symbolic too;
        another process's)."""
        if self.batch is None and self.at is None:
            return None
        if device not in self._by_signature:
            index = self._by_signature[device] = collections.defaultdict(list)
            for k in self.inner.keys(device):
                index[signature(k)].append(k)
        near, same = [], None
        for k in self._by_signature[device].get(signature(key), ()):
            b = sibling_batch(key, k, self.batch) if self.batch is not None and bucket(self.batch) > 1 else None
            if b is not None:
                near.append((abs(b - self.batch), -b, k))
            elif same is None and self.at is not None and k != key:
                stored = self.inner.get(device, k)
                if isinstance(stored, dict) and stored.get(AT_FIELD) == self.at:
                    same = k
        if not near and same is None:
            return None
        entry = self.inner.get(device, min(near)[2] if near else same)
        if entry is not None:
            self.counts["from_sibling"] += 1
        return copy.deepcopy(entry)

    def put(self, device: str, key: str, entry: dict) -> None:
        # (the same choice asked twice in one lowering, identical regions: measured once, put twice)
        held = self.inner.get(device, key)
        self.counts["cached" if held is entry else "measured"] += 1
        sig = (device, signature(key))
        if self._open.get(sig):  # the answer to the first ask of that signature that missed
            self.answers[self._open[sig].pop(0)] = copy.deepcopy(entry)
        if held is not entry:
            self.inner.put(device, key, stamped(entry, self.at))

    def replayer(self) -> "_Replay":
        return _Replay(self)


#: the buckets of the live dispatchers by the bucket of their inputs (with the model's tag), their user
#: cache and their scope (kind of graph, options): another graph of the same model (Dynamo's graph for
#: new image sizes, sides symbolic) replays a bucket an earlier graph lowered, the choices it took from
#: neighbours included, as a later lowering of that bucket does (a bucket lives while a dispatcher holds it)
_SHARED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def bucket_choices(buckets: dict, bid: tuple, key: tuple, batch_pos: Optional[int], user_cache: AutotuneCache,
                   at: Optional[str], scope: str) -> tuple:
    """``(the autotuning cache of a lowering at key, where its choices come from)``. ``buckets``: a
    dispatcher's, bucket id -> BucketChoices (updated); ``at``: the bucket of the lowering's inputs with
    the model's tag (None: not shared with other graphs). The first lowering of a bucket records (taking
    what its neighbouring buckets, ``batch_pos`` apart, agree on), a later one replays it."""
    if bid in buckets:
        return buckets[bid].replayer(), "its bucket's first lowering"
    shared = (at, user_cache.path or id(user_cache), scope) if at else None
    if shared is not None and _SHARED.get(shared) is not None:
        buckets[bid] = _SHARED[shared]
        return buckets[bid].replayer(), "another graph's lowering of its bucket"
    batch = key[batch_pos] if batch_pos is not None else None
    neighbours = [] if batch_pos is None else [
        (b[batch_pos], c) for b, c in buckets.items()
        if b[:batch_pos] + b[batch_pos + 1:] == bid[:batch_pos] + bid[batch_pos + 1:]]
    buckets[bid] = BucketChoices(user_cache, batch if isinstance(batch, int) else None, neighbours=neighbours, at=at)
    if shared is not None:
        _SHARED[shared] = buckets[bid]
    return buckets[bid], "measured here (first of its bucket)"


class _Replay(AutotuneCache):
    """A later lowering's view of its bucket's choices: the i-th request of a signature gets the
    answer to the first lowering's i-th request of it; what the bucket does not hold goes to the
    user's cache."""

    def __init__(self, source: BucketChoices):
        super().__init__(None)
        self.source = source
        self.asked: collections.Counter = collections.Counter()
        self.counts = {"measured": 0, "cached": 0, "reused": 0}

    def __deepcopy__(self, memo):
        return self

    def get(self, device: str, key: str) -> Optional[dict]:
        sig = (device, signature(key))
        entry = self.source.answers.get((sig, self.asked[sig]))
        self.asked[sig] += 1
        if entry is not None:
            self.counts["reused"] += 1
            return copy.deepcopy(entry)
        entry = self.source.inner.get(device, key)
        if entry is not None:
            self.counts["cached"] += 1
        return entry

    def put(self, device: str, key: str, entry: dict) -> None:
        self.counts["measured"] += 1
        self.source.inner.put(device, key, stamped(entry, self.source.at))


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without gaps or overlap (a dense layout)."""
    expect = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda p: p[1]):
        if stride != expect:
            return False
        expect *= size
    return True


class Padding:
    """Runs batch ``b`` on a graph lowered at batch ``B >= b`` (``plan``: a ``BatchPlan``)."""

    def __init__(self, plan):
        self.plan = plan
        self.buffers: dict = {}  # (B, argument index) -> (buffer, rows written by the last call)

    def pad_args(self, args, to: int, copy: bool = False) -> list:
        """The arguments at batch ``to``: batched tensors copied into a buffer of that batch (also
        those already of batch ``to`` with ``copy``)."""
        out = list(args)
        for i, how in self.plan.args.items():
            a = args[i]
            if how == "size":
                out[i] = to
                continue
            b = a.shape[0]
            if b == to and not copy:
                continue
            key = (to, i)
            buf, rows = self.buffers.get(key, (None, 0))
            shape = (to, *a.shape[1:])
            if buf is None or buf.shape != shape or buf.dtype != a.dtype or buf.device != a.device \
                    or buf.stride() != _strides_like(a, shape):
                buf = torch.empty_strided(shape, _strides_like(a, shape), dtype=a.dtype, device=a.device)
                buf.zero_()
                rows = 0
            buf[:b].copy_(a)
            if rows > b:  # rows an earlier, larger batch wrote: zero again
                buf[b:rows].zero_()
            self.buffers[key] = (buf, b)
            out[i] = buf
        return out

    def chunk_args(self, args, start: int, rows: int, to: int) -> list:
        """The arguments of rows ``start .. start + rows`` at batch ``to >= rows``: a chunk that does
        not start at row 0 is copied into the buffer of batch ``to`` (what a padded run passes)."""
        sub = list(args)
        for i, how in self.plan.args.items():
            if how != "size":
                sub[i] = args[i][start:start + rows]
        return self.pad_args(sub, to, copy=start > 0)

    def slice_outputs(self, outs, b: int):
        """The batched outputs' first ``b`` rows, with the strides a fresh tensor of that size has."""
        seq = outs if isinstance(outs, (list, tuple)) else [outs]
        res = []
        for o, batched in zip(seq, self.plan.outputs):
            if batched and isinstance(o, torch.Tensor):
                o = o[:b]
                if not _dense(o):
                    o = torch.empty_like(o).copy_(o)  # keeps the layout's dimension order, dense
            res.append(o)
        res.extend(seq[len(res):])
        if isinstance(outs, (list, tuple)):
            return type(outs)(res) if isinstance(outs, tuple) else res
        return res[0]

    def release(self, to: int) -> None:
        for key in [k for k in self.buffers if k[0] == to]:
            del self.buffers[key]


def _strides_like(a: torch.Tensor, shape) -> tuple:
    """Strides of a dense tensor of ``shape`` laid out like ``a`` (its dimensions' order in memory)."""
    if a.dim() == 4 and a.is_contiguous(memory_format=torch.channels_last) and not a.is_contiguous():
        return torch.empty(shape, device="meta").to(memory_format=torch.channels_last).stride()
    return torch.empty(shape, device="meta").stride()


def chunk_plan(b: int, sizes) -> Optional[list]:
    """``[(start, rows, to), ...]``: batch ``b`` as chunks run at the lowered batches ``sizes`` (the
    largest repeatedly, the rest padded onto the smallest that holds it); None where a lowered size
    holds ``b`` (a padded run) or the largest is 1 (no layout of a batch to copy the chunks into)."""
    sizes = sorted(set(int(s) for s in sizes))
    if not sizes or sizes[-1] >= b or sizes[-1] < 2:
        return None
    big, start, runs = sizes[-1], 0, []
    while b - start >= big:
        runs.append((start, big, big))
        start += big
    if start < b:
        rest = b - start
        runs.append((start, rest, min(s for s in sizes if s >= rest)))
    return runs


def describe_chunks(runs: list) -> str:
    """"3 runs of sizes 16, 16, 8 (padded to 16)" for the report."""
    parts = [f"{rows}" if rows == to else f"{rows} (padded to {to})" for _, rows, to in runs]
    return f"{len(runs)} runs of sizes {', '.join(parts)}"


def _batch_outermost(t: torch.Tensor) -> bool:
    """Whether ``t`` is dense with its dimension 0 outermost in memory (rows of equal layout)."""
    inner = 1
    for s in t.shape[1:]:
        inner *= int(s)
    return t.dim() >= 1 and t.shape[0] >= 2 and inner > 0 and _dense(t) and t.stride(0) == inner


class ChunkOutputs:
    """The outputs of batch ``b`` assembled from chunks (``flags``: per output whether it is batched).
    ``add`` copies a chunk's batched rows out at once and returns why the chunks cannot be joined
    (None: they can); ``result`` gives the outputs in the structure the graph returns."""

    def __init__(self, flags: list, b: int):
        self.flags, self.b = list(flags), b
        self.outs: Optional[list] = None
        self.kind = None

    def add(self, outs, start: int, rows: int, to: int) -> Optional[str]:
        seq = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        if len(seq) != len(self.flags):
            return f"{len(seq)} outputs where the graph has {len(self.flags)}"
        if self.outs is None:
            why = self._allocate(outs, seq, to)
            if why:
                return why
        for o, full, batched in zip(seq, self.outs, self.flags):
            if not batched:
                continue
            if not isinstance(o, torch.Tensor) or o.dim() < 1 or o.shape[0] != to \
                    or o.shape[1:] != full.shape[1:] or o.dtype != full.dtype or o.device != full.device:
                return "a chunk's output differs from the first chunk's"
            full[start:start + rows].copy_(o[:rows])
        return None

    def _allocate(self, outs, seq: list, to: int) -> Optional[str]:
        self.kind = type(outs) if isinstance(outs, (list, tuple)) else None
        res = []
        for o, batched in zip(seq, self.flags):
            if not batched:
                res.append(o)  # batch-free: the same in every chunk
                continue
            if not isinstance(o, torch.Tensor) or o.dim() < 1 or o.shape[0] != to:
                return "a batched output is not a tensor of the chunk's batch"
            if not _batch_outermost(o):
                return f"an output's batch is not its outermost dimension in memory (strides {tuple(o.stride())})"
            res.append(torch.empty_strided((self.b, *o.shape[1:]), o.stride(), dtype=o.dtype, device=o.device))
        self.outs = res
        return None

    def result(self):
        if self.kind is None:
            return self.outs[0]
        return self.kind(self.outs) if issubclass(self.kind, tuple) else list(self.outs)
