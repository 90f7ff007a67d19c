"""What a call may take: layout, reduction, kernel family, window and pull, in one place.

Every choice of how a call runs asks here: which layouts a config resolves to for a collective
(:func:`for_collective`, :func:`resolutions`) and for a known call (:func:`for_call`, as every
rank sees it: :func:`carries`), what a config runs on a GPU (:func:`for_device`,
:func:`kernel_spec`), what a call's groups communicate (:func:`comm_pattern`) and where their
last group may go (:func:`tail_apart`), and the configs a call without a tuned one also times
(:func:`alternative`, :func:`pulled`, :func:`wider_reads`). Nothing here communicates or launches anything.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import torch

from .config import PULLS as PULLS
from .config import REDUCTIONS as REDUCTIONS
from .config import ROW_MAJOR, OverlapConfig, family_problems, gemm_instance
from .gemm.generator import FAMILIES, FP8_DTYPES, GemmSpec
from .plan import late_after, rotation_rows, scheduled_tiles, spare_sms

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")
# what each collective takes: a pull reduce-scatter / all-to-all copies this rank's rows of every
# rank's group out of its memory (the ``segments`` layout: for_collective), which is already a
# reduce-scatter's share: no pull_scatter there
TAKES = {
    "all_reduce": ("nccl", "local", "pull", "pull_scatter"),
    "reduce_scatter": ("nccl", "pull", "pull_fused"),
    "all_to_all": ("nccl", "pull"),
}
# layouts whose reduce-scatter / all-to-all need equal segments of whole units (rows_carry)
EQUAL_SEGMENTS = ("rows", "segments")
COPY_ENGINE = ("all_to_all", "all_gather")  # comm_patterns NCCL runs on copy engines (windows, CTA policy ZERO)


class Exchange(Protocol):
    """What the rules ask of a call's communication (comm.Exchange)."""

    collective: str
    send: tuple[int, ...]
    recv: tuple[int, ...]
    uniform: bool  # every rank knows that every rank sends and receives as many rows

    @property
    def even(self) -> bool: ...  # this rank sends and receives as many rows to and from every rank


@functools.lru_cache(maxsize=256)  # once per config: replace() re-validates, every call would pay it
def for_collective(cfg: OverlapConfig, collective: str) -> OverlapConfig:
    """``cfg`` with an ``auto`` layout resolved for ``collective`` as a call that ``segments`` cannot
    carry resolves it (``cols``; :func:`for_call` picks for a known call); raises where the config
    cannot run it."""
    layout = cfg.layout
    if layout == "auto" and cfg.reduction in PULLS:
        layout = pull_layout(collective, cfg.reduction)
    elif layout == "auto":
        layout = "rows" if collective == "all_reduce" else "cols"
    if collective != "all_reduce" and layout == "tiles":
        raise ValueError(
            f"{collective} needs layout 'cols', 'rows' or 'segments' (groups that split into per-rank row segments), "
            f"got layout {layout!r}"
        )
    if collective == "all_reduce" and layout == "segments":
        raise ValueError(
            "layout 'segments' splits rows into per-rank segments (reduce_scatter, all_to_all); "
            "all_reduce takes 'rows', 'tiles' or 'cols'"
        )
    if (collective != "all_reduce" and layout == "rows" or layout == "segments") and cfg.scheduler != "persistent":
        raise ValueError(
            f"{collective} in layout {layout!r} rotates or interleaves the persistent schedule's rows; "
            f"scheduler {cfg.scheduler!r} cannot: use scheduler 'persistent' or layout 'cols'"
        )
    if cfg.epilogue == "tma" and layout not in ROW_MAJOR:
        raise ValueError(
            f"epilogue 'tma' stores whole rows of a row-major buffer: layout 'rows' or 'segments', "
            f"got layout {layout!r}"
        )
    if cfg.reduction not in TAKES[collective]:
        raise ValueError(f"reduction {cfg.reduction!r} is not {collective}'s: one of {list(TAKES[collective])}")
    if cfg.reduction in PULLS and pull_layout(collective, cfg.reduction) != layout:
        raise ValueError(
            f"reduction {cfg.reduction!r} runs {collective} in layout {pull_layout(collective, cfg.reduction)!r}, "
            f"not {layout!r}"
        )
    return dataclasses.replace(cfg, layout=layout)


def pull_layout(collective: str, reduction: str) -> str:
    """The layout a pull of ``collective`` runs in: an all-reduce's groups and a ``pull_fused``
    reduce-scatter's (its own segment last, comm.rows_rotation) are row bands of C (``rows``); a
    reduce-scatter / all-to-all ``pull`` copies every rank's block of the same rows (``segments``)."""
    return "rows" if collective == "all_reduce" or reduction == "pull_fused" else "segments"


