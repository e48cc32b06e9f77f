#pragma once
// diffusers' CogVideoXTransformer3DModel (CogVideoX 1.0 and 1.5's video transformer), built from
// its config.json with diffusers' parameter names:
//
//   patch_embed: text_proj (the text states to the inner width) and proj — per frame a p×p
//     convolution (1.0), or a linear map of p_t×p×p patches across frames (1.5, `patch_size_t`);
//     text and video tokens are one sequence [text; video]. CogVideoX-2B adds the fixed 3-D
//     sine-cosine table (zero over the text positions, so the text must be exactly
//     max_text_seq_length long); the 5B models instead rotate each head's video queries and keys
//     by 3-D rotary embeddings (get_3d_rotary_pos_embed, computed here as diffusers' pipelines
//     compute them, or passed in); the I2V 5B model has both, its table learned and saved.
//   time_proj + time_embedding (and ofs_proj + ofs_embedding for CogVideoX 1.5 I2V)
//   transformer_blocks.N (CogVideoXBlock): the "expert" adaptive norms — norm1/norm2
//     (CogVideoXLayerNormZero) give the video and the text tokens each their own shift, scale and
//     gate from one linear — then one attention over both (qk layer norm per head) and one
//     feed-forward over both.
//   norm_final → norm_out (AdaLayerNorm: shift, then scale) → proj_out → unpatchify.
//
// Latents are (B, F, C, H, W) as diffusers' pipelines hold them: frames before channels.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
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

struct CogVideoXTransformer3DConfig {
  static constexpr std::string_view class_name = "CogVideoXTransformer3DModel";

  std::int64_t num_attention_heads = 30;
  std::int64_t attention_head_dim = 64;
  std::int64_t in_channels = 16;
  std::int64_t out_channels = 16;
  bool flip_sin_to_cos = true;
  std::int64_t freq_shift = 0;
  std::int64_t time_embed_dim = 512;
  std::optional<std::int64_t> ofs_embed_dim;  // CogVideoX 1.5 I2V
  std::int64_t text_embed_dim = 4096;
  std::int64_t num_layers = 30;
  double dropout = 0.0;
  bool attention_bias = true;
  std::int64_t sample_width = 90;
  std::int64_t sample_height = 60;
  std::int64_t sample_frames = 49;  // in pixel frames: (latent frames − 1) · compression + 1
  std::int64_t patch_size = 2;
  std::optional<std::int64_t> patch_size_t;  // CogVideoX 1.5: patches across frames too
  std::int64_t temporal_compression_ratio = 4;
  std::int64_t max_text_seq_length = 226;
  std::string activation_fn = "gelu-approximate";
  std::string timestep_activation_fn = "silu";
  bool norm_elementwise_affine = true;
  double norm_eps = 1e-5;
  double spatial_interpolation_scale = 1.875;
  double temporal_interpolation_scale = 1.0;
  bool use_rotary_positional_embeddings = false;
  bool use_learned_positional_embeddings = false;
  bool patch_bias = true;  // the 1.0 convolution's bias (1.5's linear always has one)

  [[nodiscard]] std::int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  [[nodiscard]] std::int64_t frame_patch() const { return patch_size_t.value_or(1); }
  /// The width of one output token: the channels of one patch.
  [[nodiscard]] std::int64_t patch_values() const {
    return patch_size * patch_size * frame_patch() * out_channels;
  }
  /// Whether the patch embedding adds a position table to the tokens: the fixed one without rotary
  /// embeddings (CogVideoX-2B), the learned one beside them (CogVideoX-5B-I2V).
  [[nodiscard]] bool position_table() const {
    return !use_rotary_positional_embeddings || use_learned_positional_embeddings;
  }
  /// The latent grid the config was made for: frames, rows, columns of patches.
  [[nodiscard]] std::int64_t base_latent_frames() const {
    return (sample_frames - 1) / temporal_compression_ratio + 1;
  }

