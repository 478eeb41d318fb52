// fa2_inductor._C: the Hopper kernels behind the ops fa2_inductor::flash_attention_fwd and flash_attention_bwd.
// The only compile unit that includes torch. Python owns the ops' schemas, fakes and autograd
// (fa2_inductor/ops.py); loading this module registers their CUDA implementations and, for CUDA tensors, the
// same autograd formula in C++ (TORCH_LIBRARY_IMPL at the end), so a call goes from the dispatcher to C++
// without Python on the kernels' path.
//
// Sections, in order:
//   kernel table     the compiled (head dim, dtype) entries, from csrc/kernel_table.py
//   launches         fwd / fwd_masked / fill_empty_rows: checked arguments -> fa2::FwdParams -> launch, on the
//                    current stream, no synchronisation (CUDA-graph safe; workspaces come from the
//                    stream-ordered caching allocator, which capture allows)
//   input checks     the op's argument rules (ValueError), the same messages as ops.check_inputs
//   support          "does the kernel run this call, and if not, why": the one place that decides, on
//                    tensor metadata, so the graph pass (fake tensors) and explain ask it too
//   reference        what the CUDA path runs where the kernel does not: the reference in ATen
//                    (fa2/reference_aten.hpp), and the Python hooks that count such calls
//   the op           its CUDA implementation: checks, support, outputs, special cases, empty-row policies
//   backward         bwd: checked arguments -> fa2::BwdParams -> launches; the backward op's support rules
//                    (ours, PyTorch's flash backward) and CUDA implementation with its fallbacks
//   autograd (CUDA)  flash_attention_fwd's autograd formula for CUDA tensors, as ops.py's
//   registration     TORCH_LIBRARY_IMPL and the Python bindings
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <type_traits>
#include <string>
#include <tuple>
#include <vector>

#include "fa2/params.h"
#include "fa2/reference_aten.hpp"

// Error messages and reasons are joined with std::string and std::to_string, never through an ostringstream
// (c10::str, or TORCH_CHECK's own message formatting with several arguments): on the H200 machine this was
// built for, formatting a stream inside this module crashed the process (a segfault on every such message,
// while plain string joins worked). FA2_CHECK* hand TORCH_CHECK* one finished std::string.
namespace fa2_message {
inline void add(std::string& out, const char* part) { out += part; }
inline void add(std::string& out, const std::string& part) { out += part; }
inline void add(std::string& out, at::ScalarType part) { out += c10::toString(part); }
inline void add(std::string& out, const c10::Device& part) { out += part.str(); }
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
void add(std::string& out, T part) { out += std::to_string(part); }
inline void add(std::string& out, bool part) { out += part ? "True" : "False"; }
inline void add(std::string& out, double part) { out += std::to_string(part); }
}  // namespace fa2_message

template <class... Parts>
std::string join(const Parts&... parts) {
  std::string out;
  (fa2_message::add(out, parts), ...);
  return out;
}
#define FA2_CHECK(cond, ...) TORCH_CHECK(cond, join(__VA_ARGS__))
#define FA2_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, join(__VA_ARGS__))

namespace {

constexpr int64_t kMaxSeqLen = (int64_t(1) << 31) - 1;  // sequence positions are int32 in the kernels

// ------------------------------------------------------------------------------------------ kernel table

using RunFn = cudaError_t (*)(const fa2::FwdParams&, cudaStream_t);
using WorkspaceFn = int64_t (*)(const fa2::FwdParams&);
using DecodeRunFn = cudaError_t (*)(const fa2::FwdParams&, void*, cudaStream_t);

struct KernelEntry {
  int head_dim;
  fa2::DType dtype;
  const char* dtype_name;
  RunFn run[2];                    // [causal]
  // [0: bool mask, 1: additive mask][causal]: the bool-mask kernel takes causal at run time; null: not
  // compiled (additive with causal).
  RunFn run_masked[2][2];
  WorkspaceFn masked_workspace[2]; // device bytes the masked forward needs, [bool, additive]
  DecodeRunFn run_decode;          // split-KV for Sq <= kDecodeMaxSeqlenQ (every mask, causal/window)
  WorkspaceFn decode_workspace;
};

// One entry per compiled (head dim, dtype); the rows come from csrc/kernel_table.py.
#define FA2_ENTRY(D, DT, NAME)                                                                               \
  KernelEntry{D, fa2::DType::DT, NAME,                                                                       \
              {&fa2::run_fwd<D, fa2::DType::DT, false>, &fa2::run_fwd<D, fa2::DType::DT, true>},            \
              {{&fa2::run_fwd_masked<D, fa2::DType::DT, fa2::MaskKind::kBool>,                               \
                &fa2::run_fwd_masked<D, fa2::DType::DT, fa2::MaskKind::kBool>},                               \
               {&fa2::run_fwd_masked<D, fa2::DType::DT, fa2::MaskKind::kAdditive>, nullptr}},                 \
              {&fa2::masked_workspace_bytes<D, fa2::DType::DT, fa2::MaskKind::kBool>,                        \
               &fa2::masked_workspace_bytes<D, fa2::DType::DT, fa2::MaskKind::kAdditive>},                   \
              &fa2::run_decode<D, fa2::DType::DT>, &fa2::decode_workspace_bytes<D, fa2::DType::DT>},

const std::vector<KernelEntry>& kernel_table() {
  static const std::vector<KernelEntry> table = {
#include "generated/kernel_table.inc"
  };
  return table;
}
#undef FA2_ENTRY  // the table's file also holds the backward's rows, behind FA2_BWD_ENTRY

// The entry (forward or backward table) that runs this head dim and dtype: its own, else (a multiple of 8) the
// smallest larger one, whose TMA loads pad the head dim with zeros and whose stores clip it; null when none.
template <class Entry>
const Entry* entry_for_head_dim(const std::vector<Entry>& table, int64_t head_dim, fa2::DType dtype) {
  const Entry* padded = nullptr;
  for (const auto& e : table) {
    if (e.dtype != dtype) continue;
    if (e.head_dim == head_dim) return &e;
    if (e.head_dim > head_dim && (padded == nullptr || e.head_dim < padded->head_dim)) padded = &e;
  }
  const bool paddable = head_dim > 0 && head_dim % fa2::kStrideAlignElements == 0;
  return paddable ? padded : nullptr;
}

const KernelEntry* find_kernel(int64_t head_dim, fa2::DType dtype) {
  return entry_for_head_dim(kernel_table(), head_dim, dtype);
}

// The kernels' element types and their names in the kernel list; nullopt for every other dtype.
std::optional<fa2::DType> kernel_dtype(at::ScalarType t) {
  if (t == at::kBFloat16) return fa2::DType::kBF16;
  if (t == at::kHalf) return fa2::DType::kFP16;
  return std::nullopt;
}

const char* kernel_dtype_name(fa2::DType t) { return t == fa2::DType::kBF16 ? "bf16" : "fp16"; }

bool additive_mask_with_causal() {
  return !kernel_table().empty() && kernel_table().front().run_masked[1][1] != nullptr;
}

// ---------------------------------------------------------------------------------------------- launches

void check_operand(const at::Tensor& t, const char* name, const at::Tensor& q) {
  FA2_CHECK(t.is_cuda(), "fa2_inductor._C.fwd: ", name, " must be a CUDA tensor");
  FA2_CHECK(t.device() == q.device(), "fa2_inductor._C.fwd: ", name, " is on another device than q");
  FA2_CHECK(t.dim() == 4, "fa2_inductor._C.fwd: ", name, " must be 4-D");
  FA2_CHECK(t.stride(3) == 1 || t.size(3) == 1, "fa2_inductor._C.fwd: ", name, " must have a contiguous last dim");
  FA2_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "fa2_inductor._C.fwd: ", name, " must be 16-byte aligned");
}

// TMA needs strides that are multiples of 16 bytes (8 elements); a dimension of size 1 is never
// stepped over, so any valid stride will do for it.
int64_t tma_stride(const at::Tensor& t, int dim, const char* name) {
  if (t.size(dim) <= 1) return 8;
  const int64_t s = t.stride(dim);
  FA2_CHECK(s > 0 && s % fa2::kStrideAlignElements == 0, "fa2_inductor._C.fwd: ", name, " stride ", s, " of dim ",
              dim, " must be a positive multiple of ", fa2::kStrideAlignElements, " elements (16 bytes)");
  return s;
}

// Persistent kernels (one CTA per SM: the forward's and the backward's) unless switched off: the benchmark
// compares them with one CTA per tile in the same process.
std::atomic<bool> persistent_grid{true};

void set_persistent_grid(bool on) { persistent_grid.store(on, std::memory_order_relaxed); }

// A device attribute, asked of the driver once per device and kept (calls are on the hot path).
template <cudaDeviceAttr kAttribute>
int device_attribute(int device_index) {
  static std::array<std::atomic<int>, 128> value_plus_one{};  // 0: not asked yet
  FA2_CHECK(device_index >= 0 && device_index < int(value_plus_one.size()), "fa2_inductor: CUDA device index ",
            device_index, " out of range");
  int value = value_plus_one[device_index].load(std::memory_order_relaxed) - 1;
  if (value < 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, kAttribute, device_index));
    value_plus_one[device_index].store(value + 1, std::memory_order_relaxed);
  }
  return value;
}

