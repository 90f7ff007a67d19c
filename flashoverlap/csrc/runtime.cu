// Small runtime pieces: restoring C from packed group buffers, strided copies on the copy engines,
// the adds of partial sums, the counter reset, the stream wait on a group counter, the spin-wait fallback for devices
// without stream memory operations, and the replay of a recorded call (flashoverlap.enqueue).
// Loaded with ctypes (flashoverlap.jit.runtime_library).
#include <algorithm>
#include <cstdint>
#include <cstdio>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ float to_float(__half x) { return __half2float(x); }
template <typename T>
__device__ T from_float(float x);
template <>
__device__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __half from_float(float x) { return __float2half_rn(x); }

// out (and out2 where not null) = the sum of `count` inputs (at most kMaxSum) over n elements,
// summed in fp32 and rounded once: a group's partial sums of every rank in one pass (count + 1
// accesses per element, where chained two-input adds make 3 (count - 1)), on the few SMs a GEMM
// leaves, whose share of the memory system is the limit; out2 saves a copy where the sum goes to
// two places (a pull_scatter's share: its buffer, which the other ranks copy, and the result).
// `out` may be one of the inputs (each element is read before it is written). 16-byte vectors
// where every pointer is aligned, the rest element by element.
constexpr int kMaxSum = 8;
template <typename T>
struct SumInputs {
  T const* p[kMaxSum];
};

template <typename T>
__global__ void sum_elems(T* out, T* out2, SumInputs<T> in, int count, int64_t n, bool vectors) {
  constexpr int kPer = 16 / sizeof(T);
  int64_t const stride = int64_t(gridDim.x) * blockDim.x;
  int64_t const first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t const whole = vectors ? n / kPer : 0;
  for (int64_t v = first; v < whole; v += stride) {
    // Every input's vector is loaded before the first add: the loads are in flight together. (A
    // loop over `count` that added each as it came left one load per thread in flight: on the few
    // SMs beside a GEMM, whose throughput is loads in flight, two-rank pulls lost 0.23 ms of 1.74 on
    // 16384x8192x4096 against the two-input add this replaced.)
    uint4 x[kMaxSum];
#pragma unroll
    for (int i = 0; i < kMaxSum; ++i)
      if (i < count) x[i] = reinterpret_cast<uint4 const*>(in.p[i])[v];
    float acc[kPer] = {};
#pragma unroll
    for (int i = 0; i < kMaxSum; ++i) {
      T const* xs = reinterpret_cast<T const*>(&x[i]);
#pragma unroll
      for (int k = 0; k < kPer; ++k)
        if (i < count) acc[k] += to_float(xs[k]);
    }
    uint4 z;
    T* zs = reinterpret_cast<T*>(&z);
#pragma unroll
    for (int k = 0; k < kPer; ++k) zs[k] = from_float<T>(acc[k]);
    reinterpret_cast<uint4*>(out)[v] = z;
    if (out2 != nullptr) reinterpret_cast<uint4*>(out2)[v] = z;
  }
  for (int64_t e = whole * kPer + first; e < n; e += stride) {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxSum; ++i)
      if (i < count) acc += to_float(in.p[i][e]);  // (constant indices: the pointers stay in registers)
    out[e] = from_float<T>(acc);
    if (out2 != nullptr) out2[e] = out[e];
  }
}

template <typename T>
int sum(void* out, void* out2, void const* const* inputs, int count, size_t n, cudaStream_t stream) {
  SumInputs<T> in{};
  uintptr_t bits = reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(out2);
  for (int i = 0; i < count; ++i) {
    in.p[i] = static_cast<T const*>(inputs[i]);
    bits |= reinterpret_cast<uintptr_t>(inputs[i]);
  }
  bool const vectors = (bits & 15) == 0;
  size_t const work = vectors ? (n + 16 / sizeof(T) - 1) / (16 / sizeof(T)) : n;
  unsigned const blocks = unsigned(std::min<size_t>((work + 255) / 256, 4096));
  if (blocks == 0) return 0;
  sum_elems<T><<<blocks, 256, 0, stream>>>(static_cast<T*>(out), static_cast<T*>(out2), in, count, int64_t(n),
                                           vectors);
  return check_launch("sum");
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

// Driver functions from the driver the runtime uses (no link to libcuda, no Python bindings to
// match the driver's version): cuStreamWaitValue32 / cuStreamWriteValue32 (one signature), and
// cuStreamBatchMemOp; null where the driver lacks them.
using StreamValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);

