#pragma once
// Stable Diffusion checkpoints as one file, the way the web UI, ComfyUI, kohya's scripts and
// stable-diffusion.cpp keep them (a `.safetensors`, or a pickled `.ckpt` with a `state_dict`): the
// UNet, the VAE and the text encoder under their original names (single_file/ldm_names.hpp), as
// diffusers' `from_single_file` reads them and its conversion scripts write them.
//
//   auto file = models::read_single_file("v1-5-pruned-emaonly.safetensors");
//   auto unet = models::unet_from_single_file(file, unet_config);       // diffusers' names
//   auto vae = models::vae_from_single_file(file, vae_config);
//   auto clip = models::clip_from_single_file(file, clip_config);
//   models::save_stable_diffusion_single_file("out.safetensors", unet, vae, clip, {at::kHalf});
//   // SDXL: clip_2_from_single_file and save_stable_diffusion_xl_single_file for both encoders.
//
// The configs come from the caller (a diffusers folder's, as diffusers' `config=`): a file holds
// no config. The family is told by the keys; SD 1.x (CLIP ViT-L under
// `cond_stage_model.transformer.`), SD 2.x (OpenCLIP ViT-H's text tower under
// `cond_stage_model.model.`, q, k and v fused as `in_proj`) and SDXL (CLIP ViT-L and OpenCLIP
// ViT-bigG under `conditioner.embedders.0/1.`) are read and written; SD3 files are recognised and
// refused by name. Every tensor the model has must be in the file with its shape, and every tensor
// the file holds under a component's prefix must be taken, or the file is a FormatError naming the
// first such keys: nothing is guessed or left behind. What a file holds beyond its models
// (OpenCLIP's last layer in SD 2.x, the noise schedule's buffers) goes back into a file written
// with `keep = single_file_leftovers(file)`.

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/safetensors.hpp"
#include "difftrain/io/torch_file.hpp"
#include "difftrain/models/autoencoder_kl.hpp"
#include "difftrain/models/clip_text_model.hpp"
#include "difftrain/models/pretrained.hpp"
#include "difftrain/models/single_file/ldm_names.hpp"
#include "difftrain/models/unet_2d_condition.hpp"

namespace difftrain::models {

/// The families of single files, by their keys.
enum class SingleFileFamily { sd1, sd2, sdxl, sd3 };

inline std::string_view single_file_family_name(SingleFileFamily f) {
  switch (f) {
    case SingleFileFamily::sd1:
      return "Stable Diffusion 1.x";
    case SingleFileFamily::sd2:
      return "Stable Diffusion 2.x";
    case SingleFileFamily::sdxl:
      return "Stable Diffusion XL";
    case SingleFileFamily::sd3:
      return "Stable Diffusion 3";
  }
  return "?";
}

/// A single file's tensors by their original names (memory-mapped for `.safetensors`).
struct SingleFile {
  std::string where;
  std::map<std::string, at::Tensor> tensors;
  SingleFileFamily family = SingleFileFamily::sd1;
  /// The keys the components built from this file so far have taken (single_file_leftovers
  /// gives the rest); a record of reads, not part of the file's value, and not synchronised:
  /// build one file's components from one thread.
  mutable std::set<std::string> taken;
};

namespace single_file_detail {

/// What each family must hold, and where its parts live: the first key that is not there is
/// named when a file fits no family.
struct FamilySignature {
  SingleFileFamily family;
  std::vector<std::string_view> required;
};

inline const std::vector<FamilySignature>& signatures() {
  static const std::vector<FamilySignature> s = {
      {SingleFileFamily::sd3,
       {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight",
        "model.diffusion_model.x_embedder.proj.weight"}},
      {SingleFileFamily::sdxl,
       {"model.diffusion_model.input_blocks.0.0.weight",
        "model.diffusion_model.label_emb.0.0.weight",
        "conditioner.embedders.1.model.ln_final.weight"}},
      {SingleFileFamily::sd2,
       {"model.diffusion_model.input_blocks.0.0.weight", "cond_stage_model.model.ln_final.weight"}},
      {SingleFileFamily::sd1,
       {"model.diffusion_model.input_blocks.0.0.weight", "first_stage_model.encoder.conv_in.weight",
        "cond_stage_model.transformer.text_model.final_layer_norm.weight"}},
  };
  return s;
}

/// The tensors of a `.ckpt`: its `state_dict` (or the file's dict itself).
inline std::map<std::string, at::Tensor> pickled_state_dict(const std::filesystem::path& path) {
  const io::TorchValue root = io::load_torch_file(path);
  if (!root.is_dict())
    throw FormatError("is not a checkpoint (its root is not a dict)", path.string());
  const io::TorchValue& sd = root.contains("state_dict") ? root.at("state_dict") : root;
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, value] : sd.items()) {
    if (!key.isString()) continue;
    // Optimizer states and counters beside the weights are not a model's.
    if (!value.is_tensor()) continue;
    out.emplace(key.toStringRef(), value.tensor());
  }
  return out;
}

