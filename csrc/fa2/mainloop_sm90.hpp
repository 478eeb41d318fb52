// Mainloop of the Hopper forward kernel: the type bundle (shared-memory layouts, TMA copies,
// WGMMA tiled MMAs), the producer that streams Q/K/V through TMA and the consumer that runs
// S = Q.K^T (SS-WGMMA) and O += P.V (RS-WGMMA, P straight from registers).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "params.h"
#include "tile_config.h"
#include "mask.hpp"
#include "softmax.hpp"
#include "smem_limit.hpp"
#include "softcap.hpp"
#include "tile_scheduler.hpp"

namespace fa2 {

using namespace cute;

// Named barrier ids (CUTLASS's NamedBarrier adds its reserved offset; 8 are left to us), each per consumer
// warpgroup: the ping-pong turns and the epilogue's (epilogue_sm90.hpp).
enum : int { kBarrierSchedule = 0 /* + consumer warpgroup index */, kBarrierEpilogue = 3 /* + warpgroup */ };

template <DType Dt> struct ElementOf;
template <> struct ElementOf<DType::kBF16> { using type = cutlass::bfloat16_t; };
template <> struct ElementOf<DType::kFP16> { using type = cutlass::half_t; };

// Long_: the config's tile for long query sequences (kLongBlockM), where it has one.
template <int HeadDim_, DType Dt, bool Causal_, MaskKind Mask_ = MaskKind::kNone, bool Long_ = false>
struct KernelTraits {
  using Element = typename ElementOf<Dt>::type;
  using Config = TileConfig<HeadDim_, Causal_>;
  static constexpr int kHeadDim = HeadDim_;
  // Masked kernels keep the mask grid's rows per tile (the binding sizes it by kMaskBlockM).
  static constexpr int kBlockM = Mask_ != MaskKind::kNone ? kMaskBlockM : Long_ ? Config::kLongBlockM : Config::kBlockM;
  static_assert(kBlockM > 0, "no long-sequence tile in this config");
  static constexpr int kBlockN = Mask_ != MaskKind::kNone ? Config::kMaskBlockN : Config::kBlockN;
  static constexpr int kStages = Mask_ != MaskKind::kNone ? Config::kMaskStages : Config::kStages;
  // Unmasked kernels: causal or not by instantiation. Masked ones are instantiated once (Causal_ false); the
  // bool-mask kernel reads causal from KernelArgs at run time (causal_positions): its tiles run heaviest
  // first either way, and position masking only adds to the blocks the mask pre-pass listed.
  static constexpr bool kCausal = Causal_;
  static constexpr MaskKind kMask = Mask_;
  static_assert(!(Causal_ && Mask_ != MaskKind::kNone), "masked kernels take causal at run time");
  using MaskArgsT = typename MaskArgsFor<Mask_>::type;
  static constexpr bool kPersistent = Config::kPersistent;  // masked kernels too (0 spills with 40 producer registers)
  // Causal tiles differ in cost: the most expensive (last) query tiles run first. Masked kernels do
  // the same: the masks of real models are mostly causal-like (HF causal, sliding windows).
  using Tiles = QueryTiles<kCausal || kMask != MaskKind::kNone, kPersistent>;
  static_assert(kHeadDim % 32 == 0, "head dim must fill whole 64- or 128-byte swizzle rows");
  static_assert(kBlockM % 64 == 0 && kBlockN % 16 == 0);
  static_assert(kHeadDim <= kMaxHeadDim);

  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;  // one producer warpgroup
  // Ping-pong takes turns between two consumer warpgroups; three issue on their own.
  static constexpr bool kPingPong = Config::kPingPong && kConsumerWarpgroups == 2;
  // setmaxnreg moves registers between warpgroups of the CTA: what the consumers gain must not
  // exceed what the producer gives back from the launch allocation, or setmaxnreg.inc waits forever.
  // The producer keeps 40 in persistent kernels of two consumer warpgroups (their tile loop spilled at
  // 32), 32 elsewhere; the consumers take all it frees, a multiple of 8: 232 with two, 160 with three.
  static constexpr int kProducerRegs = kPersistent && kConsumerWarpgroups == 2 ? 40 : 32;
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static constexpr int kConsumerRegs =
      (kLaunchRegs + (kLaunchRegs - kProducerRegs) * 128 / kConsumerThreads) / 8 * 8;
  static_assert((kLaunchRegs - kProducerRegs) * 128 >= (kConsumerRegs - kLaunchRegs) * kConsumerThreads,
                "register reconfiguration would deadlock");

