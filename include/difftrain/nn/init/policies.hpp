#pragma once
// Weight-init policies by the names the web UI's hypernetwork files store ("Normal",
// "XavierUniform", ...), with its rules: biases are zeroed (Normal: drawn with std 0, which
// consumes the random stream exactly as the reference does, so seeded runs match it draw for
// draw), and Kaiming's nonlinearity follows the activation (leaky_relu for "leakyrelu", else relu).

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/init.h>

#include <cmath>
#include <string_view>

#include "difftrain/core/type_list.hpp"
#include "difftrain/nn/init/concepts.hpp"

namespace difftrain::nn::init {

/// The nonlinearity the reference hands Kaiming init for an activation name.
[[nodiscard]] inline torch::nn::init::NonlinearityType kaiming_nonlinearity_for(
    std::string_view activation) {
  if (activation == "leakyrelu") return torch::kLeakyReLU;
  return torch::kReLU;
}

/// normal(0, std) weights, normal(0, bias_std) biases; the reference's defaults 0.01 and 0.
struct Normal {
  static constexpr std::string_view name = "Normal";
  struct Options {
    double std = 0.01;
    double bias_std = 0.0;
  };
  static void apply(at::Tensor& weight, at::Tensor& bias, const Options& o) {
    const at::NoGradGuard no_grad;
    weight.normal_(0.0, o.std);
    if (bias.defined()) bias.normal_(0.0, o.bias_std);
  }
};

struct XavierUniform {
  static constexpr std::string_view name = "XavierUniform";
  struct Options {
    double gain = 1.0;
  };
  static void apply(at::Tensor& weight, at::Tensor& bias, const Options& o) {
    torch::nn::init::xavier_uniform_(weight, o.gain);
    if (bias.defined()) torch::nn::init::zeros_(bias);
  }
};

struct XavierNormal {
  static constexpr std::string_view name = "XavierNormal";
  struct Options {
    double gain = 1.0;
  };
  static void apply(at::Tensor& weight, at::Tensor& bias, const Options& o) {
    torch::nn::init::xavier_normal_(weight, o.gain);
    if (bias.defined()) torch::nn::init::zeros_(bias);
  }
};

struct KaimingUniform {
  static constexpr std::string_view name = "KaimingUniform";
  struct Options {
    torch::nn::init::NonlinearityType nonlinearity = torch::kReLU;
  };
  static void apply(at::Tensor& weight, at::Tensor& bias, const Options& o) {
    torch::nn::init::kaiming_uniform_(weight, 0.0, torch::kFanIn, o.nonlinearity);
    if (bias.defined()) torch::nn::init::zeros_(bias);
  }
};

struct KaimingNormal {
  static constexpr std::string_view name = "KaimingNormal";
  struct Options {
    torch::nn::init::NonlinearityType nonlinearity = torch::kReLU;
  };
  static void apply(at::Tensor& weight, at::Tensor& bias, const Options& o) {
    torch::nn::init::kaiming_normal_(weight, 0.0, torch::kFanIn, o.nonlinearity);
    if (bias.defined()) torch::nn::init::zeros_(bias);
  }
};

/// What torch.nn.Linear does on construction: kaiming_uniform(a=√5) weights and
/// uniform(±1/√fan_in) biases.
struct Default {
  static constexpr std::string_view name = "Default";
  struct Options {};
  static void apply(at::Tensor& weight, at::Tensor& bias, const Options& /*unused*/) {
    torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
    if (bias.defined()) {
      const double fan_in =
          static_cast<double>(weight.dim() > 1 ? weight[0].numel() : weight.numel());
      const double bound = fan_in > 0 ? 1.0 / std::sqrt(fan_in) : 0.0;
      torch::nn::init::uniform_(bias, -bound, bound);
    }
  }
};

}  // namespace difftrain::nn::init

namespace difftrain::nn {
using Inits = type_list<init::Normal, init::XavierUniform, init::XavierNormal, init::KaimingUniform,
                        init::KaimingNormal, init::Default>;
}  // namespace difftrain::nn
