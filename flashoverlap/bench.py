"""Side-by-side benchmark of GEMM + collective: sequential vs flashoverlap, in one run.

    torchrun --nproc-per-node 2 -m flashoverlap.bench --shapes 4096x8192x8192 \
        --configs '{}' '{"comm_sms": 16}' --csv results.csv
    torchrun --nproc-per-node 2 -m flashoverlap.bench --collective reduce_scatter --shapes 16384x8192x4096

all_to_all splits the rows evenly over the ranks. Beside each flashoverlap config, in the same
run: the GEMM and the collective alone, sequential (torch.matmul then the NCCL collective), the
usual hand-written overlap (the GEMM split into column chunks, each chunk's collective on a second
stream while the next chunk multiplies; best of 2, 4 and 8 chunks), torch's async-TP
``fused_matmul_reduce_scatter`` (FP8: ``fused_scaled_matmul_reduce_scatter``) for reduce_scatter
where it runs, and the ideal max(gemm, comm).
``fallback``: a flashoverlap call forced onto the sequential path (``config={"sequential": true}``),
what a call decided sequential costs beside ``seq``; ``seq`` is also timed twice, as two variants,
whose ratio is the run's noise floor (the fallback's difference from ``seq`` means little below it:
host-bound calls spread by several percent between identical paths). Summarise (and plot) saved
CSVs without GPUs, each file's runs apart:
``python -m flashoverlap.bench --from-csv a.csv b.csv --plot out.png``.

Variants take turns round by round (so drift hits all alike), after warm-up, timed with CUDA
events over blocks of back-to-back calls (the host running ahead, as in a model); the reported
time per call is the median over rounds, the largest over ranks, and a speedup over ``seq`` is
paired: the median over rounds of ``seq``'s time over the variant's in the same turn (the least
over ranks; timing.paired_speedup), which the host's drift between turns does not move. Inputs (``--inputs``): random
operands ``rotated`` through sets larger than L2 (every call reads them from memory), or ``hot``:
the same operands every call, as a layer's activations and weights can sit in L2, or ``both``.
``--graphs`` captures each variant's block once as a CUDA graph and times its replays instead:
GPU time alone, for every variant alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import yaml

from . import comm, report, state
from .comm import COLLECTIVES, NCCL_PATHS
from .config import OverlapConfig, resolve
from .decision import decide
from .inputs import FP8_DTYPES, Fp8, Scales
from .prepared import prepare
from .registry import DTYPES as DTYPE_NAMES
from .rules import for_call
from .runtime import plain
from .timing import kernel_alone, operand_sets, paired_speedup, round_calls, slowest, time_samples

log = logging.getLogger("flashoverlap.bench")  # not __name__: "__main__" under python -m
INPUTS = {"rotated": ("rotated",), "hot": ("hot",), "both": ("rotated", "hot")}  # --inputs: the modes timed

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


def parse_config(text: str) -> dict | None:
    """A JSON object of OverlapConfig fields or a YAML config file (config.cli_config), or
    ``registry`` (None: what a call without ``config=`` runs, the tuned registry's entry for the
    shape)."""
    from .config import cli_config

    return None if text == "registry" else cli_config(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashoverlap.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes", nargs="+", type=parse_shape, default=None, help="MxNxK ... (default 4096x8192x8192)"
    )
    parser.add_argument("--shapes-file", help="YAML list of shapes (MxNxK strings or [M, N, K]) to add")
    parser.add_argument(
        "--configs",
        nargs="+",
        type=parse_config,
        default=[{}],
        help="OverlapConfig fields as JSON objects or YAML config files, or 'registry' (the tuned configs, "
        "as with no config=); each is one flashoverlap variant",
    )
    parser.add_argument("--collective", choices=COLLECTIVES, default="all_reduce")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16")
    parser.add_argument(
        "--fast-accum", action="store_true", help="FP8: unpromoted partial sums (torch._scaled_mm's use_fast_accum)"
    )
    parser.add_argument("--rowwise", action="store_true", help="FP8: rowwise scales ([M, 1] and [1, N])")
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), default="nvlink")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
    parser.add_argument(
        "--block",
        type=int,
        help="calls per timed round (default: per shape, 8 for long GEMMs up to 64 for short host-bound calls: "
        "timing.round_calls)",
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--inputs",
        choices=sorted(INPUTS),
        default="rotated",
        help="operands rotated through sets larger than L2 (default), the same ones every call (hot: in L2, as a "
        "layer's can be), or both, each a run of its own",
    )
    parser.add_argument("--csv", help="write one row per shape and variant here (rank 0)")
    parser.add_argument(
        "--rounds-csv",
        help="write every timed round here (rank 0): shape, inputs, variant (and its config), rank, round in "
        "the order timed, ms per call -- the rounds each median comes from, to see a disturbed run's",
    )
    parser.add_argument("--chunks", nargs="+", type=int, default=[2, 4, 8], help="decomposition chunk counts to try")
    parser.add_argument(
        "--nccl",
        nargs="+",
        choices=NCCL_PATHS,
        help="how flashoverlap calls NCCL (FLASHOVERLAP_NCCL): each config is measured with each path "
        "(default: the path a call takes, comm.uses_direct); with several, each path's decided call runs "
        "as decided, without the public call's lookup",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="replay each variant's block of calls as one captured CUDA graph: GPU time without host time "
        "(and FLASHOVERLAP_TIMING=graphs: the registry's entries for calls replayed so apply)",
    )
    parser.add_argument("--plot", help="write a PNG of speedup per shape and method here (needs matplotlib)")
    parser.add_argument(
        "--from-csv",
        nargs="+",
        help="summarise these CSVs of --csv (and plot them with --plot) instead of measuring: each run apart, labelled",
    )
    parser.add_argument(
        "--trace",
        help="write a Chrome trace of three calls of the first config here (rank 0; rank r's beside it, "
        "NAME.rank<r>.json) and print rank 0's timeline",
    )
    return parser


def load_shapes(path: str) -> list[tuple[int, int, int]]:
    """Shapes from a YAML list of ``MxNxK`` strings or ``[M, N, K]`` lists."""
    with open(path) as handle:
        data = yaml.safe_load(handle)
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty YAML list of shapes")
    shapes = []
    for item in data:
        text = "x".join(map(str, item)) if isinstance(item, list) else str(item)
        try:
            shapes.append(parse_shape(text))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{path}: {exc}") from None
    return shapes


def overlap_efficiency(t_seq: float, t_ovl: float, t_gemm: float, t_comm: float) -> float:
    """Share of the hideable time (the shorter of GEMM and communication) actually hidden."""
    return (t_seq - t_ovl) / min(t_gemm, t_comm)


def decomposed(
    a, w, ex, chunks: int, stream: torch.cuda.Stream, product, scales: Scales | None = None, fp8: Fp8 | None = None
) -> torch.Tensor:
    """The usual hand-written overlap: the GEMM in ``chunks`` column blocks on the current stream,
    each block's collective (and its copy into the output) on ``stream`` while the next multiplies;
    ``product(a, w_block, scales)``: the block's GEMM (runtime.plain on one rank: FP8 operands'
    ``torch._scaled_mm`` with ``scales``, as ``fp8`` says; rowwise ones' columns of the block's)."""

    caller = torch.cuda.current_stream()
    n = w.shape[0]
    out = torch.empty((ex.rows, n), dtype=a.dtype if fp8 is None else fp8.out_dtype, device=a.device)
    stream.wait_stream(caller)
    unit = 1 if fp8 is None else 16  # (torch._scaled_mm takes multiples of 16 columns)
    for cols in torch.arange(n // unit).tensor_split(chunks):
        if not len(cols):
            continue
        c0, c1 = int(cols[0]) * unit, (int(cols[-1]) + 1) * unit
        block = scales if scales is None or not scales.rowwise else scales._replace(b=scales.b[:, c0:c1])
        part = product(a, w[c0:c1], block)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            out[:, c0:c1].copy_(comm.collective(ex, part, None))
        part.record_stream(stream)
    caller.wait_stream(stream)
    return out


def async_tp(
    a: torch.Tensor, w: torch.Tensor, scales: Scales | None = None, fp8: Fp8 | None = None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """torch's fused_matmul_reduce_scatter (symmetric memory; FP8 operands: its
    fused_scaled_matmul_reduce_scatter with ``scales``), or None where it does not run here. Only over
    NVLink (registry.transport): it moves data through CUDA IPC peer memory, not NCCL, so with P2P
    disabled it would use the very links the emulated machine lacks."""
    from . import registry

    if registry.transport() != "nvlink":
        return None
    if (scales is None) != (fp8 is None):
        raise ValueError("async_tp: FP8 operands take their scales and kind, 16-bit ones neither")
    op = "fused_matmul_reduce_scatter" if fp8 is None else "fused_scaled_matmul_reduce_scatter"
    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = dist.group.WORLD.group_name
        with warnings.catch_warnings():  # (older torch needs it; newer ones deprecate it, a FutureWarning)
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)

        def fused(x, y):
            if fp8 is None:
                return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, y.t(), "sum", scatter_dim=0, group_name=name)
            shape = [x.shape[0], y.shape[0]]
            return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
                x, y.t(), scales.a, scales.b, "sum", 0, 0, name, shape, None, None, fp8.out_dtype, fp8.fast_accum
            )

        fused(a, w)
        torch.cuda.synchronize()
        works = True
    except Exception as exc:  # not built, no P2P, ...: report it, measure the rest
        log.warning("async-TP %s unavailable: %s: %s", op, type(exc).__name__, exc)
        works = False
    # every rank must time the same variants
    flag = torch.tensor([int(works)], device=a.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return fused if flag.item() else None


FALLBACK = {"sequential": True}  # the config of the forced-fallback variant
# Calls per timed round by default (timing.round_calls): a round's events also hold its last call's
# GPU time after the host enqueued it, which weighs against a host-bound plain call in short rounds;
# short calls get rounds of up to 64, long GEMMs keep 8. The host's drift
# between speeds is what the paired speedups take out (docs/experiments.md, Measuring).
BLOCK = (8, 64)


class Fp8Arguments(NamedTuple):
    """What timed calls with FP8 operands pass (:func:`fp8_arguments`): their ``scales``, their ``fp8``
    kind, and the public calls' keywords for them."""

    scales: Scales | None
    fp8: Fp8 | None
    kwargs: dict


