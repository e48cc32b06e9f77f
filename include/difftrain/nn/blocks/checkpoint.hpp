#pragma once
// Gradient checkpointing, which LibTorch lacks: the forward pass runs without keeping activations,
// and backward runs the function again with gradients on, then differentiates it. The CPU and
// CUDA random states (and the autocast state) of the forward pass are restored for the recompute,
// so dropout draws the same mask and the gradients equal those of the plain function. Parameters
// are passed in explicitly so the output requires grad even when the inputs do not (the first
// block of a network), as latent diffusion's `checkpoint(func, inputs, params, flag)`.

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <functional>
#include <optional>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::nn {

using CheckpointBody = std::function<at::Tensor(const std::vector<at::Tensor>& inputs)>;

namespace checkpoint_detail {

struct Saved : torch::CustomClassHolder {
  CheckpointBody body;
  std::size_t n_inputs = 0;
  std::vector<bool> needs_grad;
  at::Tensor cpu_rng;
  std::optional<c10::Device> cuda_device;
  at::Tensor cuda_rng;
  bool autocast_cuda = false, autocast_cpu = false;
  at::ScalarType autocast_cuda_dtype = at::kHalf, autocast_cpu_dtype = at::kBFloat16;
};

inline at::Tensor generator_state(at::Generator g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}
inline void set_generator_state(at::Generator& g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

// Puts the saved random and autocast state in place for the recompute, and back afterwards.
class ReplayState {
 public:
  explicit ReplayState(const Saved& s) : s_(s) {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    cpu_now_ = generator_state(cpu);
    set_generator_state(cpu, s.cpu_rng);
    if (s.cuda_device) {
      at::Generator cuda = at::globalContext().defaultGenerator(*s.cuda_device);
      cuda_now_ = generator_state(cuda);
      set_generator_state(cuda, s.cuda_rng);
    }
    cuda_ac_ = at::autocast::is_autocast_enabled(at::kCUDA);
    cpu_ac_ = at::autocast::is_autocast_enabled(at::kCPU);
    cuda_dt_ = at::autocast::get_autocast_dtype(at::kCUDA);
    cpu_dt_ = at::autocast::get_autocast_dtype(at::kCPU);
    at::autocast::set_autocast_enabled(at::kCUDA, s.autocast_cuda);
    at::autocast::set_autocast_enabled(at::kCPU, s.autocast_cpu);
    at::autocast::set_autocast_dtype(at::kCUDA, s.autocast_cuda_dtype);
    at::autocast::set_autocast_dtype(at::kCPU, s.autocast_cpu_dtype);
  }
  ~ReplayState() {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    set_generator_state(cpu, cpu_now_);
    if (s_.cuda_device) {
      at::Generator cuda = at::globalContext().defaultGenerator(*s_.cuda_device);
      set_generator_state(cuda, cuda_now_);
    }
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_ac_);
    at::autocast::set_autocast_enabled(at::kCPU, cpu_ac_);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dt_);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dt_);
  }
  ReplayState(const ReplayState&) = delete;
  ReplayState& operator=(const ReplayState&) = delete;

 private:
  const Saved& s_;
  at::Tensor cpu_now_, cuda_now_;
  bool cuda_ac_, cpu_ac_;
  at::ScalarType cuda_dt_, cpu_dt_;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::IValue saved_capsule, at::TensorList tensors) {
    auto saved = c10::static_intrusive_pointer_cast<Saved>(saved_capsule.toCapsule());
    ctx->saved_data["saved"] = saved_capsule;
    ctx->save_for_backward(tensors.vec());
    saved->cpu_rng = generator_state(at::detail::getDefaultCPUGenerator());
    for (const at::Tensor& t : tensors)
      if (t.defined() && t.is_cuda()) {
        saved->cuda_device = t.device();
        saved->cuda_rng = generator_state(at::globalContext().defaultGenerator(t.device()));
        break;
      }
    saved->autocast_cuda = at::autocast::is_autocast_enabled(at::kCUDA);
    saved->autocast_cpu = at::autocast::is_autocast_enabled(at::kCPU);
    saved->autocast_cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
    saved->autocast_cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    const std::vector<at::Tensor> inputs(tensors.begin(),
                                         tensors.begin() + static_cast<long>(saved->n_inputs));
    return {saved->body(inputs)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto saved = c10::static_intrusive_pointer_cast<Saved>(ctx->saved_data["saved"].toCapsule());
    const std::vector<at::Tensor> all = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> wrt;  // what gradients are taken with respect to
    std::vector<std::size_t> wrt_index;
    for (std::size_t i = 0; i < all.size(); ++i) {
      at::Tensor t = all[i];
      if (i < saved->n_inputs) {
        if (t.defined()) t = t.detach().requires_grad_(saved->needs_grad[i]);
        inputs.push_back(t);
      }
      if (t.defined() && saved->needs_grad[i]) {
        wrt.push_back(t);
        wrt_index.push_back(i);
      }
    }
    at::Tensor out;
    {
      ReplayState replay(*saved);
      at::AutoGradMode grad_on(true);
      out = saved->body(inputs);
    }
    torch::autograd::variable_list result(all.size() + 1);  // +1: the capsule argument
    if (wrt.empty() || !out.requires_grad()) return result;
    const auto grads = torch::autograd::grad({out}, wrt, {grad_out[0]}, /*retain_graph=*/false,
                                             /*create_graph=*/false, /*allow_unused=*/true);
    for (std::size_t j = 0; j < wrt.size(); ++j) result[wrt_index[j] + 1] = grads[j];
    return result;
  }
};

}  // namespace checkpoint_detail

/// body(inputs) with activations recomputed in backward instead of stored, when `enabled` and
/// gradients are being recorded; otherwise just body(inputs). `params` are the parameters body
/// uses (their gradients are produced by the recompute). Inputs must be defined tensors.
inline at::Tensor checkpoint(const CheckpointBody& body, const std::vector<at::Tensor>& inputs,
                             const std::vector<at::Tensor>& params, bool enabled = true) {
  if (!enabled || !at::GradMode::is_enabled()) return body(inputs);
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (!inputs[i].defined())
      throw ConfigError("input " + std::to_string(i) + " is undefined; pass only defined tensors",
                        "checkpoint");
  auto saved = c10::make_intrusive<checkpoint_detail::Saved>();
  saved->body = body;
  saved->n_inputs = inputs.size();
  std::vector<at::Tensor> tensors = inputs;
  tensors.insert(tensors.end(), params.begin(), params.end());
  for (const at::Tensor& t : tensors) saved->needs_grad.push_back(t.defined() && t.requires_grad());
  const auto out = checkpoint_detail::CheckpointFunction::apply(
      c10::IValue::make_capsule(std::move(saved)), at::TensorList(tensors));
  return out.at(0);
}

}  // namespace difftrain::nn
