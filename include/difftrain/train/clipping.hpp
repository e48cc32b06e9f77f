#pragma once
// Gradient clipping policies, applied to unscaled gradients before the optimizer step:
//   NoClipping; ClipByNorm (total norm over every parameter, torch's clip_grad_norm_ as Python runs
//   it: one multi-tensor norm and one multi-tensor scale per device and dtype);
//   ClipByValue (clamp each element); ScheduledClip (the web UI's hypernetwork training: a limit
//   from a step string such as "0.1:200, 1.0", by norm or by value).
// A policy: `name`, `Options`, constructor from Options, and
// `double apply(const std::vector<at::Tensor>& params, std::int64_t step)` returning the total
// gradient norm before clipping (NaN when the policy does not compute it). Under sharded training
// (each rank holds only its own parameters' gradients) the trainer calls
// `apply(params, step, across)` instead, so that a norm is the norm over every rank's part.

#include <ATen/ATen.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/concepts.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/schedule/step_string.hpp"
#include "difftrain/train/gradient_groups.hpp"

namespace difftrain::train {

/// How a value computed from this rank's gradients becomes the value over every rank's: `sum` and
/// `max` combine a small CPU tensor in place. Empty (the default): the gradients are all here.
struct AcrossRanks {
  std::function<void(at::Tensor&)> sum, max;
  [[nodiscard]] bool active() const { return static_cast<bool>(sum); }
};

/// torch.nn.utils.clip_grad_norm_ as Python runs it on CPU and CUDA tensors (foreach=None): the
/// norm of each gradient by one _foreach_norm per (device, dtype), their norm as the total, and
/// every gradient times min(1, max_norm / (total + 1e-6)) by one _foreach_mul_ per kind — not
/// LibTorch's clip_grad_norm_, which launches a norm and a multiply per tensor. Returns the total
/// norm before clipping (0 when no parameter has a gradient). With `across` active, `params` are
/// this rank's share and the norm is the one over every rank's gradients (every rank calls it).
inline double clip_grad_norm_multi_tensor(const std::vector<at::Tensor>& params, double max_norm,
                                          double norm_type = 2.0, const AcrossRanks& across = {}) {
  const auto groups = gradients_by_kind(params, "clip_grad_norm");
  if (groups.empty() && !across.active()) return 0.0;
  std::vector<at::Tensor> norms;
  for (const auto& g : groups) {
    std::vector<at::Tensor> n = at::_foreach_norm(g, norm_type);
    norms.insert(norms.end(), n.begin(), n.end());
  }
  const c10::Device first = norms.empty() ? c10::Device(c10::kCPU) : norms.front().device();
  for (auto& n : norms)
    if (n.device() != first) n = n.to(first);
  at::Tensor total = norms.empty() ? at::zeros({}, at::kDouble)
                                   : at::linalg_vector_norm(at::stack(norms), norm_type);
  if (across.active()) {
    // The norm of every rank's norms: the max for the infinity norm, the sum for the 0-"norm"
    // (a count), else (sum of |n|^p)^(1/p).
    if (std::isinf(norm_type) && norm_type < 0)
      throw ConfigError("-inf is not a norm over ranks' shares (a minimum of maxima)",
                        "clip_grad_norm: norm_type");
    const bool inf = std::isinf(norm_type);
    const bool count = norm_type == 0.0;
    at::Tensor part =
        (inf || count ? total : total.pow(norm_type)).to(at::kCPU, at::kDouble).reshape({1});
    (inf ? across.max : across.sum)(part);
    total = (inf || count ? part : part.pow(1.0 / norm_type))
                .reshape({})
                .to(first, total.scalar_type());
    if (groups.empty()) return total.item<double>();
  }
  // Python's `max_norm / (total + 1e-6)` is Tensor.__rtruediv__: a reciprocal times max_norm.
  const at::Tensor coef = at::clamp_max((total + 1e-6).reciprocal() * max_norm, 1.0);
  for (const auto& g : groups) at::_foreach_mul_(g, coef.to(g.front().device()));
  return total.item<double>();
}

struct NoClipping {
  static constexpr std::string_view name = "none";
  struct Options {};
  NoClipping() = default;
  explicit NoClipping(const Options& /*unused*/) {}
  double apply(const std::vector<at::Tensor>& /*params*/, std::int64_t /*step*/,
               const AcrossRanks& /*across*/ = {}) {
    return std::numeric_limits<double>::quiet_NaN();
  }
};

struct ClipByNorm {
  static constexpr std::string_view name = "norm";
  struct Options {
    double max_norm = 1.0;
    double norm_type = 2.0;
  };
  ClipByNorm() : ClipByNorm(Options()) {}
  explicit ClipByNorm(const Options& o) : o_(o) {
    if (!(o.max_norm > 0)) throw ConfigError("max_norm must be > 0", "ClipByNorm");
  }
  double apply(const std::vector<at::Tensor>& params, std::int64_t /*step*/,
               const AcrossRanks& across = {}) {
    return clip_grad_norm_multi_tensor(params, o_.max_norm, o_.norm_type, across);
  }

