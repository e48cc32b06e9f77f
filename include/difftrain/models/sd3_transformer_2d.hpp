#pragma once
// diffusers' SD3Transformer2DModel (Stable Diffusion 3 / 3.5's MMDiT), built from its config.json
// with diffusers' parameter names:
//
//   pos_embed (PatchEmbed with the saved pos_embed_max_size table, centre-cropped per input)
//   time_text_embed: timestep_embedder (256 channels, flip, shift 0) + text_embedder (the pooled
//     text: linear_1 → SiLU → linear_2)
//   context_embedder (the text states to the inner width)
//   transformer_blocks.N: joint attention of the image and text streams — each stream its own
//     modulation (norm1, norm1_context: adaLN-Zero), projections (to_q/to_k/to_v and
//     add_q_proj/add_k_proj/add_v_proj), output (to_out.0, to_add_out) and feed-forward (ff,
//     ff_context), one attention over both token sets. The last block is context-pre-only: its
//     text stream ends at the attention (norm1_context is AdaLayerNormContinuous; no to_add_out,
//     norm2_context or ff_context). SD3.5's qk_norm "rms_norm" normalises every head's queries and
//     keys; its dual_attention_layers add a second, image-only attention (attn2) modulated by
//     three more chunks of norm1 (SD35AdaLayerNormZeroX).
//   norm_out (AdaLayerNormContinuous: scale, then shift) → proj_out → unpatchify (H ≠ W works).

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/adaln.hpp"
#include "difftrain/models/config_reader.hpp"
#include "difftrain/models/embeddings.hpp"
#include "difftrain/models/feed_forward.hpp"
#include "difftrain/models/patch_embed.hpp"
#include "difftrain/nn/activation/elementwise.hpp"
#include "difftrain/nn/attention/concepts.hpp"
#include "difftrain/nn/attention/sdpa.hpp"
#include "difftrain/nn/blocks/checkpoint.hpp"
#include "difftrain/nn/layers/adaptable.hpp"
#include "difftrain/nn/unit_scope.hpp"

namespace difftrain::models {

struct SD3Transformer2DConfig {
  static constexpr std::string_view class_name = "SD3Transformer2DModel";

  std::int64_t sample_size = 128;
  std::int64_t patch_size = 2;
  std::int64_t in_channels = 16;
  std::int64_t num_layers = 18;
  std::int64_t attention_head_dim = 64;
  std::int64_t num_attention_heads = 18;
  std::int64_t joint_attention_dim = 4096;
  std::int64_t caption_projection_dim = 1152;
  std::int64_t pooled_projection_dim = 2048;
  std::optional<std::int64_t> out_channels = 16;  // null: in_channels
  std::optional<std::int64_t> pos_embed_max_size = 96;
  std::vector<std::int64_t> dual_attention_layers;  // SD3.5: blocks with a second attention
  std::optional<std::string> qk_norm;               // null or "rms_norm"

  [[nodiscard]] std::int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  [[nodiscard]] std::int64_t out() const { return out_channels.value_or(in_channels); }
  [[nodiscard]] bool dual(std::int64_t block) const {
    for (const auto i : dual_attention_layers)
      if (i == block) return true;
    return false;
  }

