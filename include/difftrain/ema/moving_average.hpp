#pragma once
// Ema<Rule, Engine>: shadow copies of a model's weights, kept by parameter *name*.
//
// Which tensors: every floating-point parameter; trainable ones are averaged and the others are
// copied (diffusers' rule; `frozen = Frozen::average` averages them too, as ema-pytorch does).
// Buffers are left alone by default; `buffers = Buffers::average` averages floating-point buffers
// as ema-pytorch does, `Buffers::copy` copies them. Names (parameters or buffers) can be copied
// instead of averaged (`copy_names`) or ignored (`ignore_names`, `ignore_prefixes`): by default an
// ignored name is not tracked at all; `ignored = IgnoredNames::copied_when_copying` keeps it in the
// EMA, copied whenever the rule copies (the first update, ema-pytorch's warm-up) and never
// averaged, as ema-pytorch does. `Tracking::ema_pytorch()` is ema-pytorch's whole rule set.
//
//   ema::Ema<ema::WarmupDecay, ema::MultiTensor> ema(model, {.decay = 0.9999, .use_ema_warmup =
//   true});
//   ... optimizer.step(); ema.update(); ...
//   { auto scope = ema.scope(); sample(model); }   // EMA weights inside, training weights after
//
// Under sharded training each rank keeps the shadows of the parameters it steps (a `Share`): the
// update needs no communication and the EMA's memory is divided by the number of ranks. Such an
// EMA refuses whatever needs the others' shadows (copy_to, scope, state, save); the trainer gathers
// them (Trainer::ema_weights, its checkpoints).

#include <torch/nn/module.h>

#include <algorithm>
#include <array>
#include <cmath>
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

/// What happens to ignored names: not tracked (diffusers has no such option; difftrain's default),
/// or kept in the EMA and copied only when the rule copies (ema-pytorch).
enum class IgnoredNames { untracked, copied_when_copying };

/// Which of the model's tensors the EMA tracks, and how.
struct Tracking {
  Buffers buffers = Buffers::ignore;
  Frozen frozen = Frozen::copy;
  std::set<std::string> ignore_names = {};
  std::vector<std::string> ignore_prefixes = {};
  std::set<std::string> copy_names = {};  ///< tracked, but copied rather than averaged
  IgnoredNames ignored = IgnoredNames::untracked;

  /// ema-pytorch's EMA: every floating-point parameter and buffer averaged, `copy_names`
  /// (its param_or_buffer_names_no_ema) copied, ignored names copied only when copying.
  static Tracking ema_pytorch(std::set<std::string> ignore_names = {},
                              std::vector<std::string> ignore_prefixes = {},
                              std::set<std::string> copy_names = {}) {
    return {.buffers = Buffers::average,
            .frozen = Frozen::average,
            .ignore_names = std::move(ignore_names),
            .ignore_prefixes = std::move(ignore_prefixes),
            .copy_names = std::move(copy_names),
            .ignored = IgnoredNames::copied_when_copying};
  }
};

