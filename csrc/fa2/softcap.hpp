// Soft-capping (Gemma 2's cap * tanh(x / cap) of the scaled score x) as every kernel applies it: to the raw
// score s, before any mask, s -> out * tanh(s * in) with in = scale / cap and out = cap / scale, so that
// scale * s' = cap * tanh(scale * s / cap) and the rest of a kernel (raw or pre-scaled scores) is unchanged.
// in = 0: no soft-capping.
#pragma once

namespace fa2 {

struct SoftcapFactors {
  float in = 0.f, out = 0.f;
};

inline SoftcapFactors softcap_factors(float scale, float softcap) {
  return softcap > 0.f ? SoftcapFactors{scale / softcap, softcap / scale} : SoftcapFactors{};
}

#ifdef __CUDACC__
// tanh in one instruction (relative error below 2^-10.9, as FlashAttention's soft-capping uses).
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float soft_capped(float s, float in, float out) { return out * tanh_approx(s * in); }
#endif

}  // namespace fa2