  using TileM = Int<kBlockM>;
  using TileN = Int<kBlockN>;
  using TileD = Int<kHeadDim>;
  using TileShapeQK = Shape<TileM, TileN, TileD>;  // (M, N, K) of S = Q.K^T
  using TileShapePV = Shape<TileM, TileD, TileN>;  // (M, N, K) of O = P.V
  using AtomLayout = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;

  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileShapeQK>(), AtomLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileShapePV, GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));

  // All tiles keep the head dim contiguous in swizzled rows: 128-byte ones where the head dim is a multiple
  // of 64 elements, else 64-byte ones (D = 96: three per row).
  using SmemAtom = std::conditional_t<kHeadDim % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                                      GMMA::Layout_K_SW64_Atom<Element>>;
  // Q (and O) hold one 64-row block per consumer warpgroup: each warpgroup's Q is loaded, read and
  // overwritten by its O on barriers of its own, so warpgroups that run staggered (ping-pong) never wait
  // for each other between tiles.
  using SmemLayoutWarpgroupRows = decltype(tile_to_shape(SmemAtom{}, Shape<_64, TileD>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutWarpgroupRows{}, Shape<TileM, TileD>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<TileN, TileD, Int<kStages>>{}));
  using SmemLayoutV = SmemLayoutK;
  // V seen as the (D, N) B operand of P.V: head dim is the MN-major (contiguous) mode.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<TileD, TileN, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutO = SmemLayoutQ;
  static constexpr int kWarpgroupRowsElems = cosize_v<SmemLayoutWarpgroupRows>;

  // Global views: (seq, head_dim, head, batch) with runtime strides, head dim contiguous.
  using GShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GLayout = Layout<GShape, GStride>;

  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GLayout{}),
      SmemLayoutWarpgroupRows{}, Shape<_64, TileD>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GLayout{}),
      take<0, 2>(SmemLayoutK{}), Shape<TileN, TileD>{}, _1{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{},
      make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GLayout{}),
      SmemLayoutWarpgroupRows{}, Shape<_64, TileD>{}, _1{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  static constexpr uint32_t kBytesQWarpgroup = 64 * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);

  struct NoBuffer {};
  template <bool kWithO>
  struct SharedStorageOf {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;  // also O in the epilogue unless kWithO
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    std::conditional_t<kWithO, cute::array_aligned<Element, cosize_v<SmemLayoutO>, 1024>, NoBuffer> o;
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;
    // Per consumer warpgroup: its Q block loaded; its Q block free again (its last S GEMM has read it, or,
    // with O staged there, its store has read O). Raw words, used through q_loaded and q_free.
    alignas(8) cutlass::arch::ClusterTransactionBarrier::ValueType barrier_q[kConsumerWarpgroups];
    alignas(8) cutlass::arch::ClusterBarrier::ValueType barrier_q_free[kConsumerWarpgroups];

    CUTE_DEVICE cutlass::arch::ClusterTransactionBarrier& q_loaded(int w) {
      return *reinterpret_cast<cutlass::arch::ClusterTransactionBarrier*>(&barrier_q[w]);
    }
    CUTE_DEVICE cutlass::arch::ClusterBarrier& q_free(int w) {
      return *reinterpret_cast<cutlass::arch::ClusterBarrier*>(&barrier_q_free[w]);
    }
  };
  // A persistent kernel stages O in a buffer of its own where shared memory has room, so that the next
  // tile's Q loads while O is stored; elsewhere a warpgroup stages O in its own Q block, and its next Q
  // waits until that store has read the block.
  static constexpr bool kOwnOBuffer = kPersistent && sizeof(SharedStorageOf<true>) <= kSmemCapacityBytes;
  // With O in the Q block, every tile that runs loads Q, keys or not: its epilogue writes the block, so the
  // block must cycle through the same load and release as every other tile's.
  static constexpr bool kQEveryTile = kPersistent && !kOwnOBuffer;
  using SharedStorage = SharedStorageOf<kOwnOBuffer>;
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= kSmemCapacityBytes, "tile config exceeds shared memory");
};