// Checks q/k/v/out/lse as both entry points take them and describes them in FwdParams (no mask).
fa2::FwdParams describe_call(const char* fn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& out, const at::Tensor& lse, double scale) {
  check_operand(q, "q", q);
  check_operand(k, "k", q);
  check_operand(v, "v", q);
  check_operand(out, "out", q);
  FA2_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              fn, ": q, k, v, out must share a dtype");
  FA2_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, fn,
              ": dtype must be bfloat16 or float16, got ", q.scalar_type());
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Sk = k.size(2);
  FA2_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == Sk &&
                  k.size(3) == D && v.size(3) == D,
              fn, ": k/v shapes do not match q");
  FA2_CHECK(Hkv > 0 && Hq % Hkv == 0, fn, ": Hq must be a multiple of Hkv");
  FA2_CHECK(out.sizes() == q.sizes(), fn, ": out must have q's shape");
  FA2_CHECK(lse.is_cuda() && lse.device() == q.device() && lse.scalar_type() == at::kFloat &&
                  lse.dim() == 3 && lse.size(0) == B && lse.size(1) == Hq && lse.size(2) == Sq &&
                  (lse.stride(2) == 1 || Sq <= 1),
              fn, ": lse must be float32 [B, Hq, Sq] with unit row stride");
  FA2_CHECK(B <= fa2::kMaxGridDim && Hq <= fa2::kMaxGridDim, fn, ": batch and heads must be <= ", fa2::kMaxGridDim);
  FA2_CHECK(Sq <= kMaxSeqLen && Sk <= kMaxSeqLen, fn, ": sequence too long");

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
  p.num_sms = persistent_grid.load(std::memory_order_relaxed)
                  ? device_attribute<cudaDevAttrMultiProcessorCount>(q.get_device())
                  : 0;
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
  const KernelEntry* entry = find_kernel(q.size(3), dtype);
  FA2_CHECK(entry != nullptr, fn, ": no kernel compiled for head dim ", q.size(3), " and dtype ", q.scalar_type());
  return *entry;
}

// window_left: -1 (none) or, with is_causal, the number of keys before the diagonal a query still sees.
int check_window(const char* fn, bool is_causal, int64_t window_left) {
  FA2_CHECK(window_left == -1 || (is_causal && window_left >= 0 && window_left <= kMaxSeqLen), fn,
              ": window_left must be -1, or a non-negative key count together with is_causal, got ", window_left);
  return int(window_left);
}

// Soft-capping and sinks into the params. sinks ([Hq], any float dtype) is read as float32: the returned
// tensor holds that copy and must outlive the launch.
at::Tensor set_softcap_and_sinks(const char* fn, fa2::FwdParams& p, double softcap,
                                 const std::optional<at::Tensor>& sinks) {
  FA2_CHECK(softcap >= 0 && softcap < std::numeric_limits<double>::infinity(), fn,
              ": softcap must be finite and >= 0 (0: no soft-capping)");
  p.softcap = float(softcap);
  if (!sinks.has_value()) return at::Tensor();
  FA2_CHECK(sinks->is_cuda() && sinks->dim() == 1 && sinks->size(0) == p.heads_q &&
                at::isFloatingType(sinks->scalar_type()),
            fn, ": sinks must be a floating CUDA tensor of shape [Hq]");
  at::Tensor sinks_f32 = sinks->to(at::kFloat).contiguous();
  p.sinks = sinks_f32.data_ptr<float>();
  return sinks_f32;
}

// describe_call with the arguments every forward launch takes besides the tensors: positions, soft-capping
// and sinks. The tensor returned holds the float32 sinks the params point to: keep it past the launch.
std::pair<fa2::FwdParams, at::Tensor> describe_forward(const char* fn, const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& v, const at::Tensor& out,
                                                       const at::Tensor& lse, double scale, bool is_causal,
                                                       int64_t window_left, double softcap,
                                                       const std::optional<at::Tensor>& sinks) {
  fa2::FwdParams p = describe_call(fn, q, k, v, out, lse, scale);
  p.causal = is_causal;
  p.window_left = check_window(fn, is_causal, window_left);
  at::Tensor sinks_f32 = set_softcap_and_sinks(fn, p, softcap, sinks);
  return {p, sinks_f32};
}

void check_launch(const char* fn, cudaError_t err) {
  FA2_CHECK(err == cudaSuccess, fn, ": kernel launch failed: ", cudaGetErrorString(err));
}

// rows_filter (optional, float32 with lse's shape and strides): only query tiles holding a row that is
// -inf there run; the others leave out and lse untouched. after_own_kernel: see fa2::FwdParams.
void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
         double scale, bool is_causal, int64_t window_left, const std::optional<at::Tensor>& rows_filter,
         double softcap, const std::optional<at::Tensor>& sinks, bool after_own_kernel = false) {
  constexpr const char* fn = "fa2_inductor._C.fwd";
  auto [p, sinks_f32] = describe_forward(fn, q, k, v, out, lse, scale, is_causal, window_left, softcap, sinks);
  if (rows_filter.has_value()) {
    const at::Tensor& f = *rows_filter;
    FA2_CHECK(f.device() == lse.device() && f.scalar_type() == at::kFloat && f.sizes() == lse.sizes() &&
                    f.strides() == lse.strides(),
                fn, ": rows_filter must be float32 with lse's shape and strides");
    p.rows_filter = f.data_ptr<float>();
  }
  p.after_own_kernel = after_own_kernel;
  const KernelEntry& entry = kernel_for(fn, q);
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0) return;
  c10::cuda::CUDAGuard guard(q.device());
  check_launch(fn, entry.run[is_causal ? 1 : 0](p, c10::cuda::getCurrentCUDAStream().stream()));
}

// A mask expanded to [B, Hq, Sq, Sk] (zero strides on broadcast dims, any non-negative strides) into p;
// returns 0 for bool (True = attend), 1 for additive (float32/bf16/fp16).
int describe_mask(const char* fn, fa2::FwdParams& p, const at::Tensor& mask, const at::Tensor& q) {
  const int64_t B = p.batch, Hq = p.heads_q, Sq = p.seqlen_q, Sk = p.seqlen_k;
  FA2_CHECK(mask.is_cuda() && mask.device() == q.device(), fn, ": mask must be on q's device");
  FA2_CHECK(mask.dim() == 4 && mask.size(0) == B && mask.size(1) == Hq && mask.size(2) == Sq && mask.size(3) == Sk,
              fn, ": mask must be expanded to [B, Hq, Sq, Sk]");
  for (int d = 0; d < 4; ++d) FA2_CHECK(mask.stride(d) >= 0, fn, ": mask strides must be non-negative");
  int kind;
  switch (mask.scalar_type()) {
    case at::kBool: p.mask_dtype = fa2::MaskDType::kBool; kind = 0; break;
    case at::kFloat: p.mask_dtype = fa2::MaskDType::kF32; kind = 1; break;
    case at::kBFloat16: p.mask_dtype = fa2::MaskDType::kBF16; kind = 1; break;
    case at::kHalf: p.mask_dtype = fa2::MaskDType::kF16; kind = 1; break;
    default: FA2_CHECK(false, fn, ": mask dtype must be bool, float32, bfloat16 or float16, got ", mask.scalar_type());
  }
  static_assert(sizeof(bool) == 1, "bool masks are read as bytes");
  p.mask = mask.data_ptr();
  // Size-1 dims are never stepped over; zero strides make the kernel share one mask slice.
  p.mask_batch_stride = B == 1 ? 0 : mask.stride(0);
  p.mask_head_stride = Hq == 1 ? 0 : mask.stride(1);
  p.mask_row_stride = Sq == 1 ? 0 : mask.stride(2);
  p.mask_col_stride = Sk == 1 ? 0 : mask.stride(3);
  return kind;
}

// Forward with an attention mask already expanded to [B, Hq, Sq, Sk] (zero strides on broadcast
// dims; any non-negative strides). bool: True = attend; float32/bf16/fp16: additive. With is_causal
// the causal (and window) positions are hidden too. The pre-pass writes into a workspace from the
// caching allocator (stream-ordered, so CUDA-graph safe), then the masked kernel runs.
void fwd_masked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                double scale, const at::Tensor& mask, bool is_causal, int64_t window_left, double softcap,
                const std::optional<at::Tensor>& sinks) {
  constexpr const char* fn = "fa2_inductor._C.fwd_masked";
  auto [p, sinks_f32] = describe_forward(fn, q, k, v, out, lse, scale, is_causal, window_left, softcap, sinks);
  FA2_CHECK(k.size(2) > 0, fn, ": needs at least one key");
  FA2_CHECK(scale > 0, fn, ": scale must be positive");
  const int kind = describe_mask(fn, p, mask, q);
  const KernelEntry& entry = kernel_for(fn, q);
  const RunFn run = entry.run_masked[kind][is_causal ? 1 : 0];
  FA2_CHECK(run != nullptr, fn, ": no kernel compiled for ", mask.scalar_type(), " masks with is_causal");
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2);
  if (B == 0 || Hq == 0 || Sq == 0) return;

  c10::cuda::CUDAGuard guard(q.device());
  const int64_t class_batches = p.mask_batch_stride == 0 ? 1 : B;
  const int64_t class_heads = p.mask_head_stride == 0 ? 1 : Hq;
  const int64_t class_m_blocks = p.mask_row_stride == 0 ? 1 : (Sq + fa2::kMaskBlockM - 1) / fa2::kMaskBlockM;
  FA2_CHECK(class_batches * class_heads <= fa2::kMaxGridDim && class_m_blocks <= fa2::kMaxGridDim, fn,
              ": mask too large for the block classification grid");
  at::Tensor workspace = at::empty({entry.masked_workspace[kind](p)}, q.options().dtype(at::kByte));
  p.mask_workspace = workspace.data_ptr();
  check_launch(fn, run(p, c10::cuda::getCurrentCUDAStream().stream()));
}

