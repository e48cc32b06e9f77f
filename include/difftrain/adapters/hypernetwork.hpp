#pragma once
// The Stable Diffusion web UI's hypernetworks: for each context width a pair of small residual
// MLPs that transform the cross-attention context before to_k and to_v.
//
// `HypernetworkModule` is built exactly as the web UI builds it, so its state dict keys and its
// numbers match: for each step of `layer_structure` (which must start and end with 1) a Linear from
// dim·s[i] to dim·s[i+1] features, then the activation (not after the last Linear unless
// `activate_output`; none for "linear"), then a LayerNorm when `add_layer_norm`, then a Dropout
// when the dropout structure gives this layer a probability; all in one Sequential named "linear".
// forward(x) = x + linear(x) · (multiplier in eval mode, 1 while training).
//
// `Hypernetwork` holds the pairs by width, the web UI's metadata, and reads and writes its `.pt`
// layout (integer width keys → [state dict of k, state dict of v], plus the settings).

#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/torch_file.hpp"
#include "difftrain/nn/module_tensors.hpp"

namespace difftrain::adapters {

/// The web UI's parse_dropout_structure: 0 for the input, 0.3 for each hidden layer but the last,
/// 0.3 or 0 for the last hidden layer (`last_layer_dropout`), 0 for the output.
inline std::vector<double> parse_dropout_structure(const std::vector<double>& layer_structure,
                                                   bool use_dropout, bool last_layer_dropout) {
  const std::size_t n = layer_structure.empty() ? 3 : layer_structure.size();
  if (!use_dropout) return std::vector<double>(n, 0.0);
  if (n < 3)
    throw ConfigError("needs at least 3 entries to place dropout, got " + std::to_string(n),
                      "hypernetwork layer_structure");
  std::vector<double> d{0.0};
  for (std::size_t i = 0; i + 3 < n; ++i) d.push_back(0.3);
  d.push_back(last_layer_dropout ? 0.3 : 0.0);
  d.push_back(0.0);
  return d;
}

struct HypernetworkOptions {
  std::vector<double> layer_structure{1, 2, 1};
  std::string activation_func =
      "linear";  ///< the web UI's name ("relu", "leakyrelu", "swish", ...)
  std::string weight_init =
      "Normal";  ///< Normal, XavierUniform, XavierNormal, KaimingUniform, KaimingNormal
  bool add_layer_norm = false;
  bool activate_output = false;
  std::vector<double> dropout_structure{};  ///< empty: no dropout
};

namespace hypernetwork_detail {
// torch.nn's Hardswish and Hardsigmoid, which LibTorch's module set lacks.
struct HardswishImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return at::hardswish(x); }
};
TORCH_MODULE(Hardswish);
struct HardsigmoidImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return at::hardsigmoid(x); }
};
TORCH_MODULE(Hardsigmoid);

/// The activation module for a web UI name (its activation_dict: the named entries plus every
/// torch.nn activation class lower-cased that needs no arguments).
inline std::optional<torch::nn::AnyModule> activation(const std::string& name) {
  using namespace torch::nn;
  if (name == "relu") return AnyModule(ReLU());
  if (name == "leakyrelu") return AnyModule(LeakyReLU());
  if (name == "elu") return AnyModule(ELU());
  if (name == "swish" || name == "hardswish") return AnyModule(Hardswish());  // as the web UI
  if (name == "tanh") return AnyModule(Tanh());
  if (name == "sigmoid") return AnyModule(Sigmoid());
  if (name == "gelu") return AnyModule(GELU());
  if (name == "silu") return AnyModule(SiLU());
  if (name == "mish") return AnyModule(Mish());
  if (name == "softplus") return AnyModule(Softplus());
  if (name == "selu") return AnyModule(SELU());
  if (name == "celu") return AnyModule(CELU());
  if (name == "relu6") return AnyModule(ReLU6());
  if (name == "hardsigmoid") return AnyModule(Hardsigmoid());
  if (name == "hardtanh") return AnyModule(Hardtanh());
  if (name == "logsigmoid") return AnyModule(LogSigmoid());
  if (name == "softsign") return AnyModule(Softsign());
  if (name == "tanhshrink") return AnyModule(Tanhshrink());
  if (name == "softshrink") return AnyModule(Softshrink());
  if (name == "hardshrink") return AnyModule(Hardshrink());
  if (name == "prelu") return AnyModule(PReLU());
  return std::nullopt;
}
}  // namespace hypernetwork_detail

