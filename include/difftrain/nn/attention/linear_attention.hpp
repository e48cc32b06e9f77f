#pragma once
// Linear attention over the pixels of a feature map (latent diffusion's LinearAttention): keys are
// softmax-normalised over positions, then context = K Vᵀ per head and out = contextᵀ Q, so the cost
// is linear in the number of pixels. Parameter names match the reference: to_qkv (1×1 conv, no
// bias), to_out (1×1 conv).

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "difftrain/core/error.hpp"

namespace difftrain::nn::attention {

class LinearAttentionImpl : public torch::nn::Module {
 public:
  LinearAttentionImpl(std::int64_t dim, std::int64_t heads = 4, std::int64_t dim_head = 32)
      : heads_(heads), dim_head_(dim_head) {
    if (dim <= 0 || heads <= 0 || dim_head <= 0)
      throw ConfigError("dim, heads and dim_head must be positive", "LinearAttention");
    const std::int64_t hidden = heads * dim_head;
    to_qkv = register_module(
        "to_qkv", torch::nn::Conv2d(torch::nn::Conv2dOptions(dim, hidden * 3, 1).bias(false)));
    to_out = register_module("to_out", torch::nn::Conv2d(torch::nn::Conv2dOptions(hidden, dim, 1)));
  }

  at::Tensor forward(const at::Tensor& x) {
    if (x.dim() != 4 || x.size(1) != to_qkv->options.in_channels())
      throw ShapeError("expects (B, " + std::to_string(to_qkv->options.in_channels()) +
                           ", H, W), got " + c10::str(x.sizes()),
                       "LinearAttention");
    const auto b = x.size(0), h = x.size(2), w = x.size(3);
    // "b (qkv heads c) h w -> qkv b heads c (h w)"
    const at::Tensor qkv =
        to_qkv->forward(x).reshape({b, 3, heads_, dim_head_, h * w}).permute({1, 0, 2, 3, 4});
    const at::Tensor q = qkv[0], k = qkv[1].softmax(-1), v = qkv[2];
    const at::Tensor context = at::einsum("bhdn,bhen->bhde", {k, v});
    const at::Tensor out = at::einsum("bhde,bhdn->bhen", {context, q});
    return to_out->forward(out.reshape({b, heads_ * dim_head_, h, w}));
  }

  torch::nn::Conv2d to_qkv{nullptr}, to_out{nullptr};

 private:
  std::int64_t heads_, dim_head_;
};
TORCH_MODULE(LinearAttention);

}  // namespace difftrain::nn::attention