def fp8_arguments(
    dtype: torch.dtype, k: int, fast_accum: bool = False, rows: tuple[int, int] | None = None
) -> Fp8Arguments:
    """For operands of ``dtype`` and depth ``k``: FP8 ones get per-tensor scales (the weight's
    carries the 1 / sqrt(K) that 16-bit weights hold) and a bf16 result, as a quantized layer's, or
    with ``rows`` (M, N) rowwise ones ([M, 1] and [1, N], the same values); 16-bit ones none."""
    if dtype not in FP8_DTYPES:
        return Fp8Arguments(None, None, {})
    shapes = ((1,), (1,)) if rows is None else ((rows[0], 1), (1, rows[1]))
    a, b = torch.ones(shapes[0], device="cuda"), torch.full(shapes[1], k**-0.5, device="cuda")
    scales = Scales(a, b, rowwise=rows is not None)
    fp8 = Fp8(torch.bfloat16, fast_accum, rowwise=rows is not None)
    return Fp8Arguments(scales, fp8, {"scale_a": scales.a, "scale_b": scales.b, "use_fast_accum": fast_accum})


def bench_shape(shape: tuple[int, int, int], args: argparse.Namespace, inputs: str) -> tuple[list[dict], list[dict]]:
    """One row per config and NCCL path of ``shape``, every variant timed in one run: as the
    command line ``args`` (:func:`build_parser`) asks, on ``inputs`` ``rotated`` or ``hot``; and
    every timed round behind them (:func:`round_rows`)."""
    import flashoverlap

    configs, collective, dtype, chunks = args.configs, args.collective, getattr(torch, args.dtype), args.chunks
    m, n, k = shape
    world = dist.get_world_size()
    a, w = operand_sets(m, n, k, dtype, hot=inputs == "hot")
    sets = len(a)
    scales, fp8, kwargs = fp8_arguments(dtype, k, args.fast_accum, (m, n) if args.rowwise else None)
    c = torch.randn(m, n, device="cuda").to(dtype if fp8 is None else fp8.out_dtype)
    ex = comm.exchange(collective, m, world)
    overlapped = getattr(flashoverlap, f"gemm_{collective}")
    fallback = resolve(FALLBACK)
    product = plain(ex, None, "nk", 1, fp8)

    def seq(i):  # what a user without flashoverlap runs: the product, then torch.distributed's collective
        return comm.collective(ex, product(a[i % sets], w[i % sets], scales), None)

    def planned(cfg: OverlapConfig):  # its plan, kernel and tables, as the call prepares them
        return prepare(
            m, n, k, dtype, "nk", a[0].device, cfg, 0, comm.interleave(ex, cfg.layout, cfg.reduction), None, fp8
        )

    variants: dict[str, Callable[[int], object]] = {
        "gemm": lambda i: product(a[i % sets], w[i % sets], scales),
        "comm": lambda i: comm.collective(ex, c, None),
        "seq": seq,
        "seq_again": seq,  # the same work again: how far identical variants measure apart here
        # a call decided sequential: what its checks, lookup and allocation add to seq
        "fallback": lambda i: overlapped(a[i % sets], w[i % sets], config=fallback, **kwargs),
    }
    side = torch.cuda.Stream()
    for chunk in chunks:
        variants[f"decomp{chunk}"] = lambda i, chunk=chunk: decomposed(
            a[i % sets], w[i % sets], ex, chunk, side, product, scales, fp8
        )
    # async-TP sets up its symmetric memory before this shape's first flashoverlap call on purpose: on
    # four GPUs whichever of the two sets up second can run slower for the whole process, async-TP
    # more so (docs/experiments.md, "The pulls' speed per process"); this order favours the competitor
    fused = async_tp(a[0], w[0], scales, fp8) if collective == "reduce_scatter" else None
    if fused is not None:
        variants["asynctp"] = lambda i: fused(a[i % sets], w[i % sets])
    # (as a call resolves them: for FP8 operands a config naming no tile takes FP8's)
    cfgs = [for_call(resolve(cfg, fp8 is not None), ex, shape) if cfg is not None else None for cfg in configs]
    errors, picked, kernels = {}, {}, {}  # kernels: config -> the name of its kernel-alone variant
    nccl = args.nccl or ["direct" if comm.uses_direct() else "c10d"]  # none given: the path a call takes
    runs = [(j, path) for j in range(len(cfgs)) for path in nccl]
    for j, path in runs:
        if os.environ.get("FLASHOVERLAP_NCCL") != path:  # read as a call is decided (comm.direct)
            os.environ["FLASHOVERLAP_NCCL"] = path
            state.forget_decisions()
        # a call without config= decides here (timed if untuned); what it runs, as it decided
        got, want = overlapped(a[0], w[0], config=cfgs[j], **kwargs).float(), seq(0).float()
        errors[j, path] = ((got - want).norm() / want.norm()).item()
        decided = decide(a[0], w[0], collective, None, cfgs[j], scales=scales, fp8=fp8)
        if len(nccl) > 1:  # each path's decision, kept: switching paths inside the timing would decide again
            variants[f"fo{j}{path}"] = lambda i, run=decided.run: run(a[i % sets], w[i % sets], scales)
        else:  # "registry" variants call without config=, as a user would (the lookup is part of the call)
            variants[f"fo{j}{path}"] = lambda i, cfg=cfgs[j]: overlapped(a[i % sets], w[i % sets], config=cfg, **kwargs)
        cfg = picked[j, path] = cfgs[j] or decided.config or OverlapConfig(sequential=True)
        if not cfg.sequential and cfg not in kernels:
            kernels[cfg] = f"kernel{len(kernels)}"
            variants[kernels[cfg]] = kernel_alone(planned(cfg), a, w, scales)
    block = args.block or round_calls(m, n, k, *BLOCK)
    samples = time_samples(variants, args.rounds, block, args.warmup, graphs=args.graphs)
    times = {name: slowest(ranks) for name, ranks in samples.items()}

    def faster(name: str) -> float:  # how much faster than seq, round by round (NaN where not timed)
        return paired_speedup(samples["seq"], samples[name]) if name in samples else float("nan")

    rows = []
    t_gemm, t_comm, t_seq = times["gemm"], times["comm"], times["seq"]
    best_chunks = min(chunks, key=lambda ch: times[f"decomp{ch}"])
    t_decomp = times[f"decomp{best_chunks}"]
    t_async = times.get("asynctp", float("nan"))
    ideal = t_seq / max(t_gemm, t_comm)
    for j, path in runs:
        cfg, t_fo, speedup = picked[j, path], times[f"fo{j}{path}"], faster(f"fo{j}{path}")
        plan = None if cfg.sequential else planned(cfg).plan
        rows.append(
            {
                "m": m,
                "n": n,
                "k": k,
                "world": world,
                "collective": collective,
                "dtype": str(dtype).removeprefix("torch."),
                "inputs": inputs,
                "config": config_label(configs[j], cfg, collective)
                + ("" if path == "c10d" else f" nccl={path}")
                + (" fast_accum" if fp8 is not None and fp8.fast_accum else "")
                + (" rowwise" if fp8 is not None and fp8.rowwise else ""),
                "waves": plan.num_waves if plan else "",
                "groups": plan.num_groups if plan else "",
                "t_gemm_ms": t_gemm,
                "t_comm_ms": t_comm,
                "t_seq_ms": t_seq,
                "t_fallback_ms": times["fallback"],
                "t_seq_again_ms": times["seq_again"],
                "t_fo_ms": t_fo,
                "t_kernel_ms": times.get(kernels.get(cfg, ""), float("nan")),
                "t_decomp_ms": t_decomp,
                "decomp_chunks": best_chunks,
                "t_asynctp_ms": t_async,
                "speedup": speedup,
                "fallback_speedup": faster("fallback"),
                "noise_speedup": faster("seq_again"),
                "decomp_speedup": faster(f"decomp{best_chunks}"),
                "asynctp_speedup": faster("asynctp"),
                "ideal_speedup": ideal,
                "of_ideal": speedup / ideal,
                "efficiency": overlap_efficiency(t_seq, t_seq / speedup, t_gemm, t_comm),
                "kernel_vs_cublas": t_gemm / times.get(kernels.get(cfg, ""), float("nan")),
                "rel_err": errors[j, path],
                "block": block,
            }
        )
    labels = {f"fo{j}{path}": row["config"] for (j, path), row in zip(runs, rows)}
    return rows, round_rows(shape, inputs, samples, labels)


