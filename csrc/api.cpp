// Python binding of the Hopper forward kernel: fa2_inductor._C.
// The only file that includes torch. Python owns the op schema; this module registers none.
// fwd() checks its arguments, fills fa2::FwdParams and launches on the current stream: no
// allocation, no synchronisation, so it can run inside CUDA graph capture (fwd_masked allocates its
// workspace from the stream-ordered caching allocator, which capture allows).
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fa2/params.h"

namespace {

constexpr int64_t kMaxSeqLen = (int64_t(1) << 31) - 1;  // sequence positions are int32 in the kernels

using RunFn = cudaError_t (*)(const fa2::FwdParams&, cudaStream_t);
using WorkspaceFn = int64_t (*)(const fa2::FwdParams&);

struct KernelEntry {
  int head_dim;
  fa2::DType dtype;
  const char* dtype_name;
  RunFn run[2];                    // [causal]
  RunFn run_masked[2][2];          // [0: bool mask, 1: additive mask][causal]; null: not compiled
  WorkspaceFn masked_workspace[2]; // device bytes the masked forward needs, [bool, additive]
};

// One entry per compiled (head dim, dtype); the rows come from csrc/kernel_table.py.
#define FA2_ENTRY(D, DT, NAME)                                                                               \
  KernelEntry{D, fa2::DType::DT, NAME,                                                                       \
              {&fa2::run_fwd<D, fa2::DType::DT, false>, &fa2::run_fwd<D, fa2::DType::DT, true>},            \
              {{&fa2::run_fwd_masked<D, fa2::DType::DT, fa2::MaskKind::kBool, false>,                        \
                &fa2::run_fwd_masked<D, fa2::DType::DT, fa2::MaskKind::kBool, true>},                        \
               {&fa2::run_fwd_masked<D, fa2::DType::DT, fa2::MaskKind::kAdditive, false>, nullptr}},          \
              {&fa2::masked_workspace_bytes<D, fa2::DType::DT, fa2::MaskKind::kBool>,                        \
               &fa2::masked_workspace_bytes<D, fa2::DType::DT, fa2::MaskKind::kAdditive>}},

const std::vector<KernelEntry>& kernel_table() {
  static const std::vector<KernelEntry> table = {
#include "generated/kernel_table.inc"
  };
  return table;
}
#undef FA2_ENTRY  // the table's file also holds the backward's rows, behind FA2_BWD_ENTRY

const KernelEntry* find_kernel(int head_dim, fa2::DType dtype) {
  for (const auto& e : kernel_table()) {
    if (e.head_dim == head_dim && e.dtype == dtype) return &e;
  }
  return nullptr;
}

void check_operand(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.is_cuda(), "fa2_inductor._C.fwd: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == q.device(), "fa2_inductor._C.fwd: ", name, " is on another device than q");
  TORCH_CHECK(t.dim() == 4, "fa2_inductor._C.fwd: ", name, " must be 4-D");
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) == 1, "fa2_inductor._C.fwd: ", name, " must have a contiguous last dim");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "fa2_inductor._C.fwd: ", name, " must be 16-byte aligned");
}

// TMA needs strides that are multiples of 16 bytes (8 elements); a dimension of size 1 is never
// stepped over, so any valid stride will do for it.
int64_t tma_stride(const at::Tensor& t, int dim, const char* name) {
  if (t.size(dim) <= 1) return 8;
  const int64_t s = t.stride(dim);
  TORCH_CHECK(s > 0 && s % fa2::kStrideAlignElements == 0, "fa2_inductor._C.fwd: ", name, " stride ", s, " of dim ",
              dim, " must be a positive multiple of ", fa2::kStrideAlignElements, " elements (16 bytes)");
  return s;
}

