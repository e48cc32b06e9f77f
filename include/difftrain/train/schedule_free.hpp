#pragma once
// Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled"), as schedulefree's
// `AdamWScheduleFree` steps it: no learning-rate schedule; the parameters a step sees are y, an
// interpolation between the fast iterate z and the average x that is the model to evaluate:
//   v ← β₂v + (1 − β₂)g²;  ĝ = g / (√(v / (1 − β₂ᵏ⁺¹)) + ε) + wd·y
//   c = w / Σw with w = (k+1)^r · lr_max^weight_lr_power, lr = lr_group · min(1, (k+1)/warmup)
//   y ← lerp(y, z, c) + lr(β₁(1 − c) − 1)·ĝ;  z ← z − lr·ĝ
// The run's k, Σw, lr_max and train/eval mode live in the groups' options, as schedulefree keeps
// them in its param_groups, so a checkpoint carries them.
//
// Training steps y; sampling, evaluation and exported weights want x = lerp(y, z, 1 − 1/β₁).
// `eval_weights()` / `train_weights()` switch the parameters between the two (schedulefree's
// eval()/train()); `EvaluationWeights` does it for a scope and is a no-op for every other
// optimizer. Unlike schedulefree, a new optimizer starts in train mode (the Trainer owns it).

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/train/fused_adam.hpp"  // fused_detail::evaluate_closure

namespace difftrain::train {

/// An optimizer whose parameters hold different values for training and for evaluation.
class SwitchesEvaluationWeights {
 public:
  virtual ~SwitchesEvaluationWeights() = default;
  virtual void eval_weights() = 0;
  virtual void train_weights() = 0;
  [[nodiscard]] virtual bool training_weights() const = 0;
};

struct ScheduleFreeAdamWOptions
    : public torch::optim::OptimizerCloneableOptions<ScheduleFreeAdamWOptions> {
  ScheduleFreeAdamWOptions(double lr = 2.5e-3) : lr_(lr) {}  // NOLINT: as LibTorch's options
  using Betas = std::tuple<double, double>;
  TORCH_ARG(double, lr);
  TORCH_ARG(Betas, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(std::int64_t, warmup_steps) = 0;
  TORCH_ARG(double, r) = 0.0;
  TORCH_ARG(double, weight_lr_power) = 2.0;
  // The run (schedulefree's group entries).
  TORCH_ARG(std::int64_t, k) = 0;
  TORCH_ARG(bool, train_mode) = true;
  TORCH_ARG(double, weight_sum) = 0.0;
  TORCH_ARG(double, lr_max) = -1.0;
  TORCH_ARG(double, scheduled_lr) = 0.0;

 public:  // (TORCH_ARG leaves its members private)
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Betas, betas);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, warmup_steps);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, r);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_lr_power);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, k);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, train_mode);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_sum);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr_max);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, scheduled_lr);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(warmup_steps);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(r);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_lr_power);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(k);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(train_mode);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_sum);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr_max);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(scheduled_lr);
  }
  [[nodiscard]] double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct ScheduleFreeParamState
    : public torch::optim::OptimizerCloneableParamState<ScheduleFreeParamState> {
  TORCH_ARG(at::Tensor, z);
  TORCH_ARG(at::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, z);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(z);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  }
};