def round_rows(
    shape: tuple[int, int, int], inputs: str, samples: dict[str, list[list[float]]], labels: dict[str, str]
) -> list[dict]:
    """One row per variant, rank and round of ``samples`` (timing.time_samples: every rank's ms per
    call, round by round in the order timed); ``labels``: the config of each flashoverlap variant."""
    m, n, k = shape
    return [
        {
            "shape": f"{m}x{n}x{k}",
            "inputs": inputs,
            "variant": name,
            "config": labels.get(name, ""),
            "rank": rank,
            "round": i,
            "ms": ms,
        }
        for name, ranks in samples.items()
        for rank, rounds in enumerate(ranks)
        for i, ms in enumerate(rounds)
    ]


def config_label(given: dict | None, cfg, collective: str) -> str:
    """The CSV/table name of a variant: its JSON, or the registry's pick as ``registry:{...}``."""
    if given is not None:
        return json.dumps(given, sort_keys=True)
    from .config import OverlapConfig, differences
    from .rules import for_collective

    picked = differences(cfg, for_collective(OverlapConfig(), collective))
    return "registry:" + json.dumps(
        {k: list(v) if isinstance(v, tuple) else v for k, v in picked.items()}, sort_keys=True
    )


TRACE_SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: longer than a profiled host takes to enqueue three calls