// Checks q/k/v/out/lse as both entry points take them and describes them in FwdParams (no mask).
fa2::FwdParams describe_call(const char* fn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& out, const at::Tensor& lse, double scale) {
  check_operand(q, "q", q);
  check_operand(k, "k", q);
  check_operand(v, "v", q);
  check_operand(out, "out", q);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              fn, ": q, k, v, out must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, fn,
              ": dtype must be bfloat16 or float16, got ", q.scalar_type());
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Sk = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == Sk &&
                  k.size(3) == D && v.size(3) == D,
              fn, ": k/v shapes do not match q");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, fn, ": Hq must be a multiple of Hkv");
  TORCH_CHECK(out.sizes() == q.sizes(), fn, ": out must have q's shape");
  TORCH_CHECK(lse.is_cuda() && lse.device() == q.device() && lse.scalar_type() == at::kFloat &&
                  lse.dim() == 3 && lse.size(0) == B && lse.size(1) == Hq && lse.size(2) == Sq &&
                  (lse.stride(2) == 1 || Sq <= 1),
              fn, ": lse must be float32 [B, Hq, Sq] with unit row stride");
  TORCH_CHECK(B <= fa2::kMaxGridDim && Hq <= fa2::kMaxGridDim, fn, ": batch and heads must be <= ", fa2::kMaxGridDim);
  TORCH_CHECK(Sq <= kMaxSeqLen && Sk <= kMaxSeqLen, fn, ": sequence too long");

  fa2::FwdParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.batch = int(B);
  p.heads_q = int(Hq);
  p.heads_kv = int(Hkv);
  p.seqlen_q = int(Sq);
  p.seqlen_k = int(Sk);
  p.head_dim = int(D);
  p.q_batch_stride = tma_stride(q, 0, "q");
  p.q_head_stride = tma_stride(q, 1, "q");
  p.q_row_stride = tma_stride(q, 2, "q");
  p.k_batch_stride = tma_stride(k, 0, "k");
  p.k_head_stride = tma_stride(k, 1, "k");
  p.k_row_stride = tma_stride(k, 2, "k");
  p.v_batch_stride = tma_stride(v, 0, "v");
  p.v_head_stride = tma_stride(v, 1, "v");
  p.v_row_stride = tma_stride(v, 2, "v");
  p.o_batch_stride = tma_stride(out, 0, "out");
  p.o_head_stride = tma_stride(out, 1, "out");
  p.o_row_stride = tma_stride(out, 2, "out");
  p.lse_batch_stride = lse.stride(0);
  p.lse_head_stride = lse.stride(1);
  p.scale = float(scale);
  return p;
}

const KernelEntry& kernel_for(const char* fn, const at::Tensor& q) {
  const fa2::DType dtype = q.scalar_type() == at::kBFloat16 ? fa2::DType::kBF16 : fa2::DType::kFP16;
  const KernelEntry* entry = find_kernel(int(q.size(3)), dtype);
  TORCH_CHECK(entry != nullptr, fn, ": no kernel compiled for head dim ", q.size(3), " and dtype ", q.scalar_type());
  return *entry;
}

// window_left: -1 (none) or, with is_causal, the number of keys before the diagonal a query still sees.
int check_window(const char* fn, bool is_causal, int64_t window_left) {
  TORCH_CHECK(window_left == -1 || (is_causal && window_left >= 0 && window_left <= kMaxSeqLen), fn,
              ": window_left must be -1, or a non-negative key count together with is_causal, got ", window_left);
  return int(window_left);
}

void check_launch(const char* fn, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, fn, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

// rows_filter (optional, float32 with lse's shape and strides): only query tiles holding a row that is
// -inf there run; the others leave out and lse untouched.
void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
         double scale, bool is_causal, int64_t window_left, const std::optional<at::Tensor>& rows_filter) {
  constexpr const char* fn = "fa2_inductor._C.fwd";
  fa2::FwdParams p = describe_call(fn, q, k, v, out, lse, scale);
  p.causal = is_causal;
  p.window_left = check_window(fn, is_causal, window_left);
  if (rows_filter.has_value()) {
    const at::Tensor& f = *rows_filter;
    TORCH_CHECK(f.device() == lse.device() && f.scalar_type() == at::kFloat && f.sizes() == lse.sizes() &&
                    f.strides() == lse.strides(),
                fn, ": rows_filter must be float32 with lse's shape and strides");
    p.rows_filter = f.data_ptr<float>();
  }
  const KernelEntry& entry = kernel_for(fn, q);
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0) return;
  c10::cuda::CUDAGuard guard(q.device());
  check_launch(fn, entry.run[is_causal ? 1 : 0](p, c10::cuda::getCurrentCUDAStream().stream()));
}

