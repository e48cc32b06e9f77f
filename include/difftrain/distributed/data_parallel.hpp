#pragma once
// Config::Parallel = distributed::DataParallel: every rank trains the same model on its share of
// the batch, and gradients are averaged over the ranks before the optimizer step, as PyTorch's
// DistributedDataParallel does, on the same engine (c10d::Reducer):
//
// - at start (and after a resume) every parameter and buffer is rank 0's (one broadcast per
//   dtype), after checking that every rank holds the same model;
// - gradients are averaged by bucketed all-reduce launched from autograd hooks while backward is
//   still running: DDP's 25 MiB buckets (1 MiB for the first), first one bucket for everything,
//   then rebuilt after the first step in the order backward produced the gradients;
// - only the step's last backward shares gradients: the accumulation micro-batches before it
//   accumulate locally (DDP's no_sync);
// - buffers are rank 0's before every forward (DDP's broadcast_buffers);
// - before the last backward the ranks agree whether every loss of the step was finite, so a
//   NaN on one rank skips (or stops) the step on all of them.
//
// Since every rank then holds the same averaged gradient, gradient clipping sees the global
// gradient and the fp16 scaler's overflow decision is the same everywhere without further talk.
// With a world of one nothing is communicated and no reducer exists.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/csrc/distributed/c10d/logger.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/distributed/replicas.hpp"
#include "difftrain/distributed/world.hpp"

namespace difftrain::distributed {

class DataParallel {
 public:
  static constexpr std::string_view name = "data-parallel";

  struct Options {
    /// The processes to share steps with; null reads them from the launcher's environment
    /// (World::from_environment with `world_options`).
    std::shared_ptr<World> world{};
    WorldOptions world_options{};
    /// DDP's bucket_cap_mb and its first, smaller bucket.
    double bucket_cap_mb = 25.0;
    double first_bucket_cap_mb = 1.0;
    /// DDP's broadcast_buffers: rank 0's buffers before every forward.
    bool broadcast_buffers = true;
    /// DDP's find_unused_parameters: before each gradient-sharing backward the autograd graph of
    /// the loss is searched for the trainable parameters it does not reach (a conditional block,
    /// a branch of the model the step skips, an adapter not applied this step); they count as
    /// ready with no gradient, so the all-reduce does not wait for them. A parameter no rank used
    /// keeps no gradient (the optimizer skips it, as on one process). Costs one graph traversal
    /// per step; without it such a model stops with the reducer's error on the next step.
    bool find_unused_parameters = false;
  };

  DataParallel(torch::nn::Module& model, const std::vector<at::Tensor>& params, const Options& o)
      : model_(&model), params_(params), o_(o) {
    if (!(o_.bucket_cap_mb > 0.0) || !(o_.first_bucket_cap_mb > 0.0))
      throw ConfigError("bucket sizes must be positive", "DataParallel options");
    world_ = o_.world ? o_.world : World::from_environment(o_.world_options);
    if (!world_->distributed()) return;
    check_same_settings(*world_,
                        {{"policy", std::string(name)},
                         {"bucket_cap_mb", setting_text(o_.bucket_cap_mb)},
                         {"first_bucket_cap_mb", setting_text(o_.first_bucket_cap_mb)},
                         {"broadcast_buffers", o_.broadcast_buffers ? "true" : "false"},
                         {"find_unused_parameters", o_.find_unused_parameters ? "true" : "false"}},
                        "DataParallel options");
    check_same_model(*world_, params_, *model_, "DataParallel");
    start();
    std::vector<bool> sparse(params_.size(), false);
    // As DDP: one bucket per dtype and device for the first step (no size limit); the reducer
    // rebuilds them from the order of the first backward.
    auto [buckets, limits] = c10d::compute_bucket_assignment_by_size(
        params_, {static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max())}, sparse);
    (void)limits;
    std::unordered_map<std::size_t, std::string> names;
    reducer_ = std::make_shared<c10d::Reducer>(
        params_, std::vector<std::vector<std::size_t>>(buckets.rbegin(), buckets.rend()),
        world_->group(), sparse, mib(o_.bucket_cap_mb), o_.find_unused_parameters,
        /*gradient_as_bucket_view=*/false, names, mib(o_.first_bucket_cap_mb),
        /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
        std::vector<std::int64_t>{});
    // The reducer reports through a logger, as DDP sets one; the search for unused parameters
    // writes to it and would find none without it.
    logger_ = std::make_shared<c10d::Logger>(reducer_);
    reducer_->set_logger(logger_);
  }

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// Refuses on every rank, naming the setting, unless every rank holds the same `settings` (the
  /// trainer's own that change the collectives: accumulation steps, chunking, precision).
  void agree_on(const std::vector<RankSetting>& settings, const std::string& who) const {
    check_same_settings(*world_, settings, who);
  }

  [[nodiscard]] std::int64_t rank() const { return world_->rank(); }
  [[nodiscard]] std::int64_t world_size() const { return world_->size(); }
  [[nodiscard]] const World& world() const { return *world_; }

  /// Every parameter and buffer becomes rank 0's.
  void start() {
    if (!world_->distributed()) return;
    std::vector<at::Tensor> all;
    for (const auto& p : model_->parameters()) all.push_back(p);
    for (const auto& b : model_->buffers()) all.push_back(b);
    broadcast_from_rank0(*world_, all);
  }

  void before_forward(bool sync) {
    if (!world_->distributed()) return;
    if (sync) reducer_->prepare_for_forward();
    guard([&] { (void)reducer_->rebuild_buckets(); });
    if (o_.broadcast_buffers) {
      broadcast_from_rank0(*world_, model_->buffers());
    }
  }

  /// True when `ok` on every rank.
  [[nodiscard]] bool all_ok(bool ok) { return world_->all_true(ok); }

  /// Before the backward of `loss` that shares gradients.
  void before_backward(const at::Tensor& loss) {
    if (!world_->distributed()) return;
    if (o_.find_unused_parameters)
      reducer_->prepare_for_backward({loss});
    else
      reducer_->prepare_for_backward({});
  }

  /// Runs `f` (the backward that shares gradients); a failure of the group is a DistributedError.
  template <class F>
  void guard(F&& f) {
    if (!world_->distributed()) return std::forward<F>(f)();
    world_->guarded("sharing gradients", std::forward<F>(f));
  }

  [[nodiscard]] double mean(double x) { return world_->mean(x); }

  [[nodiscard]] std::vector<at::Tensor> gather(const at::Tensor& t) {
    return world_->all_gather(t);
  }

  /// Rank 0's `ok`, known on every rank (and a barrier: nobody goes on before rank 0 decided).
  [[nodiscard]] bool decide(bool ok) { return world_->rank0_decides(ok); }

 private:
  static std::int64_t mib(double m) { return static_cast<std::int64_t>(m * 1024.0 * 1024.0); }

  torch::nn::Module* model_;
  std::vector<at::Tensor> params_;
  Options o_;
  std::shared_ptr<World> world_;
  std::shared_ptr<c10d::Reducer> reducer_;
  std::shared_ptr<c10d::Logger> logger_;
};

}  // namespace difftrain::distributed
