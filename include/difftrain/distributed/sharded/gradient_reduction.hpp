#pragma once
// ShardedDataParallel's gradient reduction: buckets of gradients, the hooks on each parameter's
// gradient accumulator that send a bucket as soon as backward has produced it, the pipeline of
// at most two buckets on the wire, all-reduce (stage 1) or reduce to the owner (stage 2), and
// gradients accumulated in reduce_dtype (FSDP2 keeps these in _fsdp_collectives). Defined out of
// the class; included by sharded_data_parallel.hpp.

#include "difftrain/distributed/sharded_data_parallel.hpp"

namespace difftrain::distributed {

template <class F>
void ShardedDataParallel::guard(F&& f) {
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

inline void ShardedDataParallel::make_buckets() {
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

template <class Send, class Receive>
void ShardedDataParallel::pipeline(Send&& send, Receive&& receive) {
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

inline void ShardedDataParallel::launch(std::size_t index) {
  at::NoGradGuard no_grad;
  const Bucket& b = buckets_[index];
  const std::int64_t me = world_->rank();
  const at::Tensor& first = params_[b.params.front()];
  at::Tensor flat = at::zeros({b.numel + static_cast<std::int64_t>(b.params.size())},
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

inline void ShardedDataParallel::finish_oldest() {
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

inline void ShardedDataParallel::launch_ready(bool all) {
  while (next_ > 0 && (all || waiting_[next_ - 1] == 0)) {
    if (!all) ++sent_during_backward_;
    launch(--next_);
    if (flying_.size() > 2) finish_oldest();
  }
}

inline void ShardedDataParallel::on_gradient(std::size_t i) {
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

inline void ShardedDataParallel::arm() {
  armed_ = true;
  failed_ = nullptr;
  late_.reset();
  next_ = buckets_.size();
  std::fill(ready_.begin(), ready_.end(), false);
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    waiting_[b] = static_cast<std::int64_t>(buckets_[b].params.size());
}

inline void ShardedDataParallel::reduce_gradients() {
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

inline void ShardedDataParallel::gradients_to_copies() {
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

inline void ShardedDataParallel::hook_gradients() {
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

inline void ShardedDataParallel::widen_gradients() {
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

}  // namespace difftrain::distributed
