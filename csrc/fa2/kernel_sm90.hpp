// The Hopper forward kernel. Warpgroup 0 is the producer (one thread issues TMA); warpgroups 1.. are
// consumers, each owning 64 query rows of a tile. Each CTA runs the query tiles QueryTiles gives it
// (tile_scheduler.hpp): many per CTA when the kernel is persistent, one otherwise.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "mainloop_sm90.hpp"
#include "epilogue_sm90.hpp"
#include "softmax.hpp"
#include "tile_scheduler.hpp"

namespace fa2 {

using namespace cute;

// Whether the tile runs at all: with args.rows_filter, only tiles holding a row that is -inf there.
// A warp-wide vote: every warp decides alone and alike, so no CTA barrier separates tiles.
template <class Traits>
CUTE_DEVICE bool tile_runs(const KernelArgs<Traits>& args, TileCoord tile) {
  if (args.rows_filter == nullptr) return true;
  const float* filter = args.rows_filter + tile.batch * args.lse_batch_stride + tile.head * args.lse_head_stride;
  bool hit = false;
  for (int r = int(threadIdx.x % 32); r < Traits::kBlockM; r += 32) {
    const int row = tile.m_block * Traits::kBlockM + r;
    hit |= row < args.seqlen_q && filter[row] == -INFINITY;
  }
  return __any_sync(0xffffffffu, hit);
}

// The producer warp: every lane walks the tiles, lane 0 issues the loads.
template <class Traits>
CUTE_DEVICE void producer_tiles(const KernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                                typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                                const typename Traits::Tiles& tiles) {
  using T = Traits;
  typename T::PipelineState write = cutlass::make_producer_start_state<typename T::Pipeline>();
  int q_loads = 0;
  for (int t = tiles.first(); t < tiles.count; t = tiles.next(t)) {
    const TileCoord tile = tiles.coord(t);
    if (!tile_runs<T>(args, tile)) continue;
    const KeyBlocks<T> blocks = key_blocks<T>(args, tile);
    if (blocks.count == 0) continue;  // no key at all: the consumers write O = 0 without Q
    if (threadIdx.x == 0) producer_load<T>(args, smem, pipe_k, pipe_v, write, q_loads, tile, blocks);
    __syncwarp();
    ++q_loads;
  }
}

// The consumer warpgroups: each tile's key loop, softmax normalisation and epilogue.
template <class Traits>
CUTE_DEVICE void consumer_tiles(const KernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                                typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                                const typename Traits::Tiles& tiles, int tid) {
  using T = Traits;
  const int wg = tid / 128;
  if constexpr (T::kPingPong) {
    static_assert(T::kConsumerWarpgroups == 2, "ping-pong schedules two consumer warpgroups");
    if (wg == 0) cutlass::arch::NamedBarrier::arrive(T::kConsumerThreads, kBarrierSchedule + 0);  // first turn
  }
  typename T::TiledMmaPV mma_pv;
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<typename T::TileM, typename T::TileD>{});
  typename T::PipelineState read;  // stage 0, phase 0
  int q_loads = 0;
  for (int t = tiles.first(); t < tiles.count; t = tiles.next(t)) {
    const TileCoord tile = tiles.coord(t);
    if (!tile_runs<T>(args, tile)) continue;
    const KeyBlocks<T> blocks = key_blocks<T>(args, tile);
    clear(tOrO);
    OnlineSoftmax<2> softmax(args.scale);
    if (blocks.count > 0) {
      consumer_mainloop<T>(args, smem, pipe_k, pipe_v, read, q_loads, tOrO, softmax, tid, tile, blocks);
      ++q_loads;
    }  // else no key at all: O = 0 and LSE = -inf.
    float lse[2];
    Tensor o_rc = as_rowcol(tOrO);
    // kAdditive tracks the row max of already scaled scores.
    const float sink = args.sinks != nullptr ? args.sinks[tile.head] : -INFINITY;
    softmax.finalize(o_rc, lse, T::kMask == MaskKind::kAdditive ? 1.f : args.scale, sink);
    epilogue_store<T>(args, smem, tOrO, lse, tid, tile);
  }
  // The other warpgroup's last hand-over, so that both turn barriers end balanced.
  if constexpr (T::kPingPong) {
    if (wg == 0) cutlass::arch::NamedBarrier::sync(T::kConsumerThreads, kBarrierSchedule + 0);
  }
  if (tid == 0) tma_store_wait<0>();  // shared memory lives until the last store has read it
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
fwd_kernel_sm90(CUTE_GRID_CONSTANT const KernelArgs<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma/setmaxnreg exist only in the sm_90a target
  using T = Traits;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);

  const int warp_group = cutlass::canonical_warp_group_idx();
  const typename T::Tiles tiles(args.seqlen_q, T::kBlockM, get<2>(args.shape_q), get<3>(args.shape_q));

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_o.get_tma_descriptor());
    reinterpret_cast<cutlass::arch::ClusterTransactionBarrier*>(&smem.barrier_q)->init(1);
    reinterpret_cast<cutlass::arch::ClusterBarrier*>(&smem.barrier_q_free)->init(T::kConsumerThreads);
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
    if (threadIdx.x < 32) producer_tiles<T>(args, smem, pipe_k, pipe_v, tiles);
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    consumer_tiles<T>(args, smem, pipe_k, pipe_v, tiles, int(threadIdx.x) - 128);
  }
#elif defined(__CUDA_ARCH__)
  // Built for another target (e.g. plain sm_90 added by TORCH_CUDA_ARCH_LIST): fail loudly.
  __trap();
#endif
}

}  // namespace fa2
