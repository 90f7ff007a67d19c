"""The tuner's cost model (tune_model) fed from constants instead of measurements, at any world
size, without GPUs: ``python -m flashoverlap.tune_predict --gpu h200 --world 8``.

tune_measure times every collective on the ranks the tuner runs on, so the model itself has no
world size in it: what depends on the world is in the measurements. To predict a world nobody has
measured, the time by size of each way of communicating is built here from per-GPU constants
(:class:`Gpu`), with the world size ``w`` explicit:

* NCCL (``nccl``): a ring moves ``2 (w - 1) / w`` of an all-reduce's bytes per rank, ``(w - 1) / w``
  of a reduce-scatter's or an all-to-all's (:func:`ring_share`), at the bus bandwidth and latency
  fitted at the largest measured world <= ``w``; beyond it the bus bandwidth stays (each GPU's own
  links bound a ring) and every extra ring step adds ``hop_ms`` (:func:`ring_steps`). On ``c`` CTAs
  beside the GEMM the ring gets the share of its bus bandwidth measured on that many CTAs.
* A ``pull_fused`` reduce-scatter copies each of its groups whole from the one rank whose rows it
  holds (none in the last segment, this rank's own, kept), and its own tiles' epilogues add the
  ``w - 1`` copies at ``epilogue_read_bytes_per_ms``: the GEMM ends that much later.
* Pulls: every copy out of a peer's memory goes through the GPU's one copy engine, one after
  another (``copy_gap_ms`` between copies); sums that read the other ranks' memory in place
  (``pull_scatter``'s) read it at the rate measured for that many SMs beside the GEMM
  (``peer_read``) or, after it, on every SM; local adds (a ``pull`` all-reduce's, a reduce-scatter's
  sums of its copies) run on the SMs the GEMM leaves (per-SM rate) or, after the GEMM, on all of
  them (:func:`pull_counts`: copies, bytes copied, bytes read in place and bytes added locally, per
  byte of output, by reduction and world size). While the GEMM runs the copy engine's work on one
  group overlaps the SMs' on another (the slower sets the pace); the last group's run one after the
  other.

The GEMM runs at one rate per GPU (cuBLAS alone) and, for flashoverlap's persistent kernel, in
whole waves of tiles at the same rate per SM. Host time is left out (calls replayed natively
keep up with every suite shape). Each constant says where it was measured or that it is assumed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import bench
from .config import PULLS, resolve
from .plan import make_plan, scheduled_tiles
from .rules import COLLECTIVES, PULL_SMS, comm_pattern, for_collective, tail_apart
from .tune_model import Choice, CommModel, Problem, choose, wave_bytes

GB_S = 1e6  # bytes per ms in one GB/s


@dataclass(frozen=True)
class Gpu:
    """What the prediction knows of one GPU kind and its NVLink fabric.

    ``nccl[collective][world]``: (latency ms, bus bytes per ms) of NCCL's collective on the whole
    communicator (bus bytes: :func:`ring_share` of the output); ``capped``: (CTAs, share of that bus
    bandwidth) for NCCL held to that many CTAs, interpolated; ``hop_ms``: latency of one more ring step.
    """

    name: str
    sms: int
    gemm_flops_per_ms: float
    nccl: dict[str, dict[int, tuple[float, float]]]
    capped: tuple[tuple[int, float], ...]
    hop_ms: float
    copy_bytes_per_ms: float
    copy_gap_ms: float
    add_bytes_per_ms_per_sm: float
    add_bytes_per_ms: float
    peer_read: tuple[tuple[int, float], ...]  # (SMs beside the GEMM, bytes per ms read in place), interpolated
    peer_read_alone: float  # bytes per ms read in place on every SM, after the GEMM
    epilogue_read_bytes_per_ms: float  # a pull_fused epilogue's loads of the copied partial sums, every SM

    def read_bytes_per_ms(self, sms: int) -> float:
        """The rate a rank's sums read the other ranks' memory in place: on ``sms`` SMs beside the
        GEMM (interpolated, flat beyond the last measured count), or with 0 on every SM after it."""
        return float(np.interp(sms, *zip(*self.peer_read))) if sms else self.peer_read_alone


H200 = Gpu(
    name="NVIDIA H200",
    sms=132,
    # cuBLAS bf16 on the suite's shapes, 2x and 4x H200: 689-781 TFLOP/s (bench/results/h200x*.csv, gemm)
    gemm_flops_per_ms=740e9,
    # least-squares fits of the bench's `collective` rows (h200x2.csv, h200x4.csv, NVLink): measured
    # at 2 and 4 ranks; larger worlds extrapolated (see the module doc)
    nccl={
        "all_reduce": {2: (0.0425, 293 * GB_S), 4: (0.0386, 333 * GB_S)},
        "reduce_scatter": {2: (0.0286, 221 * GB_S), 4: (0.0257, 295 * GB_S)},
        "all_to_all": {2: (0.0290, 240 * GB_S), 4: (0.0301, 302 * GB_S)},
    },
    # 64 MB all-reduce alone on 4 / 8 / 16 CTAs against every SM, 2x H200 (docs/experiments.md, the SM
    # budget): 0.90 / 0.49 / 0.33 ms against 0.27; assumed the same for every collective and world,
    # and all of it from 32 CTAs on
    capped=((0, 0.0), (4, 0.30), (8, 0.55), (16, 0.82), (32, 1.0)),
    hop_ms=0.002,  # assumed: one more step of a ring (not measured; ~2 us per stream operation)
    # peer copies on 4x H200, one at a time on one copy engine: 150-280 GB/s each, 7-10 us apart
    copy_bytes_per_ms=215 * GB_S,
    copy_gap_ms=0.0085,
    # sums of rows in local memory on the 4 SMs the GEMM leaves, 4x H200: ~47 GB/s per SM read and written
    add_bytes_per_ms_per_sm=47 * GB_S,
    # fo_sum of four rows after the GEMM, one H200: 64 MB of sum in 161 us (~2 TB/s read and written)
    add_bytes_per_ms=2000 * GB_S,
    # fo_sum reading three peers' 16 MiB shares in place, 4x H200 (bench/peer_sum_probe.py, 64 MiB per
    # rank): 48 MiB read in 0.84 / 0.51 / 0.30 ms beside a 4096x8192x8192 GEMM on 4 / 8 / 16 SMs,
    # 0.216 ms alone; assumed the same per rank on eight (each reads seven smaller shares)
    peer_read=((4, 60 * GB_S), (8, 99 * GB_S), (16, 167 * GB_S)),
    peer_read_alone=233 * GB_S,
    # the fused epilogue's loads on 4x H200, through L1: the call 0.07-0.11 ms over its GEMM alone for
    # 96-192 MiB of partial sums added (~0.03 ms of it the claim's wait for the GEMM's end)
    epilogue_read_bytes_per_ms=2000 * GB_S,
)
GPUS = {"h200": H200}

# What the prediction compares per collective: NCCL on 16 SMs (the defaults), on 4 and 8, late on 16,
# and the pulls. Windows, clusters, other tiles and stream-K are left out: the constants cannot tell
# them apart.
CANDIDATES = {
    "all_reduce": (
        {},
        {"comm_sms": 4},
        {"comm_sms": 8},
        {"late_budget": True},
        {"reduction": "pull", "comm_sms": PULL_SMS},
        *({"reduction": "pull_scatter", "comm_sms": sms} for sms in (PULL_SMS, 8, 16)),  # as the tuner's
    ),
    "reduce_scatter": (
        {"layout": "segments"},
        {"layout": "segments", "comm_sms": 4},
        {"layout": "segments", "comm_sms": 8},
        {"layout": "segments", "reduction": "pull", "comm_sms": PULL_SMS},
    ),
}
CANDIDATES["all_to_all"] = CANDIDATES["reduce_scatter"]
# a reduce-scatter's pulled rows are summed from their copies on more SMs, or after the GEMM, as the
# tuner tries
CANDIDATES["reduce_scatter"] += tuple({"layout": "segments", "reduction": "pull", "comm_sms": sms} for sms in (8, 0))
CANDIDATES["reduce_scatter"] += ({"reduction": "pull_fused", "comm_sms": 0},)  # (the sums in the epilogue)


def ring_share(collective: str, world: int) -> float:
    """Bytes a rank sends in NCCL's ring per byte of the output: ``2 (w - 1) / w`` for all-reduce
    (a reduce-scatter, then an all-gather), ``(w - 1) / w`` for reduce-scatter and all-to-all."""
    return (2.0 if collective == "all_reduce" else 1.0) * (world - 1) / world


def ring_steps(collective: str, world: int) -> int:
    """Steps one after another, each paying a hop's latency: ``2 (w - 1)`` in an all-reduce's ring,
    ``w - 1`` in a reduce-scatter's; an all-to-all's sends run at once."""
    return {"all_reduce": 2 * (world - 1), "reduce_scatter": world - 1}.get(collective, 1)


def nccl_comm(gpu: Gpu, collective: str, world: int, ctas: int = 0) -> CommModel:
    """NCCL's ``collective`` on ``world`` ranks by bytes of output, on every SM (``ctas`` 0) or held
    to ``ctas`` CTAs: the fit of the largest measured world <= ``world``, its latency grown by a hop
    per extra ring step."""
    fits = gpu.nccl[collective]
    measured = max((w for w in fits if w <= world), default=None)
    if world < 2 or measured is None:
        raise ValueError(f"{gpu.name}: no measured {collective} on {min(fits)} ranks or fewer to predict {world} from")
    latency, bus = fits[measured]
    latency += gpu.hop_ms * (ring_steps(collective, world) - ring_steps(collective, measured))
    if ctas:
        bus *= float(np.interp(ctas, *zip(*gpu.capped)))
    return CommModel(latency, bus / ring_share(collective, world))


class PullBytes(NamedTuple):
    """What a group of pulls moves, per byte of the group's output (:func:`pull_counts`)."""

    copies: int  # copy-engine copies, one after another
    copied: float  # bytes they copy
    read: float  # bytes the sums read out of the other ranks' memory in place
    added: float  # bytes local adds read and write


