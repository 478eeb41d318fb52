// Sequence-tail and causal (top-left) masking of one S tile.
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

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

}  // namespace fa2
