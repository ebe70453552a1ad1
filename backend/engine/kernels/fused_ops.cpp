// The elementwise work around a step's GEMMs, fused: one pass over memory instead of one per torch op
// (RMSNorm alone is six: float copy, pow, mean, add, rsqrt, two muls; rotary is six more; SiLU * up two;
// gpt-oss's clamped SwiGLU seven).
// Each op rounds to the storage dtype where the torch ops it replaces do (models/llama.py, the reference the exported graph runs), so float32
// results differ only in the order of the sums; bfloat16 and float16 in those and the rounding of partial
// sums that torch keeps in float32 too.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"

namespace {

using namespace llm_kernels;

// One row: out = weight * round(x * rsqrt(mean(x^2) + eps)), as HF's LlamaRMSNorm.
template <typename scalar_t>
inline void rms_norm_row(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * round_to<scalar_t>(static_cast<float>(x[i]) * r));
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1), op,
              ": x [T, hidden] contiguous and weight [hidden] expected");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": x and weight must share a dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  auto out = at::empty_like(x);
  const int64_t n = x.size(1);
  dispatch(x, "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *px = x.data_ptr<scalar_t>(), *pw = weight.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) rms_norm_row(px + t * n, pw, po + t * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// residual += delta (rounded as torch's add), then returns rms_norm(residual): the residual stream's add
// and the next norm in one pass (vLLM's fused_add_rms_norm).
at::Tensor add_rms_norm(const at::Tensor& delta, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(residual, weight, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.is_contiguous() &&
              delta.scalar_type() == residual.scalar_type(), "add_rms_norm: delta must match residual");
  auto out = at::empty_like(residual);
  const int64_t n = residual.size(1);
  dispatch(residual, "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *pd = delta.data_ptr<scalar_t>(), *pw = weight.data_ptr<scalar_t>();
    scalar_t *pr = residual.data_ptr<scalar_t>(), *po = out.data_ptr<scalar_t>();
    at::parallel_for(0, residual.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* row = pr + t * n;
        for (int64_t i = 0; i < n; ++i)
          row[i] = static_cast<scalar_t>(static_cast<float>(row[i]) + static_cast<float>(pd[t * n + i]));
        rms_norm_row(row, pw, po + t * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// In place on x [T, heads, D] (any row stride): x * cos + rotate_half(x) * sin on each head's first R dims, cos/sin
// [T, R] in x's dtype (HF's rotate_half: the first half of the R pairs with the second; R < D: Phi's partial rotary,
// the other dims pass).
template <typename scalar_t>
void rotate(scalar_t* x, int64_t row_stride, int64_t heads, int64_t D, int64_t R, const scalar_t* cos,
            const scalar_t* sin, int64_t t) {
  const int64_t half = R / 2;
  const scalar_t *c = cos + t * R, *s = sin + t * R;
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* v = x + t * row_stride + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
      const float lo = round_to<scalar_t>(a * static_cast<float>(c[i])) +
                       round_to<scalar_t>(-b * static_cast<float>(s[i]));
      const float hi = round_to<scalar_t>(b * static_cast<float>(c[i + half])) +
                       round_to<scalar_t>(a * static_cast<float>(s[i + half]));
      v[i] = static_cast<scalar_t>(lo);
      v[i + half] = static_cast<scalar_t>(hi);
    }
  }
}

}  // namespace

namespace llm_kernels {

// Also called by attend_qkv (paged_attention.cpp).
void rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
              q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "rotary: q, k [T, heads, D] with contiguous heads expected");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
              cos.size(0) == q.size(0) && cos.size(1) <= q.size(2) && cos.size(1) % 2 == 0,
              "rotary: cos, sin [T, R] contiguous expected, R <= D even");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type(), "rotary: q, k, cos and sin must share a dtype");
  dispatch(q, "rotary", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t *pq = q.data_ptr<scalar_t>(), *pk = k.data_ptr<scalar_t>();
    const scalar_t *pc = cos.data_ptr<scalar_t>(), *ps = sin.data_ptr<scalar_t>();
    at::parallel_for(0, q.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotate(pq, q.stride(0), q.size(1), q.size(2), cos.size(1), pc, ps, t);
        rotate(pk, k.stride(0), k.size(1), k.size(2), cos.size(1), pc, ps, t);
      }
    });
  });
}

