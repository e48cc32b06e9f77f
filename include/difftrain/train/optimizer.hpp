#pragma once
// Optimizer policies over LibTorch's optimizers, with parameter groups:
//   * groups by name pattern (CogVideoX's `get_param_groups`: each pattern is matched at the
//     start of the parameter name, as Python's re.match; the first matching group wins), each with
//     its own LR and weight decay;
//   * weight decay off for biases, norms and embeddings (DALLE2's grouping puts every tensor with
//     fewer than 2 dimensions in a no-decay group; names matching `no_decay_pattern` join it).
// A policy: `name`, `Options` (lr, weight_decay, ...) and
// `static std::unique_ptr<torch::optim::Optimizer> make(std::vector<OptimizerParamGroup>, const
// Options&)`.

#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/concepts.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/train/adafactor.hpp"
#include "difftrain/train/adamw_8bit.hpp"
#include "difftrain/train/came.hpp"
#include "difftrain/train/foreach_optimizers.hpp"
#include "difftrain/train/fused_adam.hpp"
#include "difftrain/train/lion.hpp"
#include "difftrain/train/prodigy.hpp"
#include "difftrain/train/schedule_free.hpp"

namespace difftrain::train {

/// How Adam and AdamW run their step; the same state and checkpoints either way.
///   fused          torch's fused kernel (torch.optim.AdamW(fused=True)), one launch per group
///   foreach        torch's multi-tensor kernels (foreach=True), a dozen stages per group
///   per_parameter  LibTorch's torch::optim::AdamW (Python's default for-loop implementation)
enum class AdamKernel { fused, foreach, per_parameter };
/// How SGD runs its step; the same numbers, state and checkpoints every way.
///   automatic      multi-tensor for CUDA parameters, per-parameter for CPU ones: torch's own
///                  default, and the faster on each (on the CPU each stage of the multi-tensor
///                  step streams every tensor through memory; the per-parameter loop finishes one
///                  tensor while it is in cache)
///   foreach        torch's multi-tensor kernels (SGD(foreach=True))
///   per_parameter  LibTorch's torch::optim::SGD
enum class SgdKernel { automatic, foreach, per_parameter };

/// Parameters whose names start with a match of `pattern` form a group with their own settings.
struct ParamGroupRule {
  std::string pattern;
  std::optional<double> lr;
  std::optional<double> weight_decay;
};

struct GroupingOptions {
  std::vector<ParamGroupRule> rules;
  /// Put 1-D tensors (biases, norm scales) and names matching no_decay_pattern in a group without
  /// weight decay.
  bool decay_groups = true;
  std::string no_decay_pattern = "(^|.*\\.)(bias|[^.]*norm[^.]*|[^.]*embed[^.]*)(\\.|$)";
};

/// One group of parameters before it becomes an optimizer's group.
struct ParamGroup {
  std::string label;  // "default", "default/no_decay", "rule 0", ...
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::optional<double> lr;
  std::optional<double> weight_decay;
};

namespace optimizer_detail {
// Torch's own checks on an optimizer setting (it throws c10::Error with a stack trace, or accepts
// a NaN), as a ConfigError naming the option: finite, at least `lo`, and below `below`, when given.
inline void check_setting(double value, const std::string& option,
                          std::optional<double> lo = std::nullopt,
                          std::optional<double> below = std::nullopt) {
  if (std::isfinite(value) && (!lo || value >= *lo) && (!below || value < *below)) return;
  auto text = [](double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  };
  std::string want = "must be a finite number";
  if (lo) want += " >= " + text(*lo);
  if (below) want += std::string(lo ? " and" : "") + " < " + text(*below);
  throw ConfigError(want + ", got " + text(value), option);
}
}  // namespace optimizer_detail

/// The groups for the trainable parameters of `module`; frozen parameters are left out, and a rule
/// that matches nothing is a ConfigError (a typo in a pattern would otherwise train the wrong set),
/// as is a rule's negative or non-finite lr or weight decay.
inline std::vector<ParamGroup> make_param_groups(const torch::nn::Module& module,
                                                 const GroupingOptions& o) {
  std::vector<std::regex> rules;
  for (std::size_t i = 0; i < o.rules.size(); ++i) {
    const std::string where =
        "parameter group rule " + std::to_string(i) + " ('" + o.rules[i].pattern + "')";
    if (o.rules[i].lr) optimizer_detail::check_setting(*o.rules[i].lr, where + " lr", 0.0);
    if (o.rules[i].weight_decay)
      optimizer_detail::check_setting(*o.rules[i].weight_decay, where + " weight_decay", 0.0);
  }
  for (const auto& r : o.rules) {
    try {
      rules.emplace_back(r.pattern);
    } catch (const std::regex_error& e) {
      throw ConfigError("pattern '" + r.pattern + "' is not a valid regex: " + e.what(),
                        "parameter groups");
    }
  }
  const std::regex no_decay(o.no_decay_pattern);
  // For each rule (and the default): the decay group and the no-decay group.
  std::vector<ParamGroup> decay(rules.size() + 1), plain(rules.size() + 1);
  for (std::size_t i = 0; i <= rules.size(); ++i) {
    const std::string base = i < rules.size() ? "rule " + std::to_string(i) : "default";
    decay[i].label = base;
    plain[i].label = base + "/no_decay";
    if (i < rules.size()) {
      decay[i].lr = plain[i].lr = o.rules[i].lr;
      decay[i].weight_decay = o.rules[i].weight_decay;
    }
    plain[i].weight_decay = 0.0;
  }
  std::vector<bool> used(rules.size(), false);
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad()) continue;
    std::size_t g = rules.size();
    for (std::size_t i = 0; i < rules.size(); ++i)
      if (std::regex_search(item.key(), rules[i], std::regex_constants::match_continuous)) {
        g = i;
        used[i] = true;
        break;
      }
    const bool skip_decay =
        o.decay_groups && (p.dim() < 2 || std::regex_match(item.key(), no_decay));
    ParamGroup& target = skip_decay ? plain[g] : decay[g];
    target.names.push_back(item.key());
    target.params.push_back(p);
  }
  for (std::size_t i = 0; i < rules.size(); ++i)
    if (!used[i])
      throw ConfigError("pattern '" + o.rules[i].pattern + "' matches no trainable parameter",
                        "parameter groups");
  std::vector<ParamGroup> out;
  for (std::size_t i = 0; i <= rules.size(); ++i) {
    if (!decay[i].params.empty()) out.push_back(std::move(decay[i]));
    if (!plain[i].params.empty()) out.push_back(std::move(plain[i]));
  }
  if (out.empty()) throw ConfigError("the model has no trainable parameters", "parameter groups");
  return out;
}

