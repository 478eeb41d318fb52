// Type bundle of the Hopper backward kernel: tiles per head dim, the five WGMMA tiled MMAs, the
// shared-memory layouts, TMA copy types and the kernel's argument block. docs/backward.md explains
// the choices; this header only states them.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "bwd_params.h"
#include "mainloop_sm90.hpp"  // ElementOf, wg_gemm, convert_pairs
#include "bwd_mask.hpp"       // BwdMaskArgs
#include "tile_scheduler.hpp"  // BwdTile
#include "wgmma_n80.hpp"

namespace fa2 {

using namespace cute;

// One CTA owns kBlockN keys of one (batch, kv head) and walks the query tiles (kBlockM rows) of every
// query head of its group. kSplitKeys: the two MMA warpgroups own 64 keys each, so S^T and dP^T stay in
// registers and feed dV/dK as register operands (D <= 128). Otherwise (D = 256, where dK and dV of 128
// keys would not fit in registers; D = 192 too) the block has 64 keys, the warpgroups split the query tile
// for S^T/dP^T and the head dim for dV/dK/dQ, and P goes through shared memory too.
// kMasked: a mask kernel (its partial blocks need registers for the mask's bits or values).
// kStagedDq: dQ partials staged in shared memory and added to the float32 accumulator by one warp with bulk
// reductions (TMA); else the MMA warps add them with vector reductions. D <= 192 stage them (D = 192: 225 of
// 227 KiB; on the H200 staging took its fwd+bwd from 0.91-0.92x to 1.19-1.22x cuDNN). D = 256 adds directly:
// staging fits there only with one Q and one dO stage (-DFA2_BWD_STAGED_DQ_HDIM256=1
// -DFA2_BWD_STAGES_HDIM256=1, FlashAttention-3's choice), which measured slower (0.78-0.84x cuDNN, where the
// direct adds read 0.84-0.93x as atomics and 0.98-1.09x as reductions).
#ifndef FA2_BWD_STAGED_DQ_HDIM192
#define FA2_BWD_STAGED_DQ_HDIM192 1
#endif
#ifndef FA2_BWD_STAGED_DQ_HDIM256
#define FA2_BWD_STAGED_DQ_HDIM256 0
#endif
#ifndef FA2_BWD_STAGES_HDIM256
#define FA2_BWD_STAGES_HDIM256 2
#endif
// D = 128 without a mask: 80-row query tiles (FlashAttention-3's choice) amortise a step's fixed cost over
// 25 % more rows. Causal kernels take them from kLongMinSeqlenQ query rows and 64 rows below: H100, same run,
// backward spans, 80 against 64 rows: 10 % slower at 512, even at 1k, 1.5-3 % faster at 2k-4k, 5-8 % at
// 8k-16k (design.md §6). Masked kernels keep 64 rows (room for the mask's bits or values).
#ifndef FA2_BWD_BLOCK_M_HDIM128
#define FA2_BWD_BLOCK_M_HDIM128 80
#endif
// The SS-WGMMA op of a tiled MMA atom's (M, N, K): CUTLASS's selector, or ours for N = 80.
template <class Element, class AtomShape, GMMA::Major kMajorA, GMMA::Major kMajorB>
constexpr auto bwd_ss_op() {
  if constexpr (size<1>(AtomShape{}) == 80) {
    return Wgmma64x80x16SS<Element, kMajorA, kMajorB>{};
  } else {
    return GMMA::ss_op_selector<Element, Element, float, AtomShape, kMajorA, kMajorB>();
  }
}

// kLongBlockM: the query rows per tile of calls with at least kLongMinSeqlenQ query rows (0: kBlockM always).
template <int HeadDim, bool kMasked, bool kCausal>
struct BwdTileConfig;
template <bool kMasked, bool kCausal>
struct BwdTileConfig<64, kMasked, kCausal> {
  static constexpr int kBlockM = kMasked ? 64 : 128, kBlockN = 128, kStagesQ = 2, kStagesDO = 2;
  static constexpr int kLongBlockM = 0, kLongMinSeqlenQ = 0;
  static constexpr bool kSplitKeys = true, kStagedDq = true;
};
template <bool kMasked, bool kCausal>
struct BwdTileConfig<128, kMasked, kCausal> {
  static constexpr int kBlockM = kMasked || kCausal ? 64 : FA2_BWD_BLOCK_M_HDIM128, kBlockN = 128, kStagesQ = 2, kStagesDO = 2;
  static constexpr int kLongBlockM = !kMasked && kCausal ? FA2_BWD_BLOCK_M_HDIM128 : 0, kLongMinSeqlenQ = 2048;
  static constexpr bool kSplitKeys = true, kStagedDq = true;
};
template <bool kMasked, bool kCausal>
struct BwdTileConfig<192, kMasked, kCausal> {
  static constexpr int kBlockM = 64, kBlockN = 64, kStagesQ = 2, kStagesDO = 2;
  static constexpr int kLongBlockM = 0, kLongMinSeqlenQ = 0;
  static constexpr bool kSplitKeys = false, kStagedDq = FA2_BWD_STAGED_DQ_HDIM192;
};
template <bool kMasked, bool kCausal>
struct BwdTileConfig<256, kMasked, kCausal> {
  static constexpr int kBlockM = 64, kBlockN = 64, kStagesQ = FA2_BWD_STAGES_HDIM256, kStagesDO = FA2_BWD_STAGES_HDIM256;
  static constexpr int kLongBlockM = 0, kLongMinSeqlenQ = 0;
  static constexpr bool kSplitKeys = false, kStagedDq = FA2_BWD_STAGED_DQ_HDIM256;
};

// Named barrier ids of the backward kernel, one per set of threads that meets. CUTLASS's NamedBarrier adds
// its reserved offset, which leaves 8 of the hardware's 16 ids: an id past them wraps onto barrier 0 (the
// block-wide one). Where two roles meet, one syncs and the other arrives: bar.sync is PTX's aligned barrier,
// and compute-sanitizer synccheck reports two roles' syncs on one as "Divergent thread(s) in block".
enum BwdBarrier : int {
  kBwdBarrierMmaWarps = 0,  // both MMA warpgroups: a step's dS (and P) in shared memory; the epilogue's K/V reuse
  kBwdBarrierDqFull = 1,    // + warpgroup: its dQ partial is staged (warpgroup + dQ writer warp)
  kBwdBarrierDqEmpty = 3,   // + warpgroup: the writer has read the staged partial
  kBwdBarrierDqTurn = 5,    // + warpgroup: deterministic mode, direct dQ adds (one warpgroup)
  kBwdBarrierEnd = 7,
};
static_assert(kBwdBarrierEnd + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount <=
              cutlass::arch::NamedBarrier::HardwareMaxNumNamedBarriers);

// Above this many query rows a key tile's loop is long enough that the persistent grid's saved launches
// no longer pay for its static balance: one CTA per key tile measured 1-3 % faster at 16k (H100, bf16/fp16,
// D = 64-256), the persistent grid up to 9 % faster at 512-8k.
inline constexpr int kBwdStrideMaxSeqlenQ = 8192;

// The steps of a key tile (BwdSchedule, bwd_mainloop_sm90.hpp), as the producer publishes them with the tile.
struct BwdSteps {
  int first = 0;                // masked kernels: index of the first step's entry in args.mask.lists
  int begin = 0, per_head = 0;  // unmasked kernels
  int count = 0;
};

// What the MMA warps tell the dQ writer with each staged partial: the query tile it adds into, and
// (deterministic mode) the turn to wait for on that tile's counter.
struct DqTarget {
  int query_tile, turn;
};

// Long_: the config's tile for long query sequences (kLongBlockM), where it has one.
template <int HeadDim_, DType Dt, bool Causal_, MaskKind Mask_ = MaskKind::kNone, bool Long_ = false>
struct BwdTraits {
  using Element = typename ElementOf<Dt>::type;
  using Config = BwdTileConfig<HeadDim_, Mask_ != MaskKind::kNone, Causal_>;
  static constexpr int kHeadDim = HeadDim_;
  static constexpr int kBlockM = Long_ ? Config::kLongBlockM : Config::kBlockM;
  static_assert(kBlockM > 0, "no long-sequence tile in this config");
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStagesQ = Config::kStagesQ;
  static constexpr int kStagesDO = Config::kStagesDO;
  static constexpr int kStagesDS = 2;  // dS (and P) double-buffered: one barrier per step suffices
  static constexpr bool kSplitKeys = Config::kSplitKeys;
  static constexpr bool kCausal = Causal_;
  static constexpr MaskKind kMask = Mask_;
  static_assert(!(kCausal && kMask != MaskKind::kNone), "masked kernels take causal at run time (BwdKernelArgs)");
  using MaskArgsT = typename BwdMaskArgsFor<Mask_>::type;
  static constexpr bool kStagedDq = Config::kStagedDq;
  static_assert(kHeadDim % 64 == 0, "head dim must fill whole swizzle rows of either width");
  static_assert(kSplitKeys ? kBlockN == 128 : kBlockN == 64, "one or two 64-key warpgroup slices");
  static_assert((kSplitKeys ? kBlockM % 16 : kBlockM % 64) == 0 && kBlockN % 64 == 0);

