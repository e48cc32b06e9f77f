#pragma once
// The transformer feed-forward block of latent diffusion: Linear → activation (or GEGLU) → Dropout
// → Linear, with the reference's module names: net.0.proj (GEGLU) or net.0.0 (plain), net.2.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/activation/concepts.hpp"
#include "difftrain/nn/activation/elementwise.hpp"
#include "difftrain/nn/activation/module.hpp"
#include "difftrain/nn/layers/adaptable.hpp"

namespace difftrain::nn::blocks {

/// proj(x) split in halves (x, gate); x · act(gate). `Act` is GELU in the reference.
template <ElementwiseActivation Act = activation::GELU>
class GEGLUImpl : public torch::nn::Module {
 public:
  GEGLUImpl(std::int64_t dim_in, std::int64_t dim_out) {
    proj = register_module("proj", AdaptableLinear(dim_in, dim_out * 2));
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto halves = proj->forward(x).chunk(2, -1);
    return halves[0] * Act::forward(halves[1], typename Act::Options{});
  }
  AdaptableLinear proj{nullptr};
};
template <ElementwiseActivation Act = activation::GELU>
using GEGLU = torch::nn::ModuleHolder<GEGLUImpl<Act>>;

/// Linear then activation, registered as children "0" and "1" (the reference's nn.Sequential).
template <Activation Act>
class LinearActivationImpl : public torch::nn::Module {
 public:
  LinearActivationImpl(std::int64_t dim_in, std::int64_t dim_out)
      : linear(register_module("0", AdaptableLinear(dim_in, dim_out))),
        act(make_activation_module<Act>()) {
    register_module("1", act.ptr());
  }
  at::Tensor forward(const at::Tensor& x) { return act.forward(linear->forward(x)); }
  AdaptableLinear linear;
  torch::nn::AnyModule act;
};
template <Activation Act>
using LinearActivation = torch::nn::ModuleHolder<LinearActivationImpl<Act>>;

struct FeedForwardOptions {
  std::int64_t dim = 0;
  std::optional<std::int64_t> dim_out;  // defaults to dim
  double mult = 4.0;
  bool glu = false;
  double dropout = 0.0;
};

template <Activation Act = activation::GELU>
class FeedForwardImpl : public torch::nn::Module {
 public:
  explicit FeedForwardImpl(const FeedForwardOptions& o) {
    if (o.dim <= 0 || o.mult <= 0.0)
      throw ConfigError("dim and mult must be positive", "FeedForward");
    const auto inner = static_cast<std::int64_t>(static_cast<double>(o.dim) * o.mult);
    torch::nn::Sequential seq;
    if (o.glu) {
      if constexpr (ElementwiseActivation<Act>) {
        seq->push_back(GEGLU<Act>(o.dim, inner));
      } else {
        throw ConfigError("a gated feed-forward needs an elementwise activation", "FeedForward");
      }
    } else {
      seq->push_back(LinearActivation<Act>(o.dim, inner));
    }
    seq->push_back(torch::nn::Dropout(o.dropout));
    seq->push_back(AdaptableLinear(inner, o.dim_out.value_or(o.dim)));
    net = register_module("net", seq);
  }
  at::Tensor forward(const at::Tensor& x) { return net->forward(x); }
  torch::nn::Sequential net{nullptr};
};
template <Activation Act = activation::GELU>
using FeedForward = torch::nn::ModuleHolder<FeedForwardImpl<Act>>;

}  // namespace difftrain::nn::blocks
