#pragma once
// diffusers' FluxTransformer2DModel (Black Forest Labs' Flux.1 dev and schnell), built from its
// config.json with diffusers' parameter names:
//
//   x_embedder (the packed latents, 2×2 patches of 16 channels, to the inner width)
//   time_text_embed: timestep_embedder (256 channels, flip, shift 0) [+ guidance_embedder for
//     dev: the guidance scale embedded as a timestep] + text_embedder (CLIP's pooled output)
//   context_embedder (T5's states to the inner width)
//   transformer_blocks.N (double stream): each stream its own adaLN-Zero modulation (norm1,
//     norm1_context), projections (to_q/to_k/to_v, add_q_proj/add_k_proj/add_v_proj) with RMS
//     norms of every head's queries and keys, one attention over [text; image] with 3-axis rotary
//     embeddings, outputs (to_out.0, to_add_out) and feed-forwards (ff, ff_context)
//   single_transformer_blocks.N (single stream over [text; image]): one modulation (norm), the
//     attention (no output projection) and an MLP (proj_mlp, GELU-tanh) side by side, fused by
//     proj_out
//   norm_out (AdaLayerNormContinuous) → proj_out
//
// The rotary tables follow FluxPosEmbed: for each of the three id axes, get_1d_rotary_pos_embed
// with θ = 10000 in float64, cos/sin repeated per pair, the axes side by side (axes_dims_rope sum
// to the head width). Timestep and guidance are multiplied by 1000 inside, as diffusers does.
// `flux_parameter_table` lists every parameter's name and shape from a config without building
// the model (Flux.1-dev's 11.9 B parameters need no memory to count).

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/adaln.hpp"
#include "difftrain/models/config_reader.hpp"
#include "difftrain/models/feed_forward.hpp"
#include "difftrain/models/sd3_transformer_2d.hpp"
#include "difftrain/nn/attention/concepts.hpp"
#include "difftrain/nn/attention/sdpa.hpp"
#include "difftrain/nn/block_swap.hpp"
#include "difftrain/nn/blocks/checkpoint.hpp"
#include "difftrain/nn/layers/adaptable.hpp"
#include "difftrain/nn/unit_scope.hpp"

namespace difftrain::models {

struct FluxTransformer2DConfig {
  static constexpr std::string_view class_name = "FluxTransformer2DModel";

  std::int64_t patch_size = 1;
  std::int64_t in_channels = 64;
  std::optional<std::int64_t> out_channels{};  // null: in_channels
  std::int64_t num_layers = 19;
  std::int64_t num_single_layers = 38;
  std::int64_t attention_head_dim = 128;
  std::int64_t num_attention_heads = 24;
  std::int64_t joint_attention_dim = 4096;
  std::int64_t pooled_projection_dim = 768;
  bool guidance_embeds = false;
  std::vector<std::int64_t> axes_dims_rope = {16, 56, 56};

  [[nodiscard]] std::int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  [[nodiscard]] std::int64_t out() const { return out_channels.value_or(in_channels); }

  void validate(const std::string& where) const {
    check_config_range("num_attention_heads", num_attention_heads, 1, ConfigLimits::channels,
                       where);
    check_config_range("attention_head_dim", attention_head_dim, 2, ConfigLimits::channels, where);
    check_config_range("in_channels", in_channels, 1, ConfigLimits::channels, where);
    check_config_range("out_channels", out(), 1, ConfigLimits::channels, where);
    check_config_range("num_layers", num_layers, 0, ConfigLimits::layers, where);
    check_config_range("num_single_layers", num_single_layers, 0, ConfigLimits::layers, where);
    check_config_range("joint_attention_dim", joint_attention_dim, 1, ConfigLimits::channels,
                       where);
    check_config_range("pooled_projection_dim", pooled_projection_dim, 1, ConfigLimits::channels,
                       where);
    if (patch_size != 1)
      throw ConfigError("'patch_size' = " + std::to_string(patch_size) +
                            " is not supported (Flux packs 2×2 patches outside the model: 1)",
                        where);
    if (inner_dim() > ConfigLimits::channels)
      throw ConfigError(
          "num_attention_heads × attention_head_dim = " + std::to_string(inner_dim()) +
              " is over " + std::to_string(ConfigLimits::channels),
          where);
    if (axes_dims_rope.empty()) throw ConfigError("'axes_dims_rope' names no axis", where);
    for (const auto d : axes_dims_rope)
      if (d < 2 || d % 2 != 0)
        throw ConfigError("every 'axes_dims_rope' entry must be even and >= 2 (a rotated pair)",
                          where);
    const std::int64_t sum =
        std::accumulate(axes_dims_rope.begin(), axes_dims_rope.end(), std::int64_t{0});
    if (sum != attention_head_dim)
      throw ConfigError("'axes_dims_rope' sums to " + std::to_string(sum) +
                            ", not 'attention_head_dim' " + std::to_string(attention_head_dim),
                        where);
  }