/// `t` with the two halves of its rows exchanged (the same both ways).
inline at::Tensor swapped_halves(const at::Tensor& t) {
  const auto halves = t.chunk(2, 0);
  return at::cat({halves[1], halves[0]}, 0);
}

/// The original-layout tensors of one component taken into `model` by name: `place` gives a
/// diffusers name's original one under `prefix` (and, for a tensor the original fuses, which
/// third of it); `reshaped` says which tensors the original keeps in another shape of the same
/// size (1x1 convolutions for linear layers). Every tensor the model has must be found, and every
/// tensor under `prefix` taken, save those `ignored` (by their name after `prefix`).
template <class Holder>
void load_component(Holder& model, const SingleFile& file, std::string_view prefix,
                    const std::function<OriginalPlace(const std::string&)>& place,
                    const std::function<bool(const std::string&)>& reshaped,
                    const std::function<bool(const std::string&)>& ignored,
                    const std::string& what) {
  std::map<std::string, at::Tensor> weights;
  std::set<std::string> taken;
  std::vector<std::string> missing;
  // In the module's order (parameters, then buffers): the first tensor named is the model's first.
  auto take = [&](const std::string& name, const at::Tensor& own) {
    const OriginalPlace spot = place(name);
    const std::string key = std::string(prefix) + spot.name;
    const auto it = file.tensors.find(key);
    if (it == file.tensors.end()) {
      missing.push_back("'" + key + "' (diffusers' '" + name + "')");
      return;
    }
    taken.insert(key);
    at::Tensor t = it->second;
    if (spot.transposed && t.dim() == 2) t = t.t();
    if (spot.halves_swapped) {
      if (t.dim() < 1 || t.size(0) % 2 != 0)
        throw FormatError(
            "'" + key + "' is not two halves of modulation (shape " + c10::str(t.sizes()) + ")",
            file.where);
      t = swapped_halves(t);
    }
    if (spot.third >= 0) {
      const std::int64_t rows = own.size(0);
      if (t.dim() < 1 || t.size(0) != 3 * rows)
        throw FormatError("'" + key + "' is not q, k and v of " + std::to_string(rows) +
                              " rows each (shape " + c10::str(t.sizes()) + ")",
                          file.where);
      t = t.narrow(0, spot.third * rows, rows);
    }
    if (reshaped(name) && t.sizes() != own.sizes() && t.numel() == own.numel())
      t = t.reshape(own.sizes());
    weights.emplace(name, t);
  };
  for (const auto& p : model->named_parameters(true)) take(p.key(), p.value());
  for (const auto& b : model->named_buffers(true)) take(b.key(), b.value());
  if (!missing.empty()) {
    std::string msg =
        "lacks " + std::to_string(missing.size()) + " tensor(s) of the " + what + ": ";
    for (std::size_t i = 0; i < missing.size() && i < 5; ++i) msg += (i ? ", " : "") + missing[i];
    throw FormatError(msg + (missing.size() > 5 ? ", ..." : "") +
                          " (a file of another layout, or of a model with another config?)",
                      file.where);
  }
  std::vector<std::string> left;
  for (auto it = file.tensors.lower_bound(std::string(prefix));
       it != file.tensors.end() && it->first.starts_with(prefix); ++it)
    if (!taken.contains(it->first) && !ignored(it->first.substr(prefix.size())))
      left.push_back(it->first);
  if (!left.empty()) {
    std::string msg = "holds " + std::to_string(left.size()) + " tensor(s) under '" +
                      std::string(prefix) + "' the " + what + " of this config has no place for: ";
    for (std::size_t i = 0; i < left.size() && i < 5; ++i) msg += (i ? ", " : "") + left[i];
    throw FormatError(msg + (left.size() > 5 ? ", ..." : "") +
                          " (the config describes a smaller model than the file)",
                      file.where);
  }
  load_weights(*model, weights, file.where + " (" + what + ")");
  file.taken.insert(taken.begin(), taken.end());
}