// Forward of a call with few query rows (Sq <= kDecodeMaxSeqlenQ): the split-KV kernel, which takes every mask
// (as fwd_masked), causal/window positions, softcap and sinks; its partial rows live in a workspace from the
// caching allocator.
void fwd_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                double scale, const std::optional<at::Tensor>& mask, bool is_causal, int64_t window_left,
                double softcap, const std::optional<at::Tensor>& sinks) {
  constexpr const char* fn = "fa2_inductor._C.fwd_decode";
  auto [p, sinks_f32] = describe_forward(fn, q, k, v, out, lse, scale, is_causal, window_left, softcap, sinks);
  FA2_CHECK(k.size(2) > 0, fn, ": needs at least one key");
  FA2_CHECK(scale > 0, fn, ": scale must be positive");
  FA2_CHECK(q.size(2) <= fa2::kDecodeMaxSeqlenQ, fn, ": at most ", fa2::kDecodeMaxSeqlenQ, " query rows");
  if (mask.has_value()) describe_mask(fn, p, *mask, q);
  const KernelEntry& entry = kernel_for(fn, q);
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0) return;
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor workspace = at::empty({entry.decode_workspace(p)}, q.options().dtype(at::kByte));
  check_launch(fn, entry.run_decode(p, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()));
}

// Rewrites the rows the forward left empty (lse = -inf) to the mean of V over all keys, or, given
// source ([B, Hq, Sq, D] like out), to source's rows (the op's empty_rows policies).
void fill_empty_rows(at::Tensor& out, const at::Tensor& lse, const at::Tensor& v,
                     const std::optional<at::Tensor>& source, bool after_own_kernel = false) {
  constexpr const char* fn = "fa2_inductor._C.fill_empty_rows";
  check_operand(out, "out", out);
  check_operand(v, "v", out);
  FA2_CHECK(out.scalar_type() == v.scalar_type() && (v.scalar_type() == at::kBFloat16 || v.scalar_type() == at::kHalf),
              fn, ": out and v must share a dtype, bfloat16 or float16");
  const int64_t B = out.size(0), Hq = out.size(1), Sq = out.size(2), D = out.size(3);
  FA2_CHECK(v.size(0) == B && v.size(3) == D && v.size(1) > 0 && Hq % v.size(1) == 0, fn, ": v does not match out");
  FA2_CHECK(D <= fa2::kMaxHeadDim, fn, ": head dim above ", fa2::kMaxHeadDim);
  FA2_CHECK(lse.is_cuda() && lse.device() == out.device() && lse.scalar_type() == at::kFloat && lse.dim() == 3 &&
                  lse.size(0) == B && lse.size(1) == Hq && lse.size(2) == Sq && (lse.stride(2) == 1 || Sq <= 1),
              fn, ": lse must be float32 [B, Hq, Sq] with unit row stride");
  FA2_CHECK(B <= fa2::kMaxGridDim && Hq <= fa2::kMaxGridDim, fn, ": batch and heads must be <= ", fa2::kMaxGridDim);
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
  p.after_own_kernel = after_own_kernel;
  if (source.has_value()) {
    const at::Tensor& src = *source;
    FA2_CHECK(src.device() == out.device() && src.scalar_type() == out.scalar_type() && src.sizes() == out.sizes() &&
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

// ------------------------------------------------------------------------------------------ input checks

// Python's spelling of values in messages, so that they read as ops.check_inputs writes them.
std::string py_dtype(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

std::string py_sequence(c10::IntArrayRef sizes, const char* open, const char* close, bool tuple) {
  std::string s = open;
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  if (tuple && sizes.size() == 1) s += ",";
  return s + close;
}
std::string py_tuple(c10::IntArrayRef sizes) { return py_sequence(sizes, "(", ")", true); }
std::string py_list(c10::IntArrayRef sizes) { return py_sequence(sizes, "[", "]", false); }

// The op's empty_rows values (EmptyRows in fa2_inductor.reference and fa2/reference_aten.hpp).
using fa2::EmptyRows;
using fa2::kEmptyRowsCount;

// Raises ValueError naming the problem when the arguments do not describe a valid attention: the rules and
// messages of fa2_inductor.ops.check_inputs, in its order (tests/gpu/test_dispatch.py compares the two).
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                  bool is_causal, int64_t window_left, int64_t empty_rows, double softcap,
                  const std::optional<at::Tensor>& sinks) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q}, {"k", &k}, {"v", &v}}) {
    FA2_CHECK_VALUE(t->dim() == 4, "flash_attention: ", name, " must be 4-D [batch, heads, seq, head_dim], got shape ",
                      py_tuple(t->sizes()));
  }
  const at::ScalarType dtype = q.scalar_type();
  FA2_CHECK_VALUE(dtype == k.scalar_type() && dtype == v.scalar_type(), "flash_attention: q, k, v must share a dtype, got ",
                    py_dtype(dtype), ", ", py_dtype(k.scalar_type()), ", ", py_dtype(v.scalar_type()));
  FA2_CHECK_VALUE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
                    "flash_attention: unsupported dtype ", py_dtype(dtype), "; use float16, bfloat16 or float32");
  FA2_CHECK_VALUE(dtype != at::kDouble || q.device().is_cpu(),
                    "flash_attention: float64 runs only on CPU (the reference path); use float32, float16 or bfloat16");
  FA2_CHECK_VALUE(q.device() == k.device() && k.device() == v.device(), "flash_attention: q, k, v must be on one device, got ",
                    q.device(), ", ", k.device(), ", ", v.device());
  const int64_t b = q.size(0), hq = q.size(1), sq = q.size(2), d = q.size(3);
  FA2_CHECK_VALUE(k.size(0) == b && v.size(0) == b, "flash_attention: batch sizes differ: q ", b, ", k ", k.size(0),
                    ", v ", v.size(0));
  FA2_CHECK_VALUE(k.size(3) == d && v.size(3) == d, "flash_attention: head dims differ: q ", d, ", k ", k.size(3), ", v ",
                    v.size(3));
  FA2_CHECK_VALUE(d <= fa2::kMaxHeadDim, "flash_attention: head_dim ", d, " is larger than the supported ",
                    fa2::kMaxHeadDim);
  FA2_CHECK_VALUE(d != 0, "flash_attention: head_dim is 0");
  FA2_CHECK_VALUE(k.size(1) == v.size(1) && k.size(2) == v.size(2), "flash_attention: k ", py_tuple(k.sizes()),
                    " and v ", py_tuple(v.sizes()), " must have the same heads and length");
  const int64_t hkv = k.size(1);
  FA2_CHECK_VALUE(hkv != 0 && hq % hkv == 0, "flash_attention: query heads (", hq,
                    ") must be a multiple of key/value heads (", hkv, ")");
  FA2_CHECK_VALUE(window_left == -1 || (is_causal && window_left >= 0),
                    "flash_attention: window_left must be -1 or, with is_causal=True, >= 0; got ", window_left);
  if (empty_rows < 0 || empty_rows >= kEmptyRowsCount) {
    std::vector<int64_t> policies;
    for (int64_t i = 0; i < kEmptyRowsCount; ++i) policies.push_back(i);
    FA2_CHECK_VALUE(false, "flash_attention: empty_rows must be one of ", py_list(policies), " (EmptyRows), got ",
                      empty_rows);
  }
  FA2_CHECK_VALUE(softcap >= 0 && softcap < std::numeric_limits<double>::infinity(),
                  "flash_attention: softcap must be finite and >= 0 (0: no soft-capping)");
  if (sinks.has_value()) {
    const at::Tensor& s = *sinks;
    FA2_CHECK_VALUE(s.dim() == 1 && s.size(0) == hq && at::isFloatingType(s.scalar_type()),
                    "flash_attention: sinks must be a floating tensor of shape [Hq] = [", hq, "], got ",
                    py_dtype(s.scalar_type()), " of shape ", py_tuple(s.sizes()));
    FA2_CHECK_VALUE(s.device() == q.device(), "flash_attention: sinks is on ", s.device(), ", q on ", q.device());
    FA2_CHECK_VALUE(empty_rows == int64_t(EmptyRows::kZero),
                    "flash_attention: with sinks a row with no visible key gives all its weight to the sink "
                    "(out = 0): empty_rows must be EmptyRows.ZERO");
  }
  if (!mask.has_value()) return;
  const at::Tensor& m = *mask;
  FA2_CHECK_VALUE(m.scalar_type() == at::kBool || at::isFloatingType(m.scalar_type()),
                    "flash_attention: attn_mask must be bool (True = attend) or floating (additive), got ",
                    py_dtype(m.scalar_type()));
  FA2_CHECK_VALUE(m.device() == q.device(), "flash_attention: attn_mask is on ", m.device(), ", q on ", q.device());
  const std::array<int64_t, 4> shape{b, hq, sq, k.size(2)};
  bool fits = m.dim() <= 4;
  for (int64_t i = 1; fits && i <= m.dim(); ++i) {
    const int64_t size = m.size(-i);
    fits = size == 1 || size == shape[4 - i];
  }
  FA2_CHECK_VALUE(fits, "flash_attention: attn_mask of shape ", py_tuple(m.sizes()),
                    " does not broadcast to [B, Hq, Sq, Sk] = ", py_list(shape));
}

