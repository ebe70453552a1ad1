// y = x @ W^T in float32, W packed at load into panels of output channels, k-major ([panels][K][64] with AVX-512,
// [panels][K][16] with AVX2), in its own dtype (float32, bfloat16, float16): the `f32_panels` GEMM tactic
// (runners/gemm.py).
//
// Why ours beside oneDNN's and MKL's: a decode step's GEMMs have few rows (1..64) and weights that come from DRAM,
// not cache (a step reads every layer's weights once: 540 MB for SmolLM2 in float32). Timed so, with the weights cycled
// through more copies than the caches hold (Intel Xeon, 2 threads, SmolLM2's shapes), oneDNN's prepacked GEMM ran
// 7-11 GFLOP/s at one row and 60-170 at 16-64, while this loop, which prefetches the next panel into L2 while it
// computes on this one, ran 10-17 and 100-200; at 256-512 rows (prefill chunks) oneDNN stays ahead by ~10 %.
//
// Microkernel: per k, a panel row of weights (4 vectors with AVX-512, 2 with AVX2) times 6 broadcast rows of x into
// 6 x 4 (6 x 2) accumulators: 10 (8) loads per 24 (12) multiply-adds. 12 rows x 2 vectors ran ~10 % slower at
// 256-512 rows (14 loads per 24). Each output is one float32 sum over k in order: the result is x @ W^T up
// to the order of float sums, as any GEMM.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

#include "work_queue.h"

namespace {

#ifdef __AVX512F__
using Vec = __m512;
constexpr int64_t kVec = 16;
constexpr int kVecs = 4;  // a panel is 4 vectors wide: 24 accumulators of AVX-512's 32 registers
constexpr int kRows = 6;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const at::BFloat16* p) {  // a bfloat16 is a float32's high half: widened exactly
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline Vec load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#else
using Vec = __m256;
constexpr int64_t kVec = 8;
constexpr int kVecs = 2;  // 12 accumulators of AVX2's 16 registers
constexpr int kRows = 6;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline Vec load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }  // F16C
inline Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int64_t kPanel = kVecs * kVec;  // output channels per panel
// x's rows in parts of at most this many bytes, so that a part stays in L2 while it meets every panel. Sized on the
// Intel Xeon of 2026-11-28 (2 MB of L2 a core); not measured on CPUs with less L2 (AMD Zen 3: 512 KB).
constexpr int64_t kPartBytes = 512 << 10;

// MR rows of x against one panel. Meanwhile `pf_lines` cache lines from `pf` on (a share of the next panel) are
// prefetched into L2, spread over the k loop.
template <int MR, typename w_t>
inline void microkernel(const float* x, int64_t K, const w_t* wp, float* y, int64_t ldy, int64_t cols,
                        const char* pf, int64_t pf_lines) {
  Vec acc[MR][kVecs];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kVecs; ++j) acc[i][j] = zero();
  int64_t owed = 0;  // a line each time it passes K: pf_lines over the K iterations
  for (int64_t k = 0; k < K; ++k) {
    for (owed += pf_lines; owed >= K; owed -= K, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    Vec w[kVecs];
    for (int j = 0; j < kVecs; ++j) w[j] = load(wp + k * kPanel + j * kVec);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const Vec xv = broadcast(x + i * K + k);
      for (int j = 0; j < kVecs; ++j) acc[i][j] = fma(xv, w[j], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    float row[kPanel];
    float* out = cols == kPanel ? y + i * ldy : row;  // the last panel may be narrower
    for (int j = 0; j < kVecs; ++j) store(out + j * kVec, acc[i][j]);
    if (cols < kPanel) std::copy(row, row + cols, y + i * ldy);
  }
}

// The last M - m (< kRows) rows.
template <int MR, typename w_t>
inline void rows(const float* x, int64_t M, int64_t K, const w_t* wp, float* y, int64_t N, int64_t cols, int64_t m,
                 const char* pf, int64_t pf_lines) {
  if constexpr (MR > 0) {
    if (M - m == MR) microkernel<MR>(x + m * K, K, wp, y + m * N, N, cols, pf, pf_lines);
    else rows<MR - 1, w_t>(x, M, K, wp, y, N, cols, m, pf, pf_lines);
  }
}

template <typename w_t>
void pack(const w_t* src, w_t* dst, int64_t N, int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t n = p * kPanel + c;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + c] = n < N ? src[n * K + k] : w_t(0.0f);
      }
  });
}