  void validate(const std::string& where) const {
    check_config_range("num_attention_heads", num_attention_heads, 1, ConfigLimits::channels,
                       where);
    check_config_range("attention_head_dim", attention_head_dim, 1, ConfigLimits::channels, where);
    check_config_range("in_channels", in_channels, 1, ConfigLimits::channels, where);
    check_config_range("out_channels", out(), 1, ConfigLimits::channels, where);
    check_config_range("num_layers", num_layers, 1, ConfigLimits::layers, where);
    check_config_range("sample_size", sample_size, 1, ConfigLimits::spatial, where);
    check_config_range("patch_size", patch_size, 1, ConfigLimits::spatial, where);
    check_config_range("joint_attention_dim", joint_attention_dim, 1, ConfigLimits::channels,
                       where);
    check_config_range("pooled_projection_dim", pooled_projection_dim, 1, ConfigLimits::channels,
                       where);
    check_config_range("pos_embed_max_size", pos_embed_max_size, 1, ConfigLimits::spatial, where);
    if (inner_dim() > ConfigLimits::channels || inner_dim() % 4 != 0)
      throw ConfigError(
          "num_attention_heads × attention_head_dim = " + std::to_string(inner_dim()) +
              " must be a multiple of 4 (the 2-D sine-cosine position table) and " + "at most " +
              std::to_string(ConfigLimits::channels),
          where);
    if (caption_projection_dim != inner_dim())
      throw ConfigError("'caption_projection_dim' " + std::to_string(caption_projection_dim) +
                            " must equal the inner width " + std::to_string(inner_dim()) +
                            " (the text stream runs at the image stream's width)",
                        where);
    if (sample_size < patch_size)
      throw ConfigError("'sample_size' is smaller than one patch", where);
    if (qk_norm && *qk_norm != "rms_norm")
      throw ConfigError("'qk_norm' = \"" + *qk_norm +
                            "\" is not supported (null or \"rms_norm\", what SD3 and SD3.5 use)",
                        where);
    std::set<std::int64_t> seen;
    for (const auto i : dual_attention_layers) {
      config_detail::check_range("'dual_attention_layers' entry", i, 0, num_layers - 1, where);
      if (!seen.insert(i).second)
        throw ConfigError("'dual_attention_layers' names block " + std::to_string(i) + " twice",
                          where);
    }
  }

  [[nodiscard]] WeightSignature weight_signature() const {
    WeightSignature s;
    const std::int64_t d = inner_dim();
    s.shapes.push_back({"pos_embed.proj.weight", {d, in_channels, patch_size, patch_size}});
    s.shapes.push_back({"proj_out.weight", {patch_size * patch_size * out(), d}});
    s.shapes.push_back({"context_embedder.weight", {caption_projection_dim, joint_attention_dim}});
    // The saved position table: its size is checked before the model allocates it (a config
    // asking for a 4096² table must find one in the weights).
    if (pos_embed_max_size)
      s.shapes.push_back(
          {"pos_embed.pos_embed", {1, *pos_embed_max_size * *pos_embed_max_size, d}});
    s.counts.push_back({"transformer_blocks.", num_layers});
    return s;
  }

  /// The fields read and written as they are (the others have rules of their own).
  static constexpr auto fields() {
    using C = SD3Transformer2DConfig;
    return std::tuple{config_field("sample_size", &C::sample_size),
                      config_field("patch_size", &C::patch_size),
                      config_field("in_channels", &C::in_channels),
                      config_field("num_layers", &C::num_layers),
                      config_field("attention_head_dim", &C::attention_head_dim),
                      config_field("num_attention_heads", &C::num_attention_heads),
                      config_field("joint_attention_dim", &C::joint_attention_dim),
                      config_field("caption_projection_dim", &C::caption_projection_dim),
                      config_field("pooled_projection_dim", &C::pooled_projection_dim),
                      config_field("out_channels", &C::out_channels),
                      config_field("pos_embed_max_size", &C::pos_embed_max_size),
                      config_field("qk_norm", &C::qk_norm)};
  }

  static SD3Transformer2DConfig from_json(const nlohmann::json& j, const std::string& where) {
    ConfigReader r(j, where);
    SD3Transformer2DConfig c;
    read_fields(r, c, fields());
    c.dual_attention_layers = r.get("dual_attention_layers", std::vector<std::int64_t>{});
    r.finish();
    c.validate(where);
    return c;
  }

  /// The file from_pretrained read this config from (see ConfigAsRead).
  ConfigAsRead as_read{};

  [[nodiscard]] nlohmann::json to_json() const {
    nlohmann::json j = diffusers_config_json<SD3Transformer2DConfig>();
    write_fields(j, *this, fields());
    j["dual_attention_layers"] = dual_attention_layers;
    return j;
  }
};

/// diffusers' RMSNorm: x / √(mean(x²) + eps) in float32 statistics, times a weight.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(std::int64_t dim, double eps) : eps_(eps) {
    weight = register_parameter("weight", at::ones({dim}));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor variance = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);
    at::Tensor h = x * at::rsqrt(variance + eps_);
    if (weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16)
      h = h.to(weight.scalar_type());
    return h * weight;
  }
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

