"""GEMM + collective with the collective overlapped, on CUDA devices.

One call: the signal GEMM runs on the caller's stream and writes each tile into its group slot;
a communication stream waits on each group's counter and runs the group's collective; the
caller's stream then waits for the communication stream and, where the layout needs it, copies
the result into place (``tiles``: one gather; ``cols``: one copy per group). No host
synchronisation happens inside a call.

Operands of every public entry point: a: [M, K]; weight: [N, K] like ``torch.nn.Linear``
(``weight_layout="nk"``) or [K, N] (``"kn"``); bf16 or fp16, contiguous, on this rank's CUDA
device; N and K multiples of 8; every rank passes the same shapes (but M for an all-to-all whose
counts are exchanged, ``splits`` without ``output_splits``, or given, ``rows_per_rank``). ``config``: an
:class:`OverlapConfig`, a dict of its fields, or a YAML path (default: the registry's entry nearest
the call, see :mod:`flashoverlap.registry`, else the built-in defaults). The result is a
new tensor, ready on the current stream. Bad input raises ``ValueError``/``TypeError`` before
anything is launched. A group of one rank runs the plain GEMM; so does a call without ``config``
whose GEMM is one group (one wave: nothing to overlap), or that is not tuned for its shape and lost
to sequential when first timed (:func:`trial`: the defaults or the nearest tuned shape's config,
and the same with NCCL's SMs taken differently, :func:`alternative`, against the plain call).
Where an operand requires gradients, the call is differentiable (:func:`with_gradients`). Inside a
graph ``torch.compile`` traces, a call is the one operator ``flashoverlap::gemm_collective``
(:func:`_gemm_collective`).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm, enqueue, registry, signal
from .comm import Exchange
from .comm.nccl import group_fact
from .config import (
    OverlapConfig,
    differences,
    for_device,
    kernel_spec,
    resolutions,
    resolve,
    takes_every_call,
)
from .gemm import SignalGemm, get_kernel
from .plan import Plan, late_after, make_plan, rotation_rows, scheduled_tiles, spare_sms

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
WEIGHT_LAYOUTS = ("nk", "kn")
ALIGNMENT = 8  # elements: TMA needs 16-byte aligned rows
log = logging.getLogger(__name__)


def world_size(group: dist.ProcessGroup | None) -> int:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__} {group!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "flashoverlap needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first (a group of one rank works too)"
        )
    return group_fact(group, "size", dist.get_world_size)


def check_inputs(a: object, weight: object, weight_layout: str, device_type: str = "cuda") -> tuple[int, int, int]:
    """Validate the operands of C = a @ W^T ("nk") or a @ W ("kn"); return (m, n, k)."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    for name, t in (("a", a), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: {', '.join(map(str, DTYPES))}")
    if a.dtype != weight.dtype:
        raise ValueError(f"a and weight dtypes differ: {a.dtype} vs {weight.dtype}")
    m, k = a.shape
    n, wk = weight.shape if weight_layout == "nk" else weight.shape[::-1]
    if wk != k:
        expected = f"[N, {k}]" if weight_layout == "nk" else f"[{k}, N]"
        raise ValueError(
            f"K mismatch: a is {tuple(a.shape)} but weight is {tuple(weight.shape)} "
            f"(weight_layout={weight_layout!r} expects {expected})"
        )
    if n < 1 or k < 1:  # M = 0 is fine: a rank with no rows for this call (an MoE expert without tokens)
        raise ValueError(f"empty problem: N={n}, K={k}")
    if n % ALIGNMENT or k % ALIGNMENT:
        raise ValueError(f"N and K must be multiples of {ALIGNMENT} (16-byte rows for TMA), got N={n}, K={k}")
    for name, t in (("a", a), ("weight", weight)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (row-major); call .contiguous() first")
    for name, t in (("a", a), ("weight", weight)):
        if t.device.type != device_type:
            raise ValueError(f"{name} is on {t.device}, expected a {device_type} tensor")
    if a.device != weight.device:
        raise ValueError(f"a is on {a.device} but weight is on {weight.device}")
    return m, n, k


def sequential(
    a: torch.Tensor, weight: torch.Tensor, weight_layout: str, ex: Exchange, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The baseline the overlap must beat and match: matmul, then the collective."""
    out = a @ (weight.t() if weight_layout == "nk" else weight)
    if world_size(group) == 1:
        return out
    return comm.collective(ex, out, group)


@dataclass(eq=False)
class Prepared:
    """Everything a call needs that depends only on shape, dtype, device and config."""

    plan: Plan
    kernel: SignalGemm
    slots: torch.Tensor  # the plan's slot table on the device
    counters: torch.Tensor  # int32 per group, zero between calls
    workspace: torch.Tensor | None  # stream-K partial sums
    targets: tuple[int, ...]
    sm_count: int
    report: torch.Tensor  # int32[4]: a debug-mode wait that timed out (see flashoverlap.signal)
    symmetric: bool = False  # buffers in NCCL symmetric windows (OverlapConfig.symmetric)
    # exchange -> (the window region, its (out, buffer, recv) there, or a pull's buffer): the same every call
    window_views: dict = field(default_factory=dict)
    group_done: list = field(default_factory=list)  # an event per group (comm.finish_group)
    # the GEMM's end on the caller's stream (a window's copies out; a pull's last add)
    gemm_done: torch.cuda.Event | None = None
    # replay_key -> the call's enqueue.Program; None once seen (noted on the next call like it), False
    # where that call could not be replayed
    programs: dict = field(default_factory=dict)

    def launch(
        self,
        a: torch.Tensor,
        weight: torch.Tensor,
        buffer: torch.Tensor,
        stream: torch.cuda.Stream,
        counters: torch.Tensor | None = None,
    ) -> None:
        """Enqueue the signal GEMM on ``stream``, writing the plan's slots of ``buffer``, bumping
        ``counters`` (default: the plan's own)."""
        self.kernel.run(
            a,
            weight,
            buffer,
            self.slots,
            self.counters if counters is None else counters,
            self.workspace,
            (self.plan.tiles_m, self.plan.tiles_n),
            self.sm_count,
            self.plan.along_m,
            self.plan.swizzle,
            self.plan.rotate,
            self.plan.interleave,
            (self.plan.keep, self.plan.after),
            stream,
        )


# Most recently used plans; bounded so that a stream of new shapes keeps memory flat.
MAX_PREPARED = 64
_prepared: OrderedDict[tuple, Prepared] = OrderedDict()


def _recent(cache: OrderedDict, key: tuple):
    """``cache[key]``, marked most recently used; None where absent."""
    if key not in cache:
        return None
    cache.move_to_end(key)
    return cache[key]


def _keep(cache: OrderedDict, key: tuple, value, limit: int) -> None:
    """Store ``value`` as the most recently used entry, dropping the least recently used beyond ``limit``."""
    cache[key] = value
    while len(cache) > limit:
        cache.popitem(last=False)


SIDE_ROLES = ("comm", "finish")  # what side_stream keeps a stream for
_side_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_windows: dict[tuple, comm.nccl.Window] = {}  # symmetric windows per (budget, tail) group pair


def prepare(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    weight_layout: str,
    device: torch.device,
    cfg: OverlapConfig,
    rotate: int = 0,
    interleave: int = 1,
    columns: tuple[int, ...] | None = None,
) -> Prepared:
    """The plan, kernel and device tables of one call; ``rotate``: rows of C the schedule starts
    at (comm.rows_rotation); ``interleave``: segments it interleaves (comm.interleave);
    ``columns``: the ``cols`` groups' tile columns, shared by ranks whose M differ (:func:`shared_columns`)."""
    if cfg.layout == "auto":
        raise ValueError("prepare() takes a config resolved for its collective (config.for_collective)")
    key = (m, n, k, dtype, weight_layout, device.index, cfg, rotate, interleave, columns)
    if (found := _recent(_prepared, key)) is not None:
        return found
    cfg, kernel, sm_count = _kernel(dtype, weight_layout, device, cfg)
    plan = _plan(kernel, cfg, sm_count, (m, n, k), device, rotate, interleave, columns)
    slots = torch.from_numpy(plan.slot_table().view("u1")).to(device)
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=device)
    workspace_bytes = kernel.workspace_size(m, n, k, sm_count, device.index, plan.along_m, cfg.swizzle)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device) if workspace_bytes else None
    report = torch.zeros(4, dtype=torch.int32, device=device)
    for role in SIDE_ROLES:  # the side streams use them on every call; the plan may be dropped from any stream
        counters.record_stream(side_stream(device, role))
        report.record_stream(side_stream(device, role))
    targets = plan.counter_targets(kernel.signals_per_tile)
    prepared = Prepared(plan, kernel, slots, counters, workspace, targets, sm_count, report, cfg.symmetric)
    _keep(_prepared, key, prepared, MAX_PREPARED)
    return prepared


def _kernel(
    dtype: torch.dtype, weight_layout: str, device: torch.device, cfg: OverlapConfig
) -> tuple[OverlapConfig, SignalGemm, int]:
    """``cfg`` completed for the device, its kernel, and the SMs that kernel's grid gets (every SM
    under a late budget: its plan keeps ``comm_sms`` of them for the last waves only)."""
    cfg, spec = kernel_spec(cfg, DTYPES[dtype], weight_layout, torch.cuda.get_device_capability(device))
    total_sms = torch.cuda.get_device_properties(device).multi_processor_count
    if total_sms - cfg.comm_sms < 1:
        raise ValueError(f"comm_sms={cfg.comm_sms} leaves no SM for the GEMM on {device} ({total_sms} SMs)")
    return cfg, get_kernel(spec), total_sms if cfg.late_budget else total_sms - cfg.comm_sms


def _plan(
    kernel: SignalGemm,
    cfg: OverlapConfig,
    sm_count: int,
    shape: tuple[int, int, int],
    device: torch.device,
    rotate: int = 0,
    interleave: int = 1,
    columns: tuple[int, ...] | None = None,
) -> Plan:
    """The plan of a GEMM ``shape`` on ``kernel``'s grid (see :func:`prepare`)."""
    m, n, k = shape
    index, along_m = device.index, cfg.layout == "cols"
    keep = kernel.num_ctas(m, n, k, sm_count - cfg.comm_sms, index, along_m, cfg.swizzle) if cfg.late_budget else 0
    return make_plan(
        m,
        n,
        tile_m=cfg.tile_m,
        tile_n=cfg.tile_n,
        cluster_m=cfg.cluster_m,
        ctas=kernel.num_ctas(m, n, k, sm_count, index, along_m, cfg.swizzle),
        stream_k_tiles=kernel.stream_k_tiles(m, n, k, sm_count, index, along_m, cfg.swizzle),
        partition=cfg.partition if columns is None else None,
        layout=cfg.layout,
        swizzle=cfg.swizzle,
        rotate=rotate // cfg.tile_m,
        interleave=interleave,
        column_groups=columns,
        keep=keep,
    )


@functools.lru_cache(maxsize=MAX_PREPARED)
def shared_columns(
    m: int, n: int, k: int, dtype: torch.dtype, weight_layout: str, device: torch.device, cfg: OverlapConfig
) -> tuple[int, ...]:
    """The ``cols`` groups' tile columns that ranks whose M differ all plan on: those of the plan
    for ``m`` rows, the largest M (that rank's GEMM takes longest, so its waves set the pace)."""
    cfg, kernel, sm_count = _kernel(dtype, weight_layout, device, cfg)
    return _plan(kernel, cfg, sm_count, (m, n, k), device).column_groups


MAX_AGREED = 1024
_agreed: OrderedDict[tuple, bool] = OrderedDict()  # calls whose ranks agreed, most recently used last


def check_agreement(prep: Prepared, collective: str, group: dist.ProcessGroup, ex: Exchange, call: tuple) -> None:
    """On the first use of ``call`` with ``group`` (every use with ``FLASHOVERLAP_DEBUG=1``), check
    that all ranks run the same plan, so that a mismatch fails loudly instead of hanging in NCCL.

    ``call``: what the plan follows from, alike on every rank of a consistent call (never this
    rank's own state, such as which plans it keeps: ranks whose M differ keep different plans, and a
    rank that skipped the check while another ran it would leave both hanging). Ranks whose M differ
    agree once per kind of call, not per call: every rank's M reaches every rank alike (exchanged),
    and their columns follow from it."""
    key = (call, group)
    if _recent(_agreed, key) is not None and signal.debug_timeout() is None:
        return
    plan = prep.plan
    # (the rotation differs by rank on purpose: comm.rows_rotation; so do the plans of ranks whose M
    # differ, on the same columns)
    if ex.ragged:
        groups = f"M={ex.sources} columns={plan.column_groups}"
    else:
        groups = f"M={plan.m} groups={plan.bounds} ctas={plan.ctas}"
    description = f"{collective} N={plan.n} {prep.kernel.spec} {groups}"
    comm.agree(group, description, prep.counters.device)
    _keep(_agreed, key, True, MAX_AGREED)


def side_stream(device: torch.device, role: str = "comm") -> torch.cuda.Stream:
    """flashoverlap's own stream on ``device`` for ``role``: "comm" (the waits and collectives) or
    "finish" (each group's own step after its collective, comm.finish_group: apart, so that one
    waiting for SMs the GEMM holds never holds up the next group's collective)."""
    key = (device.index, role)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device=device)
    return _side_streams[key]


