#pragma once
// Every writer goes through here: the bytes go to a temporary file in the destination's folder,
// which is flushed and fsync'd, then renamed over the destination, and the folder is fsync'd so the
// rename itself is durable. A crash or a kill at any point leaves either the old file or the new
// one, never a mix.

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/read_file.hpp"  // detail::errno_text

namespace difftrain::io {

namespace detail {
inline void write_all(int fd, std::span<const char> bytes, const std::string& where) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw IoError("write failed: " + errno_text(), where);
    done += static_cast<std::size_t>(n);
  }
}
}  // namespace detail

/// Writes a file in pieces and puts it in place atomically on commit(). Until then the destination
/// keeps its old content; destroying an uncommitted writer (an exception, an early return) removes
/// the temporary file. Used directly by writers that stream large files.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::filesystem::path path) : path_(std::move(path)) {
    dir_ = path_.has_parent_path() ? path_.parent_path() : std::filesystem::path(".");
    std::error_code ec;
    if (std::filesystem::exists(dir_, ec) && !std::filesystem::is_directory(dir_, ec))
      throw IoError("is not a folder (a file is in the way)", dir_.string());
    std::filesystem::create_directories(dir_, ec);
    if (ec) throw IoError("cannot create the folder: " + ec.message(), dir_.string());
    std::random_device rd;
    tmp_ = dir_ / ("." + path_.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                   std::to_string(rd()));
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0)
      throw IoError("cannot create a temporary file: " + detail::errno_text(), tmp_.string());
  }
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }

  void write(std::span<const char> bytes) {
    if (fd_ < 0) throw IoError("write after commit", tmp_.string());
    detail::write_all(fd_, bytes, tmp_.string());
  }

  /// fsync the data, rename over the destination, fsync the folder.
  void commit() {
    if (::fsync(fd_) != 0) throw IoError("fsync failed: " + detail::errno_text(), tmp_.string());
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw IoError("close failed: " + detail::errno_text(), tmp_.string());
    if (::rename(tmp_.c_str(), path_.c_str()) != 0)
      throw IoError("cannot rename the finished file into place: " + detail::errno_text(),
                    path_.string());
    committed_ = true;
    const int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);  // best effort: some file systems refuse fsync on folders
      ::close(dfd);
    }
    remove_stale_temporary_files();
  }

  [[nodiscard]] const std::filesystem::path& temporary_path() const { return tmp_; }

 private:
  // A write to this folder just succeeded, so the disk takes files again: what killed writers
  // left behind can go (best effort; a file that cannot be removed stays listed for next time).
  void remove_stale_temporary_files() const;

  std::filesystem::path path_, dir_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

/// Replaces `path` with `bytes` atomically and durably. Parent folders are created.
inline void write_file_atomic(const std::filesystem::path& path, std::span<const char> bytes) {
  AtomicFileWriter out(path);
  out.write(bytes);
  out.commit();
}

/// Temporary files that writers killed mid-write left in `dir` (names `.NAME.tmp-PID-N`), whose
/// process no longer runs. Removing them is safe; the finished files are never touched.
inline std::vector<std::filesystem::path> stale_temporary_files(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const auto at = name.rfind(".tmp-");
    if (name.empty() || name[0] != '.' || at == std::string::npos) continue;
    const std::string rest = name.substr(at + 5);
    const auto dash = rest.find('-');
    if (dash == std::string::npos || dash == 0) continue;
    if (rest.find_first_not_of("0123456789-") != std::string::npos) continue;
    pid_t pid = 0;
    const auto [end, err] = std::from_chars(rest.data(), rest.data() + dash, pid);
    if (err != std::errc() || pid <= 0) continue;  // not a name a writer gave
    if (pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH) out.push_back(entry.path());
  }
  return out;
}

inline void AtomicFileWriter::remove_stale_temporary_files() const {
  for (const auto& stale : stale_temporary_files(dir_)) {
    std::error_code ec;
    std::filesystem::remove(stale, ec);
  }
}

/// Creates the folder `dir` (and its parents) and proves a file can be created in it. An empty
/// path, a file in the way, a folder one may not write to or a read-only disk is an IoError naming
/// it, before any work whose results would have nowhere to go.
inline void ensure_writable_folder(const std::filesystem::path& dir) {
  if (dir.empty()) throw IoError("is empty; name the output folder", "output folder");
  // What every writer does first: make the folder and a temporary file in it, which the
  // uncommitted writer removes again.
  const AtomicFileWriter probe(dir / ".write-probe");
}

}  // namespace difftrain::io