// ----------------------------------------------------------------------------------------------- support

// A tensor as the support rules see it: metadata only, so that fake tensors (the graph pass) can be asked
// about. address: unknown (nullopt) for tensors without real storage; the op re-checks at run time.
struct TensorMeta {
  c10::IntArrayRef sizes, strides;
  at::ScalarType dtype;
  c10::Device device;
  std::optional<uintptr_t> address;

  static TensorMeta of(const at::Tensor& t) {
    return {t.sizes(), t.strides(), t.scalar_type(), t.device(), reinterpret_cast<uintptr_t>(t.const_data_ptr())};
  }
  int64_t dim() const { return int64_t(sizes.size()); }
};

using Reason = std::optional<std::string>;

bool is_hopper(const c10::Device& device) {
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(index) == 9 &&
         device_attribute<cudaDevAttrComputeCapabilityMinor>(index) == 0;
}

// The mask's strides once expanded to [B, Hq, Sq, Sk] as Tensor.expand makes them (0 on broadcast dims),
// or nullopt when it does not broadcast.
std::optional<std::array<int64_t, 4>> expanded_strides(const TensorMeta& mask, const std::array<int64_t, 4>& shape) {
  std::array<int64_t, 4> strides{0, 0, 0, 0};
  for (int64_t i = 1; i <= mask.dim(); ++i) {
    const int64_t size = mask.sizes[mask.dim() - i], target = shape[4 - i];
    if (size == target) {
      strides[4 - i] = mask.strides[mask.dim() - i];
    } else if (size != 1) {
      return std::nullopt;
    }
  }
  return strides;
}

Reason mask_reason(const TensorMeta& mask, const TensorMeta& q, const TensorMeta& k, bool is_causal) {
  const char* disabled = std::getenv("FA2_INDUCTOR_DISABLE_MASK_KERNEL");
  if (disabled != nullptr && std::strcmp(disabled, "1") == 0) {
    return "masked kernels disabled (FA2_INDUCTOR_DISABLE_MASK_KERNEL=1)";
  }
  const at::ScalarType dtype = mask.dtype;
  if (dtype != at::kBool && dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) {
    return "attn_mask dtype " + py_dtype(dtype) + " not supported by the kernel";
  }
  const bool decode = q.dim() == 4 && q.sizes[2] <= fa2::kDecodeMaxSeqlenQ;  // the decode kernel takes every mask
  if (is_causal && dtype != at::kBool && !additive_mask_with_causal() && !decode) {
    return "additive attn_mask together with is_causal";
  }
  if (mask.device != q.device) return "attn_mask on another device";
  const char* no_broadcast = "attn_mask does not broadcast to [B, Hq, Sq, Sk]";
  if (mask.dim() > 4 || q.dim() != 4 || k.dim() != 4) return no_broadcast;
  const std::array<int64_t, 4> shape{q.sizes[0], q.sizes[1], q.sizes[2], k.sizes[2]};
  const auto strides = expanded_strides(mask, shape);
  if (!strides.has_value()) return no_broadcast;
  for (int64_t s : *strides) {
    if (s < 0) return "attn_mask has a negative stride";
  }
  // The pre-pass classifies one block per (class slice, query tile, key tile); see fwd_masked.
  const int64_t class_b = shape[0] == 1 || (*strides)[0] == 0 ? 1 : shape[0];
  const int64_t class_h = shape[1] == 1 || (*strides)[1] == 0 ? 1 : shape[1];
  const int64_t class_m = shape[2] == 1 || (*strides)[2] == 0 ? 1 : (shape[2] + fa2::kMaskBlockM - 1) / fa2::kMaskBlockM;
  if (class_b * class_h > fa2::kMaxGridDim || class_m > fa2::kMaxGridDim) {
    return "attn_mask too large for the block classification grid";
  }
  return std::nullopt;
}

Reason layout_reason(const char* name, const TensorMeta& t) {
  if (t.strides[3] != 1 && t.sizes[3] != 1) return std::string(name) + " last dim not contiguous";
  if (t.address.has_value() && *t.address % 16 != 0) return std::string(name) + " not 16-byte aligned";
  for (int dim = 0; dim < 3; ++dim) {
    const int64_t s = t.strides[dim];
    if (t.sizes[dim] > 1 && (s <= 0 || s % fa2::kStrideAlignElements != 0)) {
      return join(name, " stride ", s, " of dim ", dim, " is not a positive multiple of ", fa2::kStrideAlignElements,
                      " elements");
    }
  }
  return std::nullopt;
}

// None when the compiled kernel runs this call, else a short reason. The one place that decides it: the op's
// CUDA implementation below, and through fa2_inductor._cuda the graph pass's device rules and explain.
// Every compiled kernel soft-caps and takes sinks, so those two arguments never decide (yet).
Reason unsupported_reason(const TensorMeta& q, const TensorMeta& k, const TensorMeta& v, const TensorMeta* mask,
                          bool is_causal, int64_t window_left, [[maybe_unused]] double softcap,
                          [[maybe_unused]] bool has_sinks) {
  if (window_left != -1 && !is_causal) return "window_left without is_causal";
  if (mask != nullptr) {
    Reason reason = mask_reason(*mask, q, k, is_causal);
    if (reason.has_value()) return reason;
  }
  if (!q.device.is_cuda()) return "not a CUDA tensor";
  if (!is_hopper(q.device)) return "kernel needs an sm_90 (Hopper) GPU";
  const std::optional<fa2::DType> dtype = kernel_dtype(q.dtype);
  if (!dtype.has_value()) return "dtype " + py_dtype(q.dtype) + " not supported by the kernel";
  if (k.dtype != q.dtype || v.dtype != q.dtype) return "q, k, v dtypes differ";
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return "inputs must be 4-D";
  const int64_t b = q.sizes[0], hq = q.sizes[1], sq = q.sizes[2], d = q.sizes[3];
  const int64_t hkv = k.sizes[1], sk = k.sizes[2];
  if (find_kernel(d, *dtype) == nullptr) return join("no kernel compiled for head dim ", d, " ", kernel_dtype_name(*dtype));
  if (std::max(b, hq) > fa2::kMaxGridDim) return join("batch or heads above ", fa2::kMaxGridDim);
  if (std::max(sq, sk) > kMaxSeqLen) return "sequence too long";
  if (hkv == 0 || hq % hkv != 0) return "Hq must be a multiple of Hkv";
  for (const auto& [name, t] : {std::pair<const char*, const TensorMeta*>{"q", &q}, {"k", &k}, {"v", &v}}) {
    Reason reason = layout_reason(name, *t);
    if (reason.has_value()) return reason;
  }
  return std::nullopt;
}

// Python's view of a tensor for the support rules: (sizes, strides, dtype, device, address or None).
using TensorMetaArgs = std::tuple<std::vector<int64_t>, std::vector<int64_t>, at::ScalarType, c10::Device,
                                  std::optional<int64_t>>;

TensorMeta meta_of(const TensorMetaArgs& args) {
  const auto& [sizes, strides, dtype, device, address] = args;
  FA2_CHECK_VALUE(sizes.size() == strides.size(), "fa2_inductor._C.kernel_unsupported_reason: ", sizes.size(),
                    " sizes but ", strides.size(), " strides");
  std::optional<uintptr_t> where;
  if (address.has_value()) where = uintptr_t(*address);
  return {sizes, strides, dtype, device, where};
}

Reason kernel_unsupported_reason(const TensorMetaArgs& q, const TensorMetaArgs& k, const TensorMetaArgs& v,
                                 const std::optional<TensorMetaArgs>& mask, bool is_causal, int64_t window_left,
                                 double softcap, bool has_sinks) {
  const std::optional<TensorMeta> mask_meta = mask.has_value() ? std::optional<TensorMeta>(meta_of(*mask)) : std::nullopt;
  return unsupported_reason(meta_of(q), meta_of(k), meta_of(v), mask_meta ? &*mask_meta : nullptr, is_causal,
                            window_left, softcap, has_sinks);
}

// -------------------------------------------------------------------------------------------- reference

// Where the kernels do not run a call, the CUDA implementations compute it with fa2::reference_forward and
// fa2::reference_backward, the reference in ATen ops on the call's own tensors (the backward first tries
// PyTorch's flash backward): a deployment without Python (a model exported and run from C++) still runs every
// call. fa2_inductor/reference.py stays the definition of the op's numerics; the C++ port follows it op by op,
// and tests/test_reference_aten.py holds the two to the same bits. Where Python is there, it only counts these
// calls and warns once per reason (torch._dynamo.utils.counters, warnings): fa2_inductor._cuda sets the hooks
// when it imports this module.
struct ReferenceHooks {
  // (reason) -> None: counts a call that runs the reference under reference_fallback:<reason>, warns once
  // per reason.
  pybind11::object note_fallback;
  // (reason) -> None: counts a backward call our backward kernel does not run under backward_fallback:<reason>.
  pybind11::object note_backward_fallback;
};
// Never destroyed: Python objects must not be released after the interpreter has gone.
ReferenceHooks* reference_hooks = nullptr;

