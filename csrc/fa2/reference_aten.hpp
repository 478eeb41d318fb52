// The op's forward and backward from ATen ops alone: what a CUDA call the kernels do not run computes where no
// Python is there (a deployed model). A port of fa2_inductor/reference.py's attention_forward and
// attention_backward (with backward_outputs and with_filled_row_gradients), function by function and op by op,
// so that both give the same numbers: reference.py stays the definition, and tests/test_reference_aten.py
// compares the two on CPU. Runs on whatever device the tensors are on.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace fa2 {

// The op's empty_rows values (reference.EmptyRows); what each means is in the op's docs.
enum class EmptyRows : int64_t { kZero = 0, kMeanV = 1, kAllKeys = 2 };
constexpr int64_t kEmptyRowsCount = 3;

// Uninitialised (out, lse) with the layout every implementation returns (reference.empty_outputs): out
// [B, Hq, Sq, Dv] with the strides of a [B, Sq, Hq, Dv] buffer, lse contiguous float32 [B, Hq, Sq].
inline std::tuple<at::Tensor, at::Tensor> empty_outputs(const at::Tensor& q, const at::Tensor& v) {
  const int64_t b = q.size(0), hq = q.size(1), sq = q.size(2), dv = v.size(3);
  at::Tensor out = at::empty({b, sq, hq, dv}, q.options()).transpose(1, 2);
  at::Tensor lse = at::empty({b, hq, sq}, q.options().dtype(at::kFloat));
  return {out, lse};
}

// Defined at the end; ALL_KEYS reruns it over all keys.
inline void reference_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& mask, double scale, bool is_causal, at::Tensor& out,
                              at::Tensor& lse, int64_t window_left, int64_t empty_rows, double softcap,
                              const std::optional<at::Tensor>& sinks);