def rank_trace_path(path: str, rank: int) -> str:
    """Where rank ``rank`` writes its trace: rank 0 at ``path``, the others beside it with
    ``.rank<r>`` before the extension (trace.json -> trace.rank1.json)."""
    if rank == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


def trace_call(shape, config, collective, dtype, path: str) -> None:
    """Profile three overlapped calls (after warm-up), enqueued behind a sleep on the GPU so that the
    GPU runs them at its own pace, not the profiled host's (the timed runs' case: the host is ahead);
    every rank writes its trace (:func:`rank_trace_path`: the ranks' clocks are the host's, so their
    timelines line up), rank 0 prints its kernels."""
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
        torch.cuda._sleep(TRACE_SLEEP_CYCLES)
        for _ in range(3):  # back to back, as in the timed runs
            overlapped(a, w, config=config)
        torch.cuda.synchronize()
    prof.export_chrome_trace(rank_trace_path(path, dist.get_rank()))
    if dist.get_rank() != 0:
        return
    with open(path) as handle:
        events = json.load(handle)["traceEvents"]
    device_cats = ("kernel", "gpu_memset", "gpu_memcpy")
    kernels = sorted(
        (e for e in events if e.get("cat") in device_cats and "spin_kernel" not in e["name"]), key=lambda e: e["ts"]
    )
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