  static constexpr int kMmaWarpgroups = 2;
  static constexpr int kMmaThreads = 128 * kMmaWarpgroups;
  static constexpr int kThreads = 128 + kMmaThreads;  // warpgroup 0: loads and dQ writes
  // setmaxnreg moves registers between the warpgroups: what the MMA warpgroups gain must not exceed
  // what the producer warpgroup gives back from the launch allocation (else setmaxnreg.inc waits forever).
  static constexpr int kProducerRegs = 24;
  static constexpr int kMmaRegs = 240;
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static_assert((kLaunchRegs - kProducerRegs) * 128 >= (kMmaRegs - kLaunchRegs) * kMmaThreads,
                "register reconfiguration would deadlock");

  using TileM = Int<kBlockM>;
  using TileN = Int<kBlockN>;
  using TileD = Int<kHeadDim>;

  // S^T = K.Q^T and dP^T = V.dO^T: (M, N, K) = (keys, queries, head dim).
  using AtomShapeSdP = std::conditional_t<kSplitKeys, Shape<TileN, TileM, TileD>, Shape<TileN, Int<kBlockM / 2>, TileD>>;
  using AtomLayoutSdP = std::conditional_t<kSplitKeys, Layout<Shape<_2, _1, _1>>, Layout<Shape<_1, _2, _1>>>;
  using TiledMmaSdP = decltype(make_tiled_mma(bwd_ss_op<Element, AtomShapeSdP, GMMA::Major::K, GMMA::Major::K>(),
                                              AtomLayoutSdP{}));
  // dV += P^T.dO and dK += dS^T.Q: (keys, head dim, queries). kSplitKeys: P^T / dS^T from registers;
  // otherwise from shared memory (keys contiguous, i.e. MN-major), each warpgroup half the head dim.
  using AtomShapeDKV = std::conditional_t<kSplitKeys, Shape<TileN, TileD, TileM>, Shape<TileN, Int<kHeadDim / 2>, TileM>>;
  using AtomLayoutDKV = std::conditional_t<kSplitKeys, Layout<Shape<_2, _1, _1>>, Layout<Shape<_1, _2, _1>>>;
  using MmaOpDKV = std::conditional_t<
      kSplitKeys,
      decltype(GMMA::rs_op_selector<Element, Element, float, AtomShapeDKV, GMMA::Major::K, GMMA::Major::MN>()),
      decltype(GMMA::ss_op_selector<Element, Element, float, AtomShapeDKV, GMMA::Major::MN, GMMA::Major::MN>())>;
  using TiledMmaDKV = decltype(make_tiled_mma(MmaOpDKV{}, AtomLayoutDKV{}));
  // dQ = dS.K: (queries, head dim, keys). A 128-row query tile is split by rows, a 64-row one by head dim.
  // A tile of other height (no multiple of WGMMA's 64 rows) runs transposed, dQ^T = K^T.dS^T (head dim,
  // queries, keys), the warpgroups splitting the head dim. DqShape: the dQ fragment's (M, N).
  static constexpr bool kDqTransposed = kBlockM % 64 != 0;
  static constexpr bool kDqSplitRows = kBlockM == 128;
  using AtomShapeDQ = std::conditional_t<
      kDqTransposed, Shape<TileD, TileM, TileN>,
      std::conditional_t<kDqSplitRows, Shape<TileM, TileD, TileN>, Shape<TileM, Int<kHeadDim / 2>, TileN>>>;
  using AtomLayoutDQ = std::conditional_t<kDqTransposed || kDqSplitRows, Layout<Shape<_2, _1, _1>>, Layout<Shape<_1, _2, _1>>>;
  using MmaOpDQ = std::conditional_t<
      kDqTransposed, decltype(bwd_ss_op<Element, AtomShapeDQ, GMMA::Major::MN, GMMA::Major::K>()),
      decltype(GMMA::ss_op_selector<Element, Element, float, AtomShapeDQ, GMMA::Major::K, GMMA::Major::MN>())>;
  using TiledMmaDQ = decltype(make_tiled_mma(MmaOpDQ{}, AtomLayoutDQ{}));
  using DqShape = std::conditional_t<kDqTransposed, Shape<TileD, TileM>, Shape<TileM, TileD>>;

