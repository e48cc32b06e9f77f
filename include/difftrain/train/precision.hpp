#pragma once
// Precision policies: Fp32 (nothing), AutocastBf16, AutocastFp16 (with a gradient scaler). LibTorch
// has autocast but no GradScaler; `GradScaler` here follows torch.amp.GradScaler: the loss is
// multiplied by `scale`; before clipping, gradients are unscaled and checked for inf/NaN in one
// fused call (`_amp_foreach_non_finite_check_and_unscale_`); the optimizer step is skipped when any
// was found; `_amp_update_scale_` then halves the scale on overflow or doubles it after
// `growth_interval` clean steps. Defaults are torch's: 65536, 2.0, 0.5, 2000.
// With an optimizer that divides by the scale itself (the fused Adam/AdamW, `ScaledStepOptimizer`)
// and no unscale_ before step(), the gradients are only checked (read, not rewritten) and the
// scale goes to the kernel, as torch's GradScaler does with optimizers that take `grad_scale`
// (when asked: `HandScale`).

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/cpu/Utils.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/concepts.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/train/gradient_groups.hpp"
#include "difftrain/train/scaled_step.hpp"

namespace difftrain::train {

/// Turns autocast on for one device type and dtype while alive, and restores what was there.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, at::ScalarType dtype)
      : device_(device),
        was_enabled_(at::autocast::is_autocast_enabled(device)),
        was_dtype_(at::autocast::get_autocast_dtype(device)) {
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::set_autocast_dtype(device_, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_, was_enabled_);
    at::autocast::set_autocast_dtype(device_, was_dtype_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool was_enabled_;
  at::ScalarType was_dtype_;
};

/// When GradScaler hands its scale to an optimizer that takes it (ScaledStepOptimizer) rather
/// than unscaling the gradients first. The unscale pass and the plain fused step are the faster
/// pair on the CPU and on the GPU (bench_train's fp16_step_scale_handed_vs_unscaled: handing is
/// 1.7-2.4x slower on the CPU, 1.18-2.29x on an H200, where torch's check-and-unscale is one
/// multi-tensor kernel), so by default nothing is handed; `on_cuda` hands CUDA gradients, as
/// torch does for its fused optimizers.
enum class HandScale { on_cuda, always, never };

class GradScaler {
 public:
  struct Options {
    double init_scale = 65536.0;
    double growth_factor = 2.0;
    double backoff_factor = 0.5;
    std::int64_t growth_interval = 2000;
    bool enabled = true;
    HandScale hand_scale = HandScale::never;
  };

  GradScaler() : GradScaler(Options()) {}
  explicit GradScaler(const Options& o) : o_(o) {
    if (o.init_scale <= 0 || o.growth_factor <= 1.0 || o.backoff_factor <= 0 ||
        o.backoff_factor >= 1.0 || o.growth_interval <= 0)
      throw ConfigError(
          "needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
          "growth_interval > 0",
          "GradScaler");
  }

  [[nodiscard]] bool enabled() const { return o_.enabled; }

  /// loss * scale (the scale lives on the loss's device).
  at::Tensor scale(const at::Tensor& loss) {
    if (!o_.enabled) return loss;
    lazy_init(loss.device());
    return loss * scale_.to(loss.scalar_type());
  }

  /// Divides every gradient of `optimizer` by the scale and records whether any is inf/NaN.
  /// Call before clipping; step() calls it if it was not called.
  void unscale_(torch::optim::Optimizer& optimizer) {
    if (!o_.enabled || stage_ != Stage::ready) return;
    if (!scale_.defined()) throw ConfigError("unscale_ before any scaled loss", "GradScaler");
    const at::Tensor inv = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
    found_inf_ = at::zeros({1}, scale_.options());
    for (auto& grads : grads_by_kind(optimizer)) {
      at::Tensor found = at::zeros({1}, grads.front().options().dtype(at::kFloat));
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv.to(grads.front().device()));
      found_inf_ += found.to(found_inf_.device());
    }
    combine_found_inf();
    stage_ = Stage::unscaled;
  }

  /// Under sharded training each rank checks only its own gradients: `sum` adds the overflow
  /// flags of every rank (a CPU tensor, in place), so that every rank skips the same steps.
  void set_found_inf_across(std::function<void(at::Tensor&)> sum) {
    found_inf_across_ = std::move(sum);
  }

  /// Steps the optimizer unless a gradient was inf/NaN. Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer) {
    left_in_grads_.reset();
    if (!o_.enabled) {
      optimizer.step();
      return true;
    }
    const bool hand = o_.hand_scale == HandScale::always ||
                      (o_.hand_scale == HandScale::on_cuda && scale_.defined() && scale_.is_cuda());
    auto* scaled =
        stage_ == Stage::ready && hand ? dynamic_cast<ScaledStepOptimizer*>(&optimizer) : nullptr;
    if (scaled != nullptr) {
      check_(optimizer);
    } else {
      unscale_(optimizer);
    }
    const bool skip = found_inf_.item<float>() != 0.0f;
    if (!skip) {
      if (scaled != nullptr) {
        scaled->step_scaled(scale_);
      } else {
        optimizer.step();
      }
    }
    // The fused kernel writes the unscaled gradients back as it steps; a skipped step leaves
    // them scaled (update() may change scale_, so the one they carry is kept).
    if (scaled != nullptr && skip) left_in_grads_ = scale_.clone();
    return !skip;
  }

