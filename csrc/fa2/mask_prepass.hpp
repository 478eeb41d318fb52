// Pre-pass of the masked kernels, two small launches before the main kernel:
//  1. classify_mask_blocks: one CTA per (key tile, class query tile, class batch x head) reads that
//     block of the user's mask (its real strides) and writes its class: 0 fully masked, 1 fully
//     visible, 2 partial. Only entries inside [Sq, Sk] count. Bool: visible = true; bool kernels
//     also write the block's bits (one per entry) so partial blocks never read the mask itself.
//     Additive: visible = exactly 0, masked = -inf (anything else, NaN included, is partial).
//  2. list_visited_blocks: one warp per class row turns its classes into the list the main kernel
//     walks: the count, then every block that is not fully masked, highest first; and for every
//     block n, how many listed blocks lie above it (causal kernels cut the list to their tile's
//     diagonal and window with two reads).
// The outputs live in one workspace the caller allocates (MaskWorkspace gives its size).
#pragma once

#include <cmath>
#include <cstdint>
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "mask.hpp"
#include "params.h"
#include "pdl.hpp"

namespace fa2 {

constexpr int kClassifyThreads = 256;
constexpr int kListWarps = 4;  // class rows per CTA of list_visited_blocks

// Byte offsets of the pre-pass outputs inside the workspace.
struct MaskWorkspace {
  int64_t class_offset = 0, visit_offset = 0, above_offset = 0, bits_offset = 0, total_bytes = 0;

