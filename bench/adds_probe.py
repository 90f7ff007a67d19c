"""Can a ``local`` all-reduce's adds run on the few SMs an SM budget leaves while the GEMM runs?
One GPU, under ``torchrun --nproc-per-node 1``: the signal GEMM with ``comm_sms`` SMs left out,
each group's partial sums (two ranks' worth, random) added on a side stream as soon as the GEMM
signals the group, beside the same GEMM alone and the GEMM followed by all the adds; optionally a
device-to-device copy of each group first (``copy``), standing in for the all-gather's memory
traffic. ms per call, same run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap import prepared, signal
from flashoverlap.config import OverlapConfig
from flashoverlap.rules import for_collective
from flashoverlap.timing import operand_sets, time_variants

SHAPES = [(4096, 8192, 8192), (8192, 8192, 8192), (8192, 4096, 14336)]
BUDGETS = (0, 2, 4, 8)


def shape_variants(m: int, n: int, k: int) -> dict:
    a, w = operand_sets(m, n, k, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    parts = torch.randn(2, m * n, device="cuda", generator=gen).to(torch.bfloat16)
    out, copied = (torch.empty(m * n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    adder, copier = torch.cuda.Stream(), torch.cuda.Stream()
    variants = {
        "cublas": lambda i: a[i % len(a)] @ w[i % len(w)].t(),
        "adds alone": lambda i: torch.add(parts[0], parts[1], out=out),
    }
    for comm_sms in BUDGETS:
        prep = prepared.prepare(
            m, n, k, torch.bfloat16, "nk", a[0].device, for_collective(OverlapConfig(comm_sms=comm_sms), "all_reduce")
        )
        buf = torch.empty(prep.plan.numel, dtype=torch.bfloat16, device="cuda")
        b = prep.plan.bounds

        def gemm(i, prep=prep, buf=buf):
            prep.launch(a[i % len(a)], w[i % len(w)], buf, torch.cuda.current_stream())
            prep.counters.zero_()

        def gemm_then_adds(i, gemm=gemm):
            gemm(i)
            torch.add(parts[0], parts[1], out=out)

        def gemm_with_adds(i, prep=prep, buf=buf, b=b, copy=False):
            caller = torch.cuda.current_stream()
            for side in (adder, copier):
                side.wait_stream(caller)
                caller.wait_stream(side)
            prep.launch(a[i % len(a)], w[i % len(w)], buf, caller)
            for g, target in enumerate(prep.targets):
                lo, hi = b[g], b[g + 1]
                waiter = copier if copy else adder
                signal.wait_geq(waiter, prep.counters, g, target, None, prep.report)
                if copy:
                    with torch.cuda.stream(copier):
                        copied[lo:hi].copy_(buf[lo:hi])
                    adder.wait_stream(copier)
                with torch.cuda.stream(adder):
                    torch.add(parts[0, lo:hi], parts[1, lo:hi], out=out[lo:hi])
            with torch.cuda.stream(adder):
                prep.counters.zero_()
            for side in (adder, copier):
                caller.wait_stream(side)

        out.fill_(float("nan"))
        gemm_with_adds(0)
        torch.cuda.synchronize()
        if not torch.equal(out, parts[0] + parts[1]):
            raise AssertionError(f"{m}x{n}x{k} comm_sms {comm_sms}: the overlapped adds are wrong")
        variants[f"gemm, {comm_sms} SMs left"] = gemm
        variants[f"gemm then adds, {comm_sms}"] = gemm_then_adds
        variants[f"gemm beside adds, {comm_sms}"] = gemm_with_adds
        variants[f"gemm beside copy+adds, {comm_sms}"] = lambda i, f=gemm_with_adds: f(i, copy=True)
    return variants


def main() -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    print(torch.cuda.get_device_name(), "bfloat16, ms per call, median of 15 rounds of 6 calls", flush=True)
    for m, n, k in SHAPES:
        times = time_variants(shape_variants(m, n, k), rounds=15, block=6, warmup=2)
        for name, t in times.items():
            print(f"{m}x{n}x{k} {name:32s} {t:.3f} ms  {t / times['cublas']:.3f} of cublas", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
