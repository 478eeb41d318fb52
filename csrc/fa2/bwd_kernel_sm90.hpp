// The Hopper backward kernel: one CTA per (key tile, kv head, batch). Warpgroup 0: warp 0 loads
// (one thread issues TMA), warp 1 adds the staged dQ partials; warpgroups 1-2 run the GEMMs. dK and
// dV of the CTA's keys (summed over the group's query heads) are written once, at the end.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bwd_mainloop_sm90.hpp"

namespace fa2 {

using namespace cute;

// dK (scaled here) and dV: converted, staged in the K and V buffers (stmatrix) once both warpgroups are
// done reading them, and stored with one TMA copy each (rows past Sk clipped by the tensor map).
template <class Traits, class FragDKV>
CUTE_DEVICE void bwd_epilogue(const BwdKernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                              FragDKV& tdKrdK, const FragDKV& tdVrdV, int tid, int head_kv, int batch) {
  using T = Traits;
  using Element = typename T::Element;
  typename T::TiledMmaDKV mma_dkv;
  CUTE_UNROLL
  for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= args.scale;
  Tensor rdK = make_tensor_like<Element>(tdKrdK);
  convert_pairs(rdK, tdKrdK);
  Tensor rdV = make_tensor_like<Element>(tdVrdV);
  convert_pairs(rdV, tdVrdV);

  Tensor sdK = make_tensor(make_smem_ptr(smem.k.data()), typename T::SmemLayoutK{});
  Tensor sdV = make_tensor(make_smem_ptr(smem.v.data()), typename T::SmemLayoutV{});
  auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dkv);
  auto thr_copy = smem_copy.get_thread_slice(tid);
  cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBwdBarrierEpilogue);  // K and V no longer read
  copy(smem_copy, thr_copy.retile_S(rdK), thr_copy.partition_D(sdK));
  copy(smem_copy, thr_copy.retile_S(rdV), thr_copy.partition_D(sdV));
  cutlass::arch::fence_view_async_shared();  // st.shared visible to the TMA engine
  cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBwdBarrierEpilogue);

  if (tid == 0) {
    const int n_block = bwd_key_block<T>(args);
    Tensor mdK = args.tma_dk.get_tma_tensor(args.shape_kv);
    Tensor mdV = args.tma_dv.get_tma_tensor(args.shape_kv);
    Tensor gdK = local_tile(mdK(_, _, head_kv, batch), Shape<typename T::TileN, typename T::TileD>{},
                            make_coord(n_block, _0{}));
    Tensor gdV = local_tile(mdV(_, _, head_kv, batch), Shape<typename T::TileN, typename T::TileD>{},
                            make_coord(n_block, _0{}));
    auto thr_tma_dk = args.tma_dk.get_slice(_0{});
    auto thr_tma_dv = args.tma_dv.get_slice(_0{});
    copy(args.tma_dk, thr_tma_dk.partition_S(sdK), thr_tma_dk.partition_D(gdK));
    copy(args.tma_dv, thr_tma_dv.partition_S(sdV), thr_tma_dv.partition_D(gdV));
    tma_store_arrive();
    tma_store_wait<0>();  // keep shared memory alive until the stores have read it
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
bwd_kernel_sm90(CUTE_GRID_CONSTANT const BwdKernelArgs<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma/setmaxnreg exist only in the sm_90a target
  using T = Traits;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);

  const int warp_group = cutlass::canonical_warp_group_idx();
  const int n_block = bwd_key_block<T>(args);
  const int head_kv = blockIdx.y;
  const int batch = blockIdx.z;
  const int steps = bwd_schedule<T>(args, n_block, head_kv, batch).count;

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_dk.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_dv.get_tma_descriptor());
    cutlass::arch::ClusterBarrier::init(&smem.barrier_kv, 1);
  }

  using PipelineQ = typename T::PipelineQ;
  using PipelineDO = typename T::PipelineDO;
  typename PipelineQ::Params params_q;
  params_q.transaction_bytes = T::kBytesQ + T::kBytesRowStats;
  params_q.role = warp_group == 0 ? PipelineQ::ThreadCategory::Producer : PipelineQ::ThreadCategory::Consumer;
  params_q.is_leader = threadIdx.x == 0;
  params_q.num_consumers = T::kMmaThreads;
  typename PipelineDO::Params params_do;
  params_do.transaction_bytes = T::kBytesQ + T::kBytesRowStats;
  params_do.role = warp_group == 0 ? PipelineDO::ThreadCategory::Producer : PipelineDO::ThreadCategory::Consumer;
  params_do.is_leader = threadIdx.x == 0;
  params_do.num_consumers = T::kMmaThreads;
  PipelineQ pipe_q(smem.pipe_q, params_q, Shape<_1, _1, _1>{});
  PipelineDO pipe_do(smem.pipe_do, params_do, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier initialisation visible to every thread

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    const int warp = threadIdx.x / 32;
    if (warp == 0) {
      if (steps > 0) bwd_load<T>(args, smem, pipe_q, pipe_do, n_block, head_kv, batch);
    } else if (warp == 1) {
      if constexpr (T::kStagedDq) bwd_dq_writer<T>(args, smem, n_block, head_kv, batch);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kMmaRegs>();
    const int tid = threadIdx.x - 128;
    typename T::TiledMmaDKV mma_dkv;
    Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<typename T::TileN, typename T::TileD>{});
    Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<typename T::TileN, typename T::TileD>{});
    if (steps > 0) {
      bwd_mma<T>(args, smem, pipe_q, pipe_do, tdKrdK, tdVrdV, tid, head_kv, batch);
    } else {
      // No query sees these keys (causal, or a mask): dK = dV = 0. Nothing was loaded.
      clear(tdKrdK);
      clear(tdVrdV);
    }
    bwd_epilogue<T>(args, smem, tdKrdK, tdVrdV, tid, head_kv, batch);
  }
#elif defined(__CUDA_ARCH__)
  // Built for another target (e.g. plain sm_90 added by TORCH_CUDA_ARCH_LIST): fail loudly.
  __trap();
#endif
}

}  // namespace fa2
