#pragma once
// Config::Parallel = distributed::ShardedDataParallel: data parallelism whose training state is
// sharded over the ranks, as DeepSpeed's ZeRO and torch's ZeroRedundancyOptimizer do:
//
//   stage 1  the optimizer state: each rank's optimizer steps only the parameters it owns, so
//            its moments take 1/N of the memory; gradients are averaged by all-reduce as in
//            DataParallel, and after the step every owner sends the parameters it updated;
//   stage 2  and the gradients: each bucket of gradients is reduced to the rank that owns it,
//            and the other ranks drop theirs as soon as they have sent them;
//   stage 3  and the parameters during forward and backward (FSDP's fully_shard): the model runs
//            its blocks as units (nn::in_unit, nn/unit_scope.hpp); a unit's parameters are sent
//            by their owners to every rank before the unit runs, freed by the others after it
//            (reshard_after_forward), sent again when backward reaches the unit and freed once
//            the unit's gradients are in. The next unit's parameters are on the wire while the
//            current one computes (prefetch, in the order of the last forward and its reverse).
//            A rank keeps whole only the parameters it owns and those outside every unit, also
//            between steps (reshard_after_step): what reads the model then (sampling, saving)
//            takes a whole_parameters() scope on every rank; the trainer takes one for its
//            checkpoints and its EMA update. Parameters that do not train (a frozen base under
//            LoRA) are not sharded.
//
// Stage 0 is DataParallel itself (every rank keeps everything; c10d's reducer overlaps the
// all-reduce with backward), so that a program can choose the stage at run time.
//
// Ownership is by whole parameters: the parameters, in the trainer's group order, are cut into
// N contiguous runs of about equal size (ZeroRedundancyOptimizer also keeps parameters whole).
// So every rank's optimizer is an ordinary optimizer over ordinary tensors and every optimizer
// policy works and steps exactly as on one process; the price is a balance within one tensor.
//
// What DataParallel guarantees holds here too: every rank starts from rank 0's weights, buffers
// are rank 0's before every forward, accumulation micro-batches before the last communicate
// nothing, a NaN on one rank skips the step on all. Clipping computes the global norm from each
// rank's share (one scalar all-reduce), and the fp16 scaler's overflow flags are summed so that
// every rank skips the same steps. A parameter that no rank used in a step keeps no gradient and
// its optimizer skips it, as on one process (each bucket carries a used-flag per parameter, so
// unused parameters need no option and no graph search).
//
// Communication is bucketed (bucket_cap_mb, DDP's 25 MiB) and pipelined, as DDP's reducer: a hook
// on each parameter's gradient accumulator counts the gradients of the step's last backward, and
// a bucket goes out as soon as all of its are there (buckets in the same order on every rank,
// last to first), while backward goes on; at stage 2 a rank drops each gradient it does not own
// as soon as it is packed.
//
// offload_optimizer (ZeRO-Offload, FSDP's CPUOffload for the optimizer): the optimizer steps
// copies of this rank's parameters kept in host memory (pinned when the parameters are on a GPU),
// so its state lives there too; the reduced gradients are copied to host memory and dropped on
// the device, and the updated values are copied back before they are sent to the other ranks.
// offload_parameters (stage 3; FSDP's CPUOffload(offload_params=True)) goes further: a unit's
// parameters live between its uses only in those copies, the ones this rank owns too, so the
// device holds no unit between steps and only the units running or arriving during a pass; an
// owner copies its share from host memory just before it is sent. In a world of one it is the
// way to train a model whose weights, gradients and optimizer state outgrow the device.
//
// Mixed precision (FSDP's MixedPrecisionPolicy): with param_dtype the model's parameters hold
// that dtype, so forward and backward compute in it and stage 3 gathers it; the optimizer steps
// copies in the parameters' own dtype (master weights) and writes the result back rounded.
// Gradients are reduced in reduce_dtype (param_dtype's by default, as FSDP) and land straight in
// the copies' gradients. whole_parameters() gives every rank the master values, in the masters'
// dtype, for as long as it lives: checkpoints, the EMA and a resume see full precision.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/distributed/data_parallel.hpp"
#include "difftrain/distributed/replicas.hpp"
#include "difftrain/distributed/world.hpp"
#include "difftrain/nn/unit_scope.hpp"
#include "difftrain/train/optimizer.hpp"

