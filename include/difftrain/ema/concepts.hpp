#pragma once
// The EMA families. A decay *rule* says, each time the EMA is updated, what to do: skip, copy the
// model's weights, or average with a decay; it owns the counters that decide that and saves them by
// name. An update *engine* carries the action out over (shadow, parameter) pairs: a per-tensor
// loop, multi-tensor kernels, or shadows offloaded to the host. `Ema<Rule, Engine>` composes them.

#include <ATen/core/Tensor.h>

#include <concepts>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "difftrain/core/concepts.hpp"

namespace difftrain::ema {

/// What one update does.
struct Action {
  enum class Kind { skip, copy, average };
  Kind kind = Kind::skip;
  double decay = 0.0;       ///< for `average`: shadow ← decay·shadow + (1 − decay)·param
  bool copy_first = false;  ///< copy the weights into the shadows before averaging (a first update)
  /// Afterwards pull the model toward its EMA (ema-pytorch's update_model_with_ema): the model's
  /// tensors ← model_decay·model + (1 − model_decay)·shadow; 0 copies the shadows into the model.
  bool update_model = false;
  double model_decay = 0.0;
};

/// One tracked tensor: the model's (parameter or buffer) and its shadow.
struct Pair {
  std::string name;
  at::Tensor param;
  at::Tensor shadow;
};

template <class R>
concept RuleHasNext = requires(R& r) {
  { r.next() } -> std::same_as<Action>;
};

template <class R>
concept RuleSavesState = requires(R& r, const R& cr, const nlohmann::json& j) {
  { cr.state() } -> std::same_as<nlohmann::json>;
  r.load_state(j);
};

template <class R>
concept DecayRule = NamedPolicy<R> && HasOptions<R> &&
    std::constructible_from<R, const typename R::Options&> && RuleHasNext<R> && RuleSavesState<R>;

template <class R>
consteval bool diagnose_decay_rule() {
  static_assert(diagnose_named_policy<R>());
  static_assert(HasOptions<R> && std::constructible_from<R, const typename R::Options&>,
                "difftrain: an EMA decay rule needs a nested `struct Options {}` and a constructor "
                "from it");
  static_assert(RuleHasNext<R>,
                "difftrain: an EMA decay rule needs `ema::Action next()` (advance one update)");
  static_assert(RuleSavesState<R>,
                "difftrain: an EMA decay rule needs `nlohmann::json state() const` and "
                "`void load_state(const nlohmann::json&)`");
  return DecayRule<R>;
}

template <class E>
concept EngineAppliesActions = requires(E& e, std::span<Pair> pairs, double weight) {
  e.average(pairs, weight);
  e.copy(pairs);
  e.synchronize();
};

template <class E>
concept UpdateEngine = NamedPolicy<E> && HasOptions<E> &&
    std::constructible_from<E, const typename E::Options&> && EngineAppliesActions<E> &&
    requires(E& e, const at::Tensor& t) {
  { e.make_shadow(t) } -> std::same_as<at::Tensor>;
};

template <class E>
consteval bool diagnose_update_engine() {
  static_assert(diagnose_named_policy<E>());
  static_assert(HasOptions<E> && std::constructible_from<E, const typename E::Options&>,
                "difftrain: an EMA update engine needs a nested `struct Options {}` and a "
                "constructor from it");
  static_assert(EngineAppliesActions<E>,
                "difftrain: an EMA update engine needs `average(std::span<ema::Pair>, double "
                "weight)`, `copy(std::span<ema::Pair>)` and `synchronize()`");
  static_assert(
      UpdateEngine<E>,
      "difftrain: an EMA update engine needs `at::Tensor make_shadow(const at::Tensor&)`");
  return UpdateEngine<E>;
}

}  // namespace difftrain::ema
