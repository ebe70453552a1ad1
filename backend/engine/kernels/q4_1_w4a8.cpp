// y = x @ W^T with W in 4 bits, llama.cpp's Q4_1 x Q8_1: each run of 32 weights along a row is w ~ d * q + m with
// q in 0..15 (Q4_0 is the case m = -8 d, Q4_K's sub-blocks are this form too: gemm.py), and x rounded per call to
// int8, 32 values of a row per scale dx. Per block the 32 products q * qx are exact in int32, and
//     sum_k w_k x_k ~ d dx sum(q qx) + m dx sum(qx)
// so the only float work per block and row is two multiply-adds (sx = dx sum(qx) is computed with x's rounding).
//
// The 4-bit weights are unsigned and the activations signed: exactly the operand order of vpdpbusd (AVX512-VNNI,
// 4 products per 32-bit lane) and of vpmaddubsw (AVX2: 2 products per 16-bit lane, then vpmaddwd into int32; 8 of
// them add up within int16 since |q qx| <= 15 * 127). An AMD Zen 3 runs the AVX2 path.
//
// Packed W (gemm.py): panels of 16 output channels; per 32-weight block 4 groups of [16 channels][4 consecutive k]
// bytes, each byte holding k = 4g + j in its low nibble and k = 16 + 4g + j in its high one: one 64-byte load
// feeds 16 lanes twice. d and m: [panels][K / 32][16] float32, or a K-quant's int8 steps under a float16 unit per
// 256 weights (block_scales.h).
//
// With a table (GGUF IQ4_NL / IQ4_XS: w ~ d * values[q], values 16 int8, no min: m is not read) the nibble is an
// index, looked up in registers by vpshufb (16 bytes: exactly one 128-bit lane). VNNI multiplies unsigned weights, so
// it looks up u = values[q] + 128 and takes 128 d dx sum(qx) back out as the min would: m = -128 d, exact. AVX2's
// vpmaddubsw would saturate on u (2 x 241 x 127 > 2^15), so it multiplies |values[q]| by qx with values[q]'s sign
// (vpsignb) and widens each pair sum to int32 at once, as llama.cpp's IQ4_NL dot product does.

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
#include "prefetch.h"
#include "scratch.h"
#include "work_queue.h"

namespace {

using llm_kernels::BlockScales;

constexpr int64_t kBlock = 32;
constexpr int64_t kPanel = 16;
constexpr int64_t kPanelBytes = kBlock * kPanel / 2;  // one block of a panel

// One block of 32 floats -> 32 int8 (round half to even), its scale max|x| / 127 and scale * sum(q).
inline void quantize_block(const float* x, int8_t* q, float* scale, float* scaled_sum) {
#if defined(__AVX512F__)
  // as the loop below, 32 lanes at once: a 512-row prefill chunk's 295 K values took ~0.5 ms of a 1-1.5 ms GEMM so
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i r0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, inv), _MM_FROUND_TO_NEAREST_INT));
  const __m512i r1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, inv), _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(r0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(r1));
  const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
#else
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
#endif
  *scale = amax / 127.f;
  *scaled_sum = *scale * static_cast<float>(sum);
}

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kRows = 12;  // rows of x per microkernel call: 12 int32 + 12 float accumulators

// A table's values + 128 as bytes, in each 128-bit lane: what vpdpbusd's unsigned operand looks up.
inline __m512i biased_table(const int8_t* values) {
  return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values))),
                          _mm512_set1_epi8(static_cast<char>(0x80)));
}

// 64 packed bytes -> their low and high nibbles as bytes (with kTable, the table's biased values they index).
template <bool kTable>
inline void nibbles(__m512i v, __m512i table, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  if constexpr (kTable) lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
}

template <int MR, bool kTable>
inline void microkernel(const int8_t* xq, const float* xd, const float* xs, int64_t K, const uint8_t* wp,
                        BlockScales dp, BlockScales mp, const int8_t* values, float* y, int64_t ldy, bool prefetch) {
  const int64_t nb = K / kBlock;
  const __m512i table = kTable ? biased_table(values) : _mm512_setzero_si512();
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = wp + b * kPanelBytes;
    if (prefetch) llm_kernels::prefetch_l2(wb + nb * kPanelBytes, kPanelBytes);  // the next panel follows this one
    __m512i dot[MR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) dot[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      __m512i lo, hi;
      nibbles<kTable>(_mm512_loadu_si512(wb + g * 64), table, lo, hi);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const int8_t* xb = xq + i * K + b * kBlock + 4 * g;
        dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(four_bytes(xb)));
        dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(four_bytes(xb + 16)));
      }
    }
    const __m512 wd = dp.sixteen(b);
    const __m512 wm = kTable ? _mm512_mul_ps(wd, _mm512_set1_ps(-128.f)) : mp.sixteen(b);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(wd, _mm512_set1_ps(xd[i * nb + b])), acc[i]);
      acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xs[i * nb + b]), acc[i]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + i * ldy, acc[i]);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 4;  // with two 8-channel halves per row: 8 float accumulators of AVX2's 16 registers