// Everything the kernel needs, passed by value as a __grid_constant__ parameter.
template <class Traits>
struct KernelArgs {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
  typename Traits::TmaO tma_o;
  typename Traits::GShape shape_q;   // (Sq, D, Hq, B)
  typename Traits::GShape shape_kv;  // (Sk, D, Hkv, B)
  float* lse;
  int64_t lse_batch_stride, lse_head_stride;
  const float* rows_filter;  // FwdParams::rows_filter (lse's strides), or null
  int seqlen_q, seqlen_k, head_ratio;  // head_ratio = Hq / Hkv
  bool causal;                         // bool-mask kernels: causal positions apply (else Traits::kCausal)
  int window_left;                     // causal calls: keys before i - window_left hidden (-1: none)
  float scale;
  float softcap_in, softcap_out;  // softcap.hpp's factors (softcap_in = 0: none)
  const float* sinks;               // FwdParams::sinks
  typename Traits::MaskArgsT mask;  // empty for MaskKind::kNone
};

// The key blocks one CTA visits, highest first, as entries block * 2 + partial. Unmasked: every
// block position masking leaves visible (causal: up to the diagonal, from the window's start), none
// partial (tails, the diagonal and the window's edge are found from the block index). Masked: the
// pre-pass's list, which leaves out the fully masked blocks, cut to the same position range (the list
// is sorted by block, highest first; the pre-pass's `above` counts say where to cut); producer and
// consumers walk it alike.
template <class Traits>
struct KeyBlocks {
  const int32_t* entries = nullptr;  // masked kernels only
  int first = 0;  // kNone: the highest block; masked: the index of the first list entry visited
  int count = 0;

  CUTE_DEVICE int entry(int i) const {
    if constexpr (Traits::kMask == MaskKind::kNone) {
      return (first - i) * 2;
    } else {
      return entries[first + i];
    }
  }
  CUTE_DEVICE static int block(int entry) { return entry >> 1; }
  CUTE_DEVICE static bool partial(int entry) { return entry & 1; }
};

// Whether causal (and window) positions apply: a run-time value of bool-mask kernels, a constant of the others
// (unmasked: their instantiation; additive: false, causal is not offered with an additive mask).
template <class Traits>
CUTE_DEVICE bool causal_positions(const KernelArgs<Traits>& args) {
  if constexpr (Traits::kMask == MaskKind::kBool) {
    return args.causal;
  } else {
    return Traits::kCausal;
  }
}

template <class Traits>
CUTE_DEVICE KeyBlocks<Traits> key_blocks(const KernelArgs<Traits>& args, TileCoord tile) {
  using T = Traits;
  KeyBlocks<T> blocks;
  int first_block, last_block;
  visible_key_block_range<T::kBlockM, T::kBlockN>(causal_positions(args), tile.m_block * T::kBlockM, args.seqlen_k,
                                                  args.window_left, first_block, last_block);
  if constexpr (T::kMask == MaskKind::kNone) {
    blocks.first = last_block;
    blocks.count = max(0, last_block - first_block + 1);
  } else {
    const MaskArgs& mk = args.mask;
    const int64_t row =
        mk.class_slice(tile.batch, tile.head) * mk.class_m_blocks + (mk.row_broadcast ? 0 : tile.m_block);
    const int32_t* list = mk.visit + row * (mk.num_n_blocks + 1);
    blocks.entries = list + 1;
    const int size = list[0];
    if (causal_positions(args)) {
      if (first_block <= last_block) {  // both inside [0, num_n_blocks)
        const int32_t* above = mk.above + row * mk.num_n_blocks;
        blocks.first = above[last_block];
        blocks.count = (first_block > 0 ? above[first_block - 1] : size) - blocks.first;
      }
    } else {
      blocks.count = size;
    }
  }
  return blocks;
}

// Bool-mask kernels: the bits of a partial block for this thread's rows (a no-op otherwise).
template <class Traits, class MaskBits, class TensorC>
CUTE_DEVICE void load_mask_bits(const KernelArgs<Traits>& args, MaskBits& bits, const TensorC& c_rc, int entry,
                                int m0, int head, int batch) {
  using T = Traits;
  if constexpr (T::kMask == MaskKind::kBool) {
    if (KeyBlocks<T>::partial(entry)) {
      const MaskArgs& mk = args.mask;
      const int64_t row_words = int64_t(mk.num_n_blocks) * (T::kBlockN / 32);
      const uint32_t* tile_bits = mk.bits + mk.class_slice(batch, head) * mk.bit_rows * row_words +
                                  KeyBlocks<T>::block(entry) * (T::kBlockN / 32);
      bits.load(tile_bits, mk.row_broadcast ? 0 : row_words, c_rc, m0);
    }
  }
}