namespace difftrain::distributed {

class ShardedDataParallel : nn::UnitListener {
 public:
  static constexpr std::string_view name = "sharded-data-parallel";

  struct Options {
    /// The processes to share steps with; null reads them from the launcher's environment.
    std::shared_ptr<World> world{};
    WorldOptions world_options{};
    /// ZeRO's stage: 1 shards the optimizer state, 2 also the gradients; 0 shards nothing
    /// (DataParallel).
    int stage = 1;
    /// The size of a bucket of gradients or parameters on the wire (a larger parameter travels
    /// alone).
    double bucket_cap_mb = 25.0;
    /// Rank 0's buffers before every forward, as DataParallel.
    bool broadcast_buffers = true;
    /// Stage 0 only (DataParallel's option): stages 1 to 3 find unused parameters by
    /// themselves, without a graph search.
    bool find_unused_parameters = false;
    /// Keep this rank's optimizer (its copies of the parameters it owns, their gradients and the
    /// optimizer's state) in host memory; stages 1 to 3.
    bool offload_optimizer = false;
    /// Stage 3: between its uses, a unit's parameters live only in host memory (the optimizer's
    /// copies, offload_optimizer implied), this rank's share included; needs reshard_after_step.
    /// A world of one takes it too.
    bool offload_parameters = false;
    /// Send each bucket of gradients as soon as backward has produced all of them, while the
    /// rest of backward runs (as DDP's reducer); off: all of them after backward.
    bool overlap_backward = true;
    /// Stage 3: which of the modules the model runs through nn::in_unit are units, by their
    /// name in the model (named_modules': "down_blocks.1") and the module; empty: all of them.
    /// A unit's parameters are those of its module that no unit inside it holds.
    std::function<bool(const std::string& name, const torch::nn::Module& module)> wrap{};
    /// Stage 3: free a unit's parameters after its forward (FSDP's reshard_after_forward); off:
    /// keep them until its backward is done (less communication, the memory of every unit).
    bool reshard_after_forward = true;
    /// Stage 3: send the next unit's parameters while the current unit computes.
    bool prefetch = true;
    /// Stage 3: between steps too, each rank holds only its own share of the units' parameters
    /// (and those outside every unit); whatever reads the model between steps (sampling,
    /// saving) takes a whole_parameters() scope on every rank. Off: every rank holds every
    /// parameter between steps (stage 2's memory at that point, nothing to take).
    bool reshard_after_step = true;
    /// Mixed precision, stages 1 to 3 (FSDP's param_dtype): the dtype the parameters compute
    /// and travel in; the optimizer steps copies in their own dtype. Inputs are the caller's to
    /// give in this dtype (FSDP's cast_forward_inputs). Unset: parameters keep their dtype.
    std::optional<at::ScalarType> param_dtype{};
    /// The dtype gradients are reduced in (FSDP's reduce_dtype): unset, param_dtype's, or the
    /// gradients' own without it.
    std::optional<at::ScalarType> reduce_dtype{};
  };

