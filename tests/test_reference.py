"""End to end on the CPU: the plan replayed under gloo by several processes equals matmul + collective."""

import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashoverlap.overlap import sequential
from flashoverlap.plan import make_plan
from flashoverlap.reference import run_plan

from .helpers import random_plan_args

CASES = 12


def operands(seed: int, rank: int, m: int, n: int, k: int, dtype, weight_layout: str):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    a = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    return a, (w if weight_layout == "nk" else w.t().contiguous())


def case(index: int):
    rng = np.random.default_rng(index)
    args = random_plan_args(rng, max_tiles=3, ctas_choices=(1, 2, 3, 7), default_share=0.0)
    k = 8 * int(rng.integers(1, 20))
    dtype = [torch.bfloat16, torch.float16][index % 2]
    weight_layout = ["nk", "kn"][(index // 2) % 2]
    plan = make_plan(**args, layout=["rows", "tiles"][(index // 4) % 2])
    return plan, k, dtype, weight_layout


def worker(rank: int, world: int, store_path: str):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        for index in range(CASES):
            plan, k, dtype, weight_layout = case(index)
            a, w = operands(index, rank, plan.m, plan.n, k, dtype, weight_layout)
            out = run_plan(a, w, plan, weight_layout=weight_layout)
            assert out.shape == (plan.m, plan.n) and out.dtype == dtype
            assert not torch.isnan(out).any(), f"case {index}: unwritten elements"
            # fp64 reference over every rank's operands
            expected = torch.zeros(plan.m, plan.n, dtype=torch.float64)
            for r in range(world):
                ar, wr = operands(index, r, plan.m, plan.n, k, dtype, weight_layout)
                b = wr.t() if weight_layout == "nk" else wr
                expected += ar.double() @ b.double()
            rel = ((out.double() - expected).norm() / expected.norm()).item()
            assert rel < 1e-2, f"case {index} ({plan.layout}, {dtype}): rel err {rel:.2e}"
            # and the plain path (matmul then all_reduce) agrees to rounding
            seq = sequential(a, w, weight_layout, None, world)
            rel_seq = ((out.double() - seq.double()).norm() / seq.double().norm()).item()
            assert rel_seq < 1e-2, f"case {index}: differs from matmul + all_reduce by {rel_seq:.2e}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_reference_executor_matches_matmul_then_all_reduce(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "store")), nprocs=world, join=True)


def test_a_wrong_group_range_is_caught():
    """The check above can fail: a plan whose group ranges skip elements leaves NaNs behind."""
    plan, k, dtype, weight_layout = case(4)
    broken = make_plan(
        plan.m,
        plan.n,
        tile_m=plan.tile_m,
        tile_n=plan.tile_n,
        cluster_m=plan.cluster_m,
        ctas=plan.ctas,
        partition=plan.partition,
        layout="tiles",
    )
    object.__setattr__(broken, "offset", broken.offset + 8)  # every slot shifted: the first 8 elements never written
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0, world_size=1)
        try:
            a, w = operands(0, 0, broken.m, broken.n, k, dtype, weight_layout)
            with pytest.raises((AssertionError, RuntimeError)):
                out = run_plan(a, w, broken, weight_layout=weight_layout)
                assert not torch.isnan(out).any()
        finally:
            dist.destroy_process_group()
