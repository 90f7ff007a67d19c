// flashoverlap TMA signal epilogue: CUTLASS's own sm90 TMA warp-specialized epilogue (registers ->
// shared memory -> bulk tensor store, the one cuBLAS-class kernels use) plus a deferred counter bump.
//
// Contract with the Python planner (flashoverlap/plan.py, "rows" and "segments" layouts): the output
// buffer is a row-major [M, N] matrix whose tile rows are C's in some order: tile (mt, nt) is stored at
// tile row tiles[mt * tiles_n + nt].offset / (tile_m * N) ("rows": mt itself), tile column nt, and
// tiles[...].group is the counter it counts towards (-1: none). One signal per tile (kSignalsPerTile = 1).
//
// The accumulators leave through shared memory in 128x32 subtiles whose bulk stores overlap the
// conversion of the next subtile (the direct epilogue stalls the tensor cores on every global store
// instead). Only the last subtile's store is still in flight when CUTLASS's epilogue returns; the
// signal waits for it right away. Deferring the wait to the next tile would hide that microsecond
// but delay every group's signal by a whole tile, which puts the second-to-last group's
// communication behind the GEMM's end.
//
// kSums: with FusedSums (tile_slot.cuh), the tiles of the result's rows have the other ranks' partial
// sums added to their accumulators in registers and are stored into the result through a second
// bulk-store descriptor (a reduce-scatter's sums, reduction pull_fused).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

#include "tile_slot.cuh"

namespace flashoverlap {

template <class Base, bool kSums = false>
class TmaSignalEpilogue : public Base {
  struct None {  // (the plain variant's result stores: none, and no second descriptor in its parameters)
    None() = default;
    template <class P, class S>
    CUTLASS_DEVICE None(P const&, S&) {}
  };
  using ResultParams = std::conditional_t<kSums, typename Base::Params, None>;
  using Result = std::conditional_t<kSums, Base, None>;

 public:
  static constexpr int kSignalsPerTile = 1;
  using Element = typename Base::ElementD;

  struct Arguments : Base::Arguments {
    TileSlot const* tiles = nullptr;
    uint32_t* counters = nullptr;
    int tiles_m = 0;
    int tiles_n = 0;
    bool remap_rows = false;  // tile rows stored where their slots say (else at their own row)
    FusedSums fused{};
    float const* alpha = nullptr;  // (the fusion's alpha_ptr: the sums are added before it scales)
  };
  struct Params : Base::Params {
    TileSlot const* tiles;
    uint32_t* counters;
    int tiles_m;
    int tiles_n;
    bool remap_rows;
    FusedSums fused;
    float const* alpha;
    ResultParams result;  // (kSums) the stores into the result: [fused.rows, N]
  };

  // C[M, N] row-major; no source operand (beta = 0); alpha read from the device (null: 1), through the
  // fusion's own alpha_ptr, so the stores and the signal are untouched.
  // No rowwise scales (kRowwise): a row broadcast would need each stored row's logical row.
  static constexpr bool kRowwise = false;
  static constexpr bool kFusedSums = kSums;  // takes FusedSums
  static Arguments make_arguments(Element* out, TileSlot const* tiles, uint32_t* counters, float const* alpha,
                                  float const*, float const*, FusedSums const& fused, int M, int N, int tiles_m,
                                  int tiles_n, bool remap_rows) {
    Arguments args{};
    args.thread.alpha_ptr = alpha;
    args.ptr_C = nullptr;
    args.ptr_D = out;
    args.dD = cute::make_stride(int64_t(N), cute::Int<1>{}, int64_t(M) * N);
    args.dC = args.dD;
    args.tiles = tiles;
    args.counters = counters;
    args.tiles_m = tiles_m;
    args.tiles_n = tiles_n;
    args.remap_rows = remap_rows;
    args.fused = fused;
    args.alpha = alpha;
    return args;
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem, Arguments const& args, void* workspace) {
    Params params{Base::to_underlying_arguments(problem, args, workspace),
                  args.tiles,
                  args.counters,
                  args.tiles_m,
                  args.tiles_n,
                  args.remap_rows,
                  args.fused,
                  args.alpha,
                  {}};
    if constexpr (kSums) {
      if (args.fused.result != nullptr) {
        auto [M, N, K, L] = cute::append<4>(problem, 1);
        typename Base::Arguments into = args;
        into.ptr_D = static_cast<Element*>(args.fused.result);
        into.thread.alpha_ptr = nullptr;  // (alpha 1: add_sums scales the accumulators before the sums)
        into.dD = cute::make_stride(int64_t(N), cute::Int<1>{}, int64_t(args.fused.rows) * N);
        params.result = Base::to_underlying_arguments(cute::make_shape(args.fused.rows, N, K, L), into, workspace);
      }
    }
    return params;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem, Arguments const& args) {
    return Base::can_implement(problem, args) && args.ptr_D != nullptr && args.tiles != nullptr;
  }