  [[nodiscard]] WeightSignature weight_signature() const {
    WeightSignature s;
    s.shapes.push_back({"x_embedder.weight", {inner_dim(), in_channels}});
    s.shapes.push_back({"context_embedder.weight", {inner_dim(), joint_attention_dim}});
    s.shapes.push_back({"proj_out.weight", {out(), inner_dim()}});
    s.counts.push_back({"transformer_blocks.", num_layers});
    s.counts.push_back({"single_transformer_blocks.", num_single_layers});
    return s;
  }

  static constexpr auto fields() {
    using C = FluxTransformer2DConfig;
    return std::tuple{config_field("patch_size", &C::patch_size),
                      config_field("in_channels", &C::in_channels),
                      config_field("out_channels", &C::out_channels),
                      config_field("num_layers", &C::num_layers),
                      config_field("num_single_layers", &C::num_single_layers),
                      config_field("attention_head_dim", &C::attention_head_dim),
                      config_field("num_attention_heads", &C::num_attention_heads),
                      config_field("joint_attention_dim", &C::joint_attention_dim),
                      config_field("pooled_projection_dim", &C::pooled_projection_dim),
                      config_field("guidance_embeds", &C::guidance_embeds)};
  }

  static FluxTransformer2DConfig from_json(const nlohmann::json& j, const std::string& where) {
    ConfigReader r(j, where);
    FluxTransformer2DConfig c;
    read_fields(r, c, fields());
    c.axes_dims_rope = r.get("axes_dims_rope", c.axes_dims_rope);
    r.finish();
    c.validate(where);
    return c;
  }

  ConfigAsRead as_read{};

