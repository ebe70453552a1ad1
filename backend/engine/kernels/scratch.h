// A kernel call's temporaries (an int8 GEMM's quantized activations and their scales) in memory the calling thread
// keeps from one call to the next: grown when a call needs more, never shrunk. Three at::empty a call were ~1.5 us
// of an int4 GEMM's ~26 us at one row, 120 GEMM calls a decode step.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace llm_kernels {

inline size_t aligned64(size_t bytes) { return (bytes + 63) / 64 * 64; }

// At least `bytes` bytes, 64-byte aligned; valid until this thread's next call.
inline char* thread_scratch(size_t bytes) {
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<char, Free> buffer;
  thread_local size_t capacity = 0;
  if (bytes > capacity) {
    capacity = aligned64(bytes);
    buffer.reset(static_cast<char*>(std::aligned_alloc(64, capacity)));
    TORCH_CHECK(buffer, "thread_scratch: out of memory for ", capacity, " bytes");
  }
  return buffer.get();
}

}  // namespace llm_kernels
