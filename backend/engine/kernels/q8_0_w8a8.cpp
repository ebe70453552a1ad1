// y = x @ W^T in int8 arithmetic, llama.cpp's Q8_0 x Q8_0: W rounded per 32 weights along a row (as q8_linear.cpp),
// and x rounded the same way per call, 32 values of a row per scale. A block's 32 products are exact in int32
// (vpdpbusd, AVX512-VNNI); only the scales' product and the sum over blocks are float. 4 products per lane per
// instruction, where the weight-only kernel does 1: prefill-sized steps run ~2x faster than float32. W may have a
// scale per 16 instead (a GGUF Q6_K's sub-blocks, models/weight_blocks.py): a block then sums two int32 dot products
// in float, one per weight scale. Or a min per scale as well (w ~ q * scale + min: GGUF Q5_1, Q5_K, Q2_K): each
// adds min * sum(x), the sum of x's rounded values (llama.cpp's Q8_1 activations).
// A K-quant's scales and mins may come as stored, int8 steps under a float32 unit per 256 weights (block_scales.h).
//
// vpdpbusd multiplies unsigned by signed bytes: x goes in as q + 128 (1..255), and each block's sum carries
// 128 * sum(w), which the accumulator starts from minus (the `comp` input). Packed W (gemm.py): panels of 16
// output channels, 4 consecutive k per channel together ([K/4][16][4] int8), so one 64-byte load feeds 16 lanes.
// With AVX2 only (AMD Zen 3), llama.cpp's ggml_vec_dot_q8_0_q8_0 form: vpmaddubsw multiplies |w| by x carrying w's
// sign (vpsignb; a pair's sum, at most 2 x 128 x 127, fits int16), vpmaddwd adds the pairs into int32, 8 channels a
// vector: the same exact int32 dot products and the same float work after them, so the same result bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "amx.h"
#include "block_scales.h"
#include "expert_groups.h"
#include "scratch.h"
#include "work_queue.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPanel = 16;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kRows = 12;  // rows of x per microkernel call: 12 int32 + 12 float accumulators
#define LLM_W8A8 1

// One block of 32 floats -> 32 bytes q + 128, the block's scale (max|x| / 127) and scale * sum(q) of each 16 values;
// round half to even.
inline void quantize_block(const float* x, uint8_t* q, float* scale, float* scaled_sums) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  *scale = m / 127.f;
  const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
  const __m512i r0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, inv), _MM_FROUND_TO_NEAREST_INT));
  const __m512i r1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, inv), _MM_FROUND_TO_NEAREST_INT));
  const __m128i offset = _mm_set1_epi8(static_cast<char>(0x80));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_xor_si128(_mm512_cvtsepi32_epi8(r0), offset));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm_xor_si128(_mm512_cvtsepi32_epi8(r1), offset));
  scaled_sums[0] = *scale * static_cast<float>(_mm512_reduce_add_epi32(r0));
  scaled_sums[1] = *scale * static_cast<float>(_mm512_reduce_add_epi32(r1));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 4;  // with two 8-channel halves per row: 8 float + 4 int32 accumulators of AVX2's 16 registers
#define LLM_W8A8 1

// quantize_block of the AVX-512 build, a lane at a time: the same rounding (half to even), bytes and sums.
inline void quantize_block(const float* x, uint8_t* q, float* scale, float* scaled_sums) {
  float m = 0.f;
  for (int i = 0; i < kBlock; ++i) m = std::max(m, std::fabs(x[i]));
  *scale = m / 127.f;
  const float inv = m > 0.f ? 127.f / m : 0.f;
  int sums[2] = {0, 0};
  for (int i = 0; i < kBlock; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<uint8_t>(v + 128);
    sums[i / 16] += v;
  }
  scaled_sums[0] = *scale * static_cast<float>(sums[0]);
  scaled_sums[1] = *scale * static_cast<float>(sums[1]);
}
#endif

#if defined(LLM_W8A8)

