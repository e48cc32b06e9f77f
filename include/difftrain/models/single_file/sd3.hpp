#pragma once
// Stable Diffusion 3 / 3.5 single files (Stability's `sd3_medium*.safetensors`,
// `sd3.5_large.safetensors`, ComfyUI's layout), as diffusers' single-file loader maps them:
//
//   MMDiT  model.diffusion_model.  x_embedder.proj, pos_embed, t_embedder.mlp.0/2,
//          y_embedder.mlp.0/2, context_embedder, joint_blocks.i.{x_block,context_block}
//          with attn.qkv (q, k and v in one tensor), attn.proj, attn.ln_q/ln_k (3.5's RMS norms),
//          x_block.attn2 (3.5's dual attention), adaLN_modulation.1, mlp.fc1/fc2; final_layer
//          .linear and .adaLN_modulation.1. The last block's context modulation and the final
//          one keep shift before scale, diffusers scale before shift.
//   VAE    first_stage_model.  as SD 1.x's, with 16 latent channels and no quant convolutions
//   text   text_encoders.clip_l.transformer., text_encoders.clip_g.transformer. (transformers'
//          CLIPTextModelWithProjection names; CLIP-L's projection is the identity when the file
//          holds none, as diffusers sets it) and text_encoders.t5xxl.transformer. (T5EncoderModel)
//
//   auto file = models::read_single_file("sd3_medium_incl_clips_t5xxlfp16.safetensors");
//   auto mmdit = models::sd3_transformer_from_single_file(file, config);  // or told:
//   auto vae = models::vae_from_single_file(file, vae_config);  // as for every family
//   auto told = models::sd3_transformer_config_from_single_file(file);

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "difftrain/core/error.hpp"
#include "difftrain/models/sd3_transformer_2d.hpp"
#include "difftrain/models/single_file/stable_diffusion.hpp"
#include "difftrain/models/single_file/stable_diffusion_configs.hpp"
#include "difftrain/models/t5_encoder.hpp"

