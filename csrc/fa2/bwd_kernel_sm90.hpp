// The Hopper backward kernel: a CTA runs key tiles (key tile, kv head, batch), one per CTA or, persistent,
// taken by one CTA per SM (BwdTileWalk). Warpgroup 0: warp 0 walks the tiles and loads (one thread issues
// TMA), warp 1 adds the staged dQ partials; warpgroups 1-2 run the GEMMs on the tiles warp 0 names. dK and
// dV of a tile's keys (summed over the group's query heads) are written once, at the tile's end.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bwd_mainloop_sm90.hpp"

namespace fa2 {

using namespace cute;

// dK (scaled here) and dV: converted, staged in the K and V buffers (stmatrix) once both warpgroups are
// done reading them, and stored with one TMA copy each (rows past Sk clipped by the tensor map); once the
// stores have read the buffers, barrier_kv_free lets the producer load the next tile's K and V. First every
// MMA thread tells the producer warp that it no longer reads the tile's name and steps (thread 0 has taken
// the store's coordinates): an arrival of each reader on barrier_tile_done, a hand-off that sanitizers
// follow, where an order through thread 0's later arrival would be as correct. The MMA warps' next
// barrier_kv phase flips here too, between two barriers that every MMA thread passes after reading it.
template <class Traits, class FragDKV>
CUTE_DEVICE void bwd_epilogue(const BwdKernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                              FragDKV& tdKrdK, const FragDKV& tdVrdV, const volatile BwdTile& tile) {
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
  const int tid = mma_thread_index_afresh();
  auto thr_copy = smem_copy.get_thread_slice(tid);
  const int n_block = tile.n_block, head_kv = tile.head_kv, batch = tile.batch;  // (used by thread 0)
  asm volatile("" ::: "memory");  // the reads stay before the arrival (CUTLASS's asm has no clobber)
  cutlass::arch::ClusterBarrier::arrive(&smem.barrier_tile_done);
  cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBwdBarrierMmaWarps);
  if (tid == 0) *static_cast<volatile int*>(&smem.kv_phase) ^= 1;
  copy(smem_copy, thr_copy.retile_S(rdK), thr_copy.partition_D(sdK));
  copy(smem_copy, thr_copy.retile_S(rdV), thr_copy.partition_D(sdV));
  cutlass::arch::fence_view_async_shared();  // st.shared visible to the TMA engine
  cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBwdBarrierMmaWarps);

  if (tid == 0) {
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
    tma_store_wait<0>();  // the stores have read the buffers
    cutlass::arch::ClusterBarrier::arrive(&smem.barrier_kv_free);
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
bwd_kernel_sm90(CUTE_GRID_CONSTANT const BwdKernelArgs<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma/setmaxnreg exist only in the sm_90a target
  using T = Traits;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);

  // The kernel before (pdl.hpp) writes what the loads and dQ additions read: the producer waits for it
  // after its first K/V loads, the other roles before they touch its output; masked kernels at once (their
  // schedules read the pre-pass's lists). The postprocess may be scheduled from now: it waits for this grid.
  if constexpr (T::kMask != MaskKind::kNone) wait_for_prior_grid();
  allow_dependent_grid();
  const int warp_group = cutlass::canonical_warp_group_idx();

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_dk.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_dv.get_tma_descriptor());
    cutlass::arch::ClusterBarrier::init(&smem.barrier_kv, 1);
    cutlass::arch::ClusterBarrier::init(&smem.barrier_kv_free, 1);  // the epilogue's storing thread
    cutlass::arch::ClusterBarrier::init(&smem.barrier_tile_done, T::kMmaThreads);
    smem.kv_phase = 0;
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
      bwd_load<T>(args, smem, pipe_q, pipe_do);
    } else if (warp == 1) {
      if constexpr (T::kStagedDq) bwd_dq_writer<T>(args, smem);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kMmaRegs>();
    wait_for_prior_grid();  // the LSE and D rows, the zeroed accumulator and turn counters
    typename T::TiledMmaDKV mma_dkv;
    Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<typename T::TileN, typename T::TileD>{});
    Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<typename T::TileN, typename T::TileD>{});
    typename T::StepState read;  // stage 0, phase 0: Q's and dO's
    // A phase of barrier_kv per tile (bwd_load) names the tile and its steps in smem.tile and smem.steps,
    // which stay until this tile's epilogue has freed K and V; the phase's parity is kept in shared memory.
    // All are read afresh where used: the MMA warps have no register to spare across the tile loop.
    const volatile BwdTile& tile = smem.tile;
    for (;;) {
      cutlass::arch::ClusterBarrier::wait(&smem.barrier_kv, *static_cast<volatile int*>(&smem.kv_phase));
      asm volatile("" ::: "memory");  // the tile is read after the wait (CUTLASS's asm has no clobber)
      if (tile.batch < 0) break;  // BwdTile::end()
      if (smem.steps.count > 0) {
        bwd_mma<T>(args, smem, pipe_q, pipe_do, read, tdKrdK, tdVrdV, tile, smem.steps, int(threadIdx.x) - 128);
      } else {
        // No query sees these keys (causal, or a mask): dK = dV = 0. Nothing was loaded.
        clear(tdKrdK);
        clear(tdVrdV);
      }
      bwd_epilogue<T>(args, smem, tdKrdK, tdVrdV, tile);
    }
    if constexpr (T::kStagedDq) finish_dq_writer<T>(smem, read, int(threadIdx.x) - 128);
  }
#elif defined(__CUDA_ARCH__)
  // Built for another target (e.g. plain sm_90 added by TORCH_CUDA_ARCH_LIST): fail loudly.
  __trap();
#endif
}

}  // namespace fa2
