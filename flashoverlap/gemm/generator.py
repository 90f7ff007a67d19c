"""Generate the C++ source of one signal-GEMM instance from a :class:`GemmSpec`.

The generated file only names CUTLASS types (tile, cluster, layouts, elements); the epilogues
(`csrc/tma_signal_epilogue.cuh`, `csrc/signal_epilogue.cuh`) and the C entry points
(`csrc/launcher.cuh`) are fixed code.
"""

from __future__ import annotations

from dataclasses import dataclass

# Kernel families. sm90: CUTLASS 3.x warp-specialized cooperative kernel (TMA + WGMMA) for Hopper;
# two consumer warpgroups split tile_m, so it is a multiple of 128. sm80: CUTLASS 2.x multistage
# kernel (cp.async + mma.sync) for Ampere / Ada (and Hopper, without its TMA/WGMMA), in our own
# persistent loop (csrc/sm80_signal_gemm.cuh); tile_k 32 keeps 3-4 stages within the ~99 KB of
# shared memory of consumer GPUs. In both, tile_m * tile_n is bounded by the register file.
FAMILIES = {
    "sm90": {
        "archs": ("sm_90a",),
        "tile_m": (128, 256),
        "tile_n": (64, 128, 192, 256),
        "tile_k": (64,),
        "fp8_tile_k": (128,),  # 128 bytes, like the 16-bit 64: one 128-byte swizzle atom per row
        "cluster_m": (1, 2),
        "schedulers": ("persistent", "streamk"),
        "epilogues": ("tma", "direct"),
    },
    "sm80": {
        "archs": ("sm_80", "sm_86", "sm_89", "sm_90"),
        "tile_m": (64, 128, 256),
        "tile_n": (64, 128, 256),
        "tile_k": (32,),
        "fp8_tile_k": (64,),  # 64 bytes, like the 16-bit 32 (the same shared memory per stage)
        "cluster_m": (1,),
        "schedulers": ("persistent",),
        "epilogues": ("direct",),
    },
}
MAX_TILE_ELEMENTS = 128 * 256
SM80_SMEM_BUDGET = 80 * 1024  # mainloop stages within consumer GPUs' ~99 KB per block
DTYPES = {"bfloat16": "cutlass::bfloat16_t", "float16": "cutlass::half_t"}  # outputs, and 16-bit inputs
# FP8 operands (torch.float8_e4m3fn is CUTLASS's float_e4m3_t: finite, NaN but no infinity). Hopper's
# FP8 WGMMA and Ada's FP8 mma.sync read both operands K-major, so the weight is [N, K] ("nk"); a K
# tile holds as many bytes as the 16-bit kernels' (FAMILIES' fp8_tile_k). The output stays bf16 /
# fp16 (``dtype``); per-tensor scales reach the epilogue as alpha.
FP8_DTYPES = {"float8_e4m3fn": "cutlass::float_e4m3_t", "float8_e5m2": "cutlass::float_e5m2_t"}
INPUT_DTYPES = {**DTYPES, **FP8_DTYPES}
FP8_ARCHS = ("sm_89", "sm_90", "sm_90a")  # FP8 tensor cores: Ada on
WEIGHT_LAYOUTS = {
    # weight [N, K] (torch Linear): B is K-major
    "nk": "cutlass::layout::ColumnMajor",
    # weight [K, N]: B is N-major
    "kn": "cutlass::layout::RowMajor",
}
MMA_THREADS = 256  # cooperative kernel: two consumer warpgroups per tile
SCHEDULERS = {
    # fixed waves of whole tiles; CUTLASS's, with the tile rows optionally walked from a given row
    # on (csrc/rotating_scheduler.cuh)
    "persistent": "flashoverlap::RotatingScheduler",
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
    """One compiled GEMM: C[M, N] = alpha * A[M, K] @ B, fp32 accumulate, ``dtype`` out (bf16 / fp16);
    ``input_dtype`` (A and B): ``dtype`` itself (None) or FP8 (sm_89 on, weight "nk")."""

    dtype: str = "bfloat16"
    weight_layout: str = "nk"
    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    cluster_m: int = 1
    scheduler: str = "persistent"
    epilogue: str = "tma"
    arch: str = "sm_90a"
    input_dtype: str | None = None  # None: dtype (normalised, so that equal instances compare equal)
    # FP8: the tensor cores' partial sums kept in their own accumulators, never promoted into fp32
    # ones (torch._scaled_mm's use_fast_accum): fewer registers and instructions, less accurate over long K
    fast_accum: bool = False
    # the epilogue's variant (TMA or direct) that adds a reduce-scatter's other partial sums into its
    # own rows (reduction "pull_fused", csrc/tile_slot.cuh FusedSums): kernels of their own, since its
    # passes cost the plain direct kernels a register spill
    sums: bool = False

    def __post_init__(self) -> None:
        if self.input_dtype is None:
            object.__setattr__(self, "input_dtype", self.dtype)
        family = family_of(self.arch)
        if family is None:
            archs = [a for f in FAMILIES.values() for a in f["archs"]]
            raise ValueError(f"invalid GEMM instance: arch {self.arch!r} not in {archs}")
        if self.input_dtype in FP8_DTYPES and self.arch not in FP8_ARCHS:
            archs = ", ".join(FP8_ARCHS)
            raise ValueError(f"invalid GEMM instance: FP8 needs FP8 tensor cores ({archs}), not {self.arch}")
        problems = validate_instance(
            self.tile_m, self.tile_n, self.tile_k, self.cluster_m, self.scheduler, family, self.input_dtype
        )
        epilogues = list(FAMILIES[family]["epilogues"])
        if self.epilogue not in epilogues:
            problems.append(f"epilogue {self.epilogue!r} not in {epilogues} ({family} kernels)")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if self.sums and family != "sm90":
            problems.append("sums (a reduce-scatter's, in the epilogue) are the sm90 kernels'")
        if self.fast_accum and (self.input_dtype not in FP8_DTYPES or family != "sm90"):
            # (Ada's FP8 mma.sync accumulates in fp32 itself: nothing to promote)
            problems.append("fast_accum is for FP8 inputs on the sm90 kernels")
        if self.input_dtype in FP8_DTYPES:
            if self.weight_layout != "nk":
                problems.append(
                    f"FP8 inputs need weight_layout 'nk' (FP8 tensor cores read B K-major), got {self.weight_layout!r}"
                )
        elif self.input_dtype not in INPUT_DTYPES:
            problems.append(f"input_dtype {self.input_dtype!r} not in {sorted(INPUT_DTYPES)}")
        elif self.input_dtype != self.dtype:
            problems.append(
                f"16-bit inputs give their own dtype: input_dtype {self.input_dtype!r}, dtype {self.dtype!r}"
            )
        if self.weight_layout not in WEIGHT_LAYOUTS:
            problems.append(f"weight_layout {self.weight_layout!r} not in {sorted(WEIGHT_LAYOUTS)}")
        if problems:
            raise ValueError("invalid GEMM instance: " + "; ".join(problems))

    @property
    def family(self) -> str:
        return family_of(self.arch)

    @property
    def name(self) -> str:
        # 16-bit instances keep the names they had before FP8 (caches, precompile lists)
        types = self.dtype if self.input_dtype == self.dtype else f"{self.input_dtype}_{self.dtype}"
        return (
            f"fo_gemm_{types}_{self.weight_layout}_{self.tile_m}x{self.tile_n}x{self.tile_k}"
            f"_c{self.cluster_m}x1_{self.scheduler}_{self.epilogue}{'_sums' * self.sums}"
            f"{'_fastaccum' * self.fast_accum}_{self.arch}"
        )


def family_of(arch: str) -> str | None:
    """The kernel family that builds for ``arch`` (None: none)."""
    return next((name for name, f in FAMILIES.items() if arch in f["archs"]), None)


def validate_instance(
    tile_m: int,
    tile_n: int,
    tile_k: int,
    cluster_m: int,
    scheduler: str,
    family: str = "sm90",
    input_dtype: str | None = None,
) -> list[str]:
    """Reasons the generator cannot make this instance of ``family`` (empty when it can);
    ``input_dtype`` None: 16-bit operands."""
    allowed = FAMILIES[family]
    if input_dtype in FP8_DTYPES:
        allowed = {**allowed, "tile_k": allowed["fp8_tile_k"]}
    problems = []
    for name, value, key in (
        ("tile_m", tile_m, "tile_m"),
        ("tile_n", tile_n, "tile_n"),
        ("tile_k", tile_k, "tile_k"),
        ("cluster_m", cluster_m, "cluster_m"),
    ):
        if value not in allowed[key]:
            problems.append(f"{name} {value} not in {allowed[key]}")
    if scheduler not in allowed["schedulers"]:
        problems.append(f"scheduler {scheduler!r} not in {sorted(allowed['schedulers'])}")
    if tile_m * tile_n > MAX_TILE_ELEMENTS:
        problems.append(f"tile {tile_m}x{tile_n} exceeds {MAX_TILE_ELEMENTS} accumulators per CTA")
    if problems and family != "sm90":
        problems = [f"{p} ({family} kernels)" for p in problems]
    return problems


def generate(spec: GemmSpec) -> str:
    """C++ translation unit for ``spec``; compiled by :func:`flashoverlap.jit.build`."""
    if spec.family == "sm80":
        return _generate_sm80(spec)
    sums = "true" if spec.sums else "false"
    if spec.epilogue == "tma":
        epilogue = f"""using EpilogueBase = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor, kAlignment,
    Element, cutlass::layout::RowMajor, kAlignment,
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
using Epilogue = flashoverlap::TmaSignalEpilogue<EpilogueBase, {sums}>;
using CollectiveEpilogue = Epilogue;"""
        check = ""
    else:
        epilogue = f"""using Epilogue = flashoverlap::SignalEpilogue<Element, TileShape, {MMA_THREADS}, {sums}>;
using CollectiveEpilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Epilogue>;"""
        check = """static_assert(Epilogue::kSignalsPerTile * 32 == size(typename CollectiveMainloop::TiledMma{}),
              "one signal per consumer warp");
"""
    header = EPILOGUES[spec.epilogue].rsplit("/", 1)[1]
    # With FP8 operands the builder takes CUTLASS's FP8 mainloop, whose promotion of the tensor cores'
    # partial sums into fp32 accumulators (torch._scaled_mm's default, use_fast_accum=False) we replace
    # by one whose scratch registers cover one 64-row M atom, not the whole tile: half as many for a
    # 256x128 tile, which then fits the register file (csrc/fp8_promotion.cuh).
    # KernelTmaWarpSpecializedCooperativeFP8FastAccum (spec.fast_accum) promotes nothing: fewer
    # registers and instructions, less accurate over long K.
    schedule = "KernelTmaWarpSpecializedCooperative" + "FP8FastAccum" * spec.fast_accum
    promoted = spec.input_dtype in FP8_DTYPES and not spec.fast_accum
    mainloop, include, wrap = (
        (
            "MainloopBase",
            '#include "fp8_promotion.cuh"\n',
            "using CollectiveMainloop = flashoverlap::Fp8AtomPromotion<MainloopBase>;\n",
        )
        if promoted
        else ("CollectiveMainloop", "", "")
    )
    alignment_in = 16 if spec.input_dtype in FP8_DTYPES else 8  # elements of A and B in 16 bytes
    return f"""// Generated by flashoverlap.gemm.generator for {spec.name}. Do not edit.
#include "{header}"

#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "rotating_scheduler.cuh"
{include}
namespace {{
using namespace cute;
using Element = {DTYPES[spec.dtype]};  // C
using ElementIn = {INPUT_DTYPES[spec.input_dtype]};  // A and B
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = {WEIGHT_LAYOUTS[spec.weight_layout]};
using TileShape = Shape<_{spec.tile_m}, _{spec.tile_n}, _{spec.tile_k}>;
using ClusterShape = Shape<_{spec.cluster_m}, _1, _1>;
// 16 bytes: TMA needs 16-byte aligned strides
constexpr int kAlignment = 8;
constexpr int kAlignmentIn = {alignment_in};

{epilogue}

using {mainloop} = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementIn, LayoutA, kAlignmentIn,
    ElementIn, LayoutB, kAlignmentIn,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::{schedule}>::CollectiveOp;
{wrap}
using Kernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, {SCHEDULERS[spec.scheduler]}>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
{check}}}  // namespace

#include "launcher.cuh"
"""


# Most warps per CTA of an FP8 tile in 64x32 warps: their 226 registers a thread (ptxas, sm_89)
# for 256 threads fill the register file once
SM80_FP8_WARPS = 8


def _generate_sm80(spec: GemmSpec) -> str:
    warp_m, warp_n = min(64, spec.tile_m // 2), min(64, spec.tile_n // 2)
    fp8 = spec.input_dtype in FP8_DTYPES
    if fp8 and (spec.tile_m // warp_m) * (spec.tile_n // min(warp_n, 32)) <= SM80_FP8_WARPS:
        # 64x64 warps of 8-bit operands spill (128x128x64: 255 registers and 716 bytes of spills a
        # thread, sm_89; 64x32: 226 registers, none); larger tiles keep them (16 such warps would need
        # twice the register file)
        warp_n = min(warp_n, 32)
    stage_bytes = (spec.tile_m + spec.tile_n) * spec.tile_k * (1 if fp8 else 2)
    stages = max(2, min(4, SM80_SMEM_BUDGET // stage_bytes))
    # FP8 operands: Ada's mma.sync.m16n8k32 (CUTLASS's Sm89 path), 16-element (16-byte) loads. The
    # 16-bit source stays as it was (the kernel cache keys on it).
    ab, align, arch, instruction = (
        ("ElementIn", "kAlignmentIn", "Sm89", "16, 8, 32") if fp8 else ("Element", "kAlignment", "Sm80", "16, 8, 16")
    )
    operands = (
        f"using ElementIn = {INPUT_DTYPES[spec.input_dtype]};  // A and B\nconstexpr int kAlignmentIn = 16;\n"
        if fp8
        else ""
    )
    return f"""// Generated by flashoverlap.gemm.generator for {spec.name}. Do not edit.
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/kernel/default_gemm.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

namespace {{
using Element = {DTYPES[spec.dtype]};
using LayoutB = {WEIGHT_LAYOUTS[spec.weight_layout]};
constexpr int kAlignment = 8;  // 16-byte cp.async and stores
{operands}using DefaultKernel = typename cutlass::gemm::kernel::DefaultGemm<
    {ab}, cutlass::layout::RowMajor, {align},
    {ab}, LayoutB, {align},
    Element, cutlass::layout::RowMajor, float,
    cutlass::arch::OpClassTensorOp, cutlass::arch::{arch},
    cutlass::gemm::GemmShape<{spec.tile_m}, {spec.tile_n}, {spec.tile_k}>,
    cutlass::gemm::GemmShape<{warp_m}, {warp_n}, {spec.tile_k}>,
    cutlass::gemm::GemmShape<{instruction}>,
    cutlass::epilogue::thread::LinearCombination<Element, kAlignment, float, float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>,
    {stages}, false, cutlass::arch::OpMultiplyAdd>::GemmKernel;
}}  // namespace

#include "sm80_signal_gemm.cuh"
"""