  /// Units whose name matches `pattern` (std::regex_match over named_modules' names), for
  /// Options::wrap: "(down|up)_blocks\\.\\d+|mid_block" or "transformer_blocks\\.\\d+".
  [[nodiscard]] static std::function<bool(const std::string&, const torch::nn::Module&)>
  units_named(const std::string& pattern) {
    return [re = std::regex(pattern)](const std::string& name, const torch::nn::Module&) {
      return std::regex_match(name, re);
    };
  }
  /// Units whose module is a `M` (a ModuleHolder's Impl, e.g. models::DiTBlockImpl<Backend, Act>).
  template <class M>
  [[nodiscard]] static std::function<bool(const std::string&, const torch::nn::Module&)>
  units_of_type() {
    return [](const std::string&, const torch::nn::Module& m) {
      return dynamic_cast<const M*>(&m) != nullptr;
    };
  }

  ShardedDataParallel(torch::nn::Module& model, const std::vector<at::Tensor>& params,
                      const Options& o)
      : model_(&model), params_(params), o_(o) {
    world_ = o_.world ? o_.world : World::from_environment(o_.world_options);
    // Before anything a rank could refuse alone: every rank checks the same options.
    if (world_->distributed())
      check_same_settings(*world_, settings(), "ShardedDataParallel options");
    if (o_.stage < 0 || o_.stage > 3)
      throw ConfigError("is " + std::to_string(o_.stage) +
                            "; the stages are 0 (replicated, DataParallel), 1 (optimizer state "
                            "sharded), 2 (and gradients) and 3 (and parameters)",
                        "ShardedDataParallel options: stage");
    if (!(o_.bucket_cap_mb > 0.0))
      throw ConfigError("must be positive", "ShardedDataParallel options: bucket_cap_mb");
    for (std::size_t i = 0; i < params_.size(); ++i)
      index_.emplace(params_[i].unsafeGetTensorImpl(), i);
    if (o_.offload_parameters) {
      if (o_.stage != 3)
        throw ConfigError("needs stage 3 (the only stage that frees parameters between uses)",
                          "ShardedDataParallel options: offload_parameters");
      if (!o_.reshard_after_step)
        throw ConfigError(
            "needs reshard_after_step (between steps the parameters live in host memory only)",
            "ShardedDataParallel options: offload_parameters");
      o_.offload_optimizer = true;  // the copies in host memory are what the parameters live in
    }
    if (o_.offload_optimizer && o_.stage == 0)
      throw ConfigError("needs stage 1, 2 or 3 (at stage 0 every rank steps every parameter)",
                        "ShardedDataParallel options: offload_optimizer");
    for (const auto& [dtype, option] :
         {std::pair{o_.param_dtype, "param_dtype"}, std::pair{o_.reduce_dtype, "reduce_dtype"}}) {
      if (!dtype) continue;
      if (!at::isFloatingType(*dtype))
        throw ConfigError(
            std::string("is ") + c10::toString(*dtype) + ", not a floating-point dtype",
            std::string("ShardedDataParallel options: ") + option);
      if (o_.stage == 0)
        throw ConfigError("needs stage 1, 2 or 3 (stage 0 is DataParallel: use autocast there)",
                          std::string("ShardedDataParallel options: ") + option);
    }
    if (o_.param_dtype)
      for (const auto& q : params_)
        if (q.scalar_type() != *o_.param_dtype) mixed_ = true;
    // FSDP's rule: micro-batches that do not communicate accumulate their gradients in
    // reduce_dtype when it is wider than param_dtype.
    widen_ = mixed_ && o_.reduce_dtype && *o_.reduce_dtype != *o_.param_dtype;
    if (widen_) wide_grads_.resize(params_.size());
    if (o_.stage == 0) {
      replicated_ = std::make_unique<DataParallel>(
          model, params,
          DataParallel::Options{.world = world_,
                                .world_options = o_.world_options,
                                .bucket_cap_mb = o_.bucket_cap_mb,
                                .broadcast_buffers = o_.broadcast_buffers,
                                .find_unused_parameters = o_.find_unused_parameters});
      owner_.assign(params_.size(), -1);  // everyone's
      return;
    }
    partition();
    if (o_.offload_optimizer || mixed_) {
      copies_.resize(params_.size());
      for (std::size_t i = 0; i < params_.size(); ++i) {
        if (owner_[i] != world_->rank()) continue;
        const at::Tensor& p = params_[i];
        const bool host = o_.offload_optimizer;
        copies_[i] = at::empty(p.sizes(), p.options()
                                              .device(host ? at::Device(at::kCPU) : p.device())
                                              .requires_grad(false)
                                              .pinned_memory(host && p.is_cuda()));
      }
    }
    if (world_->distributed()) check_same_model(*world_, params_, *model_, "ShardedDataParallel");
    start();  // in the parameters' own dtype: the copies take rank 0's values exactly
    if (mixed_) {
      for (const auto& q : params_) master_dtypes_.push_back(q.scalar_type());
      to_param_dtype();
    }
    make_buckets();
    bucket_of_.assign(params_.size(), 0);
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      for (const std::size_t i : buckets_[b].params) bucket_of_[i] = b;
    waiting_.assign(buckets_.size(), 0);
    ready_.assign(params_.size(), false);
    // A world of one frees and brings parameters only when they live in host memory meanwhile.
    if (o_.stage == 3 && (world_->distributed() || o_.offload_parameters)) listen();
    hook_gradients();
  }