// Pointers to one panel: its weights, scales (and mins) and compensations, as `q8_0_w8a8_linear` takes them.
struct Panel {
  const int8_t* w;
  llm_kernels::BlockScales scales;  // block_scales.h
  llm_kernels::BlockScales mins;  // w ~ q * scale + min (GGUF Q5_1, Q5_K, Q2_K), as the scales: min * sum(x) joins
  const int32_t* comp;

  // Panel p of these (all panels'), for K input features and `sub` weight scales per 32 values along K.
  Panel nth(int64_t p, int64_t K, int64_t sub) const {
    const int64_t n = K / kBlock * sub;
    return {w + p * K * kPanel, scales.nth(p, n), mins.nth(p, n), comp + p * n * kPanel};
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int MR, int SUB, bool MIN>
inline void microkernel(const uint8_t* xq, const float* xs, const float* xsum, int64_t K, Panel p, float* y,
                        int64_t ldy, int64_t cols, bool prefetch) {
  constexpr int kGroups = kBlock / 4 / SUB;  // 4-k groups per weight scale
  const int64_t nb = K / kBlock;
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = p.w + b * kBlock * kPanel;
    if (prefetch)  // the next panel follows this one: DRAM's latency hides behind this panel's work
      for (int l = 0; l < kBlock * kPanel; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb + K * kPanel + l), _MM_HINT_T0);
#pragma GCC unroll 2
    for (int s = 0; s < SUB; ++s) {  // a weight scale per 32 / SUB values along K: a dot product each
      __m512i dot[MR];
      const __m512i comp = _mm512_loadu_si512(p.comp + (b * SUB + s) * kPanel);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) dot[i] = comp;
#pragma GCC unroll 8
      for (int g = s * kGroups; g < (s + 1) * kGroups; ++g) {
        const __m512i w = _mm512_loadu_si512(wb + g * 4 * kPanel);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          int32_t four;
          std::memcpy(&four, xq + i * K + b * kBlock + 4 * g, 4);
          dot[i] = _mm512_dpbusd_epi32(dot[i], _mm512_set1_epi32(four), w);
        }
      }
      const __m512 ws = p.scales.sixteen(b * SUB + s);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(ws, _mm512_set1_ps(xs[i * nb + b])),
                                 acc[i]);
      if constexpr (MIN) {
        const __m512 wm = p.mins.sixteen(b * SUB + s);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          const float* sums = xsum + i * 2 * nb + 2 * b;  // x's rounded sums per 16
          acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(SUB == 2 ? sums[s] : sums[0] + sums[1]), acc[i]);
        }
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);  // the last panel may be narrower
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * ldy, mask, acc[i]);
}
#else
template <int MR, int SUB, bool MIN>
inline void microkernel(const uint8_t* xq, const float* xs, const float* xsum, int64_t K, Panel p, float* y,
                        int64_t ldy, int64_t cols, bool prefetch) {
  constexpr int kGroups = kBlock / 4 / SUB;  // 4-k groups per weight scale
  const int64_t nb = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = p.w + b * kBlock * kPanel;
    if (prefetch)
      for (int l = 0; l < kBlock * kPanel; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb + K * kPanel + l), _MM_HINT_T0);
#pragma GCC unroll 2
    for (int s = 0; s < SUB; ++s) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // channels 8h .. 8h + 7: 32 bytes of each 4-k group
        __m256i dot[MR];
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) dot[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = s * kGroups; g < (s + 1) * kGroups; ++g) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 4 * kPanel + h * 32));
          const __m256i aw = _mm256_abs_epi8(w);
