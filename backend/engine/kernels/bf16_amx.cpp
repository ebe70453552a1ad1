// y = x @ W^T + b for a bfloat16 model by AMX tiles (TDPBF16PS): the `bf16_amx` GEMM tactic (runners/gemm.py).
// W is packed at load into panels of 16 output channels, k-blocks of 32, each one B tile ([panels][K/32][16][16][2]:
// tile row r holds w[n][k + 2r], w[n][k + 2r + 1] for the panel's 16 channels n); x is read as A tiles of 16 rows
// in place, its last M % 16 rows from a copy padded with zero rows (all of x copied only where K is not whole k-blocks).
//
// Why ours beside oneDNN's (which also runs AMX here): a decode step's GEMMs have few rows and stream their weights.
// SmolLM2's 30 layers of bfloat16 weights, cycled so that they come from memory, at 1-16 rows (Intel Xeon, AMX, 2
// threads) took oneDNN's prepacked GEMM 12-20 ms a pass and this loop 9-12 (it prefetches the next panel into L2
// while it computes on this one); at 48-64 rows ~10 % less; at 512, ~10 % more.
//
// Up to 4 row tiles (64 rows) share each loaded B tile: C tiles 0-3, A tiles 4-5, B tile 6 (amx.h's config). Each
// product of two bfloat16 values is exact in float32 and summed in float32 (TDPBF16PS flushes denormals); the sum is
// rounded to bfloat16 once, after the bias (float32, as runners/gemm.py passes it): a float32-accumulating GEMM up to
// the order of sums.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "amx.h"
#include "prefetch.h"
#include "work_queue.h"

namespace {

constexpr int64_t kCols = 16, kDepth = 32;  // a panel's channels; a k-block's depth

at::Tensor bf16_amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16_amx_pack: bfloat16 [N, K] expected");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kCols - 1) / kCols, blocks = (K + kDepth - 1) / kDepth;
  auto packed = at::zeros({panels, blocks, kDepth / 2, 16, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * kCols; n < std::min(N, end * kCols); ++n)
      for (int64_t k = 0; k < K; ++k)  // zeros past N and past K
        dst[(((n / kCols * blocks + k / kDepth) * (kDepth / 2) + k % kDepth / 2) * 16 + n % 16) * 2 + k % 2] =
            src[n * K + k];
  });
  return packed;
}

at::Tensor bf16_amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                           int64_t out_features) {
#if !defined(LLM_AMX)
  TORCH_CHECK(false, "bf16_amx_linear: this build has no AMX-BF16");
#else
  TORCH_CHECK(llm_kernels::amx_permitted(), "bf16_amx_linear: the kernel refused this process AMX's tile state");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_amx_linear: x [M, K] bfloat16 expected");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, panels = packed.size(0), blocks = packed.size(1);
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && blocks == (K + kDepth - 1) / kDepth &&
              panels * kCols >= N, "bf16_amx_linear: weight packed by bf16_amx_pack for in_features ", K, " expected");
  const int64_t Mp = (M + 15) / 16 * 16, Kp = blocks * kDepth, tiles_m = Mp / 16, rest = M % 16;
  // A tiles: 16 rows of whole k-blocks, read from x itself; the last rows (M % 16) from a copy padded with zeros. A
  // padded copy of all of x (zeroed, then copied) took ~5 % of a bfloat16 decode step of 48 sequences.
  at::Tensor xs = x;
  std::vector<uint16_t> tail;  // plain memory: torch's zeros and copy_ cost ~15 us a call in dispatch alone
  if (Kp != K || !x.is_contiguous()) {
    xs = at::zeros({Mp, Kp}, x.options());
    xs.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
  }
  const auto* px = reinterpret_cast<const uint16_t*>(xs.data_ptr());
  std::vector<const uint16_t*> row_tiles(tiles_m);  // each row tile's first row
  for (int64_t t = 0; t < tiles_m; ++t) row_tiles[t] = px + t * 16 * Kp;
  if (rest && xs.is_same(x)) {
    tail.assign(16 * Kp, 0);
    std::memcpy(tail.data(), px + (M - rest) * Kp, rest * Kp * sizeof(uint16_t));
    row_tiles[M / 16] = tail.data();
  }
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bf16_amx_linear: bias [", N, "] expected");
    b = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  const auto* pw = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* pb = bias ? b.data_ptr<float>() : nullptr;
  auto* py = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t panel = blocks * 512;  // elements: a B tile is 16 x 32 bfloat16
  llm_kernels::parallel_take(panels, [&](llm_kernels::WorkQueue& queue, int64_t thread) {
    llm_kernels::TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float c[64][kCols];
    for (int64_t p = queue.take(thread), taken; p >= 0; p = taken) {
      taken = queue.take(thread);  // the next panel, prefetched meanwhile
      const uint16_t* wp = pw + p * panel;
      const uint16_t* next = taken >= 0 ? pw + taken * panel : nullptr;
      const int64_t cols = std::min(kCols, N - p * kCols);
      for (int64_t m0 = 0; m0 < Mp; m0 += 64) {
        const int64_t tiles = std::min<int64_t>(4, (Mp - m0) / 16);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < blocks; ++kb) {
          // the next panel's k-block
          if (next && m0 == 0) llm_kernels::prefetch_l2(next + kb * 512, 512 * sizeof(uint16_t));
          _tile_loadd(6, wp + kb * 512, 64);
          const uint16_t* const* a = row_tiles.data() + m0 / 16;
          _tile_loadd(4, a[0] + kb * kDepth, Kp * 2);
          _tile_dpbf16ps(0, 4, 6);
          if (tiles > 1) {
            _tile_loadd(5, a[1] + kb * kDepth, Kp * 2);
            _tile_dpbf16ps(1, 5, 6);
          }
          if (tiles > 2) {
            _tile_loadd(4, a[2] + kb * kDepth, Kp * 2);
            _tile_dpbf16ps(2, 4, 6);
          }
          if (tiles > 3) {
            _tile_loadd(5, a[3] + kb * kDepth, Kp * 2);
            _tile_dpbf16ps(3, 5, 6);
          }
        }
        _tile_stored(0, &c[0][0], kCols * 4);
        if (tiles > 1) _tile_stored(1, &c[16][0], kCols * 4);
        if (tiles > 2) _tile_stored(2, &c[32][0], kCols * 4);
        if (tiles > 3) _tile_stored(3, &c[48][0], kCols * 4);
        const __mmask16 lanes = cols == 16 ? 0xffff : (1u << cols) - 1;
        for (int64_t i = 0; i < std::min<int64_t>(64, M - m0); ++i) {  // rounded to bfloat16 once, after the bias
          __m512 v = _mm512_load_ps(&c[i][0]);
          if (pb) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, pb + p * kCols));
          _mm256_mask_storeu_epi16(py + (m0 + i) * N + p * kCols, lanes,
                                   reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
        }
      }
    }
    _tile_release();
  });
  return y;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("bf16_amx_pack(Tensor weight) -> Tensor");
  m.def("bf16_amx_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("bf16_amx_pack", &bf16_amx_pack);
  m.impl("bf16_amx_linear", &bf16_amx_linear);
}