  [[nodiscard]] nlohmann::json to_json() const {
    nlohmann::json j = diffusers_config_json<FluxTransformer2DConfig>();
    write_fields(j, *this, fields());
    j["axes_dims_rope"] = axes_dims_rope;
    return j;
  }
};

/// FluxPosEmbed: the rotary (cos, sin) tables of `ids` (S, axes), each (S, Σ axes_dims), float32
/// from float64 angles.
inline std::pair<at::Tensor, at::Tensor> flux_rotary(const at::Tensor& ids,
                                                     const std::vector<std::int64_t>& axes_dims,
                                                     double theta = 10000.0) {
  if (ids.dim() != 2 || ids.size(1) != static_cast<std::int64_t>(axes_dims.size()))
    throw ShapeError(
        "ids must be (S, " + std::to_string(axes_dims.size()) + "), got " + c10::str(ids.sizes()),
        "flux_rotary");
  std::vector<at::Tensor> cos, sin;
  const at::Tensor pos = ids.to(at::kFloat).to(at::kDouble);
  for (std::size_t i = 0; i < axes_dims.size(); ++i) {
    const auto d = axes_dims[i];
    const at::Tensor freqs =
        1.0 / at::pow(theta, at::arange(0, d, 2, pos.options()).slice(0, 0, d / 2) /
                                 static_cast<double>(d));
    const at::Tensor angles = at::outer(pos.select(1, static_cast<std::int64_t>(i)), freqs);
    cos.push_back(angles.cos().repeat_interleave(2, 1).to(at::kFloat));
    sin.push_back(angles.sin().repeat_interleave(2, 1).to(at::kFloat));
  }
  return {at::cat(cos, -1), at::cat(sin, -1)};
}

/// apply_rotary_emb (use_real, pairs interleaved) on x (B, heads, S, D) with (S, D) tables,
/// computed in float32 and returned in x's dtype.
inline at::Tensor flux_apply_rotary(const at::Tensor& x, const at::Tensor& cos,
                                    const at::Tensor& sin) {
  const auto pairs = x.reshape({x.size(0), x.size(1), x.size(2), -1, 2}).unbind(-1);
  const at::Tensor rotated = at::stack({-pairs[1], pairs[0]}, -1).flatten(3);
  return (x.to(at::kFloat) * cos + rotated.to(at::kFloat) * sin).to(x.scalar_type());
}

/// diffusers' FluxAttention with FluxAttnProcessor: per-head RMS norms (eps 1e-6) of queries and
/// keys, the text stream's tokens first, rotary embeddings on both, one attention; to_out.0 for
/// the image tokens and to_add_out for the text (a double-stream block), or nothing (a single-
/// stream block: `pre_only`). Every projection has a bias and can carry a LoRA branch.
template <nn::attention::AttentionBackend Backend>
class FluxAttentionImpl : public torch::nn::Module {
 public:
  FluxAttentionImpl(std::int64_t dim, std::int64_t heads, std::int64_t head_dim, bool text_stream,
                    bool pre_only)
      : heads_(heads), head_dim_(head_dim) {
    const std::int64_t inner = heads * head_dim;
    auto linear = [](std::int64_t in, std::int64_t out) { return nn::AdaptableLinear(in, out); };
    norm_q = register_module("norm_q", RMSNorm(head_dim, 1e-6));
    norm_k = register_module("norm_k", RMSNorm(head_dim, 1e-6));
    to_q = register_module("to_q", linear(dim, inner));
    to_k = register_module("to_k", linear(dim, inner));
    to_v = register_module("to_v", linear(dim, inner));
    if (!pre_only)
      to_out = register_module("to_out",
                               torch::nn::Sequential(linear(inner, dim), torch::nn::Dropout(0.0)));
    if (text_stream) {
      norm_added_q = register_module("norm_added_q", RMSNorm(head_dim, 1e-6));
      norm_added_k = register_module("norm_added_k", RMSNorm(head_dim, 1e-6));
      add_q_proj = register_module("add_q_proj", linear(dim, inner));
      add_k_proj = register_module("add_k_proj", linear(dim, inner));
      add_v_proj = register_module("add_v_proj", linear(dim, inner));
      to_add_out = register_module("to_add_out", linear(inner, dim));
    }
  }

  /// (image out, text out): with a text stream both projected; otherwise the attention over `x`
  /// alone, unprojected, and an undefined text out.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& text,
                                            const at::Tensor& cos, const at::Tensor& sin) {
    auto heads = [&](const at::Tensor& t) {
      return t.view({t.size(0), t.size(1), heads_, head_dim_}).transpose(1, 2);
    };
    at::Tensor q = norm_q->forward(heads(to_q->forward(x)));
    at::Tensor k = norm_k->forward(heads(to_k->forward(x)));
    at::Tensor v = heads(to_v->forward(x));
    const bool joint = text.defined() && add_q_proj;
    if (joint) {
      q = at::cat({norm_added_q->forward(heads(add_q_proj->forward(text))), q}, 2);
      k = at::cat({norm_added_k->forward(heads(add_k_proj->forward(text))), k}, 2);
      v = at::cat({heads(add_v_proj->forward(text)), v}, 2);
    }
    q = flux_apply_rotary(q.to(v.scalar_type()), cos, sin);
    k = flux_apply_rotary(k.to(v.scalar_type()), cos, sin);
    nn::attention::AttentionArgs args;
    at::Tensor out = Backend::forward(q, k, v, args);
    out = out.transpose(1, 2).reshape({x.size(0), -1, heads_ * head_dim_});
    if (!joint) return {to_out ? to_out->forward(out) : out, at::Tensor()};
    const std::int64_t t = text.size(1);
    return {to_out->forward(out.slice(1, t)), to_add_out->forward(out.slice(1, 0, t))};
  }

  RMSNorm norm_q{nullptr}, norm_k{nullptr}, norm_added_q{nullptr}, norm_added_k{nullptr};
  nn::AdaptableLinear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  nn::AdaptableLinear add_q_proj{nullptr}, add_k_proj{nullptr}, add_v_proj{nullptr};
  nn::AdaptableLinear to_add_out{nullptr};
  torch::nn::Sequential to_out{nullptr};

