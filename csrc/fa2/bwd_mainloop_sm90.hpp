// Mainloop of the Hopper backward kernel. One CTA owns a key tile of one (batch, kv head); per step
// (one query tile of one query head of the group) the MMA warpgroups run
//   S^T = K.Q^T, dP^T = V.dO^T          (SS-WGMMA, both in registers)
//   P = exp(S * scale - LSE), dS = P * (dP - D)
//   dV += P^T.dO, dK += dS^T.Q          (RS-WGMMA from registers; SS through shared memory for D = 256)
//   dQ  = dS.K                          (SS-WGMMA; dS written to shared memory with transposing stmatrix)
// and add the float32 dQ partial to the accumulator (a writer warp's bulk reductions, or direct atomics).
// The producer warp streams Q/LSE and dO/D tiles through two TMA pipelines; K and V are loaded once.
#pragma once

#include <climits>
#include <cmath>
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "bwd_traits.hpp"
#include "bwd_mask.hpp"
#include "global_reduce.hpp"  // red_add_f32x4
#include "pdl.hpp"
#include "softmax.hpp"  // acc_to_a_operand_layout

namespace fa2 {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// Schedule: the query tiles a CTA visits, shared by the producer, the MMA warpgroups and the writer.

// The steps of one CTA: (query head of the kv head's group, query tile) pairs, heads outer and query
// tiles ascending, as entries head_in_group << 17 | m_block << 1 | partial (m_block < 65536). Unmasked:
// every query tile that sees a key of this tile (causal: from the diagonal on, up to the window's end),
// the same for every head; `partial` is unused (tails and causal edges follow from the indices).
// Masked: the pre-pass's list, blocks hidden by the mask or the causal positions left out.
template <class Traits>
struct BwdSchedule : BwdSteps {
  BwdSchedule() = default;
  // The copy the producer published in shared memory (SharedStorage::steps), read afresh.
  CUTE_DEVICE explicit BwdSchedule(const volatile BwdSteps& published)
      : BwdSteps{published.first, published.begin, published.per_head, published.count} {}

  // (A 32-bit index rather than a pointer: one register less in the MMA warps' loop.)
  CUTE_DEVICE int entry(const BwdKernelArgs<Traits>& args, int step) const {
    if constexpr (Traits::kMask == MaskKind::kNone) {
      const int head_in_group = step / per_head;
      return (head_in_group << 17) | ((begin + step - head_in_group * per_head) << 1);
    } else {
      return args.mask.lists[first + step];
    }
  }
  CUTE_HOST_DEVICE static int head_in_group(int entry) { return entry >> 17; }
  CUTE_HOST_DEVICE static int block(int entry) { return (entry >> 1) & 0xffff; }
  CUTE_HOST_DEVICE static bool partial(int entry) { return entry & 1; }
};

// Whether this call hides the causal positions: a template argument of the unmasked kernels, a run-time
// flag of the masked ones.
template <class Traits>
CUTE_DEVICE bool hides_causal(const BwdKernelArgs<Traits>& args) {
  if constexpr (Traits::kCausal) {
    return true;
  } else if constexpr (Traits::kMask != MaskKind::kNone) {
    return args.causal;
  } else {
    return false;
  }
}

template <class Traits>
CUTE_DEVICE BwdSchedule<Traits> bwd_schedule(const BwdKernelArgs<Traits>& args, int n_block, int head_kv, int batch) {
  using T = Traits;
  BwdSchedule<Traits> schedule;
  if constexpr (Traits::kMask == MaskKind::kNone) {
    // Top-left causal: key tile n is first seen by query tile floor(n * kBlockN / kBlockM) and, with a
    // window, last by the tile of query n * kBlockN + kBlockN - 1 + window_left.
    int end = args.num_m_blocks;
    if constexpr (T::kCausal) {
      schedule.begin = n_block * T::kBlockN / T::kBlockM;
      if (args.window_left >= 0) {
        const int64_t last_query = int64_t(n_block + 1) * T::kBlockN - 1 + args.window_left;
        end = int(min(int64_t(end), last_query / T::kBlockM + 1));
      }
    }
    schedule.per_head = max(0, end - schedule.begin);
    schedule.count = args.head_ratio * schedule.per_head;
  } else {
    // Fits 32 bits: the lists hold B * Hq * N * M + B * Hkv * N ints, under 2^31 for any mask that fits
    // in memory (bwd_mask_prepass.hpp checks).
    const int cta = (batch * (args.heads_q / args.head_ratio) + head_kv) * args.num_n_blocks + n_block;
    const int list = cta * (args.head_ratio * args.num_m_blocks + 1);
    schedule.count = args.mask.lists[list];
    schedule.first = list + 1;
  }
  return schedule;
}

// Deterministic mode: the key tiles adding into one query tile's dQ take turns in a fixed order; this
// is the number of tiles before this one. Unmasked: ascending key tiles. Causal: descending (the grid
// launches the short, high key tiles first, through key_block_first/step, so no CTA waits for one not yet
// resident). Masked: the pre-pass's rank among the visiting tiles, ascending (with a window, less the tiles
// before it).
template <class Traits>
CUTE_DEVICE int dq_turn(const BwdKernelArgs<Traits>& args, int n_block, int m_block, int head, int batch) {
  using T = Traits;
  if constexpr (T::kMask != MaskKind::kNone) {
    const BwdMaskArgs& mk = args.mask;
    const int64_t row = mk.classes.class_slice(batch, head) * mk.classes.class_m_blocks +
                        (mk.classes.row_broadcast ? 0 : m_block);
    const int32_t* ranks = mk.ranks + row * args.num_n_blocks;
    int turn = ranks[n_block];
    if (args.causal && args.window_left >= 0) {  // the first key tile the window lets this query tile see
      turn -= ranks[max(0, m_block * T::kBlockM - args.window_left) / T::kBlockN];
    }
    return turn;
  } else if constexpr (T::kCausal) {
    // The last key tile visible to query tile m: n * kBlockN < (m + 1) * kBlockM.
    const int last = min(args.num_n_blocks - 1, ((m_block + 1) * T::kBlockM + T::kBlockN - 1) / T::kBlockN - 1);
    return last - n_block;
  } else {
    return n_block;
  }
}

// Index of the (batch, head, query tile) among all query tiles: its LSE/D rows, dQ partial and turn
// counter. 32 bits suffice: the float32 dQ accumulator holds kBlockM * D floats per tile, so 2^31 tiles
// could never be allocated.
template <class Traits>
CUTE_DEVICE int query_tile_index(const BwdKernelArgs<Traits>& args, int batch, int head, int m_block) {
  return (batch * args.heads_q + head) * args.num_m_blocks + m_block;
}

// ---------------------------------------------------------------------------------------------
// Global-memory synchronisation of the deterministic mode.

CUTE_DEVICE int load_acquire(const int32_t* ptr) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}
CUTE_DEVICE void wait_turn(const int32_t* counter, int target) {
  while (load_acquire(counter) < target) {
  }
}
// Orders global accesses of the async proxy (bulk reductions) with those of the generic proxy.
CUTE_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

