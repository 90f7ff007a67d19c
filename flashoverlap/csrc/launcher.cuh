// C entry points of one generated signal-GEMM instance, loaded from Python with ctypes.
// The generated translation unit defines Element, Epilogue, Kernel and Gemm before including this.
// alpha (every entry point): a device pointer to the float32 scale of the accumulators (FP8's
// scale_a * scale_b), read by the kernel, so a scale computed on the GPU needs no host sync and a
// captured graph reads each replay's value; null: alpha 1. row_scale / col_scale (FP8 rowwise, where
// the epilogue takes them, Epilogue::kRowwise): device pointers to M and N float32 scales; null: none.
// result, sources, ready, row0, rows, count, ready_rows: a reduce-scatter's sums in the epilogue
// (flashoverlap::FusedSums, where the epilogue takes them, Epilogue::kFusedSums); result null: none.
#pragma once

#include <cstdio>

#include <cuda_runtime.h>

#include "cutlass/util/packed_stride.hpp"

namespace {

thread_local char g_error[512] = {0};

int fail(char const* what, char const* detail) {
  std::snprintf(g_error, sizeof(g_error), "%s: %s", what, detail);
  return 1;
}

cutlass::KernelHardwareInfo hardware(int device, int sm_count) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  // 0: let the scheduler size the persistent grid from sm_count alone, which keeps the SMs
  // outside the budget free for the communication kernels.
  hw.max_active_clusters = 0;
  return hw;
}

// Stream-K schedulers split their first sk_tiles_ output tiles along K; others split none.
template <class P>
auto stream_k_tiles(P const& p, int) -> decltype(int(p.sk_tiles_)) {
  return int(p.sk_tiles_);
}
template <class P>
int stream_k_tiles(P const&, long) {
  return 0;
}

// Tile rows rotated or interleaved, a late SM budget (rotating_scheduler.cuh); stream-K schedulers
// take none of them (the planner refuses).
template <class A>
auto set_rows(A& args, int rotate_m, int interleave, int keep, int after, int)
    -> decltype(void(args.rotate_m = rotate_m)) {
  args.rotate_m = rotate_m;
  args.interleave = interleave;
  args.keep = keep;
  args.after = after;
}
template <class A>
void set_rows(A&, int, int, int, int, long) {}

typename Kernel::TileSchedulerArguments scheduler_arguments(int along_m, int swizzle, int rotate_m = 0,
                                                            int interleave = 1, int keep = 0, int after = 0) {
  typename Kernel::TileSchedulerArguments sched{};
  // The raster the planner was told (flashoverlap.plan.schedule_order): along N (or M), swizzle.
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  sched.max_swizzle_size = swizzle;
  sched.raster_order = along_m ? Raster::AlongM : Raster::AlongN;
  set_rows(sched, rotate_m, interleave, keep, after, 0);
  return sched;
}

}  // namespace

extern "C" {

char const* fo_last_error() { return g_error; }

int fo_signals_per_tile() { return Epilogue::kSignalsPerTile; }

typename Gemm::Arguments gemm_arguments(void const* a, void const* b, void* out, void const* tiles,
                                        unsigned* counters, float const* alpha, float const* row_scale,
                                        float const* col_scale, flashoverlap::FusedSums const& fused, int M,
                                        int N, int K, int tiles_m, int tiles_n,
                                        int sm_count, int device, int along_m, int swizzle, int rotate_m,
                                        int interleave, int keep, int after) {
  auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, cute::make_shape(M, K, 1));
  auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, cute::make_shape(N, K, 1));
  return typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {M, N, K, 1},
      {static_cast<typename Kernel::ElementA const*>(a), stride_a, static_cast<typename Kernel::ElementB const*>(b),
       stride_b},
      Epilogue::make_arguments(static_cast<Element*>(out), static_cast<flashoverlap::TileSlot const*>(tiles),
                               counters, alpha, row_scale, col_scale, fused, M, N, tiles_m, tiles_n,
                               interleave > 1),
      hardware(device, sm_count),
      scheduler_arguments(along_m, swizzle, rotate_m, interleave, keep, after)};
}