  void validate(const std::string& where) const {
    using L = ConfigLimits;
    check_config_range("num_attention_heads", num_attention_heads, 1, L::channels, where);
    check_config_range("attention_head_dim", attention_head_dim, 1, L::channels, where);
    check_config_range("in_channels", in_channels, 1, L::channels, where);
    check_config_range("out_channels", out_channels, 1, L::channels, where);
    check_config_range("time_embed_dim", time_embed_dim, 1, L::channels, where);
    check_config_range("ofs_embed_dim", ofs_embed_dim, 1, L::channels, where);
    check_config_range("text_embed_dim", text_embed_dim, 1, L::channels, where);
    check_config_range("num_layers", num_layers, 1, L::layers, where);
    check_config_range("sample_width", sample_width, 1, L::spatial, where);
    check_config_range("sample_height", sample_height, 1, L::spatial, where);
    check_config_range("sample_frames", sample_frames, 1, L::spatial, where);
    check_config_range("patch_size", patch_size, 1, L::spatial, where);
    check_config_range("patch_size_t", patch_size_t, 1, L::spatial, where);
    check_config_range("temporal_compression_ratio", temporal_compression_ratio, 1, L::spatial,
                       where);
    check_config_range("max_text_seq_length", max_text_seq_length, 0, L::spatial, where);
    check_config_range("freq_shift", freq_shift, -L::spatial, L::spatial, where);
    if (!(dropout >= 0.0 && dropout < 1.0))
      throw ConfigError("'dropout' = " + std::to_string(dropout) + " must be in [0, 1)", where);
    if (!(norm_eps > 0.0)) throw ConfigError("'norm_eps' must be positive", where);
    if (!(spatial_interpolation_scale > 0.0) || !(temporal_interpolation_scale > 0.0))
      throw ConfigError("the interpolation scales must be positive", where);
    if (timestep_activation_fn != "silu" && timestep_activation_fn != "swish")
      throw ConfigError("'timestep_activation_fn' = \"" + timestep_activation_fn +
                            "\" is not supported (\"silu\", what every CogVideoX uses)",
                        where);
    if (!feed_forward_activation(activation_fn))
      throw ConfigError("'activation_fn' = \"" + activation_fn +
                            "\" is not a feed-forward activation diffusers has",
                        where);
    if (inner_dim() > L::channels)
      throw ConfigError(
          "num_attention_heads × attention_head_dim = " + std::to_string(inner_dim()) +
              " is larger than " + std::to_string(L::channels),
          where);
    if (use_learned_positional_embeddings && !use_rotary_positional_embeddings)
      throw ConfigError(
          "'use_learned_positional_embeddings' is true but 'use_rotary_positional_embeddings' is "
          "false: diffusers refuses the pair (the learned table exists only beside rotary "
          "embeddings, in CogVideoX-5B-I2V)",
          where);
    if (patch_size_t && position_table())
      throw ConfigError(
          "'patch_size_t' is set with a position table (rotary embeddings off or a "
          "learned table): diffusers' 3-D table does not cover frame patches (every "
          "CogVideoX 1.5 config uses rotary embeddings alone)",
          where);
    if (ofs_embed_dim && *ofs_embed_dim != time_embed_dim)
      throw ConfigError("'ofs_embed_dim' " + std::to_string(*ofs_embed_dim) +
                            " must equal 'time_embed_dim' " + std::to_string(time_embed_dim) +
                            " (the two embeddings are added)",
                        where);
    if (position_table() && inner_dim() % 16 != 0)
      throw ConfigError("the inner width " + std::to_string(inner_dim()) +
                            " must be a multiple of 16 for the 3-D sine-cosine table (a quarter "
                            "for time, three eighths for each spatial axis, each of sines and "
                            "cosines)",
                        where);
    if (use_rotary_positional_embeddings && attention_head_dim % 16 != 0)
      throw ConfigError("'attention_head_dim' " + std::to_string(attention_head_dim) +
                            " must be a multiple of 16 for the 3-D rotary embeddings (a quarter "
                            "for time, three eighths for each spatial axis, in pairs)",
                        where);
    if (sample_height < patch_size || sample_width < patch_size)
      throw ConfigError("'sample_height' or 'sample_width' is smaller than one patch", where);
  }

  [[nodiscard]] WeightSignature weight_signature() const {
    WeightSignature s;
    const std::int64_t d = inner_dim();
    if (patch_size_t)
      s.shapes.push_back(
          {"patch_embed.proj.weight", {d, in_channels * patch_size * patch_size * *patch_size_t}});
    else
      s.shapes.push_back({"patch_embed.proj.weight", {d, in_channels, patch_size, patch_size}});
    s.shapes.push_back({"patch_embed.text_proj.weight", {d, text_embed_dim}});
    s.shapes.push_back({"proj_out.weight", {patch_values(), d}});
    s.counts.push_back({"transformer_blocks.", num_layers});
    return s;
  }

  /// The fields read and written as they are (the others have rules of their own).
  static constexpr auto fields() {
    using C = CogVideoXTransformer3DConfig;
    return std::tuple{
        config_field("num_attention_heads", &C::num_attention_heads),
        config_field("attention_head_dim", &C::attention_head_dim),
        config_field("in_channels", &C::in_channels),
        config_field("out_channels", &C::out_channels),
        config_field("flip_sin_to_cos", &C::flip_sin_to_cos),
        config_field("freq_shift", &C::freq_shift),
        config_field("time_embed_dim", &C::time_embed_dim),
        config_field("ofs_embed_dim", &C::ofs_embed_dim),
        config_field("text_embed_dim", &C::text_embed_dim),
        config_field("num_layers", &C::num_layers),
        config_field("dropout", &C::dropout),
        config_field("attention_bias", &C::attention_bias),
        config_field("sample_width", &C::sample_width),
        config_field("sample_height", &C::sample_height),
        config_field("sample_frames", &C::sample_frames),
        config_field("patch_size", &C::patch_size),
        config_field("patch_size_t", &C::patch_size_t),
        config_field("temporal_compression_ratio", &C::temporal_compression_ratio),
        config_field("max_text_seq_length", &C::max_text_seq_length),
        config_field("activation_fn", &C::activation_fn),
        config_field("timestep_activation_fn", &C::timestep_activation_fn),
        config_field("norm_elementwise_affine", &C::norm_elementwise_affine),
        config_field("norm_eps", &C::norm_eps),
        config_field("spatial_interpolation_scale", &C::spatial_interpolation_scale),
        config_field("temporal_interpolation_scale", &C::temporal_interpolation_scale),
        config_field("use_rotary_positional_embeddings", &C::use_rotary_positional_embeddings),
        config_field("use_learned_positional_embeddings", &C::use_learned_positional_embeddings),
        config_field("patch_bias", &C::patch_bias)};
  }