// Forward with an attention mask already expanded to [B, Hq, Sq, Sk] (zero strides on broadcast
// dims; any non-negative strides). bool: True = attend; float32/bf16/fp16: additive. With is_causal
// the causal (and window) positions are hidden too. The pre-pass writes into a workspace from the
// caching allocator (stream-ordered, so CUDA-graph safe), then the masked kernel runs.
void fwd_masked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                double scale, const at::Tensor& mask, bool is_causal, int64_t window_left) {
  constexpr const char* fn = "fa2_inductor._C.fwd_masked";
  fa2::FwdParams p = describe_call(fn, q, k, v, out, lse, scale);
  p.causal = is_causal;
  p.window_left = check_window(fn, is_causal, window_left);
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), Sk = k.size(2);
  TORCH_CHECK(Sk > 0, fn, ": needs at least one key");
  TORCH_CHECK(scale > 0, fn, ": scale must be positive");
  TORCH_CHECK(mask.is_cuda() && mask.device() == q.device(), fn, ": mask must be on q's device");
  TORCH_CHECK(mask.dim() == 4 && mask.size(0) == B && mask.size(1) == Hq && mask.size(2) == Sq && mask.size(3) == Sk,
              fn, ": mask must be expanded to [B, Hq, Sq, Sk]");
  for (int d = 0; d < 4; ++d) TORCH_CHECK(mask.stride(d) >= 0, fn, ": mask strides must be non-negative");
  int kind;
  switch (mask.scalar_type()) {
    case at::kBool: p.mask_dtype = fa2::MaskDType::kBool; kind = 0; break;
    case at::kFloat: p.mask_dtype = fa2::MaskDType::kF32; kind = 1; break;
    case at::kBFloat16: p.mask_dtype = fa2::MaskDType::kBF16; kind = 1; break;
    case at::kHalf: p.mask_dtype = fa2::MaskDType::kF16; kind = 1; break;
    default: TORCH_CHECK(false, fn, ": mask dtype must be bool, float32, bfloat16 or float16, got ", mask.scalar_type());
  }
  static_assert(sizeof(bool) == 1, "bool masks are read as bytes");
  const KernelEntry& entry = kernel_for(fn, q);
  const RunFn run = entry.run_masked[kind][is_causal ? 1 : 0];
  TORCH_CHECK(run != nullptr, fn, ": no kernel compiled for ", mask.scalar_type(), " masks with is_causal");
  if (B == 0 || Hq == 0 || Sq == 0) return;

  c10::cuda::CUDAGuard guard(q.device());
  p.mask = mask.data_ptr();
  // Size-1 dims are never stepped over; zero strides make the kernel share one mask slice.
  p.mask_batch_stride = B == 1 ? 0 : mask.stride(0);
  p.mask_head_stride = Hq == 1 ? 0 : mask.stride(1);
  p.mask_row_stride = Sq == 1 ? 0 : mask.stride(2);
  p.mask_col_stride = Sk == 1 ? 0 : mask.stride(3);
  const int64_t class_batches = p.mask_batch_stride == 0 ? 1 : B;
  const int64_t class_heads = p.mask_head_stride == 0 ? 1 : Hq;
  const int64_t class_m_blocks = p.mask_row_stride == 0 ? 1 : (Sq + fa2::kMaskBlockM - 1) / fa2::kMaskBlockM;
  TORCH_CHECK(class_batches * class_heads <= fa2::kMaxGridDim && class_m_blocks <= fa2::kMaxGridDim, fn,
              ": mask too large for the block classification grid");
  at::Tensor workspace = at::empty({entry.masked_workspace[kind](p)}, q.options().dtype(at::kByte));
  p.mask_workspace = workspace.data_ptr();
  check_launch(fn, run(p, c10::cuda::getCurrentCUDAStream().stream()));
}

