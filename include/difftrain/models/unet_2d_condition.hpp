#pragma once
// diffusers' UNet2DConditionModel — the UNet of Stable Diffusion 1.x/2.x, SDXL (its added text and
// time conditions) and diffusers' class-conditional and small test configurations — built from
// its `config.json`, parameter for parameter. The attention backend and the activation are
// compile-time policies (the config's act_fn must name the activation policy); every config field
// is read, and a field or value difftrain does not build is a ConfigError naming it.
//
//   conv_in → down blocks (skips saved) → mid block → up blocks (skips consumed) →
//   GroupNorm → act → conv_out, with the timestep embedding (+ class embedding, + SDXL's added
//   embedding) in every resnet and encoder_hidden_states (optionally masked) in every
//   cross-attention.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
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
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/config_reader.hpp"
#include "difftrain/models/embeddings.hpp"
#include "difftrain/models/unet_blocks.hpp"
#include "difftrain/nn/unit_scope.hpp"

namespace difftrain::models {

/// The fields of diffusers' UNet2DConditionModel config that difftrain builds, with diffusers'
/// defaults. Per-block fields hold one entry per down block.
struct UNet2DConditionConfig {
  /// diffusers' `_class_name` for this model.
  static constexpr std::string_view class_name = "UNet2DConditionModel";

