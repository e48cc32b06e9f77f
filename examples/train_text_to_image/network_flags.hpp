#pragma once
// The adapter a LoRA run of train_text_to_image trains on the UNet, under the names kohya's
// sd-scripts and LyCORIS give it: the kind (--network_algo lora / loha / lokr), LoKr's factor,
// ranks per block (block_dims), kohya's LoCon on the resnets and resamplers (conv_dim,
// conv_alpha, conv_block_dims), DoRA; and kohya's `--network_args "key=value" ...`, which sets
// the same things from a pasted kohya configuration.

#include <CLI/CLI.hpp>
#include <difftrain/adapters/adapters.hpp>
#include <difftrain/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "../common/sd_run.hpp"

namespace examples {

struct NetworkFlags {
  std::string network_algo = "lora";     // LyCORIS' algo: lora, loha or lokr
  std::int64_t lokr_factor = -1;         // LyCORIS' factor (LoKr's split; -1: near the root)
  std::vector<std::int64_t> block_dims;  // kohya's: a rank per UNet block (25)
  std::vector<double> block_alphas;      // and an alpha per block
  std::int64_t conv_dim = 0;             // kohya's LoCon: the 3×3 convolutions' rank (0: off)
  double conv_alpha = 1.0;               // kohya's default
  std::vector<std::int64_t> conv_block_dims;
  std::vector<double> conv_block_alphas;
  std::vector<std::string> network_args;  // kohya's "key=value" settings
};

inline void add_network_flags(CLI::Option_group* t, NetworkFlags& f) {
  t->add_option("--network_algo", f.network_algo,
                "the adapter --use_lora trains: lora, loha (LyCORIS' LoHa) or lokr (LoKr); "
                "LoHa and LoKr are written in LyCORIS' layout (lora_kohya.safetensors, the web "
                "UI's and ComfyUI's) and PEFT's")
      ->capture_default_str();
  t->add_option("--lokr_factor", f.lokr_factor,
                "LoKr's factor (LyCORIS' factor; -1: the split nearest the square root)")
      ->capture_default_str();
  t->add_option("--block_dims", f.block_dims,
                "kohya's block_dims: 25 comma-separated UNet LoRA ranks, IN00-11, MID, OUT00-11 "
                "(0 leaves a block out)")
      ->delimiter(',');
  t->add_option("--block_alphas", f.block_alphas,
                "kohya's block_alphas: 25 alphas to go with --block_dims (default: --lora_alpha)")
      ->delimiter(',');
  t->add_option("--conv_dim", f.conv_dim,
                "kohya's LoCon: adapters on the resnets' and resamplers' layers too, the 3×3 "
                "convolutions at this rank (the others at --rank); 0: off")
      ->capture_default_str();
  t->add_option("--conv_alpha", f.conv_alpha, "kohya's conv_alpha (the 3×3 convolutions' alpha)")
      ->capture_default_str();
  t->add_option("--conv_block_dims", f.conv_block_dims,
                "kohya's conv_block_dims: 25 ranks of the 3×3 convolutions per block (with "
                "--block_dims)")
      ->delimiter(',');
  t->add_option("--conv_block_alphas", f.conv_block_alphas,
                "kohya's conv_block_alphas (default: --conv_alpha)")
      ->delimiter(',');
  t->add_option("--network_args", f.network_args,
                "kohya's network_args, e.g. \"conv_dim=4\" \"conv_alpha=1\" \"algo=lokr\" "
                "\"factor=8\" \"dora_wd=True\": the same settings as the flags above");
}

namespace network_detail {
inline std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\"'"), e = s.find_last_not_of(" \t\"'");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}
inline bool to_bool(const std::string& v, const std::string& where) {
  if (v == "True" || v == "true" || v == "1") return true;
  if (v == "False" || v == "false" || v == "0") return false;
  throw difftrain::ConfigError("is '" + v + "'; give True or False", where);
}
template <class T>
T to_number(const std::string& v, const std::string& where) {
  std::istringstream in(v);
  T x{};
  if (!(in >> x) || !in.eof()) throw difftrain::ConfigError("is '" + v + "', not a number", where);
  return x;
}
template <class T>
std::vector<T> to_list(const std::string& v, const std::string& where) {
  std::vector<T> out;
  std::stringstream in(v);
  for (std::string item; std::getline(in, item, ',');)
    out.push_back(to_number<T>(trim(item), where));
  return out;
}
}  // namespace network_detail

