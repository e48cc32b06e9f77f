#pragma once
// The diffusers configs of a Stable Diffusion single file's models, told from its keys and shapes,
// for a file that comes without a config folder (diffusers' `from_single_file` without `config=`
// picks the published config of the family it detects; difftrain reads each size from the file):
//
//   UNet  the levels from input_blocks (resnets until a downsampler `op`), their widths, layer
//         and transformer counts, cross-attention width, conv or linear projections, in/out
//         channels (9 in: an inpainting UNet), SDXL's added embedding;
//   VAE   levels, widths, layers, latent channels, mid-block attention, quant convolutions (SD3's
//         scaling 1.5305 and shift 0.0609 by family);
//   CLIP  vocabulary, width, positions, layers, MLP width; OpenCLIP's towers likewise, SD 2.x's
//         read to its penultimate layer as diffusers' config has it.
//
// What shapes cannot tell is the family's, as its original configs set it: attention heads (SD
// 1.x: 8 per block; SD 2.x and SDXL: 64 channels per head; CLIP: 64 per head), the activations
// (CLIP ViT-L's quick_gelu, OpenCLIP's gelu), the prediction type (the program's to say: SD 2.x's
// published default is v-prediction, as diffusers picks SD 2.1 for an SD 2.x file),
// the VAE's scaling factor (0.18215; SDXL 0.13025), the token ids, the default sample size. The
// configs are JSON in diffusers' and transformers' keys, so a program can also write them out.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "difftrain/core/error.hpp"
#include "difftrain/models/single_file/stable_diffusion.hpp"

