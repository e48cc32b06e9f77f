#pragma once
// EMA update engines. They receive the rule's action and the (shadow, parameter) pairs to average.
//   PerTensor   one in-place lerp per tensor: the reference, simplest, any device mix
//   MultiTensor torch's _foreach_ kernels, one call per (device, dtype) group; the grouping is
//               kept between updates while the tensors keep their memory
//   Offloaded   shadows in (pinned) host memory; parameters staged to the host with non-blocking
//               copies and averaged there, optionally on a worker thread that overlaps the next
//               training step (one long-lived thread: a fresh thread per update would also
//               start a fresh OpenMP team for the host lerp, which costs more than the lerp)

#include <ATen/ATen.h>
#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <torch/cuda.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "difftrain/ema/concepts.hpp"

namespace difftrain::ema {

struct PerTensor {
  static constexpr std::string_view name = "per_tensor";
  struct Options {};
  explicit PerTensor(const Options& /*unused*/ = {}) {}
  [[nodiscard]] at::Tensor make_shadow(const at::Tensor& param) const {
    return param.detach().clone();
  }
  void average(std::span<Pair> pairs, double weight) {
    const at::NoGradGuard no_grad;
    for (Pair& p : pairs)
      p.shadow.lerp_(p.param.detach().to(p.shadow.device(), p.shadow.scalar_type()), weight);
  }
  void copy(std::span<Pair> pairs) {
    const at::NoGradGuard no_grad;
    for (Pair& p : pairs) p.shadow.copy_(p.param.detach());
  }
  void synchronize() {}
};

struct MultiTensor {
  static constexpr std::string_view name = "multi_tensor";
  struct Options {};
  explicit MultiTensor(const Options& /*unused*/ = {}) {}
  [[nodiscard]] at::Tensor make_shadow(const at::Tensor& param) const {
    return param.detach().clone();
  }

  void average(std::span<Pair> pairs, double weight) {
    const at::NoGradGuard no_grad;
    for (Group& g : groups(pairs)) at::_foreach_lerp_(g.shadows, g.params, weight);
  }
  void copy(std::span<Pair> pairs) {
    const at::NoGradGuard no_grad;
    for (Group& g : groups(pairs)) at::_foreach_copy_(g.shadows, g.params);
  }
  void synchronize() {}

 private:
  // The tensors of one (device, dtype) of the shadows, in the lists _foreach_ takes.
  struct Group {
    std::vector<at::Tensor> shadows, params;
    std::vector<std::pair<std::size_t, std::size_t>> converted;  // (slot, pair): cast each update
  };
  // The grouping of one list of pairs, kept while every tensor still has the memory it had.
  struct Grouping {
    std::vector<const void*> memory;  // shadow and parameter data pointers, pair by pair
    std::vector<Group> groups;
  };

  std::vector<Group>& groups(std::span<Pair> pairs) {
    Grouping& cached = cache_[pairs.data()];
    bool same = cached.memory.size() == 2 * pairs.size();
    for (std::size_t i = 0; same && i < pairs.size(); ++i)
      same = cached.memory[2 * i] == pairs[i].shadow.data_ptr() &&
             cached.memory[2 * i + 1] == pairs[i].param.data_ptr();
    if (!same) cached = regroup(pairs);
    // Parameters of another device or dtype than their shadow are cast afresh every update.
    for (Group& g : cached.groups)
      for (const auto& [slot, i] : g.converted)
        g.params[slot] =
            pairs[i].param.detach().to(pairs[i].shadow.device(), pairs[i].shadow.scalar_type());
    return cached.groups;
  }

  static Grouping regroup(std::span<Pair> pairs) {
    using Key = std::tuple<int, int, int>;  // shadow device type, index, dtype
    std::map<Key, Group> by_key;
    Grouping out;
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      const Pair& p = pairs[i];
      out.memory.push_back(p.shadow.data_ptr());
      out.memory.push_back(p.param.data_ptr());
      Group& g = by_key[Key{static_cast<int>(p.shadow.device().type()), p.shadow.device().index(),
                            static_cast<int>(p.shadow.scalar_type())}];
      g.shadows.push_back(p.shadow);
      const at::Tensor src = p.param.detach();
      if (src.device() != p.shadow.device() || src.scalar_type() != p.shadow.scalar_type())
        g.converted.emplace_back(g.params.size(), i);
      g.params.push_back(src);
    }
    for (auto& [key, g] : by_key) out.groups.push_back(std::move(g));
    return out;
  }

  std::map<const Pair*, Grouping> cache_;
};