class HypernetworkModuleImpl : public torch::nn::Module {
 public:
  HypernetworkModuleImpl(std::int64_t dim, const HypernetworkOptions& o) : dim_(dim) {
    const std::string where = "HypernetworkModule(" + std::to_string(dim) + ")";
    const auto& ls = o.layer_structure;
    if (ls.size() < 2) throw ConfigError("layer_structure needs at least 2 entries", where);
    if (ls.front() != 1.0)
      throw ConfigError("Multiplier Sequence should start with size 1!", where);
    if (ls.back() != 1.0) throw ConfigError("Multiplier Sequence should end with size 1!", where);
    if (!o.dropout_structure.empty() && o.dropout_structure.size() != ls.size())
      throw ConfigError("dropout_structure has " + std::to_string(o.dropout_structure.size()) +
                            " entries for a layer_structure of " + std::to_string(ls.size()),
                        where);
    const bool no_activation =
        o.activation_func == "linear" || o.activation_func.empty() || o.activation_func == "none";
    if (!no_activation && !hypernetwork_detail::activation(o.activation_func))
      throw ConfigError(
          "hypernetwork uses an unsupported activation function: " + o.activation_func, where);
    static const std::vector<std::string> inits = {"Normal", "XavierUniform", "XavierNormal",
                                                   "KaimingUniform", "KaimingNormal"};
    if (std::find(inits.begin(), inits.end(), o.weight_init) == inits.end())
      throw ConfigError("Key " + o.weight_init + " is not defined as initialization!", where);
    linear = register_module("linear", torch::nn::Sequential());
    for (std::size_t i = 0; i + 1 < ls.size(); ++i) {
      const auto in = static_cast<std::int64_t>(static_cast<double>(dim) * ls[i]);
      const auto out = static_cast<std::int64_t>(static_cast<double>(dim) * ls[i + 1]);
      torch::nn::Linear lin(in, out);
      init(*lin, o);
      linear->push_back(lin);
      const bool last = i + 2 >= ls.size();
      if (!no_activation && (!last || o.activate_output))
        linear->push_back(*hypernetwork_detail::activation(o.activation_func));
      if (o.add_layer_norm) {
        torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({out}));
        at::NoGradGuard no_grad;
        norm->weight.normal_(0.0, 0.01);  // the web UI draws LayerNorm weights as Normal too
        norm->bias.zero_();
        linear->push_back(norm);
      }
      if (!o.dropout_structure.empty() && o.dropout_structure[i + 1] > 0) {
        const double p = o.dropout_structure[i + 1];
        if (!(p > 0 && p < 1))
          throw ConfigError("Dropout probability should be 0 or float between 0 and 1!", where);
        linear->push_back(torch::nn::Dropout(p));
      }
    }
  }

  at::Tensor forward(const at::Tensor& x) {
    return x + linear->forward(x) * (is_training() ? 1.0 : multiplier);
  }

  /// How many numbers a module of this width and structure holds, without building it (a file's
  /// claims are checked against its tensors before anything is allocated).
  static double parameter_count(std::int64_t dim, const HypernetworkOptions& o) {
    double n = 0;
    const auto& ls = o.layer_structure;
    for (std::size_t i = 0; i + 1 < ls.size(); ++i) {
      const double in = std::floor(static_cast<double>(dim) * ls[i]);
      const double out = std::floor(static_cast<double>(dim) * ls[i + 1]);
      n += in * out + out + (o.add_layer_norm ? 2 * out : 0);
    }
    return n;
  }

  [[nodiscard]] std::int64_t dim() const { return dim_; }

  /// Loads a state dict (the web UI's, old "linear1/linear2" names accepted), every key checked.
  void load(const std::map<std::string, at::Tensor>& sd, const std::string& where) {
    std::map<std::string, at::Tensor> fixed = sd;
    for (const auto& [from, to] :
         std::vector<std::pair<std::string, std::string>>{{"linear1.bias", "linear.0.bias"},
                                                          {"linear1.weight", "linear.0.weight"},
                                                          {"linear2.bias", "linear.1.bias"},
                                                          {"linear2.weight", "linear.1.weight"}})
      if (auto it = fixed.find(from); it != fixed.end()) {
        fixed[to] = it->second;
        fixed.erase(from);
      }
    nn::load_module_tensors(*this, fixed, where);
  }

  torch::nn::Sequential linear{nullptr};
  double multiplier = 1.0;

 private:
  static void init(torch::nn::LinearImpl& lin, const HypernetworkOptions& o) {
    namespace init = torch::nn::init;
    at::NoGradGuard no_grad;
    const auto nonlinearity = o.activation_func == "leakyrelu"
                                  ? init::NonlinearityType(torch::kLeakyReLU)
                                  : init::NonlinearityType(torch::kReLU);
    if (o.weight_init == "Normal") {
      lin.weight.normal_(0.0, 0.01);
      lin.bias.zero_();
      return;
    }
    if (o.weight_init == "XavierUniform")
      init::xavier_uniform_(lin.weight);
    else if (o.weight_init == "XavierNormal")
      init::xavier_normal_(lin.weight);
    else if (o.weight_init == "KaimingUniform")
      init::kaiming_uniform_(lin.weight, 0, torch::kFanIn, nonlinearity);
    else
      init::kaiming_normal_(lin.weight, 0, torch::kFanIn, nonlinearity);
    lin.bias.zero_();
  }
  std::int64_t dim_;
};
TORCH_MODULE(HypernetworkModule);

