#pragma once
// diffusers' PixArtTransformer2DModel (PixArt-α / PixArt-Σ: a DiT with adaLN-single and
// cross-attention to text), built from its config.json with diffusers' parameter names:
//
//   pos_embed (PatchEmbed, interpolation_scale = config or max(sample_size / 64, 1))
//   adaln_single: emb (timestep_embedder; with additional conditions also resolution_embedder and
//     aspect_ratio_embedder, each D/3 wide) → linear: the six modulations every block shares
//   caption_projection (linear_1 → GELU-tanh → linear_2), when caption_channels is set
//   transformer_blocks.N: scale_shift_table (6, D) added to the shared modulations, norm1 →
//     attn1 (self), attn2 (to the text, no norm before it, as PixArt), norm2 → ff
//   norm_out, scale_shift_table (2, D) + the time embedding → proj_out → unpatchify.
//
// The text mask (encoder_attention_mask, 1 = attend) becomes diffusers' additive bias
// (1 − mask)·−10000, so a fully masked caption attends uniformly instead of giving NaN.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
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
#include "difftrain/models/patched_transformer_config.hpp"
#include "difftrain/nn/activation/elementwise.hpp"
#include "difftrain/nn/attention/concepts.hpp"
#include "difftrain/nn/attention/sdpa.hpp"
#include "difftrain/nn/blocks/checkpoint.hpp"
#include "difftrain/nn/blocks/cross_attention.hpp"
#include "difftrain/nn/unit_scope.hpp"

namespace difftrain::models {

struct PixArtTransformer2DConfig {
  static constexpr std::string_view class_name = "PixArtTransformer2DModel";

  std::int64_t num_attention_heads = 16;
  std::int64_t attention_head_dim = 72;
  std::int64_t in_channels = 4;
  std::optional<std::int64_t> out_channels = 8;  // null: in_channels
  std::int64_t num_layers = 28;
  double dropout = 0.0;
  std::int64_t norm_num_groups = 32;  // unused by the layers (kept in the config, as diffusers)
  std::int64_t cross_attention_dim = 1152;
  bool attention_bias = true;
  std::int64_t sample_size = 128;
  std::int64_t patch_size = 2;
  std::string activation_fn = "gelu-approximate";
  std::int64_t num_embeds_ada_norm = 1000;  // required non-null by diffusers; no table is built
  bool upcast_attention = false;            // no effect with scaled-dot-product attention
  bool norm_elementwise_affine = false;
  double norm_eps = 1e-6;
  std::optional<double> interpolation_scale;      // null: max(sample_size / 64, 1)
  std::optional<bool> use_additional_conditions;  // null: sample_size == 128
  std::optional<std::int64_t> caption_channels;   // null: no caption projection

  [[nodiscard]] std::int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  [[nodiscard]] std::int64_t out() const { return out_channels.value_or(in_channels); }
  [[nodiscard]] bool additional_conditions() const {
    return use_additional_conditions.value_or(sample_size == 128);
  }
  [[nodiscard]] double position_scale() const {
    return interpolation_scale.value_or(
        static_cast<double>(std::max<std::int64_t>(sample_size / 64, 1)));
  }
  /// The width of the text the blocks attend to: the projection's output, or the encoder's.
  [[nodiscard]] std::int64_t context_width() const {
    return caption_channels ? inner_dim() : cross_attention_dim;
  }

  void validate(const std::string& where) const {
    validate_patched_transformer(*this, where);
    check_config_range("cross_attention_dim", cross_attention_dim, 1, ConfigLimits::channels,
                       where);
    check_config_range("caption_channels", caption_channels, 1, ConfigLimits::channels, where);
    if (additional_conditions() && inner_dim() % 3 != 0)
      throw ConfigError("with resolution and aspect-ratio conditions the inner width " +
                            std::to_string(inner_dim()) +
                            " must be a multiple of 3 (two thirds resolution, one aspect ratio)",
                        where);
    if (caption_channels && cross_attention_dim != inner_dim())
      throw ConfigError("'cross_attention_dim' " + std::to_string(cross_attention_dim) +
                            " must equal the inner width " + std::to_string(inner_dim()) +
                            " when 'caption_channels' projects the text to it",
                        where);
    if (interpolation_scale && !(*interpolation_scale > 0.0))
      throw ConfigError("'interpolation_scale' must be positive", where);
  }

