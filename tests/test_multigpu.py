"""Every visible GPU, one process each (NCCL): each entry point equals matmul + its collective."""

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashoverlap
from flashoverlap import OverlapConfig, comm, signal
from flashoverlap.overlap import sequential

pytestmark = pytest.mark.multigpu

SHAPES = [(4096, 8192, 2048), (1000, 1032, 200), (333, 520, 264), (3000, 2056, 1000)]
CONFIGS = [
    OverlapConfig(),
    OverlapConfig(epilogue="direct"),
    OverlapConfig(layout="tiles"),
    OverlapConfig(layout="cols"),
    OverlapConfig(cluster_m=2, partition=None, comm_sms=16),
    OverlapConfig(tile_n=128, layout="tiles"),
    OverlapConfig(scheduler="streamk", comm_sms=12),
]


def operands(seed, rank, m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    return (
        torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16),
        torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16),
    )


def init_rank(rank, world, store_path):
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
    )


def spawn(fn, *args):
    """Run fn(rank, world, store_path, *args) on every visible GPU, one process each."""
    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(world, os.path.join(tmp, "store"), *args), nprocs=world, join=True)


def worker(rank, world, store_path, mode):
    os.environ["FLASHOVERLAP_WAIT"] = mode
    init_rank(rank, world, store_path)
    try:
        for seed, (m, n, k) in enumerate(SHAPES):
            expected = torch.zeros(m, n, device="cuda")
            for r in range(world):
                ar, wr = operands(seed, r, m, n, k)
                expected += ar.float() @ wr.float().t()
            a, w = operands(seed, rank, m, n, k)
            for cfg in CONFIGS:
                torch.full((2 * m * n,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the cache
                for _ in range(2):
                    out = flashoverlap.gemm_all_reduce(a, w, config=cfg)
                assert not torch.isnan(out).any(), f"{(m, n, k)} {cfg}: unwritten elements"
                rel = ((out.float() - expected).norm() / expected.norm()).item()
                assert rel < 1e-2, f"{(m, n, k)} {cfg}: rel err {rel:.2e}"
                seq = sequential(a, w, "nk", comm.exchange("all_reduce", m, world), None)
                assert ((out.float() - seq.float()).norm() / seq.float().norm()).item() < 1e-2
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
        signal.uses_stream_wait.cache_clear()


@pytest.mark.parametrize("mode", ["stream", "spin"])
def test_gemm_all_reduce_on_all_gpus(mode):
    spawn(worker, mode)


SPLIT_CONFIGS = [OverlapConfig(), OverlapConfig(tile_n=128), OverlapConfig(scheduler="streamk", comm_sms=12)]


def uneven_splits(seed, rank, m, world):
    """Rank ``rank``'s rows per destination (zeros allowed), known to every rank."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    cuts = torch.sort(torch.randint(0, m + 1, (world - 1,), generator=gen)).values.tolist()
    return [b - a for a, b in zip([0, *cuts], [*cuts, m])]


def split_worker(rank, world, store_path):
    """gemm_reduce_scatter and gemm_all_to_all (even, uneven, exchanged counts) vs fp32 and torch."""
    init_rank(rank, world, store_path)
    try:
        for seed, (m, n, k) in enumerate(SHAPES):
            products = []
            for r in range(world):
                ar, wr = operands(seed, r, m, n, k)
                products.append(ar.float() @ wr.float().t())
            a, w = operands(seed, rank, m, n, k)
            calls = []
            if m % world == 0:
                rows = m // world
                calls.append(("reduce_scatter", {}, sum(products)[rank * rows : (rank + 1) * rows]))
                even = [torch.chunk(p, world)[rank] for p in products]
                calls.append(("all_to_all", {}, torch.cat(even)))
            splits = [uneven_splits(seed, s, m, world) for s in range(world)]
            parts = [products[s][sum(splits[s][:rank]) : sum(splits[s][: rank + 1])] for s in range(world)]
            mine = {"splits": splits[rank], "output_splits": [splits[s][rank] for s in range(world)]}
            calls.append(("all_to_all", mine, torch.cat(parts)))
            calls.append(("all_to_all", {"splits": splits[rank]}, torch.cat(parts)))  # counts exchanged
            for collective, kwargs, expected in calls:
                fn = getattr(flashoverlap, f"gemm_{collective}")
                for cfg in SPLIT_CONFIGS:
                    what = f"{collective} {(m, n, k)} {kwargs} {cfg}"
                    torch.full((2 * m * n,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the cache
                    for _ in range(2):
                        out = fn(a, w, config=cfg, **kwargs)
                    assert out.shape == expected.shape, what
                    assert not torch.isnan(out).any(), f"{what}: unwritten elements"
                    if expected.numel():
                        rel = ((out.float() - expected).norm() / expected.norm()).item()
                        assert rel < 1e-2, f"{what}: rel err {rel:.2e}"
                ex = comm.exchange(collective, m, world, kwargs.get("splits"), kwargs.get("output_splits"))
                seq = sequential(a, w, "nk", ex, None).float()  # matmul then the torch collective
                assert seq.shape == out.shape, what
                if seq.numel():
                    assert ((out.float() - seq).norm() / seq.norm()).item() < 1e-2, what
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def test_gemm_reduce_scatter_and_all_to_all_on_all_gpus():
    spawn(split_worker)


def mismatch_worker(rank, world, store_path):
    init_rank(rank, world, store_path)
    try:
        a, w = operands(0, rank, 1024, 2048, 512)
        cfg = OverlapConfig() if rank == 0 else OverlapConfig(layout="tiles", partition=None, tile_n=128)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="ranks planned different calls"):
            flashoverlap.gemm_all_reduce(a, w, config=cfg)
        assert time.monotonic() - start < 60, "the mismatch must be reported within seconds"
    finally:
        dist.destroy_process_group()


def test_mismatched_configs_fail_on_every_rank_instead_of_hanging():
    spawn(mismatch_worker)
