// Sequence-tail and causal (top-left) masking of one S tile.
#pragma once
#include <cmath>
#include <cstdint>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "params.h"

namespace fa2 {

using namespace cute;

// Position masking of one S tile: keys at or past seqlen_k; with causal, keys past the query index
// (top-left: query i sees keys j <= i) and, when window_left >= 0, keys before i - window_left (a
// sliding window of window_left + 1 keys ending at the diagonal). Masked entries become -inf.
// s_rc / coord_rc: the thread's S fragment and the matching (row, col) coordinates inside the tile,
// both in (rows, cols) view. `causal` is a constant in unmasked kernels (their template argument) and a
// run-time value in masked ones (causal_positions in mainloop_sm90.hpp).
template <class TensorS, class TensorC>
CUTE_DEVICE void apply_mask(bool causal, TensorS& s_rc, const TensorC& coord_rc, int m0, int n0, int seqlen_k,
                            int window_left) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s_rc); ++r) {
    const int row = m0 + get<0>(coord_rc(r, 0));
    const int col_limit = causal ? min(seqlen_k, row + 1) : seqlen_k;
    const int col_first = causal && window_left >= 0 ? row - window_left : 0;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s_rc); ++c) {
      const int col = n0 + get<1>(coord_rc(r, c));
      if (col >= col_limit || col < col_first) s_rc(r, c) = -INFINITY;
    }
  }
}

// True when key block n_block holds, for some query row of the tile starting at m0, a key that
// apply_mask hides: the sequence tail, (causal) a key past the diagonal or before the window.
template <int kBlockM, int kBlockN>
CUTE_DEVICE bool block_needs_mask(bool causal, int n_block, int m0, int seqlen_k, int window_left) {
  const int n0 = n_block * kBlockN, n_end = n0 + kBlockN;
  if (n_end > seqlen_k) return true;
  if (!causal) return false;
  return n_end - 1 > m0 || (window_left >= 0 && n0 < m0 + kBlockM - 1 - window_left);
}

// The key blocks [first, last] a query tile starting at m0 can see through position masking alone
// (last < first: none).
template <int kBlockM, int kBlockN>
CUTE_DEVICE void visible_key_block_range(bool causal, int m0, int seqlen_k, int window_left, int& first, int& last) {
  int end = seqlen_k;
  if (causal) end = min(seqlen_k, m0 + kBlockM);
  last = (end + kBlockN - 1) / kBlockN - 1;
  first = causal && window_left >= 0 ? max(0, m0 - window_left) / kBlockN : 0;
}

// The user's attention mask as the masked kernels see it (KernelArgs::mask), and where the
// pre-pass (mask_prepass.hpp) leaves its results. Mask dims with a zero stride share one
// classification: CB / CH / CM (class batches, heads, query tiles) are 1 for them.
struct MaskArgs {
  const void* ptr;
  int64_t batch_stride, head_stride, row_stride, col_stride;  // elements, 0 on broadcast dims
  int dtype;                                                  // MaskDType
  bool vector_bytes;   // bool mask with contiguous keys and 16-byte aligned rows: 16-byte loads
  bool row_broadcast;  // every query row reads the same mask row (zero row stride): CM = 1
  int class_batches, class_heads, class_m_blocks, num_n_blocks;
  uint8_t* block_class;  // [CB, CH, CM, N]: 0 fully masked, 1 fully visible, 2 partial
  int32_t* visit;        // [CB, CH, CM, N + 1]: count, then block * 2 + partial, highest block first
  int32_t* above;        // [CB, CH, CM, N]: how many visit entries have a block above n (causal cuts)
  uint32_t* bits;        // bool masks: [CB, CH, bit_rows, N * kBlockN / 32], bit set = attend
  int bit_rows;          // row_broadcast ? 1 : CM * kBlockM; rows past seqlen_q, keys past seqlen_k: 0

  // Index of the (class batch, class head) slice that (batch, head) reads.
  CUTE_HOST_DEVICE int64_t class_slice(int batch, int head) const {
    return int64_t(class_batches == 1 ? 0 : batch) * class_heads + (class_heads == 1 ? 0 : head);
  }
};
struct NoMaskArgs {};
template <MaskKind Kind> struct MaskArgsFor { using type = MaskArgs; };
template <> struct MaskArgsFor<MaskKind::kNone> { using type = NoMaskArgs; };

