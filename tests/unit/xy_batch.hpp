#pragma once
// The (inputs, targets) batch the trainer tests feed their small networks: a batch the trainer
// can split into chunks (size and slice, for max_batch_size).

#include <ATen/ATen.h>

#include <cstdint>

namespace difftrain::test {

struct XyBatch {
  at::Tensor x, y;
  [[nodiscard]] std::int64_t size() const { return x.size(0); }
  [[nodiscard]] XyBatch slice(std::int64_t start, std::int64_t length) const {
    return {x.narrow(0, start, length), y.narrow(0, start, length)};
  }
};

}  // namespace difftrain::test