namespace reference_detail {

// The bound on the scores one query block holds (reference._MAX_BLOCK_SCORES, 256 MiB of float32). The same
// blocks give the same matmul shapes, and a matmul's rounding may depend on its shape.
constexpr int64_t kMaxBlockScores = int64_t(1) << 26;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The query rows [start, stop) of one block (reference.py's slice).
struct Rows {
  int64_t start, stop;
};

inline at::ScalarType accumulation_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// Rows per block (reference._query_blocks); Sk = 0 counts as one key, leaving nothing to divide by 0.
inline int64_t query_block_rows(int64_t batch, int64_t heads, int64_t seq_q, int64_t seq_k) {
  const int64_t per_row = std::max<int64_t>(1, batch * heads * std::max<int64_t>(seq_k, 1));
  return std::max<int64_t>(1, std::min(seq_q, kMaxBlockScores / per_row));
}

// [B, Hq, S, X] -> [B, Hkv, G, S, X]: GQA as a view, so K and V are never repeated.
inline at::Tensor group_view(const at::Tensor& x, int64_t kv_heads) {
  return x.unflatten(1, {kv_heads, x.size(1) / kv_heads});
}

// 0 where visible, -inf elsewhere: how a bool mask and the causal positions join the scores.
inline at::Tensor visibility_bias(const at::Tensor& visible, at::ScalarType dtype) {
  return at::where(visible, at::zeros({}, visible.options().dtype(dtype)), kNegInf);
}

// The mask's bias for one block, [B|1, Hkv|1, G|1, rows|1, Sk]: a mask of fewer dims broadcasts from the
// right, like any 2-D/3-D/4-D mask against [B, Hq, Sq, Sk]; its heads split into (Hkv, G) like the queries'.
inline std::optional<at::Tensor> mask_block(const std::optional<at::Tensor>& attn_mask, Rows rows, int64_t heads,
                                            int64_t kv_heads, at::ScalarType dtype) {
  if (!attn_mask.has_value()) return std::nullopt;
  at::Tensor mask = *attn_mask;
  while (mask.dim() < 4) mask = mask.unsqueeze(0);
  if (mask.size(2) != 1) mask = mask.slice(2, rows.start, rows.stop);
  mask = mask.size(1) == 1 ? mask.unsqueeze(2) : mask.unflatten(1, {kv_heads, heads / kv_heads});
  if (mask.scalar_type() == at::kBool) return visibility_bias(mask, dtype);
  return mask.to(dtype);
}

// Top-left causal: query i sees keys j <= i and, with window_left >= 0, none before i - window_left.
inline at::Tensor causal_bias(Rows rows, int64_t seq_k, int64_t window_left, const at::Device& device,
                              at::ScalarType dtype) {
  const auto positions = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor q_pos = at::arange(rows.start, rows.stop, positions).unsqueeze(1);
  const at::Tensor k_pos = at::arange(seq_k, positions).unsqueeze(0);
  at::Tensor visible = k_pos <= q_pos;
  if (window_left >= 0) visible &= k_pos >= q_pos - window_left;
  return visibility_bias(visible, dtype);
}

// One block's scaled scores, soft-capped (before any mask, as the kernels do): [B, Hkv, G, rows, Sk].
inline at::Tensor capped_scores(const at::Tensor& q, const at::Tensor& k, double scale, double softcap, Rows rows,
                                int64_t kv_heads, at::ScalarType acc) {
  at::Tensor scores = at::matmul(group_view(q.slice(2, rows.start, rows.stop), kv_heads).to(acc),
                                 k.to(acc).unsqueeze(2).transpose(-1, -2));
  scores = scores * scale;
  return softcap != 0 ? softcap * at::tanh(scores / softcap) : scores;
}

// One block's scores with the mask's bias and then the causal one added (the order reference.py adds them).
inline at::Tensor masked(at::Tensor scores, const std::optional<at::Tensor>& attn_mask, bool is_causal,
                         int64_t window_left, Rows rows, int64_t heads, int64_t seq_k, int64_t kv_heads,
                         at::ScalarType acc) {
  if (const auto bias = mask_block(attn_mask, rows, heads, kv_heads, acc)) scores = scores + *bias;
  if (is_causal) scores = scores + causal_bias(rows, seq_k, window_left, scores.device(), acc);
  return scores;
}

// [Hq] sink logits as [1, Hkv, G, 1, 1], to broadcast against a block's row statistics.
inline std::optional<at::Tensor> sink_logits(const std::optional<at::Tensor>& sinks, int64_t kv_heads,
                                             at::ScalarType acc) {
  if (!sinks.has_value()) return std::nullopt;
  return sinks->to(acc).reshape({1, kv_heads, -1, 1, 1});
}

// A row sum to divide by: 1 where the row has nothing (no visible key, no sink), so its values stay 0.
inline at::Tensor divisor(const at::Tensor& row_sum) {
  return at::where(row_sum > 0, row_sum, at::ones_like(row_sum));
}

struct ShiftedExp {
  at::Tensor probs, finite_max, row_sum;
};

// exp(scores - row max), the max, and the row sum with the sink's share. A row with no finite score (all
// masked, or no key) shifts by 0, so its exps are 0 rather than NaN (-inf - -inf).
inline ShiftedExp shifted_exp(const at::Tensor& scores, const std::optional<at::Tensor>& sink) {
  at::Tensor row_max;
  if (scores.size(-1) == 0) {  // amax has nothing to reduce
    std::vector<int64_t> shape = scores.sizes().vec();
    shape.back() = 1;
    row_max = scores.new_full(shape, kNegInf);
  } else {
    row_max = scores.amax({-1}, /*keepdim=*/true);
  }
  if (sink.has_value()) row_max = at::maximum(row_max, *sink);
  const at::Tensor finite_max = at::where(at::isfinite(row_max), row_max, at::zeros_like(row_max));
  const at::Tensor probs = at::exp(scores - finite_max);
  at::Tensor row_sum = probs.sum({-1}, /*keepdim=*/true);
  if (sink.has_value()) row_sum = row_sum + at::exp(*sink - finite_max);
  return {probs, finite_max, row_sum};
}

// Rows with lse = -inf get the mean of V over all keys (MEAN_V) or attention over all keys, soft-capped like
// the call but without sinks (ALL_KEYS).
inline void fill_empty_rows(at::Tensor& out, const at::Tensor& lse, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, double scale, int64_t empty_rows, double softcap) {
  const at::Tensor empty = at::isneginf(lse).unsqueeze(-1);
  at::Tensor filled;
  if (empty_rows == int64_t(EmptyRows::kMeanV)) {
    const int64_t group = out.size(1) / v.size(1);
    filled = v.to(accumulation_dtype(v.scalar_type())).mean({2}).repeat_interleave(group, 1).unsqueeze(2);
  } else {
    filled = std::get<0>(empty_outputs(q, v));
    at::Tensor unused_lse = at::empty_like(lse);
    reference_forward(q, k, v, std::nullopt, scale, false, filled, unused_lse, -1, int64_t(EmptyRows::kZero), softcap,
                      std::nullopt);
  }
  out.copy_(at::where(empty, filled.to(out.scalar_type()), out));
}

}  // namespace reference_detail

// softmax(q kᵀ · scale + mask) v into out ([B, Hq, Sq, Dv], any strides) and its natural-log LSE into lse
// (float32 [B, Hq, Sq]); the arguments as the op takes them, already checked. Computed in float32 (float64
// stays float64), one block of query rows at a time.
inline void reference_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& mask, double scale, bool is_causal, at::Tensor& out,
                              at::Tensor& lse, int64_t window_left, int64_t empty_rows, double softcap,
                              const std::optional<at::Tensor>& sinks) {
  namespace detail = reference_detail;
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2);
  const int64_t kv_heads = k.size(1), seq_k = k.size(2);
  const at::ScalarType acc = detail::accumulation_dtype(q.scalar_type());
  const at::Tensor v_acc = v.to(acc).unsqueeze(2);
  const std::optional<at::Tensor> sink = detail::sink_logits(sinks, kv_heads, acc);
  const int64_t block = detail::query_block_rows(batch, heads, seq_q, seq_k);
  for (int64_t start = 0; start < seq_q; start += block) {
    const detail::Rows rows{start, std::min(start + block, seq_q)};
    at::Tensor scores = detail::capped_scores(q, k, scale, softcap, rows, kv_heads, acc);
    scores = detail::masked(scores, mask, is_causal, window_left, rows, heads, seq_k, kv_heads, acc);
    const detail::ShiftedExp e = detail::shifted_exp(scores, sink);
    // A row with nothing visible and no sink: out 0, lse -inf.
    const at::Tensor block_out = at::matmul(e.probs, v_acc) / detail::divisor(e.row_sum);
    const at::Tensor block_lse = (e.finite_max + at::log(e.row_sum)).squeeze(-1);
    out.slice(2, rows.start, rows.stop).copy_(block_out.flatten(1, 2).to(out.scalar_type()));
    lse.slice(2, rows.start, rows.stop).copy_(block_lse.flatten(1, 2).to(lse.scalar_type()));
  }
  if (empty_rows != int64_t(EmptyRows::kZero) && seq_k > 0) {
    detail::fill_empty_rows(out, lse, q, k, v, scale, empty_rows, softcap);
  }
}

