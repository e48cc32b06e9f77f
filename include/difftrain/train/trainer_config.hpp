#pragma once
// What a Trainer's Config names and what it may leave out: the concepts a model and each policy
// must meet, the sentence a compile error gives for each missing piece, DefaultConfig, and the
// small types a step reports (StepInfo, NanPolicy).

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "difftrain/core/concepts.hpp"
#include "difftrain/ema/concepts.hpp"
#include "difftrain/ema/moving_average.hpp"
#include "difftrain/schedule/bind.hpp"
#include "difftrain/schedule/concepts.hpp"
#include "difftrain/schedule/diffusers.hpp"
#include "difftrain/train/clipping.hpp"
#include "difftrain/train/optimizer.hpp"
#include "difftrain/train/parallel.hpp"
#include "difftrain/train/precision.hpp"

namespace difftrain::train {

/// A model the trainer can train: a torch::nn::Module with a `Batch` type and a scalar loss.
template <class M>
concept TrainableModel = std::derived_from<M, torch::nn::Module> && requires {
  typename M::Batch;
} && requires(M& m, const typename M::Batch& b) {
  { m.loss(b) } -> std::convertible_to<at::Tensor>;
};

/// A batch that chunked forward can split: its example count and a slice of it.
template <class B>
concept SplittableBatch = requires(const B& b, std::int64_t i) {
  { b.size() } -> std::convertible_to<std::int64_t>;
  { b.slice(i, i) } -> std::convertible_to<B>;
};

template <class M>
consteval bool diagnose_trainable_model() {
  static_assert(
      !requires { typename M::ContainedType; },
      "difftrain: the model is a TORCH_MODULE holder; name its module type instead "
      "(`Trainer<NetImpl, Config>`) and pass `*net`");
  static_assert(std::derived_from<M, torch::nn::Module>,
                "difftrain: a trainable model must derive from torch::nn::Module");
  static_assert(
      requires { typename M::Batch; },
      "difftrain: a trainable model needs a nested `Batch` type (what one step consumes)");
  static_assert(
      requires(M & m, const typename M::Batch& b) {
        { m.loss(b) } -> std::convertible_to<at::Tensor>;
      },
      "difftrain: a trainable model needs `at::Tensor loss(const Batch&)` returning a scalar loss");
  return TrainableModel<M>;
}

/// No EMA.
struct NoEma {
  static constexpr std::string_view name = "none";
};

template <class C>
concept ClippingFromOptions =
    HasOptions<C> && std::constructible_from<C, const typename C::Options&>;

// One sentence per missing piece, so a policy that lacks one is told which.
template <class C>
consteval bool diagnose_clipping() {
  static_assert(NamedPolicy<C>,
                "difftrain: Config::Clipping needs `static constexpr std::string_view name`");
  static_assert(HasOptions<C>, "difftrain: Config::Clipping needs a nested `struct Options {}`");
  static_assert(ClippingFromOptions<C>,
                "difftrain: Config::Clipping needs a constructor from `const Options&`");
  static_assert(
      requires(C & c, const std::vector<at::Tensor>& p) {
        { c.apply(p, std::int64_t{0}) } -> std::convertible_to<double>;
      },
      "difftrain: Config::Clipping needs `double apply(const std::vector<at::Tensor>& params, "
      "std::int64_t step)` returning the gradient norm");
  return ClippingPolicy<C>;
}

template <class E>
consteval bool diagnose_ema() {
  if constexpr (std::is_same_v<E, NoEma>) {
    return true;
  } else {
    static_assert(!ema::DecayRule<E>,
                  "difftrain: Config::Ema names a decay rule, not an EMA: wrap it, `using Ema = "
                  "ema::Ema<ThatRule>;` (or ema::Ema<ThatRule, AnEngine>)");
    static_assert(
        requires {
          typename E::rule_type;
          typename E::engine_type;
        },
        "difftrain: Config::Ema must be `ema::Ema<Rule, Engine>` (e.g. "
        "`ema::Ema<ema::WarmupDecay>`) or train::NoEma");
    return true;
  }
}

template <class T>
struct IsTuple : std::false_type {};
template <class... A>
struct IsTuple<std::tuple<A...>> : std::true_type {};

/// What Config may leave out.
struct DefaultConfig {
  using Optimizer = AdamW;
  using Schedule = schedule::Constant;
  using Ema = NoEma;
  using Precision = Fp32;
  using Clipping = ClipByNorm;
  using Callbacks = std::tuple<>;
  using Parallel = SingleProcess;
};

enum class NanPolicy {
  stop,  ///< throw NumericError; nothing of the step is applied
  skip,  ///< drop the step (no optimizer, schedule or EMA step) and go on
};

namespace trainer_detail {

/// What Trainer::whole_parameters returns where the parameters are always whole (a scope like
/// the others: not trivially destructible, so holding one is no unused variable).
struct AlwaysWhole {
  AlwaysWhole() = default;
  AlwaysWhole(const AlwaysWhole&) = default;
  AlwaysWhole& operator=(const AlwaysWhole&) = default;
  ~AlwaysWhole() {}  // NOLINT(modernize-use-equals-default)
};
/// The scope Trainer::whole_parameters returns under parallel policy P.
template <class P>
struct WholeOf {
  using type = AlwaysWhole;
};
template <class P>
requires requires(P& p) { p.whole_parameters(); }
struct WholeOf<P> {
  using type = decltype(std::declval<P&>().whole_parameters());
};
// AnySchedule is the value a schedule chosen at run time becomes, not a policy type: a trainer
// given it is told which policy does that job, before the generic "has no name".
template <class S>
consteval bool diagnose_schedule() {
  if constexpr (std::is_same_v<S, schedule::AnySchedule>) {
    static_assert(!std::is_same_v<S, schedule::AnySchedule>,
                  "difftrain: schedule::AnySchedule is the value a schedule chosen at run time "
                  "becomes, not a Config::Schedule; for a schedule chosen by name use `using "
                  "Schedule = schedule::ByName;` (difftrain/schedule/by_name.hpp) and set "
                  "Options::schedule");
    return false;
  } else {
    return schedule::diagnose_lr_schedule<S>();
  }
}

template <class E>
struct EmaOptions {
  typename E::rule_type::Options rule{};
  typename E::engine_type::Options engine{};
  ema::Tracking tracking{};
};
template <>
struct EmaOptions<NoEma> {};

// Config::Parallel, or SingleProcess for a Config written before it existed.
template <class C>
struct ParallelOf {
  using type = SingleProcess;
};
template <class C>
requires requires { typename C::Parallel; }
struct ParallelOf<C> {
  using type = typename C::Parallel;
};

}  // namespace trainer_detail

/// What a step did, for callbacks and callers.
struct StepInfo {
  std::int64_t step = 0;   ///< optimizer steps done after this one
  double loss = 0.0;       ///< mean loss over the step's micro-batches
  std::vector<double> lr;  ///< per group, as used by this step
  double grad_norm = std::nan("");
  bool stepped = true;  ///< false when skipped (non-finite loss, or fp16 overflow)
  double seconds = 0.0;
  /// Examples the step trained on, over all ranks (0 when the batch type cannot count them).
  std::int64_t samples = 0;
};

}  // namespace difftrain::train
