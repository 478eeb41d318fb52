// Host side of the backward: plan the workspace, build the TMA descriptors from the real strides and
// launch preprocess -> [mask pre-pass] -> main kernel -> dQ postprocess on the caller's stream, the last two
// as dependents of the kernel before them (pdl.hpp). No allocation and no synchronisation (safe under CUDA
// graph capture).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>
#include <cute/tensor.hpp>

#include "bwd_params.h"
#include "bwd_kernel_sm90.hpp"
#include "bwd_prepost.hpp"
#include "bwd_mask_prepass.hpp"
#include "pdl.hpp"
#include "smem_limit.hpp"

namespace fa2 {

using namespace cute;

template <class Traits>
struct BwdPlan {
  BwdWorkspace workspace;
  BwdMaskPlan mask;  // masked kernels only
};

template <class Traits>
BwdPlan<Traits> plan_bwd(const BwdParams& p) {
  BwdPlan<Traits> plan;
  if constexpr (Traits::kMask != MaskKind::kNone) plan.mask = plan_bwd_mask<Traits>(p);
  plan.workspace = BwdWorkspace::plan<Traits>(p.batch, p.heads_q, p.seqlen_q, plan.mask.total_bytes);
  return plan;
}

template <class Traits>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
  using T = Traits;
  using Element = typename T::Element;
  // Empty problems (no query, key, head or batch) are the caller's: they need no kernel at all.
  if (p.batch <= 0 || p.heads_q <= 0 || p.seqlen_q <= 0 || p.seqlen_k <= 0 || p.workspace == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (p.head_dim <= 0 || p.head_dim > T::kHeadDim || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) {
    return cudaErrorInvalidValue;
  }
  // Causal is the unmasked kernels' template argument; a window needs causal; soft-capping is recovered
  // from log2 probabilities, which an additive mask's values would shift.
  if ((T::kMask == MaskKind::kNone && p.causal != T::kCausal) || (p.window_left >= 0 && !p.causal) ||
      (p.softcap > 0.f && T::kMask == MaskKind::kAdditive)) {
    return cudaErrorInvalidValue;
  }
  const BwdPlan<T> plan = plan_bwd<T>(p);
  char* ws = static_cast<char*>(p.workspace);
  float* lse_rows = reinterpret_cast<float*>(ws + plan.workspace.lse_offset);
  float* dsum_rows = reinterpret_cast<float*>(ws + plan.workspace.dsum_offset);
  float* dq_accum = reinterpret_cast<float*>(ws + plan.workspace.dq_offset);
  int32_t* dq_sem = reinterpret_cast<int32_t*>(ws + plan.workspace.sem_offset);
  int32_t* tile_counter = reinterpret_cast<int32_t*>(ws + plan.workspace.counter_offset);
  const int num_m_blocks = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  const int num_n_blocks = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;
  const int64_t num_tiles = int64_t(num_n_blocks) * p.heads_kv * p.batch;
  if (num_m_blocks > 65535 || p.heads_q > 65535 || p.batch > 65535 || num_tiles > INT32_MAX ||
      p.heads_q / p.heads_kv >= kMaxHeadRatio) {
    return cudaErrorInvalidConfiguration;  // grid limits; step entries name 16-bit query tiles, 14-bit heads
  }

  // 1. D = rowsum(dO * O), LSE rows, zeroed dQ accumulator, turn counters and tile counter.
  BwdPreprocessArgs pre{p.o, p.dout, p.lse,
                        p.o_batch_stride, p.o_head_stride, p.o_row_stride,
                        p.do_batch_stride, p.do_head_stride, p.do_row_stride,
                        p.lse_batch_stride, p.lse_head_stride,
                        lse_rows, dsum_rows, dq_accum, dq_sem, tile_counter,
                        p.seqlen_q, p.heads_q, num_m_blocks, p.head_dim};
  const dim3 query_grid(num_m_blocks, p.heads_q, p.batch);
  bwd_preprocess<T><<<query_grid, kPrepostThreads, 0, stream>>>(pre);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  // 2. The mainloop.
  // As the forward: a smaller head dim than the kernel's is zero-padded by the TMA loads (every product with
  // the padding is 0) and clipped by the dQ, dK and dV stores.
  const int head_dim = p.head_dim;
  auto layout = [head_dim](int seqlen, int heads, int batch, int64_t row, int64_t head_s, int64_t batch_s) {
    return make_layout(make_shape(seqlen, head_dim, heads, batch), make_stride(row, _1{}, head_s, batch_s));
  };
  auto lq = layout(p.seqlen_q, p.heads_q, p.batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto ldo = layout(p.seqlen_q, p.heads_q, p.batch, p.do_row_stride, p.do_head_stride, p.do_batch_stride);
  auto ldq = layout(p.seqlen_q, p.heads_q, p.batch, p.dq_row_stride, p.dq_head_stride, p.dq_batch_stride);
  auto lk = layout(p.seqlen_k, p.heads_kv, p.batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto lv = layout(p.seqlen_k, p.heads_kv, p.batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  auto ldk = layout(p.seqlen_k, p.heads_kv, p.batch, p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride);
  auto ldv = layout(p.seqlen_k, p.heads_kv, p.batch, p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride);
  auto tile_q = Shape<typename T::TileM, typename T::TileD>{};
  auto tile_kv = Shape<typename T::TileN, typename T::TileD>{};
  auto gmem = [](const void* ptr) { return make_gmem_ptr(static_cast<Element const*>(ptr)); };
  auto gmem_out = [](void* ptr) { return make_gmem_ptr(static_cast<Element*>(ptr)); };
  const SoftcapFactors softcap = softcap_factors(p.scale, p.softcap);
  BwdKernelArgs<T> args{
      make_tma_copy(SM90_TMA_LOAD{}, make_tensor(gmem(p.q), lq), take<0, 2>(typename T::SmemLayoutQ{}), tile_q, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, make_tensor(gmem(p.dout), ldo), take<0, 2>(typename T::SmemLayoutDO{}), tile_q, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, make_tensor(gmem(p.k), lk), typename T::SmemLayoutK{}, tile_kv, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, make_tensor(gmem(p.v), lv), typename T::SmemLayoutV{}, tile_kv, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, make_tensor(gmem_out(p.dk), ldk), typename T::SmemLayoutK{}, tile_kv, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, make_tensor(gmem_out(p.dv), ldv), typename T::SmemLayoutV{}, tile_kv, _1{}),
      lq.shape(),
      lk.shape(),
      lse_rows,
      dsum_rows,
      dq_accum,
      dq_sem,
      p.seqlen_q,
      p.seqlen_k,
      p.heads_q,
      p.heads_q / p.heads_kv,
      num_m_blocks,
      num_n_blocks,
      false, false, 0, 0, {}, {}, tile_counter,  // the walk: set with the grid below
      // Causal deterministic: descending key tiles, the turn order of dq_turn (shortest CTAs first).
      T::kCausal && p.deterministic ? num_n_blocks - 1 : 0,
      T::kCausal && p.deterministic ? -1 : 1,
      p.scale,
      p.scale * float(M_LOG2E),
      p.deterministic,
      p.causal,
      p.causal ? p.window_left : -1,
      softcap.in,
      softcap.out,
      p.softcap > 0.f ? 1.f / (p.softcap * float(M_LOG2E)) : 0.f,
      {},  // mask: filled below for the masked kernels
  };
  if constexpr (T::kMask != MaskKind::kNone) {
    err = launch_bwd_mask_prepass<T>(p, plan.mask, ws + plan.workspace.mask_offset, num_m_blocks, num_n_blocks,
                                     args.mask, stream);
    if (err != cudaSuccess) return err;
  }
  err = allow_dynamic_smem<&bwd_kernel_sm90<T>>(T::kSmemBytes);
  if (err != cudaSuccess) return err;
  // One CTA per SM taking slots of paired key tiles, or one per tile (deterministic: see BwdTileWalk; long
  // query sequences: kBwdStrideMaxSeqlenQ).
  const bool persistent = p.num_sms > 0 && !p.deterministic && p.seqlen_q <= kBwdStrideMaxSeqlenQ;
  const bool uneven = p.causal || T::kMask != MaskKind::kNone;  // key tiles of unequal cost: paired
  const int64_t ctas = plan_bwd_walk(args, num_n_blocks, p.heads_kv, p.batch, persistent, uneven, p.num_sms);
  err = launch_after_prior_grid(&bwd_kernel_sm90<T>, dim3(unsigned(ctas)), dim3(T::kThreads), T::kSmemBytes, stream,
                                args);
  if (err != cudaSuccess) return err;

  // 3. dQ = scale * accumulator.
  BwdPostprocessArgs<T> post{
      make_tma_copy(SM90_TMA_STORE{}, make_tensor(gmem_out(p.dq), ldq), typename T::SmemLayoutDQ{}, tile_q, _1{}),
      ldq.shape(), dq_accum, p.scale, p.heads_q, num_m_blocks};
  constexpr int kPostSmem = int(cosize_v<typename T::SmemLayoutDQ>) * int(sizeof(Element));
  err = allow_dynamic_smem<&bwd_postprocess<T>>(kPostSmem);
  if (err != cudaSuccess) return err;
  return launch_after_prior_grid(&bwd_postprocess<T>, query_grid, dim3(kPrepostThreads), kPostSmem, stream, post);
}

// Calls `run` with the traits of the kernel a call runs (as a null pointer of that type): the config's
// long-sequence tile from kLongMinSeqlenQ query rows, where it has one. The launch and its workspace size
// both choose here, so they always agree.
template <int HeadDim, DType Dt, bool Causal, MaskKind Kind, class Run>
auto with_bwd_traits(const BwdParams& params, Run run) {
  using Config = BwdTileConfig<HeadDim, Kind != MaskKind::kNone, Causal>;
  if constexpr (Config::kLongBlockM > 0) {
    if (params.seqlen_q >= Config::kLongMinSeqlenQ) return run(static_cast<BwdTraits<HeadDim, Dt, Causal, Kind, true>*>(nullptr));
  }
  return run(static_cast<BwdTraits<HeadDim, Dt, Causal, Kind>*>(nullptr));
}

template <int HeadDim, DType Dt, bool Causal, MaskKind Kind>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
  return with_bwd_traits<HeadDim, Dt, Causal, Kind>(params, [&](auto* traits) {
    return launch_bwd<std::remove_pointer_t<decltype(traits)>>(params, stream);
  });
}

template <int HeadDim, DType Dt, bool Causal, MaskKind Kind>
int64_t bwd_workspace_bytes(const BwdParams& params) {
  return with_bwd_traits<HeadDim, Dt, Causal, Kind>(params, [&](auto* traits) {
    return plan_bwd<std::remove_pointer_t<decltype(traits)>>(params).workspace.total_bytes;
  });
}

}  // namespace fa2

// One explicit instantiation per generated compile unit (csrc/kernel_table.py).
#define FA2_INSTANTIATE_BWD(HDIM, DT, CAUSAL, KIND)                                                          \
  template cudaError_t fa2::run_bwd<HDIM, fa2::DType::DT, CAUSAL, fa2::MaskKind::KIND>(const fa2::BwdParams&, \
                                                                                      cudaStream_t);        \
  template int64_t fa2::bwd_workspace_bytes<HDIM, fa2::DType::DT, CAUSAL, fa2::MaskKind::KIND>(const fa2::BwdParams&);
