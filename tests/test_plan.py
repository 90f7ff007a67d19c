import functools
import shutil
import subprocess

import numpy as np
import pytest
import torch

from flashoverlap.comm import restore
from flashoverlap.plan import (
    LAYOUTS,
    SLOT_DTYPE,
    default_partition,
    effective_swizzle,
    late_after,
    make_plan,
    rotation_rows,
    schedule_order,
    scheduler_grid,
    slot_view,
    wave_count,
    wave_of_index,
    widest_budget,
)

from .helpers import random_plan_args

RNG = np.random.default_rng(0)
# layouts that take any M (segments needs M in whole units per segment: tested on its own below)
ANY_M = tuple(layout for layout in LAYOUTS if layout != "segments")


def random_plans(count: int):
    for _ in range(count):
        args = random_plan_args(RNG, max_tiles=6, ctas_choices=(1, 2, 3, 5, 8, 132))
        for layout in ANY_M:
            yield make_plan(**args, layout=layout)


def test_schedule_order_matches_cutlass_raster_along_n():
    # cluster 1: plain row-major over tiles
    assert schedule_order(2, 3, 1).tolist() == [0, 1, 2, 3, 4, 5]
    # cluster 2: the two M tiles of a cluster are consecutive, clusters walk along N
    assert schedule_order(2, 3, 2).tolist() == [0, 3, 1, 4, 2, 5]
    # an odd tile count in M is padded to whole clusters; padding owns no tile
    assert schedule_order(3, 2, 2).tolist() == [0, 2, 1, 3, 4, -1, 5, -1]
    # raster along M walks down each tile column (padding at the bottom of each)
    assert schedule_order(2, 3, 1, along_m=True).tolist() == [0, 3, 1, 4, 2, 5]
    assert schedule_order(3, 2, 2, along_m=True).tolist() == [0, 2, 4, -1, 1, 3, 5, -1]


