// WGMMA m64n80k16 with both operands in shared memory and float accumulators, for bf16 and fp16, as a CuTe
// MMA atom. CUTLASS ships N = 80 among its "extended" shapes, whose headers (76k lines, ~5 s more per compile
// unit) come only with them all; the backward's 80-row query tiles need this one shape (S^T, dP^T, dQ^T).
#pragma once

#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace fa2 {

// The instruction for operand type TYPE ("bf16" or "f16"): 40 accumulators, the two shared-memory
// descriptors, whether to add to the accumulators, and each operand's major-ness (0: K, 1: MN).
#define FA2_WGMMA_M64N80K16_SS(TYPE)                                                                             \
  asm volatile(                                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"                                                               \
      "wgmma.mma_async.sync.aligned.m64n80k16.f32." TYPE "." TYPE " "                                            \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9,\n"                                                               \
      " %10, %11, %12, %13, %14, %15, %16, %17, %18, %19,\n"                                                     \
      " %20, %21, %22, %23, %24, %25, %26, %27, %28, %29,\n"                                                     \
      " %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, %43, %44;\n}\n"                    \
      : "+f"(d00), "+f"(d01), "+f"(d02), "+f"(d03), "+f"(d04), "+f"(d05), "+f"(d06), "+f"(d07),                  \
        "+f"(d08), "+f"(d09), "+f"(d10), "+f"(d11), "+f"(d12), "+f"(d13), "+f"(d14), "+f"(d15),                  \
        "+f"(d16), "+f"(d17), "+f"(d18), "+f"(d19), "+f"(d20), "+f"(d21), "+f"(d22), "+f"(d23),                  \
        "+f"(d24), "+f"(d25), "+f"(d26), "+f"(d27), "+f"(d28), "+f"(d29), "+f"(d30), "+f"(d31),                  \
        "+f"(d32), "+f"(d33), "+f"(d34), "+f"(d35), "+f"(d36), "+f"(d37), "+f"(d38), "+f"(d39)                   \
      : "l"(desc_a), "l"(desc_b), "r"(int32_t(scale_d)), "n"(int32_t(kMajorA)), "n"(int32_t(kMajorB)))

template <class Element, cute::GMMA::Major kMajorA, cute::GMMA::Major kMajorB>
struct Wgmma64x80x16SS {
  using DRegisters = void;
  using ARegisters = uint64_t[1];
  using BRegisters = uint64_t[1];
  using CRegisters = float[40];

  CUTE_HOST_DEVICE static void fma(
      uint64_t const& desc_a, uint64_t const& desc_b,
      float& d00, float& d01, float& d02, float& d03, float& d04, float& d05, float& d06, float& d07,
      float& d08, float& d09, float& d10, float& d11, float& d12, float& d13, float& d14, float& d15,
      float& d16, float& d17, float& d18, float& d19, float& d20, float& d21, float& d22, float& d23,
      float& d24, float& d25, float& d26, float& d27, float& d28, float& d29, float& d30, float& d31,
      float& d32, float& d33, float& d34, float& d35, float& d36, float& d37, float& d38, float& d39,
      cute::GMMA::ScaleOut const scale_d = cute::GMMA::ScaleOut::One) {
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
    if constexpr (cute::is_same_v<Element, cutlass::bfloat16_t>) {
      FA2_WGMMA_M64N80K16_SS("bf16");
    } else {
      static_assert(cute::is_same_v<Element, cutlass::half_t>, "bf16 or fp16 operands");
      FA2_WGMMA_M64N80K16_SS("f16");
    }
#else
    CUTE_INVALID_CONTROL_PATH("Wgmma64x80x16SS needs sm_90a");
#endif
  }
};

#undef FA2_WGMMA_M64N80K16_SS

}  // namespace fa2

namespace cute {

template <class Element, GMMA::Major kMajorA, GMMA::Major kMajorB>
struct MMA_Traits<fa2::Wgmma64x80x16SS<Element, kMajorA, kMajorB>> {
  using ValTypeD = float;
  using ValTypeA = Element;
  using ValTypeB = Element;
  using ValTypeC = float;
  using FrgTypeA = GMMA::smem_desc<kMajorA>;
  using FrgTypeB = GMMA::smem_desc<kMajorB>;
  using Shape_MNK = Shape<_64, _80, _16>;
  using ThrID = Layout<_128>;
  using ALayout = GMMA::ABLayout<64, 16>;
  using BLayout = GMMA::ABLayout<80, 16>;
  using CLayout = GMMA::CLayout_64xN<80>;
  GMMA::ScaleOut accumulate_ = GMMA::ScaleOut::One;
};

}  // namespace cute