namespace reference_detail {

// Softmax probabilities of scores under the forward's float32 row_lse (reference._probabilities). Where row_lse
// is these scores' own, rounded, the row is normalised here in full precision (float64 stays exact, and a row
// filled with finfo.min everywhere, whose lse lost log(row sum), stays right); else (an lse over more keys, as
// a ring step passes) P = exp(scores - lse). Rows with lse -inf get none.
inline at::Tensor probabilities(const at::Tensor& scores, const at::Tensor& row_lse) {
  const ShiftedExp local = shifted_exp(scores, std::nullopt);
  const at::Tensor own = (local.finite_max + at::log(local.row_sum)).to(row_lse.scalar_type()) == row_lse;
  const at::Tensor lse = row_lse.to(scores.scalar_type());
  const at::Tensor finite = at::isfinite(lse);
  const at::Tensor from_lse = at::exp(scores - at::where(finite, lse, at::zeros_like(lse)));
  return at::where(own, local.probs / divisor(local.row_sum), at::where(finite, from_lse, at::zeros_like(from_lse)));
}

// A [B, Hq, Sq, Sk] gradient summed over the dims the mask was broadcast along (reference._reduce_to_shape):
// the leading dims it lacks, then its size-1 dims, kept.
inline at::Tensor reduce_to_shape(at::Tensor grad, c10::IntArrayRef shape) {
  const int64_t extra = grad.dim() - int64_t(shape.size());
  if (extra > 0) {
    std::vector<int64_t> leading;
    for (int64_t i = 0; i < extra; ++i) leading.push_back(i);
    grad = grad.sum(leading);
  }
  std::vector<int64_t> broadcast;
  for (int64_t i = 0; i < int64_t(shape.size()); ++i) {
    if (shape[i] == 1 && grad.size(i) != 1) broadcast.push_back(i);
  }
  return broadcast.empty() ? grad : grad.sum(broadcast, /*keepdim=*/true);
}

// One block's share of dV (P^T dO) and its scores' gradient, the softmax's: P * (dO V^T - rowsum(dO * O))
// (reference._score_gradients).
inline std::tuple<at::Tensor, at::Tensor> score_gradients(const at::Tensor& probs, const at::Tensor& d_out,
                                                          const at::Tensor& v_acc, const at::Tensor& row_delta) {
  at::Tensor d_v = at::matmul(probs.transpose(-1, -2), d_out);
  const at::Tensor d_probs = at::matmul(d_out, v_acc.transpose(-1, -2));
  return {d_v, probs * (d_probs - row_delta)};
}

// One block's dQ ([B, Hq, rows, D]) and share of dK from its scores' gradient, through the soft-cap's slope
// d(cap * tanh(x / cap)) / dx = 1 - (capped / cap)^2 (reference._query_key_gradients).
inline std::tuple<at::Tensor, at::Tensor> query_key_gradients(at::Tensor d_scores, const at::Tensor& capped,
                                                              double softcap, const at::Tensor& k_acc,
                                                              const at::Tensor& q_block, double scale) {
  if (softcap != 0) d_scores = d_scores * (1 - at::pow(capped / softcap, 2));
  at::Tensor d_q = at::matmul(d_scores, k_acc).flatten(1, 2) * scale;
  return {d_q, at::matmul(d_scores.transpose(-1, -2), q_block) * scale};
}

}  // namespace reference_detail