/// The web UI's Hypernetwork: a (k, v) pair of modules per context width, and its settings.
class Hypernetwork {
 public:
  std::string name;
  std::int64_t step = 0;
  HypernetworkOptions options;
  bool use_dropout = false;
  bool last_layer_dropout = true;
  std::optional<std::string> sd_checkpoint, sd_checkpoint_name, optional_info;
  std::map<std::int64_t, std::pair<HypernetworkModule, HypernetworkModule>> layers;

  Hypernetwork() = default;
  Hypernetwork(std::string name_, const std::vector<std::int64_t>& enable_sizes,
               HypernetworkOptions o, bool use_dropout_ = false, bool last_layer_dropout_ = true)
      : name(std::move(name_)),
        options(std::move(o)),
        use_dropout(use_dropout_),
        last_layer_dropout(last_layer_dropout_) {
    if (options.dropout_structure.empty())
      options.dropout_structure =
          parse_dropout_structure(options.layer_structure, use_dropout, last_layer_dropout);
    for (const std::int64_t size : enable_sizes)
      layers.emplace(size, std::make_pair(HypernetworkModule(size, options),
                                          HypernetworkModule(size, options)));
    eval();
  }

  /// The context for to_k and to_v: each transformed by the pair for its width, or unchanged.
  [[nodiscard]] std::pair<at::Tensor, at::Tensor> apply(const at::Tensor& context_k,
                                                        const at::Tensor& context_v) const {
    const auto it = layers.find(context_k.size(-1));
    if (it == layers.end()) return {context_k, context_v};
    HypernetworkModule k = it->second.first, v = it->second.second;  // holders share the modules
    return {k->forward(context_k), v->forward(context_v)};
  }

  /// All weights, for an optimizer; `train()` makes them trainable, `eval()` freezes them.
  [[nodiscard]] std::vector<at::Tensor> weights() const {
    std::vector<at::Tensor> out;
    for (const auto& [size, pair] : layers)
      for (const auto* m : {&pair.first, &pair.second})
        for (const auto& p : (*m)->parameters()) out.push_back(p);
    return out;
  }
  void train(bool on = true) {
    for (auto& [size, pair] : layers)
      for (auto* m : {&pair.first, &pair.second}) {
        (*m)->train(on);
        for (auto& p : (*m)->parameters()) p.set_requires_grad(on);
      }
  }
  void eval() { train(false); }
  void set_multiplier(double m) {
    for (auto& [size, pair] : layers) pair.first->multiplier = pair.second->multiplier = m;
  }

