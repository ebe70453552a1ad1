// A mixture-of-experts layer's grouping of tokens by expert and its weighted sum of their outputs (models/moe.py), each
// one call where torch took six small ops and a list's worth of Python (argsort, bincount and its list, the rows'
// gather; zeros, the weights' gather, mul, index_add_): ~60 of a ~85 us routing a layer in a decode step of a 2.8B
// Qwen3-MoE (AMD EPYC Zen 5). The same values as those torch ops (TorchOps, moe.py): the (token, choice) pairs in the
// order a stable argsort by expert gives them (a counting sort), and each pair's output times its weight added into its
// token's row in that order, the product and each sum rounded to the storage dtype as torch's mul and index_add_ round.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_math.h"

namespace {

using namespace llm_kernels;

// h [T, hidden], experts [T, k] int64 -> (rows [T k, hidden]: each pair's token's row of h, grouped by expert; order
// [T k]: each grouped pair's index t k + choice; the experts with pairs, ascending; offsets: their first rows, and the
// end).
std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>, std::vector<int64_t>> group_by_expert(
    const at::Tensor& h, const at::Tensor& experts, int64_t num_experts) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && experts.dim() == 2 && experts.size(0) == h.size(0) &&
                  experts.scalar_type() == at::kLong && experts.is_contiguous(),
              "group_by_expert: h [T, hidden] contiguous and experts [T, k] int64 expected");
  const int64_t pairs = experts.numel(), k = experts.size(1);
  const int64_t* e = experts.data_ptr<int64_t>();
  std::vector<int64_t> first(num_experts + 1, 0);  // first[i]: expert i's first row
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(e[p] >= 0 && e[p] < num_experts, "group_by_expert: expert ", e[p], " of ", num_experts);
    ++first[e[p] + 1];
  }
  std::vector<int64_t> used, offsets{0};
  for (int64_t i = 0; i < num_experts; ++i) {
    if (first[i + 1]) used.push_back(i), offsets.push_back(offsets.back() + first[i + 1]);
    first[i + 1] += first[i];
  }
  auto order = at::empty({pairs}, experts.options());
  int64_t* o = order.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) o[first[e[p]]++] = p;
  auto rows = at::empty({pairs, h.size(1)}, h.options());
  const size_t bytes = h.size(1) * h.element_size();
  const char* src = static_cast<const char*>(h.data_ptr());
  char* dst = static_cast<char*>(rows.data_ptr());
  at::parallel_for(0, pairs, 64, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) std::memcpy(dst + p * bytes, src + o[p] / k * bytes, bytes);
  });
  return {rows, order, used, offsets};
}

// row[c] += y[c] * w for c in [begin, end), the product rounded to the dtype before the sum as torch's mul then
// index_add_ round: no fused multiply-add (which GCC forms from such a loop by default).
template <typename scalar_t>
__attribute__((optimize("fp-contract=off"))) void add_weighted(scalar_t* row, const scalar_t* y, float w,
                                                               int64_t begin, int64_t end) {
  for (int64_t c = begin; c < end; ++c)
    row[c] = static_cast<scalar_t>(static_cast<float>(row[c]) + round_to<scalar_t>(static_cast<float>(y[c]) * w));
}

// ys [T k, hidden] (the grouped pairs' outputs), weights [T, k] in ys' dtype, order (group_by_expert's) -> [T, hidden]:
// zeros, then each pair's output times its weight added into its token's row, pair by pair. Threads take columns, so
// every element's sum keeps that order.
at::Tensor combine_experts(const at::Tensor& ys, const at::Tensor& weights, const at::Tensor& order) {
  TORCH_CHECK(ys.dim() == 2 && ys.is_contiguous() && weights.dim() == 2 && weights.is_contiguous() &&
                  weights.scalar_type() == ys.scalar_type() && order.dim() == 1 && order.scalar_type() == at::kLong &&
                  order.numel() == ys.size(0) && order.numel() == weights.numel(),
              "combine_experts: ys [T k, hidden], weights [T, k] in its dtype and order [T k] int64 expected");
  const int64_t pairs = ys.size(0), hidden = ys.size(1), k = weights.size(1);
  auto out = at::zeros({weights.size(0), hidden}, ys.options());
  const int64_t* o = order.data_ptr<int64_t>();
  dispatch(ys, "combine_experts", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *py = ys.data_ptr<scalar_t>(), *pw = weights.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, hidden, 512, [&](int64_t begin, int64_t end) {
      for (int64_t p = 0; p < pairs; ++p)
        add_weighted(po + o[p] / k * hidden, py + p * hidden, static_cast<float>(pw[o[p]]), begin, end);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("group_by_expert(Tensor h, Tensor experts, int num_experts) -> (Tensor, Tensor, int[], int[])");
  m.def("combine_experts(Tensor ys, Tensor weights, Tensor order) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("group_by_expert", &group_by_expert);
  m.impl("combine_experts", &combine_experts);
}
