#pragma once
// An optimizer chosen at run time, by the name kohya's sd-scripts take in `--optimizer_type`,
// with its settings as that option's `--optimizer_args` strings ("key=value", the value a Python
// literal: 0.01, True, None, 0.9,0.999): one trainer type serves every optimizer policy, so a
// program does not instantiate its loop once per optimizer. The names (case-insensitive):
//   AdamW, Adam, AdamW8bit, SGD, SGDNesterov, Lion, Prodigy, Adafactor, CAME,
//   AdamWScheduleFree (also kohya's module paths: came_pytorch.CAME, transformers.optimization.
//   Adafactor, prodigyopt.Prodigy, lion_pytorch.Lion, bitsandbytes.optim.AdamW8bit,
//   schedulefree.AdamWScheduleFree).
// lr, betas, eps and weight decay come from the program's flags where the optimizer has them;
// `args` override them and set the rest. A name or key the optimizer does not have is a
// ConfigError that lists the ones it has.

#include <algorithm>
#include <cctype>
#include <charconv>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/train/optimizer.hpp"

namespace difftrain::train {

namespace by_name_detail {

inline std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

inline std::string trimmed(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

/// A value of `--optimizer_args`, read as Python's ast.literal_eval reads the ones that occur:
/// numbers, True/False, None and tuples of numbers ("0.9,0.999" or "(0.9, 0.999)").
class ArgValue {
 public:
  ArgValue(std::string key, std::string text) : key_(std::move(key)), text_(trimmed(text)) {}

  [[nodiscard]] bool is_none() const { return text_ == "None"; }
  [[nodiscard]] double number() const {
    const std::vector<double> v = numbers();
    if (v.size() != 1) fail("a number");
    return v.front();
  }
  [[nodiscard]] std::int64_t integer() const {
    const double v = number();
    if (v != static_cast<double>(static_cast<std::int64_t>(v))) fail("a whole number");
    return static_cast<std::int64_t>(v);
  }
  [[nodiscard]] bool boolean() const {
    if (text_ == "True" || text_ == "true") return true;
    if (text_ == "False" || text_ == "false") return false;
    fail("True or False");
    return false;
  }
  /// The numbers of a tuple (or the one number).
  [[nodiscard]] std::vector<double> numbers() const {
    std::string_view s = text_;
    if (s.size() >= 2 &&
        ((s.front() == '(' && s.back() == ')') || (s.front() == '[' && s.back() == ']'))) {
      s.remove_prefix(1);
      s.remove_suffix(1);
    }
    std::vector<double> out;
    while (!s.empty()) {
      const std::size_t comma = s.find(',');
      const std::string item = trimmed(s.substr(0, comma));
      s = comma == std::string_view::npos ? std::string_view{} : s.substr(comma + 1);
      if (item.empty() && s.empty() && !out.empty()) break;  // "(0.9,)": a trailing comma
      double v = 0;
      const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
      if (ec != std::errc{} || end != item.data() + item.size() || item.empty())
        fail("a number or a tuple of numbers");
      out.push_back(v);
    }
    if (out.empty()) fail("a number or a tuple of numbers");
    return out;
  }
  [[nodiscard]] std::vector<double> tuple(std::size_t n) const {
    std::vector<double> v = numbers();
    if (v.size() != n) fail("a tuple of " + std::to_string(n) + " numbers");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& want) const {
    throw ConfigError("'" + text_ + "' is not " + want, "--optimizer_args " + key_);
  }
  std::string key_, text_;
};

/// Applies each "key=value" of `args` with the setter named by the key; a key without a setter
/// is refused, naming the keys `type` takes.
inline void apply_args(const std::vector<std::string>& args, const std::string& type,
                       const std::map<std::string, std::function<void(const ArgValue&)>>& setters) {
  for (const std::string& arg : args) {
    const std::size_t eq = arg.find('=');
    if (eq == std::string::npos)
      throw ConfigError("'" + arg + "' is not key=value", "--optimizer_args");
    const std::string key = trimmed(std::string_view(arg).substr(0, eq));
    const auto it = setters.find(key);
    if (it == setters.end()) {
      std::string known;
      for (const auto& [k, f] : setters) known += (known.empty() ? "" : ", ") + k;
      throw ConfigError("'" + key + "' is not a setting of " + type + " (it takes: " + known + ")",
                        "--optimizer_args");
    }
    it->second(ArgValue(key, arg.substr(eq + 1)));
  }
}

}  // namespace by_name_detail

struct OptimizerByName {
  static constexpr std::string_view name = "by_name";
  struct Options {
    std::string type = "AdamW";
    double lr = 1e-4;
    double beta1 = 0.9, beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 1e-2;
    std::vector<std::string> args{};  // "key=value"
    AdamKernel kernel = AdamKernel::fused;
  };

