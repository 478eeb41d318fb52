// Sequence-tail and causal (top-left) masking of one S tile.
#pragma once
#include <cmath>
#include <cstdint>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "params.h"

namespace fa2 {

using namespace cute;

// s_rc / coord_rc: the thread's S fragment and the matching (row, col) coordinates inside the
// tile, both in (rows, cols) view.  Keys at or past seqlen_k, and with Causal keys past the
// query index, become -inf.
template <bool Causal, class TensorS, class TensorC>
CUTE_DEVICE void apply_mask(TensorS& s_rc, const TensorC& coord_rc, int m0, int n0, int seqlen_k) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s_rc); ++r) {
    const int row = m0 + get<0>(coord_rc(r, 0));
    const int col_limit = Causal ? min(seqlen_k, row + 1) : seqlen_k;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s_rc); ++c) {
      if (n0 + get<1>(coord_rc(r, c)) >= col_limit) s_rc(r, c) = -INFINITY;
    }
  }
}

// True when block n_block of keys holds a tail or (with Causal) a key past some query row
// of the tile starting at m0.
template <bool Causal, int kBlockN>
CUTE_DEVICE bool block_needs_mask(int n_block, int m0, int seqlen_k) {
  const int n_end = (n_block + 1) * kBlockN;
  return n_end > seqlen_k || (Causal && n_end - 1 > m0);
}

// The user's attention mask as the masked kernels see it (KernelArgs::mask); see FwdParams.
struct MaskArgs {
  const void* ptr;
  int64_t batch_stride, head_stride, row_stride, col_stride;  // elements, 0 on broadcast dims
  const uint8_t* block_class;                                 // pre-pass output
  int64_t class_batch_stride, class_head_stride;              // 0 when the classification is shared
  int num_n_blocks;                                           // row length of block_class
  int dtype;                                                  // MaskDType
};
struct NoMaskArgs {};
template <MaskKind Kind> struct MaskArgsFor { using type = MaskArgs; };
template <> struct MaskArgsFor<MaskKind::kNone> { using type = NoMaskArgs; };

template <class E> CUTE_DEVICE float mask_value(const E* p) { return float(*p); }

// Partial blocks only. kBool: entries whose mask byte is 0 become -inf. kAdditive: the mask value
// (converted to float) is added to the (already scaled) score. Rows at or past seqlen_q and keys
// at or past seqlen_k are never read (the tail mask handles those keys).
template <MaskKind Kind, class E, class TensorS, class TensorC>
CUTE_DEVICE void apply_user_mask_typed(TensorS& s_rc, const TensorC& coord_rc, const E* base,
                                       const MaskArgs& mk, int m0, int n0, int seqlen_q, int seqlen_k) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s_rc); ++r) {
    const int row = m0 + get<0>(coord_rc(r, 0));
    if (row < seqlen_q) {
      const E* row_ptr = base + int64_t(row) * mk.row_stride;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) {
        const int col = n0 + get<1>(coord_rc(r, c));
        if (col < seqlen_k) {
          const E* ptr = row_ptr + int64_t(col) * mk.col_stride;
          if constexpr (Kind == MaskKind::kBool) {
            if (*ptr == 0) s_rc(r, c) = -INFINITY;
          } else {
            s_rc(r, c) += mask_value(ptr);
          }
        }
      }
    }
  }
}

template <MaskKind Kind, class TensorS, class TensorC>
CUTE_DEVICE void apply_user_mask(TensorS& s_rc, const TensorC& coord_rc, const MaskArgs& mk, int batch,
                                 int head, int m0, int n0, int seqlen_q, int seqlen_k) {
  const int64_t offset = int64_t(batch) * mk.batch_stride + int64_t(head) * mk.head_stride;
  if constexpr (Kind == MaskKind::kBool) {
    apply_user_mask_typed<Kind>(s_rc, coord_rc, static_cast<const uint8_t*>(mk.ptr) + offset, mk, m0, n0,
                                seqlen_q, seqlen_k);
  } else {
    if (mk.dtype == int(MaskDType::kF32)) {
      apply_user_mask_typed<Kind>(s_rc, coord_rc, static_cast<const float*>(mk.ptr) + offset, mk, m0, n0,
                                  seqlen_q, seqlen_k);
    } else if (mk.dtype == int(MaskDType::kBF16)) {
      apply_user_mask_typed<Kind>(s_rc, coord_rc, static_cast<const cutlass::bfloat16_t*>(mk.ptr) + offset,
                                  mk, m0, n0, seqlen_q, seqlen_k);
    } else {
      apply_user_mask_typed<Kind>(s_rc, coord_rc, static_cast<const cutlass::half_t*>(mk.ptr) + offset, mk,
                                  m0, n0, seqlen_q, seqlen_k);
    }
  }
}

}  // namespace fa2
