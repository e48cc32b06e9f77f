#pragma once
// Flux.1 single files: Black Forest Labs' `flux1-dev.safetensors` / `flux1-schnell.safetensors`
// (the transformer under its original names) and ComfyUI's (the same under
// `model.diffusion_model.`, maybe beside a VAE and text encoders), as diffusers' single-file
// loader maps them:
//
//   time_in / vector_in / guidance_in .in_layer, .out_layer   time_text_embed's embedders
//   txt_in, img_in                                            context_embedder, x_embedder
//   double_blocks.i. img_mod.lin, txt_mod.lin                 norm1.linear, norm1_context.linear
//                    img_attn.qkv (q, k, v stacked)           attn.to_q, to_k, to_v
//                    txt_attn.qkv                             attn.add_q_proj, add_k_proj,
//                    add_v_proj {img,txt}_attn.norm.{query,key}_norm.scale  attn.norm_q / norm_k /
//                    norm_added_* img_attn.proj, txt_attn.proj             attn.to_out.0,
//                    attn.to_add_out {img,txt}_mlp.0 / .2 ff(_context).net.0.proj / .net.2
//   single_blocks.i. linear1 (q, k, v and the MLP's input)    attn.to_q, to_k, to_v, proj_mlp
//                    linear2, modulation.lin                  proj_out, norm.linear
//                    norm.{query,key}_norm.scale              attn.norm_q / norm_k
//   final_layer.linear, final_layer.adaLN_modulation.1        proj_out, norm_out.linear (shift
//                                                             before scale there, after here)
//
//   auto tensors = models::read_flux_single_file("flux1-dev.safetensors");
//   auto config = models::FluxTransformer2DConfig::from_json(
//       models::flux_transformer_config_from_single_file(tensors), "flux1-dev");
//   auto flux = models::flux_transformer_from_single_file(tensors, config);
//   io::save_safetensors("out.safetensors", models::flux_single_file_tensors(*flux));

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "difftrain/core/error.hpp"
#include "difftrain/io/safetensors.hpp"
#include "difftrain/models/flux_transformer_2d.hpp"