template <class F>
F driver_entry(char const* name) {
  void* found = nullptr;
  cudaDriverEntryPointQueryResult status;
#if CUDART_VERSION >= 12050
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &found, 12000, cudaEnableDefault, &status);
#else
  cudaError_t err = cudaGetDriverEntryPoint(name, &found, cudaEnableDefault, &status);
#endif
  return err == cudaSuccess && status == cudaDriverEntryPointSuccess ? reinterpret_cast<F>(found) : nullptr;
}

// A stream memory operation on `counter` (no SM): `name` the driver function, `flags` its own.
int stream_value(char const* name, StreamValue32 fn, void const* counter, unsigned value, unsigned flags,
                 void* stream) {
  if (fn == nullptr) {
    std::snprintf(g_error, sizeof(g_error), "the driver has no %s", name);
    return 1;
  }
  CUresult const err = fn(static_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(counter), value, flags);
  if (err != CUDA_SUCCESS) {
    std::snprintf(g_error, sizeof(g_error), "%s returned CUresult %d", name, int(err));
    return 1;
  }
  return 0;
}

// Stream memory operations in a row on one stream (a pull's waits and flag writes: a third of a
// call's operations) are enqueued as one cuStreamBatchMemOp, in their order: one driver call for
// the row instead of ~1-2 us of host time each.
struct MemOps {
  static constexpr int kMax = 32;
  CUstreamBatchMemOpParams ops[kMax];
  int count = 0;
  int first = 0;  // the replayed op the row starts at (its errors name it)
  void* stream = nullptr;

  // Adds fo_stream_wait's or fo_write_value's (address, value) on `stream` after enqueuing the row
  // so far where it is on another stream or full; false where that enqueue failed.
  bool add(bool wait, uint64_t address, unsigned value, void* on, int index) {
    if (count > 0 && (on != stream || count == kMax) && !flush()) {
      return false;
    }
    if (count == 0) {
      first = index;
      stream = on;
    }
    CUstreamBatchMemOpParams& op = ops[count++];
    op = {};
    if (wait) {
      op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      op.waitValue.address = CUdeviceptr(address);
      op.waitValue.value = value;
      op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    } else {
      op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      op.writeValue.address = CUdeviceptr(address);
      op.writeValue.value = value;
      op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
    return true;
  }

  // Enqueues the row (if any); false where the driver refused it.
  bool flush() {
    static BatchMemOp const batch = driver_entry<BatchMemOp>("cuStreamBatchMemOp");
    int const n = count;
    count = 0;
    if (n == 0) return true;
    CUresult const err = batch(static_cast<CUstream>(stream), unsigned(n), ops, 0);
    if (err != CUDA_SUCCESS) {
      std::snprintf(g_error, sizeof(g_error), "cuStreamBatchMemOp of %d operations returned CUresult %d", n, int(err));
      return false;
    }
    return true;
  }
};

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
// the GEMM for one. A contiguous block goes as one plain copy (as torch's copy_ does it).
int fo_copy_2d(void* dst, size_t dpitch, void const* src, size_t spitch, size_t width, size_t height, void* stream) {
  cudaStream_t const s = static_cast<cudaStream_t>(stream);
  if (height == 1 || (dpitch == width && spitch == width)) {
    return check(cudaMemcpyAsync(dst, src, width * height, cudaMemcpyDeviceToDevice, s), "copy");
  }
  return check(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice, s), "copy_2d");
}

// out (and out2 where not null) = in0 + ... + in{count-1} (count 1..8; the unused pointers null), n
// elements of `dtype` (0 bfloat16, 1 float16): partial sums added (flashoverlap.comm.add_rows, add),
// one call a replay can enqueue.
int fo_sum(void* out, void* out2, void const* in0, void const* in1, void const* in2, void const* in3,
           void const* in4, void const* in5, void const* in6, void const* in7, int count, size_t n, int dtype,
           void* stream) {
  void const* inputs[kMaxSum] = {in0, in1, in2, in3, in4, in5, in6, in7};
  cudaStream_t const s = static_cast<cudaStream_t>(stream);
  if (count < 1 || count > kMaxSum) {
    std::snprintf(g_error, sizeof(g_error), "sum: %d inputs (1 to %d)", count, kMaxSum);
    return 1;
  }
  if (dtype == 0) return sum<__nv_bfloat16>(out, out2, inputs, count, n, s);
  if (dtype == 1) return sum<__half>(out, out2, inputs, count, n, s);
  std::snprintf(g_error, sizeof(g_error), "sum: unknown dtype %d", dtype);
  return 1;
}

