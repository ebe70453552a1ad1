// A panel's scales (or mins) of the int8 GEMMs, one per block of its 16 channels: float32; float16 where the file holds
// them so (a GGUF Q8_0's, Q4_0's d: exact, 2 bytes a block instead of 4); or as llama.cpp's K-quants store them
// (models/weight_blocks.py, SuperScales): an int8 step per block times a float16 unit per 256 weights along K (a
// Q4_K's d * scale6, a Q6_K's d * sc; d is the file's float16, so exact). Each product is exact in float32, so
// the kernel forms in registers the same numbers the float32 scales hold, from 1 byte a block instead of 4: a Q4_K
// weight is read in 4.625 bits, not 6 (llama.cpp's own 4.5 packs the steps in 6 bits), and a Q6_K one (its values in
// 6 bits, q8_0_w8a8.cpp) in 6.56, not 8.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace llm_kernels {

struct BlockScales {
  const float* f;         // [scales, 16] float32, or null
  const at::Half* half;   // [scales, 16] float16 (a file's own float16 scales: exact), or with steps the units
                          // [scales >> unit_shift, 16]; or null
  const int8_t* steps;    // [scales, 16], or null
  int unit_shift;         // log2 of the scales under one unit (256 weights' worth: 8 or 16); a shift, for a division
                          // by a count held here was a 64-bit idiv in each eight() / sixteen() of the block loops

  bool given() const { return f || half; }

  // These of panel p, for `scales` per panel row along K.
  BlockScales nth(int64_t p, int64_t scales) const {
    if (steps) return {nullptr, half + (p * scales >> unit_shift) * 16, steps + p * scales * 16, unit_shift};
    return {f ? f + p * scales * 16 : nullptr, half ? half + p * scales * 16 : nullptr, nullptr, unit_shift};
  }

#if defined(__AVX2__)
  // Channels 8h .. 8h + 7 of scale i. Forced inline: GCC left it a call (through the PLT) in the AVX2 microkernels'
  // block loops, where every ymm register is spilled around it; the one-row int4 GEMM ran at 21 GB/s, not 35.
  __attribute__((always_inline)) __m256 eight(int64_t i, int h) const {
    if (f) return _mm256_loadu_ps(f + i * 16 + 8 * h);
    if (!steps) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(half + i * 16 + 8 * h)));
    const __m128i s = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(steps + i * 16 + 8 * h));
    const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(half + (i >> unit_shift) * 16 + 8 * h));
    return _mm256_mul_ps(_mm256_cvtph_ps(u), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)));
  }

  // These n scales (a panel's) as float32 [n, 16] in `out`: for a call that passes over the panel more than once,
  // converted once, not per pass (a bigger share of the work where many rows share each weight).
  BlockScales as_floats(int64_t n, float* out) const {
    if (f || !half) return *this;
    for (int64_t i = 0; i < n; ++i) {
      _mm256_storeu_ps(out + i * 16, eight(i, 0));
      _mm256_storeu_ps(out + i * 16 + 8, eight(i, 1));
    }
    return {out, nullptr, nullptr, unit_shift};
  }
#endif
#if defined(__AVX512F__)
  // The 16 channels of scale i (forced inline as eight).
  __attribute__((always_inline)) __m512 sixteen(int64_t i) const {
    if (f) return _mm512_loadu_ps(f + i * 16);
    if (!steps) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + i * 16)));
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(steps + i * 16));
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + (i >> unit_shift) * 16));
    return _mm512_mul_ps(_mm512_cvtph_ps(u), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s)));
  }
#endif
};

// `f` [stacked, n, 16] float32 or float16 and `steps` empty, or `f` the units [stacked, n / per_unit, 16] float16 and
// `steps` [stacked, n, 16] int8; both empty: none (not given()).
inline BlockScales block_scales(const char* op, const char* name, const at::Tensor& f, const at::Tensor& steps,
                                int64_t stacked, int64_t n, int64_t per_unit) {
  TORCH_CHECK(per_unit > 0 && (per_unit & (per_unit - 1)) == 0, op, ": ", name, " per unit must be a power of 2");
  const int shift = __builtin_ctzll(per_unit);
  if (f.numel() == 0 && steps.numel() == 0) return {nullptr, nullptr, nullptr, shift};
  const bool stepped = steps.numel() > 0, half = f.scalar_type() == at::kHalf;
  TORCH_CHECK(f.is_contiguous() && (half || (!stepped && f.scalar_type() == at::kFloat)) &&
              f.sizes() == at::IntArrayRef({stacked, stepped ? n / per_unit : n, 16}) &&
              (!stepped || (n % per_unit == 0 && steps.is_contiguous() && steps.scalar_type() == at::kChar &&
                            steps.sizes() == at::IntArrayRef({stacked, n, 16}))),
              op, ": ", name, " [panels, ", n, ", 16] float32 or float16, or its units [panels, ", n / per_unit,
              ", 16] float16 and steps [panels, ", n, ", 16] int8, expected");
  if (half) return {nullptr, f.data_ptr<at::Half>(), stepped ? steps.data_ptr<int8_t>() : nullptr, shift};
  return {f.data_ptr<float>(), nullptr, nullptr, shift};
}

}  // namespace llm_kernels
