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
#include "difftrain/train/checkpoint_state.hpp"
#include "difftrain/train/clipping.hpp"
#include "difftrain/train/optimizer.hpp"
#include "difftrain/train/optimizer_archive.hpp"
#include "difftrain/train/parallel.hpp"
#include "difftrain/train/precision.hpp"
#include "difftrain/train/trainer_config.hpp"
#include "difftrain/train/weight_shards.hpp"

namespace difftrain::train {

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
    // The trainer's own settings that change the collectives, the same on every rank.
    if constexpr (requires(const ParallelT& p,
                           const std::vector<std::pair<std::string, std::string>>& s) {
                    p.agree_on(s, std::string());
                  })
      parallel_->agree_on(collective_settings(), "Trainer options");
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
    switch_weights(/*train=*/true);
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

  /// Puts the weights to evaluate and save in the model: a schedule-free optimizer's average x
  /// (train/schedule_free.hpp), until the next step or checkpoint takes the training weights y
  /// back; nothing for any other optimizer. Call it before sampling or exporting the model
  /// (SampleEvery does). Every rank calls it (a sharded run sends the owners' values).
  void use_evaluation_weights() { switch_weights(/*train=*/false); }

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
  [[nodiscard]] nlohmann::json fingerprint() const;

  /// Everything needed to continue bit-identically, as one torch.save-compatible value (a
  /// sharded optimizer's state is in files beside it: save_checkpoint writes them).
  [[nodiscard]] c10::IValue state() { return make_state(nullptr); }

 private:
  // Every rank's size and CRC-32 of its own files of a set, in rank order: its optimizer shard,
  // and its weights file (none when the set holds no weights files).
  struct RankFileRecords {
    std::vector<WeightShardRecord> optimizer, weights;
  };
  // The state; with `files` (the records of every rank's files of a set) their index, and when
  // the trainer's parameters and their EMA are in weights files, without those.
  [[nodiscard]] c10::IValue make_state(const RankFileRecords* files, bool contents = true);
  // The state save_checkpoint writes: complete on rank 0, only its collectives on the others.
  [[nodiscard]] c10::IValue state_for_writing() {
    return make_state(nullptr, /*contents=*/parallel_->rank() == 0);
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
    /// Set when this rank has no saved CUDA generators of its own (a resume with more ranks than
    /// wrote the checkpoint): its CUDA generators start from this seed (+ the device index).
    std::optional<std::uint64_t> cuda_seed;
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
                                         const std::filesystem::path& file = {}) const;

  /// The applying half of load_state; `s` must come from check_state on this trainer.
  void apply_state(const CheckedState& s);

  /// Writes the state atomically (temporary file, fsync, rename, fsync of the folder).
  /// In a distributed run every rank calls it (the state gathers each rank's generator); rank 0
  /// writes and the others wait until it has, and learn whether it could. Under a sharding
  /// policy every rank first writes its own files of the set (weights_in_shards says which).
  void save_checkpoint(const std::filesystem::path& path);

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
  void load_checkpoint(const std::filesystem::path& path);

  /// Whether every trained parameter is finite (frozen ones do not change: an fp8 base or a
  /// swapped block is not read).
  [[nodiscard]] bool all_finite() const {
    for (const at::Tensor& p : model_->parameters())
      if (p.requires_grad() && !at::isfinite(p).all().item<bool>()) return false;
    return true;
  }

 private:
  // MultiTrainer saves and resumes its trainers together, agreeing across ranks as one.
  template <class, class>
  friend class MultiTrainer;
  // The schedule's LR (for a base LR of 1) at steps from the first to far past any horizon: two
  // schedules with different options differ somewhere here.
  [[nodiscard]] nlohmann::json schedule_curve() const;

  // What the clipping policy does to a few gradients (small, large, huge, at several steps): two
  // policies with different options (max_norm, a clip value, a step string) differ somewhere here.
  [[nodiscard]] nlohmann::json clipping_probe() const;

  // An optimizer group's settings besides its LR (which the schedule sets), for the optimizers
  // difftrain names; another optimizer's are not compared.
  static nlohmann::json optimizer_settings(const torch::optim::OptimizerOptions& o);

  // The keys of the EMA rule's state() that count updates: those the rule declares (RuleByName
  // says which for the rule it chose); a rule that declares none is probed: the keys three
  // updates change.
  [[nodiscard]] std::vector<std::string> ema_counter_keys() const requires has_ema;