 private:
  std::int64_t heads_, head_dim_;
};
template <nn::attention::AttentionBackend Backend>
using FluxAttention = torch::nn::ModuleHolder<FluxAttentionImpl<Backend>>;

/// diffusers' FluxTransformerBlock (double stream).
template <nn::attention::AttentionBackend Backend>
class FluxTransformerBlockImpl : public torch::nn::Module {
 public:
  FluxTransformerBlockImpl(std::int64_t dim, std::int64_t heads, std::int64_t head_dim) {
    norm1 = register_module("norm1", ModulatedNorm(dim, 6));
    norm1_context = register_module("norm1_context", ModulatedNorm(dim, 6));
    attn = register_module("attn", FluxAttention<Backend>(dim, heads, head_dim, true, false));
    norm2 = register_module("norm2", adaln_layer_norm(dim));
    norm2_context = register_module("norm2_context", adaln_layer_norm(dim));
    FeedForwardOptions f;
    f.dim = dim;
    ff = register_module("ff", FeedForward<nn::activation::GELUTanh>(f));
    ff_context = register_module("ff_context", FeedForward<nn::activation::GELUTanh>(f));
  }
  /// (text out, image out).
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& text,
                                            const at::Tensor& temb, const at::Tensor& cos,
                                            const at::Tensor& sin) {
    // m, c: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
    auto [nx, m] = norm1->forward(x, temb);
    auto [nt, c] = norm1_context->forward(text, temb);
    auto [attn_out, text_attn] =
        attn->forward(modulate(nx, m[0], m[1]), modulate(nt, c[0], c[1]), cos, sin);
    at::Tensor out = x + m[2].unsqueeze(1) * attn_out;
    out = out + m[5].unsqueeze(1) * ff->forward(modulate(norm2->forward(out), m[3], m[4]));
    at::Tensor t = text + c[2].unsqueeze(1) * text_attn;
    t = t +
        c[5].unsqueeze(1) * ff_context->forward(modulate(norm2_context->forward(t), c[3], c[4]));
    if (t.scalar_type() == at::kHalf) t = t.clamp(-65504, 65504);
    return {t, out};
  }
  ModulatedNorm norm1{nullptr}, norm1_context{nullptr};
  FluxAttention<Backend> attn{nullptr};
  torch::nn::LayerNorm norm2{nullptr}, norm2_context{nullptr};
  FeedForward<nn::activation::GELUTanh> ff{nullptr}, ff_context{nullptr};
};
template <nn::attention::AttentionBackend Backend>
using FluxTransformerBlock = torch::nn::ModuleHolder<FluxTransformerBlockImpl<Backend>>;

/// diffusers' FluxSingleTransformerBlock over [text; image] (mlp_ratio 4).
template <nn::attention::AttentionBackend Backend>
class FluxSingleTransformerBlockImpl : public torch::nn::Module {
 public:
  FluxSingleTransformerBlockImpl(std::int64_t dim, std::int64_t heads, std::int64_t head_dim) {
    const std::int64_t mlp = 4 * dim;
    norm = register_module("norm", ModulatedNorm(dim, 3));
    proj_mlp = register_module("proj_mlp", nn::AdaptableLinear(dim, mlp));
    proj_out = register_module("proj_out", nn::AdaptableLinear(dim + mlp, dim));
    attn = register_module("attn", FluxAttention<Backend>(dim, heads, head_dim, false, true));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& temb, const at::Tensor& cos,
                     const at::Tensor& sin) {
    auto [n, m] = norm->forward(x, temb);  // shift, scale, gate
    const at::Tensor h = modulate(n, m[0], m[1]);
    const at::Tensor mlp = at::gelu(proj_mlp->forward(h), "tanh");
    const at::Tensor a = attn->forward(h, at::Tensor(), cos, sin).first;
    at::Tensor out = x + m[2].unsqueeze(1) * proj_out->forward(at::cat({a, mlp}, 2));
    if (out.scalar_type() == at::kHalf) out = out.clamp(-65504, 65504);
    return out;
  }
  ModulatedNorm norm{nullptr};
  nn::AdaptableLinear proj_mlp{nullptr}, proj_out{nullptr};
  FluxAttention<Backend> attn{nullptr};
};
template <nn::attention::AttentionBackend Backend>
using FluxSingleTransformerBlock = torch::nn::ModuleHolder<FluxSingleTransformerBlockImpl<Backend>>;

