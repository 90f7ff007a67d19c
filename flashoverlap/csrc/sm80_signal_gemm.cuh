// flashoverlap signal GEMM for Ampere / Ada (sm_80, sm_86, sm_89; also runs on sm_90): CUTLASS 2.x
// tensor-core mainloop (multistage cp.async pipeline) and CUTLASS's epilogue, in a persistent loop
// of our own so that the tile order is the planner's and an SM budget leaves SMs to NCCL.
//
// Same contract as the Hopper family (flashoverlap/plan.py, tile_slot.cuh): CTA j of the grid
// handles scheduler indices j, j + grid, ... of the planner's raster (along N or along M, in
// swizzle panels, over the grid padded to whole panels: schedule_order); tile (mt, nt) is
// written to out[slot.offset + r * slot.ld + c] through CUTLASS's epilogue (the slot is a small
// row-major matrix); once every thread's stores are visible (each thread fences, then the block
// synchronises), thread 0 adds 1 to counters[slot.group] with release semantics. One signal per tile.
//
// The generated translation unit defines Element, LayoutB, and DefaultKernel (a CUTLASS 2.x
// DefaultGemm<...>::GemmKernel) before including this file.
#pragma once

#include <algorithm>
#include <cstdio>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/matrix_coord.h"

#include "raster.cuh"
#include "tile_slot.cuh"

namespace flashoverlap {

template <class Mma, class Epilogue, class OutputOp>
struct Sm80SignalGemm {
  using Element = typename Epilogue::OutputTileIterator::Element;
  static constexpr int kThreads = Mma::WarpCount::kCount * 32;
  static constexpr int kM = Mma::Shape::kM;
  static constexpr int kN = Mma::Shape::kN;
  static constexpr int kK = Mma::Shape::kK;
  static constexpr int kSignalsPerTile = 1;

  union SharedStorage {
    typename Mma::SharedStorage main_loop;
    typename Epilogue::SharedStorage epilogue;
  };

  struct Params {
    cutlass::gemm::GemmCoord problem;
    typename Mma::IteratorA::Params params_a;
    typename Mma::IteratorA::Element const* a;
    typename Mma::IteratorB::Params params_b;
    typename Mma::IteratorB::Element const* b;
    Element* out;
    TileSlot const* tiles;
    uint32_t* counters;
    float const* alpha;  // the accumulators' scale on the device (null: 1)
    int tiles_m;
    int tiles_n;
    int along_m;
    Raster raster;
  };

  CUTLASS_DEVICE void operator()(Params const& p, SharedStorage& smem) const {
    int const thread_idx = threadIdx.x;
    int const warp_idx = __shfl_sync(0xffffffff, thread_idx / 32, 0);  // warp-uniform
    int const lane_idx = thread_idx % 32;
    int const scheduled = p.raster.padded_m * p.raster.padded_n;
    int const k_iterations = (p.problem.k() + kK - 1) / kK;

    for (int index = blockIdx.x; index < scheduled; index += gridDim.x) {
      int mt, nt;
      tile_of(index, p.raster, p.along_m, mt, nt);
      if (mt >= p.tiles_m || nt >= p.tiles_n) {
        continue;  // padding: no tile (uniform over the block)
      }

      typename Mma::IteratorA iterator_a(p.params_a, const_cast<typename Mma::IteratorA::Element*>(p.a),
                                         {p.problem.m(), p.problem.k()}, thread_idx,
                                         cutlass::MatrixCoord{mt * kM, 0});
      typename Mma::IteratorB iterator_b(p.params_b, const_cast<typename Mma::IteratorB::Element*>(p.b),
                                         {p.problem.k(), p.problem.n()}, thread_idx,
                                         cutlass::MatrixCoord{0, nt * kN});
      Mma mma(smem.main_loop, thread_idx, warp_idx, lane_idx);
      typename Mma::FragmentC accumulators;
      accumulators.clear();
      mma(k_iterations, accumulators, iterator_a, iterator_b, accumulators);
      __syncthreads();  // the epilogue reuses the mainloop's shared memory

      TileSlot const slot = p.tiles[tile_id(mt, nt, p)];
      int const rows = min(kM, p.problem.m() - mt * kM);
      int const cols = min(kN, p.problem.n() - nt * kN);
      typename Epilogue::OutputTileIterator::Params params_out{typename Epilogue::OutputTileIterator::Layout(slot.ld)};
      typename Epilogue::OutputTileIterator iterator_out(params_out, p.out + slot.offset, {rows, cols}, thread_idx,
                                                         cutlass::MatrixCoord{0, 0});
      Epilogue epilogue(smem.epilogue, thread_idx, warp_idx, lane_idx);
      typename OutputOp::Params scale(1.0f, 0.0f);  // beta 0: the source is never read
      scale.alpha_ptr = p.alpha;                    // read on the device where given (else alpha 1)
      OutputOp output_op(scale);
      epilogue(output_op, iterator_out, accumulators, iterator_out);

      // Every thread's stores visible at gpu scope before the one release of the counter.
      __threadfence();
      __syncthreads();
      if (thread_idx == 0 && slot.group >= 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p.counters + slot.group) : "memory");
      }
    }
  }

  CUTLASS_DEVICE static int tile_id(int mt, int nt, Params const& p) { return mt * p.tiles_n + nt; }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads) sm80_signal_gemm(typename Kernel::Params params) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 890)
  // RTX 30xx / 40xx: 99 KB of shared memory per block (the generator budgets the stages for it)
  static_assert(sizeof(typename Kernel::SharedStorage) <= 99 * 1024, "tile and stages exceed sm_86/sm_89 shared memory");
