"""End to end on the CPU: the plan replayed under gloo by several processes equals matmul + collective."""

import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashoverlap import comm
from flashoverlap.plan import make_plan, wave_count
from flashoverlap.reference import run_plan
from flashoverlap.runtime import sequential

from .helpers import random_partition, random_plan_args

CASES = 36
COLLECTIVE_LAYOUTS = [
    ("all_reduce", "rows"),
    ("all_reduce", "tiles"),
    ("all_reduce", "cols"),
    ("reduce_scatter", "cols"),
    ("all_to_all", "cols"),
    ("all_to_all", "cols"),
    ("reduce_scatter", "rows"),
    ("all_to_all", "rows"),  # equal splits
    ("reduce_scatter", "segments"),
    ("all_to_all", "segments"),  # equal splits
    ("all_reduce", "rows"),  # the ones from here on: reduction "local" (partial sums gathered, added after)
    ("all_reduce", "tiles"),
    ("all_reduce", "rows"),  # reduction "pull" (on GPUs copied out of the other ranks' memory; here comm.peer.Gathered)
    ("reduce_scatter", "segments"),  # ... this rank's segment rows of every rank's group
    ("all_to_all", "segments"),  # ... straight into the result (equal splits)
    ("all_reduce", "rows"),  # reduction "pull_scatter": each rank's share pulled and summed, the sums pulled
    ("reduce_scatter", "rows"),  # reduction "pull_fused": this rank's rows copied, added in the epilogue
]
LOCAL, PULL, SCATTER, FUSED = 10, 12, 15, 16  # COLLECTIVE_LAYOUTS[LOCAL:] gather and add locally, [PULL:] "pull", ...
SEGMENTED = ("rows", "segments")  # layouts whose reduce-scatter / all-to-all need equal, whole-unit segments


def operands(seed: int, rank: int, m: int, n: int, k: int, dtype, weight_layout: str):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    a = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    return a, (w if weight_layout == "nk" else w.t().contiguous())


