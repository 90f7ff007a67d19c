"""Build GEMM instances into the kernel cache ahead of time, several nvcc processes at once.

    python bench/precompile.py --jobs 8 bfloat16:nk:128x256:1 float16:nk:128x256:1:streamk:direct
    python bench/precompile.py bfloat16:nk:128x256:1:persistent:direct:sm_89   (Ampere/Ada family)
(dtype:weight_layout:tile_mxtile_n:cluster_m[:scheduler[:epilogue[:arch]]], tile_k the family's
default), so that timed runs never include a compile.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

from flashoverlap import jit
from flashoverlap.gemm import GemmSpec, generate
from flashoverlap.gemm.generator import FAMILIES, family_of


def parse_spec(text: str) -> GemmSpec:
    dtype, layout, tile, cluster, *rest = text.split(":")
    tile_m, tile_n = (int(v) for v in tile.split("x"))
    scheduler, epilogue, arch = rest + ["persistent", "tma", "sm_90a"][len(rest) :]
    family = family_of(arch)
    return GemmSpec(
        dtype=dtype,
        weight_layout=layout,
        tile_m=tile_m,
        tile_n=tile_n,
        cluster_m=int(cluster),
        scheduler=scheduler,
        epilogue=epilogue,
        arch=arch,
        tile_k=FAMILIES[family]["tile_k"][0] if family else 64,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", type=parse_spec)
    parser.add_argument("--jobs", type=int, default=4)
    args = parser.parse_args()
    jit.build_runtime()
    with ThreadPoolExecutor(args.jobs) as pool:
        for path in pool.map(lambda s: jit.build(s.name, generate(s), arch=s.arch, cutlass=True), args.specs):
            print(path)


if __name__ == "__main__":
    main()