  /// Its own class, or diffusers' legacy Transformer2DModel with adaLN-single (remapped there).
  static bool reads_class(const std::string& name, const nlohmann::json& j) {
    return reads_transformer_2d_class(class_name, "ada_norm_single", name, j);
  }

  [[nodiscard]] WeightSignature weight_signature() const {
    WeightSignature s;
    const std::int64_t d = inner_dim();
    s.shapes.push_back({"pos_embed.proj.weight", {d, in_channels, patch_size, patch_size}});
    s.shapes.push_back({"proj_out.weight", {patch_size * patch_size * out(), d}});
    s.shapes.push_back({"transformer_blocks.0.attn2.to_k.weight", {d, context_width()}});
    if (caption_channels)
      s.shapes.push_back({"caption_projection.linear_1.weight", {d, *caption_channels}});
    s.counts.push_back({"transformer_blocks.", num_layers});
    return s;
  }

  /// The fields read and written as they are (the others have rules of their own).
  static constexpr auto fields() {
    using C = PixArtTransformer2DConfig;
    return std::tuple{config_field("num_attention_heads", &C::num_attention_heads),
                      config_field("attention_head_dim", &C::attention_head_dim),
                      config_field("in_channels", &C::in_channels),
                      config_field("out_channels", &C::out_channels),
                      config_field("num_layers", &C::num_layers),
                      config_field("dropout", &C::dropout),
                      config_field("norm_num_groups", &C::norm_num_groups),
                      config_field("cross_attention_dim", &C::cross_attention_dim),
                      config_field("attention_bias", &C::attention_bias),
                      config_field("sample_size", &C::sample_size),
                      config_field("patch_size", &C::patch_size),
                      config_field("activation_fn", &C::activation_fn),
                      config_field("num_embeds_ada_norm", &C::num_embeds_ada_norm),
                      config_field("upcast_attention", &C::upcast_attention),
                      config_field("norm_elementwise_affine", &C::norm_elementwise_affine),
                      config_field("norm_eps", &C::norm_eps),
                      config_field("interpolation_scale", &C::interpolation_scale),
                      config_field("use_additional_conditions", &C::use_additional_conditions),
                      config_field("caption_channels", &C::caption_channels)};
  }

  static PixArtTransformer2DConfig from_json(const nlohmann::json& j, const std::string& where) {
    ConfigReader r(j, where);
    PixArtTransformer2DConfig c;
    read_fields(r, c, fields());
    r.accept("cross_attention_dim");
    if (j.contains("cross_attention_dim") && j["cross_attention_dim"].is_null())
      throw ConfigError("'cross_attention_dim' = null: PixArt attends to text", where);
    r.accept("num_embeds_ada_norm");
    if (j.contains("num_embeds_ada_norm") && j["num_embeds_ada_norm"].is_null())
      throw ConfigError("'num_embeds_ada_norm' = null is refused by diffusers for adaLN-single",
                        where);
    r.require_default("norm_type", "ada_norm_single",
                      "diffusers' PixArtTransformer2DModel implements only adaLN-single");
    r.require_default("attention_type", "default");
    // Fields of the legacy Transformer2DModel config, meaningful only at these values here.
    r.require_default("num_vector_embeds", nullptr, "PixArt takes continuous latents");
    r.require_default("only_cross_attention", false);
    r.require_default("double_self_attention", false);
    r.accept("use_linear_projection");  // no effect on patched inputs
    r.finish();
    c.validate(where);
    return c;
  }

  /// The file from_pretrained read this config from (see ConfigAsRead).
  ConfigAsRead as_read{};

