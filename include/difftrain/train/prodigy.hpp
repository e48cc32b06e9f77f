#pragma once
// Prodigy (Mishchenko & Defazio 2023), as the prodigyopt package (1.1) steps it: Adam whose
// learning rate is lr · d, with d estimated from the run (d-adaptation):
//   numerator  ← β₃·numerator + Σ (d/d₀)·d·lr·bc · ⟨g, p₀ − p⟩      (sliced every slice_p values)
//   s          ← β₃·s + (d/d₀)·d·lr·bc · g    (safeguard_warmup: (d/d₀)·d · g)
//   d̂ = d_coef · numerator / Σ|s|;  d ← min(max(d, d̂) on the first growth, d_max·…, d·growth)
//   m ← β₁·m + d(1 − β₁)·g;  v ← β₂·v + d²(1 − β₂)·g²;  p ← p − d·lr·bc · m / (√v + d·ε)
// with bc the bias correction (use_bias_correction), β₃ = √β₂ unless given, weight decay
// decoupled (p ← p − wd·d·lr·bc·p) or added to the gradient. The run's d, d_max, numerator and
// step count k live in the groups' options, as prodigyopt keeps them in its param_groups, so a
// checkpoint carries them. Every group must have the same lr (or 0), as prodigyopt requires.

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/train/fused_adam.hpp"  // fused_detail::evaluate_closure

namespace difftrain::train {

struct ProdigyOptions : public torch::optim::OptimizerCloneableOptions<ProdigyOptions> {
  ProdigyOptions(double lr = 1.0) : lr_(lr) {}  // NOLINT: implicit as LibTorch's options are
  using Betas = std::tuple<double, double>;
  TORCH_ARG(double, lr);
  TORCH_ARG(Betas, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, beta3) = -1.0;  // < 0: √β₂
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, decouple) = true;
  TORCH_ARG(bool, use_bias_correction) = false;
  TORCH_ARG(bool, safeguard_warmup) = false;
  TORCH_ARG(double, d0) = 1e-6;
  TORCH_ARG(double, d_coef) = 1.0;
  TORCH_ARG(double, growth_rate) = std::numeric_limits<double>::infinity();
  TORCH_ARG(std::int64_t, slice_p) = 1;
  // The run's estimate (prodigyopt's group entries).
  TORCH_ARG(double, d) = 1e-6;
  TORCH_ARG(double, d_max) = 1e-6;
  TORCH_ARG(double, d_numerator) = 0.0;
  TORCH_ARG(std::int64_t, k) = 0;

 public:  // (TORCH_ARG leaves its members private)
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Betas, betas);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, beta3);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, decouple);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, use_bias_correction);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, safeguard_warmup);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, d0);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, d_coef);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, growth_rate);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, slice_p);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, d);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, d_max);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, d_numerator);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, k);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(beta3);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decouple);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(use_bias_correction);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(safeguard_warmup);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(d0);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(d_coef);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(growth_rate);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(slice_p);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(d);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(d_max);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(d_numerator);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(k);
  }
  [[nodiscard]] double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct ProdigyParamState : public torch::optim::OptimizerCloneableParamState<ProdigyParamState> {
  TORCH_ARG(std::int64_t, step) = 0;
  TORCH_ARG(at::Tensor, s);
  TORCH_ARG(at::Tensor, p0);
  TORCH_ARG(at::Tensor, exp_avg);  // undefined when β₁ = 0
  TORCH_ARG(at::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, s);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, p0);
    if (c10::IValue saved; archive.try_read("exp_avg", saved)) exp_avg(saved.toTensor());
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(s);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(p0);
    if (exp_avg().defined()) _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  }
};

