#pragma once
// An append-only CSV log (the loss logs a training run writes, one row per step). Each row goes to
// the file in a single write() on an O_APPEND descriptor, so rows from a crashed run are either
// whole or missing, never interleaved. On opening an existing log the header must match, and a row
// torn by a crash (no final newline) is cut off, so a resumed run appends clean rows after it.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/atomic_file.hpp"

namespace difftrain::io {

class CsvLog {
 public:
  /// Opens (creating if needed) the log at `path` with these columns.
  CsvLog(std::filesystem::path path, std::vector<std::string> columns)
      : path_(std::move(path)), columns_(std::move(columns)) {
    if (columns_.empty()) throw ConfigError("a CSV log needs at least one column", path_.string());
    for (const auto& c : columns_) check_cell(c, "column name");
    if (path_.has_parent_path()) {
      std::error_code ec;
      std::filesystem::create_directories(path_.parent_path(), ec);
      if (ec)
        throw IoError("cannot create the folder: " + ec.message(), path_.parent_path().string());
    }
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) throw IoError("cannot open the log: " + detail::errno_text(), path_.string());
    struct stat st {};
    if (::fstat(fd_, &st) == 0 && !S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw IoError("is not a regular file", path_.string());
    }
    try {
      adopt_existing();
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  CsvLog(const CsvLog&) = delete;
  CsvLog& operator=(const CsvLog&) = delete;
  CsvLog(CsvLog&& o) noexcept
      : path_(std::move(o.path_)), columns_(std::move(o.columns_)), fd_(o.fd_) {
    o.fd_ = -1;
  }
  ~CsvLog() {
    if (fd_ >= 0) ::close(fd_);
  }

  /// Appends one row; numbers are written in the shortest form that reads back exactly.
  template <typename... Cells>
  void row(const Cells&... cells) {
    if (sizeof...(Cells) != columns_.size())
      throw ShapeError("a row has " + std::to_string(sizeof...(Cells)) + " cells but the log has " +
                           std::to_string(columns_.size()) + " columns",
                       path_.string());
    std::string line;
    bool first = true;
    ((line += first ? "" : ",", first = false, append_cell(line, cells)), ...);
    line += '\n';
    detail::write_all(fd_, line, path_.string());
  }

  /// Makes the rows written so far durable.
  void flush() {
    if (::fsync(fd_) != 0) throw IoError("fsync failed: " + detail::errno_text(), path_.string());
  }

  /// Drops the rows whose first cell is a step after `step` (rows written after the checkpoint a
  /// run resumes from; the resumed run writes them again). The file is replaced atomically.
  void drop_rows_after(std::int64_t step) {
    const std::string text = contents();
    std::string kept;
    bool dropped = false;
    std::size_t at = 0;
    for (bool header = true; at < text.size(); header = false) {
      const auto nl = text.find('\n', at);
      const std::string_view line(text.data() + at,
                                  (nl == std::string::npos ? text.size() : nl) - at);
      at = nl == std::string::npos ? text.size() : nl + 1;
      std::int64_t row_step = 0;
      const std::string_view first = line.substr(0, line.find(','));
      const auto [end, err] = std::from_chars(first.data(), first.data() + first.size(), row_step);
      if (!header &&
          (err != std::errc() || end != first.data() + first.size() || row_step > step)) {
        dropped = true;
        continue;
      }
      kept.append(line);
      kept += '\n';
    }
    if (!dropped) return;
    write_file_atomic(path_, kept);
    const int fd = ::open(path_.c_str(), O_RDWR | O_APPEND | O_CLOEXEC);
    if (fd < 0) throw IoError("cannot reopen the log: " + detail::errno_text(), path_.string());
    ::close(fd_);
    fd_ = fd;
  }

  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] const std::vector<std::string>& columns() const { return columns_; }

 private:
  static void check_cell(std::string_view s, const char* what) {
    if (s.find_first_of(",\n\r\"") != std::string_view::npos)
      throw ConfigError(
          std::string(what) + " '" + std::string(s) + "' contains a comma, quote or line break",
          "CsvLog");
  }
  static void append_cell(std::string& line, const std::string& s) {
    check_cell(s, "cell");
    line += s;
  }
  static void append_cell(std::string& line, const char* s) { append_cell(line, std::string(s)); }
  template <typename T>
  requires std::is_arithmetic_v<T>
  static void append_cell(std::string& line, T v) {
    if constexpr (std::is_floating_point_v<T>) {
      if (std::isnan(v)) return void(line += "nan");
      if (std::isinf(v)) return void(line += v > 0 ? "inf" : "-inf");
    }
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    line.append(buf, r.ptr);
  }

  std::string header_line() const {
    std::string h;
    for (std::size_t i = 0; i < columns_.size(); ++i) h += (i ? "," : "") + columns_[i];
    return h + "\n";
  }

  // The log as it is on disk now.
  [[nodiscard]] std::string contents() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0)
      throw IoError("stat failed: " + detail::errno_text(), path_.string());
    std::string text(static_cast<std::size_t>(st.st_size), '\0');
    if (::pread(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()))
      throw IoError("cannot read the existing log", path_.string());
    return text;
  }

  void adopt_existing() {
    const std::string text = contents();
    if (text.empty()) return detail::write_all(fd_, header_line(), path_.string());
    const std::string want = header_line();
    const auto first_nl = text.find('\n');
    if (first_nl == std::string::npos && want.starts_with(text)) {  // the header itself was torn
      if (::ftruncate(fd_, 0) != 0)
        throw IoError("cannot rewrite a torn header: " + detail::errno_text(), path_.string());
      return detail::write_all(fd_, want, path_.string());
    }
    const std::string have = first_nl == std::string::npos ? text : text.substr(0, first_nl + 1);
    if (have != want)
      throw FormatError("the existing log has columns '" + have.substr(0, have.find('\n')) +
                            "', expected '" + want.substr(0, want.size() - 1) + "'",
                        path_.string());
    if (text.back() != '\n') {  // a row cut short by a crash: drop it
      const auto keep = text.rfind('\n') + 1;
      if (::ftruncate(fd_, static_cast<off_t>(keep)) != 0)
        throw IoError("cannot cut a torn last row: " + detail::errno_text(), path_.string());
    }
  }

  std::filesystem::path path_;
  std::vector<std::string> columns_;
  int fd_ = -1;
};

}  // namespace difftrain::io