CUTE_DEVICE void bulk_reduce_add(float* gmem, const float* smem, int bytes) {
  const uint32_t smem_addr = cute::cast_smem_ptr_to_uint(smem);
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :
               : "l"(gmem), "r"(smem_addr), "r"(bytes)
               : "memory");
}
CUTE_DEVICE void bulk_wait_complete() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Named barrier kBase + warpgroup with the id as an immediate in each branch (no register holds it).
template <int kBase>
CUTE_DEVICE void warpgroup_barrier_sync(int wg, int threads) {
  if (wg == 0) {
    cutlass::arch::NamedBarrier::sync(threads, kBase);
  } else {
    cutlass::arch::NamedBarrier::sync(threads, kBase + 1);
  }
}
template <int kBase>
CUTE_DEVICE void warpgroup_barrier_arrive(int wg, int threads) {
  if (wg == 0) {
    cutlass::arch::NamedBarrier::arrive(threads, kBase);
  } else {
    cutlass::arch::NamedBarrier::arrive(threads, kBase + 1);
  }
}

// ---------------------------------------------------------------------------------------------
// Producer: warp 0 walks the CTA's tiles (BwdTileWalk) and their schedules (warp-uniform, so its bookkeeping
// stays in uniform registers where it can) and lane 0 issues every load. Per tile it names the tile in
// shared memory for the other roles and loads K and V once, completing a phase of barrier_kv (a tile without
// steps completes it with a plain arrival, so that phases count tiles); per step the Q tile with its LSE rows
// on the Q pipeline and the dO tile with its D rows on the dO pipeline. The tile's name and its K and V wait
// for the previous tile's epilogue (its first barrier, and the stores that read the K and V buffers); the
// tile's first Q and dO go out before those waits. After the last tile one more phase names BwdTile::end().
template <class Traits>
CUTE_DEVICE void bwd_load(const BwdKernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                          typename Traits::PipelineQ& pipe_q, typename Traits::PipelineDO& pipe_do) {
  using T = Traits;
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename T::SmemLayoutQ{});
  Tensor sDO = make_tensor(make_smem_ptr(smem.dout.data()), typename T::SmemLayoutDO{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename T::SmemLayoutV{});
  Tensor mK = args.tma_k.get_tma_tensor(args.shape_kv);
  Tensor mV = args.tma_v.get_tma_tensor(args.shape_kv);
  Tensor mQ = args.tma_q.get_tma_tensor(args.shape_q);
  Tensor mDO = args.tma_do.get_tma_tensor(args.shape_q);
  const bool leader = threadIdx.x % 32 == 0;  // the pipelines' leader (is_leader) too
  auto write = cutlass::make_producer_start_state<typename T::PipelineQ>();  // Q's and dO's (StepState)

  // The tile the other roles run next and its steps: written once the MMA warps are done with the one
  // before (barrier_tile_done), published by barrier_kv's arrival (a release; their wait acquires it).
  auto publish = [&](const BwdTile& tile, const BwdSteps& steps) {
    __syncwarp();  // the warp has read the last copy back
    if (leader) {
      volatile BwdTile* named = &smem.tile;
      named->n_block = tile.n_block;
      named->head_kv = tile.head_kv;
      named->batch = tile.batch;
      volatile BwdSteps* published = &smem.steps;
      published->first = steps.first;
      published->begin = steps.begin;
      published->per_head = steps.per_head;
      published->count = steps.count;
      asm volatile("" ::: "memory");  // the stores stay before the arrival (CUTLASS's asm has no clobber)
    }
    __syncwarp();  // the warp reads the published copy back (load_step)
  };
  // After the first tile: the name once the MMA warps are done with the last one, then the wait for its
  // stores to have read the K/V buffers.
  auto hand_over = [&](int iteration, const BwdTile& tile, const BwdSteps& steps) {
    if (iteration > 0) cutlass::arch::ClusterBarrier::wait(&smem.barrier_tile_done, (iteration - 1) % 2);
    publish(tile, steps);
    if (iteration > 0) cutlass::arch::ClusterBarrier::wait(&smem.barrier_kv_free, (iteration - 1) % 2);
  };
  // One step's Q and dO. The tile is the walk's own before it is published and the published copy after,
  // read afresh: the producer warp's 24 registers cannot hold a tile and its steps across the step loop.
  auto load_step = [&](const auto& tile, const BwdSchedule<T>& schedule, int step) {
    const int entry = schedule.entry(args, step);
    const int head = tile.head_kv * args.head_ratio + BwdSchedule<T>::head_in_group(entry);  // K/V never copied
    const int m_block = BwdSchedule<T>::block(entry);
    const int stats_row = query_tile_index<T>(args, tile.batch, head, m_block) * T::kBlockM;

    pipe_q.producer_acquire(write);
    if (leader) {
      Tensor gQ = local_tile(mQ(_, _, head, tile.batch), Shape<typename T::TileM, typename T::TileD>{},
                             make_coord(m_block, _0{}));
      auto [tQgQ, tQsQ] = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      uint64_t* bar_q = pipe_q.producer_get_barrier(write);
      copy(args.tma_q.with(*bar_q, 0), tQgQ, tQsQ(_, write.index()));
      SM90_BULK_COPY_G2S::copy(args.lse + stats_row, bar_q, smem.lse.data() + write.index() * T::kBlockM,
                               T::kBytesRowStats);
    }

    pipe_do.producer_acquire(write);
    if (leader) {
      Tensor gDO = local_tile(mDO(_, _, head, tile.batch), Shape<typename T::TileM, typename T::TileD>{},
                              make_coord(m_block, _0{}));
      auto [tDOgDO, tDOsDO] =
          tma_partition(args.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sDO), group_modes<0, 2>(gDO));
      uint64_t* bar_do = pipe_do.producer_get_barrier(write);
      copy(args.tma_do.with(*bar_do, 0), tDOgDO, tDOsDO(_, write.index()));
      SM90_BULK_COPY_G2S::copy(args.dsum + stats_row, bar_do, smem.dsum.data() + write.index() * T::kBlockM,
                               T::kBytesRowStats);
    }
    ++write;
  };
  int iteration = 0;
  for (BwdTileWalk walk(args); walk.valid(args); walk.next(args), ++iteration) {
    const BwdTile tile = walk.tile(args);
    const BwdSchedule<T> schedule = bwd_schedule<T>(args, tile.n_block, tile.head_kv, tile.batch);

    // Each tile waits for the preprocess's LSE and D rows (pdl.hpp) after its K/V, before its own Q and dO:
    // at once but for the first, whose K/V load overlaps the preprocess; later tiles send their first Q and
    // dO early, the rows ready since the first tile's wait.
    const bool first_step_early = schedule.count > 0 && iteration > 0;
    if (first_step_early) load_step(tile, schedule, 0);
    hand_over(iteration, tile, schedule);
    if (schedule.count == 0) {  // no query sees these keys: nothing to load, the epilogue writes zeros
      if (leader) cutlass::arch::ClusterBarrier::arrive(&smem.barrier_kv);
      wait_for_prior_grid();  // before the walk's next slot: the kernel before zeroes its counter
      continue;
    }
    if (leader) {
      Tensor gK = local_tile(mK(_, _, tile.head_kv, tile.batch), Shape<typename T::TileN, typename T::TileD>{},
                             make_coord(tile.n_block, _0{}));
      Tensor gV = local_tile(mV(_, _, tile.head_kv, tile.batch), Shape<typename T::TileN, typename T::TileD>{},
                             make_coord(tile.n_block, _0{}));
      auto [tKgK, tKsK] = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&smem.barrier_kv, 2 * T::kBytesKV);
      copy(args.tma_k.with(smem.barrier_kv, 0), tKgK, tKsK);
      copy(args.tma_v.with(smem.barrier_kv, 0), tVgV, tVsV);
    }
    wait_for_prior_grid();
