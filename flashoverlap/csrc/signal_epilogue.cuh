// flashoverlap signal epilogue for CUTLASS 3.x sm90 warp-specialized GEMMs.
//
// Contract with the Python planner (flashoverlap/plan.py):
//   tiles[mt * tiles_n + nt] = {offset, ld, group}: the tile's rows*cols valid elements go to
//   out[offset + r * ld + c]; once every consumer warp has stored its part, each warp adds 1
//   to counters[group] with release semantics (group < 0: no signal). A group is complete when
//   its counter reaches tiles_in_group * kSignalsPerTile. Accumulators are scaled by *alpha (null: 1)
//   and, where given, by row_scale[row] and col_scale[col] of C (FP8's rowwise scales, as
//   torch._scaled_mm's [M, 1] and [1, N]): the row is the tile's own, whatever slot it goes to.
//   With FusedSums (tile_slot.cuh), the tiles of its rows go to its result instead, with the other
//   ranks' partial sums of them added (a reduce-scatter's sums, kFusedSums).
// Nothing else differs from a plain GEMM: the mainloop is CUTLASS's, untouched.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/array.h"
#include "cutlass/gemm/gemm.h"

#include "tile_slot.cuh"

namespace flashoverlap {

// kSums: the variant that takes FusedSums (its own kernels: the passes below cost the plain kernels'
// register allocation a spill, ptxas).
template <class Element_, class TileShape_, int kMmaThreads, bool kSums = false>
class SignalEpilogue {
 public:
  using Element = Element_;
  // The kernel layer reads these names; C is never loaded (no source operand).
  using ElementC = Element;
  using ElementD = Element;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using ThreadEpilogueOp = void;  // the device adapter names it; there is no thread-level op

  static constexpr int kSignalsPerTile = kMmaThreads / 32;
  static constexpr bool kRowwise = !kSums;  // takes row_scale / col_scale
  static constexpr bool kFusedSums = kSums;  // takes FusedSums

  struct SharedStorage {};
  using TensorStorage = SharedStorage;

  struct Arguments {
    Element* out = nullptr;
    TileSlot const* tiles = nullptr;
    uint32_t* counters = nullptr;
    int tiles_m = 0;
    int tiles_n = 0;
    float const* alpha = nullptr;
    float const* row_scale = nullptr;
    float const* col_scale = nullptr;
    FusedSums fused{};
  };
  using Params = Arguments;

  // out is the group buffer; tiles[] places each tile in it (M, N only bound the tiles; every slot is
  // read, so rows are where the slots say in any case).
  static Arguments make_arguments(Element* out, TileSlot const* tiles, uint32_t* counters, float const* alpha,
                                  float const* row_scale, float const* col_scale, FusedSums const& fused, int, int,
                                  int tiles_m, int tiles_n, bool) {
    return {out, tiles, counters, tiles_m, tiles_n, alpha, row_scale, col_scale, fused};
  }

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.out != nullptr && args.tiles != nullptr;
  }

  CUTLASS_HOST_DEVICE
  SignalEpilogue(Params const& params, SharedStorage const& = SharedStorage()) : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    constexpr int kBM = size<0>(BlockShapeMNK{});
    constexpr int kBN = size<1>(BlockShapeMNK{});

    int const mt = int(get<0>(blk_coord_mnkl));
    int const nt = int(get<1>(blk_coord_mnkl));
    // The scheduler pads the tile grid to whole clusters; padded tiles own no output.
    if (mt >= params_.tiles_m || nt >= params_.tiles_n) {
      return;
    }
    TileSlot const slot = params_.tiles[int64_t(mt) * params_.tiles_n + nt];
    int const rows = min(kBM, int(get<0>(problem_shape_mnkl)) - mt * kBM);
    int const cols = min(kBN, int(get<1>(problem_shape_mnkl)) - nt * kBN);
    Element* out = params_.out + slot.offset;
    int64_t ld = slot.ld;
    float const alpha = params_.alpha != nullptr ? *params_.alpha : 1.0f;  // x 1.0f: exact

