// Paged attention for the CPU: each query reads its sequence's keys and values in place, block by
// block through the block table. No gather into padded rows, no mask tensor: the work and the memory
// read are those of the real context, which the gather path (models/llama.py) pays for the longest
// sequence of the batch. Math in float32 whatever the storage dtype (the AMX path's probabilities rounded to bfloat16
// for p.v); softmax exact (two passes). A decode token reads
// any cache (float32, bfloat16, float16, int8: kv_quantization.py) by attend_token;
// a prefill chunk's tokens go in tiles (attend_tile), any cache; with a bfloat16 query and cache on a CPU with AMX,
// in AMX tiles (attend_rows_amx).
//
// A query of sequence s at index i of its chunk sits at position context_lens[s] - chunk + i and sees
// keys 0..position: the cache must already hold this step's new keys and values.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "cpu_math.h"
#include "work_queue.h"

namespace llm_kernels {
void rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);  // fused_ops.cpp
void head_rms_norm(at::Tensor& x, const at::Tensor& weight, double eps);                     // fused_ops.cpp
}

namespace {

using namespace llm_kernels;

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_ctx;
  float scale;
  int64_t window;  // a sliding window: a query at position p sees keys p - window + 1 .. p; 0: all keys up to p
  const float* sinks = nullptr;  // [num_heads] a logit each head's softmax counts in its sum (gpt-oss), or none
  const float* sink(int64_t head) const { return sinks ? sinks + head : nullptr; }
};

// x[0..n) -> exp(x - m) in place, m the max of x (and of *sink); returns their sum, plus exp(*sink - m) with a sink
// (a key that every query sees with score *sink and a value of zero: HF's gpt-oss attention). Whole vectors, then the
// last n % kLanes lanes.
inline float softmax(float* __restrict x, int64_t n, const float* sink = nullptr) {
  const int64_t whole = n - n % kLanes;
  float mx = sink ? std::max(x[0], *sink) : x[0];
  for (int64_t i = whole; i < n; ++i) mx = std::max(mx, x[i]);
  if (whole) {
    vfloat m = load(x);
    for (int64_t i = kLanes; i < whole; i += kLanes) m = max(m, load(x + i));
    for (int64_t i = 0; i < kLanes; ++i) mx = std::max(mx, m[i]);
  }
  vfloat total = {};
  for (int64_t i = 0; i < whole; i += kLanes) {
    const vfloat e = fast_exp(load(x + i) - mx);
    store(x + i, e);
    total += e;
  }
  float rest = 0.f;
  if (whole < n) {
    vfloat tail = splat(mx);  // lanes past n: exp(0), neither stored nor counted
    std::memcpy(&tail, x + whole, (n - whole) * sizeof(float));
    const vfloat e = fast_exp(tail - mx);
    for (int64_t i = 0; i < n - whole; ++i) rest += (x[whole + i] = e[i]);
  }
  const float all = sum(total) + rest;
  return sink ? all + std::exp(*sink - mx) : all;
}

// An int8 cache row's scale (kv_quantization.py: a float32 after the row's head_dim values); 1 for other caches.
template <typename cache_t>
inline float row_scale(const cache_t* __restrict r, int64_t D) {
  float scale = 1.f;
  if constexpr (std::is_same_v<cache_t, int8_t>) std::memcpy(&scale, r + D, sizeof scale);
  return scale;
}

constexpr int64_t kSegmentBytes = 256 * 1024;

// The rows of keys j0..j1-1 of a cache (elements first..first + slice - 1 of each: a row's part of some KV heads) into
// cache ahead of the compute: a block's rows are contiguous; kStreams blocks at a time, a line of each in turn (2
// blocks: 1.2x less time than 1; 4 and 8: 1.3-1.8x). A byte of every line is read, for the read's side effect.
template <typename cache_t>
void stream(const cache_t* __restrict cache, const int64_t* __restrict offsets, int64_t j0, int64_t j1, int64_t BS,
            int64_t row, int64_t first, int64_t slice) {
  constexpr int kStreams = 8;
  const int64_t bytes = slice * sizeof(cache_t), stride = row * sizeof(cache_t);
  unsigned char t = 0;
  for (int64_t j = j0; j < j1;) {
    const unsigned char* __restrict p[kStreams];
    int64_t rows[kStreams], most = 0;
    for (int r = 0; r < kStreams; ++r) {
      const int64_t run = j < j1 ? std::min(BS - (j % BS), j1 - j) : 0;
      p[r] = reinterpret_cast<const unsigned char*>(cache + (run ? offsets[j] + first : 0));
      rows[r] = run, most = std::max(most, run);
      j += run;
    }
    for (int64_t i = 0; i < most; ++i) {
      for (int64_t e = 0; e < bytes; e += 64)  // from an unaligned start, each line once; then the last byte's
        for (int r = 0; r < kStreams; ++r)
          if (i < rows[r]) t ^= p[r][i * stride + e];
      for (int r = 0; r < kStreams; ++r)
        if (i < rows[r]) t ^= p[r][i * stride + bytes - 1];
    }
  }
  volatile unsigned char sink = t;  // keep the loads (portably: no asm)
  (void)sink;
}