/// diffusers' CombinedTimestepGuidanceTextProjEmbeddings: the timestep's and the guidance's
/// embeddings (each Timesteps(256) → TimestepEmbedding) plus the pooled text's projection.
class CombinedTimestepGuidanceTextProjEmbeddingsImpl : public torch::nn::Module {
 public:
  CombinedTimestepGuidanceTextProjEmbeddingsImpl(std::int64_t embedding_dim,
                                                 std::int64_t pooled_dim) {
    timestep_embedder =
        register_module("timestep_embedder", adaln_timestep_embedder(embedding_dim));
    guidance_embedder =
        register_module("guidance_embedder", adaln_timestep_embedder(embedding_dim));
    text_embedder = register_module("text_embedder",
                                    PixArtTextProjection(pooled_dim, embedding_dim, /*silu=*/true));
  }
  at::Tensor forward(const at::Tensor& timestep, const at::Tensor& guidance,
                     const at::Tensor& pooled) {
    const auto dtype = pooled.scalar_type();
    const at::Tensor t = timestep_embedder->forward(project_timesteps(timestep, 0.0).to(dtype));
    const at::Tensor g = guidance_embedder->forward(project_timesteps(guidance, 0.0).to(dtype));
    return (t + g) + text_embedder->forward(pooled);
  }
  TimestepEmbedding<> timestep_embedder{nullptr}, guidance_embedder{nullptr};
  PixArtTextProjection text_embedder{nullptr};
};
TORCH_MODULE(CombinedTimestepGuidanceTextProjEmbeddings);

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
class FluxTransformer2DModelImpl : public torch::nn::Module {
 public:
  using Config = FluxTransformer2DConfig;