  std::optional<nlohmann::json> sample_size;  // metadata only (an int or [h, w])
  std::int64_t in_channels = 4, out_channels = 4;
  bool center_input_sample = false;
  bool flip_sin_to_cos = true;
  double freq_shift = 0;
  std::vector<std::string> down_block_types{"CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                            "CrossAttnDownBlock2D", "DownBlock2D"};
  std::optional<std::string> mid_block_type = "UNetMidBlock2DCrossAttn";
  std::vector<std::string> up_block_types{"UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
                                          "CrossAttnUpBlock2D"};
  std::vector<bool> only_cross_attention;  // per block; empty: all false
  std::optional<bool> mid_block_only_cross_attention;
  std::vector<std::int64_t> block_out_channels{320, 640, 1280, 1280};
  std::vector<std::int64_t> layers_per_block;  // per block; empty: 2
  std::int64_t downsample_padding = 1;
  double mid_block_scale_factor = 1;
  double dropout = 0;
  std::string act_fn = "silu";
  std::int64_t norm_num_groups = 32;
  double norm_eps = 1e-5;
  std::vector<std::int64_t> cross_attention_dim;           // per block; empty: 1280
  std::vector<std::int64_t> transformer_layers_per_block;  // per block; empty: 1
  std::optional<std::int64_t> encoder_hid_dim;
  std::optional<std::string> encoder_hid_dim_type;  // "text_proj"
  /// diffusers' `attention_head_dim`, which for this model is the number of heads per block
  /// (the head size is channels / heads); empty: 8.
  std::vector<std::int64_t> attention_head_dim;
  bool use_linear_projection = false;
  std::optional<std::string> class_embed_type;  // timestep, identity, projection, simple_projection
  std::optional<std::int64_t> num_class_embeds;
  bool upcast_attention = false;  // no effect with scaled-dot-product attention, as in diffusers
  std::string resnet_time_scale_shift = "default";
  std::optional<std::int64_t> time_embedding_dim;
  std::optional<std::string> time_embedding_act_fn;
  std::optional<std::string> timestep_post_act;
  std::optional<std::int64_t> time_cond_proj_dim;
  std::int64_t conv_in_kernel = 3, conv_out_kernel = 3;
  std::optional<std::int64_t> projection_class_embeddings_input_dim;
  bool class_embeddings_concat = false;
  /// "text_time" (SDXL): text_embeds and the sinusoidal embedding of time_ids, concatenated
  /// (projection_class_embeddings_input_dim values), through add_embedding into the time embedding.
  std::optional<std::string> addition_embed_type;
  std::optional<std::int64_t> addition_time_embed_dim;
  std::int64_t addition_embed_type_num_heads = 64;  // diffusers' "text" type only

  [[nodiscard]] std::size_t blocks() const { return down_block_types.size(); }

  /// Fills the per-block lists and checks that the whole makes a UNet difftrain can build.
  void resolve(const std::string& where) {
    const std::size_t n = blocks();
    if (n == 0) throw ConfigError("'down_block_types' is empty", where);
    auto fill = [&](auto& v, auto value, const char* name) {
      if (v.empty()) v.assign(n, value);
      if (v.size() != n)
        throw ConfigError("'" + std::string(name) + "' has " + std::to_string(v.size()) +
                              " entries for " + std::to_string(n) + " down blocks",
                          where);
    };
    fill(only_cross_attention, false, "only_cross_attention");
    fill(layers_per_block, std::int64_t{2}, "layers_per_block");
    fill(cross_attention_dim, std::int64_t{1280}, "cross_attention_dim");
    fill(transformer_layers_per_block, std::int64_t{1}, "transformer_layers_per_block");
    fill(attention_head_dim, std::int64_t{8}, "attention_head_dim");
    if (up_block_types.size() != n)
      throw ConfigError("'up_block_types' has " + std::to_string(up_block_types.size()) +
                            " entries and 'down_block_types' " + std::to_string(n) +
                            "; they must match",
                        where);
    if (block_out_channels.size() != n)
      throw ConfigError("'block_out_channels' has " + std::to_string(block_out_channels.size()) +
                            " entries for " + std::to_string(n) + " down blocks",
                        where);
    auto strip = [](std::string t) { return t.starts_with("UNetRes") ? t.substr(7) : t; };
    for (auto& t : down_block_types) {
      t = strip(t);
      if (t != "DownBlock2D" && t != "CrossAttnDownBlock2D")
        throw ConfigError("'down_block_types' has \"" + t +
                              "\", which difftrain does not build (DownBlock2D, "
                              "CrossAttnDownBlock2D)",
                          where);
    }
    for (auto& t : up_block_types) {
      t = strip(t);
      if (t != "UpBlock2D" && t != "CrossAttnUpBlock2D")
        throw ConfigError("'up_block_types' has \"" + t +
                              "\", which difftrain does not build (UpBlock2D, CrossAttnUpBlock2D)",
                          where);
    }
    if (mid_block_type && *mid_block_type != "UNetMidBlock2DCrossAttn" &&
        *mid_block_type != "UNetMidBlock2D")
      throw ConfigError("'mid_block_type' = \"" + *mid_block_type +
                            "\" is not built by difftrain (UNetMidBlock2DCrossAttn, "
                            "UNetMidBlock2D or null)",
                        where);
    // Every size in range before anything divides by one or allocates with one.
    using L = ConfigLimits;
    check_conv_model_sizes("down_block_types", n, in_channels, out_channels, norm_num_groups,
                           block_out_channels, where);
    check_config_range("layers_per_block", layers_per_block, 0, L::layers, where);
    check_config_range("transformer_layers_per_block", transformer_layers_per_block, 1, L::layers,
                       where);
    check_config_range("cross_attention_dim", cross_attention_dim, 1, L::channels, where);
    check_config_range("attention_head_dim", attention_head_dim, 1, L::channels, where);
    check_config_range("conv_in_kernel", conv_in_kernel, 1, L::kernel, where);
    check_config_range("conv_out_kernel", conv_out_kernel, 1, L::kernel, where);
    check_config_range("time_embedding_dim", time_embedding_dim, 1, 4 * L::channels, where);
    check_config_range("time_cond_proj_dim", time_cond_proj_dim, 1, L::channels, where);
    check_config_range("encoder_hid_dim", encoder_hid_dim, 1, L::channels, where);
    check_config_range("num_class_embeds", num_class_embeds, 1, L::classes, where);
    check_config_range("projection_class_embeddings_input_dim",
                       projection_class_embeddings_input_dim, 1, 4 * L::channels, where);
    check_config_range("addition_time_embed_dim", addition_time_embed_dim, 1, L::channels, where);
    if (!std::isfinite(norm_eps) || norm_eps <= 0)
      throw ConfigError("'norm_eps' = " + std::to_string(norm_eps) + " must be positive", where);
    for (std::size_t i = 0; i < n; ++i)
      if (attention_head_dim[i] <= 0 || block_out_channels[i] % attention_head_dim[i] != 0)
        throw ConfigError(
            "'attention_head_dim' (the number of heads here, as diffusers reads it) "
            "entry " +
                std::to_string(attention_head_dim[i]) + " does not divide " +
                std::to_string(block_out_channels[i]) + " channels",
            where);
    if (conv_in_kernel <= 0 || conv_in_kernel % 2 == 0 || conv_out_kernel <= 0 ||
        conv_out_kernel % 2 == 0)
      throw ConfigError("'conv_in_kernel' and 'conv_out_kernel' must be odd and positive", where);
    if (class_embed_type && *class_embed_type != "timestep" && *class_embed_type != "identity" &&
        *class_embed_type != "projection" && *class_embed_type != "simple_projection")
      throw ConfigError("'class_embed_type' = \"" + *class_embed_type +
                            "\" is unknown (timestep, identity, projection, simple_projection)",
                        where);
    if (class_embed_type &&
        (*class_embed_type == "projection" || *class_embed_type == "simple_projection") &&
        !projection_class_embeddings_input_dim)
      throw ConfigError("'class_embed_type' = \"" + *class_embed_type +
                            "\" needs 'projection_class_embeddings_input_dim'",
                        where);
    if (encoder_hid_dim && !encoder_hid_dim_type) encoder_hid_dim_type = "text_proj";
    if (encoder_hid_dim_type) {
      if (*encoder_hid_dim_type != "text_proj")
        throw ConfigError("'encoder_hid_dim_type' = \"" + *encoder_hid_dim_type +
                              "\" is not supported (only \"text_proj\")",
                          where);
      if (!encoder_hid_dim)
        throw ConfigError("'encoder_hid_dim_type' needs 'encoder_hid_dim'", where);
      if (std::adjacent_find(cross_attention_dim.begin(), cross_attention_dim.end(),
                             std::not_equal_to<>()) != cross_attention_dim.end())
        throw ConfigError("'encoder_hid_dim' needs a single 'cross_attention_dim'", where);
    }
    if (addition_embed_type) {
      if (*addition_embed_type != "text_time")
        throw ConfigError("'addition_embed_type' = \"" + *addition_embed_type +
                              "\" is not built by difftrain (\"text_time\", SDXL's, or null)",
                          where);
      if (!addition_time_embed_dim || *addition_time_embed_dim <= 0)
        throw ConfigError(
            "'addition_embed_type' = \"text_time\" needs a positive "
            "'addition_time_embed_dim'",
            where);
      if (!projection_class_embeddings_input_dim)
        throw ConfigError(
            "'addition_embed_type' = \"text_time\" needs "
            "'projection_class_embeddings_input_dim' (text embedding size + "
            "time ids × addition_time_embed_dim)",
            where);
      if (class_embeddings_concat)
        throw ConfigError(
            "'addition_embed_type' cannot be combined with 'class_embeddings_concat' "
            "(the added embedding has the time embedding's width)",
            where);
    }
    time_embedding_norm_from(resnet_time_scale_shift, where);
    if (!diffusers_activation(act_fn))
      throw ConfigError(
          "'act_fn' = \"" + act_fn +
              "\" is not an activation diffusers knows (silu, swish, mish, gelu, relu)",
          where);
    for (const auto* act : {&time_embedding_act_fn, &timestep_post_act})
      if (*act && !diffusers_activation(**act))
        throw ConfigError("unknown activation \"" + **act + "\"", where);
  }

  /// What this (resolved) config implies about a weight file: block and layer counts, and the
  /// convolutions that fix every block's width.
  [[nodiscard]] WeightSignature weight_signature() const {
    WeightSignature s;
    const auto n = static_cast<std::int64_t>(blocks());
    const auto& ch = block_out_channels;
    s.shapes.push_back({"conv_in.weight", {ch[0], in_channels, conv_in_kernel, conv_in_kernel}});
    s.shapes.push_back(
        {"conv_out.weight", {out_channels, ch[0], conv_out_kernel, conv_out_kernel}});
    s.counts.push_back({"down_blocks.", n});
    s.counts.push_back({"up_blocks.", n});
    // The class table is checked before the model allocates it (num_class_embeds of 2^24 must
    // find that table in the weights).
    if (!class_embed_type && num_class_embeds)
      s.shapes.push_back({"class_embedding.weight", {*num_class_embeds, time_embed_dim()}});
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const std::string down = "down_blocks." + std::to_string(i) + ".";
      s.counts.push_back({down + "resnets.", layers_per_block[k]});
      s.counts.push_back({"up_blocks." + std::to_string(i) + ".resnets.",
                          layers_per_block[static_cast<std::size_t>(n - 1 - i)] + 1});
      if (layers_per_block[k] == 0) continue;
      s.shapes.push_back({down + "resnets.0.conv1.weight", {ch[k], ch[k == 0 ? 0 : k - 1], 3, 3}});
      if (down_block_types[k] == "CrossAttnDownBlock2D")
        s.counts.push_back(
            {down + "attentions.0.transformer_blocks.", transformer_layers_per_block[k]});
    }
    return s;
  }

