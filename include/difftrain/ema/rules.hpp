#pragma once
// EMA decay rules, with the counters and formulas of the references:
//   Constant      a fixed decay from the first update
//   WarmupDecay   diffusers' EMAModel (decay, min_decay, update_after_step, inv_gamma/power
//   warm-up,
//                 else (1 + t) / (10 + t)); its state keys are EMAModel.state_dict()'s
//   LitEma        latent diffusion / CogVideoX: min(decay, (1 + n) / (10 + n)) with num_updates
//   EmaPytorch    lucidrains' ema-pytorch EMA (beta, update_after_step, update_every, inv_gamma,
//                 power, min_value); its decay is computed in float32, as there
//   Karras        EDM2's power-function EMA: β = (1 − 1/t)^(1+γ), γ from sigma_rel

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "difftrain/core/error.hpp"
#include "difftrain/ema/concepts.hpp"

namespace difftrain::ema {

namespace detail {

inline void require(bool ok, std::string_view rule, std::string_view option,
                    const std::string& why) {
  if (!ok)
    throw ConfigError(why, "ema rule '" + std::string(rule) + "' option " + std::string(option));
}

/// Reads `key` from a saved state, checking its type and (optionally) its range.
template <class T>
T read(const nlohmann::json& s, std::string_view rule, const char* key) {
  const std::string where = "ema rule '" + std::string(rule) + "' state key '" + key + "'";
  if (!s.contains(key)) throw FormatError("is missing", where);
  const auto& v = s.at(key);
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) throw FormatError("must be a bool, got " + v.dump(), where);
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) throw FormatError("must be an integer, got " + v.dump(), where);
  } else {
    if (!v.is_number()) throw FormatError("must be a number, got " + v.dump(), where);
    if (!std::isfinite(v.get<double>())) throw FormatError("must be finite", where);
  }
  return v.get<T>();
}

inline void check_unit(double v, std::string_view rule, const char* key) {
  if (v < 0.0 || v > 1.0)
    throw FormatError("must be between 0 and 1, got " + std::to_string(v),
                      "ema rule '" + std::string(rule) + "' state key '" + key + "'");
}

inline void check_name(const nlohmann::json& s, std::string_view rule) {
  if (s.contains("rule") && s.at("rule") != rule)
    throw FormatError("was saved by rule " + s.at("rule").dump(),
                      "ema rule '" + std::string(rule) + "' state");
}

}  // namespace detail

struct Constant {
  static constexpr std::string_view name = "constant";
  /// The keys of state() that count updates; the others are options.
  static constexpr std::array<std::string_view, 1> counters{"num_updates"};
  struct Options {
    double decay = 0.9999;
  };
  explicit Constant(const Options& o) : o_(o) {
    detail::require(o.decay >= 0 && o.decay <= 1, name, "decay", "must be in [0, 1]");
  }
  Action next() {
    ++updates_;
    return {Action::Kind::average, o_.decay};
  }
  [[nodiscard]] nlohmann::json state() const {
    return {{"rule", name}, {"decay", o_.decay}, {"num_updates", updates_}};
  }
  void load_state(const nlohmann::json& s) {
    detail::check_name(s, name);
    const auto decay = detail::read<double>(s, name, "decay");
    detail::check_unit(decay, name, "decay");
    const auto updates = detail::read<std::int64_t>(s, name, "num_updates");
    o_.decay = decay;
    updates_ = updates;
  }

 private:
  Options o_;
  std::int64_t updates_ = 0;
};

/// diffusers' EMAModel.
struct WarmupDecay {
  static constexpr std::string_view name = "warmup_decay";
  /// The keys of state() that count updates; the others are options.
  static constexpr std::array<std::string_view, 1> counters{"optimization_step"};
  struct Options {
    double decay = 0.9999;
    double min_decay = 0.0;
    std::int64_t update_after_step = 0;
    bool use_ema_warmup = false;
    double inv_gamma = 1.0;
    double power = 2.0 / 3.0;
  };
  explicit WarmupDecay(const Options& o) : o_(o) { validate(o_); }