// Zeroes `bytes` at ptr on the stream (the group counters between calls: cheaper to enqueue than a
// fill kernel).
int fo_zero(void* ptr, size_t bytes, void* stream) {
  return check(cudaMemsetAsync(ptr, 0, bytes, static_cast<cudaStream_t>(stream)), "zero");
}

// Makes the stream wait (in the GPU's front end, no SM) until *counter >= target, cyclic; returns
// non-zero where stream memory operations are missing or refused.
int fo_stream_wait(void const* counter, unsigned target, void* stream) {
  static StreamValue32 const fn = driver_entry<StreamValue32>("cuStreamWaitValue32");
  return stream_value("cuStreamWaitValue32", fn, counter, target, CU_STREAM_WAIT_VALUE_GEQ, stream);
}

// Writes `value` to *flag once the stream's earlier work is done and visible (the default write
// orders it behind a memory barrier): a rank's signal to another one's stream, which waits on the
// flag in its own memory (flashoverlap.comm.peer).
int fo_write_value(void* flag, unsigned value, void* stream) {
  static StreamValue32 const fn = driver_entry<StreamValue32>("cuStreamWriteValue32");
  return stream_value("cuStreamWriteValue32", fn, flag, value, CU_STREAM_WRITE_VALUE_DEFAULT, stream);
}

// Lets the calling thread make calls CUDA counts unsafe while another thread captures a graph in
// the global mode (cudaEventQuery): the watchdog's thread polls events whatever the application's
// threads capture (flashoverlap.watchdog), as torch's NCCL watchdog does.
int fo_relaxed_capture_mode() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  return check(cudaThreadExchangeStreamCaptureMode(&mode), "capture_mode");
}

int fo_record_event(void* event, void* stream) {
  return check(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)), "record_event");
}

int fo_wait_event(void* stream, void* event) {
  return check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
               "wait_event");
}

int fo_spin_wait(void const* counter, unsigned target, unsigned long long timeout_ns, void* report, int group,
                 void* stream) {
  spin_wait<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<uint32_t const*>(counter), target,
                                                             timeout_ns, static_cast<int*>(report), group);
  return check_launch("spin_wait");
}

