#pragma once
// ema::RuleByName: the EMA decay rule chosen at run time (a flag, a config file), beside the
// compile-time rules. The rule a name builds is the static rule of that name, so the decays are
// the same; the choice costs one std::visit per update.
//
//   struct Config : train::DefaultConfig { using Ema = ema::Ema<ema::RuleByName>; };
//   o.ema.rule = ema::RuleByName::from_json(nlohmann::json::parse(
//       R"({"rule": "warmup_decay", "decay": 0.9999, "use_ema_warmup": true})"));
//
// Settings are the chosen rule's Options fields under their names (`decay`, `min_decay`, ...); an
// unknown name, an unknown key, a value of the wrong kind or out of range is a ConfigError naming
// it.

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/ema/concepts.hpp"
#include "difftrain/ema/rules.hpp"

namespace difftrain::ema {

class RuleByName {
 public:
  static constexpr std::string_view name = "by_name";
  struct Options {
    std::string rule = "warmup_decay";  ///< constant, warmup_decay, lit_ema, ema_pytorch, karras
    nlohmann::json settings = nlohmann::json::object();  ///< the rule's option keys
  };

  explicit RuleByName(const Options& o) : rule_(make(o)) {}

  Action next() {
    return std::visit([](auto& r) { return r.next(); }, rule_);
  }
  /// The chosen rule's state (its "rule" key names it, so a resume with another rule is refused).
  [[nodiscard]] nlohmann::json state() const {
    return std::visit([](const auto& r) { return r.state(); }, rule_);
  }
  void load_state(const nlohmann::json& s) {
    std::visit([&s](auto& r) { r.load_state(s); }, rule_);
  }
  /// The keys of the chosen rule's state() that count updates.
  [[nodiscard]] std::vector<std::string_view> counter_keys() const {
    return std::visit(
        [](const auto& r) {
          const auto& c = std::decay_t<decltype(r)>::counters;
          return std::vector<std::string_view>(c.begin(), c.end());
        },
        rule_);
  }
  /// The name of the rule chosen.
  [[nodiscard]] std::string_view chosen() const {
    return std::visit([](const auto& r) { return std::decay_t<decltype(r)>::name; }, rule_);
  }
  /// The names it knows.
  static constexpr std::array<std::string_view, 5> names() {
    return {Constant::name, WarmupDecay::name, LitEma::name, EmaPytorch::name, Karras::name};
  }

  /// Options from a JSON object: "rule" and the rule's settings.
  static Options from_json(const nlohmann::json& j, const std::string& where = "ema rule") {
    if (!j.is_object()) throw ConfigError("must be a JSON object", where);
    Options o;
    for (const auto& [key, value] : j.items()) {
      if (key == "rule") {
        if (!value.is_string()) throw ConfigError("must be a string", where + ".rule");
        o.rule = value.get<std::string>();
      } else {
        o.settings[key] = value;
      }
    }
    (void)make(o, where);  // check now, where the settings came from
    return o;
  }

 private:
  using Variant = std::variant<Constant, WarmupDecay, LitEma, EmaPytorch, Karras>;

  // Reads the settings into a rule's Options, field by field, checking each value's kind; a key
  // the rule does not have is refused with the list of those it has.
  struct Reader {
    const nlohmann::json& j;
    std::string where;
    std::string rule;
    std::vector<std::string> known{};
    template <class T>
    void operator()(const char* key, T& field) {
      known.emplace_back(key);
      const auto it = j.find(key);
      if (it == j.end()) return;
      const bool ok = std::is_same_v<T, bool> ? it->is_boolean()
                      : std::is_integral_v<T> ? it->is_number_integer()
                                              : it->is_number();
      if (!ok)
        throw ConfigError("must be " +
                              std::string(std::is_same_v<T, bool> ? "true or false"
                                          : std::is_integral_v<T> ? "an integer"
                                                                  : "a number") +
                              ", got " + it->dump(),
                          where + "." + key);
      field = it->get<T>();
    }
    void finish() const {
      for (const auto& [key, value] : j.items())
        if (std::find(known.begin(), known.end(), key) == known.end()) {
          std::string list;
          for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
          throw ConfigError("is not a setting of the " + rule + " rule (known: " + list + ")",
                            where + "." + key);
        }
    }
  };

  static void fields(Reader& r, Constant::Options& o) { r("decay", o.decay); }
  static void fields(Reader& r, WarmupDecay::Options& o) {
    r("decay", o.decay);
    r("min_decay", o.min_decay);
    r("update_after_step", o.update_after_step);
    r("use_ema_warmup", o.use_ema_warmup);
    r("inv_gamma", o.inv_gamma);
    r("power", o.power);
  }
  static void fields(Reader& r, LitEma::Options& o) {
    r("decay", o.decay);
    r("use_num_updates", o.use_num_updates);
  }
  static void fields(Reader& r, EmaPytorch::Options& o) {
    r("beta", o.beta);
    r("update_after_step", o.update_after_step);
    r("update_every", o.update_every);
    r("inv_gamma", o.inv_gamma);
    r("power", o.power);
    r("min_value", o.min_value);
    r("update_model_with_ema_every", o.update_model_with_ema_every);
    r("update_model_with_ema_beta", o.update_model_with_ema_beta);
  }
  static void fields(Reader& r, Karras::Options& o) {
    r("gamma", o.gamma);
    r("sigma_rel", o.sigma_rel);
    r("update_every", o.update_every);
    r("frozen", o.frozen);
  }

  template <class R>
  static R with_settings(const nlohmann::json& settings, const std::string& where) {
    if (!settings.is_object()) throw ConfigError("settings must be a JSON object", where);
    typename R::Options o{};
    Reader reader{settings, where, std::string(R::name)};
    fields(reader, o);
    reader.finish();
    return R(o);  // the rule's own checks: out-of-range values are ConfigErrors naming them
  }

  static Variant make(const Options& o, const std::string& where = "ema rule") {
    if (o.rule == Constant::name) return with_settings<Constant>(o.settings, where);
    if (o.rule == WarmupDecay::name) return with_settings<WarmupDecay>(o.settings, where);
    if (o.rule == LitEma::name) return with_settings<LitEma>(o.settings, where);
    if (o.rule == EmaPytorch::name) return with_settings<EmaPytorch>(o.settings, where);
    if (o.rule == Karras::name) return with_settings<Karras>(o.settings, where);
    throw ConfigError("unknown EMA rule \"" + o.rule +
                          "\" (constant, warmup_decay, lit_ema, ema_pytorch, karras)",
                      where);
  }

  Variant rule_;
};

static_assert(DecayRule<RuleByName>);

}  // namespace difftrain::ema
