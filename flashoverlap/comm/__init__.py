"""Per-group collectives on contiguous buffer ranges, and the restore to row-major C.

Communication is plain torch.distributed (NCCL on GPUs, gloo in the CPU reference executor) on
one contiguous range per group, so any backend and transport works; on flashoverlap's own NCCL
communicators through NCCL's C API where torch's NCCL allows (:mod:`comm.nccl`, ``FLASHOVERLAP_NCCL``).
The exception, ``reduction: pull`` / ``pull_scatter``: where the ranks have peer access, copies out of
the other ranks' memory on the copy engines, and sums reading it in place (``pull_scatter``, a
reduce-scatter's pull) (:mod:`comm.peer`: NCCL's kernels take SMs from the GEMM).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

from .. import enqueue, state
from ..plan import Plan
from ..rules import COLLECTIVES as COLLECTIVES
from ..rules import COPY_ENGINE as COPY_ENGINE
from ..rules import EQUAL_SEGMENTS as EQUAL_SEGMENTS
from ..rules import PULLS as PULLS
from ..rules import REDUCTIONS as REDUCTIONS
from ..rules import check_layout as check_layout
from ..rules import comm_pattern as comm_pattern
from ..rules import reads_in_place as reads_in_place
from ..rules import rows_carry as rows_carry
from ..rules import tail_apart as tail_apart
from .exchange import Exchange as Exchange
from .exchange import _device_for
from .exchange import all_gather_single as all_gather_single
from .exchange import exchange as exchange
from .exchange import reduce_scatter_single as reduce_scatter_single
from .exchange import with_reduction as with_reduction
from .moves import ADD_DTYPES as ADD_DTYPES
from .moves import MAX_PITCH as MAX_PITCH
from .moves import MAX_SUM as MAX_SUM
from .moves import add as add
from .moves import add_rows as add_rows
from .moves import copy_2d as copy_2d
from .moves import restore as restore
from .nccl import CTA_POLICY_ZERO, Direct, cuda_backend, unavailable
from .peer import Peers as Peers
from .peer import Pulls

DEFAULT_TIMEOUT_S = 600.0  # a group whose backend says no timeout (torch's NCCL default)

VECTOR = 8  # elements a share of a group is made of (16-byte vectors of bf16 / fp16: fo_sum's loads, the copies)
# how an overlapped call's per-group collectives reach NCCL (FLASHOVERLAP_NCCL), the default first:
# its C API (:class:`comm.nccl.Direct`: ~25 against ~80-100 us of host time per collective through
# c10d on the H100 host, for the same GPU time) or c10d
NCCL_PATHS = ("direct", "c10d")


def agree(group: dist.ProcessGroup | None, description: str, device: torch.device) -> None:
    """Check that every rank of ``group`` describes the same call; raise on all of them if not.

    Ranks that planned different calls (shape, dtype, config, partition) would otherwise issue
    collectives of different sizes and wait for each other forever. One all-gather of a hash,
    with a host sync: meant for the first call of each plan, not every call.
    """
    digest = int.from_bytes(hashlib.sha256(description.encode()).digest()[:8], "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=_device_for(group, device))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    hashes = [int(t.item()) for t in gathered]
    if len(set(hashes)) > 1:
        groups = {}
        for rank, h in enumerate(hashes):
            groups.setdefault(h, []).append(rank)
        raise RuntimeError(
            "flashoverlap: ranks planned different calls (ranks grouped by plan: "
            f"{sorted(groups.values())}); this rank ({dist.get_rank(group)}) planned: {description}"
        )


def budget_group(group: dist.ProcessGroup, comm_sms: int, copy_engine: bool = False) -> dist.ProcessGroup:
    """An NCCL communicator over ``group``'s ranks whose kernels fit in ``comm_sms`` SMs.

    While the GEMM holds the other SMs, NCCL kernels get only the ``comm_sms`` left free. A
    default communicator launches more CTAs than that, in clusters of 4 on Hopper (which need 4
    free SMs in one GPC), and crawls until the GEMM ends. This one is capped at ``comm_sms``
    single CTAs; with ``copy_engine`` its CTA policy is ZERO, under which NCCL moves all-to-all
    data in symmetric windows (:class:`comm.nccl.Window`) on the copy engines. Created once per (group,
    comm_sms, copy_engine) by every member rank, on first use; ``comm_sms == 0`` without
    ``copy_engine``, or a non-NCCL group, keeps ``group`` itself.
    """
    if (comm_sms == 0 and not copy_engine) or cuda_backend(group) != "nccl":
        return group
    key, owned = (comm_sms, copy_engine), state.of(group).communicators
    if key not in owned:
        options = dist.ProcessGroupNCCL.Options()
        options.config.cga_cluster_size = 1
        if comm_sms:
            options.config.min_ctas = comm_sms
            options.config.max_ctas = comm_sms
        if copy_engine:
            if not hasattr(options.config, "cta_policy"):
                raise RuntimeError(f"copy-engine collectives need NCCLConfig.cta_policy (torch {torch.__version__})")
            options.config.cta_policy = CTA_POLICY_ZERO
        _own_group(key, group, options)
    return owned[key]


def _own_group(
    key: tuple | str, group: dist.ProcessGroup, options: dist.ProcessGroupNCCL.Options | None = None
) -> None:
    """A private NCCL communicator over ``group``'s ranks, kept in its state under ``key`` (every
    member rank creates it, in the same order)."""
    ranks = dist.get_process_group_ranks(group)
    timeout = datetime.timedelta(seconds=group_timeout(group))  # (torch's watchdog and ours: the group's)
    if options is not None:
        options._timeout = timeout  # (else torch warns that the kwarg overrides it)
    made = dist.new_group(ranks, timeout, backend="nccl", pg_options=options, use_local_synchronization=True)
    state.of(group).own(key, made)


def group_timeout(group: dist.ProcessGroup | None) -> float:
    """The timeout of ``group``'s collectives in seconds (its backend's options; torch's NCCL default
    where it says none)."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cuda", "cpu"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout.total_seconds()
    return DEFAULT_TIMEOUT_S