// A recorded call replayed (flashoverlap.enqueue): ops of words [signature, function, then per
// argument (slot, value)]; an argument is `value` where slot is 0, else values[slot - 1] + value (what
// changes per call: the operands, the buffers allocated per call). Signatures
// are flashoverlap.enqueue.SIGNATURES by index: p pointer, u unsigned, i int, n size_t. Returns -1,
// or the index of the op that failed, its status in *status (the callee's own error code; for a row
// of stream memory operations enqueued as one, MemOps, the row's first op and 1). Every op before
// the one that failed is enqueued.
int fo_replay(uint64_t const* ops, int64_t words, uint64_t const* values, int* status) {
  using P = void*;
  using U = unsigned;
  using N = size_t;
  constexpr int kArgs[] = {2, 3, 3, 7, 6, 7, 6, 6, 0, 30, 11, 14};  // per signature (checked by a CPU test)
  constexpr int kSignatures = sizeof(kArgs) / sizeof(kArgs[0]);
  static bool const batches = driver_entry<BatchMemOp>("cuStreamBatchMemOp") != nullptr;
  void* const wait_fn = reinterpret_cast<void*>(&fo_stream_wait);
  void* const write_fn = reinterpret_cast<void*>(&fo_write_value);
  MemOps row;
  uint64_t a[30];
  int index = 0;
  for (int64_t w = 0; w < words; ++index) {
    uint64_t const sig = ops[w];
    void* const fn = reinterpret_cast<void*>(ops[w + 1]);
    if (sig >= uint64_t(kSignatures) || w + 2 + 2 * kArgs[sig] > words) {
      if (!row.flush()) {
        *status = 1;
        return row.first;
      }
      std::snprintf(g_error, sizeof(g_error), "replay: malformed op %d", index);
      *status = -1;
      return index;
    }
    w += 2;
    for (int i = 0; i < kArgs[sig]; ++i, w += 2) {
      a[i] = ops[w] == 0 ? ops[w + 1] : values[ops[w] - 1] + ops[w + 1];
    }
    if (sig == 1 && batches && (fn == wait_fn || fn == write_fn)) {
      if (!row.add(fn == wait_fn, a[0], U(a[1]), P(a[2]), index)) {
        *status = 1;
        return row.first;
      }
      continue;
    }
    if (!row.flush()) {  // (what came before this op, in order)
      *status = 1;
      return row.first;
    }
    int rc = 0;
    switch (sig) {
      case 0:  // fo_record_event, fo_wait_event
        rc = reinterpret_cast<int (*)(P, P)>(fn)(P(a[0]), P(a[1]));
        break;
      case 1:  // fo_stream_wait, fo_write_value
        rc = reinterpret_cast<int (*)(P, U, P)>(fn)(P(a[0]), U(a[1]), P(a[2]));
        break;
      case 2:  // fo_zero
        rc = reinterpret_cast<int (*)(P, N, P)>(fn)(P(a[0]), N(a[1]), P(a[2]));
        break;
      case 3:  // fo_copy_2d
        rc = reinterpret_cast<int (*)(P, N, P, N, N, N, P)>(fn)(P(a[0]), N(a[1]), P(a[2]), N(a[3]), N(a[4]),
                                                                  N(a[5]), P(a[6]));
        break;
      case 4:  // fo_spin_wait
        rc = reinterpret_cast<int (*)(P, U, N, P, int, P)>(fn)(P(a[0]), U(a[1]), N(a[2]), P(a[3]), int(a[4]),
                                                                 P(a[5]));
        break;
      case 5:  // ncclAllReduce, ncclReduceScatter
        rc = reinterpret_cast<int (*)(P, P, N, int, int, P, P)>(fn)(P(a[0]), P(a[1]), N(a[2]), int(a[3]), int(a[4]),
                                                                      P(a[5]), P(a[6]));
        break;
      case 6:  // ncclAllGather, ncclAlltoAll
        rc = reinterpret_cast<int (*)(P, P, N, int, P, P)>(fn)(P(a[0]), P(a[1]), N(a[2]), int(a[3]), P(a[4]),
                                                                 P(a[5]));
        break;
      case 7:  // ncclSend, ncclRecv
        rc = reinterpret_cast<int (*)(P, N, int, int, P, P)>(fn)(P(a[0]), N(a[1]), int(a[2]), int(a[3]), P(a[4]),
                                                                   P(a[5]));
        break;
      case 8:  // ncclGroupStart, ncclGroupEnd
        rc = reinterpret_cast<int (*)()>(fn)();
        break;
      case 9:  // fo_run of a signal GEMM (launcher.cuh): 12 pointers, 17 ints, the stream
        rc = reinterpret_cast<int (*)(P, P, P, P, P, P, P, P, P, P, P, P, int, int, int, int, int, int, int, int, int,
                                      int, int, int, int, int, int, int, int, P)>(fn)(
            P(a[0]), P(a[1]), P(a[2]), P(a[3]), P(a[4]), P(a[5]), P(a[6]), P(a[7]), P(a[8]), P(a[9]), P(a[10]),
            P(a[11]), int(a[12]), int(a[13]), int(a[14]), int(a[15]), int(a[16]), int(a[17]), int(a[18]), int(a[19]),
            int(a[20]), int(a[21]), int(a[22]), int(a[23]), int(a[24]), int(a[25]), int(a[26]), int(a[27]),
            int(a[28]), P(a[29]));
        break;
      case 10:  // fo_restore
        rc = reinterpret_cast<int (*)(P, P, P, int, int, int, int, int, int, int, P)>(fn)(
            P(a[0]), P(a[1]), P(a[2]), int(a[3]), int(a[4]), int(a[5]), int(a[6]), int(a[7]), int(a[8]), int(a[9]),
            P(a[10]));
        break;
      case 11:  // fo_sum
        rc = reinterpret_cast<int (*)(P, P, P, P, P, P, P, P, P, P, int, N, int, P)>(fn)(
            P(a[0]), P(a[1]), P(a[2]), P(a[3]), P(a[4]), P(a[5]), P(a[6]), P(a[7]), P(a[8]), P(a[9]), int(a[10]),
            N(a[11]), int(a[12]), P(a[13]));
        break;
    }
    if (rc != 0) {
      *status = rc;
      return index;
    }
  }
  if (!row.flush()) {
    *status = 1;
    return row.first;
  }
  return -1;
}

}  // extern "C"
