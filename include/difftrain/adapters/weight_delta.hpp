#pragma once
// Adapters that change a layer's weight by ΔW(θ) instead of adding a low-rank path: LoHa and LoKr
// (LyCORIS, Yeh et al. 2024), as PEFT's LoHaConfig / LoKrConfig build them and LyCORIS' files
// store them.
//   LoHa:  ΔW = (α/r) · (W1a·W1b) ⊙ (W2a·W2b)       (Hadamard product of two rank-r products)
//   LoKr:  ΔW = (α/r) · W1 ⊗ W2                        (Kronecker product; out = a·b, in = c·d
//          from PEFT's factorization, W1 a×c, W2 b×d(×k×k); a factor below rank·2 stays whole,
//          a larger one is a product W·W of rank r)
// The layer adds its own operation with ΔW (at::linear / its convolution) to its output, as PEFT
// does; a convolution's ΔW is taken over its flattened kernel (PEFT's use_effective_conv2d off).
// Initialisation is PEFT's: LoHa W1a, W1b, W2a Kaiming-uniform and W2b zero; LoKr W1 zero (or
// W1a zero) and W2 Kaiming-uniform, so a new adapter changes nothing.
//
// Files: PEFT's names (`<prefix><module>.hada_w1_a`, `.lokr_w1`, ...) with the adapter metadata,
// or LyCORIS' (`lora_unet_<module with _>.hada_w1_a`, ..., `.alpha`), which the web UI's and
// ComfyUI's LyCORIS readers apply; `load_weight_delta_state_dict` reads either back, checking
// every key and shape. A LoKr whose factors are both whole is read by those tools at scale 1
// (they ignore alpha there), so its LyCORIS file carries W1 pre-scaled and alpha = rank.

#include <torch/nn/init.h>
#include <torch/nn/module.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/adapters/lora_inject.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/nn/layers/adaptable.hpp"

namespace difftrain::adapters {

enum class DeltaKind { loha, lokr };

struct DeltaOptions {
  DeltaKind kind = DeltaKind::loha;
  std::int64_t rank = 8;
  std::optional<double> alpha{};  ///< default: rank (scale 1)
  std::int64_t factor = -1;       ///< LoKr: PEFT's decompose_factor (-1: near the square root)
  bool decompose_both = false;    ///< LoKr: W1 as a rank-r product too when it is large enough
  [[nodiscard]] double scale() const {
    return alpha.value_or(static_cast<double>(rank)) / static_cast<double>(rank);
  }
  void validate(const std::string& where) const {
    if (rank < 1) throw ConfigError("rank must be >= 1, got " + std::to_string(rank), where);
    if (alpha && !(std::isfinite(*alpha) && *alpha > 0))
      throw ConfigError("alpha must be finite and > 0", where);
    if (factor == 0 || factor < -1) throw ConfigError("factor must be -1 or > 0", where);
  }
};

/// PEFT's (and LyCORIS') `factorization(dimension, factor)`: dimension = m·n with m <= n, m as
/// close to `factor` (or to the square root for -1) as the divisors allow.
inline std::pair<std::int64_t, std::int64_t> factorization(std::int64_t dimension,
                                                           std::int64_t factor = -1) {
  if (factor > 0 && dimension % factor == 0) return {factor, dimension / factor};
  if (factor == -1) factor = dimension;
  std::int64_t m = 1, n = dimension;
  const std::int64_t length = m + n;
  while (m < n) {
    std::int64_t next_m = m + 1;
    while (dimension % next_m != 0) ++next_m;
    const std::int64_t next_n = dimension / next_m;
    if (next_m + next_n > length || next_m > factor) break;
    m = next_m;
    n = next_n;
  }
  if (m > n) std::swap(m, n);
  return {m, n};
}

namespace delta_detail {
inline void kaiming(const at::Tensor& w) {
  const at::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));
}
/// The weight's out and flattened in sizes, and its kernel (empty for a linear layer).
struct Shape {
  std::int64_t out = 0, in = 0;
  std::vector<std::int64_t> kernel;
  [[nodiscard]] std::int64_t kernel_numel() const {
    std::int64_t n = 1;
    for (auto k : kernel) n *= k;
    return n;
  }
};
inline Shape shape_of(const at::Tensor& weight) {
  Shape s{weight.size(0), weight.size(1), {}};
  for (std::int64_t d = 2; d < weight.dim(); ++d) s.kernel.push_back(weight.size(d));
  return s;
}
}  // namespace delta_detail