  /// The scale the gradients still carry after step(), for whoever reads them after the step:
  /// set when the scale was to go to the optimizer's kernel and an inf/NaN skipped the step, so
  /// nothing unscaled them; empty when they hold their true values.
  [[nodiscard]] const std::optional<at::Tensor>& scale_left_in_grads() const {
    return left_in_grads_;
  }

  /// Adjusts the scale after step(): backoff on overflow, growth after growth_interval clean steps.
  void update() {
    if (!o_.enabled) return;
    if (stage_ == Stage::ready) throw ConfigError("update() without step()", "GradScaler");
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf_.to(scale_.device()),
                           o_.growth_factor, o_.backoff_factor, o_.growth_interval);
    stage_ = Stage::ready;
  }

  [[nodiscard]] double current_scale() const {
    return scale_.defined() ? scale_.item<double>() : o_.init_scale;
  }

  /// torch.amp.GradScaler's state_dict keys.
  [[nodiscard]] nlohmann::json state() const {
    return {
        {"scale", current_scale()},
        {"growth_factor", o_.growth_factor},
        {"backoff_factor", o_.backoff_factor},
        {"growth_interval", o_.growth_interval},
        {"_growth_tracker", growth_tracker_.defined() ? growth_tracker_.item<std::int64_t>() : 0}};
  }
  void load_state(const nlohmann::json& s) {
    try {
      const double scale = s.at("scale").get<double>();
      const std::int64_t tracker = s.at("_growth_tracker").get<std::int64_t>();
      if (!(scale > 0) || tracker < 0)
        throw FormatError("has a non-positive scale", "GradScaler state");
      o_.growth_factor = s.at("growth_factor").get<double>();
      o_.backoff_factor = s.at("backoff_factor").get<double>();
      o_.growth_interval = s.at("growth_interval").get<std::int64_t>();
      const c10::Device d = scale_.defined() ? scale_.device() : c10::Device(c10::kCPU);
      scale_ = at::full({1}, scale, at::TensorOptions().dtype(at::kFloat).device(d));
      growth_tracker_ = at::full({1}, tracker, at::TensorOptions().dtype(at::kInt).device(d));
    } catch (const nlohmann::json::exception& e) {
      throw FormatError(e.what(), "GradScaler state");
    }
  }

 private:
  // ready: nothing done since the last update(); unscaled: gradients divided in place; checked:
  // gradients read for inf/NaN only, the scale goes to the optimizer.
  enum class Stage { ready, unscaled, checked };

  /// The gradients of `optimizer` by device and dtype (the fused kernels take one kind at a time).
  static std::vector<std::vector<at::Tensor>> grads_by_kind(torch::optim::Optimizer& optimizer) {
    std::vector<at::Tensor> params;
    for (auto& g : optimizer.param_groups())
      params.insert(params.end(), g.params().begin(), g.params().end());
    return gradients_by_kind(params, "GradScaler");
  }

  /// Records whether any gradient is inf/NaN without writing them: the largest magnitude of each
  /// (one multi-tensor reduction per kind) is finite exactly when every element is.
  void check_(torch::optim::Optimizer& optimizer) {
    if (!scale_.defined()) throw ConfigError("step() before any scaled loss", "GradScaler");
    found_inf_ = at::zeros({1}, scale_.options());
    for (auto& grads : grads_by_kind(optimizer)) {
      const at::Tensor largest =
          at::stack(at::_foreach_norm(grads, std::numeric_limits<double>::infinity()));
      found_inf_ += at::logical_not(at::isfinite(largest).all()).to(found_inf_.options());
    }
    combine_found_inf();
    stage_ = Stage::checked;
  }

  void combine_found_inf() {
    if (!found_inf_across_) return;
    at::Tensor flag = found_inf_.to(at::kCPU, at::kDouble);
    found_inf_across_(flag);
    found_inf_ = flag.to(found_inf_.options());
  }

  void lazy_init(c10::Device d) {
    if (!scale_.defined()) {
      scale_ = at::full({1}, o_.init_scale, at::TensorOptions().dtype(at::kFloat).device(d));
      growth_tracker_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(d));
    } else if (scale_.device() != d) {
      scale_ = scale_.to(d);
      growth_tracker_ = growth_tracker_.to(d);
    }
  }

  Options o_;
  at::Tensor scale_, growth_tracker_, found_inf_;
  Stage stage_ = Stage::ready;
  std::optional<at::Tensor> left_in_grads_;
  std::function<void(at::Tensor&)> found_inf_across_;
};