namespace optimizer_detail {
// What torch.optim.Adam and AdamW accept: lr, eps and weight decay >= 0, betas in [0, 1).
template <class O>
void check_adam(const O& o, const std::string& where) {
  check_setting(o.lr, where + ": lr", 0.0);
  check_setting(o.beta1, where + ": beta1", 0.0, 1.0);
  check_setting(o.beta2, where + ": beta2", 0.0, 1.0);
  check_setting(o.eps, where + ": eps", 0.0);
  check_setting(o.weight_decay, where + ": weight_decay", 0.0);
}

template <class TorchOptions>
std::vector<torch::optim::OptimizerParamGroup> torch_groups(const std::vector<ParamGroup>& groups,
                                                            const TorchOptions& defaults) {
  std::vector<torch::optim::OptimizerParamGroup> out;
  for (const ParamGroup& g : groups) {
    auto o = std::make_unique<TorchOptions>(defaults);
    if (g.lr) o->lr(*g.lr);
    if (g.weight_decay) o->weight_decay(*g.weight_decay);
    out.emplace_back(g.params, std::move(o));
  }
  return out;
}
}  // namespace optimizer_detail

struct AdamW {
  static constexpr std::string_view name = "adamw";
  struct Options {
    double lr = 1e-4;
    double beta1 = 0.9, beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 1e-2;
    bool amsgrad = false;
    AdamKernel kernel = AdamKernel::fused;
  };
  static std::unique_ptr<torch::optim::Optimizer> make(const std::vector<ParamGroup>& groups,
                                                       const Options& o) {
    optimizer_detail::check_adam(o, "AdamW options");
    torch::optim::AdamWOptions d(o.lr);
    d.betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay).amsgrad(o.amsgrad);
    auto g = optimizer_detail::torch_groups(groups, d);
    switch (o.kernel) {
      case AdamKernel::fused:
        return std::make_unique<FusedAdamWOptimizer>(std::move(g), d);
      case AdamKernel::foreach:
        return std::make_unique<ForeachAdamWOptimizer>(std::move(g), d);
      case AdamKernel::per_parameter:
        break;
    }
    return std::make_unique<torch::optim::AdamW>(std::move(g), d);
  }
};

