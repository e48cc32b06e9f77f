#pragma once
// Small parsing helpers shared by the string-configured schedules (web UI step strings, diffusers'
// piecewise rules). They accept what Python's int()/float() accept for these inputs (surrounding
// white space, signs, exponents) and reject, with a ConfigError naming the text, what would be
// silently wrong: non-finite numbers, trailing garbage, empty fields.

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::schedule {

inline std::string_view trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(" \t\r\n");
  return s.substr(first, last - first + 1);
}

/// Splits on `sep`, keeping empty fields (as Python's str.split(sep) does).
inline std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  std::size_t start = 0;
  while (true) {
    const auto at = s.find(sep, start);
    out.push_back(
        s.substr(start, at == std::string_view::npos ? std::string_view::npos : at - start));
    if (at == std::string_view::npos) break;
    start = at + 1;
  }
  return out;
}

inline std::int64_t parse_int(std::string_view text, const std::string& where) {
  std::string_view t = trim(text);
  if (!t.empty() && t.front() == '+') t.remove_prefix(1);
  std::int64_t value = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), value);
  if (t.empty() || ec != std::errc() || end != t.data() + t.size())
    throw ConfigError("'" + std::string(text) + "' is not a whole number of steps", where);
  return value;
}

inline double parse_finite(std::string_view text, const std::string& where) {
  std::string_view t = trim(text);
  if (!t.empty() && t.front() == '+') t.remove_prefix(1);
  double value = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), value);
  if (t.empty() || ec != std::errc() || end != t.data() + t.size())
    throw ConfigError("'" + std::string(text) + "' is not a number", where);
  if (!std::isfinite(value)) throw ConfigError("'" + std::string(text) + "' is not finite", where);
  return value;
}

/// Python's float `%`: the result has the sign of the divisor.
inline double python_mod(double a, double b) {
  const double r = std::fmod(a, b);
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

}  // namespace difftrain::schedule