  explicit FluxTransformer2DModelImpl(Config config,
                                      const std::string& where = "FluxTransformer2DModel")
      : c_(std::move(config)) {
    c_.validate(where);
    const std::int64_t d = c_.inner_dim(), heads = c_.num_attention_heads,
                       hd = c_.attention_head_dim;
    if (c_.guidance_embeds)
      time_text_guidance_embed =
          register_module("time_text_embed",
                          CombinedTimestepGuidanceTextProjEmbeddings(d, c_.pooled_projection_dim));
    else
      time_text_embed = register_module(
          "time_text_embed", CombinedTimestepTextProjEmbeddings(d, c_.pooled_projection_dim));
    context_embedder =
        register_module("context_embedder", nn::AdaptableLinear(c_.joint_attention_dim, d));
    x_embedder = register_module("x_embedder", nn::AdaptableLinear(c_.in_channels, d));
    transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_layers; ++i) {
      blocks_.push_back(FluxTransformerBlock<Backend>(d, heads, hd));
      transformer_blocks->push_back(blocks_.back());
    }
    single_transformer_blocks =
        register_module("single_transformer_blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_single_layers; ++i) {
      singles_.push_back(FluxSingleTransformerBlock<Backend>(d, heads, hd));
      single_transformer_blocks->push_back(singles_.back());
    }
    norm_out = register_module("norm_out", AdaLayerNormContinuous(d, d));
    proj_out = register_module("proj_out", nn::AdaptableLinear(d, c_.out()));
  }

  [[nodiscard]] const Config& config() const { return c_; }
  void set_gradient_checkpointing(bool on) { checkpointing_ = on; }
  [[nodiscard]] bool gradient_checkpointing() const { return checkpointing_; }

  /// The velocity for packed latents `hidden_states` (B, N, in_channels) at `timestep` (B,) in
  /// [0, 1] (σ; ×1000 inside), with T5's states (B, T, joint_attention_dim), CLIP's pooled output
  /// (B, pooled_projection_dim), the position ids `img_ids` (N, 3) and `txt_ids` (T, 3), and for a
  /// model with guidance embeddings the guidance scale (B,): (B, N, out_channels).
  at::Tensor forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                     const at::Tensor& pooled_projections, const at::Tensor& timestep,
                     const at::Tensor& img_ids, const at::Tensor& txt_ids,
                     const at::Tensor& guidance = {}) {
    const std::string where = "FluxTransformer2DModel";
    auto want = [&](const at::Tensor& t, std::vector<std::int64_t> shape, const char* name) {
      bool ok = t.defined() && t.dim() == static_cast<std::int64_t>(shape.size());
      for (std::size_t i = 0; ok && i < shape.size(); ++i)
        ok = shape[i] < 0 || t.size(static_cast<std::int64_t>(i)) == shape[i];
      if (!ok) {
        std::string s = "(";
        for (std::size_t i = 0; i < shape.size(); ++i)
          s += (i ? ", " : "") + (shape[i] < 0 ? std::string("·") : std::to_string(shape[i]));
        throw ShapeError(std::string(name) + " must be " + s + "), got " +
                             (t.defined() ? c10::str(t.sizes()) : std::string("nothing")),
                         where);
      }
    };
    want(hidden_states, {-1, -1, c_.in_channels}, "hidden_states");
    const std::int64_t b = hidden_states.size(0), n = hidden_states.size(1);
    want(encoder_hidden_states, {b, -1, c_.joint_attention_dim}, "encoder_hidden_states");
    const std::int64_t t_len = encoder_hidden_states.size(1);
    want(pooled_projections, {b, c_.pooled_projection_dim}, "pooled_projections");
    const auto axes = static_cast<std::int64_t>(c_.axes_dims_rope.size());
    want(img_ids, {n, axes}, "img_ids");
    want(txt_ids, {t_len, axes}, "txt_ids");
    if (c_.guidance_embeds != guidance.defined())
      throw ShapeError(c_.guidance_embeds
                           ? "this model embeds the guidance scale (guidance_embeds): give one"
                           : "this model has no guidance embedding (guidance_embeds false): give "
                             "no guidance",
                       where);
    const auto dtype = hidden_states.scalar_type();
    at::Tensor x = x_embedder->forward(hidden_states);
    const at::Tensor t = batch_timesteps(timestep, b, x.device(), where).to(dtype) * 1000;
    const at::Tensor temb =
        c_.guidance_embeds
            ? time_text_guidance_embed->forward(
                  t, batch_timesteps(guidance, b, x.device(), where).to(dtype) * 1000,
                  pooled_projections)
            : time_text_embed->forward(t, pooled_projections);
    at::Tensor context = context_embedder->forward(encoder_hidden_states);
    const auto [cos, sin] =
        flux_rotary(at::cat({txt_ids, img_ids}).to(x.device()), c_.axes_dims_rope);
    for (auto& block : blocks_) {
      auto body = [impl = block.ptr()](const std::vector<at::Tensor>& in) {
        auto [t_out, x_out] = impl->forward(in[0], in[1], in[2], in[3], in[4]);
        return at::cat({t_out, x_out}, 1);
      };
      const at::Tensor both = nn::in_unit(*block, [&] {
        return checkpointing_ && is_training()
                   ? nn::checkpoint(body, {x, context, temb, cos, sin}, block->parameters())
                   : body({x, context, temb, cos, sin});
      });
      context = both.slice(1, 0, t_len);
      x = both.slice(1, t_len);
    }
    at::Tensor joint = at::cat({context, x}, 1);
    for (auto& block : singles_) {
      auto body = [impl = block.ptr()](const std::vector<at::Tensor>& in) {
        return impl->forward(in[0], in[1], in[2], in[3]);
      };
      joint = nn::in_unit(*block, [&] {
        return checkpointing_ && is_training()
                   ? nn::checkpoint(body, {joint, temb, cos, sin}, block->parameters())
                   : body({joint, temb, cos, sin});
      });
    }
    x = joint.slice(1, t_len);
    return proj_out->forward(norm_out->forward(x, temb));
  }

  CombinedTimestepTextProjEmbeddings time_text_embed{nullptr};
  CombinedTimestepGuidanceTextProjEmbeddings time_text_guidance_embed{nullptr};
  nn::AdaptableLinear context_embedder{nullptr}, x_embedder{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr}, single_transformer_blocks{nullptr};
  AdaLayerNormContinuous norm_out{nullptr};
  nn::AdaptableLinear proj_out{nullptr};

 private:
  Config c_;
  std::vector<FluxTransformerBlock<Backend>> blocks_;
  std::vector<FluxSingleTransformerBlock<Backend>> singles_;
  bool checkpointing_ = false;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>>
