"""Where a call's host time goes (torchrun). On a shape small enough that the host is the
bottleneck, calls back to back run at the host's pace, so ms per call is host time (the paths
through c10d take turns in balanced orders, blocks of calls each, the median block reported: the
host's drift falls on every path alike); then a
cProfile of each flashoverlap path ("overlapped": the collectives through c10d,
FLASHOVERLAP_NCCL=c10d; "direct": through NCCL's C API, the default, replayed natively from the
third call on; "python": the same enqueued from Python every call, FLASHOVERLAP_REPLAY=0).
On one GPU, where the public calls run the plain GEMM, "overlapped" and "direct" run the whole
overlapped call on a one-rank group (NCCL's collectives are then local copies).
  torchrun --nproc-per-node 2 bench/host_profile.py [MxNxK (default 256x2048x2048)] [CONFIG_JSON] [COLLECTIVE]
(COLLECTIVE: all_reduce (default), reduce_scatter or all_to_all, split evenly.)"""

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
from flashoverlap import comm, state
from flashoverlap.config import OverlapConfig
from flashoverlap.decision import budget_communicator
from flashoverlap.prepared import prepare
from flashoverlap.rules import for_collective
from flashoverlap.runtime import run_overlapped, sequential
from flashoverlap.timing import balanced_orders

CALLS = 400
BLOCK = 50  # calls per timed block where the paths take turns


def per_call_us(fn, calls: int = CALLS, waited: bool = True) -> float:
    """us per call of ``calls`` back to back after a warm-up, the GPU waited for at the end
    (``waited`` False: the host's time alone, the work still queued not counted)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if waited:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def setup(default_shape: str = "256x2048x2048"):
    """This rank's process group (NCCL, the GPU of its local rank) and the call the command line
    names, [MxNxK] [CONFIG_JSON] [COLLECTIVE]: rank, (m, n, k), the config dict, the collective,
    random bf16 operands a [M, K] and w [N, K], the Exchange of the collective split evenly, the
    public call."""
    m, n, k = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else default_shape).split("x"))
    config = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    name = sys.argv[3] if len(sys.argv) > 3 else "all_reduce"
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ex = comm.exchange(name, m, dist.get_world_size())
    return rank, (m, n, k), config, name, a, w, ex, getattr(flashoverlap, f"gemm_{name}")


def main() -> None:
    rank, (m, n, k), config, name, a, w, ex, call = setup()
    c = a @ w.t()
    plain = OverlapConfig(sequential=True)
    cases = {
        "matmul": lambda: a @ w.t(),
        name: lambda: comm.collective(ex, c, None),
        "torch": lambda: comm.collective(ex, a @ w.t(), None),  # matmul + torch.distributed's collective
        "linear": lambda: comm.collective(ex, torch.nn.functional.linear(a, w), None),  # the plain path's product
        "sequential": lambda: sequential(a, w, "nk", ex, None),
        "fallback": lambda: call(a, w, config=plain),  # decided once, then its runner
        "registry": lambda: call(a, w),
        "overlapped": lambda: call(a, w, config=config),
        "direct": lambda: call(a, w, config=config),  # FLASHOVERLAP_NCCL=direct
    }
    cases["python"] = cases["direct"]  # FLASHOVERLAP_REPLAY=0
    if dist.get_world_size() == 1:
        cfg = for_collective(OverlapConfig.from_dict(config), name)
        prep = prepare(m, n, k, a.dtype, "nk", a.device, cfg)
        ex = comm.exchange(name, m, 1, reduction=cfg.reduction)

        def one_rank() -> torch.Tensor:
            group = budget_communicator(cfg, name, dist.group.WORLD, a.device)
            return run_overlapped(prep, a, w, ex, group, tail_group=comm.tail_group(dist.group.WORLD, a.device))

        cases["overlapped"] = cases["direct"] = cases["python"] = one_rank
        print(f"one rank: {prep.plan.num_groups} groups, {cfg}", flush=True)

    def path(case: str) -> None:  # the environment of ``case`` (the NCCL path is read as a call is decided)
        nccl = "direct" if case in ("direct", "python") else "c10d"
        if os.environ.get("FLASHOVERLAP_NCCL") != nccl:
            os.environ["FLASHOVERLAP_NCCL"] = nccl
            state.forget_decisions()
        os.environ["FLASHOVERLAP_REPLAY"] = "0" if case == "python" else "1"

    turns = [case for case in cases if case not in ("direct", "python")]  # (one NCCL path: no re-deciding)
    path(turns[0])
    blocks: dict[str, list[float]] = {case: [] for case in turns}
    for _ in range(CALLS // BLOCK // len(turns) + 1):
        for order in balanced_orders(len(turns)):
            for v in order:
                blocks[turns[v]].append(per_call_us(cases[turns[v]], BLOCK))
    for case, fn in cases.items():
        path(case)
        us = statistics.median(blocks[case]) if case in blocks else per_call_us(fn)
        if rank == 0:
            print(f"{m}x{n}x{k} {case:>14}: {us:7.1f} us per call", flush=True)
    for case in ("fallback", "overlapped", "direct", "python"):
        path(case)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(CALLS):
            cases[case]()
        profile.disable()
        torch.cuda.synchronize()
        if rank == 0:
            print(f"--- {case}, {CALLS} calls")
            stats = pstats.Stats(profile)
            stats.sort_stats("tottime").print_stats(22)
            stats.sort_stats("cumulative").print_stats("flashoverlap", 25)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