def pull_counts(collective: str, reduction: str, world: int) -> PullBytes:
    """Per group of pulls, per byte of the group's output. ``pull`` all-reduce: the ``w - 1`` other
    ranks' groups copied, ``w`` summed into one locally; ``pull_scatter``: a ``1 / w`` share of each
    other rank's group read in place by the sum, then the ``w - 1`` other shares' sums copied;
    reduce-scatter: this rank's ``1 / w`` of each other rank's group copied, then summed with its
    own locally; all-to-all: the same copied; a ``pull_fused`` reduce-scatter: every group (one
    rank's rows, its own last and kept) copied whole from one rank, summed in the GEMM's epilogue."""
    if reduction == "pull_fused":
        return PullBytes(1, 1.0, 0.0, 0.0)
    if collective == "all_reduce" and reduction == "pull":
        return PullBytes(world - 1, float(world - 1), 0.0, float(world + 1))
    share = (world - 1) / world
    if collective == "all_reduce":
        return PullBytes(world - 1, share, share, 0.0)
    if collective == "reduce_scatter":
        return PullBytes(world - 1, share, 0.0, (world + 1) / world)
    return PullBytes(world - 1, share, 0.0, 0.0)


def pull_comm(gpu: Gpu, collective: str, reduction: str, world: int, sms: int = 0, adds: bool = True) -> CommModel:
    """A group of pulls by bytes of output: the copies on the one copy engine, the sums (reads in
    place, local adds) on ``sms`` SMs beside the GEMM (overlapping another group's copies: the slower
    sets the pace) or, with 0, on every SM after it (one after the other); ``adds`` False: without
    the local adds (:func:`after_gemm_ms` prices them)."""
    moved = pull_counts(collective, reduction, world)
    added = moved.added if adds else 0.0
    copy_ms = moved.copied / gpu.copy_bytes_per_ms
    read_ms = moved.read / gpu.read_bytes_per_ms(sms)
    if sms:
        per_byte = max(copy_ms, read_ms + added / (sms * gpu.add_bytes_per_ms_per_sm))
    else:
        per_byte = copy_ms + read_ms + added / gpu.add_bytes_per_ms
    return CommModel(moved.copies * gpu.copy_gap_ms, 1.0 / per_byte)