#pragma GCC unroll 16
          for (int i = 0; i < MR; ++i) {
            uint32_t four;  // x's 4 bytes q + 128 -> q
            std::memcpy(&four, xq + i * K + b * kBlock + 4 * g, 4);
            const __m256i x = _mm256_set1_epi32(static_cast<int>(four ^ 0x80808080u));
            const __m256i pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
            dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(pairs, ones));
          }
        }
        const __m256 ws = p.scales.eight(b * SUB + s, h);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i)
          acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(ws, _mm256_set1_ps(xs[i * nb + b])),
                                      acc[i][h]);
        if constexpr (MIN) {
          const __m256 wm = p.mins.eight(b * SUB + s, h);
#pragma GCC unroll 16
          for (int i = 0; i < MR; ++i) {
            const float* sums = xsum + i * 2 * nb + 2 * b;
            acc[i][h] = _mm256_fmadd_ps(wm, _mm256_set1_ps(SUB == 2 ? sums[s] : sums[0] + sums[1]), acc[i][h]);
          }
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {  // the last panel may be narrower
    alignas(32) float out[kPanel];
    _mm256_store_ps(out, acc[i][0]);
    _mm256_store_ps(out + 8, acc[i][1]);
    std::memcpy(y + i * ldy, out, cols * sizeof(float));
  }
}
#endif

template <int MR, int SUB, bool MIN>
inline void last_rows(const uint8_t* xq, const float* xs, const float* xsum, int64_t M, int64_t K, Panel p, float* y,
                      int64_t N, int64_t cols, int64_t m) {
  if constexpr (MR > 0) {
    const int64_t nb = K / kBlock;
    if (M - m == MR)
      microkernel<MR, SUB, MIN>(xq + m * K, xs + m * nb, xsum + m * 2 * nb, K, p, y + m * N, N, cols, m == 0);
    else
      last_rows<MR - 1, SUB, MIN>(xq, xs, xsum, M, K, p, y, N, cols, m);
  }
}

// Rows m.. of x against one panel (y: the panel's first column) by the microkernel; from row 0, it prefetches the next.
template <int SUB, bool MIN>
inline void rows_from(const uint8_t* pxq, const float* pxs, const float* pxsum, int64_t M, int64_t K, Panel one,
                      float* y, int64_t N, int64_t cols, int64_t m) {
  const int64_t nb = K / kBlock;
  if (M - m > kRows) {  // several passes over this panel: its scales' steps converted once
    thread_local std::vector<float> scales;
    scales.resize(2 * nb * SUB * kPanel);
    one.scales = one.scales.as_floats(nb * SUB, scales.data());
    one.mins = one.mins.as_floats(nb * SUB, scales.data() + nb * SUB * kPanel);
  }
  for (; m + kRows <= M; m += kRows)
    microkernel<kRows, SUB, MIN>(pxq + m * K, pxs + m * nb, pxsum + m * 2 * nb, K, one, y + m * N, N, cols, m == 0);
  last_rows<kRows - 1, SUB, MIN>(pxq, pxs, pxsum, M, K, one, y, N, cols, m);
}

// Every (group, panel) item (expert_groups.h); SUB weight scales per 32 values along K, and with MIN as many mins.
template <int SUB, bool MIN>
void panels(const uint8_t* pxq, const float* pxs, const float* pxsum, int64_t K, Panel all, float* py, int64_t N,
            int64_t num_panels, const llm_kernels::ExpertGroups& groups) {
  const int64_t nb = K / kBlock;
  llm_kernels::parallel_take(groups.items(num_panels), [&](llm_kernels::WorkQueue& queue, int64_t t) {
    for (int64_t i; (i = queue.take(t)) >= 0;) {
      const auto [r, rows, p, column_panel] = groups.item(i, num_panels);
      rows_from<SUB, MIN>(pxq + r * K, pxs + r * nb, pxsum + r * 2 * nb, rows, K, all.nth(p, K, SUB),
                          py + r * N + column_panel * kPanel, N, std::min(kPanel, N - column_panel * kPanel), 0);
    }
  });
}

