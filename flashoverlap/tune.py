"""Predictive tuning: a cost model of one overlapped call and the search for its group partition.

The model (see ../shared/DESIGN.md, "Configs and tuning"):

* the GEMM finishes wave ``w`` (1-based) at ``w * wave_ms`` (measured per GEMM instance and SM
  budget), so a group covering waves (i, j] is ready at ``j * wave_ms``;
* a collective on ``b`` bytes takes ``latency_ms + b / bandwidth`` (:class:`CommModel`, fitted
  from a few NCCL sizes by :func:`fit_comm`, interpolated between them), on the budget
  communicator while the GEMM runs and on the full one for the last group;
* collectives run one after another on the communication stream, but for the last group's, which
  starts as the GEMM ends beside whatever is still queued there (on the caller's stream,
  ``tail_apart``; not in the ``rows`` layout of reduce-scatter / all-to-all); in the ``rows`` layout of
  reduce-scatter / all-to-all, a group's rows of the rank's own segment are added / copied into
  the result there instead (``local``, a model of that memory operation by size); a ``local``
  all-reduce adds the gathered partial sums of each group after its all-gather, and the ``cols``
  layout (``segments`` for all-to-all) copies each group's rows into place after its collective;
* the host needs ``base_ms + groups * per_group_ms`` (:class:`HostModel`) to enqueue one call,
  and calls run back to back, so a call never takes less than that: small GEMMs are host-bound,
  and every group costs host time (a wait and a collective to enqueue).

The makespan of a partition is the later of when its last collective ends and the host time.
:func:`best_partition` finds the partition with the smallest predicted makespan exactly (dynamic
programming over waves and group counts), and :func:`choose` compares it with the sequential time
to decide whether overlap pays.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommModel:
    """Collective time = latency_ms + bytes / bytes_per_ms; between the smallest and the largest
    of the measured ``points`` ((bytes, ms), sorted by size), their piecewise-linear interpolation
    instead, since NCCL switches protocol and algorithm with the size and a line misses that."""

    latency_ms: float
    bytes_per_ms: float
    points: tuple[tuple[float, float], ...] = ()

    def time_ms(self, nbytes):
        linear = self.latency_ms + np.asarray(nbytes, dtype=float) / self.bytes_per_ms
        if self.points:
            sizes, times = zip(*self.points)
            inside = (nbytes >= sizes[0]) & (nbytes <= sizes[-1])
            linear = np.where(inside, np.interp(nbytes, sizes, times), linear)
        return float(linear) if np.ndim(linear) == 0 else linear


def fit_comm(sizes: Sequence[float], times_ms: Sequence[float]) -> CommModel:
    """Least-squares latency + bytes/bandwidth fit of measured (bytes, ms) pairs (>= 2 sizes),
    keeping the points (the median per size) for interpolation."""
    sizes, times = np.asarray(sizes, dtype=float), np.asarray(times_ms, dtype=float)
    if len(sizes) < 2 or len(np.unique(sizes)) < 2 or len(sizes) != len(times):
        raise ValueError("fit_comm needs (bytes, ms) pairs for at least two different sizes")
    slope, intercept = np.polyfit(sizes, times, 1)
    if slope <= 0:
        raise ValueError(f"measured times do not grow with size (slope {slope:.3g} ms/byte): cannot fit a bandwidth")
    points = tuple((float(size), float(np.median(times[sizes == size]))) for size in np.unique(sizes))
    return CommModel(latency_ms=max(float(intercept), 0.0), bytes_per_ms=1.0 / float(slope), points=points)


@dataclass(frozen=True)
class HostModel:
    """Host time to enqueue one overlapped call of ``groups`` groups."""

    base_ms: float = 0.0
    per_group_ms: float = 0.0

    def time_ms(self, groups: int) -> float:
        return self.base_ms + groups * self.per_group_ms


def fit_host(groups: Sequence[int], times_ms: Sequence[float]) -> HostModel:
    """Least-squares base + per-group fit of measured (groups, ms per call) pairs (>= 2 counts)."""
    counts, times = np.asarray(groups, dtype=float), np.asarray(times_ms, dtype=float)
    if len(counts) < 2 or len(np.unique(counts)) < 2 or len(counts) != len(times):
        raise ValueError("fit_host needs (groups, ms) pairs for at least two different group counts")
    slope, intercept = np.polyfit(counts, times, 1)
    return HostModel(base_ms=max(float(intercept), 0.0), per_group_ms=max(float(slope), 0.0))


@dataclass(frozen=True)
class Problem:
    """One overlapped call as the model sees it.

    wave_bytes[w]: bytes of collective the GEMM completes in wave w (see :func:`wave_bytes`);
    wave_ms: GEMM time per wave with the SM budget; during / tail: the collective's model on the
    budget communicator while the GEMM runs, and on the full one afterwards (the last group);
    host: the host's enqueue time per call (zero: not host-bound); local_bytes[w] / local: bytes
    of wave w added or copied into the result after the group's collective (the own segment in
    the ``rows`` layout, a ``local`` all-reduce's sums) and that operation's model (empty /
    None: none); finish_ms: work after the last collective whatever the partition (a ``local``
    all-reduce's adds where the GEMM leaves them no SM); start_wave: collectives start after this
    wave at the earliest (a late SM budget's first waves leave NCCL no SM: plan.late_after);
    tail_apart: the last group's collective starts as the GEMM ends, beside the others' backlog
    (comm.tail_apart), not behind it.
    """

    wave_bytes: tuple[float, ...]
    wave_ms: float
    during: CommModel
    tail: CommModel
    host: HostModel = HostModel()
    local_bytes: tuple[float, ...] = ()
    local: CommModel | None = None
    finish_ms: float = 0.0
    start_wave: int = 0
    tail_apart: bool = False

    @property
    def num_waves(self) -> int:
        return len(self.wave_bytes)

    def group_ms(self, model: CommModel, nbytes, local_bytes):
        """Communication time of groups of ``nbytes`` of collective and ``local_bytes`` kept: the
        collective, then the local operation; a part without bytes is not issued."""
        nbytes, local_bytes = np.asarray(nbytes, dtype=float), np.asarray(local_bytes, dtype=float)
        t = np.where(nbytes > 0, model.time_ms(np.maximum(nbytes, 1.0)), 0.0)
        if self.local is not None:
            t = t + np.where(local_bytes > 0, self.local.time_ms(np.maximum(local_bytes, 1.0)), 0.0)
        return float(t) if t.ndim == 0 else t

    def local_prefix(self) -> np.ndarray:
        """Cumulative local bytes by wave (zeros where none)."""
        local = self.local_bytes or (0.0,) * self.num_waves
        return np.concatenate([[0.0], np.cumsum(local)])


def with_local_adds(problem: Problem, adds: CommModel, comm_sms: int) -> Problem:
    """``problem`` (a ``local`` all-reduce: its groups' all-gathers) with the adds of the gathered
    partial sums, ``adds`` by bytes of the sum: group by group after each all-gather where the
    GEMM leaves SMs (``comm_sms`` > 0; charged on the communication stream's timeline though they
    run on a stream of their own), else all of them once the GEMM is done."""
    if comm_sms:
        return dataclasses.replace(problem, local_bytes=problem.wave_bytes, local=adds)
    return dataclasses.replace(problem, finish_ms=adds.time_ms(sum(problem.wave_bytes)))


def makespan(problem: Problem, partition: Sequence[int]) -> float:
    """Predicted time per call for ``partition`` (waves per group): the end of the last
    collective, or the host's enqueue time where that is longer."""
    if sum(partition) != problem.num_waves or any(w < 1 for w in partition):
        raise ValueError(f"partition {list(partition)} must be positive and sum to {problem.num_waves} waves")
    done, end, local = 0, 0.0, problem.local_prefix()
    for g, waves in enumerate(partition):
        nbytes = sum(problem.wave_bytes[done : done + waves])
        kept = local[done + waves] - local[done]
        done += waves
        last = g == len(partition) - 1
        start = max(done, problem.start_wave) * problem.wave_ms
        took = problem.group_ms(problem.tail if last else problem.during, nbytes, kept)
        end = max(end, start + took) if last and problem.tail_apart else max(end, start) + took
    return max(end + problem.finish_ms, problem.host.time_ms(len(partition)))


def best_partition(problem: Problem) -> tuple[tuple[int, ...], float]:
    """The partition with the smallest predicted makespan, and that makespan.

    ``finish[g, j]``: earliest end of the collectives of waves 1..j split into g groups, the last
    ending at wave j. A later finish never lets a later group start earlier, so the best prefix is
    the one to extend: finish[g, j] = min over i < j of max(finish[g - 1, i], j * wave_ms) +
    comm(waves i+1..j) (no start before wave ``start_wave``), the last group costed on the full
    communicator (with ``tail_apart``, max(finish[g - 1, i], W * wave_ms + comm): still the best
    prefix). The host time depends on the group count alone, so the answer is the best over g of
    max(finish[g, W], host(g)).
    O(waves^3), vectorised over the split point.
    """
    total = problem.num_waves
    prefix, local = np.concatenate([[0.0], np.cumsum(problem.wave_bytes)]), problem.local_prefix()
    finish = np.full((total + 1, total + 1), np.inf)  # [groups, waves]
    finish[0, 0] = 0.0
    came_from = np.zeros((total + 1, total + 1), dtype=int)
    for g in range(1, total + 1):
        for j in range(g, total + 1):
            model = problem.tail if j == total else problem.during
            i = np.arange(g - 1, j)
            start = max(j, problem.start_wave) * problem.wave_ms
            took = problem.group_ms(model, prefix[j] - prefix[i], local[j] - local[i])
            if j == total and problem.tail_apart:
                t = np.maximum(finish[g - 1, i], start + took)
            else:
                t = np.maximum(finish[g - 1, i], start) + took
            best = int(np.argmin(t))
            finish[g, j], came_from[g, j] = t[best], i[best]
    ends = [max(finish[g, total] + problem.finish_ms, problem.host.time_ms(g)) for g in range(1, total + 1)]
    groups = int(np.argmin(ends)) + 1
    cuts, j = [], total
    for g in range(groups, 0, -1):
        cuts.append(int(j - came_from[g, j]))
        j = int(came_from[g, j])
    return tuple(reversed(cuts)), float(ends[groups - 1])


def partitions(num_waves: int, max_groups: int | None = None) -> Iterator[tuple[int, ...]]:
    """Every partition of ``num_waves`` waves into at most ``max_groups`` groups (all when None):
    the space a brute-force search measures."""
    most = num_waves if max_groups is None else min(max_groups, num_waves)
    for groups in range(1, most + 1):
        for cuts in itertools.combinations(range(1, num_waves), groups - 1):
            yield tuple(b - a for a, b in zip((0, *cuts), (*cuts, num_waves)))


@dataclass(frozen=True)
class Choice:
    partition: tuple[int, ...]
    overlap_ms: float  # predicted makespan of the best partition
    sequential_ms: float  # predicted GEMM alone (all SMs) + one collective (full communicator)
    margin: float  # overlap must win by this fraction of sequential_ms

    @property
    def overlap_pays(self) -> bool:
        return self.overlap_ms < self.sequential_ms * (1.0 - self.margin)


def choose(problem: Problem, sequential_ms: float, margin: float = 0.02) -> Choice:
    """The best partition, and whether it beats ``sequential_ms`` (predicted: the GEMM on every SM,
    then one collective) by more than ``margin``; where it does not, the config to write is
    sequential."""
    partition, overlap_ms = best_partition(problem)
    return Choice(partition, overlap_ms, sequential_ms, margin)


def pick_finalists(
    choices: list[tuple[Choice, int]],
    problems: list[Problem | None],
    defaults: list[tuple[int, ...]],
    top: int,
    plain: int | None,
    kinds: Sequence[str] | None = None,
) -> list[tuple[Choice, int]]:
    """What the tuner measures, as (choice, candidate index): the ``top`` best predicted of
    ``choices`` and, where ``kinds`` names each candidate's way of communicating (its
    comm.comm_pattern), the best predicted of every kind not among them (the model errs by kind:
    stop 30 left every pull out of 8192^3's four finalists on 2x H100, though pull measured fastest
    there in stop 29); then, as a hedge against the model's partitions, each of their candidates with its
    default partition (``defaults``; stop 25: for all-to-all ``rows`` late in a window the model's
    ``[8]`` measured 0.93x where the default partition gave 1.08x), and the built-in defaults'
    candidate ``plain`` with its default partition: nothing written may lose to a call without
    config. Each (partition, candidate) once."""
    ranked = sorted(choices, key=lambda cj: cj[0].overlap_ms)
    finalists = ranked[:top]
    for kind in dict.fromkeys([] if kinds is None else [kinds[j] for _, j in ranked]):
        if all(kinds[j] != kind for _, j in finalists):
            finalists.append(next(cj for cj in ranked if kinds[cj[1]] == kind))
    measured = {(c.partition, j) for c, j in finalists}
    best = ranked[0][0]  # the sequential prediction and margin are the shape's, alike in every choice
    for j in dict.fromkeys([*(j for _, j in finalists), *([] if plain is None else [plain])]):
        if (defaults[j], j) not in measured:
            measured.add((defaults[j], j))
            priced = dataclasses.replace(best, partition=defaults[j], overlap_ms=makespan(problems[j], defaults[j]))
            finalists.append((priced, j))
    return finalists


# --- measuring on GPUs: python -m flashoverlap.tune (under torchrun) -----------------------------

# Per collective; reduce-scatter / all-to-all also try the row-band layout (equal splits), with
# 4 SMs too: 128 CTAs make whole waves of the 1024-, 2048- and 4096-tile grids of the suite
# (the kernel then runs at cuBLAS speed). All-reduce rings on 4 CTAs are too slow beside a GEMM as
# long as the collective (0.82x) but keep up beside a longer one (1.05x, 4096x8192x28672, stop 21);
# there a late budget did better still (1.06x; 1.09x on 8192x4096x14336, stop 22), and with NCCL's
# symmetric kernels (faster per CTA over NVLink) also beside 4096x8192x8192 (1.11x against 1.09x).
# Where the collective is most of the GEMM's length, symmetric kernels from the first wave on
# (16384x8192x4096 on H100x2, 8 SMs: 1.24x against 1.08x for the best plain ring, stop 25).
DEFAULT_CANDIDATES = {
    "all_reduce": (
        {},
        {"late_budget": True},
        {"late_budget": True, "symmetric": True},
        {"symmetric": True},
        {"symmetric": True, "comm_sms": 8},
        {"comm_sms": 4},
        {"comm_sms": 8},
        {"comm_sms": 24},
        {"tile_n": 128},
        {"swizzle": 4},
        {"scheduler": "streamk"},
        # partial sums copied out of the other GPU's memory (comm.peer): no SM for the copies, a few
        # for the adds (two H100s, 4096x8192x8192: 1.23x against 1.16x for the registry's, stop 29)
        {"reduction": "pull", "comm_sms": 4},
        {"reduction": "pull", "comm_sms": 0},
        # with a cluster of two along M: the GEMM itself faster (two H200s: chosen on 4 of the 7
        # suite shapes, 1.232-1.244x against 1.214-1.225x without, stop 31)
        {"reduction": "pull", "comm_sms": 4, "cluster_m": 2},
    ),
    "reduce_scatter": (
        {},
        {"comm_sms": 24},
        {"layout": "rows"},
        {"layout": "rows", "comm_sms": 4},
        {"layout": "rows", "comm_sms": 8},
        {"layout": "rows", "comm_sms": 24},
        {"layout": "cols"},  # ({} is segments where they carry the call: overlap.for_call)
        {"layout": "segments", "comm_sms": 4},
        # the own segment last: NCCL's late SMs carry only the other ranks' rows, in a window
        # (all-to-all 8192x4096x7168 over NVLink: 1.11-1.13x against 1.08-1.10x, stop 22)
        {"layout": "rows", "late_budget": True, "symmetric": True},
    ),
}
DEFAULT_CANDIDATES["all_to_all"] = DEFAULT_CANDIDATES["reduce_scatter"]
COMM_SIZES_MB = (1, 2, 4, 8, 16, 32, 64)


def wave_bytes(plan, elem_bytes: int, world: int = 1, own: bool = False) -> tuple[float, ...]:
    """Bytes of communication each wave of ``plan`` feeds: its output bytes, except in the ``rows``
    layout of reduce-scatter / all-to-all on ``world`` > 1 ranks (comm.rows_rotation): the bytes
    this rank sends to one rank while receiving as many from another (the other ranks' segments;
    see :func:`comm.comm_pattern`), its own segment, computed last, staying here; ``own``: the bytes
    of that segment instead. ``plan``: unrotated (the plan of the last rank, whose own segment
    is the last)."""
    mt, nt = np.divmod(np.arange(plan.num_tiles), plan.tiles_n)
    elems = np.minimum(plan.tile_m, plan.m - mt * plan.tile_m) * np.minimum(plan.tile_n, plan.n - nt * plan.tile_n)
    kept = plan.layout == "rows" and world > 1
    if kept:
        mine = mt * plan.tile_m >= plan.m - plan.m // world
        elems = np.where(mine, elems, 0.0) if own else np.where(mine, 0.0, elems)
    elif own:
        elems = np.zeros(len(elems))
    per_wave = np.bincount(plan.wave, weights=elems, minlength=plan.num_waves) * elem_bytes
    return tuple(float(b) for b in per_wave)


def entry(
    collective: str, transport: str, dtype: str, shape, config: dict, measured: dict, timing: str = "eager"
) -> dict:
    """One registry entry (flashoverlap.registry) as written to YAML (``timing`` only where not eager)."""
    return {
        "collective": collective,
        "transport": transport,
        "dtype": dtype,
        "shape": [int(v) for v in shape],
        "config": config,
        "measured": measured,
        **({"timing": timing} if timing != "eager" else {}),
    }


def _key(e: dict) -> tuple:
    """What a registry entry is for: one call (collective, transport, dtype, shape) timed one way."""
    return (e["collective"], e["transport"], e["dtype"], tuple(e["shape"]), e.get("timing", "eager"))


def incumbent(existing: list[dict], collective: str, transport: str, dtype: str, shape, timing: str) -> dict | None:
    """The config of the entry in ``existing`` a re-tune of this call would replace, None where there
    is none or it runs sequentially (the tuner measures sequential anyway)."""
    want = (collective, transport, dtype, tuple(int(v) for v in shape), timing)
    found = next((e["config"] for e in existing if _key(e) == want), None)
    return None if found is None or found.get("sequential") else found


def merge(existing: list[dict], new: list[dict]) -> list[dict]:
    """``existing`` entries with those ``new`` re-tunes replaced; sorted by collective, transport, shape
    (an entry timed as CUDA graphs beside the eager one of its shape)."""
    fresh = {_key(e): e for e in new}
    kept = [e for e in existing if _key(e) not in fresh]
    return sorted(kept + list(fresh.values()), key=_key)


def read_entries(path: str, gpu: str, world: int) -> list[dict]:
    """The entries of the registry file at ``path`` (none where it does not exist yet); a file for
    another GPU or world size is an error."""
    from pathlib import Path

    import yaml

    target = Path(path)
    if not target.exists():
        return []
    data = yaml.safe_load(target.read_text()) or {}
    if (data.get("gpu"), data.get("world")) != (gpu, world):
        raise ValueError(f"{path} holds configs for {data.get('gpu')!r} x{data.get('world')}, not {gpu!r} x{world}")
    return data.get("entries", [])


def write_registry(path: str, gpu: str, world: int, entries: list[dict]) -> None:
    """Write (or update) the registry file at ``path``; the result is validated by loading it."""
    import os
    from pathlib import Path

    import yaml

    from . import registry

    target = Path(path)
    existing = read_entries(path, gpu, world)
    text = yaml.safe_dump({"gpu": gpu, "world": world, "entries": merge(existing, entries)}, sort_keys=False)
    registry.parse(yaml.safe_load(text), str(path))  # never write a file the runtime would reject
    tmp = target.with_suffix(".tmp")
    tmp.write_text("# written by python -m flashoverlap.tune\n" + text)
    os.replace(tmp, target)


def _progress(message: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        log.info(message)


@functools.cache
def _local_model(collective: str, dtype, rounds: int) -> CommModel:
    """Time by size of what stays on the rank: in the ``rows`` layout of reduce-scatter /
    all-to-all the own rows, added into the result or copied there (the copy, "all_to_all", also
    prices what comm.finish_group copies into place: ``cols`` blocks, a ``segments`` all-to-all's
    rows); for a ``local`` all-reduce (``collective`` "all_gather") the sum of the world's
    gathered partial sums (bytes: of the sum)."""
    import torch
    import torch.distributed as dist

    from . import comm

    elem, world = torch.finfo(dtype).bits // 8, dist.get_world_size()

    def make(mb: int):
        x, y = (torch.randn((mb << 20) // elem, device="cuda").to(dtype) for _ in range(2))
        if collective == "all_gather":
            parts = torch.randn(world, x.numel(), device="cuda").to(dtype)
            return (lambda i: comm.add_rows(parts, x)), x.numel() * elem
        op = x.add_ if collective == "reduce_scatter" else x.copy_
        return (lambda i: op(y)), x.numel() * elem

    return _fit_sizes(f"local {collective}", make, rounds)


def _fit_sizes(label: str, make, rounds: int) -> CommModel:
    """:func:`fit_comm` of what ``make(mb)`` returns, a (timing variant, bytes) pair for each of
    COMM_SIZES_MB, measured together; named by ``label``, so that ranks measuring different
    things fail in time_variants instead of deadlocking."""
    from .bench import time_variants

    variants, sizes = {}, []
    for mb in COMM_SIZES_MB:
        variants[f"{label} {mb}MB"], nbytes = make(mb)
        sizes.append(nbytes)
    times = time_variants(variants, rounds, 4, 2)
    return fit_comm(sizes, [times[name] for name in variants])


@functools.cache
def _comm_model(pattern: str, comm_sms: int, dtype, rounds: int, symmetric: bool = False) -> CommModel:
    """Time by size of a collective (or ``exchange`` / ``all_gather`` / ``pull``, see
    :func:`comm.comm_pattern`) on the whole world: on the communicator an overlapped call uses while
    its GEMM runs, NCCL held to ``comm_sms`` SMs (0 without ``symmetric``: the default communicator,
    as for the last group), buffers in a symmetric window where ``symmetric`` (all-to-all and
    all-gather then on the copy engines, as the runtime does); ``pull``: the other ranks' partial
    sums copied out of their memory as each says they are there (comm.peer: no NCCL, no SM, whatever
    ``comm_sms``). The same for every shape, so measured once per run."""
    import torch
    import torch.distributed as dist

    from . import comm

    if pattern == "pull":  # (one model for every comm_sms: each measurement maps memory on every rank)
        return _pull_model(dtype, rounds)

    group = comm.budget_group(dist.group.WORLD, comm_sms, copy_engine=symmetric and pattern in comm.COPY_ENGINE)
    world, me, elem = dist.get_world_size(), dist.get_rank(), torch.finfo(dtype).bits // 8
    device = torch.device("cuda", torch.cuda.current_device())
    window = comm.nccl.Window([group], device) if symmetric else None

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
        if window is None:
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

    return _fit_sizes(f"{pattern}{' symmetric' if symmetric else ''}", make, rounds)


@functools.cache
def _pull_model(dtype, rounds: int) -> CommModel:
    """Time by size of a ``pull`` all-reduce's copies (:func:`_pulls`), measured once per run."""
    return _fit_sizes("pull", _pulls(dtype), rounds)


def _pulls(dtype):
    """``make(mb)`` for :func:`_fit_sizes`: the copies a ``pull`` all-reduce makes of one group of
    that size, with the waits that order them (comm._pull, comm.peer.Peers.arrivals), in memory of its
    own, each time claimed, counted (as the GEMM would) and released as a call does (Peers.claim /
    mark / copied): without that a rank ran a measurement ahead, set a flag the other had not cleared
    yet (one signal lost), and the other waited for it forever (the tuner's hangs on 2x H100 in stop
    30, 2x H200 in stop 31)."""
    import torch
    import torch.distributed as dist

    from . import comm

    device, elem = torch.device("cuda", torch.cuda.current_device()), torch.finfo(dtype).bits // 8

    def make(mb: int):
        peers = comm.peer.Peers(dist.group.WORLD, device)  # (collective: every rank makes the same sizes)
        chunk = peers.buffer((mb << 20) // elem, dtype).copy_(torch.randn((mb << 20) // elem, device=device))
        into = torch.empty(peers.world, chunk.numel(), dtype=dtype, device=device)
        peers.targets = (1,)

        def call(i: int) -> None:
            peers.mark(0)
            comm._pull(peers, 0, chunk, into)
            peers.copied()
            peers.claim()

        return call, chunk.numel() * elem

    return make


def _fitted(model, *args) -> CommModel | None:
    """``model(*args)``, or None where its measurements cannot be fitted (said on rank 0)."""
    try:
        return model(*args)
    except ValueError as exc:
        _progress(f"{model.__name__}{args}: {exc}; its candidates are dropped")
        return None


def _tail_model(pattern: str, dtype, rounds: int, symmetric: bool) -> CommModel:
    """:func:`_comm_model` on the full communicator (the last group's), where the copy-engine
    patterns of :func:`_comm_model` run NCCL's usual kernels on every SM."""
    from . import comm

    return _comm_model(pattern, 0, dtype, rounds, symmetric and pattern not in comm.COPY_ENGINE)


def tune_shape(
    shape, collective, candidates, dtype, transport, rounds, top, margin, brute_force=0, graphs=False, current=None
) -> tuple[dict, list[dict]]:
    """Measure, predict, confirm for one shape: (registry entry, summary rows). ``brute_force`` > 0
    also measures every partition of up to that many groups for every candidate and adds the best
    of them (``brute_ms``, ``brute_config``) to the rows, to judge the model's pick. ``graphs``:
    for calls replayed as CUDA graphs: no host time in the model, the finalists and sequential
    timed as graph replays, the entry marked ``timing: graphs``. ``current``: the config the
    registry being written has for this call (:func:`incumbent`), measured beside the finalists
    (unless one of them), so that a re-tune replaces it only with what measures faster in the same
    run (stop 30: the model ranked 8192^3's pull, 1.23x in the registry, below its finalists, and a
    1.10x entry replaced it)."""
    import torch
    import torch.distributed as dist

    import flashoverlap

    from . import comm
    from .bench import kernel_alone, operand_sets, time_variants
    from .config import resolve
    from .overlap import DTYPES, for_call, prepare, sequential
    from .plan import widest_budget

    m, n, k = shape
    world = dist.get_world_size()
    a, w = operand_sets(m, n, k, dtype)
    sets = len(a)
    ex = comm.exchange(collective, m, world)
    cfgs = [for_call(resolve(c), ex, shape) for c in candidates]
    preps = [
        prepare(m, n, k, dtype, "nk", a[0].device, cfg, interleave=comm.interleave(ex, cfg.layout)) for cfg in cfgs
    ]
    # each persistent candidate also with the widest SM budget at the same wave count: NCCL gets
    # more SMs for free (16 -> 18 for the suite's grids on 132 SMs)
    candidates, total = list(candidates), torch.cuda.get_device_properties(a[0].device).multi_processor_count
    for candidate, cfg, prep in list(zip(candidates, cfgs, preps)):
        wider = {**candidate, "comm_sms": widest_budget(prep.plan, total)}
        if cfg.scheduler != "persistent" or wider["comm_sms"] <= cfg.comm_sms or wider in candidates:
            continue
        cfgs.append(for_call(resolve(wider), ex, shape))
        segments = comm.interleave(ex, cfgs[-1].layout)
        preps.append(prepare(m, n, k, dtype, "nk", a[0].device, cfgs[-1], interleave=segments))
        candidates.append(wider)
    _progress(f"{m}x{n}x{k}: GEMM per wave for {len(cfgs)} candidates")
    variants = {"gemm": lambda i: a[i % sets] @ w[i % sets].t()}
    variants.update({f"kernel{j}": kernel_alone(p, a, w) for j, p in enumerate(preps)})
    times = time_variants(variants, rounds, 4, 3)
    _progress(f"{m}x{n}x{k}: {collective} time by size (measured once per run)")
    patterns = [comm.comm_pattern(collective, c.layout, c.reduction) for c in cfgs]
    # in a fixed order: every rank must measure the same collectives in the same order (a set's
    # order of strings differs between processes, and deadlocked the first run of this)
    kinds = [(collective, False)] + [(p, c.symmetric) for c, p in zip(cfgs, patterns)]
    # the last group runs on the full communicator, in the window too where symmetric; a model that
    # cannot be fitted drops its candidates (the times are the ranks' maximum: all drop the same)
    tails = {(p, sym): _fitted(_tail_model, p, dtype, rounds, sym) for p, sym in dict.fromkeys(kinds)}
    during = {
        (c.comm_sms, p, c.symmetric): _fitted(_comm_model, p, c.comm_sms, dtype, rounds, c.symmetric)
        for c, p in zip(cfgs, patterns)
    }
    if tails[collective, False] is None:
        raise RuntimeError(f"could not fit a time-by-size model of {collective}: see the message above")
    if graphs:
        host = HostModel()
    else:
        host = _host_model(collective, a, w, candidates[0], preps[0].plan.num_waves)
        _progress(f"{m}x{n}x{k}: host {host.base_ms:.3f} ms per call + {host.per_group_ms:.3f} ms per group")
    elem = torch.finfo(dtype).bits // 8
    choices, problems = [], []
    sequential_ms = times["gemm"] + tails[collective, False].time_ms(m * n * elem)  # predicted
    for j, (cfg, prep, pattern) in enumerate(zip(cfgs, preps, patterns)):
        per_wave_ms = times[f"kernel{j}"] / prep.plan.num_waves
        ranks = world if collective != "all_reduce" else 1
        sent = wave_bytes(prep.plan, elem, ranks)
        if pattern == "pull" and collective != "all_reduce":  # a rank pulls its own segment's rows only
            sent = tuple(b / world for b in sent)
        kept = wave_bytes(prep.plan, elem, ranks, own=True)
        local = _local_model(collective, dtype, rounds) if any(kept) else None
        if comm.finishes(ex, prep.plan) and pattern != "all_gather":  # result rows copied into place per group
            kept, local = tuple(b * ex.rows / m for b in sent), _local_model("all_to_all", dtype, rounds)
        comm_models = during[cfg.comm_sms, pattern, cfg.symmetric], tails[pattern, cfg.symmetric]
        if None in comm_models:
            problems.append(None)
            continue
        apart = cfg.comm_sms > 0 and comm.tail_apart(collective, cfg.layout, cfg.reduction)  # (0: one communicator)
        problems.append(
            Problem(sent, per_wave_ms, *comm_models, host, kept, local, start_wave=prep.plan.after, tail_apart=apart)
        )
        if pattern == "all_gather" or pattern == "pull" and collective != "all_to_all":  # the partial sums added
            problems[-1] = with_local_adds(problems[-1], _local_model("all_gather", dtype, rounds), cfg.comm_sms)
        choices.append((choose(problems[-1], sequential_ms, margin), j))
    if not choices:
        raise RuntimeError(f"{m}x{n}x{k}: no candidate could be modelled (see the messages above)")
    plain = candidates.index({}) if {} in candidates and problems[candidates.index({})] is not None else None
    defaults = [prep.plan.partition for prep in preps]
    finalists = pick_finalists(choices, problems, defaults, top, plain, patterns)
    overlapped = getattr(flashoverlap, f"gemm_{collective}")
    variants = {"seq": lambda i: sequential(a[i % sets], w[i % sets], "nk", ex, None)}
    tuned = [{**candidates[j], "partition": list(choice.partition)} for choice, j in finalists]
    for f, config in enumerate(tuned):  # one candidate may come twice (defaults)
        variants[f"fo{f}"] = lambda i, config=config: overlapped(a[i % sets], w[i % sets], config=config)
    if current in tuned:
        current = None
    elif current is not None:
        try:  # an entry this version cannot run (a partition of another wave count, say): not measured
            held = for_call(resolve(current), ex, shape)
            prepare(m, n, k, dtype, "nk", a[0].device, held, interleave=comm.interleave(ex, held.layout))
        except (TypeError, ValueError) as exc:
            _progress(f"{m}x{n}x{k}: the registry's entry is left out: {exc}")
            current = None
    if current is not None:
        variants["current"] = lambda i: overlapped(a[i % sets], w[i % sets], config=current)
    what = "best predicted overall and of each kind, defaults" + (", the registry's" if current is not None else "")
    _progress(f"{m}x{n}x{k}: measuring {len(finalists)} finalists ({what}) against sequential")
    measured = time_variants(variants, 2 * rounds, 8, 3, graphs=graphs)  # what gets written: as the bench measures
    rows = [
        {
            "shape": f"{m}x{n}x{k}",
            "config": json.dumps(candidates[j], sort_keys=True),
            "partition": list(choice.partition),
            "predicted_ms": choice.overlap_ms,
            "measured_ms": measured[f"fo{f}"],
            "seq_ms": measured["seq"],
        }
        for f, (choice, j) in enumerate(finalists)
    ]
    if current is not None:
        rows.append(
            {
                "shape": f"{m}x{n}x{k}",
                "config": json.dumps({key: v for key, v in current.items() if key != "partition"}, sort_keys=True),
                "partition": current.get("partition"),
                "predicted_ms": None,  # (not modelled: the registry's)
                "measured_ms": measured["current"],
                "seq_ms": measured["seq"],
            }
        )
    if brute_force:
        brute_ms, brute_config = _brute_force(
            shape, collective, candidates, preps, brute_force, a, w, rounds, ex, graphs
        )
        for r in rows:
            r["brute_ms"] = brute_ms * r["seq_ms"]  # measured as a ratio to sequential: same scale
            r["brute_config"] = brute_config
    timing = "graphs" if graphs else "eager"
    return measured_entry(collective, transport, DTYPES[dtype], shape, rows, margin, timing), rows


def measured_entry(
    collective: str, transport: str, dtype: str, shape, rows: list[dict], margin: float, timing: str = "eager"
) -> dict:
    """The registry entry for one shape's measured finalists (summary rows of :func:`tune_shape`):
    :func:`decide`'s config, and next to one that cannot carry every call (``rows`` or ``segments``
    reduce-scatter / all-to-all, symmetric all-to-all: config.takes_every_call) the best of the
    finalists that can as ``fallback``, for the calls it cannot carry."""
    from .config import OverlapConfig, takes_every_call

    def every_call(config: dict) -> bool:
        return takes_every_call(OverlapConfig.from_dict(config), collective)

    config, speedup = decide(rows, margin)
    result = entry(collective, transport, dtype, shape, config, {"speedup": round(speedup, 3)}, timing)
    if not every_call(config):
        others = [r for r in rows if every_call(json.loads(r["config"]))]
        result["fallback"] = decide(others, margin)[0] if others else {"sequential": True}
    return result


def decide(rows: list[dict], margin: float) -> tuple[dict, float]:
    """The config to write from measured finalists (summary rows of :func:`tune_shape`) and its
    speedup over sequential: the fastest, or sequential where it does not win by ``margin``."""
    best = min(rows, key=lambda r: r["measured_ms"])
    speedup = best["seq_ms"] / best["measured_ms"]
    if speedup > 1.0 + margin:  # (a registry entry measured beside the finalists may have no partition)
        partition = {} if best["partition"] is None else {"partition": best["partition"]}
        return {**json.loads(best["config"]), **partition}, speedup
    return {"sequential": True}, speedup  # overlap does not pay here: never slower than sequential


def _host_model(collective: str, a, w, candidate: dict, num_waves: int, calls: int = 10) -> HostModel:
    """Host time to enqueue one call (nothing waits for the GPU), with one group and with one
    group per wave (as many as the layout makes of them); every rank makes the same calls."""
    import time

    import torch
    import torch.distributed as dist

    import flashoverlap

    from . import comm
    from .config import resolve
    from .overlap import for_call, prepare

    overlapped = getattr(flashoverlap, f"gemm_{collective}")
    (m, k), n = a[0].shape, w[0].shape[0]
    counts, times = [], []
    for partition in dict.fromkeys([(num_waves,), (1,) * num_waves]):  # one entry when a single wave
        cfg = {**candidate, "partition": list(partition)}
        for i in range(3):  # plan, agreement and communicators first
            overlapped(a[i % len(a)], w[i % len(w)], config=cfg)
        torch.cuda.synchronize()
        spent = []
        for i in range(calls):
            start = time.perf_counter()
            overlapped(a[i % len(a)], w[i % len(w)], config=cfg)
            spent.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        ex = comm.exchange(collective, m, dist.get_world_size())
        resolved = for_call(resolve(cfg), ex, (m, n, k))
        segments = comm.interleave(ex, resolved.layout)
        counts.append(prepare(m, n, k, a[0].dtype, "nk", a[0].device, resolved, interleave=segments).plan.num_groups)
        times.append(statistics.median(spent))
    # the slowest rank's times, so that every rank predicts (and so plans) the same calls
    times = torch.tensor(times, dtype=torch.float64, device=a[0].device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.tolist()
    # a single possible group count: its time is all there is to know
    return fit_host(counts, times) if len(set(counts)) > 1 else HostModel(base_ms=times[-1])


BRUTE_BATCH = 32  # variants per timing batch: their plans stay cached (overlap.MAX_PREPARED)


def _brute_force(shape, collective, candidates, preps, max_groups, a, w, rounds, ex, graphs) -> tuple[float, str]:
    """Best measured (time / sequential time, config JSON) over every candidate and every partition
    of up to ``max_groups`` groups; sequential runs in every batch, so drift cancels in the ratio
    (``graphs``: timed as CUDA graph replays)."""
    import flashoverlap

    from .bench import time_variants
    from .overlap import sequential

    m, n, k = shape
    sets = len(a)
    overlapped = getattr(flashoverlap, f"gemm_{collective}")
    tried = [
        {**candidates[j], "partition": list(p)}
        for j, prep in enumerate(preps)
        for p in partitions(prep.plan.num_waves, max_groups)
    ]
    best = (1.0, json.dumps({"sequential": True}))
    for start in range(0, len(tried), BRUTE_BATCH):
        batch = tried[start : start + BRUTE_BATCH]
        _progress(f"{m}x{n}x{k}: brute force {start + len(batch)}/{len(tried)}")
        variants = {"seq": lambda i: sequential(a[i % sets], w[i % sets], "nk", ex, None)}
        for b, cfg in enumerate(batch):
            variants[f"b{b}"] = lambda i, cfg=cfg: overlapped(a[i % sets], w[i % sets], config=cfg)
        times = time_variants(variants, rounds, 4, 2, graphs=graphs)
        for b, cfg in enumerate(batch):
            best = min(best, (times[f"b{b}"] / times["seq"], json.dumps(cfg, sort_keys=True)))
    return best


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import os
    import sys

    import torch
    import torch.distributed as dist

    from . import bench, comm
    from .config import cli_config, resolutions, resolve

    parser = argparse.ArgumentParser(
        prog="python -m flashoverlap.tune",
        description="Tune configs (GEMM instance, comm_sms, group partition) per shape and write them to a "
        "registry YAML (flashoverlap.registry). Run under torchrun with the world size to tune for.",
    )
    parser.add_argument("--collective", choices=("all_reduce", "reduce_scatter", "all_to_all"), default="all_reduce")
    parser.add_argument("--shapes", nargs="+", type=bench.parse_shape, help="MxNxK ...")
    parser.add_argument("--shapes-file", help="YAML list of shapes (see python -m flashoverlap.bench)")
    parser.add_argument(
        "--candidates",
        nargs="+",
        type=cli_config,
        help="configs to tune from: JSON objects or YAML config files (default: per collective)",
    )
    parser.add_argument("--transport", choices=sorted(bench.TRANSPORTS), default="nvlink")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--rounds", type=int, default=10)
    # the model misses what NCCL on more CTAs costs a GEMM beside it (Ampere/Ada kernels, P2P off: 16 SMs
    # predicted 3 % slower than 8, measured 18 %): more finalists, so that the measurements decide
    parser.add_argument(
        "--top",
        type=int,
        default=4,
        help="predicted-best candidates measured for real (each also with its default partition)",
    )
    parser.add_argument("--margin", type=float, default=0.02, help="overlap must beat sequential by this")
    parser.add_argument(
        "--output", required=True, help="registry YAML to write or update (calls read it from FLASHOVERLAP_CONFIG_DIRS)"
    )
    parser.add_argument("--csv", help="also write the predicted-vs-measured rows here")
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="tune for calls replayed as CUDA graphs (no host time; entries marked timing: graphs, read "
        "under FLASHOVERLAP_TIMING=graphs)",
    )
    parser.add_argument(
        "--brute-force",
        type=int,
        default=0,
        metavar="GROUPS",
        help="also measure every partition of up to GROUPS groups per candidate and report how the "
        "tuned pick compares (slow; to validate the model)",
    )
    args = parser.parse_args(argv)
    if args.brute_force < 0:
        parser.error("--brute-force takes a number of groups >= 1 (0: off)")
    if args.top < 1:
        parser.error(f"--top takes a number of finalists >= 1, got {args.top}")
    shapes = list(args.shapes or []) + (bench.load_shapes(args.shapes_file) if args.shapes_file else [])
    if not shapes:
        parser.error("give --shapes and/or --shapes-file")
    candidates = args.candidates or list(DEFAULT_CANDIDATES[args.collective])
    if args.transport != "nvlink":  # P2P disabled: calls run without windows nor pulls (overlap.decide)
        candidates = [c for c in candidates if not c.get("symmetric") and c.get("reduction") != "pull"] or parser.error(
            "symmetric windows and pulls need peer access: with P2P disabled some candidate must use neither"
        )
    for candidate in candidates:  # before any process group or GPU work
        try:
            resolutions(resolve(candidate), args.collective)
        except ValueError as exc:
            parser.error(f"candidate {json.dumps(candidate)}: {exc}")
    if "RANK" not in os.environ:
        print("run under torchrun, e.g. torchrun --nproc-per-node 2 -m flashoverlap.tune ...", file=sys.stderr)
        return 2
    os.environ.update(bench.TRANSPORTS[args.transport])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if (why := bench.unrunnable(local_rank)) is not None:
        print(why, file=sys.stderr)
        return 2
    gpu, world = torch.cuda.get_device_name(local_rank), int(os.environ.get("WORLD_SIZE", 1))
    if world < 2:  # (its collectives move nothing: no time by size to model)
        parser.error("tuning needs two or more ranks (torchrun --nproc-per-node 2 or more): one communicates nothing")
    try:  # what --output holds already: a file for other GPUs is refused before anything runs
        existing = [read_entries(args.output, gpu, world)]
    except ValueError as exc:
        parser.error(str(exc))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        pulls = [c for c in candidates if c.get("reduction") == "pull"]
        no_pulls = comm.peer.unavailable(dist.group.WORLD, torch.device("cuda", local_rank))  # (alike on every rank)
        if pulls and no_pulls:
            _progress(f"{len(pulls)} pull candidate(s) dropped: {no_pulls}")
            candidates = [c for c in candidates if c not in pulls] or parser.error("no candidate left")
        dtype = getattr(torch, args.dtype)
        dist.broadcast_object_list(existing, src=0)  # every rank measures rank 0's entries (the one it writes)
        timing = "graphs" if args.graphs else "eager"
        entries, rows = [], []
        for i, shape in enumerate(shapes):
            _progress(f"shape {i + 1}/{len(shapes)}")
            current = incumbent(existing[0], args.collective, args.transport, args.dtype, shape, timing)
            if current is not None and current.get("reduction") == "pull" and no_pulls:
                current = None  # (a pull config raises where the ranks cannot pull)
            found, summary = tune_shape(
                shape,
                args.collective,
                candidates,
                dtype,
                args.transport,
                args.rounds,
                args.top,
                args.margin,
                args.brute_force,
                args.graphs,
                current,
            )
            entries.append(found)
            rows += summary
            if dist.get_rank() == 0:  # after every shape, so a run cut short keeps what it found
                write_registry(args.output, gpu, world, entries)
                if args.csv:
                    bench.write_csv(args.csv, [dict(r, transport=args.transport) for r in rows])
        if dist.get_rank() == 0:
            print(format_summary(rows))
            errors = [abs(r["predicted_ms"] / r["measured_ms"] - 1) for r in rows if r["predicted_ms"] is not None]
            print(f"median |predicted / measured - 1|: {statistics.median(errors):.1%}")
            if args.brute_force:
                print(brute_summary(entries, rows))
            print(f"wrote {len(entries)} entries to {args.output}")
    finally:
        for model in (_comm_model, _pull_model):  # their communicators / mapped memory die with the group
            model.cache_clear()
        dist.destroy_process_group()
    return 0


def format_summary(rows: list[dict]) -> str:
    """Predicted vs measured per tuned candidate."""
    lines = [f"{'shape':>16} {'pred ms':>8} {'meas ms':>8} {'seq ms':>8} {'err':>6}  partition  config"]
    for r in rows:
        if r["predicted_ms"] is None:  # the registry's entry, measured beside the finalists
            predicted, err = f"{'-':>8}", f"{'-':>6}"
        else:
            predicted, err = f"{r['predicted_ms']:>8.3f}", f"{r['predicted_ms'] / r['measured_ms'] - 1:>+6.1%}"
        measured = f"{r['measured_ms']:>8.3f} {r['seq_ms']:>8.3f}"
        lines.append(f"{r['shape']:>16} {predicted} {measured} {err}  {r['partition']}  {r['config']}")
    return "\n".join(lines)


def brute_summary(entries: list[dict], rows: list[dict]) -> str:
    """Per shape: the speedup over sequential of what was written (1.0 where sequential) against
    the brute-force best, and the mean ratio of the two."""
    lines = [f"{'shape':>16} {'tuned':>6} {'brute':>6} {'ratio':>6}  brute-force best"]
    ratios = []
    for e in entries:
        shape = "x".join(map(str, e["shape"]))
        row = next(r for r in rows if r["shape"] == shape)
        tuned = 1.0 if e["config"].get("sequential") else e["measured"]["speedup"]
        brute = row["seq_ms"] / row["brute_ms"]
        ratios.append(tuned / brute)
        lines.append(f"{shape:>16} {tuned:>6.3f} {brute:>6.3f} {ratios[-1]:>6.1%}  {row['brute_config']}")
    lines.append(f"mean tuned / brute-force speedup: {statistics.mean(ratios):.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    sys.exit(main())
