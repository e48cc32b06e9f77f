#pragma once
// Trainer<Model, Config>: one optimizer step at a time, composed at compile time from the policies
// named in Config, configured at run time by plain Options.
//
//   struct MyConfig : train::DefaultConfig {
//     using Schedule = schedule::Cosine;
//     using Ema = ema::Ema<ema::WarmupDecay>;
//   };
//   train::Trainer<Net, MyConfig> trainer(net, options);
//   trainer.fit([&](std::int64_t step, std::int64_t micro) { return batch_for(step, micro); },
//   1000);
//
// A step: zero gradients; for each of `accumulation_steps` micro-batches, for each chunk of at
// most `max_batch_size` examples, loss · (chunk fraction) / accumulation_steps, scaled, backward;
// a non-finite loss is skipped or stops the run (NumericError) before anything changes; unscale;
// clip; optimizer step (skipped by the fp16 scaler on overflow); scaler update; LR schedule step;
// EMA update; callbacks.

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "difftrain/core/agreed.hpp"
#include "difftrain/core/concepts.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/ema/concepts.hpp"
#include "difftrain/ema/moving_average.hpp"
#include "difftrain/ema/rules.hpp"
#include "difftrain/io/torch_file.hpp"
#include "difftrain/io/zip_archive.hpp"
#include "difftrain/schedule/bind.hpp"
#include "difftrain/schedule/concepts.hpp"
#include "difftrain/schedule/diffusers.hpp"
#include "difftrain/train/checkpoint_header.hpp"
#include "difftrain/train/clipping.hpp"
#include "difftrain/train/optimizer.hpp"
#include "difftrain/train/optimizer_archive.hpp"
#include "difftrain/train/parallel.hpp"
#include "difftrain/train/precision.hpp"
#include "difftrain/train/weight_shards.hpp"

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

/// The parts of a checkpoint count the same steps: every applied step moves the scheduler once
/// and the EMA once, so a step counter that disagrees with them is damage (a step of 2^62 beside
/// a scheduler at 20 would make a resumed run believe itself finished).
/// `ema_counters` are the keys the EMA rule declares as counters; they are looked for at any depth
/// of the EMA's state (post-hoc EMA nests one rule state per profile).
inline void check_parts_agree(const nlohmann::json& js, std::int64_t step, const std::string& where,
                              const std::vector<std::string>& ema_counters = {}) {
  const auto& sched = js.at("scheduler");
  if (sched.contains("last_epoch") && sched["last_epoch"].is_number_integer() &&
      sched["last_epoch"].get<std::int64_t>() != step)
    throw FormatError("says step " + std::to_string(step) + " but its lr scheduler is at step " +
                          std::to_string(sched["last_epoch"].get<std::int64_t>()) +
                          "; the parts of the checkpoint disagree",
                      where + " step");
  for (const char* key : {"skipped_nonfinite", "skipped_overflow"})
    if (js.value(key, std::int64_t{0}) < 0)
      throw FormatError(std::string("has a negative '") + key + "'", where + " json");
  if (!js.contains("ema") || ema_counters.empty()) return;
  // An EMA counts its updates (diffusers' optimization_step, ema-pytorch's step, LitEma's
  // num_updates): never more than the steps taken.
  std::vector<const nlohmann::json*> stack{&js.at("ema")};
  while (!stack.empty()) {
    const nlohmann::json* node = stack.back();
    stack.pop_back();
    if (node->is_array())
      for (const auto& e : *node) stack.push_back(&e);
    if (!node->is_object()) continue;
    for (const auto& [key, value] : node->items()) {
      if (value.is_structured()) stack.push_back(&value);
      if (std::find(ema_counters.begin(), ema_counters.end(), key) != ema_counters.end() &&
          value.is_number_integer() &&
          (value.get<std::int64_t>() < 0 || value.get<std::int64_t>() > step))
        throw FormatError("says step " + std::to_string(step) + " but its EMA's '" + key + "' is " +
                              value.dump() + "; the parts of the checkpoint disagree",
                          where + " step");
    }
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

inline at::Tensor bytes_tensor(const std::string& s) {
  at::Tensor t = at::empty({static_cast<std::int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}
inline std::string tensor_bytes(const at::Tensor& t, const std::string& where) {
  if (t.scalar_type() != at::kByte || t.dim() != 1)
    throw FormatError("must be a 1-D uint8 tensor", where);
  const at::Tensor c = t.contiguous();
  return {static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.numel())};
}
/// This process's CUDA generator states, one per device (none without CUDA).
inline std::vector<at::Tensor> cuda_generator_states() {
  std::vector<at::Tensor> out;
  if (!torch::cuda::is_available()) return out;
  for (c10::DeviceIndex i = 0; i < static_cast<c10::DeviceIndex>(torch::cuda::device_count()); ++i)
    out.push_back(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, i)).get_state());
  return out;
}

/// Every rank's list of byte tensors, in rank order. Ranks may hold lists of different lengths
/// and sizes (a node with fewer devices): the sizes travel first, then the bytes, padded to the
/// longest rank's.
template <class P>
std::vector<std::vector<at::Tensor>> gather_state_lists(P& parallel,
                                                        const std::vector<at::Tensor>& own) {
  at::Tensor sizes = at::zeros({64}, at::kLong);
  if (own.size() > 63)
    throw ConfigError("has " + std::to_string(own.size()) + " generator states, more than 63",
                      "checkpoint of this rank");
  sizes[0] = static_cast<std::int64_t>(own.size());
  std::vector<at::Tensor> bytes;
  for (std::size_t i = 0; i < own.size(); ++i) {
    bytes.push_back(own[i].contiguous().view(at::kByte).reshape({-1}));
    sizes[static_cast<std::int64_t>(i) + 1] = bytes.back().numel();
  }
  const std::vector<at::Tensor> all_sizes = parallel.gather(sizes);
  std::int64_t longest = 0;
  for (const at::Tensor& t : all_sizes)
    longest = std::max(longest, t.slice(0, 1).sum().item<std::int64_t>());
  at::Tensor packed = at::zeros({longest}, at::kByte);
  if (!bytes.empty()) packed.narrow(0, 0, at::cat(bytes).numel()).copy_(at::cat(bytes));
  const std::vector<at::Tensor> all_bytes = parallel.gather(packed);
  std::vector<std::vector<at::Tensor>> out(all_bytes.size());
  for (std::size_t r = 0; r < all_bytes.size(); ++r) {
    const auto n = all_sizes[r][0].item<std::int64_t>();
    std::int64_t at_byte = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const auto len = all_sizes[r][i + 1].item<std::int64_t>();
      out[r].push_back(all_bytes[r].narrow(0, at_byte, len).clone());
      at_byte += len;
    }
  }
  return out;
}

/// Optimizer state for some parameters: their names per parameter group (the order its archive
/// lists them) and LibTorch's archive bytes.
struct OptimizerShard {
  std::vector<std::vector<std::string>> names;
  std::string bytes;
  std::string where;
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

template <class Model, class Config = DefaultConfig>
class Trainer {
  static_assert(diagnose_trainable_model<Model>());
  static_assert(OptimizerPolicy<typename Config::Optimizer>,
                "difftrain: Config::Optimizer needs a name, Options and `static "
                "std::unique_ptr<torch::optim::Optimizer> make(groups, options)`");
  static_assert(PrecisionPolicy<typename Config::Precision>,
                "difftrain: Config::Precision needs a name and `autocast`, `scaled`, `dtype` "
                "(static constexpr, or members of an instance built from its Options)");
  static_assert(diagnose_clipping<typename Config::Clipping>());
  static_assert(trainer_detail::diagnose_schedule<typename Config::Schedule>(),
                "difftrain: Config::Schedule is not an LR schedule (see the message above)");
  static_assert(diagnose_ema<typename Config::Ema>());
  static_assert(IsTuple<typename Config::Callbacks>::value,
                "difftrain: Config::Callbacks must be a std::tuple of callback objects, e.g. "
                "`std::tuple<train::ProgressBar, train::CsvLossLog>` (std::tuple<> for none)");
  static_assert(ParallelPolicy<typename trainer_detail::ParallelOf<Config>::type>,
                "difftrain: Config::Parallel needs a name, Options, a constructor from (module, "
                "params, options), rank/world_size and the step hooks of train/parallel.hpp");

 public:
  using Batch = typename Model::Batch;
  using OptimizerPolicyT = typename Config::Optimizer;
  using ScheduleT = typename Config::Schedule;
  using EmaT = typename Config::Ema;
  using PrecisionT = typename Config::Precision;
  using ClippingT = typename Config::Clipping;
  using CallbacksT = typename Config::Callbacks;
  using ParallelT = typename trainer_detail::ParallelOf<Config>::type;
  static constexpr bool has_ema = !std::is_same_v<EmaT, NoEma>;
  /// Whether the optimizer state is sharded over the ranks (Config::Parallel is ZeRO's).
  static constexpr bool sharded = ShardingParallel<ParallelT>;

