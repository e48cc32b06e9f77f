#pragma once
// Reading whole files, and opening one for reading with the checks every reader needs first (a
// regular file, not a folder; a missing file or no permission is an IoError naming it). Writing
// is in atomic_file.hpp.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::io {

namespace detail {
inline std::string errno_text() { return std::strerror(errno); }
}  // namespace detail

/// Opens `path` for reading and checks that it is a regular file; returns the descriptor (the
/// caller closes it) and fills `st`. A missing file, a folder, a FIFO or device, or no permission
/// is an IoError. Opened non-blocking, so a FIFO where a file belongs is refused at once instead of
/// waiting forever for a writer; blocking reads are restored before the descriptor is returned.
inline int open_for_reading(const std::filesystem::path& path, struct stat& st) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    throw IoError("cannot open the file for reading: " + detail::errno_text(), path.string());
  if (::fstat(fd, &st) != 0) {
    const std::string why = detail::errno_text();
    ::close(fd);
    throw IoError("cannot stat the file: " + why, path.string());
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(S_ISDIR(st.st_mode)    ? "is a folder, not a file"
                  : S_ISFIFO(st.st_mode) ? "is a FIFO (named pipe), not a file"
                                         : "is not a regular file",
                  path.string());
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) (void)::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

/// The whole file. A missing file, a folder or a failing read is an IoError naming it.
inline std::vector<char> read_file(const std::filesystem::path& path) {
  struct stat st {};
  const int fd = open_for_reading(path, st);
  std::vector<char> bytes;
  try {
    bytes.resize(static_cast<std::size_t>(st.st_size));
    std::size_t done = 0;
    while (true) {
      if (done == bytes.size()) bytes.resize(bytes.size() + 65536);  // the file may have grown
      const ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw IoError("read failed: " + detail::errno_text(), path.string());
      if (n == 0) break;
      done += static_cast<std::size_t>(n);
    }
    bytes.resize(done);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return bytes;
}

}  // namespace difftrain::io
