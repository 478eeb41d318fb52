// Tile sizes, pipeline depth and warpgroup counts per (head dim, causal).
#pragma once

namespace fa2 {

// kBlockM: query rows per CTA (64 per consumer warpgroup; masked kernels keep kMaskBlockM).
// kLongBlockM: the rows per CTA of unmasked calls with at least kLongMinSeqlenQ query rows (0: kBlockM always).
// kBlockN: key rows per pipeline stage.  kStages: K/V shared-memory stages.
// kMaskBlockN, kMaskStages: the same for masked kernels (configs with Causal false), whose key blocks are
// whole 64-key words of the pre-pass's bit rows.
// kPersistent: one CTA per SM runs many query tiles (tile_scheduler.hpp); O is staged in a buffer of its
// own where shared memory has room (D <= 128), else in each warpgroup's Q block (KernelTraits::kOwnOBuffer).
// kHeaviestFirstStrideMaxSeqlenQ: calls whose tiles
// run heaviest first (causal, masks) stride only up to this many query rows, one CTA per tile above.
// Measured on the H200 (bf16 causal, 16k tokens, striding in pairs vs one CTA per tile, same run): D=64
// 1.26x / 1.18x / 1.11x / 1.06x at 512 / 1k / 2k / 4k, 1.00x at 8k, 0.98x at 16k; D=128 1.27x / 1.19x / 1.13x
// / 1.08x / 1.05x at 512 / 1k / 2k / 4k / 8k, 0.99x at 16k. D=96/192/256 take D=128's limit (not swept).
// kLazyRescale: a row keeps its running max within softmax.hpp's threshold and a warp whose rows all kept
// theirs skips O's rescale (D/2 multiplies per thread and key block). Measured on the H200 (bf16, 16k tokens,
// same run against cuDNN): D=192/256 gain 1-4% (D=256 non-causal 0.92-1.02x -> 0.95-1.07x); at D=64 the
// warp vote costs more than the multiplies it saves (512: 0.89x -> 0.84x); D=128 within 1.5% either way.
template <int HeadDim, bool Causal>
struct TileConfig;

// FA2_STRIDE_MAX_SEQLEN_Q=n overrides kHeaviestFirstStrideMaxSeqlenQ of every persistent config (sweeps).
#ifdef FA2_STRIDE_MAX_SEQLEN_Q
#define FA2_STRIDE_MAX(measured) FA2_STRIDE_MAX_SEQLEN_Q
#else
#define FA2_STRIDE_MAX(measured) measured
#endif

// Ping-pong (kernels of two consumer warpgroups): the two take turns issuing their GEMMs (named barriers), so one
// warpgroup's softmax runs under the other's GEMMs. Defaults from a tile sweep (docs/design.md):
// on for D=64/128, off for D=256. FA2_PINGPONG=0/1 forces every head dim.
#ifdef FA2_PINGPONG
#define FA2_PINGPONG_HDIM64 FA2_PINGPONG
#define FA2_PINGPONG_HDIM128 FA2_PINGPONG
#define FA2_PINGPONG_HDIM192 FA2_PINGPONG
#define FA2_PINGPONG_HDIM256 FA2_PINGPONG
#endif
#ifndef FA2_PINGPONG_HDIM64
#define FA2_PINGPONG_HDIM64 1
#endif
#ifndef FA2_PINGPONG_HDIM128
#define FA2_PINGPONG_HDIM128 1
#endif
#ifndef FA2_PINGPONG_HDIM256
#define FA2_PINGPONG_HDIM256 0
#endif

#ifndef FA2_TILE_N_HDIM64
#define FA2_TILE_N_HDIM64 128
#endif
#ifndef FA2_TILE_N_HDIM128
#define FA2_TILE_N_HDIM128 128
#endif
#ifndef FA2_TILE_N_HDIM192
#define FA2_TILE_N_HDIM192 96
#endif
#ifndef FA2_TILE_N_HDIM256
#define FA2_TILE_N_HDIM256 64
#endif
#ifndef FA2_PINGPONG_HDIM192
#define FA2_PINGPONG_HDIM192 1
#endif
#ifndef FA2_STAGES_HDIM192
#define FA2_STAGES_HDIM192 2
#endif
// D=192/256 persistent: O staged in each warpgroup's Q block (no room for a buffer of its own).
#ifndef FA2_PERSISTENT_HDIM192
#define FA2_PERSISTENT_HDIM192 1
#endif
#ifndef FA2_PERSISTENT_HDIM256
#define FA2_PERSISTENT_HDIM256 1
#endif

// D=64: 128 query rows (two ping-pong warpgroups) for short query sequences, 192 (three warpgroups) from
// kLongMinSeqlenQ rows. H200 bf16 against cuDNN, 16k tokens, same run: without causal 128 rows gave 0.97x at
// 512/1k (192: 0.95x) and 0.98-1.00x from 2k (192: 1.02-1.09x); causal 192 rows fell to 0.70x/0.73x at
// 512/1k (128: 0.83x/0.86x), tied at 2k-4k and won from 8k (1.00x/1.06x at 8k/16k against 0.93x/0.97x).
template <bool Causal>
struct TileConfig<64, Causal> {
  static constexpr bool kPingPong = FA2_PINGPONG_HDIM64;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = FA2_TILE_N_HDIM64, kStages = 3;
  static constexpr int kMaskBlockN = kBlockN, kMaskStages = kStages;
  static constexpr int kLongBlockM = 192, kLongMinSeqlenQ = Causal ? 8192 : 2048;
  static constexpr bool kPersistent = true;
  static constexpr int kHeaviestFirstStrideMaxSeqlenQ = FA2_STRIDE_MAX(4096);
  static constexpr bool kLazyRescale = false;
};
// D=96 (Phi-3 and others; 80 runs here too, zero-padded): D=128's tiles, head-dim rows in 64-byte swizzle
// atoms. Q 24 KB + three K and three V stages (24 KB each) + O staged apart. Built on request
// (FA2_INDUCTOR_HEAD_DIMS); H200 bf16: 8-14% above the padded run on 128, 0.97-1.22x cuDNN.
template <bool Causal>
struct TileConfig<96, Causal> {
  static constexpr bool kPingPong = FA2_PINGPONG_HDIM128;
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 3;
  static constexpr int kMaskBlockN = kBlockN, kMaskStages = kStages;
  static constexpr bool kPersistent = true;
  static constexpr int kLongBlockM = 0, kLongMinSeqlenQ = 0;
  static constexpr int kHeaviestFirstStrideMaxSeqlenQ = FA2_STRIDE_MAX(8192);
  static constexpr bool kLazyRescale = false;
};
template <bool Causal>
struct TileConfig<128, Causal> {
  static constexpr bool kPingPong = FA2_PINGPONG_HDIM128;
  static constexpr int kBlockM = 128, kBlockN = FA2_TILE_N_HDIM128, kStages = 2;
  static constexpr int kMaskBlockN = kBlockN, kMaskStages = kStages;
  static constexpr bool kPersistent = true;
  static constexpr int kLongBlockM = 0, kLongMinSeqlenQ = 0;
  static constexpr int kHeaviestFirstStrideMaxSeqlenQ = FA2_STRIDE_MAX(8192);
  static constexpr bool kLazyRescale = false;
};
// D=192: unmasked kernels take 96-key blocks in two stages (Q 48 KB + two K and two V stages, 72 KB each;
// 128 keys would not fit); O is staged in each warpgroup's Q block, as at D=256. H200 bf16 against cuDNN,
// 16k tokens, same run: 96 keys 1.03-1.13x without causal from 1k, 1.07-1.24x causal from 2k (64 keys in
// three stages: 0.96-0.98x and 0.99-1.07x); 512 0.94x / 0.87x causal (64 keys: 0.93x / 0.91x). Masked
// kernels keep 64 keys in three stages (whole words of the mask's bit rows).
template <bool Causal>
struct TileConfig<192, Causal> {
  static constexpr bool kPingPong = FA2_PINGPONG_HDIM192;
  static constexpr int kBlockM = 128, kBlockN = FA2_TILE_N_HDIM192, kStages = FA2_STAGES_HDIM192;
  static constexpr bool kPersistent = FA2_PERSISTENT_HDIM192;
  static constexpr int kMaskBlockN = 64, kMaskStages = 3;
  static constexpr int kLongBlockM = 0, kLongMinSeqlenQ = 0;
  static constexpr int kHeaviestFirstStrideMaxSeqlenQ = FA2_STRIDE_MAX(8192);
  static constexpr bool kLazyRescale = true;
};
// D=256: 64 keys in two stages. Unmasked kernels may take other multiples of 16 keys (FlashAttention-3
// takes 80: -DFA2_TILE_N_HDIM256=80, 0.64-0.71x cuDNN against 64 keys' 0.93-1.04x on the H200); masked ones
// keep 64.
template <bool Causal>
struct TileConfig<256, Causal> {
  static constexpr bool kPingPong = FA2_PINGPONG_HDIM256;
  static constexpr int kBlockM = 128, kBlockN = FA2_TILE_N_HDIM256, kStages = 2;
  static constexpr int kMaskBlockN = 64, kMaskStages = 2;
  static constexpr bool kPersistent = FA2_PERSISTENT_HDIM256;
  static constexpr int kLongBlockM = 0, kLongMinSeqlenQ = 0;
  static constexpr int kHeaviestFirstStrideMaxSeqlenQ = FA2_STRIDE_MAX(8192);
  static constexpr bool kLazyRescale = true;
};

}  // namespace fa2
