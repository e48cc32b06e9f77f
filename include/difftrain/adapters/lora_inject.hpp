#pragma once
// Putting LoRA branches into a model and taking them out as files.
//
//   * `inject_lora(model, {.target_modules = {"to_q", "to_k", "to_v", "to_out.0"}}, {.rank = 8})`
//     attaches a branch to every adaptable layer whose name matches (PEFT's rule for a list: the
//     name equals a target or ends with "." + target; or one regex that must match the whole name),
//     and freezes every other parameter. A match that cannot carry a branch, or no match at all, is
//     a ConfigError naming it.
//   * `lora_state_dict(model, layout)`: the branches' tensors under PEFT / diffusers names
//     (`<prefix><module>.lora_A.weight`, `.lora_B.weight`) or kohya's (`lora_unet_<module with
//     "_">.lora_down.weight`, `.lora_up.weight`, `.alpha`); `load_lora_state_dict` attaches and
//     fills branches from either, checking every key and shape.
//   * `add_peft_adapter_metadata` / `lora_file_metadata`: the `lora_adapter_metadata` header entry
//     diffusers' save_lora_weights writes and load_lora_weights reads (the PEFT LoraConfig per
//     component: rank, alpha, targets), so a reader applies the branches at the trained scale;
//     `peft_lora_defaults` reads it back.
//   * `sat_to_diffusers_lora_key` / `diffusers_to_sat_lora_key` and the whole-map
//     `sat_to_diffusers_lora` / `diffusers_to_sat_lora`: CogVideoX SAT checkpoint keys to
//     diffusers' and back (seed 003's table).

#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "difftrain/adapters/lora.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/core/python_strings.hpp"
#include "difftrain/io/json_parse.hpp"