  static CogVideoXTransformer3DConfig from_json(const nlohmann::json& j, const std::string& where) {
    ConfigReader r(j, where);
    CogVideoXTransformer3DConfig c;
    read_fields(r, c, fields());
    r.accept("out_channels");
    if (j.contains("out_channels") && j["out_channels"].is_null())
      throw ConfigError("'out_channels' = null: diffusers needs it to size proj_out", where);
    if (c.ofs_embed_dim == 0) c.ofs_embed_dim.reset();  // diffusers tests it for truth
    r.finish();
    c.validate(where);
    return c;
  }

  /// The file from_pretrained read this config from (see ConfigAsRead).
  ConfigAsRead as_read{};

  [[nodiscard]] nlohmann::json to_json() const {
    nlohmann::json j = diffusers_config_json<CogVideoXTransformer3DConfig>();
    write_fields(j, *this, fields());
    return j;
  }
};

/// get_3d_sincos_pos_embed(embed_dim, (grid_w, grid_h), frames, spatial and temporal
/// interpolation scales): (frames·grid_h·grid_w, embed_dim) float64, frame-major, as diffusers
/// computes it (float32 positions, float64 frequencies, sines and cosines; a float32 model uses
/// the table rounded to float32, a float64 model the table itself). Each vector is
/// the frame's 1-D table (a quarter of the width) then the 2-D table of its position in the frame
/// (three quarters); positions are arange(n) / scale.
inline at::Tensor sincos_3d_pos_embed(std::int64_t embed_dim, std::int64_t frames,
                                      std::int64_t grid_h, std::int64_t grid_w,
                                      double spatial_scale, double temporal_scale,
                                      at::Device device = at::kCPU) {
  if (embed_dim <= 0 || embed_dim % 16 != 0)
    throw ConfigError(
        "the embedding width " + std::to_string(embed_dim) + " must be a positive multiple of 16",
        "sincos_3d_pos_embed");
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const at::Tensor spatial =
      sincos_2d_pos_embed_from_positions(embed_dim / 4 * 3, at::arange(grid_h, f32) / spatial_scale,
                                         at::arange(grid_w, f32) / spatial_scale,
                                         at::kDouble);  // (h·w, 3D/4)
  const at::Tensor temporal = sincos_1d_pos_embed(
      embed_dim / 4, at::arange(frames, f32) / temporal_scale, at::kDouble);  // (F, D/4)
  const std::int64_t n = grid_h * grid_w;
  return at::cat({temporal.unsqueeze(1).expand({frames, n, embed_dim / 4}),
                  spatial.unsqueeze(0).expand({frames, n, embed_dim / 4 * 3})},
                 -1)
      .reshape({frames * n, embed_dim});
}

/// get_1d_rotary_pos_embed(dim, positions, use_real, repeat_interleave_real): the cosines and sines
/// of positions · θ^(−2i/dim), each repeated for the pair it rotates: (N, dim) float32 each.
inline std::pair<at::Tensor, at::Tensor> rotary_1d(std::int64_t dim, const at::Tensor& positions,
                                                   double theta = 10000.0) {
  const at::Tensor freqs =
      1.0 / at::pow(theta, at::arange(0, dim, 2, positions.options().dtype(at::kFloat)) /
                               static_cast<double>(dim));
  const at::Tensor angles = at::outer(positions.to(at::kFloat), freqs);
  return {angles.cos().repeat_interleave(2, 1), angles.sin().repeat_interleave(2, 1)};
}

/// get_3d_rotary_pos_embed for (frames × grid_h × grid_w) video tokens, each head's width split
/// into a quarter for time and three eighths for each spatial axis. `rows` and `cols` are the
/// spatial positions and `times` the temporal ones (see CogVideoXTransformer3DModel::
/// rotary_embedding for how diffusers' pipelines choose them). (cos, sin), each
/// (frames·grid_h·grid_w, head_dim).
inline std::pair<at::Tensor, at::Tensor> rotary_3d(std::int64_t head_dim, const at::Tensor& times,
                                                   const at::Tensor& rows, const at::Tensor& cols) {
  const std::int64_t f = times.numel(), h = rows.numel(), w = cols.numel();
  const std::int64_t dim_t = head_dim / 4, dim_hw = head_dim / 8 * 3;
  const auto [t_cos, t_sin] = rotary_1d(dim_t, times);
  const auto [h_cos, h_sin] = rotary_1d(dim_hw, rows);
  const auto [w_cos, w_sin] = rotary_1d(dim_hw, cols);
  auto combine = [&](const at::Tensor& t, const at::Tensor& r, const at::Tensor& c) {
    return at::cat({t.view({f, 1, 1, dim_t}).expand({f, h, w, dim_t}),
                    r.view({1, h, 1, dim_hw}).expand({f, h, w, dim_hw}),
                    c.view({1, 1, w, dim_hw}).expand({f, h, w, dim_hw})},
                   -1)
        .reshape({f * h * w, -1});
  };
  return {combine(t_cos, h_cos, w_cos), combine(t_sin, h_sin, w_sin)};
}