template <int MR, bool kTable>
inline void microkernel(const int8_t* xq, const float* xd, const float* xs, int64_t K, const uint8_t* wp,
                        BlockScales dp, BlockScales mp, const int8_t* values, float* y, int64_t ldy, bool prefetch) {
  const int64_t nb = K / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i table = _mm256_setzero_si256();
  if constexpr (kTable) table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
  __m256 acc[MR][2];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = wp + b * kPanelBytes;
    if (prefetch) llm_kernels::prefetch_l2(wb + nb * kPanelBytes, kPanelBytes);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // channels 8h .. 8h + 7
      __m256i dot[MR];
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) dot[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if constexpr (kTable) {  // int32 sums of |w| (x with w's sign): each pair <= 2 x 127 x 127 < 2^15
          const __m256i wl = _mm256_shuffle_epi8(table, lo), wh = _mm256_shuffle_epi8(table, hi);
          const __m256i al = _mm256_abs_epi8(wl), ah = _mm256_abs_epi8(wh);
#pragma GCC unroll 16
          for (int i = 0; i < MR; ++i) {
            const int8_t* xb = xq + i * K + b * kBlock + 4 * g;
            const __m256i pl = _mm256_maddubs_epi16(al, _mm256_sign_epi8(_mm256_set1_epi32(four_bytes(xb)), wl));
            const __m256i ph = _mm256_maddubs_epi16(ah, _mm256_sign_epi8(_mm256_set1_epi32(four_bytes(xb + 16)), wh));
            dot[i] = _mm256_add_epi32(dot[i],
                                      _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones)));
          }
        } else {
#pragma GCC unroll 16
          for (int i = 0; i < MR; ++i) {  // int16 sums: 8 x 2 x 15 x 127 < 2^15
            const int8_t* xb = xq + i * K + b * kBlock + 4 * g;
            dot[i] = _mm256_add_epi16(dot[i], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_bytes(xb))));
            dot[i] = _mm256_add_epi16(dot[i], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_bytes(xb + 16))));
          }
        }
      }
      const __m256 wd = dp.eight(b, h);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m256 d = _mm256_cvtepi32_ps(kTable ? dot[i] : _mm256_madd_epi16(dot[i], ones));
        acc[i][h] = _mm256_fmadd_ps(d, _mm256_mul_ps(wd, _mm256_set1_ps(xd[i * nb + b])), acc[i][h]);
        if constexpr (!kTable)
          acc[i][h] = _mm256_fmadd_ps(mp.eight(b, h), _mm256_set1_ps(xs[i * nb + b]), acc[i][h]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(y + i * ldy, acc[i][0]);
    _mm256_storeu_ps(y + i * ldy + 8, acc[i][1]);
  }
}
#endif

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
template <int MR, bool kTable>
inline void last_rows(const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K, const uint8_t* wp,
                      BlockScales dp, BlockScales mp, const int8_t* values, float* y, int64_t ldy, int64_t m) {
  if constexpr (MR > 0) {
    const int64_t nb = K / kBlock;
    if (M - m == MR)
      microkernel<MR, kTable>(xq + m * K, xd + m * nb, xs + m * nb, K, wp, dp, mp, values, y + m * ldy, ldy, m == 0);
    else
      last_rows<MR - 1, kTable>(xq, xd, xs, M, K, wp, dp, mp, values, y, ldy, m);
  }
}

// Rows r.. of x against one panel (y: the panel's first column) by the microkernel; from row 0, it prefetches the next.
template <bool kTable>
inline void rows_from(const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K, const uint8_t* wp,
                      BlockScales dp, BlockScales mp, const int8_t* values, float* y, int64_t ldy, int64_t r) {
  const int64_t nb = K / kBlock;
  if (M - r > kRows) {  // several passes over this panel: its scales' steps converted once
    thread_local std::vector<float> scales;
    scales.resize(2 * nb * kPanel);
    dp = dp.as_floats(nb, scales.data()), mp = mp.as_floats(nb, scales.data() + nb * kPanel);
  }
  for (; r + kRows <= M; r += kRows)
    microkernel<kRows, kTable>(xq + r * K, xd + r * nb, xs + r * nb, K, wp, dp, mp, values, y + r * ldy, ldy, r == 0);
  last_rows<kRows - 1, kTable>(xq, xd, xs, M, K, wp, dp, mp, values, y, ldy, r);
}