// The backward op's outputs: dq, dk, dv, dmask (empty unless asked for), dsinks (empty without sinks).
using BwdOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The gradients of out (reference.attention_backward as reference.backward_outputs returns them: contiguous,
// dmask and dsinks empty where not asked for), with P = exp(scores - lse): lse may cover more keys than these
// (a ring step passes the global one); rows whose lse is -inf get no gradient. The arguments as the backward op
// takes them, already checked (compute_mask_grad only with a mask).
inline BwdOutputs reference_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                     const std::optional<at::Tensor>& mask, double scale, bool is_causal,
                                     bool compute_mask_grad, int64_t window_left, double softcap,
                                     const std::optional<at::Tensor>& sinks) {
  namespace detail = reference_detail;
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2);
  const int64_t kv_heads = k.size(1), seq_k = k.size(2), group = heads / kv_heads;
  const at::ScalarType acc = detail::accumulation_dtype(q.scalar_type());
  const at::TensorOptions acc_options = q.options().dtype(acc);
  const at::Tensor k_acc = k.to(acc).unsqueeze(2);
  const at::Tensor v_acc = v.to(acc).unsqueeze(2);
  // dk and dv per query head, [B, Hkv, G, Sk, D], summed over the group at the end.
  at::Tensor dq = at::zeros(q.sizes(), acc_options);
  at::Tensor dk = at::zeros({batch, kv_heads, group, seq_k, k.size(3)}, acc_options);
  at::Tensor dv = at::zeros({batch, kv_heads, group, seq_k, v.size(3)}, acc_options);
  std::optional<at::Tensor> dmask;
  if (compute_mask_grad) dmask = at::zeros({batch, heads, seq_q, seq_k}, acc_options);
  const std::optional<at::Tensor> sink = detail::sink_logits(sinks, kv_heads, acc);
  std::optional<at::Tensor> dsink;
  if (sinks.has_value()) dsink = at::zeros({1, kv_heads, group, 1, 1}, acc_options);
  // rowsum(dO * O): the softmax Jacobian's correction term.
  const at::Tensor delta = (grad_out.to(acc) * out.to(acc)).sum(-1);
  const int64_t block = detail::query_block_rows(batch, heads, seq_q, seq_k);
  for (int64_t start = 0; start < seq_q; start += block) {
    const detail::Rows rows{start, std::min(start + block, seq_q)};
    const at::Tensor capped = detail::capped_scores(q, k, scale, softcap, rows, kv_heads, acc);
    const at::Tensor scores = detail::masked(capped, mask, is_causal, window_left, rows, heads, seq_k, kv_heads, acc);
    const at::Tensor row_lse = detail::group_view(lse.slice(2, rows.start, rows.stop).unsqueeze(-1), kv_heads);
    at::Tensor probs, p_sink;
    if (!sink.has_value()) {
      probs = detail::probabilities(scores, row_lse);
    } else {  // the sink as one more key, with no value
      std::vector<int64_t> sink_column = scores.sizes().vec();
      sink_column.back() = 1;
      const at::Tensor with_sink = detail::probabilities(at::cat({scores, sink->expand(sink_column)}, -1), row_lse);
      probs = with_sink.slice(-1, 0, seq_k);
      p_sink = with_sink.slice(-1, seq_k);
    }
    const at::Tensor row_delta = detail::group_view(delta.slice(2, rows.start, rows.stop).unsqueeze(-1), kv_heads);
    const at::Tensor d_out = detail::group_view(grad_out.slice(2, rows.start, rows.stop).to(acc), kv_heads);
    const auto [d_v, d_scores] = detail::score_gradients(probs, d_out, v_acc, row_delta);
    dv += d_v;
    if (dmask.has_value()) dmask->slice(2, rows.start, rows.stop).copy_(d_scores.flatten(1, 2));
    // d(out)/d(sink) = -p_sink * out, so the row's share is -p_sink * delta.
    if (dsink.has_value()) *dsink -= (p_sink * row_delta).sum({0, 3, 4}, /*keepdim=*/true);
    const at::Tensor q_block = detail::group_view(q.slice(2, rows.start, rows.stop).to(acc), kv_heads);
    const auto [d_q, d_k] = detail::query_key_gradients(d_scores, capped, softcap, k_acc, q_block, scale);
    dq.slice(2, rows.start, rows.stop).copy_(d_q);
    dk += d_k;
  }
  const at::Tensor none = at::empty({0}, q.options());
  const at::Tensor dmask_out =
      dmask.has_value() ? detail::reduce_to_shape(*dmask, mask->sizes()).to(mask->scalar_type()).contiguous() : none;
  const at::Tensor dsinks_out =
      dsink.has_value() ? dsink->reshape(sinks->sizes()).to(sinks->scalar_type()).contiguous() : none;
  return {dq.to(q.scalar_type()).contiguous(), dk.sum(2).to(k.scalar_type()).contiguous(),
          dv.sum(2).to(v.scalar_type()).contiguous(), dmask_out, dsinks_out};
}

