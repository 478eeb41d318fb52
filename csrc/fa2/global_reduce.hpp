// Additions into float32 global memory that return nothing (PTX red). atomicAdd compiles to an atom that
// brings the old value back into registers, which none of the kernels' additions read.
#pragma once

namespace fa2 {

__device__ __forceinline__ void red_add_f32(float* gmem, float x) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(gmem), "f"(x) : "memory");
}

__device__ __forceinline__ void red_add_f32x4(float* gmem, float x, float y, float z, float w) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(gmem), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}

}  // namespace fa2