/// A rank's share of the model under sharded training (the trainer makes it): the names in
/// `elsewhere` are other ranks' and not tracked here; a name in `sources` averages that tensor
/// (the rank's full-precision master copy, perhaps in host memory) instead of the model's.
struct Share {
  std::set<std::string> elsewhere = {};
  std::map<std::string, at::Tensor> sources = {};
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
      const typename Engine::Options& engine = {}, Tracking tracking = {}, Share share = {})
      : model_(&model),
        rule_(rule),
        engine_(engine),
        tracking_(std::move(tracking)),
        elsewhere_(std::move(share.elsewhere)) {
    const at::NoGradGuard no_grad;
    for (const auto& item : model.named_parameters(/*recurse=*/true)) {
      if (elsewhere_.contains(item.key())) continue;
      const auto source = share.sources.find(item.key());
      if (source != share.sources.end() && source->second.sizes() != item.value().sizes())
        throw ShapeError("has shape " + c10::str(source->second.sizes()) + ", the parameter " +
                             c10::str(item.value().sizes()),
                         "Ema share: source of '" + item.key() + "'");
      if (source != share.sources.end()) targets_.emplace(item.key(), item.value());
      track(item.key(), source != share.sources.end() ? source->second : item.value(), false,
            item.value().requires_grad());
    }
    for (const auto& [name, t] : share.sources)
      if (model.named_parameters(true).find(name) == nullptr)
        throw ConfigError("the model has no parameter '" + name + "'", "Ema share: sources");
    if (tracking_.buffers != Buffers::ignore)
      for (const auto& item : model.named_buffers(/*recurse=*/true))
        if (!elsewhere_.contains(item.key()))
          track(item.key(), item.value(), true, item.value().requires_grad());
  }
  Ema(const Ema&) = delete;
  Ema& operator=(const Ema&) = delete;

  /// One EMA update; call it after each optimizer step.
  void update() {
    const Action action = rule_.next();
    last_decay_ = action.kind == Action::Kind::average ? action.decay
                  : action.kind == Action::Kind::copy  ? 0.0
                                                       : 1.0;
    if (action.kind != Action::Kind::skip) {
      if (action.kind == Action::Kind::copy || action.copy_first) {
        engine_.copy(averaged_);
        if (!copy_phase_.empty()) engine_.copy(copy_phase_);
      }
      if (action.kind == Action::Kind::average) engine_.average(averaged_, 1.0 - action.decay);
      if (!copied_.empty()) engine_.copy(copied_);
    }
    changed_model_ = action.update_model;
    if (action.update_model) update_model_from_shadows(action.model_decay);
  }

  /// Copies the EMA weights into the model (diffusers' copy_to).
  void copy_to() { copy_to(*model_); }
  void copy_to(torch::nn::Module& target) {
    whole_only("copy_to");
    engine_.synchronize();
    const at::NoGradGuard no_grad;
    const auto params = target.named_parameters(true);
    const auto buffers = target.named_buffers(true);
    for (const auto* list : lists())
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
    whole_only("store");
    const at::NoGradGuard no_grad;
    stored_.clear();
    for (const auto* list : lists())
      for (const Pair& p : *list) stored_.emplace_back(p.name, target_of(p).detach().clone());
  }
  /// Puts back the weights `store()` kept; a restore without a store is a ConfigError.
  void restore() {
    if (stored_.empty() && !names().empty())
      throw ConfigError("there are no store()d weights to restore()", "Ema::restore");
    const at::NoGradGuard no_grad;
    std::size_t i = 0;
    for (auto* list : lists())
      for (Pair& p : *list) target_of(p).copy_(stored_[i++].second);
    stored_.clear();
  }

  /// EMA weights in the model for the scope's lifetime.
  [[nodiscard]] EmaScope<Ema> scope() { return EmaScope<Ema>(*this); }

  /// The share of the shadow kept by the last update (diffusers' cur_decay_value): its decay
  /// when it averaged, 0 when it copied the weights, 1 when it skipped; NaN before the first.
  [[nodiscard]] double last_decay() const noexcept { return last_decay_; }
  [[nodiscard]] Rule& rule() noexcept { return rule_; }
  [[nodiscard]] const Rule& rule() const noexcept { return rule_; }
  [[nodiscard]] Engine& engine() noexcept { return engine_; }

  /// The shadow of tensor `name` (waits for an update in flight).
  [[nodiscard]] const at::Tensor& shadow(const std::string& name) {
    engine_.synchronize();
    for (const auto* list : lists())
      for (const Pair& p : *list)
        if (p.name == name) return p.shadow;
    throw ConfigError("the EMA tracks no tensor '" + name + "'", "Ema::shadow");
  }
  /// Every tracked name, averaged ones first, in model order.
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto* list : lists())
      for (const Pair& p : *list) out.push_back(p.name);
    return out;
  }

  /// The rule's scalars (diffusers' keys for WarmupDecay) and the shadows by name.
  [[nodiscard]] std::pair<nlohmann::json, std::map<std::string, at::Tensor>> state() {
    whole_only("state");
    return {rule_.state(), shadows_here()};
  }

  /// True when this EMA holds only a rank's share of the model (its Share named others' tensors).
  [[nodiscard]] bool is_share() const noexcept { return !elsewhere_.empty(); }
  /// The names another rank's share holds (empty unless is_share()).
  [[nodiscard]] const std::set<std::string>& elsewhere() const noexcept { return elsewhere_; }
  /// The shadows this EMA holds, by name (under a Share, this rank's; waits for an update).
  [[nodiscard]] std::map<std::string, at::Tensor> shadows_here() {
    engine_.synchronize();
    std::map<std::string, at::Tensor> shadows;
    for (const auto* list : lists())
      for (const Pair& p : *list) shadows.emplace(p.name, p.shadow);
    return shadows;
  }
  /// Whether this EMA's tracking rules keep parameter `name` (on whichever rank holds it).
  [[nodiscard]] bool tracks_parameter(const std::string& name, const at::Tensor& t) const {
    return t.defined() && t.is_floating_point() &&
           (tracking_.ignored != IgnoredNames::untracked || !ignored(name));
  }
  /// Whether the last update() changed the tracked tensors themselves (ema-pytorch's
  /// update_model_with_ema): under a Share the ranks that hold copies of them must be told.
  [[nodiscard]] bool last_update_changed_model() const noexcept { return changed_model_; }

  /// Restores a state: every tracked name must be present with its shape, and no other name
  /// (under a Share, the names held elsewhere may be present and are passed over); the rule's
  /// scalars are checked by the rule. Nothing changes unless all of it is valid.
  void load_state(const nlohmann::json& scalars, const std::map<std::string, at::Tensor>& shadows) {
    engine_.synchronize();
    Rule rule = checked_rule(scalars, shadows);
    const at::NoGradGuard no_grad;
    for (auto* list : lists())
      for (Pair& p : *list) p.shadow.copy_(shadows.at(p.name));
    rule_ = std::move(rule);
  }

  /// What load_state would refuse, without changing anything.
  void check_state(const nlohmann::json& scalars,
                   const std::map<std::string, at::Tensor>& shadows) const {
    (void)checked_rule(scalars, shadows);
  }

 private:
  [[nodiscard]] Rule checked_rule(const nlohmann::json& scalars,
                                  const std::map<std::string, at::Tensor>& shadows) const {
    for (const auto* list : lists())
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
      if (!elsewhere_.contains(name) && std::find(known.begin(), known.end(), name) == known.end())
        throw FormatError("is not a tensor this EMA tracks", "ema state shadow '" + name + "'");
    Rule rule = rule_;
    rule.load_state(scalars);
    return rule;
  }

 public:
  /// Writes the state atomically to a file torch.load reads:
  /// {"format": "difftrain.ema", "version": 1, "state": {rule scalars}, "shadow_params": {name:
  /// tensor}}.
  void save(const std::filesystem::path& path) {
    whole_only("save");
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
    whole_only("load");
    load_state(io::to_json(get("state"), where + " state"),
               io::to_tensor_map(get("shadow_params"), where + " shadow_params"));
  }

  static constexpr std::string_view kFormat = "difftrain.ema";
  static constexpr std::int64_t kVersion = 1;

 private:
  // Whatever needs every shadow is refused on a share: it would quietly see only this rank's.
  void whole_only(const char* what) const {
    if (is_share())
      throw ConfigError("this EMA holds only this rank's share of the model (" +
                            std::to_string(names().size()) + " tensors; " +
                            std::to_string(elsewhere_.size()) +
                            " are other ranks'); take Trainer::ema_weights() on every rank",
                        std::string("Ema::") + what);
  }

  [[nodiscard]] bool ignored(const std::string& name) const {
    bool out = tracking_.ignore_names.contains(name);
    for (const auto& prefix : tracking_.ignore_prefixes) out = out || name.starts_with(prefix);
    return out;
  }

  // The model's tensor of a pair (its param is the master copy when a Share gave one).
  [[nodiscard]] at::Tensor target_of(const Pair& p) const {
    const auto it = targets_.find(p.name);
    return it != targets_.end() ? it->second : p.param;
  }

  // `trainable`: the parameter's requires_grad (a master copy, the source, does not require it).
  void track(const std::string& name, const at::Tensor& t, bool is_buffer, bool trainable) {
    if (!t.defined() || !t.is_floating_point()) return;
    const bool is_ignored = ignored(name);
    if (is_ignored && tracking_.ignored == IgnoredNames::untracked) return;
    Pair pair{name, t, engine_.make_shadow(t)};
    if (is_ignored) {
      copy_phase_.push_back(std::move(pair));
      return;
    }
    // copy_names wins over the buffer and frozen rules, for buffers and parameters alike.
    const bool average = !tracking_.copy_names.contains(name) &&
                         (is_buffer ? tracking_.buffers == Buffers::average
                                    : trainable || tracking_.frozen == Frozen::average);
    (average ? averaged_ : copied_).push_back(std::move(pair));
  }

  [[nodiscard]] std::array<std::vector<Pair>*, 3> lists() {
    return {&averaged_, &copied_, &copy_phase_};
  }
  [[nodiscard]] std::array<const std::vector<Pair>*, 3> lists() const {
    return {&averaged_, &copied_, &copy_phase_};
  }

  /// ema-pytorch's update_model_with_ema: decay 0 copies every shadow into the model; otherwise
  /// averaged tensors move toward their shadows and copied ones take them (ignored names stay).
  void update_model_from_shadows(double decay) {
    engine_.synchronize();
    const at::NoGradGuard no_grad;
    const auto pull = [](Pair& p) { return p.shadow.to(p.param.device(), p.param.scalar_type()); };
    if (decay == 0.0) {
      for (auto* list : lists())
        for (Pair& p : *list) p.param.copy_(pull(p));
      return;
    }
    for (Pair& p : averaged_) p.param.lerp_(pull(p), 1.0 - decay);
    for (Pair& p : copied_) p.param.copy_(pull(p));
  }

  torch::nn::Module* model_;
  Rule rule_;
  Engine engine_;
  Tracking tracking_;
  std::set<std::string> elsewhere_;  ///< other ranks' share of the model (sharded training)
  std::map<std::string, at::Tensor> targets_;  ///< the model's tensors of names with a source
  bool changed_model_ = false;
  double last_decay_ = std::nan("");
  std::vector<Pair> averaged_;
  std::vector<Pair> copied_;
  std::vector<Pair> copy_phase_;  ///< ignored names kept as ema-pytorch keeps them
  std::vector<std::pair<std::string, at::Tensor>> stored_;
};

}  // namespace difftrain::ema
