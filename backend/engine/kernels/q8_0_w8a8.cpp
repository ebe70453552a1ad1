// y = x @ W^T in int8 arithmetic, llama.cpp's Q8_0 x Q8_0: W rounded per 32 weights along a row (as q8_linear.cpp),
// and x rounded the same way per call, 32 values of a row per scale. A block's 32 products are exact in int32
// (vpdpbusd, AVX512-VNNI); only the scales' product and the sum over blocks are float. 4 products per lane per
// instruction, where the weight-only kernel does 1: prefill-sized steps run ~2x faster than float32. W may have a
// scale per 16 instead (a GGUF K-quant's sub-blocks: Q6_K, Q3_K, Q2_K, models/weight_blocks.py), whose values fit in
// 6 bits and are read so (below): a block then sums two int32 dot products in float, one per weight scale. Or a min
// per scale as well (w ~ q * scale + min: GGUF Q5_1, Q5_K, Q2_K): each adds min * sum(x), the sum of x's rounded
// values (llama.cpp's Q8_1 activations).
// A K-quant's scales and mins may come as stored, int8 steps under a float16 unit per 256 weights (block_scales.h).
//
// vpdpbusd multiplies unsigned by signed bytes: the weights are held as u = w + 128 (w ^ 0x80, 0..255) and x signed,
// so each block's sum carries 128 * sum(x), which the accumulator starts from minus: a figure of x (per row and
// block, made as x is rounded), not of W, so W carries nothing beside its values and scales (8.5 bits a weight with
// a GGUF Q8_0's float16 scales, as llama.cpp reads it).
// Packed W (gemm.py): panels of 16 output channels, 4 consecutive k per channel together ([K/4][16][4] bytes), so one
// 64-byte load feeds 16 lanes. With AVX2 only (AMD Zen 3), llama.cpp's ggml_vec_dot_q8_0_q8_0 form on w = u ^ 0x80:
// vpmaddubsw multiplies |w| by x carrying w's sign (vpsignb; a pair's sum, at most 2 x 128 x 127, fits int16),
// vpmaddwd adds the pairs into int32, 8 channels a vector: the same exact int32 dot products and the same float work
// after them, so the same result bit for bit.
//
// 6-bit weights (a scale per 16) are u = q + 32 in 0..63, as llama.cpp's Q6_K holds them: their low 4 bits in
// q4_1_w4a8.cpp's layout (a block's 4 groups of [16 channels][4 k] bytes, a byte's low nibble k = 4g + j of the
// first sub-block, its high one 16 + 4g + j of the second) and their top 2 bits in two 64-byte planes (bits 2g and
// 2g + 1 of a byte: group g's low nibbles in the first plane, its high ones in the second), 384 bytes a block of a
// panel. There u is the unsigned operand and x the signed one (vpdpbusd; AVX2's vpmaddubsw, whose pair sums, at most
// 2 x 63 x 128, fit int16), as for 8-bit ones: each sub-block's dot product less 32 * sum(x) over its 16 values is
// sum(q x) exactly, the 8-bit layout's, and the float work after it is the same: the same result bit for bit, from
// 6.6 bits a weight instead of 8.6.

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

// The block loops' helpers that take the accumulators by pointer are forced inline: GCC had left six_bit_dots and the
// microkernels' `add` calls of their own, the dot products stored to memory and loaded back around every call (a
// 1-row Q6_K GEMM ran at 14 GB/s a thread from DRAM, AMD Zen 4).
#define ALWAYS_INLINE __attribute__((always_inline))

constexpr int64_t kBlock = 32;
constexpr int64_t kPanel = 16;
constexpr int64_t kSixBitBlock = kBlock * kPanel * 6 / 8;  // a 6-bit panel's block: 256 nibble bytes, 128 of top bits

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kRows = 12;  // rows of x per microkernel call: 12 int32 + 12 float accumulators
#define LLM_W8A8 1