// Soft-caps (when asked) and masks the S tile of key block `entry` in place. kAdditive first scales S (the softmax then works
// on scaled scores); masked kernels apply the user's mask to the blocks the pre-pass found partial
// (bool: the bits load_mask_bits fetched); position masking (tail, causal, window) comes on top.
template <class Traits, class TensorS, class TensorC, class MaskBits>
CUTE_DEVICE void mask_scores(const KernelArgs<Traits>& args, TensorS& s_rc, const TensorC& c_rc, int entry,
                             const MaskBits& bits, int m0, int head, int batch) {
  using T = Traits;
  using Blocks = KeyBlocks<T>;
  const int n = Blocks::block(entry);
  if (args.softcap_in != 0.f) {
    CUTE_UNROLL
    for (int i = 0; i < size(s_rc); ++i) s_rc(i) = soft_capped(s_rc(i), args.softcap_in, args.softcap_out);
  }
  if constexpr (T::kMask == MaskKind::kAdditive) {
    CUTE_UNROLL
    for (int i = 0; i < size(s_rc); ++i) s_rc(i) *= args.scale;
    if (Blocks::partial(entry)) {
      apply_additive_mask(s_rc, c_rc, args.mask, batch, head, m0, n * T::kBlockN, args.seqlen_q, args.seqlen_k);
    }
  } else if constexpr (T::kMask == MaskKind::kBool) {
    if (Blocks::partial(entry)) bits.apply(s_rc, c_rc);
  }
  const bool causal = causal_positions(args);
  if (block_needs_mask<T::kBlockM, T::kBlockN>(causal, n, m0, args.seqlen_k, args.window_left)) {
    // One loop per case, each with its bounds folded (a run-time `causal` inside the loop spilled at D=256).
    if (causal) {
      apply_mask(true, s_rc, c_rc, m0, n * T::kBlockN, args.seqlen_k, args.window_left);
    } else {
      apply_mask(false, s_rc, c_rc, m0, n * T::kBlockN, args.seqlen_k, args.window_left);
    }
  }
}

// Producer: one thread issues every TMA copy of a tile; K and V of a block go to the same stage of
// two pipelines so that S = Q.K^T can start while V is still in flight. Q comes in one 64-row block per
// consumer warpgroup, each on its own barriers. `q_loads`: the tiles whose Q this CTA loaded before (a
// warpgroup's Q block is free once its barrier_q_free says so). A tile without key blocks loads Q alone
// (kQEveryTile kernels; the others skip such tiles).
template <class Traits>
CUTE_DEVICE void producer_load(const KernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                               typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                               typename Traits::PipelineState& write, int q_loads, TileCoord tile,
                               const KeyBlocks<Traits>& blocks) {
  using T = Traits;
  const int head = tile.head, batch = tile.batch;
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename T::SmemLayoutV{});

  const int head_kv = head / args.head_ratio;  // GQA/MQA: map the head, never copy K/V
  Tensor mQ = args.tma_q.get_tma_tensor(args.shape_q);
  Tensor mK = args.tma_k.get_tma_tensor(args.shape_kv);
  Tensor mV = args.tma_v.get_tma_tensor(args.shape_kv);
  Tensor gQ = local_tile(mQ(_, _, head, batch), Shape<_64, typename T::TileD>{}, make_coord(_, _0{}));  // (64, D, blocks)
  Tensor gK = local_tile(mK(_, _, head_kv, batch), Shape<typename T::TileN, typename T::TileD>{},
                         make_coord(_, _0{}));  // (N, D, n_blocks)
  Tensor gV = local_tile(mV(_, _, head_kv, batch), Shape<typename T::TileN, typename T::TileD>{},
                         make_coord(_, _0{}));

  auto [tKgK, tKsK] = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                    group_modes<0, 2>(gK));
  auto [tVgV, tVsV] = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                    group_modes<0, 2>(gV));
  auto load_q = [&](int w) {
    Tensor sQw = make_tensor(make_smem_ptr(smem.q.data() + w * T::kWarpgroupRowsElems),
                             typename T::SmemLayoutWarpgroupRows{});
    auto [tQgQ, tQsQ] = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQw), group_modes<0, 2>(gQ));
    auto& bar_q = smem.q_loaded(w);
    auto& bar_q_free = smem.q_free(w);
    if (q_loads > 0) bar_q_free.wait((q_loads - 1) % 2);
    bar_q.arrive_and_expect_tx(T::kBytesQWarpgroup);
    copy(args.tma_q.with(smem.barrier_q[w], 0), tQgQ(_, tile.m_block * T::kConsumerWarpgroups + w), tQsQ);
  };
  // The other warpgroups' Q blocks: a warpgroup that stages O in its Q block frees it only after its store,
  // which the first warpgroup should not wait behind; they are issued once the first stages' K and V are
  // (before any stage that those warpgroups must release first: no deadlock).
  auto load_other_q = [&]() {
#pragma unroll 1
    for (int w = 1; w < T::kConsumerWarpgroups; ++w) load_q(w);
  };
  if (blocks.count == 0) {
    load_q(0);
    load_other_q();
    return;
  }

  // K of the first block, then Q, then V: the first S GEMM needs only Q and K.
  using Blocks = KeyBlocks<T>;
  int n = Blocks::block(blocks.entry(0));
  pipe_k.producer_acquire(write);
  copy(args.tma_k.with(*pipe_k.producer_get_barrier(write), 0), tKgK(_, n), tKsK(_, write.index()));
  load_q(0);
  pipe_v.producer_acquire(write);
  copy(args.tma_v.with(*pipe_v.producer_get_barrier(write), 0), tVgV(_, n), tVsV(_, write.index()));
  ++write;
  for (int i = 1; i < blocks.count; ++i) {
    if (i == T::kStages) load_other_q();
    n = Blocks::block(blocks.entry(i));  // loaded before the wait for a free stage
    pipe_k.producer_acquire(write);
    copy(args.tma_k.with(*pipe_k.producer_get_barrier(write), 0), tKgK(_, n), tKsK(_, write.index()));
    pipe_v.producer_acquire(write);
    copy(args.tma_v.with(*pipe_v.producer_get_barrier(write), 0), tVgV(_, n), tVsV(_, write.index()));
    ++write;
  }
  if (blocks.count <= T::kStages) load_other_q();
}