namespace difftrain::models {

inline constexpr std::string_view kSd3ClipLPrefix = "text_encoders.clip_l.transformer.";
inline constexpr std::string_view kSd3ClipGPrefix = "text_encoders.clip_g.transformer.";
inline constexpr std::string_view kSd3T5Prefix = "text_encoders.t5xxl.transformer.";

/// The original place (under `model.diffusion_model.`) of the diffusers SD3Transformer2DModel
/// tensor `key`, for a model of `num_layers` blocks. A name the original has no place for is a
/// ConfigError naming it.
inline OriginalPlace sd3_original_place(const std::string& key, std::int64_t num_layers) {
  using namespace ldm_detail;
  const std::vector<std::string> p = split(key);
  const auto rest_from = [&](std::size_t i) { return join(p, i); };
  if (key == "pos_embed.pos_embed") return {"pos_embed"};
  if (p.size() == 3 && p[0] == "pos_embed" && p[1] == "proj") return {"x_embedder.proj." + p[2]};
  if (p.size() == 4 && p[0] == "time_text_embed") {
    const std::string mlp = p[2] == "linear_1" ? "mlp.0." : "mlp.2.";
    if (p[1] == "timestep_embedder") return {"t_embedder." + mlp + p[3]};
    if (p[1] == "text_embedder") return {"y_embedder." + mlp + p[3]};
  }
  if (p[0] == "context_embedder") return {key};
  if (p[0] == "proj_out") return {"final_layer.linear." + rest_from(1)};
  if (p.size() == 3 && p[0] == "norm_out" && p[1] == "linear")
    return {"final_layer.adaLN_modulation.1." + p[2], -1, false, true};
  if (p.size() >= 4 && p[0] == "transformer_blocks") {
    const std::int64_t i = index_of(p[1], key);
    const bool last = i == num_layers - 1;
    const std::string b = "joint_blocks." + p[1] + ".";
    const std::string x = b + "x_block.", ctx = b + "context_block.";
    const std::string& part = p[2];
    if ((part == "attn" || part == "attn2") && p.size() >= 5) {
      const std::string attn = x + part + ".";
      const std::string& what = p[3];
      const std::string tail = rest_from(4);
      if (what == "to_q" || what == "to_k" || what == "to_v")
        return {attn + "qkv." + tail, what == "to_q" ? 0 : what == "to_k" ? 1 : 2};
      if (part == "attn" && (what == "add_q_proj" || what == "add_k_proj" || what == "add_v_proj"))
        return {ctx + "attn.qkv." + tail, what == "add_q_proj" ? 0 : what == "add_k_proj" ? 1 : 2};
      if (what == "norm_q") return {attn + "ln_q." + tail};
      if (what == "norm_k") return {attn + "ln_k." + tail};
      if (part == "attn" && what == "norm_added_q") return {ctx + "attn.ln_q." + tail};
      if (part == "attn" && what == "norm_added_k") return {ctx + "attn.ln_k." + tail};
      if (what == "to_out" && p.size() == 6 && p[4] == "0") return {attn + "proj." + p[5]};
      if (part == "attn" && what == "to_add_out") return {ctx + "attn.proj." + tail};
    }
    if (part == "norm1" && p.size() == 5) return {x + "adaLN_modulation.1." + p[4]};
    if (part == "norm1_context" && p.size() == 5)
      return {ctx + "adaLN_modulation.1." + p[4], -1, false, last};
    if ((part == "ff" || part == "ff_context") && p.size() >= 6 && p[3] == "net") {
      const std::string mlp = (part == "ff" ? x : ctx) + "mlp.";
      if (p[4] == "0" && p[5] == "proj" && p.size() == 7) return {mlp + "fc1." + p[6]};
      if (p[4] == "2" && p.size() == 6) return {mlp + "fc2." + p[5]};
    }
  }
  throw ConfigError("has no place in the original SD3 layout", key);
}

namespace single_file_detail {
inline void require_sd3(const SingleFile& f, std::string_view what) {
  if (f.family != SingleFileFamily::sd3)
    throw ConfigError("is a " + std::string(single_file_family_name(f.family)) + " file; the " +
                          std::string(what) + " is read from Stable Diffusion 3 files",
                      f.where);
}
}  // namespace single_file_detail

/// The MMDiT of an SD3 / 3.5 single file, built from `config` (diffusers' transformer config).
template <class Holder = SD3Transformer2DModel<>>
Holder sd3_transformer_from_single_file(const SingleFile& f, SD3Transformer2DConfig config) {
  single_file_detail::require_sd3(f, "MMDiT");
  auto model = built_to_load<Holder>(std::move(config), f.where);
  const std::int64_t layers = model->config().num_layers;
  single_file_detail::load_component(
      model, f, kLdmUnetPrefix,
      [layers](const std::string& n) { return sd3_original_place(n, layers); },
      single_file_detail::nothing, single_file_detail::nothing, "SD3 transformer");
  return model;
}

/// SD3's CLIP-L (`index` 0) or CLIP-G (1) as CLIPTextModelWithProjection. A CLIP-L without its
/// projection in the file gets the identity, as diffusers gives it.
template <class Holder = CLIPTextModel<>>
Holder sd3_clip_from_single_file(const SingleFile& f, CLIPTextConfig config, int index) {
  single_file_detail::require_sd3(f, "text encoder");
  const std::string_view prefix = index == 0 ? kSd3ClipLPrefix : kSd3ClipGPrefix;
  SingleFile view;  // the file, with CLIP-L's identity projection where it has none
  const SingleFile* from = &f;
  const std::string projection = std::string(prefix) + "text_projection.weight";
  if (config.with_projection && !f.tensors.contains(projection)) {
    if (index != 0 || config.projection_dim != config.hidden_size)
      throw FormatError("lacks '" + projection + "'" +
                            (index != 0 ? " (CLIP-G's projection)"
                                        : " and the config's projection_dim is not its "
                                          "hidden_size, so no identity can stand in"),
                        f.where);
    view.where = f.where;
    view.family = f.family;
    view.tensors = f.tensors;
    view.tensors[projection] = at::eye(config.hidden_size);
    from = &view;
  }
  auto model = built_to_load<Holder>(std::move(config), f.where);
  single_file_detail::load_component(
      model, *from, prefix, [](const std::string& n) { return OriginalPlace{n}; },
      single_file_detail::nothing,
      [](const std::string& rest) { return rest == "text_model.embeddings.position_ids"; },
      index == 0 ? "CLIP-L text encoder" : "CLIP-G text encoder");
  if (from != &f)
    for (const auto& key : view.taken)
      if (key != projection) f.taken.insert(key);
  return model;
}

/// SD3's T5-XXL encoder (transformers' T5EncoderModel names; the token table as `shared.weight`,
/// a copy under `encoder.embed_tokens.weight` left aside).
template <class Holder = T5EncoderModel<>>
Holder sd3_t5_from_single_file(const SingleFile& f, T5EncoderConfig config) {
  single_file_detail::require_sd3(f, "T5 encoder");
  auto model = built_to_load<Holder>(std::move(config), f.where);
  single_file_detail::load_component(
      model, f, kSd3T5Prefix, [](const std::string& n) { return OriginalPlace{n}; },
      single_file_detail::nothing,
      [](const std::string& rest) { return rest == "encoder.embed_tokens.weight"; },
      "T5 text encoder");
  return model;
}

/// diffusers' SD3Transformer2DModel config of an SD3 / 3.5 file's MMDiT, told from its keys and
/// shapes (heads of 64 channels, as every published SD3 has).
inline nlohmann::json sd3_transformer_config_from_single_file(const SingleFile& f) {
  using namespace single_file_detail;
  require_sd3(f, "MMDiT config");
  const std::string p(kLdmUnetPrefix);
  const std::string what = "SD3 transformer config";
  const auto patch = shape_of(f, p + "x_embedder.proj.weight", what);
  if (patch.size() != 4)
    throw FormatError("'" + p + "x_embedder.proj.weight' is no convolution", f.where);
  const std::int64_t inner = patch[0];
  const std::int64_t layers = count_in_a_row(f, p + "joint_blocks.", ".x_block.attn.qkv.weight");
  const auto pos = shape_of(f, p + "pos_embed", what);
  const auto side =
      static_cast<std::int64_t>(std::llround(std::sqrt(static_cast<double>(pos.at(1)))));
  if (side * side != pos.at(1))
    throw FormatError(
        "'" + p + "pos_embed' holds " + std::to_string(pos.at(1)) + " positions, not a square grid",
        f.where);
  std::vector<std::int64_t> dual;
  for (std::int64_t i = 0; i < layers; ++i)
    if (f.tensors.contains(p + "joint_blocks." + std::to_string(i) + ".x_block.attn2.qkv.weight"))
      dual.push_back(i);
  const std::int64_t out = dim_of(f, p + "final_layer.linear.weight", 0, what);
  nlohmann::json j = {{"_class_name", "SD3Transformer2DModel"},
                      {"sample_size", 128},
                      {"patch_size", patch[2]},
                      {"in_channels", patch[1]},
                      {"num_layers", layers},
                      {"attention_head_dim", 64},
                      {"num_attention_heads", inner % 64 == 0 ? inner / 64 : 1},
                      {"joint_attention_dim", dim_of(f, p + "context_embedder.weight", 1, what)},
                      {"caption_projection_dim", dim_of(f, p + "context_embedder.weight", 0, what)},
                      {"pooled_projection_dim", dim_of(f, p + "y_embedder.mlp.0.weight", 1, what)},
                      {"out_channels", out / (patch[2] * patch[3])},
                      {"pos_embed_max_size", side},
                      {"dual_attention_layers", dual}};
  if (inner % 64 != 0) j["attention_head_dim"] = inner;  // (test models: one head)
  if (f.tensors.contains(p + "joint_blocks.0.x_block.attn.ln_q.weight")) j["qk_norm"] = "rms_norm";
  return j;
}

/// transformers' config of SD3's CLIP-L (`index` 0) or CLIP-G (1), CLIPTextModelWithProjection,
/// told from the keys: CLIP's 64 channels a head, CLIP-L's quick_gelu and CLIP-G's gelu, a
/// projection as wide as the hidden states where the file holds none (CLIP-L's identity).
inline nlohmann::json sd3_clip_config_from_single_file(const SingleFile& f, int index) {
  using namespace single_file_detail;
  require_sd3(f, "text encoder config");
  const std::string p(index == 0 ? kSd3ClipLPrefix : kSd3ClipGPrefix);
  const std::string what = "text encoder config";
  const auto tokens = shape_of(f, p + "text_model.embeddings.token_embedding.weight", what);
  const std::int64_t width = tokens.at(1);
  const std::string projection = p + "text_projection.weight";
  return {
      {"model_type", "clip_text_model"},
      {"architectures", {"CLIPTextModelWithProjection"}},
      {"vocab_size", tokens.at(0)},
      {"hidden_size", width},
      {"max_position_embeddings",
       dim_of(f, p + "text_model.embeddings.position_embedding.weight", 0, what)},
      {"num_hidden_layers", count_in_a_row(f, p + "text_model.encoder.layers.", ".mlp.fc1.weight")},
      {"intermediate_size", dim_of(f, p + "text_model.encoder.layers.0.mlp.fc1.weight", 0, what)},
      {"hidden_act", index == 0 ? "quick_gelu" : "gelu"},
      {"projection_dim", f.tensors.contains(projection) ? dim_of(f, projection, 0, what) : width},
      {"num_attention_heads", width % 64 == 0 ? width / 64 : 1},
      {"bos_token_id", 0},
      {"eos_token_id", 2},
      {"pad_token_id", 1},
      {"layer_norm_eps", 1e-5}};
}

/// transformers' T5EncoderModel config of SD3's T5-XXL, told from the keys (T5-XXL's 64 channels
/// a head; T5 v1.1's gated GELU where the feed-forward has two input projections).
inline nlohmann::json sd3_t5_config_from_single_file(const SingleFile& f) {
  using namespace single_file_detail;
  require_sd3(f, "T5 config");
  const std::string p(kSd3T5Prefix);
  const std::string what = "T5 config";
  const auto shared = shape_of(f, p + "shared.weight", what);
  const std::string block = p + "encoder.block.0.layer.";
  const std::int64_t inner = dim_of(f, block + "0.SelfAttention.q.weight", 0, what);
  const bool gated = f.tensors.contains(block + "1.DenseReluDense.wi_0.weight");
  return {
      {"model_type", "t5"},
      {"architectures", {"T5EncoderModel"}},
      {"vocab_size", shared.at(0)},
      {"d_model", shared.at(1)},
      {"d_kv", inner % 64 == 0 ? 64 : inner},
      {"num_heads", inner % 64 == 0 ? inner / 64 : 1},
      {"d_ff",
       dim_of(f, block + (gated ? "1.DenseReluDense.wi_0.weight" : "1.DenseReluDense.wi.weight"), 0,
              what)},
      {"num_layers", count_in_a_row(f, p + "encoder.block.", ".layer.0.SelfAttention.q.weight")},
      {"relative_attention_num_buckets",
       dim_of(f, block + "0.SelfAttention.relative_attention_bias.weight", 0, what)},
      {"feed_forward_proj", gated ? "gated-gelu" : "relu"}};
}

/// The tensors of an SD3 single file for these models by their original names: the MMDiT and the
/// VAE, and the text encoders that are given (a file without T5, as Stability ships one, when
/// `t5` is null).
template <class Mmdit, class Vae, class Clip, class T5>
std::map<std::string, at::Tensor> stable_diffusion_3_single_file_tensors(
    Mmdit& mmdit, Vae& vae, Clip* clip_l, Clip* clip_g, T5* t5,
    const SingleFileSaveOptions& o = {}) {
  single_file_detail::SingleFileWriter w(o);
  const std::int64_t layers = mmdit->config().num_layers;
  w.put_component(mmdit, kLdmUnetPrefix,
                  [layers](const std::string& n) { return sd3_original_place(n, layers); });
  w.put_vae(vae);
  const auto same = [](const std::string& n) { return OriginalPlace{n}; };
  if (clip_l != nullptr) w.put_component(*clip_l, kSd3ClipLPrefix, same);
  if (clip_g != nullptr) w.put_component(*clip_g, kSd3ClipGPrefix, same);
  if (t5 != nullptr) w.put_component(*t5, kSd3T5Prefix, same);
  return w.finish();
}

}  // namespace difftrain::models