/// A LayerNorm without parameters (eps 1e-6) and `chunks` modulations of it from the conditioning:
/// AdaLayerNormZero (6 chunks) and SD35AdaLayerNormZeroX (9) without their own embedding.
class ModulatedNormImpl : public torch::nn::Module {
 public:
  ModulatedNormImpl(std::int64_t dim, std::int64_t chunks) : chunks_(chunks) {
    linear = register_module("linear", nn::AdaptableLinear(dim, chunks * dim));
    norm = register_module("norm", adaln_layer_norm(dim));
  }
  /// (norm(x), the chunks of linear(silu(temb)), each (B, D)).
  std::pair<at::Tensor, std::vector<at::Tensor>> forward(const at::Tensor& x,
                                                         const at::Tensor& temb) {
    return {norm->forward(x), linear->forward(at::silu(temb)).chunk(chunks_, 1)};
  }
  nn::AdaptableLinear linear{nullptr};  // kohya's fp8 base and LoRA reach the modulations too
  torch::nn::LayerNorm norm{nullptr};

 private:
  std::int64_t chunks_;
};
TORCH_MODULE(ModulatedNorm);

/// diffusers' AdaLayerNormContinuous (layer norm, no affine, eps 1e-6): linear(silu(cond)) gives
/// scale, then shift.
class AdaLayerNormContinuousImpl : public torch::nn::Module {
 public:
  AdaLayerNormContinuousImpl(std::int64_t dim, std::int64_t conditioning_dim) {
    linear = register_module("linear", nn::AdaptableLinear(conditioning_dim, 2 * dim));
    norm = register_module("norm", adaln_layer_norm(dim));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cond) {
    const auto c = linear->forward(at::silu(cond).to(x.scalar_type())).chunk(2, 1);
    return modulate(norm->forward(x), c[1], c[0]);
  }
  nn::AdaptableLinear linear{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(AdaLayerNormContinuous);

/// diffusers' Attention with JointAttnProcessor2_0: the image tokens' to_q/to_k/to_v and, with a
/// text stream, its add_q_proj/add_k_proj/add_v_proj, one attention over [image; text], then
/// to_out.0 for the image and (unless context-pre-only) to_add_out for the text. Every projection
/// has a bias and can carry a LoRA branch (diffusers' target names).
template <nn::attention::AttentionBackend Backend>
class JointAttentionImpl : public torch::nn::Module {
 public:
  JointAttentionImpl(std::int64_t dim, std::int64_t heads, std::int64_t head_dim, bool text_stream,
                     bool context_pre_only, bool rms_qk_norm)
      : heads_(heads), head_dim_(head_dim) {
    const std::int64_t inner = heads * head_dim;
    auto linear = [](std::int64_t in, std::int64_t out) { return nn::AdaptableLinear(in, out); };
    to_q = register_module("to_q", linear(dim, inner));
    to_k = register_module("to_k", linear(dim, inner));
    to_v = register_module("to_v", linear(dim, inner));
    if (text_stream) {
      add_k_proj = register_module("add_k_proj", linear(dim, inner));
      add_v_proj = register_module("add_v_proj", linear(dim, inner));
      add_q_proj = register_module("add_q_proj", linear(dim, inner));
    }
    to_out = register_module("to_out",
                             torch::nn::Sequential(linear(inner, dim), torch::nn::Dropout(0.0)));
    if (text_stream && !context_pre_only)
      to_add_out = register_module("to_add_out", linear(inner, dim));
    if (rms_qk_norm) {
      norm_q = register_module("norm_q", RMSNorm(head_dim, 1e-6));
      norm_k = register_module("norm_k", RMSNorm(head_dim, 1e-6));
      if (text_stream) {
        norm_added_q = register_module("norm_added_q", RMSNorm(head_dim, 1e-6));
        norm_added_k = register_module("norm_added_k", RMSNorm(head_dim, 1e-6));
      }
    }
  }

  /// (image output, text output — undefined without text or when context-pre-only).
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& text = {}) {
    auto heads = [&](const at::Tensor& t) {
      return t.view({t.size(0), t.size(1), heads_, head_dim_}).transpose(1, 2);
    };
    at::Tensor q = heads(to_q->forward(x)), k = heads(to_k->forward(x)),
               v = heads(to_v->forward(x));
    if (norm_q) {
      q = norm_q->forward(q);
      k = norm_k->forward(k);
    }
    const bool joint = text.defined() && add_q_proj;
    if (joint) {
      at::Tensor tq = heads(add_q_proj->forward(text)), tk = heads(add_k_proj->forward(text)),
                 tv = heads(add_v_proj->forward(text));
      if (norm_added_q) {
        tq = norm_added_q->forward(tq);
        tk = norm_added_k->forward(tk);
      }
      q = at::cat({q, tq}, 2);
      k = at::cat({k, tk}, 2);
      v = at::cat({v, tv}, 2);
    }
    // Under autocast the norms give float32 queries and keys beside lower-precision values;
    // diffusers' SDPA call is cast to the autocast dtype by autocast itself, here explicitly.
    q = q.to(v.scalar_type());
    k = k.to(v.scalar_type());
    nn::attention::AttentionArgs args;
    at::Tensor out = Backend::forward(q, k, v, args);
    out = out.transpose(1, 2).reshape({x.size(0), -1, heads_ * head_dim_});
    at::Tensor text_out;
    if (joint) {
      if (to_add_out) text_out = to_add_out->forward(out.slice(1, x.size(1)));
      out = out.slice(1, 0, x.size(1));
    }
    return {to_out->forward(out), text_out};
  }

  nn::AdaptableLinear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  nn::AdaptableLinear add_q_proj{nullptr}, add_k_proj{nullptr}, add_v_proj{nullptr};
  nn::AdaptableLinear to_add_out{nullptr};
  torch::nn::Sequential to_out{nullptr};
  RMSNorm norm_q{nullptr}, norm_k{nullptr}, norm_added_q{nullptr}, norm_added_k{nullptr};

 private:
  std::int64_t heads_, head_dim_;
};
template <nn::attention::AttentionBackend Backend>
using JointAttention = torch::nn::ModuleHolder<JointAttentionImpl<Backend>>;

/// diffusers' JointTransformerBlock (MMDiT).
template <nn::attention::AttentionBackend Backend>
class JointTransformerBlockImpl : public torch::nn::Module {
 public:
  JointTransformerBlockImpl(std::int64_t dim, std::int64_t heads, std::int64_t head_dim,
                            bool context_pre_only, bool rms_qk_norm, bool dual_attention)
      : context_pre_only_(context_pre_only), dual_(dual_attention) {
    norm1 = register_module("norm1", ModulatedNorm(dim, dual_attention ? 9 : 6));
    if (context_pre_only)
      norm1_context_continuous = register_module("norm1_context", AdaLayerNormContinuous(dim, dim));
    else
      norm1_context = register_module("norm1_context", ModulatedNorm(dim, 6));
    attn = register_module(
        "attn", JointAttention<Backend>(dim, heads, head_dim, true, context_pre_only, rms_qk_norm));
    if (dual_attention)
      attn2 = register_module(
          "attn2", JointAttention<Backend>(dim, heads, head_dim, false, false, rms_qk_norm));
    auto plain_norm = [dim] { return adaln_layer_norm(dim); };
    norm2 = register_module("norm2", plain_norm());
    FeedForwardOptions f;
    f.dim = dim;
    ff = register_module("ff", FeedForward<nn::activation::GELUTanh>(f));
    if (!context_pre_only) {
      norm2_context = register_module("norm2_context", plain_norm());
      ff_context = register_module("ff_context", FeedForward<nn::activation::GELUTanh>(f));
    }
  }