// Partial blocks of bool masks: the pre-pass's bit matrix, one 32-bit word per 32 keys of a row,
// for this thread's rows. Loaded before the S GEMM is waited on, so the load hides under it.
// A thread's S columns are its base column (0..6, even) plus 8j (+1) (GMMA accumulator layout), so
// after shifting each word right by the base column every element tests a compile-time bit.
template <int kBlockN, int kRows>
struct MaskBitsFragment {
  static constexpr int kWords = kBlockN / 32;
  static_assert(kBlockN % 64 == 0, "bit rows are loaded as 8-byte vectors");
  uint32_t words[kRows][kWords];

  // tile_bits: the block's first word in row 0 of its class slice; row_words: 0 for a broadcast row.
  template <class TensorC>
  CUTE_DEVICE void load(const uint32_t* tile_bits, int64_t row_words, const TensorC& coord_rc, int m0) {
    const int col_base = get<1>(coord_rc(0, 0));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const uint32_t* row = tile_bits + int64_t(m0 + get<0>(coord_rc(r, 0))) * row_words;
      CUTE_UNROLL
      for (int w = 0; w < kWords; w += 2) {
        const uint2 pair = *reinterpret_cast<const uint2*>(row + w);
        words[r][w] = pair.x >> col_base;
        words[r][w + 1] = pair.y >> col_base;
      }
    }
  }

  template <class TensorS, class TensorC>
  CUTE_DEVICE void apply(TensorS& s_rc, const TensorC& coord_rc) const {
    static_assert(decltype(size<0>(s_rc))::value == kRows);
    const int col_base = get<1>(coord_rc(0, 0));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) {
        const int offset = get<1>(coord_rc(r, c)) - col_base;  // 8j or 8j + 1: folds to a constant
        if (!((words[r][offset / 32] >> (offset % 32)) & 1u)) s_rc(r, c) = -INFINITY;
      }
    }
  }
};

// What kernels without a bool mask pass where the bits would go.
struct NoMaskBits {};

// Partial blocks of additive masks: the mask value (converted to float) is added to the (already
// scaled) score. Rows at or past seqlen_q and keys at or past seqlen_k are never read (the tail
// mask handles those keys).
template <class E, class TensorS, class TensorC>
CUTE_DEVICE void add_mask_values(TensorS& s_rc, const TensorC& coord_rc, const E* base, const MaskArgs& mk,
                                 int m0, int n0, int seqlen_q, int seqlen_k) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s_rc); ++r) {
    const int row = m0 + get<0>(coord_rc(r, 0));
    if (row < seqlen_q) {
      const E* row_ptr = base + int64_t(row) * mk.row_stride;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) {
        const int col = n0 + get<1>(coord_rc(r, c));
        if (col < seqlen_k) s_rc(r, c) += float(row_ptr[int64_t(col) * mk.col_stride]);
      }
    }
  }
}

template <class TensorS, class TensorC>
CUTE_DEVICE void apply_additive_mask(TensorS& s_rc, const TensorC& coord_rc, const MaskArgs& mk, int batch,
                                     int head, int m0, int n0, int seqlen_q, int seqlen_k) {
  const int64_t offset = int64_t(batch) * mk.batch_stride + int64_t(head) * mk.head_stride;
  if (mk.dtype == int(MaskDType::kF32)) {
    add_mask_values(s_rc, coord_rc, static_cast<const float*>(mk.ptr) + offset, mk, m0, n0, seqlen_q, seqlen_k);
  } else if (mk.dtype == int(MaskDType::kBF16)) {
    add_mask_values(s_rc, coord_rc, static_cast<const cutlass::bfloat16_t*>(mk.ptr) + offset, mk, m0, n0,
                    seqlen_q, seqlen_k);
  } else {
    add_mask_values(s_rc, coord_rc, static_cast<const cutlass::half_t*>(mk.ptr) + offset, mk, m0, n0, seqlen_q,
                    seqlen_k);
  }
}

}  // namespace fa2
