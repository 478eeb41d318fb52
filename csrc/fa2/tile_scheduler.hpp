// Which query tiles a CTA of the forward runs, and in which order.
//
// A persistent launch has one CTA per SM that strides through the tile numbers: the next tile's Q and
// K/V loads start while the current tile finishes, and the launch, barrier set-up and descriptor
// prefetch are paid once per SM instead of once per tile. Otherwise the grid has one CTA per tile: a
// persistent kernel's stride loop then runs once; kernels built without persistence have no loop and a
// (query tile, head, batch) grid, their coordinates read from blockIdx (no register across the key loop).
//
// Numbering: tiles of equal cost (no causal positions, no mask) go head by head, the query tiles of
// one (batch, head) next to each other, so that CTAs running at the same time share their K/V in L2.
// Tiles of unequal cost (causal, masked) run the most expensive (last) query tiles first: per head
// when the hardware hands out one CTA per tile (it balances them as SMs free up), across all heads
// when CTAs stride (each round of strides then costs about the same; a per-head order striding by a
// grid close to a multiple of the tiles per head gave some CTAs three times the work of others).
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>
#include <cute/config.hpp>

namespace fa2 {

struct TileCoord {
  int m_block, head, batch;
};

template <bool kHeaviestFirst, bool kPersistent>
struct QueryTiles {
  int num_m_blocks, heads, slices, count;  // slices: (batch, head) pairs

  CUTE_HOST_DEVICE QueryTiles(int seqlen_q, int block_m, int heads_q, int batch)
      : num_m_blocks((seqlen_q + block_m - 1) / block_m),
        heads(heads_q),
        slices(heads_q * batch),
        count(num_m_blocks * slices) {}

  // A persistent CTA's stride: tiles first(), next(first()), ... below count.
  CUTE_DEVICE int first() const { return int(blockIdx.x); }
  CUTE_DEVICE int next(int tile) const { return tile + int(gridDim.x); }
  // Kernels built without persistence ignore `tile`: their (query tile, head, batch) grid says it.
  CUTE_DEVICE TileCoord coord(int tile) const {
    if constexpr (!kPersistent) {
      const int m = int(blockIdx.x);
      return {kHeaviestFirst ? int(gridDim.x) - 1 - m : m, int(blockIdx.y), int(blockIdx.z)};
    }
    if (kHeaviestFirst && int(gridDim.x) < count) {
      const int slice = tile % slices;
      return {num_m_blocks - 1 - tile / slices, slice % heads, slice / heads};
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

}  // namespace fa2