  /// (text out — undefined after a context-pre-only block — , image out).
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& text,
                                            const at::Tensor& temb) {
    auto [nx, m] = norm1->forward(x, temb);
    // m: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp[, shift2, scale2, gate2]
    const at::Tensor h1 = modulate(nx, m[0], m[1]);
    at::Tensor text_in, cm_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp;
    if (context_pre_only_) {
      text_in = norm1_context_continuous->forward(text, temb);
    } else {
      auto [nt, c] = norm1_context->forward(text, temb);
      text_in = modulate(nt, c[0], c[1]);
      cm_gate_msa = c[2];
      c_shift_mlp = c[3];
      c_scale_mlp = c[4];
      c_gate_mlp = c[5];
    }
    auto [attn_out, text_attn] = attn->forward(h1, text_in);
    at::Tensor out = x + m[2].unsqueeze(1) * attn_out;
    if (dual_) {
      const at::Tensor h2 = modulate(nx, m[6], m[7]);
      out = out + m[8].unsqueeze(1) * attn2->forward(h2).first;
    }
    out = out + m[5].unsqueeze(1) * ff->forward(modulate(norm2->forward(out), m[3], m[4]));
    if (context_pre_only_) return {at::Tensor(), out};
    at::Tensor t = text + cm_gate_msa.unsqueeze(1) * text_attn;
    t = t + c_gate_mlp.unsqueeze(1) *
                ff_context->forward(modulate(norm2_context->forward(t), c_shift_mlp, c_scale_mlp));
    return {t, out};
  }