def after_gemm_ms(gpu: Gpu, collective: str, reduction: str, world: int, nbytes: float) -> float:
    """The local adds of a pull with no SM beside the GEMM (``comm_sms`` 0), ``nbytes`` of output in
    all: every group's wait for the GEMM's end (its persistent CTAs hold every SM), then run on
    every SM, as the tuner models them (tune_model.with_local_adds)."""
    return pull_counts(collective, reduction, world).added * nbytes / gpu.add_bytes_per_ms


def gemm_ms(gpu: Gpu, shape: tuple[int, int, int]) -> float:
    """cuBLAS's time for ``shape`` (M x N x K)."""
    m, n, k = shape
    return 2.0 * m * n * k / gpu.gemm_flops_per_ms


@dataclass(frozen=True)
class Path:
    """The best predicted call of one way of communicating: ``comm_ms`` the whole output's
    communication alone that way; ``config`` and its ``choice`` (partition, overlapped call)."""

    name: str
    comm_ms: float
    config: dict
    choice: Choice

    @property
    def call_ms(self) -> float:
        return self.choice.overlap_ms

    @property
    def partition(self) -> tuple[int, ...]:
        return self.choice.partition


@dataclass(frozen=True)
class Prediction:
    shape: tuple[int, int, int]
    collective: str
    world: int
    gemm_ms: float
    comm_ms: float  # NCCL's collective alone on the whole output
    paths: tuple[Path, ...]

    @property
    def sequential_ms(self) -> float:
        return self.gemm_ms + self.comm_ms

    @property
    def chosen(self) -> Path | None:
        """The fastest path, None (sequential) where it does not win by the margin."""
        best = min(self.paths, key=lambda p: p.call_ms)
        return best if best.choice.overlap_pays else None

    @property
    def call_ms(self) -> float:
        return self.sequential_ms if self.chosen is None else self.chosen.call_ms

    @property
    def speedup(self) -> float:
        return self.sequential_ms / self.call_ms

    @property
    def efficiency(self) -> float:
        """(T_seq - T_ovl) / min(T_gemm, T_comm), as the bench reports it."""
        return (self.sequential_ms - self.call_ms) / min(self.gemm_ms, self.comm_ms)


