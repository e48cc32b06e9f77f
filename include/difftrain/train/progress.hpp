#pragma once
// A progress line people can trust: done/total, a bar, the rate over the last stretch of work
// (not since the start, so a slow warm-up does not skew it), the ETA from that rate, and whatever
// the caller adds (loss, LR). On a terminal it is redrawn in place; elsewhere (a CI log, a file)
// it prints a whole line every `lines_every` updates, or nothing.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <string>
#include <utility>

namespace difftrain::train {

class ProgressLine {
 public:
  struct Options {
    std::string label = "train";
    std::int64_t total = 0;        ///< 0: unknown (no bar, no ETA)
    std::int64_t every = 1;        ///< on a terminal: redraw every N updates
    std::int64_t lines_every = 0;  ///< not a terminal: a line every N updates; 0: quiet
    bool force = false;            ///< draw in place even when not a terminal
    std::FILE* out = stderr;
    int bar_width = 24;
  };
  using Clock = std::chrono::steady_clock;

  ProgressLine() : ProgressLine(Options()) {}
  explicit ProgressLine(Options o)
      : o_(std::move(o)), terminal_(o_.force || ::isatty(::fileno(o_.out)) != 0) {}

  /// Starts timing at `done` (a resumed run starts past 0).
  void start(std::int64_t done = 0, Clock::time_point now = Clock::now()) {
    history_.clear();
    history_.emplace_back(done, now);
    first_ = done;
    drawn_ = false;
  }
  /// Records progress and shows it when it is time to.
  void update(std::int64_t done, const std::string& extra = {},
              Clock::time_point now = Clock::now()) {
    record(done, now);
    if (terminal_) {
      if (o_.every > 0 && (done % o_.every == 0 || done == o_.total))
        draw("\r" + line(done, extra) + "\033[K", false);  // then clear what a longer one left
    } else if (o_.lines_every > 0 && (done % o_.lines_every == 0 || done == o_.total)) {
      draw(line(done, extra) + "\n", true);
    }
  }
  /// Ends the line on a terminal.
  void finish() {
    if (terminal_ && drawn_) std::fputc('\n', o_.out);
    drawn_ = false;
  }

  /// Units per second over the recent window (the last ~30 updates or 30 seconds).
  [[nodiscard]] double rate() const {
    if (history_.size() < 2) return 0.0;
    const auto& [d0, t0] = history_.front();
    const auto& [d1, t1] = history_.back();
    const double dt = std::chrono::duration<double>(t1 - t0).count();
    return dt > 0 ? static_cast<double>(d1 - d0) / dt : 0.0;
  }
  /// The text for `done` (what a terminal shows, without the carriage return).
  [[nodiscard]] std::string line(std::int64_t done, const std::string& extra = {}) const {
    char buf[160];
    std::string s = o_.label + " ";
    if (o_.total > 0) {
      std::snprintf(buf, sizeof buf, "%lld/%lld ", static_cast<long long>(done),
                    static_cast<long long>(o_.total));
      s += buf;
      const double f = std::min(1.0, std::max(0.0, static_cast<double>(done) / o_.total));
      const int full = static_cast<int>(f * o_.bar_width);
      s += "[" + std::string(full, '#') + std::string(o_.bar_width - full, '.') + "]";
      std::snprintf(buf, sizeof buf, " %3.0f%%", 100 * f);
      s += buf;
    } else {
      s += std::to_string(done);
    }
    const double r = rate();
    std::snprintf(buf, sizeof buf, r >= 1 || r == 0 ? "  %.2f it/s" : "  %.2f s/it",
                  r >= 1 || r == 0 ? r : 1 / r);
    s += buf;
    s += "  eta " + eta(done);
    if (!extra.empty()) s += "  " + extra;
    return s;
  }
  [[nodiscard]] std::string eta(std::int64_t done) const {
    const double r = rate();
    if (o_.total <= 0 || r <= 0) return "?";
    const auto left = static_cast<long long>(static_cast<double>(o_.total - done) / r + 0.5);
    char buf[32];
    if (left >= 3600)
      std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", left / 3600, left / 60 % 60, left % 60);
    else
      std::snprintf(buf, sizeof buf, "%lld:%02lld", left / 60, left % 60);
    return buf;
  }
  [[nodiscard]] bool terminal() const noexcept { return terminal_; }

 private:
  void record(std::int64_t done, Clock::time_point now) {
    if (history_.empty()) history_.emplace_back(first_, now);
    history_.emplace_back(done, now);
    while (history_.size() > 2 &&
           (history_.size() > 31 || now - history_[1].second > std::chrono::seconds(30)))
      history_.pop_front();
  }
  void draw(const std::string& text, bool whole_line) {
    std::fputs(text.c_str(), o_.out);
    std::fflush(o_.out);
    drawn_ = !whole_line;
  }

  Options o_;
  bool terminal_;
  std::deque<std::pair<std::int64_t, Clock::time_point>> history_;
  std::int64_t first_ = 0;
  bool drawn_ = false;
};

}  // namespace difftrain::train