  ShardedDataParallel(const ShardedDataParallel&) = delete;
  ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;
  ~ShardedDataParallel() override {
    *alive_ = false;  // hooks outliving this object do nothing
    nn::stop_listening_to_units(this);
  }

  /// Refuses on every rank, naming the setting, unless every rank holds the same `settings` (the
  /// trainer's own that change the collectives: accumulation steps, chunking, precision).
  void agree_on(const std::vector<RankSetting>& settings, const std::string& who) const {
    check_same_settings(*world_, settings, who);
  }

  [[nodiscard]] std::int64_t rank() const { return world_->rank(); }
  [[nodiscard]] std::int64_t world_size() const { return world_->size(); }
  [[nodiscard]] const World& world() const { return *world_; }
  [[nodiscard]] int stage() const { return o_.stage; }

  /// How many buckets went out while backward was still running, over the run (overlap).
  [[nodiscard]] std::int64_t buckets_sent_during_backward() const { return sent_during_backward_; }

  /// Stage 3: how the parameters travelled, over the run.
  struct UnitStats {
    std::int64_t units = 0;       ///< modules that are units
    std::int64_t gathers = 0;     ///< units whose parameters were sent to every rank
    std::int64_t prefetched = 0;  ///< of those, sent ahead while another unit computed
    std::int64_t releases = 0;    ///< units whose parameters were freed on the other ranks
    /// The most bytes of parameters this rank held during a forward or backward, from the
    /// second on (the first finds the units, starting from whole weights).
    std::int64_t peak_parameter_bytes = 0;
    std::int64_t largest_unit_bytes = 0;  ///< the largest unit, whole
  };
  [[nodiscard]] UnitStats unit_stats() const {
    UnitStats s = stats_;
    s.units = static_cast<std::int64_t>(units_.size());
    return s;
  }

  /// Stage 3 gathers parameters inside forward and backward: every rank must run every one of
  /// them (the trainer keeps ranks in step even after a non-finite loss).
  [[nodiscard]] bool communicates_in_passes() const {
    return o_.stage == 3 && world_->distributed();
  }

  /// The rank whose optimizer steps parameter `i` (an index into the trainer's parameters); -1
  /// at stage 0, where every rank steps every parameter.
  [[nodiscard]] std::int64_t owner(std::size_t i) const { return owner_.at(i); }

  // ---- the trainer's hooks (train/parallel.hpp) ---------------------------------------------

