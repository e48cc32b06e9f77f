#pragma once
// CAME (Luo et al. 2023, "Confidence-guided Adaptive Memory Efficient Optimization"), as
// came-pytorch steps it (the CAME kohya's sd-scripts and the PixArt recipes load): Adafactor's
// factored second moment, a first moment, and a factored "instability" that scales it:
//   V ← β₂·V + (1 − β₂)·(g² + ε₁)   (factored for 2+ dimensions, as Adafactor)
//   u = g / √V, divided by max(1, RMS(u) / clip_threshold);  m ← β₁·m + (1 − β₁)·u
//   U ← β₃·U + (1 − β₃)·((u − m)² + ε₂)   (factored)
//   p ← p − lr·wd·p − lr · m / √U          (m itself for 0- and 1-dimensional tensors)
// Its state is FactoredParamState (train/adafactor.hpp) with the instability's row and column.

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "difftrain/train/adafactor.hpp"

namespace difftrain::train {

struct CameOptions : public torch::optim::OptimizerCloneableOptions<CameOptions> {
  CameOptions(double lr = 2e-4) : lr_(lr) {}  // NOLINT: implicit as LibTorch's options are
  using Betas = std::tuple<double, double, double>;
  TORCH_ARG(double, lr);
  TORCH_ARG(double, eps1) = 1e-30;  // added to g²
  TORCH_ARG(double, eps2) = 1e-16;  // added to the instability
  TORCH_ARG(double, clip_threshold) = 1.0;
  TORCH_ARG(Betas, betas) = std::make_tuple(0.9, 0.999, 0.9999);
  TORCH_ARG(double, weight_decay) = 0.0;

 public:  // (TORCH_ARG leaves its members private)
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps1);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps2);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, clip_threshold);
    c10::IValue saved;
    archive.read("betas", saved);
    const auto b = saved.toTupleRef().elements();
    betas({b.at(0).toDouble(), b.at(1).toDouble(), b.at(2).toDouble()});
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps1);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps2);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(clip_threshold);
    const auto [b1, b2, b3] = betas();
    archive.write("betas", c10::ivalue::Tuple::create({b1, b2, b3}));
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  }
  [[nodiscard]] double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

class CameOptimizer : public torch::optim::Optimizer {
 public:
  CameOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                const CameOptions& defaults)
      : torch::optim::Optimizer(groups, std::make_unique<CameOptions>(defaults)) {}

  at::Tensor step(LossClosure closure = nullptr) override {
    using namespace factored_detail;
    at::Tensor loss = fused_detail::evaluate_closure(closure);
    const at::NoGradGuard no_grad;
    for (auto& group : param_groups()) {
      const auto& o = static_cast<const CameOptions&>(group.options());
      const auto [beta1, beta2, beta3] = o.betas();
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        const at::Tensor grad = float_grad(p.grad());
        const bool factored = grad.dim() >= 2;
        auto& slot = state()[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto fresh = std::make_unique<FactoredParamState>();
          fresh->exp_avg(at::zeros_like(grad));
          init_second_moment(*fresh, grad);
          if (factored) {
            auto [res_row, res_col] = factored_zeros(grad);
            fresh->exp_avg_res_row(res_row).exp_avg_res_col(res_col);
          }
          slot = std::move(fresh);
        }
        auto& st = static_cast<FactoredParamState&>(*slot);
        st.step(st.step() + 1);
        at::Tensor update = scaled_gradient(st, grad, beta2, o.eps1(), o.clip_threshold());
        at::Tensor exp_avg = st.exp_avg();
        exp_avg.mul_(beta1).add_(update, 1.0 - beta1);
        if (factored) {
          const at::Tensor res = (update - exp_avg).pow(2) + o.eps2();
          st.exp_avg_res_row().mul_(beta3).add_(res.mean(-1), 1.0 - beta3);
          st.exp_avg_res_col().mul_(beta3).add_(res.mean(-2), 1.0 - beta3);
          update = approx_rsqrt(st.exp_avg_res_row(), st.exp_avg_res_col()).mul_(exp_avg);
        } else {
          update = exp_avg.clone();
        }
        at::Tensor p32 = stepped_copy(p);
        if (o.weight_decay() != 0) p32.add_(p32, -o.weight_decay() * o.lr());
        update.mul_(o.lr());
        p32.add_(update.neg());
        if (!p32.is_same(p)) p.copy_(p32);
      }
    }
    return loss;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<FactoredParamState, CameOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<FactoredParamState, CameOptions>(archive, *this);
  }
};

}  // namespace difftrain::train