namespace difftrain::adapters {

struct LoraTargets {
  std::vector<std::string> target_modules{};  ///< PEFT list rule (name == t or ends with "." + t)
  std::optional<std::string> target_regex{};  ///< or a regex matched against the whole name
};

namespace lora_inject_detail {
inline bool matches(const std::string& name, const LoraTargets& t, const std::regex* re) {
  if (re != nullptr) return std::regex_match(name, *re);
  for (const auto& target : t.target_modules)
    if (name == target || (name.size() > target.size() &&
                           name.compare(name.size() - target.size(), target.size(), target) == 0 &&
                           name[name.size() - target.size() - 1] == '.'))
      return true;
  return false;
}
inline LoraHost* host_of(const std::shared_ptr<torch::nn::Module>& m) {
  return dynamic_cast<LoraHost*>(m.get());
}
}  // namespace lora_inject_detail

/// Every module of `root` that carries a LoRA branch, by name.
inline std::vector<std::pair<std::string, LoraHost*>> lora_layers(torch::nn::Module& root) {
  std::vector<std::pair<std::string, LoraHost*>> out;
  for (const auto& item : root.named_modules("", /*include_self=*/false))
    if (auto* h = lora_inject_detail::host_of(item.value()); h != nullptr && h->has_lora())
      out.emplace_back(item.key(), h);
  return out;
}

/// Only parameters inside LoRA branches stay trainable.
inline void freeze_all_but_lora(torch::nn::Module& root) {
  for (auto& item : root.named_parameters(true))
    item.value().set_requires_grad(item.key().find("lora_") != std::string::npos);
}

/// A layer's own rank and alpha (kohya's block_dims, PEFT's rank_pattern): the options for the
/// module named, or none to leave it without a branch (kohya's dim 0).
using LoraOptionsOf = std::function<std::optional<LoraOptions>(const std::string& module)>;

namespace lora_inject_detail {
inline std::vector<std::string> inject(torch::nn::Module& root, const LoraTargets& targets,
                                       const LoraOptionsOf& options_of) {
  const std::string where = "inject_lora";
  if (targets.target_modules.empty() && !targets.target_regex)
    throw ConfigError("names no target modules", where);
  std::optional<std::regex> re;
  if (targets.target_regex) {
    try {
      re.emplace(*targets.target_regex);
    } catch (const std::regex_error& e) {
      throw ConfigError("target regex '" + *targets.target_regex + "' is invalid: " + e.what(),
                        where);
    }
  }
  std::vector<std::string> adapted;
  for (const auto& item : root.named_modules("", false)) {
    const std::string& name = item.key();
    if (!lora_inject_detail::matches(name, targets, re ? &*re : nullptr)) continue;
    auto* host = lora_inject_detail::host_of(item.value());
    if (host == nullptr)
      throw ConfigError("module '" + name + "' (" + item.value()->name() +
                            ") matches the targets but cannot carry a LoRA branch; build it from "
                            "AdaptableLinear / AdaptableConv2d",
                        where);
    const std::optional<LoraOptions> options = options_of(name);
    if (!options) continue;
    options->validate(where + " (" + name + ")");
    host->attach_lora(*options);
    adapted.push_back(name);
  }
  if (adapted.empty()) throw ConfigError("no module matches the targets", where);
  freeze_all_but_lora(root);
  return adapted;
}
}  // namespace lora_inject_detail

/// Attaches a branch to each matching layer with the options `options_of(name)` gives it (a
/// layer it gives none is left as it is), freezes the rest; returns the adapted names.
template <class OptionsOf>
requires std::is_invocable_r_v < std::optional<LoraOptions>, OptionsOf,
const std::string& > std::vector<std::string> inject_lora(torch::nn::Module& root,
                                                          const LoraTargets& targets,
                                                          OptionsOf&& options_of) {
  return lora_inject_detail::inject(root, targets, LoraOptionsOf(options_of));
}

/// The same with one set of options for every layer.
inline std::vector<std::string> inject_lora(torch::nn::Module& root, const LoraTargets& targets,
                                            const LoraOptions& options) {
  options.validate("inject_lora");
  return lora_inject_detail::inject(root, targets, [&](const std::string&) { return options; });
}

enum class LoraLayout {
  peft,   ///< `<prefix><module>.lora_A.weight` / `.lora_B.weight` (PEFT, diffusers)
  kohya,  ///< `<prefix><module_with_underscores>.lora_down.weight` / `.lora_up.weight` / `.alpha`
};

struct LoraKeyOptions {
  LoraLayout layout = LoraLayout::peft;
  std::string prefix{};  ///< peft: e.g. "unet." or "transformer."; kohya: e.g. "lora_unet_"
  /// PEFT's DoRA magnitude as `<module>.lora_magnitude_vector.weight` rather than PEFT's own
  /// `<module>.lora_magnitude_vector`: transformers' adapter loader, through which diffusers
  /// loads a text encoder's LoRA, reads only the former (PEFT's reader takes both).
  bool magnitude_as_weight = false;
};

inline std::string kohya_name(const std::string& module) {
  std::string s = module;
  for (char& c : s)
    if (c == '.') c = '_';
  return s;
}

/// The branches of `root` as a flat tensor map in the chosen layout (CPU copies).
inline std::map<std::string, at::Tensor> lora_state_dict(torch::nn::Module& root,
                                                         const LoraKeyOptions& k = {}) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, h] : lora_layers(root)) {
    const at::Tensor a = h->lora_a().detach().cpu().clone(), b = h->lora_b().detach().cpu().clone();
    const at::Tensor m = h->lora_magnitude();  // DoRA's, else undefined
    if (k.layout == LoraLayout::peft) {
      out[k.prefix + name + ".lora_A.weight"] = a;
      out[k.prefix + name + ".lora_B.weight"] = b;
      if (m.defined()) {
        if (h->lora_options().dora_axis != DoraAxis::output)
          throw ConfigError(
              "has DoRA per input column, which PEFT and diffusers cannot hold (they normalise "
              "per output row); write kohya's layout (dora_scale) instead",
              "lora_state_dict module '" + name + "'");
        // PEFT's shapes: (out) for a linear layer, (1, out, 1, 1) for a convolution.
        out[k.prefix + name + ".lora_magnitude_vector" + (k.magnitude_as_weight ? ".weight" : "")] =
            (m.dim() == 2 ? m.reshape({-1}) : m.reshape({1, -1, 1, 1})).detach().cpu().clone();
      }
    } else {
      const std::string base = k.prefix + kohya_name(name);
      out[base + ".lora_down.weight"] = a;
      out[base + ".lora_up.weight"] = b;
      out[base + ".alpha"] = at::scalar_tensor(
          h->lora_options().alpha.value_or(static_cast<double>(h->lora_options().rank)),
          at::kFloat);
      // LyCORIS' shapes: (out, 1, ...) per output row, (1, in, ...) per input column.
      if (m.defined()) out[base + ".dora_scale"] = m.detach().cpu().clone();
    }
  }
  return out;
}