  [[nodiscard]] nlohmann::json to_json() const {
    nlohmann::json j = diffusers_config_json<PixArtTransformer2DConfig>();
    write_fields(j, *this, fields());
    j["norm_type"] = "ada_norm_single";
    j["attention_type"] = "default";
    return j;
  }
};

/// diffusers' PixArtAlphaCombinedTimestepSizeEmbeddings: the timestep (256 sinusoidal channels,
/// flip, shift 0) through TimestepEmbedding, plus, with additional conditions, the resolution
/// (height, width) and aspect ratio each through their own (D/3 wide, concatenated).
class PixArtTimestepSizeEmbeddingsImpl : public torch::nn::Module {
 public:
  PixArtTimestepSizeEmbeddingsImpl(std::int64_t embedding_dim, bool additional)
      : additional_(additional) {
    timestep_embedder =
        register_module("timestep_embedder", adaln_timestep_embedder(embedding_dim));
    if (additional) {
      resolution_embedder =
          register_module("resolution_embedder", adaln_timestep_embedder(embedding_dim / 3));
      aspect_ratio_embedder =
          register_module("aspect_ratio_embedder", adaln_timestep_embedder(embedding_dim / 3));
    }
  }

  at::Tensor forward(const at::Tensor& timestep, const at::Tensor& resolution,
                     const at::Tensor& aspect_ratio, at::ScalarType dtype) {
    at::Tensor emb = timestep_embedder->forward(project(timestep).to(dtype));
    if (!additional_) return emb;
    const std::int64_t b = timestep.size(0);
    const at::Tensor res =
        resolution_embedder->forward(project(resolution.flatten()).to(dtype)).reshape({b, -1});
    const at::Tensor ar =
        aspect_ratio_embedder->forward(project(aspect_ratio.flatten()).to(dtype)).reshape({b, -1});
    return emb + at::cat({res, ar}, 1);
  }

  TimestepEmbedding<> timestep_embedder{nullptr}, resolution_embedder{nullptr},
      aspect_ratio_embedder{nullptr};

 private:
  static at::Tensor project(const at::Tensor& t) {
    return project_timesteps(t, /*downscale_freq_shift=*/0.0);
  }
  bool additional_;
};
TORCH_MODULE(PixArtTimestepSizeEmbeddings);

/// diffusers' AdaLayerNormSingle: returns (linear(silu(emb)) — the six modulations of every
/// block — and the embedding itself, which the output layer uses).
class AdaLayerNormSingleImpl : public torch::nn::Module {
 public:
  AdaLayerNormSingleImpl(std::int64_t embedding_dim, bool additional) {
    emb = register_module("emb", PixArtTimestepSizeEmbeddings(embedding_dim, additional));
    linear = register_module("linear", torch::nn::Linear(embedding_dim, 6 * embedding_dim));
  }
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& timestep,
                                            const at::Tensor& resolution,
                                            const at::Tensor& aspect_ratio, at::ScalarType dtype) {
    at::Tensor embedded = emb->forward(timestep, resolution, aspect_ratio, dtype);
    return {linear->forward(at::silu(embedded)), embedded};
  }
  PixArtTimestepSizeEmbeddings emb{nullptr};
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(AdaLayerNormSingle);

/// diffusers' BasicTransformerBlock with norm_type "ada_norm_single" and cross-attention.
template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
class PixArtBlockImpl : public torch::nn::Module {
 public:
  PixArtBlockImpl(const PixArtTransformer2DConfig& c, bool gated_ff) {
    const std::int64_t d = c.inner_dim();
    auto norm = [&] {
      return torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})
                                      .elementwise_affine(c.norm_elementwise_affine)
                                      .eps(c.norm_eps));
    };
    norm1 = register_module("norm1", norm());
    nn::blocks::CrossAttentionOptions a;
    a.query_dim = d;
    a.heads = c.num_attention_heads;
    a.dim_head = c.attention_head_dim;
    a.dropout = c.dropout;
    a.qkv_bias = c.attention_bias;
    attn1 = register_module("attn1", nn::blocks::CrossAttention<Backend>(a));
    norm2 = register_module("norm2", norm());
    a.context_dim = c.context_width();
    attn2 = register_module("attn2", nn::blocks::CrossAttention<Backend>(a));
    FeedForwardOptions f;
    f.dim = d;
    f.gated = gated_ff;
    f.dropout = c.dropout;
    ff = register_module("ff", FeedForward<Act>(f));
    scale_shift_table = register_parameter("scale_shift_table",
                                           at::randn({6, d}) / std::sqrt(static_cast<double>(d)));
  }

  /// x (B, N, D); modulation (B, 6D) from adaln_single; text (B, L, context width); text_bias an
  /// additive (B, L) bias or undefined.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& modulation, const at::Tensor& text,
                     const at::Tensor& text_bias) {
    const std::int64_t b = x.size(0);
    // shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp: each (B, 1, D).
    const auto m = (scale_shift_table.unsqueeze(0) + modulation.reshape({b, 6, -1})).chunk(6, 1);
    at::Tensor h = modulate(norm1->forward(x), m[0], m[1]);
    at::Tensor out = m[2] * attn1->forward(h) + x;
    nn::blocks::AttentionCall call;
    call.context = text;
    call.mask = text_bias;
    out = attn2->forward(out, call) + out;
    h = modulate(norm2->forward(out), m[3], m[4]);
    return m[5] * ff->forward(h) + out;
  }

  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  nn::blocks::CrossAttention<Backend> attn1{nullptr}, attn2{nullptr};
  FeedForward<Act> ff{nullptr};
  at::Tensor scale_shift_table;
};
template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
using PixArtBlock = torch::nn::ModuleHolder<PixArtBlockImpl<Backend, Act>>;