/// apply_rotary_emb with real (cos, sin) tables (S, D) on x (B, heads, S, D): each pair
/// (x₂ᵢ, x₂ᵢ₊₁) rotated, computed in float32 and returned in x's dtype.
inline at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto pairs = x.reshape({x.size(0), x.size(1), x.size(2), -1, 2}).unbind(-1);
  const at::Tensor rotated = at::stack({-pairs[1], pairs[0]}, -1).flatten(3);
  return (x.to(at::kFloat) * cos + rotated.to(at::kFloat) * sin).to(x.scalar_type());
}

/// diffusers' CogVideoXLayerNormZero: one linear of the conditioning gives shift, scale and gate
/// for the video tokens and another three for the text tokens; both go through the same norm.
class CogVideoXLayerNormZeroImpl : public torch::nn::Module {
 public:
  CogVideoXLayerNormZeroImpl(std::int64_t conditioning_dim, std::int64_t dim, bool affine,
                             double eps) {
    linear = register_module("linear", torch::nn::Linear(conditioning_dim, 6 * dim));
    norm = register_module(
        "norm", torch::nn::LayerNorm(
                    torch::nn::LayerNormOptions({dim}).elementwise_affine(affine).eps(eps)));
  }
  struct Result {
    at::Tensor video, text, gate, text_gate;  // gates (B, 1, D)
  };
  Result forward(const at::Tensor& video, const at::Tensor& text, const at::Tensor& temb) {
    const auto m = linear->forward(at::silu(temb)).chunk(6, 1);
    auto mod = [](const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale) {
      return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
    };
    return {mod(norm->forward(video), m[0], m[1]), mod(norm->forward(text), m[3], m[4]),
            m[2].unsqueeze(1), m[5].unsqueeze(1)};
  }
  torch::nn::Linear linear{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(CogVideoXLayerNormZero);

/// diffusers' Attention with CogVideoXAttnProcessor2_0: self-attention over [text; video] with a
/// layer norm (eps 1e-6) on every head's queries and keys and, when given, rotary embeddings on
/// the video part of both. The projections can carry LoRA branches (diffusers' names).
template <nn::attention::AttentionBackend Backend>
class CogVideoXAttentionImpl : public torch::nn::Module {
 public:
  CogVideoXAttentionImpl(std::int64_t dim, std::int64_t heads, std::int64_t head_dim, bool bias)
      : heads_(heads), head_dim_(head_dim) {
    const std::int64_t inner = heads * head_dim;
    auto linear = [](std::int64_t in, std::int64_t out, bool b) {
      return nn::AdaptableLinear(torch::nn::LinearOptions(in, out).bias(b));
    };
    to_q = register_module("to_q", linear(dim, inner, bias));
    to_k = register_module("to_k", linear(dim, inner, bias));
    to_v = register_module("to_v", linear(dim, inner, bias));
    auto qk_norm = [head_dim] {
      return torch::nn::LayerNorm(torch::nn::LayerNormOptions({head_dim}).eps(1e-6));
    };
    norm_q = register_module("norm_q", qk_norm());
    norm_k = register_module("norm_k", qk_norm());
    to_out = register_module(
        "to_out", torch::nn::Sequential(linear(inner, dim, true), torch::nn::Dropout(0.0)));
  }

  /// x = [text; video] (B, L + N, dim); `cos`/`sin` (N, head_dim) or undefined.
  at::Tensor forward(const at::Tensor& x, std::int64_t text_length, const at::Tensor& cos,
                     const at::Tensor& sin) {
    auto heads = [&](const at::Tensor& t) {
      return t.view({t.size(0), t.size(1), heads_, head_dim_}).transpose(1, 2);
    };
    at::Tensor q = norm_q->forward(heads(to_q->forward(x)));
    at::Tensor k = norm_k->forward(heads(to_k->forward(x)));
    const at::Tensor v = heads(to_v->forward(x));
    if (cos.defined()) {
      auto rotate = [&](const at::Tensor& t) {
        return at::cat(
            {t.slice(2, 0, text_length), apply_rotary(t.slice(2, text_length), cos, sin)}, 2);
      };
      q = rotate(q);
      k = rotate(k);
    }
    // Under autocast the layer norms give float32 queries and keys beside lower-precision values;
    // diffusers' SDPA call is cast to the autocast dtype by autocast itself, here explicitly.
    q = q.to(v.scalar_type());
    k = k.to(v.scalar_type());
    nn::attention::AttentionArgs args;
    const at::Tensor out = Backend::forward(q, k, v, args);
    return to_out->forward(out.transpose(1, 2).reshape({x.size(0), -1, heads_ * head_dim_}));
  }

  nn::AdaptableLinear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::LayerNorm norm_q{nullptr}, norm_k{nullptr};
  torch::nn::Sequential to_out{nullptr};

 private:
  std::int64_t heads_, head_dim_;
};
template <nn::attention::AttentionBackend Backend>
using CogVideoXAttention = torch::nn::ModuleHolder<CogVideoXAttentionImpl<Backend>>;

/// diffusers' CogVideoXBlock.
template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
class CogVideoXBlockImpl : public torch::nn::Module {
 public:
  CogVideoXBlockImpl(const CogVideoXTransformer3DConfig& c, bool gated) {
    const std::int64_t d = c.inner_dim();
    norm1 = register_module("norm1", CogVideoXLayerNormZero(c.time_embed_dim, d,
                                                            c.norm_elementwise_affine, c.norm_eps));
    attn1 = register_module(
        "attn1", CogVideoXAttention<Backend>(d, c.num_attention_heads, c.attention_head_dim,
                                             c.attention_bias));
    norm2 = register_module("norm2", CogVideoXLayerNormZero(c.time_embed_dim, d,
                                                            c.norm_elementwise_affine, c.norm_eps));
    FeedForwardOptions f;
    f.dim = d;
    f.gated = gated;
    f.dropout = c.dropout;
    f.final_dropout = true;
    ff = register_module("ff", FeedForward<Act>(f));
  }

  /// (video, text) after the block; `cos`/`sin` undefined without rotary embeddings.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& video, const at::Tensor& text,
                                            const at::Tensor& temb, const at::Tensor& cos,
                                            const at::Tensor& sin) {
    const std::int64_t l = text.size(1);
    auto n1 = norm1->forward(video, text, temb);
    const at::Tensor a = attn1->forward(at::cat({n1.text, n1.video}, 1), l, cos, sin);
    const at::Tensor v = video + n1.gate * a.slice(1, l);
    const at::Tensor t = text + n1.text_gate * a.slice(1, 0, l);
    auto n2 = norm2->forward(v, t, temb);
    const at::Tensor f = ff->forward(at::cat({n2.text, n2.video}, 1));
    return {v + n2.gate * f.slice(1, l), t + n2.text_gate * f.slice(1, 0, l)};
  }

  CogVideoXLayerNormZero norm1{nullptr}, norm2{nullptr};
  CogVideoXAttention<Backend> attn1{nullptr};
  FeedForward<Act> ff{nullptr};
};
template <nn::attention::AttentionBackend Backend, nn::ElementwiseActivation Act>
using CogVideoXBlock = torch::nn::ModuleHolder<CogVideoXBlockImpl<Backend, Act>>;

/// diffusers' CogVideoXPatchEmbed: text_proj of the text, proj of the video patches, the two
/// concatenated, plus the position table where the config has one.
class CogVideoXPatchEmbedImpl : public torch::nn::Module {
 public:
  explicit CogVideoXPatchEmbedImpl(const CogVideoXTransformer3DConfig& c) : c_(c) {
    const std::int64_t d = c.inner_dim();
    if (c.patch_size_t)
      proj_linear = register_module(
          "proj",
          torch::nn::Linear(c.in_channels * c.patch_size * c.patch_size * *c.patch_size_t, d));
    else
      proj_conv = register_module(
          "proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(c.in_channels, d, c.patch_size)
                                        .stride(c.patch_size)
                                        .bias(c.patch_bias)));
    text_proj = register_module("text_proj", torch::nn::Linear(c.text_embed_dim, d));
    // The I2V model's learned table is saved; the fixed one is recomputed for every input size.
    if (c.use_learned_positional_embeddings)
      pos_embedding = register_buffer(
          "pos_embedding", table(c.sample_height / c.patch_size, c.sample_width / c.patch_size,
                                 c.base_latent_frames(), at::kCPU));
  }