def case(index: int, world: int = 1):
    """make_plan arguments of a random plan (edge tiles, clusters, stream-K, random partitions) for
    case ``index``, and the call around it; the ``rows`` layout of reduce-scatter / all-to-all gets
    equal segments of whole rotation steps, and is rotated per rank (:func:`rank_plan`); so does
    the ``segments`` layout, interleaved over the ranks."""
    rng = np.random.default_rng(index)
    collective, layout = COLLECTIVE_LAYOUTS[index % len(COLLECTIVE_LAYOUTS)]
    rotated = layout in SEGMENTED and collective != "all_reduce"
    while True:  # reduce-scatter and equal splits need M divisible by the world size
        args = random_plan_args(rng, max_tiles=3, ctas_choices=(1, 2, 3, 7), default_share=0.0)
        if rotated:
            args["m"] = world * args["tile_m"] * args["cluster_m"] * args["swizzle"] * int(rng.integers(1, 3))
            args["stream_k_tiles"] = 0
            waves = wave_count(
                args["m"],
                args["n"],
                args["tile_m"],
                args["tile_n"],
                args["cluster_m"],
                args["ctas"],
                0,
                args["swizzle"],
            )
            args["partition"] = random_partition(rng, waves)
        if collective == "all_reduce" or (collective, layout) == ("all_to_all", "cols") or args["m"] % world == 0:
            break
    k = 8 * int(rng.integers(1, 20))
    dtype = [torch.bfloat16, torch.float16][index % 2]
    weight_layout = ["nk", "kn"][(index // 2) % 2]
    return dict(args, layout=layout), collective, k, dtype, weight_layout


def rank_plan(args: dict, ex: comm.Exchange, rank: int):
    """The plan of ``args`` as ``rank`` runs it (rotated: comm.rows_rotation; interleaved:
    comm.interleave)."""
    start, rows = comm.rows_rotation(ex, args["layout"], rank), args["layout"] == "rows"
    segments = comm.interleave(ex, args["layout"], ex.reduction)  # (the rows layout: segments no group spans)
    split = {"interleave": 1, "split": segments} if rows else {"interleave": segments}
    return make_plan(**args, rotate=start // args["tile_m"], **split)


def a2a_splits(index: int, rank: int, m: int, world: int) -> tuple[int, ...]:
    """Rank ``rank``'s rows per destination, known to every rank: uneven (zeros included), or
    equal for the ``rows`` and ``segments`` layouts."""
    if COLLECTIVE_LAYOUTS[index % len(COLLECTIVE_LAYOUTS)][1] in SEGMENTED:
        return (m // world,) * world
    cuts = np.sort(np.random.default_rng([index, rank]).integers(0, m + 1, size=world - 1))
    return tuple(int(v) for v in np.diff([0, *cuts, m]))


def expected_result(index, plan, collective, k, dtype, weight_layout, rank, world):
    """fp64 result of ``collective`` over every rank's a @ w."""
    products = []
    for r in range(world):
        ar, wr = operands(index, r, plan.m, plan.n, k, dtype, weight_layout)
        products.append(ar.double() @ (wr.t() if weight_layout == "nk" else wr).double())
    if collective == "all_reduce":
        return sum(products)
    if collective == "reduce_scatter":
        rows = plan.m // world
        return sum(products)[rank * rows : (rank + 1) * rows]
    parts = []
    for s in range(world):
        splits = a2a_splits(index, s, plan.m, world)
        start = sum(splits[:rank])
        parts.append(products[s][start : start + splits[rank]])
    return torch.cat(parts)


def worker(rank: int, world: int, store_path: str):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        for index in range(CASES):
            args, collective, k, dtype, weight_layout = case(index, world)
            m = args["m"]
            splits = output_splits = None
            if collective == "all_to_all":
                splits = a2a_splits(index, rank, m, world)
                if index % 4 == 0:  # otherwise exchanged by comm.exchange
                    output_splits = [a2a_splits(index, s, m, world)[rank] for s in range(world)]
            position = index % len(COLLECTIVE_LAYOUTS)
            reductions = ["nccl", "local", "pull", "pull_scatter", "pull_fused"]
            reduction = reductions[sum(position >= p for p in (LOCAL, PULL, SCATTER, FUSED))]
            ex = comm.exchange(collective, m, world, splits, output_splits, reduction=reduction)
            plan = rank_plan(args, ex, rank)
            a, w = operands(index, rank, plan.m, plan.n, k, dtype, weight_layout)
            window = index // len(COLLECTIVE_LAYOUTS) == 1  # the result copied out of the buffers, as from a window
            out = run_plan(a, w, plan, ex, weight_layout=weight_layout, window=window)
            expected = expected_result(index, plan, collective, k, dtype, weight_layout, rank, world)
            what = f"case {index} ({collective}, {plan.layout}, {reduction}, {dtype}, window {window})"
            assert out.shape == expected.shape and out.dtype == dtype, what
            assert not torch.isnan(out).any(), f"{what}: unwritten elements"
            if expected.numel():
                rel = ((out.double() - expected).norm() / expected.norm()).item()
                assert rel < 1e-2, f"{what}: rel err {rel:.2e}"
                # and the plain path (matmul then the torch collective) agrees to rounding
                seq = sequential(a, w, weight_layout, ex, None).double()
                rel_seq = ((out.double() - seq).norm() / seq.norm()).item()
                assert rel_seq < 1e-2, f"{what}: differs from matmul + {collective} by {rel_seq:.2e}"
            if collective == "all_reduce":  # every rank holds the same sum, bit for bit
                every = [torch.empty_like(out, dtype=torch.float32) for _ in range(world)]
                dist.all_gather(every, out.float())
                assert all(torch.equal(e, every[0]) for e in every), f"{what}: the ranks' sums differ"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])  # 8: issue 9's machine, not lent for GPUs yet
def test_reference_executor_matches_matmul_then_collective(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "store")), nprocs=world, join=True)


def test_a_wrong_group_range_is_caught():
    """The check above can fail: a plan whose group ranges skip elements leaves NaNs behind."""
    args, _, k, dtype, weight_layout = case(1)
    broken = make_plan(**dict(args, layout="tiles"))
    object.__setattr__(broken, "offset", broken.offset + 8)  # every slot shifted: the first 8 elements never written
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0, world_size=1)
        try:
            a, w = operands(0, 0, broken.m, broken.n, k, dtype, weight_layout)
            with pytest.raises((AssertionError, RuntimeError)):
                out = run_plan(a, w, broken, comm.exchange("all_reduce", broken.m, 1), weight_layout=weight_layout)
                assert not torch.isnan(out).any()
        finally:
            dist.destroy_process_group()


