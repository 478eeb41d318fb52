// Attention masks in the backward kernel. The forward's pre-pass (mask_prepass.hpp) classifies the
// mask's (query tile x key tile) blocks at the backward's tile sizes; list_cta_steps then turns the
// classes into each CTA's list of steps (blocks hidden by the mask or by the causal positions left
// out), and rank_key_blocks gives the deterministic mode its turn order. Partial blocks apply the mask
// element by element on the S^T fragment; additive masks that require grad also add dS into a float32
// gradient buffer.
#pragma once

#include <cmath>
#include <cstdint>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "mask.hpp"
#include "bwd_params.h"  // kMaxHeadRatio
#include "global_reduce.hpp"  // red_add_f32
#include "params.h"
#include "softmax.hpp"  // acc_rowcol_layout, quad_sum

namespace fa2 {

using namespace cute;

// The masked backward's view of the mask: the forward's pre-pass outputs plus the column lists, the
// deterministic mode's turn ranks and the optional mask gradient.
struct BwdMaskArgs {
  MaskArgs classes;      // pre-pass outputs at the backward's tile sizes (block classes, bool bits)
  const int32_t* lists;  // [B, Hkv, N, G * num_m_blocks + 1]: each CTA's step count, then its steps
  const int32_t* ranks;  // [CB * CH, CM, N]: visited key tiles before this one (deterministic turns)
  float* dmask;          // float32 gradient of an additive mask, or null
  int64_t dmask_batch_stride, dmask_head_stride, dmask_row_stride, dmask_col_stride;
};
struct NoBwdMaskArgs {};
template <MaskKind Kind> struct BwdMaskArgsFor { using type = BwdMaskArgs; };
template <> struct BwdMaskArgsFor<MaskKind::kNone> { using type = NoBwdMaskArgs; };

constexpr int kMaskListWarps = 4;  // warps (CTAs listed, or class rows ranked) per CTA of the list kernels

// Top-left causal positions of block (m_block, n_block): query i sees key j iff j <= i and, with a
// window (window_left >= 0), j >= i - window_left. 0: no query of the block sees a key of it, 1: every
// query sees every key, 2: partial.
enum class CausalBlock { kHidden = 0, kVisible = 1, kPartial = 2 };
template <int kBlockM, int kBlockN>
CUTE_HOST_DEVICE CausalBlock causal_block(int m_block, int n_block, int window_left) {
  const int m0 = m_block * kBlockM, m_last = m0 + kBlockM - 1;
  const int n0 = n_block * kBlockN, n_last = n0 + kBlockN - 1;
  const bool window = window_left >= 0;
  if (n0 > m_last || (window && n_last < m0 - window_left)) return CausalBlock::kHidden;
  if (n_last > m0 || (window && n0 < m_last - window_left)) return CausalBlock::kPartial;
  return CausalBlock::kVisible;
}

// One warp per CTA of the main kernel, i.e. per (batch, kv head, key tile): its steps in order, every
// (query head of the group, query tile) whose block is neither fully masked nor (causal) hidden by the
// positions, as BwdSchedule entries; the entry's partial bit is the mask's. A row-broadcast mask (one
// class row) gives every query tile that row's class.
template <int kWarps, int kBlockM, int kBlockN>
__global__ void __launch_bounds__(32 * kWarps)
list_cta_steps(const MaskArgs mk, int32_t* lists, int heads_kv, int head_ratio, int num_m_blocks, int64_t ctas,
               bool causal, int window_left) {
  const int64_t cta = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (cta >= ctas) return;  // whole warps leave together
  const int lane = threadIdx.x % 32;
  const int n_block = int(cta % mk.num_n_blocks);
  const int64_t kv_slice = cta / mk.num_n_blocks;
  const int head_kv = int(kv_slice % heads_kv);
  const int batch = int(kv_slice / heads_kv);
  int32_t* list = lists + cta * (int64_t(head_ratio) * num_m_blocks + 1);
  int count = 0;
  for (int h = 0; h < head_ratio; ++h) {
    const int64_t slice = mk.class_slice(batch, head_kv * head_ratio + h);
    for (int base = 0; base < num_m_blocks; base += 32) {
      const int m_block = base + lane;
      int cls = 0;
      if (m_block < num_m_blocks) {
        const int64_t row = slice * mk.class_m_blocks + (mk.row_broadcast ? 0 : m_block);
        cls = mk.block_class[row * mk.num_n_blocks + n_block];
        if (causal && causal_block<kBlockM, kBlockN>(m_block, n_block, window_left) == CausalBlock::kHidden) cls = 0;
      }
      const uint32_t visited = __ballot_sync(0xffffffffu, cls != 0);
      if (cls != 0) {
        list[1 + count + __popc(visited & ((1u << lane) - 1u))] = (h << 17) | (m_block << 1) | (cls == 2 ? 1 : 0);
      }
      count += __popc(visited);
    }
  }
  if (lane == 0) list[0] = count;
}

// One warp per class row: for every key tile, how many visited key tiles precede it in that row.
template <int kWarps>
__global__ void __launch_bounds__(32 * kWarps) rank_key_blocks(const MaskArgs mk, int32_t* ranks, int64_t class_rows) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= class_rows) return;
  const int lane = threadIdx.x % 32;
  const uint8_t* classes = mk.block_class + row * mk.num_n_blocks;
  int32_t* out = ranks + row * mk.num_n_blocks;
  int count = 0;
  for (int base = 0; base < mk.num_n_blocks; base += 32) {
    const int n_block = base + lane;
    const int cls = n_block < mk.num_n_blocks ? classes[n_block] : 0;
    const uint32_t visited = __ballot_sync(0xffffffffu, cls != 0);
    if (n_block < mk.num_n_blocks) out[n_block] = count + __popc(visited & ((1u << lane) - 1u));
    count += __popc(visited);
  }
}

