#pragma once
// Every writer goes through here: the bytes go to a temporary file in the destination's folder,
// which is flushed and fsync'd, then renamed over the destination, and the folder is fsync'd so the
// rename itself is durable. A crash or a kill at any point leaves either the old file or the new
// one, never a mix.

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::io {

namespace detail {
inline std::string errno_text() { return std::strerror(errno); }

inline void write_all(int fd, std::span<const char> bytes, const std::string& where) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw FormatError("write failed: " + errno_text(), where);
    done += static_cast<std::size_t>(n);
  }
}
}  // namespace detail

/// Replaces `path` with `bytes` atomically and durably. Parent folders are created.
inline void write_file_atomic(const std::filesystem::path& path, std::span<const char> bytes) {
  const std::string where = path.string();
  const std::filesystem::path dir =
      path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw FormatError("cannot create folder: " + ec.message(), dir.string());
  std::random_device rd;
  const std::filesystem::path tmp = dir / ("." + path.filename().string() + ".tmp-" +
                                           std::to_string(::getpid()) + "-" + std::to_string(rd()));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0)
    throw FormatError("cannot create a temporary file: " + detail::errno_text(), tmp.string());
  try {
    detail::write_all(fd, bytes, tmp.string());
    if (::fsync(fd) != 0) throw FormatError("fsync failed: " + detail::errno_text(), tmp.string());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw FormatError("close failed: " + detail::errno_text(), tmp.string());
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = detail::errno_text();
    ::unlink(tmp.c_str());
    throw FormatError("cannot rename the finished file into place: " + why, where);
  }
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // best effort: some file systems refuse fsync on folders
    ::close(dfd);
  }
}

/// The whole file; a missing or unreadable file is a FormatError naming it.
inline std::vector<char> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FormatError("cannot open the file for reading", path.string());
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw FormatError("read failed", path.string());
  return bytes;
}

}  // namespace difftrain::io