// The backward op's outputs with the gradients of the rows the forward filled (lse -inf under empty_rows MEAN_V
// or ALL_KEYS) added to dq, dk and dv (reference.with_filled_row_gradients and filled_row_gradients): eager's
// gradients for a fill added to every score of such a row, computed only at the query positions where some
// batch and head has one (finding them waits for the device once), or at every position where the caller
// cannot wait (capturing a CUDA graph).
inline BwdOutputs with_filled_row_gradients(BwdOutputs outputs, const at::Tensor& grad_out, const at::Tensor& q,
                                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                            const at::Tensor& lse, double scale, int64_t empty_rows,
                                            double softcap, bool capturing = false) {
  namespace detail = reference_detail;
  if (empty_rows == int64_t(EmptyRows::kZero) || k.size(2) == 0) return outputs;
  const at::Tensor filled = at::isneginf(lse);
  const at::Tensor positions = capturing ? at::arange(q.size(2), q.options().dtype(at::kLong))
                                         : filled.any(1).any(0).nonzero().squeeze(1);
  const int64_t count = positions.size(0);
  if (count == 0) return outputs;
  const int64_t batch = q.size(0), heads = q.size(1);
  const int64_t kv_heads = k.size(1), seq_k = k.size(2), group = heads / kv_heads;
  const at::ScalarType acc = detail::accumulation_dtype(q.scalar_type());
  const at::TensorOptions acc_options = q.options().dtype(acc);
  const at::Tensor k_acc = k.to(acc).unsqueeze(2);
  const at::Tensor v_acc = v.to(acc).unsqueeze(2);
  const at::Tensor q_rows = q.index_select(2, positions);
  // dO of the other batches' and heads' rows at these positions is zeroed: the main backward gave theirs.
  const at::Tensor d_out = at::where(filled.index_select(2, positions).unsqueeze(-1),
                                     grad_out.index_select(2, positions).to(acc), at::zeros({}, acc_options));
  const at::Tensor delta = (d_out * out.index_select(2, positions).to(acc)).sum(-1);
  at::Tensor dq = at::empty(q_rows.sizes(), acc_options);
  at::Tensor dk = at::zeros({batch, kv_heads, group, seq_k, k.size(3)}, acc_options);
  at::Tensor dv = at::zeros({batch, kv_heads, group, seq_k, v.size(3)}, acc_options);
  const int64_t block = detail::query_block_rows(batch, heads, count, seq_k);
  for (int64_t start = 0; start < count; start += block) {
    const detail::Rows rows{start, std::min(start + block, count)};
    const at::Tensor capped = detail::capped_scores(q_rows, k, scale, softcap, rows, kv_heads, acc);
    const at::Tensor probs = empty_rows == int64_t(EmptyRows::kMeanV) ? at::full_like(capped, 1.0 / double(seq_k))
                                                                      : at::softmax(capped, -1);
    const at::Tensor row_delta = detail::group_view(delta.slice(2, rows.start, rows.stop).unsqueeze(-1), kv_heads);
    const at::Tensor block_d_out = detail::group_view(d_out.slice(2, rows.start, rows.stop), kv_heads);
    const auto [d_v, d_scores] = detail::score_gradients(probs, block_d_out, v_acc, row_delta);
    dv += d_v;
    const at::Tensor q_block = detail::group_view(q_rows.slice(2, rows.start, rows.stop).to(acc), kv_heads);
    const auto [d_q, d_k] = detail::query_key_gradients(d_scores, capped, softcap, k_acc, q_block, scale);
    dq.slice(2, rows.start, rows.stop).copy_(d_q);
    dk += d_k;
  }
  auto& [out_dq, out_dk, out_dv, dmask, dsinks] = outputs;
  out_dq = out_dq.index_add(2, positions, dq.to(out_dq.scalar_type()));  // those rows' dq is 0 where filled
  out_dk = (out_dk.to(acc) + dk.sum(2)).to(out_dk.scalar_type());
  out_dv = (out_dv.to(acc) + dv.sum(2)).to(out_dv.scalar_type());
  return outputs;
}

// d loss / d sinks ([Hq], the sinks' dtype) for a forward whose float32 lse holds the sinks: a sink is one more
// key whose value is zero, so its score's gradient is p_sink * (0 - rowsum(dO * O)), summed over batch and rows.
// What runs with a backward kernel that knows nothing of sinks (fa2_inductor._cuda.sinks_gradient in Python).
inline at::Tensor sinks_gradient(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                                 const at::Tensor& sinks) {
  const at::Tensor delta = (grad_out.to(at::kFloat) * out.to(at::kFloat)).sum(-1);  // [B, Hq, Sq]
  const at::Tensor p_sink = at::exp(sinks.to(at::kFloat).view({1, -1, 1}) - lse);
  // A row with no key and a -inf sink has lse -inf: NaN above, no gradient.
  const at::Tensor shares = at::where(at::isneginf(lse), at::zeros_like(p_sink), p_sink) * delta;
  return (-shares.sum(at::IntArrayRef{0, 2})).to(sinks.scalar_type());
}

}  // namespace fa2
