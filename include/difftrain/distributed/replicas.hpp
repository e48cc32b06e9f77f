#pragma once
// What every data-parallel policy does to keep the ranks' copies of a model alike: check that
// every rank built the same model, and make every rank's tensors rank 0's.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/distributed/world.hpp"

namespace difftrain::distributed {

/// The same number of parameters and buffers with the same shapes and dtypes on every rank;
/// otherwise a broadcast or a bucket would pair up different tensors. A ConfigError on every
/// rank (naming `who`) when one differs.
inline void check_same_model(const World& world, const std::vector<at::Tensor>& params,
                             torch::nn::Module& model, const std::string& who) {
  std::uint64_t h = 1469598103934665603ULL;  // FNV-1a over the dtypes and shapes
  auto mix = [&](std::int64_t v) {
    h ^= static_cast<std::uint64_t>(v);
    h *= 1099511628211ULL;
  };
  auto mix_tensor = [&](const at::Tensor& t) {
    mix(static_cast<std::int64_t>(t.scalar_type()));
    for (auto s : t.sizes()) mix(s);
  };
  for (const auto& p : params) mix_tensor(p);
  for (const auto& b : model.buffers()) mix_tensor(b);
  const at::Tensor mine = at::tensor(
      {static_cast<std::int64_t>(params.size()), static_cast<std::int64_t>(h >> 1)}, at::kLong);
  const auto all = world.all_gather(mine);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (!at::equal(all[r], all[0]))
      throw ConfigError("rank " + std::to_string(r) +
                            " trains a model with different parameters or buffers than rank 0 "
                            "(count, shapes or dtypes differ)",
                        who + ", rank " + std::to_string(world.rank()));
}

/// Rank 0's values into `tensors`, one broadcast per dtype and device.
inline void broadcast_from_rank0(const World& world, const std::vector<at::Tensor>& tensors) {
  if (!world.distributed()) return;
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors)
    groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
  at::NoGradGuard no_grad;
  for (auto& [key, ts] : groups) {
    std::vector<at::Tensor> flat_parts;
    for (const auto& t : ts) flat_parts.push_back(t.detach().reshape({-1}));
    std::vector<at::Tensor> flat{at::cat(flat_parts)};
    world.broadcast(flat, 0);
    std::int64_t at_ = 0;
    for (const auto& t : ts) {
      t.detach().copy_(flat[0].narrow(0, at_, t.numel()).view(t.sizes()));
      at_ += t.numel();
    }
  }
}

}  // namespace difftrain::distributed