// One block of 32 floats -> 32 int8 q, the block's scale (max|x| / 127), the dot products' starts (-32 * sum(q) of
// each 16 values, -128 * sum(q) of all 32) and scale * sum(q) of each 16 values; round half to even.
inline void quantize_block(const float* x, int8_t* q, float* scale, int32_t* starts, float* scaled_sums) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  *scale = m / 127.f;
  const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
  const __m512i r0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, inv), _MM_FROUND_TO_NEAREST_INT));
  const __m512i r1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, inv), _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(r0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(r1));
  const int32_t sums[2] = {_mm512_reduce_add_epi32(r0), _mm512_reduce_add_epi32(r1)};
  starts[0] = -32 * sums[0], starts[1] = -32 * sums[1], starts[2] = -128 * (sums[0] + sums[1]);
  scaled_sums[0] = *scale * static_cast<float>(sums[0]);
  scaled_sums[1] = *scale * static_cast<float>(sums[1]);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 4;  // with two 8-channel halves per row: 8 float + 4 int32 accumulators of AVX2's 16 registers
#define LLM_W8A8 1

// quantize_block of the AVX-512 build, a lane at a time: the same rounding (half to even), bytes and sums.
inline void quantize_block(const float* x, int8_t* q, float* scale, int32_t* starts, float* scaled_sums) {
  float m = 0.f;
  for (int i = 0; i < kBlock; ++i) m = std::max(m, std::fabs(x[i]));
  *scale = m / 127.f;
  const float inv = m > 0.f ? 127.f / m : 0.f;
  int32_t sums[2] = {0, 0};
  for (int i = 0; i < kBlock; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<int8_t>(v);
    sums[i / 16] += v;
  }
  starts[0] = -32 * sums[0], starts[1] = -32 * sums[1], starts[2] = -128 * (sums[0] + sums[1]);
  scaled_sums[0] = *scale * static_cast<float>(sums[0]);
  scaled_sums[1] = *scale * static_cast<float>(sums[1]);
}
#endif

#if defined(LLM_W8A8)

// x as one call rounds it: per row its K int8 values, per 32 the scale and 3 starts (where a 6-bit weight's dot
// products start, -32 * sum(q) per 16 values, and an 8-bit one's, -128 * sum(q): vectors broadcast from memory), then
// per 16 values scale * sum(q). The rows from m on: from(m).
struct Rounded {
  const int8_t* q;
  const float* scale;
  const int32_t* starts;
  const float* scaled_sums;
  int64_t K;

  Rounded from(int64_t m) const {
    const int64_t nb = K / kBlock;
    return {q + m * K, scale + m * nb, starts + m * 3 * nb, scaled_sums + m * 2 * nb, K};
  }
  int32_t four(int i, int64_t k) const {  // x's 4 bytes at k of row i
    int32_t v;
    std::memcpy(&v, q + i * K + k, 4);
    return v;
  }
  const int32_t& start(int i, int64_t b, int s) const {  // row i's block b: s 0, 1 its 16-value halves', 2 all 32's
    return starts[(i * (K / kBlock) + b) * 3 + s];
  }
};

// Pointers to one panel: its weights, scales (and mins), as `q8_0_w8a8_linear` takes them.
struct Panel {
  const uint8_t* w;  // [K / 4][16][4] u = w + 128, or with 6 bits (SUB 2) [K / 32][384] bytes
  llm_kernels::BlockScales scales;  // block_scales.h
  llm_kernels::BlockScales mins;  // w ~ q * scale + min (GGUF Q5_1, Q5_K, Q2_K), as the scales: min * sum(x) joins