/// Adds the PEFT LoraConfig of `root`'s branches to diffusers' `lora_adapter_metadata` object
/// under "<component>." ("transformer", "unet", "text_encoder", ...): `r` and `lora_alpha` of the
/// most common branch, `rank_pattern` / `alpha_pattern` for the others by module name,
/// `target_modules` (every adapted module), `lora_dropout`, and PEFT's defaults for the rest.
/// diffusers builds the adapter from these; without them it takes alpha = rank (scale 1).
inline void add_peft_adapter_metadata(nlohmann::json& into, torch::nn::Module& root,
                                      const std::string& component) {
  const auto layers = lora_layers(root);
  if (layers.empty())
    throw ConfigError("the model has no LoRA branches", "add_peft_adapter_metadata " + component);
  std::map<std::pair<std::int64_t, double>, int> votes;
  std::size_t dora = 0;
  for (const auto& [name, h] : layers) {
    const auto& o = h->lora_options();
    ++votes[{o.rank, o.alpha.value_or(static_cast<double>(o.rank))}];
    if (o.use_dora) {
      ++dora;
      if (o.dora_axis != DoraAxis::output)
        throw ConfigError("module '" + name +
                              "' has DoRA per input column; PEFT's config holds only the "
                              "per-output-row form",
                          "add_peft_adapter_metadata " + component);
    }
  }
  if (dora != 0 && dora != layers.size())
    throw ConfigError("mixes DoRA and plain LoRA branches; PEFT's config holds one use_dora",
                      "add_peft_adapter_metadata " + component);
  auto common = votes.begin();
  for (auto it = votes.begin(); it != votes.end(); ++it)
    if (it->second > common->second) common = it;
  const auto [rank, alpha] = common->first;
  nlohmann::json targets = nlohmann::json::array(), rank_pattern = nlohmann::json::object(),
                 alpha_pattern = nlohmann::json::object();
  double dropout = 0.0;
  for (const auto& [name, h] : layers) {
    const auto& o = h->lora_options();
    targets.push_back(name);
    dropout = std::max(dropout, o.dropout);
    if (o.rank != rank) rank_pattern[name] = o.rank;
    const double a = o.alpha.value_or(static_cast<double>(o.rank));
    if (a != alpha) alpha_pattern[name] = a;
  }
  const std::string p = component + ".";
  into[p + "r"] = rank;
  into[p + "lora_alpha"] = alpha;
  into[p + "target_modules"] = targets;
  into[p + "lora_dropout"] = dropout;
  into[p + "rank_pattern"] = rank_pattern;
  into[p + "alpha_pattern"] = alpha_pattern;
  into[p + "bias"] = "none";
  into[p + "init_lora_weights"] = true;
  into[p + "use_dora"] = dora != 0;
  into[p + "use_rslora"] = false;
}

/// A LoRA file's safetensors metadata with diffusers' adapter entry (as its save_lora_weights
/// writes it: sorted keys, indented) and any `extra` entries.
inline std::map<std::string, std::string> lora_file_metadata(
    const nlohmann::json& adapter_metadata, std::map<std::string, std::string> extra = {}) {
  extra["format"] = "pt";
  extra["lora_adapter_metadata"] = adapter_metadata.dump(2);  // nlohmann objects are sorted
  return extra;
}

/// Reads alpha (and dropout) of `module`'s branch from a file's metadata as diffusers does:
/// `alpha_pattern[module]`, else `lora_alpha`, else (no entry for the component) alpha = the
/// branch's rank, diffusers' default. `rank` is the rank the tensors have.
inline LoraOptions peft_lora_defaults(const std::map<std::string, std::string>& file_metadata,
                                      const std::string& component, const std::string& module,
                                      std::int64_t rank) {
  LoraOptions o;
  o.rank = rank;
  const auto it = file_metadata.find("lora_adapter_metadata");
  if (it == file_metadata.end()) return o;
  const nlohmann::json j = io::parse_json(it->second, "lora_adapter_metadata");
  const std::string p = component + ".";
  try {
    if (j.contains(p + "alpha_pattern") && j[p + "alpha_pattern"].contains(module))
      o.alpha = j[p + "alpha_pattern"][module].get<double>();
    else if (j.contains(p + "lora_alpha"))
      o.alpha = j[p + "lora_alpha"].get<double>();
    if (j.contains(p + "lora_dropout")) o.dropout = j[p + "lora_dropout"].get<double>();
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(std::string("has a field of the wrong type: ") + e.what(),
                      "lora_adapter_metadata " + component);
  }
  return o;
}

