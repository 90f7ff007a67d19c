"""How fast NCCL moves a GEMM's output on a few SMs while the GEMM holds the rest, per kernel kind.

The question behind the SM budget: NCCL's ring kernels on 4-16 CTAs cannot carry 64 MB within a
4096x8192x8192 GEMM, and every SM they need costs the GEMM part of a wave. NCCL 2.27+ has
symmetric-memory kernels (buffers in a window registered with NCCL_WIN_COLL_SYMMETRIC; all-reduce
and reduce-scatter by NVLink loads/stores, no ring) and, with CTA policy ZERO, copy-engine
all-to-all (no SM at all). For each collective this times, side by side in one run:
  gemm{C}        the signal GEMM alone on the SMs a budget of C leaves
  {mode}{C}      the output's collective alone, in 8 chunks, on a communicator capped at C CTAs
  both_{mode}{C} both at once (the chunks issued on a second stream as the GEMM starts)
mode: ring (plain buffers), symm (buffers registered as a symmetric window), ce (symmetric window,
CTA policy ZERO: all-to-all / all-gather on the copy engines, the GEMM on every SM), ce_direct (the
same through NCCL's C API: ncclAlltoAll, which c10d may not call for all_to_all_single). All-gather is
there because on two ranks it moves as many bytes as an all-reduce (each rank receives the other's
whole partial sum), so an all-reduce could be an all-gather on the copy engines plus one add.
For all-gather also pull / push (no NCCL): each chunk copied with cudaMemcpyAsync from the other
ranks' send buffers / into their receive buffers (torch symmetric memory maps them), so the copy
engines' own pace beside the GEMM shows apart from NCCL's copy-engine path (stop 22: ~20 % of its
bandwidth while the GEMM runs); pull2d: pulls as cudaMemcpy2DAsync of 4 KB rows 8 KB apart (half
the bytes). The ranks do not synchronise there: what arrives is not checked.

    torchrun --nproc-per-node 2 bench/symmetric_probe.py [--shape 4096x8192x8192] [--budgets 4 8 16]
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING shows which kernel NCCL picked ("[Symmetric]: ... Kernel").
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.distributed as dist

from flashoverlap import comm, jit
from flashoverlap.bench import parse_shape
from flashoverlap.config import OverlapConfig
from flashoverlap.prepared import prepare
from flashoverlap.rules import for_collective
from flashoverlap.timing import kernel_alone, time_variants

CHUNKS = 8


def buffers(numel: int, dtype: torch.dtype, group, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Send (random) and receive buffers, in a symmetric window of ``group`` or plain."""
    world = dist.get_world_size(group)

    alloc = lambda shape: torch.empty(shape, dtype=dtype, device="cuda")  # noqa: E731
    if symmetric:
        window = comm.nccl.Window([group], torch.device("cuda", torch.cuda.current_device()))
        nbytes = comm.nccl.carved_bytes((numel,), dtype) + comm.nccl.carved_bytes((numel * world,), dtype)
        alloc = window.allocator(nbytes, dtype)
    send, recv = alloc((numel,)), alloc((numel * world,))
    send.copy_(torch.randn(numel, device="cuda"))
    return send, recv


class Peers:
    """Every rank's send and receive buffers (torch symmetric memory), for plain copies between them."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        world, name = dist.get_world_size(), dist.group.WORLD.group_name
        self.send = symm_mem.empty(numel, dtype=dtype, device="cuda").copy_(torch.randn(numel, device="cuda"))
        self.recv = symm_mem.empty(numel * world, dtype=dtype, device="cuda")
        send, recv = symm_mem.rendezvous(self.send, name), symm_mem.rendezvous(self.recv, name)
        self.sends = [send.get_buffer(r, (numel,), dtype) for r in range(world)]
        self.recvs = [recv.get_buffer(r, (numel * world,), dtype) for r in range(world)]

    def all_gather(self, mode: str) -> None:
        """Each chunk, rank by rank: pulled from the other ranks' send buffers into this rank's
        receive buffer, or pushed from this one's into theirs (``mode``: pull, push, pull2d)."""
        me, world = dist.get_rank(), dist.get_world_size()
        chunk = self.send.numel() // CHUNKS
        stream = torch.cuda.current_stream().cuda_stream
        for c in range(CHUNKS):
            for r in range(world):
                if r == me:
                    continue
                src, dst, at = (self.send, self.recvs[r], me) if mode == "push" else (self.sends[r], self.recv, r)
                into = dst.view(world, -1)[at][c * chunk : (c + 1) * chunk]
                part = src[c * chunk : (c + 1) * chunk]
                if mode == "pull2d":  # 4 KB of every 8 KB: a strided copy
                    rows = into.numel() * into.element_size() // 8192
                    jit.runtime_library().fo_copy_2d(into.data_ptr(), 8192, part.data_ptr(), 8192, 4096, rows, stream)
                else:
                    into.copy_(part)


