"""When does a wait on the GEMM's first group release: a stream wait or the one-thread spin kernel,
with every SM given to the GEMM (``comm_sms`` 0) or 16 left out? One GPU, no communication:
``python bench/wait_probe.py``; ms after the GEMM's start, a few rounds (the first includes the
wait mode's probe and the spin kernel's lazy module load)."""

from __future__ import annotations

import torch

from flashoverlap import OverlapConfig, signal
from flashoverlap.prepared import prepare
from flashoverlap.rules import for_collective


def main(m: int = 8192, n: int = 8192, k: int = 8192, rounds: int = 3) -> None:
    a = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    main_stream, waiter = torch.cuda.current_stream(), torch.cuda.Stream()
    for comm_sms in (0, 16):
        prep = prepare(m, n, k, a.dtype, "nk", a.device, for_collective(OverlapConfig(comm_sms=comm_sms), "all_reduce"))
        for r in range(rounds):
            for mode in ("stream", "spin"):
                prep.counters.zero_()
                torch.cuda.synchronize()
                start, gemm_done, released = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                start.record(main_stream)
                prep.launch(a, w, out, main_stream)
                gemm_done.record(main_stream)
                with torch.cuda.stream(waiter):  # timeout 0: the spin kernel without a time limit
                    signal.wait_geq(waiter, prep.counters, 0, prep.targets[0], 0.0 if mode == "spin" else None)
                    released.record(waiter)
                torch.cuda.synchronize()
                print(
                    f"comm_sms {comm_sms:2d}, {prep.plan.num_groups} groups, round {r}, {mode:6s}: group 0 released "
                    f"at {start.elapsed_time(released):.3f} ms, GEMM done at {start.elapsed_time(gemm_done):.3f} ms",
                    flush=True,
                )


if __name__ == "__main__":
    main()
