#pragma once
// Reading the golden values that tests/reference/ref_*.py write (the `reference.generate`
// fixture runs them before the unit tests).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "test_dirs.hpp"

namespace difftrain::test {

// The name by value: a reference parameter bound to a temporary string would make GCC 13 warn
// (-Wdangling-reference) at every `const auto& g = golden("...")`.
inline const nlohmann::json& golden(std::string_view name) {
  static std::map<std::string, nlohmann::json, std::less<>> cache;
  const std::string file(name);
  auto it = cache.find(file);
  if (it == cache.end()) {
    const std::string path = std::string(DIFFTRAIN_GOLDEN_DIR) + "/" + file;
    std::ifstream in(path);
    if (!in)
      throw std::runtime_error("golden file missing: " + path +
                               " (run the reference.generate test)");
    it = cache.emplace(file, nlohmann::json::parse(in)).first;
  }
  return it->second;
}

/// A float64 tensor from a JSON list of numbers and a shape.
inline at::Tensor tensor_from(const nlohmann::json& values, std::vector<std::int64_t> shape = {}) {
  std::vector<double> v = values.get<std::vector<double>>();
  if (shape.empty()) shape.push_back(static_cast<std::int64_t>(v.size()));
  return at::tensor(v, at::kDouble).reshape(shape);
}

inline std::vector<std::int64_t> shape_from(const nlohmann::json& j) {
  return j.get<std::vector<std::int64_t>>();
}

/// Largest |a - b| / max(|b|, floor): relative error that does not explode near zero.
inline double max_rel_error(const at::Tensor& a, const at::Tensor& b, double floor = 1e-30) {
  const at::Tensor ad = a.to(at::kDouble).flatten();
  const at::Tensor bd = b.to(at::kDouble).flatten();
  return ((ad - bd).abs() / bd.abs().clamp_min(floor)).max().item<double>();
}

}  // namespace difftrain::test