def process_group(group: dist.ProcessGroup | Direct | Peers | None) -> dist.ProcessGroup:
    """The process group behind ``group`` (a communicator or a pull's peers: theirs; None: the
    default group)."""
    if isinstance(group, (Direct, Peers)):
        return group.group
    return group if group is not None else dist.group.WORLD


def nccl_path() -> str:
    """``FLASHOVERLAP_NCCL`` (default ``direct``), checked."""
    path = os.environ.get("FLASHOVERLAP_NCCL", NCCL_PATHS[0])
    if path not in NCCL_PATHS:
        raise ValueError(f"FLASHOVERLAP_NCCL={path!r}: expected one of {list(NCCL_PATHS)}")
    return path


def uses_direct() -> bool:
    """Whether the per-group collectives go through NCCL's C API: asked for (the default) and
    possible with the NCCL torch loaded; by default c10d where it is not, with a warning."""
    if nccl_path() != "direct":
        return False
    if (why := unavailable()) is None:
        return True
    if "FLASHOVERLAP_NCCL" in os.environ:
        raise RuntimeError(f"FLASHOVERLAP_NCCL=direct: {why}")
    warnings.warn(f"flashoverlap: NCCL through c10d, not its C API: {why}", RuntimeWarning, stacklevel=3)
    return False


def direct(group: dist.ProcessGroup, device: torch.device) -> dist.ProcessGroup | Direct:
    """``group`` for the per-group collectives of an overlapped call: where NCCL's C API is used
    (:func:`uses_direct`) and ``group`` is one of flashoverlap's own communicators
    (:func:`budget_group`, :func:`tail_group`), its NCCL communicator called through the C API
    (:class:`comm.nccl.Direct`), else the group itself (c10d). Only private communicators: NCCL
    calls on our stream beside c10d's on its own stream could meet on one communicator in
    different orders on different ranks. Created once per (group, device), by every member rank."""
    owner = state.made(group)
    if owner is None or not uses_direct():
        return group
    if (group, device) not in owner.direct:
        owner.direct[group, device] = Direct(group, device)
    return owner.direct[group, device]


def tail_group(group: dist.ProcessGroup, device: torch.device) -> dist.ProcessGroup | Direct:
    """The communicator of an overlapped call's last group, which runs once the GEMM has freed
    every SM: ``group`` itself (c10d), or where NCCL's C API is used a private NCCL
    communicator over its ranks without a CTA cap, called through the C API (:func:`direct`: not
    ``group``'s own, which c10d drives from its own stream). Created once per group, by every
    member rank, on first use."""
    if cuda_backend(group) != "nccl" or not uses_direct():
        return group
    owned = state.of(group).communicators
    if "tail" not in owned:
        _own_group("tail", group)
    return direct(owned["tail"], device)