def subgroup_worker(rank: int, world: int, store_path: str):
    """Ranks 1 and 2 of 3 run the rows layout on their own group: its ranks are not global ranks."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        sub = dist.new_group([1, 2])
        if rank == 0:
            return
        m, n, k = 4 * 128, 192, 40  # four tile rows, one group per tile row: each segment in two groups
        args = dict(m=m, n=n, tile_m=128, tile_n=64, cluster_m=1, ctas=3, partition=(1, 1, 1, 1))
        a, w = operands(7, rank, m, n, k, torch.bfloat16, "nk")
        for collective in ("reduce_scatter", "all_to_all"):
            ex = comm.exchange(collective, m, 2)
            plan = rank_plan(dict(args, layout="rows"), ex, dist.get_rank(sub))
            out = run_plan(a, w, plan, ex, group=sub)
            want = sequential(a, w, "nk", ex, sub).double()
            rel = ((out.double() - want).norm() / want.norm()).item()
            assert rel < 1e-2, f"{collective} on a subgroup: rel err {rel:.2e}"
    finally:
        dist.destroy_process_group()


def test_rows_layout_on_a_subgroup():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(subgroup_worker, args=(3, os.path.join(tmp, "store")), nprocs=3, join=True)


def ragged_worker(rank: int, world: int, store_path: str):
    """All-to-all whose ranks have different M (MoE experts): each rank plans its own M on the tile
    columns of the largest M's plan (prepared.shared_columns), the counts exchanged."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        for index in range(8):
            rng = np.random.default_rng(index)
            args = random_plan_args(rng, max_tiles=4, ctas_choices=(1, 2, 3, 7), default_share=0.5)
            args.update(layout="cols", partition=None, stream_k_tiles=0)  # the largest M's default groups
            sizes = [int(v) for v in np.random.default_rng([index, 7]).integers(1, args["m"] + 1, size=world)]
            m, k = sizes[rank], 8 * int(rng.integers(1, 20))
            cuts = np.sort(np.random.default_rng([index, rank]).integers(0, m + 1, size=world - 1))
            splits = [int(v) for v in np.diff([0, *cuts, m])]
            ex = comm.exchange("all_to_all", m, world, splits)
            assert ex.sources == tuple(sizes) and ex.ragged == (len(set(sizes)) > 1)
            shared = make_plan(**dict(args, m=max(sizes))).column_groups
            plan = make_plan(**dict(args, m=m), column_groups=shared)
            a, w = operands(index, rank, m, plan.n, k, torch.bfloat16, "nk")
            out = run_plan(a, w, plan, ex)
            products = []
            for r in range(world):
                ar, wr = operands(index, r, sizes[r], plan.n, k, torch.bfloat16, "nk")
                products.append(ar.double() @ wr.double().t())
            parts = []
            for s in range(world):
                cuts_s = np.sort(np.random.default_rng([index, s]).integers(0, sizes[s] + 1, size=world - 1))
                start = int(([0, *cuts_s])[rank])
                parts.append(products[s][start : start + ex.recv[s]])
            expected = torch.cat(parts)
            what = f"ragged case {index}, M {sizes}, groups {plan.num_groups}"
            assert out.shape == expected.shape and not torch.isnan(out).any(), what
            if expected.numel():
                assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-2, what
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_different_m_exchange_groups_of_shared_columns(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(ragged_worker, args=(world, os.path.join(tmp, "store")), nprocs=world, join=True)


def test_fp8_operands_are_refused():
    """The executor replays 16-bit calls; FP8's scales are not modelled (it would add unscaled values)."""
    a, w = (torch.randn(rows, 32).to(torch.float8_e4m3fn) for rows in (128, 256))
    plan = make_plan(128, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=1, layout="rows")
    with pytest.raises(ValueError, match="replays 16-bit calls"):
        run_plan(a, w, plan, comm.exchange("all_reduce", 128, 1))