  /// EMAModel.get_decay(optimization_step).
  [[nodiscard]] double decay_at(std::int64_t optimization_step) const {
    const std::int64_t step =
        std::max<std::int64_t>(0, optimization_step - o_.update_after_step - 1);
    if (step <= 0) return 0.0;
    const auto s = static_cast<double>(step);
    double value =
        o_.use_ema_warmup ? 1 - std::pow(1 + s / o_.inv_gamma, -o_.power) : (1 + s) / (10 + s);
    value = std::min(value, o_.decay);
    value = std::max(value, o_.min_decay);
    return value;
  }
  Action next() {
    ++optimization_step_;
    cur_decay_ = decay_at(optimization_step_);
    return {Action::Kind::average, cur_decay_};
  }
  [[nodiscard]] std::int64_t optimization_step() const noexcept { return optimization_step_; }
  [[nodiscard]] double cur_decay_value() const noexcept { return cur_decay_; }

  [[nodiscard]] nlohmann::json state() const {
    return {{"rule", name},
            {"decay", o_.decay},
            {"min_decay", o_.min_decay},
            {"optimization_step", optimization_step_},
            {"update_after_step", o_.update_after_step},
            {"use_ema_warmup", o_.use_ema_warmup},
            {"inv_gamma", o_.inv_gamma},
            {"power", o_.power}};
  }
  /// As EMAModel.load_state_dict: keys that are absent keep their value; present ones are checked
  /// for type and range before anything changes.
  void load_state(const nlohmann::json& s) {
    detail::check_name(s, name);
    Options o = o_;
    std::int64_t step = optimization_step_;
    if (s.contains("decay")) o.decay = detail::read<double>(s, name, "decay");
    if (s.contains("min_decay")) o.min_decay = detail::read<double>(s, name, "min_decay");
    if (s.contains("optimization_step"))
      step = detail::read<std::int64_t>(s, name, "optimization_step");
    if (s.contains("update_after_step"))
      o.update_after_step = detail::read<std::int64_t>(s, name, "update_after_step");
    if (s.contains("use_ema_warmup"))
      o.use_ema_warmup = detail::read<bool>(s, name, "use_ema_warmup");
    if (s.contains("inv_gamma")) o.inv_gamma = detail::read<double>(s, name, "inv_gamma");
    if (s.contains("power")) o.power = detail::read<double>(s, name, "power");
    detail::check_unit(o.decay, name, "decay");
    detail::check_unit(o.min_decay, name, "min_decay");
    if (step < 0)
      throw FormatError("must be >= 0", "ema rule 'warmup_decay' state key 'optimization_step'");
    try {
      validate(o);
    } catch (const ConfigError& e) {
      throw FormatError(e.message(), "ema rule 'warmup_decay' state");
    }
    o_ = o;
    optimization_step_ = step;
  }

 private:
  static void validate(const Options& o) {
    detail::require(o.decay >= 0 && o.decay <= 1, name, "decay", "must be in [0, 1]");
    detail::require(o.min_decay >= 0 && o.min_decay <= o.decay, name, "min_decay",
                    "must be in [0, decay]");
    detail::require(o.update_after_step >= 0, name, "update_after_step", "must be >= 0");
    detail::require(o.inv_gamma > 0, name, "inv_gamma", "must be > 0");
    detail::require(o.power > 0, name, "power", "must be > 0");
  }
  Options o_;
  std::int64_t optimization_step_ = 0;
  double cur_decay_ = 0.0;
};

/// LitEma (latent diffusion, CogVideoX).
struct LitEma {
  static constexpr std::string_view name = "lit_ema";
  /// The keys of state() that count updates; the others are options.
  static constexpr std::array<std::string_view, 1> counters{"num_updates"};
  struct Options {
    double decay = 0.9999;
    bool use_num_updates = true;
  };
  explicit LitEma(const Options& o) : o_(o) {
    detail::require(o.decay >= 0 && o.decay <= 1, name, "decay", "Decay must be between 0 and 1");
  }
  /// The reference keeps decay and num_updates in float32 / int32 buffers, so its decay is a
  /// float32 value; so is this one.
  Action next() {
    float decay = static_cast<float>(o_.decay);
    if (num_updates_ >= 0) {
      ++num_updates_;
      const auto n = static_cast<float>(num_updates_);
      decay = std::min(decay, (1 + n) / (10 + n));
    }
    return {Action::Kind::average, static_cast<double>(decay)};
  }
  [[nodiscard]] nlohmann::json state() const {
    return {{"rule", name}, {"decay", o_.decay}, {"num_updates", num_updates_}};
  }
  void load_state(const nlohmann::json& s) {
    detail::check_name(s, name);
    const auto decay = detail::read<double>(s, name, "decay");
    detail::check_unit(decay, name, "decay");
    const auto n = detail::read<std::int64_t>(s, name, "num_updates");
    o_.decay = decay;
    num_updates_ = n;
  }

