// flashoverlap FP8 mainloop: CUTLASS's sm90 FP8 collective (TMA loads, WGMMA) with the promotion of
// the tensor cores' partial sums done one M atom at a time.
//
// Hopper's FP8 WGMMA adds its products into the accumulators at reduced precision, so a promoted
// FP8 GEMM (torch._scaled_mm's default) lets the tensor cores accumulate one K tile (128 elements)
// into scratch registers and adds those into fp32 accumulators with ordinary FADDs. CUTLASS's
// mainloop keeps a scratch copy of the whole tile's accumulators: a 128x256 or 256x128 tile is
// 128 + 128 registers per thread, which spills (and 128x128 FP8 tiles, which fit, move too many
// operand bytes per FLOP to keep up with cuBLAS). Here the scratch holds one M atom
// (64 rows) of the warp group's slice: with 256x128 tiles each warp group owns two atoms, 128
// accumulator + 64 scratch registers, and promotes each atom right after its own MMAs; the other
// warp group's MMAs keep the tensor cores busy during those adds. Same precision as CUTLASS's
// default (a promotion every 128 K elements: once per K tile of 128, whatever the mainloop
// arguments' mma_promotion_interval says).
//
// Every K tile's shared-memory stage is released as soon as its MMAs are done (they are waited on
// for the promotion anyway), so mma_tail has nothing left to release.
#pragma once

#include "cute/arch/mma_sm90_gmma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace flashoverlap {

template <class Base>
struct Fp8AtomPromotion : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using typename Base::TileShape;
  static_assert(cute::size<2>(TileShape{}) == 128, "one promotion per K tile: 128 FP8 elements, as torch._scaled_mm");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const& /*params*/) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_groups = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    int const warp_group = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_groups(warp_group));
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA,MMA_N,MMA_K,PIPE)
    CUTE_STATIC_ASSERT_V(size<1>(tCrA) == size<1>(accum));  // M
    CUTE_STATIC_ASSERT_V(size<1>(tCrB) == size<2>(accum));  // N
    CUTE_STATIC_ASSERT_V(size<2>(tCrA) == size<2>(tCrB));   // K
    CUTE_STATIC_ASSERT_V(size<3>(tCrA) == size<3>(tCrB));   // PIPE

    Tensor scratch = make_fragment_like(accum(_, 0, _));  // (MMA,MMA_N): one M atom
    clear(accum);
    warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      int const stage = smem_pipe_read.index();
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < size<1>(tCrA); ++m) {
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        warpgroup_fence_operand(scratch);
        warpgroup_arrive();
        CUTLASS_PRAGMA_UNROLL
        for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
          CUTLASS_PRAGMA_UNROLL
          for (int n = 0; n < size<1>(tCrB); ++n) {
            cute::gemm(tiled_mma, tCrA(_, m, k_block, stage), tCrB(_, n, k_block, stage), scratch(_, n));
          }
          tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        warpgroup_wait<0>();
        warpgroup_fence_operand(scratch);
        Tensor row = accum(_, m, _);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(scratch); ++i) {
          row(i) += scratch(i);
        }
      }
      pipeline.consumer_release(smem_pipe_read);  // this stage's MMAs are done
      ++smem_pipe_read;
    }
    warpgroup_fence_operand(accum);
  }

  // mma released every stage it read.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) {}
};

}  // namespace flashoverlap