struct Adam {
  static constexpr std::string_view name = "adam";
  struct Options {
    double lr = 1e-4;
    double beta1 = 0.9, beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.0;  // L2 added to the gradient, as torch.optim.Adam
    bool amsgrad = false;
    AdamKernel kernel = AdamKernel::fused;
  };
  static std::unique_ptr<torch::optim::Optimizer> make(const std::vector<ParamGroup>& groups,
                                                       const Options& o) {
    optimizer_detail::check_adam(o, "Adam options");
    torch::optim::AdamOptions d(o.lr);
    d.betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay).amsgrad(o.amsgrad);
    auto g = optimizer_detail::torch_groups(groups, d);
    switch (o.kernel) {
      case AdamKernel::fused:
        return std::make_unique<FusedAdamOptimizer>(std::move(g), d);
      case AdamKernel::foreach:
        return std::make_unique<ForeachAdamOptimizer>(std::move(g), d);
      case AdamKernel::per_parameter:
        break;
    }
    return std::make_unique<torch::optim::Adam>(std::move(g), d);
  }
};

struct SGD {
  static constexpr std::string_view name = "sgd";
  struct Options {
    double lr = 1e-2;
    double momentum = 0.0;
    double dampening = 0.0;
    double weight_decay = 0.0;
    bool nesterov = false;
    SgdKernel kernel = SgdKernel::automatic;
  };
  static std::unique_ptr<torch::optim::Optimizer> make(const std::vector<ParamGroup>& groups,
                                                       const Options& o) {
    using optimizer_detail::check_setting;
    check_setting(o.lr, "SGD options: lr", 0.0);
    check_setting(o.momentum, "SGD options: momentum", 0.0);
    check_setting(o.dampening, "SGD options: dampening");
    check_setting(o.weight_decay, "SGD options: weight_decay", 0.0);
    if (o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0))
      throw ConfigError("needs momentum > 0 and dampening = 0 (as torch.optim.SGD)",
                        "SGD options: nesterov");
    torch::optim::SGDOptions d(o.lr);
    d.momentum(o.momentum).dampening(o.dampening).weight_decay(o.weight_decay).nesterov(o.nesterov);
    auto g = optimizer_detail::torch_groups(groups, d);
    if (o.kernel != SgdKernel::per_parameter)
      return std::make_unique<ForeachSGDOptimizer>(
          std::move(g), d,
          /*cpu_per_parameter=*/o.kernel == SgdKernel::automatic);
    return std::make_unique<torch::optim::SGD>(std::move(g), d);
  }
};

/// Lion as lion-pytorch steps it (train/lion.hpp): one moment per parameter, sign updates, so a
/// learning rate 3-10x smaller than AdamW's and a weight decay as much larger.
struct Lion {
  static constexpr std::string_view name = "lion";
  struct Options {
    double lr = 1e-4;
    double beta1 = 0.9, beta2 = 0.99;
    double weight_decay = 0.0;
    bool decoupled_weight_decay = false;  // lion-pytorch's: wd divided by the initial lr
  };
  static std::unique_ptr<torch::optim::Optimizer> make(const std::vector<ParamGroup>& groups,
                                                       const Options& o) {
    using optimizer_detail::check_setting;
    if (!(o.lr > 0)) throw ConfigError("must be > 0 (as lion-pytorch asserts)", "Lion options: lr");
    check_setting(o.lr, "Lion options: lr", 0.0);
    check_setting(o.beta1, "Lion options: beta1", 0.0);
    check_setting(o.beta2, "Lion options: beta2", 0.0);
    if (o.beta1 > 1 || o.beta2 > 1) throw ConfigError("must lie in [0, 1]", "Lion options: betas");
    check_setting(o.weight_decay, "Lion options: weight_decay", 0.0);
    LionOptions d(o.lr);
    d.betas({o.beta1, o.beta2}).weight_decay(o.weight_decay);
    return std::make_unique<LionOptimizer>(optimizer_detail::torch_groups(groups, d), d,
                                           o.decoupled_weight_decay);
  }
};