  [[nodiscard]] std::int64_t time_embed_dim() const {
    return time_embedding_dim.value_or(block_out_channels.at(0) * 4);
  }
  [[nodiscard]] bool any_cross_attention() const {
    const auto is_cross = [](const std::string& t) { return t.starts_with("CrossAttn"); };
    return std::any_of(down_block_types.begin(), down_block_types.end(), is_cross) ||
           std::any_of(up_block_types.begin(), up_block_types.end(), is_cross) ||
           mid_block_type == "UNetMidBlock2DCrossAttn";
  }

  /// The fields read and written as they are (the others have rules of their own).
  static constexpr auto fields() {
    using C = UNet2DConditionConfig;
    return std::tuple{
        config_field("in_channels", &C::in_channels),
        config_field("center_input_sample", &C::center_input_sample),
        config_field("flip_sin_to_cos", &C::flip_sin_to_cos),
        // null on purpose: no mid block; absent: the default
        config_field("mid_block_type", &C::mid_block_type),
        config_field("mid_block_only_cross_attention", &C::mid_block_only_cross_attention),
        config_field("downsample_padding", &C::downsample_padding),
        config_field("dropout", &C::dropout), config_field("act_fn", &C::act_fn),
        config_field("norm_num_groups", &C::norm_num_groups),
        config_field("norm_eps", &C::norm_eps),
        config_field("encoder_hid_dim", &C::encoder_hid_dim),
        config_field("encoder_hid_dim_type", &C::encoder_hid_dim_type),
        config_field("use_linear_projection", &C::use_linear_projection),
        config_field("class_embed_type", &C::class_embed_type),
        config_field("num_class_embeds", &C::num_class_embeds),
        config_field("upcast_attention", &C::upcast_attention),
        config_field("resnet_time_scale_shift", &C::resnet_time_scale_shift),
        config_field("time_embedding_dim", &C::time_embedding_dim),
        config_field("time_embedding_act_fn", &C::time_embedding_act_fn),
        config_field("timestep_post_act", &C::timestep_post_act),
        config_field("time_cond_proj_dim", &C::time_cond_proj_dim),
        config_field("conv_in_kernel", &C::conv_in_kernel),
        config_field("class_embeddings_concat", &C::class_embeddings_concat),
        config_field("addition_embed_type", &C::addition_embed_type),
        config_field("addition_time_embed_dim", &C::addition_time_embed_dim),
        config_field("addition_embed_type_num_heads", &C::addition_embed_type_num_heads)};
  }

