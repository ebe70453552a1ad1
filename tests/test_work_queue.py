"""The kernels' work queue (backend/engine/kernels/work_queue.h), compiled into a small C++ program: each item is taken
exactly once, by threads that race for them, and a thread done with its own share takes another's from its end."""

import subprocess
import sysconfig

from torch.utils.cpp_extension import include_paths

from backend.engine.kernels.cpu_kernels import HERE

PROGRAM = r"""
#include "work_queue.h"

#include <cstdio>
#include <thread>
#include <vector>

int main() {
  {  // one thread at a time: 10 items in 3 shares [0, 3) [3, 6) [6, 10)
    llm_kernels::WorkQueue queue(10, 3);
    std::vector<int64_t> got;
    got.push_back(queue.take(1));  // thread 1 starts its own share
    for (int64_t i; (i = queue.take(0)) >= 0;) got.push_back(i);  // its own, then the rest of 1's and 2's from the end
    for (int64_t v : got) std::printf("%lld ", static_cast<long long>(v));
    std::printf("| %lld %lld\n", static_cast<long long>(queue.take(1)), static_cast<long long>(queue.take(2)));
  }
  for (int threads : {2, 3, 8}) {  // threads racing, one of them slow (yielding after each item): every item once
    const int64_t items = 100003;
    llm_kernels::WorkQueue queue(items, threads);
    std::vector<std::vector<int64_t>> taken(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        for (int64_t i; (i = queue.take(t)) >= 0;) {
          taken[t].push_back(i);
          if (t == 0) std::this_thread::yield();
        }
      });
    for (auto& thread : pool) thread.join();
    std::vector<int> count(items);
    for (const auto& mine : taken)
      for (int64_t i : mine) ++count[i];
    int64_t wrong = 0;
    for (int c : count) wrong += c != 1;
    std::printf("%d threads: %lld taken not once\n", threads, static_cast<long long>(wrong));
  }
}
"""


def test_every_item_once_and_the_done_take_from_the_end(tmp_path):
    (tmp_path / "queue.cpp").write_text(PROGRAM)
    includes = [f"-I{p}" for p in [str(HERE), *include_paths(), sysconfig.get_paths()["include"]]]
    subprocess.run(["c++", "-std=c++17", "-O1", "-pthread", *includes, "queue.cpp", "-o", "queue"], cwd=tmp_path,
                   check=True)
    lines = subprocess.run([str(tmp_path / "queue")], check=True, capture_output=True, text=True).stdout.splitlines()
    # thread 1 took 3; thread 0 its own share in order, then the others' from their ends; then nothing for anyone
    assert lines[0] == "3 0 1 2 5 4 9 8 7 6 | -1 -1"
    assert lines[1:] == [f"{n} threads: 0 taken not once" for n in (2, 3, 8)]
