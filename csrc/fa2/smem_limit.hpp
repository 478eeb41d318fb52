// Raising a kernel's dynamic shared-memory limit once per device (host side).
#pragma once

#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

namespace fa2 {

// Dynamic shared memory one CTA may take on sm_90 (228 KiB per SM less the 1 KiB the system reserves).
inline constexpr int kSmemCapacityBytes = 227 * 1024;

// Kernel's limit raised to `bytes` the first time it launches on a device, so that a later CUDA graph capture
// only sees launches. The kernel is a template argument: one record per kernel, even where several kernels
// share a signature.
template <auto Kernel>
cudaError_t allow_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> configured_devices{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(configured_devices.load(std::memory_order_relaxed) & bit)) {
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
    configured_devices.fetch_or(bit, std::memory_order_relaxed);
  }
  return cudaSuccess;
}

}  // namespace fa2