def test_swizzle_walks_panels_like_cutlass():
    # along N, swizzle 2: clusters cycle over 2 tile rows, then advance along N; the grid is padded
    # to whole panels in both dimensions (CUTLASS rounds M and N up to the swizzle)
    assert schedule_order(4, 3, 1, swizzle=2).tolist() == [0, 3, 1, 4, 2, 5, -1, -1, 6, 9, 7, 10, 8, 11, -1, -1]
    # along M: panels of 2 tile columns walked row by row (3 tile rows padded to 4)
    expected = [0, 1, 4, 5, 8, 9, -1, -1, 2, 3, 6, 7, 10, 11, -1, -1]
    assert schedule_order(3, 4, 1, along_m=True, swizzle=2).tolist() == expected
    # clusters stay together inside a panel
    assert schedule_order(4, 2, 2, swizzle=2).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    # the scheduler's rule: only as much swizzle as the smaller side of the grid allows
    assert [effective_swizzle(6, 6, s) for s in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert [effective_swizzle(5, 40, 8), effective_swizzle(40, 2, 8), effective_swizzle(1, 40, 8)] == [4, 2, 1]
    # padding to whole panels (clusters of 2 in M): scheduled but empty, so it costs waves
    assert scheduler_grid(5, 7, 2, 4) == (8, 8, 4) and scheduler_grid(5, 7, 2, 8) == (16, 8, 8)


def test_swizzled_plans_keep_groups_contiguous_and_in_completion_order():
    for layout in ANY_M:
        plain = make_plan(1000, 3000, tile_m=128, tile_n=256, cluster_m=1, ctas=9, layout=layout)
        for swizzle in (2, 4, 8):
            plan = make_plan(1000, 3000, tile_m=128, tile_n=256, cluster_m=1, ctas=9, layout=layout, swizzle=swizzle)
            assert plan.swizzle == swizzle and not np.array_equal(plan.order, plain.order)
            assert np.array_equal(np.sort(plan.buffer_index()), np.arange(plan.numel))
            # every group completes no later than the next one starts completing
            last_wave = [plan.wave[plan.group == g].max() for g in range(plan.num_groups)]
            assert last_wave == sorted(last_wave)
    with pytest.raises(ValueError, match=r"swizzle must be one of \(1, 2, 4, 8\)"):
        make_plan(1000, 3000, tile_m=128, tile_n=256, cluster_m=1, ctas=9, swizzle=3)
    with pytest.raises(ValueError, match="stream-K schedules are planned without swizzle"):
        make_plan(1000, 3000, tile_m=128, tile_n=256, cluster_m=1, ctas=9, stream_k_tiles=4, swizzle=2)


@pytest.mark.parametrize("waves", range(1, 12))
def test_default_partition(waves):
    parts = default_partition(waves)
    assert sum(parts) == waves and all(p >= 1 for p in parts)
    assert parts[0] == 1 and parts[-1] == 1


def test_every_tile_exactly_once_and_buffer_is_a_bijection():
    for plan in random_plans(60):
        assert sorted(plan.order.tolist()) == list(range(plan.num_tiles))
        index = plan.buffer_index()
        assert np.array_equal(np.sort(index), np.arange(plan.numel)), plan
        assert sum(plan.tiles_per_group) == plan.num_tiles
        assert plan.bounds[0] == 0 and plan.bounds[-1] == plan.numel
        assert all(b > a for a, b in zip(plan.bounds, plan.bounds[1:]))


def test_each_group_owns_exactly_its_buffer_range():
    for plan in random_plans(60):
        index = plan.buffer_index().reshape(plan.m, plan.n)
        for tile in range(plan.num_tiles):
            r0, c0, rows, cols = plan.tile_extent(tile)
            g = plan.group[tile]
            block = index[r0 : r0 + rows, c0 : c0 + cols]
            assert plan.bounds[g] <= block.min() and block.max() < plan.bounds[g + 1]


def test_groups_complete_in_order_of_waves():
    for plan in random_plans(60):
        last_wave = [plan.wave[plan.group == g].max() for g in range(plan.num_groups)]
        assert last_wave == sorted(last_wave)
        if plan.layout == "tiles":
            group_of_wave = np.repeat(np.arange(len(plan.partition)), plan.partition)
            # exact wave groups (renumbered only where a requested group got no tile)
            assert np.array_equal(np.unique(group_of_wave[plan.wave], return_inverse=True)[1], plan.group)


def test_rows_layout_is_row_major_c_and_bands_stay_whole():
    for plan in random_plans(60):
        if plan.layout != "rows":
            continue
        assert np.array_equal(plan.buffer_index(), np.arange(plan.numel))
        band = np.arange(plan.num_tiles) // plan.tiles_n // plan.cluster_m
        for b in np.unique(band):
            assert len(np.unique(plan.group[band == b])) == 1
        # each band waits for its last tile, so groups complete in order
        last_wave = [plan.wave[plan.group == g].max() for g in range(plan.num_groups)]
        assert last_wave == sorted(last_wave)
        if plan.swizzle == 1:  # a plain raster also never mixes requested groups across group borders
            group_of_wave = np.repeat(np.arange(len(plan.partition)), plan.partition)
            requested = group_of_wave[plan.wave]
            assert all(
                np.unique(requested[plan.group == g]).max() <= np.unique(requested[plan.group == g + 1]).min()
                for g in range(plan.num_groups - 1)
            )


def test_rotated_rows_plans_walk_rows_from_the_rotation_on_and_group_rotated_row_ranges():
    rng = np.random.default_rng(3)
    for _ in range(60):
        args = random_plan_args(rng, max_tiles=6, ctas_choices=(1, 2, 3, 5, 8), stream_k_share=0.0)
        args["m"] = args["tile_m"] * args["cluster_m"] * args["swizzle"] * int(rng.integers(1, 4))
        args["partition"] = None
        unit = rotation_rows(**{k: args[k] for k in ("m", "n", "tile_m", "tile_n", "cluster_m", "swizzle")})
        tiles_m = args["m"] // args["tile_m"]
        rotate = unit // args["tile_m"] * int(rng.integers(0, args["m"] // unit))
        plain, plan = make_plan(**args), make_plan(**args, rotate=rotate)
        assert plan.rotate == rotate and plan.rotation_rows == unit
        # the same walk with every tile row moved down by `rotate`
        mt, nt = np.divmod(plain.order, plain.tiles_n)
        assert np.array_equal(plan.order, (mt + rotate) % tiles_m * plan.tiles_n + nt)
        assert np.array_equal(plan.buffer_index(), np.arange(plan.numel))  # in place, like any rows plan
        # group g holds rows [bounds[g], bounds[g + 1]) / n of C rotated up by `rotate` tile rows
        row_of = (np.arange(plan.num_tiles) // plan.tiles_n - rotate) % tiles_m * plan.tile_m
        for g in range(plan.num_groups):
            rows = np.unique(row_of[plan.group == g])
            assert rows.min() == plan.bounds[g] // plan.n and rows.max() + plan.tile_m == plan.bounds[g + 1] // plan.n
        assert plan.tiles_per_group == plain.tiles_per_group and plan.bounds == plain.bounds


def test_split_rows_plans_keep_every_group_inside_one_segment_of_the_walk():
    rng = np.random.default_rng(5)
    for _ in range(60):
        args = random_plan_args(rng, max_tiles=6, ctas_choices=(1, 2, 3, 5, 8), stream_k_share=0.0)
        split = int(rng.integers(2, 5))
        args["m"] = split * args["tile_m"] * args["cluster_m"] * args["swizzle"] * int(rng.integers(1, 3))
        args["partition"] = None
        unit = rotation_rows(**{k: args[k] for k in ("m", "n", "tile_m", "tile_n", "cluster_m", "swizzle")})
        rotate = unit // args["tile_m"] * int(rng.integers(0, args["m"] // unit))
        plain, plan = make_plan(**args, rotate=rotate), make_plan(**args, rotate=rotate, split=split)
        assert plan.split == split and np.array_equal(plan.order, plain.order)
        seg = args["m"] // split
        for g in range(plan.num_groups):  # one segment of the walk each, contiguous rows as any rows plan
            lo, hi = plan.bounds[g] // plan.n, plan.bounds[g + 1] // plan.n
            assert lo // seg == (hi - 1) // seg
        # only where the waves' groups cross a segment's edge do groups differ from the unsplit plan's
        edges = {b // plan.n for b in plan.bounds}
        assert edges == {b // plan.n for b in plain.bounds} | set(range(0, args["m"] + 1, seg))
    with pytest.raises(ValueError, match="need the 'rows' layout and M a multiple of 768 rows"):
        make_plan(m=1024, n=512, tile_m=128, tile_n=256, cluster_m=1, ctas=3, swizzle=4, split=3)


def test_widest_budget_keeps_the_wave_count_and_no_wider_one_does():
    rng = np.random.default_rng(8)
    for _ in range(200):
        args = random_plan_args(rng, max_tiles=8, ctas_choices=(8, 30, 64, 116), stream_k_share=0.0)
        plan = make_plan(**args)
        total = args["ctas"] + int(rng.integers(0, 40)) // args["cluster_m"] * args["cluster_m"]
        free = widest_budget(plan, total)
        assert 0 <= free <= total
        ctas = total - free
        assert ctas % args["cluster_m"] == 0 or free == 0

        grid = {k: args[k] for k in ("m", "n", "tile_m", "tile_n", "cluster_m", "swizzle")}
        waves = functools.partial(wave_count, **grid)

        assert waves(ctas=ctas) == waves(ctas=args["ctas"])
        if ctas > args["cluster_m"]:  # a cluster fewer takes more waves
            assert waves(ctas=ctas - args["cluster_m"]) > waves(ctas=args["ctas"])
        # measured against the whole GPU's grid instead of the plan's
        whole = total - widest_budget(make_plan(**{**args, "ctas": total, "partition": None, "keep": 0}), total)
        assert waves(ctas=whole) == waves(ctas=total) <= waves(ctas=args["ctas"])
        if whole > args["cluster_m"]:
            assert waves(ctas=whole - args["cluster_m"]) > waves(ctas=total)


def test_rotation_errors_name_the_problem():
    args = dict(m=1024, n=512, tile_m=128, tile_n=256, cluster_m=2, ctas=3)
    with pytest.raises(ValueError, match=r"multiple of 2 tile rows in \[0, 8\), got 1"):
        make_plan(**args, rotate=1)
    with pytest.raises(ValueError, match=r"in \[0, 8\), got 8"):
        make_plan(**args, rotate=8)
    with pytest.raises(ValueError, match="needs the 'rows' layout"):
        make_plan(**args, rotate=2, layout="cols")
    with pytest.raises(ValueError, match="no stream-K tiles"):
        make_plan(**args, rotate=2, stream_k_tiles=3)
    with pytest.raises(ValueError, match="M a multiple of 256 rows"):
        make_plan(**dict(args, m=1000), rotate=2)


def test_cols_layout_groups_are_column_blocks_with_contiguous_row_segments():
    for plan in random_plans(60):
        if plan.layout != "cols":
            continue
        index = plan.buffer_index().reshape(plan.m, plan.n)
        col_of_tile = np.arange(plan.num_tiles) % plan.tiles_n
        for g in range(plan.num_groups):
            c0, c1 = plan.columns(g)
            # whole tile columns, and the group's block is C[:, c0:c1] row-major
            assert set(col_of_tile[plan.group == g]) == set(range(c0 // plan.tile_n, -(-c1 // plan.tile_n)))
            block = plan.bounds[g] + np.arange(plan.m * (c1 - c0)).reshape(plan.m, c1 - c0)
            assert np.array_equal(index[:, c0:c1], block)
    with pytest.raises(ValueError, match="'cols' layout"):
        make_plan(256, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=1).columns(0)


def test_cols_plans_of_another_m_take_the_given_column_groups():
    """Ranks whose M differ plan their own tiles on the same columns (prepared.shared_columns): same
    groups of columns, each group's block [M, width] of this plan, every tile once."""
    for plan in random_plans(60):
        if plan.layout != "cols":
            continue
        for m in (1, plan.m // 3 + 1, 3 * plan.m + 5):
            other = make_plan(
                m,
                plan.n,
                tile_m=plan.tile_m,
                tile_n=plan.tile_n,
                cluster_m=plan.cluster_m,
                ctas=plan.ctas,
                layout="cols",
                swizzle=plan.swizzle,
                column_groups=plan.column_groups,
            )
            assert other.num_groups == plan.num_groups and other.column_groups == plan.column_groups
            assert [other.columns(g) for g in range(other.num_groups)] == [
                plan.columns(g) for g in range(plan.num_groups)
            ]
            assert np.array_equal(np.sort(other.buffer_index()), np.arange(m * plan.n))
            assert sum(other.tiles_per_group) == other.num_tiles
    base = make_plan(512, 1024, tile_m=128, tile_n=256, cluster_m=1, ctas=2, layout="cols")
    for groups, message in [
        ((0, 0, 1), "each of the 4 tile columns"),
        ((1, 1, 2, 2), "0 first"),
        ((0, 2, 2, 2), "the same or the next"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_plan(512, 1024, tile_m=128, tile_n=256, cluster_m=1, ctas=2, layout="cols", column_groups=groups)
    with pytest.raises(ValueError, match="column_groups are the 'cols' layout's"):
        make_plan(512, 1024, tile_m=128, tile_n=256, cluster_m=1, ctas=2, column_groups=base.column_groups)
    with pytest.raises(ValueError, match="column groups exist in the 'cols' layout"):
        _ = make_plan(512, 1024, tile_m=128, tile_n=256, cluster_m=1, ctas=2).column_groups


def test_stream_k_waves():
    # 10 tiles on 4 CTAs: plain waves 0,0,0,0,1,1,1,1,2,2; stream-K over the first 6 tiles
    # finishes them in one shared wave, then the last 4 run as one whole wave
    assert wave_of_index(np.arange(10), 4).tolist() == [0] * 4 + [1] * 4 + [2] * 2
    assert wave_of_index(np.arange(10), 4, 6).tolist() == [0] * 6 + [1] * 4
    assert wave_count(10 * 128, 256, 128, 256, 1, 4, 6) == 2
    plan = make_plan(10 * 128, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=4, stream_k_tiles=6, partition=(1, 1))
    assert plan.tiles_per_group == (6, 4) and plan.stream_k_tiles == 6
    with pytest.raises(ValueError, match="stream_k_tiles"):
        make_plan(256, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=1, stream_k_tiles=3)


def late_steps(tiles: int, ctas: int, keep: int, after: int) -> np.ndarray:
    """The step (the CTA's how-manieth tile) at which each linear index is taken: a transcription of
    RotatingTileScheduler::linear_index (csrc/rotating_scheduler.cuh), CTA by CTA."""
    step_of = np.full(tiles, -1)
    for cta in range(ctas):
        for step in range(tiles + 1):
            if keep == 0 or step < after:
                index = cta + step * ctas
            elif cta >= keep:
                break
            else:
                index = after * ctas + (step - after) * keep + cta
            if index >= tiles:
                break
            assert step_of[index] == -1, f"index {index} taken twice"
            step_of[index] = step
    return step_of


def test_late_budget_keeps_the_whole_grids_waves():
    # 1024 tiles on 132 SMs take 8 waves; 16 SMs for NCCL from the start cost a ninth (116 CTAs),
    # from the end of wave 6 on none; 4 SMs cost none even from the start
    assert wave_count(4096, 8192, 128, 256, 1, 132) == 8 and wave_count(4096, 8192, 128, 256, 1, 116) == 9
    assert late_after(1024, 132, 116) == 6 and late_after(1024, 132, 128) == 0
    # 10 tiles on 4 CTAs, 2 going on after the first wave
    assert wave_of_index(np.arange(10), 4, keep=2, after=1).tolist() == [0] * 4 + [1, 1, 2, 2, 3, 3]
    rng = np.random.default_rng(5)
    for _ in range(300):
        ctas = int(rng.integers(2, 140))
        tiles, keep = int(rng.integers(1, 12 * ctas)), int(rng.integers(1, ctas))
        after = late_after(tiles, ctas, keep)
        steps = late_steps(tiles, ctas, keep, after)
        assert (steps >= 0).all(), "a tile nobody takes"
        assert steps.tolist() == wave_of_index(np.arange(tiles), ctas, keep=keep, after=after).tolist()
        waves = -(-tiles // ctas)
        assert steps.max() + 1 == waves, "the late budget cost a wave"
        if after:  # the fewest: stopping a wave earlier would cost one
            assert late_steps(tiles, ctas, keep, after - 1).max() + 1 > waves


def test_late_budget_plans():
    args = dict(tile_m=128, tile_n=256, cluster_m=1, ctas=132)
    plain, late = make_plan(4096, 8192, **args), make_plan(4096, 8192, **args, keep=116)
    assert (late.keep, late.after, late.num_waves) == (116, 6, plain.num_waves) and plain.keep == plain.after == 0
    assert (late.wave[late.order] == wave_of_index(np.arange(1024), 132, keep=116, after=6)).all()
    assert make_plan(4096, 8192, **args, keep=132).keep == 0  # every CTA goes on: no late budget
    with pytest.raises(ValueError, match="keep"):
        make_plan(4096, 8192, **args, keep=100, stream_k_tiles=64)
    with pytest.raises(ValueError, match="keep"):
        make_plan(4096, 8192, **args, keep=-1)


def test_counter_targets_and_slot_table():
    plan = make_plan(300, 520, tile_m=128, tile_n=256, cluster_m=1, ctas=4, layout="tiles")
    assert plan.counter_targets(8) == tuple(8 * t for t in plan.tiles_per_group)
    table = plan.slot_table()
    assert table.dtype == SLOT_DTYPE and table.dtype.itemsize == 16
    assert table["group"].tolist() == plan.group.tolist()
    assert table["offset"].tolist() == plan.offset.tolist()


@pytest.mark.parametrize("layout", ["rows", "tiles", "cols"])
def test_restore_inverts_slot_writes(layout):
    for plan in random_plans(10):
        if plan.layout != layout:
            continue
        c = torch.randn(plan.m, plan.n)
        buffer = torch.full((plan.numel,), float("nan"))
        for tile in plan.order:
            r0, c0, rows, cols = plan.tile_extent(int(tile))
            slot_view(buffer, plan, int(tile)).copy_(c[r0 : r0 + rows, c0 : c0 + cols])
        assert torch.equal(buffer[torch.from_numpy(plan.buffer_index())], c.view(-1))
        out = torch.full_like(c, float("nan"))
        restore(buffer, out, plan)
        assert torch.equal(out, c)


def test_plan_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"sum to 3 waves.*has 2 waves"):
        make_plan(256, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=1, partition=(1, 2))
    with pytest.raises(ValueError, match="positive integers"):
        make_plan(256, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=1, partition=(2, 0))
    with pytest.raises(ValueError, match="layout"):
        make_plan(256, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=1, layout="columns")
    with pytest.raises(ValueError, match="ctas must be a positive integer"):
        make_plan(256, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=0)


RASTER_MAIN = r"""
#include <cstdio>
#include "raster.cuh"
int main() {
  int tiles_m, tiles_n, swizzle, along_m, rotate, interleave;
  while (std::scanf("%d %d %d %d %d %d", &tiles_m, &tiles_n, &swizzle, &along_m, &rotate, &interleave) == 6) {
    flashoverlap::Raster const r = flashoverlap::make_raster(tiles_m, tiles_n, swizzle, rotate, interleave);
    std::printf("%d", r.swizzle);
    for (int index = 0; index < r.padded_m * r.padded_n; ++index) {
      int mt, nt;
      flashoverlap::tile_of(index, r, along_m, mt, nt);
      std::printf(" %d", mt < tiles_m && nt < tiles_n ? mt * tiles_n + nt : -1);
    }
    std::printf("\n");
  }
}
"""


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_sm80_kernels_walk_tiles_in_the_planned_order(tmp_path):
    """csrc/raster.cuh (the sm80 kernels' tile loop) against schedule_order, run on the CPU."""
    from flashoverlap import jit

    (tmp_path / "raster_main.cu").write_text(RASTER_MAIN)
    exe = tmp_path / "raster"
    csrc = jit._PACKAGE_DIR / "csrc"
    subprocess.run([jit.nvcc_path(), "-I", str(csrc), str(tmp_path / "raster_main.cu"), "-o", str(exe)], check=True)
    rng = np.random.default_rng(5)
    cases = [
        tuple(int(v) for v in (*rng.integers(1, 30, 2), rng.choice([1, 2, 4, 8]), rng.integers(2))) for _ in range(60)
    ]
    # rotated walks (along N): any start row of the walked grid
    cases = [
        (*c, int(rng.integers(0, scheduler_grid(c[0], c[1], 1, c[2])[0])) if i % 2 and not c[3] else 0, 1)
        for i, c in enumerate(cases)
    ]
    # interleaved walks (along N): 2-4 segments of whole units (swizzle panels), no padded rows
    for _ in range(30):
        tiles_n, swizzle, segments = int(rng.integers(1, 30)), int(rng.choice([1, 2, 4, 8])), int(rng.integers(2, 5))
        unit = scheduler_grid(segments * 8 * 4, tiles_n, 1, swizzle)[2]
        cases.append((segments * unit * int(rng.integers(1, 4)), tiles_n, swizzle, 0, 0, segments))
    text = "\n".join(" ".join(map(str, c)) for c in cases)
    lines = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(lines) == len(cases)
    for (tiles_m, tiles_n, swizzle, along_m, rotate, interleave), line in zip(cases, lines):
        applied, *order = map(int, line.split())
        assert applied == scheduler_grid(tiles_m, tiles_n, 1, swizzle)[2]
        expected = schedule_order(
            tiles_m, tiles_n, 1, along_m=bool(along_m), swizzle=swizzle, rotate=rotate, interleave=interleave
        ).tolist()
        assert order == expected, (tiles_m, tiles_n, swizzle, along_m, rotate, interleave)


def test_segments_layout_stores_each_group_segment_after_segment():
    """Every group of the segments layout is one contiguous [interleave, rows, n] block holding the
    same rows of every segment, groups complete in order, and each tile has exactly one place."""
    rng = np.random.default_rng(11)
    for _ in range(60):
        args = random_plan_args(rng, max_tiles=4, ctas_choices=(1, 2, 3, 5, 7), stream_k_share=0.0)
        segments = int(rng.integers(1, 5))
        unit = rotation_rows(8192, args["n"], args["tile_m"], args["tile_n"], args["cluster_m"], args["swizzle"])
        args["m"] = segments * unit * int(rng.integers(1, 4))
        args["partition"] = None
        plan = make_plan(**args, layout="segments", interleave=segments)
        m, n, seg = plan.m, plan.n, plan.m // segments
        c = np.arange(m * n).reshape(m, n)
        buffer = np.full(m * n, -1)
        buffer[plan.buffer_index()] = c.reshape(-1)
        assert (buffer >= 0).all() and plan.in_place is False
        start = 0
        for g in range(plan.num_groups):
            r0, r1 = plan.segment_rows(g)
            assert r0 == start < r1
            block = buffer[plan.bounds[g] : plan.bounds[g + 1]].reshape(segments, r1 - r0, n)
            for s in range(segments):
                assert np.array_equal(block[s], c[s * seg + r0 : s * seg + r1])
            start = r1
            if g + 1 < plan.num_groups:  # groups complete in order
                assert plan.wave[plan.group == g].max() <= plan.wave[plan.group == g + 1].max()
        assert start == seg


def test_segments_layout_checks_its_inputs():
    with pytest.raises(ValueError, match="multiple of 384"):
        make_plan(1024, 256, tile_m=128, tile_n=128, cluster_m=1, ctas=4, layout="segments", interleave=3)
    with pytest.raises(ValueError, match="'segments' layout's"):
        make_plan(1024, 256, tile_m=128, tile_n=128, cluster_m=1, ctas=4, layout="rows", interleave=2)
    with pytest.raises(ValueError, match="'segments' layout's, without stream-K"):
        make_plan(1024, 256, tile_m=128, tile_n=128, cluster_m=1, ctas=4, layout="segments", stream_k_tiles=2)
    rows = make_plan(1024, 256, tile_m=128, tile_n=128, cluster_m=1, ctas=4)
    with pytest.raises(ValueError, match="segment rows exist in the 'segments' layout"):
        rows.segment_rows(0)