  // Every 16-bit tile keeps one dimension contiguous in swizzled rows: Q, dO, K, V (and dK, dV, dQ
  // staging) the head dim; P and dS (queries, keys) the keys, in 128-byte rows. The head-dim tiles take
  // 64-byte rows where a warpgroup's half of the head dim is no multiple of 64 elements (D = 192: 96), so
  // that the second warpgroup's operands start on a whole swizzle atom.
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  static constexpr bool kHalfHeadDimInAtoms = kSplitKeys || (kHeadDim / 2) % 64 == 0;
  using SmemAtomD = std::conditional_t<kHalfHeadDimInAtoms, SmemAtom, GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomD{}, Shape<TileM, TileD, Int<kStagesQ>>{}));
  using SmemLayoutDO = decltype(tile_to_shape(SmemAtomD{}, Shape<TileM, TileD, Int<kStagesDO>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomD{}, Shape<TileN, TileD>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutPdS = decltype(tile_to_shape(SmemAtom{}, Shape<TileM, TileN, Int<kStagesDS>>{}));
  using SmemLayoutDQ = decltype(tile_to_shape(SmemAtomD{}, Shape<TileM, TileD>{}));  // postprocess staging
  using SmemLayoutDQt = decltype(composition(SmemLayoutDQ{}, make_ordered_layout(Shape<TileD, TileM>{}, Step<_2, _1>{})));
  // Transposed views (MN-major operands): Q^T and dO^T as (head dim, queries), K^T as (head dim, keys),
  // P^T and dS^T as (keys, queries).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<TileD, TileM, Int<kStagesQ>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutDOt = decltype(composition(
      SmemLayoutDO{}, make_ordered_layout(Shape<TileD, TileM, Int<kStagesDO>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutKt = decltype(composition(SmemLayoutK{}, make_ordered_layout(Shape<TileD, TileN>{}, Step<_2, _1>{})));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_ordered_layout(Shape<TileN, TileM, Int<kStagesDS>>{}, Step<_2, _1, _3>{})));

  // Global views: (seq, head_dim, head, batch) with runtime strides, head dim contiguous.
  using GShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GLayout = Layout<GShape, GStride>;
  using TmaLoadQ = decltype(make_tma_copy(SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GLayout{}),
      take<0, 2>(SmemLayoutQ{}), Shape<TileM, TileD>{}, _1{}));  // Q and dO
  using TmaLoadKV = decltype(make_tma_copy(SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GLayout{}),
      SmemLayoutK{}, Shape<TileN, TileD>{}, _1{}));
  using TmaStoreKV = decltype(make_tma_copy(SM90_TMA_STORE{},
      make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GLayout{}),
      SmemLayoutK{}, Shape<TileN, TileD>{}, _1{}));
  using TmaStoreDQ = decltype(make_tma_copy(SM90_TMA_STORE{},
      make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GLayout{}),
      SmemLayoutDQ{}, Shape<TileM, TileD>{}, _1{}));

  using PipelineQ = cutlass::PipelineTmaAsync<kStagesQ>;
  using PipelineDO = cutlass::PipelineTmaAsync<kStagesDO>;
  // Q and dO advance together, a stage per step: one pipeline state serves both (two registers fewer).
  static_assert(kStagesQ == kStagesDO);
  // A step names its dQ partial's target before its GEMMs, while the writer may read the step before's.
  static_assert(!kStagedDq || kStagesQ >= 2, "staged dQ needs a target slot per step in flight");
  using StepState = typename PipelineQ::PipelineState;

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesRowStats = kBlockM * sizeof(float);  // LSE or D of one query tile
  // The float32 dQ partial of one query tile, in the dQ MMA's fragment order (see dq_fragment_offset).
  static constexpr int kDqFloats = kBlockM * kHeadDim;
  static constexpr int kDqFloatsPerThread = kDqFloats / kMmaThreads;
  static_assert(kDqFloatsPerThread % 4 == 0);

  template <class T, int N>
  using SmemArray = std::conditional_t<(N > 0), cute::array_aligned<T, N, 1024>, cute::array<T, 0>>;
  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;  // dK in the epilogue
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;  // dV in the epilogue
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutDO>, 1024> dout;
    cute::array_aligned<Element, cosize_v<SmemLayoutPdS>, 1024> ds;
    SmemArray<Element, kSplitKeys ? 0 : int(cosize_v<SmemLayoutPdS>)> p;
    SmemArray<float, kStagedDq ? kDqFloats : 0> dq;
    cute::array_aligned<float, kBlockM * kStagesQ, 128> lse;
    cute::array_aligned<float, kBlockM * kStagesDO, 128> dsum;
    typename PipelineQ::SharedStorage pipe_q;
    typename PipelineDO::SharedStorage pipe_do;
    alignas(8) uint64_t barrier_kv;         // K and V of the tile have landed (and `tile` names it)
    alignas(8) uint64_t barrier_kv_free;    // the tile's dK/dV stores have read the K and V buffers
    alignas(8) uint64_t barrier_tile_done;  // every MMA thread is done with the tile's name and steps
    int kv_phase;                           // the barrier_kv phase the MMA warps wait for next
    BwdTile tile;                           // the producer's current tile (BwdTile::end(): no more)
    BwdSteps steps;                         // and its steps
    DqTarget dq_target[kStagesQ];           // kStagedDq: where a step's partial goes, per Q stage (< 0: no more)
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= kSmemCapacityBytes, "tile config exceeds shared memory");
};