class ProdigyOptimizer : public torch::optim::Optimizer {
 public:
  ProdigyOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                   const ProdigyOptions& defaults)
      : torch::optim::Optimizer(groups, std::make_unique<ProdigyOptions>(defaults)) {}

  at::Tensor step(LossClosure closure = nullptr) override {
    at::Tensor loss = fused_detail::evaluate_closure(closure);
    const at::NoGradGuard no_grad;
    auto options = [](torch::optim::OptimizerParamGroup& g) -> ProdigyOptions& {
      return static_cast<ProdigyOptions&>(g.options());
    };
    auto& first = options(param_groups().front());
    const auto [beta1, beta2] = first.betas();
    const double beta3 = first.beta3() < 0 ? std::sqrt(beta2) : first.beta3();
    double d = first.d(), d_max = first.d_max();
    const double d_coef = first.d_coef(), growth = first.growth_rate();
    double lr = 0;
    for (auto& g : param_groups()) lr = std::max(lr, options(g).lr());
    const auto k = static_cast<double>(first.k());
    const double bias_correction =
        first.use_bias_correction()
            ? std::sqrt(1 - std::pow(beta2, k + 1)) / (1 - std::pow(beta1, k + 1))
            : 1.0;
    const double dlr = d * lr * bias_correction;
    const double d_numerator = first.d_numerator() * beta3;
    double delta_numerator = 0, d_denom = 0;
    for (auto& g : param_groups()) {
      auto& o = options(g);
      const double decay = o.weight_decay(), group_lr = o.lr(), d0 = o.d0();
      const std::int64_t slice = o.slice_p();
      if (group_lr != lr && group_lr != 0.0)
        throw ConfigError("every group needs the same learning rate (or 0), as prodigyopt's",
                          "Prodigy");
      for (auto& p : g.params()) {
        if (!p.grad().defined()) continue;
        at::Tensor grad = p.grad();
        if (decay != 0 && !o.decouple()) grad.add_(p, decay);
        auto& slot = state()[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto fresh = std::make_unique<ProdigyParamState>();
          const at::Tensor sliced = p.flatten().slice(0, 0, c10::nullopt, slice);
          fresh->s(at::zeros_like(sliced));
          fresh->p0(p.any().item<bool>() ? sliced.clone() : at::zeros({}, p.options()));
          if (beta1 > 0) fresh->exp_avg(at::zeros_like(p));
          fresh->exp_avg_sq(at::zeros_like(p));
          slot = std::move(fresh);
        }
        auto& st = static_cast<ProdigyParamState&>(*slot);
        if (group_lr > 0.0) {
          const at::Tensor sliced_grad = grad.flatten().slice(0, 0, c10::nullopt, slice);
          const at::Tensor sliced_p = p.flatten().slice(0, 0, c10::nullopt, slice);
          delta_numerator +=
              (d / d0) * dlr * at::dot(sliced_grad, st.p0() - sliced_p).item<double>();
          if (beta1 > 0) st.exp_avg().mul_(beta1).add_(grad, d * (1 - beta1));
          st.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, d * d * (1 - beta2));
          st.s().mul_(beta3).add_(sliced_grad,
                                  o.safeguard_warmup() ? (d / d0) * d : (d / d0) * dlr);
          d_denom += st.s().abs().sum().item<double>();
        }
      }
    }
    if (d_denom == 0) return loss;
    double d_hat = d;
    double global_numerator = d_numerator;
    if (lr > 0.0) {
      global_numerator = d_numerator + delta_numerator;
      d_hat = d_coef * global_numerator / d_denom;
      if (d == first.d0()) d = std::max(d, d_hat);
      d_max = std::max(d_max, d_hat);
      d = std::min(d_max, d * growth);
    }
    for (auto& g : param_groups()) {
      auto& o = options(g);
      o.d_numerator(global_numerator).d(d).d_max(d_max);
      const double decay = o.weight_decay(), eps = o.eps();
      for (auto& p : g.params()) {
        if (!p.grad().defined()) continue;
        auto& st = static_cast<ProdigyParamState&>(*state()[p.unsafeGetTensorImpl()]);
        st.step(st.step() + 1);
        const at::Tensor denom = st.exp_avg_sq().sqrt().add_(d * eps);
        if (decay != 0 && o.decouple()) p.add_(p, -decay * dlr);
        if (beta1 > 0)
          p.addcdiv_(st.exp_avg(), denom, -dlr);
        else
          p.addcdiv_(p.grad(), denom, -dlr * d);
      }
      o.k(o.k() + 1);
    }
    return loss;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<ProdigyParamState, ProdigyOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<ProdigyParamState, ProdigyOptions>(archive, *this);
  }
};

}  // namespace difftrain::train