class ScheduleFreeAdamWOptimizer : public torch::optim::Optimizer,
                                   public SwitchesEvaluationWeights {
 public:
  ScheduleFreeAdamWOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                             const ScheduleFreeAdamWOptions& defaults)
      : torch::optim::Optimizer(groups, std::make_unique<ScheduleFreeAdamWOptions>(defaults)) {}

  at::Tensor step(LossClosure closure = nullptr) override {
    if (!training_weights())
      throw ConfigError(
          "a step with the evaluation weights in place (call train_weights() first, as "
          "schedulefree's optimizer.train())",
          "AdamWScheduleFree");
    at::Tensor loss = fused_detail::evaluate_closure(closure);
    const at::NoGradGuard no_grad;
    for (auto& group : param_groups()) {
      auto& o = options(group);
      const auto [beta1, beta2] = o.betas();
      const std::int64_t k = o.k();
      const double sched = k < o.warmup_steps()
                               ? static_cast<double>(k + 1) / static_cast<double>(o.warmup_steps())
                               : 1.0;
      const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(k + 1));
      const double lr = o.lr() * sched;
      o.scheduled_lr(lr);
      o.lr_max(std::max(lr, o.lr_max()));
      const double weight =
          std::pow(static_cast<double>(k + 1), o.r()) * std::pow(o.lr_max(), o.weight_lr_power());
      o.weight_sum(o.weight_sum() + weight);
      const double ckp1 = o.weight_sum() == 0.0 ? 0.0 : weight / o.weight_sum();
      for (auto& y : group.params()) {
        if (!y.grad().defined()) continue;
        auto& slot = state()[y.unsafeGetTensorImpl()];
        if (!slot) {
          auto fresh = std::make_unique<ScheduleFreeParamState>();
          fresh->z(y.clone(at::MemoryFormat::Preserve));
          fresh->exp_avg_sq(at::zeros_like(y, at::MemoryFormat::Preserve));
          slot = std::move(fresh);
        }
        auto& st = static_cast<ScheduleFreeParamState&>(*slot);
        at::Tensor grad = y.grad();
        st.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1.0 - beta2);
        const at::Tensor denom = st.exp_avg_sq().div(bias_correction2).sqrt_().add_(o.eps());
        at::Tensor normalised = grad.div_(denom);
        if (o.weight_decay() != 0) normalised.add_(y, o.weight_decay());
        y.lerp_(st.z(), ckp1);
        y.add_(normalised, lr * (beta1 * (1 - ckp1) - 1));
        st.z().sub_(normalised, lr);
      }
      o.k(k + 1);
    }
    return loss;
  }

  /// x = lerp(y, z, 1 − 1/β₁) in place of y (schedulefree's eval()); a no-op when switched.
  void eval_weights() override { switch_to(false); }
  /// y = lerp(x, z, 1 − β₁) in place of x (schedulefree's train()).
  void train_weights() override { switch_to(true); }
  [[nodiscard]] bool training_weights() const override {
    return static_cast<const ScheduleFreeAdamWOptions&>(param_groups().front().options())
        .train_mode();
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<ScheduleFreeParamState, ScheduleFreeAdamWOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<ScheduleFreeParamState, ScheduleFreeAdamWOptions>(archive, *this);
  }

 private:
  static ScheduleFreeAdamWOptions& options(torch::optim::OptimizerParamGroup& g) {
    return static_cast<ScheduleFreeAdamWOptions&>(g.options());
  }
  void switch_to(bool train) {
    const at::NoGradGuard no_grad;
    for (auto& group : param_groups()) {
      auto& o = options(group);
      if (o.train_mode() == train) continue;
      const double beta1 = std::get<0>(o.betas());
      for (auto& p : group.params()) {
        const auto it = state().find(p.unsafeGetTensorImpl());
        if (it == state().end()) continue;
        const at::Tensor& z = static_cast<ScheduleFreeParamState&>(*it->second).z();
        p.lerp_(z.to(p.device()), train ? 1 - beta1 : 1 - 1 / beta1);
      }
      o.train_mode(train);
    }
  }
};

/// The evaluation weights for a scope: switches a schedule-free optimizer's parameters to x and
/// back to y at the end; does nothing for any other optimizer (or one already switched).
class EvaluationWeights {
 public:
  explicit EvaluationWeights(torch::optim::Optimizer& optimizer)
      : switching_(dynamic_cast<SwitchesEvaluationWeights*>(&optimizer)) {
    if (switching_ != nullptr && switching_->training_weights())
      switching_->eval_weights();
    else
      switching_ = nullptr;
  }
  ~EvaluationWeights() {
    if (switching_ != nullptr) switching_->train_weights();
  }
  EvaluationWeights(const EvaluationWeights&) = delete;
  EvaluationWeights& operator=(const EvaluationWeights&) = delete;

 private:
  SwitchesEvaluationWeights* switching_;
};

}  // namespace difftrain::train
