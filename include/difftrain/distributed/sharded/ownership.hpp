#pragma once
// ShardedDataParallel's ownership of parameters: the partition into N contiguous runs (each
// parameter whole, on one rank), each rank's optimizer groups, the copies an offloaded or
// mixed-precision optimizer steps (masters), sending each owner's values to every rank after a
// step, and the memory a rank holds (FSDP2 keeps these in _fsdp_param). Defined out of the class;
// included by sharded_data_parallel.hpp.

#include "difftrain/distributed/sharded_data_parallel.hpp"
#include "difftrain/train/adafactor.hpp"
#include "difftrain/train/adamw_8bit.hpp"
#include "difftrain/train/lion.hpp"
#include "difftrain/train/prodigy.hpp"
#include "difftrain/train/schedule_free.hpp"

namespace difftrain::distributed {

inline std::vector<train::ParamGroup> ShardedDataParallel::groups_of_rank(
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

inline std::vector<at::Tensor> ShardedDataParallel::owned_params() const {
  std::vector<at::Tensor> out;
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (owner_[i] == world_->rank() || owner_[i] == -1)
      out.push_back(copies_.empty() ? params_[i] : copies_[i]);
  return out;
}

inline void ShardedDataParallel::after_optimizer_step() {
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

template <class Mine, class Take>
void ShardedDataParallel::from_owners(Mine&& mine, Take&& take) {
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
      const at::TensorOptions to = params_[run.front()].options().dtype(dtype).requires_grad(false);
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

inline auto ShardedDataParallel::memory(const std::vector<at::Tensor>& params,
                                        torch::optim::Optimizer& optimizer) -> Memory {
  Memory m;
  auto bytes = [](const at::Tensor& t) {
    return t.defined() ? static_cast<std::int64_t>(t.numel() * t.element_size()) : std::int64_t{0};
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
    else if (const auto* pr = dynamic_cast<const train::ProdigyParamState*>(state.get()))
      m.optimizer +=
          bytes(pr->exp_avg()) + bytes(pr->exp_avg_sq()) + bytes(pr->s()) + bytes(pr->p0());
    else if (const auto* f = dynamic_cast<const train::FactoredParamState*>(state.get()))
      m.optimizer += f->nbytes();
    else if (const auto* q = dynamic_cast<const train::AdamW8bitParamState*>(state.get()))
      m.optimizer += q->nbytes();
    else if (const auto* z = dynamic_cast<const train::ScheduleFreeParamState*>(state.get()))
      m.optimizer += bytes(z->z()) + bytes(z->exp_avg_sq());
    else if (const auto* l = dynamic_cast<const train::LionParamState*>(state.get()))
      m.optimizer += bytes(l->exp_avg());
    else if (const auto* g = dynamic_cast<const torch::optim::SGDParamState*>(state.get()))
      m.optimizer += bytes(g->momentum_buffer());
    else if (const auto* r = dynamic_cast<const torch::optim::RMSpropParamState*>(state.get()))
      m.optimizer += bytes(r->square_avg()) + bytes(r->momentum_buffer()) + bytes(r->grad_avg());
    else if (const auto* d = dynamic_cast<const torch::optim::AdagradParamState*>(state.get()))
      m.optimizer += bytes(d->sum());
  }
  return m;
}

inline void ShardedDataParallel::partition() {
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

inline void ShardedDataParallel::replace_data(std::size_t i, const at::Tensor& value) {
  const auto before = static_cast<std::int64_t>(params_[i].storage().nbytes());
  params_[i].set_data(value);
  resident_bytes_ += static_cast<std::int64_t>(params_[i].storage().nbytes()) - before;
}

inline void ShardedDataParallel::to_param_dtype() {
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!copies_.empty() && copies_[i].defined()) copies_[i].copy_(params_[i].detach());
    params_[i].mutable_grad().reset();
    replace_data(i, params_[i].detach().to(*o_.param_dtype));
  }
  full_precision_ = false;
}

inline void ShardedDataParallel::to_full_precision() {
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

}  // namespace difftrain::distributed
