// The Hopper forward kernel: one CTA per (query tile, head, batch).
// Warpgroup 0 is the producer (one thread issues TMA); warpgroups 1.. are consumers, each
// owning 64 query rows of the tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "mainloop_sm90.hpp"
#include "epilogue_sm90.hpp"
#include "softmax.hpp"

namespace fa2 {

using namespace cute;

// True when one of the tile's rows is -inf in args.rows_filter (a whole-CTA vote, before any barrier).
template <class Traits>
CUTE_DEVICE bool tile_has_filtered_row(const KernelArgs<Traits>& args, int m_block, int head, int batch) {
  static_assert(Traits::kThreads >= Traits::kBlockM);
  const int row = m_block * Traits::kBlockM + int(threadIdx.x);
  const float* filter = args.rows_filter + batch * args.lse_batch_stride + head * args.lse_head_stride;
  const bool hit = threadIdx.x < Traits::kBlockM && row < args.seqlen_q && filter[row] == -INFINITY;
  return __syncthreads_or(hit);
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
fwd_kernel_sm90(CUTE_GRID_CONSTANT const KernelArgs<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma/setmaxnreg exist only in the sm_90a target
  using T = Traits;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);

  const int warp_group = cutlass::canonical_warp_group_idx();
  const int num_m_blocks = gridDim.x;
  // Causal tiles differ in cost: launch the most expensive (last) query tiles first. Masked kernels
  // do the same: the masks of real models are mostly causal-like (HF causal, sliding windows).
  constexpr bool kReverseM = T::kCausal || T::kMask != MaskKind::kNone;
  const int m_block = kReverseM ? num_m_blocks - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  if (args.rows_filter != nullptr && !tile_has_filtered_row<T>(args, m_block, head, batch)) return;
  // Masked kernels: fully masked key blocks (pre-pass classes) are never loaded nor computed; the
  // list is read here so its latency overlaps the barrier set-up.
  const KeyBlocks<T> blocks = key_blocks<T>(args, m_block, head, batch);

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_o.get_tma_descriptor());
    reinterpret_cast<cutlass::arch::ClusterTransactionBarrier*>(&smem.barrier_q)->init(1);
  }

  typename T::Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = T::kBytesKV;
  pipe_params.role = warp_group == 0 ? T::Pipeline::ThreadCategory::Producer
                                     : T::Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = T::kConsumerThreads;
  typename T::Pipeline pipe_k(smem.pipe_k, pipe_params, Shape<_1, _1, _1>{});
  typename T::Pipeline pipe_v(smem.pipe_v, pipe_params, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier initialisation visible to every thread

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x == 0 && blocks.count > 0) {
      producer_load<T>(args, smem, pipe_k, pipe_v, m_block, head, batch, blocks);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    const int tid = threadIdx.x - 128;
    typename T::TiledMmaPV mma_pv;
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<typename T::TileM, typename T::TileD>{});
    clear(tOrO);
    OnlineSoftmax<2> softmax(args.scale);
    if (blocks.count > 0) {
      consumer_mainloop<T>(args, smem, pipe_k, pipe_v, tOrO, softmax, tid, m_block, blocks, head, batch);
    } else {
      // No key at all: O = 0 and LSE = -inf. Q was never loaded, nothing to wait for.
    }
    float lse[2];
    Tensor o_rc = as_rowcol(tOrO);
    // kAdditive tracks the row max of already scaled scores.
    const float sink = args.sinks != nullptr ? args.sinks[head] : -INFINITY;
    softmax.finalize(o_rc, lse, T::kMask == MaskKind::kAdditive ? 1.f : args.scale, sink);
    epilogue_store<T>(args, smem, tOrO, lse, tid, m_block, head, batch);
  }
#elif defined(__CUDA_ARCH__)
  // Built for another target (e.g. plain sm_90 added by TORCH_CUDA_ARCH_LIST): fail loudly.
  __trap();
#endif
}

}  // namespace fa2