  /// Every name `type` takes, as kohya spells them.
  static std::vector<std::string> known() {
    return {"AdamW", "Adam",    "AdamW8bit", "SGD",  "SGDNesterov",
            "Lion",  "Prodigy", "Adafactor", "CAME", "AdamWScheduleFree"};
  }

  /// The policy `type` names (its `name`): what a checkpoint records.
  static std::string chosen_name(const Options& o) {
    const std::string t = canonical(o.type);
    if (t == "sgdnesterov") return std::string(SGD::name);
    return t;
  }

  static std::unique_ptr<torch::optim::Optimizer> make(const std::vector<ParamGroup>& groups,
                                                       const Options& o) {
    using by_name_detail::ArgValue;
    using Setters = std::map<std::string, std::function<void(const ArgValue&)>>;
    const std::string t = canonical(o.type);
    auto betas = [](double& b1, double& b2) {
      return [&b1, &b2](const ArgValue& v) {
        const auto b = v.tuple(2);
        b1 = b[0];
        b2 = b[1];
      };
    };
    auto number = [](double& x) { return [&x](const ArgValue& v) { x = v.number(); }; };
    auto integer = [](std::int64_t& x) { return [&x](const ArgValue& v) { x = v.integer(); }; };
    auto flag = [](bool& x) { return [&x](const ArgValue& v) { x = v.boolean(); }; };
    using by_name_detail::apply_args;
    if (t == "adamw" || t == "adam") {
      auto fill = [&](auto p) {
        p.lr = o.lr;
        p.beta1 = o.beta1;
        p.beta2 = o.beta2;
        p.eps = o.eps;
        p.weight_decay = o.weight_decay;
        p.kernel = o.kernel;
        apply_args(o.args, o.type,
                   Setters{{"betas", betas(p.beta1, p.beta2)},
                           {"eps", number(p.eps)},
                           {"weight_decay", number(p.weight_decay)},
                           {"amsgrad", flag(p.amsgrad)}});
        return p;
      };
      if (t == "adam") return Adam::make(groups, fill(Adam::Options{}));
      return AdamW::make(groups, fill(AdamW::Options{}));
    }
    if (t == "adamw8bit") {
      AdamW8bit::Options p{.lr = o.lr,
                           .beta1 = o.beta1,
                           .beta2 = o.beta2,
                           .eps = o.eps,
                           .weight_decay = o.weight_decay};
      apply_args(o.args, o.type,
                 Setters{{"betas", betas(p.beta1, p.beta2)},
                         {"eps", number(p.eps)},
                         {"weight_decay", number(p.weight_decay)},
                         {"min_8bit_size", integer(p.min_8bit_size)}});
      return AdamW8bit::make(groups, p);
    }
    if (t == "sgd" || t == "sgdnesterov") {
      // kohya's SGDNesterov: momentum 0.9 unless given, Nesterov on.
      SGD::Options p{.lr = o.lr, .weight_decay = o.weight_decay};
      if (t == "sgdnesterov") p.momentum = 0.9, p.nesterov = true;
      apply_args(o.args, o.type,
                 Setters{{"momentum", number(p.momentum)},
                         {"dampening", number(p.dampening)},
                         {"weight_decay", number(p.weight_decay)},
                         {"nesterov", flag(p.nesterov)}});
      return SGD::make(groups, p);
    }
    if (t == "lion") {
      Lion::Options p{.lr = o.lr, .weight_decay = o.weight_decay};
      apply_args(o.args, o.type,
                 Setters{{"betas", betas(p.beta1, p.beta2)},
                         {"weight_decay", number(p.weight_decay)},
                         {"decoupled_weight_decay", flag(p.decoupled_weight_decay)}});
      return Lion::make(groups, p);
    }
    if (t == "prodigy") {
      Prodigy::Options p;
      p.lr = o.lr;
      p.beta1 = o.beta1;
      p.beta2 = o.beta2;
      p.eps = o.eps;
      p.weight_decay = o.weight_decay;
      apply_args(o.args, o.type,
                 Setters{{"betas", betas(p.beta1, p.beta2)},
                         {"beta3",
                          [&](const ArgValue& v) {
                            if (!v.is_none()) p.beta3 = v.number();
                          }},
                         {"eps", number(p.eps)},
                         {"weight_decay", number(p.weight_decay)},
                         {"decouple", flag(p.decouple)},
                         {"use_bias_correction", flag(p.use_bias_correction)},
                         {"safeguard_warmup", flag(p.safeguard_warmup)},
                         {"d0", number(p.d0)},
                         {"d_coef", number(p.d_coef)},
                         {"growth_rate", number(p.growth_rate)},
                         {"slice_p", integer(p.slice_p)}});
      return Prodigy::make(groups, p);
    }
    if (t == "adafactor") {
      // transformers' defaults (weight decay 0), whatever the program's AdamW flags say.
      Adafactor::Options p;
      p.lr = o.lr;
      apply_args(o.args, o.type,
                 Setters{{"eps",
                          [&](const ArgValue& v) {
                            const auto e = v.tuple(2);
                            p.eps1 = e[0];
                            p.eps2 = e[1];
                          }},
                         {"clip_threshold", number(p.clip_threshold)},
                         {"decay_rate", number(p.decay_rate)},
                         {"beta1",
                          [&](const ArgValue& v) {
                            if (v.is_none())
                              p.beta1.reset();
                            else
                              p.beta1 = v.number();
                          }},
                         {"weight_decay", number(p.weight_decay)},
                         {"scale_parameter", flag(p.scale_parameter)},
                         {"relative_step", flag(p.relative_step)},
                         {"warmup_init", flag(p.warmup_init)}});
      return Adafactor::make(groups, p);
    }
    if (t == "came") {
      CAME::Options p{.lr = o.lr, .weight_decay = o.weight_decay};
      apply_args(o.args, o.type,
                 Setters{{"eps",
                          [&](const ArgValue& v) {
                            const auto e = v.tuple(2);
                            p.eps1 = e[0];
                            p.eps2 = e[1];
                          }},
                         {"betas",
                          [&](const ArgValue& v) {
                            const auto b = v.tuple(3);
                            p.beta1 = b[0];
                            p.beta2 = b[1];
                            p.beta3 = b[2];
                          }},
                         {"clip_threshold", number(p.clip_threshold)},
                         {"weight_decay", number(p.weight_decay)}});
      return CAME::make(groups, p);
    }
    if (t == "adamw_schedulefree") {
      AdamWScheduleFree::Options p{.lr = o.lr,
                                   .beta1 = o.beta1,
                                   .beta2 = o.beta2,
                                   .eps = o.eps,
                                   .weight_decay = o.weight_decay};
      apply_args(o.args, o.type,
                 Setters{{"betas", betas(p.beta1, p.beta2)},
                         {"eps", number(p.eps)},
                         {"weight_decay", number(p.weight_decay)},
                         {"warmup_steps", integer(p.warmup_steps)},
                         {"r", number(p.r)},
                         {"weight_lr_power", number(p.weight_lr_power)}});
      return AdamWScheduleFree::make(groups, p);
    }
    throw ConfigError("unreachable", "--optimizer_type");  // canonical() refused it
  }

