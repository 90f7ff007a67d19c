"""Generate the C++ source of one signal-GEMM instance from a :class:`GemmSpec`.

The generated file only names CUTLASS types (tile, cluster, layouts, element); the epilogues
(`csrc/tma_signal_epilogue.cuh`, `csrc/signal_epilogue.cuh`) and the C entry points
(`csrc/launcher.cuh`) are fixed code.
"""

from __future__ import annotations

from dataclasses import dataclass

# What the cooperative warp-specialized sm90 kernel can be generated for. Two consumer
# warpgroups split tile_m, so it is a multiple of 128; tile_m * tile_n is bounded by the
# register file (fp32 accumulators).
TILE_M = (128, 256)
TILE_N = (64, 128, 192, 256)
TILE_K = (64,)
CLUSTER_M = (1, 2)
MAX_TILE_ELEMENTS = 128 * 256
DTYPES = {"bfloat16": "cutlass::bfloat16_t", "float16": "cutlass::half_t"}
WEIGHT_LAYOUTS = {
    # weight [N, K] (torch Linear): B is K-major
    "nk": "cutlass::layout::ColumnMajor",
    # weight [K, N]: B is N-major
    "kn": "cutlass::layout::RowMajor",
}
MMA_THREADS = 256  # cooperative kernel: two consumer warpgroups per tile
SCHEDULERS = {
    # fixed waves of whole tiles
    "persistent": "cutlass::gemm::PersistentScheduler",
    # stream-K: the tiles left over after whole waves are split along K over all CTAs, so a
    # grid that does not divide the tile count (an SM budget) loses no partial wave
    "streamk": "cutlass::gemm::StreamKScheduler",
}
EPILOGUES = {
    # CUTLASS's TMA epilogue (smem -> bulk store, overlapped with the next tile's mainloop), the
    # tile's counter bumped once its bulk store has completed. Writes C in place: "rows" layout.
    "tma": "flashoverlap/csrc/tma_signal_epilogue.cuh",
    # Fragments stored straight from registers to any slot (packed "tiles" layout too); the
    # tensor cores idle while a tile drains.
    "direct": "flashoverlap/csrc/signal_epilogue.cuh",
}


@dataclass(frozen=True)
class GemmSpec:
    """One compiled GEMM: C[M, N] = A[M, K] @ B, bf16/fp16 in, fp32 accumulate."""

    dtype: str = "bfloat16"
    weight_layout: str = "nk"
    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    cluster_m: int = 1
    scheduler: str = "persistent"
    epilogue: str = "tma"
    arch: str = "sm_90a"

    def __post_init__(self) -> None:
        problems = validate_instance(self.tile_m, self.tile_n, self.tile_k, self.cluster_m, self.scheduler)
        if self.epilogue not in EPILOGUES:
            problems.append(f"epilogue {self.epilogue!r} not in {sorted(EPILOGUES)}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            problems.append(f"weight_layout {self.weight_layout!r} not in {sorted(WEIGHT_LAYOUTS)}")
        if problems:
            raise ValueError("invalid GEMM instance: " + "; ".join(problems))

    @property
    def name(self) -> str:
        return (
            f"fo_gemm_{self.dtype}_{self.weight_layout}_{self.tile_m}x{self.tile_n}x{self.tile_k}"
            f"_c{self.cluster_m}x1_{self.scheduler}_{self.epilogue}_{self.arch}"
        )


def validate_instance(tile_m: int, tile_n: int, tile_k: int, cluster_m: int, scheduler: str) -> list[str]:
    """Reasons the generator cannot make this instance (empty when it can)."""
    problems = []
    if tile_m not in TILE_M:
        problems.append(f"tile_m {tile_m} not in {TILE_M}")
    if tile_n not in TILE_N:
        problems.append(f"tile_n {tile_n} not in {TILE_N}")
    if tile_k not in TILE_K:
        problems.append(f"tile_k {tile_k} not in {TILE_K}")
    if cluster_m not in CLUSTER_M:
        problems.append(f"cluster_m {cluster_m} not in {CLUSTER_M}")
    if scheduler not in SCHEDULERS:
        problems.append(f"scheduler {scheduler!r} not in {sorted(SCHEDULERS)}")
    if tile_m * tile_n > MAX_TILE_ELEMENTS:
        problems.append(f"tile {tile_m}x{tile_n} exceeds {MAX_TILE_ELEMENTS} accumulators per CTA")
    return problems


def generate(spec: GemmSpec) -> str:
    """C++ translation unit for ``spec``; compiled by :func:`flashoverlap.jit.build`."""
    if spec.epilogue == "tma":
        epilogue = """using EpilogueBase = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor, kAlignment,
    Element, cutlass::layout::RowMajor, kAlignment,
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
using Epilogue = flashoverlap::TmaSignalEpilogue<EpilogueBase>;
using CollectiveEpilogue = Epilogue;"""
        check = ""
    else:
        epilogue = f"""using Epilogue = flashoverlap::SignalEpilogue<Element, TileShape, {MMA_THREADS}>;
using CollectiveEpilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Epilogue>;"""
        check = """static_assert(Epilogue::kSignalsPerTile * 32 == size(typename CollectiveMainloop::TiledMma{}),
              "one signal per consumer warp");
"""
    header = EPILOGUES[spec.epilogue].rsplit("/", 1)[1]
    return f"""// Generated by flashoverlap.gemm.generator for {spec.name}. Do not edit.
#include "{header}"

#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace {{
using namespace cute;
using Element = {DTYPES[spec.dtype]};
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = {WEIGHT_LAYOUTS[spec.weight_layout]};
using TileShape = Shape<_{spec.tile_m}, _{spec.tile_n}, _{spec.tile_k}>;
using ClusterShape = Shape<_{spec.cluster_m}, _1, _1>;
constexpr int kAlignment = 8;  // 16 bytes: TMA needs 16-byte aligned strides

{epilogue}

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    Element, LayoutA, kAlignment,
    Element, LayoutB, kAlignment,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, {SCHEDULERS[spec.scheduler]}>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
{check}}}  // namespace

#include "launcher.cuh"
"""