void set_reference_hooks(pybind11::object note_fallback, pybind11::object note_backward_fallback) {
  if (reference_hooks == nullptr) reference_hooks = new ReferenceHooks();
  reference_hooks->note_fallback = std::move(note_fallback);
  reference_hooks->note_backward_fallback = std::move(note_backward_fallback);
}

// The reference is correct but slow, so its use is announced: through Python's hook where it is set, else
// (no Python) by one warning per process, naming the first reason.
void note_reference_fallback(const std::string& reason) {
  if (reference_hooks == nullptr) {
    TORCH_WARN_ONCE(join("fa2_inductor: CUDA call runs the (slow) reference implementation: ", reason));
    return;
  }
  pybind11::gil_scoped_acquire gil;
  reference_hooks->note_fallback(reason);
}

// A backward call our kernel does not run is counted where Python is there. Without Python only the calls that
// run the reference are announced (note_reference_fallback): PyTorch's flash backward is not slow.
void note_backward_fallback(const std::string& reason) {
  if (reference_hooks == nullptr) return;
  pybind11::gil_scoped_acquire gil;
  reference_hooks->note_backward_fallback(reason);
}

std::tuple<at::Tensor, at::Tensor> reference_fallback(const std::string& reason, const at::Tensor& q,
                                                      const at::Tensor& k, const at::Tensor& v,
                                                      const std::optional<at::Tensor>& mask, double scale,
                                                      bool is_causal, int64_t window_left, int64_t empty_rows,
                                                      double softcap, const std::optional<at::Tensor>& sinks) {
  note_reference_fallback(reason);
  auto [out, lse] = fa2::empty_outputs(q, v);
  fa2::reference_forward(q, k, v, mask, scale, is_causal, out, lse, window_left, empty_rows, softcap, sinks);
  return {out, lse};
}

// ------------------------------------------------------------------------------------------------ the op

// The op's meaning on the kernel, into preallocated out and lse, for calls unsupported_reason accepted.
void forward(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
             double scale, bool is_causal, const std::optional<at::Tensor>& mask, int64_t window_left,
             int64_t empty_rows, double softcap, const std::optional<at::Tensor>& sinks) {
  FA2_CHECK(q_in.dim() == 4 && k.dim() == 4, "fa2_inductor._C.forward: q and k must be 4-D");
  if (q_in.size(0) == 0 || q_in.size(1) == 0 || q_in.size(2) == 0) return;
  c10::cuda::CUDAGuard guard(q_in.device());
  if (k.size(2) == 0) {  // no key at all: every row is empty (its weight, if any, all on the sink)
    out.zero_();
    if (sinks.has_value()) {
      lse.copy_(sinks->to(at::kFloat).view({1, -1, 1}).expand_as(lse));
    } else {
      lse.fill_(-std::numeric_limits<double>::infinity());
    }
    return;
  }
  if (scale == 0) {  // rare: the kernels mask scores with -inf before scaling (0 * -inf = NaN)
    fa2::reference_forward(q_in, k, v, mask, 0.0, is_causal, out, lse, window_left, empty_rows, softcap, sinks);
    return;
  }
  at::Tensor q = q_in;
  if (scale < 0) {  // the kernels track the max of raw scores, which needs a non-negative scale
    q = q_in.neg();
    scale = -scale;
  }
  const auto expanded_mask = [&] { return mask->expand({q.size(0), q.size(1), q.size(2), k.size(2)}); };
  if (q.size(2) <= fa2::kDecodeMaxSeqlenQ) {
    fwd_decode(q, k, v, out, lse, scale, mask.has_value() ? std::optional<at::Tensor>(expanded_mask()) : std::nullopt,
               is_causal, window_left, softcap, sinks);
  } else if (mask.has_value()) {
    fwd_masked(q, k, v, out, lse, scale, expanded_mask(), is_causal, window_left, softcap, sinks);
  } else {
    fwd(q, k, v, out, lse, scale, is_causal, window_left, std::nullopt, softcap, sinks);
  }
  // The passes below each follow a kernel of ours on the stream and overlap its end (pdl.hpp).
  if (empty_rows == int64_t(EmptyRows::kMeanV)) {
    fill_empty_rows(out, lse, v, std::nullopt, /*after_own_kernel=*/true);
  } else if (empty_rows == int64_t(EmptyRows::kAllKeys)) {
    // Unmasked (still soft-capped) attention for the query tiles holding an empty row (the others exit at
    // once), then those rows copied over. Sinks never come here: they leave no row empty.
    auto [unmasked, unmasked_lse] = fa2::empty_outputs(q, v);
    fwd(q, k, v, unmasked, unmasked_lse, scale, false, -1, lse, softcap, std::nullopt, /*after_own_kernel=*/true);
    fill_empty_rows(out, lse, v, unmasked, /*after_own_kernel=*/true);
  }
}

// fa2_inductor::flash_attention_fwd on CUDA: the kernel where it runs the call, else the reference.
std::tuple<at::Tensor, at::Tensor> flash_attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const std::optional<at::Tensor>& mask,
                                                            double scale, bool is_causal, int64_t window_left,
                                                            int64_t empty_rows, double softcap,
                                                            const std::optional<at::Tensor>& sinks) {
  check_inputs(q, k, v, mask, is_causal, window_left, empty_rows, softcap, sinks);
  const std::optional<TensorMeta> mask_meta =
      mask.has_value() ? std::optional<TensorMeta>(TensorMeta::of(*mask)) : std::nullopt;
  const Reason reason = unsupported_reason(TensorMeta::of(q), TensorMeta::of(k), TensorMeta::of(v),
                                           mask_meta ? &*mask_meta : nullptr, is_causal, window_left, softcap,
                                           sinks.has_value());
  if (reason.has_value()) {
    return reference_fallback(*reason, q, k, v, mask, scale, is_causal, window_left, empty_rows, softcap, sinks);
  }
  c10::cuda::CUDAGuard guard(q.device());
  auto [out, lse] = fa2::empty_outputs(q, v);
  forward(q, k, v, out, lse, scale, is_causal, mask, window_left, empty_rows, softcap, sinks);
  return {out, lse};
}

// ---------------------------------------------------------------------------------------- registration

// Raised whenever a binding's arguments change, so that a build from older sources is refused at import
// (fa2_inductor/_extension.py INTERFACE_VERSION) instead of failing at its first call.
constexpr int64_t kInterfaceVersion = 9;

std::vector<std::tuple<int64_t, std::string>> compiled_kernels() {
  std::vector<std::tuple<int64_t, std::string>> result;
  for (const auto& e : kernel_table()) result.emplace_back(e.head_dim, e.dtype_name);
  return result;
}

// What every compiled kernel can take (the support rules above read the same constants).
std::map<std::string, int64_t> limits() {
  return {
      {"max_head_dim", fa2::kMaxHeadDim},
      {"max_grid_dim", fa2::kMaxGridDim},
      {"max_seqlen", kMaxSeqLen},
      {"stride_align_elements", fa2::kStrideAlignElements},
      {"mask_block_m", fa2::kMaskBlockM},
      {"decode_max_seqlen_q", fa2::kDecodeMaxSeqlenQ},
      {"additive_mask_with_causal", additive_mask_with_causal() ? 1 : 0},
  };
}

}  // namespace

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
  FA2_CHECK(t.sizes() == q.sizes() && t.scalar_type() == q.scalar_type(), fn, ": ", name,
              " must have q's shape and dtype");
  return {tma_stride(t, 0, name), tma_stride(t, 1, name), tma_stride(t, 2, name)};
}
std::array<int64_t, 3> like_kv_strides(const char* fn, const at::Tensor& t, const char* name, const at::Tensor& k) {
  check_operand(t, name, k);
  FA2_CHECK(t.sizes() == k.sizes() && t.scalar_type() == k.scalar_type(), fn, ": ", name,
              " must have k's shape and dtype");
  return {tma_stride(t, 0, name), tma_stride(t, 1, name), tma_stride(t, 2, name)};
}

// Strides of a [B, Hq, Sq, Sk] view (mask or mask gradient); size-1 dims are never stepped over, so
// they read as broadcast (0).
std::array<int64_t, 4> broadcast_strides(const char* fn, const at::Tensor& t, const char* name, const at::Tensor& q,
                                         int64_t seqlen_k) {
  FA2_CHECK(t.is_cuda() && t.device() == q.device(), fn, ": ", name, " must be on q's device");
  FA2_CHECK(t.dim() == 4 && t.size(0) == q.size(0) && t.size(1) == q.size(1) && t.size(2) == q.size(2) &&
                  t.size(3) == seqlen_k,
              fn, ": ", name, " must be expanded to [B, Hq, Sq, Sk]");
  std::array<int64_t, 4> strides;
  for (int d = 0; d < 4; ++d) {
    FA2_CHECK(t.stride(d) >= 0, fn, ": ", name, " strides must be non-negative");
    strides[d] = t.size(d) == 1 ? 0 : t.stride(d);
  }
  return strides;
}

}  // namespace

