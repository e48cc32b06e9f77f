#pragma once
// Where a training step's time goes: a callback that runs LibTorch's profiler over a window of
// steps and sums each operator's own time (its time minus that of the operators it called), with
// the trainer's phases (`difftrain::forward`, `::backward`, `::clip`, `::optimizer_step`,
// `::ema_update`, `::data`, `::callbacks`) as named ranges. Optionally writes the window as a
// Chrome trace (chrome://tracing, Perfetto). Outside its window it costs nothing: the ranges are
// RecordFunction scopes, inactive while no profiler is on.

#include <torch/csrc/autograd/profiler_legacy.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/train/trainer.hpp"

namespace difftrain::train {

/// One operator or range of a profiled window.
struct ProfileRow {
  std::string name;
  std::int64_t calls = 0;
  double self_ms = 0.0;   ///< time inside it, not inside what it called
  double total_ms = 0.0;  ///< time inside it, calls included (a recursive name counts once)
};

/// Self and total time per name from the profiler's per-thread push/pop events, by self time.
inline std::vector<ProfileRow> summarise_profile(
    const torch::autograd::profiler::thread_event_lists& threads) {
  using torch::autograd::profiler::EventKind;
  std::map<std::string, ProfileRow> by_name;
  for (const auto& events : threads) {
    struct Open {
      const torch::autograd::profiler::LegacyEvent* push;
      double children_us;
    };
    std::vector<Open> stack;
    std::map<std::string, int> open_names;  // a name already open lower on the stack
    for (const auto& e : events) {
      if (e.kind() == EventKind::PushRange) {
        stack.push_back({&e, 0.0});
        ++open_names[e.name()];
      } else if (e.kind() == EventKind::PopRange && !stack.empty()) {
        const Open o = stack.back();
        stack.pop_back();
        const double total = o.push->cpuElapsedUs(e);
        ProfileRow& r = by_name[o.push->name()];
        r.name = o.push->name();
        ++r.calls;
        r.self_ms += (total - o.children_us) / 1000.0;
        if (--open_names[o.push->name()] == 0) r.total_ms += total / 1000.0;
        if (!stack.empty()) stack.back().children_us += total;
      }
    }
  }
  std::vector<ProfileRow> rows;
  rows.reserve(by_name.size());
  for (auto& [name, row] : by_name) rows.push_back(std::move(row));
  std::sort(rows.begin(), rows.end(),
            [](const ProfileRow& a, const ProfileRow& b) { return a.self_ms > b.self_ms; });
  return rows;
}

/// Profiles the steps after `after_step` (`steps` of them; a run resumed past it profiles the
/// first steps it takes; a `fit` that ends inside the window ends it there). Only the thread
/// that steps is profiled, with what it launches.
class StepProfile {
 public:
  struct Options {
    std::int64_t after_step = 10;  ///< warm-up steps left out (allocator, first-call costs)
    std::int64_t steps = 20;
    std::filesystem::path trace;  ///< a Chrome trace of the window; empty: none
  };
  explicit StepProfile(const Options& o) : o_(o) {
    if (o_.steps < 1)
      throw ConfigError("steps must be at least 1, got " + std::to_string(o_.steps), "StepProfile");
    if (o_.after_step < 0)
      throw ConfigError("after_step must be >= 0, got " + std::to_string(o_.after_step),
                        "StepProfile");
  }
  // Movable into a trainer's callbacks; only the holder of a running window stops it.
  StepProfile(StepProfile&& other) noexcept
      : o_(std::move(other.o_)),
        active_(std::exchange(other.active_, false)),
        done_(other.done_),
        first_(other.first_),
        last_(other.last_),
        wall_ms_(other.wall_ms_),
        started_(other.started_),
        rows_(std::move(other.rows_)) {}
  StepProfile(const StepProfile&) = delete;
  StepProfile& operator=(const StepProfile&) = delete;
  StepProfile& operator=(StepProfile&&) = delete;
  ~StepProfile() {
    if (active_) (void)torch::autograd::profiler::disableProfilerLegacy();
  }

  template <class T>
  void on_train_begin(T& t) {
    if (o_.after_step <= t.global_step()) start(t.global_step());
  }
  /// A window open across a checkpoint load would time the load: it starts again after it.
  template <class T>
  void on_resume(T& t) {
    if (active_) {
      (void)torch::autograd::profiler::disableProfilerLegacy();
      active_ = false;
    }
    if (!done_ && o_.after_step <= t.global_step()) start(t.global_step());
  }
  template <class T>
  void on_step_end(T& /*t*/, const StepInfo& s) {
    if (!s.stepped) return;
    if (!active_ && !done_ && s.step >= o_.after_step) {
      start(s.step);
    } else if (active_ && s.step >= first_ + o_.steps) {
      stop(s.step);
    }
  }
  template <class T>
  void on_train_end(T& t) {
    if (active_) stop(t.global_step());
  }

