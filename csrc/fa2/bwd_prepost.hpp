// The two light kernels around the backward mainloop, one CTA per (query tile, query head, batch):
//  bwd_preprocess:  D = rowsum(dO * O) and the LSE rows in the mainloop's units into the workspace
//                   (padding rows inert), a zeroed dQ accumulator and turn counter for the tile, and
//                   (the first CTA) the main kernel's zeroed tile counter.
//  bwd_postprocess: dQ = scale * accumulator, converted and stored with one TMA copy.
#pragma once

#include <cmath>
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>

#include "bwd_traits.hpp"
#include "pdl.hpp"

namespace fa2 {

using namespace cute;

constexpr int kPrepostThreads = 256;

struct BwdPreprocessArgs {
  const void* o;
  const void* dout;
  const float* lse;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  int64_t lse_batch_stride, lse_head_stride;
  float* lse_rows;   // workspace: LSE in the mainloop's units
  float* dsum_rows;  // workspace: D
  float* dq_accum;
  int32_t* dq_sem;
  int32_t* tile_counter;
  int seqlen_q, heads_q, num_m_blocks;
  int head_dim;  // the tensors' (a multiple of 8, at most the kernel's): columns past it are not read
};

// The mainloop computes P = exp2(S * scale * log2(e) - lse_row), or for additive masks
// exp2((S * scale + mask - lse_row) * log2(e)) (subtracting first keeps finfo.min-sized masks finite).
// Rows without any visible key (LSE = -inf) and padding rows get +inf, so that P = 0 there.
template <class Traits>
CUTE_DEVICE float lse_row_value(float lse) {
  if (lse == -INFINITY) return INFINITY;
  return Traits::kMask == MaskKind::kAdditive ? lse : lse * float(M_LOG2E);
}

template <class Traits>
__global__ void __launch_bounds__(kPrepostThreads) bwd_preprocess(const BwdPreprocessArgs a) {
  using T = Traits;
  using Element = typename T::Element;
  allow_dependent_grid();  // the main kernel may launch now: its K/V loads do not need these rows
  constexpr int kVec = 16 / int(sizeof(Element));        // elements per 16-byte load
  constexpr int kVecsPerRow = T::kHeadDim / kVec;          // 8, 16, 24 or 32
  // A power of two within one warp (the shuffle reduction's); D = 192's 24 loads take 32 lanes, 8 idle.
  constexpr int kThreadsPerRow = kVecsPerRow > 16 ? 32 : kVecsPerRow > 8 ? 16 : 8;
  constexpr int kRowsPerPass = kPrepostThreads / kThreadsPerRow;
  static_assert(32 % kThreadsPerRow == 0 && T::kBlockM % kRowsPerPass == 0);
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int tile = (batch * a.heads_q + head) * a.num_m_blocks + m_block;  // as query_tile_index
  const int m0 = m_block * T::kBlockM;

  const int lane_in_row = threadIdx.x % kThreadsPerRow;
  const Element* o = static_cast<const Element*>(a.o) + batch * a.o_batch_stride + head * a.o_head_stride;
  const Element* dout = static_cast<const Element*>(a.dout) + batch * a.do_batch_stride + head * a.do_head_stride;
  cutlass::NumericArrayConverter<float, Element, kVec> to_float;
  CUTE_UNROLL
  for (int pass = 0; pass < T::kBlockM / kRowsPerPass; ++pass) {
    const int r = pass * kRowsPerPass + int(threadIdx.x) / kThreadsPerRow;
    const int row = m0 + r;
    float sum = 0.f;
    if (row < a.seqlen_q && lane_in_row * kVec < a.head_dim) {
      const auto ov = *reinterpret_cast<const cutlass::Array<Element, kVec>*>(o + row * a.o_row_stride + lane_in_row * kVec);
      const auto dv = *reinterpret_cast<const cutlass::Array<Element, kVec>*>(dout + row * a.do_row_stride + lane_in_row * kVec);
      const auto of = to_float(ov);
      const auto df = to_float(dv);
      CUTE_UNROLL
      for (int j = 0; j < kVec; ++j) sum += of[j] * df[j];
    }
    CUTE_UNROLL
    for (int offset = kThreadsPerRow / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane_in_row == 0) a.dsum_rows[tile * T::kBlockM + r] = sum;
  }
  for (int r = threadIdx.x; r < T::kBlockM; r += kPrepostThreads) {
    const int row = m0 + r;
    const float lse = row < a.seqlen_q ? a.lse[batch * a.lse_batch_stride + head * a.lse_head_stride + row] : -INFINITY;
    a.lse_rows[tile * T::kBlockM + r] = lse_row_value<T>(lse);
  }
  float4* accum = reinterpret_cast<float4*>(a.dq_accum + int64_t(tile) * T::kDqFloats);
  for (int i = threadIdx.x; i < T::kDqFloats / 4; i += kPrepostThreads) accum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (threadIdx.x == 0) a.dq_sem[tile] = 0;
  if (tile == 0 && threadIdx.x == 0) *a.tile_counter = 0;
}

template <class Traits>
struct BwdPostprocessArgs {
  typename Traits::TmaStoreDQ tma_dq;
  typename Traits::GShape shape_q;  // (Sq, D, Hq, B)
  const float* dq_accum;
  float scale;
  int heads_q, num_m_blocks;
};

// Each thread reads back exactly the dQ-MMA fragment the mainloop's thread of the same index added, so
// the accumulator's fragment order never needs a coordinate map here.
template <class Traits>
__global__ void __launch_bounds__(kPrepostThreads) bwd_postprocess(CUTE_GRID_CONSTANT const BwdPostprocessArgs<Traits> a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = Traits;
  using Element = typename T::Element;
  static_assert(kPrepostThreads == T::kMmaThreads);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  wait_for_prior_grid();  // the main kernel's last additions
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int tid = threadIdx.x;
  const int tile = (batch * a.heads_q + head) * a.num_m_blocks + m_block;  // as query_tile_index

  typename T::TiledMmaDQ mma_dq;
  Tensor tdQrdQ = partition_fragment_C(mma_dq, typename T::DqShape{});
  const float* accum = a.dq_accum + int64_t(tile) * T::kDqFloats;
  CUTE_UNROLL
  for (int i = 0; i < T::kDqFloatsPerThread; i += 4) {
    const float4 v = *reinterpret_cast<const float4*>(accum + dq_fragment_offset<T>(tid, i));
    tdQrdQ(i) = v.x * a.scale;
    tdQrdQ(i + 1) = v.y * a.scale;
    tdQrdQ(i + 2) = v.z * a.scale;
    tdQrdQ(i + 3) = v.w * a.scale;
  }
  Tensor rdQ = make_tensor_like<Element>(tdQrdQ);
  convert_pairs(rdQ, tdQrdQ);
  Tensor sdQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_raw)), typename T::SmemLayoutDQ{});
  // The fragment's view of the staging tile: a dQ^T fragment goes through the transposed view, with a
  // transposing stmatrix.
  using FragmentView = std::conditional_t<T::kDqTransposed, typename T::SmemLayoutDQt, typename T::SmemLayoutDQ>;
  using StoreOp = std::conditional_t<T::kDqTransposed, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>;
  Tensor sdQ_fragment_view = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_raw)), FragmentView{});
  auto smem_copy = make_tiled_copy_C(Copy_Atom<StoreOp, Element>{}, mma_dq);
  auto thr_copy = smem_copy.get_thread_slice(tid);
  copy(smem_copy, thr_copy.retile_S(rdQ), thr_copy.partition_D(sdQ_fragment_view));
  cutlass::arch::fence_view_async_shared();  // st.shared visible to the TMA engine
  __syncthreads();
  if (tid == 0) {
    Tensor mdQ = a.tma_dq.get_tma_tensor(a.shape_q);
    Tensor gdQ = local_tile(mdQ(_, _, head, batch), Shape<typename T::TileM, typename T::TileD>{},
                            make_coord(m_block, _0{}));
    auto thr_tma = a.tma_dq.get_slice(_0{});
    copy(a.tma_dq, thr_tma.partition_S(sdQ), thr_tma.partition_D(gdQ));
    tma_store_arrive();
    tma_store_wait<0>();
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

}  // namespace fa2
