#pragma once
// Adafactor (Shazeer & Stern 2018), as transformers' `Adafactor` steps it (the class kohya's
// sd-scripts, OneTrainer and the T5 recipes name):
//   lr  = max(ε₂, RMS(p)) · ρ      (scale_parameter; else ρ), ρ = min(1e-2 or 1e-6·t, 1/√t)
//         under relative_step, else the group's learning rate
//   β₂ₜ = 1 − t^decay_rate
//   V   ← β₂ₜ·V + (1 − β₂ₜ)·(g² + ε₁), kept factored for tensors of 2+ dimensions: a row and a
//         column mean, V ≈ R·Cᵀ / mean(R) (the memory saving: n + m values for an n×m matrix)
//   u   = g / √V, then divided by max(1, RMS(u) / clip_threshold), times lr
//   m   ← β₁·m + (1 − β₁)·u  (only with β₁), p ← p − lr·wd·p − (m or u)
// The scalars keep transformers' types: lr is a 0-dimensional tensor when it comes from RMS(p)
// and a number otherwise, so the rounding matches step for step. Under relative_step the group's
// learning rate is not used (a schedule has nothing to set; transformers' AdafactorSchedule only
// reports the computed one).

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "difftrain/train/fused_adam.hpp"  // fused_detail::evaluate_closure

namespace difftrain::train {

struct AdafactorOptions : public torch::optim::OptimizerCloneableOptions<AdafactorOptions> {
  AdafactorOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT: implicit as LibTorch's options are
  TORCH_ARG(double, lr);
  TORCH_ARG(double, eps1) = 1e-30;  // transformers' eps[0]: added to g²
  TORCH_ARG(double, eps2) = 1e-3;   // eps[1]: the smallest parameter scale
  TORCH_ARG(double, clip_threshold) = 1.0;
  TORCH_ARG(double, decay_rate) = -0.8;
  TORCH_ARG(double, beta1) = -1.0;  // < 0: no first moment (transformers' beta1=None)
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, scale_parameter) = true;
  TORCH_ARG(bool, relative_step) = true;
  TORCH_ARG(bool, warmup_init) = false;

 public:  // (TORCH_ARG leaves its members private)
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps1);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps2);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, clip_threshold);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, decay_rate);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, beta1);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, scale_parameter);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, relative_step);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, warmup_init);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps1);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps2);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(clip_threshold);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decay_rate);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(beta1);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(scale_parameter);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(relative_step);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(warmup_init);
  }
  [[nodiscard]] double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

/// One parameter's Adafactor state; also CAME's, which adds the factored instability.
struct FactoredParamState : public torch::optim::OptimizerCloneableParamState<FactoredParamState> {
  TORCH_ARG(std::int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);         // undefined without a first moment
  TORCH_ARG(at::Tensor, exp_avg_sq_row);  // factored (2+ dimensions)
  TORCH_ARG(at::Tensor, exp_avg_sq_col);
  TORCH_ARG(at::Tensor, exp_avg_sq);       // 0 or 1 dimension
  TORCH_ARG(at::Tensor, exp_avg_res_row);  // CAME's instability, factored
  TORCH_ARG(at::Tensor, exp_avg_res_col);

 public:
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
    auto optional = [&](const char* key, auto set) {
      if (c10::IValue saved; archive.try_read(key, saved)) set(saved.toTensor());
    };
    optional("exp_avg", [&](const at::Tensor& t) { exp_avg(t); });
    optional("exp_avg_sq_row", [&](const at::Tensor& t) { exp_avg_sq_row(t); });
    optional("exp_avg_sq_col", [&](const at::Tensor& t) { exp_avg_sq_col(t); });
    optional("exp_avg_sq", [&](const at::Tensor& t) { exp_avg_sq(t); });
    optional("exp_avg_res_row", [&](const at::Tensor& t) { exp_avg_res_row(t); });
    optional("exp_avg_res_col", [&](const at::Tensor& t) { exp_avg_res_col(t); });
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
    auto optional = [&](const char* key, const at::Tensor& t) {
      if (t.defined()) archive.write(key, t);
    };
    optional("exp_avg", exp_avg());
    optional("exp_avg_sq_row", exp_avg_sq_row());
    optional("exp_avg_sq_col", exp_avg_sq_col());
    optional("exp_avg_sq", exp_avg_sq());
    optional("exp_avg_res_row", exp_avg_res_row());
    optional("exp_avg_res_col", exp_avg_res_col());
  }
  /// Bytes of state (for the sharded optimizers' memory figures).
  [[nodiscard]] std::int64_t nbytes() const {
    std::int64_t n = 0;
    for (const at::Tensor* t : {&exp_avg_, &exp_avg_sq_row_, &exp_avg_sq_col_, &exp_avg_sq_,
                                &exp_avg_res_row_, &exp_avg_res_col_})
      if (t->defined()) n += t->numel() * static_cast<std::int64_t>(t->element_size());
    return n;
  }
};

