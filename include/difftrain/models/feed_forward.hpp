#pragma once
// diffusers' FeedForward as its transformers (DiT, PixArt, SD3, CogVideoX) have it: net.0 is an
// activation module that owns the input projection (`net.0.proj`: GELU, GELU-tanh, GEGLU, SwiGLU
// or Linear+SiLU), net.1 dropout, net.2 the output Linear, net.3 an optional final dropout. The
// names differ from latent diffusion's (net.0.0), so this is a type of its own; LoRA reaches both
// projections (`ff.net.0.proj`, `ff.net.2`) through AdaptableLinear. Mind diffusers' names:
// "geglu-approximate" is its ApproximateGELU, x·σ(1.702·x) and not gated.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/activation/concepts.hpp"
#include "difftrain/nn/activation/elementwise.hpp"
#include "difftrain/nn/layers/adaptable.hpp"

namespace difftrain::models {

/// What a diffusers `activation_fn` of a FeedForward means: the activation policy it applies
/// (difftrain's name) and whether the projection is gated (twice as wide, x · act(gate)).
struct FeedForwardActivation {
  std::string_view policy;
  bool gated = false;
};

/// diffusers' FeedForward activation names, or nothing for a name diffusers does not have.
inline std::optional<FeedForwardActivation> feed_forward_activation(std::string_view name) {
  if (name == "gelu") return FeedForwardActivation{"gelu", false};
  if (name == "gelu-approximate") return FeedForwardActivation{"gelu_tanh", false};
  if (name == "geglu") return FeedForwardActivation{"gelu", true};
  if (name == "geglu-approximate") return FeedForwardActivation{"quick_gelu", false};
  if (name == "swiglu") return FeedForwardActivation{"silu", true};
  if (name == "linear-silu") return FeedForwardActivation{"silu", false};
  return std::nullopt;
}

/// Checks a config's `activation_fn` against the model's activation policy `Act`; returns whether
/// the feed-forward is gated.
template <nn::ElementwiseActivation Act>
bool check_feed_forward_activation(const std::string& value, const std::string& where) {
  const auto a = feed_forward_activation(value);
  if (!a)
    throw ConfigError("'activation_fn' = \"" + value +
                          "\" is not a feed-forward activation diffusers has (gelu, "
                          "gelu-approximate, geglu, geglu-approximate, swiglu, linear-silu)",
                      where);
  if (a->policy != Act::name) {
    const std::string_view type = a->policy == "gelu"         ? "GELU"
                                  : a->policy == "gelu_tanh"  ? "GELUTanh"
                                  : a->policy == "quick_gelu" ? "QuickGELU"
                                                              : "SiLU";
    throw ConfigError("'activation_fn' = \"" + value + "\" but the model type was instantiated " +
                          "with the \"" + std::string(Act::name) + "\" activation policy; use " +
                          "nn::activation::" + std::string(type) + " for this config",
                      where);
  }
  return a->gated;
}

/// net.0: proj then the activation, or (gated) proj split into (x, gate) → x · act(gate).
template <nn::ElementwiseActivation Act>
class ProjectedActivationImpl : public torch::nn::Module {
 public:
  ProjectedActivationImpl(std::int64_t dim_in, std::int64_t dim_out, bool gated, bool bias)
      : gated_(gated) {
    proj = register_module(
        "proj", nn::AdaptableLinear(
                    torch::nn::LinearOptions(dim_in, gated ? 2 * dim_out : dim_out).bias(bias)));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = proj->forward(x);
    if (!gated_) return Act::forward(h, typename Act::Options{});
    const auto halves = h.chunk(2, -1);
    return halves[0] * Act::forward(halves[1], typename Act::Options{});
  }
  nn::AdaptableLinear proj{nullptr};

 private:
  bool gated_;
};
template <nn::ElementwiseActivation Act>
using ProjectedActivation = torch::nn::ModuleHolder<ProjectedActivationImpl<Act>>;

struct FeedForwardOptions {
  std::int64_t dim = 0;
  std::optional<std::int64_t> dim_out;    // defaults to dim
  double mult = 4.0;                      // inner width int(dim · mult) unless inner_dim is set
  std::optional<std::int64_t> inner_dim;  // diffusers' ff_inner_dim
  bool gated = false;
  double dropout = 0.0;
  bool final_dropout = false;
  bool bias = true;
};

template <nn::ElementwiseActivation Act = nn::activation::GELUTanh>
class FeedForwardImpl : public torch::nn::Module {
 public:
  explicit FeedForwardImpl(const FeedForwardOptions& o) {
    if (o.dim <= 0 || o.mult <= 0.0)
      throw ConfigError("dim and mult must be positive", "FeedForward");
    const std::int64_t inner =
        o.inner_dim.value_or(static_cast<std::int64_t>(static_cast<double>(o.dim) * o.mult));
    if (inner <= 0) throw ConfigError("the inner width must be positive", "FeedForward");
    torch::nn::Sequential seq;
    seq->push_back(ProjectedActivation<Act>(o.dim, inner, o.gated, o.bias));
    seq->push_back(torch::nn::Dropout(o.dropout));
    seq->push_back(nn::AdaptableLinear(
        torch::nn::LinearOptions(inner, o.dim_out.value_or(o.dim)).bias(o.bias)));
    if (o.final_dropout) seq->push_back(torch::nn::Dropout(o.dropout));
    net = register_module("net", seq);
  }
  at::Tensor forward(const at::Tensor& x) { return net->forward(x); }
  torch::nn::Sequential net{nullptr};
};
template <nn::ElementwiseActivation Act = nn::activation::GELUTanh>
using FeedForward = torch::nn::ModuleHolder<FeedForwardImpl<Act>>;

}  // namespace difftrain::models
