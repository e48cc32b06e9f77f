#pragma once
// Python's str.replace and str.split, for the name and caption rules difftrain follows from Python
// code (diffusers' conversion tables, kohya's caption processing), where the exact semantics
// decide the result.

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace difftrain {

/// Python's s.replace(from, to): every occurrence, left to right, none inside a replacement. An
/// empty `from` leaves `s` as it is (no caller means Python's insert-between-characters).
inline std::string python_replace(std::string s, std::string_view from, std::string_view to) {
  if (from.empty()) return s;
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

/// Python's s.split(sep, max_splits) for a non-empty `sep` (npos: every separator).
inline std::vector<std::string> python_split(const std::string& s, std::string_view sep,
                                             std::size_t max_splits = std::string::npos) {
  std::vector<std::string> out;
  std::size_t start = 0, splits = 0;
  for (std::size_t at = s.find(sep); at != std::string::npos && splits < max_splits;
       at = s.find(sep, start), ++splits) {
    out.push_back(s.substr(start, at - start));
    start = at + sep.size();
  }
  out.push_back(s.substr(start));
  return out;
}

}  // namespace difftrain