  static UNet2DConditionConfig from_json(const nlohmann::json& j, const std::string& where) {
    ConfigReader r(j, where);
    UNet2DConditionConfig c;
    c.sample_size = r.optional<nlohmann::json>("sample_size");
    read_fields(r, c, fields());
    c.out_channels = r.get("out_channels", c.out_channels);
    c.freq_shift = r.get("freq_shift", c.freq_shift);
    c.down_block_types = r.get("down_block_types", c.down_block_types);
    c.up_block_types = r.get("up_block_types", c.up_block_types);
    const std::size_t n = c.down_block_types.size();
    c.only_cross_attention = r.per_block("only_cross_attention", n, false);
    c.block_out_channels = r.get("block_out_channels", c.block_out_channels);
    c.layers_per_block = r.per_block<std::int64_t>("layers_per_block", n, 2);
    c.mid_block_scale_factor = r.get("mid_block_scale_factor", c.mid_block_scale_factor);
    r.accept("norm_num_groups");
    if (j.contains("norm_num_groups") && j["norm_num_groups"].is_null())
      throw ConfigError("'norm_num_groups' = null is not supported (the resnets need groups)",
                        where);
    c.cross_attention_dim = r.per_block<std::int64_t>("cross_attention_dim", n, 1280);
    if (j.contains("transformer_layers_per_block") && j["transformer_layers_per_block"].is_array())
      for (const auto& e : j["transformer_layers_per_block"])
        if (e.is_array())
          throw ConfigError(
              "'transformer_layers_per_block' with a list per block (an "
              "asymmetric UNet) is not supported",
              where);
    c.transformer_layers_per_block =
        r.per_block<std::int64_t>("transformer_layers_per_block", n, 1);
    r.require_default("reverse_transformer_layers_per_block", nullptr);
    c.attention_head_dim = r.per_block<std::int64_t>("attention_head_dim", n, 8);
    r.require_default("num_attention_heads", nullptr,
                      "diffusers itself refuses it for this model; use attention_head_dim");
    r.require_default("dual_cross_attention", false);
    // Passed by diffusers only to block types difftrain does not build: no effect here.
    r.accept("resnet_skip_time_act");
    r.accept("resnet_out_scale_factor");
    r.require_default("time_embedding_type", "positional");
    c.conv_out_kernel = r.get("conv_out_kernel", c.conv_out_kernel);
    c.projection_class_embeddings_input_dim =
        r.optional<std::int64_t>("projection_class_embeddings_input_dim");
    r.require_default("attention_type", "default");
    r.require_default("cross_attention_norm", nullptr);
    r.finish();
    c.resolve(where);
    return c;
  }

  /// The config as diffusers writes it (so `from_pretrained` reads the folder back).
  /// The file from_pretrained read this config from (see ConfigAsRead).
  ConfigAsRead as_read{};