 private:
  /// The policy name `type` stands for; a ConfigError naming the known ones otherwise.
  static std::string canonical(const std::string& type) {
    static const std::map<std::string, std::string> names = {
        {"adamw", "adamw"},
        {"torch.optim.adamw", "adamw"},
        {"adam", "adam"},
        {"torch.optim.adam", "adam"},
        {"adamw8bit", "adamw8bit"},
        {"bitsandbytes.optim.adamw8bit", "adamw8bit"},
        {"sgd", "sgd"},
        {"torch.optim.sgd", "sgd"},
        {"sgdnesterov", "sgdnesterov"},
        {"lion", "lion"},
        {"lion_pytorch.lion", "lion"},
        {"prodigy", "prodigy"},
        {"prodigyopt.prodigy", "prodigy"},
        {"adafactor", "adafactor"},
        {"transformers.optimization.adafactor", "adafactor"},
        {"came", "came"},
        {"came_pytorch.came", "came"},
        {"adamwschedulefree", "adamw_schedulefree"},
        {"adamw_schedulefree", "adamw_schedulefree"},
        {"schedulefree.adamwschedulefree", "adamw_schedulefree"}};
    const auto it = names.find(by_name_detail::lower(by_name_detail::trimmed(type)));
    if (it != names.end()) return it->second;
    std::string list;
    for (const std::string& k : known()) list += (list.empty() ? "" : ", ") + k;
    throw ConfigError("'" + type + "' is not an optimizer difftrain has (it has: " + list + ")",
                      "--optimizer_type");
  }
};

}  // namespace difftrain::train
