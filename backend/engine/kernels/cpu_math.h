// Shared by the CPU kernels: float vectors of the widest width this build's CPU
// has (16 floats with AVX-512, else 8: AVX2 here, NEON pairs on ARM), loaded from any storage dtype.
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace llm_kernels {

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vu16 __attribute__((vector_size(kLanes * 2)));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * 4)));

typedef int32_t vi32 __attribute__((vector_size(kLanes * 4)));

inline vfloat splat(float x) { return vfloat{} + x; }

// exp(x) for x <= 0 (softmax after the max is taken out), every lane at once: 2^(x log2 e) split into an
// integer power, built in the exponent bits, and a degree-6 polynomial of the fraction (relative error ~2e-7,
// about std::exp's float rounding). Written on vectors: a scalar version behind `omp simd` stayed scalar.
inline vfloat fast_exp(vfloat x) {
  x = x < -87.f ? splat(-87.f) : x;
  const vfloat t = x * 1.44269504088896341f;
  vi32 ti = __builtin_convertvector(t, vi32);  // toward zero: one above the floor where t is not whole
  ti += (__builtin_convertvector(ti, vfloat) > t);  // a true comparison is -1
  const vfloat f = t - __builtin_convertvector(ti, vfloat);  // [0, 1)
  vfloat p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  return p * (vfloat)((ti + 127) << 23);
}

inline vfloat max(vfloat a, vfloat b) { return a > b ? a : b; }

inline vfloat min(vfloat a, vfloat b) { return a < b ? a : b; }

inline vfloat abs(vfloat a) { return a < 0.f ? -a : a; }

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

inline vfloat load(const c10::Half* p) {  // F16C's conversion where the CPU has it (every AVX2 one): exact
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return reinterpret_cast<vfloat>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vfloat v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline vfloat load(const int8_t* p) {  // an int8 KV row's values (kv_quantization.py), unscaled
  // GCC turns __builtin_convertvector from int8 lanes into one scalar conversion per lane: 4x slower attention
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<vfloat>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  vfloat v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
#endif
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// float -> bfloat16 bits in the top half, rounded to nearest even as c10::BFloat16(float) does (NaN aside).
inline vu32 bf16_bits(vfloat v) {
  const vu32 bits = (vu32)v;
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
}

inline void store(c10::BFloat16* p, vfloat v) {
  const vu16 raw = __builtin_convertvector(bf16_bits(v) >> 16, vu16);
  std::memcpy(p, &raw, sizeof raw);
}

inline void store(c10::Half* p, vfloat v) {  // rounded to nearest even, as c10::Half(float)
#if defined(__AVX512F__)
  const __m256i h = _mm512_cvtps_ph(reinterpret_cast<__m512>(v), _MM_FROUND_TO_NEAREST_INT);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
#elif defined(__F16C__)
  const __m128i h = _mm256_cvtps_ph(reinterpret_cast<__m256>(v), _MM_FROUND_TO_NEAREST_INT);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
#else
  for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<c10::Half>(v[i]);
#endif
}

// v rounded to the storage dtype and back, every lane (float: v itself).
template <typename scalar_t>
inline vfloat round_to(vfloat v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return (vfloat)bf16_bits(v);
  } else {
    scalar_t tmp[kLanes];
    store(tmp, v);
    return load(tmp);
  }
}

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

// The sums of kSumVectors vectors at once, as one vector (lane i: vector i's), by a tree of shuffles and adds: with
// AVX-512, 16 in 45 instructions where 16 horizontal adds take ~130; with AVX, 8 in 9 where 8 take ~50.
#if defined(__AVX512F__)
constexpr int kSumVectors = 16;

inline vfloat sums(const vfloat (&v)[16]) {
  // the tree leaves its vector s's sum in lane kTreeOrder[s] (an involution): vector s is v[kTreeOrder[s]]
  constexpr int kTreeOrder[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  const auto m = [](vfloat x) { return reinterpret_cast<__m512>(x); };
  __m512 x[16], y[8], z[4], w[2];
  for (int i = 0; i < 16; ++i) x[i] = m(v[kTreeOrder[i]]);
  for (int i = 0; i < 8; ++i)  // 512 -> 256 bits per vector: x[i] and x[i + 8] share a register
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 8], 0x44), _mm512_shuffle_f32x4(x[i], x[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 256 -> 128
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[i], y[i + 4], 0x88), _mm512_shuffle_f32x4(y[i], y[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // 128 -> 64
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(z[i], z[i + 2], 0x44), _mm512_shuffle_ps(z[i], z[i + 2], 0xEE));
  return reinterpret_cast<vfloat>(
      _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD)));
}
#elif defined(__AVX__)
constexpr int kSumVectors = 8;

inline vfloat sums(const vfloat (&v)[8]) {
  const auto m = [](vfloat x) { return reinterpret_cast<__m256>(x); };
  // each 128-bit half's sums of v[0..3] in a, of v[4..7] in b; then the halves added
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(m(v[0]), m(v[1])), _mm256_hadd_ps(m(v[2]), m(v[3])));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(m(v[4]), m(v[5])), _mm256_hadd_ps(m(v[6]), m(v[7])));
  return reinterpret_cast<vfloat>(
      _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
}
#else
constexpr int kSumVectors = 1;

inline vfloat sums(const vfloat (&v)[1]) {
  vfloat r{};
  r[0] = sum(v[0]);
  return r;
}
#endif

// x rounded to the storage dtype and back: the rounding torch applies after each op in that dtype.
template <typename scalar_t>
inline float round_to(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

// f(scalar_t{}) for the tensor's storage dtype.
template <typename F>
void dispatch(const at::Tensor& t, const char* op, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16 only, not ", t.scalar_type());
  }
}

}  // namespace llm_kernels