  // Panel p of these (all panels'), for K input features and `sub` weight scales per 32 values along K.
  Panel nth(int64_t p, int64_t K, int64_t sub) const {
    const int64_t n = K / kBlock * sub, bytes = sub == 1 ? K * kPanel : K / kBlock * kSixBitBlock;
    return {w + p * bytes, scales.nth(p, n), mins.nth(p, n)};
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Group g's top 2 bits of each byte of a plane (bits 2g, 2g + 1) at bits 4 and 5, the other bits zero; u's nibbles
// or'ed with them make u.
template <int G>
ALWAYS_INLINE inline __m512i top_bits(__m512i plane) {
  const __m512i mask = _mm512_set1_epi8(0x30);
  if constexpr (G < 2) return _mm512_and_si512(_mm512_slli_epi16(plane, 4 - 2 * G), mask);
  else if constexpr (G == 2) return _mm512_and_si512(plane, mask);
  else return _mm512_and_si512(_mm512_srli_epi16(plane, 2), mask);
}

// u of a 6-bit block's group G of sub-block S (0: the low nibbles, with the first plane's top bits; 1: the high ones,
// with the second plane's).
template <int S, int G>
ALWAYS_INLINE inline __m512i six_bit_u(const uint8_t* wb) {
  const __m512i v = _mm512_loadu_si512(wb + G * 64), plane = _mm512_loadu_si512(wb + 256 + 64 * S);
  return _mm512_or_si512(_mm512_and_si512(S == 0 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)),
                         top_bits<G>(plane));
}

// Group G of sub-block S of a 6-bit block into each row's dot product.
template <int MR, int S, int G>
ALWAYS_INLINE inline void six_bit_group(const uint8_t* wb, const Rounded& x, int64_t b, __m512i* dot) {
  const __m512i u = six_bit_u<S, G>(wb);
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    dot[i] = _mm512_dpbusd_epi32(dot[i], u, _mm512_set1_epi32(x.four(i, b * kBlock + 16 * S + 4 * G)));
}

// Sub-block S of a 6-bit block: each row's sum(q x) over its 16 values, from -32 * sum(x) on. The sub-blocks take
// turns, not both at once: 12 rows' two int32 accumulators and their float ones would not fit in 32 registers.
template <int MR, int S>
ALWAYS_INLINE inline void six_bit_dots(const uint8_t* wb, const Rounded& x, int64_t b, __m512i* dot) {
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) dot[i] = _mm512_set1_epi32(x.start(i, b, S));
  six_bit_group<MR, S, 0>(wb, x, b, dot);
  six_bit_group<MR, S, 1>(wb, x, b, dot);
  six_bit_group<MR, S, 2>(wb, x, b, dot);
  six_bit_group<MR, S, 3>(wb, x, b, dot);
}

template <int MR, int SUB, bool MIN>
inline void microkernel(const Rounded& x, Panel p, float* y, int64_t ldy, int64_t cols, bool prefetch) {
  const int64_t K = x.K, nb = K / kBlock;
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  // each sub-block's int32 dot products into the accumulators, in order: times scale and x's scale, then the min's
  const auto add = [&](const __m512i* dot, int64_t b, int64_t s) ALWAYS_INLINE {
    const __m512 ws = p.scales.sixteen(b * SUB + s);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(ws, _mm512_set1_ps(x.scale[i * nb + b])),
                               acc[i]);
    if constexpr (MIN) {
      const __m512 wm = p.mins.sixteen(b * SUB + s);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const float* sums = x.scaled_sums + i * 2 * nb + 2 * b;  // x's rounded sums per 16
        acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(SUB == 2 ? sums[s] : sums[0] + sums[1]), acc[i]);
      }
    }
  };
  if constexpr (SUB == 2) {  // 6 bits
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = p.w + b * kSixBitBlock;
      if (prefetch) llm_kernels::prefetch_l2(wb + nb * kSixBitBlock, kSixBitBlock);  // the next panel follows this one
      __m512i dot[MR];
      six_bit_dots<MR, 0>(wb, x, b, dot);
      add(dot, b, 0);
      six_bit_dots<MR, 1>(wb, x, b, dot);
      add(dot, b, 1);
    }
  } else {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = p.w + b * kBlock * kPanel;
      if (prefetch) llm_kernels::prefetch_l2(wb + K * kPanel, kBlock * kPanel);
      __m512i dot[MR];
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) dot[i] = _mm512_set1_epi32(x.start(i, b, 2));
#pragma GCC unroll 8
      for (int g = 0; g < kBlock / 4; ++g) {
        const __m512i u = _mm512_loadu_si512(wb + g * 4 * kPanel);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i)
          dot[i] = _mm512_dpbusd_epi32(dot[i], u, _mm512_set1_epi32(x.four(i, b * kBlock + 4 * g)));
      }
      add(dot, b, 0);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);  // the last panel may be narrower
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * ldy, mask, acc[i]);
}
#else
// Group g's top 2 bits of each byte of a plane at bits 4 and 5 (as the AVX-512 build's).
template <int G>
ALWAYS_INLINE inline __m256i top_bits(__m256i plane) {
  const __m256i mask = _mm256_set1_epi8(0x30);
  if constexpr (G < 2) return _mm256_and_si256(_mm256_slli_epi16(plane, 4 - 2 * G), mask);
  else if constexpr (G == 2) return _mm256_and_si256(plane, mask);
  else return _mm256_and_si256(_mm256_srli_epi16(plane, 2), mask);
}

