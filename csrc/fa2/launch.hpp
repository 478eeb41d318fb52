// Host side: build the TMA descriptors from the real strides and launch the kernel on the
// caller's stream. No allocation and no synchronisation (safe under CUDA graph capture).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>
#include <cute/tensor.hpp>

#include "params.h"
#include "kernel_sm90.hpp"
#include "mask_prepass.hpp"
#include "smem_limit.hpp"

namespace fa2 {

using namespace cute;

// The masked kernels' view of p's mask: class grid, 16-byte path, and the pre-pass outputs' places
// in p.mask_workspace (null pointers when it is not allocated yet; `workspace` gives its size).
struct MaskPlan {
  MaskArgs args;
  MaskWorkspace workspace;
};

template <class Traits>
MaskPlan plan_mask(const FwdParams& p) {
  using T = Traits;
  MaskArgs mk{};
  mk.ptr = p.mask;
  mk.batch_stride = p.mask_batch_stride;
  mk.head_stride = p.mask_head_stride;
  mk.row_stride = p.mask_row_stride;
  mk.col_stride = p.mask_col_stride;
  mk.dtype = int(p.mask_dtype);
  auto aligned16 = [](int64_t bytes) { return bytes % 16 == 0; };
  mk.vector_bytes = p.mask_dtype == MaskDType::kBool && p.mask_col_stride == 1 &&
                    aligned16(int64_t(reinterpret_cast<uintptr_t>(p.mask))) && aligned16(p.mask_row_stride) &&
                    aligned16(p.mask_head_stride) && aligned16(p.mask_batch_stride);
  mk.row_broadcast = p.mask_row_stride == 0;
  const int num_m_blocks = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  mk.class_batches = p.mask_batch_stride == 0 ? 1 : p.batch;
  mk.class_heads = p.mask_head_stride == 0 ? 1 : p.heads_q;
  mk.class_m_blocks = mk.row_broadcast ? 1 : num_m_blocks;
  mk.num_n_blocks = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;
  mk.bit_rows = mk.row_broadcast ? 1 : num_m_blocks * T::kBlockM;
  const MaskWorkspace ws = MaskWorkspace::plan<T::kBlockM, T::kBlockN, T::kMask>(
      int64_t(mk.class_batches) * mk.class_heads, mk.class_m_blocks, mk.num_n_blocks, mk.bit_rows);
  if (auto* base = static_cast<char*>(p.mask_workspace)) {
    mk.block_class = reinterpret_cast<uint8_t*>(base + ws.class_offset);
    mk.visit = reinterpret_cast<int32_t*>(base + ws.visit_offset);
    mk.above = reinterpret_cast<int32_t*>(base + ws.above_offset);
    mk.bits = T::kMask == MaskKind::kBool ? reinterpret_cast<uint32_t*>(base + ws.bits_offset) : nullptr;
  }
  return {mk, ws};
}

template <class Traits>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using T = Traits;
  using Element = typename T::Element;
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0) return cudaSuccess;
  if (p.head_dim <= 0 || p.head_dim > T::kHeadDim) return cudaErrorInvalidValue;

  // The tensors' own head dim: a smaller one than the kernel's is padded with zeros by the TMA loads (columns
  // past the tensor read as 0, adding nothing to Q.K^T and giving O columns of 0) and clipped by the O store.
  const int head_dim = p.head_dim;
  auto layout = [head_dim](int seqlen, int heads, int batch, int64_t row, int64_t head_s, int64_t batch_s) {
    return make_layout(make_shape(seqlen, head_dim, heads, batch),
                       make_stride(row, _1{}, head_s, batch_s));
  };
  auto lq = layout(p.seqlen_q, p.heads_q, p.batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto lk = layout(p.seqlen_k, p.heads_kv, p.batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto lv = layout(p.seqlen_k, p.heads_kv, p.batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  auto lo = layout(p.seqlen_q, p.heads_q, p.batch, p.o_row_stride, p.o_head_stride, p.o_batch_stride);

  // A zero-length key sequence still needs a valid (never used) K/V descriptor.
  if (p.seqlen_k == 0) {
    lk = layout(1, p.heads_kv, p.batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
    lv = layout(1, p.heads_kv, p.batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  }

  const SoftcapFactors softcap = softcap_factors(p.scale, p.softcap);
  const bool causal = T::kMask == MaskKind::kBool ? p.causal : T::kCausal;  // see causal_positions
  KernelArgs<T> args{
      make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(p.q)), lq),
                    typename T::SmemLayoutWarpgroupRows{}, Shape<_64, typename T::TileD>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(p.k)), lk),
                    take<0, 2>(typename T::SmemLayoutK{}), Shape<typename T::TileN, typename T::TileD>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v)), lv),
                    take<0, 2>(typename T::SmemLayoutV{}), Shape<typename T::TileN, typename T::TileD>{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element*>(p.o)), lo),
                    typename T::SmemLayoutWarpgroupRows{}, Shape<_64, typename T::TileD>{}, _1{}),
      lq.shape(),
      lk.shape(),
      p.lse,
      p.lse_batch_stride,
      p.lse_head_stride,
      p.rows_filter,
      p.seqlen_q,
      p.seqlen_k,
      p.heads_q / p.heads_kv,
      causal,
      causal ? p.window_left : -1,
      p.scale,
      softcap.in,
      softcap.out,
      p.sinks,
      {},  // mask: filled below for the masked kernels
  };

  const int num_m_blocks = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  if constexpr (T::kMask != MaskKind::kNone) {
    // Pre-pass: classify the mask's blocks (bool: and pack their bits), then list the blocks each
    // query tile visits.
    if (p.seqlen_k == 0 || p.mask_workspace == nullptr || p.mask == nullptr) return cudaErrorInvalidValue;
    args.mask = plan_mask<T>(p).args;
    const MaskArgs& mk = args.mask;
    if (mk.class_m_blocks > kMaxGridDim || mk.class_batches * mk.class_heads > kMaxGridDim) {
      return cudaErrorInvalidConfiguration;
    }
    dim3 class_grid(mk.num_n_blocks, mk.class_m_blocks, mk.class_batches * mk.class_heads);
    classify_mask_blocks<T::kBlockM, T::kBlockN, T::kMask>
        <<<class_grid, kClassifyThreads, 0, stream>>>(mk, p.seqlen_q, p.seqlen_k);
    const int64_t class_rows = int64_t(mk.class_batches) * mk.class_heads * mk.class_m_blocks;
    cudaError_t prepass_err = cudaGetLastError();
    if (prepass_err != cudaSuccess) return prepass_err;
    prepass_err = launch_after_prior_grid(&list_visited_blocks<kListWarps>,
                                          dim3(unsigned((class_rows + kListWarps - 1) / kListWarps)),
                                          dim3(32 * kListWarps), 0, stream, mk, class_rows);
    if (prepass_err != cudaSuccess) return prepass_err;
  }

  const int64_t tiles = int64_t(num_m_blocks) * p.heads_q * p.batch;
  if (2 * tiles > INT32_MAX) return cudaErrorInvalidConfiguration;  // QueryTiles numbers tiles (pairs: 2x) in int
  auto kernel = &fwd_kernel_sm90<T>;
  const int smem_bytes = T::kSmemBytes;
  const cudaError_t err = allow_dynamic_smem<&fwd_kernel_sm90<T>>(smem_bytes);
  if (err != cudaSuccess) return err;
  // Tiles of unequal cost (causal, masks) stride in pairs up to the config's limit; above it one CTA per
  // tile, which the hardware balances as SMs free up.
  const bool heaviest_first = T::kCausal || T::kMask != MaskKind::kNone;
  const bool stride = !heaviest_first || p.seqlen_q <= T::Config::kHeaviestFirstStrideMaxSeqlenQ;
  const dim3 grid = forward_grid(num_m_blocks, p.heads_q, p.batch, T::kPersistent, stride ? p.num_sms : 0);
  if (T::kMask != MaskKind::kNone || p.after_own_kernel) {  // right after the pre-pass or our masked call
    return launch_after_prior_grid(kernel, grid, dim3(T::kThreads), smem_bytes, stream, args);
  }
  kernel<<<grid, T::kThreads, smem_bytes, stream>>>(args);
  return cudaGetLastError();
}

