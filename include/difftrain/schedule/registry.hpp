#pragma once
// Schedules by name, and diffusers' `get_scheduler(name, ...)` with its argument rules.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "difftrain/core/registry.hpp"
#include "difftrain/schedule/bind.hpp"
#include "difftrain/schedule/cogvideox.hpp"
#include "difftrain/schedule/diffusers.hpp"
#include "difftrain/schedule/step_string.hpp"
#include "difftrain/schedule/timm.hpp"
#include "difftrain/schedule/torch_schedulers.hpp"
#include "difftrain/schedule/warmup.hpp"

namespace difftrain::schedule {

using Schedules =
    type_list<Constant, ConstantWithWarmup, Linear, Cosine, CosineWithRestarts, Polynomial,
              PiecewiseConstant, CosineAnnealing, CosineAnnealingWarmRestarts, PolynomialDecay,
              ConstantFactor, LinearFactor, Exponential, Step, MultiStep, OneCycle, timm::Cosine,
              timm::Tanh, timm::Poly, timm::Step, timm::MultiStep, timm::WarmupStableDecay,
              WarmupCosine, WarmupCosineCycles, WarmupLinearCycles, StepString>;
inline constexpr Registry<Schedules> schedules{"lr schedule"};

using Warmups = type_list<LinearWarmup, ExponentialWarmup, UntunedLinearWarmup,
                          UntunedExponentialWarmup, RAdamWarmup>;
inline constexpr Registry<Warmups> warmups{"warm-up"};

/// The arguments of diffusers' `get_scheduler`.
struct SchedulerArgs {
  std::optional<std::string> step_rules = std::nullopt;
  std::optional<std::int64_t> num_warmup_steps = std::nullopt;
  std::optional<std::int64_t> num_training_steps = std::nullopt;
  std::int64_t num_cycles = 1;
  double power = 1.0;
  /// polynomial's lr_end (diffusers' default 1e-7).
  double lr_end = 1e-7;
  /// polynomial's reference LR: diffusers divides by the optimizer's *default* LR for every group.
  /// Unset, each group's own base LR is used (the same for one group); the overload of
  /// get_scheduler that takes the optimizer sets it from the optimizer's defaults, as diffusers.
  std::optional<double> lr_init = std::nullopt;
};

/// diffusers' `get_scheduler`: one of its seven names, with the arguments each needs (a missing
/// one is a ConfigError naming it, as diffusers raises ValueError).
inline AnySchedule get_scheduler(std::string_view name, const SchedulerArgs& a = {}) {
  using diffusers_names = type_list<Linear, Cosine, CosineWithRestarts, Polynomial, Constant,
                                    ConstantWithWarmup, PiecewiseConstant>;
  constexpr Registry<diffusers_names> names{"diffusers scheduler"};
  if (!names.contains(name)) throw names.unknown(name, "get_scheduler name");
  const auto need = [&](const std::optional<std::int64_t>& v, std::string_view arg) {
    if (!v)
      throw ConfigError(
          std::string(name) + " requires `" + std::string(arg) + "`, please provide that argument.",
          "get_scheduler " + std::string(arg));
    return *v;
  };
  if (name == "constant") return AnySchedule(Constant{});
  if (name == "piecewise_constant")
    return AnySchedule(PiecewiseConstant({.step_rules = a.step_rules.value_or("1")}));
  const std::int64_t warmup = need(a.num_warmup_steps, "num_warmup_steps");
  if (name == "constant_with_warmup")
    return AnySchedule(ConstantWithWarmup({.num_warmup_steps = warmup}));
  const std::int64_t training = need(a.num_training_steps, "num_training_steps");
  if (name == "cosine_with_restarts")
    return AnySchedule(CosineWithRestarts(
        {.num_warmup_steps = warmup, .num_training_steps = training, .num_cycles = a.num_cycles}));
  if (name == "polynomial")
    return AnySchedule(Polynomial({.num_warmup_steps = warmup,
                                   .num_training_steps = training,
                                   .lr_end = a.lr_end,
                                   .power = a.power,
                                   .lr_init = a.lr_init.value_or(0.0)}));
  if (name == "cosine")
    return AnySchedule(Cosine({.num_warmup_steps = warmup, .num_training_steps = training}));
  return AnySchedule(Linear({.num_warmup_steps = warmup, .num_training_steps = training}));
}

/// diffusers' `get_scheduler(name, optimizer, ...)`: as above, with the optimizer's default LR as
/// polynomial's reference (unless `a.lr_init` is set), so several groups get diffusers' numbers.
inline AnySchedule get_scheduler(std::string_view name, const torch::optim::Optimizer& optimizer,
                                 SchedulerArgs a = {}) {
  if (!a.lr_init) a.lr_init = optimizer.defaults().get_lr();
  return get_scheduler(name, a);
}

}  // namespace difftrain::schedule
