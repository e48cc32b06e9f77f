#pragma once
// The names Stable Diffusion's original code (CompVis' latent diffusion, Stability's generative
// models: the web UI, ComfyUI, kohya's scripts and stable-diffusion.cpp read them) gives the
// tensors diffusers names otherwise, as diffusers' single-file loader maps them:
//
//   UNet  model.diffusion_model.  input_blocks.i.0 a resnet (in_layers.0/2, emb_layers.1,
//         out_layers.0/3, skip_connection), input_blocks.i.1 its attention, input_blocks.i.0.op a
//         downsampler; middle_block.0/1/2; output_blocks.j.0/1 and .1 or .2.conv an upsampler;
//         time_embed.0/2, label_emb.0.0/2 (SDXL's added embedding), out.0/2
//   VAE   first_stage_model.  encoder.down.b.block.l / .downsample, decoder.up.(n-1-b).block.l /
//         .upsample (the decoder's blocks numbered from the bottom), mid.block_1/attn_1/block_2
//         with the attention's q/k/v/proj_out as 1x1 convolutions and its norm as norm, norm_out,
//         nin_shortcut
//   CLIP  cond_stage_model.transformer.  + transformers' names (SD 1.x); SD 2.x's OpenCLIP text
//         tower under cond_stage_model.model. (q, k and v fused as attn.in_proj_weight/bias);
//         SDXL's two encoders under conditioner.embedders.0.transformer. (CLIP ViT-L, transformers'
//         names) and conditioner.embedders.1.model. (OpenCLIP ViT-bigG, with its text_projection
//         stored transposed, as OpenCLIP multiplies by it from the right)
//
// Each name is derived from the diffusers name and the model's config alone, so one function per
// family serves reading (every tensor the model has is looked up under its original name) and
// writing (every tensor is written under it): the two directions cannot disagree.

#include <cstdint>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/autoencoder_kl.hpp"
#include "difftrain/models/unet_2d_condition.hpp"

namespace difftrain::models {

/// Where each component's tensors live in an SD 1.x single file.
inline constexpr std::string_view kLdmUnetPrefix = "model.diffusion_model.";
inline constexpr std::string_view kLdmVaePrefix = "first_stage_model.";
inline constexpr std::string_view kLdmClipPrefix = "cond_stage_model.transformer.";
/// SD 2.x's text encoder, OpenCLIP ViT-H's text tower.
inline constexpr std::string_view kLdmOpenClipPrefix = "cond_stage_model.model.";
/// SDXL's text encoders: CLIP ViT-L (transformers' names) and OpenCLIP ViT-bigG's text tower.
inline constexpr std::string_view kSdxlClipPrefix = "conditioner.embedders.0.transformer.";
inline constexpr std::string_view kSdxlOpenClipPrefix = "conditioner.embedders.1.model.";

namespace ldm_detail {

/// "a.b.c" split at its dots.
inline std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (true) {
    const std::size_t dot = s.find('.', at);
    out.push_back(s.substr(at, dot == std::string::npos ? std::string::npos : dot - at));
    if (dot == std::string::npos) return out;
    at = dot + 1;
  }
}

inline std::string join(const std::vector<std::string>& parts, std::size_t from) {
  std::string out;
  for (std::size_t i = from; i < parts.size(); ++i) out += (i == from ? "" : ".") + parts[i];
  return out;
}

inline std::int64_t index_of(const std::string& s, const std::string& key) {
  if (s.empty() || s.size() > 6 || s.find_first_not_of("0123456789") != std::string::npos)
    throw ConfigError("has no index where one is expected", key);
  return std::stoll(s);
}

/// A diffusers UNet resnet's tensor ("norm1.weight") as the original ResBlock names it.
inline std::string unet_resnet(const std::string& rest, const std::string& key) {
  static const std::pair<std::string_view, std::string_view> renames[] = {
      {"norm1.", "in_layers.0."},          {"conv1.", "in_layers.2."},
      {"time_emb_proj.", "emb_layers.1."}, {"norm2.", "out_layers.0."},
      {"conv2.", "out_layers.3."},         {"conv_shortcut.", "skip_connection."}};
  for (const auto& [from, to] : renames)
    if (rest.starts_with(from)) return std::string(to) + rest.substr(from.size());
  throw ConfigError("is not a tensor of a UNet resnet diffusers has", key);
}

/// A diffusers VAE resnet's tensor as the original one names it (only the shortcut differs).
inline std::string vae_resnet(const std::string& rest) {
  if (rest.starts_with("conv_shortcut.")) return "nin_shortcut." + rest.substr(14);
  return rest;
}

/// A diffusers VAE mid-block attention tensor as the original AttnBlock names it.
inline std::string vae_attention(const std::string& rest, const std::string& key) {
  static const std::pair<std::string_view, std::string_view> renames[] = {
      {"group_norm.", "norm."},
      {"to_q.", "q."},
      {"to_k.", "k."},
      {"to_v.", "v."},
      {"to_out.0.", "proj_out."}};
  for (const auto& [from, to] : renames)
    if (rest.starts_with(from)) return std::string(to) + rest.substr(from.size());
  throw ConfigError("is not a tensor of the VAE's attention diffusers has", key);
}

}  // namespace ldm_detail