template <bool kTable>  // threads split the (group, panel) items (work_queue.h); y has whole panels, ldy columns
void panels_times_x(const int8_t* xq, const float* xd, const float* xs, int64_t K, int64_t panels,
                    const llm_kernels::ExpertGroups& groups, const uint8_t* w, BlockScales d, BlockScales m,
                    const int8_t* values, float* y, int64_t ldy) {
  const int64_t nb = K / kBlock;
  llm_kernels::parallel_take(groups.items(panels), [&](llm_kernels::WorkQueue& queue, int64_t t) {
    for (int64_t i; (i = queue.take(t)) >= 0;) {
      const auto [r, rows, p, column_panel] = groups.item(i, panels);
      rows_from<kTable>(xq + r * K, xd + r * nb, xs + r * nb, rows, K, w + p * nb * kPanelBytes, d.nth(p, nb),
                        m.nth(p, nb), values, y + r * ldy + column_panel * kPanel, ldy, 0);
    }
  });
}

#if defined(LLM_AMX) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// With AMX-INT8 (Intel Xeon since Sapphire Rapids), 16 rows at a time: a panel's 4-bit weights are widened once into
// bytes laid out as tiles (a block's low nibbles are k = 4g + j, its high ones 16 + 4g + j: rows g and 4 + g of its
// [8][16 channels][4 k] tile), then one tile multiply (tdpbsud) takes a block's 16 x 16 x 32 products, where VNNI
// spends 128 instructions. Per block the int32 tile goes through memory into the microkernel's float work, while the
// tiles take the next block (amx.h): the same result, bit for bit. The last M % 16 rows go through the microkernel
// while the panel is in cache.
template <bool kTable>
void amx_panels(const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K, int64_t panels,
                const uint8_t* w, BlockScales d, BlockScales m, const int8_t* values, float* y, int64_t ldy) {
  const int64_t nb = K / kBlock, tiles = M / 16;
  llm_kernels::parallel_take(panels, [&](llm_kernels::WorkQueue& queue, int64_t thread) {
    llm_kernels::load_int8_block_tiles();
    std::vector<uint8_t> wide(nb * kBlock * kPanel);  // a panel's weights, a byte each
    std::vector<float> scales(2 * nb * kPanel);  // and its scales as float32, for every tile
    const __m512i table = kTable ? biased_table(values) : _mm512_setzero_si512();
    for (int64_t p = queue.take(thread), next; p >= 0; p = next) {
      next = queue.take(thread);
      const uint8_t* wp = w + p * nb * kPanelBytes;
      const BlockScales dp = d.nth(p, nb).as_floats(nb, scales.data()),
                        mp = m.nth(p, nb).as_floats(nb, scales.data() + nb * kPanel);
      for (int64_t b = 0; b < nb; ++b) {
        for (int g = 0; g < 4; ++g) {
          __m512i lo, hi;
          nibbles<kTable>(_mm512_loadu_si512(wp + b * kPanelBytes + g * 64), table, lo, hi);
          _mm512_storeu_si512(wide.data() + b * 512 + g * 64, lo);
          _mm512_storeu_si512(wide.data() + b * 512 + (4 + g) * 64, hi);
        }
      }
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r = t * 16;
        __m512 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        const auto weights = [&](int64_t b) __attribute__((always_inline)) {
          if (t == 0 && next == p + 1)  // the next panel's block, as the microkernel prefetches it
            llm_kernels::prefetch_l2(wp + (nb + b) * kPanelBytes, kPanelBytes);
          return wide.data() + b * 512;
        };
        const auto use = [&](int64_t b, const int32_t* c) __attribute__((always_inline)) {
          const __m512 wd = dp.sixteen(b);
          const __m512 wm = kTable ? _mm512_mul_ps(wd, _mm512_set1_ps(-128.f)) : mp.sixteen(b);
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + i * kPanel)),
                                     _mm512_mul_ps(wd, _mm512_set1_ps(xd[(r + i) * nb + b])), acc[i]);
            acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xs[(r + i) * nb + b]), acc[i]);
          }
        };
        llm_kernels::int8_block_products(xq + r * K, K, nb, weights, use);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(y + (r + i) * ldy + p * kPanel, acc[i]);
      }
      rows_from<kTable>(xq, xd, xs, M, K, wp, dp, mp, values, y + p * kPanel, ldy, tiles * 16);
    }
    _tile_release();
  });
}
#endif
#endif