namespace lora_inject_detail {
/// DoRA's axis from a file's magnitude: PEFT's is always per output row ((out) or (1, out, 1,
/// 1)); kohya's / LyCORIS' `dora_scale` is (out, 1, ...) per output row or (1, in, ...) per input
/// column, told apart by its first axis as ComfyUI does.
inline DoraAxis dora_axis_of(const at::Tensor& m, const at::Tensor& b, const at::Tensor& a,
                             bool peft, const std::string& where) {
  const std::int64_t out = b.size(0), in = a.size(1);
  if (peft) {
    if (m.numel() != out)
      throw FormatError("lora_magnitude_vector has " + std::to_string(m.numel()) +
                            " values; the layer has " + std::to_string(out) + " outputs",
                        where);
    return DoraAxis::output;
  }
  if (m.dim() >= 2 && m.size(0) == out && m.numel() == out) return DoraAxis::output;
  if (m.dim() >= 2 && m.size(0) == 1 && m.size(1) == in && m.numel() == in) return DoraAxis::input;
  throw FormatError("dora_scale " + c10::str(m.sizes()) + " is neither (" + std::to_string(out) +
                        ", 1, ...) nor (1, " + std::to_string(in) + ", ...)",
                    where);
}
}  // namespace lora_inject_detail

/// Attaches (where missing) and fills the branches named in `tensors`; every key must name an
/// adaptable layer of `root` and every shape must fit. `defaults` gives alpha and dropout where
/// the layout does not store them (PEFT keeps alpha in its adapter_config.json).
inline std::vector<std::string> load_lora_state_dict(
    torch::nn::Module& root, const std::map<std::string, at::Tensor>& tensors,
    const LoraKeyOptions& k = {}, const LoraOptions& defaults = {}) {
  const std::string where = "load_lora_state_dict";
  // Module name → (A, B, alpha) from the keys.
  struct Parts {
    at::Tensor a, b, magnitude;
    std::optional<double> alpha;
  };
  std::map<std::string, Parts> parts;
  std::map<std::string, std::string> kohya_to_module;
  std::map<std::string, LoraHost*> hosts;
  for (const auto& item : root.named_modules("", false))
    if (auto* h = lora_inject_detail::host_of(item.value()); h != nullptr) {
      hosts[item.key()] = h;
      kohya_to_module[kohya_name(item.key())] = item.key();
    }
  auto strip = [&](const std::string& key,
                   const std::string& suffix) -> std::optional<std::string> {
    if (key.size() < k.prefix.size() + suffix.size() ||
        key.compare(0, k.prefix.size(), k.prefix) != 0 ||
        key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0)
      return std::nullopt;
    return key.substr(k.prefix.size(), key.size() - k.prefix.size() - suffix.size());
  };
  for (const auto& [key, t] : tensors) {
    const bool peft = k.layout == LoraLayout::peft;
    const char* sa = peft ? ".lora_A.weight" : ".lora_down.weight";
    const char* sb = peft ? ".lora_B.weight" : ".lora_up.weight";
    std::optional<std::string> m;
    int which = -1;
    if ((m = strip(key, sa)))
      which = 0;
    else if ((m = strip(key, sb)))
      which = 1;
    else if (!peft && (m = strip(key, ".alpha")))
      which = 2;
    else if ((m = strip(key, peft ? ".lora_magnitude_vector" : ".dora_scale")) ||
             (peft && (m = strip(key, ".lora_magnitude_vector.weight"))))
      which = 3;
    if (which < 0)
      throw FormatError("is not a LoRA key of this layout", where + " key '" + key + "'");
    std::string module = *m;
    if (!peft) {
      const auto it = kohya_to_module.find(module);
      if (it == kohya_to_module.end())
        throw ConfigError("names no adaptable layer of the model", where + " key '" + key + "'");
      module = it->second;
    }
    if (!hosts.count(module))
      throw ConfigError("names no adaptable layer of the model", where + " key '" + key + "'");
    Parts& p = parts[module];
    if (which == 0)
      p.a = t;
    else if (which == 1)
      p.b = t;
    else if (which == 3)
      p.magnitude = t;
    else {
      if (t.numel() != 1)
        throw FormatError("alpha must hold one value", where + " key '" + key + "'");
      p.alpha = t.to(at::kDouble).item<double>();
    }
  }
  // Attach or resize branches and check every shape first; copy only when all fit. On any error
  // the layers are put back as they were (branches this call added are removed, replaced ones
  // restored with their weights).
  struct Undo {
    LoraHost* host = nullptr;
    bool had = false;
    LoraOptions options{};
    at::Tensor a{}, b{}, magnitude{};
  };
  std::vector<Undo> undo;
  std::vector<std::string> loaded;
  try {
    for (auto& [module, p] : parts) {
      const std::string at_module = where + " module '" + module + "'";
      if (!p.a.defined() || !p.b.defined())
        throw FormatError("has only one of the two LoRA matrices (lora_A/lora_B)", at_module);
      if (p.a.dim() < 2 || p.b.dim() < 2 || p.a.size(0) != p.b.size(1))
        throw FormatError("A " + c10::str(p.a.sizes()) + " and B " + c10::str(p.b.sizes()) +
                              " do not share a rank",
                          at_module);
      LoraHost* h = hosts.at(module);
      LoraOptions o = h->has_lora() ? h->lora_options() : defaults;
      o.rank = p.a.size(0);
      if (p.alpha) o.alpha = p.alpha;
      o.use_dora = p.magnitude.defined();
      if (o.use_dora)
        o.dora_axis = lora_inject_detail::dora_axis_of(p.magnitude, p.b, p.a,
                                                       k.layout == LoraLayout::peft, at_module);
      const bool replace =
          h->has_lora() &&
          (h->lora_a().sizes() != p.a.sizes() || h->lora_options().use_dora != o.use_dora ||
           (o.use_dora && h->lora_options().dora_axis != o.dora_axis));
      if (replace || !h->has_lora()) {
        Undo u{h, h->has_lora(), {}, {}, {}, {}};
        if (u.had) {
          u.options = h->lora_options(), u.a = h->lora_a().detach().clone(),
          u.b = h->lora_b().detach().clone();
          if (h->lora_magnitude().defined()) u.magnitude = h->lora_magnitude().detach().clone();
        }
        undo.push_back(u);
        if (replace) h->detach_lora();
        h->attach_lora(o);
      }
      if (h->lora_a().sizes() != p.a.sizes() || h->lora_b().sizes() != p.b.sizes())
        throw ConfigError("A " + c10::str(p.a.sizes()) + " / B " + c10::str(p.b.sizes()) +
                              " do not fit the layer (A " + c10::str(h->lora_a().sizes()) + ", B " +
                              c10::str(h->lora_b().sizes()) + ")",
                          at_module);
      if (o.use_dora && p.magnitude.numel() != h->lora_magnitude().numel())
        throw ConfigError("DoRA magnitude " + c10::str(p.magnitude.sizes()) +
                              " does not fit the layer (" + c10::str(h->lora_magnitude().sizes()) +
                              ")",
                          at_module);
      loaded.push_back(module);
    }
  } catch (...) {
    for (auto it = undo.rbegin(); it != undo.rend(); ++it) {
      if (it->host->has_lora()) it->host->detach_lora();
      if (it->had) {
        it->host->attach_lora(it->options);
        at::NoGradGuard no_grad;
        it->host->lora_a().copy_(it->a);
        it->host->lora_b().copy_(it->b);
        if (it->magnitude.defined()) it->host->lora_magnitude().copy_(it->magnitude);
      }
    }
    throw;
  }
  at::NoGradGuard no_grad;
  for (const auto& module : loaded) {
    LoraHost* h = hosts.at(module);
    const Parts& p = parts.at(module);
    h->lora_a().copy_(p.a);
    h->lora_b().copy_(p.b);
    if (p.magnitude.defined())
      h->lora_magnitude().copy_(p.magnitude.reshape(h->lora_magnitude().sizes()));
  }
  return loaded;
}