  // The EMA rule's options as its state() names them: the state of a rule made from this
  // trainer's options, less its counters.
  [[nodiscard]] nlohmann::json ema_options() const requires has_ema;

  // The saved settings against this trainer's: a difference is a ConfigError naming the setting,
  // unless take_on_resume lists it (the EMA's options are then replaced in `js` here, so the rule
  // loads with this trainer's).
  void check_settings(nlohmann::json& js, const std::string& where) const;

  // check_state, with the file named in a FormatError whose part did not name it.
  CheckedState checked_naming_file(const io::TorchValue& root,
                                   const std::filesystem::path& file = {}) const;

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
  RankFileRecords write_rank_files(const std::filesystem::path& path, bool weights);

  // Whether what this rank would write is finite: its masters and the tensors every rank holds.
  [[nodiscard]] bool own_weights_finite() const;

  // This rank's weights file: the parameters it steps (masters) and their EMA's shadows.
  [[nodiscard]] std::map<std::string, at::Tensor> own_weight_tensors();

  // The index of the weights files: each rank's size and CRC-32, and the name, dtype and shape
  // of every trainer parameter (what a reader of the set needs before opening them).
  [[nodiscard]] nlohmann::json weights_index(const std::vector<WeightShardRecord>& records) const;

  // Which rank's optimizer holds which parameters' state: stage, world size and, per rank, the
  // names of its parameters in each group.
  [[nodiscard]] nlohmann::json sharding_index() const;

  // This rank's shard file: what it holds and its optimizer's archive.
  [[nodiscard]] c10::IValue optimizer_shard_state() const;

  // The shards of a sharded checkpoint that hold state of this rank's parameters, read and
  // checked against the checkpoint's index. A shard that is missing is an IoError, one that does
  // not belong to this checkpoint a FormatError (resume_latest then falls back to an older set).
  [[nodiscard]] std::vector<trainer_detail::OptimizerShard> read_optimizer_shards(
      const nlohmann::json& index, std::int64_t step, const std::filesystem::path& file,
      const std::string& where) const;

  // The optimizer state of `shards` into this rank's optimizer. A state written by an optimizer
  // over exactly this rank's parameters loads directly; otherwise (another world size, another
  // stage, a sharded state read by one optimizer or the other way round) each shard loads into
  // a temporary optimizer over its own parameters, and the states of this rank's parameters move
  // over. Parameters are matched by name, so any partition reads any other.
  template <class Load>
  void load_optimizer_shards(const std::vector<trainer_detail::OptimizerShard>& shards,
                             Load&& load_into);

  [[nodiscard]] std::string rank_suffix() const {
    if (parallel_->world_size() == 1) return "";
    return " (rank " + std::to_string(parallel_->rank()) + " of " +
           std::to_string(parallel_->world_size()) + ")";
  }

  void switch_weights(bool train) {
    auto* switching = dynamic_cast<SwitchesEvaluationWeights*>(optimizer_.get());
    if (switching == nullptr || switching->training_weights() == train) return;
    if (train)
      switching->train_weights();
    else
      switching->eval_weights();
    if constexpr (sharded) parallel_->after_optimizer_step();  // the owners' values to all
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

  // What changes the number and order of a step's collectives: its micro-batches and chunks, the
  // scaler's overflow check, the clipping's norm, the NaN policy and the parameter groups.
  [[nodiscard]] std::vector<std::pair<std::string, std::string>> collective_settings() const {
    std::string groups;
    for (const auto& g : groups_)
      groups += (groups.empty() ? "" : ", ") + g.label + " (" + std::to_string(g.params.size()) +
                " parameters)";
    return {{"accumulation_steps", std::to_string(o_.accumulation_steps)},
            {"max_batch_size", o_.max_batch_size ? std::to_string(*o_.max_batch_size) : "unset"},
            {"precision", std::string(precision_.name)},
            {"clipping", std::string(ClippingT::name)},
            {"on_nan", o_.on_nan == NanPolicy::stop ? "stop" : "skip"},
            {"param_groups", groups}};
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

// The checkpoint members (state, check, apply, the files of a sharded set) are defined there.
#include "difftrain/train/trainer_checkpoint.hpp"
