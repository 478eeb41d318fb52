// The Hopper forward kernel. Warpgroup 0 is the producer (one thread issues TMA); warpgroups 1.. are
// consumers, each owning 64 query rows of a tile. Each CTA runs the query tiles QueryTiles gives it
// (tile_scheduler.hpp): many per CTA when the kernel is persistent, one otherwise.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "mainloop_sm90.hpp"
#include "pdl.hpp"
#include "epilogue_sm90.hpp"
#include "softmax.hpp"
#include "tile_scheduler.hpp"

namespace fa2 {

using namespace cute;

// Whether the tile runs at all: with args.rows_filter, only tiles holding a row that is -inf there.
// kWholeCta: one vote of the whole CTA (one tile per CTA, before the roles split: the fewest registers);
// otherwise each warp votes alone and alike, so no CTA barrier separates a persistent CTA's tiles.
template <class Traits, bool kWholeCta>
CUTE_DEVICE bool tile_runs(const KernelArgs<Traits>& args, TileCoord tile) {
  if (args.rows_filter == nullptr) return true;
  const float* filter = args.rows_filter + tile.batch * args.lse_batch_stride + tile.head * args.lse_head_stride;
  const int first_row = tile.m_block * Traits::kBlockM;
  if constexpr (kWholeCta) {
    static_assert(Traits::kThreads >= Traits::kBlockM);
    const int row = first_row + int(threadIdx.x);
    return __syncthreads_or(threadIdx.x < Traits::kBlockM && row < args.seqlen_q && filter[row] == -INFINITY);
  } else {
    bool hit = false;
    for (int row = first_row + int(threadIdx.x % 32); row < first_row + Traits::kBlockM; row += 32) {
      hit |= row < args.seqlen_q && filter[row] == -INFINITY;
    }
    return __any_sync(0xffffffffu, hit);
  }
}

// Whether a tile that runs loads Q: every one where the epilogue stages O in the Q blocks of a
// persistent CTA (the blocks must be free when the epilogue writes them), else those with key blocks.
template <class Traits>
CUTE_DEVICE bool loads_q(const KeyBlocks<Traits>& blocks) {
  return Traits::kQEveryTile || blocks.count > 0;
}

// The producer warp of a persistent CTA: every lane walks the tiles, lane 0 issues the loads.
template <class Traits>
CUTE_DEVICE void producer_tiles(const KernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                                typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                                const typename Traits::Tiles& tiles) {
  using T = Traits;
  typename T::PipelineState write = cutlass::make_producer_start_state<typename T::Pipeline>();
  int q_loads = 0;
  for (int t = tiles.first(); t < tiles.count; t = tiles.next(t)) {
    const TileCoord tile = tiles.coord(t);
    if (!tile_runs<T, false>(args, tile)) continue;
    const KeyBlocks<T> blocks = key_blocks<T>(args, tile);
    if (!loads_q<T>(blocks)) continue;  // no key at all: the consumers write O = 0 without Q
    if (threadIdx.x == 0) producer_load<T>(args, smem, pipe_k, pipe_v, write, q_loads, tile, blocks);
    __syncwarp();
    ++q_loads;
  }
}

// One tile's consumer work: the key loop, the softmax normalisation and the epilogue.
template <class Traits, class FragO>
CUTE_DEVICE void consumer_tile(const KernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                               typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                               typename Traits::PipelineState& read, int q_loads, FragO& tOrO, int tid,
                               TileCoord tile, const KeyBlocks<Traits>& blocks) {
  using T = Traits;
  clear(tOrO);
  OnlineSoftmax<2, T::Config::kLazyRescale> softmax(args.scale);
  if (blocks.count > 0) {
    consumer_mainloop<T>(args, smem, pipe_k, pipe_v, read, q_loads, tOrO, softmax, tid, tile, blocks);
  } else if constexpr (T::kQEveryTile) {  // no key at all: O = 0 and LSE = -inf, staged where Q has landed
    smem.q_loaded(tid / 128).wait(q_loads % 2);
  }  // else no key at all: O = 0 and LSE = -inf (Q was never loaded).
  float lse[2];
  Tensor o_rc = as_rowcol(tOrO);
  // kAdditive tracks the row max of already scaled scores.
  const float sink = args.sinks != nullptr ? args.sinks[tile.head] : -INFINITY;
  softmax.finalize(o_rc, lse, T::kMask == MaskKind::kAdditive ? 1.f : args.scale, sink);
  epilogue_store<T>(args, smem, tOrO, lse, tid, tile);
}

// The consumer warpgroups: their tiles (a persistent CTA's stride, or the one tile), between opening
// the ping-pong turns and closing them balanced.
template <class Traits>
CUTE_DEVICE void consumer_tiles(const KernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                                typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                                const typename Traits::Tiles& tiles, TileCoord one_tile,
                                const KeyBlocks<Traits>& one_tile_blocks, int tid) {
  using T = Traits;
  const int wg = tid / 128;
  if constexpr (T::kPingPong) {
    static_assert(T::kConsumerWarpgroups == 2, "ping-pong schedules two consumer warpgroups");
    if (wg == 0) cutlass::arch::NamedBarrier::arrive(T::kConsumerThreads, kBarrierSchedule + 0);  // first turn
  }
  typename T::TiledMmaPV mma_pv;
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<typename T::TileM, typename T::TileD>{});
  typename T::PipelineState read;  // stage 0, phase 0
  if constexpr (T::kPersistent) {
    int q_loads = 0;
    for (int t = tiles.first(); t < tiles.count; t = tiles.next(t)) {
      const TileCoord tile = tiles.coord(t);
      if (!tile_runs<T, false>(args, tile)) continue;
      const KeyBlocks<T> blocks = key_blocks<T>(args, tile);
      consumer_tile<T>(args, smem, pipe_k, pipe_v, read, q_loads, tOrO, tid, tile, blocks);
      q_loads += loads_q<T>(blocks);
    }
  } else {
    consumer_tile<T>(args, smem, pipe_k, pipe_v, read, 0, tOrO, tid, one_tile, one_tile_blocks);
  }
  // The other warpgroup's last hand-over, so that both turn barriers end balanced.
  if constexpr (T::kPingPong) {
    if (wg == 0) cutlass::arch::NamedBarrier::sync(T::kConsumerThreads, kBarrierSchedule + 0);
  }
  // Shared memory lives until the warpgroup's last store has read it.
  if (T::kPersistent && tid % 128 == 0) tma_store_wait<0>();
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
fwd_kernel_sm90(CUTE_GRID_CONSTANT const KernelArgs<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma/setmaxnreg exist only in the sm_90a target
  using T = Traits;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);