/// LoHa's ΔW: parameters hada_w1_a [out, r], hada_w1_b [r, in·k·k], hada_w2_a, hada_w2_b.
class LohaDelta : public nn::WeightDelta {
 public:
  LohaDelta(const at::Tensor& weight, const DeltaOptions& o) : o_(o) {
    const auto s = delta_detail::shape_of(weight);
    const auto opts = weight.options();
    const std::int64_t in = s.in * s.kernel_numel();
    w1_a = register_parameter("hada_w1_a", at::empty({s.out, o.rank}, opts));
    w1_b = register_parameter("hada_w1_b", at::empty({o.rank, in}, opts));
    w2_a = register_parameter("hada_w2_a", at::empty({s.out, o.rank}, opts));
    w2_b = register_parameter("hada_w2_b", at::zeros({o.rank, in}, opts));
    for (const auto* w : {&w1_a, &w1_b, &w2_a}) delta_detail::kaiming(*w);
  }
  [[nodiscard]] at::Tensor delta_weight(const at::Tensor& weight) const override {
    return (w1_a.mm(w1_b) * w2_a.mm(w2_b) * o_.scale()).reshape(weight.sizes());
  }
  [[nodiscard]] const DeltaOptions& options() const { return o_; }
  at::Tensor w1_a, w1_b, w2_a, w2_b;

 private:
  DeltaOptions o_;
};

/// LoKr's ΔW: lokr_w1 [a, c] (or lokr_w1_a [a, r], lokr_w1_b [r, c]) and lokr_w2 [b, d(, k, k)]
/// (or lokr_w2_a [b, r], lokr_w2_b [r, d·k·k]), with out = a·b and in = c·d.
class LokrDelta : public nn::WeightDelta {
 public:
  /// `whole_w1` / `whole_w2` say which factors are whole (a file's keys); by default PEFT's rule.
  LokrDelta(const at::Tensor& weight, const DeltaOptions& o,
            std::optional<bool> whole_w1_given = std::nullopt,
            std::optional<bool> whole_w2_given = std::nullopt)
      : o_(o) {
    const auto s = delta_detail::shape_of(weight);
    const auto [a, b] = factorization(s.out, o.factor);
    const auto [c, d] = factorization(s.in, o.factor);
    const auto r = static_cast<double>(o.rank);
    const auto opts = weight.options();
    const bool whole_w1 = whole_w1_given.value_or(
        !(o.decompose_both && r < static_cast<double>(std::max(a, c)) / 2.0));
    const bool whole_w2 = whole_w2_given.value_or(!(r < static_cast<double>(std::max(b, d)) / 2.0));
    if (whole_w1) {
      w1 = register_parameter("lokr_w1", at::zeros({a, c}, opts));
    } else {
      w1_a = register_parameter("lokr_w1_a", at::zeros({a, o.rank}, opts));
      w1_b = register_parameter("lokr_w1_b", at::empty({o.rank, c}, opts));
      delta_detail::kaiming(w1_b);
    }
    if (whole_w2) {
      std::vector<std::int64_t> shape{b, d};
      shape.insert(shape.end(), s.kernel.begin(), s.kernel.end());
      w2 = register_parameter("lokr_w2", at::empty(shape, opts));
      delta_detail::kaiming(w2);
    } else {
      w2_a = register_parameter("lokr_w2_a", at::empty({b, o.rank}, opts));
      w2_b = register_parameter("lokr_w2_b", at::empty({o.rank, d * s.kernel_numel()}, opts));
      delta_detail::kaiming(w2_a);
      delta_detail::kaiming(w2_b);
    }
  }
  [[nodiscard]] at::Tensor delta_weight(const at::Tensor& weight) const override {
    at::Tensor first = w1.defined() ? w1 : w1_a.mm(w1_b);
    const at::Tensor second = w2.defined() ? w2 : w2_a.mm(w2_b);
    if (second.dim() == 4) first = first.unsqueeze(2).unsqueeze(2);
    return (at::kron(first, second.contiguous()) * o_.scale()).reshape(weight.sizes());
  }
  [[nodiscard]] const DeltaOptions& options() const { return o_; }
  at::Tensor w1, w1_a, w1_b, w2, w2_a, w2_b;

