"""Do batched copies (``cudaMemcpyBatchAsync``) move peer memory faster than one copy at a time?

NCCL's copy-engine collectives issue their copies as one batch; if the driver spread a batch over
several copy engines, a pull's copies could beat the ~160 GB/s per GPU that one-at-a-time copies
keep beside a GEMM (docs/experiments.md, "Pulls over peer memory"). Each rank moves three shares
of ``SHARE`` MiB, every rank at once, in ring order (rank r with r+1, r+2, ...):

  pull_seq          the other ranks' shares copied out of their memory, one cudaMemcpyAsync each,
                    on one stream (what a pull does)
  pull_batch        the same three copies as one cudaMemcpyBatchAsync, the flag that prefers
                    overlap with compute; ``_f0`` without it
  pull_batch_split  each share in 8 pieces, 24 copies in one batch
  pull_3s           a stream per share
  push_*            the same moved the other way: each rank writes its shares into the others' memory

alone and beside a 8192^3 bf16 ``torch.matmul`` on every SM started with them; each variant twice,
in balanced order, 15 barrier-aligned rounds each. Printed: the slowest and fastest rank's median
(ms to the copies' end from the start) and GB/s per rank of the slowest.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 4 \\
        bench/batch_copy_probe.py [SHARE_MIB ...]
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

KINDS = ("pull_seq", "pull_batch", "pull_batch_f0", "pull_batch_split", "pull_3s",
         "push_seq", "push_batch", "push_batch_split", "push_3s")  # fmt: skip
SPLIT = 8  # pieces per share of the ``_split`` variants
DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # cudaMemcpyAttributes (CUDA 12.8+)
    _fields_ = [("src_access_order", ctypes.c_int), ("src", _Location), ("dst", _Location), ("flags", ctypes.c_uint)]


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (CUDA 13: ``cudaMemcpyBatchAsync`` without 12.8's failure index)."""
    if int(torch.version.cuda.split(".")[0]) < 13:
        raise RuntimeError(f"this probe calls CUDA 13's cudaMemcpyBatchAsync; torch has CUDA {torch.version.cuda}")
    rt = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    rt.cudaMemcpyBatchAsync.argtypes = [ctypes.c_void_p] * 3 + [
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
    ]
    rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return rt


class Probe:
    def __init__(self, top: int) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.rt = _cudart()
        self.mem = symm_mem.empty(top * self.world, dtype=torch.uint8, device="cuda")
        self.mem.random_(0, 255)
        self.handle = symm_mem.rendezvous(self.mem, dist.group.WORLD.group_name)  # (keeps the mappings)
        self.peers = {r: self.handle.get_buffer(r, (top * self.world,), torch.uint8) for r in range(self.world)}
        self.local = torch.empty(top * self.world, dtype=torch.uint8, device="cuda")
        self.others = [(self.rank + j) % self.world for j in range(1, self.world)]
        self.lanes = [torch.cuda.Stream() for _ in self.others]

    def pieces(self, share: int, split: int, push: bool) -> list[tuple[int, int, int]]:
        """(dst, src, bytes) of the three shares, each in ``split`` pieces, ring order."""
        out = []
        for r in self.others:
            for p in range(split):
                size = share // split
                mine = self.local.data_ptr() + r * share + p * size
                theirs = self.peers[r].data_ptr() + self.rank * share + p * size
                out.append((theirs, mine, size) if push else (mine, theirs, size))
        return out

    def _copy(self, dst: int, src: int, size: int, stream: torch.cuda.Stream) -> None:
        status = self.rt.cudaMemcpyAsync(dst, src, size, DEVICE_TO_DEVICE, ctypes.c_void_p(stream.cuda_stream))
        if status:
            raise RuntimeError(f"cudaMemcpyAsync: error {status}")

    def issue(self, kind: str, share: int, stream: torch.cuda.Stream) -> None:
        push = kind.startswith("push")
        copies = self.pieces(share, SPLIT if kind.endswith("_split") else 1, push)
        if kind.endswith("_seq"):
            for dst, src, size in copies:
                self._copy(dst, src, size, stream)
        elif kind.endswith("_3s"):  # every lane after the stream's work, then the stream after every lane
            for lane in self.lanes:
                lane.wait_stream(stream)
            for lane, (dst, src, size) in zip(self.lanes, copies):
                self._copy(dst, src, size, lane)
            for lane in self.lanes:
                stream.wait_stream(lane)
        else:
            n = len(copies)
            attrs = _Attributes(1, _Location(0, 0), _Location(0, 0), 0 if kind.endswith("_f0") else 1)
            status = self.rt.cudaMemcpyBatchAsync(
                (ctypes.c_void_p * n)(*(c[0] for c in copies)),
                (ctypes.c_void_p * n)(*(c[1] for c in copies)),
                (ctypes.c_size_t * n)(*(c[2] for c in copies)),
                n,
                ctypes.byref(attrs),
                (ctypes.c_size_t * 1)(0),
                1,
                ctypes.c_void_p(stream.cuda_stream),
            )
            if status:
                raise RuntimeError(f"cudaMemcpyBatchAsync: error {status}")


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    shares = [int(x) << 20 for x in (sys.argv[1:] or ["16", "4"])]
    probe = Probe(max(shares))
    main_stream, copies = torch.cuda.current_stream(), torch.cuda.Stream()
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cases, times = [], []
    for share in shares:
        for beside in (False, True):
            for kind in KINDS + KINDS[::-1]:
                samples = []
                for r in range(18):
                    dist.barrier(device_ids=[rank])
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(main_stream)
                    if beside:
                        torch.matmul(a, b)
                    copies.wait_event(start)
                    probe.issue(kind, share, copies)
                    end.record(copies)
                    torch.cuda.synchronize()
                    if r >= 3:
                        samples.append(start.elapsed_time(end))
                cases.append((share, beside, kind))
                times.append(statistics.median(samples))
    every = [torch.empty(len(times), device="cuda", dtype=torch.float64) for _ in range(probe.world)]
    dist.all_gather(every, torch.tensor(times, device="cuda", dtype=torch.float64))
    if rank == 0:
        runs: dict = {}
        for i, case in enumerate(cases):
            runs.setdefault(case, []).append([e[i].item() for e in every])
        print("share MiB | beside a GEMM | variant | ms slowest / fastest rank | GB/s per rank (slowest)")
        for (share, beside, kind), both in runs.items():
            slow, fast = statistics.mean(max(t) for t in both), statistics.mean(min(t) for t in both)
            rate = (probe.world - 1) * share / slow / 1e6
            print(f"{share >> 20} | {'yes' if beside else 'no'} | {kind} | {slow:.3f} / {fast:.3f} | {rate:.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