  // Launched after the pre-pass (masked kernels) or the masked call (the rows filter) it reads: wait for it
  // (at once for a plain launch); the empty-row pass after this kernel may be scheduled from now (pdl.hpp).
  wait_for_prior_grid();
  allow_dependent_grid();
  const int warp_group = cutlass::canonical_warp_group_idx();
  const typename T::Tiles tiles(args.seqlen_q, T::kBlockM, get<2>(args.shape_q), get<3>(args.shape_q));
  // One tile per CTA: whether it runs and its key blocks are known before the roles split, so the
  // list's read overlaps the barrier set-up and no loop state takes registers.
  TileCoord one_tile{};
  KeyBlocks<T> one_tile_blocks;
  if constexpr (!T::kPersistent) {
    one_tile = tiles.coord(0);
    if (!tile_runs<T, true>(args, one_tile)) return;
    one_tile_blocks = key_blocks<T>(args, one_tile);
  }

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_o.get_tma_descriptor());
    for (int w = 0; w < T::kConsumerWarpgroups; ++w) {
      smem.q_loaded(w).init(1);
      // All the warpgroup's threads after its last S GEMM, or its epilogue's storing thread (O in the block).
      smem.q_free(w).init(T::kOwnOBuffer ? 128 : 1);
    }
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
    if constexpr (T::kPersistent) {
      if (threadIdx.x < 32) producer_tiles<T>(args, smem, pipe_k, pipe_v, tiles);
    } else if (threadIdx.x == 0 && one_tile_blocks.count > 0) {
      typename T::PipelineState write = cutlass::make_producer_start_state<typename T::Pipeline>();
      producer_load<T>(args, smem, pipe_k, pipe_v, write, 0, one_tile, one_tile_blocks);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    consumer_tiles<T>(args, smem, pipe_k, pipe_v, tiles, one_tile, one_tile_blocks, int(threadIdx.x) - 128);
  }
#elif defined(__CUDA_ARCH__)
  // Built for another target (e.g. plain sm_90 added by TORCH_CUDA_ARCH_LIST): fail loudly.
  __trap();
#endif
}

}  // namespace fa2
