"""How a call runs: plain (:func:`sequential`, the GEMM then the collective) or overlapped
(:func:`run_overlapped`).

An overlapped call: the signal GEMM runs on the caller's stream and writes each tile into its
group slot; a communication stream waits on each group's counter and runs the group's
collective; the caller's stream then waits for the communication stream and, where the layout
needs it, copies the result into place (``tiles``: one gather; ``cols``: one copy per group). No
host synchronisation happens inside a call. A call of a kind its plan ran twice before is
replayed natively (:func:`replay_key`, flashoverlap.enqueue).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from . import comm, enqueue, signal, state, watchdog
from .comm import Exchange
from .comm.nccl import raw_stream
from .gemm import FusedSums
from .inputs import Fp8, Scales, epilogue, world_size
from .prepared import Prepared
from .streams import join, lanes, side_stream

# Calls of a kind (:func:`replay_key`) a plan runs from Python before it replays them natively: the
# first sets up what the calls share (events, windows, communicators), the second records its steps on
# a tape (host time beyond a replay's), the later ones replay it. Timings meant to show a model's
# repeated calls warm each variant up past these.
RECORDED_CALLS = 2


class _On:
    """``with _On(stream, current):`` what ``with torch.cuda.stream(stream):`` does, for a stream
    of the current device whose current stream is ``current``: two switches (torch's context asks
    for the device three times and builds two Stream objects; run_overlapped switches per group)."""

    __slots__ = ("stream", "current")

    def __init__(self, stream: torch.cuda.Stream, current: torch.cuda.Stream) -> None:
        self.stream, self.current = stream, current

    def __enter__(self) -> None:
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.current)


def sequential(
    a: torch.Tensor,
    weight: torch.Tensor,
    weight_layout: str,
    ex: Exchange,
    group: dist.ProcessGroup | None,
    scales: Scales | None = None,
    fp8: Fp8 | None = None,
) -> torch.Tensor:
    """The baseline the overlap must beat and match: matmul, then the collective (FP8 operands:
    ``torch._scaled_mm`` with their ``scales``, as ``fp8`` says)."""
    return plain(ex, group, weight_layout, world_size(group), fp8)(a, weight, scales)


def plain(
    ex: Exchange, group: dist.ProcessGroup | None, weight_layout: str, world: int, fp8: Fp8 | None = None
) -> Callable[..., torch.Tensor]:
    """:func:`sequential` as a function ``(a, weight, scales=None)`` of the operands of calls like
    ``ex`` on ``group`` (of ``world`` ranks), made once: what a call decided plain runs on every
    repeat, the matmul and the collective and nothing else (``world`` 1: the matmul alone; the
    collective as :func:`comm.plain_collective` calls it); ``fp8`` given: FP8 operands, multiplied
    by ``torch._scaled_mm`` (weight [N, K])."""
    if fp8 is not None:
        out_dtype, fast = fp8.out_dtype, fp8.fast_accum

        def product(a: torch.Tensor, weight: torch.Tensor, scales: Scales) -> torch.Tensor:
            b = weight.t()
            return torch._scaled_mm(a, b, scale_a=scales.a, scale_b=scales.b, out_dtype=out_dtype, use_fast_accum=fast)

        if world == 1:
            return product
        collect = comm.plain_collective(ex, group)
        return lambda a, weight, scales: collect(product(a, weight, scales))
    linear = torch.nn.functional.linear if weight_layout == "nk" else torch.matmul  # (linear: a @ weight.T, one op)
    if world == 1:
        return lambda a, weight, scales=None: linear(a, weight)
    collect = comm.plain_collective(ex, group)
    return lambda a, weight, scales=None: collect(linear(a, weight))


def run_overlapped(
    prep: Prepared,
    a: torch.Tensor,
    weight: torch.Tensor,
    ex: Exchange,
    group: dist.ProcessGroup | comm.Direct | None,
    tail_group: dist.ProcessGroup | comm.Direct | None = None,
    scales: Scales | None = None,
) -> torch.Tensor:
    """One overlapped call (FP8 operands: with their ``scales``); the last group's collective, which
    runs after the GEMM has freed every SM, goes to ``tail_group`` (a communicator free to use them
    all) when given, on the caller's stream behind the GEMM: it starts as the GEMM ends, beside what
    the budget communicator still has queued, not behind it. Either group may be a :class:`comm.nccl.Direct`
    (comm.direct). A call of a kind this plan ran twice before is replayed natively where it can
    be (:func:`replay_key`, flashoverlap.enqueue)."""
    device = a.device
    replay = prep.replays.get((ex, group, tail_group, raw_stream(device.index)))
    if replay is not None and replay.current():
        return replay(a, weight, scales)
    if torch.cuda.current_device() != device.index:  # (_On switches streams on the current device)
        with torch.cuda.device(device):
            return run_overlapped(prep, a, weight, ex, group, tail_group, scales)
    plan, dtype = prep.plan, prep.out_dtype
    caller = torch.cuda.current_stream(device)
    # what changes per call: with the operands, what a replay substitutes; first an FP8 GEMM's scales
    # as its epilogue reads them (alpha, the per-tensor scales' product made on the caller's stream
    # before the GEMM that reads it there; or the rowwise scales themselves), then what it allocates
    scaled = epilogue(scales)
    fresh: list[torch.Tensor] = [t for t in scaled if t is not None]
    shapes: list[tuple[int, ...]] = []  # (what it allocates, for its replays)

    def alloc(shape):
        shapes.append(tuple(shape))
        fresh.append(torch.empty(shape, dtype=dtype, device=device))
        return fresh[-1]

    window = None
    peers = group if isinstance(group, comm.Peers) else None
    if peers is not None and plan.num_groups > comm.peer.MAX_GROUPS:
        raise ValueError(
            f"reduction {ex.reduction!r} orders at most {comm.peer.MAX_GROUPS} groups per call, "
            f"this plan has {plan.num_groups}"
        )
    if prep.symmetric:
        groups = tuple(comm.process_group(g) for g in (group, tail_group or group))
        windows = state.owner(groups[0]).windows
        if groups not in windows:
            windows[groups] = comm.nccl.Window(groups, device)
        window = windows[groups] if windows[groups].groups else None  # none without an NCCL group
    if window is not None:  # communicate in a symmetric window, copy the result out of it

        def carve():
            sizes = []
            comm.buffers(ex, plan, lambda shape: sizes.append(shape) or torch.empty(shape, device="meta"))
            nbytes = sum(comm.nccl.carved_bytes(shape, dtype) for shape in sizes)
            return comm.buffers(ex, plan, window.allocator(nbytes, dtype))

        out, buffer, recv = _carved(prep, ex, window, carve)
        result = alloc((ex.rows, plan.n))
    else:  # a pull's GEMM buffer in memory every rank maps, the same for every call
        shared = None if peers is None else _carved(prep, ex, peers, lambda: peers.buffer(plan.numel, dtype))
        out, buffer, recv = comm.buffers(ex, plan, alloc, shared)
        result = out
    # Everything the call allocates is allocated above, before anything is enqueued: where memory
    # runs out, no flag of a pull is set or claim owed, and the next call starts clean.
    timeout = signal.debug_timeout()
    tensors = (a, weight, *fresh)
    key = replay_key(prep, ex, (group, tail_group), caller, window or peers, timeout)
    known = key is not None and key in prep.programs
    program = prep.programs[key] if known else None
    if program:  # (displaced in prep.replays by a recording since, its waits or memory now as before)
        prep.replays[ex, group, tail_group, caller.cuda_stream] = program
        program.enqueue(tensors)
        return result
    tape = None
    if known and program is None:  # seen once: what it set up (events, windows, communicators) is there now
        extents = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
        tape = enqueue.Tape(extents) if _disjoint(extents) else None
    elif key is not None and not known:
        prep.programs[key] = None
    with enqueue.recording(tape):
        _enqueue(prep, a, weight, ex, (group, tail_group), caller, window, (out, buffer, recv, result), timeout, scaled)
    watched = _watched(ex, (a.shape[0], prep.plan.n, a.shape[1]), group, peers, window, caller, device)
    if tape is not None:  # (False: a step that is not a native call, on every call like it)
        made = fresh[len(fresh) - len(shapes) :]
        which = next((i for i, t in enumerate(made) if t is result), None)  # (None: not replayable)
        replay = False
        if tape.usable and which is not None:
            shared = window or peers
            region = None if shared is None else shared.memory
            waits = signal.stream_waits(device.index, False)
            replay = Replay(tape.program(), shared, region, waits, tuple(shapes), which, dtype, device, watched)
            prep.replays[ex, group, tail_group, caller.cuda_stream] = replay
        prep.programs[key] = replay
    if key is not None or not torch.cuda.is_current_stream_capturing():  # (a graph's owner synchronises its replays)
        _watch(watched)
    if timeout is not None:
        signal.raise_on_timeout(prep.report, plan.num_groups, timeout)
    return result


def _watched(
    ex: Exchange, shape: tuple, group, peers, window, caller: torch.cuda.Stream, device: torch.device
) -> tuple:
    """What the watchdog is handed of a call (:func:`_watch`): its end on the caller's stream and, for
    pulls, the claim for the next call on the communication stream (it waits for the other ranks,
    and no later call of this process may come to wait behind it), each (stream, collective, shape,
    path, group)."""
    path = "pulls" if peers is not None else "an NCCL window" if window is not None else _nccl_path(group)
    streams = (caller, side_stream(device)) if peers is not None else (caller,)
    return tuple((stream, ex.collective, shape, path, group) for stream in streams)


def _watch(watched: tuple) -> None:
    """Hand a call to the watchdog (:func:`_watched`)."""
    for call in watched:
        watchdog.track(*call)


class Replay:
    """A call's native replay (enqueue.Program) with what calls like it allocate and watch, called
    as ``replay(a, weight, scales)`` in place of :func:`run_overlapped` while :meth:`current`: a
    repeat then costs its allocations, the replay and the watchdog's events, nothing else (kept in
    ``Prepared.replays`` under (exchange, group, tail group, the caller's stream)). ``shared``: the
    NCCL window or comm.Peers whose memory (``region`` when recorded) its pointers lie in; ``waits``:
    whether its waits were stream waits (signal.stream_waits); ``shapes``: the tensors it allocates,
    in order, the ``result``-th returned; ``watched``: :func:`_watched`'s."""

    __slots__ = ("program", "shared", "region", "waits", "shapes", "result", "dtype", "device", "watched")

    def __init__(self, program, shared, region, waits, shapes, result, dtype, device, watched) -> None:
        self.program, self.shared, self.region, self.waits = program, shared, region, waits
        self.shapes, self.result, self.dtype, self.device, self.watched = shapes, result, dtype, device, watched

    def current(self) -> bool:
        """Whether a call now would be recorded the same: its window's (or pulls') memory not grown,
        no capture, replays on, not in debug mode, waits of the same kind, on the current device."""
        return (
            (self.shared is None or self.shared.memory is self.region)
            and torch.cuda.current_device() == self.device.index
            and _replays_on(signal.debug_timeout())
            and signal.stream_waits(self.device.index, False) == self.waits
        )

    def __call__(self, a: torch.Tensor, weight: torch.Tensor, scales: Scales | None = None) -> torch.Tensor:
        # (an FP8 call's scales' product is made here, a new tensor: held until the GEMM reading it is
        # enqueued, so that no other allocation on the stream can take its memory first)
        scaled = [t for t in epilogue(scales) if t is not None]
        made = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape in self.shapes]
        self.enqueue((a, weight, *scaled, *made))
        return made[self.result]

    def enqueue(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replay the call on ``tensors`` (the operands, an FP8 call's scales, what it allocated: the
        tape's order) and hand it to the watchdog."""
        self.program.replay([t.data_ptr() for t in tensors])
        _watch(self.watched)


def _replays_on(timeout: float | None) -> bool:
    """Whether a call now may replay natively: not in debug mode (``timeout``, signal.debug_timeout:
    its report), not while a CUDA graph is captured (a capture records what the host does once
    anyway), not with ``FLASHOVERLAP_REPLAY=0``."""
    return (
        timeout is None
        and not torch.cuda.is_current_stream_capturing()
        and os.environ.get("FLASHOVERLAP_REPLAY") != "0"
    )


def _nccl_path(group) -> str:
    return "NCCL's C API" if isinstance(group, comm.Direct) else "c10d"


def _carved(prep: Prepared, ex: Exchange, window: comm.nccl.Window, carve: Callable[[], object]):
    """What ``carve()`` cuts out of ``window`` (an NCCL window or comm.Peers) for this plan's calls of
    ``ex``, kept in ``prep.window_views`` while the window's memory stays the same (carving may grow
    it: new views then)."""
    region, views = prep.window_views.get(ex, (None, None))
    if region is None or region is not window.memory:
        views = carve()
        prep.window_views[ex] = (window.memory, views)
    return views


def replay_key(
    prep: Prepared,
    ex: Exchange,
    groups: tuple,
    caller: torch.cuda.Stream,
    window: comm.nccl.Window | None,
    timeout: float | None,
) -> tuple | None:
    """What the native replay of a call from ``caller`` with ``groups`` = (group, tail_group) is
    kept under in ``prep.programs`` (flashoverlap.enqueue; ``window``: its NCCL window, or a ``pull``
    all-reduce's comm.Peers), None where the call is enqueued from Python: collectives through c10d
    (its own Python and C++ work per call), debug mode (its report), a CUDA graph being captured (a
    capture records what the host does once anyway), or ``FLASHOVERLAP_REPLAY=0``. (Calls with a
    torch operation among their steps, a ``local`` all-reduce's sum over more than two ranks, a copy
    whose pitch cudaMemcpy2DAsync refuses, mark their tape unusable themselves: enqueue.opaque.)"""
    group, tail_group = groups
    native = (comm.Direct, comm.Peers)
    if not (isinstance(group, native) and isinstance(tail_group or group, native)):
        return None
    if not _replays_on(timeout):
        return None
    waits = signal.stream_waits(prep.counters.device.index, False)
    return ex, *groups, caller.cuda_stream, None if window is None else window.memory.data_ptr(), waits


def _fused(ex: Exchange, plan, peers: comm.Peers, out: torch.Tensor, recv: torch.Tensor) -> FusedSums:
    """A ``pull_fused`` reduce-scatter's sums in the GEMM's epilogue: this rank's rows of C into
    ``out`` with the other ranks' partial sums of them (``recv``, comm.buffers) added, a ready flag
    per :attr:`Plan.rotation_rows` rows (the rows its walk completes together); raises before
    anything is enqueued where they outnumber the flags."""
    rows = plan.rotation_rows
    if not peers.others:
        raise ValueError("reduction 'pull_fused' adds the other ranks' partial sums: a group of one rank has none")
    if ex.rows // rows > comm.peer.MAX_GROUPS:
        raise ValueError(
            f"reduction 'pull_fused' has a ready flag per {rows} rows of the result, at most "
            f"{comm.peer.MAX_GROUPS}: {ex.rows} rows need {ex.rows // rows}"
        )
    if ex.rows * plan.n * out.element_size() > comm.MAX_PITCH:  # (a larger copy would need an SM, which the
        raise ValueError(  # GEMM's waiting epilogues may all hold: comm.copy_2d)
            f"reduction 'pull_fused' copies each rank's rows on the copy engines, at most {comm.MAX_PITCH} bytes: "
            f"{ex.rows} rows of {plan.n} are more"
        )
    sources = recv.view(len(peers.others), ex.rows, plan.n)
    return FusedSums(out, sources, peers.ready_flags, peers.rank * ex.rows, rows)


def _disjoint(extents: Sequence[tuple[int, int]]) -> bool:
    """Whether no two (address, bytes) extents overlap: a replay substitutes each on its own (a call
    whose operands share memory is not recorded; a later one may be)."""
    spans = sorted((start, start + max(size, 1)) for start, size in extents)
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def _enqueue(
    prep: Prepared,
    a: torch.Tensor,
    weight: torch.Tensor,
    ex: Exchange,
    groups: tuple,
    caller: torch.cuda.Stream,
    window: comm.nccl.Window | None,
    tensors: tuple,
    timeout: float | None,
    scaled: tuple = (None, None, None),
) -> None:
    """:func:`run_overlapped`'s work on the streams: ``groups`` = (group, tail_group), ``tensors`` =
    (out, buffer, recv, result) from :func:`comm.buffers` (in ``window`` where given); ``timeout``:
    signal.debug_timeout; ``scaled``: the GEMM's scales (FP8: inputs.Scales.epilogue)."""
    device, plan = a.device, prep.plan
    (group, tail_group), (out, buffer, recv, result) = groups, tensors
    stream = side_stream(device)
    # (not where one communicator serves both, c10d's for comm_sms 0: its stream orders them anyway)
    apart = (
        tail_group is not None and tail_group is not group and comm.tail_apart(ex.collective, plan.layout, ex.reduction)
    )

    # A window's result is copied out group by group, where each group lands in one range, from
    # the GEMM's end on: beside the last collectives instead of after them. (Copied as each
    # collective ends, they slow the GEMM and NCCL beside it: 1.13x against 1.16x.)
    copy_out = window is not None and comm.landed(ex, plan, 0, out) is not None
    finishes = comm.finishes(ex, plan)
    finisher = side_stream(device, "finish") if finishes or copy_out else None
    if finisher is not None and not prep.group_done:
        prep.group_done = [torch.cuda.Event() for _ in prep.targets]
    if (finisher is not None or ex.reduction == "pull_fused") and prep.gemm_done is None:
        prep.gemm_done = torch.cuda.Event()

    # A pull's GEMM counts in memory the other ranks map, and they wait on that (comm.peer); this
    # rank's own counters only where its own rows are read. Its buffer and counters were claimed
    # for it at the previous call's end (Peers.claim).
    peers = group if isinstance(group, comm.Peers) else None
    fused = None  # a pull_fused reduce-scatter's sums in the epilogue, and the bands each group's copies make ready
    if ex.reduction == "pull_fused":
        fused = _fused(ex, plan, peers, out, recv)
        bands = comm.ready_bands(ex, plan, peers.rank, fused.ready_rows)
    shared = window if window is not None else peers  # memory every call uses: ordered across callers' streams
    if shared is not None:
        shared.acquire(caller)
    join(stream, caller, device)  # operands ready; earlier users of the buffers done
    in_place = ex.in_place  # (sums that read the other ranks' memory)
    if peers is not None:  # the pulls from each other rank on a lane of its own where there are several
        others = len(peers.others)  # (sums that read in place copy nothing there: their waits go on `stream`)
        peers.lanes = lanes(device, others) if others > 1 and not in_place else ()
        # a pull_scatter's copies of the sums on one stream of their own: apart, so that their waits for
        # the other ranks' sums never hold up the next group's waits and sums; one, so that they queue
        # for the copy engine one at a time (a lane per rank, when the shares were still copied into
        # staging too: 0.86x against 1.09x on 16384x8192x4096, four H200s; not measured since)
        peers.sum_lanes = (side_stream(device, "sums"),) * others if ex.reduction == "pull_scatter" else ()
        # Made once and only added to: calls of one plan with and without lanes (copies, and sums that
        # read in place) or with other numbers of them would share these events, and a replay notes
        # their handles (remade, the other kind's recorded replays enqueued freed events: "context is
        # destroyed").
        prep.lane_done += [[torch.cuda.Event() for _ in prep.targets] for _ in peers.lanes[len(prep.lane_done) :]]
        if peers.lanes and prep.pulls_start is None:
            prep.pulls_start = torch.cuda.Event()
        if peers.lanes:
            enqueue.record(prep.pulls_start, stream)
    if peers is not None:
        peers.targets = prep.targets
        # the GEMM only after the counters' zeroing, not after the rest of the comm stream's claim
        # and its wait for the caller above
        enqueue.wait(caller, peers.claimed)
    else:
        join(caller, stream, device)  # a call from another stream may not have reset the counters yet
    prep.launch(a, weight, buffer, caller, None if peers is None else peers.counters, *scaled, fused=fused)
    if copy_out or finisher is not None and peers is not None or fused is not None:
        enqueue.record(prep.gemm_done, caller)
    last = len(prep.targets) - 1
    for g, target in enumerate(prep.targets):
        # The last collective, apart: on the caller's stream, ordered after the GEMM without a
        # counter wait or another stream (on a stream of its own behind a counter wait, traces
        # showed c10d starting it 108-126 us after the GEMM's end).
        issuer = caller if g == last and apart else stream
        on = tail_group if g == last and tail_group is not None else group
        with _On(issuer, caller):
            if issuer is stream and peers is None:
                signal.wait_geq(issuer, prep.counters, g, target, timeout, prep.report)
            for lane in peers.lanes if peers is not None and g == 0 else ():
                enqueue.wait(lane, prep.pulls_start)
            comm.communicate_group(ex, plan, g, buffer, recv, out, on)
            for lane, done in zip(peers.lanes if peers is not None else (), prep.lane_done):  # the pulls joined
                enqueue.record(done[g], lane)
                enqueue.wait(issuer, done[g])
            for band in bands[g] if fused is not None else ():  # the epilogue may add these rows now
                peers.ready(band)
            if peers is not None and finishes and g < last:  # this rank's own rows, for the finisher's
                peers.mine(g)  # add (here, not on the finisher: each stream operation costs ~2 us)
            if finisher is not None:
                enqueue.record(prep.group_done[g], issuer)
        if finishes:  # the group's own step (copies: copy engines; adds: SMs the GEMM leaves, or
            # as it retires), enqueued with its collective so that a slow host cannot hold it back
            if peers is not None and g == last:  # its own rows: the GEMM's end (an event hop, ~2 us)
                enqueue.wait(finisher, prep.gemm_done)
            enqueue.wait(finisher, prep.group_done[g])
            with _On(finisher, caller):
                comm.finish_group(ex, plan, g, buffer, recv, result, peers)
        if ex.reduction == "pull_scatter":  # the others' sums (Peers.sum_lanes)
            for lane in dict.fromkeys(peers.sum_lanes) if g == 0 else ():  # (after the first pulls: the `fresh` flags)
                enqueue.wait(lane, prep.group_done[0])
            comm.gather_group(ex, plan, g, buffer, result, peers)
    if copy_out:
        enqueue.wait(finisher, prep.gemm_done)
        with _On(finisher, caller):
            for g, done in enumerate(prep.group_done):
                enqueue.wait(finisher, done)
                comm.copy_2d(*(comm.landed(ex, plan, g, t).view(-1, plan.n) for t in (result, out)))
    if apart:  # the stream saw all but the last counter
        join(stream, caller, device)
    sum_lanes = tuple(dict.fromkeys(peers.sum_lanes)) if peers is not None else ()
    for lane in sum_lanes:  # copied (done) once the sums are too
        join(stream, lane, device)
    if peers is not None and in_place:  # and once the sums have read the others' memory
        join(stream, finisher, device)
    if peers is not None:  # (every group on `stream`: comm.tail_apart; its counters zeroed by Peers.claim)
        with _On(stream, caller):
            peers.copied()
    else:
        signal.reset(prep.counters, stream)  # stream-ordered: the next call's GEMM waits for it through `caller`
    # The caller's stream waits for the side streams, so the buffers of this call (allocated on it,
    # freed on return) are safe to reuse on it without record_stream.
    for side in (stream, finisher, *sum_lanes):
        if side is not None:
            join(caller, side, device)
    if peers is not None:  # the next call's claim, beside this one's last adds; its GEMM waits for it, the caller not
        if fused is not None:  # (not before the epilogue has read the ready flags the claim zeroes: no other
            enqueue.wait(stream, prep.gemm_done)  # rank waits for this rank's own rows, which it computes last)
        with _On(stream, caller):
            peers.claim()
        if torch.cuda.is_current_stream_capturing():  # a capture ends with every stream joined
            join(caller, stream, device)
    if plan.layout == "tiles":  # every other layout's result is in place (comm.finish_group)
        comm.restore(buffer, result, plan, prep.slots)
    if result is not out and comm.lands_in_out(ex, plan) and not copy_out:  # the result is in the window
        comm.copy_2d(result.view(-1, plan.n), out.view(-1, plan.n))
    if shared is not None:
        shared.release(caller)