_join_events: dict[tuple[int, int, int], torch.cuda.Event] = {}


def join(waiter: torch.cuda.Stream, waitee: torch.cuda.Stream, device: torch.device) -> None:
    """``waiter.wait_stream(waitee)`` with one event per stream pair, kept (a fresh event per wait
    costs its creation and destruction on every call)."""
    key = (device.index, waiter.cuda_stream, waitee.cuda_stream)
    event = _join_events.get(key)
    if event is None:
        event = _join_events[key] = torch.cuda.Event()
    enqueue.record(event, waitee)
    enqueue.wait(waiter, event)


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


def run_overlapped(
    prep: Prepared,
    a: torch.Tensor,
    weight: torch.Tensor,
    ex: Exchange,
    group: dist.ProcessGroup | comm.Direct | None,
    tail_group: dist.ProcessGroup | comm.Direct | None = None,
) -> torch.Tensor:
    """One overlapped call; the last group's collective, which runs after the GEMM has freed
    every SM, goes to ``tail_group`` (a communicator free to use them all) when given, on the
    caller's stream behind the GEMM: it starts as the GEMM ends, beside what the budget
    communicator still has queued, not behind it. Either group may be a :class:`comm.nccl.Direct`
    (comm.direct). A call of a kind this plan ran twice before is replayed natively where it can
    be (:func:`replay_key`, flashoverlap.enqueue)."""
    device = a.device
    if torch.cuda.current_device() != device.index:  # (_On switches streams on the current device)
        with torch.cuda.device(device):
            return run_overlapped(prep, a, weight, ex, group, tail_group)
    plan = prep.plan
    caller = torch.cuda.current_stream(device)
    fresh: list[torch.Tensor] = []  # what this call allocates: with the operands, what a replay substitutes

    def alloc(shape):
        fresh.append(torch.empty(shape, dtype=a.dtype, device=device))
        return fresh[-1]

    window = None
    peers = group if isinstance(group, comm.Peers) else None
    if peers is not None and plan.num_groups > comm.peer.MAX_GROUPS:
        raise ValueError(
            f"reduction 'pull' orders at most {comm.peer.MAX_GROUPS} groups per call, this plan has {plan.num_groups}"
        )
    if prep.symmetric:
        groups = tuple(comm.process_group(g) for g in (group, tail_group or group))
        if groups not in _windows:
            _windows[groups] = comm.nccl.Window(groups, device)
        window = _windows[groups] if _windows[groups].groups else None  # none without an NCCL group
    if window is not None:  # communicate in a symmetric window, copy the result out of it

        def carve():
            sizes = []
            comm.buffers(ex, plan, lambda shape: sizes.append(shape) or torch.empty(shape, device="meta"))
            nbytes = sum(comm.nccl.carved_bytes(shape, a.dtype) for shape in sizes)
            return comm.buffers(ex, plan, window.allocator(nbytes, a.dtype))

        out, buffer, recv = _carved(prep, ex, window, carve)
        result = alloc((ex.rows, plan.n))
    else:  # a pull's GEMM buffer in memory every rank maps, the same for every call
        shared = None if peers is None else _carved(prep, ex, peers, lambda: peers.buffer(plan.numel, a.dtype))
        out, buffer, recv = comm.buffers(ex, plan, alloc, shared)
        result = out
    timeout = signal.debug_timeout()
    tensors = (a, weight, *fresh)
    key = replay_key(prep, ex, (group, tail_group), caller, window or peers, timeout)
    known = key is not None and key in prep.programs
    program = prep.programs[key] if known else None
    if program:
        program.replay([t.data_ptr() for t in tensors])
        return result
    tape = None
    if known and program is None:  # seen once: what it set up (events, windows, communicators) is there now
        extents = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
        tape = enqueue.Tape(extents) if _disjoint(extents) else None
    elif key is not None and not known:
        prep.programs[key] = None
    with enqueue.recording(tape):
        _enqueue(prep, a, weight, ex, (group, tail_group), caller, window, (out, buffer, recv, result), timeout)
    if tape is not None:  # (False: a step that is not a native call, on every call like it)
        prep.programs[key] = tape.program() if tape.usable else False
    if timeout is not None:
        signal.raise_on_timeout(prep.report, plan.num_groups, timeout)
    return result


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
    if timeout is not None or torch.cuda.is_current_stream_capturing() or os.environ.get("FLASHOVERLAP_REPLAY") == "0":
        return None
    waits = signal.stream_waits(prep.counters.device.index, False)
    return ex, *groups, caller.cuda_stream, None if window is None else window.memory.data_ptr(), waits


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
) -> None:
    """:func:`run_overlapped`'s work on the streams: ``groups`` = (group, tail_group), ``tensors`` =
    (out, buffer, recv, result) from :func:`comm.buffers` (in ``window`` where given); ``timeout``:
    signal.debug_timeout."""
    device, plan = a.device, prep.plan
    (group, tail_group), (out, buffer, recv, result) = groups, tensors
    stream = side_stream(device)
    # (not where one communicator serves both, c10d's for comm_sms 0: its stream orders them anyway)
    apart = (
        tail_group is not None and tail_group is not group and comm.tail_apart(ex.collective, plan.layout, ex.reduction)
    )

    # A window's result is copied out group by group, where each group lands in one range, from
    # the GEMM's end on: beside the last collectives instead of after them. (As each collective
    # ended, the copies slowed the GEMM and NCCL beside it: 1.13x against 1.16x, stop 24.)
    copy_out = window is not None and comm.landed(ex, plan, 0, out) is not None
    finishes = comm.finishes(ex, plan)
    finisher = side_stream(device, "finish") if finishes or copy_out else None
    if finisher is not None and not prep.group_done:
        prep.group_done = [torch.cuda.Event() for _ in prep.targets]
        prep.gemm_done = torch.cuda.Event()

    # A pull's GEMM counts in memory the other ranks map, and they wait on that (comm.peer); this
    # rank's own counters only where its own rows are read. Its buffer and counters were claimed
    # for it at the previous call's end (Peers.claim).
    peers = group if isinstance(group, comm.Peers) else None
    shared = window if window is not None else peers  # memory every call uses: ordered across callers' streams
    if shared is not None:
        shared.acquire(caller)
    join(stream, caller, device)  # operands ready; earlier users of the buffers done
    if peers is not None:
        peers.targets = prep.targets
        # the GEMM only after the counters' zeroing, not after the rest of the comm stream's claim
        # and its wait for the caller above
        enqueue.wait(caller, peers.claimed)
    else:
        join(caller, stream, device)  # a call from another stream may not have reset the counters yet
    prep.launch(a, weight, buffer, caller, None if peers is None else peers.counters)
    if copy_out or finisher is not None and peers is not None:
        enqueue.record(prep.gemm_done, caller)
    last = len(prep.targets) - 1
    for g, target in enumerate(prep.targets):
        # The last collective, apart: on the caller's stream, ordered after the GEMM without a
        # counter wait or another stream (on a stream of its own behind a counter wait, stop 24's
        # traces showed c10d starting it 108-126 us after the GEMM's end).
        issuer = caller if g == last and apart else stream
        on = tail_group if g == last and tail_group is not None else group
        with _On(issuer, caller):
            if issuer is stream and peers is None:
                signal.wait_geq(issuer, prep.counters, g, target, timeout, prep.report)
            comm.communicate_group(ex, plan, g, buffer, recv, out, on)
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
    if copy_out:
        enqueue.wait(finisher, prep.gemm_done)
        with _On(finisher, caller):
            for g, done in enumerate(prep.group_done):
                enqueue.wait(finisher, done)
                comm.copy_2d(*(comm.landed(ex, plan, g, t).view(-1, plan.n) for t in (result, out)))
    if apart:  # the stream saw all but the last counter
        join(stream, caller, device)
    if peers is not None:  # (every group on `stream`: comm.tail_apart; its counters zeroed by Peers.claim)
        with _On(stream, caller):
            peers.copied()
    else:
        signal.reset(prep.counters, stream)  # stream-ordered: the next call's GEMM waits for it through `caller`
    # The caller's stream waits for the side streams, so the buffers of this call (allocated on it,
    # freed on return) are safe to reuse on it without record_stream.
    for side in [stream] if finisher is None else [stream, finisher]:
        join(caller, side, device)
    if peers is not None:  # the next call's claim, beside this one's last adds; its GEMM waits for it, the caller not
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


