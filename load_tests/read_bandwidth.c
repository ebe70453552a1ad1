// DRAM read bandwidth, the bound of a decode step (which reads every weight once): T threads read their shares of a
// buffer far larger than the last-level cache, 256-bit loads into 4 accumulators, each thread prefetching 2 KiB
// ahead as the GEMM kernels prefetch their next panel; the best of 7 passes, in GB/s (10^9 bytes a second).
// load_tests/bench_scale.py compiles it with the machine's gcc (-O3 -march=native -fopenmp) and runs it beside the
// systems it measures.
//
//     read_bandwidth [threads] [MiB]     -> one line: "<GB/s>"
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 2;
  const size_t bytes = (size_t)(argc > 2 ? atoi(argv[2]) : 1024) << 20;
  char* buf = aligned_alloc(64, bytes);
  if (!buf) return 1;
#pragma omp parallel for num_threads(threads)  // each thread's pages first touched by itself
  for (size_t i = 0; i < bytes; i += 64) buf[i] = (char)i;
  double best = 1e30;
  long long sink = 0;
  for (int pass = 0; pass < 7; ++pass) {
    const double start = now();
#pragma omp parallel num_threads(threads) reduction(^ : sink)
    {
      const size_t n = omp_get_num_threads(), id = omp_get_thread_num();
      const size_t lo = bytes / n * id, hi = bytes / n * (id + 1);
      __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
      for (size_t i = lo; i < hi; i += 128) {
        _mm_prefetch(buf + i + 2048, _MM_HINT_T0);
        _mm_prefetch(buf + i + 2048 + 64, _MM_HINT_T0);
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i*)(buf + i)));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i*)(buf + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i*)(buf + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i*)(buf + i + 96)));
      }
      sink ^= _mm256_extract_epi64(_mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)), 0);
    }
    const double seconds = now() - start;
    if (seconds < best) best = seconds;
  }
  printf("%.2f\n", bytes / best / 1e9 + (sink == 42 ? 1e-9 : 0.0));  // sink: the loads are not optimized away
  free(buf);
  return 0;
}