// channels 8h .. 8h + 7 of the AVX-512 build's six_bit_u
template <int S, int G>
ALWAYS_INLINE inline __m256i six_bit_u(const uint8_t* wb, int h) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + G * 64 + h * 32));
  const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 256 + 64 * S + h * 32));
  return _mm256_or_si256(_mm256_and_si256(S == 0 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)),
                         top_bits<G>(plane));
}

// Channels 8h .. 8h + 7 of group G of a 6-bit block's sub-block S into each row's dot product (int32), as the
// AVX-512 build's.
template <int MR, int S, int G>
ALWAYS_INLINE inline void six_bit_group(const uint8_t* wb, int h, const Rounded& x, int64_t b, __m256i* dot) {
  const __m256i ones = _mm256_set1_epi16(1), u = six_bit_u<S, G>(wb, h);
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    const __m256i xs = _mm256_set1_epi32(x.four(i, b * kBlock + 16 * S + 4 * G));
    dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xs), ones));
  }
}

template <int MR, int S>
ALWAYS_INLINE inline void six_bit_dots(const uint8_t* wb, int h, const Rounded& x, int64_t b, __m256i* dot) {
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) dot[i] = _mm256_set1_epi32(x.start(i, b, S));
  six_bit_group<MR, S, 0>(wb, h, x, b, dot);
  six_bit_group<MR, S, 1>(wb, h, x, b, dot);
  six_bit_group<MR, S, 2>(wb, h, x, b, dot);
  six_bit_group<MR, S, 3>(wb, h, x, b, dot);
}

template <int MR, int SUB, bool MIN>
inline void microkernel(const Rounded& x, Panel p, float* y, int64_t ldy, int64_t cols, bool prefetch) {
  const int64_t K = x.K, nb = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  // channels 8h .. 8h + 7 of each sub-block's int32 dot products into the accumulators, as the AVX-512 build's
  const auto add = [&](const __m256i* dot, int64_t b, int64_t s, int h) ALWAYS_INLINE {
    const __m256 ws = p.scales.eight(b * SUB + s, h);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(ws, _mm256_set1_ps(x.scale[i * nb + b])),
                                  acc[i][h]);
    if constexpr (MIN) {
      const __m256 wm = p.mins.eight(b * SUB + s, h);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const float* sums = x.scaled_sums + i * 2 * nb + 2 * b;
        acc[i][h] = _mm256_fmadd_ps(wm, _mm256_set1_ps(SUB == 2 ? sums[s] : sums[0] + sums[1]), acc[i][h]);
      }
    }
  };
  if constexpr (SUB == 2) {  // 6 bits
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = p.w + b * kSixBitBlock;
      if (prefetch) llm_kernels::prefetch_l2(wb + nb * kSixBitBlock, kSixBitBlock);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256i dot[MR];
        six_bit_dots<MR, 0>(wb, h, x, b, dot);
        add(dot, b, 0, h);
        six_bit_dots<MR, 1>(wb, h, x, b, dot);
        add(dot, b, 1, h);
      }
    }
  } else {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = p.w + b * kBlock * kPanel;
      if (prefetch) llm_kernels::prefetch_l2(wb + K * kPanel, kBlock * kPanel);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // channels 8h .. 8h + 7: 32 bytes of each 4-k group
        __m256i dot[MR];
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) dot[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < kBlock / 4; ++g) {
          const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 4 * kPanel + h * 32));
          const __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
          const __m256i aw = _mm256_abs_epi8(w);
