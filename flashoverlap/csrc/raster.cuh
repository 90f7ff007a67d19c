// The tile raster of flashoverlap.plan.schedule_order for clusters of 1, for kernels that walk
// their tiles themselves (the sm80 family): scheduler index -> (tile row, tile column). Host and
// device code; CI runs it on the CPU against the planner.
#pragma once

namespace flashoverlap {

struct Raster {
  int swizzle;     // as applied: plan.effective_swizzle
  int padded_m;    // tile rows and columns walked: plan.scheduler_grid
  int padded_n;
  int rotate_m;    // tile rows walked from this one on, wrapping (see rotating_scheduler.cuh)
  int interleave;  // segments whose tile rows are walked interleaved (1: none; see interleaved_row)
};

inline __host__ __device__ Raster make_raster(int tiles_m, int tiles_n, int max_swizzle, int rotate_m = 0,
                                              int interleave = 1) {
  int const smaller = tiles_m < tiles_n ? tiles_m : tiles_n;
  int const size = max_swizzle >= 8 && smaller >= 6   ? 8
                   : max_swizzle >= 4 && smaller >= 3 ? 4
                   : max_swizzle >= 2 && smaller >= 2 ? 2
                                                      : 1;
  return {size, (tiles_m + size - 1) / size * size, (tiles_n + size - 1) / size * size, rotate_m, interleave};
}

// The tile row of C walked at position `row` when `interleave` equal segments of `tiles_m` tile rows
// are walked a unit of `unit` tile rows of each in turn (plan.interleaved_rows; the "segments" layout).
inline __host__ __device__ int interleaved_row(int row, int tiles_m, int unit, int interleave) {
  int const units = tiles_m / (unit * interleave);  // per segment
  int const b = row / unit, w = row - b * unit;
  return ((b % interleave) * units + b / interleave) * unit + w;
}

// Panels `swizzle` tiles wide: along N, consecutive indices cycle over the panel's tile rows before
// moving to the next column; along M, over its tile columns before moving to the next row.
inline __host__ __device__ void tile_of(int index, Raster const& r, int along_m, int& mt, int& nt) {
  int const offset = index % r.swizzle, extra = index / r.swizzle;
  int const major_count = along_m ? r.padded_m : r.padded_n;
  int const major = extra % major_count, panel = extra / major_count;
  mt = along_m ? major : panel * r.swizzle + offset;
  nt = along_m ? panel * r.swizzle + offset : major;
  mt += r.rotate_m;
  mt -= mt >= r.padded_m ? r.padded_m : 0;
  if (r.interleave > 1) {
    mt = interleaved_row(mt, r.padded_m, r.swizzle, r.interleave);
  }
}

}  // namespace flashoverlap
