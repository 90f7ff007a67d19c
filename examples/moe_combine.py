"""MoE expert combine with the all-to-all overlapped with the expert's down projection:

    torchrun --nproc-per-node 2 examples/moe_combine.py [--tokens 8192] [--transport pcie]

Each rank ran its experts on tokens that other ranks own (rows grouped by owner, uneven counts).
The combine multiplies them by the down projection and sends each row back to its owner:
``torch.matmul`` + ``dist.all_to_all_single`` vs ``flashoverlap.gemm_all_to_all``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap.bench import time_variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="expert rows on each rank")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=7168)
    parser.add_argument("--transport", choices=["nvlink", "pcie"], default="nvlink")
    args = parser.parse_args()
    if args.transport == "pcie":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(rank)
    # uneven routing: how many of this rank's expert rows belong to each owner
    cuts = torch.sort(torch.randint(0, args.tokens + 1, (world - 1,), generator=gen, device="cuda")).values
    splits = torch.diff(torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), args.tokens)]))
    received = torch.empty_like(splits)
    dist.all_to_all_single(received, splits)
    splits, received = splits.tolist(), received.tolist()
    h = torch.randn(args.tokens, args.ffn, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(args.hidden, args.ffn, device="cuda", generator=gen) / args.ffn**0.5).bfloat16()

    def plain():
        out = torch.empty(sum(received), args.hidden, device="cuda", dtype=torch.bfloat16)
        dist.all_to_all_single(out, h @ w.t(), received, splits)
        return out

    def overlapped():
        return flashoverlap.gemm_all_to_all(h, w, splits=splits, output_splits=received)

    want, got = plain().float(), overlapped().float()
    err = ((got - want).norm() / want.norm()).item()
    times = time_variants({"plain": lambda i: plain(), "fo": lambda i: overlapped()}, 20, 1, 3)
    t_plain, t_fo = times["plain"], times["fo"]
    if rank == 0:
        print(
            f"{torch.cuda.get_device_name()} x{world}, {args.transport}: combine of {args.tokens} rows "
            f"({args.ffn} -> {args.hidden}), rank 0 sends {splits}: matmul + all_to_all {t_plain:.3f} ms, "
            f"flashoverlap {t_fo:.3f} ms, speedup {t_plain / t_fo:.3f}, rel err {err:.1e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