/// The original name (without `model.diffusion_model.`) of the diffusers UNet tensor `key`, for a
/// UNet of config `c` (SD 1.x, 2.x and SDXL UNets, whose mid block has attention). A name the
/// original layout has no place for is a ConfigError naming it.
inline std::string ldm_unet_name(const std::string& key, const UNet2DConditionConfig& c) {
  using namespace ldm_detail;
  const std::vector<std::string> p = split(key);
  const auto rest_from = [&](std::size_t i) { return join(p, i); };
  const std::size_t n = c.down_block_types.size();
  if (p.size() >= 3 && p[0] == "time_embedding")
    return std::string("time_embed.") + (p[1] == "linear_1" ? "0." : "2.") + rest_from(2);
  if (p.size() >= 3 && (p[0] == "add_embedding" || (p[0] == "class_embedding" && p[1] != "weight")))
    return std::string("label_emb.0.") + (p[1] == "linear_1" ? "0." : "2.") + rest_from(2);
  if (key == "class_embedding.weight") return "label_emb.weight";
  if (p[0] == "conv_in") return "input_blocks.0.0." + rest_from(1);
  if (p[0] == "conv_norm_out") return "out.0." + rest_from(1);
  if (p[0] == "conv_out") return "out.2." + rest_from(1);
  if (p.size() >= 5 && p[0] == "down_blocks") {
    const auto b = static_cast<std::size_t>(index_of(p[1], key));
    if (b >= n) throw ConfigError("names a down block the config does not have", key);
    std::int64_t first = 1;  // input_blocks.0 is conv_in; each block has its layers + a downsampler
    for (std::size_t i = 0; i < b; ++i) first += c.layers_per_block[i] + 1;
    if (p[2] == "downsamplers")
      return "input_blocks." + std::to_string(first + c.layers_per_block[b]) + ".0.op." +
             rest_from(5);
    const std::int64_t l = index_of(p[3], key);
    const std::string block = "input_blocks." + std::to_string(first + l);
    if (p[2] == "resnets") return block + ".0." + unet_resnet(rest_from(4), key);
    if (p[2] == "attentions") return block + ".1." + rest_from(4);
  }
  if (p.size() >= 4 && p[0] == "mid_block") {
    const std::int64_t i = index_of(p[2], key);
    if (p[1] == "resnets" && (i == 0 || i == 1))
      return "middle_block." + std::to_string(2 * i) + "." + unet_resnet(rest_from(3), key);
    if (p[1] == "attentions" && i == 0) return "middle_block.1." + rest_from(3);
  }
  if (p.size() >= 5 && p[0] == "up_blocks") {
    const auto b = static_cast<std::size_t>(index_of(p[1], key));
    if (b >= n) throw ConfigError("names an up block the config does not have", key);
    // Up block b has the layers of down block n-1-b plus one.
    const auto layers = [&](std::size_t up) { return c.layers_per_block[n - 1 - up] + 1; };
    std::int64_t first = 0;
    for (std::size_t i = 0; i < b; ++i) first += layers(i);
    if (p[2] == "upsamplers") {
      // The upsampler follows the block's last layer: after its attention when it has one.
      const bool attention = c.up_block_types[b].starts_with("CrossAttn");
      return "output_blocks." + std::to_string(first + layers(b) - 1) +
             (attention ? ".2." : ".1.") + rest_from(4);
    }
    const std::int64_t l = index_of(p[3], key);
    const std::string block = "output_blocks." + std::to_string(first + l);
    if (p[2] == "resnets") return block + ".0." + unet_resnet(rest_from(4), key);
    if (p[2] == "attentions") return block + ".1." + rest_from(4);
  }
  throw ConfigError("has no place in the original UNet layout", key);
}