/// Nothing under the prefix is left aside.
inline bool nothing(const std::string&) { return false; }

}  // namespace single_file_detail

/// Which family a single file's keys belong to; a file of none is a FormatError naming the family
/// it comes closest to and the keys it lacks for it.
inline SingleFileFamily single_file_family(const std::map<std::string, at::Tensor>& tensors,
                                           const std::string& where) {
  const single_file_detail::FamilySignature* closest = nullptr;
  std::size_t best = 0;
  for (const auto& s : single_file_detail::signatures()) {
    std::size_t have = 0;
    for (const auto key : s.required) have += tensors.contains(std::string(key)) ? 1 : 0;
    if (have == s.required.size()) return s.family;
    if (closest == nullptr || have > best) {
      closest = &s;
      best = have;
    }
  }
  std::string lacks;
  for (const auto key : closest->required)
    if (!tensors.contains(std::string(key)))
      lacks += (lacks.empty() ? "'" : ", '") + std::string(key) + "'";
  throw FormatError("is no Stable Diffusion single file difftrain knows (" +
                        std::to_string(tensors.size()) + " tensors); it comes closest to " +
                        std::string(single_file_family_name(closest->family)) + " but lacks " +
                        lacks,
                    where);
}

/// Reads a single file (`.safetensors` memory-mapped, `.ckpt`/`.pt` through the bounded pickle
/// reader) and tells its family. `use_ema`: the UNet's EMA weights (`model_ema.*`, the web UI's
/// and the original trainer's) stand in for the trained ones; a file without them is refused.
inline SingleFile read_single_file(const std::filesystem::path& path, bool use_ema = false) {
  SingleFile f;
  f.where = path.string();
  const std::string ext = path.extension().string();
  if (ext == ".ckpt" || ext == ".pt" || ext == ".pth" || ext == ".bin")
    f.tensors = single_file_detail::pickled_state_dict(path);
  else
    f.tensors = io::load_safetensors(path).tensors;
  f.family = single_file_family(f.tensors, f.where);
  if (use_ema) {
    // The original EMA keeps each tensor as "model_ema." + its name after "model." without dots.
    std::size_t found = 0;
    for (auto& [key, t] : f.tensors) {
      if (!key.starts_with(kLdmUnetPrefix)) continue;
      std::string flat = "model_ema.";
      for (const char ch : key.substr(6))
        if (ch != '.') flat += ch;
      const auto it = f.tensors.find(flat);
      if (it == f.tensors.end()) continue;
      t = it->second;
      ++found;
    }
    if (found == 0)
      throw ConfigError("holds no EMA weights (model_ema.*) to use in place of the trained ones",
                        f.where);
  }
  // The EMA copies are not a component's: they are used above or left.
  for (auto it = f.tensors.begin(); it != f.tensors.end();)
    it = it->first.starts_with("model_ema.") ? f.tensors.erase(it) : std::next(it);
  return f;
}

