// What each step between a group's last tile and its copy costs on the GPU: stream memory
// operations (cuStreamWaitValue32 / cuStreamWriteValue32), event hops, peer copies, on one GPU and
// between two (flashoverlap.comm.peer orders a pull with these). Each case times, with
// %globaltimer on GPU 0, the span from a kernel's stamp (the "signal": a tile's counter bump) to a
// stamp kernel behind the chain under test, everything enqueued behind a busy kernel so that the
// host is ahead; medians of 25 runs after 5. Needs two GPUs with peer access.
//
//   nvcc -O2 -arch=sm_90a -o /tmp/stream_ops_probe bench/stream_ops_probe.cu
//   /tmp/stream_ops_probe          # every case
//   /tmp/stream_ops_probe 11       # one case (a process each is safest: see "hung" below)
//
// A wait that never sees its value is released from the host after 0.5 s and the case reported
// hung. Every kernel is launched once first: a kernel's first launch (lazy module loading) waits
// for the device, which a pending stream wait may hold -- the probe's first runs hung on that.
// Results (2x H200): docs/experiments.md, "Pulls over peer memory".
#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                 \
  do {                                                                           \
    auto status_ = (x);                                                          \
    if (status_ != 0) {                                                          \
      printf("error %d at %s:%d\n", int(status_), __FILE__, __LINE__);          \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

__device__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// After delay_ns: stamp t[0], then count (release at gpu scope, as the GEMM's tiles do).
__global__ void signal_gpu(unsigned* counter, unsigned long long* t, unsigned long long delay_ns) {
  unsigned long long const start = now();
  while (now() - start < delay_ns) {
  }
  t[0] = now();
  __threadfence();
  if (counter) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}

// The same, counting at system scope (a flag in another GPU's memory).
__global__ void signal_sys(unsigned* counter, unsigned long long* t, unsigned long long delay_ns) {
  unsigned long long const start = now();
  while (now() - start < delay_ns) {
  }
  if (t) t[0] = now();
  __threadfence_system();
  asm volatile("red.release.sys.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}

__global__ void stamp(unsigned long long* t) { t[0] = now(); }

__global__ void busy(unsigned long long ns) {
  unsigned long long const start = now();
  while (now() - start < ns) {
  }
}

using StreamValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

StreamValue32 driver(char const* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found));
  return reinterpret_cast<StreamValue32>(fn);
}

char const* const kCases[] = {
    "kernel -> kernel, one stream",
    "event hop: kernel on A, event, wait on B, kernel",
    "wait(counter) -> kernel",
    "wait(counter) -> write(flag) -> wait(flag) -> write(flag 0) -> kernel, one GPU",
    "round trip, flags: wait -> write(GPU 1) | GPU 1 wait -> write(GPU 0) | wait -> kernel",
    "wait(counter) -> 4 B copy -> kernel",
    "wait(counter) -> 8 MB copy from GPU 1 -> kernel",
    "kernel -> 8 MB copy from GPU 1 -> kernel",
    "wait -> write -> wait -> write 0 -> 8 MB copy from GPU 1 -> kernel",
    "kernel -> 2 x 4 MB copies from GPU 1 on two streams -> kernel",
    "kernel -> 4 x 2 MB copies from GPU 1 on one stream -> kernel",
    "round trip, waits on the other GPU's counter: GPU 1 waits on GPU 0's, GPU 0 on GPU 1's",
    "round trip, kernels count in the other GPU's memory, each GPU waits on its own",
    "wait(counter) and wait(a flag already set) in one cuStreamBatchMemOp -> kernel",
    "kernel -> wait(already satisfied) -> kernel, one stream",
    "kernel -> wait on an event already complete -> kernel, one stream",
};
int const kNumCases = sizeof(kCases) / sizeof(kCases[0]);

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  int const first = argc > 1 ? atoi(argv[1]) : 0, last = argc > 1 ? first + 1 : kNumCases;
  if (argc > 2 || first < 0 || first >= kNumCases) {
    printf("usage: %s [case 0-%d]\n", argv[0], kNumCases - 1);
    return 2;
  }
  StreamValue32 const wait_value = driver("cuStreamWaitValue32"), write_value = driver("cuStreamWriteValue32");
  auto const batch = reinterpret_cast<CUresult (*)(CUstream, unsigned, CUstreamBatchMemOpParams*, unsigned)>(
      driver("cuStreamBatchMemOp"));
  auto wait = [&](cudaStream_t s, void* p, unsigned v) {
    CHECK(wait_value(CUstream(s), CUdeviceptr(p), v, CU_STREAM_WAIT_VALUE_GEQ));
  };
  auto write = [&](cudaStream_t s, void* p, unsigned v) {
    CHECK(write_value(CUstream(s), CUdeviceptr(p), v, CU_STREAM_WRITE_VALUE_DEFAULT));
  };
  size_t const big = 8 << 20;

  CHECK(cudaSetDevice(1));
  CHECK(cudaDeviceEnablePeerAccess(0, 0));
  unsigned* flags1;  // GPU 1's words
  void* src1;
  cudaStream_t c;
  CHECK(cudaMalloc(&flags1, 4096));
  CHECK(cudaMalloc(&src1, big));
  CHECK(cudaMemset(src1, 1, big));
  CHECK(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
  CHECK(cudaSetDevice(0));
  CHECK(cudaDeviceEnablePeerAccess(1, 0));
  unsigned* words;  // GPU 0's: [0] the counter, [32] a flag
  unsigned long long* t;
  void* dst;
  cudaStream_t a, b, idle;
  cudaEvent_t ev, ev2, done;
  CHECK(cudaMalloc(&words, 4096));
  CHECK(cudaMalloc(&t, 64 * 8));
  CHECK(cudaMalloc(&dst, big));
  CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&idle, cudaStreamNonBlocking));
  CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&ev2, cudaEventDisableTiming));
  unsigned* const counter = words;
  unsigned* const flag = words + 32;
  // stop 31's pull order on one GPU: the counter, then a flag written, waited on and cleared
  auto handshake = [&](cudaStream_t s) {
    wait(s, counter, 1);
    write(s, flag, 1);
    wait(s, flag, 1);
    write(s, flag, 0);
  };
  char* const d = static_cast<char*>(dst);
  char* const s1 = static_cast<char*>(src1);

  // every kernel loaded on both GPUs before any stream waits
  signal_gpu<<<1, 1>>>(words + 64, t, 0);
  signal_sys<<<1, 1>>>(words + 64, t, 0);
  stamp<<<1, 1>>>(t);
  busy<<<1, 1>>>(0);
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaSetDevice(1));
  signal_gpu<<<1, 1>>>(flags1 + 64, reinterpret_cast<unsigned long long*>(flags1 + 128), 0);
  signal_sys<<<1, 1>>>(flags1 + 64, nullptr, 0);
  busy<<<1, 1>>>(0);
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaSetDevice(0));

  for (int v = first; v < last; ++v) {
    std::vector<double> spans;
    for (int run = 0; run < 30; ++run) {
      CHECK(cudaMemset(words, 0, 4096));
      CHECK(cudaSetDevice(1));
      CHECK(cudaMemset(flags1, 0, 4096));
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaSetDevice(0));
      CHECK(cudaDeviceSynchronize());
      busy<<<1, 1, 0, a>>>(v == 9 ? 100000 : 200000);
      busy<<<1, 1, 0, b>>>(150000);
      switch (v) {
        case 0:
          signal_gpu<<<1, 1, 0, a>>>(nullptr, t, 1000);
          stamp<<<1, 1, 0, a>>>(t + 1);
          break;
        case 1:
          signal_gpu<<<1, 1, 0, a>>>(nullptr, t, 1000);
          CHECK(cudaEventRecord(ev, a));
          CHECK(cudaStreamWaitEvent(b, ev, 0));
          stamp<<<1, 1, 0, b>>>(t + 1);
          break;
        case 2:
          wait(b, counter, 1);
          stamp<<<1, 1, 0, b>>>(t + 1);
          signal_gpu<<<1, 1, 0, a>>>(counter, t, 1000);
          break;
        case 3:
          handshake(b);
          stamp<<<1, 1, 0, b>>>(t + 1);
          signal_gpu<<<1, 1, 0, a>>>(counter, t, 1000);
          break;
        case 4:
          CHECK(cudaSetDevice(1));
          busy<<<1, 1, 0, c>>>(100000);
          wait(c, flags1, 1);
          write(c, flag, 1);
          CHECK(cudaSetDevice(0));
          wait(b, counter, 1);
          write(b, flags1, 1);
          wait(b, flag, 1);
          stamp<<<1, 1, 0, b>>>(t + 1);
          signal_gpu<<<1, 1, 0, a>>>(counter, t, 1000);
          break;
        case 5:
          wait(b, counter, 1);
          CHECK(cudaMemcpyAsync(dst, words + 64, 4, cudaMemcpyDeviceToDevice, b));
          stamp<<<1, 1, 0, b>>>(t + 1);
          signal_gpu<<<1, 1, 0, a>>>(counter, t, 1000);
          break;
        case 6:
          wait(b, counter, 1);
          CHECK(cudaMemcpyAsync(dst, src1, big, cudaMemcpyDeviceToDevice, b));
          stamp<<<1, 1, 0, b>>>(t + 1);
          signal_gpu<<<1, 1, 0, a>>>(counter, t, 1000);
          break;
        case 7:
          signal_gpu<<<1, 1, 0, b>>>(nullptr, t, 1000);
          CHECK(cudaMemcpyAsync(dst, src1, big, cudaMemcpyDeviceToDevice, b));
          stamp<<<1, 1, 0, b>>>(t + 1);
          break;
        case 8:
          handshake(b);
          CHECK(cudaMemcpyAsync(dst, src1, big, cudaMemcpyDeviceToDevice, b));
          stamp<<<1, 1, 0, b>>>(t + 1);
          signal_gpu<<<1, 1, 0, a>>>(counter, t, 1000);
          break;
        case 9:
          signal_gpu<<<1, 1, 0, b>>>(nullptr, t, 1000);
          CHECK(cudaEventRecord(ev, b));
          CHECK(cudaStreamWaitEvent(a, ev, 0));
          CHECK(cudaMemcpyAsync(d, s1, big / 2, cudaMemcpyDeviceToDevice, b));
          CHECK(cudaMemcpyAsync(d + big / 2, s1 + big / 2, big / 2, cudaMemcpyDeviceToDevice, a));
          CHECK(cudaEventRecord(ev2, a));
          CHECK(cudaStreamWaitEvent(b, ev2, 0));
          stamp<<<1, 1, 0, b>>>(t + 1);
          break;
        case 10:
          signal_gpu<<<1, 1, 0, b>>>(nullptr, t, 1000);
          for (int q = 0; q < 4; ++q) {
            CHECK(cudaMemcpyAsync(d + q * big / 4, s1 + q * big / 4, big / 4, cudaMemcpyDeviceToDevice, b));
          }
          stamp<<<1, 1, 0, b>>>(t + 1);
          break;
        case 11:
          CHECK(cudaSetDevice(1));
          busy<<<1, 1, 0, c>>>(100000);
          wait(c, counter, 1);  // GPU 0's memory
          signal_sys<<<1, 1, 0, c>>>(flags1, nullptr, 0);
          CHECK(cudaSetDevice(0));
          wait(b, flags1, 1);  // GPU 1's memory
          stamp<<<1, 1, 0, b>>>(t + 1);
          signal_gpu<<<1, 1, 0, a>>>(counter, t, 1000);
          break;
        case 12:
          CHECK(cudaSetDevice(1));
          busy<<<1, 1, 0, c>>>(100000);
          wait(c, flags1, 1);
          signal_sys<<<1, 1, 0, c>>>(flag, nullptr, 0);  // into GPU 0's memory
          CHECK(cudaSetDevice(0));
          wait(b, flag, 1);
          stamp<<<1, 1, 0, b>>>(t + 1);
          signal_sys<<<1, 1, 0, a>>>(flags1, t, 1000);  // into GPU 1's memory
          break;
        case 13: {
          CHECK(cudaMemsetAsync(flag, 1, 4, b));  // 0x01010101 >= 1
          CUstreamBatchMemOpParams ops[2] = {};
          for (int q = 0; q < 2; ++q) {
            ops[q].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
            ops[q].waitValue.address = CUdeviceptr(q == 0 ? counter : flag);
            ops[q].waitValue.value = 1;
            ops[q].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
          }
          CHECK(batch(CUstream(b), 2, ops, 0));
          stamp<<<1, 1, 0, b>>>(t + 1);
          signal_gpu<<<1, 1, 0, a>>>(counter, t, 1000);
          break;
        }
        case 14:
          signal_gpu<<<1, 1, 0, b>>>(nullptr, t, 1000);
          wait(b, counter, 0);  // (>= 0: at once)
          stamp<<<1, 1, 0, b>>>(t + 1);
          break;
        case 15:
          CHECK(cudaEventRecord(done, idle));
          signal_gpu<<<1, 1, 0, b>>>(nullptr, t, 1000);
          CHECK(cudaStreamWaitEvent(b, done, 0));
          stamp<<<1, 1, 0, b>>>(t + 1);
          break;
      }
      bool hung = true;
      for (int ms = 0; ms < 500 && hung; ++ms) {
        hung = !(cudaStreamQuery(a) == cudaSuccess && cudaStreamQuery(b) == cudaSuccess);
        if (hung) usleep(1000);
      }
      if (hung) {  // release every wait (values far above any target) and report the case
        unsigned high[64];
        std::fill(high, high + 64, 1000u);
        cudaStream_t u;
        CHECK(cudaStreamCreateWithFlags(&u, cudaStreamNonBlocking));
        CHECK(cudaMemcpyAsync(words, high, sizeof high, cudaMemcpyHostToDevice, u));
        CHECK(cudaSetDevice(1));
        cudaStream_t u1;
        CHECK(cudaStreamCreateWithFlags(&u1, cudaStreamNonBlocking));
        CHECK(cudaMemcpyAsync(flags1, high, sizeof high, cudaMemcpyHostToDevice, u1));
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaSetDevice(0));
        CHECK(cudaDeviceSynchronize());
        printf("%-96s hung (released from the host)\n", kCases[v]);
        return 1;
      }
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaSetDevice(1));
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaSetDevice(0));
      unsigned long long stamps[2];
      CHECK(cudaMemcpy(stamps, t, sizeof stamps, cudaMemcpyDeviceToHost));
      if (run >= 5) spans.push_back((double(stamps[1]) - double(stamps[0])) / 1e3);
    }
    std::sort(spans.begin(), spans.end());
    printf("%2d %-96s median %7.2f us  min %7.2f  max %7.2f\n", v, kCases[v], spans[spans.size() / 2], spans.front(),
           spans.back());
  }
  return 0;
}