// Where the float32 workspaces of one call live (byte offsets into BwdParams::workspace), all
// indexed [batch, query head, padded query row]: rows past Sq up to a whole tile exist and stay inert.
struct BwdWorkspace {
  int64_t lse_offset = 0;      // float: LSE in the kernel's units (+inf for empty and padding rows)
  int64_t dsum_offset = 0;     // float: rowsum(dO * O) (0 for padding rows)
  int64_t dq_offset = 0;       // float: dQ accumulator, kDqFloats per query tile in fragment order
  int64_t sem_offset = 0;      // int32 per query tile: deterministic mode's turn counters
  int64_t counter_offset = 0;  // int32: the persistent grid's tile counter (BwdTileWalk)
  int64_t mask_offset = 0;     // masked kernels: the mask pre-pass workspace (bwd_mask.hpp)
  int64_t total_bytes = 0;

  template <class Traits>
  static BwdWorkspace plan(int64_t batch, int64_t heads_q, int64_t seqlen_q, int64_t mask_bytes) {
    auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
    const int64_t m_blocks = (seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    const int64_t rows = batch * heads_q * m_blocks * Traits::kBlockM;
    BwdWorkspace w;
    w.dsum_offset = w.lse_offset + aligned(rows * int64_t(sizeof(float)));
    w.dq_offset = w.dsum_offset + aligned(rows * int64_t(sizeof(float)));
    w.sem_offset = w.dq_offset + aligned(rows * Traits::kHeadDim * int64_t(sizeof(float)));
    w.counter_offset = w.sem_offset + aligned(batch * heads_q * m_blocks * int64_t(sizeof(int32_t)));
    w.mask_offset = w.counter_offset + aligned(int64_t(sizeof(int32_t)));
    w.total_bytes = w.mask_offset + aligned(mask_bytes);
    return w;
  }
};

// Offset (in floats) of element `i` of MMA thread `tid`'s dQ fragment inside its query tile's partial:
// each warpgroup owns one contiguous half, and four consecutive fragment elements of consecutive
// threads are consecutive float4s, so both the staging writes and the postprocess reads are
// conflict-free 16-byte accesses.
template <class Traits>
CUTE_HOST_DEVICE int dq_fragment_offset(int tid, int i) {
  const int wg = tid / 128, t = tid % 128;
  return wg * (Traits::kDqFloats / 2) + ((i / 4) * 128 + t) * 4 + i % 4;
}

// Everything the main kernel needs, passed by value as a __grid_constant__ parameter.
template <class Traits>
struct BwdKernelArgs {
  typename Traits::TmaLoadQ tma_q;
  typename Traits::TmaLoadQ tma_do;
  typename Traits::TmaLoadKV tma_k;
  typename Traits::TmaLoadKV tma_v;
  typename Traits::TmaStoreKV tma_dk;
  typename Traits::TmaStoreKV tma_dv;
  typename Traits::GShape shape_q;   // (Sq, D, Hq, B)
  typename Traits::GShape shape_kv;  // (Sk, D, Hkv, B)
  const float* lse;   // workspace rows (BwdWorkspace::lse_offset)
  const float* dsum;  // workspace rows (BwdWorkspace::dsum_offset)
  float* dq_accum;
  int32_t* dq_sem;
  int seqlen_q, seqlen_k, heads_q, head_ratio;  // head_ratio = Hq / Hkv
  int num_m_blocks, num_n_blocks;
  // BwdTileWalk (tile_scheduler.hpp): persistent (slots taken from tile_counter), paired key tiles, the slots
  // per (batch, kv head) (num_n_blocks, or pairs of key tiles) and in all, and the divisions of a slot number.
  bool persistent, paired;
  int slots_per_head, slots;
  cutlass::FastDivmod slots_divmod, heads_kv_divmod;
  int32_t* tile_counter;  // the slots taken so far beyond the first gridDim.x (zeroed by the preprocess)
  int key_block_first, key_block_step;  // key tile = first + step * (the tile's place in its kv head)
  float scale;      // softmax scale
  float scale_log2; // scale * log2(e)
  bool deterministic;
  bool causal;      // masked kernels: the causal positions are hidden too (unmasked ones: Traits::kCausal)
  int window_left;  // with causal: keys before query - window_left are hidden too; -1: no window
  // Soft-capping (bool-masked and unmasked kernels): the forward's transform of the raw score (softcap_in = 0:
  // none), and 1 / (cap * log2 e), which turns a probability's log2 back into tanh (see score_gradients).
  float softcap_in, softcap_out, softcap_tanh_per_log2;
  typename Traits::MaskArgsT mask;  // empty for MaskKind::kNone
};

}  // namespace fa2