  [[nodiscard]] nlohmann::json to_json() const {
    nlohmann::json j = diffusers_config_json<UNet2DConditionConfig>();
    j["sample_size"] = sample_size.value_or(nullptr);
    write_fields(j, *this, fields());
    j["out_channels"] = out_channels;
    j["freq_shift"] = config_number(freq_shift);
    j["down_block_types"] = down_block_types;
    j["up_block_types"] = up_block_types;
    j["only_cross_attention"] = per_block_json(only_cross_attention);
    j["block_out_channels"] = block_out_channels;
    j["layers_per_block"] = per_block_json(layers_per_block);
    j["mid_block_scale_factor"] = config_number(mid_block_scale_factor);
    j["cross_attention_dim"] = per_block_json(cross_attention_dim);
    j["transformer_layers_per_block"] = per_block_json(transformer_layers_per_block);
    j["attention_head_dim"] = per_block_json(attention_head_dim);
    j["time_embedding_type"] = "positional";
    j["conv_out_kernel"] = conv_out_kernel;
    j["projection_class_embeddings_input_dim"] =
        value_or_null(projection_class_embeddings_input_dim);
    return j;
  }
};

/// Optional inputs of a UNet call.
struct UNetConditions {
  at::Tensor class_labels;   // (B,) labels, or (B, D) for "identity"/"projection" class embeddings
  at::Tensor timestep_cond;  // (B, time_cond_proj_dim)
  /// (B, L) over encoder_hidden_states' tokens, 1 (or true) = attend, 0 = ignore; diffusers turns
  /// it into an additive bias of −10000 (not −∞: a fully masked row gives no NaN; softmax being
  /// shift-invariant, it attends as if unmasked, as in diffusers).
  at::Tensor encoder_attention_mask;
  /// SDXL's added conditions ("text_time"): the pooled text embedding (B, D) and the time ids
  /// (B, K) — original size, crop corner, target size.
  at::Tensor text_embeds, time_ids;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>,
          nn::ElementwiseActivation Act = nn::activation::SiLU>
class UNet2DConditionModelImpl : public torch::nn::Module {
 public:
  using Config = UNet2DConditionConfig;

  explicit UNet2DConditionModelImpl(Config config,
                                    const std::string& where = "UNet2DConditionModel")
      : c_(std::move(config)) {
    c_.resolve(where);
    check_activation<Act>("act_fn", c_.act_fn, where);
    needs_context_ = c_.any_cross_attention();
    using namespace torch::nn;
    const auto& ch = c_.block_out_channels;
    const std::size_t n = c_.blocks();
    const std::int64_t temb = c_.time_embed_dim();
    conv_in =
        register_module("conv_in", Conv2d(Conv2dOptions(c_.in_channels, ch[0], c_.conv_in_kernel)
                                              .padding((c_.conv_in_kernel - 1) / 2)));
    TimestepEmbeddingOptions te;
    te.in_channels = ch[0];
    te.time_embed_dim = temb;
    te.post_act = c_.timestep_post_act;
    te.cond_proj_dim = c_.time_cond_proj_dim;
    time_embedding = register_module("time_embedding", TimestepEmbedding<Act>(te));
    if (c_.addition_embed_type == "text_time") {
      // diffusers' TimestepEmbedding default activation (silu), whatever act_fn says.
      TimestepEmbeddingOptions ae;
      ae.in_channels = *c_.projection_class_embeddings_input_dim;
      ae.time_embed_dim = temb;
      add_embedding = register_module("add_embedding", TimestepEmbedding<nn::activation::SiLU>(ae));
    }
    if (c_.encoder_hid_dim)
      encoder_hid_proj = register_module("encoder_hid_proj",
                                         Linear(*c_.encoder_hid_dim, c_.cross_attention_dim[0]));
    if (!c_.class_embed_type && c_.num_class_embeds) {
      class_embedding = register_module("class_embedding", Embedding(*c_.num_class_embeds, temb));
    } else if (c_.class_embed_type == "timestep") {
      TimestepEmbeddingOptions ce;
      ce.in_channels = ch[0];
      ce.time_embed_dim = temb;
      class_timestep_ = register_module("class_embedding", TimestepEmbedding<Act>(ce));
    } else if (c_.class_embed_type == "projection") {
      // diffusers builds this one with its default activation (silu), whatever act_fn says.
      TimestepEmbeddingOptions ce;
      ce.in_channels = *c_.projection_class_embeddings_input_dim;
      ce.time_embed_dim = temb;
      class_projection_ =
          register_module("class_embedding", TimestepEmbedding<nn::activation::SiLU>(ce));
    } else if (c_.class_embed_type == "simple_projection") {
      class_linear_ = register_module("class_embedding",
                                      Linear(*c_.projection_class_embeddings_input_dim, temb));
    }
    down_blocks = register_module("down_blocks", ModuleList());
    up_blocks = register_module("up_blocks", ModuleList());

    ResnetSettings rs;
    rs.temb_channels = c_.class_embeddings_concat ? 2 * temb : temb;
    rs.groups = c_.norm_num_groups;
    rs.eps = c_.norm_eps;
    rs.dropout = c_.dropout;
    rs.time_embedding_norm = time_embedding_norm_from(c_.resnet_time_scale_shift, where);
    auto cross = [&](std::size_t i, bool only_cross) {
      CrossAttentionSettings a;
      a.num_attention_heads = c_.attention_head_dim[i];
      a.transformer_layers = c_.transformer_layers_per_block[i];
      a.cross_attention_dim = c_.cross_attention_dim[i];
      a.use_linear_projection = c_.use_linear_projection;
      a.only_cross_attention = only_cross;
      return a;
    };
    std::int64_t out = ch[0];
    for (std::size_t i = 0; i < n; ++i) {
      DownBlockOptions d;
      d.in_channels = out;
      d.out_channels = out = ch[i];
      d.num_layers = c_.layers_per_block[i];
      d.resnet = rs;
      if (c_.down_block_types[i] == "CrossAttnDownBlock2D")
        d.attention = cross(i, c_.only_cross_attention[i]);
      d.add_downsample = i + 1 < n;
      d.downsample_padding = c_.downsample_padding;
      down_.push_back(DownBlock<Backend, Act>(d));
      down_blocks->push_back(down_.back());
    }
    if (c_.mid_block_type) {
      MidBlockOptions m;
      m.channels = ch.back();
      m.resnet = rs;
      m.resnet.output_scale_factor = c_.mid_block_scale_factor;
      if (*c_.mid_block_type == "UNetMidBlock2DCrossAttn") {
        // As diffusers: this mid block ignores (mid_block_)only_cross_attention.
        m.attention = cross(n - 1, false);
        m.num_layers = 1;
      } else {
        m.num_layers = 0;  // UNetMidBlock2D in a UNet2DConditionModel: one resnet, no attention
      }
      mid_block = register_module("mid_block", MidBlock<Backend, Act>(m));
    }
    out = ch.back();
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t r = n - 1 - i;  // the matching down block
      UpBlockOptions u;
      u.prev_output_channels = out;
      u.out_channels = out = ch[r];
      u.in_channels = ch[r == 0 ? 0 : r - 1];
      u.num_layers = c_.layers_per_block[r] + 1;
      u.resnet = rs;
      if (c_.up_block_types[i] == "CrossAttnUpBlock2D")
        u.attention = cross(r, c_.only_cross_attention[r]);
      u.add_upsample = i + 1 < n;
      up_.push_back(UpBlock<Backend, Act>(u));
      up_blocks->push_back(up_.back());
    }
    conv_norm_out = register_module(
        "conv_norm_out", GroupNorm(GroupNormOptions(c_.norm_num_groups, ch[0]).eps(c_.norm_eps)));
    conv_out =
        register_module("conv_out", Conv2d(Conv2dOptions(ch[0], c_.out_channels, c_.conv_out_kernel)
                                               .padding((c_.conv_out_kernel - 1) / 2)));
  }

