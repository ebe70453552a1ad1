// y = x @ W^T with W in llama.cpp's Q8_0 rounding: each run of 32 weights along a row is int8 with one float
// scale (w ~ q * scale, scale = max|w| / 127), or each run of 16 (a GGUF Q6_K's sub-blocks, models/weight_blocks.py),
// and may have a min per scale as well (w ~ q * scale + min: GGUF Q5_1, Q5_K, Q2_K).
// Weight-only: x stays float32, and each weight is widened to float in registers (sign-extend, convert, times its
// block's scale) just before its multiply-adds, so the result is x @ dequantized(W) up to the order of float sums,
// at any batch size.
//
// The weights are repacked at load into panels of 16 output channels, k-major ([K][16] int8, and [K/32][16] scales),
// so the microkernel is a GEMM's outer product: per k, 16 widened weights (one AVX-512 vector, or two AVX2 ones)
// times MR broadcast rows of x (12 with AVX-512's 32 registers, 6 with AVX2's 16). A decode step (one row) streams
// 4x fewer bytes than float32; larger steps reuse each widened weight for MR rows and run at float FMA speed.
//
// Measured against (AMD EPYC Zen 4, 2 threads, SmolLM2's layer shapes): an int8 x int8 dot product (activations
// rounded per 32-block, llama.cpp's vec_dot_q8_0_q8_0 with vpdpbusd) was as fast at one row and 3x slower at 16
// and 64 (its per-block float work costs as much as the FMAs it saves); an inner-product layout (vectors along K)
// of this widening was 1.5x slower at 16 and 64.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

#include "prefetch.h"
#include "work_queue.h"

namespace {

constexpr int64_t kPanel = 16;  // output channels per panel

// The packed form of a [N, K] weight: panels of kPanel channels (N padded with zero rows).
at::Tensor pack_q8_0(const at::Tensor& q, const at::Tensor& scales, at::Tensor& packed_scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack_q8_0: int8 [N, K] expected");
  const int64_t N = q.size(0), K = q.size(1), panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K % 32 == 0, "pack_q8_0: in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && (scales.size(1) == K / 32 || scales.size(1) == K / 16) &&
              scales.scalar_type() == at::kFloat, "pack_q8_0: scales [N, K / 32 or K / 16] float32 expected");
  const int64_t nb = scales.size(1);
  auto padded = at::zeros({panels * kPanel, K}, q.options());
  padded.narrow(0, 0, N).copy_(q);
  auto padded_scales = at::zeros({panels * kPanel, nb}, scales.options());
  padded_scales.narrow(0, 0, N).copy_(scales);
  packed_scales = padded_scales.view({panels, kPanel, nb}).transpose(1, 2).contiguous();  // [panels][nb][16]
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();                    // [panels][K][16]
}

#ifdef __AVX512F__
constexpr int kRows = 12;  // rows of x per microkernel call: 12 accumulators of 16 floats

// 16 int8 weights -> 16 floats, times their scales (plus their mins).
template <bool MIN>
inline __m512 widen(const int8_t* q, __m512 scale, __m512 min) {
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  return MIN ? _mm512_fmadd_ps(v, scale, min) : _mm512_mul_ps(v, scale);
}

template <int MR, int kBlock, bool MIN>
inline void microkernel(const float* x, int64_t K, const int8_t* wp, const float* sp, const float* mp, float* y,
                        int64_t ldy, int64_t cols, bool prefetch) {
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m512 scale = _mm512_loadu_ps(sp + b * kPanel);
    const __m512 min = MIN ? _mm512_loadu_ps(mp + b * kPanel) : _mm512_setzero_ps();
    // the next panel's block
    if (prefetch) llm_kernels::prefetch_l2(wp + K * kPanel + b * kBlock * kPanel, kBlock * kPanel);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      const __m512 w = widen<MIN>(wp + k * kPanel, scale, min);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k]), w, acc[i]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);  // the last panel may be narrower
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * ldy, mask, acc[i]);
}
#else
constexpr int kRows = 6;  // rows of x per microkernel call: 12 accumulators of 8 floats (16 registers)

// 8 int8 weights -> 8 floats, times their scales (plus their mins).
template <bool MIN>
inline __m256 widen(__m128i bytes, __m256 scale, __m256 min) {
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  return MIN ? _mm256_fmadd_ps(v, scale, min) : _mm256_mul_ps(v, scale);
}