def tuned_config(
    a: torch.Tensor, world: int, ex: Exchange, shape: tuple[int, int, int], p2p: bool = True
) -> registry.Found | None:
    """The registry's config for this call (flashoverlap.registry), None without one. Where the
    entry cannot take the call (:func:`carries`; entries are tuned with equal splits on NCCL:
    unequal all-to-all splits, say), the entry's measured ``fallback``, else None."""
    key = (_device_name(a.device.index), world, ex.collective, registry.transport(), DTYPES[a.dtype], shape)
    timing = registry.timing()
    found = registry.lookup(*key, timing=timing)
    if found is not None and not carries(found.config, ex, shape, p2p):
        found = registry.lookup(*key, fallback=True, timing=timing)
    return found


@functools.cache  # every call without config= asks
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def carries(cfg: OverlapConfig, ex: Exchange, shape: tuple[int, int, int], p2p: bool = True) -> bool:
    """Whether ``cfg`` can run the call ``ex`` of GEMM ``shape``, as every rank sees it (the choice
    of a call without config=): the ``rows`` and ``segments`` layouts need equal segments of whole
    scheduling units (comm.rows_carry), symmetric windows the same buffer sizes, on every rank; the
    ``rows`` layout's send / receive a group that sends CUDA tensors point to point (``p2p``: NCCL,
    not gloo)."""
    segments_ok = cfg.layout not in comm.EQUAL_SEGMENTS or ex.uniform and comm.rows_carry(ex, rotation_unit(cfg, shape))
    sends_ok = p2p or comm.comm_pattern(ex.collective, cfg.layout) != "exchange"
    return segments_ok and sends_ok and (ex.uniform or not cfg.symmetric)