// One warpgroup-wide GEMM: issue, commit, optionally wait until at most kWait groups remain.
template <bool kZeroInit, int kWait, bool kRegA, class TiledMma, class TA, class TB, class TC>
CUTE_DEVICE void wg_gemm(TiledMma& mma, TA& tA, TB const& tB, TC& tC) {
  if constexpr (kRegA) warpgroup_fence_operand(tA);
  warpgroup_fence_operand(tC);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tA); ++k) {
    cute::gemm(mma, tA(_, _, k), tB(_, _, k), tC);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(tC);
  if constexpr (kRegA) warpgroup_fence_operand(tA);
}

// fp32 -> 16-bit, two at a time (packed cvt).
template <class TensorD, class TensorS>
CUTE_DEVICE void convert_pairs(TensorD& d, TensorS const& s) {
  using To = typename TensorD::value_type;
  static_assert(decltype(size(s))::value % 2 == 0);
  cutlass::NumericArrayConverter<To, float, 2, cutlass::FloatRoundStyle::round_to_nearest> conv;
  CUTE_UNROLL
  for (int i = 0; i < size(s); i += 2) {
    cutlass::Array<float, 2> in;
    in[0] = s(i);
    in[1] = s(i + 1);
    cutlass::Array<To, 2> out = conv(in);
    d(i) = out[0];
    d(i + 1) = out[1];
  }
}