/// Optional inputs of a PixArt call.
struct PixArtConditions {
  /// (B, L) over the text tokens: 1 (or true) = attend, 0 = ignore.
  at::Tensor encoder_attention_mask;
  /// With additional conditions: (B, 2) image height and width, (B, 1) aspect ratio.
  at::Tensor resolution, aspect_ratio;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>,
          nn::ElementwiseActivation Act = nn::activation::GELUTanh>
class PixArtTransformer2DModelImpl : public torch::nn::Module {
 public:
  using Config = PixArtTransformer2DConfig;

  explicit PixArtTransformer2DModelImpl(Config config,
                                        const std::string& where = "PixArtTransformer2DModel")
      : c_(std::move(config)) {
    c_.validate(where);
    const bool gated = check_feed_forward_activation<Act>(c_.activation_fn, where);
    const std::int64_t d = c_.inner_dim();
    PatchEmbedOptions pe;
    pe.height = pe.width = c_.sample_size;
    pe.patch_size = c_.patch_size;
    pe.in_channels = c_.in_channels;
    pe.embed_dim = d;
    pe.interpolation_scale = c_.position_scale();
    pos_embed = register_module("pos_embed", PatchEmbed(pe));
    transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_layers; ++i) {
      blocks_.push_back(PixArtBlock<Backend, Act>(c_, gated));
      transformer_blocks->push_back(blocks_.back());
    }
    norm_out = register_module("norm_out", adaln_layer_norm(d));
    scale_shift_table = register_parameter("scale_shift_table",
                                           at::randn({2, d}) / std::sqrt(static_cast<double>(d)));
    proj_out =
        register_module("proj_out", torch::nn::Linear(d, c_.patch_size * c_.patch_size * c_.out()));
    adaln_single =
        register_module("adaln_single", AdaLayerNormSingle(d, c_.additional_conditions()));
    if (c_.caption_channels)
      caption_projection =
          register_module("caption_projection", PixArtTextProjection(*c_.caption_channels, d));
  }

  [[nodiscard]] const Config& config() const { return c_; }
  void set_gradient_checkpointing(bool on) { checkpointing_ = on; }
  [[nodiscard]] bool gradient_checkpointing() const { return checkpointing_; }