  /// (B, L + N, D): [text_proj(text); proj(video patches)] + the position table.
  at::Tensor forward(const at::Tensor& text, const at::Tensor& video) {
    const std::int64_t b = video.size(0), f = video.size(1), ch = video.size(2), hh = video.size(3),
                       ww = video.size(4), p = c_.patch_size;
    at::Tensor tokens;
    if (proj_conv) {
      tokens = proj_conv->forward(video.reshape({b * f, ch, hh, ww}));
      tokens = tokens.view({b, f, tokens.size(1), -1}).transpose(2, 3).flatten(1, 2);
    } else {
      const std::int64_t pt = *c_.patch_size_t;
      tokens = video.permute({0, 1, 3, 4, 2})
                   .reshape({b, f / pt, pt, hh / p, p, ww / p, p, ch})
                   .permute({0, 1, 3, 5, 7, 2, 4, 6})
                   .flatten(4, 7)
                   .flatten(1, 3);
      tokens = proj_linear->forward(tokens);
    }
    at::Tensor embeds = at::cat({text_proj->forward(text), tokens}, 1).contiguous();
    if (!c_.position_table()) return embeds;
    const std::int64_t gh = hh / p, gw = ww / p;
    at::Tensor pos;
    if (c_.use_learned_positional_embeddings &&
        (f - 1) * c_.temporal_compression_ratio + 1 == c_.sample_frames)
      pos = pos_embedding;  // its size was checked against the config by the model
    else
      pos = table(gh, gw, f, video.device(),
                  embeds.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
    return embeds + pos.to(embeds.device(), embeds.scalar_type());
  }

  torch::nn::Conv2d proj_conv{nullptr};
  torch::nn::Linear proj_linear{nullptr};
  torch::nn::Linear text_proj{nullptr};
  at::Tensor pos_embedding;

 private:
  /// (1, max_text_seq_length + F·h·w, D): zeros over the text, the 3-D table over the video.
  at::Tensor table(std::int64_t grid_h, std::int64_t grid_w, std::int64_t frames, at::Device device,
                   at::ScalarType dtype = at::kFloat) {
    if (cached_.defined() && cached_.device() == device && cached_.scalar_type() == dtype &&
        cached_key_ == std::tuple(grid_h, grid_w, frames))
      return cached_;
    const at::Tensor video =
        sincos_3d_pos_embed(c_.inner_dim(), frames, grid_h, grid_w, c_.spatial_interpolation_scale,
                            c_.temporal_interpolation_scale, device);
    cached_ = at::cat({at::zeros({c_.max_text_seq_length, c_.inner_dim()}, video.options()), video})
                  .unsqueeze(0)
                  .to(dtype);
    cached_key_ = {grid_h, grid_w, frames};
    return cached_;
  }

  CogVideoXTransformer3DConfig c_;
  at::Tensor cached_;
  std::tuple<std::int64_t, std::int64_t, std::int64_t> cached_key_{};
};
TORCH_MODULE(CogVideoXPatchEmbed);

/// diffusers' AdaLayerNorm with chunk_dim 1: linear(silu(temb)) gives shift, then scale.
class CogVideoXAdaLayerNormImpl : public torch::nn::Module {
 public:
  CogVideoXAdaLayerNormImpl(std::int64_t embedding_dim, std::int64_t dim, bool affine, double eps) {
    linear = register_module("linear", torch::nn::Linear(embedding_dim, 2 * dim));
    norm = register_module(
        "norm", torch::nn::LayerNorm(
                    torch::nn::LayerNormOptions({dim}).elementwise_affine(affine).eps(eps)));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& temb) {
    const auto m = linear->forward(at::silu(temb)).chunk(2, 1);
    return norm->forward(x) * (1 + m[1].unsqueeze(1)) + m[0].unsqueeze(1);
  }
  torch::nn::Linear linear{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(CogVideoXAdaLayerNorm);

/// What CogVideoXTransformer3DModel takes besides the latents, the text and the timesteps.
struct CogVideoXConditions {
  /// CogVideoX 1.5 I2V's "ofs" (its pipeline passes 2.0): one value or (B,); required exactly
  /// when the config has ofs_embed_dim.
  at::Tensor ofs{};
  /// Rotary tables (cos, sin), each (F'·h·w, attention_head_dim), for configs with rotary
  /// embeddings; computed by rotary_embedding() for the input's size when not given.
  at::Tensor rotary_cos{}, rotary_sin{};
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>,
          nn::ElementwiseActivation Act = nn::activation::GELUTanh>
class CogVideoXTransformer3DModelImpl : public torch::nn::Module {
 public:
  using Config = CogVideoXTransformer3DConfig;

  explicit CogVideoXTransformer3DModelImpl(Config config,
                                           const std::string& where = "CogVideoXTransformer3DModel")
      : c_(std::move(config)) {
    c_.validate(where);
    const bool gated = check_feed_forward_activation<Act>(c_.activation_fn, where);
    const std::int64_t d = c_.inner_dim();
    patch_embed = register_module("patch_embed", CogVideoXPatchEmbed(c_));
    embedding_dropout = register_module("embedding_dropout", torch::nn::Dropout(c_.dropout));
    TimestepEmbeddingOptions te;
    te.in_channels = d;
    te.time_embed_dim = c_.time_embed_dim;
    time_embedding = register_module("time_embedding", TimestepEmbedding<>(te));
    if (c_.ofs_embed_dim) {
      TimestepEmbeddingOptions oe;
      oe.in_channels = oe.time_embed_dim = *c_.ofs_embed_dim;
      ofs_embedding = register_module("ofs_embedding", TimestepEmbedding<>(oe));
    }
    transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c_.num_layers; ++i) {
      blocks_.push_back(CogVideoXBlock<Backend, Act>(c_, gated));
      transformer_blocks->push_back(blocks_.back());
    }
    norm_final = register_module(
        "norm_final", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})
                                               .elementwise_affine(c_.norm_elementwise_affine)
                                               .eps(c_.norm_eps)));
    norm_out = register_module(
        "norm_out",
        CogVideoXAdaLayerNorm(c_.time_embed_dim, d, c_.norm_elementwise_affine, c_.norm_eps));
    proj_out = register_module("proj_out", torch::nn::Linear(d, c_.patch_values()));
  }