// Bool masks, partial blocks: zero P where the pre-pass's bit is clear. s_rc / c_rc: the thread's
// S^T fragment and its (key, query) tile coordinates in (rows = keys, cols = queries) view. A thread's
// two keys lie in one aligned group of 16 (GMMA accumulator layout), so one 32-bit word per query
// holds both bits.
template <int kBlockM, int kBlockN, class TensorS, class TensorC>
CUTE_DEVICE void apply_mask_bits(TensorS& s_rc, const TensorC& c_rc, const MaskArgs& mk, int m_block, int n_block,
                                 int head, int batch) {
  static_assert(decltype(size<0>(s_rc))::value == 2, "two key rows per thread");
  const int64_t row_words = int64_t(mk.num_n_blocks) * (kBlockN / 32);
  const uint32_t* words = mk.bits + mk.class_slice(batch, head) * mk.bit_rows * row_words +
                          n_block * (kBlockN / 32) + get<0>(c_rc(0, 0)) / 32;
  CUTE_UNROLL
  for (int c = 0; c < size<1>(s_rc); ++c) {
    const int64_t row = mk.row_broadcast ? 0 : int64_t(m_block) * kBlockM + get<1>(c_rc(0, c));
    const uint32_t word = words[row * row_words];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      if (!((word >> (get<0>(c_rc(r, c)) % 32)) & 1u)) s_rc(r, c) = 0.f;
    }
  }
}

