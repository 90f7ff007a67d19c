"""Randomised stress run on GPUs (not collected by pytest; run it under torchrun):

    torchrun --nproc-per-node 2 tests/stress_overlap.py --calls 10000
    torchrun --nproc-per-node 2 tests/stress_overlap.py --shared-gpu --calls 1000   # one GPU, gloo

Random shapes (from a pool of random shapes, so that plans are reused as in a model), random
collectives (all-reduce, reduce-scatter, all-to-all with uneven splits, and over ranks of different
M with the counts exchanged or every rank's M given), configs varying with the shape (among prebuilt kernel instances,
symmetric windows and local reductions among them; GPU memory outside the cached plans must be flat
once every pair has run) and two process groups, back to back with the host running ahead.
FLASHOVERLAP_NCCL=c10d: the per-group collectives through c10d (default: NCCL's C API).
``--shared-gpu``: every rank on GPU 0 over gloo (which carries CUDA tensors through host memory,
not point to point: the ``rows`` layout of reduce-scatter / all-to-all is left out).
Every ``--check-every`` calls the last few outputs -- returned earlier, still held -- are compared
with matmul + the torch collective (a later call must not have overwritten them). Exits non-zero
on any error; prints calls, shapes, the largest error and GPU memory after warm-up and at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap import OverlapConfig, comm, state
from flashoverlap.runtime import sequential

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import runs_on_this_gpu  # noqa: E402  (tests/helpers.py; this file runs as a script)

CONFIGS = {
    "all_reduce": [
        {},
        {"epilogue": "direct"},
        {"layout": "tiles"},
        {"tile_n": 128},
        {"cluster_m": 2},
        {"kernel": "sm80"},
        {"swizzle": 4},
        {"symmetric": True},
        {"reduction": "local", "symmetric": True, "comm_sms": 0},
        {"reduction": "pull", "comm_sms": 4},  # copies out of the other ranks' memory (not on a shared GPU)
        {"reduction": "pull_scatter", "comm_sms": 4},  # ... each rank's share summed, the sums copied
    ],
    "reduce_scatter": [
        {},
        {"tile_n": 128},
        {"scheduler": "streamk", "comm_sms": 12},
        {"kernel": "sm80", "tile_n": 128},
        {"swizzle": 2},
        {"layout": "rows"},
        {"layout": "segments"},
        {"symmetric": True},
        {"layout": "segments", "reduction": "pull", "comm_sms": 4},
        {"layout": "segments", "reduction": "pull", "comm_sms": 0},  # summed after the GEMM
        {"layout": "rows", "reduction": "pull_fused", "comm_sms": 0},  # summed in the epilogue (whole tiles)
    ],
    "all_to_all": [
        {},
        {"tile_n": 128},
        {"scheduler": "streamk", "comm_sms": 12},
        {"kernel": "sm80", "tile_n": 128},
        {"swizzle": 2},
        {"layout": "rows"},  # equal splits
        {"layout": "segments"},  # equal splits
        {"symmetric": True},  # equal splits, copy engines
        {"layout": "segments", "reduction": "pull", "comm_sms": 4},  # equal splits
    ],
}
KEEP = 3  # outputs held and re-checked at every check


def settled_allocated(groups: list) -> int:
    """GPU bytes held by live tensors once all work is done, but for the cached plans' tables (a
    plan made late in the run is no leak: the cache is bounded). Each NCCL process group may keep
    its last collective's tensors (torch's work tracking), so a one-element all-reduce on every
    group (the overlap's own communicators too) replaces them first; blocks freed while another
    stream used them (record_stream) return at the allocator's next malloc, which the flush makes."""
    private = [c for group in groups for c in state.of(group).communicators.values()]
    for group in [*groups, *private]:
        dist.all_reduce(torch.zeros(1, device="cuda"), group=group)
    torch.cuda.synchronize()
    time.sleep(1)
    torch.empty(1, device="cuda")
    plans = sum(  # as the allocator counts them: in blocks of 512 bytes
        -(-t.numel() * t.element_size() // 512) * 512
        for p in state.plans.values()
        for t in (p.slots, p.counters, p.workspace, p.report)
        if t is not None
    )
    print(
        f"[rank {dist.get_rank()}] allocated {torch.cuda.memory_allocated()} B, {len(state.plans)} plans "
        f"{plans} B; {len(private)} budget communicators",
        flush=True,
    )
    return torch.cuda.memory_allocated() - plans


def point_to_point(collective: str, cfg: dict) -> bool:
    """Whether ``cfg`` moves data point to point (gloo cannot for CUDA tensors) or between mapped GPU
    memories (not between ranks of one GPU): ``rows`` reduce-scatter / all-to-all, pulls."""
    return collective != "all_reduce" and cfg.get("layout") == "rows" or cfg.get("reduction") in comm.PULLS


def random_shape(rng: np.random.Generator, world: int) -> tuple[int, int, int]:
    # half of them in segments of whole 256-row bands and whole 256-column tiles, which the rows and
    # segments layouts of reduce-scatter / all-to-all need (and pull_fused's epilogue); the others
    # run them as the defaults
    if rng.random() < 0.5:
        return world * 256 * int(rng.integers(1, 6)), 256 * int(rng.integers(1, 16)), 8 * int(rng.integers(1, 256))
    return world * int(rng.integers(1, 3072 // world)), 8 * int(rng.integers(1, 512)), 8 * int(rng.integers(1, 256))


def check(item: tuple, world: int) -> float | None:
    """Relative error of a held output against matmul + the torch collective (None: wrong shape/NaN)."""
    out, a, w, collective, group, kwargs, _ = item
    ex = comm.exchange(collective, a.shape[0], world, kwargs.get("splits"), kwargs.get("output_splits"))
    want = sequential(a, w, "nk", ex, group).float()
    if out.shape != want.shape or torch.isnan(out).any():
        return None
    return ((out.float() - want).norm() / want.norm().clamp_min(1e-30)).item() if want.numel() else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--check-every", type=int, default=50)
    parser.add_argument("--shapes", type=int, default=16, help="size of the random shape pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared-gpu", action="store_true", help="every rank on GPU 0, over gloo")
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    if args.shared_gpu:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    world = dist.get_world_size()
    groups = [None, dist.new_group(list(range(world)))]
    # the configs this GPU has kernels for (the Hopper ones need sm_90), and gloo can carry
    configs = {
        c: [
            cfg
            for cfg in cfgs
            if runs_on_this_gpu(OverlapConfig(**cfg), c) and not (args.shared_gpu and point_to_point(c, cfg))
        ]
        for c, cfgs in CONFIGS.items()
    }
    rng = np.random.default_rng(args.seed)  # same stream on every rank: same calls everywhere
    pool = [random_shape(rng, world) for _ in range(args.shapes)]
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    operands = {}
    for m, n, k in pool:
        if (m, n, k) not in operands:
            a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
            operands[(m, n, k)] = a, w

    held: list[tuple] = []
    worst = 0.0
    mem_warm = None
    warm_calls = min(args.calls // 5, 2000)  # by then every (shape, collective) pair has run
    start = time.monotonic()
    for call in range(args.calls):
        index = int(rng.integers(len(pool)))
        m, n, k = pool[index]
        collective = ["all_reduce", "reduce_scatter", "all_to_all"][int(rng.integers(3))]
        config = configs[collective][index % len(configs[collective])]
        group = groups[int(rng.integers(2))]
        kwargs = {}
        if (
            config.get("layout") in ("rows", "segments")
            and m % (world * 256)
            or n % 256
            and "pull_fused" in config.values()
        ):
            config = {}
        if (
            collective == "all_to_all"
            and config.get("layout") not in ("rows", "segments")
            and not config.get("symmetric")
        ):
            # every rank draws every rank's splits, so output_splits are known without exchange; or
            # (ragged) rank r has M / 2^r rows (MoE experts; none where that rounds to 0) and the
            # counts are exchanged, or (half of those) given with every rank's M
            ragged = rng.random() < 0.5
            rows = np.array([m >> r if ragged else m for r in range(world)])
            cuts = np.sort((rng.random(size=(world, world - 1)) * (rows[:, None] + 1)).astype(int), axis=1)
            splits = np.diff(np.concatenate([np.zeros((world, 1), int), cuts, rows[:, None]], axis=1), axis=1)
            kwargs = {"splits": splits[rank].tolist()}
            if not ragged or rng.random() < 0.5:  # (the same draws on every rank)
                kwargs["output_splits"] = splits[:, rank].tolist()
                if ragged:
                    kwargs["rows_per_rank"] = rows.tolist()
        a, w = operands[(m, n, k)]
        a = a[: sum(kwargs["splits"])] if "splits" in kwargs else a  # a ragged rank's rows
        out = getattr(flashoverlap, f"gemm_{collective}")(a, w, group=group, config=config, **kwargs)
        held = [*held, (out, a, w, collective, group, kwargs, config)][-KEEP:]
        del out  # only `held` keeps outputs alive (memory is measured with it empty)
        if (call + 1) % args.check_every == 0 or call + 1 == args.calls:
            errors = [check(item, world) for item in held]
            if any(err is None or err > 1e-2 for err in errors):
                print(f"[rank {rank}] call {call}: {[(i[3], i[6], tuple(i[1].shape)) for i in held]}: rel err {errors}")
                return 1
            worst = max(worst, *errors)
        if call + 1 == warm_calls:
            held.clear()
            mem_warm = settled_allocated(groups)
    held.clear()
    mem_end = settled_allocated(groups)
    elapsed = time.monotonic() - start
    if rank == 0:
        print(
            f"stress: {args.calls} calls ({world} ranks, {len(set(pool))} shapes, 3 collectives, 2 groups) in "
            f"{elapsed:.1f} s; max rel err {worst:.2e}; GPU memory allocated outside the plans after "
            f"{warm_calls} calls {mem_warm} B, at the end {mem_end} B; {len(state.plans)} plans cached",
            flush=True,
        )
    dist.destroy_process_group()
    grew = mem_warm is not None and mem_end > mem_warm
    if grew:
        print(f"[rank {rank}] GPU memory grew from {mem_warm} to {mem_end} bytes", flush=True)
    return 1 if grew else 0


if __name__ == "__main__":
    sys.exit(main())