/// Applies kohya's `--network_args` to the flags they stand for; an unknown key, or a LyCORIS
/// setting difftrain does not train, is a ConfigError listing the keys taken.
inline void apply_network_args(NetworkFlags& f, sd::LoraFlags& lora) {
  using namespace network_detail;
  static const std::vector<std::string> known = {"algo",
                                                 "conv_dim",
                                                 "conv_alpha",
                                                 "factor",
                                                 "block_dims",
                                                 "block_alphas",
                                                 "conv_block_dims",
                                                 "conv_block_alphas",
                                                 "dora_wd",
                                                 "wd_on_output",
                                                 "loraplus_lr_ratio",
                                                 "loraplus_unet_lr_ratio",
                                                 "loraplus_text_encoder_lr_ratio"};
  for (const auto& arg : f.network_args) {
    const auto eq = arg.find('=');
    const std::string where = "--network_args '" + arg + "'";
    if (eq == std::string::npos) throw difftrain::ConfigError("is not key=value", where);
    const std::string key = trim(arg.substr(0, eq)), v = trim(arg.substr(eq + 1));
    if (key == "algo") {
      f.network_algo = v == "locon" ? "lora" : v;  // LyCORIS' locon is LoRA with conv_dim
    } else if (key == "conv_dim") {
      f.conv_dim = to_number<std::int64_t>(v, where);
    } else if (key == "conv_alpha") {
      f.conv_alpha = to_number<double>(v, where);
    } else if (key == "factor") {
      f.lokr_factor = to_number<std::int64_t>(v, where);
    } else if (key == "block_dims") {
      f.block_dims = to_list<std::int64_t>(v, where);
    } else if (key == "block_alphas") {
      f.block_alphas = to_list<double>(v, where);
    } else if (key == "conv_block_dims") {
      f.conv_block_dims = to_list<std::int64_t>(v, where);
    } else if (key == "conv_block_alphas") {
      f.conv_block_alphas = to_list<double>(v, where);
    } else if (key == "dora_wd") {
      lora.use_dora = to_bool(v, where);
    } else if (key == "wd_on_output") {
      lora.dora_wd_on_output = to_bool(v, where);
    } else if (key == "loraplus_lr_ratio") {
      lora.loraplus_lr_ratio = to_number<double>(v, where);
    } else if (key == "loraplus_unet_lr_ratio") {
      lora.loraplus_unet_lr_ratio = to_number<double>(v, where);
    } else if (key == "loraplus_text_encoder_lr_ratio") {
      lora.loraplus_text_encoder_lr_ratio = to_number<double>(v, where);
    } else {
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      throw difftrain::ConfigError(
          "has the key '" + key + "', which this program does not take (" + list + ")", where);
    }
  }
}

/// kohya's block_dims from --block_dims / --block_alphas (alphas default to --lora_alpha).
inline difftrain::adapters::BlockDims unet_block_dims(const NetworkFlags& f,
                                                      const sd::LoraFlags& l) {
  return {.dims = f.block_dims,
          .alphas = f.block_alphas,
          .alpha = l.lora_alpha > 0 ? l.lora_alpha : static_cast<double>(l.rank)};
}
/// kohya's conv_block_dims (or conv_dim for every block) with their alphas; none without LoCon.
inline std::optional<difftrain::adapters::BlockDims> unet_conv_block_dims(const NetworkFlags& f) {
  if (!f.conv_block_dims.empty())
    return difftrain::adapters::BlockDims{
        .dims = f.conv_block_dims, .alphas = f.conv_block_alphas, .alpha = f.conv_alpha};
  if (f.conv_dim > 0)
    return difftrain::adapters::BlockDims{
        .dims = std::vector<std::int64_t>(difftrain::adapters::BlockDims::kCount, f.conv_dim),
        .alphas = {},
        .alpha = f.conv_alpha};
  return std::nullopt;
}