// One query token against keys lo..n-1 of its sequence (its KV heads kv0..kv1-1), any cache (float32, bfloat16,
// float16, int8: kv_quantization.py, a row of head_dim int8s and their float32 scale, head_dim + 4 bytes). The G query
// heads of a KV head share its rows in registers: q.k takes up to kHeads of them against kKeysAtOnce keys at a time
// (each key's vector loaded and widened once for them all, the accumulators' sums by one `sums`), p.v up to kHeads
// heads x kColumns vectors of their outputs against one value at a time. The kernels before this one read a key's
// vectors once per head from L1 (a narrow cache's widened first into scratch) and added each key's lanes apart: at the
// Qwen3-4B's heads (G 4, head_dim 128, float16 cache) 8 sequences of 1,040 keys took 1.22-1.38x this one's time, one
// 1.17x, 16 of 300 1.22x; other heads (G 3 and 7, head_dim 64 and 256) 1.14-1.35x; int8 1.15x, float32 1.06-1.21x,
// bfloat16 the same as its AVX512-BF16 pair dots; the AVX2 build 1.03-1.08x (AMD EPYC Zen 4, 36 layers' caches cold,
// old and new builds alternating in one process). q.k's accumulators start at zero and its loop over a key's vectors
// is unrolled, the full groups of kKeysAtOnce keys apart from the last keys, and p.v takes its value rows' and
// probabilities' pointers once per 16 keys: before, GCC kept q.k's accumulators on the stack in a loop that tested each
// key's presence, and p.v reloaded its pointers for every value. In the AVX2 build the 1B's and 4B's heads at 1,040
// keys (float16 cache) took 1.16-1.25x this one's time (AMD EPYC Zen 3, 2 threads, cold and warm, one sequence and
// eight); in the AVX-512 build 0.95-1.01x for one sequence and 0.93-0.98x for eight, inside that VM's noise (AMD EPYC
// Zen 4, 2026-12-07: the best of 5-6 processes a build, while pairs of processes differed by 0.5-1.9x).
// Key j's row (every KV head of one position) starts at element offsets[j] of the cache: the block table is read once
// per token. The rows come from memory first, kSegmentBytes of keys (then of values) at a time, by `stream`, and the
// heads then compute over the segment from L2: reading while computing (each group's first head fetching its rows as it
// used them) drew 14-15 GB/s from a DRAM that a plain read takes at 30 (with 8 blocks side by side the kernel took
// 1.3-1.8x less time: AMD EPYC Zen 4, SmolLM2's heads, 4-64 sequences of 100-4,000 keys in random blocks of 16), and
// prefetch hints for the next segment while computing this one took 1.5x the time of the pre-read (Zen 4).
// Sums: q.k a chain of FMAs over a key's vectors, then the lanes by `sums` (a partial block's by `sum`); p.v a chain
// per head and vector over the keys in order. A head's bits do not depend on the heads that share its pass.
// Scratch: scores H x max_ctx, offsets max_ctx, qs H x D (the scaled queries), acc H x D.
#if defined(__AVX512F__)
constexpr int kHeads = 4, kKeysAtOnce = 4, kColumns = 4;  // q.k's and p.v's 16 accumulators of 32 vector registers
#else
constexpr int kHeads = 4, kKeysAtOnce = 2, kColumns = 2;  // 8 of 16
#endif
template <int N, typename F>
void in_passes(int64_t count, F&& f) {  // f(std::integral_constant<int, k>{}, first) over 0..count-1 in runs of <= N
  for (int64_t first = 0; first < count; first += N) {
    const int64_t k = std::min<int64_t>(N, count - first);
    if (k == N) {
      f(std::integral_constant<int, N>{}, first);
    } else if constexpr (N > 1) {
      in_passes<N - 1>(k, [&](auto run, int64_t at) { f(run, first + at); });
    }
  }
}

