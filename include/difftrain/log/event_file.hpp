#pragma once
// TensorBoard event files: `events.out.tfevents.<seconds>.<host>.<pid>.<n>` in a run folder, a
// TFRecord stream of `Event` messages (tensorflow/core/util/event.proto): the file version first,
// then scalars, images (PNG), histograms, text and session markers.
//
// Records are buffered and reach the file in whole records, in one write() each flush: at least
// every `flush_seconds` (a background thread), when `max_pending_bytes` are buffered, on flush()
// and when the writer closes. A crash loses at most the last `flush_seconds`, and the file it
// leaves ends with whole records or one torn record, which TensorBoard's reader skips.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/atomic_file.hpp"
#include "difftrain/io/png.hpp"
#include "difftrain/log/protobuf_wire.hpp"
#include "difftrain/log/tfrecord.hpp"

namespace difftrain::log {

/// A histogram as TensorBoard stores it: bucket i holds the values in (bucket_limit[i-1],
/// bucket_limit[i]] (the first from `min`).
struct Histogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> bucket_limit;
  std::vector<double> bucket;
};

struct EventFileOptions {
  double flush_seconds = 2.0;                ///< the most a crash can lose
  std::size_t max_pending_bytes = 4u << 20;  ///< flush sooner when this much is buffered
  bool fsync_on_close = true;                ///< make the file durable when the writer closes
  std::string filename_suffix{};             ///< appended to the file name
};

namespace event_detail {
// Field numbers of event.proto / summary.proto.
enum EventField { kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5, kSessionLog = 7 };
enum ValueField { kTag = 1, kSimpleValue = 2, kImage = 4, kHisto = 5, kTensor = 8, kMetadata = 9 };
inline constexpr int kDtString = 7;       // tensorflow.DataType.DT_STRING
inline constexpr int kSessionStart = 1;   // SessionLog.START
inline constexpr int kColorspaceRgb = 3;  // Summary.Image.colorspace

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

inline std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  std::string h(buf);
  for (char& c : h)  // a file name, whatever the host calls itself
    if (c == '/' || c == '\0') c = '_';
  return h;
}

inline void check_tag(std::string_view tag, const std::string& where) {
  if (tag.empty()) throw ConfigError("a tag must not be empty", where);
}
}  // namespace event_detail

class EventFileWriter {
 public:
  /// Creates `dir` if needed and a new event file in it.
  explicit EventFileWriter(const std::filesystem::path& dir, EventFileOptions o = {})
      : o_(std::move(o)) {
    if (!(o_.flush_seconds > 0))
      throw ConfigError("flush_seconds must be > 0", "EventFileWriter options");
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw IoError("cannot create the folder: " + ec.message(), dir.string());
    const auto seconds = static_cast<long long>(event_detail::now_seconds());
    static std::atomic<int> counter{0};
    for (int attempt = 0; fd_ < 0; ++attempt) {
      path_ = dir / ("events.out.tfevents." + std::to_string(seconds) + "." +
                     event_detail::host_name() + "." + std::to_string(::getpid()) + "." +
                     std::to_string(counter++) + o_.filename_suffix);
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
      if (fd_ < 0 && (errno != EEXIST || attempt > 1000))
        throw IoError("cannot create the event file: " + io::detail::errno_text(), path_.string());
    }
    ProtoWriter e;
    e.f64(event_detail::kWallTime, event_detail::now_seconds())
        .int64(event_detail::kStep, 0)
        .bytes(event_detail::kFileVersion, "brain.Event:2");
    append_record(pending_, e.str());
    write_pending_locked();  // a file TensorBoard recognises from the start
    flusher_ = std::thread([this] { flush_loop(); });
  }
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;
  ~EventFileWriter() {
    try {
      close();
    } catch (...) {  // a destructor cannot report; close() explicitly to see the error
    }
  }

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