typename Kernel::Params schedule(int M, int N, int K, int sm_count, int device, int along_m, int swizzle) {
  auto problem = cute::make_shape(M, N, K, 1);
  auto hw = hardware(device, sm_count);
  typename Kernel::Params params{};
  params.problem_shape = problem;
  params.hw_info = hw;
  params.scheduler = Kernel::TileScheduler::to_underlying_arguments(
      problem, typename Kernel::TileShape{}, typename Kernel::ClusterShape{}, hw, scheduler_arguments(along_m, swizzle),
      nullptr);
  return params;
}

// Number of persistent CTAs (tiles per wave) the kernel launches for this problem.
int fo_num_ctas(int M, int N, int K, int sm_count, int device, int along_m, int swizzle) {
  dim3 grid = Kernel::get_grid_shape(schedule(M, N, K, sm_count, device, along_m, swizzle));
  return int(grid.x * grid.y * grid.z);
}

// Output tiles (the first ones in raster order) that a stream-K schedule splits along K.
int fo_stream_k_tiles(int M, int N, int K, int sm_count, int device, int along_m, int swizzle) {
  return stream_k_tiles(schedule(M, N, K, sm_count, device, along_m, swizzle).scheduler, 0);
}

// Bytes of scratch the schedule needs (stream-K partial sums); 0 for plain persistent kernels.
long long fo_workspace_size(int M, int N, int K, int sm_count, int device, int along_m, int swizzle) {
  auto args =
      gemm_arguments(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, {}, M, N, K, 1, 1,
                     sm_count, device, along_m, swizzle, 0, 1, 0, 0);
  return static_cast<long long>(Gemm::get_workspace_size(args));
}

int fo_run(void const* a, void const* b, void* out, void const* tiles, unsigned* counters, void* workspace,
           float const* alpha, float const* row_scale, float const* col_scale, void* result, void const* sources,
           unsigned const* ready, int M, int N, int K, int tiles_m, int tiles_n, int sm_count, int device,
           int along_m, int swizzle, int rotate_m, int interleave, int keep, int after, int row0, int rows,
           int count, int ready_rows, void* stream) {
  if (!Epilogue::kRowwise && (row_scale != nullptr || col_scale != nullptr)) {
    return fail("launch", "rowwise scales need the direct epilogue");
  }
  if (!Epilogue::kFusedSums && result != nullptr) {
    return fail("launch", "sums in the epilogue need a sums kernel (GemmSpec.sums)");
  }
  if (result != nullptr && (sources == nullptr && count > 0 || ready == nullptr || ready_rows < 1)) {
    return fail("launch", "sums in the epilogue need their sources, ready flags and rows per flag");
  }
  flashoverlap::FusedSums const fused{result, sources, ready, row0, rows, count, ready_rows};
  auto args = gemm_arguments(a, b, out, tiles, counters, alpha, row_scale, col_scale, fused, M, N, K, tiles_m,
                             tiles_n, sm_count, device, along_m, swizzle, rotate_m, interleave, keep, after);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return fail("can_implement", "CUTLASS rejected the problem (alignment or shape)");
  }
  if (Gemm::get_workspace_size(args) != 0 && workspace == nullptr) {
    return fail("workspace", "this schedule needs a workspace (fo_workspace_size bytes)");
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  // Also zeroes the stream-K workspace, ordered on the stream before the kernel.
  cutlass::Status status = gemm.initialize(args, workspace, cuda_stream);
  if (status != cutlass::Status::kSuccess) {
    return fail("initialize", cutlassGetStatusString(status));
  }
  status = gemm.run(cuda_stream);
  cudaError_t err = cudaGetLastError();
  if (status != cutlass::Status::kSuccess || err != cudaSuccess) {
    return fail("launch", err != cudaSuccess ? cudaGetErrorString(err) : cutlassGetStatusString(status));
  }
  return 0;
}

}  // extern "C"
