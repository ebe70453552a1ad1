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
// The int8 GEMMs' tiles (q8_0_w8a8.cpp, q4_1_w4a8.cpp), one 32-deep block of products at a time: tile 0 holds 16 rows
// of x's block (32 bytes each), tile 2 the block's weights (8 groups of [16 channels][4 k]), tile 4 their int32 sums.
inline void load_int8_block_tiles() {
  TileConfig config;
  config.colsb[0] = 32;
  config.rows[2] = 8;
  _tile_loadconfig(&config);
}
#endif

}  // namespace llm_kernels
#endif
