#pragma once
// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as lion-pytorch
// (lucidrains, the package kohya's sd-scripts and OneTrainer name as "Lion") steps it:
//   p ← p · (1 − lr·wd)                               (decoupled weight decay)
//   p ← p − lr · sign(β₁·m + (1 − β₁)·g)
//   m ← β₂·m + (1 − β₂)·g
// with one moment per parameter (half of AdamW's state). `decoupled_weight_decay` divides wd by
// the initial learning rate, as lion-pytorch's option does. A LibTorch optimizer: its options carry
// the learning rate the schedulers set, its state saves and loads through LibTorch's archives (and
// so through difftrain's checkpoints and the sharded optimizers, which take any optimizer).

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/train/fused_adam.hpp"  // fused_detail::evaluate_closure

namespace difftrain::train {

struct LionOptions : public torch::optim::OptimizerCloneableOptions<LionOptions> {
  LionOptions(double lr = 1e-4) : lr_(lr) {}  // NOLINT: implicit as LibTorch's options are
  TORCH_ARG(double, lr);
  using Betas = std::tuple<double, double>;
  TORCH_ARG(Betas, betas) = std::make_tuple(0.9, 0.99);
  TORCH_ARG(double, weight_decay) = 0.0;

 public:  // (TORCH_ARG leaves its members private)
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Betas, betas);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  }
  [[nodiscard]] double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct LionParamState : public torch::optim::OptimizerCloneableParamState<LionParamState> {
  TORCH_ARG(at::Tensor, exp_avg);

 public:
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  }
};

class LionOptimizer : public torch::optim::Optimizer {
 public:
  LionOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                const LionOptions& defaults, bool decoupled_weight_decay = false)
      : torch::optim::Optimizer(groups, std::make_unique<LionOptions>(defaults)),
        init_lr_(defaults.lr()),
        decoupled_(decoupled_weight_decay) {}

  at::Tensor step(LossClosure closure = nullptr) override {
    at::Tensor loss = fused_detail::evaluate_closure(closure);
    const at::NoGradGuard no_grad;
    for (auto& group : param_groups()) {
      const auto& o = static_cast<const LionOptions&>(group.options());
      const double lr = o.lr();
      const auto [beta1, beta2] = o.betas();
      const double wd = decoupled_ ? o.weight_decay() / init_lr_ : o.weight_decay();
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        const at::Tensor& grad = p.grad();
        auto& slot = state()[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto fresh = std::make_unique<LionParamState>();
          fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
          slot = std::move(fresh);
        }
        at::Tensor exp_avg = static_cast<LionParamState&>(*slot).exp_avg();
        p.mul_(1.0 - lr * wd);
        const at::Tensor update = exp_avg.clone().mul_(beta1).add(grad, 1.0 - beta1).sgn_();
        p.add_(update, -lr);
        exp_avg.mul_(beta2).add_(grad, 1.0 - beta2);
      }
    }
    return loss;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<LionParamState, LionOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<LionParamState, LionOptions>(archive, *this);
  }

 private:
  double init_lr_;
  bool decoupled_;
};

}  // namespace difftrain::train