    // A tile of the fused sums' rows: into the result, once the other ranks' rows of it are here.
    Element const* sources = nullptr;
    int64_t source_stride = 0;
    if constexpr (kSums) {
      FusedSums const& fused = params_.fused;
      int const row = mt * kBM - fused.row0;  // (uniform over the tile: no divergence)
      if (fused.result != nullptr && row >= 0 && row < fused.rows) {
        ld = int64_t(get<1>(problem_shape_mnkl));
        out = static_cast<Element*>(fused.result) + row * ld + nt * kBN;
        sources = static_cast<Element const*>(fused.sources) + row * ld + nt * kBN;
        source_stride = int64_t(fused.rows) * ld;
        fused.wait_ready(row);
      }
    }

    // Tile-local (row, col) of every accumulator element this thread holds.
    Tensor coords = tiled_mma.get_thread_slice(thread_idx).partition_C(make_identity_tensor(take<0, 2>(blk_shape_mnk)));
    static_assert(decltype(size(coords))::value == decltype(size(accumulators))::value, "fragment mismatch");
    static_assert(decltype(size(accumulators))::value % 2 == 0, "fragment holds column pairs");

    using Pair = cutlass::AlignedArray<Element, 2, 4>;
    if constexpr (kSums) {
      if (sources != nullptr) {
        // The other ranks' partial sums added to the scaled accumulators in place (their last
        // use: the next tile's mainloop starts them from zero), one source per pass: a pass stores
        // nothing, so its loads can be in flight together (through L1: a quad's 16 bytes are half a
        // sector, whose other half the next column pair reads; no SM read them earlier in this
        // kernel, which began before the copy engines wrote them). Whole tiles and per-tensor scales
        // only (the call's decision refuses others: rules.fused_tiles, rules.for_rowwise).
        auto& sums = const_cast<cute::Tensor<FrgEngine, FrgLayout>&>(accumulators);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(sums); ++i) {
          sums(i) *= alpha;
        }
        for (int k = 0; k < params_.fused.count; ++k) {
          Element const* source = sources + k * source_stride;
          int64_t pitch = ld;  // (opaque per pass: the pairs' offsets are computed again, not held in registers)
          asm volatile("" : "+l"(pitch));
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(sums); i += 2) {
            int const r = get<0>(coords(i));
            int const c = get<1>(coords(i));
            unsigned const bits = __ldca(reinterpret_cast<unsigned const*>(source + r * pitch + c));
            Pair const& pair = reinterpret_cast<Pair const&>(bits);
            sums(i) += float(pair[0]);
            sums(i + 1) += float(pair[1]);
          }
        }
      }
    }
    cutlass::NumericArrayConverter<Element, float, 2, cutlass::FloatRoundStyle::round_to_nearest> convert;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); i += 2) {
      // wgmma accumulators hold (row, col), (row, col + 1) at i, i + 1; cols and col are even
      // (N % 8 == 0 is checked on the host), so a pair is either wholly inside or outside.
      int const r = get<0>(coords(i));
      int const c = get<1>(coords(i));
      if (r < rows && c < cols) {
        cutlass::Array<float, 2> acc;
        float const scale = kSums && sources != nullptr ? 1.0f : alpha;  // (the sums are scaled already)
        acc[0] = scale * accumulators(i);
        acc[1] = scale * accumulators(i + 1);
        if (!kSums && params_.row_scale != nullptr) {  // (uniform over the kernel: no divergence)
          float const row = params_.row_scale[mt * kBM + r];
          float const* col = params_.col_scale + nt * kBN + c;
          acc[0] = accumulators(i) * row * col[0];
          acc[1] = accumulators(i + 1) * row * col[1];
        }
        auto v = convert(acc);
        *reinterpret_cast<Pair*>(out + int64_t(r) * ld + c) = reinterpret_cast<Pair const&>(v);
      }
    }

    if (slot.group >= 0) {
      // Every lane's stores are ordered before lane 0's release by the warp barrier; the
      // release at gpu scope makes them visible to whoever observes the counter.
      __syncwarp();
      if ((threadIdx.x & 31) == 0) {
        uint32_t* counter = params_.counters + slot.group;
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
      }
    }
  }

 private:
  Params params_;
};

}  // namespace flashoverlap