_DEFAULTS = OverlapConfig()  # frozen: built once (each construction validates)


@functools.lru_cache(maxsize=1024)  # every call asks
def for_call(cfg: OverlapConfig, ex: Exchange, shape: tuple[int, int, int]) -> OverlapConfig:
    """``cfg`` resolved for the call ``ex`` of GEMM ``shape``: the first of its resolutions
    (config.resolutions) that carries the call as every rank sees it (:func:`carries`), else the
    last. An ``auto`` layout of a reduce-scatter / all-to-all thus runs ``segments`` where its
    segments are equal and of whole tile rows: the same plain collective per group as ``cols`` with
    the TMA-store kernel (0.87 of cuBLAS against 0.83 for ``cols``, 8192x4096x7168 with 16 SMs left
    to NCCL, one H200) and less to copy (a reduce-scatter lands in place). Your config, a registry
    entry and the defaults alike, so that ``config={}`` runs what a call without config starts from."""
    *preferred, last = resolutions(cfg, ex.collective)
    return next((c for c in preferred if carries(c, ex, shape)), last)


def rotation_unit(cfg: OverlapConfig, shape: tuple[int, int, int]) -> int:
    """Rows the ``rows`` / ``segments`` schedules rotate or interleave by under ``cfg``
    (plan.rotation_rows)."""
    return rotation_rows(shape[0], shape[1], cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.swizzle)


def _gemm_collective(
    a: torch.Tensor,
    weight: torch.Tensor,
    collective: str,
    group: dist.ProcessGroup | None,
    config: OverlapConfig | dict | str | os.PathLike | None,
    weight_layout: str,
    splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    rows_per_rank: Sequence[int] | None = None,
    exchanged: list[Exchange] | None = None,
) -> torch.Tensor:
    """A call (see the module's docstring): with gradients where autograd asks for them (CUDA
    tensors; others fail the checks below), inside a graph ``torch.compile`` traces the one operator
    ``flashoverlap::gemm_collective`` (no graph break, so ``fullgraph=True`` works; its group and
    config reach it as strings fixed when the graph is traced), else run here. ``exchanged``: where
    given, the call's :class:`Exchange` is appended to it (for the gradients; not where traced)."""
    tensors = all(isinstance(t, torch.Tensor) for t in (a, weight))
    if tensors and torch.is_grad_enabled() and a.is_cuda and (a.requires_grad or weight.requires_grad):
        return with_gradients(a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank)
    if torch.compiler.is_compiling():
        counts = [None if s is None else [int(c) for c in s] for s in (splits, output_splits, rows_per_rank)]
        return torch.ops.flashoverlap.gemm_collective(
            a, weight, collective, _group_name(group), _config_text(config), weight_layout, *counts
        )
    chosen = decide(
        a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank, exchanged
    )
    if chosen.config is None:
        return sequential(a, weight, weight_layout, chosen.ex, group)
    return run_overlapped(chosen.prep, a, weight, chosen.ex, chosen.budget, tail_group=chosen.tail)


@dataclass(frozen=True, eq=False)
class Decision:
    """What a call runs (:func:`decide`): its exchange, and ``config`` None for the plain GEMM and
    collective, else the overlapped call with its plan and communicators (:func:`run_overlapped`)."""

    ex: Exchange
    config: OverlapConfig | None = None
    prep: Prepared | None = None
    budget: dist.ProcessGroup | comm.Direct | None = None
    tail: dist.ProcessGroup | comm.Direct | None = None


