"""The tuner's cost model of one overlapped call, and the search for its group partition.

The model:

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
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


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
    (rules.tail_apart), not behind it.
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
    rules.comm_pattern), the best predicted of every kind not among them (the model errs by kind:
    it left every pull out of 8192^3's four finalists on 2x H100, where pull measured fastest); then,
    as a hedge against the model's partitions, each of their candidates with its default partition
    (``defaults``: for all-to-all ``rows`` late in a window the model's ``[8]`` measured 0.93x where
    the default partition gave 1.08x), and the built-in defaults'
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


def wave_bytes(plan, elem_bytes: int, world: int = 1, own: bool = False) -> tuple[float, ...]:
    """Bytes of communication each wave of ``plan`` feeds: its output bytes, except in the ``rows``
    layout of reduce-scatter / all-to-all on ``world`` > 1 ranks (comm.rows_rotation): the bytes
    this rank sends to one rank while receiving as many from another (the other ranks' segments;
    see rules.comm_pattern), its own segment, computed last, staying here; ``own``: the bytes
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