#pragma GCC unroll 16
          for (int i = 0; i < MR; ++i) {
            const __m256i pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(
                _mm256_set1_epi32(x.four(i, b * kBlock + 4 * g)), w));
            dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(pairs, ones));
          }
        }
        add(dot, b, 0, h);
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
inline void last_rows(const Rounded& x, int64_t M, Panel p, float* y, int64_t N, int64_t cols, int64_t m) {
  if constexpr (MR > 0) {
    if (M - m == MR)
      microkernel<MR, SUB, MIN>(x.from(m), p, y + m * N, N, cols, m == 0);
    else
      last_rows<MR - 1, SUB, MIN>(x, M, p, y, N, cols, m);
  }
}

// Rows m.. of x against one panel (y: the panel's first column) by the microkernel; from row 0, it prefetches the next.
template <int SUB, bool MIN>
inline void rows_from(const Rounded& x, int64_t M, Panel one, float* y, int64_t N, int64_t cols, int64_t m) {
  const int64_t nb = x.K / kBlock;
  if (M - m > kRows) {  // several passes over this panel: its scales' steps converted once
    thread_local std::vector<float> scales;
    scales.resize(2 * nb * SUB * kPanel);
    one.scales = one.scales.as_floats(nb * SUB, scales.data());
    one.mins = one.mins.as_floats(nb * SUB, scales.data() + nb * SUB * kPanel);
  }
  for (; m + kRows <= M; m += kRows) microkernel<kRows, SUB, MIN>(x.from(m), one, y + m * N, N, cols, m == 0);
  last_rows<kRows - 1, SUB, MIN>(x, M, one, y, N, cols, m);
}

// Every (group, panel) item (expert_groups.h); SUB weight scales per 32 values along K, and with MIN as many mins.
template <int SUB, bool MIN>
void panels(const Rounded& x, Panel all, float* py, int64_t N, int64_t num_panels,
            const llm_kernels::ExpertGroups& groups) {
  llm_kernels::parallel_take(groups.items(num_panels), [&](llm_kernels::WorkQueue& queue, int64_t t) {
    for (int64_t i; (i = queue.take(t)) >= 0;) {
      const auto [r, rows, p, column_panel] = groups.item(i, num_panels);
      rows_from<SUB, MIN>(x.from(r), rows, all.nth(p, x.K, SUB), py + r * N + column_panel * kPanel, N,
                          std::min(kPanel, N - column_panel * kPanel), 0);
    }
  });
}