using FluxTransformer2DModel = torch::nn::ModuleHolder<FluxTransformer2DModelImpl<Backend>>;

// ---- FluxPipeline's pieces --------------------------------------------------------------------

/// FluxPipeline._pack_latents: latents (B, C, H, W), H and W even, as (B, H/2·W/2, 4C) tokens of
/// 2×2 patches (channel-major within a patch).
inline at::Tensor flux_pack_latents(const at::Tensor& latents) {
  if (latents.dim() != 4 || latents.size(2) % 2 != 0 || latents.size(3) % 2 != 0)
    throw ShapeError(
        "latents must be (B, C, H, W) with H and W even, got " + c10::str(latents.sizes()),
        "flux_pack_latents");
  const std::int64_t b = latents.size(0), c = latents.size(1), h = latents.size(2),
                     w = latents.size(3);
  return latents.view({b, c, h / 2, 2, w / 2, 2})
      .permute({0, 2, 4, 1, 3, 5})
      .reshape({b, (h / 2) * (w / 2), c * 4});
}

/// FluxPipeline._unpack_latents: tokens (B, N, 4C) back to (B, C, H, W) for an image of
/// `height` × `width` pixels and the VAE's downscale (H = 2·⌊height / (2·downscale)⌋).
inline at::Tensor flux_unpack_latents(const at::Tensor& packed, std::int64_t height,
                                      std::int64_t width, std::int64_t vae_scale_factor) {
  const std::int64_t h = 2 * (height / (vae_scale_factor * 2)),
                     w = 2 * (width / (vae_scale_factor * 2));
  if (packed.dim() != 3 || packed.size(1) != (h / 2) * (w / 2) || packed.size(2) % 4 != 0)
    throw ShapeError("tokens must be (B, " + std::to_string((h / 2) * (w / 2)) + ", 4C) for a " +
                         std::to_string(height) + "x" + std::to_string(width) + " image, got " +
                         c10::str(packed.sizes()),
                     "flux_unpack_latents");
  const std::int64_t b = packed.size(0), c = packed.size(2) / 4;
  return packed.view({b, h / 2, w / 2, c, 2, 2}).permute({0, 3, 1, 4, 2, 5}).reshape({b, c, h, w});
}

/// FluxPipeline._prepare_latent_image_ids: (h·w, 3) float32, (0, row, column) of each packed
/// token of an h × w grid.
inline at::Tensor flux_latent_image_ids(std::int64_t h, std::int64_t w) {
  at::Tensor ids = at::zeros({h, w, 3}, at::kFloat);
  ids.select(2, 1).add_(at::arange(h, at::kFloat).unsqueeze(1));
  ids.select(2, 2).add_(at::arange(w, at::kFloat).unsqueeze(0));
  return ids.reshape({h * w, 3});
}

/// FluxPipeline's calculate_shift: μ of the dynamic shift, linear in the image's token count
/// between (base_seq_len, base_shift) and (max_seq_len, max_shift) (the scheduler config's).
inline double flux_calculate_shift(std::int64_t image_seq_len, std::int64_t base_seq_len = 256,
                                   std::int64_t max_seq_len = 4096, double base_shift = 0.5,
                                   double max_shift = 1.15) {
  const double m = (max_shift - base_shift) / static_cast<double>(max_seq_len - base_seq_len);
  const double b = base_shift - m * static_cast<double>(base_seq_len);
  return static_cast<double>(image_seq_len) * m + b;
}

