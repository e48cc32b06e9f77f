#pragma once
// Gradients grouped by device and dtype, the unit torch's multi-tensor kernels take (clipping,
// unscaling, the overflow check).

#include <ATen/ATen.h>

#include <cstddef>
#include <tuple>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::train {

/// A tensor's device type, device index and dtype, compared as integers: the unit torch's
/// multi-tensor and fused kernels take, found without building a string per tensor and step.
using TensorKind = std::tuple<int, int, int>;
inline TensorKind kind_of(const at::Tensor& t) {
  return {static_cast<int>(t.device().type()), static_cast<int>(t.device().index()),
          static_cast<int>(t.scalar_type())};
}

/// The defined gradients of `params`, one list per (device, dtype) in first-seen order, as
/// torch's _group_tensors_by_device_and_dtype groups them. A linear search over the few kinds a
/// model has: no strings or maps are built per step. Sparse gradients are a ConfigError naming
/// `where` (the multi-tensor kernels take dense tensors).
inline std::vector<std::vector<at::Tensor>> gradients_by_kind(const std::vector<at::Tensor>& params,
                                                              const char* where = "gradients") {
  std::vector<TensorKind> kinds;
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (g.is_sparse()) throw ConfigError("sparse gradients are not supported", where);
    const TensorKind kind = kind_of(g);
    std::size_t i = 0;
    while (i < kinds.size() && kinds[i] != kind) ++i;
    if (i == kinds.size()) {
      kinds.push_back(kind);
      out.emplace_back();
    }
    out[i].push_back(g);
  }
  return out;
}

}  // namespace difftrain::train