// Rewrites the rows the forward left empty (lse = -inf) to the mean of V over all keys, or, given
// source ([B, Hq, Sq, D] like out), to source's rows (the op's empty_rows policies).
void fill_empty_rows(at::Tensor& out, const at::Tensor& lse, const at::Tensor& v,
                     const std::optional<at::Tensor>& source) {
  constexpr const char* fn = "fa2_inductor._C.fill_empty_rows";
  check_operand(out, "out", out);
  check_operand(v, "v", out);
  TORCH_CHECK(out.scalar_type() == v.scalar_type() && (v.scalar_type() == at::kBFloat16 || v.scalar_type() == at::kHalf),
              fn, ": out and v must share a dtype, bfloat16 or float16");
  const int64_t B = out.size(0), Hq = out.size(1), Sq = out.size(2), D = out.size(3);
  TORCH_CHECK(v.size(0) == B && v.size(3) == D && v.size(1) > 0 && Hq % v.size(1) == 0, fn, ": v does not match out");
  TORCH_CHECK(D <= fa2::kMaxHeadDim, fn, ": head dim above ", fa2::kMaxHeadDim);
  TORCH_CHECK(lse.is_cuda() && lse.device() == out.device() && lse.scalar_type() == at::kFloat && lse.dim() == 3 &&
                  lse.size(0) == B && lse.size(1) == Hq && lse.size(2) == Sq && (lse.stride(2) == 1 || Sq <= 1),
              fn, ": lse must be float32 [B, Hq, Sq] with unit row stride");
  TORCH_CHECK(B <= fa2::kMaxGridDim && Hq <= fa2::kMaxGridDim, fn, ": batch and heads must be <= ", fa2::kMaxGridDim);
  fa2::EmptyRowsParams p;
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.v = v.data_ptr();
  p.batch = int(B);
  p.heads_q = int(Hq);
  p.heads_kv = int(v.size(1));
  p.seqlen_q = int(Sq);
  p.seqlen_k = int(v.size(2));
  p.head_dim = int(D);
  p.o_batch_stride = out.stride(0);
  p.o_head_stride = out.stride(1);
  p.o_row_stride = out.stride(2);
  p.lse_batch_stride = lse.stride(0);
  p.lse_head_stride = lse.stride(1);
  p.v_batch_stride = v.stride(0);
  p.v_head_stride = v.stride(1);
  p.v_row_stride = v.stride(2);
  if (source.has_value()) {
    const at::Tensor& src = *source;
    TORCH_CHECK(src.device() == out.device() && src.scalar_type() == out.scalar_type() && src.sizes() == out.sizes() &&
                    src.stride(3) == 1,
                fn, ": source must match out (shape, dtype, device, contiguous last dim)");
    p.source = src.data_ptr();
    p.source_batch_stride = src.stride(0);
    p.source_head_stride = src.stride(1);
    p.source_row_stride = src.stride(2);
  }
  c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(fn, v.scalar_type() == at::kBFloat16 ? fa2::run_fill_empty_rows<fa2::DType::kBF16>(p, stream)
                                                    : fa2::run_fill_empty_rows<fa2::DType::kFP16>(p, stream));
}

// ===== Backward kernel binding (fa2::run_bwd) =====================================================
// bwd() checks its arguments, fills fa2::BwdParams and launches preprocess, [mask pre-pass,] main kernel
// and dQ postprocess on the current stream; its workspace comes from the caching allocator.
#include "fa2/bwd_params.h"