  /// The web UI's .pt layout.
  [[nodiscard]] c10::IValue state() const {
    auto root = io::torch_dict();
    auto module_sd = [](const HypernetworkModule& m) {
      auto d = io::torch_dict();
      for (const auto& [key, t] : nn::module_tensors(*m)) d.insert(key, t.detach().cpu().clone());
      return d;
    };
    for (const auto& [size, pair] : layers) {
      root.insert(size, c10::ivalue::Tuple::create(c10::IValue(module_sd(pair.first)),
                                                   c10::IValue(module_sd(pair.second))));
    }
    auto doubles = [](const std::vector<double>& v) {
      auto l = io::torch_list();
      for (double x : v) {
        if (x == std::floor(x))
          l.push_back(static_cast<std::int64_t>(x));
        else
          l.push_back(x);
      }
      return l;
    };
    auto opt = [](const std::optional<std::string>& s) {
      return s ? c10::IValue(*s) : c10::IValue();
    };
    root.insert("step", step);
    root.insert("name", name);
    root.insert("layer_structure", doubles(options.layer_structure));
    root.insert("activation_func", options.activation_func);
    root.insert("is_layer_norm", options.add_layer_norm);
    root.insert("weight_initialization", options.weight_init);
    root.insert("sd_checkpoint", opt(sd_checkpoint));
    root.insert("sd_checkpoint_name", opt(sd_checkpoint_name));
    root.insert("activate_output", options.activate_output);
    root.insert("use_dropout", use_dropout);
    auto ds = io::torch_list();
    for (double x : options.dropout_structure) ds.push_back(x);
    root.insert("dropout_structure", ds);
    root.insert("last_layer_dropout",
                options.dropout_structure.size() >= 2
                    ? options.dropout_structure[options.dropout_structure.size() - 2] != 0
                    : last_layer_dropout);
    root.insert("optional_info", opt(optional_info));
    return root;
  }
  void save(const std::filesystem::path& path) const { io::save_torch_file(path, state()); }

  /// Reads the web UI's layout with its defaults for missing settings.
  static Hypernetwork from_state(const io::TorchValue& root) {
    Hypernetwork h;
    auto get = [&](std::string_view key) { return root.find(key); };
    auto numbers = [](const io::TorchValue& v) {
      std::vector<double> out;
      for (const auto& e : v.elements()) out.push_back(e.number());
      return out;
    };
    auto opt_string = [&](std::string_view key) -> std::optional<std::string> {
      const auto v = get(key);
      return v ? v->optional_string() : std::nullopt;
    };
    if (auto v = get("layer_structure"); v && !v->is_none())
      h.options.layer_structure = numbers(*v);
    h.optional_info = opt_string("optional_info");
    if (auto v = get("activation_func"); v && !v->is_none())
      h.options.activation_func = v->string();
    if (auto v = get("weight_initialization"); v && !v->is_none())
      h.options.weight_init = v->string();
    if (auto v = get("is_layer_norm")) h.options.add_layer_norm = v->boolean();
    std::vector<double> dropout;
    if (auto v = get("dropout_structure"); v && !v->is_none()) dropout = numbers(*v);
    bool any = false;
    for (double d : dropout) any = any || d != 0;
    h.use_dropout = any ? true : (get("use_dropout") ? get("use_dropout")->boolean() : false);
    h.options.activate_output = get("activate_output") ? get("activate_output")->boolean() : true;
    h.last_layer_dropout = get("last_layer_dropout") ? get("last_layer_dropout")->boolean() : false;
    h.options.dropout_structure = dropout.empty()
                                      ? parse_dropout_structure(h.options.layer_structure,
                                                                h.use_dropout, h.last_layer_dropout)
                                      : dropout;
    for (double x : h.options.layer_structure)
      if (!(std::isfinite(x) && x > 0))
        throw FormatError("has a layer_structure entry that is not a positive number",
                          root.where());
    for (const auto& [key, value] : root.items()) {
      if (!key.isInt()) continue;
      const std::int64_t size = key.toInt();
      if (size <= 0) throw FormatError("has a layer width that is not positive", value.where());
      const auto pair = value.elements();
      if (pair.size() != 2)
        throw FormatError(
            "must hold two state dicts (k and v), holds " + std::to_string(pair.size()),
            value.where());
      for (const auto& sd : pair) {
        double held = 0;
        for (const auto& [name, t] : sd.tensor_map()) held += static_cast<double>(t.numel());
        const double needed = HypernetworkModuleImpl::parameter_count(size, h.options);
        if (needed > held)
          throw FormatError(
              "holds " + c10::str(held) + " numbers, the structure needs " + c10::str(needed),
              sd.where());
      }
      HypernetworkModule k(size, h.options), v(size, h.options);
      k->load(pair[0].tensor_map(), pair[0].where());
      v->load(pair[1].tensor_map(), pair[1].where());
      h.layers.emplace(size, std::make_pair(k, v));
    }
    if (auto v = get("name"); v && !v->is_none()) h.name = v->string();
    if (auto v = get("step"); v && !v->is_none()) h.step = v->integer();
    h.sd_checkpoint = opt_string("sd_checkpoint");
    h.sd_checkpoint_name = opt_string("sd_checkpoint_name");
    h.eval();
    return h;
  }
  static Hypernetwork load(const std::filesystem::path& path) {
    return from_state(io::load_torch_file(path));
  }
};

}  // namespace difftrain::adapters
