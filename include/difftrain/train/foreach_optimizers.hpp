#pragma once
// Adam, AdamW and SGD on torch's multi-tensor (`_foreach_*`) kernels: each stage of the update
// runs once over every parameter of a (device, dtype) bucket, where LibTorch's optimizers run it
// once per parameter. On CUDA a stage is one launch for many tensors; on the CPU ATen runs the
// same stages tensor by tensor. The numbers are torch.optim.Adam/AdamW/SGD(foreach=True)'s: the
// same stages in the same order, bias corrections computed on the host in double precision from
// the integer step (Python reads its float32 step tensor back, which holds the same integer).
//
// As the fused optimizers, these are LibTorch's optimizers with another step(): options, state and
// archives are LibTorch's, so checkpoints, the Python state converters and a change of kernel
// between runs work unchanged.

#include <ATen/ATen.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_addcdiv.h>
#include <ATen/ops/_foreach_addcmul.h>
#include <ATen/ops/_foreach_div.h>
#include <ATen/ops/_foreach_lerp.h>
#include <ATen/ops/_foreach_maximum.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_sqrt.h>
#include <c10/core/GradMode.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/train/fused_adam.hpp"

namespace difftrain::train {

namespace foreach_detail {

/// torch.optim's _multi_tensor_adam (capturable=False, maximize=False) over every group of `opt`.
template <class Kind>
void adam_step(torch::optim::Optimizer& opt) {
  using Options = typename Kind::Options;
  using State = typename Kind::State;
  const std::string who = std::string("multi-tensor ") + Kind::name;
  const at::NoGradGuard no_grad;
  for (auto& group : opt.param_groups()) {
    auto& o = static_cast<Options&>(group.options());
    const auto [beta1, beta2] = o.betas();
    const double lr = o.lr(), wd = o.weight_decay();
    auto buckets = fused_detail::adam_buckets<Kind>(
        opt, group, who, [](fused_detail::Bucket&, const at::Tensor&, State&) {});
    for (auto& [key, b] : buckets) {
      std::vector<at::Scalar> step_size, bias_correction2_sqrt;
      step_size.reserve(b.states.size());
      bias_correction2_sqrt.reserve(b.states.size());
      for (auto* base : b.states) {
        auto& s = static_cast<State&>(*base);
        s.step(s.step() + 1);
        const auto t = static_cast<double>(s.step());
        step_size.emplace_back(-(lr / (1.0 - std::pow(beta1, t))));
        bias_correction2_sqrt.emplace_back(
            std::pow(1.0 - std::pow(beta2, t), 0.5));  // as `bc ** 0.5`
      }
      std::vector<at::Tensor> grads = b.grads;
      if (wd != 0) {
        if constexpr (Kind::decoupled_weight_decay)
          at::_foreach_mul_(b.params, 1.0 - lr * wd);
        else
          grads = at::_foreach_add(grads, b.params, wd);
      }
      at::_foreach_lerp_(b.exp_avgs, grads, 1.0 - beta1);
      at::_foreach_mul_(b.exp_avg_sqs, beta2);
      at::_foreach_addcmul_(b.exp_avg_sqs, grads, grads, 1.0 - beta2);
      grads.clear();  // an Adam weight-decay copy is not needed past this point
      std::vector<at::Tensor> denom;
      if (o.amsgrad()) {
        at::_foreach_maximum_(b.max_exp_avg_sqs, b.exp_avg_sqs);
        denom = at::_foreach_sqrt(b.max_exp_avg_sqs);
      } else {
        denom = at::_foreach_sqrt(b.exp_avg_sqs);
      }
      at::_foreach_div_(denom, bias_correction2_sqrt);
      at::_foreach_add_(denom, o.eps());
      at::_foreach_addcdiv_(b.params, b.exp_avgs, denom, step_size);
    }
  }
}

/// torch.optim's _multi_tensor_sgd (maximize=False, dense gradients) over every group of `opt`.
inline void sgd_step(torch::optim::SGD& opt) {
  const at::NoGradGuard no_grad;
  for (auto& group : opt.param_groups()) {
    auto& o = static_cast<torch::optim::SGDOptions&>(group.options());
    struct Bucket {
      std::vector<at::Tensor> params, grads;
      std::vector<torch::optim::SGDParamState*> states;  // null: no momentum buffer yet
    };
    std::map<TensorKind, Bucket> buckets;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (p.grad().is_sparse())
        throw ConfigError("sparse gradients are not supported", "multi-tensor SGD");
      Bucket& b = buckets[kind_of(p)];
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      b.states.push_back(it == opt.state().end()
                             ? nullptr
                             : static_cast<torch::optim::SGDParamState*>(it->second.get()));
    }
    const double momentum = o.momentum(), dampening = o.dampening(), wd = o.weight_decay();
    for (auto& [key, b] : buckets) {
      std::vector<at::Tensor> grads = b.grads;
      if (wd != 0) grads = at::_foreach_add(grads, b.params, wd);
      if (momentum != 0) {
        std::vector<at::Tensor> bufs;
        bufs.reserve(grads.size());
        bool all_have_buffers = true;
        for (auto* s : b.states)
          if (s == nullptr || !s->momentum_buffer().defined()) all_have_buffers = false;
        if (all_have_buffers) {
          for (auto* s : b.states) bufs.push_back(s->momentum_buffer());
          at::_foreach_mul_(bufs, momentum);
          at::_foreach_add_(bufs, grads, 1.0 - dampening);
        } else {
          // The first step: a buffer starts as a copy of the gradient (no dampening), as torch.
          for (std::size_t i = 0; i < grads.size(); ++i) {
            auto* s = b.states[i];
            if (s == nullptr) {
              auto fresh = std::make_unique<torch::optim::SGDParamState>();
              s = fresh.get();
              opt.state()[b.params[i].unsafeGetTensorImpl()] = std::move(fresh);
            }
            if (!s->momentum_buffer().defined()) {
              s->momentum_buffer(grads[i].detach().clone());
            } else {
              s->momentum_buffer().mul_(momentum).add_(grads[i], 1.0 - dampening);
            }
            bufs.push_back(s->momentum_buffer());
          }
        }
        if (o.nesterov())
          grads = at::_foreach_add(grads, bufs, momentum);  // Python adds in place into the grads
        else
          grads = std::move(bufs);
      }
      at::_foreach_add_(b.params, grads, -o.lr());
    }
  }
}

}  // namespace foreach_detail