// Attention backward into preallocated dq [B,Hq,Sq,D] and dk, dv [B,Hkv,Sk,D] (any TMA-compatible
// strides). mask (optional): as fwd_masked takes it, with or without is_causal; window_left and softcap as the
// forward's (softcap not with an additive mask). dmask (optional, additive masks): float32, zeroed,
// expanded to [B,Hq,Sq,Sk] with zero strides on the dims to sum over; receives dS added in.
void bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
         const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, double scale, bool is_causal,
         bool deterministic, const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& dmask,
         int64_t window_left, double softcap) {
  constexpr const char* fn = "fa2_inductor._C.bwd";
  const fa2::FwdParams f = describe_call(fn, q, k, v, out, lse, scale);
  FA2_CHECK(f.batch > 0 && f.heads_q > 0 && f.seqlen_q > 0 && f.seqlen_k > 0, fn,
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
  // A window as long as the queries hides nothing: none (and no sum of positions overflows).
  p.window_left = check_window(fn, is_causal, window_left) >= f.seqlen_q ? -1 : int(window_left);
  p.deterministic = deterministic;
  p.num_sms = f.num_sms;
  FA2_CHECK(softcap >= 0.0 && std::isfinite(softcap), fn, ": softcap must be a finite number >= 0, got ", softcap);
  p.softcap = float(softcap);

  int variant = is_causal ? 1 : 0;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    switch (m.scalar_type()) {
      case at::kBool: p.mask_dtype = fa2::MaskDType::kBool; variant = 2; break;
      case at::kFloat: p.mask_dtype = fa2::MaskDType::kF32; variant = 3; break;
      case at::kBFloat16: p.mask_dtype = fa2::MaskDType::kBF16; variant = 3; break;
      case at::kHalf: p.mask_dtype = fa2::MaskDType::kF16; variant = 3; break;
      default: FA2_CHECK(false, fn, ": mask dtype must be bool, float32, bfloat16 or float16, got ", m.scalar_type());
    }
    static_assert(sizeof(bool) == 1, "bool masks are read as bytes");
    const auto s = broadcast_strides(fn, m, "mask", q, f.seqlen_k);
    p.mask = m.data_ptr();
    p.mask_batch_stride = s[0], p.mask_head_stride = s[1], p.mask_row_stride = s[2], p.mask_col_stride = s[3];
    const int64_t class_slices = (s[0] == 0 ? 1 : f.batch) * (s[1] == 0 ? 1 : f.heads_q);
    FA2_CHECK(class_slices <= 65535, fn, ": mask too large for the block classification grid");
  }
  FA2_CHECK(!(p.softcap > 0.f && variant == 3), fn, ": softcap together with an additive mask is not supported");
  if (dmask.has_value()) {
    FA2_CHECK(variant == 3, fn, ": dmask needs an additive mask");
    const at::Tensor& g = *dmask;
    FA2_CHECK(g.scalar_type() == at::kFloat, fn, ": dmask must be float32");
    const auto s = broadcast_strides(fn, g, "dmask", q, f.seqlen_k);
    p.dmask = g.data_ptr<float>();
    p.dmask_batch_stride = s[0], p.dmask_head_stride = s[1], p.dmask_row_stride = s[2], p.dmask_col_stride = s[3];
  }

  const fa2::DType dtype = q.scalar_type() == at::kBFloat16 ? fa2::DType::kBF16 : fa2::DType::kFP16;
  const BwdKernelEntry* entry = entry_for_head_dim(bwd_kernel_table(), f.head_dim, dtype);
  FA2_CHECK(entry != nullptr, fn, ": no kernel compiled for head dim ", f.head_dim, " and dtype ", q.scalar_type());
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor workspace = at::empty({entry->workspace[variant](p)}, q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  check_launch(fn, entry->run[variant](p, c10::cuda::getCurrentCUDAStream().stream()));
}

// ------------------------------------------------------------------------------------------ backward op

namespace {

// None when our backward kernel runs the call, else a short reason: what the forward kernels cover (masks,
// causal positions and windows, alone or together; soft-capping), less soft-capping with an additive mask.
// Sinks need nothing of the kernel: the LSE holds them and fa2::sinks_gradient gives theirs. The one
// place that decides it: the op's CUDA implementation below, and through fa2_inductor._cuda the graph pass.
Reason backward_unsupported_reason(const TensorMeta& grad_out, const TensorMeta& q, const TensorMeta& k,
                                   const TensorMeta& v, const TensorMeta& out, const TensorMeta* mask, bool is_causal,
                                   bool compute_mask_grad, int64_t window_left, double softcap, bool has_sinks,
                                   bool deterministic) {
  const char* disabled = std::getenv("FA2_INDUCTOR_DISABLE_BACKWARD_KERNEL");
  if (disabled != nullptr && std::strcmp(disabled, "1") == 0) {
    return "backward kernel disabled (FA2_INDUCTOR_DISABLE_BACKWARD_KERNEL=1)";
  }
  if (softcap > 0.0 && mask != nullptr && mask->dtype != at::kBool) {
    return "softcap with an additive mask (the backward kernel recovers capped scores from P, which the mask shifts)";
  }
  // Every backward kernel takes the causal positions and a window, with or without a mask, so the forward's
  // rules are asked of the positions and of the mask apart (its additive-mask kernels may have no causal
  // instantiation).
  Reason reason = unsupported_reason(q, k, v, nullptr, is_causal, window_left, softcap, has_sinks);
  if (!reason.has_value() && mask != nullptr) reason = unsupported_reason(q, k, v, mask, false, -1, softcap, has_sinks);
  if (reason.has_value()) return reason;
  // A build may hold a head dim's forward without a backward to run it (FA2_INDUCTOR_HEAD_DIMS=96 alone).
  const fa2::DType dtype = *kernel_dtype(q.dtype);
  if (entry_for_head_dim(bwd_kernel_table(), q.sizes[3], dtype) == nullptr) {
    return join("no backward kernel compiled for head dim ", q.sizes[3], " ", kernel_dtype_name(dtype));
  }
  for (const auto& [name, t] : {std::pair<const char*, const TensorMeta*>{"grad_out", &grad_out}, {"out", &out}}) {
    if (!t->sizes.equals(q.sizes) || t->dtype != q.dtype || t->device != q.device) {
      return std::string(name) + " does not match q";
    }
  }
  if (q.sizes[1] / k.sizes[1] >= fa2::kMaxHeadRatio) {
    return join("more than ", fa2::kMaxHeadRatio - 1, " query heads per kv head");
  }
  if (compute_mask_grad && deterministic && mask != nullptr) {
    // Deterministic mode adds each dS element into dmask once: no sum over a broadcast dim.
    const std::array<int64_t, 4> full{q.sizes[0], q.sizes[1], q.sizes[2], k.sizes[2]};
    const int64_t missing = 4 - mask->dim();
    for (int64_t d = 0; d < 4; ++d) {
      const int64_t size = d < missing ? 1 : mask->sizes[d - missing];
      if (size == 1 && full[d] > 1) return "deterministic mask gradient summed over broadcast dims";
    }
  }
  return std::nullopt;
}

Reason backward_kernel_unsupported_reason(const TensorMetaArgs& grad_out, const TensorMetaArgs& q,
                                          const TensorMetaArgs& k, const TensorMetaArgs& v, const TensorMetaArgs& out,
                                          const std::optional<TensorMetaArgs>& mask, bool is_causal,
                                          bool compute_mask_grad, int64_t window_left, double softcap, bool has_sinks,
                                          bool deterministic) {
  const std::optional<TensorMeta> mask_meta = mask.has_value() ? std::optional<TensorMeta>(meta_of(*mask)) : std::nullopt;
  return backward_unsupported_reason(meta_of(grad_out), meta_of(q), meta_of(k), meta_of(v), meta_of(out),
                                     mask_meta ? &*mask_meta : nullptr, is_causal, compute_mask_grad, window_left,
                                     softcap, has_sinks, deterministic);
}

using fa2::BwdOutputs;

// PyTorch's flash-attention backward, aten::_flash_attention_backward, or nullopt in a torch without it. Called
// boxed, by name and along its schema's own argument list: the schema differs between torch releases, so a
// typed call compiled against one would not fit another.
const std::optional<c10::OperatorHandle>& flash_backward_op() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"aten::_flash_attention_backward", ""});
  return op;
}

bool flash_backward_takes_window() {
  static const bool takes = flash_backward_op().has_value() &&
                            flash_backward_op()->schema().argumentIndexWithName("window_size_left").has_value();
  return takes;
}

// Whether PyTorch's flash backward (flash_backward) runs a call our backward kernel does not, with our LSE:
// the rule of fa2_inductor._cuda.flash_backward_unsupported_reason, which the graph pass and installs without
// this module ask.
bool flash_backward_runs(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& mask,
                         bool is_causal, int64_t window_left, double softcap) {
  if (mask.has_value() || softcap != 0) return false;  // it has neither
  if (window_left != -1 && !flash_backward_takes_window()) return false;
  if (!q.is_cuda() || (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf)) return false;
  if (!flash_backward_op().has_value()) return false;
  if (device_attribute<cudaDevAttrComputeCapabilityMajor>(q.get_device()) < 8) return false;
  const int64_t d = q.size(3);
  if (d > 256 || d % 8 != 0) return false;
  if (q.size(2) == 0 || k.size(2) == 0) return false;
  // It aligns a causal mask bottom-right when Sq != Sk; ours is top-left.
  return !is_causal || q.size(2) == k.size(2);
}

