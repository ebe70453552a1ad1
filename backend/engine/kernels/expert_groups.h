// A mixture-of-experts layer's GEMMs in one kernel call (models/moe.py): x's rows sorted by expert, group g being rows
// offsets[g] .. offsets[g + 1] - 1 times expert experts[g]'s weights, the experts' packed panels stacked, each expert
// `panels` of them. The threads take (group, panel) items from one queue, as they take a plain GEMM's panels: one
// thread wake-up and one activation rounding a layer where a call per expert paid them per expert. A plain GEMM is the
// one group {expert 0, rows 0 .. M - 1}.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace llm_kernels {

struct ExpertGroups {
  std::vector<int64_t> experts, offsets;

  static ExpertGroups one(int64_t rows) { return {{0}, {0, rows}}; }

  // Checked against x's rows and the stacked panels (`stacked` of them, `panels` an expert).
  static ExpertGroups of(const char* op, at::IntArrayRef experts, at::IntArrayRef offsets, int64_t rows,
                         int64_t stacked, int64_t panels) {
    TORCH_CHECK(panels > 0 && stacked % panels == 0, op, ": ", stacked, " stacked panels are not whole experts of ",
                panels);
    TORCH_CHECK(offsets.size() == experts.size() + 1 && offsets.front() == 0 && offsets.back() == rows, op,
                ": offsets must be one more than experts, from 0 to x's ", rows, " rows");
    for (size_t g = 0; g < experts.size(); ++g) {
      TORCH_CHECK(offsets[g] <= offsets[g + 1], op, ": offsets must not decrease");
      TORCH_CHECK(experts[g] >= 0 && experts[g] < stacked / panels, op, ": expert ", experts[g], " of ",
                  stacked / panels);
    }
    return {experts.vec(), offsets.vec()};
  }

  int64_t items(int64_t panels) const { return static_cast<int64_t>(experts.size()) * panels; }

  // Item i (of items(panels)): its group's first row and row count, its panel among the stacked ones, and that
  // panel's index within the expert (its output columns).
  struct Item {
    int64_t row, rows, panel, column_panel;
  };
  Item item(int64_t i, int64_t panels) const {
    const int64_t g = i / panels, p = i % panels;
    return {offsets[g], offsets[g + 1] - offsets[g], experts[g] * panels + p, p};
  }
};

}  // namespace llm_kernels