#pragma unroll 1  // one step's bookkeeping at a time
    for (int step = first_step_early ? 1 : 0; step < smem.steps.count; ++step) {
      load_step(smem.tile, BwdSchedule<T>(smem.steps), step);
    }
  }
  hand_over(iteration, BwdTile::end(), BwdSteps{});
  if (leader) cutlass::arch::ClusterBarrier::arrive(&smem.barrier_kv);
}

// ---------------------------------------------------------------------------------------------
constexpr int kDqHandoffThreads = 128 + 32;  // the named barriers of a hand-off: one MMA warpgroup + the writer

// dQ writer (kStagedDq): one warp adds each warpgroup's staged dQ partial to the float32 accumulator
// with a bulk reduction, then hands the staging buffer back. It follows the MMA warps' partials, not the
// tiles: the first warpgroup names each partial's query tile (and deterministic turn) in smem.dq_target (a
// slot per Q stage, in the order of the steps), and a negative query tile once the CTA has no more; the MMA
// warps take the last hand-backs before that (finish_dq_writer). Deterministic mode: waits for its turn on
// the query tile's counter first, and passes the turn on once the reductions have completed.
template <class Traits>
CUTE_DEVICE void bwd_dq_writer(const BwdKernelArgs<Traits>& args, typename Traits::SharedStorage& smem) {
  using T = Traits;
  constexpr int kHalf = T::kDqFloats / 2;  // one warpgroup's part of a tile's partial
  const bool leader = threadIdx.x % 32 == 0;
  wait_for_prior_grid();  // the accumulator and turn counters the preprocess zeroed
  CUTE_UNROLL
  for (int wg = 0; wg < T::kMmaWarpgroups; ++wg) {
    cutlass::arch::NamedBarrier::arrive(kDqHandoffThreads, kBwdBarrierDqEmpty + wg);  // staging starts empty
  }
#pragma unroll 1  // one partial's bookkeeping at a time
  for (int slot = 0;; slot = (slot + 1) % T::kStagesQ) {  // the MMA warps' Q stage of the partial's step
    cutlass::arch::NamedBarrier::sync(kDqHandoffThreads, kBwdBarrierDqFull);
    const volatile DqTarget* named = &smem.dq_target[slot];
    const DqTarget target{named->query_tile, named->turn};
    if (target.query_tile < 0) break;
    float* accum = args.dq_accum + int64_t(target.query_tile) * T::kDqFloats;
    if (args.deterministic && leader) {
      wait_turn(args.dq_sem + target.query_tile, 2 * target.turn);
      fence_proxy_async_global();
    }
    __syncwarp();  // the whole warp meets the named barriers
    CUTE_UNROLL
    for (int wg = 0; wg < T::kMmaWarpgroups; ++wg) {
      if (wg > 0) cutlass::arch::NamedBarrier::sync(kDqHandoffThreads, kBwdBarrierDqFull + wg);
      if (leader) {
        bulk_reduce_add(accum + wg * kHalf, smem.dq.data() + wg * kHalf, kHalf * int(sizeof(float)));
        tma_store_arrive();
        tma_store_wait<0>();  // the staging buffer has been read
      }
      __syncwarp();
      cutlass::arch::NamedBarrier::arrive(kDqHandoffThreads, kBwdBarrierDqEmpty + wg);
    }
    if (args.deterministic && leader) {
      bulk_wait_complete();
      fence_proxy_async_global();
      __threadfence();
      atomicAdd(args.dq_sem + target.query_tile, 2);
    }
  }
  if (leader) bulk_wait_complete();
}