/// The original name (without `first_stage_model.`) of the diffusers AutoencoderKL tensor `key`.
inline std::string ldm_vae_name(const std::string& key, const AutoencoderKLConfig& c) {
  using namespace ldm_detail;
  const std::vector<std::string> p = split(key);
  const auto rest_from = [&](std::size_t i) { return join(p, i); };
  const auto n = static_cast<std::int64_t>(c.block_out_channels.size());
  if (p[0] == "quant_conv" || p[0] == "post_quant_conv") return key;
  if (p.size() >= 3 && (p[0] == "encoder" || p[0] == "decoder")) {
    const std::string& part = p[0];
    if (p[1] == "conv_in" || p[1] == "conv_out") return key;
    if (p[1] == "conv_norm_out") return part + ".norm_out." + rest_from(2);
    if (p[1] == "mid_block" && p.size() >= 5) {
      const std::int64_t i = index_of(p[3], key);
      if (p[2] == "resnets" && (i == 0 || i == 1))
        return part + ".mid.block_" + std::to_string(i + 1) + "." + vae_resnet(rest_from(4));
      if (p[2] == "attentions" && i == 0)
        return part + ".mid.attn_1." + vae_attention(rest_from(4), key);
    }
    if (p.size() >= 6 && (p[1] == "down_blocks" || p[1] == "up_blocks")) {
      const std::int64_t b = index_of(p[2], key);
      if (b >= n) throw ConfigError("names a block the config does not have", key);
      // The decoder's blocks are numbered from the bottom in the original.
      const std::string block = part + (part == "encoder" ? ".down." : ".up.") +
                                std::to_string(part == "encoder" ? b : n - 1 - b);
      if (p[3] == "resnets")
        return block + ".block." + std::to_string(index_of(p[4], key)) + "." +
               vae_resnet(rest_from(5));
      if (p[3] == "downsamplers" || p[3] == "upsamplers")
        return block + (p[3] == "downsamplers" ? ".downsample." : ".upsample.") + rest_from(5);
    }
  }
  throw ConfigError("has no place in the original VAE layout", key);
}

/// Where a diffusers tensor lives in an original layout: its name there, and for a tensor the
/// original fuses with others (OpenCLIP's q, k and v in one `in_proj`), which third it is (0, 1,
/// 2; -1 for a tensor of its own), whether the original keeps it transposed (OpenCLIP's
/// text_projection, applied as x @ P where transformers' linear layer computes x @ W^T), and
/// whether it keeps the two halves of its rows in the other order (SD3's final modulations:
/// shift then scale where diffusers has scale then shift).
struct OriginalPlace {
  std::string name;
  int third = -1;
  bool transposed = false;
  bool halves_swapped = false;
};

/// A CLIPTextModel (or CLIPTextModelWithProjection) tensor's place in OpenCLIP's text tower (SD
/// 2.x's ViT-H, SDXL's ViT-bigG).
inline OriginalPlace openclip_place(const std::string& key) {
  using namespace ldm_detail;
  if (key == "text_model.embeddings.token_embedding.weight") return {"token_embedding.weight"};
  if (key == "text_model.embeddings.position_embedding.weight") return {"positional_embedding"};
  if (key == "text_projection.weight") return {"text_projection", -1, true};
  if (key.starts_with("text_model.final_layer_norm."))
    return {"ln_final." + key.substr(std::string_view("text_model.final_layer_norm.").size())};
  const std::vector<std::string> p = split(key);
  // text_model.encoder.layers.N.<part>...
  if (p.size() >= 6 && p[0] == "text_model" && p[1] == "encoder" && p[2] == "layers") {
    const std::string block = "transformer.resblocks." + std::to_string(index_of(p[3], key)) + ".";
    const std::string rest = join(p, 5);
    if (p[4] == "layer_norm1") return {block + "ln_1." + rest};
    if (p[4] == "layer_norm2") return {block + "ln_2." + rest};
    if (p[4] == "mlp" && p.size() >= 7 && (p[5] == "fc1" || p[5] == "fc2"))
      return {block + "mlp." + (p[5] == "fc1" ? "c_fc." : "c_proj.") + join(p, 6)};
    if (p[4] == "self_attn" && p.size() >= 7) {
      if (p[5] == "out_proj") return {block + "attn.out_proj." + join(p, 6)};
      const int third = p[5] == "q_proj" ? 0 : p[5] == "k_proj" ? 1 : p[5] == "v_proj" ? 2 : -1;
      if (third >= 0 && p.size() == 7) return {block + "attn.in_proj_" + p[6], third};
    }
  }
  throw ConfigError("has no place in OpenCLIP's text tower", key);
}

/// Whether the original stores the VAE tensor `key` (diffusers' name) as a 1x1 convolution where
/// diffusers has a linear layer: the mid-block attention's q, k, v and proj_out weights.
inline bool ldm_vae_conv_as_linear(const std::string& key) {
  return key.find(".mid_block.attentions.0.") != std::string::npos &&
         (key.ends_with("to_q.weight") || key.ends_with("to_k.weight") ||
          key.ends_with("to_v.weight") || key.ends_with("to_out.0.weight"));
}

}  // namespace difftrain::models
