"""What one call communicates (:class:`Exchange`): the collective, the rows each rank sends to and
receives from each rank, and how an all-reduce adds (``reduction``), validated before anything is
launched (:func:`exchange`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..rules import COLLECTIVES, TAKES, reads_in_place
from .nccl import cuda_backend, group_fact

# torch 2.13 renamed these two (the old names warn there); older torch has only the old names.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _device_for(group: dist.ProcessGroup | None, device: torch.device | None) -> torch.device:
    """Where a small tensor for a collective on ``group`` must live (gloo: CPU, NCCL: a GPU)."""
    if cuda_backend(group) != "nccl":
        return torch.device("cpu")
    return device if device is not None else torch.device("cuda", torch.cuda.current_device())


@dataclass(frozen=True)
class Exchange:
    """What one call communicates: the collective, the rows of C this rank sends to each rank
    (``send``), and those it receives from each (``recv``); ``rows`` = rows of its result.
    ``reduction`` (all-reduce): ``nccl`` (NCCL reduces, in place), ``local`` (each group is
    all-gathered, every rank's partial sums arriving here, and added here: :func:`finish_group`) or
    ``pull`` (the same, copied out of the other ranks' memory: comm.peer)."""

    collective: str
    send: tuple[int, ...]
    recv: tuple[int, ...]
    rows: int
    reduction: str = "nccl"
    # Whether every rank knows that every rank sends and receives as many rows: what a choice
    # every rank must make alike may rest on (``even`` is this rank's view only: with 3+ ranks an
    # all-to-all can be even here and not on another rank).
    uniform: bool = True
    sources: tuple[int, ...] | None = None  # every rank's M, where the counts were exchanged

    @property
    def in_place(self) -> bool:
        """Whether a pull's sums read the other ranks' memory where it is, not copies of it
        (rules.reads_in_place)."""
        return reads_in_place(self.reduction)

    @property
    def even(self) -> bool:
        """Whether this rank sends and receives as many rows to and from every rank."""
        return len(set(self.send + self.recv)) == 1

    @property
    def ragged(self) -> bool:
        """Whether the ranks are known to pass different M (none for some: MoE experts with
        different token counts); known only where the counts were exchanged."""
        return self.sources is not None and len(set(self.sources)) > 1


def exchange(
    collective: str,
    m: int,
    world: int,
    splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    reduction: str = "nccl",
    rows_per_rank: Sequence[int] | None = None,
) -> Exchange:
    """Validate and describe a call's communication; raises ``ValueError`` naming the problem.

    all_to_all: ``splits[d]`` rows of C (in order) go to rank d; without ``splits`` the rows are
    split evenly. ``output_splits[s]`` = rows rank s sends here; when omitted with ``splits`` every
    rank's splits are exchanged first (one small all-gather and a host sync), so every rank knows
    every rank's M (``sources``) and whether the call is even (``uniform``). ``rows_per_rank``
    (with ``splits`` and ``output_splits``): every rank's M as the caller knows it, so that ranks
    whose M differ need no exchange (the call is then never ``uniform``).
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; supported: {COLLECTIVES}")
    if collective != "all_to_all" and (splits is not None or output_splits is not None or rows_per_rank is not None):
        raise ValueError(f"splits apply to all_to_all only, not {collective}")
    if rows_per_rank is not None and (splits is None or output_splits is None):
        raise ValueError("rows_per_rank (every rank's M) goes with an all-to-all's splits and output_splits")
    _check_reduction(collective, reduction)
    if collective == "all_reduce":
        return with_reduction(Exchange(collective, (m,), (m,), m), reduction, world)
    if splits is None and m % world:
        raise ValueError(f"{collective} splits M={m} rows evenly over {world} ranks: M must be a multiple of {world}")
    even = (m // world,) * world
    if collective == "reduce_scatter":
        return Exchange(collective, even, even, m // world, reduction)
    if reduction != "nccl":  # (its splits kept: with_reduction)
        plain = exchange(collective, m, world, splits, output_splits, group, device, rows_per_rank=rows_per_rank)
        return with_reduction(plain, reduction, world)
    send = even if splits is None else _counts("splits", splits, world)
    if sum(send) != m:
        raise ValueError(f"splits {list(send)} sum to {sum(send)} rows, but a has M={m} rows")
    if output_splits is not None:
        recv = _counts("output_splits", output_splits, world)
        if rows_per_rank is not None:  # (splits given too, checked above)
            sources, rank = _counts("rows_per_rank", rows_per_rank, world), group_fact(group, "rank", dist.get_rank)
            if sources[rank] != m:
                raise ValueError(f"rows_per_rank[{rank}] is {sources[rank]}, but this rank's a has M={m} rows")
            return Exchange(collective, send, recv, sum(recv), uniform=False, sources=sources)
        # without splits every rank splits its M (the same everywhere) evenly: then even is known
        return Exchange(collective, send, recv, sum(recv), uniform=splits is None and recv == even)
    if splits is None or world == 1:  # (one rank: nothing to exchange)
        return Exchange(collective, send, send, m)
    mine = torch.tensor(send, dtype=torch.int64, device=_device_for(group, device))
    matrix = torch.empty(world * world, dtype=torch.int64, device=mine.device)
    all_gather_single(matrix, mine, group=group)
    counts = matrix.tolist()  # row s: what rank s sends to each rank
    rows = [tuple(counts[s * world : (s + 1) * world]) for s in range(world)]
    recv = tuple(row[dist.get_rank(group)] for row in rows)
    uniform = len({c for row in rows for c in row}) == 1
    return Exchange(collective, send, recv, sum(recv), uniform=uniform, sources=tuple(map(sum, rows)))


def _check_reduction(collective: str, reduction: str) -> None:
    if reduction not in TAKES[collective]:
        raise ValueError(
            "reduction must be 'nccl', 'local' / 'pull' / 'pull_scatter' for all_reduce, 'pull' / 'pull_fused' "
            "for reduce_scatter, 'pull' for all_to_all; "
            f"got {reduction!r} for {collective}"
        )


def with_reduction(ex: Exchange, reduction: str, world: int) -> Exchange:
    """``ex`` (of ``world`` ranks) with ``reduction``, its splits kept (an all-reduce's gathers
    receive every rank's partial sums)."""
    _check_reduction(ex.collective, reduction)
    if ex.collective == "all_reduce":
        return Exchange(ex.collective, ex.send, (ex.rows,) * (world if reduction != "nccl" else 1), ex.rows, reduction)
    return replace(ex, reduction=reduction)


def _counts(name: str, values: Sequence[int], world: int) -> tuple[int, ...]:
    values = tuple(values)
    if len(values) != world or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values):
        raise ValueError(f"{name} must be {world} non-negative integers (one per rank), got {list(values)}")
    return values
