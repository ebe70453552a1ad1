// Shared by the CPU kernels: a vectorizable exp and float vectors of the widest width this build's CPU
// has (16 floats with AVX-512, else 8: AVX2 here, NEON pairs on ARM), loaded from any storage dtype.
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace llm_kernels {

// exp(x) for x <= 0 (softmax after the max is taken out, sigmoid of -|x|): 2^(x log2 e) split into an
// integer power, built in the exponent bits, and a degree-6 polynomial of the fraction (relative error
// ~2e-7, about std::exp's float rounding). Plain arithmetic, so loops over it vectorize; std::exp does not.
#pragma omp declare simd
inline float fast_exp(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float f = t - fi;  // [0, 1)
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vu16 __attribute__((vector_size(kLanes * 2)));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * 4)));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vfloat load(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  vu16 raw;
  std::memcpy(&raw, p, sizeof raw);
  const vu32 wide = __builtin_convertvector(raw, vu32) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline vfloat load(const c10::Half* p) {
  vfloat v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

inline float sum(vfloat v) {  // the lanes added in registers (a tree of shuffles and adds)
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX__)
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(reinterpret_cast<__m256>(v)),
                        _mm256_extractf128_ps(reinterpret_cast<__m256>(v), 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#else
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof v);
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t i = 0; i < w; ++i) lanes[i] += lanes[i + w];
  return lanes[0];
#endif
}

// x rounded to the storage dtype and back: the rounding torch applies after each op in that dtype.
template <typename scalar_t>
inline float round_to(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

}  // namespace llm_kernels