namespace difftrain::models {

inline constexpr std::string_view kComfyModelPrefix = "model.diffusion_model.";

/// One tensor of the original layout and the diffusers tensors it holds, stacked along dim 0 in
/// this order; `swap_halves`: the original keeps the two halves in the other order.
struct FluxOriginalTensor {
  std::string original;
  std::vector<std::string> parts;
  bool swap_halves = false;
};

/// Every tensor of the original layout of a model of `c` (weights, biases, norm scales).
inline std::vector<FluxOriginalTensor> flux_original_table(const FluxTransformer2DConfig& c) {
  std::vector<FluxOriginalTensor> t;
  auto linear = [&](const std::string& original, const std::vector<std::string>& parts,
                    bool swap = false) {
    for (const char* kind : {"weight", "bias"}) {
      std::vector<std::string> named;
      for (const auto& p : parts) named.push_back(p + "." + kind);
      t.push_back({original + "." + kind, named, swap});
    }
  };
  auto embedder = [&](const std::string& original, const std::string& diffusers) {
    linear(original + ".in_layer", {diffusers + ".linear_1"});
    linear(original + ".out_layer", {diffusers + ".linear_2"});
  };
  embedder("time_in", "time_text_embed.timestep_embedder");
  embedder("vector_in", "time_text_embed.text_embedder");
  if (c.guidance_embeds) embedder("guidance_in", "time_text_embed.guidance_embedder");
  linear("txt_in", {"context_embedder"});
  linear("img_in", {"x_embedder"});
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string o = "double_blocks." + std::to_string(i) + ".",
                      d = "transformer_blocks." + std::to_string(i) + ".";
    linear(o + "img_mod.lin", {d + "norm1.linear"});
    linear(o + "txt_mod.lin", {d + "norm1_context.linear"});
    linear(o + "img_attn.qkv", {d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"});
    linear(o + "txt_attn.qkv",
           {d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"});
    t.push_back({o + "img_attn.norm.query_norm.scale", {d + "attn.norm_q.weight"}});
    t.push_back({o + "img_attn.norm.key_norm.scale", {d + "attn.norm_k.weight"}});
    t.push_back({o + "txt_attn.norm.query_norm.scale", {d + "attn.norm_added_q.weight"}});
    t.push_back({o + "txt_attn.norm.key_norm.scale", {d + "attn.norm_added_k.weight"}});
    linear(o + "img_attn.proj", {d + "attn.to_out.0"});
    linear(o + "txt_attn.proj", {d + "attn.to_add_out"});
    linear(o + "img_mlp.0", {d + "ff.net.0.proj"});
    linear(o + "img_mlp.2", {d + "ff.net.2"});
    linear(o + "txt_mlp.0", {d + "ff_context.net.0.proj"});
    linear(o + "txt_mlp.2", {d + "ff_context.net.2"});
  }
  for (std::int64_t i = 0; i < c.num_single_layers; ++i) {
    const std::string o = "single_blocks." + std::to_string(i) + ".",
                      d = "single_transformer_blocks." + std::to_string(i) + ".";
    linear(o + "linear1", {d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"});
    linear(o + "linear2", {d + "proj_out"});
    linear(o + "modulation.lin", {d + "norm.linear"});
    t.push_back({o + "norm.query_norm.scale", {d + "attn.norm_q.weight"}});
    t.push_back({o + "norm.key_norm.scale", {d + "attn.norm_k.weight"}});
  }
  linear("final_layer.linear", {"proj_out"});
  linear("final_layer.adaLN_modulation.1", {"norm_out.linear"}, true);
  return t;
}

namespace flux_file_detail {
inline at::Tensor swap_halves(const at::Tensor& t) {
  const auto halves = t.chunk(2, 0);
  return at::cat({halves[1], halves[0]});
}
/// The model's parameters by name (a Flux transformer has no buffers but an fp8 base's scales,
/// which flux_single_file_tensors refuses).
template <class Model>
std::map<std::string, at::Tensor> named_tensors(Model& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) out[p.key()] = p.value();
  return out;
}
}  // namespace flux_file_detail

/// The transformer's tensors in the original layout (what flux1-dev.safetensors holds), in
/// `dtype` when given (BFL ships bf16). LoRA branches are not part of it: merge them first.
template <class Model>
std::map<std::string, at::Tensor> flux_single_file_tensors(
    Model& model, std::optional<at::ScalarType> dtype = std::nullopt,
    const std::string& prefix = {}) {
  const std::string where = "flux_single_file_tensors";
  auto named = flux_file_detail::named_tensors(model);
  for (const auto& [name, t] : named)
    if (name.find("lora_") != std::string::npos || name.find("lokr_") != std::string::npos ||
        name.find("hada_") != std::string::npos)
      throw ConfigError("holds adapter tensors (" + name +
                            "); a single file holds the base weights: merge the adapters or "
                            "write them as a LoRA file",
                        where);
  std::map<std::string, at::Tensor> out;
  at::NoGradGuard no_grad;
  for (const FluxOriginalTensor& e : flux_original_table(model.config())) {
    std::vector<at::Tensor> parts;
    for (const auto& p : e.parts) {
      const auto it = named.find(p);
      if (it == named.end()) throw ConfigError("the model has no tensor " + p, where);
      parts.push_back(it->second.detach().cpu());
    }
    at::Tensor t = parts.size() == 1 ? parts[0].clone() : at::cat(parts);
    if (e.swap_halves) t = flux_file_detail::swap_halves(t);
    if (t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2)
      throw ConfigError(
          "holds fp8 base weights (" + e.original + "); write the trained model from float weights",
          where);
    out[prefix + e.original] = dtype ? t.to(*dtype).contiguous() : t.contiguous();
  }
  return out;
}

/// A Flux single file's transformer tensors under their original names (ComfyUI's prefix
/// taken off); its other tensors (a VAE, text encoders) in `leftovers` when given. Refuses a
/// file that holds no Flux transformer, naming what it found.
inline std::map<std::string, at::Tensor> read_flux_single_file(
    const std::filesystem::path& file, std::map<std::string, at::Tensor>* leftovers = nullptr) {
  const std::string where = file.string();
  auto all = io::load_safetensors(file).tensors;
  const bool comfy = all.contains(std::string(kComfyModelPrefix) + "img_in.weight");
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : all) {
    if (comfy && name.starts_with(kComfyModelPrefix))
      out[name.substr(kComfyModelPrefix.size())] = t;
    else if (!comfy)
      out[name] = t;
    else if (leftovers != nullptr)
      (*leftovers)[name] = t;
  }
  if (!out.contains("img_in.weight") || !out.contains("txt_in.weight"))
    throw FormatError(
        "holds no Flux transformer (no img_in.weight and txt_in.weight, bare or under " +
            std::string(kComfyModelPrefix) + ")",
        where);
  return out;
}

/// diffusers' transformer config told from a file's shapes: the widths, the block counts, the
/// guidance embedding, the heads (from the query norm's width). The rotary axes are Flux.1's
/// (16, 56, 56) for heads of 128 and must be given otherwise (a config folder).
inline nlohmann::json flux_transformer_config_from_single_file(
    const std::map<std::string, at::Tensor>& t, const std::string& where = "Flux single file") {
  auto shape = [&](const std::string& key) {
    const auto it = t.find(key);
    if (it == t.end()) throw FormatError("lacks " + key, where);
    return it->second.sizes().vec();
  };
  auto count = [&](std::string_view prefix) {
    std::int64_t n = 0;
    while (t.contains(std::string(prefix) + std::to_string(n) + ".linear1.weight") ||
           t.contains(std::string(prefix) + std::to_string(n) + ".img_mod.lin.weight"))
      ++n;
    return n;
  };
  const auto img = shape("img_in.weight"), txt = shape("txt_in.weight"),
             vec = shape("vector_in.in_layer.weight");
  const std::int64_t doubles = count("double_blocks."), singles = count("single_blocks.");
  const std::string norm = doubles > 0 ? "double_blocks.0.img_attn.norm.query_norm.scale"
                                       : "single_blocks.0.norm.query_norm.scale";
  if (doubles + singles == 0) throw FormatError("holds no double or single blocks", where);
  const std::int64_t head = shape(norm).at(0), inner = img.at(0);
  if (inner % head != 0)
    throw FormatError("has a width of " + std::to_string(inner) + ", not a multiple of its " +
                          std::to_string(head) + "-wide heads",
                      where);
  if (head != 128)
    throw ConfigError("has heads of " + std::to_string(head) +
                          " (Flux.1's are 128), whose rotary axes the keys cannot tell: give the "
                          "transformer's config.json (--single_file_config)",
                      where);
  const auto out = shape("final_layer.linear.weight");
  nlohmann::json j = {{"_class_name", "FluxTransformer2DModel"},
                      {"patch_size", 1},
                      {"in_channels", img.at(1)},
                      {"num_layers", doubles},
                      {"num_single_layers", singles},
                      {"attention_head_dim", head},
                      {"num_attention_heads", inner / head},
                      {"joint_attention_dim", txt.at(1)},
                      {"pooled_projection_dim", vec.at(1)},
                      {"guidance_embeds", t.contains("guidance_in.in_layer.weight")},
                      {"axes_dims_rope", {16, 56, 56}}};
  if (out.at(0) != img.at(1)) j["out_channels"] = out.at(0);
  return j;
}

/// The transformer of a Flux single file (`tensors` from read_flux_single_file), built from
/// `config`: every tensor of the original layout is split into the diffusers tensors it holds
/// and checked for shape; a tensor missing, one left over, or a wrong shape is an error naming it.
template <class Holder = FluxTransformer2DModel<>>
Holder flux_transformer_from_single_file(const std::map<std::string, at::Tensor>& tensors,
                                         FluxTransformer2DConfig config,
                                         const std::string& where = "Flux single file") {
  Holder model(std::move(config), where);
  auto named = flux_file_detail::named_tensors(*model);
  std::set<std::string> used;
  at::NoGradGuard no_grad;
  for (const FluxOriginalTensor& e : flux_original_table(model->config())) {
    const auto it = tensors.find(e.original);
    if (it == tensors.end())
      throw FormatError("lacks " + e.original + " (the config names " +
                            std::to_string(model->config().num_layers) + " double and " +
                            std::to_string(model->config().num_single_layers) + " single blocks" +
                            (model->config().guidance_embeds ? ", guidance embeddings" : "") + ")",
                        where);
    used.insert(e.original);
    at::Tensor t = it->second;
    if (e.swap_halves) t = flux_file_detail::swap_halves(t);
    std::int64_t rows = 0;
    for (const auto& p : e.parts) rows += named.at(p).size(0);
    if (t.dim() != named.at(e.parts.front()).dim() || t.size(0) != rows ||
        (t.dim() == 2 && t.size(1) != named.at(e.parts.front()).size(1)))
      throw ConfigError(
          e.original + " has shape " + c10::str(t.sizes()) + "; the config gives " +
              std::to_string(rows) + " rows" +
              (t.dim() == 2 ? " of " + std::to_string(named.at(e.parts.front()).size(1))
                            : std::string()),
          where);
    std::int64_t at_row = 0;
    for (const auto& p : e.parts) {
      at::Tensor& dst = named.at(p);
      dst.copy_(t.narrow(0, at_row, dst.size(0)));
      at_row += dst.size(0);
    }
  }
  for (const auto& [name, t] : tensors)
    if (!used.contains(name))
      throw FormatError("holds " + name + ", which the config's transformer has no place for",
                        where);
  return model;
}

}  // namespace difftrain::models
