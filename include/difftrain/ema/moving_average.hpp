#pragma once
// Ema<Rule, Engine>: shadow copies of a model's weights, kept by parameter *name*.
//
// Which tensors: every floating-point parameter; trainable ones are averaged and the others are
// copied (diffusers' rule; `frozen = Frozen::average` averages them too, as ema-pytorch does).
// Buffers are left alone by default; `buffers = Buffers::average` averages floating-point buffers
// as ema-pytorch does, `Buffers::copy` copies them. Names can be excluded
// (`ignore_names`, `ignore_prefixes`) or copied instead of averaged (`copy_names`).
//
//   ema::Ema<ema::WarmupDecay, ema::MultiTensor> ema(model, {.decay = 0.9999, .use_ema_warmup =
//   true});
//   ... optimizer.step(); ema.update(); ...
//   { auto scope = ema.scope(); sample(model); }   // EMA weights inside, training weights after

#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/ema/concepts.hpp"
#include "difftrain/ema/engines.hpp"
#include "difftrain/ema/rules.hpp"
#include "difftrain/io/torch_pickle.hpp"

namespace difftrain::ema {

/// What to do with a model's buffers (running statistics and the like).
enum class Buffers { ignore, copy, average };

/// What to do with parameters that do not require gradients: diffusers copies them, ema-pytorch
/// averages every floating-point parameter alike.
enum class Frozen { copy, average };

/// Which of the model's tensors the EMA tracks, and how.
struct Tracking {
  Buffers buffers = Buffers::ignore;
  Frozen frozen = Frozen::copy;
  std::set<std::string> ignore_names = {};
  std::vector<std::string> ignore_prefixes = {};
  std::set<std::string> copy_names = {};  ///< tracked, but copied rather than averaged
};

template <class Rule, class Engine = PerTensor>
class Ema;

/// Swaps the EMA weights into the model for its lifetime and puts the training weights back when it
/// ends, also when an exception unwinds through it.
template <class E>
class EmaScope {
 public:
  explicit EmaScope(E& ema) : ema_(&ema) {
    ema_->store();
    ema_->copy_to();
  }
  EmaScope(const EmaScope&) = delete;
  EmaScope& operator=(const EmaScope&) = delete;
  EmaScope(EmaScope&& other) noexcept : ema_(std::exchange(other.ema_, nullptr)) {}
  EmaScope& operator=(EmaScope&&) = delete;
  ~EmaScope() {
    if (ema_ != nullptr) ema_->restore();
  }

 private:
  E* ema_;
};

template <class Rule, class Engine>
class Ema {
  static_assert(diagnose_decay_rule<Rule>());
  static_assert(diagnose_update_engine<Engine>());

 public:
  using rule_type = Rule;
  using engine_type = Engine;

  Ema(torch::nn::Module& model, const typename Rule::Options& rule = {},
      const typename Engine::Options& engine = {}, Tracking tracking = {})
      : model_(&model), rule_(rule), engine_(engine), tracking_(std::move(tracking)) {
    const at::NoGradGuard no_grad;
    for (const auto& item : model.named_parameters(/*recurse=*/true))
      track(item.key(), item.value(), false);
    if (tracking_.buffers != Buffers::ignore)
      for (const auto& item : model.named_buffers(/*recurse=*/true))
        track(item.key(), item.value(), true);
  }
  Ema(const Ema&) = delete;
  Ema& operator=(const Ema&) = delete;

  /// One EMA update; call it after each optimizer step.
  void update() {
    const Action action = rule_.next();
    if (action.kind == Action::Kind::skip) return;
    if (action.kind == Action::Kind::copy || action.copy_first) {
      engine_.copy(averaged_);
    }
    if (action.kind == Action::Kind::average) engine_.average(averaged_, 1.0 - action.decay);
    if (!copied_.empty()) engine_.copy(copied_);
  }

  /// Copies the EMA weights into the model (diffusers' copy_to).
  void copy_to() { copy_to(*model_); }
  void copy_to(torch::nn::Module& target) {
    engine_.synchronize();
    const at::NoGradGuard no_grad;
    const auto params = target.named_parameters(true);
    const auto buffers = target.named_buffers(true);
    for (const auto* list : {&averaged_, &copied_})
      for (const Pair& p : *list) {
        const at::Tensor* dst = params.find(p.name);
        if (dst == nullptr) dst = buffers.find(p.name);
        if (dst == nullptr)
          throw ConfigError("the target model has no tensor '" + p.name + "'", "Ema::copy_to");
        if (dst->sizes() != p.shadow.sizes())
          throw ShapeError("shadow has shape " + c10::str(p.shadow.sizes()) + ", the target " +
                               c10::str(dst->sizes()),
                           "Ema::copy_to tensor '" + p.name + "'");
        at::Tensor(*dst).copy_(p.shadow);
      }
  }

  /// Keeps a copy of the model's current weights for `restore()` (diffusers' store).
  void store() {
    const at::NoGradGuard no_grad;
    stored_.clear();
    for (const auto* list : {&averaged_, &copied_})
      for (const Pair& p : *list) stored_.emplace_back(p.name, p.param.detach().clone());
  }
  /// Puts back the weights `store()` kept; a restore without a store is a ConfigError.
  void restore() {
    if (stored_.empty() && !(averaged_.empty() && copied_.empty()))
      throw ConfigError("there are no store()d weights to restore()", "Ema::restore");
    const at::NoGradGuard no_grad;
    std::size_t i = 0;
    for (auto* list : {&averaged_, &copied_})
      for (Pair& p : *list) p.param.copy_(stored_[i++].second);
    stored_.clear();
  }

