// Programmatic dependent launch (Hopper): a kernel that only reads what the kernel just before it wrote is
// launched with launch_after_prior_grid, so its launch and CTA set-up overlap that kernel's run instead of
// following it; it calls wait_for_prior_grid before its first read of that kernel's output (the wait returns
// once the prior grid has finished and its writes are visible, and at once for a plain launch). The prior
// kernel calls allow_dependent_grid when it starts, which lets the dependent grid be scheduled as soon as
// every one of its CTAs is running. FA2_PDL=0 launches plainly (for measuring what it gains).
#pragma once

#include <utility>

#include <cuda_runtime.h>

#ifndef FA2_PDL
#define FA2_PDL 1
#endif

namespace fa2 {

__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

template <class... Params, class... Args>
cudaError_t launch_after_prior_grid(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                                    cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = FA2_PDL;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace fa2
