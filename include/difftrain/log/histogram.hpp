#pragma once
// A tensor's histogram for TensorBoard, computed where the tensor lives (one small copy to the
// host per histogram, not the tensor): equal-width buckets between its finite min and max, plus
// the count, sum and sum of squares TensorBoard shows. Non-finite values are left out (`num`
// counts the finite ones).

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <string>

#include "difftrain/core/error.hpp"
#include "difftrain/log/event_file.hpp"

namespace difftrain::log {

[[nodiscard]] inline Histogram histogram_of(const at::Tensor& tensor, int buckets = 30) {
  if (buckets < 1) throw ConfigError("buckets must be >= 1", "histogram_of");
  if (!tensor.defined()) throw ConfigError("the tensor is undefined", "histogram_of");
  if (!at::isFloatingType(tensor.scalar_type()) && !at::isIntegralType(tensor.scalar_type(), true))
    throw ConfigError(
        std::string("cannot histogram a tensor of ") + c10::toString(tensor.scalar_type()),
        "histogram_of");
  const at::NoGradGuard no_grad;
  at::Tensor v = tensor.detach().reshape(-1).to(at::kDouble);
  v = v.masked_select(v.isfinite());
  Histogram h;
  if (v.numel() == 0) return h;
  const auto [lo_t, hi_t] = at::aminmax(v);
  const at::Tensor stats =
      at::stack({lo_t, hi_t, v.sum(), v.square().sum()}).cpu();  // the one synchronisation
  const auto* s = stats.const_data_ptr<double>();
  h.min = s[0];
  h.max = s[1];
  h.num = static_cast<double>(v.numel());
  h.sum = s[2];
  h.sum_squares = s[3];
  const int n = h.max > h.min ? buckets : 1;
  const at::Tensor counts =
      (n == 1 ? at::full({1}, h.num, v.options()) : at::histc(v, n, h.min, h.max)).cpu();
  const auto* c = counts.const_data_ptr<double>();
  const double width = (h.max - h.min) / n;
  for (int i = 0; i < n; ++i) {
    h.bucket_limit.push_back(i + 1 == n ? h.max : h.min + width * (i + 1));
    h.bucket.push_back(c[i]);
  }
  return h;
}

}  // namespace difftrain::log
