#pragma once
// Adam and AdamW on torch's fused kernels (`at::_fused_adam_` / `at::_fused_adamw_`, CPU and
// CUDA): one kernel per (device, dtype) bucket of a parameter group updates every parameter, its
// moments and its step, where LibTorch's own optimizers launch a handful of kernels per parameter.
// The numbers are torch.optim.Adam/AdamW(fused=True)'s.
//
// They are LibTorch's torch::optim::Adam / AdamW with another step(): the options, the
// per-parameter state and the serialized archive are LibTorch's, so checkpoints, the Python
// state converters and parameter-group code work unchanged, and a run saved with one kernel
// resumes with the other. As in Python, each parameter's step count also lives in a float32
// scalar on the parameter's device (the fused kernels read it there); it is rebuilt from the
// integer step of LibTorch's state whenever the two disagree (after loading a state).

#include <ATen/ATen.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/train/gradient_groups.hpp"
#include "difftrain/train/scaled_step.hpp"

namespace difftrain::train {

namespace fused_detail {

/// The float32 step scalars the fused kernels read, one per parameter, kept in step with the
/// integer step of LibTorch's state.
class StepScalars {
 public:
  at::Tensor& for_param(const at::Tensor& p, std::int64_t step) {
    Entry& e = entries_[p.unsafeGetTensorImpl()];
    if (!e.tensor.defined() || e.host != step || e.tensor.device() != p.device()) {
      e.tensor = at::full({}, static_cast<double>(step),
                          at::TensorOptions().dtype(at::kFloat).device(p.device()));
      e.host = step;
    }
    return e.tensor;
  }
  void advanced(const at::Tensor& p) { ++entries_[p.unsafeGetTensorImpl()].host; }

