"""Tile order, waves, groups and the tile -> (group, slot) map of one overlapped GEMM.

Everything here is pure Python/numpy: the GPU kernel, the GPU runtime and the CPU reference
executor all consume the same :class:`Plan`, so CPU tests prove the layout logic.

Terms (see docs/design.md): a *tile* is one CTA output tile (tile_m x tile_n); a *wave* is
the ``ctas`` tiles the persistent grid works on at once; a *group* is a run of consecutive
waves whose output is communicated by one collective.

Layouts of the output buffer:

* ``rows``: group boundaries are rounded to whole bands of tile rows (a band is the
  ``cluster_m`` tile rows the scheduler walks together). Each band goes to the group in which
  its last tile finishes, so every group is a contiguous row range of row-major C: tiles are
  stored in place and no restore is needed. With ``rotate`` the scheduler walks the tile rows
  from row ``rotate`` on, wrapping around: group ranges are then rows of C rotated up by
  ``rotate`` tile rows (``bounds`` count in that rotated order). With ``split`` > 1 no group spans
  two of that many equal row segments of the walk (a reduce-scatter whose sums are fused into the
  epilogue: a rank's own segment, computed last, waits for the other ranks' groups of it, which
  must not wait for their own last segment in turn).
* ``tiles``: groups are exactly the requested waves. Each group's tiles are packed back to back
  (a tile of r x c valid elements occupies r*c elements with leading dimension c) and C is
  restored afterwards by one gather.
* ``cols``: the scheduler rasters along M (down tile columns) and group boundaries are rounded to
  whole tile columns, so group g is C[:, c0:c1] for all M rows, stored as its own row-major
  [M, c1 - c0] block. Any row range of it is contiguous: the per-destination segments that
  reduce-scatter and all-to-all need. Each group's result is copied into its columns of the
  output once its collective is done (comm.finish_group).
* ``segments``: for reduce-scatter / all-to-all over ``interleave`` ranks, C's rows split into
  that many equal segments (one per destination). The scheduler walks the segments' tile rows
  interleaved, a *unit* (:func:`rotation_rows`) of each segment in turn, so that every *step* (a
  unit of every segment) completes in order; group boundaries are rounded to whole steps, and a
  group's rows are stored segment after segment as full-width rows: group g is one contiguous
  [interleave, rows_g, N] block, ready for one reduce-scatter or equal-split all-to-all, and every
  tile is a whole-row tile of a row-major buffer (the TMA epilogue stores it at its slot's row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

LAYOUTS = ("rows", "tiles", "cols", "segments")

# Mirrors flashoverlap::TileSlot in csrc/tile_slot.cuh.
SLOT_DTYPE = np.dtype([("offset", "<i8"), ("ld", "<i4"), ("group", "<i4")])


SWIZZLES = (1, 2, 4, 8)


def effective_swizzle(blocks_m: int, blocks_n: int, swizzle: int) -> int:
    """The swizzle CUTLASS's sm90 tile scheduler applies when asked for at most ``swizzle``
    (``get_log_swizzle_size``): 8, 4 or 2 where the smaller side of the tile grid has at least 6,
    3 or 2 tiles, else 1. The sm80 kernels apply the same rule."""
    smaller = min(blocks_m, blocks_n)
    for size, needs in ((8, 6), (4, 3), (2, 2)):
        if swizzle >= size and smaller >= needs:
            return size
    return 1


def scheduler_grid(tiles_m: int, tiles_n: int, cluster_m: int, swizzle: int = 1) -> tuple[int, int, int]:
    """(tile rows, tile columns, swizzle) the scheduler walks: the tile grid padded to whole
    clusters and swizzle panels, and the swizzle it applies."""
    blocks_m = -(-tiles_m // cluster_m) * cluster_m
    size = effective_swizzle(blocks_m, tiles_n, swizzle)
    return -(-tiles_m // (size * cluster_m)) * size * cluster_m, -(-tiles_n // size) * size, size


def interleaved_rows(rows: np.ndarray, tiles_m: int, unit: int, interleave: int) -> np.ndarray:
    """Tile row of C the interleaved schedule (the ``segments`` layout) computes at walk position
    ``rows``: units of ``unit`` tile rows taken from each of ``interleave`` equal segments in turn
    (unit b is unit b // interleave of segment b % interleave). Mirrored by
    csrc/rotating_scheduler.cuh and csrc/raster.cuh."""
    units = tiles_m // (unit * interleave)  # units per segment
    b, w = np.divmod(rows, unit)
    return ((b % interleave) * units + b // interleave) * unit + w


def schedule_order(
    tiles_m: int,
    tiles_n: int,
    cluster_m: int,
    along_m: bool = False,
    swizzle: int = 1,
    rotate: int = 0,
    interleave: int = 1,
) -> np.ndarray:
    """Tile id (``mt * tiles_n + nt``) for each linear scheduler index, -1 for padding.

    Mirrors CUTLASS's ``PersistentTileSchedulerSm90`` as the generated kernels configure it:
    clusters ``(cluster_m, 1)``, raster along N (``along_m``: along M), and a swizzle of ``s``
    (see :func:`effective_swizzle`): consecutive clusters cycle over ``s`` tile rows (along M:
    ``s`` tile columns) before the raster advances, so a wave covers panels ``s`` tiles wide and
    reuses its operands in L2; ``s`` = 1 is a plain raster. The grid is padded to whole clusters
    and panels (:func:`scheduler_grid`); padded indices own no output. CTA ``j`` of a grid of
    ``ctas`` handles indices ``j, j + ctas, ...``, so index ``i`` runs in wave ``i // ctas``.
    ``rotate``: tile rows are walked from row ``rotate`` on (csrc/rotating_scheduler.cuh);
    ``interleave`` > 1: the segments' tile rows interleaved (:func:`interleaved_rows`; the grid
    has no padded rows then).
    """
    padded_m, padded_n, size = scheduler_grid(tiles_m, tiles_n, cluster_m, swizzle)
    cluster, within = np.divmod(np.arange(padded_m * padded_n, dtype=np.int64), cluster_m)
    offset, extra = cluster % size, cluster // size
    if along_m:
        panel, major = np.divmod(extra, padded_m // cluster_m)
        mt, nt = major * cluster_m + within, panel * size + offset
    else:
        panel, major = np.divmod(extra, padded_n)
        mt, nt = (panel * size + offset) * cluster_m + within, major
    mt = (mt + rotate) % padded_m
    if interleave > 1:
        mt = interleaved_rows(mt, padded_m, cluster_m * size, interleave)
    return np.where((mt < tiles_m) & (nt < tiles_n), mt * tiles_n + nt, -1)


def rotation_rows(m: int, n: int, tile_m: int, tile_n: int, cluster_m: int, swizzle: int = 1) -> int:
    """Rows a rotated schedule turns by at a time: the tile rows the raster walks as one unit
    (clusters, swizzle panels), so that rotating keeps each wave's tiles."""
    return tile_m * cluster_m * scheduler_grid(math.ceil(m / tile_m), math.ceil(n / tile_n), cluster_m, swizzle)[2]


