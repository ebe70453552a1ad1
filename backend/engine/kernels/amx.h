// AMX for the CPU kernels that use its tiles (bf16_amx.cpp, paged_attention.cpp): compiled only where the build's CPU
// has AMX-BF16 (LLM_AMX), and used only after Linux grants the process the tile state.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define LLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace llm_kernels {

inline bool amx_permitted() {  // Linux hands out AMX's tile state per process, on request
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// Every tile 16 rows of 64 bytes (16 floats, or 32 bfloat16: 16 pairs); loaded by each thread before its tiles
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

#if defined(__AMX_INT8__)
// The int8 GEMMs' tiles (q8_0_w8a8.cpp, q4_1_w4a8.cpp), one 32-deep block of products at a time, in two sets: tile 0
// (1) holds 16 rows of x's block (32 bytes each), tile 2 (3) the block's weights (8 groups of [16 channels][4 k]),
// tile 4 (5) their int32 sums.
inline void load_int8_block_tiles() {
  TileConfig config;
  config.colsb[0] = config.colsb[1] = 32;
  config.rows[2] = config.rows[3] = 8;
  _tile_loadconfig(&config);
}

// One block's 16 x 16 int32 sums into c (16 rows of 16), in tile set (X, W, C). A macro: GCC's tile intrinsics are
// macros that write their tiles' numbers into the instruction's text.
#define LLM_INT8_BLOCK_TILE(X, W, C, x, ldx, w, c) \
  do {                                             \
    _tile_loadd(X, x, ldx);                        \
    _tile_loadd(W, w, 64);                         \
    _tile_zero(C);                                 \
    _tile_dpbsud(C, X, W);                         \
    _tile_stored(C, c, 64);                        \
  } while (0)

// For each 32-deep block b < nb in order: 16 rows of x (int8, row stride ldx, block b at x + 32 b) times the block's
// weights at weights(b), the int32 sums [16 rows][16 channels] handed to use(b, sums). The tile unit takes block b + 1
// (the other tile set and buffer) while use() does block b's float work: each block waiting for its own sums held the
// tiles to ~1.3x VNNI (Intel Xeon, 2026-12-05).
template <typename Weights, typename Use>
__attribute__((always_inline)) inline void int8_block_products(const int8_t* x, int64_t ldx, int64_t nb,
                                                               Weights weights, Use use) {
  alignas(64) int32_t c[2][16 * 16];
  LLM_INT8_BLOCK_TILE(0, 2, 4, x, ldx, weights(0), c[0]);
  for (int64_t b = 0; b < nb; b += 2) {
    if (b + 1 < nb) LLM_INT8_BLOCK_TILE(1, 3, 5, x + 32 * (b + 1), ldx, weights(b + 1), c[1]);
    use(b, c[0]);
    if (b + 1 < nb) {
      if (b + 2 < nb) LLM_INT8_BLOCK_TILE(0, 2, 4, x + 32 * (b + 2), ldx, weights(b + 2), c[0]);
      use(b + 1, c[1]);
    }
  }
}
#endif

}  // namespace llm_kernels
#endif
