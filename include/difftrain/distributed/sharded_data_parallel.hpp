#pragma once
// Config::Parallel = distributed::ShardedDataParallel: data parallelism whose training state is
// sharded over the ranks, as DeepSpeed's ZeRO and torch's ZeroRedundancyOptimizer do:
//
//   stage 1  the optimizer state: each rank's optimizer steps only the parameters it owns, so
//            its moments take 1/N of the memory; gradients are averaged by all-reduce as in
//            DataParallel, and after the step every owner sends the parameters it updated;
//   stage 2  and the gradients: each bucket of gradients is reduced to the rank that owns it,
//            and the other ranks drop theirs as soon as they have sent them.
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
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/distributed/data_parallel.hpp"
#include "difftrain/distributed/replicas.hpp"
#include "difftrain/distributed/world.hpp"
#include "difftrain/train/optimizer.hpp"

namespace difftrain::distributed {

class ShardedDataParallel {
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
    /// Stage 0 only (DataParallel's option): stages 1 and 2 find unused parameters by
    /// themselves, without a graph search.
    bool find_unused_parameters = false;
    /// Keep this rank's optimizer (its copies of the parameters it owns, their gradients and the
    /// optimizer's state) in host memory; stages 1 and 2.
    bool offload_optimizer = false;
    /// Send each bucket of gradients as soon as backward has produced all of them, while the
    /// rest of backward runs (as DDP's reducer); off: all of them after backward.
    bool overlap_backward = true;
  };

  ShardedDataParallel(torch::nn::Module& model, const std::vector<at::Tensor>& params,
                      const Options& o)
      : model_(&model), params_(params), o_(o) {
    if (o_.stage == 3)
      throw ConfigError(
          "is 3 (parameters sharded as well); this version shards the optimizer "
          "state (1) and the gradients (2)",
          "ShardedDataParallel options: stage");
    if (o_.stage < 0 || o_.stage > 2)
      throw ConfigError("is " + std::to_string(o_.stage) +
                            "; the stages are 0 (replicated, DataParallel), 1 and 2",
                        "ShardedDataParallel options: stage");
    if (!(o_.bucket_cap_mb > 0.0))
      throw ConfigError("must be positive", "ShardedDataParallel options: bucket_cap_mb");
    world_ = o_.world ? o_.world : World::from_environment(o_.world_options);
    for (std::size_t i = 0; i < params_.size(); ++i)
      index_.emplace(params_[i].unsafeGetTensorImpl(), i);
    if (o_.offload_optimizer && o_.stage == 0)
      throw ConfigError("needs stage 1 or 2 (at stage 0 every rank steps every parameter)",
                        "ShardedDataParallel options: offload_optimizer");
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
    make_buckets();
    if (o_.offload_optimizer) {
      host_.resize(params_.size());
      for (std::size_t i = 0; i < params_.size(); ++i) {
        if (owner_[i] != world_->rank()) continue;
        const at::Tensor& p = params_[i];
        host_[i] =
            at::empty(p.sizes(),
                      p.options().device(at::kCPU).requires_grad(false).pinned_memory(p.is_cuda()));
      }
    }
    if (world_->distributed()) check_same_model(*world_, params_, *model_, "ShardedDataParallel");
    start();
    bucket_of_.assign(params_.size(), 0);
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      for (const std::size_t i : buckets_[b].params) bucket_of_[i] = b;
    waiting_.assign(buckets_.size(), 0);
    ready_.assign(params_.size(), false);
    if (!world_->distributed() || !o_.overlap_backward) return;
    // As the reducer: a hook on each parameter's gradient accumulator says when it is ready.
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

  ShardedDataParallel(const ShardedDataParallel&) = delete;
  ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;
  ~ShardedDataParallel() { *alive_ = false; }  // hooks outliving this object do nothing

  [[nodiscard]] std::int64_t rank() const { return world_->rank(); }
  [[nodiscard]] std::int64_t world_size() const { return world_->size(); }
  [[nodiscard]] const World& world() const { return *world_; }
  [[nodiscard]] int stage() const { return o_.stage; }

  /// How many buckets went out while backward was still running, over the run (overlap).
  [[nodiscard]] std::int64_t buckets_sent_during_backward() const { return sent_during_backward_; }

  /// The rank whose optimizer steps parameter `i` (an index into the trainer's parameters); -1
  /// at stage 0, where every rank steps every parameter.
  [[nodiscard]] std::int64_t owner(std::size_t i) const { return owner_.at(i); }

  // ---- the trainer's hooks (train/parallel.hpp) ---------------------------------------------

  /// Every parameter and buffer becomes rank 0's.
  /// Every parameter and buffer becomes rank 0's (and the host copies of an offloaded
  /// optimizer take the parameters' values: at start and after a resume).
  void start() {
    if (replicated_) return replicated_->start();
    if (world_->distributed()) {
      std::vector<at::Tensor> all(params_.begin(), params_.end());
      for (const auto& b : model_->buffers()) all.push_back(b);
      broadcast_from_rank0(*world_, all);
    }
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < host_.size(); ++i)
      if (host_[i].defined()) host_[i].copy_(params_[i].detach());
  }