@functools.lru_cache(maxsize=256)  # every call asks (a replace() validates)
def resolutions(cfg: OverlapConfig, collective: str) -> tuple[OverlapConfig, ...]:
    """What ``cfg`` may run for ``collective``, best first, each valid (:func:`for_collective`): an
    ``auto`` layout of a reduce-scatter / all-to-all is ``segments`` where that layout carries the
    call (:func:`for_call` decides, knowing the call), else ``cols``, of those two the ones that
    can run the config (``epilogue: tma`` stores rows: ``segments`` alone; a stream-K schedule
    cannot interleave: ``cols`` alone); any other config, one. Raises where none can."""
    if cfg.layout != "auto" or collective == "all_reduce" or cfg.reduction in PULLS:  # (a pull's layout is its own)
        return (for_collective(cfg, collective),)
    valid, problems = [], []
    for layout in ("segments", "cols"):
        try:
            valid.append(for_collective(dataclasses.replace(cfg, layout=layout), collective))
        except ValueError as exc:
            problems.append(f"as {layout!r}: {exc}")
    if not valid:
        neither = "; ".join(problems)
        raise ValueError(f"layout 'auto' runs {collective} in layout 'segments' or 'cols', neither takes it: {neither}")
    return tuple(valid)


def takes_every_call(cfg: OverlapConfig, collective: str) -> bool:
    """Whether ``cfg`` runs every call of ``collective`` (as a registry entry's ``fallback`` must):
    the ``rows`` / ``segments`` layouts of reduce-scatter / all-to-all need equal segments of whole
    tile rows, and symmetric windows equal all-to-all splits."""
    if collective == "all_reduce":
        return True
    layout = resolutions(cfg, collective)[-1].layout  # (what a call the first cannot carry gets)
    return layout not in EQUAL_SEGMENTS and not (cfg.symmetric and collective == "all_to_all")


FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89, the sm80 kernels' mma.sync) on


@functools.lru_cache(maxsize=256)  # once per config and GPU kind: every call resolves its config
def for_device(cfg: OverlapConfig, capability: tuple[int, int]) -> tuple[OverlapConfig, str]:
    """``cfg`` with kernel family, tile_k and epilogue resolved for a GPU of compute ``capability``,
    and the arch to compile for; raises ``ValueError`` where no kernel of the config runs there."""
    arch = f"sm_{capability[0]}{capability[1]}"
    family = cfg.kernel if cfg.kernel != "auto" else ("sm90" if capability == (9, 0) else "sm80")
    if family == "sm90":
        if capability != (9, 0):
            raise ValueError(f"the sm90 kernels need a Hopper GPU (sm_90), this one is {arch}: use kernel 'sm80'")
        arch = "sm_90a"
    elif arch not in FAMILIES["sm80"]["archs"]:
        raise ValueError(f"no flashoverlap kernels for {arch}; supported: {list(FAMILIES['sm80']['archs'])}")
    epilogue = cfg.epilogue
    if epilogue == "auto":
        epilogue = "tma" if family == "sm90" and cfg.layout in ROW_MAJOR else "direct"
    problems = family_problems(cfg, family, epilogue)
    if problems:
        raise ValueError(f"config {cfg} cannot run on {arch}: " + "; ".join(problems))
    return dataclasses.replace(cfg, kernel=family, tile_k=gemm_instance(cfg, family)[2], epilogue=epilogue), arch


def for_rowwise(cfg: OverlapConfig, capability: tuple[int, int]) -> OverlapConfig:
    """``cfg`` for a call with rowwise FP8 scales: the sm90 kernels' ``direct`` epilogue multiplies
    them in (the ``tma`` one stores tile rows where their slots say, and a row broadcast there would
    need each stored row's own row of C; Ada's kernels take a per-tensor alpha alone); raises
    ``ValueError`` for a config or GPU that cannot."""
    if cfg.epilogue == "tma":
        raise ValueError("rowwise FP8 scales need epilogue 'direct' (or 'auto'), got 'tma'")
    if cfg.reduction == "pull_fused":  # (its epilogue scales by one alpha before it adds the sums)
        raise ValueError("reduction 'pull_fused' takes per-tensor FP8 scales, not rowwise ones")
    if for_device(cfg, capability)[0].kernel != "sm90":
        arch = f"sm_{capability[0]}{capability[1]}"
        raise ValueError(f"rowwise FP8 scales need the sm90 kernels (Hopper); {arch} with kernel {cfg.kernel!r}")
    return dataclasses.replace(cfg, epilogue="direct")