/// Full precision: no autocast, no scaling.
struct Fp32 {
  static constexpr std::string_view name = "fp32";
  static constexpr bool autocast = false;
  static constexpr bool scaled = false;
  static constexpr at::ScalarType dtype = at::kFloat;
};
/// Autocast to bfloat16; its range needs no loss scaling.
struct AutocastBf16 {
  static constexpr std::string_view name = "bf16";
  static constexpr bool autocast = true;
  static constexpr bool scaled = false;
  static constexpr at::ScalarType dtype = at::kBFloat16;
};
/// Autocast to float16 with the gradient scaler.
struct AutocastFp16 {
  static constexpr std::string_view name = "fp16";
  static constexpr bool autocast = true;
  static constexpr bool scaled = true;
  static constexpr at::ScalarType dtype = at::kHalf;
};

/// Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16): there bf16 autocast
/// speeds convolutions and matrix products up; elsewhere the bf16 kernels emulate it and run
/// slower than float32. For choosing a precision at run time, e.g. a program's "auto".
inline bool cpu_has_native_bf16() {
  const auto caps = at::cpu::get_cpu_capabilities();
  auto has = [&](const char* key) {
    const auto it = caps.find(key);
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  };
  return has("avx512_bf16") || has("amx_bf16");
}

/// A precision fixed at compile time (Fp32, AutocastBf16, AutocastFp16).
template <class P>
concept StaticPrecision = NamedPolicy<P> && requires {
  { P::autocast } -> std::convertible_to<bool>;
  { P::scaled } -> std::convertible_to<bool>;
  { P::dtype } -> std::convertible_to<at::ScalarType>;
};

/// Config::Precision = PrecisionByName: the precision chosen at run time, as diffusers' scripts
/// take `--mixed_precision no|fp16|bf16` ("fp32" is "no"). The trainer reads the choice from
/// Options::precision; the numbers are those of the static policy of that name.
struct PrecisionByName {
  static constexpr std::string_view name = "by_name";
  struct Options {
    std::string mixed_precision = "no";  ///< no (fp32), bf16, fp16
  };
  explicit PrecisionByName(const Options& o) {
    if (o.mixed_precision == "no" || o.mixed_precision == "fp32") {
      set<Fp32>();
    } else if (o.mixed_precision == "bf16") {
      set<AutocastBf16>();
    } else if (o.mixed_precision == "fp16") {
      set<AutocastFp16>();
    } else {
      throw ConfigError("\"" + o.mixed_precision + "\" is not a precision (no, fp32, bf16, fp16)",
                        "mixed_precision");
    }
  }
  bool autocast = false;
  bool scaled = false;
  at::ScalarType dtype = at::kFloat;
  std::string_view chosen = Fp32::name;  ///< the static policy's name

 private:
  template <class P>
  void set() {
    autocast = P::autocast;
    scaled = P::scaled;
    dtype = P::dtype;
    chosen = P::name;
  }
};

/// A precision chosen at run time from its Options.
template <class P>
concept RuntimePrecision = NamedPolicy<P> && HasOptions<P> &&
    std::constructible_from<P, const typename P::Options&> && requires(const P& p) {
  { p.autocast } -> std::convertible_to<bool>;
  { p.scaled } -> std::convertible_to<bool>;
  { p.dtype } -> std::convertible_to<at::ScalarType>;
  { p.chosen } -> std::convertible_to<std::string_view>;
};

template <class P>
concept PrecisionPolicy = StaticPrecision<P> || RuntimePrecision<P>;

namespace precision_detail {
struct NoOptions {};
template <class P>
struct OptionsOf {
  using type = NoOptions;
};
template <RuntimePrecision P>
struct OptionsOf<P> {
  using type = typename P::Options;
};
}  // namespace precision_detail

/// What a precision policy decided, read the same way for both kinds.
struct PrecisionChoice {
  bool autocast = false;
  bool scaled = false;
  at::ScalarType dtype = at::kFloat;
  std::string_view name = Fp32::name;

  template <StaticPrecision P>
  static PrecisionChoice of(const precision_detail::NoOptions& /*unused*/) {
    return {P::autocast, P::scaled, P::dtype, P::name};
  }
  template <RuntimePrecision P>
  static PrecisionChoice of(const typename P::Options& o) {
    const P p(o);
    return {p.autocast, p.scaled, p.dtype, p.chosen};
  }
};

/// diffusers' cast_training_params: trainable parameters (those that require grad) to `dtype`,
/// usually float32 so a half-precision model trains adapters in full precision.
inline void cast_training_params(torch::nn::Module& module, at::ScalarType dtype = at::kFloat) {
  at::NoGradGuard no_grad;
  for (auto& p : module.parameters())
    if (p.requires_grad()) p.set_data(p.data().to(dtype));
}

}  // namespace difftrain::train
