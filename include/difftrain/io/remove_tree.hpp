#pragma once
// Removing a folder and everything in it, without std::filesystem::remove_all.
//
// The torch wheel's libtorch.so exports std::filesystem symbols of its own build; in a program
// linked to it, std::filesystem::remove_all on a non-empty folder can resolve to those and crash.
// remove_tree walks the tree with POSIX nftw instead (depth first, symbolic links removed, never
// followed, other file systems not entered).

#include <ftw.h>
#include <unistd.h>

#include <sys/stat.h>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include "difftrain/core/error.hpp"

namespace difftrain::io {

namespace remove_tree_detail {
// nftw's callback cannot capture: the first failure is kept here (one walk per thread at a time).
inline thread_local std::string first_failure;
inline thread_local std::uintmax_t removed = 0;

inline int remove_entry(const char* path, const struct stat* /*st*/, int type, struct FTW* /*f*/) {
  const int rc = type == FTW_DP ? ::rmdir(path) : ::unlink(path);
  if (rc != 0) {
    first_failure = std::string(path) + ": " + std::strerror(errno);
    return 1;  // stop the walk
  }
  ++removed;
  return 0;
}
}  // namespace remove_tree_detail

/// Removes `path` and, when it is a folder, everything under it; returns how many entries went
/// (0 when `path` does not exist). A symbolic link is removed, not followed. What cannot be removed
/// is an IoError naming the first entry that stayed; entries removed before it are gone.
inline std::uintmax_t remove_tree(const std::filesystem::path& path) {
  if (path.empty()) throw IoError("is empty; name what to remove", "remove_tree");
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return 0;
    throw IoError(std::string("cannot be examined: ") + std::strerror(errno), path.string());
  }
  remove_tree_detail::first_failure.clear();
  remove_tree_detail::removed = 0;
  const int rc =
      ::nftw(path.c_str(), remove_tree_detail::remove_entry, 32, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
  if (rc != 0) {
    const std::string why = remove_tree_detail::first_failure.empty()
                                ? std::string(std::strerror(errno))
                                : remove_tree_detail::first_failure;
    throw IoError("could not be removed entirely (" + why + ")", path.string());
  }
  return remove_tree_detail::removed;
}

}  // namespace difftrain::io