def kernel_spec(
    cfg: OverlapConfig,
    dtype: str,
    weight_layout: str,
    capability: tuple[int, int],
    input_dtype: str | None = None,
    rowwise: bool = False,
) -> tuple[OverlapConfig, GemmSpec]:
    """``cfg`` resolved for the device (:func:`for_device`) and the GEMM instance it runs there;
    ``input_dtype``: the operands' (None: ``dtype``); ``rowwise``: FP8 operands with rowwise scales
    (:func:`for_rowwise`)."""
    if rowwise:
        cfg = for_rowwise(cfg, capability)
    # FP8 kernels' K tile where the config leaves it (the family's fp8_tile_k: as many bytes as the
    # 16-bit ones'); configs validate tile_k for 16-bit operands, so the resolved config keeps its own
    fp8_k = input_dtype in FP8_DTYPES and cfg.tile_k is None
    cfg, arch = for_device(cfg, capability)
    spec = GemmSpec(
        dtype=dtype,
        weight_layout=weight_layout,
        tile_m=cfg.tile_m,
        tile_n=cfg.tile_n,
        tile_k=FAMILIES[cfg.kernel]["fp8_tile_k"][0] if fp8_k else cfg.tile_k,
        cluster_m=cfg.cluster_m,
        scheduler=cfg.scheduler,
        epilogue=cfg.epilogue,
        arch=arch,
        input_dtype=input_dtype,
        sums=cfg.reduction == "pull_fused",
    )
    return cfg, spec


def spills_promoted(spec: GemmSpec) -> bool:
    """Whether ``spec``'s FP8 mainloop, with its tensor cores' sums promoted into a second set of fp32
    accumulators (``_scaled_mm``'s default accumulation), spills registers: Hopper's 128x256 tile, one
    64x256 WGMMA atom per warp group whose scratch is as large as its accumulators (ptxas: 472 bytes
    a thread; beside pulls on two H200s it ran at 0.30-0.37 of ``_scaled_mm``, 256x128 at 0.86-0.94).
    A call asking for it is warned, not refused: fast accumulation in those tiles does not spill."""
    return spec.input_dtype in FP8_DTYPES and spec.family == "sm90" and (spec.tile_m, spec.tile_n) == (128, 256)


def comm_pattern(collective: str, layout: str, reduction: str = "nccl") -> str:
    """What a call's groups communicate: the collective itself, ``exchange`` (the ``rows`` layout of
    reduce-scatter / all-to-all: grouped send to rank + k / receive from rank - k) or
    ``all_gather`` (a ``local`` all-reduce), ``pull`` (the same by copies out of the other ranks'
    memory: comm.peer), ``pull_scatter`` (its shares pulled and added, the sums pulled)."""
    if reduction != "nccl":
        return "all_gather" if reduction == "local" else reduction
    return "exchange" if layout == "rows" and collective != "all_reduce" else collective


def rows_carry(ex: Exchange, unit: int) -> bool:
    """Whether the ``rows`` or ``segments`` layout can carry ``ex``: an all-reduce, or equal row
    segments to and from every rank, each a whole number of ``unit`` rows (plan.rotation_rows: the
    tile rows their schedules walk as one, rotated or interleaved)."""
    if ex.collective == "all_reduce":
        return True
    return ex.even and ex.send[0] % unit == 0


def check_layout(ex: Exchange, layout: str, unit: int) -> None:
    """Raise where ``layout`` cannot carry ``ex`` (before anything is launched); ``unit``: see
    :func:`rows_carry`."""
    if layout in EQUAL_SEGMENTS and not rows_carry(ex, unit):
        raise ValueError(
            f"layout {layout!r} runs {ex.collective} with equal row segments to and from every rank, each a "
            f"multiple of {unit} rows (the tile rows its schedule walks as one), got {list(ex.send)} rows sent "
            f"and {list(ex.recv)} received: use layout 'cols'"
        )


def tail_apart(collective: str, layout: str, reduction: str = "nccl") -> bool:
    """Whether a call's last group may communicate beside the earlier groups' collectives, on the
    caller's stream behind the GEMM (runtime.run_overlapped): all but the ``rows`` layout's
    exchange, whose last group's own-segment step reads what the earlier groups received, and
    pulls (no NCCL communicator to take the last group; their copies are ordered by flags, comm.peer)."""
    return comm_pattern(collective, layout, reduction) not in ("exchange", *PULLS)


