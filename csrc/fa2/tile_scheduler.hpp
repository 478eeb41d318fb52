// Which tiles a CTA runs, and in which order: the forward's query tiles, the backward's key tiles.
//
// A persistent launch has one CTA per SM that strides through the tile numbers: the next tile's Q and
// K/V loads start while the current tile finishes, and the launch, barrier set-up and descriptor
// prefetch are paid once per SM instead of once per tile. Otherwise the grid has one CTA per tile: a
// persistent kernel's stride loop then runs once; kernels built without persistence have no loop and a
// (query tile, head, batch) grid, their coordinates read from blockIdx (no register across the key loop).
//
// Numbering: tiles of equal cost (no causal positions, no mask) go head by head, the query tiles of
// one (batch, head) next to each other, so that CTAs running at the same time share their K/V in L2.
// Tiles of unequal cost (causal, masked) run the most expensive (last) query tiles first per head when
// the hardware hands out one CTA per tile (it balances them as SMs free up). A striding CTA takes them in
// pairs, a heavy and a light tile of one head (m and M-1-m: under causal positions the pair costs about
// M+1 key blocks whatever m is), heaviest pair first, the pairs of a head next to each other: each round
// of strides then costs the same and the CTAs running together read the K/V of few heads, which stay in
// L2. Heaviest first across all heads balanced the rounds too, but kept every head's K/V in flight: on the
// H200 its L2 hit rate was 12-15 % (cuDNN's 46-74 %) and its DRAM traffic 1.7-4.3x the minimum.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>
#include <cute/config.hpp>
#include <cute/int_tuple.hpp>
#include <cutlass/fast_math.h>

namespace fa2 {

struct TileCoord {
  int m_block, head, batch;
};

template <bool kHeaviestFirst, bool kPersistent>
struct QueryTiles {
  int num_m_blocks, heads, slices;  // slices: (batch, head) pairs
  int pairs_per_slice;              // 0 unless a striding CTA takes its tiles in pairs
  int count;                        // tile numbers: first(), next(first()), ... below count

  CUTE_DEVICE QueryTiles(int seqlen_q, int block_m, int heads_q, int batch)
      : num_m_blocks((seqlen_q + block_m - 1) / block_m),
        heads(heads_q),
        slices(heads_q * batch),
        pairs_per_slice(kHeaviestFirst && kPersistent && int(gridDim.x) < num_m_blocks * slices
                            ? (num_m_blocks + 1) / 2 : 0),
        count(pairs_per_slice > 0 ? 2 * pairs_per_slice * slices : num_m_blocks * slices) {}