  /// The prediction for latents (B, in_channels, H, W) at timesteps (B,) (or one for all) with
  /// text (B, L, caption_channels or cross_attention_dim): (B, out_channels, H, W).
  at::Tensor forward(const at::Tensor& sample, const at::Tensor& timestep,
                     const at::Tensor& encoder_hidden_states, const PixArtConditions& cond = {}) {
    const std::string where = "PixArtTransformer2DModel";
    const auto [h, w] = patch_grid(sample, c_.in_channels, c_.patch_size, where);
    const std::int64_t b = sample.size(0);
    const at::Tensor t = batch_timesteps(timestep, b, sample.device(), where);
    const std::int64_t text_width = c_.caption_channels.value_or(c_.cross_attention_dim);
    const at::Tensor& text = encoder_hidden_states;
    if (!text.defined() || text.dim() != 3 || text.size(0) != b || text.size(2) != text_width)
      throw ShapeError("encoder_hidden_states must be (" + std::to_string(b) + ", L, " +
                           std::to_string(text_width) + "), got " +
                           (text.defined() ? c10::str(text.sizes()) : std::string("nothing")),
                       where);
    at::Tensor text_bias;
    if (const at::Tensor& m = cond.encoder_attention_mask; m.defined()) {
      if (m.dim() != 2 || m.size(0) != b || m.size(1) != text.size(1))
        throw ShapeError("encoder_attention_mask must be (B, L) = (" + std::to_string(b) + ", " +
                             std::to_string(text.size(1)) + "), got " + c10::str(m.sizes()),
                         where);
      text_bias = (1 - m.to(sample.device(), at::kFloat)) * -10000.0;
    }
    at::Tensor resolution, aspect_ratio;
    if (c_.additional_conditions()) {
      if (!cond.resolution.defined() || !cond.aspect_ratio.defined())
        throw ShapeError(
            "this config uses additional conditions (use_additional_conditions, or sample_size "
            "128): pass resolution (B, 2) and aspect_ratio (B, 1)",
            where);
      if (cond.resolution.numel() != 2 * b || cond.aspect_ratio.numel() != b)
        throw ShapeError("resolution must be (B, 2) and aspect_ratio (B, 1) for B = " +
                             std::to_string(b) + ", got " + c10::str(cond.resolution.sizes()) +
                             " and " + c10::str(cond.aspect_ratio.sizes()),
                         where);
      resolution = cond.resolution.to(sample.device());
      aspect_ratio = cond.aspect_ratio.to(sample.device());
    }
    at::Tensor x = pos_embed->forward(sample);
    auto [modulation, embedded] =
        adaln_single->forward(t, resolution, aspect_ratio, x.scalar_type());
    at::Tensor context = caption_projection ? caption_projection->forward(text) : text;
    for (auto& block : blocks_) {
      // The modulation and the text carry gradients (adaln_single, caption_projection): they go
      // through the checkpoint as inputs. By value: a checkpointed block replays this in backward.
      auto body = [impl = block.ptr(), text_bias](const std::vector<at::Tensor>& in) {
        return impl->forward(in[0], in[1], in[2], text_bias);
      };
      x = nn::in_unit(*block, [&] {
        return checkpointing_ && is_training()
                   ? nn::checkpoint(body, {x, modulation, context}, block->parameters())
                   : body({x, modulation, context});
      });
    }
    const auto ss = (scale_shift_table.unsqueeze(0) + embedded.unsqueeze(1)).chunk(2, 1);
    x = modulate(norm_out->forward(x), ss[0], ss[1]);
    x = proj_out->forward(x);
    return unpatchify(x, h, w, c_.patch_size, c_.out());
  }

  PatchEmbed pos_embed{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr};
  torch::nn::LayerNorm norm_out{nullptr};
  at::Tensor scale_shift_table;
  torch::nn::Linear proj_out{nullptr};
  AdaLayerNormSingle adaln_single{nullptr};
  PixArtTextProjection caption_projection{nullptr};

 private:
  Config c_;
  std::vector<PixArtBlock<Backend, Act>> blocks_;
  bool checkpointing_ = false;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>,
          nn::ElementwiseActivation Act = nn::activation::GELUTanh>
using PixArtTransformer2DModel =
    torch::nn::ModuleHolder<PixArtTransformer2DModelImpl<Backend, Act>>;

}  // namespace difftrain::models
