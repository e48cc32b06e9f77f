#pragma once
// The library version; kept in step with `project(VERSION)` in the top CMakeLists.txt
// (a test compares them).

namespace difftrain {
inline constexpr int version_major = 0;
inline constexpr int version_minor = 1;
inline constexpr int version_patch = 0;
inline constexpr const char* version_string = "0.1.0";
}  // namespace difftrain
