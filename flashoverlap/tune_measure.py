"""What the tuner's cost model is fed, measured on the GPUs (under torchrun): collectives by size
on the communicators an overlapped call uses, the adds and copies a call makes on its own, pulls,
and the host's time to enqueue a call. Each is measured once per run and shape-independent but
for the host's time; every rank measures the same variants in the same order (timing.time_variants).
"""

from __future__ import annotations

import functools
import math
import statistics
import time

import torch
import torch.distributed as dist

from . import comm, overlap
from .config import resolve
from .inputs import FP8_DTYPES
from .plan import Plan, make_plan
from .prepared import prepare
from .rules import for_call
from .timing import time_variants
from .tune_model import CommModel, HostModel, fit_comm, fit_host

COMM_SIZES_MB = (1, 2, 4, 8, 16, 32, 64)
# Groups a measured pull call copies between two claims: a call claims once and pulls every group,
# so the claim's waits and flags are a call's, not a group's (timed one group per claim, they made
# a 17-group call 2.3x too slow: docs/experiments.md, the tuner)
PULL_GROUPS = 8


@functools.cache
def local_model(collective: str, dtype, rounds: int) -> CommModel:
    """Time by size of what stays on the rank: in the ``rows`` layout of reduce-scatter /
    all-to-all the own rows, added into the result or copied there (the copy, "all_to_all", also
    prices what comm.finish_group copies into place: ``cols`` blocks, a ``segments`` all-to-all's
    rows); for a ``local`` all-reduce (``collective`` "all_gather") the sum of the world's
    gathered partial sums (bytes: of the sum)."""

    elem, world = torch.finfo(dtype).bits // 8, dist.get_world_size()

    def make(mb: int):
        x, y = (torch.randn((mb << 20) // elem, device="cuda").to(dtype) for _ in range(2))
        if collective == "all_gather":
            parts = torch.randn(world, x.numel(), device="cuda").to(dtype)
            return (lambda i: comm.add_rows(parts, x)), x.numel() * elem
        op = x.add_ if collective == "reduce_scatter" else x.copy_
        return (lambda i: op(y)), x.numel() * elem

    return fit_sizes(f"local {collective}", make, rounds)


def fit_sizes(label: str, make, rounds: int, graphs: bool = False) -> CommModel:
    """:func:`fit_comm` of what ``make(mb)`` returns, a (timing variant, bytes) pair for each of
    COMM_SIZES_MB, measured together; named by ``label``, so that ranks measuring different
    things fail in time_variants instead of deadlocking. ``graphs``: timed as CUDA-graph replays
    (the GPU's time alone), eagerly where a variant could not be captured."""

    variants, sizes = {}, []
    for mb in COMM_SIZES_MB:
        variants[f"{label} {mb}MB"], nbytes = make(mb)
        sizes.append(nbytes)
    times = time_variants(variants, rounds, 4, 2, graphs=graphs)
    if graphs and any(math.isnan(t) for t in times.values()):  # (alike on every rank: NaN everywhere)
        times = time_variants(variants, rounds, 4, 2)
    return fit_comm(sizes, [times[name] for name in variants])


@functools.cache
def comm_model(pattern: str, comm_sms: int, dtype, rounds: int, symmetric: bool = False) -> CommModel:
    """Time by size of a collective (or ``exchange`` / ``all_gather`` / ``pull``, see
    rules.comm_pattern) on the whole world: on the communicator an overlapped call uses while
    its GEMM runs, NCCL held to ``comm_sms`` SMs (0 without ``symmetric``: the default communicator,
    as for the last group), buffers in a symmetric window where ``symmetric`` (all-to-all and
    all-gather then on the copy engines, as the runtime does); ``pull`` / ``pull_scatter``: a pull
    all-reduce's group alone (:func:`pull_model`: no NCCL; one model whatever ``comm_sms``). The same
    for every shape, so measured once per run."""

    if pattern in comm.PULLS:  # (one model for every comm_sms: each measurement maps memory on every rank)
        return pull_model(dtype, rounds, "pull" if pattern == "pull_fused" else pattern)  # (fused: copies alone)

    group = comm.budget_group(dist.group.WORLD, comm_sms, copy_engine=symmetric and pattern in comm.COPY_ENGINE)
    world, me, elem = dist.get_world_size(), dist.get_rank(), torch.finfo(dtype).bits // 8
    device = torch.device("cuda", torch.cuda.current_device())

    def exchange(data, into):
        ops = [
            dist.P2POp(dist.isend, data, (me + 1) % world, group),
            dist.P2POp(dist.irecv, into, (me - 1) % world, group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    def make(mb: int):
        rows = max(world, (mb << 20) // (1024 * elem) // world * world)
        shapes = [(rows, 1024), (world * rows if pattern == "all_gather" else rows, 1024)]
        if not symmetric:
            alloc = lambda shape: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
        else:  # a window of its own per size: the sizes are measured side by side
            alloc = comm.nccl.Window([group], device).allocator(
                sum(comm.nccl.carved_bytes(shape, dtype) for shape in shapes), dtype
            )
        data, into = (alloc(shape) for shape in shapes)
        data.copy_(torch.randn(rows, 1024, device=device))
        if pattern == "exchange":
            return (lambda i: exchange(data, into)), rows * 1024 * elem
        if pattern == "all_gather":
            return (lambda i: comm.all_gather_single(into, data, group)), rows * 1024 * elem
        ex = comm.exchange(pattern, rows, world)
        return (lambda i: comm.collective(ex, data, group, into[: ex.rows])), rows * 1024 * elem

    return fit_sizes(f"{pattern}{' symmetric' if symmetric else ''}", make, rounds)


@functools.cache
def pull_model(dtype, rounds: int, reduction: str = "pull") -> CommModel:
    """Time by size of a ``pull`` / ``pull_scatter`` all-reduce's group, measured once per run, alone
    (on every SM), as :data:`PULL_GROUPS` groups of a call (:func:`_pulls`) replayed as a CUDA graph:
    a call's host enqueues its groups while its GEMM runs, so only the GPU's time counts, and one
    claim per call. A reduce-scatter's pull is priced from the ``pull`` all-reduce's copies (its rows
    are copied too, then summed locally: tune_predict.pull_counts' share)."""
    calls = fit_sizes(reduction, _pulls(dtype, reduction), rounds, graphs=True)  # (bytes: of a call's groups)
    per = 1.0 / PULL_GROUPS
    return CommModel(calls.latency_ms * per, calls.bytes_per_ms, tuple((b * per, t * per) for b, t in calls.points))


def pull_plan(numel: int) -> Plan:
    """The groups :func:`_pulls` measures ``numel`` elements in: :data:`PULL_GROUPS` equal row bands
    (1024-element rows, one wave of 64-row tiles each)."""
    rows = numel // 1024
    return make_plan(
        rows, 1024, tile_m=64, tile_n=1024, cluster_m=1, ctas=rows // 64 // PULL_GROUPS, partition=(1,) * PULL_GROUPS
    )


def _pulls(dtype, reduction: str = "pull"):
    """``make(mb)`` for :func:`fit_sizes`: the copies a ``pull`` all-reduce makes of
    :data:`PULL_GROUPS` groups of that size together, with the waits that order them (comm._pull,
    comm.peer.Peers.arrivals), in memory of its own, each group counted (as the GEMM would) and the
    call claimed and released as a call is (Peers.mark / copied / claim): without that a rank ran a
    measurement ahead, set a flag the other had not cleared yet (one signal lost), and the other
    waited for it forever (the tuner hung so on 2x H100 and 2x H200). A ``pull_scatter``'s groups:
    the waits, each share's sum reading the other ranks' memory in place and the other shares'
    copies (comm.communicate_group, finish_group, gather_group)."""

    device, elem = torch.device("cuda", torch.cuda.current_device()), torch.finfo(dtype).bits // 8

    def make(mb: int):
        peers = comm.peer.Peers(dist.group.WORLD, device)  # (collective: every rank makes the same sizes)
        chunk = peers.buffer((mb << 20) // elem, dtype).copy_(torch.randn((mb << 20) // elem, device=device))
        into = torch.empty(peers.world, chunk.numel(), dtype=dtype, device=device)
        plan = pull_plan(chunk.numel())
        peers.targets = (1,) * plan.num_groups
        ex = comm.exchange("all_reduce", plan.m, peers.world, reduction=reduction)
        _, _, recv = comm.buffers(ex, plan, lambda shape: torch.empty(shape, dtype=dtype, device=device), chunk)
        out = torch.empty(plan.m, plan.n, dtype=dtype, device=device)

        def call(i: int) -> None:
            for g, (lo, hi) in enumerate(zip(plan.bounds, plan.bounds[1:])):
                peers.mark(g)
                if reduction == "pull":
                    comm._pull(peers, g, chunk[lo:hi], into[:, lo:hi])
                else:
                    comm.communicate_group(ex, plan, g, chunk, recv, out, peers)
                    comm.finish_group(ex, plan, g, chunk, recv, out, peers)
                    comm.gather_group(ex, plan, g, chunk, out, peers)
            peers.copied()
            peers.claim()

        return call, chunk.numel() * elem

    return make


def tail_model(pattern: str, dtype, rounds: int, symmetric: bool) -> CommModel:
    """:func:`comm_model` on the full communicator (the last group's), where the copy-engine
    patterns of :func:`comm_model` run NCCL's usual kernels on every SM."""

    return comm_model(pattern, 0, dtype, rounds, symmetric and pattern not in comm.COPY_ENGINE)


def host_model(
    collective: str, a, w, candidate: dict, num_waves: int, kwargs: dict | None = None, calls: int = 10
) -> HostModel:
    """Host time to enqueue one call (nothing waits for the GPU), with one group and with one
    group per wave (as many as the layout makes of them); every rank makes the same calls
    (``kwargs``: the calls' FP8 arguments, bench.fp8_arguments)."""
    kwargs = kwargs or {}
    fp8 = a[0].dtype in FP8_DTYPES

    overlapped = getattr(overlap, f"gemm_{collective}")
    (m, k), n = a[0].shape, w[0].shape[0]
    counts, times = [], []
    for partition in dict.fromkeys([(num_waves,), (1,) * num_waves]):  # one entry when a single wave
        # resolved once, as a registry entry is: its calls take the fast path a user's repeats take
        cfg = resolve({**candidate, "partition": list(partition)}, fp8)
        for i in range(3):  # plan, agreement and communicators first
            overlapped(a[i % len(a)], w[i % len(w)], config=cfg, **kwargs)
        torch.cuda.synchronize()
        spent = []
        for i in range(calls):
            start = time.perf_counter()
            overlapped(a[i % len(a)], w[i % len(w)], config=cfg, **kwargs)
            spent.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        ex = comm.exchange(collective, m, dist.get_world_size())
        resolved = for_call(cfg, ex, (m, n, k))
        segments = comm.interleave(ex, resolved.layout, resolved.reduction)
        counts.append(prepare(m, n, k, a[0].dtype, "nk", a[0].device, resolved, interleave=segments).plan.num_groups)
        times.append(statistics.median(spent))
    # the slowest rank's times, so that every rank predicts (and so plans) the same calls
    times = torch.tensor(times, dtype=torch.float64, device=a[0].device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.tolist()
    # a single possible group count: its time is all there is to know
    return fit_host(counts, times) if len(set(counts)) > 1 else HostModel(base_ms=times[-1])