  CUTLASS_DEVICE
  TmaSignalEpilogue(Params const& params, typename Base::TensorStorage& shared)
      : Base(params, shared), p_(params), result_(params.result, shared) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma>
  CUTLASS_DEVICE auto store(typename Base::LoadPipeline load_pipeline,
                            typename Base::LoadPipelineState load_pipe_consumer_state,
                            typename Base::StorePipeline store_pipeline,
                            typename Base::StorePipelineState store_pipe_producer_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, typename Base::TensorStorage& shared_tensors,
                            int subtile_idx = -1) {
    int const mt = int(cute::get<0>(tile_coord_mnkl));
    int const nt = int(cute::get<1>(tile_coord_mnkl));
    // The scheduler pads the tile grid to whole clusters; padded tiles own no output (and keep
    // their coordinate, past C's edge, where the bulk store drops them).
    bool const real = mt < p_.tiles_m && nt < p_.tiles_n;
    int64_t const tile = int64_t(mt) * p_.tiles_n + nt;
    int row = mt;
    if (p_.remap_rows && real) {  // only then is the slot read before the store
      row = int(p_.tiles[tile].offset / (int64_t(cute::size<0>(tile_shape_MNK)) * cute::get<1>(problem_shape_mnkl)));
    }
    auto next = [&] {
      if constexpr (kSums) {
        FusedSums const& fused = p_.fused;
        int const tile_m = int(cute::size<0>(tile_shape_MNK));
        int const own = mt * tile_m - fused.row0;  // (uniform over the tile)
        if (real && fused.result != nullptr && own >= 0 && own < fused.rows) {
          add_sums(accumulators, tiled_mma, thread_idx, own, nt * int(cute::size<1>(tile_shape_MNK)),
                   int64_t(cute::get<1>(problem_shape_mnkl)));
          return result_.store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
                               cute::replace<0>(problem_shape_mnkl, fused.rows), tile_shape_MNK,
                               cute::replace<0>(tile_coord_mnkl, own / tile_m), accumulators, tiled_mma, thread_idx,
                               shared_tensors, subtile_idx);
        }
      }
      return Base::store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
                         problem_shape_mnkl, tile_shape_MNK, cute::replace<0>(tile_coord_mnkl, row), accumulators,
                         tiled_mma, thread_idx, shared_tensors, subtile_idx);
    }();
    // Warp 0 issues every bulk store (all of its lanes do), so all of its lanes wait for their bulk
    // groups to complete -- not only to have been read from shared memory -- before lane 0 releases.
    if (thread_idx < 32) {
      int const group = real ? p_.tiles[tile].group : -1;
      if (group >= 0) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        asm volatile("fence.proxy.async.global;" ::: "memory");
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        __syncwarp();
        if (thread_idx == 0) {
          asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p_.counters + group) : "memory");
        }
      }
    }
    return next;
  }

 private:
  // The other ranks' partial sums of the tile at row `own` of the result, column `col`, added to its
  // accumulators scaled by alpha (the result's stores then scale by 1: D = alpha * acc + sums, rounded
  // once, as the direct epilogue's), once the band's ready flag is set.
  // One source per pass (a pass stores nothing, so its loads can be in flight together; through L1:
  // a quad's 16 bytes are half a sector, whose other half the next column pair reads, and no SM read
  // them earlier in this kernel, which began before the copy engines wrote them); whole tiles (the
  // call's decision refuses others: rules.fused_tiles).
  template <class AccEngine, class AccLayout, class TiledMma>
  CUTLASS_DEVICE void add_sums(cute::Tensor<AccEngine, AccLayout>& accumulators, TiledMma tiled_mma, int thread_idx,
                               int own, int col, int64_t ld) const {
    using namespace cute;
    FusedSums const& fused = p_.fused;
    fused.wait_ready(own);
    using TileShape = typename Base::CtaTileMNK;
    Tensor coords = tiled_mma.get_thread_slice(thread_idx).partition_C(make_identity_tensor(take<0, 2>(TileShape{})));
    static_assert(decltype(size(coords))::value == decltype(size(accumulators))::value, "fragment mismatch");
    float const alpha = p_.alpha != nullptr ? *p_.alpha : 1.0f;  // (x 1.0f: exact)
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); ++i) {
      accumulators(i) *= alpha;
    }
    Element const* sources = static_cast<Element const*>(fused.sources) + own * ld + col;
    using Pair = cutlass::AlignedArray<Element, 2, 4>;
    for (int k = 0; k < fused.count; ++k) {
      Element const* source = sources + k * int64_t(fused.rows) * ld;
      int64_t pitch = ld;  // (opaque per pass: the pairs' offsets are computed again, not held in registers)
      asm volatile("" : "+l"(pitch));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accumulators); i += 2) {  // (pairs of columns: wgmma's fragment)
        unsigned const bits =
            __ldca(reinterpret_cast<unsigned const*>(source + get<0>(coords(i)) * pitch + get<1>(coords(i))));
        Pair const& pair = reinterpret_cast<Pair const&>(bits);
        accumulators(i) += float(pair[0]);
        accumulators(i + 1) += float(pair[1]);
      }
    }
  }

  Params const& p_;
  Result result_;  // (kSums) CUTLASS's epilogue storing into the result
};

}  // namespace flashoverlap