  [[nodiscard]] const Config& config() const { return c_; }
  void set_gradient_checkpointing(bool on) { checkpointing_ = on; }
  [[nodiscard]] bool gradient_checkpointing() const { return checkpointing_; }

  /// The rotary tables diffusers' CogVideoX pipelines and training scripts compute for latents of
  /// `latent_frames` frames and h×w patches: CogVideoX 1.0 spreads the patch grid over the
  /// config's base grid (get_resize_crop_region_for_grid, linspace positions); 1.5 takes the first
  /// h×w integer positions of the base grid and ⌈frames / patch_size_t⌉ frame positions.
  [[nodiscard]] std::pair<at::Tensor, at::Tensor> rotary_embedding(
      std::int64_t latent_frames, std::int64_t grid_h, std::int64_t grid_w,
      at::Device device = at::kCPU) const {
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
    const std::int64_t base_w = c_.sample_width / c_.patch_size,
                       base_h = c_.sample_height / c_.patch_size;
    if (c_.patch_size_t) {
      if (grid_h > base_h || grid_w > base_w)
        throw ShapeError("a grid of " + std::to_string(grid_h) + "x" + std::to_string(grid_w) +
                             " patches is larger than the configured " + std::to_string(base_h) +
                             "x" + std::to_string(base_w) +
                             " (sample_height and sample_width / patch_size), which CogVideoX "
                             "1.5's rotary positions are sliced from",
                         "CogVideoXTransformer3DModel");
      const std::int64_t frames = (latent_frames + *c_.patch_size_t - 1) / *c_.patch_size_t;
      return rotary_3d(c_.attention_head_dim, at::arange(frames, f32), at::arange(grid_h, f32),
                       at::arange(grid_w, f32));
    }
    // get_resize_crop_region_for_grid with Python's round (half to even: nearbyint).
    const double r = static_cast<double>(grid_h) / static_cast<double>(grid_w);
    std::int64_t resize_h = 0, resize_w = 0;
    if (r > static_cast<double>(base_h) / static_cast<double>(base_w)) {
      resize_h = base_h;
      resize_w = static_cast<std::int64_t>(std::nearbyint(
          static_cast<double>(base_h) / static_cast<double>(grid_h) * static_cast<double>(grid_w)));
    } else {
      resize_w = base_w;
      resize_h = static_cast<std::int64_t>(std::nearbyint(
          static_cast<double>(base_w) / static_cast<double>(grid_w) * static_cast<double>(grid_h)));
    }
    const auto top = static_cast<std::int64_t>(std::nearbyint((base_h - resize_h) / 2.0));
    const auto left = static_cast<std::int64_t>(std::nearbyint((base_w - resize_w) / 2.0));
    auto spread = [&](double start, double stop, std::int64_t n) {
      return at::linspace(start, stop * static_cast<double>(n - 1) / static_cast<double>(n), n,
                          f32);
    };
    return rotary_3d(
        c_.attention_head_dim, spread(0.0, static_cast<double>(latent_frames), latent_frames),
        spread(static_cast<double>(top), static_cast<double>(top + resize_h), grid_h),
        spread(static_cast<double>(left), static_cast<double>(left + resize_w), grid_w));
  }

