// A sampled row's draw on the CPU (sampling.py's inverse transform): the first token whose running sum of
// exp(logit - max) passes the row's uniform times the whole sum, from the filtered logits (-inf: dropped, never
// drawn). Three passes over a row, which stays in L2: the max, the sum (float64 across vectors), the walk. The torch
// ops it replaces (softmax, a float64 copy, cumsum, searchsorted) took 9 ms for 16 rows of a 128k vocabulary on a
// 2-core Xeon.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "cpu_math.h"

namespace {

using namespace llm_kernels;

constexpr float kDropped = -std::numeric_limits<float>::infinity();

// The kLanes values from i (the last vector padded with dropped tokens).
inline vfloat lanes_at(const float* x, int64_t n, int64_t i) {
  if (i + kLanes <= n) return load(x + i);
  float padded[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) padded[j] = i + j < n ? x[i + j] : kDropped;
  return load(padded);
}

inline vfloat weights(vfloat v, float max) { return v > kDropped ? fast_exp(v - max) : splat(0.f); }

inline float lane_sum(vfloat e) {
  float s = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) s += e[j];
  return s;
}

int64_t draw_row(const float* x, int64_t n, double uniform) {
  vfloat top = splat(kDropped);
  for (int64_t i = 0; i < n; i += kLanes) top = max(top, lanes_at(x, n, i));
  float m = kDropped;
  for (int64_t j = 0; j < kLanes; ++j) m = std::max(m, top[j]);
  if (!(m > kDropped)) return 0;  // no token allowed (a guide's row, or NaN): any index; the caller tells
  double total = 0.0;
  for (int64_t i = 0; i < n; i += kLanes) total += lane_sum(weights(lanes_at(x, n, i), m));
  const double target = uniform * total;
  double sum = 0.0;
  for (int64_t i = 0; i < n; i += kLanes) {
    const vfloat e = weights(lanes_at(x, n, i), m);
    const float s = lane_sum(e);
    if (sum + s > target) {  // in this vector, unless rounding says otherwise: then on, as the total was summed
      double running = sum;
      for (int64_t j = 0; j < kLanes && i + j < n; ++j)
        if ((running += e[j]) > target && e[j] > 0.f) return i + j;
    }
    sum += s;
  }
  for (int64_t i = n - 1; i > 0; --i)  // the uniform times the total rounded up to it: the last token allowed
    if (x[i] > kDropped) return i;
  return 0;
}

// logits [S, V] float32 with contiguous rows, uniforms [S] float64 in [0, 1) -> [S] int64
at::Tensor draw_rows(const at::Tensor& logits, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "draw_rows: logits [S, V] float32 with contiguous rows expected");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == logits.size(0) && uniforms.scalar_type() == at::kDouble &&
              uniforms.is_contiguous(), "draw_rows: uniforms [S] float64 expected");
  const int64_t S = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({S}, logits.options().dtype(at::kLong));
  const float* px = logits.data_ptr<float>();
  const double* pu = uniforms.data_ptr<double>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) po[s] = draw_row(px + s * stride, V, pu[s]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) { m.def("draw_rows(Tensor logits, Tensor uniforms) -> Tensor"); }

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) { m.impl("draw_rows", &draw_rows); }