/// LibTorch's Adam or AdamW (`Kind`: fused_detail::Adam or AdamW) whose step runs torch's
/// multi-tensor kernels, as torch.optim.Adam/AdamW(foreach=True).
template <class Kind>
class ForeachOptimizer : public Kind::Torch {
 public:
  using Kind::Torch::Torch;
  at::Tensor step(typename Kind::Torch::LossClosure closure = nullptr) override {
    at::Tensor loss = fused_detail::evaluate_closure(closure);
    foreach_detail::adam_step<Kind>(*this);
    return loss;
  }
};

/// torch::optim::AdamW whose step runs torch's multi-tensor kernels.
using ForeachAdamWOptimizer = ForeachOptimizer<fused_detail::AdamW>;
/// torch::optim::Adam whose step runs torch's multi-tensor kernels.
using ForeachAdamOptimizer = ForeachOptimizer<fused_detail::Adam>;

/// torch::optim::SGD whose step runs torch's multi-tensor kernels, as
/// torch.optim.SGD(foreach=True). With `cpu_per_parameter`, parameters on the CPU take LibTorch's
/// per-parameter step instead, as torch.optim picks foreach only for CUDA tensors (the numbers
/// are the same).
class ForeachSGDOptimizer : public torch::optim::SGD {
 public:
  ForeachSGDOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                      const torch::optim::SGDOptions& defaults, bool cpu_per_parameter = false)
      : torch::optim::SGD(groups, defaults), cpu_per_parameter_(cpu_per_parameter) {}
  ForeachSGDOptimizer(std::vector<at::Tensor> params, const torch::optim::SGDOptions& defaults,
                      bool cpu_per_parameter = false)
      : torch::optim::SGD(std::move(params), defaults), cpu_per_parameter_(cpu_per_parameter) {}

  at::Tensor step(LossClosure closure = nullptr) override {
    if (cpu_per_parameter_ && on_cpu()) return torch::optim::SGD::step(std::move(closure));
    at::Tensor loss = fused_detail::evaluate_closure(closure);
    foreach_detail::sgd_step(*this);
    return loss;
  }

 private:
  // Where the first parameter with a gradient lives (a group's tensors share a device).
  [[nodiscard]] bool on_cpu() {
    for (auto& group : param_groups())
      for (auto& p : group.params())
        if (p.grad().defined()) return p.is_cpu();
    return true;
  }
  bool cpu_per_parameter_;
};

}  // namespace difftrain::train
