#pragma once
// Which examples each rank of a data-parallel run reads: torch.utils.data.DistributedSampler's
// rule, index for index. Shuffled with torch.randperm from a generator seeded with seed + epoch
// (so every rank draws the same permutation), padded by repeating the first indices so every rank
// gets as many (or, with drop_last, cut to a multiple of the world size), then rank r takes
// positions r, r + world, r + 2·world, ...

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::distributed {

class DistributedSampler {
 public:
  struct Options {
    std::int64_t num_replicas = 1;
    std::int64_t rank = 0;
    bool shuffle = true;
    std::uint64_t seed = 0;
    bool drop_last = false;
  };

  DistributedSampler(std::int64_t dataset_size, const Options& o) : n_(dataset_size), o_(o) {
    const std::string where = "DistributedSampler";
    if (dataset_size < 0) throw ConfigError("dataset size must be >= 0", where);
    if (o.num_replicas < 1)
      throw ConfigError("num_replicas must be >= 1, got " + std::to_string(o.num_replicas), where);
    if (o.rank < 0 || o.rank >= o.num_replicas)
      throw ConfigError("rank " + std::to_string(o.rank) + " is outside [0, " +
                            std::to_string(o.num_replicas - 1) + "]",
                        where);
    // As torch: with drop_last the tail that cannot be split evenly is dropped.
    num_samples_ = o.drop_last && n_ % o.num_replicas != 0
                       ? (n_ - o.num_replicas + o.num_replicas - 1) / o.num_replicas
                       : (n_ + o.num_replicas - 1) / o.num_replicas;
    if (num_samples_ < 0) num_samples_ = 0;
  }

  /// The epoch seeds the shuffle (set it before each epoch, as torch's set_epoch).
  void set_epoch(std::int64_t epoch) { epoch_ = epoch; }
  [[nodiscard]] std::int64_t epoch() const { return epoch_; }
  /// Indices this rank reads in one epoch.
  [[nodiscard]] std::int64_t size() const { return num_samples_; }

  /// This rank's indices for the current epoch.
  [[nodiscard]] std::vector<std::int64_t> indices() const {
    std::vector<std::int64_t> all;
    if (o_.shuffle) {
      at::Generator g =
          at::make_generator<at::CPUGeneratorImpl>(o_.seed + static_cast<std::uint64_t>(epoch_));
      const at::Tensor perm = at::randperm(n_, g, at::TensorOptions().dtype(at::kLong));
      all.assign(perm.data_ptr<std::int64_t>(), perm.data_ptr<std::int64_t>() + n_);
    } else {
      all.resize(static_cast<std::size_t>(n_));
      for (std::int64_t i = 0; i < n_; ++i) all[static_cast<std::size_t>(i)] = i;
    }
    const auto total = static_cast<std::size_t>(num_samples_ * o_.num_replicas);
    if (all.size() < total && !all.empty()) {  // pad by repeating from the start
      const std::size_t have = all.size();
      for (std::size_t i = 0; all.size() < total; ++i) all.push_back(all[i % have]);
    }
    all.resize(total);
    std::vector<std::int64_t> out;
    out.reserve(static_cast<std::size_t>(num_samples_));
    for (std::size_t i = static_cast<std::size_t>(o_.rank); i < total;
         i += static_cast<std::size_t>(o_.num_replicas))
      out.push_back(all[i]);
    return out;
  }

 private:
  std::int64_t n_;
  Options o_;
  std::int64_t epoch_ = 0;
  std::int64_t num_samples_ = 0;
};

}  // namespace difftrain::distributed