  /// Every parameter and buffer becomes rank 0's (and the copies an offloaded or mixed-precision
  /// optimizer steps take the parameters' values: at start, and after a resume inside
  /// whole_parameters(), where the parameters hold the masters' dtype).
  void start() {
    if (replicated_) return replicated_->start();
    if (world_->distributed()) {
      std::vector<at::Tensor> all(params_.begin(), params_.end());
      for (const auto& b : model_->buffers()) all.push_back(b);
      broadcast_from_rank0(*world_, all);
    }
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < copies_.size(); ++i)
      if (copies_[i].defined()) copies_[i].copy_(params_[i].detach());
  }

  void before_forward(bool sync) {
    if (replicated_) return replicated_->before_forward(sync);
    if (widen_) widen_gradients();
    if (listening_) begin_pass();
    if (world_->distributed() && o_.broadcast_buffers)
      broadcast_from_rank0(*world_, model_->buffers());
  }

  /// True when `ok` on every rank.
  [[nodiscard]] bool all_ok(bool ok) { return world_->all_true(ok); }

  /// Before the backward that shares gradients: buckets go out as their gradients arrive.
  void before_backward(const at::Tensor& loss) {
    if (replicated_) return replicated_->before_backward(loss);
    if (world_->distributed() && o_.overlap_backward) arm();
  }

  /// Runs the step's last backward, then shares its gradients: all-reduced (stage 1) or reduced
  /// to their owners (stage 2). A failure of the group is a DistributedError.
  template <class F>
  void guard(F&& f);

  [[nodiscard]] double mean(double x) { return world_->mean(x); }

  [[nodiscard]] std::vector<at::Tensor> gather(const at::Tensor& t) {
    return world_->all_gather(t);
  }

  /// Rank 0's `ok`, known on every rank (and a barrier).
  [[nodiscard]] bool decide(bool ok) { return world_->rank0_decides(ok); }

  // ---- sharding (train::ShardingParallel) ---------------------------------------------------

  /// `groups` with only the parameters rank `r` owns, in the same order.
  [[nodiscard]] std::vector<train::ParamGroup> groups_of_rank(
      const std::vector<train::ParamGroup>& groups, std::int64_t r) const;

  [[nodiscard]] std::vector<at::Tensor> owned_params() const;

  void sum_across(at::Tensor& t) { world_->all_reduce_sum(t); }
  void max_across(at::Tensor& t) { world_->all_reduce_max(t); }

  void zero_grad() {
    for (auto& p : params_) p.mutable_grad().reset();
    for (auto& c : copies_)
      if (c.defined()) c.mutable_grad().reset();
    for (auto& w : wide_grads_) w.reset();
  }

  /// Every owner sends the parameters its optimizer updated, bucket by bucket. At stage 3 the
  /// other ranks' shares of the units stay with their owners (reshard_after_step), or arrive
  /// whole as at the other stages.
  void after_optimizer_step();

  /// A step that changed nothing: every parameter as after a step (stage 3 frees parameters in
  /// forward and backward; the other stages hold them whole throughout).
  void after_skipped_step();

  /// Every parameter whole on every rank while it lives, at full precision: for sampling,
  /// saving, an EMA update or anything else that reads the model between steps at stage 3 or
  /// under mixed precision (where the parameters hold the masters' values and dtype meanwhile).
  /// Every rank makes one (the parameters travel); nothing happens when neither applies, or when
  /// one is alive already.
  class WholeParameters {
   public:
    explicit WholeParameters(ShardedDataParallel* p) : p_(p) {
      if (p_ != nullptr && !p_->gather_whole()) p_ = nullptr;
    }
    WholeParameters(const WholeParameters&) = delete;
    WholeParameters& operator=(const WholeParameters&) = delete;
    WholeParameters(WholeParameters&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
    WholeParameters& operator=(WholeParameters&&) = delete;
    ~WholeParameters() {
      if (p_ != nullptr) p_->end_whole();
    }

   private:
    ShardedDataParallel* p_;
  };
  [[nodiscard]] WholeParameters whole_parameters() {
    return WholeParameters((listening_ && o_.reshard_after_step) || mixed_ ? this : nullptr);
  }