namespace single_file_detail {
/// SD 1.x, 2.x and SDXL files hold a UNet and VAE in the same layout.
inline void require_unet_family(const SingleFile& f, std::string_view what) {
  if (f.family == SingleFileFamily::sd3)
    throw ConfigError(
        "is a " + std::string(single_file_family_name(f.family)) + " file; its " +
            std::string(what) +
            " is not read from single files yet (Stable Diffusion 1.x, 2.x and XL are)",
        f.where);
}

/// Where a family keeps its text encoder `index` (0, or SDXL's 1), and whether in OpenCLIP's
/// layout (else transformers' names).
struct TextEncoderLayout {
  std::string_view prefix;
  bool openclip = false;
};

inline TextEncoderLayout text_encoder_layout(SingleFileFamily family, int index,
                                             const std::string& where) {
  if (index == 0 && family == SingleFileFamily::sd1) return {kLdmClipPrefix, false};
  if (index == 0 && family == SingleFileFamily::sd2) return {kLdmOpenClipPrefix, true};
  if (index == 0 && family == SingleFileFamily::sdxl) return {kSdxlClipPrefix, false};
  if (index == 1 && family == SingleFileFamily::sdxl) return {kSdxlOpenClipPrefix, true};
  throw ConfigError("is a " + std::string(single_file_family_name(family)) + " file, which has " +
                        (index == 1 ? "no second text encoder (SDXL's files have)"
                                    : "no text encoder difftrain reads yet"),
                    where);
}

/// A text encoder in `layout` taken into `model`. OpenCLIP's towers hold more than transformers'
/// encoder: the layers past the config's (SD 2.x reads the penultimate layer: diffusers' config has
/// 23 of OpenCLIP's 24), `logit_scale`, `attn_mask` and, for an encoder without projection,
/// `text_projection` are left aside as diffusers leaves them; transformers' `position_ids`
/// likewise.
template <class Holder>
void load_text_encoder(Holder& model, const SingleFile& f, TextEncoderLayout layout,
                       const std::string& what) {
  if (!layout.openclip) {
    load_component(
        model, f, layout.prefix, [](const std::string& n) { return OriginalPlace{n}; }, nothing,
        [](const std::string& rest) { return rest == "text_model.embeddings.position_ids"; }, what);
    return;
  }
  const std::int64_t layers = model->config().num_hidden_layers;
  load_component(
      model, f, layout.prefix, openclip_place, nothing,
      [layers](const std::string& rest) {
        if (rest == "text_projection" || rest == "logit_scale" || rest == "attn_mask") return true;
        constexpr std::string_view blocks = "transformer.resblocks.";
        if (!rest.starts_with(blocks)) return false;
        const std::string n =
            rest.substr(blocks.size(), rest.find('.', blocks.size()) - blocks.size());
        return !n.empty() && n.size() < 7 &&
               n.find_first_not_of("0123456789") == std::string::npos && std::stoll(n) >= layers;
      },
      what);
}
}  // namespace single_file_detail

/// The UNet of an SD 1.x, 2.x or XL single file, built from `config` (diffusers' UNet config of
/// the file's model: the file holds none).
template <class Holder = UNet2DConditionModel<>>
Holder unet_from_single_file(const SingleFile& f, UNet2DConditionConfig config) {
  single_file_detail::require_unet_family(f, "UNet");
  auto model = built_to_load<Holder>(std::move(config), f.where);
  const auto& c = model->config();
  single_file_detail::load_component(
      model, f, kLdmUnetPrefix,
      [&](const std::string& n) { return OriginalPlace{ldm_unet_name(n, c)}; },
      single_file_detail::nothing, single_file_detail::nothing, "UNet");
  return model;
}

/// The VAE of a single file of any family (its mid-block attention's 1x1 convolutions as linear
/// layers; SD3's with 16 latent channels and no quant convolutions).
template <class Holder = AutoencoderKL<>>
Holder vae_from_single_file(const SingleFile& f, AutoencoderKLConfig config) {
  auto model = built_to_load<Holder>(std::move(config), f.where);
  const auto& c = model->config();
  single_file_detail::load_component(
      model, f, kLdmVaePrefix,
      [&](const std::string& n) { return OriginalPlace{ldm_vae_name(n, c)}; },
      ldm_vae_conv_as_linear, single_file_detail::nothing, "VAE");
  return model;
}

/// The (first) text encoder of a single file: SD 1.x's CLIP ViT-L, SD 2.x's OpenCLIP ViT-H (q, k
/// and v thirds of OpenCLIP's fused `in_proj`), SDXL's CLIP ViT-L.
template <class Holder = CLIPTextModel<>>
Holder clip_from_single_file(const SingleFile& f, CLIPTextConfig config) {
  const auto layout = single_file_detail::text_encoder_layout(f.family, 0, f.where);
  auto model = built_to_load<Holder>(std::move(config), f.where);
  single_file_detail::load_text_encoder(model, f, layout, "text encoder");
  return model;
}