/// Prodigy as prodigyopt steps it (train/prodigy.hpp): Adam with its learning rate estimated
/// (lr is a multiplier, 1 as the LoRA trainers set it, with a constant schedule).
struct Prodigy {
  static constexpr std::string_view name = "prodigy";
  struct Options {
    double lr = 1.0;
    double beta1 = 0.9, beta2 = 0.999;
    std::optional<double> beta3;  // none: √β₂
    double eps = 1e-8;
    double weight_decay = 0.0;
    bool decouple = true;
    bool use_bias_correction = false;
    bool safeguard_warmup = false;
    double d0 = 1e-6, d_coef = 1.0;
    double growth_rate = std::numeric_limits<double>::infinity();
    std::int64_t slice_p = 1;
  };
  static std::unique_ptr<torch::optim::Optimizer> make(const std::vector<ParamGroup>& groups,
                                                       const Options& o) {
    using optimizer_detail::check_setting;
    // prodigyopt's own checks, named.
    if (!(o.lr > 0)) throw ConfigError("must be > 0", "Prodigy options: lr");
    if (!(o.d0 > 0)) throw ConfigError("must be > 0", "Prodigy options: d0");
    if (!(o.eps > 0)) throw ConfigError("must be > 0", "Prodigy options: eps");
    check_setting(o.beta1, "Prodigy options: beta1", 0.0, 1.0);
    check_setting(o.beta2, "Prodigy options: beta2", 0.0, 1.0);
    if (o.beta3) check_setting(*o.beta3, "Prodigy options: beta3", 0.0, 1.0);
    check_setting(o.weight_decay, "Prodigy options: weight_decay", 0.0);
    check_setting(o.d_coef, "Prodigy options: d_coef", 0.0);
    if (!(o.growth_rate >= 1)) throw ConfigError("must be >= 1", "Prodigy options: growth_rate");
    if (o.slice_p < 1) throw ConfigError("must be >= 1", "Prodigy options: slice_p");
    ProdigyOptions d(o.lr);
    d.betas({o.beta1, o.beta2})
        .beta3(o.beta3.value_or(-1.0))
        .eps(o.eps)
        .weight_decay(o.weight_decay)
        .decouple(o.decouple)
        .use_bias_correction(o.use_bias_correction)
        .safeguard_warmup(o.safeguard_warmup)
        .d0(o.d0)
        .d_coef(o.d_coef)
        .growth_rate(o.growth_rate)
        .slice_p(o.slice_p)
        .d(o.d0)
        .d_max(o.d0);
    return std::make_unique<ProdigyOptimizer>(optimizer_detail::torch_groups(groups, d), d);
  }
};

/// Adafactor as transformers steps it (train/adafactor.hpp): a factored second moment (n + m
/// values for an n×m matrix), by default its own relative step size scaled by RMS(p).
struct Adafactor {
  static constexpr std::string_view name = "adafactor";
  struct Options {
    double lr = 1e-3;  // used only without relative_step
    double eps1 = 1e-30, eps2 = 1e-3;
    double clip_threshold = 1.0;
    double decay_rate = -0.8;
    std::optional<double> beta1 = std::nullopt;  // none: no first moment
    double weight_decay = 0.0;
    bool scale_parameter = true;
    bool relative_step = true;
    bool warmup_init = false;
  };
  static std::unique_ptr<torch::optim::Optimizer> make(const std::vector<ParamGroup>& groups,
                                                       const Options& o) {
    using optimizer_detail::check_setting;
    check_setting(o.lr, "Adafactor options: lr", 0.0);
    check_setting(o.eps1, "Adafactor options: eps1", 0.0);
    check_setting(o.eps2, "Adafactor options: eps2", 0.0);
    if (!(o.clip_threshold > 0))
      throw ConfigError("must be > 0", "Adafactor options: clip_threshold");
    if (!(o.decay_rate < 0))
      throw ConfigError("must be < 0 (β₂ₜ = 1 − t^decay_rate)", "Adafactor options: decay_rate");
    if (o.beta1) check_setting(*o.beta1, "Adafactor options: beta1", 0.0, 1.0);
    check_setting(o.weight_decay, "Adafactor options: weight_decay", 0.0);
    if (o.warmup_init && !o.relative_step)  // transformers' own check
      throw ConfigError("warmup_init needs relative_step", "Adafactor options: warmup_init");
    AdafactorOptions d(o.lr);
    d.eps1(o.eps1)
        .eps2(o.eps2)
        .clip_threshold(o.clip_threshold)
        .decay_rate(o.decay_rate)
        .beta1(o.beta1.value_or(-1.0))
        .weight_decay(o.weight_decay)
        .scale_parameter(o.scale_parameter)
        .relative_step(o.relative_step)
        .warmup_init(o.warmup_init);
    return std::make_unique<AdafactorOptimizer>(optimizer_detail::torch_groups(groups, d), d);
  }
};

