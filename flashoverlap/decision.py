"""Which path a call takes, and with which config: the plain GEMM and collective, or overlapped.

A call with ``config`` runs it (refused before anything is launched where it cannot). One
without takes the registry's entry for its very shape (flashoverlap.registry); one that is not
tuned for its shape (the built-in defaults, or the nearest tuned shape's config) is timed on its
first use against the plain call (:func:`trial`). A group of one rank, a call where a rank has no
rows and a GEMM of one group (one wave without ``config``: nothing to overlap) run plain before
any of that. What a kind of call decided is kept in its group's state (flashoverlap.state) until
:func:`flashoverlap.registry.reload`: the registry files and the environment a decision rests on
are read when it is made.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import comm, registry, runtime, signal, state, timing, watchdog
from .comm import Exchange
from .comm.nccl import group_fact
from .config import FP8_TILES, OverlapConfig, differences, resolve
from .inputs import FP8_DTYPES, OPERAND_DTYPES, Fp8, Scales, check_inputs, world_size
from .prepared import Prepared, prepare, shared_columns
from .rules import (
    FP8_MIN_CAPABILITY,
    alternative,
    carries,
    check_layout,
    for_call,
    for_device,
    fused_pull,
    fused_tiles,
    kernel_spec,
    one_wave,
    peer_memory,
    pulled,
    resolutions,
    rotation_unit,
    spills_promoted,
    takes_every_call,
    wider_reads,
    without_pull,
    without_window,
)

log = logging.getLogger(__name__)
_DEFAULTS = OverlapConfig()  # frozen: built once (each construction validates)
_FP8_DEFAULTS = OverlapConfig(**FP8_TILES)  # FP8 operands' (config.FP8_TILES says why)
Communicator = dist.ProcessGroup | comm.Direct | comm.Peers


@dataclass(frozen=True, eq=False)
class Decision:
    """What a call runs (:func:`decide`): its exchange, and ``run(a, weight, scales=None)`` (FP8
    operands: with their scales): the plain GEMM and collective where ``config`` is None, else the
    overlapped call with its plan and communicators (runtime.run_overlapped)."""

    ex: Exchange
    run: Callable[..., torch.Tensor]
    config: OverlapConfig | None = None
    prep: Prepared | None = None
    budget: Communicator | None = None
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
    scales: Scales | None = None,
    fp8: Fp8 | None = None,
) -> Decision:
    """Which path a call takes and with which config (every check first; a call without
    ``config=`` that is not tuned for its very shape is timed on first use, :func:`trial`).
    ``exchanged``: the call's :class:`Exchange` is appended to it; FP8 operands: their ``scales`` and
    ``fp8`` (result dtype, accumulation: inputs.check_scales). Kept in the group's state for the
    next call like it (same arguments, operand shapes, dtypes and device; not one whose counts are
    exchanged): a repeated call pays the input checks and one lookup, not the decision."""
    world = world_size(group)
    given = resolve(config, getattr(a, "dtype", None) in FP8_DTYPES) if config is not None else None
    explicit = resolutions(given, collective)[0] if given is not None else None  # its layout resolved below
    m, n, k = check_inputs(a, weight, weight_layout)
    if not (a.dtype in FP8_DTYPES) == (scales is not None) == (fp8 is not None):
        raise ValueError(f"FP8 operands take scales and their kind, others neither: a is {a.dtype}, {scales}, {fp8}")
    key, kept = None, state.of(group).decisions
    if splits is None and output_splits is None and rows_per_rank is None:  # (else exchanged per call)
        key = (collective, given, weight_layout, m, n, k, a.dtype, fp8, a.device.index)
        if (known := kept.recent(key)) is not None:
            if exchanged is not None:
                exchanged.append(known.ex)
            return known
    args = (splits, output_splits, rows_per_rank, exchanged, scales, fp8)
    decision = _decide(a, weight, collective, group, given, explicit, weight_layout, world, (m, n, k), *args)
    if key is not None and not capturing(a):  # (a capture skips the trial)
        kept.keep(key, decision)
    return decision


def capturing(a: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``a``'s device: what a call decides then is not
    kept (it skips the trial)."""
    return a.is_cuda and torch.cuda.is_current_stream_capturing()