template <int MR, int kBlock, bool MIN>
inline void microkernel(const float* x, int64_t K, const int8_t* wp, const float* sp, const float* mp, float* y,
                        int64_t ldy, int64_t cols, bool prefetch) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m256 s0 = _mm256_loadu_ps(sp + b * kPanel), s1 = _mm256_loadu_ps(sp + b * kPanel + 8);
    const __m256 m0 = MIN ? _mm256_loadu_ps(mp + b * kPanel) : _mm256_setzero_ps();
    const __m256 m1 = MIN ? _mm256_loadu_ps(mp + b * kPanel + 8) : _mm256_setzero_ps();
    if (prefetch) llm_kernels::prefetch_l2(wp + K * kPanel + b * kBlock * kPanel, kBlock * kPanel);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + k * kPanel));
      const __m256 w0 = widen<MIN>(bytes, s0, m0), w1 = widen<MIN>(_mm_srli_si128(bytes, 8), s1, m1);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * K + k);
        acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    float row[kPanel];
    _mm256_storeu_ps(row, acc[i][0]);
    _mm256_storeu_ps(row + 8, acc[i][1]);
    std::copy(row, row + cols, y + i * ldy);
  }
}
#endif

template <int MR, int kBlock, bool MIN>
inline void rows(const float* x, int64_t M, int64_t K, const int8_t* wp, const float* sp, const float* mp, float* y,
                 int64_t N, int64_t cols, int64_t m) {
  if constexpr (MR > 0) {
    if (M - m == MR) microkernel<MR, kBlock, MIN>(x + m * K, K, wp, sp, mp, y + m * N, N, cols, m == 0);
    else rows<MR - 1, kBlock, MIN>(x, M, K, wp, sp, mp, y, N, cols, m);
  }
}

// One panel against every row of x: the panel stays in L1 while x streams from L2. kBlock weights per scale (and,
// with MIN, per min).
template <int kBlock, bool MIN>
void panel(const float* x, int64_t M, int64_t K, const int8_t* wp, const float* sp, const float* mp, float* y,
           int64_t N, int64_t cols) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows)
    microkernel<kRows, kBlock, MIN>(x + m * K, K, wp, sp, mp, y + m * N, N, cols, m == 0);
  rows<kRows - 1, kBlock, MIN>(x, M, K, wp, sp, mp, y, N, cols, m);  // the last M % kRows rows
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                       const at::Tensor& packed_mins, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "q8_0_linear: x [M, K] float32 contiguous expected");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, panels = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
              packed.size(1) == K && packed.size(2) == kPanel && panels * kPanel >= N,
              "q8_0_linear: weight packed by pack_q8_0 for in_features ", K, " expected");
  TORCH_CHECK(packed_scales.is_contiguous() && packed_scales.dim() == 3 && packed_scales.size(0) == panels &&
              (packed_scales.size(1) == K / 32 || packed_scales.size(1) == K / 16), "q8_0_linear: scales mismatch");
  const int64_t nb = packed_scales.size(1);
  const bool with_mins = packed_mins.numel() > 0;  // none: an empty tensor
  TORCH_CHECK(!with_mins || (packed_mins.is_contiguous() && packed_mins.sizes() == packed_scales.sizes() &&
                             packed_mins.scalar_type() == at::kFloat),
              "q8_0_linear: mins as the scales or empty expected");
  const auto run = nb == K / 32 ? (with_mins ? &panel<32, true> : &panel<32, false>)
                                : (with_mins ? &panel<16, true> : &panel<16, false>);
  const float* pm = with_mins ? packed_mins.data_ptr<float>() : nullptr;
  auto y = at::empty({M, N}, x.options());
  const float* px = x.data_ptr<float>();
  const int8_t* pw = packed.data_ptr<int8_t>();
  const float* ps = packed_scales.data_ptr<float>();
  float* py = y.data_ptr<float>();
  // Threads split the panels (each reads its share of W once; work_queue.h).
  llm_kernels::parallel_take(panels, [&](llm_kernels::WorkQueue& queue, int64_t t) {
    for (int64_t p; (p = queue.take(t)) >= 0;)
      run(px, M, K, pw + p * K * kPanel, ps + p * nb * kPanel, with_mins ? pm + p * nb * kPanel : nullptr,
          py + p * kPanel, N, std::min(kPanel, N - p * kPanel));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> pack(const at::Tensor& q, const at::Tensor& scales) {
  at::Tensor packed_scales;
  at::Tensor packed = pack_q8_0(q, scales, packed_scales);
  return {packed, packed_scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("q8_0_pack(Tensor weight, Tensor scales) -> (Tensor, Tensor)");
  m.def("q8_0_linear(Tensor x, Tensor packed, Tensor packed_scales, Tensor packed_mins, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("q8_0_pack", &pack);
  m.impl("q8_0_linear", &q8_0_linear);
}
