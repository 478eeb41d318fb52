// Split-KV forward for few query rows (decode steps: Sq <= kDecodeMaxSeqlenQ).
//
// The 128-row tiles of the main kernel waste almost all of their work on a 1-row query, and one CTA per
// (query tile, head) leaves most SMs idle while it walks a long cache. Here:
// - the query rows of one GQA group (its Hq/Hkv heads x Sq rows) are packed into 16-row tiles, so K/V are
//   read once per group rather than once per query head;
// - the key blocks are dealt out to CTAs in turn (grid: row tiles x (batch, KV head) x splits), each
//   writing a float32 partial output normalised by its own row sums, with its row max and sum; a second
//   kernel combines the splits by those (and a sink, if any) into out and lse; a call planned with one split
//   has the split kernel write out and lse itself;
// - inside a CTA the 4 warps take 16 keys each of a 64-key block (from D = 192: two warps per 16 keys, half
//   of the columns each, 32-key blocks; see Config; mma.sync m16n8k16, operands from shared memory through
//   ldmatrix; K/V blocks in kStages cp.async stages), then merge their rows in shared memory;
// - before its loop a CTA finds which of its key blocks any of its rows sees (mask, causal/window, Sk)
//   and only loads those: the unfilled slots of a static KV cache (masked keys) cost a mask read, not a
//   K/V read; a call with no mask, causal or window visits all its blocks in order, with no scan and no
//   limit on how many a split holds (at batch 32 one split per tile, no combine).
// Decode is bound by K/V bandwidth, so the warp-level MMAs (not WGMMA) cost nothing that shows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "params.h"
#include "pdl.hpp"
#include "smem_limit.hpp"
#include "softcap.hpp"