namespace {

using BwdRunFn = cudaError_t (*)(const fa2::BwdParams&, cudaStream_t);
using BwdWorkspaceFn = int64_t (*)(const fa2::BwdParams&);

// Variants per (head dim, dtype): [0] no mask, [1] causal, [2] bool mask, [3] additive mask.
struct BwdKernelEntry {
  int head_dim;
  fa2::DType dtype;
  BwdRunFn run[4];
  BwdWorkspaceFn workspace[4];
};

#define FA2_BWD_VARIANTS(D, DT, FN)                                                                     \
  {&fa2::FN<D, fa2::DType::DT, false, fa2::MaskKind::kNone>, &fa2::FN<D, fa2::DType::DT, true, fa2::MaskKind::kNone>, \
   &fa2::FN<D, fa2::DType::DT, false, fa2::MaskKind::kBool>,                                            \
   &fa2::FN<D, fa2::DType::DT, false, fa2::MaskKind::kAdditive>}
#define FA2_BWD_ENTRY(D, DT) \
  BwdKernelEntry{D, fa2::DType::DT, FA2_BWD_VARIANTS(D, DT, run_bwd), FA2_BWD_VARIANTS(D, DT, bwd_workspace_bytes)},

// One entry per compiled (head dim, dtype); the rows come from csrc/kernel_table.py.
const std::vector<BwdKernelEntry>& bwd_kernel_table() {
  static const std::vector<BwdKernelEntry> table = {
#include "generated/kernel_table.inc"
  };
  return table;
}

// Checks a tensor laid out like q (same shape and dtype, TMA-compatible strides) and returns its
// (batch, head, row) strides.
std::array<int64_t, 3> like_q_strides(const char* fn, const at::Tensor& t, const char* name, const at::Tensor& q) {
  check_operand(t, name, q);
  TORCH_CHECK(t.sizes() == q.sizes() && t.scalar_type() == q.scalar_type(), fn, ": ", name,
              " must have q's shape and dtype");
  return {tma_stride(t, 0, name), tma_stride(t, 1, name), tma_stride(t, 2, name)};
}
std::array<int64_t, 3> like_kv_strides(const char* fn, const at::Tensor& t, const char* name, const at::Tensor& k) {
  check_operand(t, name, k);
  TORCH_CHECK(t.sizes() == k.sizes() && t.scalar_type() == k.scalar_type(), fn, ": ", name,
              " must have k's shape and dtype");
  return {tma_stride(t, 0, name), tma_stride(t, 1, name), tma_stride(t, 2, name)};
}

// Strides of a [B, Hq, Sq, Sk] view (mask or mask gradient); size-1 dims are never stepped over, so
// they read as broadcast (0).
std::array<int64_t, 4> broadcast_strides(const char* fn, const at::Tensor& t, const char* name, const at::Tensor& q,
                                         int64_t seqlen_k) {
  TORCH_CHECK(t.is_cuda() && t.device() == q.device(), fn, ": ", name, " must be on q's device");
  TORCH_CHECK(t.dim() == 4 && t.size(0) == q.size(0) && t.size(1) == q.size(1) && t.size(2) == q.size(2) &&
                  t.size(3) == seqlen_k,
              fn, ": ", name, " must be expanded to [B, Hq, Sq, Sk]");
  std::array<int64_t, 4> strides;
  for (int d = 0; d < 4; ++d) {
    TORCH_CHECK(t.stride(d) >= 0, fn, ": ", name, " strides must be non-negative");
    strides[d] = t.size(d) == 1 ? 0 : t.stride(d);
  }
  return strides;
}

}  // namespace