struct Offloaded {
  static constexpr std::string_view name = "offloaded";
  struct Options {
    bool pin_memory = true;  ///< pinned host shadows make the device→host copies asynchronous
    bool overlap = true;     ///< average on a worker thread while training goes on
  };
  Offloaded() : o_() {}
  explicit Offloaded(const Options& o) : o_(o) {}
  Offloaded(const Offloaded&) = delete;
  Offloaded& operator=(const Offloaded&) = delete;
  Offloaded(Offloaded&&) = delete;
  Offloaded& operator=(Offloaded&&) = delete;
  ~Offloaded() {
    try {
      wait();
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor cannot throw; update() reports
    }
  }

  [[nodiscard]] at::Tensor make_shadow(const at::Tensor& param) const {
    at::Tensor host = param.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    if (o_.pin_memory && param.is_cuda()) host = host.pin_memory();
    return host;
  }

  void average(std::span<Pair> pairs, double weight) {
    launch(pairs, [weight](std::vector<at::Tensor>& shadows, std::vector<at::Tensor>& staged) {
      at::_foreach_lerp_(shadows, staged, weight);
    });
  }
  void copy(std::span<Pair> pairs) {
    launch(pairs, [](std::vector<at::Tensor>& shadows, std::vector<at::Tensor>& staged) {
      at::_foreach_copy_(shadows, staged);
    });
  }
  /// Waits for an update still running on the worker thread.
  void synchronize() { wait(); }

 private:
  template <class Op>
  void launch(std::span<Pair> pairs, Op op) {
    wait();  // one update in flight at a time; the staging buffers are reused
    const at::NoGradGuard no_grad;
    // One set of staging buffers per list of pairs (the EMA averages one list and copies
    // another), rebuilt when a tensor's shape, dtype or device no longer matches.
    std::vector<at::Tensor>& staged = staging_[pairs.data()];
    bool fits = staged.size() == pairs.size();
    for (std::size_t i = 0; fits && i < pairs.size(); ++i)
      fits = staged[i].sizes() == pairs[i].param.sizes() &&
             staged[i].scalar_type() == pairs[i].param.scalar_type();
    if (!fits) {
      staged.clear();
      for (Pair& p : pairs) staged.push_back(make_shadow(p.param));  // same shape, dtype, pinning
    }
    std::vector<at::Tensor> shadows;
    bool any_cuda = false;
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      any_cuda = any_cuda || pairs[i].param.is_cuda();
      staged[i].copy_(pairs[i].param.detach(), /*non_blocking=*/true);
      shadows.push_back(pairs[i].shadow);
    }
    // Device→host copies into pinned memory are asynchronous: they must land before the host
    // reads them. One synchronisation per update, after all copies were queued.
    if (any_cuda) torch::cuda::synchronize();
    auto work = [op, shadows = std::move(shadows), staged]() mutable {
      const at::NoGradGuard guard;
      op(shadows, staged);
    };
    if (o_.overlap) {
      worker_.post(std::move(work));
    } else {
      work();
    }
  }
  void wait() { worker_.wait(); }

  /// One thread that runs one job at a time; wait() returns when the last job is done and
  /// rethrows what it threw.
  class Worker {
   public:
    Worker() = default;
    Worker(const Worker&) = delete;
    Worker& operator=(const Worker&) = delete;
    ~Worker() {
      if (!thread_.joinable()) return;
      {
        std::lock_guard<std::mutex> lock(m_);
        stop_ = true;
      }
      cv_.notify_all();
      thread_.join();
    }
    void post(std::function<void()> job) {
      std::unique_lock<std::mutex> lock(m_);
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
      job_ = std::move(job);
      busy_ = true;
      lock.unlock();
      cv_.notify_all();
    }
    void wait() {
      std::unique_lock<std::mutex> lock(m_);
      cv_.wait(lock, [this] { return !busy_; });
      if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
    }

   private:
    void loop() {
      std::unique_lock<std::mutex> lock(m_);
      while (true) {
        cv_.wait(lock, [this] { return stop_ || job_ != nullptr; });
        if (job_ == nullptr) return;  // stopping, nothing left to run
        std::function<void()> job = std::exchange(job_, nullptr);
        lock.unlock();
        std::exception_ptr error;
        try {
          job();
        } catch (...) {
          error = std::current_exception();
        }
        lock.lock();
        error_ = error;
        busy_ = false;
        cv_.notify_all();
      }
    }
    std::mutex m_;
    std::condition_variable cv_;
    std::function<void()> job_;
    std::exception_ptr error_;
    bool busy_ = false, stop_ = false;
    std::thread thread_;
  };

  Options o_;
  std::map<const Pair*, std::vector<at::Tensor>> staging_;
  Worker worker_;  // last: joined first, while the staging buffers still exist
};

}  // namespace difftrain::ema
