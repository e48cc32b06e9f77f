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
    if (o_.stage < 0 || o_.stage > 3)
      throw ConfigError("is " + std::to_string(o_.stage) +
                            "; the stages are 0 (replicated, DataParallel), 1 (optimizer state "
                            "sharded), 2 (and gradients) and 3 (and parameters)",
                        "ShardedDataParallel options: stage");
    if (!(o_.bucket_cap_mb > 0.0))
      throw ConfigError("must be positive", "ShardedDataParallel options: bucket_cap_mb");
    world_ = o_.world ? o_.world : World::from_environment(o_.world_options);
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
  void guard(F&& f) {
    if (replicated_) return replicated_->guard(std::forward<F>(f));
    if (!world_->distributed()) {
      std::forward<F>(f)();
      gradients_to_copies();
      if (listening_) release_all();  // what backward left whole (unused parameters)
      return;
    }
    world_->guarded("sharing gradients", [&] {
      std::forward<F>(f)();
      reduce_gradients();
      if (listening_) release_all();  // what backward left gathered (unused parameters)
    });
  }

  [[nodiscard]] double mean(double x) { return world_->mean(x); }

  [[nodiscard]] std::vector<at::Tensor> gather(const at::Tensor& t) {
    return world_->all_gather(t);
  }

  /// Rank 0's `ok`, known on every rank (and a barrier).
  [[nodiscard]] bool decide(bool ok) { return world_->rank0_decides(ok); }

  // ---- sharding (train::ShardingParallel) ---------------------------------------------------

  /// `groups` with only the parameters rank `r` owns, in the same order.
  [[nodiscard]] std::vector<train::ParamGroup> groups_of_rank(
      const std::vector<train::ParamGroup>& groups, std::int64_t r) const {
    std::vector<train::ParamGroup> out;
    for (const auto& g : groups) {
      train::ParamGroup mine = g;
      mine.names.clear();
      mine.params.clear();
      for (std::size_t i = 0; i < g.params.size(); ++i) {
        const auto it = index_.find(g.params[i].unsafeGetTensorImpl());
        if (it == index_.end())
          throw ConfigError("parameter '" + g.names[i] + "' is not one the trainer shares",
                            "ShardedDataParallel");
        if (owner_[it->second] != r && owner_[it->second] != -1) continue;
        mine.names.push_back(g.names[i]);
        // This rank's optimizer steps the copies when it is offloaded or in mixed precision.
        const bool copy = r == world_->rank() && !copies_.empty();
        mine.params.push_back(copy ? copies_[it->second] : g.params[i]);
      }
      out.push_back(std::move(mine));
    }
    return out;
  }

  [[nodiscard]] std::vector<at::Tensor> owned_params() const {
    std::vector<at::Tensor> out;
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (owner_[i] == world_->rank() || owner_[i] == -1)
        out.push_back(copies_.empty() ? params_[i] : copies_[i]);
    return out;
  }

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
  void after_optimizer_step() {
    if (replicated_) return;
    at::NoGradGuard no_grad;
    // The updated copies back (rounded), into the parameters that hold memory now (a unit's
    // offloaded parameters take theirs when the unit is gathered next).
    for (std::size_t i = 0; i < copies_.size(); ++i)
      if (copies_[i].defined() && storage_of(i)->nbytes() != 0)
        params_[i].detach().copy_(copies_[i], /*non_blocking=*/true);
    std::unique_lock<std::recursive_mutex> units_lock(unit_mutex_, std::defer_lock);
    const bool sharded_between = listening_ && o_.reshard_after_step;
    if (listening_) {
      units_lock.lock();
      world_->guarded("freeing parameters after the step", [&] {
        for (std::size_t u = 0; u < units_.size(); ++u) {
          release_unit(u);  // what backward left (and a prefetch left over)
          if (sharded_between) continue;
          for (const std::size_t i : units_[u].freed) materialize(i);
          units_[u].gathered = true;
        }
      });
      in_passes_ = false;
      fresh_ = !sharded_between;
    }
    // (A world of one listens only with offloaded parameters: it has nothing to send.)
    if (!world_->distributed()) return;
    // At stage 3 between steps, only parameters outside every unit travel.
    const auto travels = [&](std::size_t i) { return !sharded_between || unit_of_param_[i] < 0; };
    world_->guarded("sending updated parameters", [&] {
      pipeline(
          [&](const Bucket& b) {
            std::vector<at::Tensor> parts;
            std::int64_t numel = 0;
            for (const std::size_t i : b.params) {
              if (!travels(i)) continue;
              numel += params_[i].numel();
              if (b.owner == world_->rank()) parts.push_back(params_[i].detach().reshape({-1}));
            }
            if (numel == 0) return std::make_pair(c10::intrusive_ptr<c10d::Work>(), at::Tensor());
            at::Tensor flat =
                b.owner == world_->rank()
                    ? at::cat(parts)
                    : at::empty({numel}, params_[b.params.front()].options().requires_grad(false));
            std::vector<at::Tensor> v{flat};
            c10d::BroadcastOptions bo;
            bo.rootRank = b.owner;
            return std::make_pair(world_->group()->broadcast(v, bo), flat);
          },
          [&](const Bucket& b, const at::Tensor& flat) {
            if (b.owner == world_->rank() || !flat.defined()) return;
            std::int64_t at_ = 0;
            for (const std::size_t i : b.params) {
              if (!travels(i)) continue;
              const at::Tensor& p = params_[i];
              p.variable_data().copy_(flat.narrow(0, at_, p.numel()).view(p.sizes()));
              at_ += p.numel();
            }
          });
    });
  }

  /// A step that changed nothing: every parameter as after a step (stage 3 frees parameters in
  /// forward and backward; the other stages hold them whole throughout).
  void after_skipped_step() {
    if (!listening_) return;
    world_->guarded("gathering parameters after a skipped step", [&] {
      const std::lock_guard<std::recursive_mutex> lock(unit_mutex_);
      for (std::size_t u = 0; u < units_.size(); ++u) {
        if (o_.reshard_after_step)
          release_unit(u);
        else
          finish_gather(u, false);
      }
      in_passes_ = false;
      fresh_ = !o_.reshard_after_step;
    });
  }

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
  void from_owners(Mine&& mine, Take&& take) {
    at::NoGradGuard no_grad;
    const std::int64_t me = world_->rank();
    if (replicated_) {
      for (std::size_t i = 0; i < params_.size(); ++i) take(i, mine(i));
      return;
    }
    for (const Bucket& b : buckets_) {
      for (std::size_t k = 0; k < b.params.size();) {
        const at::ScalarType dtype = master_dtype(b.params[k]);
        std::vector<std::size_t> run;
        while (k < b.params.size() && master_dtype(b.params[k]) == dtype)
          run.push_back(b.params[k++]);
        const at::TensorOptions to =
            params_[run.front()].options().dtype(dtype).requires_grad(false);
        if (b.owner == me) {
          std::vector<at::Tensor> parts;
          for (const std::size_t i : run) {
            at::Tensor v = mine(i);
            take(i, v);
            if (world_->distributed()) parts.push_back(v.to(to).reshape({-1}));
          }
          if (world_->distributed()) {
            std::vector<at::Tensor> flat{at::cat(parts)};
            world_->broadcast(flat, b.owner);
          }
          continue;
        }
        std::int64_t numel = 0;
        for (const std::size_t i : run) numel += params_[i].numel();
        std::vector<at::Tensor> flat{at::empty({numel}, to)};
        world_->broadcast(flat, b.owner);
        std::int64_t at_ = 0;
        for (const std::size_t i : run) {
          take(i, flat[0].narrow(0, at_, params_[i].numel()).view(params_[i].sizes()));
          at_ += params_[i].numel();
        }
      }
    }
  }

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
                                     torch::optim::Optimizer& optimizer) {
    Memory m;
    auto bytes = [](const at::Tensor& t) {
      return t.defined() ? static_cast<std::int64_t>(t.numel() * t.element_size())
                         : std::int64_t{0};
    };
    for (const auto& p : params) {
      // What the parameter holds now: nothing for a share stage 3 has freed.
      if (p.defined())
        m.parameters += std::min(bytes(p), static_cast<std::int64_t>(p.storage().nbytes()));
      m.gradients += bytes(p.grad());
    }
    for (const auto& [key, state] : optimizer.state()) {
      (void)key;
      if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state.get()))
        m.optimizer += bytes(s->exp_avg()) + bytes(s->exp_avg_sq()) + bytes(s->max_exp_avg_sq());
      else if (const auto* a = dynamic_cast<const torch::optim::AdamParamState*>(state.get()))
        m.optimizer += bytes(a->exp_avg()) + bytes(a->exp_avg_sq()) + bytes(a->max_exp_avg_sq());
      else if (const auto* g = dynamic_cast<const torch::optim::SGDParamState*>(state.get()))
        m.optimizer += bytes(g->momentum_buffer());
      else if (const auto* r = dynamic_cast<const torch::optim::RMSpropParamState*>(state.get()))
        m.optimizer += bytes(r->square_avg()) + bytes(r->momentum_buffer()) + bytes(r->grad_avg());
      else if (const auto* d = dynamic_cast<const torch::optim::AdagradParamState*>(state.get()))
        m.optimizer += bytes(d->sum());
    }
    return m;
  }

 private:
  // Consecutive parameters with one owner and one dtype and device, at most bucket_cap_mb.
  struct Bucket {
    std::int64_t owner = 0;
    std::vector<std::size_t> params;
    std::int64_t numel = 0;
  };

  // Parameter i goes to the rank whose share of the total size holds its middle: N contiguous
  // runs of about equal size, the same on every rank.
  void partition() {
    const std::int64_t n = world_->size();
    std::int64_t total = 0;
    for (const auto& p : params_) total += p.numel();
    owner_.assign(params_.size(), 0);
    std::int64_t before = 0;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const std::int64_t middle2 = 2 * before + params_[i].numel();  // twice the middle
      std::int64_t r = total > 0 ? (middle2 * n) / (2 * total) : 0;
      owner_[i] = std::min<std::int64_t>(r, n - 1);
      before += params_[i].numel();
    }
  }

  void make_buckets() {
    const auto cap = static_cast<std::int64_t>(o_.bucket_cap_mb * 1024.0 * 1024.0);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& p = params_[i];
      bool fits = !buckets_.empty();
      if (fits) {
        const Bucket& last = buckets_.back();
        const at::Tensor& q = params_[last.params.front()];
        fits = last.owner == owner_[i] && q.scalar_type() == p.scalar_type() &&
               q.device() == p.device() &&
               (last.numel + p.numel()) * static_cast<std::int64_t>(p.element_size()) <= cap;
      }
      if (!fits) buckets_.push_back({owner_[i], {}, 0});
      buckets_.back().params.push_back(i);
      buckets_.back().numel += p.numel();
    }
  }

  // Starts `send(bucket)` -> (work, buffer) for each bucket in order with at most two on the wire,
  // and `receive(bucket, buffer)` for each as it completes, in the same order on every rank.
  template <class Send, class Receive>
  void pipeline(Send&& send, Receive&& receive) {
    struct InFlight {
      const Bucket* bucket;
      c10::intrusive_ptr<c10d::Work> work;
      at::Tensor buffer;
    };
    std::deque<InFlight> flying;
    auto finish_one = [&] {
      InFlight f = std::move(flying.front());
      flying.pop_front();
      if (f.work) f.work->wait(world_->timeout());
      receive(*f.bucket, f.buffer);
    };
    for (const Bucket& b : buckets_) {
      auto [work, buffer] = send(b);
      flying.push_back({&b, std::move(work), std::move(buffer)});
      if (flying.size() > 2) finish_one();
    }
    while (!flying.empty()) finish_one();
  }

  // Each bucket: its gradients (zeros where this rank has none) followed by one used-flag per
  // parameter, summed over the ranks on every rank (stage 1) or on the owner (stage 2), then
  // divided by the number of ranks. A parameter no rank used keeps no gradient. Buckets go out
  // from the last to the first, the order backward produces them, the same on every rank.
  void launch(std::size_t index) {
    at::NoGradGuard no_grad;
    const Bucket& b = buckets_[index];
    const std::int64_t me = world_->rank();
    const at::Tensor& first = params_[b.params.front()];
    at::Tensor flat =
        at::zeros({b.numel + static_cast<std::int64_t>(b.params.size())},
                  first.options().dtype(o_.reduce_dtype.value_or(first.scalar_type())));
    std::int64_t at_ = 0;
    for (std::size_t k = 0; k < b.params.size(); ++k) {
      const std::size_t i = b.params[k];
      at::Tensor& p = params_[i];
      at::Tensor* wide = widen_ && wide_grads_[i].defined() ? &wide_grads_[i] : nullptr;
      if (p.grad().defined() || wide != nullptr) {
        at::Tensor into = flat.narrow(0, at_, p.numel());
        if (p.grad().defined()) into.copy_(p.grad().reshape({-1}));
        if (wide != nullptr) into.add_(std::exchange(*wide, at::Tensor()).reshape({-1}));
        flat[b.numel + static_cast<std::int64_t>(k)] = 1.0;
        // Stages 2 and 3: a gradient this rank does not own is gone once it is packed.
        if (o_.stage >= 2 && b.owner != me) p.mutable_grad().reset();
      }
      at_ += p.numel();
    }
    // Divided before the sum, as DDP's default communication hook does.
    flat.narrow(0, 0, b.numel).div_(static_cast<double>(world_->size()));
    std::vector<at::Tensor> v{flat};
    c10::intrusive_ptr<c10d::Work> work;
    if (o_.stage == 1) {
      work = world_->group()->allreduce(v);
    } else {
      c10d::ReduceOptions ro;
      ro.rootRank = b.owner;
      work = world_->group()->reduce(v, ro);
    }
    flying_.push_back({index, std::move(work), std::move(flat)});
  }

  // Waits for the oldest bucket on the wire and gives its owner (every rank at stage 1) the mean.
  void finish_oldest() {
    at::NoGradGuard no_grad;
    Flying f = std::move(flying_.front());
    flying_.pop_front();
    f.work->wait(world_->timeout());
    const Bucket& b = buckets_[f.bucket];
    if (o_.stage >= 2 && b.owner != world_->rank()) return;
    const at::Tensor used = f.buffer.narrow(0, b.numel, static_cast<std::int64_t>(b.params.size()))
                                .to(at::kCPU, at::kDouble)
                                .contiguous();
    const double* used_by = used.data_ptr<double>();
    std::int64_t at_ = 0;
    for (std::size_t k = 0; k < b.params.size(); ++k) {
      const std::size_t i = b.params[k];
      at::Tensor& p = params_[i];
      // The optimizer reads this gradient from the copy it steps, where there is one (in the
      // copy's dtype and memory, not rounded to the parameter's dtype on the way).
      const bool to_copy = !copies_.empty() && copies_[i].defined();
      at::Tensor& target = to_copy ? copies_[i] : p;
      if (to_copy) p.mutable_grad().reset();
      if (!(used_by[k] > 0.0)) {
        target.mutable_grad().reset();
      } else {
        const at::Tensor mean = f.buffer.narrow(0, at_, p.numel()).view(p.sizes());
        if (!target.grad().defined()) target.mutable_grad() = at::empty_like(target);
        target.mutable_grad().copy_(mean);
      }
      at_ += p.numel();
    }
  }

  // Launches every bucket whose turn it is and whose gradients are all there, keeping at most
  // two on the wire.
  void launch_ready(bool all) {
    while (next_ > 0 && (all || waiting_[next_ - 1] == 0)) {
      if (!all) ++sent_during_backward_;
      launch(--next_);
      if (flying_.size() > 2) finish_oldest();
    }
  }

  // From the autograd engine: parameter `i`'s gradient is accumulated.
  void on_gradient(std::size_t i) {
    // The engine may run accumulators of several devices on several threads, as for DDP.
    const std::lock_guard<std::mutex> lock(hook_mutex_);
    if (listening_) unit_gradient_in(i);
    if (!armed_ || failed_) return;
    try {
      const std::size_t b = bucket_of_[i];
      if (next_ <= b) {  // its bucket already left: this gradient arrived twice
        late_ = i;
        return;
      }
      if (!ready_[i]) {
        ready_[i] = true;
        --waiting_[b];
      }
      launch_ready(false);
    } catch (...) {  // raised after backward, where the trainer can see it
      failed_ = std::current_exception();
    }
  }

  void arm() {
    armed_ = true;
    failed_ = nullptr;
    late_.reset();
    next_ = buckets_.size();
    std::fill(ready_.begin(), ready_.end(), false);
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      waiting_[b] = static_cast<std::int64_t>(buckets_[b].params.size());
  }

  // After the step's last backward: what is left goes out (parameters that got no gradient with
  // zeros and a zero flag), and every bucket is received.
  void reduce_gradients() {
    if (!world_->distributed()) return gradients_to_copies();
    if (!armed_) arm();  // no hooks ran (overlap off): everything goes now
    armed_ = false;
    if (failed_) std::rethrow_exception(std::exchange(failed_, nullptr));
    if (late_)
      throw ConfigError("parameter " + std::to_string(*late_) +
                            " received its gradient after its bucket was sent (twice in one "
                            "backward, as reentrant checkpointing does); set overlap_backward = "
                            "false",
                        "ShardedDataParallel");
    launch_ready(true);
    while (!flying_.empty()) finish_oldest();
  }

  // A world of one (nothing reduced): the parameters' gradients into the copies the optimizer
  // steps, dropped on the parameters.
  void gradients_to_copies() {
    if (widen_) widen_gradients();
    for (std::size_t i = 0; i < copies_.size(); ++i) {
      if (!copies_[i].defined()) continue;
      at::Tensor& p = params_[i];
      if (widen_) p.mutable_grad() = std::exchange(wide_grads_[i], at::Tensor());
      if (!p.grad().defined()) {
        copies_[i].mutable_grad().reset();
        continue;
      }
      if (!copies_[i].grad().defined()) copies_[i].mutable_grad() = at::empty_like(copies_[i]);
      copies_[i].mutable_grad().copy_(p.grad());
      p.mutable_grad().reset();
    }
  }

  // As the reducer: a hook on each parameter's gradient accumulator says when it is ready. Made
  // again whenever a parameter's dtype changed (autograd makes a new accumulator then).
  void hook_gradients() {
    accumulators_.clear();
    // (A world of one hooks them only to free each offloaded unit as its gradients are in.)
    if (!listening_ && (!world_->distributed() || (!o_.overlap_backward && o_.stage < 3))) return;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
      acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, i, alive = alive_](const torch::autograd::variable_list& outputs,
                                    const torch::autograd::variable_list& /*inputs*/) {
            if (*alive) on_gradient(i);
            return outputs;
          }));
      accumulators_.push_back(std::move(acc));
    }
  }

  // ---- mixed precision ------------------------------------------------------------------------

  // The gradients of the micro-batches so far, added up in reduce_dtype and dropped on the
  // parameters (before each forward, and before a world of one hands them to the optimizer).
  void widen_gradients() {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& p = params_[i];
      if (!p.grad().defined()) continue;
      if (wide_grads_[i].defined())
        wide_grads_[i].add_(p.grad());
      else
        wide_grads_[i] = p.grad().to(*o_.reduce_dtype, /*non_blocking=*/false, /*copy=*/true);
      p.mutable_grad().reset();
    }
  }

  // Parameter i holds `value` from now on (its dtype may change; the same tensor for autograd).
  void replace_data(std::size_t i, const at::Tensor& value) {
    const auto before = static_cast<std::int64_t>(params_[i].storage().nbytes());
    params_[i].set_data(value);
    resident_bytes_ += static_cast<std::int64_t>(params_[i].storage().nbytes()) - before;
  }

  // Every parameter in param_dtype (rounded from what it holds); the copies keep what the
  // parameters held, which a scope may have changed (a resume). The dtype change gives each
  // parameter a new gradient accumulator: the caller hooks them (hook_gradients).
  void to_param_dtype() {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!copies_.empty() && copies_[i].defined()) copies_[i].copy_(params_[i].detach());
      params_[i].mutable_grad().reset();
      replace_data(i, params_[i].detach().to(*o_.param_dtype));
    }
    full_precision_ = false;
  }

  // Every parameter whole in its masters' dtype: each owner sends its copies' values.
  void to_full_precision() {
    at::NoGradGuard no_grad;
    from_owners([&](std::size_t i) { return copies_[i]; },
                [&](std::size_t i, const at::Tensor& value) {
                  params_[i].mutable_grad().reset();
                  replace_data(i, value.to(params_[i].device(), /*non_blocking=*/false,
                                           /*copy=*/true));
                });
    for (Unit& u : units_) u.gathered = true;
    full_precision_ = true;
  }

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

  void listen() {
    for (const auto& item : model_->named_modules("", /*include_self=*/false))
      module_names_.emplace(item.value().get(), item.key());
    unit_of_param_.assign(params_.size(), -1);
    arrived_.assign(params_.size(), false);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& p = params_[i];
      const auto& storage = p.storage();
      if (p.storage_offset() != 0 || !p.is_contiguous() ||
          storage.nbytes() != static_cast<std::size_t>(p.numel() * p.element_size()))
        throw ConfigError("parameter " + std::to_string(i) +
                              " is a view into a larger tensor; stage 3 frees each parameter's "
                              "memory on its own and needs parameters that own theirs",
                          "ShardedDataParallel options: stage");
      resident_bytes_ += static_cast<std::int64_t>(storage.nbytes());
    }
    if (!nn::listen_to_units(this))
      throw ConfigError(
          "is 3, but another stage-3 ShardedDataParallel in this process listens to the "
          "model's units already (one per process)",
          "ShardedDataParallel options: stage");
    listening_ = true;
  }

  // The unit `m` is, or none: decided at its first entry, the same on every rank.
  std::optional<std::size_t> unit_for(const torch::nn::Module& m) {
    if (const auto it = unit_of_module_.find(&m); it != unit_of_module_.end()) return it->second;
    std::optional<std::size_t> found;
    const auto named = module_names_.find(&m);
    if (named != module_names_.end() && (!o_.wrap || o_.wrap(named->second, m))) {
      Unit u;
      u.module = &m;
      u.name = named->second;
      for (const at::Tensor& q : m.parameters(/*recurse=*/true)) {
        const auto at_ = index_.find(q.unsafeGetTensorImpl());
        if (at_ == index_.end() || unit_of_param_[at_->second] >= 0) continue;
        const std::size_t i = at_->second;
        unit_of_param_[i] = static_cast<std::int64_t>(units_.size());
        u.params.push_back(i);
        if (owner_[i] != world_->rank() || o_.offload_parameters) u.freed.push_back(i);
        u.whole_bytes += params_[i].numel() * static_cast<std::int64_t>(params_[i].element_size());
      }
      stats_.largest_unit_bytes = std::max(stats_.largest_unit_bytes, u.whole_bytes);
      if (!u.params.empty()) {
        found = units_.size();
        units_.push_back(std::move(u));
      }
    }
    unit_of_module_.emplace(&m, found);
    return found;
  }

  c10::StorageImpl* storage_of(std::size_t i) {
    return params_[i].unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
  }
  void materialize(std::size_t i) {
    c10::StorageImpl* s = storage_of(i);
    if (s->nbytes() != 0) return;
    const auto n = static_cast<std::size_t>(params_[i].numel() * params_[i].element_size());
    s->set_data_ptr_noswap(s->allocator()->allocate(n));
    s->set_nbytes(n);
    resident_bytes_ += static_cast<std::int64_t>(n);
    if (in_passes_ && !units_.empty())
      stats_.peak_parameter_bytes = std::max(stats_.peak_parameter_bytes, resident_bytes_);
  }
  void release(std::size_t i) {
    c10::StorageImpl* s = storage_of(i);
    resident_bytes_ -= static_cast<std::int64_t>(s->nbytes());
    s->set_data_ptr_noswap(at::DataPtr(nullptr, params_[i].device()));
    s->set_nbytes(0);
  }

  // Puts unit u's parameters on the wire (nothing when they are whole or already travelling):
  // each owner sends its share, one broadcast per owner, in the same order on every rank.
  void start_gather(std::size_t u, bool ahead) {
    Unit& unit = units_[u];
    if (unit.gathered || !unit.gathers.empty()) return;
    at::NoGradGuard no_grad;
    for (const std::size_t i : unit.freed) materialize(i);
    const std::int64_t me = world_->rank();
    if (o_.offload_parameters)  // this rank's share comes from its copies in host memory
      for (const std::size_t i : unit.params)
        if (owner_[i] == me) params_[i].variable_data().copy_(copies_[i], /*non_blocking=*/true);
    ++stats_.gathers;
    if (ahead) ++stats_.prefetched;
    if (!world_->distributed()) {  // a world of one: nothing else to bring
      unit.gathered = true;
      return;
    }
    for (std::size_t k = 0; k < unit.params.size();) {
      Gather g;
      g.owner = owner_[unit.params[k]];
      while (k < unit.params.size() && owner_[unit.params[k]] == g.owner)
        g.params.push_back(unit.params[k++]);
      c10d::BroadcastOptions bo;
      bo.rootRank = g.owner;
      std::vector<at::Tensor> v;
      if (g.params.size() == 1) {
        v.push_back(params_[g.params.front()].variable_data());
      } else {
        std::int64_t numel = 0;
        std::vector<at::Tensor> parts;
        for (const std::size_t i : g.params) {
          numel += params_[i].numel();
          if (g.owner == me) parts.push_back(params_[i].variable_data().reshape({-1}));
        }
        g.flat = g.owner == me
                     ? at::cat(parts)
                     : at::empty({numel}, params_[g.params.front()].options().requires_grad(false));
        v.push_back(g.flat);
      }
      g.work = world_->group()->broadcast(v, bo);
      unit.gathers.push_back(std::move(g));
    }
  }

  // Unit u's parameters whole on this rank (waiting for what is on the wire).
  void finish_gather(std::size_t u, bool ahead) {
    start_gather(u, ahead);
    Unit& unit = units_[u];
    if (unit.gathered) return;
    at::NoGradGuard no_grad;
    const std::int64_t me = world_->rank();
    for (Gather& g : unit.gathers) {
      g.work->wait(world_->timeout());
      if (!g.flat.defined() || g.owner == me) continue;
      std::int64_t at_ = 0;
      for (const std::size_t i : g.params) {
        const at::Tensor& p = params_[i];
        p.variable_data().copy_(g.flat.narrow(0, at_, p.numel()).view(p.sizes()));
        at_ += p.numel();
      }
    }
    unit.gathers.clear();
    unit.gathered = true;
  }

  // The other ranks' parameters of unit u freed here.
  void release_unit(std::size_t u) {
    Unit& unit = units_[u];
    for (auto& g : unit.gathers) g.work->wait(world_->timeout());  // never free what is arriving
    unit.gathers.clear();
    unit.in_backward = false;
    if (!unit.gathered) return;
    for (const std::size_t i : unit.freed) release(i);
    unit.gathered = false;
    ++stats_.releases;
  }

  void release_all() {
    const std::lock_guard<std::recursive_mutex> lock(unit_mutex_);
    for (std::size_t u = 0; u < units_.size(); ++u) release_unit(u);
  }

  // Every unit whole (WholeParameters), at full precision under mixed precision; false when
  // they were already.
  bool gather_whole() {
    const std::lock_guard<std::recursive_mutex> lock(unit_mutex_);
    if (mixed_) {
      if (full_precision_) return false;
      world_->guarded("gathering every parameter at full precision", [&] {
        for (std::size_t u = 0; u < units_.size(); ++u) release_unit(u);  // nothing in flight
        to_full_precision();
      });
      return true;
    }
    bool any = false;
    world_->guarded("gathering every parameter", [&] {
      for (std::size_t u = 0; u < units_.size(); ++u) {
        any = any || !units_[u].gathered;
        finish_gather(u, false);
      }
    });
    return any;
  }

  // The end of a WholeParameters scope: back to param_dtype, and to this rank's share.
  void end_whole() {
    const std::lock_guard<std::recursive_mutex> lock(unit_mutex_);
    if (mixed_) {
      to_param_dtype();
      hook_gradients();
    }
    if (listening_ && o_.reshard_after_step)
      world_->guarded("freeing parameters", [&] { release_all(); });
    else if (listening_)
      fresh_ = true;
  }

  // Before each forward: what the last backward left gathered is freed (except at a step's
  // first forward, where every parameter is whole from the step before and each unit is freed
  // as it is done with).
  void begin_pass() {
    const std::lock_guard<std::recursive_mutex> lock(unit_mutex_);
    world_->guarded("freeing parameters", [&] {
      if (!fresh_) release_all();
    });
    fresh_ = false;
    in_passes_ = true;
    // The first forward finds the units, on weights whole as they were loaded: counted after it.
    if (!units_.empty())
      stats_.peak_parameter_bytes = std::max(stats_.peak_parameter_bytes, resident_bytes_);
    for (Unit& u : units_) u.in_backward = false;
    previous_order_ = std::move(order_);
    order_.clear();
  }

  // The unit to send ahead. In forward: the one that came after this entry in the last forward
  // (entries are counted, since a unit may run twice). In backward: the one before the last entry
  // of `u` in this forward, whose backward comes next.
  std::optional<std::size_t> neighbour(std::size_t u, bool forward) const {
    if (forward) {
      const std::size_t pos = order_.size() - 1;  // this entry
      if (pos + 1 < previous_order_.size() && previous_order_[pos] == u)
        return previous_order_[pos + 1];
      return std::nullopt;
    }
    for (std::size_t k = order_.size(); k-- > 0;)
      if (order_[k] == u) return k > 0 ? std::optional<std::size_t>(order_[k - 1]) : std::nullopt;
    return std::nullopt;
  }

  // Outside a training step's forward and backward (sampling, validation: maybe on one rank
  // alone) nothing travels: a unit runs as it is if it is whole, and one that is not is an error
  // that says what to do (a rank alone cannot gather). Units are found in steps only, so that
  // every rank has the same ones in the same order.
  void enter(const torch::nn::Module& m) override {
    const std::lock_guard<std::recursive_mutex> lock(unit_mutex_);
    if (!in_passes_) {
      const auto it = unit_of_module_.find(&m);
      if (it != unit_of_module_.end() && it->second && !units_[*it->second].gathered)
        throw ConfigError(
            std::string("runs outside a training step while stage 3 holds only this rank's "
                        "share of its parameters; take trainer.whole_parameters() on every rank "
                        "first") +
                (o_.offload_parameters ? "" : " (or set reshard_after_step = false)"),
            "ShardedDataParallel: " + units_[*it->second].name);
      return;
    }
    const auto u = unit_for(m);
    if (!u) return;
    order_.push_back(*u);
    world_->guarded("gathering the parameters of " + units_[*u].name, [&] {
      finish_gather(*u, false);
      if (!o_.prefetch) return;
      if (const auto n = neighbour(*u, true); n && *n != *u) start_gather(*n, true);
    });
  }

  void leave(const torch::nn::Module& m, const std::vector<at::Tensor>& outputs) override {
    const std::lock_guard<std::recursive_mutex> lock(unit_mutex_);
    if (!in_passes_) return;
    const auto it = unit_of_module_.find(&m);
    if (it == unit_of_module_.end() || !it->second) return;
    const std::size_t u = *it->second;
    bool backward_comes = false;
    for (const at::Tensor& t : outputs) {
      if (!t.requires_grad()) continue;
      backward_comes = true;
      at::Tensor(t).register_hook([this, u, alive = alive_](const at::Tensor& /*grad*/) {
        if (*alive) before_unit_backward(u);
      });
    }
    if (units_[u].in_backward) return;  // recomputed inside backward: needed right after
    if (o_.reshard_after_forward || !backward_comes)
      world_->guarded("freeing the parameters of " + units_[u].name, [&] { release_unit(u); });
  }

  // From the autograd engine: a gradient reached an output of unit u, so its backward is next.
  void before_unit_backward(std::size_t u) {
    const std::lock_guard<std::recursive_mutex> lock(unit_mutex_);
    Unit& unit = units_[u];
    if (unit.in_backward) return;
    world_->guarded("gathering the parameters of " + unit.name + " for backward", [&] {
      finish_gather(u, false);
      if (o_.prefetch)
        if (const auto n = neighbour(u, false); n && *n != u) start_gather(*n, true);
    });
    unit.in_backward = true;
    unit.waiting = static_cast<std::int64_t>(unit.params.size());
    for (const std::size_t i : unit.params) arrived_[i] = false;
  }

  // Parameter i's gradient is in: its unit is freed once all of them are.
  void unit_gradient_in(std::size_t i) {
    const std::lock_guard<std::recursive_mutex> lock(unit_mutex_);
    const std::int64_t u = unit_of_param_[i];
    if (u < 0) return;
    Unit& unit = units_[static_cast<std::size_t>(u)];
    if (!unit.in_backward || arrived_[i]) return;
    arrived_[i] = true;
    if (--unit.waiting == 0) release_unit(static_cast<std::size_t>(u));
  }

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