template <typename scalar_t, typename cache_t, int V>
void attend_token(const scalar_t* __restrict q, const cache_t* __restrict k_cache, const cache_t* __restrict v_cache,
                  scalar_t* __restrict out, const int64_t* __restrict table, int64_t lo, int64_t n, const Shape& shape,
                  int64_t kv0, int64_t kv1, float* __restrict scores, int64_t* __restrict offsets,
                  float* __restrict qs, float* __restrict acc) {
  constexpr bool kInt8 = std::is_same_v<cache_t, int8_t>;
  const int64_t H = shape.num_heads, KVH = shape.num_kv_heads, G = H / KVH, D = V * kLanes, W = D + (kInt8 ? 4 : 0);
  const int64_t BS = shape.block_size, row = KVH * W, slice = (kv1 - kv0) * W, ctx = shape.max_ctx;
  for (int64_t j = lo; j < n; ++j) offsets[j] = (table[j / BS] * BS + j % BS) * row;
  // keys per segment: a multiple of 16 from lo, so the chunks of 16 (and their sums) are those of one pass
  const int64_t segment = std::max<int64_t>(16, kSegmentBytes / (slice * sizeof(cache_t)) / 16 * 16);
  const auto wide = [&](const cache_t* __restrict r, int v) {  // vector v of a row in float32 (int8: scaled)
    if constexpr (kInt8) return load(r + v * kLanes) * row_scale(r, D);
    return load(r + v * kLanes);
  };
  // every 16 keys (then values) of the segments, every KV head in turn, its G heads in passes of up to kHeads
  const auto each_pass = [&](const cache_t* cache, auto&& f) {  // f(heads, the KV head's rows, first head, j0, m)
    for (int64_t s0 = lo; s0 < n; s0 += segment) {
      const int64_t s1 = std::min(s0 + segment, n);
      stream(cache, offsets, s0, s1, BS, row, kv0 * W, slice);
      for (int64_t j0 = s0; j0 < s1; j0 += 16)
        for (int64_t kh = kv0; kh < kv1; ++kh)
          in_passes<kHeads>(G, [&](auto heads, int64_t g0) { f(heads, cache + kh * W, kh * G + g0, j0, s1 - j0); });
    }
  };
  for (int64_t h = kv0 * G; h < kv1 * G; ++h)
    for (int v = 0; v < V; ++v) store(qs + h * D + v * kLanes, load(q + h * D + v * kLanes) * shape.scale);

  each_pass(k_cache, [&](auto heads, const cache_t* __restrict keys, int64_t h0, int64_t j0, int64_t left) {
    constexpr int GH = decltype(heads)::value;
    const int64_t m = std::min<int64_t>(16, left);
    const float* __restrict qh = qs + h0 * D;
    const int64_t* __restrict at = offsets + j0;
    float* __restrict out = scores + h0 * ctx + j0;  // head h0 + g's key k: out[g * ctx + k]
    // keys k0..k0 + K - 1 against the pass's heads: d[k][g] = sum over v of q(h0 + g, v) * key(k0 + k, v), a chain of
    // FMAs from zero over v = 0, 1, ... (unrolled: the accumulators stay in registers)
    const auto dots = [&](auto keys_at_once, int64_t k0, vfloat (&d)[decltype(keys_at_once)::value][GH]) {
      constexpr int K = decltype(keys_at_once)::value;
      const cache_t* __restrict r[K];
      for (int k = 0; k < K; ++k) r[k] = keys + at[k0 + k];
      // +0, which GCC may not fold away (-0 + 0 is +0), so every product enters the chain by one FMA in every build
      // (started from the first product, GCC fused it with the second on the float32 path and the bits moved)
      for (int k = 0; k < K; ++k)
        for (int g = 0; g < GH; ++g) d[k][g] = vfloat{};
#pragma GCC unroll 32
      for (int v = 0; v < V; ++v) {
        vfloat kv[K];
        for (int k = 0; k < K; ++k) kv[k] = wide(r[k], v);
        for (int g = 0; g < GH; ++g) {
          const vfloat x = load(qh + g * D + v * kLanes);
          for (int k = 0; k < K; ++k) d[k][g] += x * kv[k];
        }
      }
    };
    constexpr int K = kKeysAtOnce;
    int64_t k0 = 0;
    for (; k0 + K <= m; k0 += K) {
      vfloat d[K][GH];
      dots(std::integral_constant<int, K>{}, k0, d);
      if constexpr (kHeads * K == kSumVectors) {  // all their sums at once: lane g K + k
        vfloat t[kSumVectors];
        for (int i = 0; i < kSumVectors; ++i) t[i] = i / K < GH ? d[i % K][i / K] : vfloat{};
        alignas(64) float lanes[kLanes];
        store(lanes, sums(t));
        for (int g = 0; g < GH; ++g)
          for (int k = 0; k < K; ++k) out[g * ctx + k0 + k] = lanes[g * K + k];
      } else {
        for (int g = 0; g < GH; ++g)
          for (int k = 0; k < K; ++k) out[g * ctx + k0 + k] = sum(d[k][g]);
      }
    }
    for (; k0 < m; ++k0) {  // the last keys of the sequence, one by one
      vfloat d[1][GH];
      dots(std::integral_constant<int, 1>{}, k0, d);
      for (int g = 0; g < GH; ++g) out[g * ctx + k0] = sum(d[0][g]);
    }
  });
  for (int64_t h = kv0 * G; h < kv1 * G; ++h) {
    float* __restrict p = scores + h * ctx;
    const float inv = 1.f / softmax(p + lo, n - lo, shape.sink(h));
    for (int64_t j = lo; j < n; ++j) p[j] *= inv;
  }
  std::fill(acc + kv0 * G * D, acc + kv1 * G * D, 0.f);
  constexpr int CV = V < kColumns ? V : kColumns;
  each_pass(v_cache, [&](auto heads, const cache_t* __restrict values, int64_t h0, int64_t j0, int64_t left) {
    constexpr int GH = decltype(heads)::value;
    const int64_t m = std::min<int64_t>(16, left);
    const float* __restrict p[GH];  // the heads' probabilities of the 16 values
    for (int g = 0; g < GH; ++g) p[g] = scores + (h0 + g) * ctx + j0;
    const cache_t* __restrict rows[16];
    for (int64_t i = 0; i < m; ++i) rows[i] = values + offsets[j0 + i];
    float* __restrict a_h = acc + h0 * D;
    for (int c0 = 0; c0 < V; c0 += CV) {
      vfloat a[GH][CV];
      for (int g = 0; g < GH; ++g)
        for (int c = 0; c < CV; ++c) a[g][c] = load(a_h + g * D + (c0 + c) * kLanes);
      for (int64_t i = 0; i < m; ++i) {
        vfloat x[CV];
        for (int c = 0; c < CV; ++c) x[c] = wide(rows[i], c0 + c);
        for (int g = 0; g < GH; ++g) {
          const float pg = p[g][i];
          for (int c = 0; c < CV; ++c) a[g][c] += pg * x[c];
        }
      }
      for (int g = 0; g < GH; ++g)
        for (int c = 0; c < CV; ++c) store(a_h + g * D + (c0 + c) * kLanes, a[g][c]);
    }
  });
  for (int64_t h = kv0 * G; h < kv1 * G; ++h)
    for (int v = 0; v < V; ++v) store(out + h * D + v * kLanes, load(acc + h * D + v * kLanes));
}

// Prefill chunks: a tile of a sequence's consecutive query tokens times the G query heads of one KV head, R rows of
// queries (up to kTileRows, or G), against the keys in blocks of kKeys. Each key and value a thread reads is widened
// (and the keys transposed to [D][kKeys], so that a block's scores of a row are two vectors, no horizontal adds) once
// per sequence and KV head into its scratch, then used by every row of every tile: q.k costs 2 loads and R
// broadcasts per 2R multiply-adds, p.v DV loads and R broadcasts per R x DV, where attend_token paid a load per
// multiply-add and a horizontal add per key, per head and token.
constexpr int kTileRows = 6;
constexpr int64_t kKeys = 2 * kLanes;
#if defined(__AVX512F__)
constexpr int kPV = 4;  // value vectors per pass: 6 x 4 accumulators
#else
constexpr int kPV = 2;
#endif

struct TileScratch {  // a thread's; left uninitialized: a lane past a row's keys is computed but never read
  std::unique_ptr<float[]> kt, vw, scores, qs, inv;  // keys [blocks][D][kKeys], values [n][D], scores [rows][stride],
                                                     // queries [rows][D], each row's 1 / sum of its exps
  int64_t seq = -1, kv_head = -1, have = 0;  // whose keys and values are widened, and how many
  TileScratch(int64_t keys, int64_t D, int64_t rows)
      : kt(new float[keys * D]), vw(new float[keys * D]), scores(new float[rows * keys]), qs(new float[rows * D]),
        inv(new float[rows]) {}
};