def collective(
    ex: Exchange, data: torch.Tensor, group: dist.ProcessGroup | Direct | None, out: torch.Tensor | None = None
):
    """Run ``ex``'s collective on ``data`` (rows of C, [rows, cols]); returns the result rows:
    ``data`` itself (all-reduce, in place) or ``out`` ([ex.rows, cols], allocated if None)."""
    direct = isinstance(group, Direct)
    if ex.collective == "all_reduce":
        group.all_reduce(data) if direct else dist.all_reduce(data, group=group)
        return data
    if out is None:
        out = data.new_empty((ex.rows, data.shape[1]))
        enqueue.opaque()  # (a replay would reuse this call's memory)
    if ex.collective == "reduce_scatter":
        group.reduce_scatter(out, data) if direct else reduce_scatter_single(out, data, group=group)
    elif direct:
        group.all_to_all(out, data, ex.recv, ex.send)
    elif ex.uniform:  # c10d's equal-split path (ncclAlltoAll: copy engines in a window) on every rank
        dist.all_to_all_single(out, data, group=group)
    else:
        dist.all_to_all_single(out, data, list(ex.recv), list(ex.send), group=group)
    return out


def plain_collective(ex: Exchange, group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`collective` on c10d's ``group`` (None: the default group) as a function of the data,
    made once for calls like ``ex``: what a call decided plain runs on every repeat.

    It calls the process group's own method with options made here, as torch.distributed's
    functions do after their per-call checks (tensor types, group membership, options): those were
    settled when the call was first decided, and they cost 1.4-2 us of host time per collective on
    this repository's CPU machine, as much as flashoverlap's own front (the call's key and lookup).
    On a host-bound call (decode: 60-90 us of host time for the GEMM and the collective) that
    difference is the plain path's whole cost over torch's own call. Data that asks for torch
    function handling (a subclass, or a torch function mode) or is complex (torch.distributed
    views it as real: the CPU path takes any dtype) takes :func:`collective`, and so does a call
    torch.compile traces (the CPU path of flashoverlap.nn's layers: dynamo turns
    torch.distributed's functions into functional collectives, and cannot trace the group's).
    Inside torch's coalescing manager the collective is issued at once, not queued."""
    if torch.compiler.is_compiling():
        return lambda data: collective(ex, data, group)
    pg = process_group(group)
    if ex.collective == "all_reduce":
        reduce = dist.AllreduceOptions()
        reduce.asyncOp = False  # (as torch.distributed's blocking call: NCCL on the current stream, no work)

        def run(data: torch.Tensor) -> torch.Tensor:
            if has_torch_function((data,)) or data.is_complex():
                return collective(ex, data, group)
            _wait(pg.allreduce([data], reduce))
            return data

        return run
    options = dist.ReduceScatterOptions() if ex.collective == "reduce_scatter" else dist.AllToAllOptions()
    options.asyncOp = False
    counts = ([], []) if ex.uniform else (list(ex.recv), list(ex.send))

    def run(data: torch.Tensor) -> torch.Tensor:
        if has_torch_function((data,)) or data.is_complex():
            return collective(ex, data, group)
        out = data.new_empty((ex.rows, data.shape[1]))
        enqueue.opaque()  # (a replay would reuse this call's memory)
        if ex.collective == "reduce_scatter":
            _wait(pg._reduce_scatter_base(out, data, options))
        else:
            _wait(pg.alltoall_base(out, data, *counts, options))
        return out

    return run


def _wait(work: dist.Work | None) -> None:
    """As torch.distributed's blocking calls end: a backend that ran the collective on the current
    stream (NCCL, not asked for its work) returns none."""
    if work is not None:
        work.wait()


def gathered_rows(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's rows of ``t`` [rows, cols], in rank order (all-gather)."""
    full = t.new_empty((t.shape[0] * dist.get_world_size(group), t.shape[1]))
    all_gather_single(full, t.contiguous(), group=group)
    return full


def adjoint(
    name: str,
    grad: torch.Tensor,
    group: dist.ProcessGroup | None,
    counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """The gradient of a call's rows of C, from the gradient of its result (``name``: the call's
    collective): all-reduce: ``grad`` itself (every rank holds the result alike, as after
    Megatron's row-parallel linear); reduce-scatter: every rank's ``grad`` all-gathered;
    all-to-all: the rows sent back (the call's exchange reversed), ``counts`` = the call's (send,
    recv) rows per rank, None where the call split evenly (so every rank takes the same path as in
    the call: Exchange.uniform)."""
    grad = grad.contiguous()
    if name == "all_reduce":
        return grad
    if name == "reduce_scatter":
        return gathered_rows(grad, group)
    send, recv = counts or ((), ())  # the call's exchange, reversed
    back = Exchange("all_to_all", send=recv, recv=send, rows=sum(send) if counts else len(grad), uniform=not counts)
    return collective(back, grad, group)


def interleave(ex: Exchange, layout: str, reduction: str = "nccl") -> int:
    """Segments a plan knows of (prepared.prepare): one per rank where the schedule interleaves them
    (the ``segments`` layout) or where no group may span two (a ``pull_fused`` reduce-scatter in the
    ``rows`` layout, plan.make_plan's ``split``), else 1."""
    fused = reduction == "pull_fused" and ex.collective == "reduce_scatter" and layout == "rows"
    return len(ex.send) if layout == "segments" or fused else 1


def rows_rotation(ex: Exchange, layout: str, rank: int) -> int:
    """Rows of C at which the schedule starts on ``rank`` (see csrc/rotating_scheduler.cuh): in
    the ``rows`` layout of reduce-scatter / all-to-all the segment of rank + 1, so that each rank
    computes the rows it sends to rank + 1, rank + 2, ... first and its own rows last. At every
    step each rank then sends to one rank while receiving from another, and the last groups need
    no communication at all. 0 for any other call (not rotated)."""
    if ex.collective == "all_reduce" or layout != "rows":
        return 0
    return (rank + 1) % len(ex.send) * ex.send[0]


def buffers(
    ex: Exchange, plan: Plan, alloc, shared: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, buffer, recv) of one call: the [ex.rows, n] result, the flat buffer the GEMM writes
    (``out`` itself for an all-reduce in the ``rows`` layout; ``shared`` where given: a ``pull``
    all-reduce's, in memory every rank maps) and the flat buffer received rows land in: for an
    all-reduce None (also with ``pull_scatter``: its sums read the other ranks' memory in place), or
    with a ``local`` / ``pull`` reduction every rank's partial sums, group by group ([world, group
    size] each); in the ``rows`` layout, the partial sums a reduce-scatter receives beyond the first
    (which lands in ``out``): world - 2 segments, else None; in the ``segments`` layout None for a
    reduce-scatter (by pulls the rows copied from each rank, [world, rows * n] by source), for an
    all-to-all the rows received, group by group ([world, group rows] each), but None by pulls (they
    land in ``out``)); a ``pull_fused`` reduce-scatter's, the other ranks' partial sums of this
    rank's rows ([world - 1, rows * n], in the order of ``Pulls.others``), which the GEMM's epilogue
    adds into ``out``.
    ``alloc(shape)`` makes a tensor."""
    out = alloc((ex.rows, plan.n))
    if ex.collective == "all_reduce":
        gathered = alloc((len(ex.recv) * plan.numel,)) if ex.reduction in ("local", "pull") else None
        in_place = plan.in_place and ex.reduction not in PULLS  # (whose buffer others read while this rank adds)
        return out, shared if shared is not None else out.view(-1) if in_place else alloc((plan.numel,)), gathered
    if ex.reduction == "pull_fused":  # the other ranks' partial sums of this rank's rows, copied for the epilogue
        buffer = shared if shared is not None else alloc((plan.numel,))
        return out, buffer, alloc(((len(ex.recv) - 1) * ex.rows * plan.n,))
    if plan.layout == "rows":
        extra = len(ex.send) - 2 if ex.collective == "reduce_scatter" else 0
        return out, alloc((plan.numel,)), alloc((extra * ex.rows * plan.n,)) if extra > 0 else None
    if ex.reduction == "pull":  # this rank's segment rows of every rank's group: pulled into place (all-to-all),
        buffer = shared if shared is not None else alloc((plan.numel,))  # or copied to be summed
        copies = None if ex.collective == "all_to_all" else alloc((len(ex.recv) * ex.rows * plan.n,))
        return out, buffer, copies
    if plan.layout == "segments" and ex.collective == "reduce_scatter":  # each group's sums land in place
        return out, alloc((plan.numel,)), None
    return out, alloc((plan.numel,)), alloc((ex.rows * plan.n,))


def _rows_group(
    ex: Exchange, plan: Plan, g: int, buffer: torch.Tensor, stage: torch.Tensor | None, out: torch.Tensor, group
) -> None:
    """Group ``g`` of the ``rows`` layout for reduce-scatter / all-to-all: rows [bounds[g],
    bounds[g + 1]) of the rotated order (:func:`rows_rotation`), which walks the equal segments
    from this rank's + 1 on. Each part inside another rank's segment is sent to it while the same
    rows of this rank's segment arrive from the rank as far behind (grouped send/recv): into the
    result (all-to-all: at the sender's rows; reduce-scatter: the first partial sum, the others in
    ``stage``). Parts of the own segment, which comes last, are then copied (all-to-all) or added
    (reduce-scatter) to the result: every partial sum of those rows arrived in an earlier step.
    Every step is a native call on the GPU (a replay can enqueue it)."""
    pg = process_group(group)
    n, me, world, seg = plan.n, dist.get_rank(pg), len(ex.send), ex.send[0]
    first = plan.rotate * plan.tile_m // seg
    v0, v1 = plan.bounds[g] // n, plan.bounds[g + 1] // n
    flat = out.view(-1)

    def rows(t: torch.Tensor, segment: int, lo: int, hi: int) -> torch.Tensor:  # rows [lo, hi) of a segment
        return t[(segment * seg + lo) * n : (segment * seg + hi) * n]

    sends, recvs, own = [], [], []
    for step in range(v0 // seg, -(-v1 // seg)):
        lo, hi = max(v0 - step * seg, 0), min(v1 - step * seg, seg)  # rows within the segment
        dest = (first + step) % world
        part = rows(buffer, dest, lo, hi)
        if dest == me:
            own.append((lo, hi, part))
            continue
        src = (2 * me - dest) % world  # the rank whose step `step` is this rank's segment
        if ex.collective == "all_to_all":
            into = rows(flat, src, lo, hi)
        else:  # the first partial sum straight into the result, later ones staged
            into = rows(flat, 0, lo, hi) if step == 0 else rows(stage, step - 1, lo, hi)
        sends.append((part, dest))
        recvs.append((into, src))
    if isinstance(group, Direct):
        group.send_recv(sends, recvs)
    elif sends:
        peer = [dist.get_global_rank(pg, r) for r in range(world)]  # torch >= 2.4 takes global ranks
        ops = [dist.P2POp(dist.isend, t, peer[r], group) for t, r in sends]
        for request in dist.batch_isend_irecv(ops + [dist.P2POp(dist.irecv, t, peer[r], group) for t, r in recvs]):
            request.wait()
    for lo, hi, part in own:
        result = rows(flat, me if ex.collective == "all_to_all" else 0, lo, hi)
        if ex.collective == "all_to_all" or world == 1:  # (a reduce-scatter of one rank: nothing arrived)
            copy_2d(result.view(1, -1), part.view(1, -1))
            continue
        add(result, result, part)
        for step in range(1, world - 1):
            add(result, result, rows(stage, step - 1, lo, hi))


def communicate_group(
    ex: Exchange,
    plan: Plan,
    g: int,
    buffer: torch.Tensor,
    recv: torch.Tensor | None,
    out: torch.Tensor,
    group: dist.ProcessGroup | Direct | None,
) -> None:
    """Group ``g``'s communication: on its buffer range for an all-reduce (in place); in the
    ``cols`` layout the received rows land in ``recv`` (one flat [ex.rows * n] buffer, group after
    group); in the ``rows`` layout in ``out`` (see :func:`_rows_group`). ``recv``, ``out``: from
    :func:`buffers`."""
    chunk = buffer[plan.bounds[g] : plan.bounds[g + 1]]
    if ex.reduction == "pull_fused":
        _pull_rows(ex, plan, g, buffer, recv, group)
        return
    if ex.reduction != "nccl" and ex.collective != "all_reduce":  # (a pull: this rank's segment rows)
        _pull_segment(ex, plan, g, chunk, recv, out, group)
        return
    if ex.reduction == "pull_scatter":  # the waits for the other ranks' partial sums of this rank's
        bounds = shares(plan.bounds[g], plan.bounds[g + 1], group.world)  # share: finish_group reads them there
        group.arrived(g, buffer[bounds[group.rank] : bounds[group.rank + 1]])
        return
    if ex.reduction != "nccl":  # every rank's partial sums of the group, rank after rank
        into = recv[len(ex.recv) * plan.bounds[g] : len(ex.recv) * plan.bounds[g + 1]]
        if isinstance(group, Pulls):  # copied out of each rank's memory as it says the group is there
            _pull(group, g, chunk, into.view(len(ex.recv), -1))  # (its own row stays empty: finish_group's ``peers``)
        elif isinstance(group, Direct):
            group.all_gather(into, chunk)
        else:
            all_gather_single(into, chunk, group)
        return
    if ex.collective == "all_reduce" and plan.layout != "cols":
        collective(ex, chunk.view(1, -1), group)  # any shape, in place
        return
    if plan.layout == "rows":
        _rows_group(ex, plan, g, buffer, recv, out, group)
        return
    if plan.layout == "segments":  # [world, rows, n]: every rank's segment's rows of the group
        (r0, r1), world = plan.segment_rows(g), len(ex.send)
        part = Exchange(ex.collective, (r1 - r0,) * world, (r1 - r0,) * world, r1 - r0)
        into = out[r0:r1] if recv is None else recv[plan.bounds[g] : plan.bounds[g + 1]].view(-1, plan.n)
        collective(part, chunk.view(-1, plan.n), group, into)
        return
    c0, c1 = plan.columns(g)
    staged = None if recv is None else recv[ex.rows * c0 : ex.rows * c1].view(ex.rows, c1 - c0)
    collective(ex, chunk.view(plan.m, c1 - c0), group, staged)


def shares(lo: int, hi: int, world: int) -> list[int]:
    """The bounds of each rank's share of a group's elements [lo, hi) (``pull_scatter``): ``world``
    ranges of whole :data:`VECTOR` s, as equal as they come (share q: [bounds[q], bounds[q + 1]))."""
    vectors = (hi - lo) // VECTOR
    return [lo + vectors * q // world * VECTOR for q in range(world)] + [hi]


def _pull(group: Pulls, g: int, chunk: torch.Tensor, into: torch.Tensor) -> None:
    """Every other rank r's ``chunk`` of group ``g`` (the same bytes of its memory) into row r of
    ``into`` on the copy engines, each as soon as r says the group is there (comm.peer)."""
    for r, theirs in group.arrivals(g, group.every(chunk)):
        copy_2d(into[r].view(1, -1), theirs.view(1, -1))


def _pull_segment(
    ex: Exchange,
    plan: Plan,
    g: int,
    chunk: torch.Tensor,
    recv: torch.Tensor | None,
    out: torch.Tensor,
    group: Pulls,
) -> None:
    """Group ``g`` of a ``pull`` reduce-scatter / all-to-all (layout ``segments``: the group is
    [world, rows, n], block q the rows of rank q's segment): every rank's block of this rank's
    segment from rank q, a reduce-scatter's copied into row q of ``recv`` ([world, rows * n], at the
    group's rows; its own row stays empty: finish_group's sums read it in the buffer); an
    all-to-all's copied straight into ``out``, row q of [world, rows * n] at the group's rows of
    source q's segment (its own copied too, once written: the pulls wait only for the other ranks'
    rows)."""
    world, (r0, r1) = len(ex.recv), plan.segment_rows(g)
    mine = chunk.view(world, -1)
    into = (out if ex.collective == "all_to_all" else recv).view(world, -1)[:, r0 * plan.n : r1 * plan.n]
    _pull(group, g, mine[group.rank], into)
    if ex.collective == "all_to_all":
        group.mine(g)
        copy_2d(into[group.rank].view(1, -1), mine[group.rank].view(1, -1))


def _pull_rows(ex: Exchange, plan: Plan, g: int, buffer: torch.Tensor, recv: torch.Tensor, group: Pulls) -> None:
    """Group ``g`` of a ``pull_fused`` reduce-scatter (layout ``rows``, rotated: comm.rows_rotation):
    the part of each other rank's group ``g`` that is this rank's rows, copied out of its buffer into
    that rank's row of ``recv`` (:func:`buffers`) as soon as it says the group is there. Every rank's
    plan has the same groups in its own rotated walk, so rank q's group ``g`` holds this rank's rows
    where they fall in q's walk (:func:`own_rows`)."""
    seg, n, me = ex.rows, plan.n, group.rank
    v0, v1 = plan.bounds[g] // n, plan.bounds[g + 1] // n  # rows of the walk
    mine = buffer.view(len(ex.send), seg * n)[me]  # this rank's rows of C (in every rank's buffer alike)
    parts = {}
    for j, q in enumerate(group.others):
        start = own_rows(ex, me, q)
        lo, hi = max(v0 - start, 0), min(v1 - start, seg)
        if lo < hi:
            parts[q] = (j, lo, hi)
    into = recv.view(len(group.others), seg * n)
    for q, theirs in group.arrivals(g, {q: mine[lo * n : hi * n] for q, (_, lo, hi) in parts.items()}):
        j, lo, hi = parts[q]
        copy_2d(into[j, lo * n : hi * n].view(1, -1), theirs.view(1, -1))


def own_rows(ex: Exchange, rank: int, of: int) -> int:
    """The row of rank ``of``'s walk at which it computes rank ``rank``'s rows of a reduce-scatter in
    the ``rows`` layout (:func:`rows_rotation`: each walk starts at the next rank's segment)."""
    world = len(ex.send)
    return (rank - of - 1) % world * ex.rows


def ready_bands(ex: Exchange, plan: Plan, rank: int, rows: int) -> list[list[int]]:
    """A ``pull_fused`` reduce-scatter's ready flags: for each group, the bands of ``rows`` rows of
    this rank's result whose every other rank's partial sums are copied once that group's are (the
    epilogue waits for a band's flag before it adds them: csrc/tile_slot.cuh FusedSums); none on one
    rank (nothing to wait for)."""
    walk = np.asarray(plan.bounds[1:]) // plan.n  # the walk's row after each group
    after: list[list[int]] = [[] for _ in range(plan.num_groups)]
    for band in range(ex.rows // rows if len(ex.send) > 1 else 0):
        last = max(  # the group holding the band's last row, in the walk of the rank that computes it latest
            int(np.searchsorted(walk, own_rows(ex, rank, q) + (band + 1) * rows, side="left"))
            for q in range(len(ex.send))
            if q != rank
        )
        after[last].append(band)
    return after


def finishes(ex: Exchange, plan: Plan) -> bool:
    """Whether a call's groups need :func:`finish_group` after their collectives (not a ``pull``
    all-to-all: its rows land in place; a ``pull_scatter``'s adds its share; not a ``pull_fused``
    reduce-scatter: its epilogue adds)."""
    if ex.reduction == "pull_fused":
        return False
    if ex.reduction != "nccl":
        return ex.collective != "all_to_all"
    return plan.layout == "cols" or plan.layout == "segments" and ex.collective == "all_to_all"


def finish_group(
    ex: Exchange,
    plan: Plan,
    g: int,
    buffer: torch.Tensor,
    recv: torch.Tensor | None,
    out: torch.Tensor,
    peers: Pulls | None = None,
) -> None:
    """Group ``g``'s own step once its collective is done (the GPU path runs it on a stream of its
    own, so it never holds up the next collective): a ``local`` / ``pull`` all-reduce adds the
    world's partial sums of the group (in ``recv``) straight into ``out``'s rows in the ``rows``
    layout (its groups are row bands of C), else into the group's range of ``buffer``; a ``pull``
    reduce-scatter every rank's rows of this rank's segment, copied into ``recv``
    (:func:`_pull_segment`), into ``out``'s rows of the group; then in the ``cols`` layout the
    group's [ex.rows, c1 - c0] block (of ``buffer`` after an all-reduce, local or not, else of
    ``recv``) is copied into its columns of ``out``; a ``segments`` all-to-all copies the rows each
    rank sent into that rank's segment of ``out``. Nothing for any other call (:func:`finishes`).
    ``peers``: where a ``pull``'s rows came from (comm.peer), whose own row of ``recv`` stays empty:
    ``buffer`` holds this rank's partial sums (copying them next to the others' on the copy engines
    ran at ~90 GB/s beside the GEMM and held up the pulls behind it); the rows are then
    added in rank order as a ``local`` reduction's (:func:`add_rows`). A ``pull_scatter`` adds only its
    share (:func:`shares`) of every rank's partial sums, the others' read where they are (``peers.at``:
    ``recv`` is None), into its own buffer, where the other ranks pull the sum from
    (:func:`gather_group`) once it says so (``peers.summed``), and into ``out``."""
    if not finishes(ex, plan):
        return
    lo, hi = plan.bounds[g], plan.bounds[g + 1]
    if ex.reduction == "pull_scatter":
        bounds, me = shares(lo, hi, peers.world), peers.rank
        mine = buffer[bounds[me] : bounds[me + 1]]
        parts = [mine if r == me else peers.at(r, mine) for r in range(peers.world)]
        add_rows(parts, mine, out.view(-1)[bounds[me] : bounds[me + 1]])
        peers.summed(g)
        return
    world = len(ex.recv)
    if ex.reduction == "pull" and ex.collective == "reduce_scatter":  # this rank's segment rows of every rank's group
        (r0, r1), mine = plan.segment_rows(g), buffer[lo:hi].view(world, -1)[peers.rank]
        copies = recv.view(world, -1)[:, r0 * plan.n : r1 * plan.n]
        parts = [mine if r == peers.rank else copies[r] for r in range(world)]
        add_rows(parts, out[r0:r1].view(-1))
        return
    if ex.reduction != "nccl":
        into = (out.view(-1) if plan.layout == "rows" else buffer)[lo:hi]
        parts, mine = recv[world * lo : world * hi].view(world, hi - lo), buffer[lo:hi]
        add_rows(parts if peers is None else [mine if r == peers.rank else parts[r] for r in range(world)], into)
    if plan.layout == "cols":
        c0, c1 = plan.columns(g)
        block = buffer if ex.collective == "all_reduce" else recv
        copy_2d(out[:, c0:c1], block[ex.rows * c0 : ex.rows * c1].view(ex.rows, c1 - c0))
    elif plan.layout == "segments" and ex.collective == "all_to_all":
        r0, r1 = plan.segment_rows(g)
        copy_2d(out.view(world, -1)[:, r0 * plan.n : r1 * plan.n], recv[lo:hi].view(world, -1))


def gather_group(ex: Exchange, plan: Plan, g: int, buffer: torch.Tensor, out: torch.Tensor, peers: Pulls) -> None:
    """A ``pull_scatter``'s second half of group ``g``: every other rank's share of the group, summed
    there (:func:`finish_group`), copied out of its buffer into ``out`` as soon as it says so (the GPU
    path runs it on a stream of its own: its waits never hold up the next group's first half).
    Nothing for any other call."""
    if ex.reduction != "pull_scatter":
        return
    bounds = shares(plan.bounds[g], plan.bounds[g + 1], peers.world)
    parts = [buffer[bounds[r] : bounds[r + 1]] for r in range(peers.world)]
    for r, theirs in peers.sums(g, parts):
        copy_2d(out.view(-1)[bounds[r] : bounds[r + 1]].view(1, -1), theirs.view(1, -1))


def lands_in_out(ex: Exchange, plan: Plan) -> bool:
    """Whether the collectives leave the result in :func:`buffers`' ``out`` itself (the ``rows``
    layout, a ``segments`` reduce-scatter, a ``pull`` all-to-all); every other layout puts it into
    the ``out`` that :func:`finish_group` (or the ``tiles`` layout's :func:`restore`) is given."""
    if ex.reduction != "nccl":
        return ex.collective == "all_to_all" or ex.reduction == "pull_fused"
    return plan.layout == "rows" or plan.layout == "segments" and ex.collective == "reduce_scatter"


def landed(ex: Exchange, plan: Plan, g: int, out: torch.Tensor) -> torch.Tensor | None:
    """The part of ``out`` (:func:`buffers`) that group ``g``'s collective completes, where the
    result lands there (:func:`lands_in_out`) in one range: an all-reduce's row band, a ``segments``
    reduce-scatter's rows of the group; else None (the ``rows`` layout of reduce-scatter /
    all-to-all lands in parts of several segments, the own one's after a local step; so does a
    ``pull`` all-to-all, in every source's segment)."""
    if not lands_in_out(ex, plan):
        return None
    if ex.collective == "all_reduce":
        return out.view(-1)[plan.bounds[g] : plan.bounds[g + 1]]
    if plan.layout == "segments" and ex.collective == "reduce_scatter":
        r0, r1 = plan.segment_rows(g)
        return out[r0:r1]
    return None
