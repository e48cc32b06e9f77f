#pragma once
// What every data-parallel policy does to keep the ranks' copies of a model alike: check that
// every rank built the same model, and make every rank's tensors rank 0's.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

/// One setting every rank must share because it changes which collectives run and when (ZeRO's
/// stage, a bucket size, accumulation steps): its name and its value as text.
/// (A pair, so that the trainer names its own without including this layer.)
using RankSetting = std::pair<std::string, std::string>;

/// A number as a setting's value: the shortest text that reads back as it.
inline std::string setting_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  for (int precision = 1; precision < 17; ++precision) {
    char shorter[32];
    std::snprintf(shorter, sizeof shorter, "%.*g", precision, v);
    if (std::strtod(shorter, nullptr) == v) return shorter;
  }
  return buf;
}

/// The same value of every setting on every rank, checked before any other collective: ranks
/// started with different options would otherwise wait for each other in different collectives
/// until the timeout, or fail inside the transport. A ConfigError on every rank naming the first
/// setting that differs and which ranks hold which value. `settings` must list the same names in
/// the same order on every rank (the same code builds it), at most 255 of them.
inline void check_same_settings(const World& world, const std::vector<RankSetting>& settings,
                                const std::string& who) {
  if (!world.distributed()) return;
  constexpr std::int64_t kSlots = 256;
  if (static_cast<std::int64_t>(settings.size()) >= kSlots)
    throw ConfigError("lists " + std::to_string(settings.size()) + " settings, more than 255", who);
  auto fnv = [](const std::string& text) {
    std::uint64_t h = 1469598103934665603ULL;
    for (const unsigned char c : text) {
      h ^= c;
      h *= 1099511628211ULL;
    }
    return static_cast<std::int64_t>(h >> 1);
  };
  at::Tensor mine = at::zeros({kSlots}, at::kLong);
  auto* m = mine.data_ptr<std::int64_t>();
  m[0] = static_cast<std::int64_t>(settings.size());
  for (std::size_t i = 0; i < settings.size(); ++i)
    m[i + 1] = fnv(settings[i].first + '\0' + settings[i].second);
  const auto all = world.all_gather(mine);
  // The settings first (a setting that names the policy tells more than their count), the count
  // last.
  std::int64_t differing = -1;
  for (std::int64_t step = 1; step <= kSlots && differing < 0; ++step) {
    const std::int64_t k = step % kSlots;
    for (const auto& other : all)
      if (other[k].item<std::int64_t>() != m[k]) {
        differing = k;
        break;
      }
  }
  if (differing < 0) return;
  // Every rank found the same slot: each sends that setting's value, so the message names them.
  constexpr std::int64_t kText = 96;
  const std::string what = differing == 0 ? std::string("(the number of settings)")
                                          : settings[static_cast<std::size_t>(differing - 1)].first;
  const std::string value = differing == 0
                                ? std::to_string(settings.size())
                                : settings[static_cast<std::size_t>(differing - 1)].second;
  at::Tensor text = at::zeros({kText}, at::kByte);
  std::memcpy(text.data_ptr(), value.data(),
              std::min<std::size_t>(value.size(), static_cast<std::size_t>(kText - 1)));
  const auto texts = world.all_gather(text);
  std::vector<std::pair<std::string, std::vector<std::size_t>>> by_value;
  for (std::size_t r = 0; r < texts.size(); ++r) {
    const at::Tensor c = texts[r].contiguous();
    std::string v(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(kText));
    v.resize(v.find('\0') == std::string::npos ? v.size() : v.find('\0'));
    auto it = std::find_if(by_value.begin(), by_value.end(),
                           [&](const auto& entry) { return entry.first == v; });
    if (it == by_value.end()) it = by_value.insert(by_value.end(), {v, {}});
    it->second.push_back(r);
  }
  std::string held;
  for (const auto& [v, ranks] : by_value) {
    if (!held.empty()) held += "; ";
    held += ranks.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < ranks.size(); ++i)
      held += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
    held += (ranks.size() == 1 ? " has " : " have ") + v;
  }
  throw ConfigError("'" + what + "' differs between the ranks (" + held +
                        "); start every rank with the same options",
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
