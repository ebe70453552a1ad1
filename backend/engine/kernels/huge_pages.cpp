// A weight the kernels stream every decode step, copied into memory backed by 2 MiB pages (transparent huge pages,
// asked for with madvise: Linux's default THP mode, "madvise", gives them only where asked). With 4 KiB pages a
// 1 GB step crosses 250,000 pages, each a TLB miss and a page walk beside the stream: the 1B Q8_0 decode step took
// 54-56 ms against 51.5-52.5 with every page huge (THP "always", Intel Xeon with AMX, 4 pairs alternating).
//
// The region is its own mapping, 2 MiB-aligned, as long as the tensor rounded up to 4 KiB: the kernel backs each
// whole 2 MiB of it with one page and the tail with small ones, so nothing is allocated that the tensor does not use.
// Where the system refuses (THP "never", no memory to compact into huge pages), the same mapping has small pages: the
// copy is then only a copy. runners/gemm.py calls it on packed weights of 2 MiB and more.

#include <ATen/ATen.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kHuge = 2 << 20, kPage = 4096;

at::Tensor in_huge_pages(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "in_huge_pages: a contiguous tensor expected");
  const int64_t bytes = t.nbytes();
  const int64_t length = (bytes + kPage - 1) / kPage * kPage, span = length + kHuge;
  void* mapped = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(mapped != MAP_FAILED, "in_huge_pages: mmap of ", span, " bytes failed");
  // keep [start, start + length) with start 2 MiB-aligned; unmap the rest of the span on both sides
  char* const base = static_cast<char*>(mapped);
  char* const start = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) / kHuge * kHuge);
  if (start > base) munmap(base, start - base);
  if (base + span > start + length) munmap(start + length, base + span - (start + length));
  madvise(start, length, MADV_HUGEPAGE);  // advice: where it is refused, small pages
  at::Tensor out = at::from_blob(start, t.sizes(), [length](void* p) { munmap(p, length); }, t.options());
  out.copy_(t);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) { m.def("in_huge_pages(Tensor t) -> Tensor"); }

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) { m.impl("in_huge_pages", &in_huge_pages); }