def decide(
    a: torch.Tensor,
    weight: torch.Tensor,
    collective: str,
    group: dist.ProcessGroup | None = None,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    weight_layout: str = "nk",
    splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    rows_per_rank: Sequence[int] | None = None,
    exchanged: list[Exchange] | None = None,
) -> Decision:
    """Which path a call takes and with which config, as :func:`_gemm_collective` runs it (every
    check first; a call without ``config=`` that is not tuned for its very shape is timed on first
    use, :func:`trial`). ``exchanged``: the call's :class:`Exchange` is appended to it. Kept for
    the next call like it (same arguments, operand shapes, dtype, device, :data:`DECISION_ENV`
    and registry files): a repeated call pays the input checks and one lookup, not the decision."""
    world = world_size(group)
    given = resolve(config) if config is not None else None
    explicit = resolutions(given, collective)[0] if given is not None else None  # its layout resolved below
    m, n, k = check_inputs(a, weight, weight_layout)
    key = None
    if splits is None and output_splits is None and rows_per_rank is None:  # (else exchanged per call)
        pg = group if group is not None else dist.group.WORLD  # (a new default group is a new call)
        key = (collective, pg, given, weight_layout, m, n, k, a.dtype, a.device.index, registry.generation)
        key += _environment(DECISION_ENV)
        if (known := _recent(_decided, key)) is not None:
            if exchanged is not None:
                exchanged.append(known.ex)
            return known
    args = (splits, output_splits, rows_per_rank, exchanged)
    decision = _decide(a, weight, collective, group, given, explicit, weight_layout, world, (m, n, k), *args)
    if key is not None and not (a.is_cuda and torch.cuda.is_current_stream_capturing()):  # (a capture skips the trial)
        _keep(_decided, key, decision, MAX_PREPARED)  # (a decision holds its plan: no more than plans kept)
    return decision


# what a decision rests on besides the call: the registry's directories and which of its entries
# apply, the transport, NCCL's API, whether untuned calls are timed, whether the path taken is reported
DECISION_ENV = (
    "FLASHOVERLAP_CONFIG_DIRS",
    "FLASHOVERLAP_TIMING",
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "FLASHOVERLAP_NCCL",
    "FLASHOVERLAP_TRIAL",
    "FLASHOVERLAP_LOG",
)
_decided: OrderedDict[tuple, Decision] = OrderedDict()  # decide's answers, most recently used last


def _environment(names: tuple[str, ...]) -> tuple:
    """The environment variables ``names`` as they stand (None where unset), to compare, not to read:
    os.environ's own entries where it keeps them (bytes on POSIX). Each ``os.environ.get`` encodes
    its name and decodes the value: ~0.8 us on the development CPU, ~3 us on the H100 host, more
    than half of a repeated call's :func:`decide`."""
    data = getattr(os.environ, "_data", None)
    if data is None:
        return tuple(map(os.environ.get, names))
    return tuple(map(data.get, _encoded(names)))


@functools.cache
def _encoded(names: tuple[str, ...]) -> tuple:
    return tuple(map(os.environ.encodekey, names))


def _decide(
    a: torch.Tensor,
    weight: torch.Tensor,
    collective: str,
    group: dist.ProcessGroup | None,
    given: OverlapConfig | None,
    explicit: OverlapConfig | None,
    weight_layout: str,
    world: int,
    mnk: tuple[int, int, int],
    splits: Sequence[int] | None,
    output_splits: Sequence[int] | None,
    rows_per_rank: Sequence[int] | None,
    exchanged: list[Exchange] | None,
) -> Decision:
    """:func:`decide`, its arguments checked (``given``: the config resolved, ``explicit``: its first
    resolution for the collective, ``mnk``: the GEMM's shape)."""
    m, n, k = mnk
    if explicit is not None and world > 1 and not explicit.sequential:  # no kernel here: fail before communicating
        for_device(explicit, torch.cuda.get_device_capability(a.device))
    ex = comm.exchange(collective, m, world, splits, output_splits, group, a.device, rows_per_rank=rows_per_rank)
    if exchanged is not None:
        exchanged.append(ex)
    # before any lookup: the same model run without tensor parallelism pays nothing more; so does a
    # call where this rank, or any rank known to, has no rows
    if world == 1 or m == 0 or ex.ragged and 0 in ex.sources:
        _say(ex, (m, n, k), a.dtype, group, "sequential: one rank" if world == 1 else "sequential: a rank has no rows")
        return Decision(ex)
    # what every rank decides alike rests on: where the ranks' M differ (known where the counts were
    # exchanged), the largest, whose GEMM sets the pace
    shape = (max(ex.sources) if ex.ragged else m, n, k)

    def plain(why: str) -> Decision:
        _say(ex, shape, a.dtype, group, f"sequential: {why}")
        return Decision(ex)

    full = group if group is not None else dist.group.WORLD
    backend = comm.cuda_backend(group)
    p2p = backend == "nccl"  # gloo carries CUDA tensors in collectives, not point to point
    if explicit is not None and not p2p and comm.comm_pattern(collective, explicit.layout) == "exchange":
        raise ValueError(
            f"layout 'rows' sends {collective} groups point to point, which a {backend} group cannot do with "
            "CUDA tensors: use an NCCL group, or layout 'segments' or 'cols'"
        )
    found = None if explicit is not None else tuned_config(a, world, ex, shape, p2p)
    # an entry for another shape is a hint (its waves, and so its choice, differ): timed like the
    # defaults, which replace a hint of sequential
    timed = explicit is None and not (found is not None and found.exact)
    hint = found.config if found is not None and not (timed and found.config.sequential) else None
    cfg = for_call(given or hint or _DEFAULTS, ex, shape)
    if cfg.symmetric and registry.transport() != "nvlink":
        # NCCL maps a window's peers through CUDA IPC wherever the driver allows peer access, whatever
        # NCCL_P2P_DISABLE says: its symmetric kernels would bypass the transport the user forced
        # (two H200s, P2P off: 3.4x "faster" than sequential, over NVLink). Without peer access NCCL
        # registers nothing anyway: no window either way.
        cfg = without_window(cfg)
    if cfg.reduction == "pull" and (why := comm.peer.unavailable(full, a.device)):
        if explicit is not None:
            raise ValueError(f"reduction 'pull' copies between the GPUs' memories: {why}; use 'nccl' or 'local'")
        cfg = without_pull(cfg)  # a tuned entry (or the nearest one) where its pulls cannot run
    source = (
        "your config"
        if explicit is not None
        else "the registry's config"
        if not timed
        else "the nearest tuned shape's config"
        if hint is not None
        else "the defaults"
    )
    # a GEMM of one wave without config= (decode-sized M, which varies a lot): nothing to overlap, and
    # found before planning
    if cfg.sequential:
        return plain(f"{source} says sequential")
    if explicit is None and one_wave(cfg, shape[0], n, a.device):
        return plain("one wave of tiles, nothing to overlap")
    if ex.ragged and not takes_every_call(cfg, collective):
        raise ValueError(
            f"the ranks pass different M ({list(ex.sources)} rows): their groups are whole tile columns "
            f"(layout 'cols', no symmetric windows), got layout {cfg.layout!r}"
            + (", symmetric: true" if cfg.symmetric else "")
        )
    with torch.cuda.device(a.device):  # the kernels launch on the current device
        if cfg.reduction != ex.reduction:
            ex = comm.with_reduction(ex, cfg.reduction, world)
        comm.check_layout(ex, cfg.layout, rotation_unit(cfg, (m, n, k)))
        if cfg.symmetric and not ex.even:
            raise ValueError(
                "symmetric windows need the same buffer sizes on every rank: equal splits, got "
                f"splits {list(ex.send)} and output_splits {list(ex.recv)}"
            )
        rotate = comm.rows_rotation(ex, cfg.layout, group_fact(group, "rank", dist.get_rank))

        def planned(c: OverlapConfig) -> Prepared:
            columns = shared_columns(*shape, a.dtype, weight_layout, a.device, c) if ex.ragged else None
            return prepare(m, n, k, a.dtype, weight_layout, a.device, c, rotate, comm.interleave(ex, c.layout), columns)

        preps = [planned(cfg)]
        if explicit is None and preps[0].plan.num_groups == 1:  # nothing to overlap: it would only add host time
            return plain(f"{source} make one group, nothing to overlap")
        candidates = [cfg]
        # (on the shape every rank decides on: candidates that differ by rank would hang in NCCL)
        others = []
        if timed:
            total = preps[0].sm_count + cfg.comm_sms
            if not cfg.late_budget:  # (a late hint is late already; its grid is every SM)
                others.append(alternative(cfg, shape, total, torch.cuda.get_device_capability(a.device)))
            # where the ranks can pull (asked only where the trial runs: the first ask per group gathers
            # every rank's view, a host sync)
            pull = pulled(cfg, collective, shape, total)
            if pull is not None and _trial_runs() and comm.peer.unavailable(full, a.device) is None:
                others.append(pull)
        for other in others:
            if other is not None and (other_prep := planned(other)).plan.num_groups > 1:
                candidates.append(other)
                preps.append(other_prep)
        exes = [ex if c.reduction == ex.reduction else comm.with_reduction(ex, c.reduction, world) for c in candidates]
        for c, prep, e in zip(candidates, preps, exes):
            call = (collective, "ragged" if ex.ragged else m, n, k, a.dtype, weight_layout, a.device.index, c)
            check_agreement(prep, collective, full, e, call)
        budgets = [budget_communicator(c, collective, full, a.device) for c in candidates]
        tail = comm.tail_group(full, a.device) if any(c.reduction != "pull" for c in candidates) else None
        tails = [None if c.reduction == "pull" else tail for c in candidates]  # (pull: no NCCL)
        pick = 0
        if timed:
            pick = trial(
                candidates, preps, budgets, a, weight, weight_layout, exes, tails, full, shape[0], found is None
            )
            if pick is None:
                return plain(f"{source} lost to it when timed")
        cfg, prep, ex = candidates[pick], preps[pick], exes[pick]
        groups = prep.plan.num_groups  # the message is built only where printed: every call passes here
        _say(
            ex,
            shape,
            a.dtype,
            group,
            lambda: f"overlapped, {source} {differences(cfg, _DEFAULTS)}: {groups} group{'s' * (groups > 1)}",
        )
        return Decision(ex, cfg, prep, budgets[pick], tails[pick])