def path_name(pattern: str) -> str:
    return pattern if pattern in PULLS else "nccl"


def candidate(
    gpu: Gpu, shape: tuple[int, int, int], collective: str, world: int, fields: dict, elem_bytes: int = 2
) -> tuple[str, Problem, CommModel]:
    """One candidate config's call as tune_model sees it, from ``gpu``'s constants: (path name, its
    Problem, the model of its communication on every SM)."""
    m, n, k = shape
    cfg = for_collective(resolve(fields), collective)
    pattern = comm_pattern(collective, cfg.layout, cfg.reduction)
    tiles = scheduled_tiles(m, n, cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.swizzle)
    budget = gpu.sms - cfg.comm_sms
    plan = make_plan(
        m,
        n,
        tile_m=cfg.tile_m,
        tile_n=cfg.tile_n,
        cluster_m=cfg.cluster_m,
        ctas=min(tiles, gpu.sms if cfg.late_budget else budget),
        layout=cfg.layout,
        interleave=world if cfg.layout == "segments" else 1,
        keep=min(tiles, budget) if cfg.late_budget else 0,
        split=world if cfg.reduction == "pull_fused" else 1,
    )
    wave_ms = 2.0 * cfg.tile_m * cfg.tile_n * k / (gpu.gemm_flops_per_ms / gpu.sms)  # one tile per SM per wave
    finish_ms = 0.0
    if pattern in PULLS:
        alone = pull_comm(gpu, collective, cfg.reduction, world)  # (on every SM, after the GEMM)
        # with no SM beside the GEMM the adds wait for its end (pull_scatter's reads in place would
        # too: no candidate here runs it without SMs)
        if pattern == "pull" and cfg.comm_sms == 0:
            during = tail = pull_comm(gpu, collective, cfg.reduction, world, 0, adds=False)
            finish_ms = after_gemm_ms(gpu, collective, cfg.reduction, world, m * n * elem_bytes)
        elif pattern == "pull_fused":  # the own tiles' epilogues load the others' partial sums: the GEMM's end
            during, tail = pull_comm(gpu, collective, cfg.reduction, world), alone
            finish_ms = (world - 1) / world * m * n * elem_bytes / gpu.epilogue_read_bytes_per_ms
        else:
            during, tail = pull_comm(gpu, collective, cfg.reduction, world, cfg.comm_sms), alone
    else:
        during, alone = nccl_comm(gpu, collective, world, cfg.comm_sms), nccl_comm(gpu, collective, world)
        tail = alone
    apart = cfg.comm_sms > 0 and tail_apart(collective, cfg.layout, cfg.reduction)
    sent = wave_bytes(plan, elem_bytes, world if collective != "all_reduce" else 1)
    problem = Problem(sent, wave_ms, during, tail, start_wave=plan.after, tail_apart=apart, finish_ms=finish_ms)
    return path_name(pattern), problem, alone