template <int MR>
void qk_rows(const float* __restrict qs, int64_t D, const float* __restrict kt, int64_t blocks,
             float* __restrict scores, int64_t stride) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* __restrict kb = kt + b * D * kKeys;
    vfloat a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = vfloat{};
    for (int64_t d = 0; d < D; ++d) {
      const vfloat k0 = load(kb + d * kKeys), k1 = load(kb + d * kKeys + kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const float x = qs[r * D + d];
        a0[r] += x * k0;
        a1[r] += x * k1;
      }
    }
    for (int r = 0; r < MR; ++r) {
      store(scores + r * stride + b * kKeys, a0[r]);
      store(scores + r * stride + b * kKeys + kLanes, a1[r]);
    }
  }
}

// rows of p (zero past each row's keys) times values 0..n-1: out row r = sum_j p[r][j] v[j] * inv[r]; row r's output
// at out + offset(r)
template <typename scalar_t, int MR, int DV, typename Offset>
void pv_rows(const float* __restrict p, int64_t stride, const float* __restrict vw, int64_t n, int64_t D,
             const float* __restrict inv, scalar_t* __restrict out, Offset offset) {
  for (int64_t c = 0; c < D; c += DV * kLanes) {
    vfloat acc[MR][DV];
    for (int r = 0; r < MR; ++r)
      for (int i = 0; i < DV; ++i) acc[r][i] = vfloat{};
    for (int64_t j = 0; j < n; ++j) {
      vfloat v[DV];
      for (int i = 0; i < DV; ++i) v[i] = load(vw + j * D + c + i * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const float x = p[r * stride + j];
        for (int i = 0; i < DV; ++i) acc[r][i] += x * v[i];
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int i = 0; i < DV; ++i) store(out + offset(r) + c + i * kLanes, acc[r][i] * inv[r]);
  }
}

// Tokens first..first + tokens - 1 of one sequence (rows of q and out), token i seeing keys 0..n_first + i - 1, the
// G heads of KV head kh.
template <typename scalar_t, typename cache_t, int V>
void attend_tile(const scalar_t* __restrict q, const cache_t* __restrict k_cache, const cache_t* __restrict v_cache,
                 scalar_t* __restrict out, const int64_t* __restrict table, int64_t seq, int64_t kh, int64_t first,
                 int64_t tokens, int64_t n_first, const Shape& shape, TileScratch& sc) {
  constexpr bool kInt8 = std::is_same_v<cache_t, int8_t>;
  const int64_t H = shape.num_heads, KVH = shape.num_kv_heads, G = H / KVH, D = V * kLanes, W = D + (kInt8 ? 4 : 0);
  const int64_t BS = shape.block_size, row = KVH * W, R = tokens * G, n_max = n_first + tokens - 1;
  const int64_t stride = (shape.max_ctx + kKeys - 1) / kKeys * kKeys;
  if (sc.seq != seq || sc.kv_head != kh) sc.seq = seq, sc.kv_head = kh, sc.have = 0;
  for (int64_t j = sc.have; j < n_max; ++j) {
    const int64_t offset = (table[j / BS] * BS + j % BS) * row + kh * W;
    const cache_t *__restrict kr = k_cache + offset, *__restrict vr = v_cache + offset;
    const float ks = row_scale(kr, D), vs = row_scale(vr, D);
    float* __restrict kt = sc.kt.get() + (j / kKeys) * D * kKeys + j % kKeys;
    for (int v = 0; v < V; ++v) {
      const vfloat k = kInt8 ? load(kr + v * kLanes) * ks : load(kr + v * kLanes);
      store(sc.vw.get() + j * D + v * kLanes, kInt8 ? load(vr + v * kLanes) * vs : load(vr + v * kLanes));
      for (int64_t l = 0; l < kLanes; ++l) kt[(v * kLanes + l) * kKeys] = k[l];
    }
  }
  sc.have = std::max(sc.have, n_max);
  const auto offset = [&](int64_t r) { return ((first + r / G) * H + kh * G + r % G) * D; };  // row r's q and out
  float* __restrict qs = sc.qs.get();
  for (int64_t r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(qs + r * D + v * kLanes, load(q + offset(r) + v * kLanes) * shape.scale);
  const int64_t blocks = (n_max + kKeys - 1) / kKeys;
  float* __restrict scores = sc.scores.get();
  in_passes<kTileRows>(R, [&](auto mr, int64_t r0) {
    qk_rows<decltype(mr)::value>(qs + r0 * D, D, sc.kt.get(), blocks, scores + r0 * stride, stride);
  });
  for (int64_t r = 0; r < R; ++r) {  // row r sees keys lo..n - 1: p is zero elsewhere
    const int64_t n = n_first + r / G, lo = shape.window ? std::max<int64_t>(0, n - shape.window) : 0;
    float* s = scores + r * stride;
    sc.inv[r] = 1.f / softmax(s + lo, n - lo, shape.sink(kh * G + r % G));
    std::fill(s, s + lo, 0.f);
    std::fill(s + n, s + n_max, 0.f);
  }
  constexpr int DV = V < kPV ? V : kPV;
  in_passes<kTileRows>(R, [&](auto mr, int64_t r0) {
    pv_rows<scalar_t, decltype(mr)::value, DV>(scores + r0 * stride, stride, sc.vw.get(), n_max, D,
                                               sc.inv.get() + r0, out, [&](int64_t r) { return offset(r0 + r); });
  });
}

#if defined(LLM_AMX)
// Prefill chunks of a bfloat16 model on a CPU with AMX: 16 query rows (tokens x the G heads of one KV head, as in
// attend_tile) at a time, q.k and p.v each by TDPBF16PS on tiles. A thread packs a sequence's keys and values once per
// KV head as B tiles (keys: 16 keys x 16 dim pairs a tile, [blocks of 16][D / 32][pair][key]; values: 16 key pairs x 16
// dims, [blocks of 32][D / 16][key pair][dim][2]). Scores in float32, scaled and softmaxed exactly as attend_tile's;
// the exps rounded to bfloat16 for p.v (HF's eager bfloat16 attention rounds its probabilities so), the sums divided
// out after. Tiles: 0 the scores or, with 1-3, the output's 16-dim columns; 4 and 5 the A and B operands.
struct AmxScratch {  // a thread's; the packed keys and values zeroed once: lanes past a sequence's keys stay finite
  std::unique_ptr<uint16_t[]> kp, vp, p, q;  // packed keys and values; p [16][keys]; the tile's queries [16][D]
  std::unique_ptr<float[]> scores, acc;      // [16][keys]; p.v [16][D]
  int64_t seq = -1, kv_head = -1, have = 0;
  AmxScratch(int64_t keys, int64_t D)
      : kp(new uint16_t[keys * D]()), vp(new uint16_t[keys * D]()), p(new uint16_t[16 * keys]),
        q(new uint16_t[16 * D]), scores(new float[16 * keys]), acc(new float[16 * D]) {}
};

template <int V>
void attend_rows_amx(const c10::BFloat16* __restrict q, const c10::BFloat16* __restrict k_cache,
                     const c10::BFloat16* __restrict v_cache, c10::BFloat16* __restrict out,
                     const int64_t* __restrict table, int64_t seq, int64_t kh, int64_t first, int64_t tokens,
                     int64_t n_first, const Shape& shape, AmxScratch& sc) {
  const int64_t H = shape.num_heads, KVH = shape.num_kv_heads, G = H / KVH, D = V * kLanes, DH = D / 32, DC = D / 16;
  const int64_t BS = shape.block_size, row = KVH * D, R = tokens * G, n_max = n_first + tokens - 1;
  const int64_t stride = (shape.max_ctx + 31) / 32 * 32;
  if (sc.seq != seq || sc.kv_head != kh) sc.seq = seq, sc.kv_head = kh, sc.have = 0;
  uint16_t *__restrict kp = sc.kp.get(), *__restrict vp = sc.vp.get();
  for (int64_t j = sc.have; j < n_max; ++j) {
    const int64_t offset = (table[j / BS] * BS + j % BS) * row + kh * D;
    const auto* kr = reinterpret_cast<const uint16_t*>(k_cache + offset);
    const auto* vr = reinterpret_cast<const uint16_t*>(v_cache + offset);
    for (int64_t d = 0; d < D; d += 2)  // key j: column j % 16 of its block's tiles, a dim pair a row
      std::memcpy(kp + (((j / 16 * DH + d / 32) * 16 + d % 32 / 2) * 16 + j % 16) * 2, kr + d, 4);
    for (int64_t d = 0; d < D; ++d)  // value j: row (j % 32) / 2 of its block's tiles, half j % 2 of each dim's pair
      vp[((j / 32 * DC + d / 16) * 16 + j % 32 / 2) * 32 + d % 16 * 2 + j % 2] = vr[d];
  }
  sc.have = std::max(sc.have, n_max);
  const auto offset = [&](int64_t r) { return ((first + r / G) * H + kh * G + r % G) * D; };  // row r's q and out
  uint16_t *__restrict qs = sc.q.get(), *__restrict p = sc.p.get();
  float *__restrict scores = sc.scores.get(), *__restrict acc = sc.acc.get();
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, R - r0), n_top = n_first + (r0 + rows - 1) / G;
    const int64_t width = (n_top + 31) / 32 * 32;  // p's columns: whole tiles of 32 keys
    for (int64_t i = 0; i < 16; ++i)
      if (i < rows) std::memcpy(qs + i * D, q + offset(r0 + i), D * 2);
      else std::memset(qs + i * D, 0, D * 2);
    for (int64_t b = 0; b < (n_top + 15) / 16; ++b) {
      _tile_zero(0);
      for (int64_t h = 0; h < DH; ++h) {
        _tile_loadd(4, qs + h * 32, D * 2);
        _tile_loadd(5, kp + (b * DH + h) * 512, 64);
        _tile_dpbf16ps(0, 4, 5);
      }
      _tile_stored(0, scores + b * 16, stride * 4);
    }
    float inv[16];
    for (int64_t i = 0; i < 16; ++i) {
      float* __restrict s = scores + i * stride;
      const int64_t n = i < rows ? n_first + (r0 + i) / G : 0;
      for (int64_t j = 0; j < n; j += kLanes) store(s + j, load(s + j) * shape.scale);
      inv[i] = n ? 1.f / softmax(s, n) : 0.f;
      std::fill(s + n, s + width, 0.f);
      for (int64_t j = 0; j < width; j += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i * stride + j),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j))));
    }
    for (int64_t c0 = 0; c0 < DC; c0 += 4) {  // 4 tiles of 16 output dims at a time
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t b = 0; b < width / 32; ++b) {
        _tile_loadd(4, p + b * 32, stride * 2);
        const uint16_t* v = vp + (b * DC + c0) * 512;  // accumulator tile c += p (4) x the values' tile c (5)
        _tile_loadd(5, v, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (c0 + 1 < DC) {
          _tile_loadd(5, v + 512, 64);
          _tile_dpbf16ps(1, 4, 5);
        }
        if (c0 + 2 < DC) {
          _tile_loadd(5, v + 1024, 64);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (c0 + 3 < DC) {
          _tile_loadd(5, v + 1536, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, acc + c0 * 16, D * 4);
      if (c0 + 1 < DC) _tile_stored(1, acc + c0 * 16 + 16, D * 4);
      if (c0 + 2 < DC) _tile_stored(2, acc + c0 * 16 + 32, D * 4);
      if (c0 + 3 < DC) _tile_stored(3, acc + c0 * 16 + 48, D * 4);
    }
    for (int64_t i = 0; i < rows; ++i)
      for (int v = 0; v < V; ++v) store(out + offset(r0 + i) + v * kLanes, load(acc + i * D + v * kLanes) * inv[i]);
  }
}
#endif

// Which path a query token takes depends on the token, not on the step that computes it: a prompt token's (position
// below prompt_lens[s]) goes in tiles, a generated token's one by one, as a decode. So a token's attention is the same
// bits whether it is decoded alone, verified with speculative drafts after it, or recomputed after a preemption, and
// speculation cannot change a greedy output even at a near-tie (the tiles sum q.k and p.v in another order). Without
// prompt_lens, a chunk of one token is the decode and longer chunks go in tiles.
template <typename scalar_t, typename cache_t>
void attend(const scalar_t* q, const cache_t* k_cache, const cache_t* v_cache, scalar_t* out,
            const int64_t* block_tables, const int64_t* query_start, const int64_t* context_lens,
            const int64_t* prompt_lens, int64_t num_seqs, Shape shape) {
  for (int64_t s = 0; s < num_seqs; ++s) shape.max_ctx = std::max(shape.max_ctx, context_lens[s]);
  const int64_t HD = shape.num_heads * shape.head_dim, group = shape.num_heads / shape.num_kv_heads;
#if defined(LLM_AMX)
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>;
  const bool amx = kBf16 && shape.head_dim % 32 == 0 && shape.window == 0 && !shape.sinks && amx_permitted();
#else
  const bool amx = false;
#endif
  // chunks of 2+ tokens (prefill) in tiles of `per_tile` tokens per KV head (attend_tile, or attend_rows_amx's rows
  // of 16); single tokens one by one
  const int64_t per_tile = std::max<int64_t>(1, (amx ? 16 : kTileRows) / group);
  struct Tile {
    int64_t seq, kv_head, first, tokens;
  };
  struct Single {
    int64_t seq, token;  // token: its row in q and out; it sees keys 0..its position
    int64_t kv0, kv1;  // its KV heads kv0..kv1-1 (and their query heads)
  };
  std::vector<Tile> tiles;
  std::vector<Single> singles;  // the tokens that attend one by one (decodes)
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t begin = query_start[s], end = query_start[s + 1], first_pos = context_lens[s] - (end - begin);
    const int64_t tiled = prompt_lens ? std::clamp<int64_t>(prompt_lens[s] - first_pos, 0, end - begin)
                                      : (end - begin == 1 ? 0 : end - begin);
    for (int64_t kh = 0; kh < shape.num_kv_heads && tiled; ++kh)
      for (int64_t t = begin; t < begin + tiled; t += per_tile)
        tiles.push_back({s, kh, t, std::min(per_tile, begin + tiled - t)});
    for (int64_t t = begin + tiled; t < end; ++t) singles.push_back({s, t, 0, shape.num_kv_heads});
  }
  // Fewer decodes than threads (one sequence: one item, one busy thread): each token's KV heads in parts, one an item.
  // A head's sums are the same either way.
  if (const int64_t decodes = singles.size(); decodes && decodes < at::get_num_threads()) {
    const int64_t parts = std::min<int64_t>(shape.num_kv_heads, (at::get_num_threads() + decodes - 1) / decodes);
    std::vector<Single> split;
    for (const Single& one : singles)
      for (int64_t i = 0; i < parts; ++i)
        split.push_back({one.seq, one.token, shape.num_kv_heads * i / parts, shape.num_kv_heads * (i + 1) / parts});
    singles = std::move(split);
  }
  const auto token = [&](auto head_vectors) {
    constexpr int V = decltype(head_vectors)::value;
    // Thread c takes tiles c, c + n, c + 2n, ... (a sequence's later tiles see more keys; a strided deal spreads
    // them, and each thread meets a sequence's tiles in order, its widened keys growing)
    const int64_t tile_threads = std::min<int64_t>(at::get_num_threads(), tiles.size());
    if (tile_threads)
      at::parallel_for(0, tile_threads, 1, [&](int64_t begin, int64_t end) {
        const int64_t keys = (shape.max_ctx + kKeys - 1) / kKeys * kKeys;
        const auto each_tile = [&](auto&& attend_one) {  // attend_one(tile, n_first: the keys its first token sees)
          for (int64_t c = begin; c < end; ++c)
            for (int64_t i = c; i < static_cast<int64_t>(tiles.size()); i += tile_threads) {
              const Tile& tile = tiles[i];
              const int64_t chunk = query_start[tile.seq + 1] - query_start[tile.seq];
              attend_one(tile, context_lens[tile.seq] - chunk + (tile.first - query_start[tile.seq]) + 1);
            }
        };
#if defined(LLM_AMX)
        if constexpr (kBf16)
          if (amx) {
            TileConfig config;
            _tile_loadconfig(&config);
            AmxScratch scratch((shape.max_ctx + 31) / 32 * 32, shape.head_dim);
            each_tile([&](const Tile& tile, int64_t n_first) {
              attend_rows_amx<V>(q, k_cache, v_cache, out, block_tables + tile.seq * shape.max_blocks, tile.seq,
                                 tile.kv_head, tile.first, tile.tokens, n_first, shape, scratch);
            });
            _tile_release();
            return;
          }
#endif
        TileScratch scratch(keys, shape.head_dim, per_tile * group);
        each_tile([&](const Tile& tile, int64_t n_first) {
          attend_tile<scalar_t, cache_t, V>(q, k_cache, v_cache, out, block_tables + tile.seq * shape.max_blocks,
                                            tile.seq, tile.kv_head, tile.first, tile.tokens, n_first, shape, scratch);
        });
      });
    // The decodes in shares, one that is done taking another's last (work_queue.h)
    llm_kernels::parallel_take(singles.size(), [&](llm_kernels::WorkQueue& queue, int64_t thread) {
      const int64_t H = shape.num_heads, D = shape.head_dim;  // attend_token's scratch
      std::vector<float> scores(H * shape.max_ctx), qs(H * D), acc(H * D);
      std::vector<int64_t> offsets(shape.max_ctx);
      for (int64_t i; (i = queue.take(thread)) >= 0;) {
        const auto [s, t, kv0, kv1] = singles[i];
        const int64_t n = context_lens[s] - (query_start[s + 1] - 1 - t);  // it sees keys lo..n - 1
        const int64_t lo = shape.window ? std::max<int64_t>(0, n - shape.window) : 0;
        attend_token<scalar_t, cache_t, V>(q + t * HD, k_cache, v_cache, out + t * HD,
                                           block_tables + s * shape.max_blocks, lo, n, shape, kv0, kv1, scores.data(),
                                           offsets.data(), qs.data(), acc.data());
      }
    });
  };
  switch (shape.head_dim / kLanes) {
    case 1: token(std::integral_constant<int, 1>{}); break;
    case 2: token(std::integral_constant<int, 2>{}); break;
    case 4: token(std::integral_constant<int, 4>{}); break;
    case 8: token(std::integral_constant<int, 8>{}); break;
    case 16: token(std::integral_constant<int, 16>{}); break;
    case 32: token(std::integral_constant<int, 32>{}); break;  // head_dim 256 (Gemma 3) on AVX2
    default: TORCH_CHECK(false, "paged_attention: head_dim ", shape.head_dim, " is not 1, 2, 4, 8, 16 or 32 vectors of ",
                         kLanes, " floats");
  }
}

