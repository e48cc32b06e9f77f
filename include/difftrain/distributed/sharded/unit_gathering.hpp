#pragma once
// ShardedDataParallel's stage 3: units found as the model enters them (nn::in_unit), their
// parameters sent by their owners before forward and again before backward, freed after,
// prefetched in the order of the last pass, and whole on every rank inside a WholeParameters scope
// (FSDP2 keeps these in _fsdp_param_group and _fsdp_state). Defined out of the class; included by
// sharded_data_parallel.hpp.

#include "difftrain/distributed/sharded_data_parallel.hpp"

namespace difftrain::distributed {

inline void ShardedDataParallel::after_skipped_step() {
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

inline void ShardedDataParallel::listen() {
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

inline std::optional<std::size_t> ShardedDataParallel::unit_for(const torch::nn::Module& m) {
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

inline c10::StorageImpl* ShardedDataParallel::storage_of(std::size_t i) {
  return params_[i].unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
}

inline void ShardedDataParallel::materialize(std::size_t i) {
  c10::StorageImpl* s = storage_of(i);
  if (s->nbytes() != 0) return;
  const auto n = static_cast<std::size_t>(params_[i].numel() * params_[i].element_size());
  s->set_data_ptr_noswap(s->allocator()->allocate(n));
  s->set_nbytes(n);
  resident_bytes_ += static_cast<std::int64_t>(n);
  if (in_passes_ && !units_.empty())
    stats_.peak_parameter_bytes = std::max(stats_.peak_parameter_bytes, resident_bytes_);
}

inline void ShardedDataParallel::release(std::size_t i) {
  c10::StorageImpl* s = storage_of(i);
  resident_bytes_ -= static_cast<std::int64_t>(s->nbytes());
  s->set_data_ptr_noswap(at::DataPtr(nullptr, params_[i].device()));
  s->set_nbytes(0);
}

inline void ShardedDataParallel::start_gather(std::size_t u, bool ahead) {
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

inline void ShardedDataParallel::finish_gather(std::size_t u, bool ahead) {
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

inline void ShardedDataParallel::release_unit(std::size_t u) {
  Unit& unit = units_[u];
  for (auto& g : unit.gathers) g.work->wait(world_->timeout());  // never free what is arriving
  unit.gathers.clear();
  unit.in_backward = false;
  if (!unit.gathered) return;
  for (const std::size_t i : unit.freed) release(i);
  unit.gathered = false;
  ++stats_.releases;
}

inline void ShardedDataParallel::release_all() {
  const std::lock_guard<std::recursive_mutex> lock(unit_mutex_);
  for (std::size_t u = 0; u < units_.size(); ++u) release_unit(u);
}

inline bool ShardedDataParallel::gather_whole() {
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

inline void ShardedDataParallel::end_whole() {
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

inline void ShardedDataParallel::begin_pass() {
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

inline std::optional<std::size_t> ShardedDataParallel::neighbour(std::size_t u,
                                                                 bool forward) const {
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

inline void ShardedDataParallel::enter(const torch::nn::Module& m) {
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

inline void ShardedDataParallel::leave(const torch::nn::Module& m,
                                       const std::vector<at::Tensor>& outputs) {
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

inline void ShardedDataParallel::before_unit_backward(std::size_t u) {
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

inline void ShardedDataParallel::unit_gradient_in(std::size_t i) {
  const std::lock_guard<std::recursive_mutex> lock(unit_mutex_);
  const std::int64_t u = unit_of_param_[i];
  if (u < 0) return;
  Unit& unit = units_[static_cast<std::size_t>(u)];
  if (!unit.in_backward || arrived_[i]) return;
  arrived_[i] = true;
  if (--unit.waiting == 0) release_unit(static_cast<std::size_t>(u));
}

}  // namespace difftrain::distributed
