// Plain description of one attention backward call. Torch-free and CuTe-free so that api.cpp (host
// compiler) and the kernel headers (nvcc) can both include it.
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

#include "params.h"  // DType, MaskKind, MaskDType

namespace fa2 {

// Largest query-head group a backward step entry can name (head_in_group << 17 | m_block << 1 | partial);
// the op's support rule (api.cpp) refuses larger groups.
constexpr int kMaxHeadRatio = 1 << 14;

struct BwdParams {
  // Device pointers. q/o/dout/dq: [B, Hq, Sq, D]; k/v/dk/dv: [B, Hkv, Sk, D], all through strides.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;  // [B, Hq, Sq], natural log, as the forward writes it
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;

  int batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0;

  // Strides in elements; the last (head-dim) stride is 1 for every tensor.
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  int64_t o_batch_stride = 0, o_head_stride = 0, o_row_stride = 0;
  int64_t do_batch_stride = 0, do_head_stride = 0, do_row_stride = 0;
  int64_t dq_batch_stride = 0, dq_head_stride = 0, dq_row_stride = 0;
  int64_t dk_batch_stride = 0, dk_head_stride = 0, dk_row_stride = 0;
  int64_t dv_batch_stride = 0, dv_head_stride = 0, dv_row_stride = 0;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;  // row stride is 1

  float scale = 1.0f;          // softmax scale applied to Q.K^T (any sign)
  bool causal = false;         // top-left aligned: query i sees keys j <= i (also with a mask: both apply)
  int window_left = -1;        // with causal: query i sees only keys j >= i - window_left; -1: no window
  float softcap = 0.0f;        // > 0: the forward soft-capped the scaled scores (not with an additive mask)
  bool deterministic = false;  // dQ (and dmask) summed in a fixed order: bit-identical run to run
  int num_sms = 0;             // the device's SMs: the main kernel launches one CTA on each (0: one per key tile)

  // Attention mask (masked instantiations only), seen as [B, Hq, Sq, Sk] through its strides (0 on
  // broadcast dims), exactly as FwdParams describes it. The masked instantiations take causal and the
  // window at run time; the unmasked ones have a causal instantiation of their own.
  const void* mask = nullptr;
  MaskDType mask_dtype = MaskDType::kBool;
  int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_row_stride = 0, mask_col_stride = 0;

  // Gradient of an additive mask (optional): float32, zero-filled by the caller, seen as [B, Hq, Sq, Sk]
  // through these strides (0 on the dims the mask is broadcast along: those are summed).
  float* dmask = nullptr;
  int64_t dmask_batch_stride = 0, dmask_head_stride = 0, dmask_row_stride = 0, dmask_col_stride = 0;

  // bwd_workspace_bytes(params) bytes of device memory, 256-byte aligned, contents arbitrary.
  void* workspace = nullptr;
};

// One definition per compiled (head dim, dtype, causal, mask kind), in the generated units (csrc/kernel_table.py).
// Causal is a template argument of the unmasked kernels only.
template <int HeadDim, DType Dt, bool Causal, MaskKind Kind>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream);

// Device workspace run_bwd needs for these params (sizes, flags and mask strides set).
template <int HeadDim, DType Dt, bool Causal, MaskKind Kind>
int64_t bwd_workspace_bytes(const BwdParams& params);

}  // namespace fa2