  struct Options {
    typename OptimizerPolicyT::Options optimizer{};
    GroupingOptions groups{};
    typename ScheduleT::Options schedule{};
    trainer_detail::EmaOptions<EmaT> ema{};
    typename ClippingT::Options clipping{};
    /// For PrecisionByName: which precision ("no", "bf16", "fp16"); empty for static policies.
    typename precision_detail::OptionsOf<PrecisionT>::type precision{};
    GradScaler::Options scaler{};
    std::int64_t accumulation_steps = 1;
    std::optional<std::int64_t> max_batch_size{};
    NanPolicy on_nan = NanPolicy::stop;
    typename ParallelT::Options parallel{};
    /// Resuming with another number of ranks than the checkpoint was written with changes the
    /// global batch; it is a ConfigError unless allowed here.
    bool allow_world_size_change = false;
    /// A checkpoint written with other settings than this trainer's is refused, naming the
    /// setting, unless the setting is listed here: then the resumed run trains on with this
    /// trainer's (fine-tuning from a checkpoint with a new LR, say).
    struct TakeOnResume {
      bool lr = false;         ///< the base LR of each group (optimizer.lr and the rules' lr)
      bool schedule = false;   ///< the schedule's options (its LR curve)
      bool optimizer = false;  ///< the optimizer's other settings (betas, eps, weight decay, ...)
      bool ema = false;        ///< the EMA rule's options (decay, ...); its counters continue
      bool clipping = false;   ///< the clipping policy's options (max_norm, ...)
    } take_on_resume{};
  };

  Trainer(Model& model, Options options, CallbacksT callbacks = {})
      : model_(&model),
        o_(std::move(options)),
        clipping_(o_.clipping),
        precision_(PrecisionChoice::of<PrecisionT>(o_.precision)),
        scaler_([&] {
          GradScaler::Options s = o_.scaler;
          s.enabled = precision_.scaled;
          return s;
        }()),
        callbacks_(std::move(callbacks)) {
    if (o_.accumulation_steps < 1)
      throw ConfigError("accumulation_steps must be >= 1", "Trainer options");
    if (o_.max_batch_size && *o_.max_batch_size < 1)
      throw ConfigError("max_batch_size must be >= 1", "Trainer options");
    groups_ = make_param_groups(model, o_.groups);
    for (const auto& g : groups_) {
      params_.insert(params_.end(), g.params.begin(), g.params.end());
      param_names_.insert(param_names_.end(), g.names.begin(), g.names.end());
    }
    // Before the EMA copies the weights: with more than one rank they become rank 0's here.
    parallel_ = std::make_unique<ParallelT>(model, params_, o_.parallel);
    if constexpr (sharded) {
      static_assert(ShardedClipping<ClippingT>,
                    "difftrain: under a sharding Config::Parallel, Config::Clipping needs `double "
                    "apply(const std::vector<at::Tensor>& params, std::int64_t step, const "
                    "AcrossRanks& across)`: each rank holds only its share of the gradients");
      // This rank's optimizer steps only the parameters it owns.
      local_groups_ = parallel_->groups_of_rank(groups_, parallel_->rank());
      optimizer_ = OptimizerPolicyT::make(local_groups_, o_.optimizer);
      if (shards_state())
        scaler_.set_found_inf_across([p = parallel_.get()](at::Tensor& t) { p->sum_across(t); });
    } else {
      local_groups_ = groups_;
      optimizer_ = OptimizerPolicyT::make(groups_, o_.optimizer);
    }
    scheduler_.emplace(*optimizer_, ScheduleT(o_.schedule));
    // This trainer's own settings, which a resumed checkpoint's are compared with.
    option_base_lrs_ = scheduler_->base_lrs();
    for (auto& g : optimizer_->param_groups()) option_groups_.push_back(g.options().clone());
    if constexpr (has_ema) {
      if (ema_by_rank()) {
        // Each rank the shadows of the parameters it steps, averaging their masters.
        ema_ =
            std::make_unique<EmaT>(model, o_.ema.rule, o_.ema.engine, o_.ema.tracking, ema_share());
      } else {
        // Whole, and in the masters' dtype under a sharded policy's mixed precision.
        const auto whole = whole_parameters();
        ema_ = std::make_unique<EmaT>(model, o_.ema.rule, o_.ema.engine, o_.ema.tracking);
      }
    }
    call([&](auto& cb) {
      if constexpr (requires { cb.on_train_begin(*this); }) cb.on_train_begin(*this);
    });
  }

  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// One optimizer step over `micro_batches` (accumulation_steps of them).
  StepInfo step(const std::vector<Batch>& micro_batches) {
    if (static_cast<std::int64_t>(micro_batches.size()) != o_.accumulation_steps)
      throw ShapeError("got " + std::to_string(micro_batches.size()) + " micro-batches, expected " +
                           std::to_string(o_.accumulation_steps) + " (accumulation_steps)",
                       "Trainer::step");
    const auto start = std::chrono::steady_clock::now();
    StepInfo info;
    info.lr = scheduler_->last_lr();
    if constexpr (SplittableBatch<Batch>) {
      for (const Batch& b : micro_batches) info.samples += b.size();
      info.samples *= parallel_->world_size();  // every rank takes an equal share
    }
    model_->train();
    zero_grads();
    double loss_sum = 0.0;
    // The first non-finite loss of the step; with more than one rank, the step goes on to the
    // point where the ranks agree (so a NaN anywhere drops the step everywhere).
    std::optional<double> bad;
    step_bad_ = false;
    step_bad_agreed_only_ = false;
    pending_.clear();
    for (std::size_t m = 0; m < micro_batches.size(); ++m) {
      const double l = accumulate(micro_batches[m], m, m + 1 == micro_batches.size());
      if (deferred_read()) continue;  // read below, once, after every backward is queued
      if (!std::isfinite(l) && !bad) bad = l;
      loss_sum += l;
    }
    if (deferred_read()) {
      for (const double l : read_pending_losses(micro_batches.size())) {
        if (!std::isfinite(l) && !bad) bad = l;
        if (!bad) loss_sum += l;
      }
    }
    if (bad) {
      zero_grads();
      if constexpr (sharded) parallel_->after_skipped_step();  // every rank agreed to skip
      ++nonfinite_;
      const bool here = !step_bad_agreed_only_;
      if (o_.on_nan == NanPolicy::stop)
        throw NumericError(here ? "loss is " + std::to_string(*bad) + "; the step was not applied"
                                : "a loss on another rank was not finite; the step was not "
                                  "applied on any rank",
                           "Trainer step " + std::to_string(step_ + 1) + rank_suffix());
      info.loss = *bad;
      info.stepped = false;
      info.step = step_;
      finish(info, start);
      return info;
    }
    info.loss = parallel_->mean(loss_sum / static_cast<double>(o_.accumulation_steps));
    // Clipping needs the true gradients; without it a fused optimizer takes the scale itself.
    {
      RECORD_USER_SCOPE("difftrain::clip");
      if constexpr (!std::is_same_v<ClippingT, NoClipping>) scaler_.unscale_(*optimizer_);
      if constexpr (sharded)
        info.grad_norm = clipping_.apply(parallel_->owned_params(), step_, across_ranks());
      else
        info.grad_norm = clipping_.apply(params_, step_);
    }
    {
      RECORD_USER_SCOPE("difftrain::optimizer_step");
      info.stepped = scaler_.step(*optimizer_);
      scaler_.update();
    }
    if constexpr (sharded) {
      // Every rank skips the same steps (the overflow flags were combined), so every rank takes
      // part in sending the parameters it updated, or none does.
      RECORD_USER_SCOPE("difftrain::gather_parameters");
      if (info.stepped)
        parallel_->after_optimizer_step();
      else
        parallel_->after_skipped_step();  // whole again for EMA, callbacks and checkpoints
    }
    if (info.stepped) {
      scheduler_->step();
      if constexpr (has_ema) {
        RECORD_USER_SCOPE("difftrain::ema_update");
        if (ema_by_rank()) {
          ema_->update();  // this rank's masters into its shadows: nothing travels
          // A rule that pulls the model toward its EMA changed the owners' masters: every rank
          // takes them, as after a step.
          if constexpr (OwnerGatheringParallel<ParallelT>)
            if (ema_->last_update_changed_model()) parallel_->after_optimizer_step();
        } else {
          const auto whole = whole_parameters();
          ema_->update();
        }
      }
      ++step_;
    } else {
      ++overflow_skips_;
    }
    info.step = step_;
    finish(info, start);
    return info;
  }

  /// Steps until `until_step` optimizer steps are done; `source(step, micro)` gives each batch
  /// (a function of the step, so a resumed run sees the same data). Callbacks may stop early.
  template <class Source>
  requires std::invocable<Source&, std::int64_t, std::int64_t>
  void fit(Source&& source, std::int64_t until_step) {
    // A schedule with a horizon is defined up to it: past it diffusers' cosine climbs back to the
    // peak and the linear one stays at zero. Training past it is a mistake in the options.
    std::optional<std::int64_t> horizon;
    if constexpr (requires { o_.schedule.num_training_steps; })
      horizon = o_.schedule.num_training_steps;
    else if constexpr (requires { ScheduleT::horizon(o_.schedule); })
      horizon = ScheduleT::horizon(o_.schedule);  // a schedule chosen at run time
    if (horizon && until_step > *horizon)
      throw ConfigError("is " + std::to_string(*horizon) + ", but fit trains until step " +
                            std::to_string(until_step) +
                            "; the schedule is not defined past its horizon (set it to the run's "
                            "length)",
                        "Trainer options: schedule.num_training_steps");
    stop_requested_ = false;
    while (step_ < until_step && !stop_requested_) {
      std::vector<Batch> micro;
      {
        RECORD_USER_SCOPE("difftrain::data");
        for (std::int64_t m = 0; m < o_.accumulation_steps; ++m) micro.push_back(source(step_, m));
      }
      (void)step(micro);
      // A stop asked on any rank (a callback runs on rank 0 only) stops every rank at this step.
      if (parallel_->world_size() > 1) stop_requested_ = !parallel_->all_ok(!stop_requested_);
    }
    call([&](auto& cb) {
      if constexpr (requires { cb.on_train_end(*this); }) cb.on_train_end(*this);
    });
  }