  ModulatedNorm norm1{nullptr}, norm1_context{nullptr};
  AdaLayerNormContinuous norm1_context_continuous{nullptr};
  JointAttention<Backend> attn{nullptr}, attn2{nullptr};
  torch::nn::LayerNorm norm2{nullptr}, norm2_context{nullptr};
  FeedForward<nn::activation::GELUTanh> ff{nullptr}, ff_context{nullptr};

 private:
  bool context_pre_only_, dual_;
};
template <nn::attention::AttentionBackend Backend>
using JointTransformerBlock = torch::nn::ModuleHolder<JointTransformerBlockImpl<Backend>>;

/// diffusers' CombinedTimestepTextProjEmbeddings: timestep (256 channels, flip, shift 0) through
/// TimestepEmbedding, plus the pooled text through linear_1 → SiLU → linear_2.
class CombinedTimestepTextProjEmbeddingsImpl : public torch::nn::Module {
 public:
  CombinedTimestepTextProjEmbeddingsImpl(std::int64_t embedding_dim, std::int64_t pooled_dim) {
    timestep_embedder =
        register_module("timestep_embedder", adaln_timestep_embedder(embedding_dim));
    text_embedder = register_module("text_embedder",
                                    PixArtTextProjection(pooled_dim, embedding_dim, /*silu=*/true));
  }
  at::Tensor forward(const at::Tensor& timestep, const at::Tensor& pooled) {
    const at::Tensor proj = project_timesteps(timestep, /*downscale_freq_shift=*/0.0);
    return timestep_embedder->forward(proj.to(pooled.scalar_type())) +
           text_embedder->forward(pooled);
  }
  TimestepEmbedding<> timestep_embedder{nullptr};
  PixArtTextProjection text_embedder{nullptr};
};
TORCH_MODULE(CombinedTimestepTextProjEmbeddings);

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
class SD3Transformer2DModelImpl : public torch::nn::Module {
 public:
  using Config = SD3Transformer2DConfig;

