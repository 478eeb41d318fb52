// Plain description of one attention forward call. Torch-free and CuTe-free so that
// api.cpp (host compiler) and the kernel headers (nvcc) can both include it.
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

namespace fa2 {

enum class DType : int { kBF16 = 0, kFP16 = 1 };

// Limits every kernel shares; the binding reports them to Python (fa2_inductor._C.limits()).
constexpr int kMaxHeadDim = 256;
constexpr int kMaxGridDim = 65535;       // batch, heads, query tiles and mask class slices per launch
constexpr int kStrideAlignElements = 8;  // TMA: strides of 16 bytes' multiples (16-bit elements)
constexpr int kMaskBlockM = 128;         // query rows per tile of every masked kernel
constexpr int kDecodeMaxSeqlenQ = 16;    // calls with at most this many query rows run the split-KV decode kernel

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
  int num_sms = 0;  // the device's SMs: persistent forward kernels launch one CTA on each (0: one CTA per tile)

  // Strides in elements; the last (head-dim) stride is 1 for every tensor.
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  int64_t o_batch_stride = 0, o_head_stride = 0, o_row_stride = 0;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;  // row stride is 1

  // When set ([B, Hq, Sq] float32 with lse's strides): only query tiles holding a row whose value here
  // is -inf run (the others exit at once). The ALL_KEYS empty-row pass: unmasked attention for the
  // rows a masked call left empty.
  const float* rows_filter = nullptr;

  float scale = 1.0f;  // softmax scale applied to Q.K^T
  float softcap = 0.0f; // > 0: scaled scores become softcap * tanh(scores / softcap) before masks apply
  const float* sinks = nullptr;  // [Hq] float32 or null: a logit per query head that joins each row's denominator
  bool causal = false; // top-left aligned: query i sees keys j <= i
  int window_left = -1; // with causal: query i also sees no key before i - window_left (-1: no window)

  // Attention mask (masked instantiations only), seen as [B, Hq, Sq, Sk] through its strides
  // (0 on broadcast dims). mask_workspace: masked_workspace_bytes(params) bytes of device memory,
  // 256-byte aligned, for the pre-pass's block classes, visit lists and (bool masks) bits.
  const void* mask = nullptr;
  MaskDType mask_dtype = MaskDType::kBool;
  int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_row_stride = 0, mask_col_stride = 0;
  void* mask_workspace = nullptr;

  // The launch comes right after one of this library's kernels on the stream, so it may overlap that
  // kernel's end (programmatic dependent launch, pdl.hpp). Masked kernels overlap their own pre-pass always.
  bool after_own_kernel = false;
};

// The instantiations are generated at build time from csrc/kernel_table.py.
template <int HeadDim, DType Dt, bool Causal>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream);

// Masked forward (with params.causal, the mask and the causal/window positions both apply): classification
// pre-pass, then the main kernel.
template <int HeadDim, DType Dt, MaskKind Kind>
cudaError_t run_fwd_masked(const FwdParams& params, cudaStream_t stream);

// Device workspace the masked forward needs for these params (sizes and mask strides set).
template <int HeadDim, DType Dt, MaskKind Kind>
int64_t masked_workspace_bytes(const FwdParams& params);

// Split-KV forward for Sq <= kDecodeMaxSeqlenQ (every mask, causal/window, softcap and sinks in one kernel):
// partial rows per key split into workspace (decode_workspace_bytes(params) bytes), then their combination.
template <int HeadDim, DType Dt>
cudaError_t run_decode(const FwdParams& params, void* workspace, cudaStream_t stream);
template <int HeadDim, DType Dt>
int64_t decode_workspace_bytes(const FwdParams& params);

// Rows left empty (LSE = -inf) get the mean of V over all keys, or (source set) that row of source.
struct EmptyRowsParams {
  void* o = nullptr;
  const float* lse = nullptr;
  const void* v = nullptr;
  const void* source = nullptr;  // [B, Hq, Sq, D] like o
  int64_t source_batch_stride = 0, source_head_stride = 0, source_row_stride = 0;
  int batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0;
  int64_t o_batch_stride = 0, o_head_stride = 0, o_row_stride = 0;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  bool after_own_kernel = false;  // as FwdParams::after_own_kernel
};

template <DType Dt>
cudaError_t run_fill_empty_rows(const EmptyRowsParams& params, cudaStream_t stream);

}  // namespace fa2
