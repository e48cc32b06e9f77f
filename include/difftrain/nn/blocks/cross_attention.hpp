#pragma once
// Multi-head (cross-)attention as in latent diffusion / CogVideoX: to_q, to_k, to_v (no bias),
// to_out = [Linear, Dropout]. Queries come from x, keys and values from `context` (x itself when
// absent). Options from the reference: a boolean key-padding mask, additional tokens prepended to
// x and dropped from the output, cross-frame attention (every frame attends to the keys of the
// first frame of its group). A context hook may transform the context separately for keys and
// values before to_k / to_v — the web UI's hypernetworks use it.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/attention/concepts.hpp"
#include "difftrain/nn/attention/sdpa.hpp"
#include "difftrain/nn/layers/adaptable.hpp"

namespace difftrain::nn::blocks {

/// Returns (context for keys, context for values).
using ContextHook = std::function<std::pair<at::Tensor, at::Tensor>(const at::Tensor& context)>;

struct CrossAttentionOptions {
  std::int64_t query_dim = 0;
  std::optional<std::int64_t> context_dim;  // defaults to query_dim
  std::int64_t heads = 8;
  std::int64_t dim_head = 64;
  double dropout = 0.0;
  bool qkv_bias = false;  // diffusers' VAE attention has biases on to_q, to_k, to_v
};

/// Optional inputs of one call.
struct AttentionCall {
  at::Tensor context;  // (B, Lk, context_dim); undefined → self-attention
  /// Key padding (B, Lk) or (B, Lq, Lk): bool (true = attend) or an additive float bias (cast to
  /// the queries' dtype, so a float32 bias serves under autocast too).
  at::Tensor mask;
  at::Tensor additional_tokens;  // (B, n, query_dim), prepended to x and removed from the output
  std::int64_t n_times_crossframe_attn_in_self = 0;
};

template <class Backend = attention::Sdpa<attention::Auto>>
class CrossAttentionImpl : public torch::nn::Module {
  // Checked here rather than in the template head so a wrong backend gets a sentence.
  static_assert(attention::diagnose_attention_backend<Backend>());

 public:
  explicit CrossAttentionImpl(const CrossAttentionOptions& o)
      : heads_(o.heads), dim_head_(o.dim_head) {
    if (o.query_dim <= 0 || o.heads <= 0 || o.dim_head <= 0)
      throw ConfigError("query_dim, heads and dim_head must be positive", "CrossAttention");
    const std::int64_t inner = o.heads * o.dim_head;
    const std::int64_t context_dim = o.context_dim.value_or(o.query_dim);
    auto linear = [&o](std::int64_t in, std::int64_t out) {
      return AdaptableLinear(torch::nn::LinearOptions(in, out).bias(o.qkv_bias));
    };
    to_q = register_module("to_q", linear(o.query_dim, inner));
    to_k = register_module("to_k", linear(context_dim, inner));
    to_v = register_module("to_v", linear(context_dim, inner));
    to_out = register_module("to_out", torch::nn::Sequential(AdaptableLinear(inner, o.query_dim),
                                                             torch::nn::Dropout(o.dropout)));
  }

  void set_context_hook(ContextHook hook) { hook_ = std::move(hook); }
  /// The kernel that ran in the last forward (useful with Fallback and Sdpa<Auto>).
  [[nodiscard]] const std::string& last_backend() const { return ran_; }

  at::Tensor forward(const at::Tensor& x_in, const AttentionCall& call = {}) {
    const std::string where = "CrossAttention";
    if (x_in.dim() != 3 || x_in.size(2) != to_q->options.in_features())
      throw ShapeError("x must be (B, L, " + std::to_string(to_q->options.in_features()) +
                           "), got " + c10::str(x_in.sizes()),
                       where);
    at::Tensor x = x_in;
    std::int64_t n_extra = 0;
    if (call.additional_tokens.defined()) {
      if (call.additional_tokens.dim() != 3 || call.additional_tokens.size(0) != x.size(0) ||
          call.additional_tokens.size(2) != x.size(2))
        throw ShapeError("additional_tokens " + c10::str(call.additional_tokens.sizes()) +
                             " do not match x " + c10::str(x.sizes()),
                         where);
      n_extra = call.additional_tokens.size(1);
      x = at::cat({call.additional_tokens, x}, 1);
    }
    const at::Tensor context = call.context.defined() ? call.context : x;
    if (context.dim() != 3 || context.size(0) != x.size(0) ||
        context.size(2) != to_k->options.in_features())
      throw ShapeError("context must be (" + std::to_string(x.size(0)) + ", Lk, " +
                           std::to_string(to_k->options.in_features()) + "), got " +
                           c10::str(context.sizes()) + " for x " + c10::str(x.sizes()),
                       where);
    at::Tensor q = to_q->forward(x), k, v;
    if (hook_) {
      auto [ck, cv] = hook_(context);
      k = to_k->forward(ck);
      v = to_v->forward(cv);
    } else {
      k = to_k->forward(context);
      v = to_v->forward(context);
    }
    if (const std::int64_t n = call.n_times_crossframe_attn_in_self; n > 0) {
      if (x.size(0) % n != 0)
        throw ShapeError("batch " + std::to_string(x.size(0)) + " is not a multiple of " +
                             "n_times_crossframe_attn_in_self = " + std::to_string(n),
                         where);
      const std::int64_t copies = x.size(0) / n;
      k = k.slice(0, 0, k.size(0), n).repeat_interleave(copies, 0);
      v = v.slice(0, 0, v.size(0), n).repeat_interleave(copies, 0);
    }
    // "b n (h d) -> b h n d"
    auto heads = [&](const at::Tensor& t) {
      return t.view({t.size(0), t.size(1), heads_, dim_head_}).transpose(1, 2);
    };
    attention::AttentionArgs args;
    args.ran = &ran_;
    if (call.mask.defined()) {
      at::Tensor m = call.mask;
      if (m.scalar_type() != at::kBool && m.scalar_type() != q.scalar_type())
        m = m.to(q.scalar_type());
      if (m.dim() == 2 && m.size(0) == x.size(0) && m.size(1) == k.size(1))
        args.mask = m.view({m.size(0), 1, 1, m.size(1)});
      else if (m.dim() == 3 && m.size(0) == x.size(0) && m.size(1) == x.size(1) &&
               m.size(2) == k.size(1))
        args.mask = m.unsqueeze(1);
      else
        throw ShapeError("mask " + c10::str(m.sizes()) + " must be (B, Lk) = (" +
                             std::to_string(x.size(0)) + ", " + std::to_string(k.size(1)) +
                             ") or (B, Lq, Lk) for x " + c10::str(x.sizes()) + " and context " +
                             c10::str(context.sizes()),
                         where);
    }
    at::Tensor out = Backend::forward(heads(q), heads(k), heads(v), args);
    out = out.transpose(1, 2).reshape({x.size(0), x.size(1), heads_ * dim_head_});
    if (n_extra > 0) out = out.slice(1, n_extra);
    return to_out->forward(out);
  }

  // Adaptable: each can carry a LoRA branch (adapters::inject_lora).
  AdaptableLinear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::Sequential to_out{nullptr};

 private:
  std::int64_t heads_, dim_head_;
  ContextHook hook_;
  std::string ran_;
};

template <class Backend = attention::Sdpa<attention::Auto>>
using CrossAttention = torch::nn::ModuleHolder<CrossAttentionImpl<Backend>>;

}  // namespace difftrain::nn::blocks