/// Refuses combinations that cannot work, naming the flag.
inline void check_network_flags(const NetworkFlags& f, const sd::LoraFlags& l) {
  using difftrain::ConfigError;
  const bool blocks = !f.block_dims.empty() || !f.block_alphas.empty();
  const bool conv = f.conv_dim != 0 || !f.conv_block_dims.empty() || !f.conv_block_alphas.empty();
  if (blocks && !l.use_lora) throw ConfigError("sets LoRA ranks; add --use_lora", "--block_dims");
  if (conv && !l.use_lora) throw ConfigError("sets LoCon ranks; add --use_lora", "--conv_dim");
  if (!f.block_alphas.empty() && f.block_dims.empty())
    throw ConfigError("goes with --block_dims", "--block_alphas");
  if (!f.block_dims.empty()) unet_block_dims(f, l).validate("--block_dims", "--block_alphas");
  if (f.conv_dim < 0) throw ConfigError("must be >= 0", "--conv_dim");
  if (!(std::isfinite(f.conv_alpha) && f.conv_alpha > 0))
    throw ConfigError("must be a finite number > 0", "--conv_alpha");
  if (!f.conv_block_alphas.empty() && f.conv_block_dims.empty())
    throw ConfigError("goes with --conv_block_dims", "--conv_block_alphas");
  if (!f.conv_block_dims.empty()) {
    if (f.block_dims.empty())
      throw ConfigError("goes with --block_dims (kohya's rule); without it give --conv_dim",
                        "--conv_block_dims");
    unet_conv_block_dims(f)->validate("--conv_block_dims", "--conv_block_alphas");
  }
  if (f.network_algo != "lora") {
    if (f.network_algo != "loha" && f.network_algo != "lokr")
      throw ConfigError("is '" + f.network_algo + "'; choose lora, loha or lokr", "--network_algo");
    if (!l.use_lora) throw ConfigError("trains an adapter; add --use_lora", "--network_algo");
    if (blocks || !f.conv_block_dims.empty())
      throw ConfigError("sets LoRA ranks per block; it goes with --network_algo lora",
                        "--block_dims");
    if (l.loraplus_lr_ratio > 0 || l.loraplus_unet_lr_ratio > 0 ||
        l.loraplus_text_encoder_lr_ratio > 0)
      throw ConfigError("speeds up LoRA's B matrices; it goes with --network_algo lora",
                        "--loraplus_lr_ratio");
    if (l.use_dora)
      throw ConfigError("decomposes LoRA's weight; it goes with --network_algo lora", "--use_dora");
  }
  if (f.lokr_factor == 0 || f.lokr_factor < -1)
    throw ConfigError("must be -1 or > 0", "--lokr_factor");
}

/// Puts the flags' adapters on the UNet: the attention projections (diffusers' targets) at --rank
/// or per block, and with LoCon every resnet and resampler layer, 3×3 convolutions at the conv
/// rank and the rest (time_emb_proj, the 1×1 shortcut) at the linear one, as kohya's
/// networks/lora.py does. Returns the adapted module names.
template <class Unet>
std::vector<std::string> inject_unet_network(Unet& unet, const NetworkFlags& f,
                                             const sd::LoraFlags& l) {
  namespace ad = difftrain::adapters;
  const difftrain::nn::LoraOptions base = l.lora_options();
  const std::optional<ad::BlockDims> dims =
      f.block_dims.empty() ? std::nullopt : std::optional(unet_block_dims(f, l));
  const std::optional<ad::BlockDims> conv = unet_conv_block_dims(f);
  // A module's rank and alpha, or none (a block of rank 0, a 3×3 convolution without LoCon).
  auto rank_of = [&](const std::string& m,
                     bool conv_layer) -> std::optional<std::pair<std::int64_t, double>> {
    std::optional<difftrain::nn::LoraOptions> o;
    if (conv_layer) {
      if (!conv) return std::nullopt;
      o = conv->of(m);
    } else {
      o = dims ? dims->of(m) : std::optional(base);
    }
    if (!o) return std::nullopt;
    return std::pair{o->rank, *o->alpha};
  };
  std::vector<std::string> adapted;
  auto inject = [&](const ad::LoraTargets& targets, bool resnets) {
    std::vector<std::string> added;
    if (f.network_algo == "lora") {
      added = ad::inject_lora(
          unet, targets, [&](const std::string& m) -> std::optional<difftrain::nn::LoraOptions> {
            const auto r = rank_of(m, resnets && ad::kohya_conv_3x3(m));
            if (!r) return std::nullopt;
            auto o = base;
            o.rank = r->first;
            o.alpha = r->second;
            return o;
          });
    } else {
      added = ad::inject_weight_delta(
          unet, targets, [&](const std::string& m) -> std::optional<ad::DeltaOptions> {
            const auto r = rank_of(m, resnets && ad::kohya_conv_3x3(m));
            if (!r) return std::nullopt;
            return ad::DeltaOptions{
                .kind = f.network_algo == "loha" ? ad::DeltaKind::loha : ad::DeltaKind::lokr,
                .rank = r->first,
                .alpha = r->second,
                .factor = f.lokr_factor};
          });
    }
    adapted.insert(adapted.end(), added.begin(), added.end());
  };
  inject(ad::unet_lora_targets(), false);
  if (conv) inject(ad::unet_conv_lora_targets(), true);
  return adapted;
}

}  // namespace examples