  /// Whether whole_parameters() makes parameters travel: a rank holds only its share of them
  /// between steps (stage 3 with reshard_after_step), or they compute in param_dtype while the
  /// masters are elsewhere (mixed precision). Reading the model then takes one on every rank.
  [[nodiscard]] bool whole_needs_every_rank() const {
    return world_->distributed() && ((listening_ && o_.reshard_after_step) || mixed_);
  }

  /// The tensor holding parameter i's full-precision value on the rank that owns it: the copy
  /// its optimizer steps (offloaded or under mixed precision), else the parameter itself.
  [[nodiscard]] at::Tensor master(std::size_t i) const {
    return !copies_.empty() && copies_.at(i).defined() ? copies_[i] : params_.at(i);
  }
  /// The dtype of parameter i's masters (its own dtype unless under mixed precision).
  [[nodiscard]] at::ScalarType master_dtype(std::size_t i) const {
    return master_dtypes_.empty() ? params_.at(i).scalar_type() : master_dtypes_.at(i);
  }

  /// Each owner's values for its parameters, on every rank: on the owner `mine(i)` gives
  /// parameter i's (its shape, in its masters' dtype, on any device); every rank gets
  /// `take(i, value)` for every parameter, its own included (the value is then the owner's
  /// tensor, not a copy, unless it was on another device). One broadcast per bucket and dtype, on
  /// the parameters' device; every rank calls it together. Stage 0 (every rank owns everything)
  /// only takes its own.
  template <class Mine, class Take>
  void from_owners(Mine&& mine, Take&& take);

  /// True when the parameters compute in Options::param_dtype while the optimizer steps copies
  /// in their own dtype.
  [[nodiscard]] bool mixed_precision() const { return mixed_; }

  /// Bytes this rank holds in parameters, gradients and the optimizer's state (ZeRO's memory
  /// accounting; the optimizer's state is counted for torch's Adam, AdamW, SGD, RMSprop and
  /// Adagrad and everything derived from them).
  struct Memory {
    std::int64_t parameters = 0, gradients = 0, optimizer = 0;
  };
  [[nodiscard]] static Memory memory(const std::vector<at::Tensor>& params,
                                     torch::optim::Optimizer& optimizer);

 private:
  // The options that change which collectives run and when (all but wrap, whose units every rank
  // finds and counts alike when the models agree).
  [[nodiscard]] std::vector<RankSetting> settings() const {
    auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
    auto dtype = [](const std::optional<at::ScalarType>& t) {
      return t ? std::string(c10::toString(*t)) : std::string("unset");
    };
    return {{"policy", std::string(name)},
            {"stage", std::to_string(o_.stage)},
            {"bucket_cap_mb", setting_text(o_.bucket_cap_mb)},
            {"broadcast_buffers", flag(o_.broadcast_buffers)},
            {"find_unused_parameters", flag(o_.find_unused_parameters)},
            {"offload_optimizer", flag(o_.offload_optimizer || o_.offload_parameters)},
            {"offload_parameters", flag(o_.offload_parameters)},
            {"overlap_backward", flag(o_.overlap_backward)},
            {"reshard_after_forward", flag(o_.reshard_after_forward)},
            {"prefetch", flag(o_.prefetch)},
            {"reshard_after_step", flag(o_.reshard_after_step)},
            {"param_dtype", dtype(o_.param_dtype)},
            {"reduce_dtype", dtype(o_.reduce_dtype)}};
  }

  // Consecutive parameters with one owner and one dtype and device, at most bucket_cap_mb.
  struct Bucket {
    std::int64_t owner = 0;
    std::vector<std::size_t> params;
    std::int64_t numel = 0;
  };

  // Parameter i goes to the rank whose share of the total size holds its middle: N contiguous
  // runs of about equal size, the same on every rank.
  void partition();

  void make_buckets();