namespace lora_inject_detail {
/// Seed 003's table: SAT's LoRA matrices of the fused qkv and the output projection, and the
/// diffusers names they become.
inline const std::vector<std::pair<std::string, std::string>>& sat_lora_table() {
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"attention.query_key_value.matrix_A.0", "attn1.to_q.lora_A.weight"},
      {"attention.query_key_value.matrix_A.1", "attn1.to_k.lora_A.weight"},
      {"attention.query_key_value.matrix_A.2", "attn1.to_v.lora_A.weight"},
      {"attention.query_key_value.matrix_B.0", "attn1.to_q.lora_B.weight"},
      {"attention.query_key_value.matrix_B.1", "attn1.to_k.lora_B.weight"},
      {"attention.query_key_value.matrix_B.2", "attn1.to_v.lora_B.weight"},
      {"attention.dense.matrix_A.0", "attn1.to_out.0.lora_A.weight"},
      {"attention.dense.matrix_B.0", "attn1.to_out.0.lora_B.weight"}};
  return table;
}
inline bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
}  // namespace lora_inject_detail

/// A CogVideoX SAT LoRA key in diffusers' naming (seed 003's table, and its export script's
/// rules): the SAT prefix "model.diffusion_model." is dropped, the attention matrices are renamed
/// and "layers" becomes "transformer_blocks" ("transformer.layers.3.attention.dense.matrix_A.0" →
/// "transformer.transformer_blocks.3.attn1.to_out.0.lora_A.weight"). Keys outside the table give
/// std::nullopt (they are not LoRA weights).
inline std::optional<std::string> sat_to_diffusers_lora_key(const std::string& key) {
  const auto& table = lora_inject_detail::sat_lora_table();
  std::string k = key;
  const std::string sat_prefix = "model.diffusion_model.";
  if (k.rfind(sat_prefix, 0) == 0) k = k.substr(sat_prefix.size());
  for (const auto& [from, to] : table) {
    if (!lora_inject_detail::ends_with(k, from)) continue;
    return python_replace(k.substr(0, k.size() - from.size()), "layers", "transformer_blocks") + to;
  }
  return std::nullopt;
}