 private:
  struct Entry {
    at::Tensor tensor;
    std::int64_t host = -1;
  };
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
};

struct Bucket {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  std::vector<torch::optim::OptimizerParamState*> states;  // one per parameter, in its order
};

/// A step's closure evaluated with gradients on, as torch.optim's `with torch.enable_grad()`
/// (the caller may run the step itself under no_grad). No closure: an undefined loss.
inline at::Tensor evaluate_closure(const std::function<at::Tensor()>& closure) {
  if (!closure) return {};
  const at::AutoGradMode enable(true);
  return closure();
}

/// What differs between Adam and AdamW: LibTorch's classes and torch's fused kernel.
struct AdamW {
  using Torch = torch::optim::AdamW;
  using Options = torch::optim::AdamWOptions;
  using State = torch::optim::AdamWParamState;
  static constexpr const char* name = "AdamW";
  static constexpr bool decoupled_weight_decay = true;
  static void kernel(auto&&... a) { at::_fused_adamw_(std::forward<decltype(a)>(a)...); }
};
struct Adam {
  using Torch = torch::optim::Adam;
  using Options = torch::optim::AdamOptions;
  using State = torch::optim::AdamParamState;
  static constexpr const char* name = "Adam";
  static constexpr bool decoupled_weight_decay = false;
  static void kernel(auto&&... a) { at::_fused_adam_(std::forward<decltype(a)>(a)...); }
};

/// The parameters of one group that have a gradient, by (device, dtype) — torch's kernels take
/// tensors of one device and dtype — with their Adam state, created at the first step as torch
/// creates it. `on_param(bucket, param, state)` fills what the caller's kernel needs beyond the
/// tensors (the step scalars of the fused kernel).
template <class Kind, class OnParam>
std::map<TensorKind, Bucket> adam_buckets(torch::optim::Optimizer& opt,
                                          torch::optim::OptimizerParamGroup& group,
                                          const std::string& who, OnParam&& on_param) {
  using State = typename Kind::State;
  const bool amsgrad = static_cast<typename Kind::Options&>(group.options()).amsgrad();
  std::map<TensorKind, Bucket> buckets;
  for (auto& p : group.params()) {
    if (!p.grad().defined()) continue;
    if (p.grad().is_sparse()) throw ConfigError("sparse gradients are not supported", who);
    if (!at::isFloatingType(p.scalar_type()))
      throw ConfigError(
          "needs floating-point parameters, got " + std::string(c10::toString(p.scalar_type())),
          who);
    auto& slot = opt.state()[p.unsafeGetTensorImpl()];
    if (!slot) {
      auto s = std::make_unique<State>();
      s->step(0);
      s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
      s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      if (amsgrad) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      slot = std::move(s);
    }
    auto& s = static_cast<State&>(*slot);
    if (amsgrad && !s.max_exp_avg_sq().defined())
      s.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    Bucket& b = buckets[kind_of(p)];
    b.params.push_back(p);
    b.grads.push_back(p.grad());
    b.exp_avgs.push_back(s.exp_avg());
    b.exp_avg_sqs.push_back(s.exp_avg_sq());
    if (amsgrad) b.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
    b.states.push_back(&s);
    on_param(b, p, s);
  }
  return buckets;
}

/// Gradient scaling handed to the fused kernel (torch.amp.GradScaler's grad_scale): the kernel
/// divides each gradient by it as it reads it. The kernel's `found_inf` is not passed: the scaler
/// has already read it on the host and does not launch the step at all on an overflow, which also
/// keeps LibTorch's integer step counts right without another read-back.
struct AmpArgs {
  std::optional<at::Tensor> grad_scale;
};

/// One fused step over every parameter group of `opt`.
template <class Kind>
void fused_step(torch::optim::Optimizer& opt, StepScalars& scalars, const AmpArgs& amp = {}) {
  using Options = typename Kind::Options;
  using State = typename Kind::State;
  const std::string who = std::string("fused ") + Kind::name;
  const at::NoGradGuard no_grad;
  for (auto& group : opt.param_groups()) {
    auto& o = static_cast<Options&>(group.options());
    const auto [beta1, beta2] = o.betas();
    auto buckets =
        adam_buckets<Kind>(opt, group, who, [&](Bucket& b, const at::Tensor& p, State& s) {
          b.steps.push_back(scalars.for_param(p, s.step()));
        });
    for (auto& [key, b] : buckets) {
      at::_foreach_add_(b.steps, 1);
      // On the bucket's device: the scaler's tensors live where the loss was.
      const c10::Device d = b.params.front().device();
      std::optional<at::Tensor> scale;
      if (amp.grad_scale) scale = amp.grad_scale->to(d);
      Kind::kernel(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps, o.lr(),
                   beta1, beta2, o.weight_decay(), o.eps(), o.amsgrad(), /*maximize=*/false, scale,
                   std::nullopt);
      for (std::size_t i = 0; i < b.params.size(); ++i) {
        auto& s = static_cast<State&>(*b.states[i]);
        s.step(s.step() + 1);
        scalars.advanced(b.params[i]);
      }
    }
  }
}

}  // namespace fused_detail

/// LibTorch's Adam or AdamW (`Kind`: fused_detail::Adam or AdamW) whose step is torch's fused
/// kernel.
template <class Kind>
class FusedOptimizer : public Kind::Torch, public ScaledStepOptimizer {
 public:
  using Kind::Torch::Torch;
  at::Tensor step(typename Kind::Torch::LossClosure closure = nullptr) override {
    at::Tensor loss = fused_detail::evaluate_closure(closure);
    fused_detail::fused_step<Kind>(*this, scalars_);
    return loss;
  }
  void step_scaled(const at::Tensor& grad_scale) override {
    fused_detail::fused_step<Kind>(*this, scalars_, {.grad_scale = grad_scale});
  }

 private:
  fused_detail::StepScalars scalars_;
};

/// torch::optim::AdamW whose step is torch's fused AdamW kernel.
using FusedAdamWOptimizer = FusedOptimizer<fused_detail::AdamW>;
/// torch::optim::Adam whose step is torch's fused Adam kernel (L2 weight decay on the gradient).
using FusedAdamOptimizer = FusedOptimizer<fused_detail::Adam>;

}  // namespace difftrain::train