def carries(cfg: OverlapConfig, ex: Exchange, shape: tuple[int, int, int], p2p: bool = True) -> bool:
    """Whether ``cfg`` can run the call ``ex`` of GEMM ``shape``, as every rank sees it (the choice
    of a call without config=): the ``rows`` and ``segments`` layouts need equal segments of whole
    scheduling units (:func:`rows_carry`), symmetric windows the same buffer sizes, on every rank; the
    ``rows`` layout's send / receive a group that sends CUDA tensors point to point (``p2p``: NCCL,
    not gloo)."""
    segments_ok = cfg.layout not in EQUAL_SEGMENTS or ex.uniform and rows_carry(ex, rotation_unit(cfg, shape))
    sends_ok = p2p or comm_pattern(ex.collective, cfg.layout) != "exchange"
    return segments_ok and sends_ok and not _cut_tiles(cfg, shape[1]) and (ex.uniform or not cfg.symmetric)


def _cut_tiles(cfg: OverlapConfig, n: int) -> bool:
    """Whether a ``pull_fused`` reduce-scatter's epilogue would add its sums into tiles cut by the
    output's edge: N not a multiple of ``tile_n`` (its rows are whole tiles by rows_carry); its
    passes hold no bounds per element."""
    return cfg.reduction == "pull_fused" and n % cfg.tile_n != 0


def fused_tiles(cfg: OverlapConfig, n: int) -> None:
    """Raise where ``cfg`` cannot add a reduce-scatter's sums in its epilogue for N = ``n``
    (:func:`_cut_tiles`)."""
    if _cut_tiles(cfg, n):
        raise ValueError(
            f"reduction 'pull_fused' adds into whole tiles: N={n} must be a multiple of tile_n={cfg.tile_n}"
        )


