#pragma once
// Activations that are modules: PReLU has a learnable weight (saved as `<prefix>.weight`, as the
// web UI's hypernetwork files have it) and RReLU samples its slope only in training mode.

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/any.h>

#include <cstdint>
#include <string_view>

#include "difftrain/nn/activation/concepts.hpp"

namespace difftrain::nn::activation {

struct PReLU {
  static constexpr std::string_view name = "prelu";
  struct Options {
    std::int64_t num_parameters = 1;
    double init = 0.25;
  };
  static torch::nn::AnyModule make_module(const Options& o) {
    return torch::nn::AnyModule(
        torch::nn::PReLU(torch::nn::PReLUOptions().num_parameters(o.num_parameters).init(o.init)));
  }
};

struct RReLU {
  static constexpr std::string_view name = "rrelu";
  struct Options {
    double lower = 1.0 / 8.0;
    double upper = 1.0 / 3.0;
  };
  static torch::nn::AnyModule make_module(const Options& o) {
    return torch::nn::AnyModule(
        torch::nn::RReLU(torch::nn::RReLUOptions().lower(o.lower).upper(o.upper)));
  }
};

}  // namespace difftrain::nn::activation
