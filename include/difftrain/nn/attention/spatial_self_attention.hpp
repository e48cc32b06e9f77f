#pragma once
// Single-head self-attention over the pixels of a feature map with a residual connection (latent
// diffusion's SpatialSelfAttention): GroupNorm(32), 1×1 convs q, k, v, attention with scale
// 1/sqrt(C), 1×1 conv proj_out, plus the input. The attention itself goes through a backend.

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/attention/concepts.hpp"
#include "difftrain/nn/attention/sdpa.hpp"

namespace difftrain::nn::attention {

template <class Backend = Sdpa<Auto>>
class SpatialSelfAttentionImpl : public torch::nn::Module {
  // Checked here rather than in the template head so a wrong backend gets a sentence.
  static_assert(diagnose_attention_backend<Backend>());

 public:
  explicit SpatialSelfAttentionImpl(std::int64_t in_channels) : channels_(in_channels) {
    if (in_channels <= 0 || in_channels % 32 != 0)
      throw ConfigError(
          "in_channels must be a positive multiple of 32 (GroupNorm of 32 groups), got " +
              std::to_string(in_channels),
          "SpatialSelfAttention");
    norm = register_module(
        "norm", torch::nn::GroupNorm(torch::nn::GroupNormOptions(32, in_channels).eps(1e-6)));
    auto conv = [&](const char* n) {
      return register_module(
          n, torch::nn::Conv2d(torch::nn::Conv2dOptions(in_channels, in_channels, 1)));
    };
    q = conv("q");
    k = conv("k");
    v = conv("v");
    proj_out = conv("proj_out");
  }

  at::Tensor forward(const at::Tensor& x) {
    if (x.dim() != 4 || x.size(1) != channels_)
      throw ShapeError(
          "expects (B, " + std::to_string(channels_) + ", H, W), got " + c10::str(x.sizes()),
          "SpatialSelfAttention");
    const auto b = x.size(0), h = x.size(2), w = x.size(3);
    const at::Tensor hn = norm->forward(x);
    // (B, C, H, W) -> (B, 1, HW, C): one head whose head dim is the channel count.
    auto tokens = [&](const at::Tensor& t) {
      return t.reshape({b, 1, channels_, h * w}).transpose(2, 3);
    };
    const at::Tensor out = Backend::forward(tokens(q->forward(hn)), tokens(k->forward(hn)),
                                            tokens(v->forward(hn)), {});
    return x + proj_out->forward(out.transpose(2, 3).reshape({b, channels_, h, w}));
  }

  torch::nn::GroupNorm norm{nullptr};
  torch::nn::Conv2d q{nullptr}, k{nullptr}, v{nullptr}, proj_out{nullptr};

 private:
  std::int64_t channels_;
};

template <class Backend = Sdpa<Auto>>
using SpatialSelfAttention = torch::nn::ModuleHolder<SpatialSelfAttentionImpl<Backend>>;

}  // namespace difftrain::nn::attention
