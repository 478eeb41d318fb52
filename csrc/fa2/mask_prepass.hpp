// Light pre-pass of the masked kernels: classifies each (batch, head, query tile, key tile) block of
// the user's mask as fully masked (0), fully visible (1) or partial (2). Only entries inside
// [Sq, Sk] count. Bool: visible = true. Additive: visible = exactly 0, masked = -inf (anything
// else, NaN included, is partial). One CTA per block; heads/batches with a zero mask stride share
// one classification (the grid's z covers only the class batches x class heads).
#pragma once

#include <cmath>
#include <cstdint>
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "mask.hpp"
#include "params.h"

namespace fa2 {

constexpr int kClassifyThreads = 256;

template <class E>
CUTE_DEVICE void classify_entries(const E* base, const MaskArgs& mk, int rows, int cols, bool& all_visible,
                                  bool& all_masked) {
  const int total = rows * cols;
  for (int e = threadIdx.x; e < total; e += kClassifyThreads) {
    const int r = e / cols;
    const int c = e - r * cols;
    const E raw = base[int64_t(r) * mk.row_stride + int64_t(c) * mk.col_stride];
    if constexpr (std::is_same_v<E, uint8_t>) {
      const bool v = raw != 0;
      all_visible &= v;
      all_masked &= !v;
    } else {
      const float x = float(raw);
      all_visible &= (x == 0.f);
      all_masked &= (x == -INFINITY);
    }
    if (!all_visible && !all_masked) break;  // already partial
  }
}

template <int kBlockM, int kBlockN>
__global__ void __launch_bounds__(kClassifyThreads)
classify_mask_blocks(const MaskArgs mk, uint8_t* block_class, int seqlen_q, int seqlen_k, int class_heads) {
  const int n_block = blockIdx.x;
  const int m_block = blockIdx.y;
  const int cb = blockIdx.z / class_heads;
  const int ch = blockIdx.z - cb * class_heads;
  const int m0 = m_block * kBlockM, n0 = n_block * kBlockN;
  const int rows = min(kBlockM, seqlen_q - m0);
  const int cols = min(kBlockN, seqlen_k - n0);
  const int64_t offset = int64_t(cb) * mk.batch_stride + int64_t(ch) * mk.head_stride +
                         int64_t(m0) * mk.row_stride + int64_t(n0) * mk.col_stride;
  bool all_visible = true, all_masked = true;
  switch (mk.dtype) {
    case int(MaskDType::kBool):
      classify_entries(static_cast<const uint8_t*>(mk.ptr) + offset, mk, rows, cols, all_visible, all_masked);
      break;
    case int(MaskDType::kF32):
      classify_entries(static_cast<const float*>(mk.ptr) + offset, mk, rows, cols, all_visible, all_masked);
      break;
    case int(MaskDType::kBF16):
      classify_entries(static_cast<const cutlass::bfloat16_t*>(mk.ptr) + offset, mk, rows, cols, all_visible,
                       all_masked);
      break;
    default:
      classify_entries(static_cast<const cutlass::half_t*>(mk.ptr) + offset, mk, rows, cols, all_visible,
                       all_masked);
      break;
  }
  all_visible = __syncthreads_and(all_visible);
  all_masked = __syncthreads_and(all_masked);
  if (threadIdx.x == 0) {
    block_class[(int64_t(blockIdx.z) * gridDim.y + m_block) * gridDim.x + n_block] =
        all_masked ? 0 : (all_visible ? 1 : 2);
  }
}

}  // namespace fa2