// The MMA warps after their last tile (kStagedDq): the first names no query tile in the slot of the Q stage
// a next step would have had, before its sync on the last hand-back as a step names its target (racecheck
// follows a store before a sync, not one before an arrival); each warpgroup takes the writer's last
// hand-back (or, without any partial, the empty staging it started with), and the first wakes the writer.
template <class Traits>
CUTE_DEVICE void finish_dq_writer(typename Traits::SharedStorage& smem, const typename Traits::StepState& read,
                                  int tid) {
  const int wg = tid / 128;
  if (tid == 0) {
    static_cast<volatile DqTarget*>(&smem.dq_target[read.index()])->query_tile = -1;
    asm volatile("" ::: "memory");  // the store stays before the barrier (CUTLASS's asm has no clobber)
  }
  warpgroup_barrier_sync<kBwdBarrierDqEmpty>(wg, kDqHandoffThreads);
  if (wg == 0) cutlass::arch::NamedBarrier::arrive(kDqHandoffThreads, kBwdBarrierDqFull);  // as publish_dq's
}

// ---------------------------------------------------------------------------------------------
// MMA warpgroups.

// P = exp(S * scale [+ mask] - LSE) on the S^T fragment, in place; keys past Sk, keys after the query
// or before its window (causal) and masked-out entries give 0. lse: this query tile's rows in the units of lse_row_value
// (+inf for empty and padding rows, so P = 0 there).
template <class Traits, class TensorS, class TensorC>
CUTE_DEVICE void probabilities(const BwdKernelArgs<Traits>& args, TensorS& tSrS, const TensorC& tScS,
                               const float* lse, int entry, int m_block, int n_block, int head, int batch) {
  using T = Traits;
  const int m0 = m_block * T::kBlockM, n0 = n_block * T::kBlockN;
  const bool key_tail = n0 + T::kBlockN > args.seqlen_k;
  if constexpr (T::kMask == MaskKind::kAdditive) {
    // Natural units: S * scale + mask - LSE is formed before the exp2 scaling (huge finite masks).
    if (BwdSchedule<T>::partial(entry)) {
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) tSrS(i) *= args.scale;
      add_additive_mask(tSrS, tScS, args.mask.classes, batch, head, m0, n0, args.seqlen_q, args.seqlen_k);
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) tSrS(i) = exp2f((tSrS(i) - lse[get<1>(tScS(i))]) * float(M_LOG2E));
    } else {
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) {
        tSrS(i) = exp2f((tSrS(i) * args.scale - lse[get<1>(tScS(i))]) * float(M_LOG2E));
      }
    }
  } else {
    if (args.softcap_in != 0.f) {  // the forward's soft-capping of the raw score, before any mask
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) tSrS(i) = soft_capped(tSrS(i), args.softcap_in, args.softcap_out);
    }
    CUTE_UNROLL
    for (int i = 0; i < size(tSrS); ++i) tSrS(i) = exp2f(tSrS(i) * args.scale_log2 - lse[get<1>(tScS(i))]);
    if constexpr (T::kMask == MaskKind::kBool) {
      if (BwdSchedule<T>::partial(entry)) {
        Tensor s_rc = make_tensor(tSrS.data(), acc_rowcol_layout(tSrS.layout()));
        Tensor c_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
        apply_mask_bits<T::kBlockM, T::kBlockN>(s_rc, c_rc, args.mask.classes, m_block, n_block, head, batch);
      }
    }
  }
  const bool causal = hides_causal<T>(args);
  const bool causal_edge =
      causal && causal_block<T::kBlockM, T::kBlockN>(m_block, n_block, args.window_left) == CausalBlock::kPartial;
  if (key_tail || causal_edge) {
    // A key inside Sk is seen by the queries from itself (causal; else from the first) to key + window_left
    // (else to the last): two bounds per key row of the fragment, as query columns of this tile, then two
    // comparisons per element. `reach` saturates at INT_MAX / 2, which no column reaches (no overflow).
    Tensor s_rc = make_tensor(tSrS.data(), acc_rowcol_layout(tSrS.layout()));
    Tensor c_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
    const bool windowed = causal && args.window_left >= 0;
    const int reach = windowed ? int(min(int64_t(args.window_left) + n0 - m0, int64_t(INT_MAX / 2))) : INT_MAX / 2;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s_rc); ++r) {
      const int key_in_tile = get<0>(c_rc(r, 0));
      const int first = causal ? n0 - m0 + key_in_tile : INT_MIN;
      const int last = n0 + key_in_tile >= args.seqlen_k ? -1 : key_in_tile + reach;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) {
        const int query_in_tile = get<1>(c_rc(r, c));
        if (query_in_tile < first || query_in_tile > last) s_rc(r, c) = 0.f;
      }
    }
  }
}

