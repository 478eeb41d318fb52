// Which shared-memory hand-offs compute-sanitizer follows. Every kernel below is correct by the PTX
// memory model (a barrier's arrival releases the arriving thread's earlier stores to the threads that wait
// on it); what racecheck and synccheck report on them is what the tools do not model, and the rules the
// attention kernels follow so that their sanitizer runs stay clean (docs/design.md, section 4).
//
//   nvcc -arch=sm_90a -o /tmp/sanitizer_probe scripts/sanitizer_probe.cu
//   compute-sanitizer --tool racecheck /tmp/sanitizer_probe
//   compute-sanitizer --tool synccheck /tmp/sanitizer_probe
#include <cstdint>
#include <cstdio>

__device__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }" ::"r"(smem_addr(bar)) : "memory");
}
__device__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{ .reg .pred done; WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1; @!done bra WAIT; }" ::"r"(
          smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ void named_sync(int id, int threads) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory"); }
__device__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Warp 0's lane 0 names a value and arrives on `full`; the other warps wait, read it and free it on `empty`
// before warp 0 names the next. Every reader arrives on `empty` (kOneFrees false): both tools are clean. The
// readers meet on a named barrier and one of them arrives for all (true): racecheck reports the reads against
// the next name (it does not follow the order through the other thread).
template <bool kOneFrees>
__global__ void mbarrier_hand_off(int* out) {
  __shared__ uint64_t full, empty;
  __shared__ int name;
  const int readers = blockDim.x - 32;
  if (threadIdx.x == 0) {
    mbar_init(&full, 1);
    mbar_init(&empty, kOneFrees ? 1 : readers);
  }
  __syncthreads();
  for (int round = 0; round < 4; ++round) {
    if (threadIdx.x < 32) {
      if (round > 0) mbar_wait(&empty, (round - 1) & 1);
      if (threadIdx.x == 0) {
        name = round + 7;
        mbar_arrive(&full);
      }
    } else {
      mbar_wait(&full, round & 1);
      out[round * readers + threadIdx.x - 32] = name;
      if (kOneFrees) {
        named_sync(1, readers);
        if (threadIdx.x == 32) mbar_arrive(&empty);
      } else {
        mbar_arrive(&empty);
      }
    }
  }
}

// A named-barrier hand-off: warp 1's lane 32 stores a value and meets warp 0 on barrier 2, warp 0 reads it
// and meets warp 1 on barrier 3 before the next store. The writer arrives (kWriterSyncs false: PTX's
// producer/consumer example, store then bar.arrive, bar.sync then load): racecheck reports it (it orders a
// thread's stores before its syncs, not before its arrivals), synccheck does not. The writer syncs (true),
// each role in its own branch: racecheck follows it, synccheck reports "Divergent thread(s) in block"
// (bar.sync is PTX's aligned barrier, which the threads meeting on it must reach on the same path).
template <bool kWriterSyncs>
__global__ void named_hand_off(int* out) {
  __shared__ int slot;
  for (int round = 0; round < 4; ++round) {
    if (threadIdx.x / 32 == 1) {
      if (threadIdx.x == 32) slot = round + 7;
      if (kWriterSyncs) {
        named_sync(2, 64);
      } else {
        named_arrive(2, 64);
      }
      named_sync(3, 64);
    } else {
      named_sync(2, 64);
      out[round * 32 + threadIdx.x] = slot;
      if (kWriterSyncs) {
        named_sync(3, 64);
      } else {
        named_arrive(3, 64);
      }
    }
  }
}

int main() {
  int* out = nullptr;
  cudaMalloc(&out, 4096);
  mbarrier_hand_off<false><<<1, 64>>>(out);
  mbarrier_hand_off<true><<<1, 96>>>(out);
  named_hand_off<false><<<1, 64>>>(out);
  named_hand_off<true><<<1, 64>>>(out);
  printf("%s\n", cudaGetErrorString(cudaDeviceSynchronize()));
  return 0;
}