/// Every parameter of the model `c` describes, by diffusers' name, with its shape, in the
/// model's order — computed, not built (a full-size Flux.1 has 11.9 B parameters).
inline std::vector<std::pair<std::string, std::vector<std::int64_t>>> flux_parameter_table(
    const FluxTransformer2DConfig& c) {
  c.validate("flux_parameter_table");
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> t;
  const std::int64_t d = c.inner_dim(), hd = c.attention_head_dim, ts = kAdaLnTimestepChannels;
  auto linear = [&](const std::string& name, std::int64_t in, std::int64_t out) {
    t.push_back({name + ".weight", {out, in}});
    t.push_back({name + ".bias", {out}});
  };
  auto rms = [&](const std::string& name) { t.push_back({name + ".weight", {hd}}); };
  linear("time_text_embed.timestep_embedder.linear_1", ts, d);
  linear("time_text_embed.timestep_embedder.linear_2", d, d);
  if (c.guidance_embeds) {
    linear("time_text_embed.guidance_embedder.linear_1", ts, d);
    linear("time_text_embed.guidance_embedder.linear_2", d, d);
  }
  linear("time_text_embed.text_embedder.linear_1", c.pooled_projection_dim, d);
  linear("time_text_embed.text_embedder.linear_2", d, d);
  linear("context_embedder", c.joint_attention_dim, d);
  linear("x_embedder", c.in_channels, d);
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "transformer_blocks." + std::to_string(i) + ".";
    linear(p + "norm1.linear", d, 6 * d);
    linear(p + "norm1_context.linear", d, 6 * d);
    rms(p + "attn.norm_q");
    rms(p + "attn.norm_k");
    linear(p + "attn.to_q", d, d);
    linear(p + "attn.to_k", d, d);
    linear(p + "attn.to_v", d, d);
    linear(p + "attn.to_out.0", d, d);
    rms(p + "attn.norm_added_q");
    rms(p + "attn.norm_added_k");
    linear(p + "attn.add_q_proj", d, d);
    linear(p + "attn.add_k_proj", d, d);
    linear(p + "attn.add_v_proj", d, d);
    linear(p + "attn.to_add_out", d, d);
    linear(p + "ff.net.0.proj", d, 4 * d);
    linear(p + "ff.net.2", 4 * d, d);
    linear(p + "ff_context.net.0.proj", d, 4 * d);
    linear(p + "ff_context.net.2", 4 * d, d);
  }
  for (std::int64_t i = 0; i < c.num_single_layers; ++i) {
    const std::string p = "single_transformer_blocks." + std::to_string(i) + ".";
    linear(p + "norm.linear", d, 3 * d);
    linear(p + "proj_mlp", d, 4 * d);
    linear(p + "proj_out", 5 * d, d);
    rms(p + "attn.norm_q");
    rms(p + "attn.norm_k");
    linear(p + "attn.to_q", d, d);
    linear(p + "attn.to_k", d, d);
    linear(p + "attn.to_v", d, d);
  }
  linear("norm_out.linear", d, 2 * d);
  linear("proj_out", d, c.out());
  return t;
}

/// kohya's --blocks_to_swap N for a Flux transformer (on its device, or in host memory with
/// o.device naming the device: then place the rest of the model after this call): the last N / 2
/// double blocks and the last 2·(N − N / 2) single blocks keep their frozen weights in host memory
/// (at most 35 for Flux.1's 19 + 38). Null for N = 0. Live while the model trains; destroying it
/// puts every block back on the device.
template <class Model>
std::unique_ptr<nn::BlockSwap> flux_block_swap(Model& model, std::int64_t n,
                                               nn::BlockSwapOptions o = {},
                                               const std::string& where = "blocks_to_swap") {
  const auto& c = model->config();
  const nn::DoubleSingleSwap split =
      nn::split_blocks_to_swap(n, c.num_layers, c.num_single_layers, where);
  if (n == 0) return nullptr;
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  std::vector<std::string> names;
  for (std::int64_t i = c.num_layers - split.double_blocks; i < c.num_layers; ++i) {
    blocks.push_back(model->transformer_blocks->ptr(static_cast<std::size_t>(i)));
    names.push_back("transformer_blocks." + std::to_string(i));
  }
  for (std::int64_t i = c.num_single_layers - split.single_blocks; i < c.num_single_layers; ++i) {
    blocks.push_back(model->single_transformer_blocks->ptr(static_cast<std::size_t>(i)));
    names.push_back("single_transformer_blocks." + std::to_string(i));
  }
  return std::make_unique<nn::BlockSwap>(blocks, std::move(names), o);
}

}  // namespace difftrain::models