// (dq, dk, dv) from PyTorch's flash backward fed with our LSE, for calls flash_backward_runs accepts: the
// arguments fa2_inductor._cuda.backward passes (tensors as [B, S, H, D], GQA handled inside; no dropout, so
// no rng state), a causal window as its window_size_left with window_size_right = 0 (the diagonal).
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                              const at::Tensor& k, const at::Tensor& v,
                                                              const at::Tensor& out, const at::Tensor& lse,
                                                              double scale, bool is_causal, int64_t window_left) {
  const c10::OperatorHandle& op = *flash_backward_op();
  const at::Tensor no_rng = at::empty({}, at::TensorOptions().dtype(at::kLong));
  // grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k (none: not a varlen call), max_q, max_k,
  // dropout_p, is_causal and the two rng tensors; the keyword arguments by name, at their schema positions.
  const std::vector<c10::IValue> positional{
      grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
      lse.contiguous(), at::Tensor(), at::Tensor(), q.size(2), k.size(2), 0.0, is_causal, no_rng, no_rng};
  size_t next_positional = 0;
  torch::jit::Stack stack;
  for (const c10::Argument& argument : op.schema().arguments()) {
    if (!argument.kwarg_only()) {
      FA2_CHECK(next_positional < positional.size(), "fa2_inductor: aten::_flash_attention_backward takes more than ",
                positional.size(), " positional arguments");
      stack.push_back(positional[next_positional++]);
    } else if (argument.name() == "scale") {
      stack.emplace_back(scale);
    } else if (argument.name() == "window_size_left" && window_left != -1) {
      stack.emplace_back(window_left);
    } else if (argument.name() == "window_size_right" && window_left != -1) {
      stack.emplace_back(int64_t(0));
    } else {
      FA2_CHECK(argument.default_value().has_value(), "fa2_inductor: aten::_flash_attention_backward's argument ",
                argument.name(), " has no default");
      stack.push_back(*argument.default_value());
    }
  }
  FA2_CHECK(next_positional == positional.size(), "fa2_inductor: aten::_flash_attention_backward takes fewer than ",
            positional.size(), " positional arguments");
  op.callBoxed(stack);
  return {stack[0].toTensor().transpose(1, 2), stack[1].toTensor().transpose(1, 2),
          stack[2].toTensor().transpose(1, 2)};
}

// The backward op's outputs where our backward kernel does not run the call (counted under
// backward_fallback:<reason>): PyTorch's flash backward where it can, with fa2::sinks_gradient for the sinks
// (the LSE holds them), else the reference (announced as a reference fallback).
BwdOutputs backward_fallback(const std::string& reason, const at::Tensor& grad_out, const at::Tensor& q,
                             const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                             const std::optional<at::Tensor>& mask, double scale, bool is_causal,
                             bool compute_mask_grad, int64_t window_left, double softcap,
                             const std::optional<at::Tensor>& sinks) {
  note_backward_fallback(reason);
  if (compute_mask_grad || !flash_backward_runs(q, k, mask, is_causal, window_left, softcap)) {
    note_reference_fallback("backward: " + reason);
    return fa2::reference_backward(grad_out, q, k, v, out, lse, mask, scale, is_causal, compute_mask_grad,
                                   window_left, softcap, sinks);
  }
  c10::cuda::CUDAGuard guard(q.device());
  auto [dq, dk, dv] = flash_backward(grad_out, q, k, v, out, lse, scale, is_causal, window_left);
  at::Tensor dsinks = sinks.has_value() ? fa2::sinks_gradient(grad_out, out, lse, *sinks) : q.new_empty({0});
  return {dq.contiguous(), dk.contiguous(), dv.contiguous(), q.new_empty({0}), dsinks};
}

// Whether the current stream is capturing a CUDA graph, in which nothing may wait for the device.
bool capturing_cuda_graph() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// Whether the forward filled any row (lse -inf), found without idling the GPU: the check and its copy to host
// memory are queued when the probe is made, before the backward's kernels, and any() waits for those two
// alone, while the kernels queued after them keep the GPU busy (waiting after the kernels would drain the
// queue on every call: design.md §2).
class FilledRowsProbe {
 public:
  explicit FilledRowsProbe(const at::Tensor& lse)
      : host_(at::empty({}, at::TensorOptions().dtype(at::kBool).pinned_memory(true))) {
    host_.copy_(at::isneginf(lse).any(), /*non_blocking=*/true);
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(copied_, c10::cuda::getCurrentCUDAStream().stream()));
  }
  FilledRowsProbe(const FilledRowsProbe&) = delete;
  FilledRowsProbe& operator=(const FilledRowsProbe&) = delete;
  ~FilledRowsProbe() { cudaEventDestroy(copied_); }

  bool any() const {
    C10_CUDA_CHECK(cudaEventSynchronize(copied_));
    return host_.item<bool>();
  }

 private:
  at::Tensor host_;
  cudaEvent_t copied_ = nullptr;
};

// The backward's outputs with the gradients of the rows the forward filled (fa2::with_filled_row_gradients),
// where the probe found any; while a CUDA graph is captured (no probe: nothing may wait) at every position.
BwdOutputs with_filled_rows(BwdOutputs outputs, const std::optional<FilledRowsProbe>& probe,
                            const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse, double scale, int64_t empty_rows,
                            double softcap) {
  if (empty_rows == int64_t(EmptyRows::kZero) || (probe.has_value() && !probe->any())) return outputs;
  return fa2::with_filled_row_gradients(std::move(outputs), grad_out, q, k, v, out, lse, scale, empty_rows, softcap,
                                        /*capturing=*/!probe.has_value());
}

// The tensor if TMA can read it as it is, else a contiguous copy (autograd may hand over any layout, e.g. the
// zero strides of a sum's gradient).
at::Tensor tma_readable(const at::Tensor& t) {
  return layout_reason("t", TensorMeta::of(t)).has_value() ? t.contiguous() : t;
}

// fa2_inductor::flash_attention_bwd on CUDA: our backward kernel where it runs the call, else backward_fallback
// (PyTorch's flash backward or the reference, counted). Deterministic (bit-identical run to run) under
// torch.use_deterministic_algorithms(True).
BwdOutputs flash_attention_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                    const std::optional<at::Tensor>& mask, double scale, bool is_causal,
                                    bool compute_mask_grad, int64_t window_left, double softcap,
                                    const std::optional<at::Tensor>& sinks, int64_t empty_rows) {
  FA2_CHECK(mask.has_value() || !compute_mask_grad, "flash_attention_bwd: compute_mask_grad needs an attn_mask");
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  c10::cuda::CUDAGuard guard(q.device());
  std::optional<FilledRowsProbe> probe;
  if (empty_rows != int64_t(EmptyRows::kZero) && !capturing_cuda_graph()) probe.emplace(lse);
  const std::optional<TensorMeta> mask_meta =
      mask.has_value() ? std::optional<TensorMeta>(TensorMeta::of(*mask)) : std::nullopt;
  const Reason reason = backward_unsupported_reason(
      TensorMeta::of(grad_out), TensorMeta::of(q), TensorMeta::of(k), TensorMeta::of(v), TensorMeta::of(out),
      mask_meta ? &*mask_meta : nullptr, is_causal, compute_mask_grad, window_left, softcap, sinks.has_value(),
      deterministic);
  if (reason.has_value()) {
    return with_filled_rows(backward_fallback(*reason, grad_out, q, k, v, out, lse, mask, scale, is_causal,
                                              compute_mask_grad, window_left, softcap, sinks),
                            probe, grad_out, q, k, v, out, lse, scale, empty_rows, softcap);
  }
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  std::optional<at::Tensor> dmask_sum;  // float32, the mask's shape padded to 4-D
  if (compute_mask_grad) {
    std::vector<int64_t> shape(size_t(4 - mask->dim()), 1);
    shape.insert(shape.end(), mask->sizes().begin(), mask->sizes().end());
    dmask_sum = at::zeros(shape, q.options().dtype(at::kFloat));
  }
  const std::vector<int64_t> full{q.size(0), q.size(1), q.size(2), k.size(2)};
  if (full[0] * full[1] * full[2] == 0 || full[3] == 0) {  // nothing to attend: every gradient is zero (or empty)
    dq.zero_();
    dk.zero_();
    dv.zero_();
  } else {
    const std::optional<at::Tensor> expanded_mask =
        mask.has_value() ? std::optional<at::Tensor>(mask->expand(full)) : std::nullopt;
    const std::optional<at::Tensor> expanded_dmask =
        dmask_sum.has_value() ? std::optional<at::Tensor>(dmask_sum->expand(full)) : std::nullopt;
    bwd(tma_readable(grad_out), q, k, v, tma_readable(out), lse, dq, dk, dv, scale, is_causal, deterministic,
        expanded_mask, expanded_dmask, window_left, softcap);
  }
  at::Tensor dmask = dmask_sum.has_value() ? dmask_sum->reshape(mask->sizes()).to(mask->scalar_type())
                                           : q.new_empty({0});
  at::Tensor dsinks = sinks.has_value() ? fa2::sinks_gradient(grad_out, out, lse, *sinks) : q.new_empty({0});
  return with_filled_rows({dq, dk, dv, dmask, dsinks}, probe, grad_out, q, k, v, out, lse, scale, empty_rows, softcap);
}

}  // namespace