#if defined(LLM_AMX) && defined(__AMX_INT8__)
// With AMX-INT8 (Intel Xeon since Sapphire Rapids), 16 rows at a time: one tile multiply (tdpbsud: x signed, u
// unsigned) takes a block's 16 x 16 x 32 products, where VNNI spends 128 instructions. Per block the int32 tile goes
// through memory into the microkernel's float work (plus the row's -128 * sum(x), times the scales, summed over
// blocks in order), while the tiles take the next block (amx.h): the same result, bit for bit.
// The last M % 16 rows go through the microkernel while the panel is in cache. A scale per 32 only (Q8_0; SUB 2 is a
// GGUF K-quant's 6-bit sub-blocks, which stay on VNNI).
template <bool MIN>
void amx_panels(const Rounded& x, int64_t M, Panel all, float* py, int64_t N, int64_t num_panels) {
  const int64_t K = x.K, nb = K / kBlock, tiles = M / 16;
  llm_kernels::parallel_take(num_panels, [&](llm_kernels::WorkQueue& queue, int64_t thread) {
    llm_kernels::load_int8_block_tiles();
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
        const auto weights = [&](int64_t b) ALWAYS_INLINE {
          const uint8_t* wb = one.w + b * kBlock * kPanel;
          if (t == 0 && next == p + 1)  // the next panel's block, as the microkernel prefetches it
            llm_kernels::prefetch_l2(wb + K * kPanel, kBlock * kPanel);
          llm_kernels::prefetch_l1(wb + 2 * kBlock * kPanel, kBlock * kPanel);  // a tile load waits for L2, unlike VNNI's
          return wb;
        };
        const auto use = [&](int64_t b, const int32_t* c) ALWAYS_INLINE {
          const __m512 ws = one.scales.sixteen(b);
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            const __m512i dot = _mm512_add_epi32(_mm512_load_si512(c + i * kPanel),
                                                 _mm512_set1_epi32(x.start(m + i, b, 2)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, _mm512_set1_ps(x.scale[(m + i) * nb + b])),
                                     acc[i]);
          }
          if constexpr (MIN) {
            const __m512 wm = one.mins.sixteen(b);
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) {
              const float* sums = x.scaled_sums + (m + i) * 2 * nb + 2 * b;
              acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(sums[0] + sums[1]), acc[i]);
            }
          }
        };
        llm_kernels::int8_block_products(x.q + m * K, K, nb, weights, use);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) _mm512_mask_storeu_ps(py + (m + i) * N + p * kPanel, mask, acc[i]);
      }
      rows_from<1, MIN>(x, M, one, py + p * kPanel, N, cols, tiles * 16);
    }
    _tile_release();
  });
}
#endif
#endif  // LLM_W8A8

// y = x @ W^T, or with groups each group of x's rows times its own expert's W (expert_groups.h).
at::Tensor q8_0_w8a8(const char* op, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& mins, const at::Tensor& scale_steps, const at::Tensor& min_steps,
                     int64_t out_features, const std::optional<llm_kernels::ExpertGroups>& experts) {
#if defined(LLM_W8A8)
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, op,
              ": x [M, K] float32 contiguous expected");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, stacked = packed.size(0), nb = K / kBlock;
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K % kBlock == 0, op, ": in_features must be a multiple of 32, got ", K);
  // 8-bit weights [panels, K / 4, 16, 4] (u = w + 128) with a scale per 32; or 6-bit ones [panels, K / 32, 384] with a
  // scale per 16
  const bool six_bits = packed.dim() == 3;
  TORCH_CHECK(packed.is_contiguous() && stacked >= num_panels &&
                  (six_bits ? packed.scalar_type() == at::kByte && packed.size(1) == nb && packed.size(2) == kSixBitBlock
                            : packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(1) == K / 4 &&
                                  packed.size(2) == kPanel && packed.size(3) == 4),
              op, ": weight packed [panels, K / 4, 16, 4] uint8 or [panels, K / 32, ", kSixBitBlock,
              "] uint8 (6 bits) for in_features ", K, " expected");
  const llm_kernels::ExpertGroups groups = experts ? *experts : llm_kernels::ExpertGroups::one(M);
  TORCH_CHECK(experts || stacked == num_panels, op, ": ", stacked, " panels for ", N, " out_features");
  const int64_t sub = six_bits ? 2 : 1;  // weight scales per 32 values along K
  const llm_kernels::BlockScales ws = llm_kernels::block_scales(op, "scales", scales, scale_steps, stacked, nb * sub,
                                                                8 * sub);
  const llm_kernels::BlockScales wm = llm_kernels::block_scales(op, "mins", mins, min_steps, stacked, nb * sub, 8 * sub);
  TORCH_CHECK(ws.given(), op, ": scales expected");
  const bool with_mins = wm.given();  // none: empty tensors
  const size_t q_bytes = llm_kernels::aligned64(M * K), s_bytes = llm_kernels::aligned64(M * nb * sizeof(float));
  const size_t start_bytes = llm_kernels::aligned64(3 * M * nb * sizeof(int32_t));
  char* scratch = llm_kernels::thread_scratch(q_bytes + s_bytes + start_bytes + 2 * M * nb * sizeof(float));
  const float* px = x.data_ptr<float>();
  int8_t* pxq = reinterpret_cast<int8_t*>(scratch);
  float* pxs = reinterpret_cast<float*>(scratch + q_bytes);
  int32_t* pxstart = reinterpret_cast<int32_t*>(scratch + q_bytes + s_bytes);
  float* pxscaled = reinterpret_cast<float*>(scratch + q_bytes + s_bytes + start_bytes);
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_block(px + i * kBlock, pxq + i * kBlock, pxs + i, pxstart + 3 * i, pxscaled + 2 * i);
  });
  const Rounded rounded{pxq, pxs, pxstart, pxscaled, K};
  auto y = at::empty({M, N}, x.options());
  const Panel all{packed.data_ptr<uint8_t>(), ws, wm};
  float* py = y.data_ptr<float>();
