// The weight kernels' prefetch of the next panel while they read this one: DRAM's latency hides behind this panel's
// work. Into L2 (T1), not L1: into L1 (T0) the next panel's lines, 16-20 KB ahead, evicted the panel being read (a 1B
// Q4_K_M batch-1 decode step 1.22x longer, AMD Zen 4, the hint alternated in one process).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace llm_kernels {

// Every cache line of [p, p + bytes) into L2.
inline void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(static_cast<const char*>(p) + l, _MM_HINT_T1);
}

// Every cache line of [p, p + bytes) into L1: a tile load's rows, two loads ahead (q8_0_w8a8.cpp's AMX tiles: a 16-row
// GEMM 4-20 % faster than its tile loads waiting for L2, Intel Xeon, 2026-12-06).
inline void prefetch_l1(const void* p, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(static_cast<const char*>(p) + l, _MM_HINT_T0);
}

}  // namespace llm_kernels
