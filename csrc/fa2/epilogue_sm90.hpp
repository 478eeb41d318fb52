// Epilogue: normalise O, stage it through shared memory (stmatrix), store it with TMA (rows past
// seqlen_q are clipped by the tensor map), and write the LSE rows. Each consumer warpgroup stages and
// stores its own 64-row block, behind barriers of its own 128 threads: warpgroups that run staggered
// (ping-pong) never wait for each other. With an O buffer of its own (kOwnOBuffer) a warpgroup waits for
// its previous store lazily (before its next O is staged, and before it exits: consumer_tiles); with O
// staged in its Q block it waits at once, then frees the block for the next tile's Q.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cutlass/arch/barrier.h>

#include "mainloop_sm90.hpp"

namespace fa2 {

using namespace cute;

template <class Traits, class FragO>
CUTE_DEVICE void epilogue_store(const KernelArgs<Traits>& args, typename Traits::SharedStorage& smem,
                                FragO& tOrO, const float (&lse)[2], int tid, TileCoord tile) {
  using T = Traits;
  using Element = typename T::Element;
  typename T::TiledMmaPV mma_pv;

  const int wg = tid / 128;
  const bool leader = tid % 128 == 0;  // issues and waits for the warpgroup's store
  Element* o_buffer;
  if constexpr (T::kOwnOBuffer) {
    o_buffer = smem.o.data();
    // The warpgroup's previous store must have read its block before it is written again.
    if (leader) tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(128, kBarrierEpilogue + wg);
  } else {
    // The Q block is the warpgroup's own: only its S GEMMs (complete) read it.
    o_buffer = smem.q.data();
  }
  Tensor sO = make_tensor(make_smem_ptr(o_buffer), typename T::SmemLayoutO{});
  Tensor rO = make_tensor_like<Element>(tOrO);
  convert_pairs(rO, tOrO);
  auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
  auto thr_copy = smem_copy.get_thread_slice(tid);
  Tensor tRrO = thr_copy.retile_S(rO);
  Tensor tRsO = thr_copy.partition_D(sO);
  copy(smem_copy, tRrO, tRsO);  // each thread's rows lie in its warpgroup's block
  cutlass::arch::fence_view_async_shared();  // make st.shared visible to the TMA engine
  cutlass::arch::NamedBarrier::sync(128, kBarrierEpilogue + wg);

  if (leader) {
    const int block = tile.m_block * T::kConsumerWarpgroups + wg;  // 64-row blocks
    if (block * 64 < args.seqlen_q) {
      Tensor sOw = make_tensor(make_smem_ptr(o_buffer + wg * T::kWarpgroupRowsElems),
                               typename T::SmemLayoutWarpgroupRows{});
      Tensor mO = args.tma_o.get_tma_tensor(args.shape_q);
      Tensor gO = local_tile(mO(_, _, tile.head, tile.batch), Shape<_64, typename T::TileD>{}, make_coord(block, _0{}));
      auto thr_tma = args.tma_o.get_slice(_0{});
      copy(args.tma_o, thr_tma.partition_S(sOw), thr_tma.partition_D(gO));
      tma_store_arrive();
    }
    if constexpr (!T::kOwnOBuffer) {
      tma_store_wait<0>();  // O has left the Q block (and shared memory may end with the CTA)
      if constexpr (T::kPersistent) {
        smem.q_free(wg).arrive();
      }
    }
  }

  // LSE: the thread holding column pair 0 of each quad writes its two rows.
  typename T::TiledMmaQK mma_qk;
  Tensor cS = make_identity_tensor(Shape<typename T::TileM, typename T::TileN>{});
  Tensor tScS = mma_qk.get_thread_slice(tid).partition_C(cS);
  Tensor c_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
  if (tid % 4 == 0) {
    float* lse_ptr = args.lse + tile.batch * args.lse_batch_stride + tile.head * args.lse_head_stride;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int row = tile.m_block * T::kBlockM + get<0>(c_rc(r, 0));
      if (row < args.seqlen_q) lse_ptr[row] = lse[r];
    }
  }
}

}  // namespace fa2