  /// EMA weights in the model for the scope's lifetime.
  [[nodiscard]] EmaScope<Ema> scope() { return EmaScope<Ema>(*this); }

  [[nodiscard]] Rule& rule() noexcept { return rule_; }
  [[nodiscard]] const Rule& rule() const noexcept { return rule_; }
  [[nodiscard]] Engine& engine() noexcept { return engine_; }

  /// The shadow of tensor `name` (waits for an update in flight).
  [[nodiscard]] const at::Tensor& shadow(const std::string& name) {
    engine_.synchronize();
    for (const auto* list : {&averaged_, &copied_})
      for (const Pair& p : *list)
        if (p.name == name) return p.shadow;
    throw ConfigError("the EMA tracks no tensor '" + name + "'", "Ema::shadow");
  }
  /// Every tracked name, averaged ones first, in model order.
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto* list : {&averaged_, &copied_})
      for (const Pair& p : *list) out.push_back(p.name);
    return out;
  }

  /// The rule's scalars (diffusers' keys for WarmupDecay) and the shadows by name.
  [[nodiscard]] std::pair<nlohmann::json, std::map<std::string, at::Tensor>> state() {
    engine_.synchronize();
    std::map<std::string, at::Tensor> shadows;
    for (const auto* list : {&averaged_, &copied_})
      for (const Pair& p : *list) shadows.emplace(p.name, p.shadow);
    return {rule_.state(), std::move(shadows)};
  }

  /// Restores a state: every tracked name must be present with its shape, and no other name; the
  /// rule's scalars are checked by the rule. Nothing changes unless all of it is valid.
  void load_state(const nlohmann::json& scalars, const std::map<std::string, at::Tensor>& shadows) {
    engine_.synchronize();
    for (const auto* list : {&averaged_, &copied_})
      for (const Pair& p : *list) {
        const auto it = shadows.find(p.name);
        if (it == shadows.end())
          throw FormatError("is missing", "ema state shadow '" + p.name + "'");
        if (it->second.sizes() != p.shadow.sizes())
          throw ShapeError("has shape " + c10::str(it->second.sizes()) + ", the model's is " +
                               c10::str(p.shadow.sizes()),
                           "ema state shadow '" + p.name + "'");
        if (!it->second.is_floating_point())
          throw FormatError("is not floating point", "ema state shadow '" + p.name + "'");
      }
    const std::vector<std::string> known = names();
    for (const auto& [name, tensor] : shadows)
      if (std::find(known.begin(), known.end(), name) == known.end())
        throw FormatError("is not a tensor this EMA tracks", "ema state shadow '" + name + "'");
    Rule rule = rule_;
    rule.load_state(scalars);
    const at::NoGradGuard no_grad;
    for (auto* list : {&averaged_, &copied_})
      for (Pair& p : *list) p.shadow.copy_(shadows.at(p.name));
    rule_ = std::move(rule);
  }

  /// Writes the state atomically to a file torch.load reads:
  /// {"format": "difftrain.ema", "version": 1, "state": {rule scalars}, "shadow_params": {name:
  /// tensor}}.
  void save(const std::filesystem::path& path) {
    auto [scalars, shadows] = state();
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("format", std::string(kFormat));
    d.insert("version", kVersion);
    d.insert("state", io::to_ivalue(scalars, "ema state"));
    d.insert("shadow_params", io::to_ivalue(shadows));
    io::save_pickle(path, c10::IValue(d));
  }
  /// Reads a file written by `save` (or by Python in the same layout); a malformed file, another
  /// format, a newer version or a state that does not fit this model is a typed error and leaves
  /// the EMA as it was.
  void load(const std::filesystem::path& path) {
    const std::string where = path.string();
    const c10::IValue v = io::load_pickle(path);
    if (!v.isGenericDict()) throw FormatError("is not a dict", where);
    const auto d = v.toGenericDict();
    const auto get = [&](const char* key) {
      const auto it = d.find(key);
      if (it == d.end()) throw FormatError(std::string("has no '") + key + "' entry", where);
      return it->value();
    };
    if (!get("format").isString() || get("format").toStringRef() != kFormat)
      throw FormatError("is not a difftrain EMA file", where);
    if (!get("version").isInt() || get("version").toInt() > kVersion)
      throw FormatError("has format version " + get("version").tagKind() +
                            " newer than this difftrain reads (" + std::to_string(kVersion) + ")",
                        where);
    load_state(io::to_json(get("state"), where + " state"),
               io::to_tensor_map(get("shadow_params"), where + " shadow_params"));
  }

  static constexpr std::string_view kFormat = "difftrain.ema";
  static constexpr std::int64_t kVersion = 1;

 private:
  void track(const std::string& name, const at::Tensor& t, bool is_buffer) {
    if (!t.defined() || !t.is_floating_point()) return;
    if (tracking_.ignore_names.contains(name)) return;
    for (const auto& prefix : tracking_.ignore_prefixes)
      if (name.starts_with(prefix)) return;
    Pair pair{name, t, engine_.make_shadow(t)};
    const bool average = is_buffer ? tracking_.buffers == Buffers::average
                                   : (t.requires_grad() || tracking_.frozen == Frozen::average) &&
                                         !tracking_.copy_names.contains(name);
    (average ? averaged_ : copied_).push_back(std::move(pair));
  }

  torch::nn::Module* model_;
  Rule rule_;
  Engine engine_;
  Tracking tracking_;
  std::vector<Pair> averaged_;
  std::vector<Pair> copied_;
  std::vector<std::pair<std::string, at::Tensor>> stored_;
};

}  // namespace difftrain::ema