#if defined(LLM_AMX) && defined(__AMX_INT8__)
// With AMX-INT8 (Intel Xeon since Sapphire Rapids), 16 rows at a time: one tile multiply (tdpbusd) takes a block's
// 16 x 16 x 32 products, where VNNI spends 128 instructions. Per block the int32 tile goes through memory into the
// microkernel's float work (from comp, times the scales, summed over blocks in order): the same result, bit for bit.
// The last M % 16 rows go through the microkernel while the panel is in cache. A scale per 32 only (Q8_0; SUB 2 is a
// GGUF K-quant's sub-block, which stays on VNNI).
template <bool MIN>
void amx_panels(const uint8_t* pxq, const float* pxs, const float* pxsum, int64_t M, int64_t K, Panel all, float* py,
                int64_t N, int64_t num_panels) {
  const int64_t nb = K / kBlock, tiles = M / 16;
  llm_kernels::parallel_take(num_panels, [&](llm_kernels::WorkQueue& queue, int64_t thread) {
    llm_kernels::load_int8_block_tiles();
    alignas(64) int32_t c[16][kPanel];
    std::vector<float> scales(2 * nb * kPanel);  // a panel's scales as float32, for every tile
    for (int64_t p = queue.take(thread), next; p >= 0; p = next) {
      next = queue.take(thread);
      Panel one = all.nth(p, K, 1);
      one.scales = one.scales.as_floats(nb, scales.data());
      one.mins = one.mins.as_floats(nb, scales.data() + nb * kPanel);
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m = t * 16;
        __m512 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
          const int8_t* wb = one.w + b * kBlock * kPanel;
          if (t == 0 && next == p + 1)  // the next panel's block, as the microkernel prefetches it
            for (int l = 0; l < kBlock * kPanel; l += 64)
              _mm_prefetch(reinterpret_cast<const char*>(wb + K * kPanel + l), _MM_HINT_T0);
          _tile_loadd(0, pxq + m * K + b * kBlock, K);
          _tile_loadd(2, wb, 4 * kPanel);
          _tile_loadd(4, one.comp + b * kPanel, 0);  // every row starts from the block's comp
          _tile_dpbusd(4, 0, 2);
          _tile_stored(4, &c[0][0], 4 * kPanel);
          const __m512 ws = one.scales.sixteen(b);
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            const __m512i dot = _mm512_load_si512(&c[i][0]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, _mm512_set1_ps(pxs[(m + i) * nb + b])),
                                     acc[i]);
          }
          if constexpr (MIN) {
            const __m512 wm = one.mins.sixteen(b);
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) {
              const float* sums = pxsum + (m + i) * 2 * nb + 2 * b;
              acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(sums[0] + sums[1]), acc[i]);
            }
          }
        }
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) _mm512_mask_storeu_ps(py + (m + i) * N + p * kPanel, mask, acc[i]);
      }
      rows_from<1, MIN>(pxq, pxs, pxsum, M, K, one, py + p * kPanel, N, cols, tiles * 16);
    }
    _tile_release();
  });
}
#endif
#endif  // LLM_W8A8