  void add_scalar(std::string_view tag, double value, std::int64_t step,
                  double wall_time = event_detail::now_seconds()) {
    add_scalars({{std::string(tag), value}}, step, wall_time);
  }
  /// Several scalars of one step in one event.
  void add_scalars(const std::vector<std::pair<std::string, double>>& values, std::int64_t step,
                   double wall_time = event_detail::now_seconds()) {
    ProtoWriter summary;
    for (const auto& [tag, v] : values) {
      event_detail::check_tag(tag, path_.string());
      ProtoWriter value;
      value.bytes(event_detail::kTag, tag).f32(event_detail::kSimpleValue, static_cast<float>(v));
      summary.message(1, value);
    }
    add_summary(summary, step, wall_time);
  }
  /// An image, stored as PNG.
  void add_image(std::string_view tag, const io::RgbImage& image, std::int64_t step,
                 double wall_time = event_detail::now_seconds()) {
    add_png(tag, image.width, image.height, io::encode_png(image), step, wall_time);
  }
  /// An image already encoded as PNG.
  void add_png(std::string_view tag, std::uint32_t width, std::uint32_t height,
               std::span<const char> png, std::int64_t step,
               double wall_time = event_detail::now_seconds()) {
    event_detail::check_tag(tag, path_.string());
    ProtoWriter img;
    img.int64(1, height).int64(2, width).int64(3, event_detail::kColorspaceRgb);
    img.bytes(4, std::string_view(png.data(), png.size()));
    ProtoWriter value;
    value.bytes(event_detail::kTag, tag).message(event_detail::kImage, img);
    add_summary(ProtoWriter().message(1, value), step, wall_time);
  }
  void add_histogram(std::string_view tag, const Histogram& h, std::int64_t step,
                     double wall_time = event_detail::now_seconds()) {
    event_detail::check_tag(tag, path_.string());
    if (h.bucket.size() != h.bucket_limit.size())
      throw ShapeError("a histogram has " + std::to_string(h.bucket.size()) + " buckets and " +
                           std::to_string(h.bucket_limit.size()) + " bucket limits",
                       std::string(tag));
    ProtoWriter histo;
    histo.f64(1, h.min).f64(2, h.max).f64(3, h.num).f64(4, h.sum).f64(5, h.sum_squares);
    histo.packed_f64(6, h.bucket_limit).packed_f64(7, h.bucket);
    ProtoWriter value;
    value.bytes(event_detail::kTag, tag).message(event_detail::kHisto, histo);
    add_summary(ProtoWriter().message(1, value), step, wall_time);
  }
  /// Text, rendered by TensorBoard's text plugin as Markdown (tables included).
  void add_text(std::string_view tag, std::string_view markdown, std::int64_t step,
                double wall_time = event_detail::now_seconds()) {
    event_detail::check_tag(tag, path_.string());
    ProtoWriter plugin;
    plugin.bytes(1, "text");
    ProtoWriter metadata;
    metadata.message(1, plugin);
    ProtoWriter shape;
    shape.message(2, ProtoWriter().int64(1, 1));
    ProtoWriter tensor;
    tensor.int64(1, event_detail::kDtString).message(2, shape).bytes(8, markdown);
    ProtoWriter value;
    value.bytes(event_detail::kTag, tag)
        .message(event_detail::kMetadata, metadata)
        .message(event_detail::kTensor, tensor);
    add_summary(ProtoWriter().message(1, value), step, wall_time);
  }
  /// Marks a restart at `step`: TensorBoard then drops what earlier files logged at `step` and
  /// after (the steps a run resumed from a checkpoint logs again).
  void add_session_start(std::int64_t step, double wall_time = event_detail::now_seconds()) {
    ProtoWriter log;
    log.int64(1, event_detail::kSessionStart);
    ProtoWriter e;
    e.f64(event_detail::kWallTime, wall_time)
        .int64(event_detail::kStep, step)
        .message(event_detail::kSessionLog, log);
    add_event(e.str());
  }

  /// Puts everything added so far into the file (the operating system's; close() also fsyncs).
  void flush() {
    std::lock_guard lock(mu_);
    rethrow_locked();
    write_pending_locked();
  }
  /// Flushes, stops the background flush, makes the file durable and closes it. Idempotent.
  void close() {
    {
      std::lock_guard lock(mu_);
      if (fd_ < 0) return;
      stop_ = true;
    }
    wake_.notify_all();
    if (flusher_.joinable()) flusher_.join();
    std::lock_guard lock(mu_);
    const int fd = std::exchange(fd_, -1);
    std::exception_ptr err = std::exchange(error_, nullptr);
    try {
      if (!err) {
        write_pending_to(fd);
        if (o_.fsync_on_close && ::fsync(fd) != 0)
          throw IoError("fsync failed: " + io::detail::errno_text(), path_.string());
      }
    } catch (...) {
      err = std::current_exception();
    }
    ::close(fd);
    if (err) std::rethrow_exception(err);
  }

 private:
  void add_summary(const ProtoWriter& summary, std::int64_t step, double wall_time) {
    ProtoWriter e;
    e.f64(event_detail::kWallTime, wall_time)
        .int64(event_detail::kStep, step)
        .message(event_detail::kSummary, summary);
    add_event(e.str());
  }
  void add_event(std::string_view event) {
    std::lock_guard lock(mu_);
    rethrow_locked();
    if (fd_ < 0) throw IoError("the event file is closed", path_.string());
    append_record(pending_, event);
    if (pending_.size() >= o_.max_pending_bytes) write_pending_locked();
  }
  // After a failed write (a full disk, say) the file may end in a torn record: nothing more is
  // appended after it, and every later call reports the failure.
  void rethrow_locked() {
    if (error_) std::rethrow_exception(error_);
  }
  void write_pending_locked() { write_pending_to(fd_); }
  void write_pending_to(int fd) {
    if (pending_.empty() || fd < 0) return;
    try {
      io::detail::write_all(fd, pending_, path_.string());
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
    pending_.clear();
  }
  void flush_loop() {
    std::unique_lock lock(mu_);
    const auto period = std::chrono::duration<double>(o_.flush_seconds);
    while (!stop_) {
      wake_.wait_for(lock, period, [&] { return stop_; });
      if (stop_ || error_) continue;
      try {
        write_pending_locked();
      } catch (...) {  // kept in error_: reported by the next call on the writer's thread
      }
    }
  }

  EventFileOptions o_;
  std::filesystem::path path_;
  int fd_ = -1;
  std::string pending_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread flusher_;
};

/// The TensorBoard event files in `dir` (not its subfolders), sorted by name; none when `dir` does
/// not exist.
inline std::vector<std::filesystem::path> event_files(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.is_regular_file() && e.path().filename().string().starts_with("events.out.tfevents."))
      out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

/// Removes the event files of `dir` (an earlier run's), leaving anything else in it.
inline void remove_event_files(const std::filesystem::path& dir) {
  for (const auto& file : event_files(dir)) {
    std::error_code ec;
    std::filesystem::remove(file, ec);
    if (ec)
      throw IoError("cannot remove an earlier run's event file: " + ec.message(), file.string());
  }
}

}  // namespace difftrain::log