  template <int kBlockM, int kBlockN, MaskKind Kind>
  static MaskWorkspace plan(int64_t class_slices, int64_t class_m_blocks, int64_t num_n_blocks, int64_t bit_rows) {
    auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
    const int64_t class_rows = class_slices * class_m_blocks;
    MaskWorkspace w;
    w.visit_offset = aligned(class_rows * num_n_blocks);
    w.above_offset = w.visit_offset + aligned(class_rows * (num_n_blocks + 1) * int64_t(sizeof(int32_t)));
    w.bits_offset = w.above_offset + aligned(class_rows * num_n_blocks * int64_t(sizeof(int32_t)));
    const int64_t bits_bytes = Kind == MaskKind::kBool ? class_slices * bit_rows * num_n_blocks * (kBlockN / 8) : 0;
    w.total_bytes = w.bits_offset + bits_bytes;
    return w;
  }
};

// Additive masks (and bool masks the 16-byte path cannot read): one entry per thread, stopping as
// soon as the block is known to be partial.
template <class E>
CUTE_DEVICE void classify_entries(const E* base, const MaskArgs& mk, int rows, int cols, bool& all_visible,
                                  bool& all_masked) {
  const int total = rows * cols;
  for (int e = threadIdx.x; e < total; e += kClassifyThreads) {
    const int r = e / cols;
    const int c = e - r * cols;
    const float x = float(base[int64_t(r) * mk.row_stride + int64_t(c) * mk.col_stride]);
    all_visible &= (x == 0.f);
    all_masked &= (x == -INFINITY);
    if (!all_visible && !all_masked) break;  // already partial
  }
}

// Four bool bytes (each 0 or 1 after the compare) -> four bits, byte i -> bit i.
CUTE_DEVICE uint32_t pack_bool_bytes(uint32_t x) {
  const uint32_t ones = __vcmpne4(x, 0u) & 0x01010101u;
  return (ones * 0x01020408u) >> 24;
}

// Bool masks: every thread turns 16 keys of one row into 16 bits; two neighbouring lanes hold the
// two halves of one 32-key word. Entries outside [rows, cols] give 0 bits and do not count.
template <int kBlockM, int kBlockN>
CUTE_DEVICE void classify_and_pack_bool(const uint8_t* base, const MaskArgs& mk, int rows, int cols, int bit_rows,
                                        uint32_t* tile_bits, int64_t row_words, bool& all_visible,
                                        bool& all_masked) {
  constexpr int kChunksPerRow = kBlockN / 16;
  static_assert(kClassifyThreads % kChunksPerRow == 0 && kChunksPerRow % 2 == 0);
  const int total = bit_rows * kChunksPerRow;
  for (int start = 0; start < total; start += kClassifyThreads) {  // warps stay converged
    const int e = start + int(threadIdx.x);
    const int r = e / kChunksPerRow;
    const int col0 = (e % kChunksPerRow) * 16;
    const int valid = r < rows ? max(0, min(16, cols - col0)) : 0;
    const uint8_t* src = base + int64_t(r) * mk.row_stride + int64_t(col0) * mk.col_stride;
    uint32_t bits = 0;
    if (valid == 16 && mk.vector_bytes) {
      const uint4 v = *reinterpret_cast<const uint4*>(src);
      bits = pack_bool_bytes(v.x) | (pack_bool_bytes(v.y) << 4) | (pack_bool_bytes(v.z) << 8) |
             (pack_bool_bytes(v.w) << 12);
    } else {
      for (int j = 0; j < valid; ++j) bits |= uint32_t(src[int64_t(j) * mk.col_stride] != 0) << j;
    }
    const uint32_t valid_bits = (1u << valid) - 1u;
    all_visible &= bits == valid_bits;
    all_masked &= bits == 0u;
    const uint32_t high = __shfl_down_sync(0xffffffffu, bits, 1);
    if (e < total && (e % 2) == 0) tile_bits[int64_t(r) * row_words + col0 / 32] = bits | (high << 16);
  }
}

template <int kBlockM, int kBlockN, MaskKind Kind>
__global__ void __launch_bounds__(kClassifyThreads)
classify_mask_blocks(const MaskArgs mk, int seqlen_q, int seqlen_k) {
  allow_dependent_grid();  // the list kernel may launch now; it waits for these classes
  const int n_block = blockIdx.x;
  const int m_block = blockIdx.y;  // class query tile
  const int slice = blockIdx.z;    // class batch * CH + class head
  const int cb = slice / mk.class_heads;
  const int ch = slice - cb * mk.class_heads;
  const int m0 = m_block * kBlockM, n0 = n_block * kBlockN;
  // A mask with one row for every query (zero row stride) is classified from that row.
  const int rows = mk.row_broadcast ? 1 : min(kBlockM, seqlen_q - m0);
  const int cols = min(kBlockN, seqlen_k - n0);
  const int64_t offset = int64_t(cb) * mk.batch_stride + int64_t(ch) * mk.head_stride +
                         int64_t(m0) * mk.row_stride + int64_t(n0) * mk.col_stride;
  bool all_visible = true, all_masked = true;
  if constexpr (Kind == MaskKind::kBool) {
    const int64_t row_words = int64_t(mk.num_n_blocks) * (kBlockN / 32);
    const int bit_rows = mk.row_broadcast ? 1 : kBlockM;
    uint32_t* tile_bits = mk.bits + (int64_t(slice) * mk.bit_rows + (mk.row_broadcast ? 0 : m0)) * row_words +
                          n_block * (kBlockN / 32);
    classify_and_pack_bool<kBlockM, kBlockN>(static_cast<const uint8_t*>(mk.ptr) + offset, mk, rows, cols, bit_rows,
                                             tile_bits, row_words, all_visible, all_masked);
  } else {
    switch (mk.dtype) {
      case int(MaskDType::kF32):
        classify_entries(static_cast<const float*>(mk.ptr) + offset, mk, rows, cols, all_visible, all_masked);
        break;
      case int(MaskDType::kBF16):
        classify_entries(static_cast<const cutlass::bfloat16_t*>(mk.ptr) + offset, mk, rows, cols, all_visible,
                         all_masked);
        break;
      default:
        classify_entries(static_cast<const cutlass::half_t*>(mk.ptr) + offset, mk, rows, cols, all_visible,
                         all_masked);
        break;
    }
  }
  all_visible = __syncthreads_and(all_visible);
  all_masked = __syncthreads_and(all_masked);
  if (threadIdx.x == 0) {
    mk.block_class[(int64_t(slice) * gridDim.y + m_block) * gridDim.x + n_block] =
        all_masked ? 0 : (all_visible ? 1 : 2);
  }
}

// One warp per class row: 32 classes per step, highest block first, compacted with a ballot.
// (A template so that every translation unit including this header can define it.)
template <int kWarps>
__global__ void __launch_bounds__(32 * kWarps) list_visited_blocks(const MaskArgs mk, int64_t class_rows) {
  allow_dependent_grid();  // the main kernel may launch now; it waits for these lists
  wait_for_prior_grid();   // the classes
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= class_rows) return;  // whole warps leave together
  const int lane = threadIdx.x % 32;
  const int num_n = mk.num_n_blocks;
  const uint8_t* classes = mk.block_class + row * num_n;
  int32_t* list = mk.visit + row * (num_n + 1);
  int32_t* above = mk.above + row * num_n;
  int count = 0;
  for (int top = num_n - 1; top >= 0; top -= 32) {
    const int n = top - lane;
    const int cls = n >= 0 ? classes[n] : 0;
    const uint32_t visited = __ballot_sync(0xffffffffu, cls != 0);
    const int position = count + __popc(visited & ((1u << lane) - 1u));
    if (n >= 0) above[n] = position;
    if (cls != 0) list[1 + position] = n * 2 + (cls == 2 ? 1 : 0);
    count += __popc(visited);
  }
  if (lane == 0) list[0] = count;
}

}  // namespace fa2