/// The other direction: a diffusers CogVideoX LoRA key ("transformer.transformer_blocks.3.attn1.
/// to_q.lora_A.weight") as the SAT checkpoint holds it
/// ("model.diffusion_model.transformer.layers.3. attention.query_key_value.matrix_A.0"). Only the
/// attention projections SAT adapts map; others give std::nullopt.
inline std::optional<std::string> diffusers_to_sat_lora_key(const std::string& key) {
  for (const auto& [sat, diffusers] : lora_inject_detail::sat_lora_table()) {
    if (!lora_inject_detail::ends_with(key, diffusers)) continue;
    return "model.diffusion_model." +
           python_replace(key.substr(0, key.size() - diffusers.size()), "transformer_blocks",
                          "layers") +
           sat;
  }
  return std::nullopt;
}

/// A whole LoRA map from SAT to diffusers keys (or back): every key must map, or the ConfigError
/// names the first that does not (SAT adapts only the attention projections).
inline std::map<std::string, at::Tensor> sat_to_diffusers_lora(
    const std::map<std::string, at::Tensor>& sat) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [k, v] : sat) {
    const auto d = sat_to_diffusers_lora_key(k);
    if (!d)
      throw ConfigError("is not a SAT LoRA matrix of seed 003's table", "SAT key '" + k + "'");
    out[*d] = v;
  }
  return out;
}
inline std::map<std::string, at::Tensor> diffusers_to_sat_lora(
    const std::map<std::string, at::Tensor>& diffusers) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [k, v] : diffusers) {
    const auto s = diffusers_to_sat_lora_key(k);
    if (!s)
      throw ConfigError("has no SAT counterpart (SAT adapts attn1's to_q, to_k, to_v, to_out.0)",
                        "diffusers LoRA key '" + k + "'");
    out[*s] = v;
  }
  return out;
}

}  // namespace difftrain::adapters