 private:
  Options o_;
  std::int64_t num_updates_ = o_.use_num_updates ? 0 : -1;  // -1: the reference's "not counting"
};

/// ema-pytorch's EMA: the first update copies, updates happen every `update_every` calls, and up
/// to `update_after_step` they copy instead of averaging.
struct EmaPytorch {
  static constexpr std::string_view name = "ema_pytorch";
  /// The keys of state() that count updates; the others are options.
  static constexpr std::array<std::string_view, 2> counters{"step", "initted"};
  struct Options {
    double beta = 0.9999;
    std::int64_t update_after_step = 100;
    std::int64_t update_every = 10;
    double inv_gamma = 1.0;
    double power = 2.0 / 3.0;
    double min_value = 0.0;
    /// Every this many calls (0: never) pull the model toward its EMA, keeping this share of the
    /// model's own weights (continual learning, arXiv 2406.02596).
    std::int64_t update_model_with_ema_every = 0;
    double update_model_with_ema_beta = 0.0;
  };
  explicit EmaPytorch(const Options& o) : o_(o) {
    detail::require(o.beta >= 0 && o.beta <= 1, name, "beta", "must be in [0, 1]");
    detail::require(o.update_every > 0, name, "update_every", "must be > 0");
    detail::require(o.update_after_step >= 0, name, "update_after_step", "must be >= 0");
    detail::require(o.inv_gamma > 0, name, "inv_gamma", "must be > 0");
    detail::require(o.update_model_with_ema_every >= 0, name, "update_model_with_ema_every",
                    "must be >= 0 (0: never)");
    detail::require(o.update_model_with_ema_beta >= 0 && o.update_model_with_ema_beta <= 1, name,
                    "update_model_with_ema_beta", "must be in [0, 1]");
  }
  /// get_current_decay() at the current step. ema-pytorch evaluates it on a one-element float32
  /// tensor; torch raises a float32 tensor to a Python-float power with a double exponent, so the
  /// power is taken in double and rounded to float32.
  [[nodiscard]] double current_decay() const {
    const float epoch = std::max(0.0F, static_cast<float>(step_ - o_.update_after_step - 1));
    if (epoch <= 0) return 0.;
    const float base = 1.0F + epoch / static_cast<float>(o_.inv_gamma);
    const float value = 1.0F - static_cast<float>(std::pow(static_cast<double>(base), -o_.power));
    return static_cast<double>(
        std::clamp(value, static_cast<float>(o_.min_value), static_cast<float>(o_.beta)));
  }
  Action next() {
    const std::int64_t step = step_++;
    if (!initted_) {
      initted_ = true;
      return {Action::Kind::copy, 0.0};
    }
    const bool should_update = step % o_.update_every == 0;
    if (should_update && step <= o_.update_after_step) return {Action::Kind::copy, 0.0};
    Action action;
    if (should_update && o_.beta != 1.0) action = {Action::Kind::average, current_decay()};
    // A frozen EMA (β = 1) moves nothing, the model included, unless the pull is a plain copy.
    if (o_.update_model_with_ema_every > 0 && step % o_.update_model_with_ema_every == 0 &&
        (o_.beta != 1.0 || o_.update_model_with_ema_beta == 0.0)) {
      action.update_model = true;
      action.model_decay = o_.update_model_with_ema_beta;
    }
    return action;
  }
  [[nodiscard]] nlohmann::json state() const {
    return {{"rule", name}, {"step", step_}, {"initted", initted_}, {"beta", o_.beta}};
  }
  void load_state(const nlohmann::json& s) {
    detail::check_name(s, name);
    const auto step = detail::read<std::int64_t>(s, name, "step");
    const auto initted = detail::read<bool>(s, name, "initted");
    const auto beta = detail::read<double>(s, name, "beta");
    detail::check_unit(beta, name, "beta");
    if (step < 0) throw FormatError("must be >= 0", "ema rule 'ema_pytorch' state key 'step'");
    step_ = step;
    initted_ = initted;
    o_.beta = beta;
  }