/// SDXL's second text encoder, OpenCLIP ViT-bigG's text tower, as transformers'
/// CLIPTextModelWithProjection (`config.with_projection`): its text_projection is OpenCLIP's,
/// transposed.
template <class Holder = CLIPTextModel<>>
Holder clip_2_from_single_file(const SingleFile& f, CLIPTextConfig config) {
  const auto layout = single_file_detail::text_encoder_layout(f.family, 1, f.where);
  auto model = built_to_load<Holder>(std::move(config), f.where);
  single_file_detail::load_text_encoder(model, f, layout, "second text encoder");
  return model;
}

/// What a file holds that no component built from it so far has taken, by name: OpenCLIP's last
/// layer and projection in SD 2.x files, the noise schedule's buffers the original trainers saved.
/// Given as SingleFileSaveOptions::keep, a fine-tune written back holds every key its base had.
inline std::map<std::string, at::Tensor> single_file_leftovers(const SingleFile& f) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, t] : f.tensors)
    if (!f.taken.contains(key)) out.emplace(key, t);
  return out;
}

struct SingleFileSaveOptions {
  /// The floating-point tensors in this dtype (the web UI's fp16 files); none: as trained.
  std::optional<at::ScalarType> dtype;
  /// sd1: the text encoder as CLIP ViT-L under cond_stage_model.transformer.; sd2: as OpenCLIP's
  /// text tower under cond_stage_model.model. (q, k, v fused as in_proj). SDXL files are written
  /// by the functions that take both text encoders.
  SingleFileFamily family = SingleFileFamily::sd1;
  /// Tensors written beside the models' as they are (in `dtype`), where no model tensor has their
  /// name: what the file a model was read from held beyond it (single_file_leftovers).
  std::map<std::string, at::Tensor> keep = {};
};

namespace single_file_detail {

/// Adds tensors under their original names, in the options' dtype, each name once.
class SingleFileWriter {
 public:
  explicit SingleFileWriter(const SingleFileSaveOptions& o) : o_(o) {}

  void put(const std::string& key, const at::Tensor& t) {
    if (!out_.emplace(key, stored(t)).second) throw ConfigError("two tensors map to one name", key);
  }

  template <class Module, class F>
  void each_tensor(Module& m, F&& f) {
    for (const auto& p : m->named_parameters(true)) f(p.key(), p.value());
    for (const auto& b : m->named_buffers(true)) f(b.key(), b.value());
  }

  template <class Unet, class Vae>
  void put_unet_and_vae(Unet& unet, Vae& vae) {
    const auto& uc = unet->config();
    each_tensor(unet, [&](const std::string& n, const at::Tensor& t) {
      put(std::string(kLdmUnetPrefix) + ldm_unet_name(n, uc), t);
    });
    put_vae(vae);
  }

  template <class Vae>
  void put_vae(Vae& vae) {
    const auto& vc = vae->config();
    each_tensor(vae, [&](const std::string& n, const at::Tensor& t) {
      // The original's attention projections are 1x1 convolutions.
      put(std::string(kLdmVaePrefix) + ldm_vae_name(n, vc),
          ldm_vae_conv_as_linear(n) && t.dim() == 2 ? t.unsqueeze(-1).unsqueeze(-1) : t);
    });
  }

  template <class Clip>
  void put_text_encoder(Clip& clip, TextEncoderLayout layout) {
    if (layout.openclip) {  // q, k and v fused in in_proj, the projection transposed
      put_component(clip, layout.prefix, openclip_place);
      return;
    }
    put_component(clip, layout.prefix, [](const std::string& n) { return OriginalPlace{n}; });
    // The original CLIP keeps its position ids as a buffer (the files in the wild hold it).
    const std::string ids = std::string(layout.prefix) + "text_model.embeddings.position_ids";
    if (!out_.contains(ids))
      out_.emplace(ids, at::arange(clip->config().max_position_embeddings, at::kLong).unsqueeze(0));
  }

  /// Every tensor of `m` under `prefix` + its original place (q, k and v of one original
  /// tensor joined, transposed or half-swapped ones restored).
  template <class Module>
  void put_component(Module& m, std::string_view prefix,
                     const std::function<OriginalPlace(const std::string&)>& place) {
    std::map<std::string, std::array<at::Tensor, 3>> fused;
    each_tensor(m, [&](const std::string& n, const at::Tensor& value) {
      const OriginalPlace spot = place(n);
      at::Tensor t = value.detach();
      if (spot.transposed) t = t.t();
      if (spot.halves_swapped) t = swapped_halves(t);
      if (spot.third >= 0)
        fused[spot.name][static_cast<std::size_t>(spot.third)] = t;
      else
        put(std::string(prefix) + spot.name, t);
    });
    for (const auto& [name, parts] : fused) {
      for (const auto& part : parts)
        if (!part.defined())
          throw ConfigError("has only some of q, k and v of one original tensor", name);
      put(std::string(prefix) + name, at::cat({parts[0], parts[1], parts[2]}, 0));
    }
  }