namespace fa2 {
namespace decode {

constexpr int kRows = 16;                    // packed query rows per CTA (one m16 tile)
// K/V blocks in flight per CTA: three leave shared memory for two CTAs per SM at D = 128 (four, one: batch 32
// took twice the time).
constexpr int kStages = 3;
constexpr int kMaxBlocksPerSplit = 64;       // where blocks are scanned: a split's visible-block set is one word
constexpr int kCombineWarps = 4;             // per output row (a CTA each), sharing its splits
constexpr int kCombineEarly = 8;             // splits per warp whose first columns are loaded at entry
constexpr int kCombineMaxSplits = 256;       // split weights a combining CTA keeps in shared memory
static_assert(32 * kCombineWarps <= kCombineMaxSplits, "a combining thread's first split has its weight kept");
constexpr float kLog2e = 1.4426950408889634f;

// The warps split a block's keys 16 each (key groups: 4, a 64-key block; 2 from D = 192, 32-key blocks). Above
// D = 128 two warps share a key group and take half of the output columns each: a 16 x 256 float accumulator does
// not fit one warp's registers. FA2_DECODE_COL_SPLIT=2 does the same at D <= 128: twice the warps per CTA (each
// computes its key group's scores, as the pair's other warp does): a sweep's A/B, slower where measured.
#ifndef FA2_DECODE_COL_SPLIT
#define FA2_DECODE_COL_SPLIT 1
#endif
// Key blocks are dealt out to the splits in turn (see the split kernel); FA2_DECODE_DEAL_UNMASKED=0 gives calls
// without a mask contiguous ranges instead, every key of theirs being visible anyway: a sweep's A/B (their rows
// read 2-5% slower after the change, against a run whose cuDNN rows moved as much).
#ifndef FA2_DECODE_DEAL_UNMASKED
#define FA2_DECODE_DEAL_UNMASKED 1
#endif
template <int HeadDim>
struct Config {
  static constexpr int kColSplit = HeadDim > 128 ? 2 : FA2_DECODE_COL_SPLIT;
  static constexpr int kKeyGroups = HeadDim > 128 ? 2 : 4;
  static constexpr int kWarps = kKeyGroups * kColSplit;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = 16 * kKeyGroups;    // keys per block
  static constexpr int kCols = HeadDim / kColSplit;  // output columns per warp
  static_assert(kCols % 16 == 0, "a warp's columns are whole 16-wide MMA tiles");
};

template <DType Dt>
struct Element;
template <>
struct Element<DType::kBF16> {
  using T = __nv_bfloat16;
  static __device__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ T from_float(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Element<DType::kFP16> {
  using T = __half;
  static __device__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ T from_float(float x) { return __float2half_rn(x); }
};

// c += a (16x16, row) . b (16x8, col), float32 accumulators.
template <DType Dt>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (Dt == DType::kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// 16 bytes from global to shared memory; zeros when !valid (src stays a valid address, nothing is read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}


// How the keys of one call are split across CTAs, and where the partial results live.
struct Plan {
  int groups = 1;            // query heads per KV head
  int row_tiles = 1;         // 16-row tiles per (batch, KV head)
  int64_t ctas = 0;          // split-kernel CTAs per split: batch * KV heads * row tiles
  int num_blocks = 0;        // blocks of Config::kBlockN keys
  int splits = 1;             // blocks dealt out (see the split kernel), at most kMaxBlocksPerSplit each where scanned
  int64_t partial_rows = 0;  // B * Hq * Sq
  int64_t workspace_bytes = 0;
};

struct Args {
  FwdParams p;
  Plan plan;
  float* o_partial;     // [splits, B * Hq * Sq, head_dim]
  float* max_partial;   // [splits, B * Hq * Sq]: each split's row max (natural units), -inf for an empty row
  float* sum_partial;   // [splits, B * Hq * Sq]: its sum of exp(score - max). Kept apart rather than as an LSE:
                        // max + log(sum) loses the sum where the max is huge (finfo.min fills)
  float softcap_in, softcap_out;  // softcap.hpp's factors (softcap_in = 0: none)
};

// Shared memory: the query tile and the K/V stages; at the end the stages hold each warp's rows.
template <int HeadDim, DType Dt>
struct Smem {
  using T = typename Element<Dt>::T;
  static constexpr int kPitch = HeadDim + 8;  // elements per row: 16-byte shift per row, no ldmatrix bank conflicts
  static constexpr int kStageElems = 2 * Config<HeadDim>::kBlockN * kPitch;  // K then V
  static constexpr int kBytes = (kRows * kPitch + kStages * kStageElems) * int(sizeof(T));
  static_assert(kStages * kStageElems * int(sizeof(T)) >=
                    Config<HeadDim>::kKeyGroups * kRows * HeadDim * int(sizeof(float)),
                "the key groups' partial rows must fit in the K/V stages");
};

// A call without a mask, causal or window sees every key: its splits visit each of their blocks in order, with no
// scan and so no limit on their number; the others scan their blocks into a 64-bit set first.
__host__ __device__ __forceinline__ bool sees_every_block(const FwdParams& p) {
  return p.mask == nullptr && !p.causal && p.window_left < 0;
}

// A packed row of the tile: whether it is a row of the call, its query position and its mask row.
struct RowView {
  bool real;          // a row of the call (the tile's last rows may be padding)
  int i;              // query position
  const char* mask;   // the row's mask base (byte address), or null
};

__device__ __forceinline__ float read_mask(const FwdParams& p, const char* row, int j, bool& visible) {
  const char* at = row + int64_t(j) * p.mask_col_stride * (p.mask_dtype == MaskDType::kBool ? 1 :
                                                           p.mask_dtype == MaskDType::kF32 ? 4 : 2);
  switch (p.mask_dtype) {
    case MaskDType::kBool: visible = *reinterpret_cast<const uint8_t*>(at) != 0; return 0.f;
    case MaskDType::kF32: {
      const float m = *reinterpret_cast<const float*>(at);
      visible = m != -INFINITY;
      return m;
    }
    case MaskDType::kBF16: {
      const float m = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(at));
      visible = m != -INFINITY;
      return m;
    }
    default: {
      const float m = __half2float(*reinterpret_cast<const __half*>(at));
      visible = m != -INFINITY;
      return m;
    }
  }
}

// Visibility of (row, key) from everything but the mask.
__device__ __forceinline__ bool position_visible(const FwdParams& p, const RowView& row, int j) {
  if (!row.real || j >= p.seqlen_k) return false;
  if (p.causal && j > row.i) return false;
  if (p.window_left >= 0 && j < row.i - p.window_left) return false;
  return true;
}

// A row's LSE from the max of its visible scores and its sum of exp(score - max) (-inf with no visible key), and
// the factor its normalised output takes where a sink joins the denominator: lse' = logaddexp(lse, sink),
// out' = out * exp(lse - lse') (0 for a row that sees no key: its weight is all on the sink).
__device__ __forceinline__ float2 finish_row(float row_max, float row_sum, const float* sinks, int head) {
  const float lse = row_sum > 0.f ? row_max + logf(row_sum) : -INFINITY;
  if (sinks == nullptr) return make_float2(lse, 1.f);
  const float sink = sinks[head];
  const float joined = lse == -INFINITY ? sink : fmaxf(lse, sink) + log1pf(expf(-fabsf(lse - sink)));
  return make_float2(joined, lse == -INFINITY ? 0.f : expf(lse - joined));
}

// A split's weight in its row: its sum scaled from its max to the row's (0 for a split that saw no key).
__device__ __forceinline__ float split_weight(float split_max, float split_sum, float row_max) {
  return split_max == -INFINITY ? 0.f : split_sum * expf(split_max - row_max);
}

template <int HeadDim, DType Dt>
__global__ void __launch_bounds__(Config<HeadDim>::kThreads) decode_split_kernel(const Args args) {
  using S = Smem<HeadDim, Dt>;
  using C = Config<HeadDim>;
  using T = typename S::T;
  constexpr int kBlockN = C::kBlockN;
  constexpr int kPitch = S::kPitch;
  constexpr int kChunks = HeadDim / 8;  // 16-byte chunks per row
  const FwdParams& p = args.p;
  const Plan& plan = args.plan;
  allow_dependent_grid();  // the combine kernel may launch now; it waits for these partial rows

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_smem = reinterpret_cast<T*>(smem_raw);
  T* stage_smem = q_smem + kRows * kPitch;
  __shared__ unsigned long long visible_blocks, masked_blocks;  // masked: a bool mask hides some key there
  __shared__ float group_max[C::kKeyGroups][kRows], group_sum[C::kKeyGroups][kRows];
  __shared__ float out_factor[kRows];  // one split: each row's sink factor (finish_row)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = warp / C::kColSplit, col0 = (warp % C::kColSplit) * C::kCols;  // keys group*16.., columns col0..
  const int tile = blockIdx.x % plan.row_tiles;
  const int bh = blockIdx.x / plan.row_tiles;  // batch * Hkv + kv head
  const int batch = bh / p.heads_kv, kv_head = bh % p.heads_kv;
  const int split = blockIdx.y;
  const int rows_total = plan.groups * p.seqlen_q;  // packed rows of this (batch, KV head)

  // Row r of the tile: packed index tile*16 + r = g * Sq + i (query head kv_head * groups + g).
  auto row_view = [&](int r) {
    RowView v{false, 0, nullptr};
    const int packed = tile * kRows + r;
    if (packed < rows_total) {
      v.real = true;
      v.i = packed % p.seqlen_q;
      const int head = kv_head * plan.groups + packed / p.seqlen_q;
      if (p.mask != nullptr) {
        const int elem = p.mask_dtype == MaskDType::kBool ? 1 : p.mask_dtype == MaskDType::kF32 ? 4 : 2;
        v.mask = static_cast<const char*>(p.mask) +
                 (batch * p.mask_batch_stride + head * p.mask_head_stride + int64_t(v.i) * p.mask_row_stride) * elem;
      }
    }
    return v;
  };
  auto q_row_ptr = [&](int r) {
    const int packed = tile * kRows + r;
    const int head = kv_head * plan.groups + packed / p.seqlen_q;
    return static_cast<const T*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride +
           int64_t(packed % p.seqlen_q) * p.q_row_stride;
  };

  // Split s takes key blocks s, s + splits, s + 2 splits, ...: where only some keys are visible (a static
  // cache's filled prefix) they spread over every split instead of filling the first few.
  const bool dealt = FA2_DECODE_DEAL_UNMASKED || p.mask != nullptr;
  const int per_split = (plan.num_blocks + plan.splits - 1) / plan.splits;
  const int first = dealt ? split : split * per_split, stride = dealt ? plan.splits : 1;
  const int end = dealt ? plan.num_blocks : min(plan.num_blocks, first + per_split);
  const int num_blocks = max(0, (end - first + stride - 1) / stride);
  auto key_block = [&](int local) { return first + local * stride; };

  // 1. The blocks of this split that some row of the tile sees, and those where the mask hides a key that the
  // positions leave visible (elsewhere a bool mask's bits need not be read again). A call that sees every block
  // (each holds a key below Sk) skips the scan: its loads start at once.
  const bool every_block = sees_every_block(p);
  if (!every_block) {
    if (tid == 0) visible_blocks = masked_blocks = 0ull;
    __syncthreads();
    unsigned long long mine = 0ull, hidden = 0ull;
    if (p.mask != nullptr) {
      // With a mask shared by the heads, a row's visibility depends on its query position only: the tile's
      // first Sq rows hold every position it has.
      const int rows_here = min(kRows, rows_total - tile * kRows);
      const int keys = num_blocks * kBlockN, rows = p.mask_head_stride == 0 ? min(rows_here, p.seqlen_q) : rows_here;
      for (int idx = tid; idx < rows * keys; idx += C::kThreads) {
        const int r = idx / keys, local = idx % keys, j = key_block(local / kBlockN) * kBlockN + local % kBlockN;
        const RowView row = row_view(r);
        bool visible = position_visible(p, row, j);
        if (visible) {
          read_mask(p, row.mask, j, visible);
          (visible ? mine : hidden) |= 1ull << (local / kBlockN);
        }
      }
    } else if (tid < num_blocks) {
      for (int r = 0; r < kRows; ++r) {  // a block is seen if a row sees its first or last key in range
        const RowView row = row_view(r);
        const int j0 = key_block(tid) * kBlockN, j1 = min(j0 + kBlockN, p.seqlen_k) - 1;
        const int lo = p.window_left >= 0 ? max(j0, row.i - p.window_left) : j0;
        const int hi = p.causal ? min(j1, row.i) : j1;
        if (row.real && lo <= hi) mine |= 1ull << tid;
      }
    }
    if (mine) atomicOr(&visible_blocks, mine);
    if (hidden) atomicOr(&masked_blocks, hidden);
  }

  // 2. The query tile into shared memory (padding rows and columns as zeros).
  for (int idx = tid; idx < kRows * kChunks; idx += C::kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = tile * kRows + r < rows_total && c * 8 < p.head_dim;
    cp_async_16(smem_address(q_smem + r * kPitch + c * 8), valid ? q_row_ptr(r) + c * 8 : p.q, valid);
  }
  cp_async_commit();
  if (!every_block) __syncthreads();  // the scan's result
  // The blocks still to visit, as bits of a 64-block window from window_base: a scanned split has one window
  // (its visible set), a split that sees every block one full window after the other.
  auto window_of = [&](int base) { return num_blocks - base >= 64 ? ~0ull : (1ull << (num_blocks - base)) - 1; };
  int window_base = 0;
  unsigned long long todo = every_block ? window_of(0) : visible_blocks;
  static_assert(kMaxBlocksPerSplit == 64, "a scanned split's blocks are the bits of one 64-bit word");

  auto load_block = [&](int stage, int block) {
    T* k_dst = stage_smem + stage * S::kStageElems;
    T* v_dst = k_dst + kBlockN * kPitch;
    const int j0 = key_block(block) * kBlockN;
    const T* k_base = static_cast<const T*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
    const T* v_base = static_cast<const T*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;
    for (int idx = tid; idx < kBlockN * kChunks; idx += C::kThreads) {
      const int n = idx / kChunks, c = idx % kChunks, j = j0 + n;
      const bool valid = j < p.seqlen_k && c * 8 < p.head_dim;
      cp_async_16(smem_address(k_dst + n * kPitch + c * 8), valid ? k_base + int64_t(j) * p.k_row_stride + c * 8 : p.k,
                  valid);
      cp_async_16(smem_address(v_dst + n * kPitch + c * 8), valid ? v_base + int64_t(j) * p.v_row_stride + c * 8 : p.v,
                  valid);
    }
  };
  auto next_block = [&]() {
    if (todo == 0ull) {
      if (!every_block || window_base + 64 >= num_blocks) return -1;
      window_base += 64;
      todo = window_of(window_base);
    }
    const int b = __ffsll(static_cast<long long>(todo)) - 1;
    todo &= todo - 1;
    return window_base + b;
  };

  // The blocks in the stages, in visiting order: in_flight[0] is computed next, from stage `stage`.
  int in_flight[kStages];
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    in_flight[s] = next_block();
    if (in_flight[s] >= 0) load_block(s, in_flight[s]);
    cp_async_commit();
  }

  // 3. Online softmax over the visible blocks. Thread (lane) holds rows qr and qr + 8 of the tile,
  // columns 2 * qc, 2 * qc + 1 of each 8-wide MMA tile.
  const int qr = lane / 4, qc = lane % 4;
  const RowView rows[2] = {row_view(qr), row_view(qr + 8)};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  float acc[C::kCols / 8][4];
#pragma unroll
  for (int n = 0; n < C::kCols / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  for (int stage = 0; in_flight[0] >= 0; stage = stage + 1 == kStages ? 0 : stage + 1) {
    const int block = in_flight[0];
    cp_async_wait<kStages - 1>();
    __syncthreads();
    const T* k_smem = stage_smem + stage * S::kStageElems;
    const T* v_smem = k_smem + kBlockN * kPitch;

    // Visibility and mask terms first: their loads are in flight while the MMAs run. A float mask's values
    // are always read; a bool mask's only in blocks where it hides a key.
    const int key0 = key_block(block) * kBlockN + group * 16;
    const bool read_mask_here =
        p.mask != nullptr && (p.mask_dtype != MaskDType::kBool || (masked_blocks >> block & 1ull));
    bool visible[2][4];
    float bias[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int h = c / 2, j = key0 + n * 8 + 2 * qc + (c % 2);
        visible[n][c] = position_visible(p, rows[h], j);
        bias[n][c] = visible[n][c] && rows[h].mask != nullptr && read_mask_here
                         ? read_mask(p, rows[h].mask, j, visible[n][c]) : 0.f;
      }
    }

    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk) {
      uint32_t a[4], b[4];
      ldmatrix_x4(a, smem_address(q_smem + (lane % 16) * kPitch + kk * 16 + (lane / 16) * 8));
      const int m = lane / 8;
      ldmatrix_x4(b, smem_address(k_smem + (group * 16 + (m / 2) * 8 + lane % 8) * kPitch + kk * 16 + (m % 2) * 8));
      mma_16816<Dt>(s[0], a, b[0], b[1]);
      mma_16816<Dt>(s[1], a, b[2], b[3]);
    }

    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float x = s[n][c];
        if (args.softcap_in > 0.f) x = soft_capped(x, args.softcap_in, args.softcap_out);
        s[n][c] = visible[n][c] ? x * p.scale + bias[n][c] : -INFINITY;  // natural units: finfo.min fills stay finite
        block_max[c / 2] = fmaxf(block_max[c / 2], s[n][c]);
      }
    }
    float correction[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      block_max[h] = fmaxf(block_max[h], __shfl_xor_sync(0xffffffffu, block_max[h], 1));
      block_max[h] = fmaxf(block_max[h], __shfl_xor_sync(0xffffffffu, block_max[h], 2));
      const float new_max = fmaxf(row_max[h], block_max[h]);
      const float base = new_max == -INFINITY ? 0.f : new_max;  // a row with nothing visible yet stays at 0
      correction[h] = exp2f((row_max[h] - base) * kLog2e);
      row_max[h] = new_max;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        s[n][2 * h] = exp2f((s[n][2 * h] - base) * kLog2e);
        s[n][2 * h + 1] = exp2f((s[n][2 * h + 1] - base) * kLog2e);
        row_sum[h] = row_sum[h] * (n == 0 ? correction[h] : 1.f) + s[n][2 * h] + s[n][2 * h + 1];
      }
    }
#pragma unroll
    for (int n = 0; n < C::kCols / 8; ++n) {
      acc[n][0] *= correction[0], acc[n][1] *= correction[0];
      acc[n][2] *= correction[1], acc[n][3] *= correction[1];
    }
    using E = Element<Dt>;
    const uint32_t probs[4] = {E::pack(s[0][0], s[0][1]), E::pack(s[0][2], s[0][3]), E::pack(s[1][0], s[1][1]),
                               E::pack(s[1][2], s[1][3])};
#pragma unroll
    for (int dd = 0; dd < C::kCols / 16; ++dd) {
      uint32_t b[4];
      const int m = lane / 8;
      ldmatrix_x4_trans(b, smem_address(v_smem + (group * 16 + (m % 2) * 8 + lane % 8) * kPitch + col0 + dd * 16 +
                                        (m / 2) * 8));
      mma_16816<Dt>(acc[2 * dd], probs, b[0], b[1]);
      mma_16816<Dt>(acc[2 * dd + 1], probs, b[2], b[3]);
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s + 1 < kStages; ++s) in_flight[s] = in_flight[s + 1];
    in_flight[kStages - 1] = next_block();
    if (in_flight[kStages - 1] >= 0) load_block(stage, in_flight[kStages - 1]);
    cp_async_commit();
  }
  cp_async_wait<0>();

  // 4. Merge the key groups' rows: each group's share scaled to the tile's max, summed in a fixed order.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
    if (qc == 0 && col0 == 0) {
      group_max[group][qr + 8 * h] = row_max[h];
      group_sum[group][qr + 8 * h] = row_sum[h];
    }
  }
  __syncthreads();
  float* partial = reinterpret_cast<float*>(stage_smem);  // [kKeyGroups][kRows][HeadDim]
  float tile_max[2], tile_sum[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = qr + 8 * h;
    tile_max[h] = -INFINITY;
    for (int g = 0; g < C::kKeyGroups; ++g) tile_max[h] = fmaxf(tile_max[h], group_max[g][r]);
    const float base = tile_max[h] == -INFINITY ? 0.f : tile_max[h];
    tile_sum[h] = 0.f;
    for (int g = 0; g < C::kKeyGroups; ++g) tile_sum[h] += group_sum[g][r] * exp2f((group_max[g][r] - base) * kLog2e);
    const float factor = tile_sum[h] > 0.f ? exp2f((row_max[h] - base) * kLog2e) / tile_sum[h] : 0.f;  // O / sum
#pragma unroll
    for (int n = 0; n < C::kCols / 8; ++n) {
      float* out = partial + (group * kRows + r) * HeadDim + col0 + n * 8 + 2 * qc;
      out[0] = acc[n][2 * h] * factor;
      out[1] = acc[n][2 * h + 1] * factor;
    }
    if (warp == 0 && qc == 0 && rows[h].real) {
      const int packed = tile * kRows + r;
      const int head = kv_head * plan.groups + packed / p.seqlen_q, i = packed % p.seqlen_q;
      if (plan.splits == 1) {
        const float2 finished = finish_row(tile_max[h], tile_sum[h], p.sinks, head);
        p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + i] = finished.x;
        out_factor[r] = finished.y;
      } else {
        const int64_t row_index = (int64_t(batch) * p.heads_q + head) * p.seqlen_q + i;
        args.max_partial[split * plan.partial_rows + row_index] = tile_sum[h] > 0.f ? tile_max[h] : -INFINITY;
        args.sum_partial[split * plan.partial_rows + row_index] = tile_sum[h];
      }
    }
  }
  __syncthreads();
  for (int idx = tid; idx < kRows * p.head_dim; idx += C::kThreads) {
    const int r = idx / p.head_dim, d = idx % p.head_dim;
    const int packed = tile * kRows + r;
    if (packed >= rows_total) continue;
    float sum = 0.f;
#pragma unroll
    for (int g = 0; g < C::kKeyGroups; ++g) sum += partial[(g * kRows + r) * HeadDim + d];
    const int head = kv_head * plan.groups + packed / p.seqlen_q, i = packed % p.seqlen_q;
    if (plan.splits == 1) {
      T* out = static_cast<T*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride + int64_t(i) * p.o_row_stride;
      out[d] = Element<Dt>::from_float(sum * out_factor[r]);
    } else {
      const int64_t row_index = (int64_t(batch) * p.heads_q + head) * p.seqlen_q + i;
      args.o_partial[(split * plan.partial_rows + row_index) * p.head_dim + d] = sum;
    }
  }
}