  /// Whether a window has been profiled (a run shorter than after_step + steps profiles less).
  [[nodiscard]] bool done() const { return done_; }
  [[nodiscard]] const std::vector<ProfileRow>& rows() const { return rows_; }
  [[nodiscard]] std::int64_t profiled_steps() const { return last_ - first_; }
  [[nodiscard]] double wall_ms() const { return wall_ms_; }

  /// The `n` names with the most self time, as a Markdown table with per-step figures.
  [[nodiscard]] std::string table(std::size_t n = 20) const {
    const double per = profiled_steps() > 0 ? static_cast<double>(profiled_steps()) : 1.0;
    std::string out =
        "| operator or range | calls/step | self ms/step | % of step | total ms/step |\n"
        "| --- | ---: | ---: | ---: | ---: |\n";
    char line[512];
    for (std::size_t i = 0; i < rows_.size() && i < n; ++i) {
      const ProfileRow& r = rows_[i];
      std::snprintf(line, sizeof line, "| %s | %.1f | %.2f | %.1f | %.2f |\n", r.name.c_str(),
                    static_cast<double>(r.calls) / per, r.self_ms / per,
                    wall_ms_ > 0 ? 100.0 * r.self_ms / wall_ms_ : 0.0, r.total_ms / per);
      out += line;
    }
    std::snprintf(line, sizeof line, "\n%lld steps, %.2f ms per step (wall)\n",
                  static_cast<long long>(profiled_steps()), wall_ms_ / per);
    return out + line;
  }

  /// The trainer's phases (the `difftrain::` ranges) by total time per step, and what is left of
  /// the step's wall time outside them.
  [[nodiscard]] std::string phase_table() const {
    const double per = profiled_steps() > 0 ? static_cast<double>(profiled_steps()) : 1.0;
    std::vector<const ProfileRow*> phases;
    for (const ProfileRow& r : rows_)
      if (r.name.starts_with("difftrain::")) phases.push_back(&r);
    std::sort(phases.begin(), phases.end(),
              [](const ProfileRow* a, const ProfileRow* b) { return a->total_ms > b->total_ms; });
    std::string out = "| phase | ms/step | % of step |\n| --- | ---: | ---: |\n";
    char line[256];
    double sum = 0.0;
    for (const ProfileRow* r : phases) {
      sum += r->total_ms;
      std::snprintf(line, sizeof line, "| %s | %.2f | %.1f |\n", r->name.c_str(), r->total_ms / per,
                    wall_ms_ > 0 ? 100.0 * r->total_ms / wall_ms_ : 0.0);
      out += line;
    }
    std::snprintf(line, sizeof line,
                  "| (between phases: schedule, zero_grad, the loop) | %.2f | %.1f |\n",
                  (wall_ms_ - sum) / per, wall_ms_ > 0 ? 100.0 * (wall_ms_ - sum) / wall_ms_ : 0.0);
    return out + line;
  }

 private:
  void start(std::int64_t step) {
    using torch::profiler::impl::ProfilerConfig;
    using torch::profiler::impl::ProfilerState;
    torch::autograd::profiler::enableProfilerLegacy(ProfilerConfig(ProfilerState::CPU,
                                                                   /*report_input_shapes=*/false,
                                                                   /*profile_memory=*/false));
    active_ = true;
    first_ = step;
    started_ = std::chrono::steady_clock::now();
  }
  void stop(std::int64_t step) {
    wall_ms_ =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started_)
            .count();
    auto threads = torch::autograd::profiler::disableProfilerLegacy();
    active_ = false;
    done_ = true;
    last_ = step;
    rows_ = summarise_profile(threads);
    if (!o_.trace.empty()) {
      std::ofstream out(o_.trace);
      if (!out) throw IoError("cannot write the profile trace", o_.trace.string());
      std::vector<torch::autograd::profiler::LegacyEvent*> events;
      for (auto& list : threads)
        for (auto& e : list) events.push_back(&e);
      torch::autograd::profiler::writeProfilerEventsToStream(out, events);
      if (!out) throw IoError("cannot write the profile trace", o_.trace.string());
    }
  }

  Options o_;
  bool active_ = false, done_ = false;
  std::int64_t first_ = 0, last_ = 0;
  double wall_ms_ = 0.0;
  std::chrono::steady_clock::time_point started_;
  std::vector<ProfileRow> rows_;
};

}  // namespace difftrain::train