// The values of a per-query shared-memory row (`rows`, one per query of the tile) at the query columns of
// this thread's S^T / dP^T fragment, into registers.
template <class TensorC>
CUTE_DEVICE auto query_column_values(const TensorC& tScS, const float* rows) {
  Tensor c_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
  cute::array<float, decltype(size<1>(c_rc))::value> columns;
  CUTE_UNROLL
  for (int c = 0; c < size<1>(c_rc); ++c) columns[c] = rows[get<1>(c_rc(0, c))];
  return columns;
}

// A per-query value at column c (query `query`) of the fragment: from query_column_values' registers, or
// straight from the shared-memory row.
template <class Columns>
CUTE_DEVICE float column_value(const Columns& columns, int c, int) { return columns[c]; }
CUTE_DEVICE float column_value(const float* rows, int, int query) { return rows[query]; }

// dS = P * (dP - D) on the dP^T fragment, in place. dsum: D at the fragment's query columns
// (query_column_values), or its shared-memory row. Soft-capped scores x = cap * tanh(scale * s / cap) also
// carry dx/ds = scale * (1 - tanh^2) (the scale is applied later, as without soft-capping); tanh comes back
// from P itself, log2 P + LSE = x * log2 e, so no fragment has to live from the S GEMM to here (P = 0, masked
// or past the row's end, gives 0 either way).
template <class Traits, class TensorDP, class TensorP, class TensorC, class Columns>
CUTE_DEVICE void score_gradients(const BwdKernelArgs<Traits>& args, TensorDP& tdPrdP, const TensorP& tSrP,
                                 const TensorC& tScS, const Columns& dsum, const float* lse) {
  Tensor dp_rc = make_tensor(tdPrdP.data(), acc_rowcol_layout(tdPrdP.layout()));
  Tensor p_rc = make_tensor(tSrP.data(), acc_rowcol_layout(tSrP.layout()));
  Tensor c_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
  if constexpr (Traits::kMask != MaskKind::kAdditive) {
    if (args.softcap_in != 0.f) {
      CUTE_UNROLL
      for (int r = 0; r < size<0>(dp_rc); ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(dp_rc); ++c) {
          const float p = p_rc(r, c);
          const float t = (__log2f(p) + lse[get<1>(c_rc(r, c))]) * args.softcap_tanh_per_log2;
          const float slope = p > 0.f ? 1.f - fminf(t * t, 1.f) : 0.f;
          dp_rc(r, c) = p * (dp_rc(r, c) - column_value(dsum, c, get<1>(c_rc(r, c)))) * slope;
        }
      }
      return;
    }
  }
  CUTE_UNROLL
  for (int r = 0; r < size<0>(dp_rc); ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(dp_rc); ++c) {
      dp_rc(r, c) = p_rc(r, c) * (dp_rc(r, c) - column_value(dsum, c, get<1>(c_rc(r, c))));
    }
  }
}

