"""Every visible GPU, one process each (NCCL): gemm_all_reduce equals matmul + all_reduce."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashoverlap
from flashoverlap import OverlapConfig, signal
from flashoverlap.overlap import sequential

pytestmark = pytest.mark.multigpu

SHAPES = [(4096, 8192, 2048), (1000, 1032, 200), (333, 520, 264), (3000, 2056, 1000)]
CONFIGS = [
    OverlapConfig(),
    OverlapConfig(epilogue="direct"),
    OverlapConfig(layout="tiles"),
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
                seq = sequential(a, w, "nk", None, world)
                assert ((out.float() - seq.float()).norm() / seq.float().norm()).item() < 1e-2
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
        signal.uses_stream_wait.cache_clear()


@pytest.mark.parametrize("mode", ["stream", "spin"])
def test_gemm_all_reduce_on_all_gpus(mode):
    spawn(worker, mode)


def mismatch_worker(rank, world, store_path):
    init_rank(rank, world, store_path)
    try:
        a, w = operands(0, rank, 1024, 2048, 512)
        cfg = OverlapConfig() if rank == 0 else OverlapConfig(layout="tiles", partition=None, tile_n=128)
        with pytest.raises(RuntimeError, match="ranks planned different calls"):
            flashoverlap.gemm_all_reduce(a, w, config=cfg)
    finally:
        dist.destroy_process_group()


def test_mismatched_configs_fail_on_every_rank_instead_of_hanging():
    spawn(mismatch_worker)