def chunked(collective: str, send: torch.Tensor, recv: torch.Tensor, group) -> None:
    """``collective`` on each of CHUNKS chunks of ``send`` (an all-gather into ``recv``), through
    c10d or NCCL's C API (``group`` a comm.Direct), as an overlapped call issues its groups."""
    world = dist.get_world_size(comm.process_group(group))
    ex = comm.exchange(collective, world, world) if collective != "all_gather" else None
    for s, r in zip(send.chunk(CHUNKS), recv.chunk(CHUNKS)):
        if ex is not None:  # the chunk as `world` rows: one per rank
            comm.collective(ex, s.view(world, -1), group, r[: ex.rows * s.numel() // world].view(ex.rows, -1))
        elif isinstance(group, comm.Direct):
            group.all_gather(r, s)
        else:
            dist.all_gather_into_tensor(r, s, group=group)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=parse_shape, default=(4096, 8192, 8192))
    parser.add_argument(
        "--collectives", nargs="+", default=["all_reduce", "reduce_scatter", "all_to_all", "all_gather"]
    )
    parser.add_argument("--budgets", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=10)
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    m, n, k = args.shape
    dtype = torch.bfloat16
    a = [torch.randn(m, k, device="cuda").to(dtype) for _ in range(2)]
    w = [torch.randn(n, k, device="cuda").to(dtype) for _ in range(2)]
    side = torch.cuda.Stream()
    gemms = {"cublas": lambda i: a[i % 2] @ w[i % 2].t()}
    for budget in [0, *args.budgets]:
        cfg = for_collective(OverlapConfig(comm_sms=budget), "all_reduce")
        gemms[f"gemm{budget}"] = kernel_alone(prepare(m, n, k, dtype, "nk", a[0].device, cfg), a, w)
    if dist.get_rank() == 0:
        print(
            f"{torch.cuda.get_device_name()} x{dist.get_world_size()}, {m}x{n}x{k} bf16, "
            f"{2 * m * n / 2**20:.0f} MiB in {CHUNKS} chunks, ms per call (median, max over ranks)",
            flush=True,
        )
    # one timed run per collective, the GEMMs in each, printed as it ends: a collective NCCL fails
    # on (its copy-engine all-to-all did, stop 20) leaves the ones before it
    for collective in args.collectives:
        variants = dict(gemms)
        runs = [(mode, c) for c in args.budgets for mode in ("ring", "symm")]
        if collective in ("all_to_all", "all_gather"):
            runs += [("ce", 0), ("ce_direct", 0)]
        if collective == "all_gather":
            runs += [("pull", 0), ("push", 0), ("pull2d", 0)]
        for mode, ctas in runs:
            gemm = gemms[f"gemm{ctas}"]
            if mode in ("pull", "push", "pull2d"):
                peers = Peers(m * n, dtype)

                def copies(i, with_gemm, peers=peers, mode=mode, gemm=gemm):
                    caller = torch.cuda.current_stream()
                    side.wait_stream(caller)
                    if with_gemm:
                        gemm(i)
                    with torch.cuda.stream(side):
                        peers.all_gather(mode)
                    caller.wait_stream(side)

                variants[f"{collective}:{mode}"] = functools.partial(copies, with_gemm=False)
                variants[f"{collective}:both_{mode}"] = functools.partial(copies, with_gemm=True)
                continue
            group = comm.budget_group(dist.group.WORLD, ctas, copy_engine=mode.startswith("ce"))
            send, recv = buffers(m * n, dtype, group, mode != "ring")
            if mode.endswith("direct"):
                group = comm.Direct(group, torch.device("cuda", local))

            # the chunks always on the side stream, as in an overlapped call: NCCL's copy-engine
            # collectives (cudaMemcpyBatchAsync) reject torch's default stream, the legacy one
            # (what crashed this probe's ce_direct runs in stop 20)
            def run(i, with_gemm, send=send, recv=recv, group=group, collective=collective, gemm=gemm):
                caller = torch.cuda.current_stream()
                side.wait_stream(caller)
                if with_gemm:
                    gemm(i)
                with torch.cuda.stream(side):
                    chunked(collective, send, recv, group)
                caller.wait_stream(side)

            variants[f"{collective}:{mode}{ctas}"] = functools.partial(run, with_gemm=False)
            variants[f"{collective}:both_{mode}{ctas}"] = functools.partial(run, with_gemm=True)
        times = time_variants(variants, args.rounds, args.block, warmup=3)
        if dist.get_rank() == 0:
            for name, t in times.items():
                print(f"{name:32s} {t:8.3f}  {times['cublas'] / t:5.2f}x of cublas", flush=True)
    comm.agree(None, "done", torch.device("cuda", local))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
