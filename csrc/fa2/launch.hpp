// Host side: build the TMA descriptors from the real strides and launch the kernel on the
// caller's stream. No allocation and no synchronisation (safe under CUDA graph capture).
#pragma once

#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>
#include <cute/tensor.hpp>

#include "params.h"
#include "kernel_sm90.hpp"
#include "mask_prepass.hpp"

namespace fa2 {

using namespace cute;

template <class Traits>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using T = Traits;
  using Element = typename T::Element;
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0) return cudaSuccess;

  auto layout = [](int seqlen, int heads, int batch, int64_t row, int64_t head_s, int64_t batch_s) {
    return make_layout(make_shape(seqlen, int(T::kHeadDim), heads, batch),
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

  KernelArgs<T> args{
      make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(p.q)), lq),
                    typename T::SmemLayoutQ{}, Shape<typename T::TileM, typename T::TileD>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(p.k)), lk),
                    take<0, 2>(typename T::SmemLayoutK{}), Shape<typename T::TileN, typename T::TileD>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v)), lv),
                    take<0, 2>(typename T::SmemLayoutV{}), Shape<typename T::TileN, typename T::TileD>{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element*>(p.o)), lo),
                    typename T::SmemLayoutO{}, Shape<typename T::TileM, typename T::TileD>{}, _1{}),
      lq.shape(),
      lk.shape(),
      p.lse,
      p.lse_batch_stride,
      p.lse_head_stride,
      p.seqlen_q,
      p.seqlen_k,
      p.heads_q / p.heads_kv,
      p.scale,
      {},  // mask: filled below for the masked kernels
  };

  const int num_m_blocks = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  if constexpr (T::kMask != MaskKind::kNone) {
    // Pre-pass: classify the mask's blocks into p.block_class, [CB, CH, num_m, num_n].
    const int num_n_blocks = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;
    if (p.seqlen_k == 0 || p.block_class == nullptr || p.mask == nullptr) return cudaErrorInvalidValue;
    if (num_m_blocks > 65535 || p.class_batches * p.class_heads > 65535) return cudaErrorInvalidConfiguration;
    const int64_t per_head = int64_t(num_m_blocks) * num_n_blocks;
    args.mask = MaskArgs{p.mask,
                         p.mask_batch_stride,
                         p.mask_head_stride,
                         p.mask_row_stride,
                         p.mask_col_stride,
                         p.block_class,
                         p.class_batches > 1 ? int64_t(p.class_heads) * per_head : 0,
                         p.class_heads > 1 ? per_head : 0,
                         num_n_blocks,
                         int(p.mask_dtype)};
    dim3 class_grid(num_n_blocks, num_m_blocks, p.class_batches * p.class_heads);
    classify_mask_blocks<T::kBlockM, T::kBlockN>
        <<<class_grid, kClassifyThreads, 0, stream>>>(args.mask, p.block_class, p.seqlen_q, p.seqlen_k, p.class_heads);
    cudaError_t class_err = cudaGetLastError();
    if (class_err != cudaSuccess) return class_err;
  }

  auto kernel = &fwd_kernel_sm90<T>;
  const int smem_bytes = T::kSmemBytes;
  // Raise the dynamic shared-memory limit once per device, so a later CUDA graph capture only
  // sees the launch.
  static std::atomic<uint64_t> configured_devices{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(configured_devices.load(std::memory_order_relaxed) & bit)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return err;
    configured_devices.fetch_or(bit, std::memory_order_relaxed);
  }
  dim3 grid(num_m_blocks, p.heads_q, p.batch);
  kernel<<<grid, T::kThreads, smem_bytes, stream>>>(args);
  return cudaGetLastError();
}

template <int HeadDim, DType Dt, bool Causal>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
  return launch_fwd<KernelTraits<HeadDim, Dt, Causal>>(params, stream);
}

template <int HeadDim, DType Dt, MaskKind Kind>
cudaError_t run_fwd_masked(const FwdParams& params, cudaStream_t stream) {
  return launch_fwd<KernelTraits<HeadDim, Dt, false, Kind>>(params, stream);
}

template <int HeadDim, DType Dt>
void masked_tile_shape(int* block_m, int* block_n) {
  using T = KernelTraits<HeadDim, Dt, false, MaskKind::kBool>;
  *block_m = T::kBlockM;
  *block_n = T::kBlockN;
}

}  // namespace fa2

// One explicit instantiation per compile unit in csrc/instantiations/.
#define FA2_INSTANTIATE_FWD(HDIM, DT, CAUSAL) \
  template cudaError_t fa2::run_fwd<HDIM, fa2::DType::DT, CAUSAL>(const fa2::FwdParams&, cudaStream_t);
#define FA2_INSTANTIATE_FWD_MASKED(HDIM, DT, KIND) \
  template cudaError_t fa2::run_fwd_masked<HDIM, fa2::DType::DT, fa2::MaskKind::KIND>(const fa2::FwdParams&, cudaStream_t);
#define FA2_INSTANTIATE_MASKED_TILE(HDIM, DT) \
  template void fa2::masked_tile_shape<HDIM, fa2::DType::DT>(int*, int*);
