// Which query tiles a CTA of the forward runs, and in which order.
//
// Tiles are numbered head by head (the query tiles of one (batch, head) next to each other, so that
// CTAs running at the same time share their K/V in L2); causal and masked kernels number the most
// expensive (last) query tiles of a head first. A persistent launch has one CTA per SM that strides
// through the numbers: the next tile's Q and K/V loads start while the current tile finishes, and the
// launch, barrier set-up and descriptor prefetch are paid once per SM instead of once per tile.
// Otherwise the grid has one CTA per tile and the stride loop runs once.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cute/config.hpp>

namespace fa2 {

struct TileCoord {
  int m_block, head, batch;
};

template <bool kHeaviestFirst, bool kPersistent>
struct QueryTiles {
  int num_m_blocks, heads, count;

  CUTE_HOST_DEVICE QueryTiles(int seqlen_q, int block_m, int heads_q, int batch)
      : num_m_blocks((seqlen_q + block_m - 1) / block_m), heads(heads_q), count(num_m_blocks * heads_q * batch) {}

  CUTE_DEVICE int first() const { return int(blockIdx.x); }
  // One tile per CTA ends the loop at once, visibly to the compiler (no loop state kept in registers).
  CUTE_DEVICE int next(int tile) const { return kPersistent ? tile + int(gridDim.x) : count; }
  CUTE_DEVICE TileCoord coord(int tile) const {
    const int m = tile % num_m_blocks, slice = tile / num_m_blocks;
    return {kHeaviestFirst ? num_m_blocks - 1 - m : m, slice % heads, slice / heads};
  }
};

// Grid size: persistent kernels one CTA per SM (never more CTAs than tiles), others one per tile.
inline int64_t forward_grid_size(int64_t tiles, bool persistent, int num_sms) {
  return persistent && num_sms > 0 ? std::min<int64_t>(tiles, num_sms) : tiles;
}

}  // namespace fa2
