// Rows with no visible key, under the op's empty_rows policies other than zero (fa2_inductor's
// EmptyRows). The main kernel leaves these rows at O = 0, LSE = -inf; this kernel rewrites their O
// (their LSE stays -inf: no key is visible) with
//  * MEAN_V: the mean of V over all Sk keys (masked scores hold a fill that swallows the score, e.g.
//    HF's finfo.min: every score of the row is the fill, a uniform softmax), or
//  * ALL_KEYS: the row of `source`, an unmasked attention the caller ran for the tiles holding such
//    rows (masked scores hold a finite fill that shifts the whole row equally, e.g. cuDNN's -65504).
// A CTA whose rows all saw a key leaves after one read of their LSE, so the pass costs one small
// launch when nothing is empty.
#pragma once

#include <cmath>
#include <cstdint>
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "params.h"
#include "pdl.hpp"

namespace fa2 {

constexpr int kEmptyRowsThreads = 256;  // also the query rows of one head checked per CTA
static_assert(kEmptyRowsThreads >= kMaxHeadDim, "one thread per head-dim column");

template <class Element>
__global__ void __launch_bounds__(kEmptyRowsThreads) fill_empty_rows_kernel(const EmptyRowsParams p) {
  wait_for_prior_grid();  // the LSE (and source) the kernel before wrote
  const int row0 = blockIdx.x * kEmptyRowsThreads;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int row = row0 + int(threadIdx.x);
  const float* lse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride;
  __shared__ bool row_empty[kEmptyRowsThreads];
  __shared__ float partial[kEmptyRowsThreads];
  __shared__ float mean[kEmptyRowsThreads];
  const bool empty = row < p.seqlen_q && lse[row] == -INFINITY;
  row_empty[threadIdx.x] = empty;
  if (!__syncthreads_or(empty)) return;
  Element* o = static_cast<Element*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;
  const int rows = min(kEmptyRowsThreads, p.seqlen_q - row0);

  if (p.source != nullptr) {
    const Element* src = static_cast<const Element*>(p.source) + batch * p.source_batch_stride +
                         head * p.source_head_stride;
    for (int i = threadIdx.x; i < rows * p.head_dim; i += kEmptyRowsThreads) {
      const int r = i / p.head_dim, c = i - r * p.head_dim;
      if (row_empty[r]) o[int64_t(row0 + r) * p.o_row_stride + c] = src[int64_t(row0 + r) * p.source_row_stride + c];
    }
    return;
  }

  // Mean of V over all keys: thread t sums column t % D over every (threads / D)-th key.
  const int d = int(threadIdx.x) % p.head_dim, slice = int(threadIdx.x) / p.head_dim;
  const int slices = kEmptyRowsThreads / p.head_dim;
  const Element* v = static_cast<const Element*>(p.v) + batch * p.v_batch_stride +
                     int64_t(head / (p.heads_q / p.heads_kv)) * p.v_head_stride;
  float sum = 0.f;
  if (slice < slices) {
    for (int j = slice; j < p.seqlen_k; j += slices) sum += float(v[int64_t(j) * p.v_row_stride + d]);
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  if (int(threadIdx.x) < p.head_dim) {
    float total = 0.f;
    for (int s = 0; s < slices; ++s) total += partial[s * p.head_dim + threadIdx.x];
    mean[threadIdx.x] = total / float(p.seqlen_k);
  }
  __syncthreads();

  for (int i = threadIdx.x; i < rows * p.head_dim; i += kEmptyRowsThreads) {
    const int r = i / p.head_dim, c = i - r * p.head_dim;
    if (row_empty[r]) o[int64_t(row0 + r) * p.o_row_stride + c] = Element(mean[c]);
  }
}

template <DType Dt>
cudaError_t run_fill_empty_rows(const EmptyRowsParams& p, cudaStream_t stream) {
  using Element = std::conditional_t<Dt == DType::kBF16, cutlass::bfloat16_t, cutlass::half_t>;
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0 || p.seqlen_k == 0) return cudaSuccess;
  if (p.head_dim > kMaxHeadDim || p.head_dim <= 0) return cudaErrorInvalidValue;
  dim3 grid((p.seqlen_q + kEmptyRowsThreads - 1) / kEmptyRowsThreads, p.heads_q, p.batch);
  if (p.after_own_kernel) {
    return launch_after_prior_grid(&fill_empty_rows_kernel<Element>, grid, dim3(kEmptyRowsThreads), 0, stream, p);
  }
  fill_empty_rows_kernel<Element><<<grid, kEmptyRowsThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fa2