 private:
  DeltaOptions o_;
};

/// The layer's weight-change adapter, if it has one.
inline nn::WeightDelta* delta_of(torch::nn::Module& m) {
  if (auto* l = dynamic_cast<nn::AdaptableLinearImpl*>(&m)) return l->delta().get();
  if (auto* c = dynamic_cast<nn::AdaptableConv2dImpl*>(&m)) return c->delta().get();
  return nullptr;
}

/// Every module of `root` with a weight-change adapter, by name.
inline std::vector<std::pair<std::string, nn::WeightDelta*>> delta_layers(torch::nn::Module& root) {
  std::vector<std::pair<std::string, nn::WeightDelta*>> out;
  for (const auto& item : root.named_modules("", false))
    if (auto* d = delta_of(*item.value()); d != nullptr) out.emplace_back(item.key(), d);
  return out;
}

/// The adapter `o` describes for a layer whose weight is `weight`.
inline std::shared_ptr<nn::WeightDelta> make_delta(const at::Tensor& weight,
                                                   const DeltaOptions& o) {
  if (o.kind == DeltaKind::loha) return std::make_shared<LohaDelta>(weight, o);
  return std::make_shared<LokrDelta>(weight, o);
}

/// Attaches a LoHa or LoKr adapter to each matching adaptable layer (PEFT's target rule, as
/// inject_lora), with the options `options_of(name)` gives it (none: left as it is); freezes
/// every other parameter. Returns the adapted names.
inline std::vector<std::string> inject_weight_delta(
    torch::nn::Module& root, const LoraTargets& targets,
    const std::function<std::optional<DeltaOptions>(const std::string&)>& options_of) {
  const std::string where = "inject_weight_delta";
  if (targets.target_modules.empty() && !targets.target_regex)
    throw ConfigError("names no target modules", where);
  std::optional<std::regex> re;
  if (targets.target_regex) re.emplace(*targets.target_regex);
  std::vector<std::string> adapted;
  for (const auto& item : root.named_modules("", false)) {
    const std::string& name = item.key();
    if (!lora_inject_detail::matches(name, targets, re ? &*re : nullptr)) continue;
    const auto o = options_of(name);
    if (!o) continue;
    o->validate(where + " (" + name + ")");
    if (auto* l = dynamic_cast<nn::AdaptableLinearImpl*>(item.value().get()))
      l->attach_delta(make_delta(l->weight, *o));
    else if (auto* c = dynamic_cast<nn::AdaptableConv2dImpl*>(item.value().get()))
      c->attach_delta(make_delta(c->weight, *o));
    else
      throw ConfigError("module '" + name + "' (" + item.value()->name() +
                            ") matches the targets but cannot carry an adapter",
                        where);
    adapted.push_back(name);
  }
  if (adapted.empty()) throw ConfigError("no module matches the targets", where);
  for (auto& p : root.named_parameters(true))
    p.value().set_requires_grad(p.key().find(".adapter.") != std::string::npos);
  return adapted;
}