  void request_stop() { stop_requested_ = true; }

  // ---- state --------------------------------------------------------------------------------

  [[nodiscard]] std::int64_t global_step() const { return step_; }
  [[nodiscard]] Model& model() { return *model_; }
  [[nodiscard]] torch::optim::Optimizer& optimizer() { return *optimizer_; }
  /// The Config::Parallel policy this trainer shares its steps through.
  [[nodiscard]] ParallelT& parallel() { return *parallel_; }
  /// Every parameter whole on every rank while the returned scope lives. Stage 3 of
  /// ShardedDataParallel keeps only a share of them on each rank between steps: sampling,
  /// saving or reading the model then takes one, on every rank. Free under other policies.
  [[nodiscard]] auto whole_parameters() {
    if constexpr (requires(ParallelT & p) { p.whole_parameters(); })
      return parallel_->whole_parameters();
    else
      return trainer_detail::AlwaysWhole{};
  }
  [[nodiscard]] schedule::LrScheduler<ScheduleT>& scheduler() { return *scheduler_; }
  [[nodiscard]] GradScaler& scaler() { return scaler_; }
  [[nodiscard]] const std::vector<ParamGroup>& param_groups() const { return groups_; }
  [[nodiscard]] const Options& options() const { return o_; }
  [[nodiscard]] CallbacksT& callbacks() { return callbacks_; }
  [[nodiscard]] std::int64_t skipped_nonfinite() const { return nonfinite_; }
  [[nodiscard]] std::int64_t skipped_overflow() const { return overflow_skips_; }
  [[nodiscard]] EmaT& ema() requires has_ema { return *ema_; }

  /// Whether each rank keeps the EMA of the parameters it steps only (a sharding policy at stage
  /// 1 to 3): the EMA's weights are then read through ema_weights(), on every rank.
  [[nodiscard]] bool ema_by_rank() const {
    if constexpr (has_ema && OwnerGatheringParallel<ParallelT>)
      return parallel_->stage() >= 1;
    else
      return false;
  }
  /// Whether reading the model between steps (sampling, validation, writing it) needs every
  /// rank: its parameters or its EMA's shadows are shared out. Callbacks that read it then run on
  /// every rank (SampleEvery does).
  [[nodiscard]] bool reading_needs_every_rank() const {
    if constexpr (OwnerGatheringParallel<ParallelT>)
      return parallel_->world_size() > 1 &&
             (parallel_->whole_needs_every_rank() || (has_ema && ema_by_rank()));
    else
      return false;
  }

  /// The EMA's weights in the model while the returned scope lives (every parameter whole),
  /// the training weights again after it, also when an exception unwinds through it. Under a
  /// sharding policy every rank takes it together (the shadows travel from their owners, one
  /// broadcast per bucket); otherwise it is Ema::scope's swap.
  class EmaWeights {
   public:
    using Whole = typename trainer_detail::WholeOf<ParallelT>::type;
    EmaWeights(EmaWeights&& o) noexcept
        : whole_(std::move(o.whole_)), saved_(std::exchange(o.saved_, {})) {}
    EmaWeights(const EmaWeights&) = delete;
    EmaWeights& operator=(const EmaWeights&) = delete;
    EmaWeights& operator=(EmaWeights&&) = delete;
    ~EmaWeights() {
      const at::NoGradGuard no_grad;
      for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) it->first.copy_(it->second);
    }  // then whole_ ends: back to this rank's share, or to param_dtype

   private:
    friend class Trainer;
    explicit EmaWeights(Whole whole) : whole_(std::move(whole)) {}
    // The model's tensor gets `value`; its training value is kept to put back.
    void swap_in(at::Tensor target, const at::Tensor& value) {
      const at::NoGradGuard no_grad;
      at::Tensor t = target.detach();
      saved_.emplace_back(t, t.clone());
      t.copy_(value);
    }
    Whole whole_;
    std::vector<std::pair<at::Tensor, at::Tensor>> saved_;  // (model tensor, training value)
  };
  [[nodiscard]] EmaWeights ema_weights() requires has_ema {
    EmaWeights scope(whole_parameters());
    std::map<std::string, at::Tensor> model_tensors;
    for (const auto& item : model_->named_parameters(true))
      model_tensors.emplace(item.key(), item.value());
    for (const auto& item : model_->named_buffers(true))
      model_tensors.emplace(item.key(), item.value());
    for_each_ema_shadow(true, [&](const std::string& name, const at::Tensor& shadow) {
      const auto it = model_tensors.find(name);
      if (it == model_tensors.end())
        throw ConfigError("the model has no tensor '" + name + "'", "Trainer::ema_weights");
      scope.swap_in(it->second, shadow);
    });
    return scope;
  }

  /// What must match between a checkpoint and the trainer loading it.
  [[nodiscard]] nlohmann::json fingerprint() const {
    nlohmann::json groups = nlohmann::json::array();
    for (const auto& g : groups_) groups.push_back({{"label", g.label}, {"names", g.names}});
    return {{"optimizer", OptimizerPolicyT::name},
            {"schedule", detail_name<ScheduleT>()},
            {"ema", detail_name<EmaT>()},
            {"precision", precision_.name},
            {"clipping", ClippingT::name},
            {"accumulation_steps", o_.accumulation_steps},
            {"param_groups", groups}};
  }

  /// Everything needed to continue bit-identically, as one torch.save-compatible value (a
  /// sharded optimizer's state is in files beside it: save_checkpoint writes them).
  [[nodiscard]] c10::IValue state() { return make_state(nullptr); }

 private:
  // The state; with `shards` (one record per rank's weights file, when the trainer's parameters
  // and their EMA are in those files), without the trainer's parameters and their shadows.
  [[nodiscard]] c10::IValue make_state(const std::vector<WeightShardRecord>* shards) {
    std::set<std::string> in_shards;
    if (shards != nullptr) in_shards.insert(param_names_.begin(), param_names_.end());
    auto root = io::torch_dict();
    root.insert("format", std::string("difftrain.checkpoint"));
    root.insert("version", kCheckpointFormatVersion);
    root.insert("step", step_);
    nlohmann::json js = {{"fingerprint", fingerprint()},
                         {"scheduler", scheduler_->state()},
                         {"scaler", scaler_.state()},
                         {"skipped_nonfinite", nonfinite_},
                         {"skipped_overflow", overflow_skips_}};
    auto model = io::torch_dict();
    for (const auto& item : model_->named_parameters(true))
      if (!in_shards.contains(item.key()))
        model.insert(item.key(), item.value().detach().cpu().clone());
    for (const auto& item : model_->named_buffers(true))
      model.insert(item.key(), item.value().detach().cpu().clone());
    root.insert("model", model);
    // A sharded optimizer state is in one file per rank beside this one (save_checkpoint); here
    // is only the index of which rank holds which parameters' state.
    if (shards_state()) {
      js["sharding"] = sharding_index();
      if (shards != nullptr) js["sharding"]["weights"] = weights_index(*shards);
    } else
      root.insert("optimizer", trainer_detail::bytes_tensor(optimizer_state_bytes(*optimizer_)));
    if constexpr (has_ema) {
      js["ema"] = ema_->rule().state();
      // The trainer's parameters' shadows are in the weights files of a set; kept per rank
      // otherwise, they come to rank 0 from their owners, one bucket at a time (the other
      // ranks, which write nothing, keep none).
      const bool keep = !ema_->is_share() || parallel_->rank() == 0;
      std::map<std::string, at::Tensor> shadows;  // by name, as the file has always held them
      for_each_ema_shadow(shards == nullptr, [&](const std::string& name, const at::Tensor& v) {
        if (keep) shadows.emplace(name, v.detach().to(at::kCPU, false, /*copy=*/true));
      });
      auto e = io::torch_dict();
      for (const auto& [name, v] : shadows) e.insert(name, v);
      root.insert("ema", e);
    }
    js["world_size"] = parallel_->world_size();
    {
      nlohmann::json groups = nlohmann::json::array();
      for (const auto& g : option_groups_) groups.push_back(optimizer_settings(*g));
      js["settings"] = {{"schedule_curve", schedule_curve()},
                        {"optimizer", groups},
                        {"clipping", clipping_probe()}};
    }
    // Every rank's generator (each draws its own noise); rank 0's also under the old key.
    const at::Tensor rng = at::detail::getDefaultCPUGenerator().get_state();
    root.insert("rng_cpu", rng);
    if (parallel_->world_size() > 1) {
      auto ranks = io::torch_list();
      for (const at::Tensor& t : parallel_->gather(rng)) ranks.push_back(t);
      root.insert("rng_cpu_ranks", ranks);
    }
    const std::vector<at::Tensor> own_cuda = trainer_detail::cuda_generator_states();
    auto cuda = io::torch_list();
    for (const at::Tensor& t : own_cuda) cuda.push_back(t);
    root.insert("rng_cuda", cuda);
    // Each rank's CUDA generators as well: every rank draws its noise on its own device, and a
    // rank given rank 0's states would repeat rank 0's draws after a resume.
    if (parallel_->world_size() > 1) {
      auto ranks = io::torch_list();
      for (const auto& states : trainer_detail::gather_state_lists(*parallel_, own_cuda)) {
        auto list = io::torch_list();
        for (const at::Tensor& t : states) list.push_back(t);
        ranks.push_back(list);
      }
      root.insert("rng_cuda_ranks", ranks);
    }
    root.insert("json", js.dump());
    return root;
  }