  [[nodiscard]] const Config& config() const { return c_; }

  /// Gradient checkpointing of every resnet and transformer block (diffusers'
  /// enable_gradient_checkpointing): activations are recomputed in backward.
  void set_gradient_checkpointing(bool on) {
    for (auto& d : down_) d->set_checkpointing(on);
    if (mid_block) mid_block->set_checkpointing(on);
    for (auto& u : up_) u->set_checkpointing(on);
  }

  /// Every Transformer2DModel, in the order diffusers' attention processors are listed
  /// (down blocks, up blocks, mid block).
  [[nodiscard]] std::vector<std::pair<std::string, Transformer2DModel<Backend>>> transformers()
      const {
    std::vector<std::pair<std::string, Transformer2DModel<Backend>>> out;
    for (std::size_t i = 0; i < down_.size(); ++i)
      for (std::size_t k = 0; k < down_[i]->transformers().size(); ++k)
        out.emplace_back("down_blocks." + std::to_string(i) + ".attentions." + std::to_string(k),
                         down_[i]->transformers()[k]);
    for (std::size_t i = 0; i < up_.size(); ++i)
      for (std::size_t k = 0; k < up_[i]->transformers().size(); ++k)
        out.emplace_back("up_blocks." + std::to_string(i) + ".attentions." + std::to_string(k),
                         up_[i]->transformers()[k]);
    if (mid_block)
      for (std::size_t k = 0; k < mid_block->transformers().size(); ++k)
        out.emplace_back("mid_block.attentions." + std::to_string(k), mid_block->transformers()[k]);
    return out;
  }