/// The same with one set of options for every layer.
inline std::vector<std::string> inject_weight_delta(torch::nn::Module& root,
                                                    const LoraTargets& targets,
                                                    const DeltaOptions& o) {
  o.validate("inject_weight_delta");
  return inject_weight_delta(root, targets,
                             [&](const std::string&) -> std::optional<DeltaOptions> { return o; });
}

namespace delta_detail {
inline const DeltaOptions& options_of(const nn::WeightDelta& d) {
  if (const auto* h = dynamic_cast<const LohaDelta*>(&d)) return h->options();
  return dynamic_cast<const LokrDelta&>(d).options();
}
}  // namespace delta_detail

/// The adapters' tensors in PEFT's names (`<prefix><module>.hada_w1_a`, `.lokr_w1`, ...) or in
/// LyCORIS' (`<prefix><module with _>.hada_w1_a`, ..., `.alpha`). CPU copies.
inline std::map<std::string, at::Tensor> weight_delta_state_dict(torch::nn::Module& root,
                                                                 const LoraKeyOptions& k = {}) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, d] : delta_layers(root)) {
    const DeltaOptions& o = delta_detail::options_of(*d);
    const std::string base =
        k.layout == LoraLayout::peft ? k.prefix + name : k.prefix + kohya_name(name);
    double alpha = o.alpha.value_or(static_cast<double>(o.rank));
    // LyCORIS readers apply a LoKr of two whole factors at scale 1: W1 carries the scale.
    const auto* lokr = dynamic_cast<const LokrDelta*>(d);
    const bool prescale = k.layout == LoraLayout::kohya && lokr != nullptr && lokr->w1.defined() &&
                          lokr->w2.defined();
    for (const auto& p : d->named_parameters(false)) {
      at::Tensor t = p.value().detach().cpu().clone();
      if (prescale && p.key() == "lokr_w1") t.mul_(o.scale());
      out[base + "." + p.key()] = t;
    }
    if (k.layout == LoraLayout::kohya) {
      if (prescale) alpha = static_cast<double>(o.rank);
      out[base + ".alpha"] = at::scalar_tensor(alpha, at::kFloat);
    }
  }
  return out;
}