 private:
  Options o_;
};

struct ClipByValue {
  static constexpr std::string_view name = "value";
  struct Options {
    double clip_value = 1.0;
  };
  ClipByValue() : ClipByValue(Options()) {}
  explicit ClipByValue(const Options& o) : o_(o) {
    if (!(o.clip_value > 0)) throw ConfigError("clip_value must be > 0", "ClipByValue");
  }
  // Element by element: each rank clamps its own share, nothing to combine.
  double apply(const std::vector<at::Tensor>& params, std::int64_t /*step*/,
               const AcrossRanks& /*across*/ = {}) {
    torch::nn::utils::clip_grad_value_(params, o_.clip_value);
    return std::numeric_limits<double>::quiet_NaN();
  }

 private:
  Options o_;
};

struct ScheduledClip {
  static constexpr std::string_view name = "scheduled";
  enum class Mode { norm, value };
  struct Options {
    Mode mode = Mode::norm;
    std::string limits = "1.0";  // step string: "0.1:200, 1.0" is 0.1 until step 200, then 1.0
    std::int64_t max_steps = std::numeric_limits<std::int64_t>::max();
    std::int64_t start_step = 0;         ///< a resumed run's first step (earlier entries drop)
    std::int64_t consults_per_step = 1;  ///< micro-batches per step (the web UI consults each)
  };
  ScheduledClip() : ScheduledClip(Options()) {}
  explicit ScheduledClip(const Options& o)
      : o_(o),
        limits_(schedule::StepString::Options{o.limits, o.max_steps, o.start_step,
                                              o.consults_per_step}) {}
  double apply(const std::vector<at::Tensor>& params, std::int64_t step,
               const AcrossRanks& across = {}) {
    const double limit = limits_.value_at(step);
    if (o_.mode == Mode::norm) return clip_grad_norm_multi_tensor(params, limit, 2.0, across);
    torch::nn::utils::clip_grad_value_(params, limit);
    return std::numeric_limits<double>::quiet_NaN();
  }
  [[nodiscard]] double limit_at(std::int64_t step) const { return limits_.value_at(step); }

 private:
  Options o_;
  schedule::StepString limits_;
};

template <class C>
concept ClippingPolicy = NamedPolicy<C> && HasOptions<C> &&
    std::constructible_from<C, const typename C::Options&> &&
    requires(C& c, const std::vector<at::Tensor>& p) {
  { c.apply(p, std::int64_t{0}) } -> std::convertible_to<double>;
};

/// A clipping policy that can clip gradients spread over ranks (sharded training).
template <class C>
concept ShardedClipping = requires(C& c, const std::vector<at::Tensor>& p, const AcrossRanks& a) {
  { c.apply(p, std::int64_t{0}, a) } -> std::convertible_to<double>;
};

}  // namespace difftrain::train
