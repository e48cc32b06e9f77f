#pragma once
// Reading a diffusers `config.json` field by field. Every field read is remembered, so after a
// model has taken what it understands, the rest can be refused by name: a field difftrain does not
// know is a ConfigError, never silently ignored (a model built without it would not be the model
// the file describes). Fields starting with "_" (`_class_name`, `_diffusers_version`, ...) are
// bookkeeping and always accepted.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::models {

/// An optional config value as JSON: the value, or null (diffusers writes absent options as null).
template <class T>
nlohmann::json value_or_null(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

class ConfigReader {
 public:
  ConfigReader(nlohmann::json config, std::string where)
      : j_(std::move(config)), where_(std::move(where)) {
    if (!j_.is_object())
      throw ConfigError("a model config must be a JSON object, got " + std::string(j_.type_name()),
                        where_);
  }

  [[nodiscard]] const std::string& where() const { return where_; }
  [[nodiscard]] const nlohmann::json& json() const { return j_; }

  /// The field, or `fallback` when absent or null.
  template <class T>
  T get(const std::string& key, T fallback) {
    return optional<T>(key).value_or(std::move(fallback));
  }

  /// The field, or nothing when absent or null.
  template <class T>
  std::optional<T> optional(const std::string& key) {
    read_.insert(key);
    const auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return std::nullopt;
    return convert<T>(*it, key);
  }

  /// An integer (or bool, string...) that diffusers lets be one value for every block or a list
  /// with one entry per block: always returns `n` entries.
  template <class T>
  std::vector<T> per_block(const std::string& key, std::size_t n, T fallback) {
    read_.insert(key);
    const auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return std::vector<T>(n, fallback);
    if (!it->is_array()) return std::vector<T>(n, convert<T>(*it, key));
    auto v = convert<std::vector<T>>(*it, key);
    if (v.size() != n)
      throw ConfigError("'" + key + "' has " + std::to_string(v.size()) +
                            " entries; it needs one " + "per block (" + std::to_string(n) +
                            ") or a single value",
                        where_);
    return v;
  }

  /// A field difftrain reads but supports only at `supported` (its diffusers default): any other
  /// value is refused by name.
  void require_default(const std::string& key, const nlohmann::json& supported,
                       const std::string& why = "") {
    read_.insert(key);
    const auto it = j_.find(key);
    if (it == j_.end() || *it == supported) return;
    throw ConfigError("'" + key + "' = " + it->dump() + " is not supported (only " +
                          supported.dump() + ")" + (why.empty() ? "" : ": " + why),
                      where_);
  }

  /// A field with no effect on the model difftrain builds (as in diffusers for this model).
  void accept(const std::string& key) { read_.insert(key); }

  /// Throws for the first field nobody read.
  void finish() const {
    for (const auto& [key, value] : j_.items()) {
      if (key.starts_with("_") || read_.contains(key)) continue;
      throw ConfigError("unknown field '" + key + "' = " + value.dump() +
                            " (not a field this model has; a newer diffusers option?)",
                        where_);
    }
  }

 private:
  template <class T>
  T convert(const nlohmann::json& v, const std::string& key) const {
    try {
      // nlohmann converts a float to an integer by truncation; a config that says 2.5 layers is
      // wrong, not 2.
      if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
        if (!v.is_number_integer())
          throw ConfigError("'" + key + "' must be an integer, got " + v.dump(), where_);
      }
      if constexpr (std::is_same_v<T, bool>) {
        if (!v.is_boolean())
          throw ConfigError("'" + key + "' must be true or false, got " + v.dump(), where_);
      }
      if constexpr (std::is_same_v<T, std::vector<std::int64_t>>) {
        for (const auto& e : v)
          if (!e.is_number_integer())
            throw ConfigError("'" + key + "' must be a list of integers, got " + v.dump(), where_);
      }
      return v.get<T>();
    } catch (const nlohmann::json::exception&) {
      throw ConfigError("'" + key + "' has the wrong type: " + v.dump(), where_);
    }
  }

  nlohmann::json j_;
  std::string where_;
  std::set<std::string> read_;
};

}  // namespace difftrain::models