 private:
  Options o_;
  std::int64_t step_ = 0;
  bool initted_ = false;
};

/// EDM2's γ for a relative standard deviation σ_rel: the largest real root of
/// γ³ + 7γ² + (16 − σ⁻²)γ + (12 − σ⁻²) = 0 (what ema-pytorch finds with np.roots).
inline double sigma_rel_to_gamma(double sigma_rel) {
  if (!(sigma_rel > 0) || !std::isfinite(sigma_rel))
    throw ConfigError("must be a positive finite number, got " + std::to_string(sigma_rel),
                      "ema sigma_rel");
  const double t = 1.0 / (sigma_rel * sigma_rel);
  const auto f = [t](double g) { return ((g + 7) * g + (16 - t)) * g + (12 - t); };
  const auto df = [t](double g) { return (3 * g + 14) * g + (16 - t); };
  // The polynomial is (γ+2)²(γ+3) − t(γ+1); above its largest root it is positive and convex, so
  // Newton from an upper bound converges monotonically to that root.
  double g = std::max(1.0, std::sqrt(t) + 8.0);
  while (f(g) < 0) g *= 2;
  for (int i = 0; i < 200; ++i) {
    const double next = g - f(g) / df(g);
    if (!(next < g)) break;
    g = next;
  }
  return g;
}

/// EDM2's power-function EMA (ema-pytorch's KarrasEMA): the first update copies, then
/// β = (1 − 1/(t+1))^(1+γ) with t the number of calls so far, every `update_every` calls.
struct Karras {
  static constexpr std::string_view name = "karras";
  /// The keys of state() that count updates; the others are options (gamma as derived from
  /// sigma_rel when that is set).
  static constexpr std::array<std::string_view, 2> counters{"step", "initted"};
  struct Options {
    double gamma = 6.94;  ///< set this or sigma_rel
    double sigma_rel = 0.0;
    std::int64_t update_every = 100;
    bool frozen = false;
  };
  explicit Karras(const Options& o)
      : o_(o), gamma_(o.sigma_rel > 0 ? sigma_rel_to_gamma(o.sigma_rel) : o.gamma) {
    detail::require(gamma_ > 0, name, "gamma", "must be > 0");
    detail::require(o.update_every > 0, name, "update_every", "must be > 0");
  }
  [[nodiscard]] double gamma() const noexcept { return gamma_; }
  [[nodiscard]] std::int64_t step() const noexcept { return step_; }
  [[nodiscard]] double beta() const {
    return std::pow(1. - 1. / (static_cast<double>(step_) + 1.), 1. + gamma_);
  }
  Action next() {
    const std::int64_t step = step_++;
    if (step % o_.update_every != 0) return {};
    const bool first = !initted_;
    initted_ = true;
    if (o_.frozen) return {first ? Action::Kind::copy : Action::Kind::skip, 0.0};
    return {Action::Kind::average, beta(), first};
  }
  [[nodiscard]] nlohmann::json state() const {
    return {{"rule", name}, {"step", step_}, {"initted", initted_}, {"gamma", gamma_}};
  }
  void load_state(const nlohmann::json& s) {
    detail::check_name(s, name);
    const auto step = detail::read<std::int64_t>(s, name, "step");
    const auto initted = detail::read<bool>(s, name, "initted");
    const auto gamma = detail::read<double>(s, name, "gamma");
    if (step < 0) throw FormatError("must be >= 0", "ema rule 'karras' state key 'step'");
    if (gamma <= 0) throw FormatError("must be > 0", "ema rule 'karras' state key 'gamma'");
    step_ = step;
    initted_ = initted;
    gamma_ = gamma;
  }

 private:
  Options o_;
  double gamma_;
  std::int64_t step_ = 0;
  bool initted_ = false;
};

}  // namespace difftrain::ema