// Consumer: the full key loop of one tile for this thread's rows. Software-pipelined inside the
// warpgroup: S for block j+1 is issued before P.V of block j, so the softmax of j+1 overlaps the P.V
// GEMM. `read` carries the K/V pipelines' position from tile to tile; `q_loads` counts the tiles whose
// Q this CTA loaded before. On return tOrO holds the unnormalised O and `softmax` its running statistics.
//
// Ping-pong turn taking: warpgroup w waits on barrier w before issuing its GEMMs and then opens the
// other's; the turns alternate across tiles (consumer_tiles opens the first and closes the last).
template <class Traits, class FragO, class Softmax>
CUTE_DEVICE void consumer_mainloop(const KernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                                   typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                                   typename Traits::PipelineState& read, int q_loads, FragO& tOrO,
                                   Softmax& softmax, int tid, TileCoord tile, const KeyBlocks<Traits>& blocks) {
  using T = Traits;
  const int head = tile.head, batch = tile.batch;
  using Element = typename T::Element;
  typename T::TiledMmaQK mma_qk;
  typename T::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename T::SmemLayoutVt{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // smem descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stages)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, D, N, stages)

  Tensor tSrS = partition_fragment_C(mma_qk, Shape<typename T::TileM, typename T::TileN>{});
  Tensor rP = make_tensor_like<Element>(tSrS);
  Tensor tOrP = make_tensor(rP.data(), acc_to_a_operand_layout(rP.layout()));
  Tensor cS = make_identity_tensor(Shape<typename T::TileM, typename T::TileN>{});
  Tensor tScS = thr_qk.partition_C(cS);
  Tensor s_rc = as_rowcol(tSrS);
  Tensor c_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
  Tensor o_rc = as_rowcol(tOrO);
  constexpr int kRows = decltype(size<0>(s_rc))::value;
  float correction[kRows];

  const int m0 = tile.m_block * T::kBlockM;

  const int wg = tid / 128;
  auto& bar_q = smem.q_loaded(wg);
  auto& bar_q_free = smem.q_free(wg);
  // The warpgroup's last S GEMM has read its Q block: with O staged elsewhere, the producer may load the
  // next tile's (with O staged in the block, the epilogue frees it once O is stored).
  constexpr bool kFreeQAfterLastS = T::kOwnOBuffer;

  // First (highest) key block: always masked when needed, no rescale.
  constexpr bool kScaled = T::kMask == MaskKind::kAdditive;  // softmax on pre-scaled scores
  int entry = blocks.entry(0);
  // Bool masks read their list one entry ahead: the bits load depends on it and should start before
  // the S GEMM. (Additive kernels, at the register limit already, would spill the extra entry.)
  constexpr bool kEntryAhead = T::kMask == MaskKind::kBool;
  int entry_next = kEntryAhead && blocks.count > 1 ? blocks.entry(1) : 0;
  // Only bool-mask kernels carry bits (whose rows take whole 64-key words).
  std::conditional_t<T::kMask == MaskKind::kBool, MaskBitsFragment<T::kBlockN, kRows>, NoMaskBits> mask_bits;
  load_mask_bits<T>(args, mask_bits, c_rc, entry, m0, head, batch);
  auto turn_wait = [&]() {
    if constexpr (T::kPingPong) cutlass::arch::NamedBarrier::sync(T::kConsumerThreads, kBarrierSchedule + wg);
  };
  auto turn_pass = [&]() {
    if constexpr (T::kPingPong) {
      cutlass::arch::NamedBarrier::arrive(T::kConsumerThreads, kBarrierSchedule + (wg + 1) % T::kConsumerWarpgroups);
    }
  };

  pipe_k.consumer_wait(read);
  bar_q.wait(q_loads % 2);
  turn_wait();
  wg_gemm<true, -1, false>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
  turn_pass();
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
  if (kFreeQAfterLastS && blocks.count == 1) bar_q_free.arrive();
  pipe_k.consumer_release(read);
  mask_scores<T>(args, s_rc, c_rc, entry, mask_bits, m0, head, batch);
  softmax.template update<true, kScaled>(s_rc, correction);
  convert_pairs(rP, tSrS);

  typename T::PipelineState read_v = read;
  ++read;
  for (int i = 1; i < blocks.count; ++i) {
    entry = kEntryAhead ? entry_next : blocks.entry(i);
    if (kEntryAhead && i + 1 < blocks.count) entry_next = blocks.entry(i + 1);
    load_mask_bits<T>(args, mask_bits, c_rc, entry, m0, head, batch);  // used after the S GEMM
    pipe_k.consumer_wait(read);
    turn_wait();
    wg_gemm<true, -1, false>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
    pipe_v.consumer_wait(read_v);
    wg_gemm<false, -1, true>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
    turn_pass();
    warpgroup_wait<1>();  // S of block n is ready; P.V of the previous block may still run
    warpgroup_fence_operand(tSrS);
    if (kFreeQAfterLastS && i + 1 == blocks.count) bar_q_free.arrive();
    pipe_k.consumer_release(read);
    mask_scores<T>(args, s_rc, c_rc, entry, mask_bits, m0, head, batch);
    softmax.template update<false, kScaled>(s_rc, correction);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    pipe_v.consumer_release(read_v);
    softmax.rescale(o_rc, correction);
    convert_pairs(rP, tSrS);
    read_v = read;
    ++read;
  }
  pipe_v.consumer_wait(read_v);
  wg_gemm<false, 0, true>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
  pipe_v.consumer_release(read_v);
}

}  // namespace fa2