@functools.lru_cache(maxsize=256)  # calls without NVLink ask every time (a replace() validates)
def without_window(cfg: OverlapConfig) -> OverlapConfig:
    return dataclasses.replace(cfg, symmetric=False)


@functools.lru_cache(maxsize=256)
def without_pull(cfg: OverlapConfig) -> OverlapConfig:
    return dataclasses.replace(cfg, reduction="nccl")


FEWEST_COMM_SMS = 4  # NCCL's CTAs beside an Ampere/Ada GEMM when a call without config= times fewer
PULL_SMS = 4  # the most SMs a pull candidate leaves for its adds (the tuner's pick on 2x H100, stop 29)


@functools.lru_cache(maxsize=1024)  # every call of a timed shape asks (a replace() validates)
def pulled(cfg: OverlapConfig, collective: str, shape: tuple[int, int, int], total_sms: int) -> OverlapConfig | None:
    """What an all-reduce without a tuned config also times where its ranks can pull (comm.peer):
    ``cfg`` as a ``pull`` all-reduce (no window, the budget from the start, the default partition),
    leaving for the adds the SMs its GEMM spares at the whole grid's wave count, at most
    :data:`PULL_SMS` (4 on the suite's grids; 0: the adds wait for the GEMM's end). The tuner picked
    pull with 4 SMs on every suite shape on 2x H100 (1.20x against 1.14x for stop 28's entries).
    None for another collective, a pull already, or a layout other than ``rows``."""
    if collective != "all_reduce" or cfg.reduction == "pull" or cfg.layout != "rows":
        return None
    m, n, _ = shape
    spare = spare_sms(m, n, cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.swizzle, total_sms, total_sms)
    return dataclasses.replace(
        cfg, reduction="pull", symmetric=False, late_budget=False, comm_sms=min(spare, PULL_SMS), partition=None
    )


@functools.lru_cache(maxsize=1024)  # every call of a timed shape asks (a replace() validates)
def alternative(
    cfg: OverlapConfig, shape: tuple[int, int, int], total_sms: int, capability: tuple[int, int]
) -> OverlapConfig | None:
    """What a call without a tuned config times beside ``cfg`` (and sequential): ``cfg`` with NCCL's
    SMs taken differently, the default partition for them.

    Hopper kernels: the SM budget late (``late_budget``): the GEMM on every SM until the wave from
    which the rest still end it in as many waves. Beside GEMMs much longer than their collective it
    won (two H200s, all-reduce over NVLink: 1.09x where 16 SMs from the start gave 1.04x and 4 SMs
    1.02x, 8192x4096x14336; 1.06x against 1.04x, 4096x8192x28672); where the collective is long,
    NCCL starting that late falls behind (0.95x against 1.10x, 4096x8192x8192). None where the
    budget costs the GEMM ``shape`` no wave anyway.

    Ampere/Ada kernels (their CTAs cannot stop early): NCCL on :data:`FEWEST_COMM_SMS` SMs. NCCL on
    more CTAs slowed that GEMM although they ran on SMs of their own (forced on two H200s, P2P off,
    all-reduce 8192x4096x14336: the GEMM 2.2 ms alone, 3.1-3.3 ms beside NCCL on 16 CTAs, 1.00-1.03x;
    4 CTAs 1.15-1.20x with the default partition, 1.21-1.25x with one-wave groups). None where
    ``cfg`` leaves NCCL no more than that.

    ``shape``: what every rank decides on (the largest M where they differ: candidates that differ
    by rank would hang in NCCL)."""
    if cfg.late_budget:
        return None
    try:
        if for_device(cfg, capability)[0].kernel == "sm80":
            if cfg.comm_sms <= FEWEST_COMM_SMS:
                return None
            return dataclasses.replace(cfg, comm_sms=FEWEST_COMM_SMS, partition=None)
        m, n, _ = shape
        tiles = scheduled_tiles(m, n, cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.swizzle)
        ctas, keep = min(total_sms, tiles), min(total_sms - cfg.comm_sms, tiles)  # the persistent grids
        if keep >= ctas or late_after(tiles, ctas, keep) == 0:
            return None
        late = dataclasses.replace(cfg, late_budget=True, partition=None)
        for_device(late, capability)
    except ValueError:  # no late budget for this scheduler or cluster shape
        return None
    return late


