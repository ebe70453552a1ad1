// The kernels' threads split their items as at::parallel_for does, in contiguous shares, but a thread that has done its
// own share takes the items another has not started, from that share's end.
//
// A region of an OpenMP-parallel kernel ends when its slowest thread does. With fixed shares, a thread that the OS holds
// back (a Triton server's or a client's thread waking on its CPU, a hypervisor's steal) makes its whole share late, and
// the other threads wait for it at the region's end. Taking the late thread's last items, they end within an item of
// each other. Each share stays contiguous and in order until the end, as a weight stream from DRAM wants (items dealt
// one at a time from a single counter ran a decode GEMM's panels 4-5 % slower).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace llm_kernels {

class WorkQueue {
 public:
  WorkQueue(int64_t items, int64_t threads) : shares_(threads) {
    for (int64_t t = 0; t < threads; ++t)
      shares_[t].range.store(pack(items * t / threads, items * (t + 1) / threads), std::memory_order_relaxed);
  }

  // Thread t's next item: from the front of its own share, else from the end of another's; -1 when none is left.
  int64_t take(int64_t t) {
    const int64_t n = shares_.size();
    for (int64_t i = 0; i < n; ++i) {
      std::atomic<uint64_t>& range = shares_[(t + i) % n].range;
      uint64_t v = range.load(std::memory_order_relaxed);
      while (front(v) < back(v)) {
        const uint64_t taken = i == 0 ? pack(front(v) + 1, back(v)) : pack(front(v), back(v) - 1);
        if (range.compare_exchange_weak(v, taken, std::memory_order_relaxed))
          return i == 0 ? front(v) : back(v) - 1;
      }
    }
    return -1;
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) { return static_cast<uint64_t>(front) << 32 | back; }
  static int64_t front(uint64_t v) { return v >> 32; }
  static int64_t back(uint64_t v) { return v & 0xffffffffu; }
  struct alignas(64) Share {  // a cache line each: the owners' takes do not contend
    std::atomic<uint64_t> range;
  };
  std::vector<Share> shares_;
};

// body(queue, t) once on each thread t of up to at::get_num_threads() (one, inline, where already in a parallel
// region); body takes items 0 .. items - 1 with queue.take(t) until it returns -1.
template <typename F>
void parallel_take(int64_t items, const F& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  if (threads <= 0) return;
  WorkQueue queue(items, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) body(queue, t);
  });
}

}  // namespace llm_kernels