 public:
  /// A state read and checked against this trainer, not yet applied.
  struct CheckedState {
    std::string where;
    nlohmann::json js;
    std::int64_t step = 0;
    std::map<std::string, at::Tensor> model_tensors, ema_shadows;
    /// The optimizer state this rank needs: the whole state of a checkpoint written by one
    /// optimizer, or the shards of a sharded one holding this rank's parameters.
    std::vector<trainer_detail::OptimizerShard> opt_shards;
    at::Tensor rng_cpu;
    std::vector<at::Tensor> rng_cuda;
  };

  /// Restores a state written by state(). Everything is checked before the trainer changes: a
  /// wrong format, a version from the future, a different configuration or model is a typed error
  /// and leaves the trainer as it was.
  void load_state(const io::TorchValue& root) {
    load_agreed(root.where(), [&] { return checked_naming_file(root); });
  }

  /// The checking half of load_state (a multi-model trainer checks every model before applying).
  /// `file`: where `root` was read from; the shards of a sharded checkpoint lie beside it.
  [[nodiscard]] CheckedState check_state(const io::TorchValue& root,
                                         const std::filesystem::path& file = {}) const {
    const std::string where = root.where();
    check_checkpoint_format(root, "difftrain.checkpoint", "a difftrain checkpoint");
    nlohmann::json js = checkpoint_json(root, "settings");
    // Every piece apply_state reads is here and of the right kind, so applying cannot stop
    // halfway on a missing key.
    if (!js.is_object() || !js.contains("fingerprint") || !js["fingerprint"].is_object())
      throw FormatError("has settings without a fingerprint", where + " json");
    std::vector<std::string> parts = {"scheduler", "scaler"};
    if constexpr (has_ema) parts.emplace_back("ema");
    for (const auto& key : parts)
      if (!js.contains(key) || !js[key].is_object())
        throw FormatError("has no '" + key + "' state", where + " json");
    for (const char* key : {"skipped_nonfinite", "skipped_overflow"})
      if (js.contains(key) && !js[key].is_number_integer())
        throw FormatError(std::string("has a '") + key + "' that is not an integer",
                          where + " json");
    {
      GradScaler probe = scaler_;  // load_state rebinds its tensors: the trainer's are untouched
      probe.load_state(js.at("scaler"));
    }
    scheduler_->check_state(js.at("scheduler"));
    const nlohmann::json want = fingerprint();
    for (const auto& [key, value] : want.items())
      if (!js["fingerprint"].contains(key) || js["fingerprint"][key] != value)
        throw ConfigError("was written with " + key + " = " +
                              (js["fingerprint"].contains(key) ? js["fingerprint"][key].dump()
                                                               : std::string("(missing)")) +
                              ", this trainer has " + value.dump(),
                          where);
    const std::int64_t saved_step = root.at("step").integer();
    if (saved_step < 0) throw FormatError("has a negative step", where);
    if constexpr (has_ema)
      trainer_detail::check_parts_agree(js, saved_step, where, ema_counter_keys());
    else
      trainer_detail::check_parts_agree(js, saved_step, where);
    // Model tensors: same names and shapes (the trainer's parameters of a sharded set, and their
    // shadows, from each rank's weights file).
    auto model_tensors = root.at("model").tensor_map();
    std::map<std::string, at::Tensor> shard_shadows;
    if (js.contains("sharding") && js["sharding"].is_object() &&
        js["sharding"].contains("weights")) {
      if (file.empty())
        throw ConfigError(
            "holds its weights in files beside it, one per rank: load it with "
            "load_checkpoint(path)",
            where);
      read_weight_shards(file, js["sharding"], saved_step, where, model_tensors, &shard_shadows);
    }
    std::size_t expected = 0;
    auto check = [&](const std::string& name, const at::Tensor& t) {
      ++expected;
      const auto it = model_tensors.find(name);
      if (it == model_tensors.end())
        throw ConfigError("has no tensor '" + name + "' (a different model?)", where + " model");
      if (it->second.sizes() != t.sizes())
        throw ConfigError("tensor '" + name + "' has shape " + c10::str(it->second.sizes()) +
                              ", the model's is " + c10::str(t.sizes()),
                          where + " model");
    };
    for (const auto& item : model_->named_parameters(true)) check(item.key(), item.value());
    for (const auto& item : model_->named_buffers(true)) check(item.key(), item.value());
    if (model_tensors.size() != expected)
      throw ConfigError("holds tensors the model does not have", where + " model");
    check_settings(js, where);
    std::map<std::string, at::Tensor> ema_shadows;
    if constexpr (has_ema) {
      ema_shadows = root.at("ema").tensor_map();
      ema_shadows.merge(shard_shadows);
      ema_->check_state(js.at("ema"), ema_shadows);
    }
    std::vector<trainer_detail::OptimizerShard> opt_shards;
    if (js.contains("sharding")) {
      opt_shards = read_optimizer_shards(js["sharding"], saved_step, file, where);
    } else {
      trainer_detail::OptimizerShard whole;
      for (const auto& g : groups_) whole.names.push_back(g.names);
      whole.bytes =
          trainer_detail::tensor_bytes(root.at("optimizer").tensor(), where + " optimizer");
      whole.where = where + " optimizer";
      opt_shards.push_back(std::move(whole));
    }
    for (const auto& shard : opt_shards) {
      // LibTorch's reader of the inner archive checks no CRC-32: every record is checked here,
      // so a damaged optimizer state is refused instead of loading with different numbers.
      const io::ZipArchive inner({shard.bytes.data(), shard.bytes.size()}, shard.where);
      std::vector<char> buffer;
      for (const auto& [name, record] : inner.records()) {
        buffer.resize(static_cast<std::size_t>(record.size));
        inner.read_into(name, buffer.data());
      }
    }
    if (js.contains("world_size")) {
      if (!js["world_size"].is_number_integer() || js["world_size"].get<std::int64_t>() < 1)
        throw FormatError("has a world_size that is not a positive integer", where + " json");
    }
    const std::int64_t saved_world = js.value("world_size", std::int64_t{1});
    if (saved_world != parallel_->world_size() && !o_.allow_world_size_change)
      throw ConfigError("was written by " + std::to_string(saved_world) + " ranks, this run has " +
                            std::to_string(parallel_->world_size()) +
                            " (the global batch would change); set allow_world_size_change to "
                            "resume anyway",
                        where);
    at::Tensor rng_cpu = root.at("rng_cpu").tensor();
    if (saved_world == parallel_->world_size() && saved_world > 1) {
      const auto ranks = root.at("rng_cpu_ranks").elements();
      if (static_cast<std::int64_t>(ranks.size()) != saved_world)
        throw FormatError("holds " + std::to_string(ranks.size()) + " generator states for " +
                              std::to_string(saved_world) + " ranks",
                          where + " rng_cpu_ranks");
      rng_cpu = ranks[static_cast<std::size_t>(parallel_->rank())].tensor();
    }
    std::vector<at::Tensor> rng_cuda;
    for (const auto& t : root.at("rng_cuda").elements()) rng_cuda.push_back(t.tensor());
    // Written before CUDA states were kept per rank: every rank takes rank 0's, as it did then.
    if (saved_world == parallel_->world_size() && saved_world > 1 &&
        root.contains("rng_cuda_ranks")) {
      const auto ranks = root.at("rng_cuda_ranks").elements();
      if (static_cast<std::int64_t>(ranks.size()) != saved_world)
        throw FormatError("holds " + std::to_string(ranks.size()) +
                              " ranks' CUDA generator states for " + std::to_string(saved_world) +
                              " ranks",
                          where + " rng_cuda_ranks");
      rng_cuda.clear();
      for (const auto& t : ranks[static_cast<std::size_t>(parallel_->rank())].elements())
        rng_cuda.push_back(t.tensor());
    }
    return {where,         std::move(js),          saved_step,
            model_tensors, std::move(ema_shadows), std::move(opt_shards),
            rng_cpu,       std::move(rng_cuda)};
  }

