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
#include <climits>
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


// A key tile of the backward: the unit of work of a CTA. The producer hands each tile it walks to the
// other roles through shared memory; a negative batch says the walk has ended.
struct BwdTile {
  int n_block, head_kv, batch;
  CUTE_HOST_DEVICE static BwdTile end() { return {0, 0, -1}; }
};

// The backward's key tiles: one per (key tile, kv head, batch), in slots numbered with the key tiles of one
// (batch, kv head) next to each other. A persistent launch (one CTA per SM) under causal positions or a mask
// pairs a (batch, kv head)'s key tiles j and N-1-j into one slot, heavy then light: under causal positions the
// pair costs about the same whatever j is, and under a mask it evens out what a slot costs. Unmasked tiles of
// equal cost stay single: paired, non-causal backward calls of 512 tokens ran at 0.86-0.88x one CTA per tile
// (H100; perhaps as the CTAs running together read the queries of twice as many heads). Its CTAs take slots
// dynamically: the first is blockIdx.x, each next one the lowest slot no CTA has taken yet (a counter the
// preprocess zeroes, BwdKernelArgs::tile_counter), so a CTA whose slots were cheap (keys a mask hides, a short
// sequence of a padded batch) takes more; a static stride balanced masked calls worse (docs/backward.md,
// "Persistent grid"). The next tile's first Q and dO loads overlap the current tile's epilogue, and the launch
// and set-up are paid once per SM. Otherwise (deterministic calls, long query sequences) each CTA runs the tile
// blockIdx.x alone, in tile order: the hardware hands the next tile to the SM that frees up, and a deterministic
// turn only waits for tiles of CTAs launched before (dq_turn). Only the producer warp walks (warp-uniform, its
// fields in uniform registers where they can be); the counter is read after the kernel before has finished
// (pdl.hpp), since that kernel zeroes it.
template <class Args>
struct BwdTileWalk {
  int slot;      // this CTA's slot; args.slots and above: the walk has ended
  int side = 0;  // paired slots: 0 the heavy key tile j, 1 the light one N-1-j

  CUTE_DEVICE explicit BwdTileWalk(const Args&) : slot(int(blockIdx.x)) {}
  CUTE_DEVICE bool valid(const Args& args) const { return slot < args.slots; }
  // To the pair's light tile, else to the next slot: persistent launches take it from the counter (lane 0
  // for the warp; the producer calls this once a tile's loads are all issued, so the atomic's latency
  // overlaps the MMA warps' last steps), one CTA per slot ends.
  CUTE_DEVICE void next(const Args& args) {
    if (args.paired && side == 0 && 2 * slot_in_head(args) + 1 < args.num_n_blocks) {
      side = 1;
      return;
    }
    side = 0;
    if (!args.persistent) {
      slot = INT_MAX;
      return;
    }
    int taken = 0, ctas;
    if (threadIdx.x % 32 == 0) taken = atomicAdd(args.tile_counter, 1);
    asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(ctas));  // read here: kept across the loop, it spilled
    slot = ctas + __shfl_sync(0xffffffffu, taken, 0);
  }
  // (Decoded where asked rather than kept: the producer warp has few registers.)
  CUTE_DEVICE BwdTile tile(const Args& args) const {
    int slice, in_head, head_kv, batch;
    args.slots_divmod.fast_divmod(slice, in_head, slot);
    args.heads_kv_divmod.fast_divmod(batch, head_kv, slice);
    const int key_index = side ? args.num_n_blocks - 1 - in_head : in_head;
    return {args.key_block_first + args.key_block_step * key_index, head_kv, batch};
  }

 private:
  CUTE_DEVICE int slot_in_head(const Args& args) const {
    int slice, in_head;
    args.slots_divmod.fast_divmod(slice, in_head, slot);
    return in_head;
  }
};

// Host side of BwdTileWalk: sets the walk's fields of args for num_n_blocks key tiles per (batch, kv head)
// (persistent: at most num_sms CTAs, with paired slots where key tiles cost `uneven`ly) and returns the
// grid's CTA count.
template <class Args>
inline int64_t plan_bwd_walk(Args& args, int num_n_blocks, int heads_kv, int batch, bool persistent, bool uneven,
                             int num_sms) {
  args.persistent = persistent;
  args.paired = persistent && uneven;
  args.slots_per_head = args.paired ? (num_n_blocks + 1) / 2 : num_n_blocks;
  const int64_t slots = int64_t(args.slots_per_head) * heads_kv * batch;
  args.slots = int(slots);
  args.slots_divmod = cutlass::FastDivmod(args.slots_per_head);
  args.heads_kv_divmod = cutlass::FastDivmod(heads_kv);
  return persistent ? std::min<int64_t>(slots, num_sms) : slots;
}

}  // namespace fa2
