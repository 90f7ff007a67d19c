"""Side-by-side benchmark of GEMM + collective: sequential vs flashoverlap, in one run.

    torchrun --nproc-per-node 2 -m flashoverlap.bench --shapes 4096x8192x8192 \
        --configs '{}' '{"comm_sms": 16}' --csv results.csv
    torchrun --nproc-per-node 2 -m flashoverlap.bench --collective reduce_scatter --shapes 16384x8192x4096

all_to_all splits the rows evenly over the ranks.

Variants take turns round by round (so drift hits all alike),
after warm-up, on random inputs rotated through sets larger than L2, timed with CUDA events
over blocks of back-to-back calls (the host running ahead, as in a model); the reported time per
call is the median over rounds, the largest over ranks.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .comm import COLLECTIVES

TRANSPORTS = {
    "nvlink": {},
    # NCCL through host shared memory, as on PCIe consumer GPUs without P2P (RTX 4090).
    "pcie": {"NCCL_P2P_DISABLE": "1"},
    # sockets: a multi-node stand-in
    "net": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be MxNxK (e.g. 4096x8192x8192), got {text!r}") from None
    if min(m, n, k) < 1:
        raise argparse.ArgumentTypeError(f"shape dimensions must be positive, got {text!r}")
    return m, n, k


def parse_config(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"config must be a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"config must be a JSON object, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashoverlap.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(4096, 8192, 8192)])
    parser.add_argument(
        "--configs",
        nargs="+",
        type=parse_config,
        default=[{}],
        help="OverlapConfig fields as JSON objects; each is one flashoverlap variant",
    )
    parser.add_argument("--collective", choices=COLLECTIVES, default="all_reduce")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), default="nvlink")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
    parser.add_argument("--block", type=int, default=8, help="calls per timed round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--csv", help="write one row per shape and variant here (rank 0)")
    parser.add_argument(
        "--trace",
        help="write a Chrome trace of three calls of the first config here (rank 0) and print their timeline",
    )
    return parser


def median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def overlap_efficiency(t_seq: float, t_ovl: float, t_gemm: float, t_comm: float) -> float:
    """Share of the hideable time (the shorter of GEMM and communication) actually hidden."""
    return (t_seq - t_ovl) / min(t_gemm, t_comm)


def input_sets(m: int, n: int, k: int, dtype: torch.dtype, l2_bytes: int) -> int:
    """How many operand sets to rotate through so that consecutive iterations miss in L2."""
    per_set = (m * k + n * k) * torch.finfo(dtype).bits // 8
    return max(2, math.ceil(3 * l2_bytes / per_set))


def time_variants(
    variants: dict[str, Callable[[int], object]], rounds: int, block: int, warmup: int
) -> dict[str, float]:
    """Steady-state ms per call for each variant (median over rounds, max over ranks).

    Each round times ``block`` calls of one variant back to back between two CUDA events, the
    host free to run ahead as in a model's forward pass (launch overhead counts only where it
    stalls the GPU); variants take turns round by round so drift hits all of them alike.
    """
    torch.cuda.synchronize()
    dist.barrier()
    for i in range(warmup):
        for fn in variants.values():
            fn(i)
    torch.cuda.synchronize()
    dist.barrier()
    events = []
    for r in range(rounds):
        for name, fn in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(block):
                fn(r * block + i)
            end.record()
            events.append((name, start, end))
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for name, start, end in events:
        samples[name].append(start.elapsed_time(end) / block)
    medians = torch.tensor([median_ms(samples[name]) for name in variants], dtype=torch.float64, device="cuda")
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(variants, medians.tolist()))


def bench_shape(shape, configs, collective, dtype, rounds, block, warmup) -> list[dict]:
    import flashoverlap

    from . import comm
    from .config import for_collective, resolve
    from .overlap import prepare

    m, n, k = shape
    rank, world = dist.get_rank(), dist.get_world_size()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    sets = input_sets(m, n, k, dtype, props.L2_cache_size)
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    a = [torch.randn(m, k, device="cuda", generator=gen).to(dtype) for _ in range(sets)]
    w = [torch.randn(n, k, device="cuda", generator=gen).to(dtype) / math.sqrt(k) for _ in range(sets)]
    c = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
    ex = comm.exchange(collective, m, world)
    overlapped = getattr(flashoverlap, f"gemm_{collective}")

    def seq(i):
        return comm.collective(ex, a[i % sets] @ w[i % sets].t(), None)

    variants: dict[str, Callable[[int], object]] = {
        "gemm": lambda i: a[i % sets] @ w[i % sets].t(),
        "comm": lambda i: comm.collective(ex, c, None),
        "seq": seq,
    }
    cfgs = [for_collective(resolve(cfg), collective) for cfg in configs]
    errors = {}
    for j, cfg in enumerate(cfgs):
        variants[f"fo{j}"] = lambda i, cfg=cfg: overlapped(a[i % sets], w[i % sets], config=cfg)
        if not cfg.sequential:
            prep = prepare(m, n, k, dtype, "nk", a[0].device, cfg)
            buf = torch.empty(m * n, dtype=dtype, device="cuda")

            def kernel_only(i, prep=prep, buf=buf):
                prep.launch(a[i % sets], w[i % sets], buf, torch.cuda.current_stream())
                prep.counters.zero_()

            variants[f"kernel{j}"] = kernel_only
        got, want = overlapped(a[0], w[0], config=cfg).float(), seq(0).float()
        errors[j] = ((got - want).norm() / want.norm()).item()
    times = time_variants(variants, rounds, block, warmup)

    rows = []
    t_gemm, t_comm, t_seq = times["gemm"], times["comm"], times["seq"]
    for j, cfg in enumerate(cfgs):
        t_fo = times[f"fo{j}"]
        plan = None if cfg.sequential else prepare(m, n, k, dtype, "nk", a[0].device, cfg).plan
        rows.append(
            {
                "m": m,
                "n": n,
                "k": k,
                "world": world,
                "collective": collective,
                "dtype": str(dtype).removeprefix("torch."),
                "config": json.dumps(configs[j], sort_keys=True),
                "waves": plan.num_waves if plan else "",
                "groups": plan.num_groups if plan else "",
                "t_gemm_ms": t_gemm,
                "t_comm_ms": t_comm,
                "t_seq_ms": t_seq,
                "t_fo_ms": t_fo,
                "t_kernel_ms": times.get(f"kernel{j}", float("nan")),
                "speedup": t_seq / t_fo,
                "ideal_speedup": t_seq / max(t_gemm, t_comm),
                "efficiency": overlap_efficiency(t_seq, t_fo, t_gemm, t_comm),
                "kernel_vs_cublas": t_gemm / times.get(f"kernel{j}", float("nan")),
                "rel_err": errors[j],
            }
        )
    return rows


def trace_call(shape, config, collective, dtype, path: str) -> None:
    """Profile three overlapped calls (after warm-up); rank 0 writes the trace and prints its kernels."""
    from torch.profiler import ProfilerActivity, profile

    import flashoverlap

    overlapped = getattr(flashoverlap, f"gemm_{collective}")

    m, n, k = shape
    a = torch.randn(m, k, device="cuda").to(dtype)
    w = torch.randn(n, k, device="cuda").to(dtype)
    for _ in range(3):
        overlapped(a, w, config=config)
    enqueue_s = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        overlapped(a, w, config=config)
        enqueue_s.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):  # back to back, as in the timed runs
            overlapped(a, w, config=config)
        torch.cuda.synchronize()
    if dist.get_rank() != 0:
        return
    prof.export_chrome_trace(path)
    with open(path) as handle:
        events = json.load(handle)["traceEvents"]
    device_cats = ("kernel", "gpu_memset", "gpu_memcpy")
    kernels = sorted((e for e in events if e.get("cat") in device_cats), key=lambda e: e["ts"])
    if not kernels:
        print("trace: no device activity recorded")
        return
    t0 = kernels[0]["ts"]
    print(f"\nhost time to enqueue one call: {1e3 * statistics.median(enqueue_s):.3f} ms")
    print(f"kernel timeline of three calls, {m}x{n}x{k} {json.dumps(config)} (us from first kernel):")
    for e in kernels:
        print(f"  stream {e.get('tid')!s:>4}  start {e['ts'] - t0:9.1f}  dur {e['dur']:8.1f}  {e['name'][:70]}")
    api_calls = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: e["ts"])
    print("host API calls during the calls (us from first kernel):")
    for e in api_calls:
        print(f"  start {e['ts'] - t0:9.1f}  dur {e.get('dur', 0):8.1f}  {e['name'][:60]}")


COLUMNS = [
    ("m", "M", "d"),
    ("n", "N", "d"),
    ("k", "K", "d"),
    ("t_gemm_ms", "gemm", ".3f"),
    ("t_comm_ms", "comm", ".3f"),
    ("t_seq_ms", "seq", ".3f"),
    ("t_fo_ms", "fo", ".3f"),
    ("speedup", "speedup", ".3f"),
    ("ideal_speedup", "ideal", ".3f"),
    ("efficiency", "eff", ".2f"),
    ("kernel_vs_cublas", "kern/cublas", ".3f"),
    ("rel_err", "rel_err", ".1e"),
    ("config", "config", "s"),
]


def format_table(rows: list[dict]) -> str:
    cells = [[title for _, title, _ in COLUMNS]]
    for row in rows:
        cells.append([format(row[key], fmt) if row[key] != "" else "-" for key, _, fmt in COLUMNS])
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.update(TRANSPORTS[args.transport])  # before NCCL creates its communicators
    if "RANK" not in os.environ:
        print("run under torchrun, e.g. torchrun --nproc-per-node 2 -m flashoverlap.bench", file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        dtype = getattr(torch, args.dtype)
        rows = []
        for shape in args.shapes:
            rows += bench_shape(shape, args.configs, args.collective, dtype, args.rounds, args.block, args.warmup)
        if args.trace:
            trace_call(args.shapes[0], args.configs[0], args.collective, dtype, args.trace)
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name()
            print(
                f"\n{name} x{dist.get_world_size()}, {args.collective}, transport={args.transport}, {args.dtype}, "
                f"ms per call, median of {args.rounds} rounds of {args.block} calls"
            )
            print(format_table(rows), flush=True)
            if args.csv:
                write_csv(args.csv, [dict(row, gpu=name, transport=args.transport) for row in rows])
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