/// Attaches adapters to `root`'s layers from a state dict in either layout and fills them: the
/// kind, the LoKr split and the rank from the keys and shapes, alpha from `.alpha` (LyCORIS) or
/// `rank_alpha_of(module)` (PEFT: its metadata's rank and alpha, which a LoKr of two whole factors
/// needs for its scale). A key of no layer, a missing or extra tensor, or a shape that does not
/// fit is a FormatError naming the key.
inline std::vector<std::string> load_weight_delta_state_dict(
    torch::nn::Module& root, const std::map<std::string, at::Tensor>& sd,
    const LoraKeyOptions& k = {},
    const std::function<std::optional<std::pair<std::int64_t, double>>(const std::string&)>&
        rank_alpha_of = {}) {
  const std::string where = "load_weight_delta_state_dict";
  std::map<std::string, std::string> by_key;  // the file's module key -> module name
  for (const auto& item : root.named_modules("", false)) {
    if (dynamic_cast<nn::AdaptableLinearImpl*>(item.value().get()) == nullptr &&
        dynamic_cast<nn::AdaptableConv2dImpl*>(item.value().get()) == nullptr)
      continue;
    by_key[k.layout == LoraLayout::peft ? k.prefix + item.key()
                                        : k.prefix + kohya_name(item.key())] = item.key();
  }
  std::map<std::string, std::map<std::string, at::Tensor>> per_module;
  for (const auto& [key, t] : sd) {
    const auto dot = key.rfind('.');
    if (dot == std::string::npos) throw FormatError("is not <module>.<tensor>", where + " " + key);
    const std::string module = key.substr(0, dot), tensor = key.substr(dot + 1);
    if (!by_key.contains(module))
      throw FormatError("names no adaptable layer of the model", where + " " + key);
    per_module[module][tensor] = t;
  }
  auto modules = root.named_modules("", false);
  std::vector<std::string> loaded;
  for (auto& [module, tensors] : per_module) {
    const std::string& name = by_key.at(module);
    const bool loha = tensors.contains("hada_w1_a");
    DeltaOptions o;
    o.kind = loha ? DeltaKind::loha : DeltaKind::lokr;
    if (loha) {
      o.rank = tensors.at("hada_w1_a").size(1);
    } else if (tensors.contains("lokr_w2_a")) {
      o.rank = tensors.at("lokr_w2_a").size(1);
    } else if (tensors.contains("lokr_w1_a")) {
      o.rank = tensors.at("lokr_w1_a").size(1);
    } else if (!tensors.contains("lokr_w1")) {
      throw FormatError("holds neither LoHa's hada_w1_a nor LoKr's lokr_w1", where + " " + module);
    } else {  // two whole factors: the shapes hold no rank
      o.rank = 1;
    }
    const bool whole = !loha && tensors.contains("lokr_w1") && tensors.contains("lokr_w2");
    const auto told = rank_alpha_of ? rank_alpha_of(name) : std::nullopt;
    if (const auto it = tensors.find("alpha"); it != tensors.end()) {
      // LyCORIS' readers apply two whole factors at scale 1 whatever alpha says.
      o.alpha = whole ? 1.0 : it->second.item<double>();
      tensors.erase(it);
    } else if (told) {
      if (whole) o.rank = told->first;
      o.alpha = told->second;
    }
    torch::nn::Module& layer = *modules[name];
    const at::Tensor weight = layer.named_parameters(false)["weight"];
    // LoKr's factor split: the one of PEFT's factorizations (near the square root, or a given
    // factor) that gives the file's first factor.
    if (!loha) {
      const at::Tensor& first =
          tensors.contains("lokr_w1") ? tensors.at("lokr_w1") : tensors.at("lokr_w1_a");
      const std::int64_t a = first.size(0);
      const std::int64_t c =
          tensors.contains("lokr_w1") ? first.size(1) : tensors.at("lokr_w1_b").size(1);
      const std::int64_t in = weight.size(1);
      for (const std::int64_t f : {std::int64_t{-1}, a, c}) {
        o.factor = f;
        if (factorization(weight.size(0), f).first == a && factorization(in, f).first == c) break;
      }
    }
    std::shared_ptr<nn::WeightDelta> delta =
        loha ? make_delta(weight, o)
             : std::make_shared<LokrDelta>(weight, o, tensors.contains("lokr_w1"),
                                           tensors.contains("lokr_w2"));
    std::set<std::string> expected;
    for (const auto& p : delta->named_parameters(false)) expected.insert(p.key());
    for (const auto& [tensor, t] : tensors)
      if (!expected.contains(tensor))
        throw FormatError(
            "is not a tensor of this adapter (its layer expects another LoKr split "
            "or kind)",
            where + " " + module + "." + tensor);
    {
      const at::NoGradGuard no_grad;
      for (auto& p : delta->named_parameters(false)) {
        const auto it = tensors.find(p.key());
        if (it == tensors.end())
          throw FormatError("is missing", where + " " + module + "." + p.key());
        if (it->second.sizes() != p.value().sizes())
          throw FormatError("has shape " + c10::str(it->second.sizes()) + ", the layer needs " +
                                c10::str(p.value().sizes()),
                            where + " " + module + "." + p.key());
        p.value().copy_(it->second);
      }
    }
    if (auto* l = dynamic_cast<nn::AdaptableLinearImpl*>(&layer))
      l->attach_delta(delta);
    else
      dynamic_cast<nn::AdaptableConv2dImpl&>(layer).attach_delta(delta);
    loaded.push_back(name);
  }
  return loaded;
}

}  // namespace difftrain::adapters