  /// The prediction for video latents (B, F, in_channels, H, W) at timesteps (B,) (or one for
  /// all) with the text states (B, L, text_embed_dim): (B, F, out_channels, H, W).
  at::Tensor forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                     const at::Tensor& timestep, const CogVideoXConditions& cond = {}) {
    const std::string where = "CogVideoXTransformer3DModel";
    const at::Tensor& x = hidden_states;
    const std::int64_t p = c_.patch_size, pt = c_.frame_patch();
    if (!x.defined() || x.dim() != 5 || x.size(2) != c_.in_channels)
      throw ShapeError("expects video latents (B, F, " + std::to_string(c_.in_channels) +
                           ", H, W), got " + (x.defined() ? c10::str(x.sizes()) : "nothing"),
                       where);
    const std::int64_t b = x.size(0), f = x.size(1), hh = x.size(3), ww = x.size(4);
    if (hh % p != 0 || ww % p != 0 || f % pt != 0)
      throw ShapeError("the latent size " + std::to_string(f) + "x" + std::to_string(hh) + "x" +
                           std::to_string(ww) + " (frames x height x width) is not a multiple of " +
                           "patch_size_t x patch_size x patch_size = " + std::to_string(pt) + "x" +
                           std::to_string(p) + "x" + std::to_string(p) +
                           (pt > 1 ? " (pad the latent frames as diffusers' pipeline does)" : ""),
                       where);
    const at::Tensor& text = encoder_hidden_states;
    if (!text.defined() || text.dim() != 3 || text.size(0) != b ||
        text.size(2) != c_.text_embed_dim)
      throw ShapeError("encoder_hidden_states must be (" + std::to_string(b) + ", L, " +
                           std::to_string(c_.text_embed_dim) + "), got " +
                           (text.defined() ? c10::str(text.sizes()) : std::string("nothing")),
                       where);
    const std::int64_t gh = hh / p, gw = ww / p;
    if (c_.position_table()) {
      if (text.size(1) != c_.max_text_seq_length)
        throw ShapeError("the text is " + std::to_string(text.size(1)) +
                             " tokens long; this config's position table covers exactly "
                             "max_text_seq_length = " +
                             std::to_string(c_.max_text_seq_length) +
                             " text tokens (pad the prompt to that length, as the pipeline does)",
                         where);
      if (c_.use_learned_positional_embeddings &&
          (gh != c_.sample_height / p || gw != c_.sample_width / p))
        throw ShapeError("the learned position table was trained for " +
                             std::to_string(c_.sample_height) + "x" +
                             std::to_string(c_.sample_width) + " latents, got " +
                             std::to_string(hh) + "x" + std::to_string(ww),
                         where);
    }
    const at::Tensor t = batch_timesteps(timestep, b, x.device(), where);
    at::Tensor emb =
        time_embedding->forward(timestep_embedding(t, c_.inner_dim(), c_.flip_sin_to_cos,
                                                   static_cast<double>(c_.freq_shift))
                                    .to(x.scalar_type()));
    if (ofs_embedding) {
      if (!cond.ofs.defined())
        throw ShapeError(
            "this config has ofs_embed_dim: pass CogVideoXConditions::ofs (the "
            "pipeline's 2.0)",
            where);
      const at::Tensor o = batch_timesteps(cond.ofs, b, x.device(), where);
      emb =
          emb + ofs_embedding->forward(timestep_embedding(o, *c_.ofs_embed_dim, c_.flip_sin_to_cos,
                                                          static_cast<double>(c_.freq_shift))
                                           .to(x.scalar_type()));
    } else if (cond.ofs.defined()) {
      throw ShapeError("an ofs was passed but the config has no ofs_embed_dim", where);
    }
    at::Tensor cos = cond.rotary_cos, sin = cond.rotary_sin;
    const std::int64_t video_tokens = (f / pt) * gh * gw;
    if (c_.use_rotary_positional_embeddings) {
      if (!cos.defined() || !sin.defined())
        std::tie(cos, sin) = rotary_embedding(f, gh, gw, x.device());
      const std::vector<std::int64_t> want{video_tokens, c_.attention_head_dim};
      if (cos.sizes() != want || sin.sizes() != want)
        throw ShapeError("the rotary tables must be (" + std::to_string(video_tokens) + ", " +
                             std::to_string(c_.attention_head_dim) + "), got " +
                             c10::str(cos.sizes()) + " and " + c10::str(sin.sizes()),
                         where);
      cos = cos.to(x.device());
      sin = sin.to(x.device());
    } else if (cos.defined() || sin.defined()) {
      throw ShapeError("rotary tables were passed but the config has no rotary embeddings", where);
    }

    at::Tensor all = embedding_dropout->forward(patch_embed->forward(text, x));
    const std::int64_t l = text.size(1);
    at::Tensor context = all.slice(1, 0, l), video = all.slice(1, l);
    for (auto& block : blocks_) {
      // The two streams travel through the checkpoint as one tensor, split after.
      auto body = [impl = block.ptr(), cos, sin](const std::vector<at::Tensor>& in) {
        auto [v, c] = impl->forward(in[0], in[1], in[2], cos, sin);
        return at::cat({c, v}, 1);
      };
      const at::Tensor both = nn::in_unit(*block, [&] {
        return checkpointing_ && is_training()
                   ? nn::checkpoint(body, {video, context, emb}, block->parameters())
                   : body({video, context, emb});
      });
      context = both.slice(1, 0, l);
      video = both.slice(1, l);
    }
    video = norm_out->forward(norm_final->forward(video), emb);
    video = proj_out->forward(video);
    const std::int64_t oc = c_.out_channels;
    if (!c_.patch_size_t)
      return video.reshape({b, f, gh, gw, oc, p, p})
          .permute({0, 1, 4, 2, 5, 3, 6})
          .reshape({b, f, oc, hh, ww});
    return video.reshape({b, f / pt, gh, gw, oc, pt, p, p})
        .permute({0, 1, 5, 4, 2, 6, 3, 7})
        .reshape({b, f, oc, hh, ww});
  }

  CogVideoXPatchEmbed patch_embed{nullptr};
  torch::nn::Dropout embedding_dropout{nullptr};
  TimestepEmbedding<> time_embedding{nullptr}, ofs_embedding{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr};
  torch::nn::LayerNorm norm_final{nullptr};
  CogVideoXAdaLayerNorm norm_out{nullptr};
  torch::nn::Linear proj_out{nullptr};

 private:
  Config c_;
  std::vector<CogVideoXBlock<Backend, Act>> blocks_;
  bool checkpointing_ = false;
};

template <nn::attention::AttentionBackend Backend = nn::attention::Sdpa<nn::attention::Auto>,
          nn::ElementwiseActivation Act = nn::activation::GELUTanh>
using CogVideoXTransformer3DModel =
    torch::nn::ModuleHolder<CogVideoXTransformer3DModelImpl<Backend, Act>>;

}  // namespace difftrain::models
