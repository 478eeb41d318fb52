// Plain description of one attention forward call. Torch-free and CuTe-free so that
// api.cpp (host compiler) and the kernel headers (nvcc) can both include it.
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

namespace fa2 {

enum class DType : int { kBF16 = 0, kFP16 = 1 };

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
};

// One definition per compiled (head dim, dtype, causal) lives in csrc/instantiations/.
template <int HeadDim, DType Dt, bool Causal>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream);

}  // namespace fa2
