"""Reduce-scatter by SM loads out of the other GPUs' memory, against copy-engine pulls and NCCL.

Can a reduce-scatter's sum read the other ranks' shares straight out of their memory (SM loads over
NVLink: one kernel, every link at once, no copy engine) instead of copying them in first? (On many
SMs it can: ``pull_scatter`` sums so. A reduce-scatter by pulls copies first and sums the copies
locally on the few SMs a GEMM spares, which measured faster there: docs/experiments.md, "Pulls over
peer memory".) For each buffer size S (bf16 per rank: a group's size, 16 MiB = a 4096x8192 output
in 4 groups), rank r's share is elements [r S/w, (r+1) S/w) of every rank's buffer (torch symmetric
memory, mapped as comm/peer.py maps it). Variants, timed on every rank:

  ce+sum      w-1 cudaMemcpyAsync copies of the other ranks' share-r slices into local staging on
              one stream (as pull_scatter did), then one fo_sum (csrc/runtime.cu) of the w slices
  peer-sum    one fo_sum whose inputs are the local slice and the w-1 peer pointers (no staging);
              fo_sum as it is (a thread loads one 16-byte vector per input in turn): torch-rs shows
              what a kernel made for remote loads gets
  nccl-rs     NCCL reduce-scatter of the same buffer (beside the GEMM: a communicator capped at
              comm_sms CTAs, comm.budget_group)
  torch-rs    torch's own SM-load reduce-scatter (torch.ops.symm_mem.reduce_scatter_out), where
              torch has it: a tuned kernel on the same kind of memory (it barriers the ranks itself)
  gather:ce   the all-gather half: the w-1 owners' shares copied out of their memory (copy engine)
  gather:ring the same in ring order: rank r pulls from r+1, r+2, ... (each step a permutation: every
              rank read by one other at a time), where gather:ce's rank order has every rank pull
              from rank 0 (or 1) first
  gather:lanes the same, each owner's copy on a stream of its own (do the copies overlap?)
  gather:push the same moved the other way: each owner copies its share into the w-1 other ranks'
              memory, a stream per destination (do pushes spread over more copy engines than pulls?)
  gather:sm   the same by SM loads: fo_sum with one input per owner (alone only)
  sum:local   the copied reduce-scatter's sum alone: fo_sum of the w slices in local memory (its
              rate beside the GEMM per SM is tune_predict's add_bytes_per_ms_per_sm)
  nccl-ag     NCCL all-gather of each rank's share into the whole buffer (an all-reduce's second half)
  nccl-ar     NCCL all-reduce of the whole buffer, in place in a copy of it (what an all-reduce in a
              window does per group)
  split       the two halves of an all-reduce on different engines at once: the reduce-scatter's
              copies (gather:ring's, into staging) on the copy engines while nccl-ag moves the other
              half on the SMs the GEMM leaves (do the copies and NCCL's transfers slow each other?)

each alone on an idle GPU and (all but gather:sm) beside the signal GEMM (--shape, bf16, on every
SM but comm_sms), started with it on another stream. Every round is barrier-aligned over the ranks;
medians over rounds, the slowest rank's median. Printed: ms (beside: when the op ends, from the
GEMM's start, and the GEMM's own time against its time alone) and GB/s ((w-1)/w S per rank, whatever
the variant moves: nccl-ar and split move twice that).
Each variant is checked once before timing (relative error against a float32 sum).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 4 bench/peer_sum_probe.py \\
        [--sizes-mb 16 64] [--budgets 4 8 16] [--rounds 30]
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.distributed as dist

from flashoverlap import comm, jit, signal
from flashoverlap.bench import parse_shape
from flashoverlap.comm.moves import ADD_DTYPES, MAX_SUM
from flashoverlap.config import OverlapConfig
from flashoverlap.prepared import prepare
from flashoverlap.rules import for_collective
from flashoverlap.timing import operand_sets

DTYPE = torch.bfloat16


def fo_sum(out: torch.Tensor, rows: list[torch.Tensor]) -> None:
    """``out`` = the float32 sum of ``rows``, rounded once: one csrc/runtime.cu fo_sum on the current
    stream, called as comm/moves.add_rows calls it (with one row: a copy by SM loads)."""
    lib = jit.runtime_library()
    inputs = [t.data_ptr() for t in rows] + [None] * (MAX_SUM - len(rows))
    stream = torch.cuda.current_stream().cuda_stream
    status = lib.fo_sum(out.data_ptr(), None, *inputs, len(rows), out.numel(), ADD_DTYPES[out.dtype], stream)
    jit.check(lib, status, "fo_runtime_error")


def rank_data(q: int, numel: int) -> torch.Tensor:
    """Rank ``q``'s buffer: any rank can make it, for the reference."""
    return torch.randn(numel, device="cuda", generator=torch.Generator(device="cuda").manual_seed(100 + q)).to(DTYPE)


