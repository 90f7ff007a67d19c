"""A tensor-parallel transformer MLP block (Llama-style SwiGLU, random weights), with and without
flashoverlap, side by side:

    torchrun --nproc-per-node 2 examples/tp_mlp.py --tokens 4096 16384 [--transport pcie] [--backward]

gate/up are column-parallel (each rank holds ffn/world of the features), down is row-parallel:
its partial sums are all-reduced -- plain ``F.linear`` + ``dist.all_reduce`` in the baseline,
:class:`flashoverlap.nn.RowParallelLinear` (overlapped) otherwise. ``--backward`` times forward +
backward: the input gradient of gate/up is then all-reduced too -- after the plain GEMM in the
baseline (Megatron's identity whose backward all-reduces), overlapped with it by
:class:`flashoverlap.nn.ColumnParallelLinear`. Prints tokens/s of both.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashoverlap.nn import ColumnParallelLinear, RowParallelLinear
from flashoverlap.timing import time_variants


class AllReduceGrad(torch.autograd.Function):
    """The baseline's column-parallel input: identity forward, all-reduced gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class AllReduce(torch.autograd.Function):
    """The baseline's row-parallel output: all-reduced forward, identity gradient."""

    @staticmethod
    def forward(ctx, y):
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, world: int, overlap: bool) -> None:
        super().__init__()
        local = ffn // world
        column, row = (ColumnParallelLinear, RowParallelLinear) if overlap else (nn.Linear, nn.Linear)
        self.gate_up = column(hidden, 2 * local, bias=False)
        self.down = row(local, hidden, bias=False)
        self.overlap = overlap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.overlap:
            x = AllReduceGrad.apply(x)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        y = self.down(F.silu(gate) * up)
        return y if self.overlap else AllReduce.apply(y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--ffn", type=int, default=28672)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--transport", choices=["nvlink", "pcie"], default="nvlink")
    parser.add_argument("--backward", action="store_true", help="time forward + backward (training)")
    args = parser.parse_args()
    if args.transport == "pcie":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # NCCL through host memory, as on consumer GPUs
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = dist.get_world_size()
    torch.manual_seed(0)
    plain = MLP(args.hidden, args.ffn, world, overlap=False).cuda().bfloat16()
    overlapped = MLP(args.hidden, args.ffn, world, overlap=True).cuda().bfloat16()
    overlapped.load_state_dict(plain.state_dict())  # same weights
    rows = []
    with torch.set_grad_enabled(args.backward):
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
            grad = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16)

            def step(model: MLP, x: torch.Tensor = x, grad: torch.Tensor = grad) -> torch.Tensor:
                y = model(x)
                if not args.backward:
                    return y
                x.grad = None
                y.backward(grad)
                return x.grad

            want, got = step(plain).float(), step(overlapped).float()  # the output, or the input's gradient
            err = ((got - want).norm() / want.norm()).item()
            # the two take turns, CUDA events, median over rounds, max over ranks (flashoverlap.timing)
            variants = {"plain": lambda i: step(plain), "fo": lambda i: step(overlapped)}
            times = time_variants(variants, args.iters, 1, 3)
            t_plain, t_fo = times["plain"], times["fo"]
            rows.append((tokens, t_plain, t_fo, err))
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name()
        what = "forward + backward" if args.backward else "forward"
        print(f"{name} x{world}, {args.transport}, MLP hidden {args.hidden} ffn {args.ffn} bf16, {what}")
        titles = ("tokens", "plain ms", "fo ms", "plain tok/s", "fo tok/s", "speedup", "rel_err")
        print(" ".join(f"{t:>{w}}" for t, w in zip(titles, (7, 9, 8, 12, 10, 8, 8))))
        for tokens, t_plain, t_fo, err in rows:
            print(
                f"{tokens:>7} {t_plain:>9.3f} {t_fo:>8.3f} {tokens / t_plain * 1e3:>12.0f} "
                f"{tokens / t_fo * 1e3:>10.0f} {t_plain / t_fo:>8.3f} {err:>8.1e}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
