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

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "difftrain/core/error.hpp"

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
};

/// What differs between the fused Adam and AdamW: LibTorch's classes and torch's kernel.
struct AdamW {
  using Torch = torch::optim::AdamW;
  using Options = torch::optim::AdamWOptions;
  using State = torch::optim::AdamWParamState;
  static constexpr const char* name = "fused AdamW";
  static void kernel(auto&&... a) { at::_fused_adamw_(std::forward<decltype(a)>(a)...); }
};
struct Adam {
  using Torch = torch::optim::Adam;
  using Options = torch::optim::AdamOptions;
  using State = torch::optim::AdamParamState;
  static constexpr const char* name = "fused Adam";
  static void kernel(auto&&... a) { at::_fused_adam_(std::forward<decltype(a)>(a)...); }
};

/// One fused step over every parameter group of `opt`.
template <class Kind>
void fused_step(torch::optim::Optimizer& opt, StepScalars& scalars) {
  using Options = typename Kind::Options;
  using State = typename Kind::State;
  const char* name = Kind::name;
  const at::NoGradGuard no_grad;
  for (auto& group : opt.param_groups()) {
    auto& o = static_cast<Options&>(group.options());
    const auto [beta1, beta2] = o.betas();
    // Kernels take tensors of one device and dtype; a group usually has one bucket.
    std::map<std::pair<std::string, int>, Bucket> buckets;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (p.grad().is_sparse())
        throw ConfigError("sparse gradients are not supported", std::string(name));
      if (!at::isFloatingType(p.scalar_type()))
        throw ConfigError(
            "needs floating-point parameters, got " + std::string(c10::toString(p.scalar_type())),
            std::string(name));
      auto& slot = opt.state()[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto s = std::make_unique<State>();
        s->step(0);
        s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (o.amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      auto& s = static_cast<State&>(*slot);
      if (o.amsgrad() && !s.max_exp_avg_sq().defined())
        s.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      Bucket& b = buckets[{p.device().str(), static_cast<int>(p.scalar_type())}];
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      b.exp_avgs.push_back(s.exp_avg());
      b.exp_avg_sqs.push_back(s.exp_avg_sq());
      if (o.amsgrad()) b.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
      b.steps.push_back(scalars.for_param(p, s.step()));
    }
    for (auto& [key, b] : buckets) {
      at::_foreach_add_(b.steps, 1);
      Kind::kernel(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps, o.lr(),
                   beta1, beta2, o.weight_decay(), o.eps(), o.amsgrad(), /*maximize=*/false);
      for (const at::Tensor& p : b.params) {
        auto& s = static_cast<State&>(*opt.state()[p.unsafeGetTensorImpl()]);
        s.step(s.step() + 1);
        scalars.advanced(p);
      }
    }
  }
}

}  // namespace fused_detail

/// LibTorch's Adam or AdamW (`Kind`: fused_detail::Adam or AdamW) whose step is torch's fused
/// kernel.
template <class Kind>
class FusedOptimizer : public Kind::Torch {
 public:
  using Kind::Torch::Torch;
  at::Tensor step(typename Kind::Torch::LossClosure closure = nullptr) override {
    at::Tensor loss;
    if (closure) {
      const at::AutoGradMode enable(true);
      loss = closure();
    }
    fused_detail::fused_step<Kind>(*this, scalars_);
    return loss;
  }

 private:
  fused_detail::StepScalars scalars_;
};

/// torch::optim::AdamW whose step is torch's fused AdamW kernel.
using FusedAdamWOptimizer = FusedOptimizer<fused_detail::AdamW>;
/// torch::optim::Adam whose step is torch's fused Adam kernel (L2 weight decay on the gradient).
using FusedAdamOptimizer = FusedOptimizer<fused_detail::Adam>;

}  // namespace difftrain::train