// y = x @ W^T, or with groups each group of x's rows times its own expert's W (expert_groups.h).
at::Tensor q4_1_w4a8(const char* op, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                     const at::Tensor& m, const at::Tensor& d_steps, const at::Tensor& m_steps,
                     const at::Tensor& values, int64_t out_features,
                     const std::optional<llm_kernels::ExpertGroups>& experts) {
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, op,
              ": x [M, K] float32 contiguous expected");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, stacked = packed.size(0), nb = K / kBlock;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K % kBlock == 0, op, ": in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
              packed.size(1) == nb && packed.size(2) == kPanelBytes && stacked >= panels,
              op, ": weight packed [panels, K / 32, 256] uint8 for in_features ", K, " expected");
  const llm_kernels::ExpertGroups groups = experts ? *experts : llm_kernels::ExpertGroups::one(M);
  TORCH_CHECK(experts || stacked == panels, op, ": ", stacked, " panels for ", N, " out_features");
  const bool table = values.numel() > 0;
  const BlockScales wd = llm_kernels::block_scales(op, "d", d, d_steps, stacked, nb, 8);
  const BlockScales wm = llm_kernels::block_scales(op, "m", m, m_steps, stacked, nb, 8);
  TORCH_CHECK(wd.given() && !wm.given() == table, op, ": d, and m unless values are given, expected");
  TORCH_CHECK(!table || (values.sizes() == at::IntArrayRef({16}) && values.scalar_type() == at::kChar &&
                         values.is_contiguous()),
              op, ": values (the weight of each 4-bit index) [16] int8, or empty, expected");
  const size_t q_bytes = llm_kernels::aligned64(M * K), f_bytes = llm_kernels::aligned64(M * nb * sizeof(float));
  char* scratch = llm_kernels::thread_scratch(q_bytes + 2 * f_bytes);
  const float* px = x.data_ptr<float>();
  int8_t* pxq = reinterpret_cast<int8_t*>(scratch);
  float* pxd = reinterpret_cast<float*>(scratch + q_bytes);
  float* pxs = reinterpret_cast<float*>(scratch + q_bytes + f_bytes);
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_block(px + i * kBlock, pxq + i * kBlock, pxd + i, pxs + i);
  });
  const int64_t ldy = panels * kPanel;  // whole panels: the padded channels are cut off below
  auto y = at::empty({M, ldy}, x.options());
  const uint8_t* pw = packed.data_ptr<uint8_t>();
  float* py = y.data_ptr<float>();
#if defined(LLM_AMX) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // at 16 rows widening a panel for one tile cost more than it gave; experts' groups stay on VNNI (the same bits)
  if (!experts && M >= 32 && llm_kernels::amx_permitted()) {
    if (table) amx_panels<true>(pxq, pxd, pxs, M, K, panels, pw, wd, wm, values.data_ptr<int8_t>(), py, ldy);
    else amx_panels<false>(pxq, pxd, pxs, M, K, panels, pw, wd, wm, nullptr, py, ldy);
    return ldy == N ? y : y.narrow(1, 0, N).contiguous();
  }
#endif
  if (table)
    panels_times_x<true>(pxq, pxd, pxs, K, panels, groups, pw, wd, wm, values.data_ptr<int8_t>(), py, ldy);
  else
    panels_times_x<false>(pxq, pxd, pxs, K, panels, groups, pw, wd, wm, nullptr, py, ldy);
  return ldy == N ? y : y.narrow(1, 0, N).contiguous();
#else
  TORCH_CHECK(false, op, ": needs AVX2 and FMA (or AVX512-VNNI), which this build's CPU lacks");
#endif
}

at::Tensor q4_1_w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                            const at::Tensor& d_steps, const at::Tensor& m_steps, const at::Tensor& values,
                            int64_t out_features) {
  return q4_1_w4a8("q4_1_w4a8_linear", x, packed, d, m, d_steps, m_steps, values, out_features, std::nullopt);
}

at::Tensor q4_1_w4a8_experts(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                             const at::Tensor& d_steps, const at::Tensor& m_steps, const at::Tensor& values,
                             int64_t out_features, at::IntArrayRef experts, at::IntArrayRef offsets) {
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  return q4_1_w4a8("q4_1_w4a8_experts", x, packed, d, m, d_steps, m_steps, values, out_features,
                   llm_kernels::ExpertGroups::of("q4_1_w4a8_experts", experts, offsets, x.size(0), packed.size(0),
                                                 panels));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("q4_1_w4a8_linear(Tensor x, Tensor packed, Tensor d, Tensor m, Tensor d_steps, Tensor m_steps, Tensor values, "
        "int out_features) -> Tensor");
  m.def("q4_1_w4a8_experts(Tensor x, Tensor packed, Tensor d, Tensor m, Tensor d_steps, Tensor m_steps, "
        "Tensor values, int out_features, int[] experts, int[] offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("q4_1_w4a8_linear", &q4_1_w4a8_linear);
  m.impl("q4_1_w4a8_experts", &q4_1_w4a8_experts);
}