  /// ε, v or x0 (as trained) for `sample` (B, in_channels, H, W) at `timestep` (a scalar or one
  /// per sample, integer or fractional), attending to `encoder_hidden_states` (B, L, D).
  at::Tensor forward(at::Tensor sample, const at::Tensor& timestep,
                     at::Tensor encoder_hidden_states = {}, const UNetConditions& cond = {}) {
    const std::string where = "UNet2DConditionModel";
    if (sample.dim() != 4 || sample.size(1) != c_.in_channels)
      throw ShapeError("sample must be (B, " + std::to_string(c_.in_channels) + ", H, W), got " +
                           c10::str(sample.sizes()),
                       where);
    const std::int64_t batch = sample.size(0);
    if (!timestep.defined() || timestep.dim() > 1 ||
        (timestep.dim() == 1 && timestep.size(0) != batch && timestep.size(0) != 1))
      throw ShapeError("timestep must be a scalar or (B,) = (" + std::to_string(batch) + "), got " +
                           (timestep.defined() ? c10::str(timestep.sizes()) : "none"),
                       where);
    if (needs_context_) {
      const std::int64_t d =
          c_.encoder_hid_dim ? *c_.encoder_hid_dim : c_.cross_attention_dim.front();
      if (!encoder_hidden_states.defined() || encoder_hidden_states.dim() != 3 ||
          encoder_hidden_states.size(0) != batch)
        throw ShapeError(
            "encoder_hidden_states must be (" + std::to_string(batch) + ", L, " +
                std::to_string(d) + "), got " +
                (encoder_hidden_states.defined() ? c10::str(encoder_hidden_states.sizes())
                                                 : std::string("none")),
            where);
    }
    // With sizes that do not halve evenly down to the last block, each upsampler is told the
    // size of its skip instead of doubling.
    const std::int64_t factor = std::int64_t{1} << (up_.size() - 1);
    const bool forward_upsample_size = sample.size(2) % factor != 0 || sample.size(3) % factor != 0;

    if (c_.center_input_sample) sample = 2 * sample - 1.0;
    const at::Tensor t = timestep.to(sample.device()).reshape({-1}).expand({batch});
    at::Tensor emb = time_embedding->forward(
        timestep_embedding(t, c_.block_out_channels[0], c_.flip_sin_to_cos, c_.freq_shift)
            .to(sample.scalar_type()),
        cond.timestep_cond);
    if (at::Tensor class_emb = class_embed(sample, cond.class_labels); class_emb.defined())
      emb = c_.class_embeddings_concat ? at::cat({emb, class_emb}, -1) : emb + class_emb;
    if (add_embedding) emb = emb + added_embed(cond, batch, emb.scalar_type());
    if (c_.time_embedding_act_fn)
      emb = apply_activation(*diffusers_activation(*c_.time_embedding_act_fn), emb);
    if (encoder_hid_proj) encoder_hidden_states = encoder_hid_proj->forward(encoder_hidden_states);
    const at::Tensor mask = context_bias(cond.encoder_attention_mask, encoder_hidden_states, batch,
                                         sample.scalar_type());

    at::Tensor h = conv_in->forward(sample);
    std::vector<at::Tensor> skips{h};
    // Each block is a unit (nn/unit_scope.hpp); a down block's outputs include its skips.
    for (auto& d : down_) {
      const std::size_t before = skips.size();
      h = nn::in_unit(*d, [&] {
            at::Tensor out = d->forward(h, emb, encoder_hidden_states, &skips, mask);
            return std::make_pair(
                out, std::vector<at::Tensor>(skips.begin() + static_cast<std::ptrdiff_t>(before),
                                             skips.end()));
          }).first;
    }
    if (mid_block)
      h = nn::in_unit(*mid_block,
                      [&] { return mid_block->forward(h, emb, encoder_hidden_states, mask); });
    for (std::size_t i = 0; i < up_.size(); ++i) {
      std::optional<std::vector<std::int64_t>> size;
      const std::size_t take = up_[i]->num_resnets();
      if (i + 1 < up_.size() && forward_upsample_size)
        size = skips[skips.size() - take - 1].sizes().slice(2).vec();
      h = nn::in_unit(*up_[i], [&] {
        return up_[i]->forward(h, emb, encoder_hidden_states, &skips, size, mask);
      });
    }
    h = Act::forward(conv_norm_out->forward(h), typename Act::Options{});
    return conv_out->forward(h);
  }

  /// A ShapeError unless every label lies in [0, num_class_embeds) (a model without a class
  /// table accepts any). forward does it for labels on the CPU; call it where labels for a GPU are
  /// made (once per batch, before they move) to get the typed error there too: on the GPU a bad
  /// label stops the device with the embedding's assert instead.
  void check_class_labels(const at::Tensor& labels) const {
    if (!c_.num_class_embeds || !labels.defined() || labels.numel() == 0) return;
    // One read-back of both ends, not one per end.
    const auto [lo_t, hi_t] = at::aminmax(labels);
    const at::Tensor ends = at::stack({lo_t, hi_t}).to(at::kCPU, at::kLong);
    const std::int64_t lo = ends[0].item<std::int64_t>(), hi = ends[1].item<std::int64_t>();
    if (lo < 0 || hi >= *c_.num_class_embeds)
      throw ShapeError("class_labels must lie in [0, " + std::to_string(*c_.num_class_embeds) +
                           "); got " + std::to_string(lo) + " to " + std::to_string(hi),
                       "UNet2DConditionModel");
  }

  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  TimestepEmbedding<Act> time_embedding{nullptr};
  torch::nn::Linear encoder_hid_proj{nullptr};
  torch::nn::Embedding class_embedding{nullptr};
  TimestepEmbedding<nn::activation::SiLU> add_embedding{nullptr};
  torch::nn::ModuleList down_blocks{nullptr}, up_blocks{nullptr};
  MidBlock<Backend, Act> mid_block{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};