MAX_SAID = 1024
_said: OrderedDict[tuple, bool] = OrderedDict()  # what FLASHOVERLAP_LOG=1 reported, most recent last


def _say(ex: Exchange, shape: tuple[int, int, int], dtype: torch.dtype, group, path: str | Callable[[], str]) -> None:
    """With ``FLASHOVERLAP_LOG=1``: which path a kind of call took and why (``path``, or a function
    making it), once (stderr, rank 0: every rank decides alike)."""
    if os.environ.get("FLASHOVERLAP_LOG") != "1":
        return
    path = path() if callable(path) else path
    key = (ex.collective, shape, dtype, ex.ragged, path)
    if _recent(_said, key) is not None:
        return
    _keep(_said, key, True, MAX_SAID)
    if dist.get_rank(group) == 0:
        world = dist.get_world_size(group)
        what = f"{ex.collective} {'x'.join(map(str, shape))} {DTYPES[dtype]}, {world} rank{'s' * (world > 1)}"
        log.info(f"{what}{' (M differs by rank)' * ex.ragged}: {path}")


def one_wave(cfg: OverlapConfig, m: int, n: int, device: torch.device) -> bool:
    """Whether the GEMM's tiles all fit in one wave of the SMs ``cfg`` leaves it: then its plan is
    one group, found without planning (the plan says so for the other one-group cases too)."""
    tiles = -(-m // cfg.tile_m) * -(-n // cfg.tile_n)
    return tiles <= torch.cuda.get_device_properties(device).multi_processor_count - cfg.comm_sms


TRIAL_MARGIN = 0.02  # overlap must beat sequential by this fraction (as the tuner's --margin)
MAX_TRIALS = 1024
_trials: OrderedDict[tuple, int | None] = OrderedDict()  # trial's answers, most recently used last


def trial(
    cfgs: Sequence[OverlapConfig],
    preps: Sequence[Prepared],
    budgets: Sequence[dist.ProcessGroup | comm.Direct | comm.Peers],
    a: torch.Tensor,
    weight: torch.Tensor,
    weight_layout: str,
    exes: Sequence[Exchange],
    tails: Sequence[dist.ProcessGroup | comm.Direct | None],
    full: dist.ProcessGroup,
    m: int,
    untuned: bool = True,
) -> int | None:
    """Which of the overlapped calls ``cfgs`` (their plans ``preps``, communicators ``budgets``,
    exchanges ``exes`` and ``tails``: :func:`run_overlapped`) is fastest, None where none beats the sequential call on
    ``full`` by :data:`TRIAL_MARGIN`: for a call that is not tuned for its shape (the built-in
    defaults, or the nearest tuned shape's config: neither is tuned for this GPU, world size,
    transport and shape; on small GEMMs over NVLink they lose, and 16 SMs for NCCL lose beside a
    long GEMM). Timed on the call's own operands, a few rounds of each taking turns, the slower
    rank's median deciding (bench.time_variants), so that every rank decides alike; the answer is
    kept for every M of the same power of two (with the same N, K, dtype, configs, kind of exchange
    and communicators: a model whose token counts vary times each range once, not each count;
    ``m``: the M every rank decides on, the largest where they differ). Not timed while a CUDA graph
    is being captured (the first config then, the answer not kept) or with ``FLASHOVERLAP_TRIAL=0``;
    under ``FLASHOVERLAP_TIMING=graphs`` each candidate's calls are captured and replayed as a CUDA
    graph (the host's time does not count); ``untuned``: no registry entry at all (for the message)."""
    graphs = registry.timing() == "graphs"
    key = (
        graphs,
        m.bit_length(),
        weight.shape,
        a.dtype,
        weight_layout,
        a.device.index,
        tuple(cfgs),
        exes[0].collective,
        exes[0].uniform,
        exes[0].ragged,
        tuple(e.reduction for e in exes),
        tuple(budgets),
        full,
    )
    if key in _trials:
        return _recent(_trials, key)
    if not _trial_runs():
        return 0
    from .bench import time_variants

    # the candidates differ in their SM budget, or pull
    names = [
        f"overlapped, comm_sms {c.comm_sms}{' late' * c.late_budget}{' pull' * (c.reduction == 'pull')}" for c in cfgs
    ]
    variants = {"sequential": lambda i: sequential(a, weight, weight_layout, exes[0], full)}
    for name, prep, budget, ex, tail in zip(names, preps, budgets, exes, tails):
        variants[name] = lambda i, p=prep, b=budget, e=ex, t=tail: run_overlapped(p, a, weight, e, b, tail_group=t)
    times = time_variants(variants, rounds=3, block=4, warmup=1, group=full, graphs=graphs)
    timed = [j for j in range(len(cfgs)) if not math.isnan(times[names[j]])]  # NaN: some rank could not capture it
    best = min(timed, key=lambda j: times[names[j]], default=None)
    pick = best if best is not None and times[names[best]] < times["sequential"] * (1 - TRIAL_MARGIN) else None
    _keep(_trials, key, pick, MAX_TRIALS)
    if dist.get_rank(full) == 0:
        what = "no tuned config" if untuned else "tuned for another shape"
        log.info(
            f"{exes[0].collective} {m}x{preps[0].plan.n}, {what}: "
            + ", ".join(f"{name} {t:.3f} ms" for name, t in times.items())
            + f" per call{' (CUDA graphs)' * graphs} -> {'sequential' if pick is None else names[pick]}"
            f" for M in [{1 << (m.bit_length() - 1)}, "
            f"{(1 << m.bit_length()) - 1}] (tune to do better: python -m flashoverlap.tune)",
        )
    return pick


@atexit.register  # (after torch's own handlers are registered: it runs before them)
def _forget() -> None:
    """Drop every cached object that holds a process group (the calls' decisions, plans and their
    replays, agreements, windows, communicators) while the interpreter is whole: a group still alive
    when it finalizes can abort the process as the group's threads go (gloo after
    destroy_process_group: about one exit in 50 of a two-rank CPU test, stop 31's CI)."""
    for cache in (_decided, _prepared, _agreed, _windows):
        cache.clear()
    comm.forget_groups()


def _trial_runs() -> bool:
    """Whether :func:`trial` times its candidates (not under ``FLASHOVERLAP_TRIAL=0``, nor while a
    CUDA graph is captured)."""
    return os.environ.get("FLASHOVERLAP_TRIAL", "1") != "0" and not torch.cuda.is_current_stream_capturing()


def budget_communicator(
    cfg: OverlapConfig, collective: str, full: dist.ProcessGroup, device: torch.device
) -> dist.ProcessGroup | comm.Direct | comm.Peers:
    """The communicator of an overlapped call's groups during the GEMM: ``full``'s ranks capped at
    ``cfg.comm_sms`` CTAs (the copy engines where ``cfg``'s symmetric collectives can use them),
    through NCCL's C API under ``FLASHOVERLAP_NCCL=direct`` (comm.direct); for a ``pull``
    all-reduce, the ranks' mapped memory (comm.peer), no NCCL."""
    if cfg.reduction == "pull":
        return comm.peer.peers(full, device)
    copy_engine = cfg.symmetric and comm.comm_pattern(collective, cfg.layout, cfg.reduction) in comm.COPY_ENGINE
    return comm.direct(comm.budget_group(full, cfg.comm_sms, copy_engine=copy_engine), device)


def gemm_all_reduce(
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    weight_layout: str = "nk",
) -> torch.Tensor:
    """``all_reduce(a @ weight.T)`` over ``group`` -> [M, N], overlapped with the GEMM."""
    return _gemm_collective(a, weight, "all_reduce", group, config, weight_layout)


def gemm_reduce_scatter(
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    weight_layout: str = "nk",
) -> torch.Tensor:
    """``reduce_scatter_tensor`` of ``a @ weight.T`` over ``group``: rank r gets the summed rows
    [r * M / world, (r + 1) * M / world) -> [M / world, N]; M must be a multiple of the world size."""
    return _gemm_collective(a, weight, "reduce_scatter", group, config, weight_layout)


def gemm_all_to_all(
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    rows_per_rank: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    weight_layout: str = "nk",
) -> torch.Tensor:
    """``all_to_all_single`` of ``a @ weight.T``: the first ``splits[0]`` rows go to rank 0, the
    next ``splits[1]`` to rank 1, ... (even split when omitted); returns the rows received from
    every rank in rank order -> [sum(output_splits), N]. ``output_splits[s]`` = rows rank s sends
    here; omitted with ``splits``, every rank's splits are exchanged first (a small collective and a
    host sync), and the ranks may then pass different M (MoE experts; none included). Ranks whose M
    differ and that know every rank's M (``rows_per_rank``, e.g. from the dispatcher's token
    counts) pass it with ``splits`` and ``output_splits``: then nothing is exchanged."""
    return _gemm_collective(a, weight, "all_to_all", group, config, weight_layout, splits, output_splits, rows_per_rank)


def with_gradients(
    a: torch.Tensor,
    weight: torch.Tensor,
    collective: str,
    group: dist.ProcessGroup | None = None,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    weight_layout: str = "nk",
    splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    rows_per_rank: Sequence[int] | None = None,
) -> torch.Tensor:
    """``collective(a @ W^T)`` (``weight_layout`` "nk"; ``a @ W`` for "kn") with autograd: on CUDA the
    overlapped call, on the CPU (flashoverlap.nn's plain path, e.g. over gloo) matmul then the collective.
    Backward: the rows' gradient ``comm.adjoint`` of the result's, then plain matmuls for a and W."""
    call = (a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank)
    return _WithGradients.apply(*call)


class _WithGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank):
        exchanged: list[Exchange] = []
        if a.is_cuda:
            call = (a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank)
            out = _gemm_collective(*call, exchanged)
        else:  # any dtype: a model debugged on the CPU
            given = (splits, output_splits, group, a.device)
            ex = comm.exchange(collective, a.shape[0], world_size(group), *given, rows_per_rank=rows_per_rank)
            exchanged.append(ex)
            out = sequential(a, weight, weight_layout, ex, group)
        counts = None
        if collective == "all_to_all":
            if exchanged:  # eager: what the call exchanged
                ex = exchanged[0]
                counts = None if ex.uniform else (ex.send, ex.recv)
            elif splits is not None:  # traced by torch.compile, where the call is one operator
                if output_splits is None:
                    raise ValueError(
                        "under torch.compile an all-to-all with gradients needs output_splits (its backward sends "
                        "the rows back, and the counts the call exchanges stay inside its operator)"
                    )
                counts = (tuple(splits), tuple(output_splits))
        ctx.save_for_backward(a, weight)
        ctx.call = collective, group, weight_layout, counts
        return out

    @staticmethod
    def backward(ctx, grad):
        a, weight = ctx.saved_tensors
        collective, group, weight_layout, counts = ctx.call
        rows = comm.adjoint(collective, grad, group, counts)  # the gradient of a @ W^T (or a @ W)
        grad_a = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_a = rows @ weight if weight_layout == "nk" else rows @ weight.t()
        if ctx.needs_input_grad[1]:
            grad_w = rows.t() @ a if weight_layout == "nk" else a.t() @ rows
        return grad_a, grad_w, None, None, None, None, None, None, None


