// A step's decoder layers in one call from Python (runners/layer_program.py): each layer's GEMMs (our kernels, each
// with its packed weight, as its tactic chose: runners/gemm.py), attend_qkv, its norms (add_rms_norm, and Gemma's
// rms_norm) and its activation (silu_mul, or Gemma's GeGLU in ATen's ops), called here through the dispatcher with the
// same arguments the Python loop (models/llama.py, DecoderLayer.forward on KernelOps) passes them: the same kernels on
// the same tensors, the same bits. From Python each of a layer's eight calls cost 4-8 us of
// argument parsing and frames, ~150 us a layer with the layer's own Python (AMD EPYC Zen 3, 2026-12-07); from here a
// boxed call through the dispatcher costs under a microsecond.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

// One kernel call of a Linear: y = op(x, *tensors, *ints) (+ bias); a Linear of several parts concatenates theirs.
struct KernelCall {
  c10::OperatorHandle op;
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> ints;
  std::optional<at::Tensor> bias;
};

struct Layer {
  std::vector<KernelCall> linears[4];  // qkv_proj, o_proj, gate_up_proj, down_proj (models/llama.py PROJECTIONS)
  at::Tensor k_cache, v_cache, post_norm, next_norm;  // next_norm: the next layer's input_layernorm, or the final norm
  std::optional<at::Tensor> q_norm, k_norm;
  std::optional<at::Tensor> pre_ff_norm, post_ff_norm;  // Gemma's norms around the MLP (its attention's: post_norm)
  int64_t window;
  bool gelu;     // Gemma's GeGLU (tanh), else SiLU
  bool sliding;  // Gemma's sliding layers turn by their own rope
};

c10::OperatorHandle op_named(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
}

at::Tensor call(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  op.callBoxed(stack);
  return std::move(stack[0]).toTensor();
}

class LayerProgram : public torch::CustomClassHolder {
 public:
  LayerProgram(int64_t num_heads, double scale, double eps)
      : num_heads_(num_heads),
        scale_(scale),
        eps_(eps),
        attend_qkv_(op_named("llm_kernels::attend_qkv")),
        add_rms_norm_(op_named("llm_kernels::add_rms_norm")),
        rms_norm_(op_named("llm_kernels::rms_norm")),
        silu_mul_(op_named("llm_kernels::silu_mul")) {}

  void add_layer(at::Tensor k_cache, at::Tensor v_cache, at::Tensor post_norm, at::Tensor next_norm,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 std::optional<at::Tensor> pre_ff_norm, std::optional<at::Tensor> post_ff_norm, int64_t window,
                 bool gelu, bool sliding) {
    TORCH_CHECK(pre_ff_norm.has_value() == post_ff_norm.has_value(), "LayerProgram.add_layer: both MLP norms or none");
    layers_.push_back(Layer{{}, k_cache, v_cache, post_norm, next_norm, q_norm, k_norm, pre_ff_norm, post_ff_norm,
                            window, gelu, sliding});
  }

  // A part of the last layer's Linear `linear` (an index into Layer::linears)
  void add_kernel_call(int64_t linear, const std::string& op, std::vector<at::Tensor> tensors,
                       std::vector<int64_t> ints, std::optional<at::Tensor> bias) {
    TORCH_CHECK(!layers_.empty() && linear >= 0 && linear < 4, "LayerProgram.add_kernel_call: no such layer or Linear");
    layers_.back().linears[linear].push_back(KernelCall{op_named(op), std::move(tensors), std::move(ints), bias});
  }

  // Layers first..last-1 over the residual stream x (changed in place) and h, its norm by the first layer's
  // input_layernorm; returns h after them. The rest is the step's KernelLayout and its rope rows (the sliding
  // layers' where they have their own).
  at::Tensor run(at::Tensor x, at::Tensor h, at::Tensor cos, at::Tensor sin, std::optional<at::Tensor> cos_sliding,
                 std::optional<at::Tensor> sin_sliding, at::Tensor slot_mapping, at::Tensor block_tables,
                 at::Tensor query_start, at::Tensor context_lens, std::optional<at::Tensor> prompt_lens,
                 int64_t first, int64_t last) {
    TORCH_CHECK(0 <= first && first <= last && last <= static_cast<int64_t>(layers_.size()),
                "LayerProgram.run: layers ", first, "..", last, " of ", layers_.size());
    torch::jit::Stack stack;
    for (int64_t i = first; i < last; ++i) {
      const Layer& layer = layers_[i];
      TORCH_CHECK(!layer.sliding || (cos_sliding && sin_sliding), "LayerProgram.run: the sliding layers' rope missing");
      stack = {linear(layer.linears[0], h), layer.sliding ? *cos_sliding : cos, layer.sliding ? *sin_sliding : sin,
               layer.k_cache, layer.v_cache, slot_mapping, block_tables, query_start, context_lens, num_heads_,
               scale_, prompt_lens, layer.q_norm, layer.k_norm, eps_, layer.window, c10::IValue()};
      const at::Tensor attention = call(attend_qkv_, stack);
      const at::Tensor o = linear(layer.linears[1], attention);
      h = layer.pre_ff_norm ? add_rms_norm(rms_norm(o, layer.post_norm), x, *layer.pre_ff_norm)
                            : add_rms_norm(o, x, layer.post_norm);
      const at::Tensor mlp = linear(layer.linears[3], gated(linear(layer.linears[2], h), layer.gelu));
      h = layer.post_ff_norm ? add_rms_norm(rms_norm(mlp, *layer.post_ff_norm), x, layer.next_norm)
                             : add_rms_norm(mlp, x, layer.next_norm);
    }
    return h;
  }

 private:
  at::Tensor linear(const std::vector<KernelCall>& parts, const at::Tensor& x) const {
    std::vector<at::Tensor> ys;
    for (const KernelCall& part : parts) {
      torch::jit::Stack stack{x};
      stack.insert(stack.end(), part.tensors.begin(), part.tensors.end());
      stack.insert(stack.end(), part.ints.begin(), part.ints.end());
      at::Tensor y = call(part.op, stack);
      ys.push_back(part.bias ? y + *part.bias : y);
    }
    return ys.size() == 1 ? ys[0] : at::cat(ys, -1);
  }

  at::Tensor add_rms_norm(const at::Tensor& delta, const at::Tensor& residual, const at::Tensor& weight) const {
    torch::jit::Stack stack{delta, residual, weight, eps_};
    return call(add_rms_norm_, stack);
  }

  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
    torch::jit::Stack stack{x, weight, eps_};
    return call(rms_norm_, stack);
  }

  // silu_mul, or Gemma's GeGLU as the Python loop computes it (models/llama.py TorchOps.gelu_tanh_mul: ATen's ops)
  at::Tensor gated(const at::Tensor& gate_up, bool gelu) const {
    if (gelu) {
      const auto parts = gate_up.chunk(2, -1);
      return at::gelu(parts[0], "tanh") * parts[1];
    }
    torch::jit::Stack stack{gate_up};
    return call(silu_mul_, stack);
  }

  int64_t num_heads_;
  double scale_, eps_;
  c10::OperatorHandle attend_qkv_, add_rms_norm_, rms_norm_, silu_mul_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.class_<LayerProgram>("LayerProgram")
      .def(torch::init<int64_t, double, double>())
      .def("add_layer", &LayerProgram::add_layer)
      .def("add_kernel_call", &LayerProgram::add_kernel_call)
      .def("run", &LayerProgram::run);
}