// y = x @ W^T, or with groups each group of x's rows times its own expert's W (expert_groups.h).
at::Tensor q8_0_w8a8(const char* op, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& mins, const at::Tensor& comp, const at::Tensor& scale_steps,
                     const at::Tensor& min_steps, int64_t out_features,
                     const std::optional<llm_kernels::ExpertGroups>& experts) {
#if defined(LLM_W8A8)
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, op,
              ": x [M, K] float32 contiguous expected");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, stacked = packed.size(0), nb = K / kBlock;
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K % kBlock == 0, op, ": in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
              packed.size(1) == K / 4 && packed.size(2) == kPanel && packed.size(3) == 4 && stacked >= num_panels,
              op, ": weight packed [panels, K / 4, 16, 4] for in_features ", K, " expected");
  const llm_kernels::ExpertGroups groups = experts ? *experts : llm_kernels::ExpertGroups::one(M);
  TORCH_CHECK(experts || stacked == num_panels, op, ": ", stacked, " panels for ", N, " out_features");
  // a scale per 32 weights along K, or per 16: comp has one per scale
  TORCH_CHECK(comp.is_contiguous() && comp.dim() == 3 && comp.size(0) == stacked &&
              (comp.size(1) == nb || comp.size(1) == 2 * nb) && comp.size(2) == kPanel && comp.scalar_type() == at::kInt,
              op, ": comp [panels, K / 32 or K / 16, 16] int32 expected");
  const int64_t sub = comp.size(1) / nb;
  const llm_kernels::BlockScales ws = llm_kernels::block_scales(op, "scales", scales, scale_steps, stacked, nb * sub,
                                                                8 * sub);
  const llm_kernels::BlockScales wm = llm_kernels::block_scales(op, "mins", mins, min_steps, stacked, nb * sub, 8 * sub);
  TORCH_CHECK(ws.f, op, ": scales expected");
  const bool with_mins = wm.f != nullptr;  // none: empty tensors
  const size_t q_bytes = llm_kernels::aligned64(M * K), s_bytes = llm_kernels::aligned64(M * nb * sizeof(float));
  char* scratch = llm_kernels::thread_scratch(q_bytes + s_bytes + 2 * M * nb * sizeof(float));
  const float* px = x.data_ptr<float>();
  uint8_t* pxq = reinterpret_cast<uint8_t*>(scratch);
  float* pxs = reinterpret_cast<float*>(scratch + q_bytes);
  float* pxsum = reinterpret_cast<float*>(scratch + q_bytes + s_bytes);
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_block(px + i * kBlock, pxq + i * kBlock, pxs + i, pxsum + 2 * i);
  });
  auto y = at::empty({M, N}, x.options());
  const Panel all{packed.data_ptr<int8_t>(), ws, wm, comp.data_ptr<int32_t>()};
  float* py = y.data_ptr<float>();
  const bool per_32 = sub == 1;
#if defined(LLM_AMX) && defined(__AMX_INT8__)
  if (!experts && per_32 && M >= 16 && llm_kernels::amx_permitted()) {  // experts' groups stay on VNNI: the same bits
    if (with_mins) amx_panels<true>(pxq, pxs, pxsum, M, K, all, py, N, num_panels);
    else amx_panels<false>(pxq, pxs, pxsum, M, K, all, py, N, num_panels);
    return y;
  }
#endif
  if (with_mins && per_32) panels<1, true>(pxq, pxs, pxsum, K, all, py, N, num_panels, groups);
  else if (with_mins) panels<2, true>(pxq, pxs, pxsum, K, all, py, N, num_panels, groups);
  else if (per_32) panels<1, false>(pxq, pxs, pxsum, K, all, py, N, num_panels, groups);
  else panels<2, false>(pxq, pxs, pxsum, K, all, py, N, num_panels, groups);
  return y;
#else
  TORCH_CHECK(false, op, ": needs AVX2 and FMA (or AVX512-VNNI), which this build's CPU lacks");
#endif
}

at::Tensor q8_0_w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const at::Tensor& mins, const at::Tensor& comp, const at::Tensor& scale_steps,
                            const at::Tensor& min_steps, int64_t out_features) {
  return q8_0_w8a8("q8_0_w8a8_linear", x, packed, scales, mins, comp, scale_steps, min_steps, out_features,
                   std::nullopt);
}

at::Tensor q8_0_w8a8_experts(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const at::Tensor& mins, const at::Tensor& comp, const at::Tensor& scale_steps,
                             const at::Tensor& min_steps, int64_t out_features, at::IntArrayRef experts,
                             at::IntArrayRef offsets) {
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  return q8_0_w8a8("q8_0_w8a8_experts", x, packed, scales, mins, comp, scale_steps, min_steps, out_features,
                   llm_kernels::ExpertGroups::of("q8_0_w8a8_experts", experts, offsets, x.size(0), packed.size(0),
                                                 panels));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("q8_0_w8a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, Tensor comp, Tensor scale_steps, "
        "Tensor min_steps, int out_features) -> Tensor");
  m.def("q8_0_w8a8_experts(Tensor x, Tensor packed, Tensor scales, Tensor mins, Tensor comp, Tensor scale_steps, "
        "Tensor min_steps, int out_features, int[] experts, int[] offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("q8_0_w8a8_linear", &q8_0_w8a8_linear);
  m.impl("q8_0_w8a8_experts", &q8_0_w8a8_experts);
}