// q [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] in q's dtype (or float16 under a float32 q), or
// [..., D + 4] int8;
// block_tables [S, B]; query_start [S + 1]; context_lens [S] (int64). Returns [T, H, D] in q's dtype.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& context_lens, double scale,
                           const std::optional<at::Tensor>& prompt_lens, int64_t window,
                           const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "paged_attention: bad shapes");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  const bool half = k_cache.scalar_type() == at::kHalf && q.scalar_type() == at::kFloat;  // kv_cache_dtype float16
  TORCH_CHECK((int8 || half || q.scalar_type() == k_cache.scalar_type()) &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention: the cache must be in q's dtype, int8, or float16 under a float32 q");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) + (int8 ? 4 : 0) == k_cache.size(3),
              "paged_attention: head mismatch");
  TORCH_CHECK(q.size(2) % kLanes == 0, "paged_attention: head_dim a multiple of ", kLanes,
              " (this CPU's float vector width)");
  for (const auto* t : {&block_tables, &query_start, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong, "paged_attention: index tensors must be int64");
  TORCH_CHECK(!prompt_lens || (prompt_lens->scalar_type() == at::kLong && prompt_lens->numel() == context_lens.numel()),
              "paged_attention: prompt_lens [S] int64");
  TORCH_CHECK(window >= 0, "paged_attention: window >= 0 (0: none)");
  TORCH_CHECK(!sinks || sinks->numel() == q.size(1), "paged_attention: sinks [num_heads]");
  const auto sk = sinks ? sinks->to(at::kFloat).contiguous() : at::Tensor();
  const auto qc = q.contiguous(), kc = k_cache.contiguous(), vc = v_cache.contiguous();
  const auto bt = block_tables.contiguous(), qs = query_start.contiguous(), cl = context_lens.contiguous();
  const auto pl = prompt_lens ? prompt_lens->contiguous() : at::Tensor();
  auto out = at::empty_like(qc);
  dispatch(q, "paged_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    const Shape shape{qc.size(1), kc.size(2), qc.size(2), kc.size(1), bt.size(1), 1, static_cast<float>(scale),
                      window, sk.defined() ? sk.data_ptr<float>() : nullptr};
    const auto run = [&](auto* k, auto* v) {
      attend(qc.data_ptr<scalar_t>(), k, v, out.data_ptr<scalar_t>(), bt.data_ptr<int64_t>(), qs.data_ptr<int64_t>(),
             cl.data_ptr<int64_t>(), pl.defined() ? pl.data_ptr<int64_t>() : nullptr, cl.size(0), shape);
    };
    if (int8) {
      run(kc.data_ptr<int8_t>(), vc.data_ptr<int8_t>());
    } else if (half) {
      if constexpr (std::is_same_v<scalar_t, float>) run(kc.data_ptr<c10::Half>(), vc.data_ptr<c10::Half>());
    } else {
      run(kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>());
    }
  });
  return out;
}