def symmetric(numel: int) -> tuple[torch.Tensor, object, list[torch.Tensor]]:
    """A buffer every rank maps, its handle (keep it: the mappings live while it does) and every rank's
    buffer as mapped here, as comm/peer.py Peers._grow makes them."""
    import torch.distributed._symmetric_memory as symm_mem

    mine = symm_mem.empty(numel, dtype=DTYPE, device="cuda")
    handle = symm_mem.rendezvous(mine, dist.group.WORLD.group_name)
    return mine, handle, [handle.get_buffer(r, (numel,), DTYPE) for r in range(dist.get_world_size())]


def measure(cases: dict, rounds: int, warmup: int, side: torch.cuda.Stream) -> dict[str, tuple[float, float]]:
    """name -> (ms from the start to the op's end, to the GEMM's end) of ``cases`` (name -> (op or None,
    gemm or None)): the slowest rank's median over ``rounds``, each barrier-aligned over the ranks, the
    cases in turns (rotated every round) after ``warmup`` rounds."""
    main, names = torch.cuda.current_stream(), list(cases)
    samples: dict[str, list] = {name: [] for name in names}
    for r in range(warmup + rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            op, gemm = cases[name]
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            start, gemm_end, op_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record(main)
            side.wait_event(start)
            if gemm is not None:
                gemm(r, main)
            gemm_end.record(main)
            if op is not None:
                with torch.cuda.stream(side):
                    op()
            op_end.record(side)
            main.wait_stream(side)
            if r >= warmup:
                samples[name].append((start, op_end, gemm_end))
    torch.cuda.synchronize()
    times = torch.tensor(
        [[[s.elapsed_time(o), s.elapsed_time(g)] for s, o, g in samples[name]] for name in names],
        dtype=torch.float64,
        device="cuda",
    )
    every = torch.empty((dist.get_world_size(), *times.shape), dtype=times.dtype, device="cuda")
    dist.all_gather_into_tensor(every, times)
    slowest = every.quantile(0.5, dim=2).amax(dim=0)  # [names, 2]
    return {name: tuple(slowest[v].tolist()) for v, name in enumerate(names)}


def on_lanes(lanes: list[torch.cuda.Stream], copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each (source, destination) copy on a lane of its own, all after and before the current stream's work."""
    current = torch.cuda.current_stream()
    for lane, (src, dst) in zip(lanes, copies):
        lane.wait_stream(current)
        with torch.cuda.stream(lane):
            dst.copy_(src)
    for lane in lanes[: len(copies)]:
        current.wait_stream(lane)


def check(name: str, op, outs: list[torch.Tensor], want: torch.Tensor, tol: float) -> None:
    """Run ``op`` once (``outs`` NaN before, on every rank before any runs it: other ranks may write
    them); raise on every rank where some rank's ``outs`` (concatenated) are off ``want`` by more than
    ``tol`` (relative, in norm)."""
    for out in outs:
        out.fill_(float("nan"))
    torch.cuda.synchronize()
    dist.barrier()
    op()
    torch.cuda.synchronize()
    dist.barrier()
    got = torch.cat([out.float() for out in outs])
    err = ((got - want).norm() / want.norm()).nan_to_num(float("inf")).reshape(1)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"  checked {name:12s} relative error {err.item():.2e}", flush=True)
    if not err.item() <= tol:
        raise AssertionError(f"{name}: relative error {err.item():.3g} over {tol}")


def size_cases(numel: int, gemms: dict, groups: dict, only: tuple[str, ...]) -> tuple[dict, dict, tuple]:
    """The ops of one buffer size, checked: (alone cases, beside cases per budget, what must stay alive),
    those whose names start with one of ``only``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    share, others = numel // world, [q for q in range(world) if q != rank]
    mine, handle, theirs = symmetric(numel)
    mine.copy_(rank_data(rank, numel))
    sl = slice(rank * share, (rank + 1) * share)
    rows = [mine[sl] if q == rank else theirs[q][sl] for q in range(world)]
    staging = torch.empty(world - 1, share, dtype=DTYPE, device="cuda")
    result, gathered, plain = torch.empty(share, dtype=DTYPE, device="cuda"), torch.empty_like(mine), mine.clone()
    reduced = mine.clone()  # (nccl-ar's, summed in place call after call: its values only grow)
    owned = [(theirs[q][q * share : (q + 1) * share], gathered[q * share : (q + 1) * share]) for q in others]
    ring = [owned[others.index(q)] for q in comm.peer.ring(rank, world)]  # (the pulls' order)

    def ce_sum() -> None:
        for j, q in enumerate(others):
            staging[j].copy_(rows[q])
        fo_sum(result, [mine[sl], *staging])

    lane = torch.cuda.Stream()
    ring_staging = [(theirs[q][sl], staging[others.index(q)]) for q in comm.peer.ring(rank, world)]

    def split(group=None) -> None:
        lane.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(lane):
            dist.all_gather_into_tensor(gathered, mine[sl], group=group)
        for src, dst in ring_staging:
            dst.copy_(src)
        torch.cuda.current_stream().wait_stream(lane)

    ops = {
        "ce+sum": ce_sum,
        "peer-sum": lambda: fo_sum(result, rows),
        "nccl-rs": lambda group=None: dist.reduce_scatter_tensor(result, plain, group=group),
        "nccl-ag": lambda group=None: dist.all_gather_into_tensor(gathered, mine[sl], group=group),
        "nccl-ar": lambda group=None: dist.all_reduce(reduced, group=group),
        "split": split,
    }
    grouped = ("nccl-rs", "nccl-ag", "nccl-ar", "split")  # (on the capped communicator beside the GEMM)
    into_buffers = ("nccl-ag", "nccl-ar", "split")  # (checked below: they write whole buffers)
    keep: tuple = (handle,)
    torch_rs = getattr(torch.ops.symm_mem, "reduce_scatter_out", None)
    if torch_rs is not None:  # its own buffer, zeroed once checked (torch says the op may modify its input)
        rs_in, rs_handle, _ = symmetric(numel)
        rs_in.copy_(mine)
        ops["torch-rs"] = lambda: torch_rs(rs_in, dist.group.WORLD.group_name, False, result)
        keep += (rs_handle,)
    torch.cuda.synchronize()
    dist.barrier()  # every rank's buffer written before any rank reads it
    summed = sum(rank_data(q, numel)[sl].float() for q in range(world))  # (every reduce-scatter's answer)
    for name, op in list(ops.items()):
        if name in into_buffers:
            continue
        try:
            check(name, op, [result], summed, 1e-2)
        except (RuntimeError, NotImplementedError) as exc:  # (torch's op missing its CUDA kernel: on every rank)
            if name != "torch-rs":
                raise
            print(f"rank {rank}: torch-rs left out: {type(exc).__name__}: {exc}", flush=True)
            del ops[name]
    if torch_rs is not None:
        rs_in.zero_()
    every_share = torch.cat([rank_data(q, numel)[q * share : (q + 1) * share].float() for q in range(world)])
    check("nccl-ag", ops["nccl-ag"], [gathered], every_share, 0.0)
    copied = [rank_data(q, numel)[sl].float() for q in others]
    check("split", ops["split"], [gathered, *staging], torch.cat([every_share, *copied]), 0.0)
    total = sum(rank_data(q, numel).float() for q in range(world))
    check("nccl-ar", lambda: (reduced.copy_(mine), ops["nccl-ar"]()), [reduced], total, 1e-2)
    # pushes: each rank's own share into the others' symmetric buffers, where pulls would have read it
    pushed, push_handle, their_pushed = symmetric(numel)
    keep += (push_handle,)
    lanes = [torch.cuda.Stream() for _ in others]
    pushes = [(mine[sl], their_pushed[q][sl]) for q in others]
    gathers = {
        "gather:ce": lambda: [dst.copy_(src) for src, dst in owned],
        "gather:ring": lambda: [dst.copy_(src) for src, dst in ring],
        "gather:lanes": lambda: on_lanes(lanes, owned),
        "gather:push": lambda: on_lanes(lanes, pushes),
        "gather:sm": lambda: [fo_sum(dst, [src]) for src, dst in owned],
    }
    want = torch.cat([rank_data(q, numel)[q * share : (q + 1) * share].float() for q in others])
    for name, op in gathers.items():
        outs = [pushed[q * share : (q + 1) * share] for q in others] if name == "gather:push" else [d for _, d in owned]
        check(name, op, outs, want, 0.0)
    for j, q in enumerate(others):  # (the copies the local sum adds)
        staging[j].copy_(rows[q])
    sums = {"sum:local": lambda: fo_sum(result, [mine[sl], *staging])}
    check("sum:local", sums["sum:local"], [result], summed, 1e-2)
    every = {name: op for name, op in {**ops, **gathers, **sums}.items() if name.startswith(only)}
    alone = {name: (op, None) for name, op in every.items()}
    beside = {}
    for c, gemm in gemms.items():
        beside[c] = {"gemm alone": (None, gemm)}
        for name, op in every.items():
            if name != "gather:sm":
                beside[c][name] = (functools.partial(op, groups[c]) if name in grouped else op, gemm)
    return alone, beside, keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", nargs="+", type=int, default=[16, 64], help="S: bf16 MiB per rank")
    parser.add_argument("--shape", type=parse_shape, default=(4096, 8192, 8192), help="the signal GEMM beside")
    parser.add_argument("--budgets", nargs="+", type=int, default=[4, 8, 16], help="comm_sms: SMs left free")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", nargs="+", default=[""], help="time only the variants whose names start so")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, m, n, k = dist.get_world_size(), *args.shape
    a, w = operand_sets(m, n, k, DTYPE)
    gemms, groups = {}, {}
    for c in args.budgets:
        prep = prepare(m, n, k, DTYPE, "nk", a[0].device, for_collective(OverlapConfig(comm_sms=c), "all_reduce"))
        buf = torch.empty(prep.plan.numel, dtype=DTYPE, device="cuda")

        def gemm(i: int, stream, prep=prep, buf=buf) -> None:
            prep.launch(a[i % len(a)], w[i % len(w)], buf, stream)
            signal.reset(prep.counters, stream)

        gemm(0, torch.cuda.current_stream())  # (loaded before any timing)
        gemms[c], groups[c] = gemm, comm.budget_group(dist.group.WORLD, c)
    torch.cuda.synchronize()
    say = print if dist.get_rank() == 0 else lambda *_, **__: None
    say(
        f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}; "
        f"GEMM {m}x{n}x{k} bf16; medians of {args.rounds} barrier-aligned rounds, slowest rank",
        flush=True,
    )
    side = torch.cuda.Stream()
    for mib in args.sizes_mb:
        numel, moved = mib * 2**20 // 2, (world - 1) / world * mib * 2**20
        say(f"S = {mib} MiB per rank, share {mib / world:g} MiB, {moved / 2**20:g} MiB read per rank", flush=True)
        alone, beside, _keep = size_cases(numel, gemms, groups, tuple(args.only))
        for name, (op_ms, _) in measure(alone, args.rounds, args.warmup, side).items():
            say(f"  alone   {name:12s} {op_ms:7.3f} ms {moved / op_ms / 1e6:6.0f} GB/s", flush=True)
        for c, cases in beside.items():
            times = measure(cases, args.rounds, args.warmup, side)
            base = times["gemm alone"][1]
            say(f"  {c:2d} SMs  GEMM alone {base:7.3f} ms", flush=True)
            for name, (op_ms, gemm_ms) in times.items():
                if name != "gemm alone":
                    say(
                        f"  {c:2d} SMs  {name:12s} done {op_ms:7.3f} ms after the GEMM's start "
                        f"({moved / op_ms / 1e6:5.0f} GB/s), GEMM {gemm_ms:7.3f} ms ({gemm_ms / base - 1:+.1%})",
                        flush=True,
                    )
        torch.cuda.synchronize()
        dist.barrier()  # (no rank reads this size's buffers any more)
        del alone, beside, _keep
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