// out and lse from the splits' partial rows: weights sum_s * exp(max_s - max), then the sink (if any) joins the row.
// A CTA per row, its warps sharing the splits (split s to warp s % kCombineWarps), each lane 4 columns: the first
// kCombineEarly splits of a warp are loaded at entry, beside the maxima and sums, so a row of up to
// kCombineWarps * kCombineEarly splits costs one round of loads rather than one per split group; the warps' sums
// are added in shared memory in a fixed order.
template <DType Dt>
__global__ void __launch_bounds__(32 * kCombineWarps) decode_combine_kernel(const Args args) {
  using T = typename Element<Dt>::T;
  __shared__ float weights[kCombineMaxSplits];
  __shared__ float warp_share[kCombineWarps];
  __shared__ float4 partial[kCombineWarps][kMaxHeadDim / 4];
  wait_for_prior_grid();  // the split kernel's partial rows (pdl.hpp)
  allow_dependent_grid();  // the empty-row pass, if one follows
  const FwdParams& p = args.p;
  const Plan& plan = args.plan;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t row = blockIdx.x;
  const int i = int(row % p.seqlen_q);
  const int head = int((row / p.seqlen_q) % p.heads_q);
  const int batch = int(row / (int64_t(p.seqlen_q) * p.heads_q));
  const float* max_partial = args.max_partial + row;  // split s at s * partial_rows
  const float* sum_partial = args.sum_partial + row;
  const int64_t split_stride = plan.partial_rows * p.head_dim;
  const float* o_row = args.o_partial + row * p.head_dim;  // split s at s * split_stride

  // 1. One round of loads: this warp's first splits at the first columns, this thread's first max and sum.
  const int d0 = 4 * lane;
  float4 early[kCombineEarly];
#pragma unroll
  for (int e = 0; e < kCombineEarly; ++e) {
    const int split = warp + e * kCombineWarps;
    early[e] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (split < plan.splits && d0 < p.head_dim) {
      early[e] = *reinterpret_cast<const float4*>(o_row + split * split_stride + d0);
    }
  }
  const float first_max = tid < plan.splits ? max_partial[tid * plan.partial_rows] : -INFINITY;
  const float first_sum = tid < plan.splits ? sum_partial[tid * plan.partial_rows] : 0.f;

  // 2. The row's max, then each split's weight and their total (both reduced over the CTA).
  auto reduce = [&](float x, bool is_max) {
    for (int offset = 16; offset > 0; offset /= 2) {
      const float y = __shfl_xor_sync(0xffffffffu, x, offset);
      x = is_max ? fmaxf(x, y) : x + y;
    }
    if (lane == 0) warp_share[warp] = x;
    __syncthreads();
    x = warp_share[0];
    for (int w = 1; w < kCombineWarps; ++w) x = is_max ? fmaxf(x, warp_share[w]) : x + warp_share[w];
    __syncthreads();  // warp_share is reused
    return x;
  };
  float top = first_max;
  for (int split = tid + 32 * kCombineWarps; split < plan.splits; split += 32 * kCombineWarps) {
    top = fmaxf(top, max_partial[split * plan.partial_rows]);
  }
  top = reduce(top, true);
  auto weight = [&](int split) {
    return split_weight(max_partial[split * plan.partial_rows], sum_partial[split * plan.partial_rows], top);
  };
  float total = 0.f;
  if (tid < plan.splits) {
    const float w = split_weight(first_max, first_sum, top);
    weights[tid] = w;
    total += w;
  }
  for (int split = tid + 32 * kCombineWarps; split < plan.splits; split += 32 * kCombineWarps) {
    const float w = weight(split);
    if (split < kCombineMaxSplits) weights[split] = w;
    total += w;
  }
  total = reduce(total, false);  // its barriers also publish the weights

  // 3. Each warp's weighted sum of its splits, column group by column group, then the warps' sums added.
  const float2 finished = finish_row(top, total, p.sinks, head);
  const float out_scale = total > 0.f ? finished.y / total : 0.f;
  T* out = static_cast<T*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride + int64_t(i) * p.o_row_stride;
  for (int d = d0; d - d0 < p.head_dim; d += 128) {  // every warp runs the same passes (barriers below)
    float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
    if (total > 0.f && d < p.head_dim) {
      int split = warp;
      if (d == d0) {
#pragma unroll
        for (int e = 0; e < kCombineEarly; ++e, split += kCombineWarps) {
          if (split < plan.splits) {
            const float w = weights[split];
            value.x += w * early[e].x, value.y += w * early[e].y, value.z += w * early[e].z, value.w += w * early[e].w;
          }
        }
      }
#pragma unroll 4
      for (; split < plan.splits; split += kCombineWarps) {
        const float w = split < kCombineMaxSplits ? weights[split] : weight(split);
        const float4 o = *reinterpret_cast<const float4*>(o_row + split * split_stride + d);
        value.x += w * o.x, value.y += w * o.y, value.z += w * o.z, value.w += w * o.w;
      }
    }
    if (d < p.head_dim) partial[warp][d / 4] = value;
    __syncthreads();
    for (int c = tid; c < 128 && d - d0 + c < p.head_dim; c += 32 * kCombineWarps) {
      const int column = d - d0 + c;
      const float4& q = partial[0][column / 4];
      float sum = (&q.x)[column % 4];
      for (int w = 1; w < kCombineWarps; ++w) sum += (&partial[w][column / 4].x)[column % 4];
      out[column] = Element<Dt>::from_float(sum * out_scale);
    }
    __syncthreads();  // partial is reused by the next pass
  }
  if (tid == 0) p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + i] = finished.x;
}

