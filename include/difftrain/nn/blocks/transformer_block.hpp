#pragma once
// latent diffusion's BasicTransformerBlock: x + attn1(norm1(x)) (self-attention, or attention to
// the context when disable_self_attn), x + attn2(norm2(x), context), x + ff(norm3(x)), with
// optional gradient checkpointing of the whole block. Unlike the reference, whose checkpointed
// forward drops them, additional tokens and cross-frame attention reach the attention layers.
// A context mask (diffusers' encoder_attention_mask) reaches the attention to the context (attn2)
// only, as in diffusers, where attn1 of an only-cross-attention block takes the self-attention
// mask.

#include <torch/nn/module.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/activation/elementwise.hpp"
#include "difftrain/nn/attention/concepts.hpp"
#include "difftrain/nn/attention/sdpa.hpp"
#include "difftrain/nn/blocks/checkpoint.hpp"
#include "difftrain/nn/blocks/cross_attention.hpp"
#include "difftrain/nn/blocks/feed_forward.hpp"

namespace difftrain::nn::blocks {

struct TransformerBlockOptions {
  std::int64_t dim = 0;
  std::int64_t n_heads = 8;
  std::int64_t d_head = 64;
  double dropout = 0.0;
  std::optional<std::int64_t> context_dim;
  bool gated_ff = true;
  bool checkpoint = false;  // the reference defaults to true; it costs a recompute per step
  bool disable_self_attn = false;
};

template <attention::AttentionBackend Backend = attention::Sdpa<attention::Auto>,
          ElementwiseActivation Act = activation::GELU>
class BasicTransformerBlockImpl : public torch::nn::Module {
 public:
  explicit BasicTransformerBlockImpl(const TransformerBlockOptions& o)
      : disable_self_attn_(o.disable_self_attn), checkpoint_(o.checkpoint) {
    CrossAttentionOptions a1{o.dim, o.disable_self_attn ? o.context_dim : std::nullopt, o.n_heads,
                             o.d_head, o.dropout};
    CrossAttentionOptions a2{o.dim, o.context_dim, o.n_heads, o.d_head, o.dropout};
    attn1 = register_module("attn1", CrossAttention<Backend>(a1));
    ff = register_module("ff", FeedForward<Act>(FeedForwardOptions{o.dim, std::nullopt, 4.0,
                                                                   o.gated_ff, o.dropout}));
    attn2 = register_module("attn2", CrossAttention<Backend>(a2));
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
    norm3 = register_module("norm3", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
  }

  void set_checkpointing(bool on) { checkpoint_ = on; }
  [[nodiscard]] bool checkpointing() const { return checkpoint_; }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& context = {},
                     const at::Tensor& additional_tokens = {},
                     std::int64_t n_times_crossframe_attn_in_self = 0,
                     const at::Tensor& context_mask = {}) {
    // Inputs travel as a list so the checkpoint can save and replay them.
    std::vector<at::Tensor> inputs{x};
    const bool has_context = context.defined(), has_extra = additional_tokens.defined();
    if (has_context) inputs.push_back(context);
    if (has_extra) inputs.push_back(additional_tokens);
    // The mask takes no gradient: the checkpoint's replay uses the captured one.
    auto body = [this, has_context, has_extra, n_times_crossframe_attn_in_self,
                 context_mask](const std::vector<at::Tensor>& in) {
      const at::Tensor ctx = has_context ? in[1] : at::Tensor();
      const at::Tensor extra = has_extra ? in[has_context ? 2 : 1] : at::Tensor();
      return body_forward(in[0], ctx, extra, n_times_crossframe_attn_in_self, context_mask);
    };
    if (!checkpoint_ || !is_training()) return body(inputs);
    return nn::checkpoint(body, inputs, parameters(), true);
  }

  CrossAttention<Backend> attn1{nullptr}, attn2{nullptr};
  FeedForward<Act> ff{nullptr};
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};

 private:
  at::Tensor body_forward(const at::Tensor& x_in, const at::Tensor& context,
                          const at::Tensor& extra, std::int64_t crossframe,
                          const at::Tensor& context_mask) {
    AttentionCall c1;
    c1.context = disable_self_attn_ ? context : at::Tensor();
    c1.additional_tokens = extra;
    c1.n_times_crossframe_attn_in_self = disable_self_attn_ ? 0 : crossframe;
    at::Tensor x = attn1->forward(norm1->forward(x_in), c1) + x_in;
    AttentionCall c2;
    c2.context = context;
    c2.additional_tokens = extra;
    c2.mask = context_mask;
    x = attn2->forward(norm2->forward(x), c2) + x;
    return ff->forward(norm3->forward(x)) + x;
  }

  bool disable_self_attn_;
  bool checkpoint_;
};

template <attention::AttentionBackend Backend = attention::Sdpa<attention::Auto>,
          ElementwiseActivation Act = activation::GELU>
using BasicTransformerBlock = torch::nn::ModuleHolder<BasicTransformerBlockImpl<Backend, Act>>;

}  // namespace difftrain::nn::blocks
