// Host side of the masked backward's pre-pass: the forward's block classification (launch.hpp's
// plan_mask and mask_prepass.hpp's classify_mask_blocks, at the backward's tile sizes), then the
// per-CTA step lists (causal positions applied) and (deterministic mode) the turn ranks of bwd_mask.hpp.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "bwd_params.h"
#include "bwd_mask.hpp"
#include "launch.hpp"  // plan_mask, MaskPlan
#include "mask_prepass.hpp"

namespace fa2 {

// Byte offsets inside the mask part of the backward's workspace.
struct BwdMaskPlan {
  int64_t lists_offset = 0, ranks_offset = 0, total_bytes = 0;  // the classification's workspace first
  int64_t list_ints = 0;  // the step lists' length: the kernel indexes them with 32 bits
};

// The mask as plan_mask reads it (only sizes and mask fields matter to it).
inline FwdParams mask_description(const BwdParams& p, void* classification_workspace) {
  FwdParams f;
  f.batch = p.batch;
  f.heads_q = p.heads_q;
  f.heads_kv = p.heads_kv;
  f.seqlen_q = p.seqlen_q;
  f.seqlen_k = p.seqlen_k;
  f.head_dim = p.head_dim;
  f.mask = p.mask;
  f.mask_dtype = p.mask_dtype;
  f.mask_batch_stride = p.mask_batch_stride;
  f.mask_head_stride = p.mask_head_stride;
  f.mask_row_stride = p.mask_row_stride;
  f.mask_col_stride = p.mask_col_stride;
  f.mask_workspace = classification_workspace;
  return f;
}

template <class Traits>
BwdMaskPlan plan_bwd_mask(const BwdParams& p) {
  auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  const MaskPlan classification = plan_mask<Traits>(mask_description(p, nullptr));
  const MaskArgs& mk = classification.args;
  const int64_t slices = int64_t(mk.class_batches) * mk.class_heads;
  const int64_t num_m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  BwdMaskPlan plan;
  plan.lists_offset = aligned(classification.workspace.total_bytes);
  const int64_t ctas = int64_t(p.batch) * p.heads_kv * mk.num_n_blocks;
  const int64_t list_ints = ctas * (int64_t(p.heads_q / p.heads_kv) * num_m_blocks + 1);
  plan.list_ints = list_ints;
  plan.ranks_offset = plan.lists_offset + aligned(list_ints * int64_t(sizeof(int32_t)));
  const int64_t rank_bytes = p.deterministic ? slices * mk.class_m_blocks * mk.num_n_blocks * int64_t(sizeof(int32_t)) : 0;
  plan.total_bytes = plan.ranks_offset + aligned(rank_bytes);
  return plan;
}

// Classifies the mask's blocks, lists each key tile's query tiles (and ranks the key tiles), and fills
// the kernel's view `out`. workspace: the mask part of the backward's workspace (plan.total_bytes).
template <class Traits>
cudaError_t launch_bwd_mask_prepass(const BwdParams& p, const BwdMaskPlan& plan, char* workspace, int num_m_blocks,
                                    int num_n_blocks, BwdMaskArgs& out, cudaStream_t stream) {
  using T = Traits;
  if (p.mask == nullptr) return cudaErrorInvalidValue;
  const MaskArgs mk = plan_mask<T>(mask_description(p, workspace)).args;
  if (mk.num_n_blocks != num_n_blocks || mk.class_m_blocks > 65535 || mk.class_batches * mk.class_heads > 65535 ||
      plan.list_ints >= (int64_t(1) << 31)) {
    return cudaErrorInvalidConfiguration;
  }
  const int64_t slices = int64_t(mk.class_batches) * mk.class_heads;
  dim3 class_grid(mk.num_n_blocks, mk.class_m_blocks, unsigned(slices));
  classify_mask_blocks<T::kBlockM, T::kBlockN, T::kMask><<<class_grid, kClassifyThreads, 0, stream>>>(
      mk, p.seqlen_q, p.seqlen_k);

  int32_t* lists = reinterpret_cast<int32_t*>(workspace + plan.lists_offset);
  const int64_t ctas = int64_t(p.batch) * p.heads_kv * mk.num_n_blocks;
  list_cta_steps<kMaskListWarps, T::kBlockM, T::kBlockN>
      <<<unsigned((ctas + kMaskListWarps - 1) / kMaskListWarps), 32 * kMaskListWarps, 0, stream>>>(
          mk, lists, p.heads_kv, p.heads_q / p.heads_kv, num_m_blocks, ctas, p.causal, p.window_left);
  int32_t* ranks = nullptr;
  if (p.deterministic) {
    ranks = reinterpret_cast<int32_t*>(workspace + plan.ranks_offset);
    const int64_t class_rows = slices * mk.class_m_blocks;
    rank_key_blocks<kMaskListWarps><<<unsigned((class_rows + kMaskListWarps - 1) / kMaskListWarps),
                                      32 * kMaskListWarps, 0, stream>>>(mk, ranks, class_rows);
  }
  out.classes = mk;
  out.lists = lists;
  out.ranks = ranks;
  out.dmask = p.dmask;
  out.dmask_batch_stride = p.dmask_batch_stride;
  out.dmask_head_stride = p.dmask_head_stride;
  out.dmask_row_stride = p.dmask_row_stride;
  out.dmask_col_stride = p.dmask_col_stride;
  return cudaGetLastError();
}

}  // namespace fa2
