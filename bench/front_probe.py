"""The Python front of a repeat call, step by step, on this host's CPU (no GPU).

A call decided before runs its kept runner after a few checks and one lookup (overlap._gemm_collective):
on a host-bound call (decode, small prefill: 60-90 us of host time per GEMM + collective) those
microseconds are the part before its runner of what a call decided plain costs over the product and
the collective alone. Timed here with CPU tensors on a one-process gloo group, the runner a no-op, so
that only the front is left:

    python bench/front_probe.py [--calls 300000]

Prints one line per step, "<step>  <us> us" (each timed alone, the best of three repeats), and for
the whole front, with the call's config none (the registry's path) and an :class:`OverlapConfig`
(the forced fallback's).
"""

from __future__ import annotations

import argparse
import timeit

import torch
import torch.distributed as dist

from flashoverlap import overlap, state
from flashoverlap.config import OverlapConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300_000, help="calls per timed repeat")
    args = parser.parse_args()
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # (no port to take)
    a = torch.randn(8, 64, dtype=torch.bfloat16)
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    fallback = OverlapConfig(sequential=True)
    kept = state.of(None)
    for config in (None, fallback):  # a decided call's runner, a no-op
        kept.runners.keep(overlap._call_key(a, w, "all_reduce", config, "nk", None), (lambda *_: None, None))
    key = overlap._call_key(a, w, "all_reduce", None, "nk", None)
    steps = {
        "the call's key": lambda: overlap._call_key(a, w, "all_reduce", None, "nk", None),
        "its key with a config": lambda: overlap._call_key(a, w, "all_reduce", fallback, "nk", None),
        "the group's state": lambda: state.kept(None),
        "the runner's lookup": lambda: kept.runners.get(key),
        "the gradient check": lambda: overlap._wants_gradients(a, w),
        "the compile check": lambda: torch.compiler.is_compiling(),
        "nothing (a lambda)": lambda: None,
        "front, registry": lambda: overlap.gemm_all_reduce(a, w),
        "front, a config": lambda: overlap.gemm_all_reduce(a, w, config=fallback),
    }
    for name, fn in steps.items():
        us = min(timeit.repeat(fn, number=args.calls, repeat=3)) / args.calls * 1e6
        print(f"{name:24s} {us:6.3f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