class Start(NamedTuple):
    """The config a call starts from (:func:`_start`), and what it rests on."""

    config: OverlapConfig
    source: str  # where it came from, for FLASHOVERLAP_LOG
    timed: bool  # not tuned for the call's very shape: its first use is timed (:func:`trial`)
    untuned: bool  # no registry entry at all (for the trial's message)


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
    scales: Scales | None,
    fp8: Fp8 | None,
) -> Decision:
    """:func:`decide`, its arguments checked (``given``: the config resolved, ``explicit``: its first
    resolution for the collective, ``mnk``: the GEMM's shape): the exchange, the config the call
    starts from, its plans and the candidates timed beside it, their communicators, the pick."""
    m, n, k = mnk
    capability = torch.cuda.get_device_capability(a.device) if scales is not None else None
    if scales is not None and capability < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"FP8 operands need a GPU with FP8 tensor cores (sm_89 or later): {a.device} is "
            f"sm_{capability[0]}{capability[1]}"
        )
    if explicit is not None and world > 1 and not explicit.sequential:  # no kernel here: fail before communicating
        for_device(explicit, capability or torch.cuda.get_device_capability(a.device))
        if fp8 is not None:  # (an FP8 kernel's own limits: its K tile, its epilogue for rowwise scales)
            out, operands = OPERAND_DTYPES[fp8.out_dtype], OPERAND_DTYPES[a.dtype]
            resolved, spec = kernel_spec(explicit, out, weight_layout, capability, operands, fp8.rowwise)
            if spills_promoted(spec) and not fp8.fast_accum:
                _warn_spills(resolved.tile_m, resolved.tile_n)
    ex = comm.exchange(collective, m, world, splits, output_splits, group, a.device, rows_per_rank=rows_per_rank)
    if exchanged is not None:
        exchanged.append(ex)
    # before any lookup: the same model run without tensor parallelism pays nothing more; so does a
    # call where this rank, or any rank known to, has no rows
    if world == 1 or m == 0 or ex.ragged and 0 in ex.sources:
        _say(ex, (m, n, k), a.dtype, group, "sequential: one rank" if world == 1 else "sequential: a rank has no rows")
        return Decision(ex, runtime.plain(ex, group, weight_layout, world, fp8))
    # what every rank decides alike rests on: where the ranks' M differ (known where the counts were
    # exchanged), the largest, whose GEMM sets the pace
    shape = (max(ex.sources) if ex.ragged else m, n, k)

    def plain(why: str) -> Decision:
        _say(ex, shape, a.dtype, group, f"sequential: {why}")
        return Decision(ex, runtime.plain(ex, group, weight_layout, world, fp8))

    if explicit is not None and explicit.sequential:  # (on any GPUs: nothing is asked of them)
        return plain("your config says sequential")
    if fp8 is not None and explicit is None and capability != (9, 0):
        # Ada's FP8 kernels (the sm80 family's mma.sync) run only where a config asks for them: never
        # measured on an Ada GPU, and forced on Hopper 15-200x slower than cuBLAS (docs/experiments.md)
        return plain(f"FP8 overlap on sm_{capability[0]}{capability[1]} only with config=")
    full = group if group is not None else dist.group.WORLD
    start = _start(a, collective, group, full, given, explicit, world, ex, shape, fp8)
    cfg, source = start.config, start.source
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
        ex, planned = _planning(a, weight_layout, group, cfg, ex, world, mnk, shape, fp8)
        preps = [planned(cfg)]
        if explicit is None and preps[0].plan.num_groups == 1:  # nothing to overlap: it would only add host time
            return plain(f"{source} make one group, nothing to overlap")
        rowwise = fp8 is not None and fp8.rowwise
        candidates, preps = _candidates(cfg, preps, planned, start.timed, ex, shape, full, a.device, rowwise)
        exes = [comm.with_reduction(ex, c.reduction, world) for c in candidates]
        for c, prep, e in zip(candidates, preps, exes):
            call = (collective, "ragged" if ex.ragged else m, n, k, a.dtype, fp8, weight_layout, a.device.index, c)
            check_agreement(prep, collective, full, e, call)
        budgets = [budget_communicator(c, collective, full, a.device) for c in candidates]
        tail = comm.tail_group(full, a.device) if any(c.reduction not in comm.PULLS for c in candidates) else None
        tails = [None if c.reduction in comm.PULLS else tail for c in candidates]  # (pulls: no NCCL)
        pick = 0
        if start.timed:
            pick = trial(
                candidates,
                preps,
                budgets,
                a,
                weight,
                weight_layout,
                exes,
                tails,
                full,
                shape[0],
                start.untuned,
                scales=scales,
                fp8=fp8,
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
        return _overlapped(ex, cfg, prep, budgets[pick], tails[pick])


@functools.cache  # once per tile shape: calls with splits are decided on every call
def _warn_spills(tile_m: int, tile_n: int) -> None:
    log.warning(
        f"FP8 {tile_m}x{tile_n} tiles with promoted sums (use_fast_accum=False) spill registers on Hopper and "
        "run at about a third of torch._scaled_mm's speed: leave the tiles to FP8's defaults (256x128) or pass "
        "use_fast_accum=True"
    )


def _overlapped(
    ex: Exchange, cfg: OverlapConfig, prep: Prepared, budget: Communicator, tail: dist.ProcessGroup | comm.Direct | None
) -> Decision:
    """The decision to run ``prep`` overlapped with these communicators (the watchdog that will
    watch its calls made, its settings checked, before any of them runs)."""
    watchdog.get()

    def run(a: torch.Tensor, weight: torch.Tensor, scales: Scales | None = None) -> torch.Tensor:
        return runtime.run_overlapped(prep, a, weight, ex, budget, tail_group=tail, scales=scales)

    return Decision(ex, run, cfg, prep, budget, tail)


def _start(
    a: torch.Tensor,
    collective: str,
    group: dist.ProcessGroup | None,
    full: dist.ProcessGroup,
    given: OverlapConfig | None,
    explicit: OverlapConfig | None,
    world: int,
    ex: Exchange,
    shape: tuple[int, int, int],
    fp8: Fp8 | None = None,
) -> Start:
    """The config a call starts from: the one given, else the registry's for the group's transport
    (a hint where tuned for another shape), else the defaults (``fp8``: FP8's); resolved for the
    call, without what its ranks cannot run (a window without NVLink, pulls without peer access,
    neither across hosts). Every rank's host and GPU are asked first, once per group
    (comm.peer.every_rank): ranks on different GPUs are refused (:func:`check_gpus`) before any
    choice rests on this rank's own."""
    backend = comm.cuda_backend(group)
    p2p = backend == "nccl"  # gloo carries CUDA tensors in collectives, not point to point
    if explicit is not None and not p2p and comm.comm_pattern(collective, explicit.layout) == "exchange":
        raise ValueError(
            f"layout 'rows' sends {collective} groups point to point, which a {backend} group cannot do with "
            "CUDA tensors: use an NCCL group, or layout 'segments' or 'cols'"
        )
    ranks = comm.peer.every_rank(full, a.device)
    check_gpus(ranks)
    hosts = comm.peer.hosts(ranks)
    transport = registry.transport(len(hosts))
    found = None if explicit is not None else tuned_config(a, world, ex, shape, transport, p2p)
    # an entry for another shape is a hint (its waves, and so its choice, differ): timed like the
    # defaults, which replace a hint of sequential
    timed = explicit is None and not (found is not None and found.exact)
    hint = found.config if found is not None and not (timed and found.config.sequential) else None
    cfg = for_call(given or hint or (_DEFAULTS if fp8 is None else _FP8_DEFAULTS), ex, shape)
    # NCCL carries a group across hosts over the network, and peer memory reaches no other host: your
    # config is refused; a registry entry (or the nearest one) drops its window (transport net) and
    # pulls (comm.peer.unavailable) below
    if explicit is not None and len(hosts) > 1 and (paths := peer_memory(cfg)):
        raise ValueError(
            f"{' and '.join(paths)} reach the other GPUs' memory, which GPUs of one host alone can; the ranks "
            f"of this group sit on {len(hosts)} hosts ({', '.join(hosts)}): leave {' and '.join(paths)} out"
        )
    if cfg.symmetric and transport != "nvlink":
        # NCCL maps a window's peers through CUDA IPC wherever the driver allows peer access, whatever
        # NCCL_P2P_DISABLE says: its symmetric kernels would bypass the transport the user forced
        # (two H200s, P2P off: 3.4x "faster" than sequential, over NVLink). Without peer access NCCL
        # registers nothing anyway: no window either way.
        cfg = without_window(cfg)
    if cfg.reduction in comm.PULLS and (why := comm.peer.unavailable(full, a.device)):
        if explicit is not None:
            raise ValueError(
                f"reduction {cfg.reduction!r} copies between the GPUs' memories: {why}; use 'nccl' or 'local'"
            )
        cfg = without_pull(cfg)  # a tuned entry (or the nearest one) where its pulls cannot run
    if explicit is None and fp8 is not None and fp8.rowwise and cfg.reduction == "pull_fused":
        # (its epilogue scales by one alpha: rowwise scales take the copied pull, with the spare SMs)
        total = torch.cuda.get_device_properties(a.device).multi_processor_count
        cfg = pulled(cfg, collective, shape, total, world)
    source = (
        "your config"
        if explicit is not None
        else "the registry's config"
        if not timed
        else "the nearest tuned shape's config"
        if hint is not None
        else "the defaults"
    )
    return Start(cfg, source, timed, found is None)


def _planning(
    a: torch.Tensor,
    weight_layout: str,
    group: dist.ProcessGroup | None,
    cfg: OverlapConfig,
    ex: Exchange,
    world: int,
    mnk: tuple[int, int, int],
    shape: tuple[int, int, int],
    fp8: Fp8 | None,
) -> tuple[Exchange, Callable[[OverlapConfig], Prepared]]:
    """The call's exchange with ``cfg``'s reduction, checked against its layout, and ``planned(c)``:
    the plan of config ``c`` for this rank's GEMM ``mnk`` (on the shared columns of the largest M,
    ``shape``, where the ranks' M differ; ``fp8``: an FP8 GEMM's result and accumulation), rotated
    or interleaved as ``c``'s own layout says (a candidate's may differ from ``cfg``'s: a pull in
    ``segments`` beside NCCL's ``rows``)."""
    m, n, k = mnk
    ex = comm.with_reduction(ex, cfg.reduction, world)
    check_layout(ex, cfg.layout, rotation_unit(cfg, mnk))
    fused_tiles(cfg, n)
    if cfg.symmetric and not ex.even:
        raise ValueError(
            "symmetric windows need the same buffer sizes on every rank: equal splits, got "
            f"splits {list(ex.send)} and output_splits {list(ex.recv)}"
        )
    rank = group_fact(group, "rank", dist.get_rank)

    def planned(c: OverlapConfig) -> Prepared:
        columns = shared_columns(*shape, a.dtype, weight_layout, a.device, c, fp8=fp8) if ex.ragged else None
        rotate, segments = comm.rows_rotation(ex, c.layout, rank), comm.interleave(ex, c.layout, c.reduction)
        return prepare(m, n, k, a.dtype, weight_layout, a.device, c, rotate, segments, columns, fp8=fp8)

    return ex, planned


def _candidates(
    cfg: OverlapConfig,
    preps: list[Prepared],
    planned: Callable[[OverlapConfig], Prepared],
    timed: bool,
    ex: Exchange,
    shape: tuple[int, int, int],
    full: dist.ProcessGroup,
    device: torch.device,
    rowwise: bool = False,
) -> tuple[list[OverlapConfig], list[Prepared]]:
    """The configs a call may run, and their plans: ``cfg`` (planned: ``preps``), and where the call
    is timed the same with NCCL's SMs taken differently (rules.alternative) and, where the ranks
    can pull, as a pull (rules.pulled; where its sums read the others' memory in place, also with
    more SMs for them: rules.wider_reads; a reduce-scatter's also with its sums in the epilogue:
    rules.fused_pull, not with rowwise FP8 scales); only those that carry the call (rules.carries: a pull's
    layout may not) in more than one group. On the shape every rank decides on: candidates that
    differ by rank would hang in NCCL."""
    candidates, collective = [cfg], ex.collective
    others = []
    if timed:
        total = preps[0].sm_count + (0 if cfg.late_budget else cfg.comm_sms)  # (a late grid has every SM)
        if not cfg.late_budget:  # (a late hint is late already; its grid is every SM)
            others.append(alternative(cfg, shape, total, torch.cuda.get_device_capability(device)))
        # where the ranks can pull (asked only where the trial runs: the first ask per group gathers
        # every rank's view, a host sync)
        pull = pulled(cfg, collective, shape, total, dist.get_world_size(full))
        if (  # (carries asked first too: a pull that cannot carry the call costs no peer-access host sync)
            pull is not None
            and carries(pull, ex, shape)
            and _trial_runs()
            and comm.peer.unavailable(full, device) is None
        ):
            # (the hint may be the copied pull itself: pulled() gives None)
            fused = None if rowwise else fused_pull(pull or cfg, collective, torch.cuda.get_device_capability(device))
            others += [pull, wider_reads(pull), fused]
    for other in others:
        if other is None or other in candidates or not carries(other, ex, shape):
            continue
        if (other_prep := planned(other)).plan.num_groups > 1:
            candidates.append(other)
            preps.append(other_prep)
    return candidates, preps


def tuned_config(
    a: torch.Tensor, world: int, ex: Exchange, shape: tuple[int, int, int], transport: str, p2p: bool = True
) -> registry.Found | None:
    """The registry's config for this call over ``transport`` (flashoverlap.registry), None without
    one. Where the entry cannot take the call (rules.carries; entries are tuned with equal splits on
    NCCL: unequal all-to-all splits, say), the entry's measured ``fallback``, else None."""
    key = (_device_name(a.device.index), world, ex.collective, transport, OPERAND_DTYPES[a.dtype], shape)
    timing = registry.timing()
    found = registry.lookup(*key, timing=timing)
    if found is not None and not carries(found.config, ex, shape, p2p):
        found = registry.lookup(*key, fallback=True, timing=timing)
    return found


@functools.cache  # every decision without config= asks
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def check_gpus(ranks: Sequence[comm.peer.Rank]) -> None:
    """Refuse a group whose ranks run on different GPU models or SM counts (``ranks``: every rank's,
    comm.peer.every_rank): each rank would look up the registry, count waves and plan on its own GPU,
    and ranks that choose differently (one plain, one overlapped; plans of different sizes) wait for
    each other in NCCL forever. Every rank holds every rank's view, so every rank raises alike."""
    kinds: dict[tuple[str, int], list[int]] = {}
    for rank, r in enumerate(ranks):
        kinds.setdefault((r.name, r.sms), []).append(rank)
    if len(kinds) > 1:
        which = "; ".join(f"ranks {ids} on {name} ({sms} SMs)" for (name, sms), ids in kinds.items())
        raise RuntimeError(
            f"flashoverlap: the ranks of a group run on different GPUs ({which}): an overlapped call plans on its "
            "GPU's SMs and takes its registry entry by GPU, which must be alike on every rank: make groups of one "
            "GPU model, or pass config={'sequential': True}"
        )


def check_agreement(prep: Prepared, collective: str, group: dist.ProcessGroup, ex: Exchange, call: tuple) -> None:
    """On the first use of ``call`` with ``group`` (every use with ``FLASHOVERLAP_DEBUG=1``), check
    that all ranks run the same plan, so that a mismatch fails loudly instead of hanging in NCCL.

    ``call``: what the plan follows from, alike on every rank of a consistent call (never this
    rank's own state, such as which plans it keeps: ranks whose M differ keep different plans, and a
    rank that skipped the check while another ran it would leave both hanging). Ranks whose M differ
    agree once per kind of call, not per call: every rank's M reaches every rank alike (exchanged),
    and their columns follow from it. That the ranks' GPUs are alike was checked before anything
    rested on them (:func:`check_gpus`, once per group)."""
    agreed = state.of(group).agreed
    if agreed.recent(call) is not None and signal.debug_timeout() is None:
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
    agreed.keep(call, True)


def budget_communicator(
    cfg: OverlapConfig, collective: str, full: dist.ProcessGroup, device: torch.device
) -> Communicator:
    """The communicator of an overlapped call's groups during the GEMM: ``full``'s ranks capped at
    ``cfg.comm_sms`` CTAs (the copy engines where ``cfg``'s symmetric collectives can use them),
    through NCCL's C API under ``FLASHOVERLAP_NCCL=direct`` (comm.direct); for a pull, the ranks'
    mapped memory (comm.peer), no NCCL."""
    if cfg.reduction in comm.PULLS:
        return comm.peer.peers(full, device)
    copy_engine = cfg.symmetric and comm.comm_pattern(collective, cfg.layout, cfg.reduction) in comm.COPY_ENGINE
    return comm.direct(comm.budget_group(full, cfg.comm_sms, copy_engine=copy_engine), device)


def _say(ex: Exchange, shape: tuple[int, int, int], dtype: torch.dtype, group, path: str | Callable[[], str]) -> None:
    """With ``FLASHOVERLAP_LOG=1``: which path a kind of call took and why (``path``, or a function
    making it), once (stderr, rank 0: every rank decides alike)."""
    if os.environ.get("FLASHOVERLAP_LOG") != "1":
        return
    path = path() if callable(path) else path
    key, said = (ex.collective, shape, dtype, ex.ragged, path), state.of(group).said
    if said.recent(key) is not None:
        return
    said.keep(key, True)
    if dist.get_rank(group) == 0:
        world = dist.get_world_size(group)
        what = f"{ex.collective} {'x'.join(map(str, shape))} {OPERAND_DTYPES[dtype]}, {world} rank{'s' * (world > 1)}"
        log.info(f"{what}{' (M differs by rank)' * ex.ragged}: {path}")


TRIAL_MARGIN = 0.02  # overlap must beat sequential by this fraction (as the tuner's --margin)
TRIAL_ROUNDS = 3  # rounds (rounded up to whole cycles of orders), each of timing.round_calls calls
# calls of each variant before its timed rounds: an overlapped call's set-up and recorded calls
# (runtime.RECORDED_CALLS), which take more host time than the replays that follow, then one replay,
# so that no timed round starts with a kind's first native run
TRIAL_WARMUP = runtime.RECORDED_CALLS + 1


def trial(
    cfgs: Sequence[OverlapConfig],
    preps: Sequence[Prepared],
    budgets: Sequence[Communicator],
    a: torch.Tensor,
    weight: torch.Tensor,
    weight_layout: str,
    exes: Sequence[Exchange],
    tails: Sequence[dist.ProcessGroup | comm.Direct | None],
    full: dist.ProcessGroup,
    m: int,
    untuned: bool = True,
    scales: Scales | None = None,
    fp8: Fp8 | None = None,
) -> int | None:
    """Which of the overlapped calls ``cfgs`` (their plans ``preps``, communicators ``budgets``,
    exchanges ``exes`` and ``tails``: runtime.run_overlapped) to run, None for the sequential call
    on ``full`` (:func:`trial_pick`): for a call that is not tuned for its shape (the built-in
    defaults, or the nearest tuned shape's config: neither is tuned for this GPU, world size,
    transport and shape; on small GEMMs over NVLink they lose, and 16 SMs for NCCL lose beside a
    long GEMM). Timed on the call's own operands, a few rounds of each taking turns, every rank's
    rounds deciding (timing.time_samples, each round no faster than the host enqueued it), so that
    every rank decides alike: with the same operands
    every call (hot in L2, as a layer's), and where they fit in L2, also rotated through copies
    larger than it together (as where activations come from far away). The answer is kept for
    every M of the same power of two (with the same N, K, dtype, configs, kind of exchange and
    communicators: a model whose token counts vary times each range once, not each count; ``m``:
    the M every rank decides on, the largest where they differ). Not timed while a CUDA graph is
    being captured (the first config then, the answer not kept) or with ``FLASHOVERLAP_TRIAL=0``;
    under ``FLASHOVERLAP_TIMING=graphs`` each candidate's calls are captured and replayed as a CUDA
    graph (the host's time does not count); ``untuned``: no registry entry at all (for the message);
    FP8 operands: their ``scales`` and ``fp8``."""
    graphs = registry.timing() == "graphs"
    key = (
        graphs,
        m.bit_length(),
        weight.shape,
        a.dtype,
        fp8,
        weight_layout,
        a.device.index,
        tuple(cfgs),
        exes[0].collective,
        exes[0].uniform,
        exes[0].ragged,
        tuple(e.reduction for e in exes),
        tuple(budgets),
    )
    trials = state.of(full).trials
    if key in trials:
        return trials.recent(key)
    if not _trial_runs():
        return 0
    # the candidates differ in their SM budget, or pull
    names = [
        f"overlapped, comm_sms {c.comm_sms}{' late' * c.late_budget}{f' {c.reduction}' * (c.reduction in comm.PULLS)}"
        for c in cfgs
    ]

    plain = runtime.plain(exes[0], full, weight_layout, world_size(full), fp8)  # (made once, as a call decided plain)

    def variants(operands: list[torch.Tensor], weights: list[torch.Tensor]) -> dict[str, Callable[[int], object]]:
        def on(i: int) -> tuple[torch.Tensor, torch.Tensor]:  # call i's operands
            return operands[i % len(operands)], weights[i % len(weights)]

        timed = {"sequential": lambda i: plain(*on(i), scales)}
        for name, prep, budget, ex, tail in zip(names, preps, budgets, exes, tails):
            timed[name] = lambda i, p=prep, b=budget, e=ex, t=tail: runtime.run_overlapped(
                p, *on(i), e, b, tail_group=t, scales=scales
            )
        return timed

    rounds = {}
    block = timing.round_calls(m, preps[0].plan.n, a.shape[1])
    for mode, sets in _operands(a, weight).items():
        calls = variants(*sets)
        rounds[mode] = timing.time_samples(
            calls, TRIAL_ROUNDS, block, TRIAL_WARMUP, group=full, graphs=graphs, host_floor=True
        )
    pick = trial_pick(names, list(rounds.values()))
    trials.keep(key, pick)
    if dist.get_rank(full) == 0:
        what = "no tuned config" if untuned else "tuned for another shape"

        def said(name: str, samples: dict) -> str:  # its time per call, and against sequential's in the same turns
            base, own = samples["sequential"], samples[name]
            text = f"{name} {timing.slowest(own):.3f} ms"
            if name == "sequential":
                return text
            return f"{text} ({timing.paired_speedup(base, own):.3f}x +-{timing.paired_spread(base, own):.0%})"

        summary = "; ".join(
            f"{mode}: " + ", ".join(said(name, samples) for name in samples) for mode, samples in rounds.items()
        )
        log.info(
            f"{exes[0].collective} {m}x{preps[0].plan.n}, {what}: {summary} per call"
            f"{' (CUDA graphs)' * graphs} -> {'sequential' if pick is None else names[pick]}"
            f" for M in [{1 << (m.bit_length() - 1)}, "
            f"{(1 << m.bit_length()) - 1}] (tune to do better: python -m flashoverlap.tune)"
        )
        if log.isEnabledFor(logging.DEBUG):  # every rank's rounds behind those medians: what a trial gone wrong shows
            for mode, samples in rounds.items():
                for name, ranks in samples.items():
                    each = "; ".join(" ".join(f"{t:.3f}" for t in rank) for rank in ranks)
                    label = f"trial of {exes[0].collective} {m}x{preps[0].plan.n}, {mode}, {name}"
                    log.debug(f"{label}: {each} ms per call")
    return pick


def _operands(a: torch.Tensor, weight: torch.Tensor) -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """What a trial times its calls on: the call's own operands every call ("hot"), and where they fit
    in L2, copies of them to rotate through, larger than L2 together ("rotated"; timing.input_sets)."""
    modes = {"hot": ([a], [weight])}
    (m, k), per_set = a.shape, a.numel() * a.element_size() + weight.numel() * weight.element_size()
    l2 = torch.cuda.get_device_properties(a.device).L2_cache_size
    if per_set < l2:
        copies = timing.input_sets(m, weight.numel() // k, k, a.dtype, l2) - 1
        modes["rotated"] = (
            [a, *(a.clone() for _ in range(copies))],
            [weight, *(weight.clone() for _ in range(copies))],
        )
    return modes


def trial_pick(
    names: Sequence[str], modes: Sequence[Mapping[str, Sequence[Sequence[float]]]], margin: float = TRIAL_MARGIN
) -> int | None:
    """The candidate (an index into ``names``) a trial runs, None for the sequential call, from its
    rounds ``modes`` (one per way of timing: operands hot, rotated; each every rank's rounds of every
    variant, timing.time_samples, ``"sequential"`` among them): of the candidates faster than
    sequential in every mode by more than ``margin`` and more than the noise of that speedup, both
    paired round by round (timing.paired_speedup, timing.paired_spread: a host-bound call's host
    drifts between speeds over seconds, which two medians taken apart carry and a turn's pair does
    not; a smaller win may be noise, and the plain call never loses to itself), the one with the
    largest speedup in the mode it wins least in. A candidate some rank could not time (NaN) is none."""
    best, best_speedup = None, 1.0
    for j, name in enumerate(names):
        speedups = []
        for samples in modes:
            base, other = samples["sequential"], samples[name]
            speedup, noise = timing.paired_speedup(base, other), timing.paired_spread(base, other)
            if math.isnan(speedup) or math.isnan(noise) or not 1 / speedup < 1 - max(margin, noise):
                break
            speedups.append(speedup)
        else:
            if min(speedups) > best_speedup:
                best, best_speedup = j, min(speedups)
    return best


def _trial_runs() -> bool:
    """Whether :func:`trial` times its candidates (not under ``FLASHOVERLAP_TRIAL=0``, nor while a
    CUDA graph is captured)."""
    return os.environ.get("FLASHOVERLAP_TRIAL", "1") != "0" and not torch.cuda.is_current_stream_capturing()
