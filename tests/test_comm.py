"""comm on the CPU (gloo): plan agreement across ranks."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashoverlap.comm import agree


def worker(rank: int, world: int, store_path: str):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        agree(None, "all_reduce 128x256 partition=(1, 1)", torch.device("cpu"))  # same everywhere: passes
        expected = r"ranks planned different calls \(ranks grouped by plan: \[\[0, 2\], \[1\]\]"
        with pytest.raises(RuntimeError, match=expected):
            agree(None, f"all_reduce 128x256 partition={(1, 1) if rank != 1 else (2,)}", torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_mismatched_plans_fail_on_every_rank():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(3, os.path.join(tmp, "store")), nprocs=3, join=True)