  std::map<std::string, at::Tensor> finish() {
    for (const auto& [key, t] : o_.keep)
      if (!out_.contains(key)) out_.emplace(key, stored(t));
    return std::move(out_);
  }

 private:
  at::Tensor stored(const at::Tensor& t) const {
    at::Tensor v = t.detach().to(at::kCPU).contiguous();
    if (o_.dtype && at::isFloatingType(v.scalar_type())) v = v.to(*o_.dtype);
    return v;
  }

  const SingleFileSaveOptions& o_;
  std::map<std::string, at::Tensor> out_;
};

}  // namespace single_file_detail

/// The tensors of an SD 1.x or 2.x single file for these models, by their original names.
template <class Unet, class Vae, class Clip>
std::map<std::string, at::Tensor> stable_diffusion_single_file_tensors(
    Unet& unet, Vae& vae, Clip& clip, const SingleFileSaveOptions& o = {}) {
  if (o.family != SingleFileFamily::sd1 && o.family != SingleFileFamily::sd2)
    throw ConfigError(
        "writes Stable Diffusion 1.x and 2.x single files here (SDXL's: "
        "stable_diffusion_xl_single_file_tensors, with both text encoders)",
        "SingleFileSaveOptions::family");
  single_file_detail::SingleFileWriter w(o);
  w.put_unet_and_vae(unet, vae);
  w.put_text_encoder(clip, single_file_detail::text_encoder_layout(o.family, 0, "family"));
  return w.finish();
}

/// The tensors of an SDXL single file (`o.family` is not read): CLIP ViT-L under
/// conditioner.embedders.0.transformer., `clip_2` as OpenCLIP ViT-bigG's tower under
/// conditioner.embedders.1.model.
template <class Unet, class Vae, class Clip, class Clip2>
std::map<std::string, at::Tensor> stable_diffusion_xl_single_file_tensors(
    Unet& unet, Vae& vae, Clip& clip, Clip2& clip_2, const SingleFileSaveOptions& o = {}) {
  if (!clip_2->config().with_projection)
    throw ConfigError(
        "SDXL's second text encoder is a CLIPTextModelWithProjection (its text_projection is "
        "OpenCLIP's); this one has no projection",
        "clip_2");
  single_file_detail::SingleFileWriter w(o);
  w.put_unet_and_vae(unet, vae);
  using single_file_detail::text_encoder_layout;
  w.put_text_encoder(clip, text_encoder_layout(SingleFileFamily::sdxl, 0, "clip"));
  w.put_text_encoder(clip_2, text_encoder_layout(SingleFileFamily::sdxl, 1, "clip_2"));
  return w.finish();
}

/// Writes an SD 1.x or 2.x single file (safetensors, atomically) that the web UI, ComfyUI and
/// diffusers' `from_single_file` load.
template <class Unet, class Vae, class Clip>
void save_stable_diffusion_single_file(const std::filesystem::path& path, Unet& unet, Vae& vae,
                                       Clip& clip, const SingleFileSaveOptions& o = {}) {
  io::save_safetensors(path, stable_diffusion_single_file_tensors(unet, vae, clip, o),
                       {{"format", "pt"}});
}

/// Writes an SDXL single file (safetensors, atomically) that the web UI, ComfyUI and diffusers'
/// `StableDiffusionXLPipeline.from_single_file` load.
template <class Unet, class Vae, class Clip, class Clip2>
void save_stable_diffusion_xl_single_file(const std::filesystem::path& path, Unet& unet, Vae& vae,
                                          Clip& clip, Clip2& clip_2,
                                          const SingleFileSaveOptions& o = {}) {
  io::save_safetensors(path, stable_diffusion_xl_single_file_tensors(unet, vae, clip, clip_2, o),
                       {{"format", "pt"}});
}

}  // namespace difftrain::models
