#pragma once
// The two LoRA files a Stable Diffusion run leaves: `pytorch_lora_weights.safetensors` (PEFT keys
// under "unet.", "text_encoder.", "text_encoder_2.", what diffusers' load_lora_weights reads) and
// `lora_kohya.safetensors` (kohya's keys with an `.alpha` per module, what the web UI, ComfyUI
// and kohya's scripts read).
//
// The PEFT layout keeps no alpha beside its tensors: diffusers takes it from the file's
// `lora_adapter_metadata` (one LoraConfig per component) and, without one, applies alpha = rank.
// So the PEFT file always carries that entry for every component it holds: a run trained at alpha
// != rank loads at the scale it trained at, and both files give the same model.

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/adapters/lora_inject.hpp"
#include "difftrain/adapters/text_encoder_adapters.hpp"
#include "difftrain/adapters/unet_adapters.hpp"
#include "difftrain/adapters/weight_delta.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/io/safetensors.hpp"

namespace difftrain::adapters {

/// The modules of a Stable Diffusion pipeline whose LoRA branches a file holds; a null text
/// encoder is left out (its branches were not trained). `sdxl` names the text encoders as SDXL's
/// files do ("lora_te1_" / "lora_te2_" in kohya's layout).
struct StableDiffusionLoraModules {
  torch::nn::Module* unet = nullptr;
  torch::nn::Module* text_encoder = nullptr;
  torch::nn::Module* text_encoder_2 = nullptr;
  bool sdxl = false;
};

/// The file names a run writes, as diffusers' and kohya's tools name them.
struct StableDiffusionLoraFiles {
  std::filesystem::path peft = "pytorch_lora_weights.safetensors";
  std::filesystem::path kohya = "lora_kohya.safetensors";
};

namespace sd_lora_detail {
/// (component as diffusers names it, module, key options) for each module present.
inline std::vector<std::pair<std::string, std::pair<torch::nn::Module*, LoraKeyOptions>>> parts(
    const StableDiffusionLoraModules& m, LoraLayout layout) {
  if (m.unet == nullptr && m.text_encoder == nullptr && m.text_encoder_2 == nullptr)
    throw ConfigError("names no module", "stable_diffusion_lora_state_dict");
  if (m.text_encoder_2 != nullptr && !m.sdxl)
    throw ConfigError("has a second text encoder but is not marked sdxl",
                      "stable_diffusion_lora_state_dict");
  using Slot = TextEncoderSlot;
  std::vector<std::pair<std::string, std::pair<torch::nn::Module*, LoraKeyOptions>>> out;
  if (m.unet != nullptr) out.push_back({"unet", {m.unet, unet_lora_keys(layout)}});
  if (m.text_encoder != nullptr)
    out.push_back(
        {"text_encoder",
         {m.text_encoder, text_encoder_lora_keys(layout, m.sdxl ? Slot::first : Slot::single)}});
  if (m.text_encoder_2 != nullptr)
    out.push_back(
        {"text_encoder_2", {m.text_encoder_2, text_encoder_lora_keys(layout, Slot::second)}});
  return out;
}
}  // namespace sd_lora_detail

/// Every module's branches in one layout, as one flat map (CPU copies).
inline std::map<std::string, at::Tensor> stable_diffusion_lora_state_dict(
    const StableDiffusionLoraModules& m, LoraLayout layout) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [component, part] : sd_lora_detail::parts(m, layout))
    out.merge(lora_state_dict(*part.first, part.second));
  return out;
}

/// The PEFT file's metadata: diffusers' `lora_adapter_metadata` with a LoraConfig for every
/// component (rank, alpha, per-module patterns, targets), `format` = "pt", and `extra`.
inline std::map<std::string, std::string> stable_diffusion_peft_metadata(
    const StableDiffusionLoraModules& m, std::map<std::string, std::string> extra = {}) {
  nlohmann::json adapter = nlohmann::json::object();
  for (const auto& [component, part] : sd_lora_detail::parts(m, LoraLayout::peft)) {
    add_peft_adapter_metadata(adapter, *part.first, component);
    if (component == "unet") continue;
    // transformers 5's CLIP text models name their modules without the "text_model." that
    // transformers 4's (and difftrain's) have; PEFT matches a target as a name's suffix, so the
    // names without it fit both.
    const auto strip = [](const std::string& name) {
      const std::string head = "text_model.";
      return name.starts_with(head) ? name.substr(head.size()) : name;
    };
    auto& targets = adapter[component + ".target_modules"];
    for (auto& t : targets) t = strip(t.get<std::string>());
    for (const char* field : {".rank_pattern", ".alpha_pattern"}) {
      nlohmann::json renamed = nlohmann::json::object();
      for (const auto& [name, v] : adapter[component + field].items()) renamed[strip(name)] = v;
      adapter[component + field] = renamed;
    }
  }
  return lora_file_metadata(adapter, std::move(extra));
}

/// Writes both files into `folder` (each atomically) and returns their paths. `extra` goes into
/// both files' metadata (the base model, the run's rank and alpha, ...). `peft` false writes
/// kohya's alone (the returned PEFT path is then empty): DoRA per input column has no PEFT form.
inline StableDiffusionLoraFiles save_stable_diffusion_lora_files(
    const std::filesystem::path& folder, const StableDiffusionLoraModules& m,
    const std::map<std::string, std::string>& extra = {},
    const StableDiffusionLoraFiles& names = {}, bool peft = true) {
  StableDiffusionLoraFiles written{peft ? folder / names.peft : std::filesystem::path(),
                                   folder / names.kohya};
  if (peft)
    io::save_safetensors(written.peft, stable_diffusion_lora_state_dict(m, LoraLayout::peft),
                         stable_diffusion_peft_metadata(m, extra));
  auto kohya_meta = extra;
  kohya_meta["format"] = "pt";
  io::save_safetensors(written.kohya, stable_diffusion_lora_state_dict(m, LoraLayout::kohya),
                       kohya_meta);
  return written;
}

/// The same two files for a run that trained LoHa or LoKr adapters (adapters/weight_delta.hpp):
/// `pytorch_lora_weights.safetensors` in PEFT's names under the same component prefixes (what
/// PEFT's LoHaConfig / LoKrConfig take once the prefix is stripped; diffusers' load_lora_weights
/// reads LoRA only), and `lora_kohya.safetensors` in LyCORIS' layout (`lora_unet_…`, `lora_te_…`
/// with `hada_w1_a` / `lokr_w1` ... and an `.alpha` per module), what the web UI's and ComfyUI's
/// LyCORIS readers apply. `extra` goes into both files' metadata.
inline StableDiffusionLoraFiles save_stable_diffusion_weight_delta_files(
    const std::filesystem::path& folder, const StableDiffusionLoraModules& m,
    const std::map<std::string, std::string>& extra = {},
    const StableDiffusionLoraFiles& names = {}) {
  StableDiffusionLoraFiles written{folder / names.peft, folder / names.kohya};
  for (const auto layout : {LoraLayout::peft, LoraLayout::kohya}) {
    std::map<std::string, at::Tensor> tensors;
    for (const auto& [component, part] : sd_lora_detail::parts(m, layout)) {
      auto sd = weight_delta_state_dict(*part.first, part.second);
      if (sd.empty())
        throw ConfigError("the " + component + " has no LoHa or LoKr adapter",
                          "save_stable_diffusion_weight_delta_files");
      tensors.merge(sd);
    }
    auto meta = extra;
    meta["format"] = "pt";
    io::save_safetensors(layout == LoraLayout::peft ? written.peft : written.kohya, tensors, meta);
  }
  return written;
}

}  // namespace difftrain::adapters