  // Starts `send(bucket)` -> (work, buffer) for each bucket in order with at most two on the wire,
  // and `receive(bucket, buffer)` for each as it completes, in the same order on every rank.
  template <class Send, class Receive>
  void pipeline(Send&& send, Receive&& receive);

  // Each bucket: its gradients (zeros where this rank has none) followed by one used-flag per
  // parameter, summed over the ranks on every rank (stage 1) or on the owner (stage 2), then
  // divided by the number of ranks. A parameter no rank used keeps no gradient. Buckets go out
  // from the last to the first, the order backward produces them, the same on every rank.
  void launch(std::size_t index);

  // Waits for the oldest bucket on the wire and gives its owner (every rank at stage 1) the mean.
  void finish_oldest();

  // Launches every bucket whose turn it is and whose gradients are all there, keeping at most
  // two on the wire.
  void launch_ready(bool all);

  // From the autograd engine: parameter `i`'s gradient is accumulated.
  void on_gradient(std::size_t i);

  void arm();

  // After the step's last backward: what is left goes out (parameters that got no gradient with
  // zeros and a zero flag), and every bucket is received.
  void reduce_gradients();

  // A world of one (nothing reduced): the parameters' gradients into the copies the optimizer
  // steps, dropped on the parameters.
  void gradients_to_copies();

  // As the reducer: a hook on each parameter's gradient accumulator says when it is ready. Made
  // again whenever a parameter's dtype changed (autograd makes a new accumulator then).
  void hook_gradients();

  // ---- mixed precision ------------------------------------------------------------------------

  // The gradients of the micro-batches so far, added up in reduce_dtype and dropped on the
  // parameters (before each forward, and before a world of one hands them to the optimizer).
  void widen_gradients();

  // Parameter i holds `value` from now on (its dtype may change; the same tensor for autograd).
  void replace_data(std::size_t i, const at::Tensor& value);

  // Every parameter in param_dtype (rounded from what it holds); the copies keep what the
  // parameters held, which a scope may have changed (a resume). The dtype change gives each
  // parameter a new gradient accumulator: the caller hooks them (hook_gradients).
  void to_param_dtype();

  // Every parameter whole in its masters' dtype: each owner sends its copies' values.
  void to_full_precision();

  // ---- stage 3: units -----------------------------------------------------------------------

  // One broadcast of a unit's parameters owned by one rank (a flat buffer when they are many).
  struct Gather {
    std::int64_t owner = 0;
    std::vector<std::size_t> params;
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor flat;  // undefined: the parameter itself travelled
  };
  struct Unit {
    const torch::nn::Module* module = nullptr;
    std::string name;
    std::vector<std::size_t> params;  // indices into params_, owned by any rank
    // Freed here between uses: those another rank owns, and under offload_parameters all.
    std::vector<std::size_t> freed;
    std::int64_t whole_bytes = 0;
    bool gathered = true;         // every rank holds all of its parameters
    bool in_backward = false;     // backward reached it in this pass
    std::int64_t waiting = 0;     // its gradients not yet in, in this backward
    std::vector<Gather> gathers;  // on the wire
  };

  void listen();

  // The unit `m` is, or none: decided at its first entry, the same on every rank.
  std::optional<std::size_t> unit_for(const torch::nn::Module& m);

  c10::StorageImpl* storage_of(std::size_t i);
  void materialize(std::size_t i);
  void release(std::size_t i);

  // Puts unit u's parameters on the wire (nothing when they are whole or already travelling):
  // each owner sends its share, one broadcast per owner, in the same order on every rank.
  void start_gather(std::size_t u, bool ahead);

  // Unit u's parameters whole on this rank (waiting for what is on the wire).
  void finish_gather(std::size_t u, bool ahead);

  // The other ranks' parameters of unit u freed here.
  void release_unit(std::size_t u);

  void release_all();