// x [T, KVH, D] (heads contiguous, any token stride) -> the int8 rows [.., KVH, D + 4] of `cache` at slot_mapping[t]:
// kv_quantization.quantize's rounding exactly (scale max |x| / 127, or 1 for a zero row; round half to even), in one
// op per layer where the torch ops took ~0.1 ms of dispatch (3 ms a step at batch 1).
void write_int8_rows(const at::Tensor& x, at::Tensor& cache, const at::Tensor& slot_mapping) {
  const int64_t T = x.size(0), KVH = x.size(1), D = x.size(2);
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == D && cache.scalar_type() == at::kChar &&
              cache.is_contiguous() && cache.dim() == 4 && cache.size(2) == KVH && cache.size(3) == D + 4 &&
              slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T,
              "write_int8_rows: x [T, KVH, D], an int8 cache [blocks, block_size, KVH, D + 4], T int64 slots");
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  int8_t* rows = cache.data_ptr<int8_t>();
  dispatch(x, "write_int8_rows", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* px = x.data_ptr<scalar_t>();
    std::vector<float> values(D);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        const scalar_t* in = px + t * x.stride(0) + h * D;
        float amax = 0.f;
        for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::abs(values[i] = static_cast<float>(in[i])));
        float scale = amax / 127.f;
        if (!(scale > 0.f)) scale = 1.f;
        int8_t* out = rows + (slot[t] * KVH + h) * (D + 4);
        for (int64_t i = 0; i < D; ++i) out[i] = static_cast<int8_t>(std::nearbyint(values[i] / scale));
        std::memcpy(out + D, &scale, sizeof scale);
      }
  });
}