// In place on x [T, heads, D] (contiguous heads, any row stride): each head's D values RMS-normed by weight [D], as
// HF's per-head q_norm / k_norm (Qwen3, Gemma 3 with its 1 + w folded into the weight at load). Called by attend_qkv.
void head_rms_norm(at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && weight.dim() == 1 &&
              weight.size(0) == x.size(2) && weight.scalar_type() == x.scalar_type(),
              "head_rms_norm: x [T, heads, D] with contiguous heads and weight [D] of its dtype expected");
  dispatch(x, "head_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* px = x.data_ptr<scalar_t>();
    const scalar_t* pw = weight.data_ptr<scalar_t>();
    const int64_t heads = x.size(1), D = x.size(2);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* row = px + t * x.stride(0) + h * D;
          rms_norm_row(row, pw, row, D, static_cast<float>(eps));
        }
    });
  });
}

}  // namespace llm_kernels

namespace {

// [T, 2I] (gate | up) -> [T, I]: act(tag, gate, up) lane by lane (tag: a scalar_t, the dtype to round to where the
// torch ops do). Whole vectors; a row's last I % kLanes lanes go through a padded vector.
template <typename Act>
at::Tensor gated(const at::Tensor& gate_up, const char* op, Act act) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, op,
              ": [T, 2 * intermediate] contiguous expected");
  const int64_t n = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), n}, gate_up.options());
  dispatch(gate_up, op, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* pg = gate_up.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, gate_up.size(0), 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t *g = pg + t * 2 * n, *u = g + n;
        scalar_t* o = po + t * n;
        int64_t i = 0;
        for (; i + kLanes <= n; i += kLanes) store(o + i, act(tag, load(g + i), load(u + i)));
        if (i < n) {
          scalar_t gs[kLanes] = {}, us[kLanes] = {}, os[kLanes];
          std::copy(g + i, g + n, gs);
          std::copy(u + i, u + n, us);
          store(os, act(tag, load(gs), load(us)));
          std::copy(os, os + (n - i), o + i);
        }
      }
    });
  });
  return out;
}

// sigmoid(x) from e = exp(-|x|) <= 1 (no overflow).
inline vfloat sigmoid(vfloat x) {
  const vfloat e = fast_exp(-abs(x));
  return (x >= 0.f ? splat(1.f) : e) / (1.f + e);
}

// round(silu(gate)) * up, as torch's silu then mul; silu(x) = x * sigmoid(x).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  return gated(gate_up, "silu_mul", [](auto tag, vfloat g, vfloat u) {
    using scalar_t = decltype(tag);
    return round_to<scalar_t>(g * sigmoid(g)) * u;
  });
}

// gpt-oss's activation, rounded where models/llama.py TorchOps.clamped_swiglu_mul's torch ops round: gate clamped
// above at `limit`, up to [-limit, limit], (up + 1) * (gate * sigmoid(alpha gate)). Its torch ops were seven passes
// over [T, 2I] at a decode step: ~65 us a layer on AMD Zen 3.
at::Tensor clamped_swiglu_mul(const at::Tensor& gate_up, double alpha, double limit) {
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
  return gated(gate_up, "clamped_swiglu_mul", [a, l](auto tag, vfloat g, vfloat u) {
    using scalar_t = decltype(tag);
    g = min(g, splat(l));
    u = max(min(u, splat(l)), splat(-l));
    const vfloat glu = round_to<scalar_t>(g * round_to<scalar_t>(sigmoid(round_to<scalar_t>(g * a))));
    return round_to<scalar_t>(u + 1.f) * glu;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor delta, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("clamped_swiglu_mul(Tensor gate_up, float alpha, float limit) -> Tensor");
  m.def("lanes() -> int", []() -> int64_t { return kLanes; });  // the build's float vector width
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &llm_kernels::rotary);
  m.impl("silu_mul", &silu_mul);
  m.impl("clamped_swiglu_mul", &clamped_swiglu_mul);
}