#if defined(LLM_AMX) && defined(__AMX_INT8__)
  if (!experts && !six_bits && M >= 16 && llm_kernels::amx_permitted()) {  // experts' groups stay on VNNI: the same bits
    if (with_mins) amx_panels<true>(rounded, M, all, py, N, num_panels);
    else amx_panels<false>(rounded, M, all, py, N, num_panels);
    return y;
  }
#endif
  if (with_mins && !six_bits) panels<1, true>(rounded, all, py, N, num_panels, groups);
  else if (with_mins) panels<2, true>(rounded, all, py, N, num_panels, groups);
  else if (!six_bits) panels<1, false>(rounded, all, py, N, num_panels, groups);
  else panels<2, false>(rounded, all, py, N, num_panels, groups);
  return y;
#else
  TORCH_CHECK(false, op, ": needs AVX2 and FMA (or AVX512-VNNI), which this build's CPU lacks");
#endif
}

at::Tensor q8_0_w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const at::Tensor& mins, const at::Tensor& scale_steps, const at::Tensor& min_steps,
                            int64_t out_features) {
  return q8_0_w8a8("q8_0_w8a8_linear", x, packed, scales, mins, scale_steps, min_steps, out_features, std::nullopt);
}

at::Tensor q8_0_w8a8_experts(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const at::Tensor& mins, const at::Tensor& scale_steps, const at::Tensor& min_steps,
                             int64_t out_features, at::IntArrayRef experts, at::IntArrayRef offsets) {
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  return q8_0_w8a8("q8_0_w8a8_experts", x, packed, scales, mins, scale_steps, min_steps, out_features,
                   llm_kernels::ExpertGroups::of("q8_0_w8a8_experts", experts, offsets, x.size(0), packed.size(0),
                                                 panels));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("q8_0_w8a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, Tensor scale_steps, Tensor min_steps, "
        "int out_features) -> Tensor");
  m.def("q8_0_w8a8_experts(Tensor x, Tensor packed, Tensor scales, Tensor mins, Tensor scale_steps, Tensor min_steps, "
        "int out_features, int[] experts, int[] offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("q8_0_w8a8_linear", &q8_0_w8a8_linear);
  m.impl("q8_0_w8a8_experts", &q8_0_w8a8_experts);
}