  // Every unit whole (WholeParameters), at full precision under mixed precision; false when
  // they were already.
  bool gather_whole();

  // The end of a WholeParameters scope: back to param_dtype, and to this rank's share.
  void end_whole();

  // Before each forward: what the last backward left gathered is freed (except at a step's
  // first forward, where every parameter is whole from the step before and each unit is freed
  // as it is done with).
  void begin_pass();

  // The unit to send ahead. In forward: the one that came after this entry in the last forward
  // (entries are counted, since a unit may run twice). In backward: the one before the last entry
  // of `u` in this forward, whose backward comes next.
  std::optional<std::size_t> neighbour(std::size_t u, bool forward) const;

  // Outside a training step's forward and backward (sampling, validation: maybe on one rank
  // alone) nothing travels: a unit runs as it is if it is whole, and one that is not is an error
  // that says what to do (a rank alone cannot gather). Units are found in steps only, so that
  // every rank has the same ones in the same order.
  void enter(const torch::nn::Module& m) override;

  void leave(const torch::nn::Module& m, const std::vector<at::Tensor>& outputs) override;

  // From the autograd engine: a gradient reached an output of unit u, so its backward is next.
  void before_unit_backward(std::size_t u);

  // Parameter i's gradient is in: its unit is freed once all of them are.
  void unit_gradient_in(std::size_t i);

  torch::nn::Module* model_;
  std::vector<at::Tensor> params_;
  Options o_;
  std::shared_ptr<World> world_;
  std::unordered_map<const void*, std::size_t> index_;
  std::vector<std::int64_t> owner_;
  std::vector<Bucket> buckets_;
  std::unique_ptr<DataParallel> replicated_;  // stage 0
  // What this rank's optimizer steps in place of the parameters it owns: copies in host memory
  // (offload_optimizer) and in the parameters' own dtype (mixed precision).
  std::vector<at::Tensor> copies_;
  bool mixed_ = false;           // param_dtype differs from some parameter's dtype
  bool full_precision_ = false;  // in a WholeParameters scope, under mixed precision
  bool widen_ = false;           // gradients accumulate in reduce_dtype between micro-batches
  std::vector<at::Tensor> wide_grads_;
  std::vector<at::ScalarType> master_dtypes_;
  // Gradients sent while backward runs: buckets on the wire, and this backward's progress.
  struct Flying {
    std::size_t bucket;
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor buffer;
  };
  std::deque<Flying> flying_;
  std::vector<std::size_t> bucket_of_;
  std::vector<std::int64_t> waiting_;  // per bucket, gradients not yet accumulated
  std::vector<bool> ready_;
  std::size_t next_ = 0;  // buckets below this index are not sent yet
  std::int64_t sent_during_backward_ = 0;
  bool armed_ = false;
  std::exception_ptr failed_;
  std::optional<std::size_t> late_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  std::mutex hook_mutex_;
  // stage 3
  bool listening_ = false;
  std::recursive_mutex unit_mutex_;
  std::unordered_map<const torch::nn::Module*, std::string> module_names_;
  std::unordered_map<const torch::nn::Module*, std::optional<std::size_t>> unit_of_module_;
  std::vector<Unit> units_;
  std::vector<std::int64_t> unit_of_param_;  // -1: outside every unit (always whole)
  std::vector<bool> arrived_;
  std::vector<std::size_t> order_, previous_order_;  // units entered, this forward and the last
  bool fresh_ = true;       // every parameter whole (a step's first forward comes)
  bool in_passes_ = false;  // between a step's first forward and its optimizer step
  std::int64_t resident_bytes_ = 0;
  UnitStats stats_;
};

}  // namespace difftrain::distributed

// The members of each concern are defined in their own header.
#include "difftrain/distributed/sharded/gradient_reduction.hpp"
#include "difftrain/distributed/sharded/ownership.hpp"
#include "difftrain/distributed/sharded/unit_gathering.hpp"
