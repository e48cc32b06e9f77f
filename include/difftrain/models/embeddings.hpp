#pragma once
// diffusers' timestep embeddings: the sinusoidal projection (`Timesteps`, no parameters) and the
// MLP that lifts it to the embedding every ResnetBlock2D receives (`TimestepEmbedding`:
// linear_1 → act → linear_2). Also the activation names diffusers' configs use ("silu" and
// "swish" both mean x·sigmoid(x) there, unlike the web UI's hypernetworks where "swish" is
// Hardswish).

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/activation/concepts.hpp"
#include "difftrain/nn/activation/elementwise.hpp"

namespace difftrain::models {

/// diffusers' activation name (`get_activation`) in difftrain's spelling, or nothing if diffusers
/// has no such name.
inline std::optional<std::string_view> diffusers_activation(std::string_view name) {
  std::string lower(name);
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "silu" || lower == "swish") return "silu";
  if (lower == "mish") return "mish";
  if (lower == "gelu") return "gelu";
  if (lower == "relu") return "relu";
  return std::nullopt;
}

/// Applies the activation a config names at run time (for the optional `time_embedding_act_fn`
/// and `timestep_post_act`); the main activation is a compile-time policy.
inline at::Tensor apply_activation(std::string_view canonical, const at::Tensor& x) {
  if (canonical == "silu") return at::silu(x);
  if (canonical == "mish") return at::mish(x);
  if (canonical == "gelu") return at::gelu(x);
  return at::relu(x);
}

/// Checks that the activation policy `Act` is the one a config field names.
template <nn::ElementwiseActivation Act>
void check_activation(const std::string& field, const std::string& value,
                      const std::string& where) {
  const auto canonical = diffusers_activation(value);
  if (!canonical)
    throw ConfigError("'" + field + "' = \"" + value +
                          "\" is not an activation diffusers knows (silu, swish, mish, gelu, relu)",
                      where);
  if (*canonical != Act::name) {
    const std::string_view type = *canonical == "silu"   ? "SiLU"
                                  : *canonical == "mish" ? "Mish"
                                  : *canonical == "gelu" ? "GELU"
                                                         : "ReLU";
    throw ConfigError("'" + field + "' = \"" + value + "\" but the model type was instantiated " +
                          "with the \"" + std::string(Act::name) + "\" activation policy; " +
                          "use nn::activation::" + std::string(type) + " for this config",
                      where);
  }
}

/// Sinusoidal embedding of (possibly fractional) timesteps, (N,) → (N, dim), as diffusers'
/// get_timestep_embedding: frequencies exp(-ln(max_period)·i / (half − shift)), [sin, cos] (or
/// [cos, sin] with flip_sin_to_cos), zero-padded to an odd `dim`. Computed in float32.
inline at::Tensor timestep_embedding(const at::Tensor& timesteps, std::int64_t dim,
                                     bool flip_sin_to_cos, double downscale_freq_shift,
                                     double scale = 1.0, double max_period = 10000.0) {
  if (timesteps.dim() != 1)
    throw ShapeError("timesteps must be 1-D (one per sample), got " + c10::str(timesteps.sizes()),
                     "timestep_embedding");
  const std::int64_t half = dim / 2;
  at::Tensor exponent =
      at::arange(half, timesteps.options().dtype(at::kFloat)) * -std::log(max_period);
  exponent = exponent / (static_cast<double>(half) - downscale_freq_shift);
  at::Tensor emb = timesteps.unsqueeze(1).to(at::kFloat) * exponent.exp().unsqueeze(0);
  emb = emb * scale;
  emb = at::cat({emb.sin(), emb.cos()}, -1);
  if (flip_sin_to_cos) emb = at::cat({emb.slice(1, half), emb.slice(1, 0, half)}, -1);
  if (dim % 2 == 1) emb = at::constant_pad_nd(emb, {0, 1, 0, 0});
  return emb;
}

struct TimestepEmbeddingOptions {
  std::int64_t in_channels = 0;
  std::int64_t time_embed_dim = 0;
  std::optional<std::int64_t> out_dim;        // defaults to time_embed_dim
  std::optional<std::string> post_act;        // diffusers' timestep_post_act
  std::optional<std::int64_t> cond_proj_dim;  // a condition added before linear_1
};

/// linear_1 → Act → linear_2 [→ post_act], with an optional `cond_proj` of a condition.
template <nn::ElementwiseActivation Act = nn::activation::SiLU>
class TimestepEmbeddingImpl : public torch::nn::Module {
 public:
  explicit TimestepEmbeddingImpl(const TimestepEmbeddingOptions& o) {
    if (o.in_channels <= 0 || o.time_embed_dim <= 0)
      throw ConfigError("in_channels and time_embed_dim must be positive", "TimestepEmbedding");
    linear_1 = register_module("linear_1", torch::nn::Linear(o.in_channels, o.time_embed_dim));
    if (o.cond_proj_dim)
      cond_proj = register_module(
          "cond_proj",
          torch::nn::Linear(torch::nn::LinearOptions(*o.cond_proj_dim, o.in_channels).bias(false)));
    linear_2 = register_module(
        "linear_2", torch::nn::Linear(o.time_embed_dim, o.out_dim.value_or(o.time_embed_dim)));
    if (o.post_act) {
      const auto canonical = diffusers_activation(*o.post_act);
      if (!canonical)
        throw ConfigError("unknown activation '" + *o.post_act + "'", "TimestepEmbedding");
      post_act_ = std::string(*canonical);
    }
  }

  at::Tensor forward(at::Tensor sample, const at::Tensor& condition = {}) {
    if (condition.defined()) {
      if (!cond_proj)
        throw ConfigError("a condition was given but the config has no time_cond_proj_dim",
                          "TimestepEmbedding");
      sample = sample + cond_proj->forward(condition);
    }
    sample = Act::forward(linear_1->forward(sample), typename Act::Options{});
    sample = linear_2->forward(sample);
    if (post_act_) sample = apply_activation(*post_act_, sample);
    return sample;
  }

  torch::nn::Linear linear_1{nullptr}, linear_2{nullptr}, cond_proj{nullptr};

 private:
  std::optional<std::string> post_act_;
};

template <nn::ElementwiseActivation Act = nn::activation::SiLU>
using TimestepEmbedding = torch::nn::ModuleHolder<TimestepEmbeddingImpl<Act>>;

}  // namespace difftrain::models
