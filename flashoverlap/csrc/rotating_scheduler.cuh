// CUTLASS's sm90 persistent tile scheduler, with its tile rows walked from row `rotate_m` on
// (wrapping around). With rows split into per-rank segments (reduce-scatter, all-to-all), rank r
// starts at segment r + 1: every rank computes the rows it sends first and the rows it keeps last,
// so at each step all ranks send and receive at once and the last groups need no communication.
// Or, with `interleave` > 1 segments (the "segments" layout), the segments' tile rows walked
// interleaved, a unit (cluster x swizzle panel rows) of each in turn (raster.cuh, interleaved_row).
// rotate_m = 0, interleave = 1 is CUTLASS's schedule. Planned by flashoverlap.plan.schedule_order.
// With `keep` > 0 (a late SM budget) the whole grid works the first `after` waves and then only its
// first `keep` CTAs go on: the others exit, and NCCL's kernels, queued behind the GEMM, take their
// SMs (plan.late_after picks `after` so that the GEMM keeps its wave count; plan.wave_of_index).
#pragma once

#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

#include "raster.cuh"

namespace flashoverlap {

struct RotatingScheduler {};  // the tag the generated kernels name

class RotatingTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    int rotate_m = 0;    // tile rows; a multiple of the cluster and swizzle rows, with no padded rows
    int interleave = 1;  // segments, each a whole number of units, with no padded rows
    int keep = 0;        // CTAs that go on after `after` waves (0: all, CUTLASS's schedule)
    int after = 0;
  };
  struct Params : Base::Params {
    int rotate_m = 0;
    int interleave = 1;
    int keep = 0;
    int after = 0;
    int unit = 1;  // tile rows walked together: cluster rows x swizzle panel
    int tiles_m = 1;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape tile, ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw, Arguments const& args,
                                        void* workspace = nullptr, uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<Base::Params&>(params) = Base::to_underlying_arguments(
        problem, tile, cluster, hw, args, workspace, epilogue_subtile, ktile_start_alignment_count);
    params.rotate_m = args.rotate_m;
    params.interleave = args.interleave;
    params.keep = args.keep;
    params.after = args.after;
    params.unit = int(params.cluster_shape_m_) << params.log_swizzle_size_;
    params.tiles_m = int(cute::ceil_div(cute::get<0>(problem), cute::get<0>(TileShape{})));
    return params;
  }

  CUTLASS_HOST_DEVICE RotatingTileScheduler() {}
  CUTLASS_DEVICE explicit RotatingTileScheduler(Params const& params)
      : Base(params),
        rotate_m_(params.rotate_m),
        interleave_(params.interleave),
        unit_(params.unit),
        tiles_m_(params.tiles_m),
        keep_(params.keep),
        after_(params.after) {
    // the base's own linear index, which it keeps private (static_tile_scheduler.hpp)
    start_ = params.raster_order_ == RasterOrder::AlongN ? uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * gridDim.x
                                                         : uint64_t(blockIdx.x) * gridDim.y + uint64_t(blockIdx.y);
    grid_ = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
  }

  // Every way the kernel obtains a work tile, rotated.
  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }
  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    return rotated(Base::get_current_work_for_linear_idx(linear_index()));
  }
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo info) {
    ++step_;  // static schedule: no tile continues (PersistentTileSchedulerSm90)
    return cute::make_tuple(get_current_work(), true);
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo info, Pipeline&, PipelineState) {
    return fetch_next_work(info);
  }

 private:
  // Only rotated or interleaved schedules remap rows: others may walk padded tile rows (clusters,
  // swizzle panels) past tiles_m, which must stay padding; these have none (the planner makes sure).
  CUTLASS_DEVICE WorkTileInfo rotated(WorkTileInfo info) const {
    if (rotate_m_ != 0 && info.is_valid()) {
      info.M_idx += rotate_m_;
      info.M_idx -= info.M_idx >= tiles_m_ ? tiles_m_ : 0;
    }
    if (interleave_ > 1 && info.is_valid()) {
      info.M_idx = interleaved_row(info.M_idx, tiles_m_, unit_, interleave_);
    }
    return info;
  }

  // This CTA's `step_`-th tile in the linear order: strided by the whole grid, and by `keep_` CTAs
  // from wave `after_` on (past the end for the CTAs that stop).
  CUTLASS_DEVICE uint64_t linear_index() const {
    if (keep_ == 0 || step_ < uint64_t(after_)) {
      return start_ + step_ * grid_;
    }
    if (start_ >= uint64_t(keep_)) {
      return ~uint64_t(0);
    }
    return uint64_t(after_) * grid_ + (step_ - after_) * keep_ + start_;
  }

  int rotate_m_ = 0;
  int interleave_ = 1;
  int unit_ = 1;
  int tiles_m_ = 1;
  int keep_ = 0;
  int after_ = 0;
  uint64_t start_ = 0;
  uint64_t grid_ = 1;
  uint64_t step_ = 0;
};

}  // namespace flashoverlap

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<flashoverlap::RotatingScheduler, ArchTag, TileShape, ClusterShape, Stages> {
  using Scheduler = flashoverlap::RotatingTileScheduler;
};
}  // namespace cutlass::gemm::kernel::detail