// The SMs of the current device (asked once per device).
inline int sm_count() {
  static int counts[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  if (counts[device] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    counts[device] = n > 0 ? n : 132;
  }
  return counts[device];
}

// Split kernels one SM holds at once (shared memory and registers decide; asked once per device, which
// also raises the kernel's shared-memory limit, before any CUDA graph capture).
template <int HeadDim, DType Dt>
int resident_ctas_per_sm() {
  static int counts[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 1;
  if (counts[device] == 0) {
    constexpr int smem_bytes = Smem<HeadDim, Dt>::kBytes;
    int n = 0;
    if (allow_dynamic_smem<&decode_split_kernel<HeadDim, Dt>>(smem_bytes) == cudaSuccess) {
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_split_kernel<HeadDim, Dt>, Config<HeadDim>::kThreads,
                                                    smem_bytes);
    }
    counts[device] = n > 0 ? n : 1;
  }
  return counts[device];
}

// At least `fewest` splits, at most one per block, and no split left empty (blocks per split rounded up).
inline int whole_splits(int wanted, int num_blocks, int max_blocks_per_split) {
  const int fewest = std::max(1, (num_blocks + max_blocks_per_split - 1) / max_blocks_per_split);
  wanted = std::max(fewest, std::min(wanted, std::max(1, num_blocks)));
  const int blocks_per_split = (num_blocks + wanted - 1) / wanted;
  return std::max(1, (num_blocks + blocks_per_split - 1) / blocks_per_split);
}

// How many splits the keys of `num_blocks` blocks get when each split launches `ctas` CTAs and `slots` CTAs
// run at once. The time is about (waves of CTAs) x (blocks per CTA + one block's worth of fixed cost: the
// CTA's prologue and its rows in the combine), so a last wave that fills a few SMs costs a whole wave:
// e.g. 64 CTAs per split on 264 slots take 4 splits (one wave), not 5 (two). The fewest splits of the
// cheapest count win; a split holds at most max_blocks_per_split blocks (kMaxBlocksPerSplit where they are
// scanned); more splits than fill two waves never pay.
inline int choose_splits(int64_t ctas, int num_blocks, int64_t slots, int max_blocks_per_split) {
  const int fewest = std::max(1, (num_blocks + max_blocks_per_split - 1) / max_blocks_per_split);
  const int64_t two_waves = (2 * slots + ctas - 1) / ctas;
  const int most = int(std::max<int64_t>(fewest, std::min<int64_t>(num_blocks, two_waves)));
  int best = fewest;
  int64_t best_cost = INT64_MAX;
  for (int wanted = fewest; wanted <= most; ++wanted) {
    const int splits = whole_splits(wanted, num_blocks, max_blocks_per_split);
    const int blocks_per_split = (num_blocks + splits - 1) / splits;
    const int64_t waves = (ctas * splits + slots - 1) / slots;
    const int64_t cost = waves * (blocks_per_split + 1);
    if (cost < best_cost) best = splits, best_cost = cost;
  }
  return best;
}

// FA2_INDUCTOR_DECODE_SPLITS=n (a tuning knob, read at each call so that one process can time several): n splits
// instead of choose_splits' count, within what a plan allows (enough for a split's block limit, at most one per
// block), to time the curve that choose_splits models. Unset or 0: the planned count.
inline int forced_splits() {
  const char* value = std::getenv("FA2_INDUCTOR_DECODE_SPLITS");
  return value == nullptr ? 0 : std::max(0, std::atoi(value));
}

template <int HeadDim, DType Dt>
Plan make_plan(const FwdParams& p) {
  constexpr int kBlockN = Config<HeadDim>::kBlockN;
  Plan plan;
  plan.groups = p.heads_q / p.heads_kv;
  plan.row_tiles = (plan.groups * p.seqlen_q + kRows - 1) / kRows;
  plan.num_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
  plan.ctas = int64_t(p.batch) * p.heads_kv * plan.row_tiles;
  const int64_t slots = int64_t(sm_count()) * resident_ctas_per_sm<HeadDim, Dt>();
  const int forced = forced_splits();
  const int max_blocks_per_split = sees_every_block(p) ? std::max(1, plan.num_blocks) : kMaxBlocksPerSplit;
  plan.splits = forced > 0 ? whole_splits(forced, plan.num_blocks, max_blocks_per_split)
                           : choose_splits(plan.ctas, plan.num_blocks, slots, max_blocks_per_split);
  plan.partial_rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  // One split writes out and lse itself: partial rows only for the combine.
  const int64_t floats = plan.splits == 1 ? 0 : int64_t(plan.splits) * plan.partial_rows * (p.head_dim + 2);
  plan.workspace_bytes = (floats * int64_t(sizeof(float)) + 255) / 256 * 256;
  return plan;
}

}  // namespace decode