 private:
  /// diffusers' (1 − mask) · −10000 in the sample's dtype, checked against the context.
  at::Tensor context_bias(const at::Tensor& mask, const at::Tensor& context, std::int64_t batch,
                          at::ScalarType dtype) const {
    if (!mask.defined()) return {};
    const std::string where = "UNet2DConditionModel";
    if (!needs_context_)
      throw ShapeError("encoder_attention_mask given to a UNet without cross-attention", where);
    if (mask.dim() != 2 || mask.size(0) != batch || mask.size(1) != context.size(1))
      throw ShapeError("encoder_attention_mask must be (B, L) = (" + std::to_string(batch) + ", " +
                           std::to_string(context.size(1)) + ") for encoder_hidden_states " +
                           c10::str(context.sizes()) + ", got " + c10::str(mask.sizes()),
                       where);
    return (1.0 - mask.to(context.device(), dtype)) * -10000.0;
  }

  /// SDXL's added embedding: add_embedding(cat(text_embeds, sinusoidal(time_ids))).
  at::Tensor added_embed(const UNetConditions& cond, std::int64_t batch, at::ScalarType dtype) {
    const std::string where = "UNet2DConditionModel";
    const at::Tensor& text = cond.text_embeds;
    const at::Tensor& ids = cond.time_ids;
    if (!text.defined() || !ids.defined())
      throw ShapeError(
          "this UNet has SDXL's added conditions (addition_embed_type \"text_time\"): pass "
          "text_embeds and time_ids",
          where);
    const std::int64_t width = *c_.projection_class_embeddings_input_dim;
    const std::int64_t per_id = *c_.addition_time_embed_dim;
    if (text.dim() != 2 || text.size(0) != batch || ids.dim() != 2 || ids.size(0) != batch ||
        text.size(1) + ids.size(1) * per_id != width)
      throw ShapeError("text_embeds " + c10::str(text.sizes()) + " and time_ids " +
                           c10::str(ids.sizes()) + " must be (B, D) and (B, K) with B = " +
                           std::to_string(batch) + " and D + K·" + std::to_string(per_id) +
                           " = projection_class_embeddings_input_dim " + std::to_string(width),
                       where);
    const at::Tensor time_embeds =
        timestep_embedding(ids.flatten(), per_id, c_.flip_sin_to_cos, c_.freq_shift)
            .reshape({batch, -1});
    // cat promotes as torch.concat does (float32 time embedding, maybe half text embeds).
    return add_embedding->forward(at::cat({text, time_embeds}, -1).to(dtype));
  }

  at::Tensor class_embed(const at::Tensor& sample, const at::Tensor& labels) {
    const bool has = class_embedding || class_timestep_ || class_projection_ || class_linear_ ||
                     c_.class_embed_type == "identity";
    if (!has) return {};
    const std::string where = "UNet2DConditionModel";
    if (!labels.defined())
      throw ShapeError(
          "this UNet is class-conditional (" +
              (c_.class_embed_type ? "class_embed_type \"" + *c_.class_embed_type + "\""
                                   : "num_class_embeds " + std::to_string(*c_.num_class_embeds)) +
              "): pass class_labels",
          where);
    if (labels.size(0) != sample.size(0))
      throw ShapeError("class_labels has " + std::to_string(labels.size(0)) +
                           " rows for a batch of " + std::to_string(sample.size(0)),
                       where);
    if (class_embedding) {
      if (at::isFloatingType(labels.scalar_type()))
        throw ShapeError("class_labels must be integer labels for num_class_embeds", where);
      // Labels on the CPU are range-checked here (a scan, no device wait). On a GPU the check
      // would wait for the device every forward: there the embedding's own device-side assert
      // stops a bad label, and check_class_labels does the typed check where the labels are made.
      if (labels.device().is_cpu()) check_class_labels(labels);
      return class_embedding->forward(labels.to(at::kLong)).to(sample.scalar_type());
    }
    if (class_timestep_)
      return class_timestep_
          ->forward(timestep_embedding(labels.reshape({-1}), c_.block_out_channels[0],
                                       c_.flip_sin_to_cos, c_.freq_shift)
                        .to(sample.scalar_type()))
          .to(sample.scalar_type());
    if (class_projection_) return class_projection_->forward(labels).to(sample.scalar_type());
    if (class_linear_) return class_linear_->forward(labels).to(sample.scalar_type());
    return labels.to(sample.scalar_type());  // identity
  }

  Config c_;
  bool needs_context_ = false;  // some block cross-attends: encoder_hidden_states are required
  TimestepEmbedding<Act> class_timestep_{nullptr};
  TimestepEmbedding<nn::activation::SiLU> class_projection_{nullptr};
  torch::nn::Linear class_linear_{nullptr};
  std::vector<DownBlock<Backend, Act>> down_;
  std::vector<UpBlock<Backend, Act>> up_;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>,
          nn::ElementwiseActivation Act = nn::activation::SiLU>
using UNet2DConditionModel = torch::nn::ModuleHolder<UNet2DConditionModelImpl<Backend, Act>>;

}  // namespace difftrain::models