  /// The applying half of load_state; `s` must come from check_state on this trainer.
  void apply_state(const CheckedState& s) {
    const std::string& where = s.where;
    const auto& js = s.js;
    const auto& model_tensors = s.model_tensors;
    // The optimizer first: its archive is the part that can still refuse. Its current state is
    // kept and put back if the saved one does not load, so a refusal changes nothing.
    const std::string before = optimizer_state_bytes(*optimizer_);
    // The moments go where the parameters are now, as torch.optim's load_state_dict moves them:
    // a checkpoint written on a GPU resumes on the CPU and the other way round.
    // (This rank's optimizer may step copies elsewhere: an offloaded one's are in host memory.)
    std::optional<c10::Device> device;
    for (const auto& g : local_groups_)
      if (!device && !g.params.empty()) device = g.params.front().device();
    if (!device && !params_.empty()) device = params_.front().device();
    auto load_optimizer = [&](torch::optim::Optimizer& optimizer, const std::string& bytes) {
      torch::serialize::InputArchive archive;
      archive.load_from(bytes.data(), bytes.size(), device);
      optimizer.load(archive);
    };
    try {
      load_optimizer_shards(s.opt_shards, load_optimizer);
    } catch (const std::exception& e) {  // c10::Error, or std::out_of_range from a damaged pickle
      optimizer_->state().clear();
      load_optimizer(*optimizer_, before);
      const auto* c10e = dynamic_cast<const c10::Error*>(&e);
      throw FormatError(std::string("optimizer state does not load: ") +
                            (c10e != nullptr ? c10e->what_without_backtrace() : e.what()),
                        where + " optimizer");
    }
    {
      at::NoGradGuard no_grad;
      for (const auto& item : model_->named_parameters(true))
        item.value().copy_(model_tensors.at(item.key()));
      for (const auto& item : model_->named_buffers(true))
        item.value().copy_(model_tensors.at(item.key()));
    }
    if (o_.take_on_resume.optimizer)
      for (std::size_t i = 0; i < option_groups_.size(); ++i)
        optimizer_->param_groups()[i].set_options(option_groups_[i]->clone());
    scheduler_->load_state(js.at("scheduler"));
    if (o_.take_on_resume.lr) scheduler_->rebase(option_base_lrs_);
    scaler_.load_state(js.at("scaler"));
    if constexpr (has_ema) ema_->load_state(js.at("ema"), s.ema_shadows);
    at::Generator cpu_gen = at::detail::getDefaultCPUGenerator();
    cpu_gen.set_state(s.rng_cpu);
    if (torch::cuda::is_available())
      for (std::size_t i = 0;
           i < s.rng_cuda.size() && i < static_cast<std::size_t>(torch::cuda::device_count());
           ++i) {
        at::Generator gen = at::globalContext().defaultGenerator(
            c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
        gen.set_state(s.rng_cuda[i]);
      }
    step_ = s.step;
    nonfinite_ = js.value("skipped_nonfinite", std::int64_t{0});
    overflow_skips_ = js.value("skipped_overflow", std::int64_t{0});
  }

  /// Writes the state atomically (temporary file, fsync, rename, fsync of the folder).
  /// In a distributed run every rank calls it (the state gathers each rank's generator); rank 0
  /// writes and the others wait until it has, and learn whether it could. Under a sharding
  /// policy every rank first writes its own files of the set (weights_in_shards says which).
  void save_checkpoint(const std::filesystem::path& path) {
    const bool own_weights = weights_in_shards();
    // Each rank's weights file holds its own masters: nothing is gathered for those.
    std::optional<typename trainer_detail::WholeOf<ParallelT>::type> whole;
    if (!own_weights) whole.emplace(whole_parameters());
    if (!(own_weights ? parallel_->all_ok(own_weights_finite()) : all_finite()))
      throw NumericError(
          "the model holds non-finite weights; not saving them over a good checkpoint",
          path.string());
    std::vector<WeightShardRecord> records;
    if (shards_state()) records = write_rank_files(path, own_weights);
    const c10::IValue st = make_state(own_weights ? &records : nullptr);
    // Rank 0's file, written only once every rank's are on disk, commits the set: a run stopped
    // in between leaves the previous set whole (its own files), and resume_latest takes that one.
    agreed(
        [&] {
          if (parallel_->rank() == 0) io::save_torch_file(path, st);
        },
        [&](bool ok) { return parallel_->decide(ok); },
        [&] {
          return IoError("rank 0 could not write the checkpoint (its error says why)",
                         path.string());
        });
  }

  /// Whether save_checkpoint writes the trainer's parameters (and their EMA) as one file per
  /// rank beside the checkpoint, each rank its own (a sharding policy at stage 1 to 3).
  [[nodiscard]] bool weights_in_shards() const {
    if constexpr (OwnerGatheringParallel<ParallelT>)
      return shards_state();
    else
      return false;
  }

  /// The file beside checkpoint `path` holding rank `rank`'s shard of a sharded optimizer state.
  [[nodiscard]] static std::filesystem::path shard_path(const std::filesystem::path& path,
                                                        std::int64_t rank, std::int64_t world) {
    return path.string() + ".shard-" + std::to_string(rank) + "-of-" + std::to_string(world);
  }

  /// This process's rank in a distributed run (0 otherwise) and the number of ranks.
  [[nodiscard]] std::int64_t rank() const { return parallel_->rank(); }
  [[nodiscard]] std::int64_t world_size() const { return parallel_->world_size(); }
  [[nodiscard]] bool is_main() const { return parallel_->rank() == 0; }
  /// Every rank of a distributed run reads the file; all of them go on only when all could use
  /// it (the others' error says another rank refused), so they resume from the same one.
  void load_checkpoint(const std::filesystem::path& path) {
    load_agreed(path.string(),
                [&] { return checked_naming_file(io::load_torch_file(path), path); });
  }

  [[nodiscard]] bool all_finite() const {
    for (const at::Tensor& p : model_->parameters())
      if (!at::isfinite(p).all().item<bool>()) return false;
    return true;
  }

 private:
  // MultiTrainer saves and resumes its trainers together, agreeing across ranks as one.
  template <class, class>
  friend class MultiTrainer;
  // The schedule's LR (for a base LR of 1) at steps from the first to far past any horizon: two
  // schedules with different options differ somewhere here.
  [[nodiscard]] nlohmann::json schedule_curve() const {
    nlohmann::json curve = nlohmann::json::array();
    const ScheduleT& sch = scheduler_->schedule();
    for (std::int64_t step : {0,   1,   2,    3,    5,    8,     10,    20,    50,     100,
                              200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 1000000}) {
      double lr = 0;
      if constexpr (schedule::HasGroupLrAt<ScheduleT>)
        lr = sch.lr(step, 1.0, 0);
      else
        lr = sch.lr(step, 1.0);
      curve.push_back(std::isfinite(lr) ? nlohmann::json(lr) : nlohmann::json(nullptr));
    }
    return curve;
  }

  // What the clipping policy does to a few gradients (small, large, huge, at several steps): two
  // policies with different options (max_norm, a clip value, a step string) differ somewhere here.
  [[nodiscard]] nlohmann::json clipping_probe() const {
    ClippingT clip(o_.clipping);
    nlohmann::json out = nlohmann::json::array();
    auto number = [](double v) {
      return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
    };
    for (std::int64_t step : {0, 10, 100, 1000, 10000})
      for (double scale : {0.01, 1.0, 100.0}) {
        at::Tensor p = at::zeros({2}, at::kDouble).requires_grad_();
        p.mutable_grad() = at::tensor({3.0, -4.0}, at::kDouble) * scale;
        const double norm = clip.apply({p}, step);
        out.push_back(
            {number(norm), number(p.grad()[0].item<double>()), number(p.grad()[1].item<double>())});
      }
    return out;
  }

  // An optimizer group's settings besides its LR (which the schedule sets), for the optimizers
  // difftrain names; another optimizer's are not compared.
  static nlohmann::json optimizer_settings(const torch::optim::OptimizerOptions& o) {
    auto adam = [](const auto& a) -> nlohmann::json {  // AdamW's and Adam's are the same fields
      return {{"beta1", std::get<0>(a.betas())},
              {"beta2", std::get<1>(a.betas())},
              {"eps", a.eps()},
              {"weight_decay", a.weight_decay()},
              {"amsgrad", a.amsgrad()}};
    };
    if (const auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) return adam(*w);
    if (const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) return adam(*a);
    if (const auto* g = dynamic_cast<const torch::optim::SGDOptions*>(&o))
      return {{"momentum", g->momentum()},
              {"dampening", g->dampening()},
              {"weight_decay", g->weight_decay()},
              {"nesterov", g->nesterov()}};
    return nlohmann::json::object();
  }

  // The keys of the EMA rule's state() that count updates: those the rule declares (RuleByName
  // says which for the rule it chose); a rule that declares none is probed: the keys three
  // updates change.
  [[nodiscard]] std::vector<std::string> ema_counter_keys() const requires has_ema {
    using Rule = typename EmaT::rule_type;
    Rule rule(o_.ema.rule);
    std::vector<std::string> keys;
    if constexpr (requires { rule.counter_keys(); }) {
      for (const auto key : rule.counter_keys()) keys.emplace_back(key);
    } else if constexpr (requires { Rule::counters; }) {
      for (const auto key : Rule::counters) keys.emplace_back(key);
    } else {
      const nlohmann::json before = rule.state();
      for (int i = 0; i < 3; ++i) (void)rule.next();
      const nlohmann::json after = rule.state();
      for (const auto& [key, value] : before.items())
        if (!after.contains(key) || after[key] != value) keys.push_back(key);
    }
    return keys;
  }

  // The EMA rule's options as its state() names them: the state of a rule made from this
  // trainer's options, less its counters.
  [[nodiscard]] nlohmann::json ema_options() const requires has_ema {
    nlohmann::json out = typename EmaT::rule_type(o_.ema.rule).state();
    for (const auto& key : ema_counter_keys()) out.erase(key);
    return out;
  }

  // The saved settings against this trainer's: a difference is a ConfigError naming the setting,
  // unless take_on_resume lists it (the EMA's options are then replaced in `js` here, so the rule
  // loads with this trainer's).
  void check_settings(nlohmann::json& js, const std::string& where) const {
    const std::string at = where + " settings";
    auto refuse = [&](const std::string& what, const nlohmann::json& saved,
                      const nlohmann::json& now, const std::string& take) {
      throw ConfigError("was written with " + what + " = " + saved.dump() + ", this trainer has " +
                            now.dump() + "; set Options::take_on_resume." + take +
                            " to train on with this trainer's",
                        at);
    };
    const nlohmann::json bases = js["scheduler"].value("base_lrs", nlohmann::json::array());
    if (!o_.take_on_resume.lr && bases != nlohmann::json(option_base_lrs_)) {
      for (std::size_t i = 0; i < groups_.size() && i < bases.size(); ++i)
        if (bases[i] != nlohmann::json(option_base_lrs_[i]))
          refuse("lr of group '" + groups_[i].label + "'", bases[i], option_base_lrs_[i], "lr");
    }
    if (!js.contains("settings") || !js["settings"].is_object()) return;  // an older checkpoint
    const nlohmann::json& saved = js["settings"];
    if (!o_.take_on_resume.schedule && saved.contains("schedule_curve")) {
      const nlohmann::json now = schedule_curve();
      const nlohmann::json& was = saved["schedule_curve"];
      if (was != now)
        refuse("a schedule whose LR curve (base LR 1, at steps 0, 1, 2, 3, 5, 8, 10, 20, ...)", was,
               now, "schedule");
    }
    if (!o_.take_on_resume.clipping && saved.contains("clipping")) {
      const nlohmann::json now = clipping_probe();
      if (saved["clipping"] != now)
        refuse("a clipping policy whose effect on probe gradients", saved["clipping"], now,
               "clipping");
    }
    if (!o_.take_on_resume.optimizer && saved.contains("optimizer")) {
      const nlohmann::json& was = saved["optimizer"];
      for (std::size_t i = 0; i < option_groups_.size() && i < was.size(); ++i) {
        const nlohmann::json now = optimizer_settings(*option_groups_[i]);
        for (const auto& [key, value] : now.items())
          if (was[i].contains(key) && was[i][key] != value)
            refuse("optimizer " + key + " in group '" + groups_[i].label + "'", was[i][key], value,
                   "optimizer");
      }
    }
    if constexpr (has_ema) {
      const nlohmann::json now = ema_options();
      for (const auto& [key, value] : now.items()) {
        if (!js["ema"].contains(key) || js["ema"][key] == value) continue;
        if (!o_.take_on_resume.ema) refuse("EMA " + key, js["ema"][key], value, "ema");
        js["ema"][key] = value;
      }
    }
  }

  // check_state, with the file named in a FormatError whose part did not name it.
  CheckedState checked_naming_file(const io::TorchValue& root,
                                   const std::filesystem::path& file = {}) const {
    try {
      return check_state(root, file);
    } catch (const FormatError& e) {
      if (e.where().find(root.where()) != std::string::npos) throw;
      throw FormatError(e.message(), root.where() + ": " + e.where());
    }
  }

  // Checks on every rank, applies only when every rank could; then rank 0's weights everywhere.
  template <class Check>
  void load_agreed(const std::string& where, Check&& check) {
    resume_from(agreed(
        [&]() -> CheckedState { return check(); }, [&](bool ok) { return parallel_->all_ok(ok); },
        [&] {
          return FormatError("could not be used by another rank (its error says why)", where);
        }));
  }

  // Applies a state every rank agreed on, then rank 0's weights everywhere and on_resume.
  void resume_from(const CheckedState& checked) {
    {
      const auto whole = whole_parameters();
      apply_state(checked);
      parallel_->start();
    }
    call([&](auto& cb) {
      if constexpr (requires { cb.on_resume(*this); }) cb.on_resume(*this);
    });
  }

  // Every gradient this rank holds dropped (a sharded optimizer's zero_grad reaches only the
  // parameters it steps).
  void zero_grads() {
    optimizer_->zero_grad(/*set_to_none=*/true);
    if constexpr (sharded) parallel_->zero_grad();
  }

  // Whether this rank's optimizer holds only part of the state (a sharding policy at stage 1 or
  // more; at stage 0 it replicates, as DataParallel).
  [[nodiscard]] bool shards_state() const {
    if constexpr (sharded)
      return parallel_->stage() > 0;
    else
      return false;
  }

  [[nodiscard]] AcrossRanks across_ranks() {
    if (!shards_state()) return {};
    if constexpr (sharded) {
      auto* p = parallel_.get();
      return {[p](at::Tensor& t) { p->sum_across(t); }, [p](at::Tensor& t) { p->max_across(t); }};
    } else {
      return {};
    }
  }

  // Every rank's own files of a set, in parallel: its optimizer shard and, with `weights`, its
  // weights file (the parameters it steps, from its masters, and their shadows). Returns every
  // rank's weights-file record (empty without `weights`), for rank 0's index.
  std::vector<WeightShardRecord> write_rank_files(const std::filesystem::path& path, bool weights) {
    const std::int64_t r = parallel_->rank(), n = parallel_->world_size();
    const WeightShardRecord record = agreed(
        [&] {
          io::save_torch_file(shard_path(path, r, n), optimizer_shard_state());
          return weights ? write_weight_shard(weight_shard_path(path, r, n), own_weight_tensors(),
                                              step_, r, n)
                         : WeightShardRecord{};
        },
        [&](bool ok) { return parallel_->all_ok(ok); },
        [&] {
          return IoError(
              "another rank could not write its shard of the checkpoint (its error says why); "
              "the previous checkpoint stays the latest",
              path.string());
        });
    std::vector<WeightShardRecord> records;
    if (!weights) return records;
    const at::Tensor mine = at::tensor(
        {static_cast<std::int64_t>(record.bytes), std::int64_t{record.crc32}}, at::kLong);
    for (const at::Tensor& t : parallel_->gather(mine))
      records.push_back({static_cast<std::uint64_t>(t[0].item<std::int64_t>()),
                         static_cast<std::uint32_t>(t[1].item<std::int64_t>())});
    return records;
  }

  // Whether what this rank would write is finite: its masters and the tensors every rank holds.
  [[nodiscard]] bool own_weights_finite() const {
    if constexpr (OwnerGatheringParallel<ParallelT>) {
      std::set<std::string> trainer_names(param_names_.begin(), param_names_.end());
      for (std::size_t i = 0; i < params_.size(); ++i)
        if (parallel_->owner(i) == parallel_->rank() &&
            !at::isfinite(parallel_->master(i)).all().template item<bool>())
          return false;
      for (const auto& item : model_->named_parameters(true))
        if (!trainer_names.contains(item.key()) &&
            !at::isfinite(item.value()).all().template item<bool>())
          return false;
    }
    return true;
  }

  // This rank's weights file: the parameters it steps (masters) and their EMA's shadows.
  [[nodiscard]] std::map<std::string, at::Tensor> own_weight_tensors() {
    std::map<std::string, at::Tensor> out;
    if constexpr (OwnerGatheringParallel<ParallelT>) {
      for (std::size_t i = 0; i < params_.size(); ++i)
        if (parallel_->owner(i) == parallel_->rank())
          out.emplace(param_names_[i], parallel_->master(i).detach());
      if constexpr (has_ema) {
        const std::map<std::string, at::Tensor> shadows = ema_->shadows_here();
        for (std::size_t i = 0; i < params_.size(); ++i) {
          const auto it = shadows.find(param_names_[i]);
          if (it != shadows.end() && parallel_->owner(i) == parallel_->rank())
            out.emplace(std::string(kEmaPrefix) + it->first, it->second.detach());
        }
      }
    }
    return out;
  }

  // The index of the weights files: each rank's size and CRC-32, and the name, dtype and shape
  // of every trainer parameter (what a reader of the set needs before opening them).
  [[nodiscard]] nlohmann::json weights_index(const std::vector<WeightShardRecord>& records) const {
    nlohmann::json files = nlohmann::json::array();
    for (const auto& rec : records) files.push_back({{"bytes", rec.bytes}, {"crc32", rec.crc32}});
    nlohmann::json tensors = nlohmann::json::object();
    if constexpr (OwnerGatheringParallel<ParallelT>)
      for (std::size_t i = 0; i < params_.size(); ++i)
        tensors[param_names_[i]] = {
            {"dtype",
             io::safetensors_detail::by_type(parallel_->master_dtype(i), param_names_[i]).name},
            {"shape", params_[i].sizes().vec()},
            {"rank", parallel_->owner(i)}};
    return {{"files", files}, {"tensors", tensors}};
  }

  // Which rank's optimizer holds which parameters' state: stage, world size and, per rank, the
  // names of its parameters in each group.
  [[nodiscard]] nlohmann::json sharding_index() const {
    nlohmann::json ranks = nlohmann::json::array();
    if constexpr (sharded) {
      for (std::int64_t r = 0; r < parallel_->world_size(); ++r) {
        nlohmann::json groups = nlohmann::json::array();
        for (const auto& g : parallel_->groups_of_rank(groups_, r)) groups.push_back(g.names);
        ranks.push_back(groups);
      }
      return {
          {"stage", parallel_->stage()}, {"world_size", parallel_->world_size()}, {"ranks", ranks}};
    }
    return {};
  }

  // This rank's shard file: what it holds and its optimizer's archive.
  [[nodiscard]] c10::IValue optimizer_shard_state() const {
    auto root = io::torch_dict();
    root.insert("format", std::string("difftrain.optimizer_shard"));
    root.insert("version", kCheckpointFormatVersion);
    root.insert("step", step_);
    root.insert("rank", parallel_->rank());
    root.insert("world_size", parallel_->world_size());
    nlohmann::json names = nlohmann::json::array();
    for (const auto& g : local_groups_) names.push_back(g.names);
    root.insert("json", names.dump());
    root.insert("optimizer", trainer_detail::bytes_tensor(optimizer_state_bytes(*optimizer_)));
    return root;
  }

  // The shards of a sharded checkpoint that hold state of this rank's parameters, read and
  // checked against the checkpoint's index. A shard that is missing is an IoError, one that does
  // not belong to this checkpoint a FormatError (resume_latest then falls back to an older set).
  [[nodiscard]] std::vector<trainer_detail::OptimizerShard> read_optimizer_shards(
      const nlohmann::json& index, std::int64_t step, const std::filesystem::path& file,
      const std::string& where) const {
    const std::string at = where + " json sharding";
    if (file.empty())
      throw ConfigError(
          "holds a sharded optimizer state, whose shards are files beside it: load "
          "it with load_checkpoint(path)",
          where);
    if (!index.is_object() || !index.contains("world_size") ||
        !index["world_size"].is_number_integer() || !index.contains("ranks") ||
        !index["ranks"].is_array())
      throw FormatError("is not an index of optimizer shards", at);
    const auto world = index["world_size"].get<std::int64_t>();
    if (world < 1 || static_cast<std::int64_t>(index["ranks"].size()) != world)
      throw FormatError("lists " + std::to_string(index["ranks"].size()) + " shards for " +
                            std::to_string(world) + " ranks",
                        at);
    std::set<std::string> mine;
    for (const auto& g : local_groups_) mine.insert(g.names.begin(), g.names.end());
    std::vector<trainer_detail::OptimizerShard> out;
    for (std::int64_t r = 0; r < world; ++r) {
      trainer_detail::OptimizerShard shard;
      try {
        shard.names = index["ranks"][static_cast<std::size_t>(r)]
                          .get<std::vector<std::vector<std::string>>>();
      } catch (const nlohmann::json::exception&) {
        throw FormatError("rank " + std::to_string(r) + "'s entry is not a list of name lists", at);
      }
      if (shard.names.size() != groups_.size())
        throw FormatError("rank " + std::to_string(r) + "'s entry has " +
                              std::to_string(shard.names.size()) + " groups, the trainer " +
                              std::to_string(groups_.size()),
                          at);
      bool needed = false;
      for (std::size_t g = 0; g < groups_.size(); ++g) {
        const std::set<std::string> known(groups_[g].names.begin(), groups_[g].names.end());
        for (const auto& n : shard.names[g]) {
          if (known.count(n) == 0)
            throw FormatError("rank " + std::to_string(r) + " holds '" + n +
                                  "', not a parameter "
                                  "of group " +
                                  std::to_string(g),
                              at);
          needed = needed || mine.count(n) != 0;
        }
      }
      if (!needed) continue;
      const std::filesystem::path shard_file = shard_path(file, r, world);
      const io::TorchValue root = io::load_torch_file(shard_file);
      const std::string w = shard_file.string();
      check_checkpoint_format(root, "difftrain.optimizer_shard", "a shard of an optimizer state");
      if (root.at("step").integer() != step || root.at("rank").integer() != r ||
          root.at("world_size").integer() != world)
        throw FormatError("belongs to another checkpoint (step " +
                              std::to_string(root.at("step").integer()) + ", rank " +
                              std::to_string(root.at("rank").integer()) + " of " +
                              std::to_string(root.at("world_size").integer()) + "; expected step " +
                              std::to_string(step) + ", rank " + std::to_string(r) + " of " +
                              std::to_string(world) + ")",
                          w);
      const nlohmann::json names = checkpoint_json(root, "names");
      if (names != index["ranks"][static_cast<std::size_t>(r)])
        throw FormatError("holds other parameters than the checkpoint's index lists for rank " +
                              std::to_string(r),
                          w);
      shard.bytes = trainer_detail::tensor_bytes(root.at("optimizer").tensor(), w + " optimizer");
      shard.where = w + " optimizer";
      out.push_back(std::move(shard));
    }
    return out;
  }

  // The optimizer state of `shards` into this rank's optimizer. A state written by an optimizer
  // over exactly this rank's parameters loads directly; otherwise (another world size, another
  // stage, a sharded state read by one optimizer or the other way round) each shard loads into
  // a temporary optimizer over its own parameters, and the states of this rank's parameters move
  // over. Parameters are matched by name, so any partition reads any other.
  template <class Load>
  void load_optimizer_shards(const std::vector<trainer_detail::OptimizerShard>& shards,
                             Load&& load_into) {
    std::vector<std::vector<std::string>> local;
    for (const auto& g : local_groups_) local.push_back(g.names);
    if (shards.size() == 1 && shards.front().names == local) {
      load_into(*optimizer_, shards.front().bytes);
      return;
    }
    std::map<std::string, at::Tensor> by_name, mine;
    for (const auto& g : groups_)
      for (std::size_t i = 0; i < g.names.size(); ++i) by_name.emplace(g.names[i], g.params[i]);
    for (const auto& g : local_groups_)  // what this rank's optimizer steps, by name
      for (std::size_t i = 0; i < g.names.size(); ++i) mine.emplace(g.names[i], g.params[i]);
    optimizer_->state().clear();
    bool options_taken = false;
    for (const auto& shard : shards) {
      std::vector<ParamGroup> gs;
      for (std::size_t g = 0; g < groups_.size(); ++g) {
        ParamGroup pg = groups_[g];
        pg.names = shard.names[g];
        pg.params.clear();
        for (const auto& n : pg.names) pg.params.push_back(by_name.at(n));
        gs.push_back(std::move(pg));
      }
      const auto temp = OptimizerPolicyT::make(gs, o_.optimizer);
      torch::optim::Optimizer& t = *temp;
      load_into(t, shard.bytes);
      for (std::size_t g = 0; g < gs.size(); ++g)
        for (std::size_t i = 0; i < gs[g].names.size(); ++i) {
          const auto it = t.state().find(t.param_groups()[g].params()[i].unsafeGetTensorImpl());
          const auto own = mine.find(gs[g].names[i]);
          if (own != mine.end() && it != t.state().end())
            optimizer_->state()[own->second.unsafeGetTensorImpl()] = std::move(it->second);
        }
      if (!options_taken) {  // the groups' settings (lr, betas, ...) as the checkpoint has them
        for (std::size_t g = 0; g < groups_.size(); ++g)
          optimizer_->param_groups()[g].set_options(t.param_groups()[g].options().clone());
        options_taken = true;
      }
    }
  }

  [[nodiscard]] std::string rank_suffix() const {
    if (parallel_->world_size() == 1) return "";
    return " (rank " + std::to_string(parallel_->rank()) + " of " +
           std::to_string(parallel_->world_size()) + ")";
  }

  template <class T>
  static std::string detail_name() {
    if constexpr (requires { T::name; })
      return std::string(T::name);
    else if constexpr (requires { T::rule_type::name; })
      return std::string(T::rule_type::name);
    else
      return "custom";
  }

  // Forward/backward of one micro-batch, in chunks when max_batch_size asks; returns its loss.
  // `last`: the step's last micro-batch, whose last backward shares gradients between ranks.
  // With a deferred read (one process) the losses wait in pending_ and this returns 0.
  double accumulate(const Batch& micro, std::size_t index, bool last) {
    const double per_micro = 1.0 / static_cast<double>(o_.accumulation_steps);
    if (!o_.max_batch_size) return backward_one(micro, per_micro, last, {index, 1.0});
    if constexpr (SplittableBatch<Batch>) {
      const std::int64_t n = micro.size();
      double total = 0.0;
      for (std::int64_t s = 0; s < n; s += *o_.max_batch_size) {
        const std::int64_t len = std::min(*o_.max_batch_size, n - s);
        const double frac = static_cast<double>(len) / static_cast<double>(n);
        total += backward_one(micro.slice(s, len), per_micro * frac, last && s + len == n,
                              {index, frac}) *
                 frac;
      }
      return total;
    } else {
      throw ConfigError("max_batch_size needs a Batch with size() and slice(start, length)",
                        "Trainer options");
    }
  }

  // Where a loss goes in the step's report: its micro-batch, and its share of that micro-batch
  // (a chunk's fraction of the samples when max_batch_size splits it).
  struct LossSlot {
    std::size_t micro;
    double frac;
  };

  // One process reads the step's losses once, after all its backward passes are queued: a GPU
  // then runs the step's forwards and backwards without waiting for the host between them.
  // With several ranks each loss is read before the last backward, where the ranks must agree
  // that all were finite before gradients are shared.
  [[nodiscard]] bool deferred_read() const { return parallel_->world_size() == 1; }

  // The loss of each of `micros` micro-batches from pending_, in one transfer.
  std::vector<double> read_pending_losses(std::size_t micros) {
    std::vector<double> out(micros, 0.0);
    if (pending_.empty()) return out;
    std::vector<at::Tensor> losses;
    losses.reserve(pending_.size());
    for (const auto& p : pending_) losses.push_back(p.loss.reshape({}).to(at::kDouble));
    const at::Tensor host =
        (losses.size() == 1 ? losses.front().reshape({1}) : at::stack(losses)).cpu();
    const double* v = host.data_ptr<double>();
    for (std::size_t i = 0; i < pending_.size(); ++i)
      out[pending_[i].slot.micro] += v[i] * pending_[i].slot.frac;
    pending_.clear();
    return out;
  }

  // `sync`: the step's last backward. With several ranks, before it the ranks agree that every
  // loss of the step was finite; a rank that already saw a non-finite one computes nothing more
  // until then (unless the policy communicates inside forward and backward: see lockstep).
  double backward_one(const Batch& b, double weight, bool sync, LossSlot slot) {
    if (step_bad_ && !lockstep()) {
      if (sync) (void)parallel_->all_ok(false);
      return std::nan("");
    }
    parallel_->before_forward(sync);
    at::Tensor loss;
    {
      RECORD_USER_SCOPE("difftrain::forward");
      if (precision_.autocast) {
        const c10::DeviceType dev = params_.empty() ? c10::kCPU : params_.front().device().type();
        AutocastGuard autocast(dev, precision_.dtype);
        loss = model_->loss(b);
      } else {
        loss = model_->loss(b);
      }
    }
    if (loss.numel() != 1)
      throw ShapeError("loss must be a scalar, got shape " + c10::str(loss.sizes()), "Model::loss");
    // Checked before this loss's backward: a mistake here never reaches the weights.
    if (!at::isFloatingType(loss.scalar_type()))
      throw DeviceError("loss must be a floating-point scalar, got dtype " +
                            std::string(c10::toString(loss.scalar_type())),
                        "Model::loss");
    if (!loss.requires_grad())
      throw ConfigError(
          "the loss does not lead back to any trainable weight: it was computed under a no-grad "
          "guard or detached, or every parameter it uses is frozen",
          "Model::loss");
    if (deferred_read()) {  // one rank: nothing to agree on before the gradients are final
      if (sync) {
        parallel_->before_backward(loss);
        parallel_->guard([&] {
          RECORD_USER_SCOPE("difftrain::backward");
          scaled_backward(loss, weight);
        });
      } else {
        RECORD_USER_SCOPE("difftrain::backward");
        scaled_backward(loss, weight);
      }
      pending_.push_back({loss.detach(), slot});
      return 0.0;
    }
    const double value = loss.detach().item<double>();
    step_bad_agreed_only_ = false;
    if (!std::isfinite(value)) step_bad_ = true;
    if (step_bad_) {
      // Its gradients are dropped with the step; the backward only meets the other ranks'.
      if (lockstep() && !sync) scaled_backward(loss, weight);
      if (sync) (void)parallel_->all_ok(false);
      return value;
    }
    if (!sync) {
      RECORD_USER_SCOPE("difftrain::backward");
      scaled_backward(loss, weight);
      return value;
    }
    if (!parallel_->all_ok(true)) {
      step_bad_ = true;
      step_bad_agreed_only_ = true;
      return std::nan("");
    }
    parallel_->before_backward(loss);
    parallel_->guard([&] {
      RECORD_USER_SCOPE("difftrain::backward");
      scaled_backward(loss, weight);
    });
    return value;
  }

  // Whether every rank must run every forward and backward of a step, even after a non-finite
  // loss: the policy communicates inside them (stage 3 gathers parameters unit by unit).
  [[nodiscard]] bool lockstep() const {
    if constexpr (requires(const ParallelT& p) {
                    { p.communicates_in_passes() } -> std::convertible_to<bool>;
                  })
      return parallel_->communicates_in_passes();
    else
      return false;
  }

  // backward of loss * weight (* the gradient scale): without a scaler the weight enters as the
  // incoming gradient, the same numbers without a multiply and its backward node.
  void scaled_backward(const at::Tensor& loss, double weight) {
    if (scaler_.enabled())
      scaler_.scale(loss * weight).backward();
    else if (weight == 1.0)
      loss.backward();
    else
      loss.backward(at::full_like(loss, weight));
  }

  void finish(StepInfo& info, std::chrono::steady_clock::time_point start) {
    info.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    RECORD_USER_SCOPE("difftrain::callbacks");
    call([&](auto& cb) {
      if constexpr (requires { cb.on_step_end(*this, info); }) cb.on_step_end(*this, info);
    });
  }

  // The EMA::Share of this rank: the trainer's parameters other ranks step are theirs; those it
  // steps average their masters (copies when offloaded or under mixed precision).
  [[nodiscard]] ema::Share ema_share() const requires has_ema {
    ema::Share share;
    if constexpr (OwnerGatheringParallel<ParallelT>) {
      const auto named = model_->named_parameters(true);
      for (std::size_t i = 0; i < params_.size(); ++i) {
        const std::int64_t owner = parallel_->owner(i);
        if (owner != parallel_->rank() && owner != -1) {
          share.elsewhere.insert(param_names_[i]);
        } else {
          const at::Tensor master = parallel_->master(i);
          if (!master.is_same(params_[i]) && named.find(param_names_[i]) != nullptr)
            share.sources.emplace(param_names_[i], master);
        }
      }
    }
    return share;
  }

  // Which of the trainer's parameters an EMA kept per rank tracks on some rank: the names it
  // tracks here and those held elsewhere (every name the tracking rules keep is one or the
  // other).
  [[nodiscard]] std::set<std::string> ema_tracked_names() const requires has_ema {
    const std::vector<std::string> here = ema_->names();
    std::set<std::string> out(here.begin(), here.end());
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (ema_->elsewhere().contains(param_names_[i]) &&
          ema_->tracks_parameter(param_names_[i], params_[i]))
        out.insert(param_names_[i]);
    return out;
  }

  // `take(name, shadow)` for every shadow of the EMA: with `trainer_params`, those of the
  // trainer's parameters too, which under a share come from their owners (every rank calls it
  // together then: one broadcast per bucket, every rank getting every shadow); then the others
  // this rank holds (frozen parameters, tracked buffers: alike on every rank).
  template <class Take>
  void for_each_ema_shadow(bool trainer_params, Take&& take) requires has_ema {
    std::map<std::string, at::Tensor> own = ema_->shadows_here();
    if (!trainer_params || ema_->is_share()) {
      if constexpr (OwnerGatheringParallel<ParallelT>) {
        if (trainer_params) {
          // An owner sends the master of a parameter its EMA does not track (the shapes must
          // line up): the receivers pass over those names.
          const std::set<std::string> tracked = ema_tracked_names();
          parallel_->from_owners(
              [&](std::size_t i) {
                const auto it = own.find(param_names_[i]);
                return it != own.end() ? it->second : parallel_->master(i);
              },
              [&](std::size_t i, const at::Tensor& value) {
                if (tracked.contains(param_names_[i])) take(param_names_[i], value);
              });
        }
      }
      for (const auto& name : param_names_) own.erase(name);
    }
    for (const auto& [name, shadow] : own) take(name, shadow);
  }

  // Callbacks run on rank 0 only (they print and write), except those that must act on every
  // rank (a checkpoint's state is gathered from all; a stop must stop all) and say so.
  template <class F>
  void call(F&& f) {
    const bool main = parallel_->rank() == 0;
    std::apply(
        [&](auto&... cb) {
          (
              [&](auto& c) {
                if (main || EveryRankCallback<std::remove_cvref_t<decltype(c)>>) f(c);
              }(cb),
              ...);
        },
        callbacks_);
  }

  Model* model_;
  Options o_;
  std::vector<ParamGroup> groups_;
  std::vector<ParamGroup> local_groups_;  // the groups this rank's optimizer steps (all unsharded)
  std::vector<at::Tensor> params_;
  std::vector<std::string> param_names_;  // params_' names, in the same order
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::optional<schedule::LrScheduler<ScheduleT>> scheduler_;
  std::unique_ptr<EmaT> ema_;
  ClippingT clipping_;
  PrecisionChoice precision_;  // before scaler_, which it enables
  GradScaler scaler_;
  CallbacksT callbacks_;
  std::int64_t step_ = 0;
  std::int64_t nonfinite_ = 0;
  std::int64_t overflow_skips_ = 0;
  bool stop_requested_ = false;
  std::unique_ptr<ParallelT> parallel_;
  std::vector<double> option_base_lrs_;  // this trainer's settings, before any resume
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> option_groups_;
  struct PendingLoss {
    at::Tensor loss;  // detached, where the model computed it
    LossSlot slot;
  };
  std::vector<PendingLoss> pending_;   // this step's losses, not yet read (one process)
  bool step_bad_ = false;              // a loss of this step was not finite (here or elsewhere)
  bool step_bad_agreed_only_ = false;  // ... and only another rank saw it
};

}  // namespace difftrain::train
