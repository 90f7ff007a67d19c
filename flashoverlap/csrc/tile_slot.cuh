// Where one output tile lives in a group buffer; mirrors flashoverlap.plan.SLOT_DTYPE.
#pragma once

#include <cstdint>

namespace flashoverlap {

struct TileSlot {
  int64_t offset;  // element offset of the tile's (0, 0) in the output buffer
  int32_t ld;      // leading dimension (elements) of the tile in the output buffer
  int32_t group;   // counter index, or -1 for no signal
};
static_assert(sizeof(TileSlot) == 16, "TileSlot layout is shared with Python");

// A reduce-scatter's sums in the epilogue (flashoverlap reduction "pull_fused"): the tiles of C's rows
// [row0, row0 + rows) -- this rank's own segment, which its schedule computes last -- are stored at
// result[(row - row0) * N + col] as their scaled accumulators plus the `count` partial sums of the same
// elements in `sources` (the k-th at sources + k * rows * N: the other ranks' rows, copied here on the
// copy engines while the GEMM ran), rounded once, after ready[(row - row0) / ready_rows] turns
// non-zero (those rows' copies have landed). The sums then cost no SM beside the GEMM and no pass
// after it. result null: none (every tile goes to its slot).
struct FusedSums {
  void* result = nullptr;
  void const* sources = nullptr;
  uint32_t const* ready = nullptr;
  int row0 = 0;
  int rows = 0;
  int count = 0;
  int ready_rows = 1;

#ifdef __CUDACC__
  // Until the ready flag of the band holding row `row` (of the result) is set: one lane per warp
  // polls (acquire, system scope: the copy engines' stream wrote it), the warp barrier orders the
  // others' loads after it.
  __device__ void wait_ready(int row) const {
    if ((threadIdx.x & 31) == 0) {
      uint32_t const* flag = ready + row / ready_rows;
      uint32_t seen;
      do {
        asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
      } while (seen == 0);
    }
    __syncwarp();
  }
#endif
};

}  // namespace flashoverlap
