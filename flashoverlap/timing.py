"""Timing GEMM + collective variants on GPUs, as bench, tune and a call's first-use trial do.

Variants take turns round by round (so drift hits all alike, :func:`balanced_orders`), after
warm-up, timed with CUDA events over blocks of back-to-back calls (the host running ahead, as in
a model); a variant's time per call is the median over rounds, the largest over ranks.
``graphs``: each variant's block is captured once as a CUDA graph and its replays are timed
instead: GPU time alone, for every variant alike.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import comm, signal
from .inputs import FP8_DTYPES, Scales, epilogue

log = logging.getLogger(__name__)


ROUND_FLOP = 2**41  # GEMM work a timed round aims for (round_calls)
ROUND_CALLS = (4, 16)  # the fewest and most calls per round round_calls gives by default


def round_calls(m: int, n: int, k: int, fewest: int = ROUND_CALLS[0], most: int = ROUND_CALLS[1]) -> int:
    """Calls per timed round of an M x N x K call: enough that a round holds :data:`ROUND_FLOP` of
    GEMM work, within [``fewest``, ``most``] (FP8 GEMMs, about twice as fast, get the rounds of a
    16-bit GEMM of their size). A round is timed between two events on the GPU, which is idle at its
    start where the host sets the pace (short calls): the round then also holds the last call's GPU
    time after the host enqueued it, about one call more of a host-bound variant (a plain call) and
    less of one whose GPU work runs behind the host (an overlapped call). In few calls per round that
    weighs against the plain call; long calls keep short rounds (a first-use trial costs a few of
    them). docs/experiments.md, "Calls not tuned for their shape"."""
    return min(most, max(fewest, -(-ROUND_FLOP // max(2 * m * n * k, 1))))


def median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def input_sets(m: int, n: int, k: int, dtype: torch.dtype, l2_bytes: int) -> int:
    """How many operand sets to rotate through so that consecutive iterations miss in L2."""
    per_set = (m * k + n * k) * torch.finfo(dtype).bits // 8
    return max(2, math.ceil(3 * l2_bytes / per_set))


def operand_sets(
    m: int, n: int, k: int, dtype: torch.dtype, hot: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random operand sets (a [m, k], weight [n, k]) to rotate through, larger than L2 together;
    ``hot``: one set, read by every call (a layer's activations sit in L2). The weights are scaled by
    1 / sqrt(k), but FP8 ones (whose scale_b carries that: they would underflow)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    sets = 1 if hot else input_sets(m, n, k, dtype, props.L2_cache_size)
    gen = torch.Generator(device="cuda").manual_seed(1234 + dist.get_rank())
    norm = 1.0 if dtype in FP8_DTYPES else math.sqrt(k)
    a = [torch.randn(m, k, device="cuda", generator=gen).to(dtype) for _ in range(sets)]
    w = [(torch.randn(n, k, device="cuda", generator=gen) / norm).to(dtype) for _ in range(sets)]
    return a, w


def kernel_alone(
    prep, a: Sequence[torch.Tensor], w: Sequence[torch.Tensor], scales: Scales | None = None
) -> Callable[[int], None]:
    """A timing variant: the signal GEMM of ``prep`` alone (no waits, no collectives) on operand
    set ``i % len(a)``, into a scratch buffer, counters reset after each call (FP8 operands: scaled
    by ``scales``, inputs.Scales.epilogue)."""
    buf = torch.empty(prep.plan.numel, dtype=prep.out_dtype, device=a[0].device)
    scaled = epilogue(scales)

    def run(i: int) -> None:
        stream = torch.cuda.current_stream()
        prep.launch(a[i % len(a)], w[i % len(w)], buf, stream, None, *scaled)
        signal.reset(prep.counters, stream)

    return run


def time_variants(
    variants: dict[str, Callable[[int], object]],
    rounds: int,
    block: int,
    warmup: int,
    group: dist.ProcessGroup | None = None,
    graphs: bool = False,
) -> dict[str, float]:
    """Steady-state ms per call for each variant: the median over rounds, the largest over the
    ranks of ``group`` (:func:`time_samples`, :func:`slowest`)."""
    return {
        name: slowest(ranks) for name, ranks in time_samples(variants, rounds, block, warmup, group, graphs).items()
    }


def time_samples(
    variants: dict[str, Callable[[int], object]],
    rounds: int,
    block: int,
    warmup: int,
    group: dist.ProcessGroup | None = None,
    graphs: bool = False,
    host_floor: bool = False,
) -> dict[str, list[list[float]]]:
    """Every rank's ms per call of each variant, round by round: ``{name: [rank 0's rounds, ...]}``,
    alike on every rank of ``group``.

    Each round times ``block`` calls of one variant back to back between two CUDA events, the
    host free to run ahead as in a model's forward pass (launch overhead counts only where it
    stalls the GPU); variants take turns round by round so drift hits all of them alike, in
    :func:`balanced_orders` (``rounds`` rounded up to whole cycles of them): every variant follows
    every other equally often. (In one fixed order identical work measured up to 5 % apart; in
    ten shuffled ones the later of two identical variants measured 1-3 % faster in every run on
    two H100s: a block inherits the GPU's state from the one before it.) Every rank must pass the
    same variants in the same order: checked first, so that a divergence is an error on every rank
    instead of a hang.
    ``graphs``: each variant's block is captured once (after the warm-up) as one CUDA graph and a
    round replays it: GPU time alone, as in a model captured in CUDA graphs. A variant that cannot
    be captured on some rank has NaN rounds on every rank.
    ``host_floor`` (eager): a round's time per call is at least the host's time to enqueue it. A
    call whose host work outlasts its GPU work (a short pull's dozens of stream operations) runs at
    the host's pace once such calls follow each other, which a round that starts behind the work
    the round before it queued can hide: what decides which path to take counts the host.
    """

    if graphs and warmup < 1:
        raise ValueError("timing CUDA graphs needs a warm-up call of every variant before capture")
    torch.cuda.synchronize()
    comm.agree(group, "time_variants: " + ", ".join(variants), torch.device("cuda", torch.cuda.current_device()))
    for i in range(warmup):
        for fn in variants.values():
            fn(i)
    torch.cuda.synchronize()
    if graphs:  # a variant some rank could not capture is dropped on every rank
        runs = {name: _captured(name, fn, block) for name, fn in variants.items()}
        missing = torch.tensor([run is None for run in runs.values()], dtype=torch.float64, device="cuda")
        dist.all_reduce(missing, op=dist.ReduceOp.MAX, group=group)
        runs = {name: run for (name, run), gone in zip(runs.items(), missing.tolist()) if not gone}
    else:
        runs = {name: _eager(fn, block) for name, fn in variants.items()}
    dist.barrier(group=group)
    names = random.Random(0).sample(list(runs), len(runs))  # their places in the design, alike on every rank
    orders = balanced_orders(len(names))
    total = whole_cycles(rounds, len(names))
    events = []
    with without_collections():
        for r in range(total):
            for name in (names[v] for v in orders[r % len(orders)]):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                began = time.perf_counter()
                runs[name](r)
                enqueued_ms = (time.perf_counter() - began) * 1e3 if host_floor and not graphs else 0.0
                end.record()
                events.append((name, start, end, enqueued_ms))
        torch.cuda.synchronize()
    table = torch.full((len(variants), total), math.nan, dtype=torch.float64)
    row = {name: v for v, name in enumerate(variants)}
    done = dict.fromkeys(runs, 0)
    for name, start, end, enqueued_ms in events:
        table[row[name], done[name]] = max(start.elapsed_time(end), enqueued_ms) / block
        done[name] += 1
    world = dist.get_world_size(group)  # (gathered along dim 0, as gloo requires, then split by rank)
    every = torch.empty((world * table.shape[0], table.shape[1]), dtype=table.dtype, device="cuda")
    comm.all_gather_single(every, table.cuda(), group=group)
    per_rank = every.view(world, *table.shape).tolist()
    return {name: [rank[v] for rank in per_rank] for v, name in enumerate(variants)}


@contextlib.contextmanager
def without_collections():
    """Python's garbage collector off inside (as ``timeit`` runs) and back as it was after: where the
    host sets the pace (eager calls of a few tens of microseconds), a collection pauses whichever
    variant's block it falls in, and a full one over a model's objects takes milliseconds. (No
    collection first: in a process holding a model, the first-use trial would wait for it.)"""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def slowest(ranks: Sequence[Sequence[float]]) -> float:
    """A variant's time from every rank's rounds (:func:`time_samples`): the slowest rank's median
    (NaN where any is)."""
    medians = [median_ms(rounds) for rounds in ranks]
    return math.nan if any(math.isnan(t) for t in medians) else max(medians)


def paired_speedup(base: Sequence[Sequence[float]], other: Sequence[Sequence[float]]) -> float:
    """How much faster than ``base`` a variant ``other`` ran (:func:`time_samples`' rounds of the
    two): on each rank the median over rounds of base's time over other's in the same round (one
    turn of every variant), the least over the ranks (the slowest rank's view, as :func:`slowest`;
    NaN where any rank's is). A host-bound call's host speed moves between levels over seconds (the
    same launches took 12 and 20 us per call on one GPU host, in runs of rounds), so two medians
    taken apart carry that luck: identical variants measured up to 20 % apart on 0.05-0.1 ms calls.
    In one turn both mostly run at one level, which narrowed identical variants' worst case to 3-8 %
    on those calls (docs/experiments.md, Measuring)."""
    ratios = [median_ms(rank) for rank in _round_ratios(base, other)]
    return math.nan if any(math.isnan(r) for r in ratios) else min(ratios)


def _round_ratios(base: Sequence[Sequence[float]], other: Sequence[Sequence[float]]) -> list[list[float]]:
    """Per rank, base's time over other's in each round (the pairs behind :func:`paired_speedup`)."""
    return [[b / o for b, o in zip(bs, os)] for bs, os in zip(base, other)]


def spread(ranks: Sequence[Sequence[float]]) -> float:
    """How far apart a variant's rounds lie (:func:`time_samples`), as a fraction of their median:
    half the range of the widest rank's, without its slowest and fastest round where it has four or
    more (NaN where any rank's rounds are). One stray round (a page fault, a clock change, another
    process's kernel) moves a median little but a range a lot, and made clear wins of the first-use
    trial look like noise (docs/experiments.md, Calls not tuned for their shape)."""

    def width(rounds: Sequence[float]) -> float:
        kept = sorted(rounds)[1:-1] if len(rounds) >= 4 else rounds
        return (max(kept) - min(kept)) / (2 * median_ms(rounds))

    widths = [width(rounds) for rounds in ranks]
    return math.nan if any(math.isnan(w) for w in widths) else max(widths)


def paired_spread(base: Sequence[Sequence[float]], other: Sequence[Sequence[float]]) -> float:
    """How far apart the per-round ratios of :func:`paired_speedup` lie (:func:`spread` of base's
    time over other's, round by round): the noise of a paired speedup, which the host's drift
    between turns, moving both variants of a turn alike, does not widen."""
    return spread(_round_ratios(base, other))


def paired_interval(
    base: Sequence[Sequence[float]], other: Sequence[Sequence[float]], level: float = 0.95, resamples: int = 2000
) -> tuple[float, float]:
    """A bootstrap interval at ``level`` for :func:`paired_speedup` of ``other`` over ``base``: the
    rounds redrawn with replacement, the same rounds for every rank (a round is one turn of every
    variant on every rank), the same draws every time (seeded); over the rounds every rank has of
    both. It says how far one run pins a shape's speedup down: the worst of many shapes is often a
    tail of their noise. Not a calibrated test: rounds are not independent draws (the host's speed
    persists over seconds), and the least over ranks of noisy medians leans low, more so the more
    ranks, so an interval wholly below a floor overstates a loss, and one not below it is the
    safer reading. (NaN, NaN where a round's time is NaN or there are no rounds.)"""
    pairs = _round_ratios(base, other)
    rounds = min((len(r) for r in pairs), default=0)
    ratios = np.array([r[:rounds] for r in pairs], dtype=float)
    if rounds == 0 or np.isnan(ratios).any():
        return math.nan, math.nan
    draws = np.random.default_rng(0).integers(0, rounds, size=(resamples, rounds))
    stats = np.median(ratios[:, draws], axis=2).min(axis=0)  # (the slowest rank's view, as paired_speedup)
    low, high = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def whole_cycles(rounds: int, variants: int) -> int:
    """``rounds`` rounded up to whole cycles of :func:`balanced_orders` of ``variants``: how many
    rounds :func:`time_samples` times."""
    cycle = len(balanced_orders(variants))
    return -(-rounds // cycle) * cycle if cycle else 0


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` variants (a Williams design) in which each comes first equally often and
    directly after every other equally often: ``n`` orders for even ``n``, ``2n`` for odd (the
    first ``n`` reversed too), so that what a timed block inherits from the one before it (the
    clocks a power-hungry GEMM leaves, say) falls on every variant alike."""
    base, low, high = [0], 1, n - 1
    while low <= high:  # 0, 1, n-1, 2, n-2, ...
        base.append(low)
        low += 1
        if low <= high:
            base.append(high)
            high -= 1
    orders = [[(v + shift) % n for v in base] for shift in range(n)]
    return orders if n % 2 == 0 or n == 1 else orders + [order[::-1] for order in orders]


def _eager(fn: Callable[[int], object], block: int) -> Callable[[int], None]:
    """Round ``r`` of a variant: ``block`` calls on operand sets rotated from ``r * block``."""

    def run(r: int) -> None:
        for i in range(block):
            fn(r * block + i)

    return run


def _captured(name: str, fn: Callable[[int], object], block: int) -> Callable[[int], None] | None:
    """A round of a variant as one replay of its block of calls captured in a CUDA graph (operand
    sets 0 .. block - 1, the same every round), or None where it cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(block):
                fn(i)
    except Exception as exc:  # report it, time the rest (every rank drops the variant)
        log.warning("%s: not captured in a CUDA graph: %s: %s", name, type(exc).__name__, exc)
        return None
    return lambda r: graph.replay()