// A step's new keys and values into the cache rows of their slots: index_copy_'s result, in one call for both (two
// index_copy_ calls a layer were ~3 % of a decode step of 48 sequences, nearly all of it dispatch). Float32 ones into a
// float16 cache are rounded to nearest even, as Tensor.half() rounds them.
void write_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache_k, at::Tensor& cache_v,
                const at::Tensor& slot_mapping) {
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  const bool half = cache_k.scalar_type() == at::kHalf && k.scalar_type() == at::kFloat;
  const auto check = [&](const at::Tensor& x, const at::Tensor& cache) {
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(0) == T &&
                x.size(1) * x.size(2) == row && cache.is_contiguous() && cache.dim() == 4 &&
                cache.size(2) * cache.size(3) == row && cache.sizes() == cache_k.sizes() &&
                cache.scalar_type() == cache_k.scalar_type() && x.scalar_type() == k.scalar_type() &&
                (half || cache.scalar_type() == x.scalar_type()),
                "write_rows: k, v [T, KVH, D], each row contiguous; caches [blocks, block_size, KVH, D] of their dtype "
                "(or float16)");
  };
  check(k, cache_k);
  check(v, cache_v);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T, "write_rows: T int64 slots");
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t bytes = row * cache_k.element_size(), limit = cache_k.size(0) * cache_k.size(1);
  const auto copy = [&](const at::Tensor& x, at::Tensor& cache, int64_t t) {
    char* to = static_cast<char*>(cache.data_ptr()) + slot[t] * bytes;
    const char* from = static_cast<const char*>(x.data_ptr()) + t * x.stride(0) * x.element_size();
    if (!half) {
      std::memcpy(to, from, bytes);
      return;
    }
    const float* in = reinterpret_cast<const float*>(from);
    c10::Half* out = reinterpret_cast<c10::Half*>(to);
    int64_t i = 0;
    for (; i + kLanes <= row; i += kLanes) store(out + i, load(in + i));
    for (; i < row; ++i) out[i] = static_cast<c10::Half>(in[i]);
  };
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < limit, "write_rows: slot ", slot[t], " outside the cache");
    copy(k, cache_k, t);
    copy(v, cache_v, t);
  }
}