// The query tile a step's dQ partial adds into (its entry of the tile's schedule) and, deterministic, its
// turn there. Computed where the partial is added, from the entry: two registers fewer across the GEMMs.
template <class Traits>
CUTE_DEVICE DqTarget dq_target(const BwdKernelArgs<Traits>& args, const volatile BwdTile& tile, int entry) {
  using S = BwdSchedule<Traits>;
  const int head = tile.head_kv * args.head_ratio + S::head_in_group(entry), m_block = S::block(entry);
  return {query_tile_index<Traits>(args, tile.batch, head, m_block),
          args.deterministic ? dq_turn<Traits>(args, tile.n_block, m_block, head, tile.batch) : 0};
}

// The MMA warps' thread index (0-255) read afresh: address math from it then stays where it is used
// instead of holding a register across the steps and tiles (ptxas hoists what it derives from `tid`).
CUTE_DEVICE int mma_thread_index_afresh() {
  int thread;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(thread));
  return thread - 128;
}

// Adds this warpgroup's dQ partial (a dQ-MMA fragment) of the step `entry` of `tile`; staged, it is added
// once publish_dq hands it to the dQ writer.
template <class Traits, class FragDQ>
CUTE_DEVICE void add_dq(const BwdKernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                        const FragDQ& tdQrdQ, int tid, const volatile BwdTile& tile, int entry) {
  using T = Traits;
  const int wg = tid / 128;
  const int t = tid % 128;
  static_assert(decltype(size(tdQrdQ))::value == T::kDqFloatsPerThread);
  if constexpr (T::kStagedDq) {
    warpgroup_barrier_sync<kBwdBarrierDqEmpty>(wg, kDqHandoffThreads);
    float* stage = smem.dq.data();
    CUTE_UNROLL
    for (int i = 0; i < T::kDqFloatsPerThread; i += 4) {
      *reinterpret_cast<float4*>(stage + dq_fragment_offset<T>(tid, i)) =
          make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3));
    }
  } else {
    const DqTarget target = dq_target<T>(args, tile, entry);
    float* accum = args.dq_accum + int64_t(target.query_tile) * T::kDqFloats;
    int32_t* counter = args.dq_sem + target.query_tile;
    if (args.deterministic) {
      if (t == 0) wait_turn(counter, 2 * target.turn);
      __syncwarp();
      warpgroup_barrier_sync<kBwdBarrierDqTurn>(wg, 128);
    }
    CUTE_UNROLL
    for (int i = 0; i < T::kDqFloatsPerThread; i += 4) {
      red_add_f32x4(accum + dq_fragment_offset<T>(tid, i), tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3));
    }
    if (args.deterministic) {
      warpgroup_barrier_sync<kBwdBarrierDqTurn>(wg, 128);
      if (t == 0) {
        __threadfence();
        atomicAdd(counter, 1);
      }
      __syncwarp();
    }
  }
}