  // Paired tile numbers are 2 * pair + side (side 0 the heavy tile); with an odd number of query tiles a
  // head's last pair is its middle tile alone.
  CUTE_DEVICE bool lone(int pair) const { return (num_m_blocks & 1) && pair % pairs_per_slice == pairs_per_slice - 1; }
  CUTE_DEVICE int first() const { return pairs_per_slice > 0 ? 2 * int(blockIdx.x) : int(blockIdx.x); }
  CUTE_DEVICE int next(int tile) const {
    if (pairs_per_slice == 0) return tile + int(gridDim.x);
    if ((tile & 1) == 0 && !lone(tile >> 1)) return tile + 1;  // the pair's light tile
    return (tile & ~1) + 2 * int(gridDim.x);
  }
  // Kernels built without persistence ignore `tile`: their (query tile, head, batch) grid says it.
  CUTE_DEVICE TileCoord coord(int tile) const {
    if constexpr (!kPersistent) {
      const int m = int(blockIdx.x);
      return {kHeaviestFirst ? int(gridDim.x) - 1 - m : m, int(blockIdx.y), int(blockIdx.z)};
    }
    if (pairs_per_slice > 0) {
      const int pair = tile >> 1, slice = pair / pairs_per_slice, j = pair % pairs_per_slice;
      return {(tile & 1) ? j : num_m_blocks - 1 - j, slice % heads, slice / heads};
    }
    const int m = tile % num_m_blocks, slice = tile / num_m_blocks;
    return {kHeaviestFirst ? num_m_blocks - 1 - m : m, slice % heads, slice / heads};
  }
};

// The grid: persistent kernels one CTA per SM (never more CTAs than tiles; num_sms = 0: one per tile),
// others one per (query tile, head, batch).
inline dim3 forward_grid(int num_m_blocks, int heads, int batch, bool persistent, int num_sms) {
  const int64_t tiles = int64_t(num_m_blocks) * heads * batch;
  if (!persistent) return dim3(unsigned(num_m_blocks), unsigned(heads), unsigned(batch));
  return dim3(unsigned(num_sms > 0 ? std::min<int64_t>(tiles, num_sms) : tiles));
}


// A key tile of the backward: the unit of work of a CTA.
struct BwdTile {
  int n_block, head_kv, batch;
};

// The backward's key tiles: one per (key tile, kv head, batch), numbered with the key tiles of one (batch, kv head)
// next to each other (causal: most query tiles first). A persistent launch has one CTA per SM striding
// through them: the next tile's first Q and dO loads overlap the current tile's epilogue, and the launch and
// set-up are paid once per SM. Otherwise each CTA runs the tile blockIdx.x, and the walks end after it.
// Deterministic calls take one CTA per tile: a turn then only waits for tiles of CTAs launched before
// (dq_turn), which every CTA of a striding grid is not guaranteed to be.
// A striding CTA steps over slots: a key tile, or, under causal positions (args.paired), a pair of one
// (batch, kv head)'s key tiles j and N-1-j, heavy then light, which together cost about the same whatever j
// is (without pairs a stride that is a multiple of N would hand a CTA the same key tile of every head).
// Every role walks its CTA's slots alike: the slot number kept as (slot, kv head, batch) and stepped by
// gridDim.x in that form (args.stride_*) with carries, no division per tile, and the first one decoded by
// multiplications (FastDivmod), so that the walk stays in uniform registers (with divisions it took vector
// registers, and the D=64 causal kernel spilled).
template <class Args>
struct BwdTileWalk {
  int slot, head_kv, batch;
  int side = 0;  // paired slots: 0 the heavy key tile j, 1 the light one N-1-j

  CUTE_DEVICE explicit BwdTileWalk(const Args& args) {
    int slice;
    args.slots_divmod.fast_divmod(slice, slot, int(blockIdx.x));
    args.heads_kv_divmod.fast_divmod(batch, head_kv, slice);
  }
  CUTE_DEVICE bool valid(const Args& args) const { return batch < cute::get<3>(args.shape_kv); }
  CUTE_DEVICE void next(const Args& args) {
    if (args.paired && side == 0 && 2 * slot + 1 < args.num_n_blocks) {  // the pair's light tile, if it has one
      side = 1;
      return;
    }
    side = 0;
    slot += args.stride_slots;
    head_kv += args.stride_heads;
    batch += args.stride_batches;
    if (slot >= args.slots_per_head) {
      slot -= args.slots_per_head;
      ++head_kv;
    }
    if (head_kv >= cute::get<2>(args.shape_kv)) {
      head_kv -= cute::get<2>(args.shape_kv);
      ++batch;
    }
  }
  CUTE_DEVICE BwdTile tile(const Args& args) const {
    const int key_index = side ? args.num_n_blocks - 1 - slot : slot;
    return {args.key_block_first + args.key_block_step * key_index, head_kv, batch};
  }
};

// Host side of BwdTileWalk: sets the walk's fields of args for num_n_blocks key tiles per (batch, kv head)
// (persistent: at most num_sms CTAs, in pairs under causal positions) and returns the grid's CTA count.
template <class Args>
inline int64_t plan_bwd_walk(Args& args, int num_n_blocks, int heads_kv, int batch, bool persistent, bool causal,
                             int num_sms) {
  args.paired = persistent && causal;
  args.slots_per_head = args.paired ? (num_n_blocks + 1) / 2 : num_n_blocks;
  const int64_t slots = int64_t(args.slots_per_head) * heads_kv * batch;
  const int64_t ctas = persistent ? std::min<int64_t>(slots, num_sms) : slots;
  args.stride_slots = int(ctas % args.slots_per_head);
  args.stride_heads = int(ctas / args.slots_per_head % heads_kv);
  args.stride_batches = int(ctas / (int64_t(args.slots_per_head) * heads_kv));
  args.slots_divmod = cutlass::FastDivmod(args.slots_per_head);
  args.heads_kv_divmod = cutlass::FastDivmod(heads_kv);
  return ctas;
}

}  // namespace fa2
