// Online softmax over the QK^T accumulator, kept entirely in registers.
//
// Each thread of a consumer warpgroup owns two rows of the 64-row slice of S; a row is
// spread over the four threads of a quad, so row reductions finish with two xor-shuffles.
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

namespace fa2 {

using namespace cute;

// View a GMMA accumulator fragment ((2, 2, V), MMA_M, MMA_N) as (rows, cols):
// rows = (row-half, MMA_M), cols = (column pair, 8-column groups, MMA_N).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol_layout(Layout l) {
  static_assert(decltype(rank(l))::value == 3);
  static_assert(decltype(rank(get<0>(l)))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

template <class Engine, class Layout>
CUTE_DEVICE auto as_rowcol(Tensor<Engine, Layout>& t) {
  return make_tensor(t.data(), acc_rowcol_layout(t.layout()));
}

// Re-read an fp32 GMMA accumulator layout ((2, 2, N/8), M, 1) as the register A operand of a
// 16-bit k16 GMMA: ((2, 2, 2), M, N/16). Two adjacent 8-column groups form one k16 slice.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_to_a_operand_layout(Layout l) {
  auto split = logical_divide(get<0, 2>(l), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(split)),
                     get<1>(l),
                     coalesce(make_layout(get<0, 1>(split), get<2>(l))));
}

CUTE_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return x;
}
CUTE_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x;
}

// With kLazyRescale (tile_config.h says which head dims), the running max a row keeps until a block's scores
// exceed it by more than this many powers of two (in the exponent's units): P then stays below
// 2^kRescaleThreshold, harmless in float32 sums and in the 16-bit P (bf16's range is float32's; fp16 holds up
// to 65504), and while every row of a warp keeps its max the warp skips O's rescale (D/2 multiplies per thread
// and key block). 0 rescales whenever a max grows, with the bits of an always-rescaling softmax.
#ifndef FA2_RESCALE_THRESHOLD
#define FA2_RESCALE_THRESHOLD 8
#endif
constexpr float kRescaleThreshold = FA2_RESCALE_THRESHOLD;

template <int kRows, bool kLazyRescale>
struct OnlineSoftmax {
  float row_max[kRows];  // running max of raw scores (before scaling), -inf when none seen
  float row_sum[kRows];  // per-thread partial sum of exp; reduced over the quad at the end
  float scale_log2;      // softmax scale * log2(e)

  CUTE_DEVICE explicit OnlineSoftmax(float scale) : scale_log2(scale * float(M_LOG2E)) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }
  }

  // Turns S (raw scores, masked entries -inf) into unnormalised P in place and returns, in
  // `correction`, the factor by which the running O must be rescaled.
  // kScaled (additive masks): S already holds scale * scores + mask, so the row max is tracked in
  // those units and exp2((s - max) * log2(e)) is used: subtracting first keeps huge finite masks
  // (e.g. finfo.min) finite, where max * log2(e) could overflow. finalize() then takes scale = 1.
  template <bool kFirst, bool kScaled = false, class TensorS>
  CUTE_DEVICE void update(TensorS& s_rc, float (&correction)[kRows]) {
    static_assert(decltype(size<0>(s_rc))::value == kRows);
    if constexpr (kScaled) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float m = kFirst ? -INFINITY : row_max[r];
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s_rc); ++c) m = fmaxf(m, s_rc(r, c));
        m = quad_max(m);
        if constexpr (kFirst) {
          correction[r] = 1.f;
          row_max[r] = m;
        } else if (kLazyRescale && (m - row_max[r]) * float(M_LOG2E) <= kRescaleThreshold) {  // NaN: rescale
          correction[r] = 1.f;
        } else {
          correction[r] = exp2f((row_max[r] - (m == -INFINITY ? 0.f : m)) * float(M_LOG2E));
          row_max[r] = m;
        }
        const float m_off = (row_max[r] == -INFINITY) ? 0.f : row_max[r];
        float sum = 0.f;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s_rc); ++c) {
          const float p = exp2f((s_rc(r, c) - m_off) * float(M_LOG2E));
          s_rc(r, c) = p;
          sum += p;
        }
        row_sum[r] = kFirst ? sum : row_sum[r] * correction[r] + sum;
      }
    } else {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float m = kFirst ? -INFINITY : row_max[r];
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s_rc); ++c) m = fmaxf(m, s_rc(r, c));
        m = quad_max(m);
        if constexpr (kFirst) {
          correction[r] = 1.f;
          row_max[r] = m;
        } else if (kLazyRescale && (m - row_max[r]) * scale_log2 <= kRescaleThreshold) {  // NaN: rescale
          correction[r] = 1.f;
        } else {
          correction[r] = exp2f(row_max[r] * scale_log2 - (m == -INFINITY ? 0.f : m * scale_log2));
          row_max[r] = m;
        }
        // A row with nothing visible yet keeps max -inf; use 0 as the offset so exp2 gives 0.
        const float m_scaled = (row_max[r] == -INFINITY) ? 0.f : row_max[r] * scale_log2;
        float sum = 0.f;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s_rc); ++c) {
          const float p = exp2f(s_rc(r, c) * scale_log2 - m_scaled);
          s_rc(r, c) = p;
          sum += p;
        }
        row_sum[r] = kFirst ? sum : row_sum[r] * correction[r] + sum;
      }
    }
  }

  // With kLazyRescale, skipped by a warp none of whose rows changed its max (correction 1 keeps the bits).
  template <class TensorO>
  CUTE_DEVICE void rescale(TensorO& o_rc, const float (&correction)[kRows]) {
    if constexpr (kLazyRescale) {
      bool changed = false;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) changed |= correction[r] != 1.f;
      if (!__any_sync(0xffffffffu, changed)) return;
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= correction[r];
    }
  }

  // Normalises O by the row sums and returns the natural-log LSE per row. `sink` (natural-log units of
  // the scaled scores, -inf for none) joins each row's denominator: a row that saw no key then gets
  // O = 0 and LSE = sink; without a sink such a row gets O = 0 and LSE = -inf.
  template <class TensorO>
  CUTE_DEVICE void finalize(TensorO& o_rc, float (&lse)[kRows], float scale, float sink) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool seen = sum > 0.f;
      const float m_scores = seen ? row_max[r] * scale : -INFINITY;
      const float m = fmaxf(m_scores, sink);  // the row's largest logit, sink included
      float inv = 0.f;
      if (m == -INFINITY) {
        lse[r] = -INFINITY;
      } else {
        // O and sum are relative to m_scores; w rescales them to m (1 when there is no sink).
        const float w = seen ? (m_scores == m ? 1.f : expf(m_scores - m)) : 0.f;
        const float total = sum * w + (sink == -INFINITY ? 0.f : expf(sink - m));
        lse[r] = m + logf(total);
        inv = w / total;
      }
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= inv;
    }
  }
};

}  // namespace fa2