def scheduled_tiles(m: int, n: int, tile_m: int, tile_n: int, cluster_m: int, swizzle: int = 1) -> int:
    """Tiles the scheduler walks (padding included, see :func:`scheduler_grid`)."""
    padded_m, padded_n, _ = scheduler_grid(math.ceil(m / tile_m), math.ceil(n / tile_n), cluster_m, swizzle)
    return padded_m * padded_n


def widest_budget(plan: Plan, total_sms: int) -> int:
    """The most SMs a persistent ``plan`` can leave to NCCL at no cost to the GEMM: ``total_sms``
    minus the fewest CTAs (whole clusters) that still walk its tiles in as many waves."""
    return spare_sms(plan.m, plan.n, plan.tile_m, plan.tile_n, plan.cluster_m, plan.swizzle, plan.ctas, total_sms)


def spare_sms(m: int, n: int, tile_m: int, tile_n: int, cluster_m: int, swizzle: int, ctas: int, total_sms: int) -> int:
    """``total_sms`` minus the fewest CTAs (whole clusters) that walk C[m, n]'s tiles in as many
    waves as a persistent grid of ``ctas`` CTAs does."""
    grid = (m, n, tile_m, tile_n, cluster_m)
    waves = wave_count(*grid, ctas, 0, swizzle)
    fewest = -(-scheduled_tiles(*grid, swizzle) // waves)
    return max(total_sms - -(-fewest // cluster_m) * cluster_m, 0)


def wave_count(
    m: int,
    n: int,
    tile_m: int,
    tile_n: int,
    cluster_m: int,
    ctas: int,
    stream_k_tiles: int = 0,
    swizzle: int = 1,
) -> int:
    """Waves the persistent grid needs for C[m, n] (padded tiles included, as they are scheduled).

    A stream-K schedule first spreads its ``stream_k_tiles`` leading tiles over all CTAs (one
    wave), then runs the rest in whole waves.
    """
    last = scheduled_tiles(m, n, tile_m, tile_n, cluster_m, swizzle) - 1
    return int(wave_of_index(np.array([last]), ctas, stream_k_tiles)[0]) + 1


def wave_of_index(index: np.ndarray, ctas: int, stream_k_tiles: int = 0, keep: int = 0, after: int = 0) -> np.ndarray:
    """Wave in which linear scheduler index ``index`` completes (see :func:`wave_count`); with
    ``keep`` > 0, only the first ``keep`` CTAs go on after the whole grid's first ``after`` waves
    (:func:`late_after`)."""
    if keep:
        return np.where(index < after * ctas, index // ctas, after + (index - after * ctas) // keep)
    if not stream_k_tiles:
        return index // ctas
    return np.where(index < stream_k_tiles, 0, 1 + (index - stream_k_tiles) // ctas)


def late_after(tiles: int, ctas: int, keep: int) -> int:
    """Waves a grid of ``ctas`` CTAs works on ``tiles`` before all but its first ``keep`` stop (a
    late SM budget: the stopped CTAs' SMs go to NCCL): the fewest after which the ``keep`` still
    finish in as many waves as the whole grid (0 where they need no more waves on their own)."""
    waves = -(-tiles // ctas)
    return max(0, -(-(tiles - keep * waves) // (ctas - keep)))


def default_partition(num_waves: int, after: int = 0) -> tuple[int, ...]:
    """Waves per group when no config says otherwise.

    A one-wave first group starts communication early (what matters when communication is the
    long pole); a one-wave last group keeps the exposed tail short (what matters when the GEMM
    is); the middle goes in pairs of waves to bound the per-collective latency. Under a late SM
    budget (``after`` > 0: no SM for NCCL before that wave ends) the first ``after`` waves are one
    group, their collectives could not start earlier anyway; the rest as above.
    """
    if 0 < after < num_waves:
        return (after, *default_partition(num_waves - after))
    if num_waves <= 3:
        return (1,) * num_waves
    middle = num_waves - 2
    return (1,) + (2,) * (middle // 2) + (1,) * (middle % 2) + (1,)


@dataclass(frozen=True, eq=False)
class Plan:
    m: int
    n: int
    tile_m: int
    tile_n: int
    cluster_m: int
    ctas: int
    stream_k_tiles: int
    keep: int  # CTAs that go on after the first ``after`` waves (a late SM budget; 0: all of them)
    after: int
    swizzle: int  # as applied (see effective_swizzle)
    layout: str
    rotate: int  # tile rows the schedule starts at (see the module doc)
    interleave: int  # segments the schedule interleaves (the ``segments`` layout; 1: none)
    split: int  # segments of the walk no group spans (the ``rows`` layout; 1: none)
    partition: tuple[int, ...]  # waves per group, as requested
    tiles_m: int
    tiles_n: int
    order: np.ndarray  # real tile ids in execution order
    wave: np.ndarray  # per tile id
    group: np.ndarray  # per tile id
    offset: np.ndarray  # per tile id: element offset in the buffer
    ld: np.ndarray  # per tile id: leading dimension in the buffer
    bounds: tuple[int, ...]  # group g owns buffer elements [bounds[g], bounds[g + 1]) (rotated, see above)
    tiles_per_group: tuple[int, ...]

    @property
    def num_tiles(self) -> int:
        return self.tiles_m * self.tiles_n

    @property
    def num_waves(self) -> int:
        return int(self.wave.max()) + 1

    @property
    def num_groups(self) -> int:
        return len(self.tiles_per_group)

    @property
    def numel(self) -> int:
        return self.m * self.n

    @property
    def along_m(self) -> bool:
        """Whether the kernel rasters along M (the ``cols`` layout)."""
        return self.layout == "cols"

    @property
    def column_groups(self) -> tuple[int, ...]:
        """The ``cols`` layout's group of each tile column (see :func:`make_plan`)."""
        if self.layout != "cols":
            raise ValueError(f"column groups exist in the 'cols' layout, this plan is {self.layout!r}")
        return tuple(int(g) for g in self.group[: self.tiles_n])

    def columns(self, group: int) -> tuple[int, int]:
        """Output columns [c0, c1) of ``group`` in the ``cols`` layout."""
        if self.layout != "cols":
            raise ValueError(f"group columns exist in the 'cols' layout, this plan is {self.layout!r}")
        return self.bounds[group] // self.m, self.bounds[group + 1] // self.m

    @property
    def rotation_rows(self) -> int:
        """Rows its schedule can rotate by at a time (see :func:`rotation_rows`)."""
        return rotation_rows(self.m, self.n, self.tile_m, self.tile_n, self.cluster_m, self.swizzle)

    def segment_rows(self, group: int) -> tuple[int, int]:
        """Rows [r0, r1) of every segment that ``group`` holds in the ``segments`` layout."""
        if self.layout != "segments":
            raise ValueError(f"segment rows exist in the 'segments' layout, this plan is {self.layout!r}")
        row = self.interleave * self.n
        return self.bounds[group] // row, self.bounds[group + 1] // row

    @property
    def in_place(self) -> bool:
        """The buffer is row-major C itself: nothing to restore."""
        return self.layout == "rows"

    def tile_extent(self, tile: int) -> tuple[int, int, int, int]:
        """(row0, col0, rows, cols) of tile ``tile`` in C."""
        mt, nt = divmod(tile, self.tiles_n)
        r0, c0 = mt * self.tile_m, nt * self.tile_n
        return r0, c0, min(self.tile_m, self.m - r0), min(self.tile_n, self.n - c0)

    def counter_targets(self, signals_per_tile: int) -> tuple[int, ...]:
        return tuple(t * signals_per_tile for t in self.tiles_per_group)

    def slot_table(self) -> np.ndarray:
        """Per-tile records in the kernel's ``TileSlot`` layout."""
        table = np.empty(self.num_tiles, dtype=SLOT_DTYPE)
        table["offset"] = self.offset
        table["ld"] = self.ld
        table["group"] = self.group
        return table

    def buffer_index(self) -> np.ndarray:
        """For each element of row-major C (flattened), its index in the buffer."""
        index = np.empty((self.m, self.n), dtype=np.int64)
        for tile in range(self.num_tiles):
            r0, c0, rows, cols = self.tile_extent(tile)
            local = np.arange(rows)[:, None] * self.ld[tile] + np.arange(cols)[None, :]
            index[r0 : r0 + rows, c0 : c0 + cols] = self.offset[tile] + local
        return index.reshape(-1)


def make_plan(
    m: int,
    n: int,
    *,
    tile_m: int,
    tile_n: int,
    cluster_m: int,
    ctas: int,
    stream_k_tiles: int = 0,
    partition: tuple[int, ...] | None = None,
    layout: str = "rows",
    swizzle: int = 1,
    rotate: int = 0,
    interleave: int = 1,
    column_groups: Sequence[int] | None = None,
    keep: int = 0,
    split: int = 1,
) -> Plan:
    """Plan C[m, n] computed by a persistent grid of ``ctas`` CTAs; see the module doc.

    ``stream_k_tiles``: leading tiles a stream-K schedule splits along K (0: none).
    ``keep``: a late SM budget: only that many of the CTAs go on after the waves of
    :func:`late_after` (0, or ``ctas`` and more: all of them throughout).
    ``swizzle``: the most the scheduler may swizzle (see :func:`schedule_order`).
    ``rotate``: tile rows the ``rows`` layout's schedule starts at, a multiple of
    :func:`rotation_rows` / ``tile_m`` below the tile rows (0: none).
    ``interleave``: the ``segments`` layout's segments (ranks); M a multiple of that many units of
    :func:`rotation_rows` rows.
    ``split``: the ``rows`` layout's equal segments of the walk no group spans (M a multiple of
    that many units of :func:`rotation_rows` rows).
    ``column_groups``: the ``cols`` layout's group of each tile column, as another plan of the
    same N gives them (:attr:`Plan.column_groups`) instead of from this plan's waves
    (``partition`` then unused): ranks whose M differ plan their groups on the same columns, so
    that every group's all-to-all exchanges blocks of one width.
    """
    _check_grid(m, n, tile_m, tile_n, cluster_m, ctas, layout, swizzle)
    tiles_m, tiles_n = math.ceil(m / tile_m), math.ceil(n / tile_n)
    _check_walk(m, n, tile_m, tile_n, cluster_m, swizzle, tiles_m, layout, stream_k_tiles, rotate, interleave)
    _check_split(m, n, tile_m, tile_n, cluster_m, swizzle, layout, split)
    order_padded = schedule_order(
        tiles_m, tiles_n, cluster_m, along_m=layout == "cols", swizzle=swizzle, rotate=rotate, interleave=interleave
    )
    keep, after = _late_budget(len(order_padded), ctas, stream_k_tiles, swizzle, keep)
    num_waves = wave_count(m, n, tile_m, tile_n, cluster_m, ctas, stream_k_tiles, swizzle)
    partition, column_groups = _partition(partition, column_groups, layout, tiles_n, num_waves, after)
    if column_groups is None and sum(partition) != num_waves:
        raise ValueError(
            f"group sizes {list(partition)} sum to {sum(partition)} waves, but a {m}x{n} output in "
            f"{tile_m}x{tile_n} tiles on {ctas} CTAs has {num_waves} waves"
        )

    real = order_padded >= 0
    order = order_padded[real]
    wave = np.empty(tiles_m * tiles_n, dtype=np.int64)
    wave[order] = wave_of_index(np.nonzero(real)[0], ctas, stream_k_tiles, keep, after)
    group_of_wave = np.repeat(np.arange(len(partition)), partition)
    mt, nt = np.divmod(np.arange(tiles_m * tiles_n), tiles_n)
    cols = np.minimum(tile_n, n - nt * tile_n)
    elems = np.minimum(tile_m, m - mt * tile_m) * cols  # valid elements per tile id

    if layout == "rows":
        group, offset, ld = _rows_layout(n, tile_m, tile_n, cluster_m, mt, nt, wave, group_of_wave)
        if split > 1:  # (renumbered below: segment after segment, each in its own groups)
            walked = (mt - int(rotate)) % tiles_m // (tiles_m // split)
            group = walked * len(partition) + group
    elif layout == "cols":
        group, offset, ld = _cols_layout(m, n, tile_m, tile_n, mt, nt, wave, group_of_wave, column_groups)
    elif layout == "segments":
        unit = rotation_rows(m, n, tile_m, tile_n, cluster_m, swizzle) // tile_m
        group, offset, ld = _segments_layout(n, tile_m, tile_n, interleave, unit, mt, nt, wave, group_of_wave)
    else:
        group = group_of_wave[wave]
        offset, ld = _tiles_layout(order, group, elems), cols

    # Renumber so that groups are 0..G-1 in completion order with no empty group.
    used = np.unique(group)
    group = np.searchsorted(used, group)
    tiles_per_group = np.bincount(group, minlength=len(used))
    sizes = np.bincount(group, weights=elems, minlength=len(used)).astype(np.int64)
    bounds = (0, *np.cumsum(sizes).tolist())
    return Plan(
        m=m,
        n=n,
        tile_m=tile_m,
        tile_n=tile_n,
        cluster_m=cluster_m,
        ctas=ctas,
        stream_k_tiles=int(stream_k_tiles),
        keep=keep,
        after=after,
        swizzle=scheduler_grid(tiles_m, tiles_n, cluster_m, swizzle)[2],
        layout=layout,
        rotate=int(rotate),
        interleave=int(interleave),
        split=int(split),
        partition=partition,
        tiles_m=tiles_m,
        tiles_n=tiles_n,
        order=order,
        wave=wave,
        group=group.astype(np.int32),
        offset=offset,
        ld=ld.astype(np.int32),
        bounds=tuple(int(b) for b in bounds),
        tiles_per_group=tuple(int(t) for t in tiles_per_group),
    )


def _check_grid(m, n, tile_m, tile_n, cluster_m, ctas, layout, swizzle) -> None:
    """Raise where the problem, its tiles and grid, layout or swizzle are no plan's."""
    for name, value in (
        ("m", m),
        ("n", n),
        ("tile_m", tile_m),
        ("tile_n", tile_n),
        ("cluster_m", cluster_m),
        ("ctas", ctas),
    ):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if swizzle not in SWIZZLES:
        raise ValueError(f"swizzle must be one of {SWIZZLES}, got {swizzle!r}")


def _check_walk(m, n, tile_m, tile_n, cluster_m, swizzle, tiles_m, layout, stream_k_tiles, rotate, interleave) -> None:
    """Raise where the schedule cannot start at ``rotate`` tile rows or interleave ``interleave``
    segments: the ``rows`` / ``segments`` layouts' walks, of whole :func:`rotation_rows` units."""
    if rotate:
        unit = rotation_rows(m, n, tile_m, tile_n, cluster_m, swizzle) // tile_m
        if layout != "rows" or stream_k_tiles or m % (unit * tile_m):
            raise ValueError(
                f"a rotated schedule needs the 'rows' layout, no stream-K tiles and M a multiple of "
                f"{unit * tile_m} rows (got layout {layout!r}, M={m})"
            )
        if not isinstance(rotate, (int, np.integer)) or not 0 <= rotate < tiles_m or rotate % unit:
            raise ValueError(f"rotate must be a multiple of {unit} tile rows in [0, {tiles_m}), got {rotate!r}")
    if not isinstance(interleave, (int, np.integer)) or interleave < 1:
        raise ValueError(f"interleave must be a positive integer (segments), got {interleave!r}")
    if interleave > 1 and layout != "segments" or layout == "segments" and stream_k_tiles:
        raise ValueError("an interleaved schedule is the 'segments' layout's, without stream-K tiles")
    if layout == "segments":
        unit = rotation_rows(m, n, tile_m, tile_n, cluster_m, swizzle)
        if m % (unit * interleave):
            raise ValueError(
                f"layout 'segments' splits M into {interleave} equal segments of whole {unit}-row units "
                f"(tile rows x cluster x swizzle panel): M must be a multiple of {unit * interleave}, got {m}"
            )


def _check_split(m, n, tile_m, tile_n, cluster_m, swizzle, layout, split) -> None:
    """Raise where the ``rows`` layout's groups cannot keep inside ``split`` equal segments of whole
    :func:`rotation_rows` units."""
    if not isinstance(split, (int, np.integer)) or split < 1:
        raise ValueError(f"split must be a positive integer (segments), got {split!r}")
    unit = rotation_rows(m, n, tile_m, tile_n, cluster_m, swizzle)
    if split > 1 and (layout != "rows" or m % (unit * split)):
        raise ValueError(
            f"groups split at {split} segments need the 'rows' layout and M a multiple of {unit * split} rows "
            f"(got layout {layout!r}, M={m})"
        )


def _late_budget(tiles: int, ctas: int, stream_k_tiles, swizzle: int, keep) -> tuple[int, int]:
    """(keep, after) of a schedule of ``tiles`` (padded) tiles on ``ctas`` CTAs: the CTAs that go on
    after the first ``after`` waves (0: all of them throughout), the stream-K tiles checked."""
    if not isinstance(stream_k_tiles, (int, np.integer)) or not 0 <= stream_k_tiles <= tiles:
        raise ValueError(f"stream_k_tiles must be in [0, {tiles}], got {stream_k_tiles!r}")
    if stream_k_tiles and swizzle > 1:
        raise ValueError("stream-K schedules are planned without swizzle")
    if not isinstance(keep, (int, np.integer)) or keep < 0 or keep and stream_k_tiles:
        raise ValueError(f"keep must be an integer >= 0 (CTAs), without stream-K tiles, got {keep!r}")
    keep = int(keep) if keep < ctas else 0
    return keep, late_after(tiles, ctas, keep) if keep else 0


def _partition(
    partition, column_groups, layout: str, tiles_n: int, num_waves: int, after: int
) -> tuple[tuple[int, ...], np.ndarray | None]:
    """The waves per group (the default partition where None) and the ``cols`` layout's group of
    each tile column where given (then the groups are the columns', no partition), checked."""
    if column_groups is not None:
        column_groups = np.asarray(column_groups, dtype=np.int64)
        steps = np.diff(column_groups)
        if layout != "cols" or partition is not None:
            raise ValueError("column_groups are the 'cols' layout's, given instead of a partition")
        if column_groups.shape != (tiles_n,) or column_groups[0] != 0 or ((steps != 0) & (steps != 1)).any():
            raise ValueError(
                f"column_groups must give each of the {tiles_n} tile columns its group: 0 first, then "
                f"the same or the next, got {column_groups.tolist()}"
            )
        partition = ()  # none requested: the groups are the columns'
    partition = tuple(default_partition(num_waves, after) if partition is None else partition)
    if any(not isinstance(w, (int, np.integer)) or w < 1 for w in partition):
        raise ValueError(f"group sizes must be positive integers (waves), got {list(partition)}")
    return partition, column_groups


def _rows_layout(n, tile_m, tile_n, cluster_m, mt, nt, wave, group_of_wave):
    band = mt // cluster_m
    # A band is complete when its last tile is: assign it to the group of its latest wave.
    band_wave = np.zeros(band.max() + 1, dtype=np.int64)
    np.maximum.at(band_wave, band, wave)
    group = group_of_wave[band_wave][band]
    offset = mt.astype(np.int64) * tile_m * n + nt * tile_n
    return group, offset, np.full(len(mt), n)


def _cols_layout(m, n, tile_m, tile_n, mt, nt, wave, group_of_wave, col_group=None):
    # A tile column is complete when its last tile is; raster along M completes columns in order,
    # so every group is a run of whole columns [start, end).
    if col_group is None:
        col_wave = np.zeros(nt.max() + 1, dtype=np.int64)
        np.maximum.at(col_wave, nt, wave)
        col_group = group_of_wave[col_wave]
    start = np.searchsorted(col_group, col_group, side="left")[nt]
    end = np.searchsorted(col_group, col_group, side="right")[nt]
    width = np.minimum(n, end * tile_n) - start * tile_n
    offset = m * start * tile_n + mt.astype(np.int64) * tile_m * width + (nt - start) * tile_n
    return col_group[nt], offset, width


def _segments_layout(n, tile_m, tile_n, interleave, unit, mt, nt, wave, group_of_wave):
    # A step (a unit of every segment) is complete when its last tile is; the interleaved raster
    # completes steps in order, so every group is a run of whole steps [first, end).
    segment, row = np.divmod(mt, (mt.max() + 1) // interleave)
    step = row // unit
    step_wave = np.zeros(step.max() + 1, dtype=np.int64)
    np.maximum.at(step_wave, step, wave)
    step_group = group_of_wave[step_wave]
    first = np.searchsorted(step_group, step_group, side="left")[step]
    end = np.searchsorted(step_group, step_group, side="right")[step]
    # a group's rows: every segment's rows of its steps, segment after segment, at full width
    slot_row = first * unit * interleave + segment * (end - first) * unit + (row - first * unit)
    offset = slot_row.astype(np.int64) * tile_m * n + nt * tile_n
    return step_group[step], offset, np.full(len(mt), n)


def _tiles_layout(order, group, elems):
    # Tiles of a group back to back in execution order; groups in group order.
    packed = order[np.argsort(group[order], kind="stable")]
    offset = np.zeros(len(group), dtype=np.int64)
    offset[packed] = np.concatenate([[0], np.cumsum(elems[packed])[:-1]])
    return offset


def slot_view(buffer: torch.Tensor, plan: Plan, tile: int) -> torch.Tensor:
    """The ``rows x cols`` view of ``tile``'s slot in the flat ``buffer``."""
    _, _, rows, cols = plan.tile_extent(tile)
    return buffer.as_strided((rows, cols), (int(plan.ld[tile]), 1), buffer.storage_offset() + int(plan.offset[tile]))