// The panels keep the weight's dtype: float32, or a bfloat16 / float16 model's own 16 bits, widened exactly to float32
// as they are loaded (the same sums as from a float32 copy, half the bytes read and held).
at::Tensor f32_pack(const at::Tensor& weight) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "f32_pack: float32, bfloat16 or float16 [N, K] expected");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto packed = at::empty({panels, K, kPanel}, w.options());  // written once: no padded copy beside the weight
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "f32_pack",
                                  [&] { pack(w.data_ptr<scalar_t>(), packed.data_ptr<scalar_t>(), N, K); });
  return packed;
}

template <typename w_t>
void linear(const float* px, const w_t* pw, float* py, int64_t M, int64_t K, int64_t N, int64_t panels) {
  // Threads split the panels (each reads its share of W once per part of x), and one that is done takes another's
  // last panels (work_queue.h). While a thread computes on a panel, it prefetches the one it takes next, a share with
  // each kRows rows: all of it with the first rows asked for more than one core's share of DRAM bandwidth while they
  // lasted, and decode-sized GEMMs (16-64 rows) ran 12-25 % slower. A prefill chunk's x (512 rows: 1.2 MB at K = 576,
  // 3.1 MB at 1536) would leave L2 between panels: it is taken in parts of at most kPartBytes, each against all of the
  // panels (a pass at 512 rows 1.05-1.10x faster).
  const int64_t parts = std::max<int64_t>(1, (M * K * 4 + kPartBytes - 1) / kPartBytes);
  const int64_t part_rows = ((M + parts - 1) / parts + kRows - 1) / kRows * kRows;
  for (int64_t m0 = 0; m0 < M; m0 += part_rows) {
    const int64_t m1 = std::min(M, m0 + part_rows), blocks = (m1 - m0 + kRows - 1) / kRows;
    llm_kernels::parallel_take(panels, [&](llm_kernels::WorkQueue& queue, int64_t t) {
      for (int64_t p = queue.take(t), next; p >= 0; p = next) {
        next = queue.take(t);
        const w_t* wp = pw + p * K * kPanel;
        const int64_t cols = std::min(kPanel, N - p * kPanel),
                      lines = next >= 0 ? K * kPanel * int64_t(sizeof(w_t)) / 64 : 0;
        const char* pf = reinterpret_cast<const char*>(pw + std::max<int64_t>(next, 0) * K * kPanel);
        int64_t m = m0;
        for (int64_t b = 0; m + kRows <= m1; ++b, m += kRows) {
          const int64_t from = lines * b / blocks, to = lines * (b + 1) / blocks;
          microkernel<kRows>(px + m * K, K, wp, py + m * N + p * kPanel, N, cols, pf + 64 * from, to - from);
        }
        const int64_t from = lines * (blocks - 1) / blocks;  // the last rows of a part, if fewer than kRows
        rows<kRows - 1>(px, m1, K, wp, py + p * kPanel, N, cols, m, pf + 64 * from, lines - from);
      }
    });
  }
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "f32_linear: x [M, K] float32 contiguous expected");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, panels = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == K && packed.size(2) == kPanel &&
              panels * kPanel >= N, "f32_linear: weight packed by f32_pack for in_features ", K, " expected");
  auto y = at::empty({M, N}, x.options());
  const float* px = x.data_ptr<float>();
  float* py = y.data_ptr<float>();
  switch (packed.scalar_type()) {
    case at::kFloat: linear(px, packed.data_ptr<float>(), py, M, K, N, panels); break;
    case at::kBFloat16: linear(px, packed.data_ptr<at::BFloat16>(), py, M, K, N, panels); break;
    case at::kHalf: linear(px, packed.data_ptr<at::Half>(), py, M, K, N, panels); break;
    default: TORCH_CHECK(false, "f32_linear: packed float32, bfloat16 or float16 expected");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("f32_pack(Tensor weight) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("f32_pack", &f32_pack);
  m.impl("f32_linear", &f32_linear);
}
