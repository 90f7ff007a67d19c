"""Predictive tuning: a cost model of one overlapped call and the search for its group partition.

The model (see ../shared/DESIGN.md, "Configs and tuning"):

* the GEMM finishes wave ``w`` (1-based) at ``w * wave_ms`` (measured per GEMM instance and SM
  budget), so a group covering waves (i, j] is ready at ``j * wave_ms``;
* a collective on ``b`` bytes takes ``latency_ms + b / bandwidth`` (:class:`CommModel`, fitted
  from a few NCCL sizes by :func:`fit_comm`), on the budget communicator while the GEMM runs and
  on the full one for the last group;
* collectives run one after another on the communication stream.

The makespan of a partition is when its last collective ends. :func:`best_partition` finds the
partition with the smallest predicted makespan exactly (dynamic programming over waves), and
:func:`choose` compares it with the sequential time to decide whether overlap pays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CommModel:
    """Collective time = latency_ms + bytes / bytes_per_ms."""

    latency_ms: float
    bytes_per_ms: float

    def time_ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / self.bytes_per_ms


def fit_comm(sizes: Sequence[float], times_ms: Sequence[float]) -> CommModel:
    """Least-squares latency + bytes/bandwidth fit of measured (bytes, ms) pairs (>= 2 sizes)."""
    sizes, times = np.asarray(sizes, dtype=float), np.asarray(times_ms, dtype=float)
    if len(sizes) < 2 or len(np.unique(sizes)) < 2 or len(sizes) != len(times):
        raise ValueError("fit_comm needs (bytes, ms) pairs for at least two different sizes")
    slope, intercept = np.polyfit(sizes, times, 1)
    if slope <= 0:
        raise ValueError(f"measured times do not grow with size (slope {slope:.3g} ms/byte): cannot fit a bandwidth")
    return CommModel(latency_ms=max(float(intercept), 0.0), bytes_per_ms=1.0 / float(slope))


@dataclass(frozen=True)
class Problem:
    """One overlapped call as the model sees it.

    wave_bytes[w]: output bytes the GEMM completes in wave w (the last wave may be partial);
    wave_ms: GEMM time per wave with the SM budget; during / tail: the collective's model on the
    budget communicator while the GEMM runs, and on the full one afterwards (the last group).
    """

    wave_bytes: tuple[float, ...]
    wave_ms: float
    during: CommModel
    tail: CommModel

    @property
    def num_waves(self) -> int:
        return len(self.wave_bytes)


def makespan(problem: Problem, partition: Sequence[int]) -> float:
    """Predicted end of the last collective for ``partition`` (waves per group)."""
    if sum(partition) != problem.num_waves or any(w < 1 for w in partition):
        raise ValueError(f"partition {list(partition)} must be positive and sum to {problem.num_waves} waves")
    done, end = 0, 0.0
    for g, waves in enumerate(partition):
        nbytes = sum(problem.wave_bytes[done : done + waves])
        done += waves
        model = problem.tail if g == len(partition) - 1 else problem.during
        end = max(end, done * problem.wave_ms) + model.time_ms(nbytes)
    return end


def best_partition(problem: Problem) -> tuple[tuple[int, ...], float]:
    """The partition with the smallest predicted makespan, and that makespan.

    ``finish[j]``: earliest end of the collectives of waves 1..j when a group ends at wave j.
    A later finish never lets a later group start earlier, so the best prefix is the one to
    extend: finish[j] = min over i < j of max(finish[i], j * wave_ms) + comm(waves i+1..j),
    with the last group costed on the full communicator. O(waves^2).
    """
    total = problem.num_waves
    prefix = np.concatenate([[0.0], np.cumsum(problem.wave_bytes)])
    finish = np.full(total + 1, np.inf)
    finish[0] = 0.0
    came_from = np.zeros(total + 1, dtype=int)
    for j in range(1, total + 1):
        model = problem.tail if j == total else problem.during
        for i in range(j):
            t = max(finish[i], j * problem.wave_ms) + model.time_ms(prefix[j] - prefix[i])
            if t < finish[j]:
                finish[j], came_from[j] = t, i
    cuts, j = [], total
    while j > 0:
        cuts.append(int(j - came_from[j]))
        j = int(came_from[j])
    return tuple(reversed(cuts)), float(finish[total])


@dataclass(frozen=True)
class Choice:
    partition: tuple[int, ...]
    overlap_ms: float  # predicted makespan of the best partition
    sequential_ms: float  # predicted GEMM alone (all SMs) + one collective (full communicator)
    margin: float  # overlap must win by this fraction of sequential_ms

    @property
    def overlap_pays(self) -> bool:
        return self.overlap_ms < self.sequential_ms * (1.0 - self.margin)


def choose(problem: Problem, gemm_full_ms: float, margin: float = 0.02) -> Choice:
    """The best partition, and whether it beats sequential (GEMM on every SM, then one
    collective) by more than ``margin``; where it does not, the config to write is sequential."""
    partition, overlap_ms = best_partition(problem)
    sequential_ms = gemm_full_ms + problem.tail.time_ms(sum(problem.wave_bytes))
    return Choice(partition, overlap_ms, sequential_ms, margin)