// Additive masks, partial blocks: adds the mask value (as float) to each in-range element of the
// (already scaled) S^T fragment `x`. Rows past Sq and keys past Sk are never read. Four query columns
// at a time: the compiler fence keeps it from hoisting every load (and its 64-bit address) at once,
// which the MMA warps' register budget cannot hold.
template <class E, class TensorS, class TensorC>
CUTE_DEVICE void add_mask_values_transposed(TensorS& x, const TensorC& tScS, const E* base, const MaskArgs& mk,
                                            int m0, int n0, int seqlen_q, int seqlen_k) {
  Tensor x_rc = make_tensor(x.data(), acc_rowcol_layout(x.layout()));
  Tensor c_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
  constexpr int kRows = decltype(size<0>(x_rc))::value;
  const E* rows[kRows];
  bool row_ok[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int key = n0 + get<0>(c_rc(r, 0));
    row_ok[r] = key < seqlen_k;
    rows[r] = base + int64_t(key) * mk.col_stride;
  }
  CUTE_UNROLL
  for (int c = 0; c < size<1>(x_rc); ++c) {
    if (c % 4 == 0) asm volatile("" ::: "memory");
    const int query = m0 + get<1>(c_rc(0, c));
    const int64_t offset = int64_t(query) * mk.row_stride;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      if (query < seqlen_q && row_ok[r]) x_rc(r, c) += float(rows[r][offset]);
    }
  }
}

template <class TensorS, class TensorC>
CUTE_DEVICE void add_additive_mask(TensorS& x, const TensorC& tScS, const MaskArgs& mk, int batch, int head, int m0,
                                   int n0, int seqlen_q, int seqlen_k) {
  const int64_t offset = int64_t(batch) * mk.batch_stride + int64_t(head) * mk.head_stride;
  if (mk.dtype == int(MaskDType::kF32)) {
    add_mask_values_transposed(x, tScS, static_cast<const float*>(mk.ptr) + offset, mk, m0, n0, seqlen_q, seqlen_k);
  } else if (mk.dtype == int(MaskDType::kBF16)) {
    add_mask_values_transposed(x, tScS, static_cast<const cutlass::bfloat16_t*>(mk.ptr) + offset, mk, m0, n0,
                               seqlen_q, seqlen_k);
  } else {
    add_mask_values_transposed(x, tScS, static_cast<const cutlass::half_t*>(mk.ptr) + offset, mk, m0, n0, seqlen_q,
                               seqlen_k);
  }
}

// Gradient of an additive mask: dS of every in-range element added into the float32 buffer, whose
// zero strides sum the broadcast dims. A mask shared by all query rows (zero row stride) gets each
// thread's queries, then its quad's, summed first: one atomic per key and quad instead of one per query.
template <class TensorDS, class TensorC>
CUTE_DEVICE void add_mask_gradient(const BwdMaskArgs& mk, TensorDS& tdS, const TensorC& tScS, int batch, int head,
                                   int m0, int n0, int seqlen_q, int seqlen_k) {
  float* base = mk.dmask + int64_t(batch) * mk.dmask_batch_stride + int64_t(head) * mk.dmask_head_stride;
  if (mk.dmask_row_stride == 0) {
    Tensor ds_rc = make_tensor(tdS.data(), acc_rowcol_layout(tdS.layout()));
    Tensor c_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
    CUTE_UNROLL
    for (int r = 0; r < size<0>(ds_rc); ++r) {
      float sum = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(ds_rc); ++c) {
        if (m0 + get<1>(c_rc(r, c)) < seqlen_q) sum += ds_rc(r, c);
      }
      sum = quad_sum(sum);
      const int key = n0 + get<0>(c_rc(r, 0));
      if (threadIdx.x % 4 == 0 && key < seqlen_k && sum != 0.f) {
        red_add_f32(base + int64_t(key) * mk.dmask_col_stride, sum);
      }
    }
  } else {
    Tensor ds_rc = make_tensor(tdS.data(), acc_rowcol_layout(tdS.layout()));
    Tensor c_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
    CUTE_UNROLL
    for (int r = 0; r < size<0>(ds_rc); ++r) {
      const int key = n0 + get<0>(c_rc(r, 0));
      if (key >= seqlen_k) continue;
      float* row = base + int64_t(key) * mk.dmask_col_stride;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(ds_rc); ++c) {
        const int query = m0 + get<1>(c_rc(r, c));
        if (query < seqlen_q && ds_rc(r, c) != 0.f) red_add_f32(row + int64_t(query) * mk.dmask_row_stride, ds_rc(r, c));
      }
    }
  }
}

}  // namespace fa2