template <int HeadDim, DType Dt>
int64_t decode_workspace_bytes(const FwdParams& p) {
  return decode::make_plan<HeadDim, Dt>(p).workspace_bytes;
}

template <int HeadDim, DType Dt>
cudaError_t run_decode(const FwdParams& p, void* workspace, cudaStream_t stream) {
  using namespace decode;
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0) return cudaSuccess;
  if (p.head_dim <= 0 || p.head_dim > HeadDim || p.head_dim % 8 != 0 || p.seqlen_k <= 0 ||
      p.seqlen_q > kDecodeMaxSeqlenQ) {
    return cudaErrorInvalidValue;
  }
  const SoftcapFactors softcap = softcap_factors(p.scale, p.softcap);
  Args args{p, make_plan<HeadDim, Dt>(p), nullptr, nullptr, nullptr, softcap.in, softcap.out};
  const Plan& plan = args.plan;
  if (plan.workspace_bytes > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  if (plan.splits > kMaxGridDim || plan.ctas > 0x7fffffff ||
      plan.partial_rows > 0x7fffffff) {  // the combine's grid: a CTA per row
    return cudaErrorInvalidConfiguration;
  }
  if (plan.splits > 1) {
    args.o_partial = static_cast<float*>(workspace);  // first: 16-byte aligned for the combine's float4 loads
    args.max_partial = args.o_partial + int64_t(plan.splits) * plan.partial_rows * p.head_dim;
    args.sum_partial = args.max_partial + int64_t(plan.splits) * plan.partial_rows;
  }
  auto kernel = &decode_split_kernel<HeadDim, Dt>;
  constexpr int smem_bytes = Smem<HeadDim, Dt>::kBytes;
  static_assert(smem_bytes <= kSmemCapacityBytes, "decode tile too large for shared memory");
  cudaError_t err = allow_dynamic_smem<&decode_split_kernel<HeadDim, Dt>>(smem_bytes);
  if (err != cudaSuccess) return err;
  dim3 grid(unsigned(plan.ctas), unsigned(plan.splits));
  kernel<<<grid, Config<HeadDim>::kThreads, smem_bytes, stream>>>(args);
  err = cudaGetLastError();
  if (err != cudaSuccess || plan.splits == 1) return err;
  const int64_t combine_ctas = plan.partial_rows;
  return launch_after_prior_grid(&decode_combine_kernel<Dt>, dim3(unsigned(combine_ctas)),
                                 dim3(32 * kCombineWarps), 0, stream, args);
}

}  // namespace fa2

#define FA2_INSTANTIATE_DECODE(HDIM, DT)                                                                           \
  template cudaError_t fa2::run_decode<HDIM, fa2::DType::DT>(const fa2::FwdParams&, void*, cudaStream_t);          \
  template int64_t fa2::decode_workspace_bytes<HDIM, fa2::DType::DT>(const fa2::FwdParams&);