namespace factored_detail {
/// RMS as transformers computes it: ‖t‖₂ / numel^0.5 (Python's float power).
inline at::Tensor rms(const at::Tensor& t) {
  return t.norm(2) / std::pow(static_cast<double>(t.numel()), 0.5);
}
/// V ≈ (R / mean(R)) ⊗ C, returned as 1/√V: the factored second moment's reciprocal root.
inline at::Tensor approx_rsqrt(const at::Tensor& row, const at::Tensor& col) {
  const at::Tensor r = (row / row.mean(-1, /*keepdim=*/true)).rsqrt_().unsqueeze(-1);
  const at::Tensor c = col.unsqueeze(-2).rsqrt();
  return at::mul(r, c);
}
/// Zeros for a factored moment of `grad`: its shape without the last (row) or second-to-last
/// (column) dimension.
inline std::pair<at::Tensor, at::Tensor> factored_zeros(const at::Tensor& grad) {
  std::vector<std::int64_t> row(grad.sizes().begin(), grad.sizes().end() - 1);
  std::vector<std::int64_t> col(grad.sizes().begin(), grad.sizes().end() - 2);
  col.push_back(grad.size(-1));
  return {at::zeros(row, grad.options()), at::zeros(col, grad.options())};
}
/// The gradient in float32 (a half or bfloat16 one widened), as both packages step it.
inline at::Tensor float_grad(const at::Tensor& grad) {
  return grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16
             ? grad.to(at::kFloat)
             : grad;
}
/// A fresh state's second moment for `grad`: a row and a column for 2+ dimensions.
inline void init_second_moment(FactoredParamState& st, const at::Tensor& grad) {
  if (grad.dim() >= 2) {
    auto [row, col] = factored_zeros(grad);
    st.exp_avg_sq_row(row).exp_avg_sq_col(col);
  } else {
    st.exp_avg_sq(at::zeros_like(grad));
  }
}
/// Adafactor's and CAME's scaled gradient: V ← β·V + (1 − β)·(g² + ε₁) (factored for 2+
/// dimensions), u = g / √V, divided by max(1, RMS(u) / clip).
inline at::Tensor scaled_gradient(FactoredParamState& st, const at::Tensor& grad, double beta,
                                  double eps1, double clip) {
  at::Tensor update = grad.pow(2) + eps1;
  if (grad.dim() >= 2) {
    st.exp_avg_sq_row().mul_(beta).add_(update.mean(-1), 1.0 - beta);
    st.exp_avg_sq_col().mul_(beta).add_(update.mean(-2), 1.0 - beta);
    update = approx_rsqrt(st.exp_avg_sq_row(), st.exp_avg_sq_col());
    update.mul_(grad);
  } else {
    st.exp_avg_sq().mul_(beta).add_(update, 1.0 - beta);
    update = st.exp_avg_sq().rsqrt().mul_(grad);
  }
  return update.div_((rms(update) / clip).clamp_(1.0));
}
/// The parameter's values in float32 (a half or bfloat16 parameter is stepped in a copy).
inline at::Tensor stepped_copy(const at::Tensor& p) {
  return p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16 ? p.to(at::kFloat) : p;
}
}  // namespace factored_detail

class AdafactorOptimizer : public torch::optim::Optimizer {
 public:
  AdafactorOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                     const AdafactorOptions& defaults)
      : torch::optim::Optimizer(groups, std::make_unique<AdafactorOptions>(defaults)) {}

  at::Tensor step(LossClosure closure = nullptr) override {
    using namespace factored_detail;
    at::Tensor loss = fused_detail::evaluate_closure(closure);
    const at::NoGradGuard no_grad;
    for (auto& group : param_groups()) {
      const auto& o = static_cast<const AdafactorOptions&>(group.options());
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        const at::Tensor grad = float_grad(p.grad());
        auto& slot = state()[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto fresh = std::make_unique<FactoredParamState>();
          if (o.beta1() >= 0) fresh->exp_avg(at::zeros_like(grad));
          init_second_moment(*fresh, grad);
          slot = std::move(fresh);
        }
        auto& st = static_cast<FactoredParamState&>(*slot);
        at::Tensor p32 = stepped_copy(p);
        st.step(st.step() + 1);
        const auto t = static_cast<double>(st.step());
        // The learning rate: a number, or a 0-dimensional tensor when it is RMS(p)·ρ.
        double relative = o.lr();
        if (o.relative_step())
          relative = std::min(o.warmup_init() ? 1e-6 * t : 1e-2, 1.0 / std::sqrt(t));
        double lr_number = relative;
        at::Tensor lr_tensor;
        if (o.scale_parameter()) {
          const at::Tensor scale = rms(p32);
          if ((scale > o.eps2()).item<bool>())  // Python's max(eps2, RMS): eps2 on a tie
            lr_tensor = scale * relative;
          else
            lr_number = o.eps2() * relative;
        }
        const double beta2t = 1.0 - std::pow(t, o.decay_rate());
        at::Tensor update = scaled_gradient(st, grad, beta2t, o.eps1(), o.clip_threshold());
        if (lr_tensor.defined())
          update.mul_(lr_tensor);
        else
          update.mul_(lr_number);
        if (o.beta1() >= 0) {
          st.exp_avg().mul_(o.beta1()).add_(update, 1.0 - o.beta1());
          update = st.exp_avg();
        }
        if (o.weight_decay() != 0) {
          const double alpha = lr_tensor.defined() ? (lr_tensor * -o.weight_decay()).item<double>()
                                                   : -o.weight_decay() * lr_number;
          p32.add_(p32, alpha);
        }
        p32.add_(update.neg());
        if (!p32.is_same(p)) p.copy_(p32);
      }
    }
    return loss;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<FactoredParamState, AdafactorOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<FactoredParamState, AdafactorOptions>(archive, *this);
  }
};

}  // namespace difftrain::train