namespace difftrain::models {

namespace single_file_detail {

/// The shape of `key`, which the file must hold to tell `what`.
inline std::vector<std::int64_t> shape_of(const SingleFile& f, const std::string& key,
                                          std::string_view what) {
  const auto it = f.tensors.find(key);
  if (it == f.tensors.end())
    throw FormatError("lacks '" + key + "', which tells the " + std::string(what), f.where);
  return it->second.sizes().vec();
}

inline std::int64_t dim_of(const SingleFile& f, const std::string& key, std::size_t dim,
                           std::string_view what) {
  const auto s = shape_of(f, key, what);
  if (s.size() <= dim)
    throw FormatError("'" + key + "' has " + std::to_string(s.size()) + " dimension(s) where " +
                          std::to_string(dim + 1) + " tell the " + std::string(what),
                      f.where);
  return s[dim];
}

/// How many of prefix + "0" + suffix, prefix + "1" + suffix, ... the file holds, in a row.
inline std::int64_t count_in_a_row(const SingleFile& f, const std::string& prefix,
                                   const std::string& suffix) {
  std::int64_t n = 0;
  while (n < 100000 && f.tensors.contains(prefix + std::to_string(n) + suffix)) ++n;
  return n;
}

inline int sample_size_of(SingleFileFamily family, int sd1, int sd2, int sdxl) {
  return family == SingleFileFamily::sdxl ? sdxl : family == SingleFileFamily::sd2 ? sd2 : sd1;
}

}  // namespace single_file_detail

/// diffusers' UNet2DConditionModel config of an SD 1.x, 2.x or XL single file's UNet.
inline nlohmann::json unet_config_from_single_file(const SingleFile& f) {
  using namespace single_file_detail;
  require_unet_family(f, "UNet config");
  const std::string p(kLdmUnetPrefix);
  const std::string what = "UNet config";
  const auto conv_in = shape_of(f, p + "input_blocks.0.0.weight", what);
  if (conv_in.size() != 4)
    throw FormatError("'" + p + "input_blocks.0.0.weight' is no convolution", f.where);
  struct Level {
    std::int64_t channels = 0, layers = 0, depth = 1;
    bool attention = false, only_cross = false;
  };
  std::vector<Level> levels(1);
  std::int64_t cross = -1;
  std::optional<bool> linear;
  auto attention_at = [&](const std::string& block, Level& level) {
    if (!f.tensors.contains(block + "proj_in.weight")) return false;
    level.depth = count_in_a_row(f, block + "transformer_blocks.", ".attn1.to_q.weight");
    const std::string to_k = block + "transformer_blocks.0.attn2.to_k.weight";
    const std::int64_t width = dim_of(f, to_k, 1, what);
    if (cross >= 0 && width != cross)
      throw FormatError("attends to text " + std::to_string(width) + " wide at '" + to_k +
                            "' and " + std::to_string(cross) + " wide before",
                        f.where);
    cross = width;
    linear = shape_of(f, block + "proj_in.weight", what).size() == 2;
    // diffusers' only_cross_attention: the first attention attends to the text too.
    const auto in = shape_of(f, block + "proj_in.weight", what);
    level.only_cross =
        dim_of(f, block + "transformer_blocks.0.attn1.to_k.weight", 1, what) != in.at(0);
    return true;
  };
  for (std::int64_t i = 1;; ++i) {
    const std::string block = p + "input_blocks." + std::to_string(i) + ".";
    if (f.tensors.contains(block + "0.op.weight")) {  // a downsampler ends a level
      levels.emplace_back();
      continue;
    }
    if (!f.tensors.contains(block + "0.in_layers.2.weight")) break;
    Level& level = levels.back();
    level.channels = dim_of(f, block + "0.in_layers.2.weight", 0, what);
    ++level.layers;
    Level seen;
    if (attention_at(block + "1.", seen)) {
      level.attention = true;
      level.depth = seen.depth;
      level.only_cross = seen.only_cross;
    }
  }
  if (levels.back().layers == 0 || levels.size() < 2)
    throw FormatError("has no UNet levels under '" + p + "input_blocks.' (resnets, downsamplers)",
                      f.where);
  Level mid;
  if (!attention_at(p + "middle_block.1.", mid))
    throw FormatError("has no attention in its UNet's middle block ('" + p +
                          "middle_block.1.proj_in.weight'): not a Stable Diffusion UNet",
                      f.where);
  if (cross < 0) throw FormatError("has no cross-attention in its UNet", f.where);
  if (mid.depth != levels.back().depth && levels.back().attention)
    throw FormatError("has " + std::to_string(mid.depth) +
                          " transformer layers in the middle block and " +
                          std::to_string(levels.back().depth) +
                          " in the last level, which diffusers' config cannot say",
                      f.where);
  const bool sd1 = f.family == SingleFileFamily::sd1;
  nlohmann::json j = {{"_class_name", "UNet2DConditionModel"},
                      {"in_channels", conv_in[1]},
                      {"out_channels", dim_of(f, p + "out.2.weight", 0, what)},
                      {"cross_attention_dim", cross},
                      {"use_linear_projection", linear.value_or(false)},
                      {"sample_size", sample_size_of(f.family, 64, 96, 128)},
                      // SD 2.1's published config (diffusers' choice for an SD 2.x file)
                      {"upcast_attention", f.family == SingleFileFamily::sd2}};
  std::vector<std::string> down, up;
  std::vector<std::int64_t> channels, layers, depth, heads;
  std::vector<bool> only_cross;
  for (const Level& l : levels) {
    only_cross.push_back(l.only_cross);
    down.push_back(l.attention ? "CrossAttnDownBlock2D" : "DownBlock2D");
    up.insert(up.begin(), l.attention ? "CrossAttnUpBlock2D" : "UpBlock2D");
    channels.push_back(l.channels);
    layers.push_back(l.layers);
    // A level without attention has no transformer layers; the last entry is the middle
    // block's (diffusers reads it from there).
    depth.push_back(l.attention ? l.depth : &l == &levels.back() ? mid.depth : 1);
    // SD 1.x: 8 heads everywhere; SD 2.x and SDXL: 64 channels a head (diffusers' configs call
    // these counts attention_head_dim).
    // (A width that is no multiple of 64, which only test models have, gets one head.)
    heads.push_back(sd1 ? 8 : l.channels % 64 == 0 ? l.channels / 64 : 1);
  }
  j["down_block_types"] = down;
  j["up_block_types"] = up;
  j["block_out_channels"] = channels;
  j["layers_per_block"] = layers;
  j["attention_head_dim"] = heads;
  if (std::find(only_cross.begin(), only_cross.end(), true) != only_cross.end())
    j["only_cross_attention"] = only_cross;
  if (mid.only_cross) j["mid_block_only_cross_attention"] = true;
  // The original's use_scale_shift_norm: each resnet's time projection gives a scale and a shift.
  if (dim_of(f, p + "input_blocks.1.0.emb_layers.1.weight", 0, what) == 2 * channels[0])
    j["resnet_time_scale_shift"] = "scale_shift";
  if (std::any_of(depth.begin(), depth.end(), [](std::int64_t d) { return d != 1; }))
    j["transformer_layers_per_block"] = depth;
  const std::int64_t time = dim_of(f, p + "time_embed.0.weight", 0, what);
  if (time != 4 * channels[0]) j["time_embedding_dim"] = time;
  // The original's class labels (num_classes): an embedding table diffusers names
  // class_embedding.
  if (const auto table = f.tensors.find(p + "label_emb.weight"); table != f.tensors.end())
    j["num_class_embeds"] = dim_of(f, table->first, 0, what);
  const std::string label = p + "label_emb.0.0.weight";
  if (f.tensors.contains(label)) {
    if (f.family != SingleFileFamily::sdxl)
      throw FormatError("has a class embedding ('" + label +
                            "') in a file of no SDXL text encoders: not a UNet difftrain reads "
                            "from single files",
                        f.where);
    // SDXL's added embedding takes the pooled text and six time ids of addition_time_embed_dim.
    const std::int64_t in = dim_of(f, label, 1, what);
    const std::int64_t pooled =
        dim_of(f, std::string(kSdxlOpenClipPrefix) + "text_projection", 1, what);
    if (in <= pooled || (in - pooled) % 6 != 0)
      throw FormatError("'" + label + "' takes " + std::to_string(in) +
                            " features, not the pooled text (" + std::to_string(pooled) +
                            ") and six time ids",
                        f.where);
    j["addition_embed_type"] = "text_time";
    j["addition_time_embed_dim"] = (in - pooled) / 6;
    j["projection_class_embeddings_input_dim"] = in;
  }
  return j;
}

/// diffusers' AutoencoderKL config of a single file's VAE.
inline nlohmann::json vae_config_from_single_file(const SingleFile& f) {
  using namespace single_file_detail;
  const std::string p(kLdmVaePrefix);
  const std::string what = "VAE config";
  const std::int64_t n = count_in_a_row(f, p + "encoder.down.", ".block.0.conv1.weight");
  if (n == 0)
    throw FormatError(
        "lacks '" + p + "encoder.down.0.block.0.conv1.weight', which tells the " + what, f.where);
  std::vector<std::int64_t> channels;
  for (std::int64_t i = 0; i < n; ++i)
    channels.push_back(
        dim_of(f, p + "encoder.down." + std::to_string(i) + ".block.0.conv1.weight", 0, what));
  const bool xl = f.family == SingleFileFamily::sdxl;
  const bool sd3 = f.family == SingleFileFamily::sd3;
  nlohmann::json j = {
      {"_class_name", "AutoencoderKL"},
      {"in_channels", dim_of(f, p + "encoder.conv_in.weight", 1, what)},
      {"out_channels", dim_of(f, p + "decoder.conv_out.weight", 0, what)},
      {"down_block_types", std::vector<std::string>(n, "DownEncoderBlock2D")},
      {"up_block_types", std::vector<std::string>(n, "UpDecoderBlock2D")},
      {"block_out_channels", channels},
      {"layers_per_block", count_in_a_row(f, p + "encoder.down.0.block.", ".conv1.weight")},
      {"latent_channels", dim_of(f, p + "decoder.conv_in.weight", 1, what)},
      {"scaling_factor", sd3  ? 1.5305
                         : xl ? 0.13025
                              : 0.18215},
      {"force_upcast", xl},
      {"use_quant_conv", f.tensors.contains(p + "quant_conv.weight")},
      {"use_post_quant_conv", f.tensors.contains(p + "post_quant_conv.weight")},
      {"mid_block_add_attention", f.tensors.contains(p + "encoder.mid.attn_1.q.weight")},
      {"sample_size", sd3 ? 1024 : sample_size_of(f.family, 512, 768, 1024)}};
  if (sd3) j["shift_factor"] = 0.0609;  // SD3's latents are shifted, then scaled
  return j;
}

/// transformers' CLIPTextConfig of a single file's text encoder `index` (0, or SDXL's 1: OpenCLIP
/// ViT-bigG as CLIPTextModelWithProjection).
inline nlohmann::json clip_config_from_single_file(const SingleFile& f, int index = 0) {
  using namespace single_file_detail;
  const TextEncoderLayout layout = text_encoder_layout(f.family, index, f.where);
  const std::string p(layout.prefix);
  const std::string what = "text encoder config";
  nlohmann::json j = {{"model_type", "clip_text_model"},
                      {"bos_token_id", 0},
                      {"eos_token_id", 2},
                      {"pad_token_id", 1},
                      {"layer_norm_eps", 1e-5}};
  std::int64_t width = 0;
  if (!layout.openclip) {
    const auto tokens = shape_of(f, p + "text_model.embeddings.token_embedding.weight", what);
    width = tokens.at(1);
    j["vocab_size"] = tokens.at(0);
    j["hidden_size"] = width;
    j["max_position_embeddings"] =
        dim_of(f, p + "text_model.embeddings.position_embedding.weight", 0, what);
    j["num_hidden_layers"] = count_in_a_row(f, p + "text_model.encoder.layers.", ".mlp.fc1.weight");
    j["intermediate_size"] = dim_of(f, p + "text_model.encoder.layers.0.mlp.fc1.weight", 0, what);
    j["hidden_act"] = "quick_gelu";
    j["projection_dim"] = width;
    j["architectures"] = {"CLIPTextModel"};
  } else {
    const auto tokens = shape_of(f, p + "token_embedding.weight", what);
    width = tokens.at(1);
    const std::int64_t layers = count_in_a_row(f, p + "transformer.resblocks.", ".mlp.c_fc.weight");
    j["vocab_size"] = tokens.at(0);
    j["hidden_size"] = width;
    j["max_position_embeddings"] = dim_of(f, p + "positional_embedding", 0, what);
    // SD 2.x conditions on the penultimate layer, and diffusers' config stops there; SDXL's
    // encoder keeps every layer (its pipeline takes the penultimate hidden state itself).
    j["num_hidden_layers"] = index == 0 ? layers - 1 : layers;
    j["intermediate_size"] = dim_of(f, p + "transformer.resblocks.0.mlp.c_fc.weight", 0, what);
    j["hidden_act"] = "gelu";
    // SDXL's second encoder projects with OpenCLIP's text_projection; SD 2.x's has none, and its
    // published config keeps transformers' default 512.
    const bool projection = index == 1;
    j["projection_dim"] = projection ? dim_of(f, p + "text_projection", 1, what) : 512;
    j["architectures"] = {projection ? "CLIPTextModelWithProjection" : "CLIPTextModel"};
  }
  // CLIP's heads are 64 wide (a width that is no multiple of 64, which only test models have, gets
  // one head).
  j["num_attention_heads"] = width % 64 == 0 ? width / 64 : 1;
  return j;
}

}  // namespace difftrain::models
