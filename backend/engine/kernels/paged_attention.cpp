// Paged attention for the CPU: each query reads its sequence's keys and values in place, block by
// block through the block table. No gather into padded rows, no mask tensor: the work and the memory
// read are those of the real context, which the gather path (models/llama.py) pays for the longest
// sequence of the batch. Math in float32 whatever the storage dtype; softmax exact (two passes).
//
// A query of sequence s at index i of its chunk sits at position context_lens[s] - chunk + i and sees
// keys 0..position: the cache must already hold this step's new keys and values.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// exp(x) for x <= 0 (softmax after the max is taken out): 2^(x log2 e) split into an integer power,
// built in the exponent bits, and a degree-6 polynomial of the fraction (relative error ~2e-7, about
// std::exp's float rounding). Plain arithmetic, so the softmax loop vectorizes; std::exp does not.
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

// 8 floats in a vector register (GCC/Clang vector extensions: AVX2 here, NEON on ARM).
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v8f load8(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  v8u16 raw;
  std::memcpy(&raw, p, sizeof raw);
  const v8u32 wide = __builtin_convertvector(raw, v8u32) << 16;
  v8f v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline v8f load8(const c10::Half* p) {
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

inline float sum8(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// f(j, row) for positions j = 0..n-1 of a sequence, in order, block by block through its block table;
// row: position j's [KVH, D] slice of the cache (a block holds every KV head, so reads are contiguous).
template <typename scalar_t, typename F>
inline void for_each_key(const scalar_t* __restrict cache, const int64_t* __restrict table, int64_t n,
                         int64_t block_size, int64_t row_size, F&& f) {
  for (int64_t j0 = 0; j0 < n; j0 += block_size) {
    const scalar_t* __restrict block = cache + table[j0 / block_size] * block_size * row_size;
    const int64_t m = std::min(block_size, n - j0);
    for (int64_t jo = 0; jo < m; ++jo) f(j0 + jo, block + jo * row_size);
  }
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_ctx;
  float scale;
};

// One query token against keys 0..n-1 of its sequence, all heads: blocks are read whole and in
// order (a block holds every KV head), each key once for the G query heads that share it.
// Scratch: scores H * max_ctx, acc and qf H * head_dim floats.
template <typename scalar_t>
void attend_token(const scalar_t* __restrict q, const scalar_t* __restrict k_cache,
                  const scalar_t* __restrict v_cache, scalar_t* __restrict out, const int64_t* __restrict table,
                  int64_t n, const Shape& shape, float* __restrict scores, float* __restrict acc,
                  float* __restrict qf) {
  const int64_t H = shape.num_heads, KVH = shape.num_kv_heads, G = H / KVH, D = shape.head_dim;
  const int64_t BS = shape.block_size, max_ctx = shape.max_ctx, V = D / 8;
  for (int64_t i = 0; i < H * D; ++i) qf[i] = static_cast<float>(q[i]) * shape.scale;

  for_each_key(k_cache, table, n, BS, KVH * D, [&](int64_t j, const scalar_t* __restrict row) {
    for (int64_t g = 0; g < KVH; ++g) {
      const scalar_t* __restrict key = row + g * D;
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        const float* __restrict qh = qf + h * D;
        v8f dot = {};
        for (int64_t v = 0; v < V; ++v) dot += load8(qh + 8 * v) * load8(key + 8 * v);
        scores[h * max_ctx + j] = sum8(dot);
      }
    }
  });
  float inv_sum[256];
  for (int64_t h = 0; h < H; ++h) {
    float* __restrict sh = scores + h * max_ctx;
    const float mx = *std::max_element(sh, sh + n);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      sh[j] = fast_exp(sh[j] - mx);
      sum += sh[j];
    }
    inv_sum[h] = 1.f / sum;
  }
  std::fill(acc, acc + H * D, 0.f);
  for_each_key(v_cache, table, n, BS, KVH * D, [&](int64_t j, const scalar_t* __restrict row) {
    for (int64_t g = 0; g < KVH; ++g) {
      const scalar_t* __restrict value = row + g * D;
      for (int64_t v = 0; v < V; ++v) {
        const v8f x = load8(value + 8 * v);
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          const v8f sum = load8(acc + h * D + 8 * v) + scores[h * max_ctx + j] * x;
          std::memcpy(acc + h * D + 8 * v, &sum, sizeof sum);
        }
      }
    }
  });
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<scalar_t>(acc[h * D + d] * inv_sum[h]);
}

template <typename scalar_t>
void attend(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, scalar_t* out,
            const int64_t* block_tables, const int64_t* query_start, const int64_t* context_lens,
            int64_t num_seqs, int64_t num_tokens, Shape shape) {
  std::vector<int64_t> token_seq(num_tokens);
  for (int64_t s = 0; s < num_seqs; ++s) {
    std::fill(token_seq.begin() + query_start[s], token_seq.begin() + query_start[s + 1], s);
    shape.max_ctx = std::max(shape.max_ctx, context_lens[s]);
  }
  const int64_t HD = shape.num_heads * shape.head_dim;
  // Thread c takes tokens c, c + n, c + 2n, ...: prefill tokens cost far more than decode tokens, and
  // a strided deal spreads both kinds over the threads (contiguous chunks would not).
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_tokens);
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(shape.num_heads * shape.max_ctx), acc(HD), qf(HD);
    for (int64_t c = begin; c < end; ++c) {
      for (int64_t t = c; t < num_tokens; t += num_threads) {
        const int64_t s = token_seq[t];
        const int64_t chunk = query_start[s + 1] - query_start[s];
        const int64_t n = context_lens[s] - chunk + (t - query_start[s]) + 1;  // visible keys
        attend_token<scalar_t>(q + t * HD, k_cache, v_cache, out + t * HD, block_tables + s * shape.max_blocks, n,
                               shape, scores.data(), acc.data(), qf.data());
      }
    }
  });
}

// q [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [S, B];
// query_start [S + 1]; context_lens [S] (int64). Returns [T, H, D] in q's dtype.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "paged_attention: bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and the cache must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "paged_attention: head mismatch");
  TORCH_CHECK(q.size(1) <= 256 && q.size(2) % 8 == 0, "paged_attention: at most 256 heads, head_dim a multiple of 8");
  for (const auto* t : {&block_tables, &query_start, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong, "paged_attention: index tensors must be int64");
  const auto qc = q.contiguous(), kc = k_cache.contiguous(), vc = v_cache.contiguous();
  const auto bt = block_tables.contiguous(), qs = query_start.contiguous(), cl = context_lens.contiguous();
  auto out = at::empty_like(qc);
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    attend<scalar_t>(qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                     bt.data_ptr<int64_t>(), qs.data_ptr<int64_t>(), cl.data_ptr<int64_t>(), cl.size(0), qc.size(0),
                     Shape{qc.size(1), kc.size(2), qc.size(2), kc.size(1), bt.size(1), 1, static_cast<float>(scale)});
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16 only, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(llm_kernels, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) { m.impl("paged_attention", &paged_attention); }
