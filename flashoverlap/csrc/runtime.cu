// Small runtime pieces: restoring C from packed group buffers, strided copies on the copy engines,
// the counter reset, the stream wait on a group counter, and the spin-wait fallback for devices
// without stream memory operations. Loaded with ctypes (flashoverlap.jit.runtime_library).
#include <cstdint>
#include <cstdio>

#include <cuda.h>
#include <cuda_runtime.h>

#include "tile_slot.cuh"

namespace {

thread_local char g_error[256] = {0};

int check(cudaError_t err, char const* what) {
  if (err != cudaSuccess) {
    std::snprintf(g_error, sizeof(g_error), "%s: %s", what, cudaGetErrorString(err));
    return 1;
  }
  return 0;
}

int check_launch(char const* what) { return check(cudaGetLastError(), what); }

// One CTA per tile copies its rows x cols block from the packed slot into row-major C with
// 16-byte vectors (the host guarantees 16-byte aligned rows: cols and ld are multiples of 8
// two-byte elements).
__global__ void restore_tiles(uint4 const* __restrict__ buffer, uint4* __restrict__ out,
                              flashoverlap::TileSlot const* __restrict__ tiles, int m, int n, int tile_m,
                              int tile_n, int tiles_n, int elem_bytes) {
  int const tile = blockIdx.x;
  int const mt = tile / tiles_n, nt = tile % tiles_n;
  int const rows = min(tile_m, m - mt * tile_m);
  int const vec_per_row = min(tile_n, n - nt * tile_n) * elem_bytes / 16;
  int const per = 16 / elem_bytes;
  flashoverlap::TileSlot const slot = tiles[tile];
  int64_t const src0 = slot.offset / per, src_ld = slot.ld / per;
  int64_t const dst0 = (int64_t(mt) * tile_m * n + int64_t(nt) * tile_n) / per, dst_ld = n / per;
  for (int i = threadIdx.x; i < rows * vec_per_row; i += blockDim.x) {
    int const r = i / vec_per_row, v = i % vec_per_row;
    out[dst0 + r * dst_ld + v] = buffer[src0 + r * src_ld + v];
  }
}

// Waits until *counter >= target (cyclic, as cuStreamWaitValue32 GEQ). With timeout_ns > 0 it
// gives up after that long and records {1, group, value seen, target} in report, so a debug run
// says which group never completed instead of hanging.
__global__ void spin_wait(uint32_t const* counter, uint32_t target, uint64_t timeout_ns, int* report, int group) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  uint32_t value;
  while (true) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
    if (int32_t(value - target) >= 0) break;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (timeout_ns != 0 && now - start > timeout_ns) {
      if (report[0] == 0) {
        report[1] = group;
        report[2] = int(value);
        report[3] = int(target);
        __threadfence_system();
        report[0] = 1;
      }
      break;
    }
    __nanosleep(200);
  }
}

using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// cuStreamWaitValue32 from the driver the runtime uses (no link to libcuda, no Python bindings to
// match the driver's version); null where the driver lacks it.
WaitValue32 wait_value32() {
  static WaitValue32 const fn = [] {
    void* found = nullptr;
    cudaDriverEntryPointQueryResult status;
#if CUDART_VERSION >= 12050
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &found, 12000, cudaEnableDefault, &status);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuStreamWaitValue32", &found, cudaEnableDefault, &status);
#endif
    return err == cudaSuccess && status == cudaDriverEntryPointSuccess ? reinterpret_cast<WaitValue32>(found) : nullptr;
  }();
  return fn;
}

}  // namespace

extern "C" {

char const* fo_runtime_error() { return g_error; }

int fo_restore(void const* buffer, void* out, void const* tiles, int num_tiles, int m, int n, int tile_m,
               int tile_n, int tiles_n, int elem_bytes, void* stream) {
  restore_tiles<<<num_tiles, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint4 const*>(buffer), static_cast<uint4*>(out),
      static_cast<flashoverlap::TileSlot const*>(tiles), m, n, tile_m, tile_n, tiles_n, elem_bytes);
  return check_launch("restore");
}

// `height` rows of `width` bytes from src (rows `spitch` bytes apart) to dst (`dpitch` apart) on
// the copy engines: a group's placement uses no SM, so it never competes with NCCL's kernels or
// the GEMM for one.
int fo_copy_2d(void* dst, size_t dpitch, void const* src, size_t spitch, size_t width, size_t height, void* stream) {
  return check(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice,
                                 static_cast<cudaStream_t>(stream)),
               "copy_2d");
}

// Zeroes `bytes` at ptr on the stream (the group counters between calls: cheaper to enqueue than a
// fill kernel).
int fo_zero(void* ptr, size_t bytes, void* stream) {
  return check(cudaMemsetAsync(ptr, 0, bytes, static_cast<cudaStream_t>(stream)), "zero");
}

// Makes the stream wait (in the GPU's front end, no SM) until *counter >= target, cyclic; returns
// non-zero where stream memory operations are missing or refused.
int fo_stream_wait(void const* counter, unsigned target, void* stream) {
  WaitValue32 const fn = wait_value32();
  if (fn == nullptr) {
    std::snprintf(g_error, sizeof(g_error), "stream_wait: the driver has no cuStreamWaitValue32");
    return 1;
  }
  CUresult const err = fn(static_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(counter), target,
                          CU_STREAM_WAIT_VALUE_GEQ);
  if (err != CUDA_SUCCESS) {
    std::snprintf(g_error, sizeof(g_error), "stream_wait: cuStreamWaitValue32 returned CUresult %d", int(err));
    return 1;
  }
  return 0;
}

int fo_spin_wait(void const* counter, unsigned target, unsigned long long timeout_ns, void* report, int group,
                 void* stream) {
  spin_wait<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<uint32_t const*>(counter), target,
                                                             timeout_ns, static_cast<int*>(report), group);
  return check_launch("spin_wait");
}

}  // extern "C"