// Hands this warpgroup's staged dQ partial (add_dq's stores) to the dQ writer warp.
template <class Traits>
CUTE_DEVICE void publish_dq(int tid) {
  if constexpr (Traits::kStagedDq) {
    cutlass::arch::fence_view_async_shared();  // st.shared visible to the bulk reduction
    warpgroup_barrier_arrive<kBwdBarrierDqFull>(tid / 128, kDqHandoffThreads);
  }
}

// The key loop of one MMA warpgroup thread over `tile`, once its K and V have landed; on return tdKrdK
// (unscaled) and tdVrdV hold its part of dK / scale and dV. `read` (the Q and dO pipelines' state) carries
// on from tile to tile.
template <class Traits, class FragDKV>
CUTE_DEVICE void bwd_mma(const BwdKernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                         typename Traits::PipelineQ& pipe_q, typename Traits::PipelineDO& pipe_do,
                         typename Traits::StepState& read, FragDKV& tdKrdK, FragDKV& tdVrdV,
                         const volatile BwdTile& tile, const volatile BwdSteps& steps, int tid) {
  using T = Traits;
  using Element = typename T::Element;
  using TileM = typename T::TileM;
  using TileN = typename T::TileN;
  using TileD = typename T::TileD;
  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmaDKV mma_dkv;
  typename T::TiledMmaDQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename T::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename T::SmemLayoutQt{});
  Tensor sDO = make_tensor(make_smem_ptr(smem.dout.data()), typename T::SmemLayoutDO{});
  Tensor sDOt = make_tensor(make_smem_ptr(smem.dout.data()), typename T::SmemLayoutDOt{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename T::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename T::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename T::SmemLayoutV{});
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename T::SmemLayoutPdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.data()), typename T::SmemLayoutPdSt{});

  // WGMMA operands (shared-memory descriptors): (MMA, MMA_M or MMA_N, MMA_K[, stage]).
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sDO);
  Tensor tdVrdO = thr_dkv.partition_fragment_B(sDOt);
  Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt);
  // dQ's operands: dS (queries, keys) and K^T (head dim, keys), as A and B, or B and A transposed.
  Tensor tdQrdS = [&] {
    if constexpr (T::kDqTransposed) return thr_dq.partition_fragment_B(sdS); else return thr_dq.partition_fragment_A(sdS);
  }();
  Tensor tdQrK = [&] {
    if constexpr (T::kDqTransposed) return thr_dq.partition_fragment_A(sKt); else return thr_dq.partition_fragment_B(sKt);
  }();
  auto dq_gemm = [&](auto& tdQrdS_step, auto& tdQrdQ) {
    if constexpr (T::kDqTransposed) {
      wg_gemm<true, -1, false>(mma_dq, tdQrK, tdQrdS_step, tdQrdQ);
    } else {
      wg_gemm<true, -1, false>(mma_dq, tdQrdS_step, tdQrK, tdQrdQ);
    }
  };

  // P and dS into shared memory: the S^T fragment stored transposed, as (queries, keys).
  auto copy_pds = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, mma_sdp);
  auto thr_copy_pds = copy_pds.get_thread_slice(tid);
  Tensor tPdSsdS = thr_copy_pds.partition_D(sdSt);  // (CPY, CPY_N, CPY_M, stage)

  // (key, query) of each element of this thread's S^T fragment.
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<TileN, TileM>{}));

  clear(tdKrdK);
  clear(tdVrdV);

  // The tile and its steps are read from shared memory where used (no register held across the steps).
  for (int step = 0; step < steps.count; ++step) {
    {  // one step: one query tile of one query head
      const int entry = BwdSchedule<T>(steps).entry(args, step);
      const int head = tile.head_kv * args.head_ratio + BwdSchedule<T>::head_in_group(entry);
      const int m_block = BwdSchedule<T>::block(entry);
      const int m0 = m_block * T::kBlockM;
      const int ds_stage = step % T::kStagesDS;
      if constexpr (T::kStagedDq) {
        // The writer reads it once the first warpgroup's partial is staged. One slot per Q stage, so that
        // it is written here, before the GEMMs, while the writer may still read the previous step's.
        if (tid == 0) {
          const DqTarget target = dq_target<T>(args, tile, entry);
          volatile DqTarget* named = &smem.dq_target[read.index()];
          named->query_tile = target.query_tile;
          named->turn = target.turn;
        }
      }

      Tensor tSrS = partition_fragment_C(mma_sdp, Shape<TileN, TileM>{});
      Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<TileN, TileM>{});
      pipe_q.consumer_wait(read);
      wg_gemm<true, -1, false>(mma_sdp, tSrK, tSrQ(_, _, _, read.index()), tSrS);
      pipe_do.consumer_wait(read);
      wg_gemm<true, -1, false>(mma_sdp, tdPrV, tdPrdO(_, _, _, read.index()), tdPrdP);
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      probabilities<T>(args, tSrS, tScS, smem.lse.data() + read.index() * T::kBlockM, entry, m_block, tile.n_block,
                       head, tile.batch);
      // D read while the dP GEMM runs keeps the shared-memory latency off the path after its wait (with the
      // 128-query tiles of D=64 the 32 registers it holds there spill, with D=128's 80-query tiles 20: read
      // after it).
      const float* dsum_rows = smem.dsum.data() + read.index() * T::kBlockM;
      const auto dsum = [&] {
        if constexpr (T::kBlockM == 64) return query_column_values(tScS, dsum_rows); else return dsum_rows;
      }();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tdPrdP);
      score_gradients<T>(args, tdPrdP, tSrS, tScS, dsum, smem.lse.data() + read.index() * T::kBlockM);
      if constexpr (T::kMask == MaskKind::kAdditive) {
        if (args.mask.dmask != nullptr) {
          add_mask_gradient(args.mask, tdPrdP, tScS, tile.batch, head, m0, tile.n_block * T::kBlockN,
                            args.seqlen_q, args.seqlen_k);
        }
      }

      Tensor rP = make_tensor_like<Element>(tSrS);
      convert_pairs(rP, tSrS);
      Tensor rdS = make_tensor_like<Element>(tdPrdP);
      convert_pairs(rdS, tdPrdP);
      Tensor tdQrdQ = partition_fragment_C(mma_dq, typename T::DqShape{});
      auto tdQrdS_step = tdQrdS(_, _, _, ds_stage);
      if constexpr (T::kSplitKeys) {
        // dV += P^T.dO straight from registers, while dS goes to shared memory for dQ.
        Tensor tdVrP = make_tensor(rP.data(), acc_to_a_operand_layout(rP.layout()));
        wg_gemm<false, -1, true>(mma_dkv, tdVrP, tdVrdO(_, _, _, read.index()), tdVrdV);
        // (Addressed from the thread index afresh: a store address kept across the step spilled.)
        auto thr_copy_ds = copy_pds.get_thread_slice(mma_thread_index_afresh());
        copy(copy_pds, thr_copy_ds.retile_S(rdS), thr_copy_ds.partition_D(sdSt)(_, _, _, ds_stage));
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBwdBarrierMmaWarps);
        dq_gemm(tdQrdS_step, tdQrdQ);
        Tensor tdKrdS = make_tensor(rdS.data(), acc_to_a_operand_layout(rdS.layout()));
        wg_gemm<false, -1, true>(mma_dkv, tdKrdS, tdKrQ(_, _, _, read.index()), tdKrdK);
        warpgroup_wait<1>();  // dV and dQ done, dK may still run
        warpgroup_fence_operand(tdQrdQ);
        pipe_do.consumer_release(read);
        add_dq<T>(args, smem, tdQrdQ, tid, tile, entry);
        warpgroup_wait<0>();
        // Published after the dK wait: the staged stores drain while dK runs, and the proxy fence, which
        // waits for them, comes once they have.
        publish_dq<T>(tid);
        warpgroup_fence_operand(tdVrdV);
        warpgroup_fence_operand(tdKrdK);
        pipe_q.consumer_release(read);
      } else {
        // P and dS both through shared memory; every GEMM after the barrier reads all of them.
        Tensor sPt = make_tensor(make_smem_ptr(smem.p.data()), typename T::SmemLayoutPdSt{});
        Tensor tPdSsP = thr_copy_pds.partition_D(sPt);
        copy(copy_pds, thr_copy_pds.retile_S(rP), tPdSsP(_, _, _, ds_stage));
        // (Addressed from the thread index afresh: a store address kept across the step spilled.)
        auto thr_copy_ds = copy_pds.get_thread_slice(mma_thread_index_afresh());
        copy(copy_pds, thr_copy_ds.retile_S(rdS), thr_copy_ds.partition_D(sdSt)(_, _, _, ds_stage));
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBwdBarrierMmaWarps);
        dq_gemm(tdQrdS_step, tdQrdQ);
        auto tdVrPt = thr_dkv.partition_fragment_A(sPt)(_, _, _, ds_stage);
        wg_gemm<false, -1, false>(mma_dkv, tdVrPt, tdVrdO(_, _, _, read.index()), tdVrdV);
        auto tdKrdSt = thr_dkv.partition_fragment_A(sdSt)(_, _, _, ds_stage);
        wg_gemm<false, -1, false>(mma_dkv, tdKrdSt, tdKrQ(_, _, _, read.index()), tdKrdK);
        warpgroup_wait<2>();  // dQ done; its adds overlap dV and dK
        warpgroup_fence_operand(tdQrdQ);
        add_dq<T>(args, smem, tdQrdQ, tid, tile, entry);
        publish_dq<T>(tid);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tdVrdV);
        warpgroup_fence_operand(tdKrdK);
        pipe_do.consumer_release(read);
        pipe_q.consumer_release(read);
      }
      ++read;
    }
  }
}

}  // namespace fa2