def unrunnable(local_rank: int) -> str | None:
    """Why this process of a torchrun cannot time anything here (None: it can)."""
    if not torch.cuda.is_available():
        return (
            "no CUDA GPU here (torch.cuda.is_available() is False): timing needs one GPU per process; "
            "--from-csv summarises saved results without one"
        )
    if local_rank >= (count := torch.cuda.device_count()):
        return f"local rank {local_rank}, but {count} GPU(s) here: start at most {count} processes per node"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.from_csv:  # no GPUs needed: summarise (and plot) saved results
        try:
            print(report.from_csv(args.from_csv, args.plot))
        except ValueError as exc:
            parser.error(str(exc))
        return 0
    shapes = list(args.shapes or [])
    if args.shapes_file:
        try:
            shapes += load_shapes(args.shapes_file)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
    args.shapes = shapes or [(4096, 8192, 8192)]
    for flag, value in (("--rounds", args.rounds), ("--block", args.block)):  # (--block: None is the default)
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    for flag, given in (("--fast-accum", args.fast_accum), ("--rowwise", args.rowwise)):
        if given and not args.dtype.startswith("float8"):
            parser.error(f"{flag} is for FP8 operands (--dtype float8_e4m3fn), not {args.dtype}")
    os.environ.update(TRANSPORTS[args.transport])  # before NCCL creates its communicators
    if args.graphs:  # "registry" variants: what calls replayed as CUDA graphs take (registry.timing)
        os.environ["FLASHOVERLAP_TIMING"] = "graphs"
    if "RANK" not in os.environ:
        print("run under torchrun, e.g. torchrun --nproc-per-node 2 -m flashoverlap.bench", file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if (why := unrunnable(local_rank)) is not None:
        print(why, file=sys.stderr)
        return 2
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        measured = [bench_shape(shape, args, mode) for shape in args.shapes for mode in INPUTS[args.inputs]]
        rows = [row for shape_rows, _ in measured for row in shape_rows]
        if args.trace:
            trace_call(args.shapes[0], args.configs[0], args.collective, getattr(torch, args.dtype), args.trace)
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name()
            print(
                f"\n{name} x{dist.get_world_size()}, {args.collective}, transport={args.transport}, {args.dtype}, "
                f"ms per call, median of {args.rounds}+ rounds (whole cycles of balanced orders) of "
                + (f"{args.block} calls" if args.block else "{}-{} calls (by the shape's GEMM work)".format(*BLOCK))
                + (", each block one CUDA graph replay (GPU time only)" if args.graphs else "")
            )
            timing = "graphs" if args.graphs else "eager"
            rows = [dict(row, gpu=name, transport=args.transport, timing=timing) for row in rows]
            labelled = report.runs(rows)
            print(report.show(labelled), flush=True)
            if args.csv:
                report.write_csv(args.csv, rows)
            if args.rounds_csv:
                report.write_csv(args.rounds_csv, [r for _, rounds in measured for r in rounds])
            if args.plot:
                report.plot(labelled, args.plot)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
