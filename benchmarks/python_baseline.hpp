#pragma once
// A baseline measured by a Python script in the same run: the script prints
// {"seconds_per_step": ...} and this returns that number (or -1 when it did not run).

#include <cstdio>
#include <string>

namespace difftrain::bench {

inline double python_seconds_per_step(const std::string& command) {
  std::FILE* p = ::popen((command + " 2>/dev/null").c_str(), "r");
  if (p == nullptr) return -1.0;
  char buf[512] = {};
  const std::size_t n = std::fread(buf, 1, sizeof buf - 1, p);
  ::pclose(p);
  const std::string out(buf, n);
  const auto at = out.find("\"seconds_per_step\": ");
  return at == std::string::npos ? -1.0 : std::stod(out.substr(at + 20));
}

}  // namespace difftrain::bench