/// CAME as came-pytorch steps it (train/came.hpp): Adafactor's factored moments with a
/// confidence-weighted first moment.
struct CAME {
  static constexpr std::string_view name = "came";
  struct Options {
    double lr = 2e-4;
    double eps1 = 1e-30, eps2 = 1e-16;
    double clip_threshold = 1.0;
    double beta1 = 0.9, beta2 = 0.999, beta3 = 0.9999;
    double weight_decay = 0.0;
  };
  static std::unique_ptr<torch::optim::Optimizer> make(const std::vector<ParamGroup>& groups,
                                                       const Options& o) {
    using optimizer_detail::check_setting;
    if (!(o.lr > 0)) throw ConfigError("must be > 0 (as came-pytorch asserts)", "CAME options: lr");
    check_setting(o.lr, "CAME options: lr", 0.0);
    for (const auto& [value, label] :
         {std::pair{o.beta1, "beta1"}, std::pair{o.beta2, "beta2"}, std::pair{o.beta3, "beta3"}})
      if (!(value >= 0 && value <= 1))
        throw ConfigError("must lie in [0, 1]", std::string("CAME options: ") + label);
    check_setting(o.eps1, "CAME options: eps1", 0.0);
    check_setting(o.eps2, "CAME options: eps2", 0.0);
    if (!(o.clip_threshold > 0)) throw ConfigError("must be > 0", "CAME options: clip_threshold");
    check_setting(o.weight_decay, "CAME options: weight_decay", 0.0);
    CameOptions d(o.lr);
    d.eps1(o.eps1)
        .eps2(o.eps2)
        .clip_threshold(o.clip_threshold)
        .betas({o.beta1, o.beta2, o.beta3})
        .weight_decay(o.weight_decay);
    return std::make_unique<CameOptimizer>(optimizer_detail::torch_groups(groups, d), d);
  }
};

/// 8-bit AdamW as bitsandbytes keeps it (train/adamw_8bit.hpp): moments of tensors of at least
/// min_8bit_size values in one byte each, block-wise scaled; a quarter of AdamW's state.
struct AdamW8bit {
  static constexpr std::string_view name = "adamw8bit";
  struct Options {
    double lr = 1e-3;
    double beta1 = 0.9, beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 1e-2;
    std::int64_t min_8bit_size = 4096;
  };
  static std::unique_ptr<torch::optim::Optimizer> make(const std::vector<ParamGroup>& groups,
                                                       const Options& o) {
    optimizer_detail::check_adam(o, "AdamW8bit options");
    if (o.min_8bit_size < 0) throw ConfigError("must be >= 0", "AdamW8bit options: min_8bit_size");
    AdamW8bitOptions d(o.lr);
    d.betas({o.beta1, o.beta2})
        .eps(o.eps)
        .weight_decay(o.weight_decay)
        .min_8bit_size(o.min_8bit_size);
    return std::make_unique<AdamW8bitOptimizer>(optimizer_detail::torch_groups(groups, d), d);
  }
};

/// Schedule-free AdamW as schedulefree steps it (train/schedule_free.hpp): no schedule needed;
/// evaluate and save under `EvaluationWeights`.
struct AdamWScheduleFree {
  static constexpr std::string_view name = "adamw_schedulefree";
  struct Options {
    double lr = 2.5e-3;
    double beta1 = 0.9, beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.0;
    std::int64_t warmup_steps = 0;
    double r = 0.0;
    double weight_lr_power = 2.0;
  };
  static std::unique_ptr<torch::optim::Optimizer> make(const std::vector<ParamGroup>& groups,
                                                       const Options& o) {
    using optimizer_detail::check_setting;
    optimizer_detail::check_adam(o, "AdamWScheduleFree options");
    if (!(o.beta1 > 0))  // eval's lerp divides by β₁
      throw ConfigError("must be > 0 (the evaluation weights divide by it)",
                        "AdamWScheduleFree options: beta1");
    if (o.warmup_steps < 0)
      throw ConfigError("must be >= 0", "AdamWScheduleFree options: warmup_steps");
    check_setting(o.r, "AdamWScheduleFree options: r", 0.0);
    check_setting(o.weight_lr_power, "AdamWScheduleFree options: weight_lr_power", 0.0);
    ScheduleFreeAdamWOptions d(o.lr);
    d.betas({o.beta1, o.beta2})
        .eps(o.eps)
        .weight_decay(o.weight_decay)
        .warmup_steps(o.warmup_steps)
        .r(o.r)
        .weight_lr_power(o.weight_lr_power);
    return std::make_unique<ScheduleFreeAdamWOptimizer>(optimizer_detail::torch_groups(groups, d),
                                                        d);
  }
};

template <class O>
concept OptimizerPolicy = NamedPolicy<O> && HasOptions<O> &&
    requires(const std::vector<ParamGroup>& g, const typename O::Options& o) {
  { O::make(g, o) } -> std::same_as<std::unique_ptr<torch::optim::Optimizer>>;
};

}  // namespace difftrain::train