def predict(
    gpu: Gpu, shape: tuple[int, int, int], collective: str, world: int, margin: float = 0.02, elem_bytes: int = 2
) -> Prediction:
    """The predicted call of every candidate (:data:`CANDIDATES`), the best per path, and sequential."""
    m, n, _ = shape
    nbytes = m * n * elem_bytes
    comm_ms = nccl_comm(gpu, collective, world).time_ms(nbytes)
    best: dict[str, Path] = {}
    for fields in CANDIDATES[collective]:
        name, problem, alone = candidate(gpu, shape, collective, world, fields, elem_bytes)
        choice = choose(problem, gemm_ms(gpu, shape) + comm_ms, margin)
        if name not in best or choice.overlap_ms < best[name].call_ms:
            best[name] = Path(name, alone.time_ms(nbytes), fields, choice)
    return Prediction(shape, collective, world, gemm_ms(gpu, shape), comm_ms, tuple(best.values()))


def format_table(predictions: Sequence[Prediction]) -> str:
    """A markdown table, one row per prediction, and the mean speedup and efficiency per collective."""
    names = list(dict.fromkeys(p.name for pr in predictions for p in pr.paths))
    head = ["shape", "collective", "T_gemm", *(f"T_comm {n}" for n in names), "T_seq"]
    head += [*(f"T_ovl {n}" for n in names), "chosen", "speedup", "efficiency"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for pr in predictions:
        paths = {p.name: p for p in pr.paths}
        comm = [f"{paths[n].comm_ms:.3f}" if n in paths else "-" for n in names]
        ovl = [f"{paths[n].call_ms:.3f}" if n in paths else "-" for n in names]
        chosen = "sequential" if pr.chosen is None else f"{pr.chosen.name} {label(pr.chosen)}"
        row = ["x".join(map(str, pr.shape)), pr.collective, f"{pr.gemm_ms:.3f}", *comm, f"{pr.sequential_ms:.3f}"]
        row += [*ovl, chosen, f"{pr.speedup:.3f}", f"{pr.efficiency:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for collective in dict.fromkeys(pr.collective for pr in predictions):
        mine = [pr for pr in predictions if pr.collective == collective]
        speedup = statistics.mean(pr.speedup for pr in mine)
        efficiency = statistics.mean(pr.efficiency for pr in mine)
        lines.append(f"{collective}: mean speedup {speedup:.3f}, mean efficiency {efficiency:.2f} ({len(mine)} shapes)")
    return "\n".join(lines)


def label(path: Path) -> str:
    """The path's config as the fields that differ from the defaults (reduction and layout named by
    the path already; ``defaults`` where none), and its partition: ``comm_sms 8 [2, 2, 1]``."""
    fields = [f"{k} {str(v).lower()}" for k, v in path.config.items() if k not in ("reduction", "layout")]
    return " ".join([*(fields or ["defaults"]), str(list(path.partition))])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashoverlap.tune_predict",
        description="Predict, without GPUs, what the tuner's cost model makes of each shape on a GPU kind and world "
        "size: T_gemm, each path's communication alone and overlapped, the chosen path, speedup and efficiency "
        "(over NVLink, bf16, from constants measured on fewer GPUs).",
    )
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    parser.add_argument("--world", type=int, default=8, help="ranks, one GPU each, one host")
    parser.add_argument("--collective", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    parser.add_argument("--shapes", nargs="+", type=bench.parse_shape, help="MxNxK ...")
    parser.add_argument("--shapes-file", help="YAML list of shapes (bench/suite.yaml)")
    parser.add_argument("--margin", type=float, default=0.02, help="overlap must beat sequential by this")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    shapes = list(args.shapes or []) + (bench.load_shapes(args.shapes_file) if args.shapes_file else [])
    if not shapes:
        parser.error("give --shapes and/or --shapes-file")
    gpu = GPUS[args.gpu]
    try:
        predictions = [predict(gpu, s, c, args.world, args.margin) for c in args.collective for s in shapes]
    except ValueError as exc:
        parser.error(str(exc))
    print(f"{gpu.name} x{args.world}, NVLink, bf16, predicted (ms):\n")
    print(format_table(predictions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