// The step's new K and V [T, KVH, D] into the cache (an int8 one rounds them as kv_quantization.quantize does), then
// paged_attention: KernelLayout.attend in one call.
at::Tensor write_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& query_start, const at::Tensor& context_lens, double scale,
                            const std::optional<at::Tensor>& prompt_lens, int64_t window,
                            const std::optional<at::Tensor>& sinks) {
  if (k_cache.scalar_type() == at::kChar) {
    write_int8_rows(k, k_cache, slot_mapping);
    write_int8_rows(v, v_cache, slot_mapping);
  } else {
    write_rows(k, v, k_cache, v_cache, slot_mapping);
  }
  return paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, scale, prompt_lens, window,
                         sinks);
}

// A decoder layer's attention from its fused qkv projection [T, (H + 2 KVH) D]: q and k RMS-normed per head where the
// model has q_norm / k_norm (Qwen3, Gemma 3), rotary on q and k in place (on the first cos.size(1) dims of each head:
// Phi's partial rotary), then write_and_attend; returns [T, H D]. One call where the split, views, norms, rotary,
// write and attention were eight or more dispatches from Python, ~1.5 us each, every layer of every step.
at::Tensor attend_qkv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                      const at::Tensor& query_start, const at::Tensor& context_lens, int64_t num_heads, double scale,
                      const std::optional<at::Tensor>& prompt_lens, const std::optional<at::Tensor>& q_norm,
                      const std::optional<at::Tensor>& k_norm, double eps, int64_t window,
                      const std::optional<at::Tensor>& sinks) {
  const int64_t T = qkv.size(0), KVH = k_cache.size(2), D = k_cache.size(3) - (k_cache.scalar_type() == at::kChar ? 4 : 0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * KVH) * D, "attend_qkv: qkv [T, (H + 2 KVH) D]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "attend_qkv: q_norm and k_norm go together");
  auto q = qkv.narrow(1, 0, num_heads * D).view({T, num_heads, D});
  auto k = qkv.narrow(1, num_heads * D, KVH * D).view({T, KVH, D});
  const auto v = qkv.narrow(1, (num_heads + KVH) * D, KVH * D).view({T, KVH, D});
  if (q_norm) {
    llm_kernels::head_rms_norm(q, *q_norm, eps);
    llm_kernels::head_rms_norm(k, *k_norm, eps);
  }
  llm_kernels::rotary(q, k, cos, sin);
  return write_and_attend(q, k, v, k_cache, v_cache, slot_mapping, block_tables, query_start, context_lens, scale,
                          prompt_lens, window, sinks)
      .view({T, num_heads * D});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("attend_qkv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor query_start, Tensor context_lens, int num_heads, "
        "float scale, Tensor? prompt_lens=None, Tensor? q_norm=None, Tensor? k_norm=None, float eps=1e-6, "
        "int window=0, Tensor? sinks=None) -> Tensor");
  m.def("write_and_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor query_start, Tensor context_lens, float scale, Tensor? prompt_lens=None, "
        "int window=0, Tensor? sinks=None) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start, "
        "Tensor context_lens, float scale, Tensor? prompt_lens=None, int window=0, Tensor? sinks=None) -> Tensor");
  m.def("write_int8_rows(Tensor x, Tensor(a!) cache, Tensor slot_mapping) -> ()");
  m.def("write_rows(Tensor k, Tensor v, Tensor(a!) cache_k, Tensor(b!) cache_v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("attend_qkv", &attend_qkv);
  m.impl("write_and_attend", &write_and_attend);
  m.impl("paged_attention", &paged_attention);
  m.impl("write_int8_rows", &write_int8_rows);
  m.impl("write_rows", &write_rows);
}
