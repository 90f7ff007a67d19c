"""MoE expert combine with the all-to-all overlapped with the expert's down projection:

    torchrun --nproc-per-node 2 examples/moe_combine.py [--tokens 8192] [--transport pcie] [--ragged [--exchange]]

Each rank ran its experts on tokens that other ranks own (rows grouped by owner, uneven counts).
The combine multiplies them by the down projection and sends each row back to its owner:
``torch.matmul`` + ``dist.all_to_all_single`` vs ``flashoverlap.gemm_all_to_all``. With
``--ragged`` the ranks' experts got different numbers of rows (from half to all of ``--tokens``),
as routing gives them; every rank knows every rank's count, as after a dispatcher's all-gather of
the token counts, and passes them (``output_splits``, ``rows_per_rank``). ``--exchange``: pass
``splits`` only, and flashoverlap exchanges the counts itself on every call (an all-gather and a
host sync, in its time).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap.timing import time_variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="expert rows on each rank")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=7168)
    parser.add_argument("--transport", choices=["nvlink", "pcie"], default="nvlink")
    parser.add_argument("--ragged", action="store_true", help="a different number of expert rows on each rank")
    parser.add_argument("--exchange", action="store_true", help="with --ragged: flashoverlap exchanges the counts")
    args = parser.parse_args()
    if args.transport == "pcie":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(rank)
    rows = args.tokens // 2 + int(torch.randint(0, args.tokens // 2 + 1, (1,), generator=gen, device="cuda"))
    rows = rows if args.ragged else args.tokens
    # uneven routing: how many of this rank's expert rows belong to each owner
    cuts = torch.sort(torch.randint(0, rows + 1, (world - 1,), generator=gen, device="cuda")).values
    splits = torch.diff(torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), rows)]))
    received = torch.empty_like(splits)
    dist.all_to_all_single(received, splits)
    every_rows = [torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(world)]
    dist.all_gather(every_rows, torch.tensor([rows], device="cuda"))  # as a dispatcher's counts tell it
    splits, received, every_rows = splits.tolist(), received.tolist(), [int(r) for r in every_rows]
    h = torch.randn(rows, args.ffn, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(args.hidden, args.ffn, device="cuda", generator=gen) / args.ffn**0.5).bfloat16()

    def plain():
        out = torch.empty(sum(received), args.hidden, device="cuda", dtype=torch.bfloat16)
        dist.all_to_all_single(out, h @ w.t(), received, splits)
        return out

    def overlapped():  # ranks with different M: every M given, or the counts exchanged by flashoverlap
        if args.ragged and args.exchange:
            return flashoverlap.gemm_all_to_all(h, w, splits=splits)
        every = {"rows_per_rank": every_rows} if args.ragged else {}
        return flashoverlap.gemm_all_to_all(h, w, splits=splits, output_splits=received, **every)

    want, got = plain().float(), overlapped().float()
    err = ((got - want).norm() / want.norm()).item()
    times = time_variants({"plain": lambda i: plain(), "fo": lambda i: overlapped()}, 20, 1, 3)
    t_plain, t_fo = times["plain"], times["fo"]
    if rank == 0:
        print(
            f"{torch.cuda.get_device_name()} x{world}, {args.transport}: combine of {rows} rows on rank 0 "
            f"({args.ffn} -> {args.hidden}), sent as {splits}: matmul + all_to_all {t_plain:.3f} ms, "
            f"flashoverlap {t_fo:.3f} ms, speedup {t_plain / t_fo:.3f}, rel err {err:.1e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
