"""The FP8 signal GEMM alone on every SM against torch._scaled_mm, per tile and accumulation mode.

    python bench/fp8_probe.py [--shapes 8192x8192x8192 ...] [--tiles 256x128 128x128c2 ...]
                              [--accum promoted fast] [--iters 20]

One GPU (Hopper). For each shape: torch._scaled_mm with and without use_fast_accum, and the signal
GEMM (no collective, counters reset after each call) for each tile shape (MxN, cluster cC) with the
tensor cores' partial sums promoted into fp32 accumulators (as _scaled_mm by default) and with CUTLASS's
fast-accumulation mainloop (GemmSpec.fast_accum). Per-tensor scales, bf16 out; median ms over
``--iters`` timed calls after warm-up, operands rotated through sets larger than L2; the error of
each against a float32 product of the scaled operands.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flashoverlap.config import OverlapConfig
from flashoverlap.inputs import Fp8, Scales
from flashoverlap.prepared import Prepared, prepare
from flashoverlap.rules import for_collective
from flashoverlap.timing import input_sets, kernel_alone

TILES = ["128x256", "256x128", "256x128c2", "128x128", "128x128c2"]


def parse_tile(text: str) -> tuple[int, int, int]:
    """A tile as written on the command line, "256x128c2": (tile_m, tile_n, cluster_m)."""
    dims, _, cluster = text.partition("c")
    tile_m, tile_n = (int(v) for v in dims.split("x"))
    return tile_m, tile_n, int(cluster or 1)


def timed(fn, iters: int) -> float:
    """Median ms of ``fn(i)`` over ``iters`` calls, each between two CUDA events, after warm-up."""
    for i in range(3):
        fn(i)
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def prepared(shape: tuple[int, int, int], tile: tuple[int, int, int], fast_accum: bool) -> Prepared:
    """The signal GEMM of ``tile`` on every SM, FP8 e4m3 operands, bf16 out, as a call prepares it."""
    tile_m, tile_n, cluster_m = tile
    cfg = for_collective(OverlapConfig(tile_m=tile_m, tile_n=tile_n, cluster_m=cluster_m, comm_sms=0), "all_reduce")
    device = torch.device("cuda", torch.cuda.current_device())
    return prepare(*shape, torch.float8_e4m3fn, "nk", device, cfg, fp8=Fp8(torch.bfloat16, fast_accum))


def probe(
    shape: tuple[int, int, int], tiles: list[tuple[int, int, int]], accums: list[str], iters: int
) -> dict[str, tuple[float, float]]:
    """{variant: (ms per call, rel err)} for one shape (see the module's docstring)."""
    m, n, k = shape
    fp8 = torch.float8_e4m3fn
    sets = input_sets(m, n, k, fp8, torch.cuda.get_device_properties(0).L2_cache_size)
    a = [torch.randn(m, k, device="cuda").to(fp8) for _ in range(sets)]
    w = [torch.randn(n, k, device="cuda").to(fp8) for _ in range(sets)]
    scales = Scales(torch.ones(1, device="cuda"), torch.full((1,), k**-0.5, device="cuda"))
    ref = (a[0].float() @ w[0].float().t()) * k**-0.5

    def error(out: torch.Tensor) -> float:
        return ((out.float() - ref).norm() / ref.norm()).item()

    rows = {}
    for fast in (accum == "fast" for accum in accums):

        def scaled(i: int, fast: bool = fast) -> torch.Tensor:
            b = w[i % sets].t()
            return torch._scaled_mm(
                a[i % sets], b, scale_a=scales.a, scale_b=scales.b, out_dtype=torch.bfloat16, use_fast_accum=fast
            )

        rows[f"_scaled_mm fast_accum={fast}"] = (timed(scaled, iters), error(scaled(0)))
        for tile in tiles:
            prep = prepared(shape, tile, fast)
            buffer = torch.empty(m * n, dtype=torch.bfloat16, device="cuda")
            prep.launch(a[0], w[0], buffer, torch.cuda.current_stream(), alpha=scales.alpha())
            prep.counters.zero_()
            name = f"signal {tile[0]}x{tile[1]} c{tile[2]} fast_accum={fast}"
            rows[name] = (timed(kernel_alone(prep, a, w, scales), iters), error(buffer.view(m, n)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["8192x8192x8192", "4096x8192x8192", "16384x8192x4096"])
    parser.add_argument("--tiles", nargs="+", default=[parse_tile(t) for t in TILES], type=parse_tile)
    parser.add_argument("--accum", nargs="+", default=["promoted", "fast"], choices=["promoted", "fast"])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}: ms per call (TFLOP/s), rel err against float32")
    for text in args.shapes:
        m, n, k = shape = tuple(int(v) for v in text.split("x"))
        print(f"\n{text}")
        for name, (ms, err) in probe(shape, args.tiles, args.accum, args.iters).items():
            print(f"  {name:42s} {ms:7.3f} ms ({2 * m * n * k / ms / 1e9:5.0f})  rel err {err:.1e}")


if __name__ == "__main__":
    main()
