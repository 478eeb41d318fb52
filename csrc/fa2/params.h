// Plain description of one attention forward call. Torch-free and CuTe-free so that
// api.cpp (host compiler) and the kernel headers (nvcc) can both include it.
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

namespace fa2 {

enum class DType : int { kBF16 = 0, kFP16 = 1 };

// Attention mask policy of a kernel instantiation (compile time). kNone: no mask tensor (the
// original kernels). kBool: True = attend, read as bytes. kAdditive: added to the scaled scores
// (float32 / bf16 / fp16, chosen at run time by FwdParams::mask_dtype).
enum class MaskKind : int { kNone = 0, kBool = 1, kAdditive = 2 };
// Element type of the user's mask as read by the kernel.
enum class MaskDType : int { kBool = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

struct FwdParams {
  // Device pointers. q/o: [B, Hq, S, D] viewed through strides; k/v: [B, Hkv, Sk, D].
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // [B, Hq, Sq]

  int batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0;

  // Strides in elements; the last (head-dim) stride is 1 for every tensor.
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  int64_t o_batch_stride = 0, o_head_stride = 0, o_row_stride = 0;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;  // row stride is 1

  float scale = 1.0f;  // softmax scale applied to Q.K^T
  bool causal = false; // top-left aligned: query i sees keys j <= i

  // Attention mask (masked instantiations only), seen as [B, Hq, Sq, Sk] through its strides
  // (0 on broadcast dims). mask_workspace: masked_workspace_bytes(params) bytes of device memory,
  // 256-byte aligned, for the pre-pass's block classes, visit lists and (bool masks) bits.
  const void* mask = nullptr;
  MaskDType mask_dtype = MaskDType::kBool;
  int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_row_stride = 0, mask_col_stride = 0;
  void* mask_workspace = nullptr;
};

// One definition per compiled (head dim, dtype, causal) lives in csrc/instantiations/.
template <int HeadDim, DType Dt, bool Causal>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream);

// Masked (non-causal) forward: classification pre-pass, then the main kernel. One definition per
// (head dim, dtype, mask kind) in csrc/instantiations/fwd_hdim{D}_{dtype}_mask{bool,add}.cu.
template <int HeadDim, DType Dt, MaskKind Kind>
cudaError_t run_fwd_masked(const FwdParams& params, cudaStream_t stream);

// Device workspace the masked forward needs for these params (sizes and mask strides set).
template <int HeadDim, DType Dt, MaskKind Kind>
int64_t masked_workspace_bytes(const FwdParams& params);

}  // namespace fa2