@functools.lru_cache(maxsize=1024)  # every call asks
def for_call(cfg: OverlapConfig, ex: Exchange, shape: tuple[int, int, int]) -> OverlapConfig:
    """``cfg`` resolved for the call ``ex`` of GEMM ``shape``: the first of its resolutions
    (:func:`resolutions`) that carries the call as every rank sees it (:func:`carries`), else the
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


@functools.lru_cache(maxsize=256)  # calls without NVLink ask every time (a replace() validates)
def without_window(cfg: OverlapConfig) -> OverlapConfig:
    return dataclasses.replace(cfg, symmetric=False)


@functools.lru_cache(maxsize=256)
def without_pull(cfg: OverlapConfig) -> OverlapConfig:
    """``cfg`` on NCCL, for ranks that cannot pull: with the default SMs for NCCL's kernels where the
    pull left none beside the GEMM (its copies took none; NCCL's kernels would wait for its end)."""
    return dataclasses.replace(cfg, reduction="nccl", comm_sms=cfg.comm_sms or OverlapConfig.comm_sms)


def peer_memory(cfg: OverlapConfig) -> list[str]:
    """What of ``cfg`` reads or writes the other GPUs' memory directly, which GPUs of one host alone
    can: a symmetric window (NCCL's symmetric kernels; an all-to-all's or a ``local`` gather's copy
    engines) and pulls (comm.peer). Empty where ``cfg`` communicates through NCCL's transports only."""
    return ["symmetric: true"] * cfg.symmetric + [f"reduction: {cfg.reduction}"] * (cfg.reduction in PULLS)


FEWEST_COMM_SMS = 4  # NCCL's CTAs beside an Ampere/Ada GEMM when a call without config= times fewer


PULL_SMS = 4  # the most SMs a pull candidate leaves for its adds (the tuner's pick on 2x H100)
# SMs a pull whose sums read the other ranks' memory in place is also timed with (4x H100: the best
# of 4 / 8 / 16 on 4 of 7 all-reduce shapes; the GEMM loses waves)
READ_SMS = 16


def reads_in_place(reduction: str) -> bool:
    """Whether a pull's sums read the other ranks' partial sums in their memory (comm.peer.Pulls.at)
    rather than copies of them: a ``pull_scatter`` all-reduce's, whose copy engine is busy with the
    all-gather half (SM loads over NVLink read every link at once; its copies of the shares measured
    slower). A ``pull`` reduce-scatter's rows are copied into local memory on the copy engines while
    the GEMM runs, for no SM, and summed there at the memory's speed on the few SMs the GEMM leaves
    (or after it): on four H200s 1.19x over six shapes with 4 SMs for the sums, against 1.15x with
    none and 1.07x for sums reading in place on 8."""
    return reduction == "pull_scatter"


@functools.lru_cache(maxsize=1024)  # every call of a timed shape asks (a replace() validates)
def pulled(
    cfg: OverlapConfig, collective: str, shape: tuple[int, int, int], total_sms: int, world: int = 2
) -> OverlapConfig | None:
    """What a call without a tuned config also times where its ranks can pull (comm.peer): ``cfg`` as
    a pull (no window, the budget from the start, the default partition), leaving for the adds the
    SMs its GEMM spares at the whole grid's wave count, at most :data:`PULL_SMS` (4 on the suite's
    grids; 0: the adds wait for the GEMM's end). The tuner picked pull with 4 SMs on every suite
    shape on 2x H100 (1.20x against 1.14x for NCCL's best configs). An all-reduce pulls as ``pull``
    on two ranks, ``pull_scatter`` on more (``world``): every rank copying every other rank's groups
    moves w - 1 groups per rank, 3 on four ranks against 1.5 for NCCL's ring and ``pull_scatter``; a
    reduce-scatter / all-to-all in the ``segments`` layout pulls its own segment's rows (``pull``:
    picked on 9 of 10 shapes on four H200s; a reduce-scatter's copied and summed on those SMs,
    :func:`reads_in_place`), in its :func:`pull_layout` whatever ``cfg``'s layout (the caller checks
    that it :func:`carries` the call): a hint tuned for another shape may be NCCL in the ``rows``
    layout (registry entries of reduce-scatter are). A pull already keeps its reduction, with the
    spare SMs: the hint's SM count is its own shape's (four H200s, reduce-scatter 4096x8192x2048
    from 4096x4096x4096's 0-SM pull: 1.01x, plain, where 4 SMs measured 1.04x). None where that is
    ``cfg`` itself. Where its sums read in place, :func:`wider_reads` is timed too."""
    m, n, _ = shape
    spare = spare_sms(m, n, cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.swizzle, total_sms, total_sms)
    if cfg.reduction in PULLS:  # (a fused hint's: the copied pull, beside which fused_pull times it again)
        reduction = "pull" if cfg.reduction == "pull_fused" else cfg.reduction
    else:
        reduction = "pull_scatter" if collective == "all_reduce" and world > 2 else "pull"
    pull = dataclasses.replace(
        cfg,
        layout=pull_layout(collective, reduction),
        reduction=reduction,
        symmetric=False,
        late_budget=False,
        comm_sms=min(spare, PULL_SMS),
        partition=None,
    )
    try:  # (a hint in another layout may hold what the pulls' cannot: stream-K's schedule, say)
        for_collective(pull, collective)
    except ValueError:
        return None
    return None if pull == cfg else pull


def wider_reads(pull: OverlapConfig | None) -> OverlapConfig | None:
    """The pull candidate ``pull`` (:func:`pulled`) with :data:`READ_SMS` SMs for its sums, where they
    read the other ranks' memory in place (:func:`reads_in_place`): on large calls reading faster
    pays for the GEMM's lost waves, on small ones it does not, so the trial times both. None for
    none, for copies, or where ``pull`` has as many already."""
    if pull is None or not reads_in_place(pull.reduction) or pull.comm_sms >= READ_SMS:
        return None
    return dataclasses.replace(pull, comm_sms=READ_SMS)


@functools.lru_cache(maxsize=256)
def fused_pull(pull: OverlapConfig | None, collective: str, capability: tuple[int, int]) -> OverlapConfig | None:
    """A reduce-scatter's pull candidate ``pull`` (:func:`pulled`) with its sums in the GEMM's epilogue
    (``pull_fused``: no SM beside the GEMM, nothing after it) on a GPU whose kernels can (Hopper): the
    trial times both. On four H200s it led on the small shapes (4096 rows: 1.05 / 1.26x against 1.02
    / 1.18x) and trailed on the large ones, where the sums' loads in the epilogue cost more than 4 SMs
    (16384x8192x4096: 1.28x against 1.34x). None elsewhere."""
    if pull is None or pull.reduction != "pull" or collective != "reduce_scatter":
        return None
    fused = dataclasses.replace(pull, layout="rows", reduction="pull_fused", comm_sms=0)
    try:
        for_device(for_collective(fused, collective), capability)
    except ValueError:
        return None
    return fused


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


def one_wave(cfg: OverlapConfig, m: int, n: int, device: torch.device) -> bool:
    """Whether the GEMM's tiles all fit in one wave of the SMs ``cfg`` leaves it: then its plan is
    one group, found without planning (the plan says so for the other one-group cases too)."""
    tiles = -(-m // cfg.tile_m) * -(-n // cfg.tile_n)
    return tiles <= torch.cuda.get_device_properties(device).multi_processor_count - cfg.comm_sms