  void before_forward(bool sync) {
    if (replicated_) return replicated_->before_forward(sync);
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
      return offload_gradients();
    }
    world_->guarded("sharing gradients", [&] {
      std::forward<F>(f)();
      reduce_gradients();
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
        // This rank's optimizer steps the host copies when it is offloaded.
        const bool host = r == world_->rank() && !host_.empty();
        mine.params.push_back(host ? host_[it->second] : g.params[i]);
      }
      out.push_back(std::move(mine));
    }
    return out;
  }

  [[nodiscard]] std::vector<at::Tensor> owned_params() const {
    std::vector<at::Tensor> out;
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (owner_[i] == world_->rank() || owner_[i] == -1)
        out.push_back(host_.empty() ? params_[i] : host_[i]);
    return out;
  }

  void sum_across(at::Tensor& t) { world_->all_reduce_sum(t); }
  void max_across(at::Tensor& t) { world_->all_reduce_max(t); }

  void zero_grad() {
    for (auto& p : params_) p.mutable_grad().reset();
    for (auto& h : host_)
      if (h.defined()) h.mutable_grad().reset();
  }

  /// Every owner sends the parameters its optimizer updated, bucket by bucket.
  void after_optimizer_step() {
    if (replicated_) return;
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < host_.size(); ++i)  // the updated host copies back
      if (host_[i].defined()) params_[i].detach().copy_(host_[i], /*non_blocking=*/true);
    if (!world_->distributed()) return;
    world_->guarded("sending updated parameters", [&] {
      pipeline(
          [&](const Bucket& b) {
            at::Tensor flat;
            if (b.owner == world_->rank()) {
              std::vector<at::Tensor> parts;
              for (const std::size_t i : b.params)
                parts.push_back(params_[i].detach().reshape({-1}));
              flat = at::cat(parts);
            } else {
              flat = at::empty({b.numel}, params_[b.params.front()].options().requires_grad(false));
            }
            std::vector<at::Tensor> v{flat};
            c10d::BroadcastOptions bo;
            bo.rootRank = b.owner;
            return std::make_pair(world_->group()->broadcast(v, bo), flat);
          },
          [&](const Bucket& b, const at::Tensor& flat) {
            if (b.owner == world_->rank()) return;
            std::int64_t at_ = 0;
            for (const std::size_t i : b.params) {
              const at::Tensor& p = params_[i];
              p.detach().copy_(flat.narrow(0, at_, p.numel()).view(p.sizes()));
              at_ += p.numel();
            }
          });
    });
  }

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
      m.parameters += bytes(p);
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
      f.work->wait(world_->timeout());
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
    at::Tensor flat = at::zeros({b.numel + static_cast<std::int64_t>(b.params.size())},
                                first.options().requires_grad(false));
    std::int64_t at_ = 0;
    for (std::size_t k = 0; k < b.params.size(); ++k) {
      at::Tensor& p = params_[b.params[k]];
      if (p.grad().defined()) {
        flat.narrow(0, at_, p.numel()).copy_(p.grad().reshape({-1}));
        flat[b.numel + static_cast<std::int64_t>(k)] = 1.0;
        // Stage 2: a gradient this rank does not own is gone once it is packed.
        if (o_.stage == 2 && b.owner != me) p.mutable_grad().reset();
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
    if (o_.stage == 2 && b.owner != world_->rank()) return;
    const at::Tensor used = f.buffer.narrow(0, b.numel, static_cast<std::int64_t>(b.params.size()))
                                .to(at::kCPU, at::kDouble)
                                .contiguous();
    const double* used_by = used.data_ptr<double>();
    std::int64_t at_ = 0;
    for (std::size_t k = 0; k < b.params.size(); ++k) {
      at::Tensor& p = params_[b.params[k]];
      if (!(used_by[k] > 0.0)) {
        p.mutable_grad().reset();
      } else {
        const at::Tensor mean = f.buffer.narrow(0, at_, p.numel()).view(p.sizes());
        if (p.grad().defined())
          p.mutable_grad().copy_(mean);
        else
          p.mutable_grad() = mean.clone(at::MemoryFormat::Preserve);
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
    if (!world_->distributed()) return offload_gradients();
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
    offload_gradients();
  }

  // An offloaded optimizer's gradients: this rank's averaged gradients into the host copies,
  // dropped on the device.
  void offload_gradients() {
    for (std::size_t i = 0; i < host_.size(); ++i) {
      if (!host_[i].defined()) continue;
      at::Tensor& p = params_[i];
      if (!p.grad().defined()) {
        host_[i].mutable_grad().reset();
        continue;
      }
      if (!host_[i].grad().defined()) host_[i].mutable_grad() = at::empty_like(host_[i]);
      host_[i].mutable_grad().copy_(p.grad());
      p.mutable_grad().reset();
    }
  }

  torch::nn::Module* model_;
  std::vector<at::Tensor> params_;
  Options o_;
  std::shared_ptr<World> world_;
  std::unordered_map<const void*, std::size_t> index_;
  std::vector<std::int64_t> owner_;
  std::vector<Bucket> buckets_;
  std::unique_ptr<DataParallel> replicated_;  // stage 0
  std::vector<at::Tensor> host_;  // offload_optimizer: host copies of the parameters owned here
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
};

}  // namespace difftrain::distributed