  explicit SD3Transformer2DModelImpl(Config config,
                                     const std::string& where = "SD3Transformer2DModel")
      : c_(std::move(config)) {
    c_.validate(where);
    const std::int64_t d = c_.inner_dim();
    PatchEmbedOptions pe;
    pe.height = pe.width = c_.sample_size;
    pe.patch_size = c_.patch_size;
    pe.in_channels = c_.in_channels;
    pe.embed_dim = d;
    pe.pos_embed_max_size = c_.pos_embed_max_size;
    pos_embed = register_module("pos_embed", PatchEmbed(pe));
    time_text_embed = register_module(
        "time_text_embed", CombinedTimestepTextProjEmbeddings(d, c_.pooled_projection_dim));
    context_embedder = register_module(
        "context_embedder", nn::AdaptableLinear(c_.joint_attention_dim, c_.caption_projection_dim));
    transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_layers; ++i) {
      blocks_.push_back(JointTransformerBlock<Backend>(
          d, c_.num_attention_heads, c_.attention_head_dim, i == c_.num_layers - 1,
          c_.qk_norm.has_value(), c_.dual(i)));
      transformer_blocks->push_back(blocks_.back());
    }
    norm_out = register_module("norm_out", AdaLayerNormContinuous(d, d));
    proj_out =
        register_module("proj_out", torch::nn::Linear(d, c_.patch_size * c_.patch_size * c_.out()));
  }

  [[nodiscard]] const Config& config() const { return c_; }
  void set_gradient_checkpointing(bool on) { checkpointing_ = on; }
  [[nodiscard]] bool gradient_checkpointing() const { return checkpointing_; }

  /// The velocity for latents (B, in_channels, H, W) at timesteps (B,) (or one for all; SD3's
  /// σ · 1000) with the text states (B, L, joint_attention_dim) and the pooled text
  /// (B, pooled_projection_dim): (B, out_channels, H, W).
  at::Tensor forward(const at::Tensor& sample, const at::Tensor& encoder_hidden_states,
                     const at::Tensor& pooled_projections, const at::Tensor& timestep) {
    const std::string where = "SD3Transformer2DModel";
    const auto [h, w] = patch_grid(sample, c_.in_channels, c_.patch_size, where);
    const std::int64_t b = sample.size(0);
    const at::Tensor& text = encoder_hidden_states;
    if (!text.defined() || text.dim() != 3 || text.size(0) != b ||
        text.size(2) != c_.joint_attention_dim)
      throw ShapeError("encoder_hidden_states must be (" + std::to_string(b) + ", L, " +
                           std::to_string(c_.joint_attention_dim) + "), got " +
                           (text.defined() ? c10::str(text.sizes()) : std::string("nothing")),
                       where);
    if (!pooled_projections.defined() || pooled_projections.dim() != 2 ||
        pooled_projections.size(0) != b || pooled_projections.size(1) != c_.pooled_projection_dim)
      throw ShapeError("pooled_projections must be (" + std::to_string(b) + ", " +
                           std::to_string(c_.pooled_projection_dim) + "), got " +
                           (pooled_projections.defined() ? c10::str(pooled_projections.sizes())
                                                         : std::string("nothing")),
                       where);
    const at::Tensor t = batch_timesteps(timestep, b, sample.device(), where);
    at::Tensor x = pos_embed->forward(sample);
    const at::Tensor temb = time_text_embed->forward(t, pooled_projections);
    at::Tensor context = context_embedder->forward(text);
    for (auto& block : blocks_) {
      // Both streams and the conditioning go through the checkpoint as inputs (they carry
      // gradients); the block's two outputs travel as one tensor, split after.
      const bool last = !context.defined() || block.ptr() == blocks_.back().ptr();
      auto body = [impl = block.ptr()](const std::vector<at::Tensor>& in) {
        auto [t_out, x_out] = impl->forward(in[0], in[1], in[2]);
        return t_out.defined() ? at::cat({x_out, t_out}, 1) : x_out;
      };
      const at::Tensor both = nn::in_unit(*block, [&] {
        return checkpointing_ && is_training()
                   ? nn::checkpoint(body, {x, context, temb}, block->parameters())
                   : body({x, context, temb});
      });
      const std::int64_t n = x.size(1);
      x = both.slice(1, 0, n);
      context = last ? at::Tensor() : both.slice(1, n);
    }
    x = norm_out->forward(x, temb);
    x = proj_out->forward(x);
    return unpatchify(x, h, w, c_.patch_size, c_.out());
  }

  PatchEmbed pos_embed{nullptr};
  CombinedTimestepTextProjEmbeddings time_text_embed{nullptr};
  nn::AdaptableLinear context_embedder{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr};
  AdaLayerNormContinuous norm_out{nullptr};
  torch::nn::Linear proj_out{nullptr};

 private:
  Config c_;
  std::vector<JointTransformerBlock<Backend>> blocks_;
  bool checkpointing_ = false;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
using SD3Transformer2DModel = torch::nn::ModuleHolder<SD3Transformer2DModelImpl<Backend>>;

}  // namespace difftrain::models