void register_bwd(pybind11::module_& m) {
  m.def("bwd", &bwd,
        "Attention backward into preallocated dq, dk, dv (optional mask as fwd_masked takes it, optional float32 "
        "dmask accumulator)",
        pybind11::arg("dout"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"),
        pybind11::arg("lse"), pybind11::arg("dq"), pybind11::arg("dk"), pybind11::arg("dv"), pybind11::arg("scale"),
        pybind11::arg("is_causal"), pybind11::arg("deterministic"), pybind11::arg("mask") = pybind11::none(),
        pybind11::arg("dmask") = pybind11::none(), pybind11::arg("window_left") = -1,
        pybind11::arg("softcap") = 0.0);
  m.def("backward_kernel_unsupported_reason", &backward_kernel_unsupported_reason,
        "None when the backward kernel runs the call, else why not; tensors as kernel_unsupported_reason takes them",
        pybind11::arg("grad_out"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"),
        pybind11::arg("attn_mask"), pybind11::arg("is_causal"), pybind11::arg("compute_mask_grad"),
        pybind11::arg("window_left"), pybind11::arg("softcap"), pybind11::arg("has_sinks"),
        pybind11::arg("deterministic"));
}
// ===== end of the backward kernel binding ========================================================

// ------------------------------------------------------------------------------------ autograd (CUDA)

namespace {

using FwdOpSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                          const std::optional<at::Tensor>&, double, bool, int64_t,
                                                          int64_t, double, const std::optional<at::Tensor>&);
using BwdOpSignature = BwdOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double, bool,
                                  bool, int64_t, double, const std::optional<at::Tensor>&, int64_t);

// The ops through the dispatcher (their schemas are Python's, defined once fa2_inductor.ops has imported).
const c10::TypedOperatorHandle<FwdOpSignature>& fwd_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fa2_inductor::flash_attention_fwd", "")
                                 .typed<FwdOpSignature>();
  return handle;
}
const c10::TypedOperatorHandle<BwdOpSignature>& bwd_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fa2_inductor::flash_attention_bwd", "")
                                 .typed<BwdOpSignature>();
  return handle;
}

// flash_attention_fwd's autograd for CUDA tensors: ops.py's register_autograd formula (_setup_context and
// _backward, which every other device and a build without this module keep), here without Python's
// autograd machinery on each call. Both ops are called through the dispatcher below autograd, so tracing
// (fake tensors, AOTAutograd) records them as it records the Python formula's calls.
struct FlashAttentionAutograd : public torch::autograd::Function<FlashAttentionAutograd> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v,
                                                const std::optional<at::Tensor>& mask, double scale, bool is_causal,
                                                int64_t window_left, int64_t empty_rows, double softcap,
                                                const std::optional<at::Tensor>& sinks) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = fwd_op().call(q, k, v, mask, scale, is_causal, window_left, empty_rows, softcap, sinks);
    ctx->save_for_backward({q, k, v, out, lse, mask.value_or(at::Tensor()), sinks.value_or(at::Tensor())});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["empty_rows"] = empty_rows;
    ctx->saved_data["softcap"] = softcap;
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);  // no zero-filled gradient for the LSE (a kernel launch per backward)
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor none;
    if (!grads[0].defined()) return torch::autograd::variable_list(10, none);  // the output's gradient is zero
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const std::optional<at::Tensor> mask = saved[5].defined() ? std::optional<at::Tensor>(saved[5]) : std::nullopt;
    const std::optional<at::Tensor> sinks = saved[6].defined() ? std::optional<at::Tensor>(saved[6]) : std::nullopt;
    // needs_input_grad counts the tensor inputs present: q, k, v, then the mask and the sinks where given.
    const bool mask_grad = mask.has_value() && ctx->needs_input_grad(3);
    const bool sinks_grad = sinks.has_value() && ctx->needs_input_grad(mask.has_value() ? 4 : 3);
    auto [dq, dk, dv, dmask, dsinks] =
        bwd_op().call(grads[0], q, k, v, out, lse, mask, ctx->saved_data["scale"].toDouble(),
                      ctx->saved_data["is_causal"].toBool(), mask_grad, ctx->saved_data["window_left"].toInt(),
                      ctx->saved_data["softcap"].toDouble(), sinks, ctx->saved_data["empty_rows"].toInt());
    // One gradient per forward argument: q, k, v, attn_mask, scale, is_causal, window_left, empty_rows,
    // softcap, sinks.
    return {dq, dk, dv, mask_grad ? dmask : none, none, none, none, none, none, sinks_grad ? dsinks : none};
  }
};

std::tuple<at::Tensor, at::Tensor> flash_attention_fwd_autograd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
    double scale, bool is_causal, int64_t window_left, int64_t empty_rows, double softcap,
    const std::optional<at::Tensor>& sinks) {
  const torch::autograd::variable_list outputs =
      FlashAttentionAutograd::apply(q, k, v, mask, scale, is_causal, window_left, empty_rows, softcap, sinks);
  return {outputs[0], outputs[1]};
}

}  // namespace

// flash_attention_fwd's autograd for CUDA tensors (a dispatch key of its own, so it takes precedence over the
// Autograd kernel ops.py registers for every device).
TORCH_LIBRARY_IMPL(fa2_inductor, AutogradCUDA, m) {
  m.impl("flash_attention_fwd", TORCH_FN(flash_attention_fwd_autograd_cuda));
}

// The op's CUDA implementations (fa2_inductor/ops.py registers its Python CUDA kernels only where none is
// registered here: installs without this module).
TORCH_LIBRARY_IMPL(fa2_inductor, CUDA, m) {
  m.impl("flash_attention_fwd", TORCH_FN(flash_attention_fwd_cuda));
  m.impl("flash_attention_bwd", TORCH_FN(flash_attention_bwd_cuda));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "fa2_inductor Hopper (sm_90a) FlashAttention forward kernel";
  m.def("fwd",
        [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
           double scale, bool is_causal, int64_t window_left, const std::optional<at::Tensor>& rows_filter,
           double softcap, const std::optional<at::Tensor>& sinks) {
          fwd(q, k, v, out, lse, scale, is_causal, window_left, rows_filter, softcap, sinks);
        },
        "Attention forward into preallocated out [B,Hq,Sq,D] and lse [B,Hq,Sq] (float32)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("scale"),
        py::arg("is_causal"), py::arg("window_left"), py::arg("rows_filter") = py::none(), py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none());
  m.def("fwd_masked", &fwd_masked,
        "Masked attention forward (mask expanded to [B,Hq,Sq,Sk]: bool = attend, or additive float32/bf16/fp16)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("scale"), py::arg("mask"),
        py::arg("is_causal"), py::arg("window_left"), py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("fwd_decode", &fwd_decode,
        "Split-KV forward for at most 16 query rows (optional mask expanded to [B,Hq,Sq,Sk] as fwd_masked takes it)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("scale"),
        py::arg("mask") = py::none(), py::arg("is_causal") = false, py::arg("window_left") = -1,
        py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("fill_empty_rows",
        [](at::Tensor& out, const at::Tensor& lse, const at::Tensor& v, const std::optional<at::Tensor>& source) {
          fill_empty_rows(out, lse, v, source);
        },
        "Rows with lse = -inf get the mean of V over all keys, or source's rows when given",
        py::arg("out"), py::arg("lse"), py::arg("v"), py::arg("source") = py::none());
  m.def("forward", &forward,
        "The op's CUDA path into preallocated out and lse (for calls kernel_unsupported_reason accepts): special "
        "cases, mask broadcast, empty_rows policies",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("scale"),
        py::arg("is_causal"), py::arg("attn_mask"), py::arg("window_left"), py::arg("empty_rows"),
        py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("kernel_unsupported_reason", &kernel_unsupported_reason,
        "None when the kernel runs the call, else why not; tensors as (sizes, strides, dtype, device, address or None)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("attn_mask"), py::arg("is_causal"), py::arg("window_left"),
        py::arg("softcap") = 0.0, py::arg("has_sinks") = false);
  m.def("set_reference_hooks", &set_reference_hooks,
        "The Python the CUDA implementations notify: note_fallback(reason) where a call runs the reference (a "
        "backward's reason as 'backward: <reason>'), note_backward_fallback(reason) where our backward kernel "
        "does not run a backward call",
        py::arg("note_fallback"), py::arg("note_backward_fallback"));
  m.def("compiled_kernels", &compiled_kernels, "List of (head_dim, dtype_name) compiled into this build");
  m.def("interface_version", [] { return kInterfaceVersion; },
        "The version of these bindings' arguments (fa2_inductor._extension refuses a build of another)");
  m.def("limits", &limits, "The limits every compiled kernel shares");
  m.def("set_persistent_grid", &set_persistent_grid,
        "Persistent kernels, forward and backward (one CTA per SM, the default), on or off (one CTA per tile)",
        py::arg("on"));
  register_bwd(m);  // the backward kernel binding's one line here
}