#endif
  extern __shared__ __align__(16) char storage[];
  Kernel{}(params, *reinterpret_cast<typename Kernel::SharedStorage*>(storage));
}

}  // namespace flashoverlap

namespace {

using Kernel = flashoverlap::Sm80SignalGemm<typename DefaultKernel::Mma, typename DefaultKernel::Epilogue,
                                            typename DefaultKernel::OutputOp>;

thread_local char g_error[512] = {0};

int fail(char const* what, char const* detail) {
  std::snprintf(g_error, sizeof(g_error), "%s: %s", what, detail);
  return 1;
}

constexpr int kSmemBytes = int(sizeof(typename Kernel::SharedStorage));

// Resident CTAs per SM at this kernel's shared memory and thread count on the current device (0 on
// error). The shared-memory opt-in is a per-device attribute, so it is set once per device.
int blocks_per_sm() {
  constexpr int kDevices = 64;
  static int known[kDevices] = {};  // blocks per SM + 1; 0: not yet asked
  int device = 0, blocks = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    return 0;
  }
  if (device < kDevices && known[device] > 0) {
    return known[device] - 1;
  }
  if (cudaFuncSetAttribute(flashoverlap::sm80_signal_gemm<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kSmemBytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, flashoverlap::sm80_signal_gemm<Kernel>, Kernel::kThreads,
                                                    kSmemBytes) != cudaSuccess) {
    blocks = 0;
  }
  if (device < kDevices) {
    known[device] = blocks + 1;
  }
  return blocks;
}

flashoverlap::Raster raster(int M, int N, int swizzle, int rotate_m = 0, int interleave = 1) {
  return flashoverlap::make_raster((M + Kernel::kM - 1) / Kernel::kM, (N + Kernel::kN - 1) / Kernel::kN, swizzle,
                                   rotate_m, interleave);
}

// Under an SM budget (sm_count below the device's SMs) one CTA per SM: the hardware spreads
// resident blocks over every SM, so two per SM on sm_count SMs' worth would leave none free for NCCL.
int grid_size(int M, int N, int sm_count, int swizzle) {
  flashoverlap::Raster const r = raster(M, N, swizzle);
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  int const blocks = blocks_per_sm();
  long long const per_sm = sm_count < sms ? std::min(blocks, 1) : blocks;
  return int(std::min<long long>((long long)r.padded_m * r.padded_n, (long long)sm_count * per_sm));
}

}  // namespace

extern "C" {

char const* fo_last_error() { return g_error; }

int fo_signals_per_tile() { return Kernel::kSignalsPerTile; }

// Persistent CTAs: at most one per tile and sm_count SMs' worth (see grid_size).
int fo_num_ctas(int M, int N, int, int sm_count, int, int, int swizzle) { return grid_size(M, N, sm_count, swizzle); }

int fo_stream_k_tiles(int, int, int, int, int, int, int) { return 0; }

long long fo_workspace_size(int, int, int, int, int, int, int) { return 0; }

int fo_run(void const* a, void const* b, void* out, void const* tiles, unsigned* counters, void*, float const* alpha,
           float const* row_scale, float const* col_scale, void* result, void const*, unsigned const*, int M, int N,
           int K, int tiles_m, int tiles_n, int sm_count, int, int along_m, int swizzle, int rotate_m, int interleave,
           int keep, int, int, int, int, int, void* stream) {
  if (row_scale != nullptr || col_scale != nullptr) {
    return fail("launch", "rowwise scales need the sm90 kernels' direct epilogue");
  }
  if (result != nullptr) {
    return fail("launch", "sums in the epilogue need the sm90 kernels' direct epilogue");
  }
  if (keep != 0) {  // two resident blocks per SM: CTAs that stop would free no whole SM
    return fail("launch", "a late SM budget needs the sm90 kernels");
  }
  int const grid = grid_size(M, N, sm_count, swizzle);
  if (grid <= 0) {
    return fail("launch", "the kernel cannot be resident on this device (shared memory or threads)");
  }
  using ElementAB = typename DefaultKernel::Mma::IteratorA::Element;
  typename Kernel::Params params{};
  params.problem = cutlass::gemm::GemmCoord(M, N, K);
  params.params_a = typename DefaultKernel::Mma::IteratorA::Params(cutlass::layout::RowMajor(K));
  params.a = static_cast<ElementAB const*>(a);
  params.params_b = typename DefaultKernel::Mma::IteratorB::Params(LayoutB::packed({K, N}));
  params.b = static_cast<ElementAB const*>(b);
  params.out = static_cast<typename Kernel::Element*>(out);
  params.tiles = static_cast<flashoverlap::TileSlot const*>(tiles);
  params.counters = counters;
  params.alpha = alpha;
  params.tiles_m = tiles_m;
  params.tiles_n = tiles_n;
  params.along_m = along_m;
  params.raster = raster(M, N, swizzle, rotate_m, interleave);
  flashoverlap::sm80_signal_gemm<Kernel>
      <<<grid, Kernel::kThreads, kSmemBytes, static_cast<cudaStream_t>(stream)>>>(params);
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : fail("launch", cudaGetErrorString(err));
}

}  // extern "C"