template <int HeadDim, DType Dt, bool Causal>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Config = TileConfig<HeadDim, Causal>;
  if constexpr (Config::kLongBlockM > 0) {
    if (params.seqlen_q >= Config::kLongMinSeqlenQ) {
      return launch_fwd<KernelTraits<HeadDim, Dt, Causal, MaskKind::kNone, true>>(params, stream);
    }
  }
  return launch_fwd<KernelTraits<HeadDim, Dt, Causal>>(params, stream);
}

template <int HeadDim, DType Dt, MaskKind Kind>
cudaError_t run_fwd_masked(const FwdParams& params, cudaStream_t stream) {
  return launch_fwd<KernelTraits<HeadDim, Dt, false, Kind>>(params, stream);
}

template <int HeadDim, DType Dt, MaskKind Kind>
int64_t masked_workspace_bytes(const FwdParams& params) {
  return plan_mask<KernelTraits<HeadDim, Dt, false, Kind>>(params).workspace.total_bytes;
}

}  // namespace fa2

// One explicit instantiation per generated compile unit (csrc/kernel_table.py).
#define FA2_INSTANTIATE_FWD(HDIM, DT, CAUSAL) \
  template cudaError_t fa2::run_fwd<HDIM, fa2::DType::DT, CAUSAL>(const fa2::FwdParams&, cudaStream_t);
#define FA2_INSTANTIATE_FWD_MASKED(HDIM, DT, KIND)                                                          \
  template cudaError_t fa2::run_fwd_masked<HDIM, fa2::DType::DT, fa2::MaskKind::KIND>(const fa2::FwdParams&, \
                                                                                      cudaStream_t);
#define FA2_INSTANTIATE_MASK_WORKSPACE(HDIM, DT, KIND) \
  template int64_t fa2::masked_workspace_bytes<HDIM, fa2::DType::DT, fa2::MaskKind::KIND>(const fa2::FwdParams&);
