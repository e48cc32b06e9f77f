#pragma once
// The pieces of a Trainer checkpoint that do not depend on the trainer's policies: the check that
// its parts count the same steps, byte tensors (an archive inside the pickle), every rank's
// generator states, and an optimizer shard read from disk.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/json_parse.hpp"

namespace difftrain::train::trainer_detail {

/// Where two fingerprints' parameter groups (lists of {label, names}) first differ, in one short
/// sentence: the group, and the first name the checkpoint and the trainer hold differently.
inline std::string group_difference(const nlohmann::json& saved, const nlohmann::json& now) {
  if (!saved.is_array() || !now.is_array())
    return "param_groups = " + io::json_brief(saved) + ", this trainer has " + io::json_brief(now);
  if (saved.size() != now.size())
    return std::to_string(saved.size()) + " parameter groups, this trainer has " +
           std::to_string(now.size());
  for (std::size_t g = 0; g < now.size(); ++g) {
    const nlohmann::json& a = saved[g];
    const nlohmann::json& b = now[g];
    const std::string label = b.value("label", std::string());
    if (!a.is_object() || a.value("label", nlohmann::json()) != b.value("label", nlohmann::json()))
      return "group " + std::to_string(g) + " = " +
             io::json_brief(a.is_object() && a.contains("label") ? a["label"] : a) +
             ", this trainer's is '" + label + "'";
    const nlohmann::json names_a = a.value("names", nlohmann::json::array());
    const nlohmann::json& names_b = b["names"];
    if (!names_a.is_array()) return "group '" + label + "' without a list of names";
    const std::size_t common = std::min(names_a.size(), names_b.size());
    for (std::size_t i = 0; i < common; ++i)
      if (names_a[i] != names_b[i])
        return "group '" + label + "' holding " + io::json_brief(names_a[i]) + " as parameter " +
               std::to_string(i) + ", this trainer has " + io::json_brief(names_b[i]) + " there (" +
               std::to_string(names_a.size()) + " parameters in the group, this trainer " +
               std::to_string(names_b.size()) + ")";
    if (names_a.size() != names_b.size())
      return "group '" + label + "' of " + std::to_string(names_a.size()) + " parameters (" +
             (names_a.size() > names_b.size()
                  ? "first extra: " + io::json_brief(names_a[common])
                  : "first missing: " + io::json_brief(names_b[common])) +
             "), this trainer's has " + std::to_string(names_b.size());
  }
  return "other parameter groups";
}

/// The parts of a checkpoint count the same steps: every applied step moves the scheduler once
/// and the EMA once, so a step counter that disagrees with them is damage (a step of 2^62 beside
/// a scheduler at 20 would make a resumed run believe itself finished).
/// `ema_counters` are the keys the EMA rule declares as counters; they are looked for at any depth
/// of the EMA's state (post-hoc EMA nests one rule state per profile).
inline void check_parts_agree(const nlohmann::json& js, std::int64_t step, const std::string& where,
                              const std::vector<std::string>& ema_counters = {}) {
  const auto& sched = js.at("scheduler");
  if (sched.contains("last_epoch") && sched["last_epoch"].is_number_integer() &&
      sched["last_epoch"].get<std::int64_t>() != step)
    throw FormatError("says step " + std::to_string(step) + " but its lr scheduler is at step " +
                          std::to_string(sched["last_epoch"].get<std::int64_t>()) +
                          "; the parts of the checkpoint disagree",
                      where + " step");
  for (const char* key : {"skipped_nonfinite", "skipped_overflow"})
    if (js.value(key, std::int64_t{0}) < 0)
      throw FormatError(std::string("has a negative '") + key + "'", where + " json");
  if (!js.contains("ema") || ema_counters.empty()) return;
  // An EMA counts its updates (diffusers' optimization_step, ema-pytorch's step, LitEma's
  // num_updates): never more than the steps taken.
  std::vector<const nlohmann::json*> stack{&js.at("ema")};
  while (!stack.empty()) {
    const nlohmann::json* node = stack.back();
    stack.pop_back();
    if (node->is_array())
      for (const auto& e : *node) stack.push_back(&e);
    if (!node->is_object()) continue;
    for (const auto& [key, value] : node->items()) {
      if (value.is_structured()) stack.push_back(&value);
      if (std::find(ema_counters.begin(), ema_counters.end(), key) != ema_counters.end() &&
          value.is_number_integer() &&
          (value.get<std::int64_t>() < 0 || value.get<std::int64_t>() > step))
        throw FormatError("says step " + std::to_string(step) + " but its EMA's '" + key + "' is " +
                              value.dump() + "; the parts of the checkpoint disagree",
                          where + " step");
    }
  }
}

/// A 1-D uint8 tensor that takes over `s`'s bytes without copying them (a sharded optimizer's
/// state is the largest thing a save holds: a copy of it was 8/N B per parameter more at save).
inline at::Tensor bytes_tensor(std::string&& s) {
  auto* owner = new std::string(std::move(s));
  return at::from_blob(
      owner->data(), {static_cast<std::int64_t>(owner->size())}, [owner](void*) { delete owner; },
      at::TensorOptions().dtype(at::kByte));
}
inline at::Tensor bytes_tensor(const std::string& s) {
  at::Tensor t = at::empty({static_cast<std::int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}
inline std::string tensor_bytes(const at::Tensor& t, const std::string& where) {
  if (t.scalar_type() != at::kByte || t.dim() != 1)
    throw FormatError("must be a 1-D uint8 tensor", where);
  const at::Tensor c = t.contiguous();
  return {static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.numel())};
}
/// The seed of rank `rank`'s generators when the checkpoint it resumes from has none of its own:
/// a number drawn from rank 0's saved CPU generator, mixed with the rank (splitmix64), so every
/// rank differs from every other and the same resume gives the same seeds.
inline std::uint64_t rank_seed(const at::Tensor& rank0_state, std::int64_t rank,
                               const std::string& where) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>();
  try {
    g.set_state(rank0_state);
  } catch (const c10::Error& e) {
    throw FormatError(std::string("is not a CPU generator state: ") + e.what_without_backtrace(),
                      where);
  }
  std::uint64_t z = g.get<at::CPUGeneratorImpl>()->random64() +
                    0x9E3779B97F4A7C15ULL * static_cast<std::uint64_t>(rank + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// The state of a CPU generator seeded with `seed`.
inline at::Tensor cpu_generator_state(std::uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return g.get_state();
}

/// This process's CUDA generator states, one per device (none without CUDA).
inline std::vector<at::Tensor> cuda_generator_states() {
  std::vector<at::Tensor> out;
  if (!torch::cuda::is_available()) return out;
  for (c10::DeviceIndex i = 0; i < static_cast<c10::DeviceIndex>(torch::cuda::device_count()); ++i)
    out.push_back(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, i)).get_state());
  return out;
}

/// Every rank's list of byte tensors, in rank order. Ranks may hold lists of different lengths
/// and sizes (a node with fewer devices): the sizes travel first, then the bytes, padded to the
/// longest rank's.
template <class P>
std::vector<std::vector<at::Tensor>> gather_state_lists(P& parallel,
                                                        const std::vector<at::Tensor>& own) {
  at::Tensor sizes = at::zeros({64}, at::kLong);
  if (own.size() > 63)
    throw ConfigError("has " + std::to_string(own.size()) + " generator states, more than 63",
                      "checkpoint of this rank");
  sizes[0] = static_cast<std::int64_t>(own.size());
  std::vector<at::Tensor> bytes;
  for (std::size_t i = 0; i < own.size(); ++i) {
    bytes.push_back(own[i].contiguous().view(at::kByte).reshape({-1}));
    sizes[static_cast<std::int64_t>(i) + 1] = bytes.back().numel();
  }
  const std::vector<at::Tensor> all_sizes = parallel.gather(sizes);
  std::int64_t longest = 0;
  for (const at::Tensor& t : all_sizes)
    longest = std::max(longest, t.slice(0, 1).sum().item<std::int64_t>());
  at::Tensor packed = at::zeros({longest}, at::kByte);
  if (!bytes.empty()) packed.narrow(0, 0, at::cat(bytes).numel()).copy_(at::cat(bytes));
  const std::vector<at::Tensor> all_bytes = parallel.gather(packed);
  std::vector<std::vector<at::Tensor>> out(all_bytes.size());
  for (std::size_t r = 0; r < all_bytes.size(); ++r) {
    const auto n = all_sizes[r][0].item<std::int64_t>();
    std::int64_t at_byte = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const auto len = all_sizes[r][i + 1].item<std::int64_t>();
      out[r].push_back(all_bytes[r].narrow(0, at_byte, len).clone());
      at_byte += len;
    }
  }
  return out;
}

/// Optimizer state for some parameters: their names per parameter group (the order its archive
/// lists them) and LibTorch's archive bytes.
struct OptimizerShard {
  std::vector<std::vector<std::string>> names;
  std::string bytes;
  std::string where;
};

}  // namespace difftrain::train::trainer_detail