// Attention backward into preallocated dq [B,Hq,Sq,D] and dk, dv [B,Hkv,Sk,D] (any TMA-compatible
// strides). mask (optional): as fwd_masked takes it. dmask (optional, additive masks): float32, zeroed,
// expanded to [B,Hq,Sq,Sk] with zero strides on the dims to sum over; receives dS added in.
void bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
         const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, double scale, bool is_causal,
         bool deterministic, const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& dmask) {
  constexpr const char* fn = "fa2_inductor._C.bwd";
  const fa2::FwdParams f = describe_call(fn, q, k, v, out, lse, scale);
  TORCH_CHECK(f.batch > 0 && f.heads_q > 0 && f.seqlen_q > 0 && f.seqlen_k > 0, fn,
              ": empty problems need no kernel (the caller's)");
  fa2::BwdParams p;
  p.q = f.q;
  p.k = f.k;
  p.v = f.v;
  p.o = f.o;
  p.lse = f.lse;
  p.batch = f.batch;
  p.heads_q = f.heads_q;
  p.heads_kv = f.heads_kv;
  p.seqlen_q = f.seqlen_q;
  p.seqlen_k = f.seqlen_k;
  p.head_dim = f.head_dim;
  p.q_batch_stride = f.q_batch_stride, p.q_head_stride = f.q_head_stride, p.q_row_stride = f.q_row_stride;
  p.k_batch_stride = f.k_batch_stride, p.k_head_stride = f.k_head_stride, p.k_row_stride = f.k_row_stride;
  p.v_batch_stride = f.v_batch_stride, p.v_head_stride = f.v_head_stride, p.v_row_stride = f.v_row_stride;
  p.o_batch_stride = f.o_batch_stride, p.o_head_stride = f.o_head_stride, p.o_row_stride = f.o_row_stride;
  p.lse_batch_stride = f.lse_batch_stride, p.lse_head_stride = f.lse_head_stride;
  const auto s_do = like_q_strides(fn, dout, "dout", q);
  const auto s_dq = like_q_strides(fn, dq, "dq", q);
  const auto s_dk = like_kv_strides(fn, dk, "dk", k);
  const auto s_dv = like_kv_strides(fn, dv, "dv", k);
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.do_batch_stride = s_do[0], p.do_head_stride = s_do[1], p.do_row_stride = s_do[2];
  p.dq_batch_stride = s_dq[0], p.dq_head_stride = s_dq[1], p.dq_row_stride = s_dq[2];
  p.dk_batch_stride = s_dk[0], p.dk_head_stride = s_dk[1], p.dk_row_stride = s_dk[2];
  p.dv_batch_stride = s_dv[0], p.dv_head_stride = s_dv[1], p.dv_row_stride = s_dv[2];
  p.scale = float(scale);
  p.causal = is_causal;
  p.deterministic = deterministic;

  int variant = is_causal ? 1 : 0;
  if (mask.has_value()) {
    TORCH_CHECK(!is_causal, fn, ": a mask together with is_causal is not supported");
    const at::Tensor& m = *mask;
    switch (m.scalar_type()) {
      case at::kBool: p.mask_dtype = fa2::MaskDType::kBool; variant = 2; break;
      case at::kFloat: p.mask_dtype = fa2::MaskDType::kF32; variant = 3; break;
      case at::kBFloat16: p.mask_dtype = fa2::MaskDType::kBF16; variant = 3; break;
      case at::kHalf: p.mask_dtype = fa2::MaskDType::kF16; variant = 3; break;
      default: TORCH_CHECK(false, fn, ": mask dtype must be bool, float32, bfloat16 or float16, got ", m.scalar_type());
    }
    static_assert(sizeof(bool) == 1, "bool masks are read as bytes");
    const auto s = broadcast_strides(fn, m, "mask", q, f.seqlen_k);
    p.mask = m.data_ptr();
    p.mask_batch_stride = s[0], p.mask_head_stride = s[1], p.mask_row_stride = s[2], p.mask_col_stride = s[3];
    const int64_t class_slices = (s[0] == 0 ? 1 : f.batch) * (s[1] == 0 ? 1 : f.heads_q);
    TORCH_CHECK(class_slices <= 65535, fn, ": mask too large for the block classification grid");
  }
  if (dmask.has_value()) {
    TORCH_CHECK(variant == 3, fn, ": dmask needs an additive mask");
    const at::Tensor& g = *dmask;
    TORCH_CHECK(g.scalar_type() == at::kFloat, fn, ": dmask must be float32");
    const auto s = broadcast_strides(fn, g, "dmask", q, f.seqlen_k);
    p.dmask = g.data_ptr<float>();
    p.dmask_batch_stride = s[0], p.dmask_head_stride = s[1], p.dmask_row_stride = s[2], p.dmask_col_stride = s[3];
  }

  const fa2::DType dtype = q.scalar_type() == at::kBFloat16 ? fa2::DType::kBF16 : fa2::DType::kFP16;
  const BwdKernelEntry* entry = nullptr;
  for (const auto& e : bwd_kernel_table()) {
    if (e.head_dim == f.head_dim && e.dtype == dtype) entry = &e;
  }
  TORCH_CHECK(entry != nullptr, fn, ": no kernel compiled for head dim ", f.head_dim, " and dtype ", q.scalar_type());
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor workspace = at::empty({entry->workspace[variant](p)}, q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  check_launch(fn, entry->run[variant](p, c10::cuda::getCurrentCUDAStream().stream()));
}

void register_bwd(pybind11::module_& m) {
  m.def("bwd", &bwd,
        "Attention backward into preallocated dq, dk, dv (optional mask as fwd_masked takes it, optional float32 "
        "dmask accumulator)",
        pybind11::arg("dout"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"),
        pybind11::arg("lse"), pybind11::arg("dq"), pybind11::arg("dk"), pybind11::arg("dv"), pybind11::arg("scale"),
        pybind11::arg("is_causal"), pybind11::arg("deterministic"), pybind11::arg("mask") = pybind11::none(),
        pybind11::arg("dmask") = pybind11::none());
}
// ===== end of the backward kernel binding ========================================================

std::vector<std::tuple<int64_t, std::string>> compiled_kernels() {
  std::vector<std::tuple<int64_t, std::string>> result;
  for (const auto& e : kernel_table()) result.emplace_back(e.head_dim, e.dtype_name);
  return result;
}

// What every compiled kernel can take; Python's support rules read these instead of restating them.
std::map<std::string, int64_t> limits() {
  return {
      {"max_head_dim", fa2::kMaxHeadDim},
      {"max_grid_dim", fa2::kMaxGridDim},
      {"max_seqlen", kMaxSeqLen},
      {"stride_align_elements", fa2::kStrideAlignElements},
      {"mask_block_m", fa2::kMaskBlockM},
      {"additive_mask_with_causal",
       !kernel_table().empty() && kernel_table().front().run_masked[1][1] != nullptr ? 1 : 0},
  };
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fa2_inductor Hopper (sm_90a) FlashAttention forward kernel";
  m.def("fwd", &fwd, "Attention forward into preallocated out [B,Hq,Sq,D] and lse [B,Hq,Sq] (float32)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"), pybind11::arg("lse"),
        pybind11::arg("scale"), pybind11::arg("is_causal"), pybind11::arg("window_left"),
        pybind11::arg("rows_filter") = pybind11::none());
  m.def("fwd_masked", &fwd_masked,
        "Masked attention forward (mask expanded to [B,Hq,Sq,Sk]: bool = attend, or additive float32/bf16/fp16)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"), pybind11::arg("lse"),
        pybind11::arg("scale"), pybind11::arg("mask"), pybind11::arg("is_causal"), pybind11::arg("window_left"));
  m.def("fill_empty_rows", &fill_empty_rows,
        "Rows with lse = -inf get the mean of V over all keys, or source's rows when given",
        pybind11::arg("out"), pybind11::arg("lse"), pybind11::arg("v"), pybind11::arg("source") = pybind11::none());
  m.def("compiled_kernels", &compiled_kernels, "List of (head_dim, dtype_name) compiled into this build");
  m.def("limits", &limits, "The limits every compiled kernel shares");
  register_bwd(m);  // the backward kernel binding's one line here
}