@torch.compiler.assume_constant_result
def _group_name(group: dist.ProcessGroup | None) -> str:
    world_size(group)  # a clear error where no group is initialised, while the graph is traced
    return (group if group is not None else dist.group.WORLD).group_name


@torch.compiler.assume_constant_result
def _config_text(config: OverlapConfig | dict | str | os.PathLike | None) -> str:
    """``config`` as the operator takes it: "" for none (the registry's), else the resolved config's
    fields as JSON (validated, and a YAML file read, once, while the graph is traced)."""
    return "" if config is None else json.dumps(dataclasses.asdict(resolve(config)))


@functools.lru_cache(maxsize=256)
def _config_of(text: str) -> OverlapConfig | None:
    return None if text == "" else resolve(json.loads(text))


# Defined through torch.library.Library, not custom_op: its wrappers cost a compiled call ~10 us more
# host time (one CPU); the operator has no autograd formula (the overlapped call has none either).
_library = torch.library.Library("flashoverlap", "DEF")
_library.define(
    "gemm_collective(Tensor a, Tensor weight, str collective, str group, str config, str weight_layout, "
    "int[]? splits, int[]? output_splits, int[]? rows_per_rank=None) -> Tensor"
)


def _gemm_collective_op(a, weight, collective, group, config, weight_layout, *counts):
    pg = dist.distributed_c10d._resolve_process_group(group)
    return _gemm_collective(a, weight, collective, pg, _config_of(config), weight_layout, *counts)


_library.impl("gemm_collective", _gemm_collective_op, "CompositeExplicitAutograd")


@torch.library.register_fake("flashoverlap::gemm_collective")
def _(a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank=None):
    m, n, _ = check_inputs(a, weight, weight_layout)
    if collective == "reduce_scatter":
        rows = m // dist.distributed_c10d._resolve_process_group(group).size()
    elif output_splits is not None:
        rows = sum(output_splits)
    elif splits is not None:  # exchanged on every call: known only then
        rows = torch.library.get_ctx().new_dynamic_size()
    else:
        rows = m
    return a.new_empty((rows, n))
