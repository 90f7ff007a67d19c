"""Where a call's host time goes (torchrun, 2+ GPUs): per-call enqueue time of the sequential
baseline, the registry's sequential fallback and the overlapped call, then a cProfile of the
overlapped one.  torchrun --nproc-per-node 2 bench/host_profile.py [MxNxK] [CONFIG_JSON]"""

import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap import comm
from flashoverlap.overlap import sequential


def enqueue_ms(fn, calls: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    spent = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        spent.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()  # each call from an idle GPU: the host's time alone
    return statistics.median(spent)


def main() -> None:
    m, n, k = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1024x8192x8192").split("x"))
    config = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ex = comm.exchange("all_reduce", m, dist.get_world_size())
    cases = {
        "matmul": lambda: a @ w.t(),
        "sequential": lambda: sequential(a, w, "nk", ex, None),
        "fallback (config sequential)": lambda: flashoverlap.gemm_all_reduce(a, w, config={"sequential": True}),
        "registry (no config)": lambda: flashoverlap.gemm_all_reduce(a, w),
        f"overlapped {config}": lambda: flashoverlap.gemm_all_reduce(a, w, config=config),
    }
    for name, fn in cases.items():
        ms = enqueue_ms(fn)
        if rank == 0:
            print(f"{m}x{n}x{k} {name:>32}: {ms * 1e3:7.1f} us host per call")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        flashoverlap.gemm_all_reduce(a, w, config=config)
    profile.disable()
    torch.cuda.synchronize()
    if rank == 0:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
