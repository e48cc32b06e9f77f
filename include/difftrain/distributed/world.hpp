#pragma once
// The processes of a data-parallel run and the c10d process group joining them.
//
// torchrun (and Slurm or MPI launchers through it) starts one process per rank and tells each who
// it is in the environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT. World::from_environment reads them, meets the other ranks through a c10d::TCPStore
// at MASTER_ADDR:MASTER_PORT (the launcher's own store when torchrun hosts one, else rank 0's) and
// joins them in a Gloo process group. Without those variables, or with a world of one, there is no
// group and nothing is communicated: a program runs exactly as a single process.
//
// Every collective here turns a failure of the group (a rank that died, one that hung past the
// timeout, a rendezvous nobody answered) into a DistributedError naming the operation and rank.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"

#ifndef USE_C10D_GLOO
#error "difftrain/distributed needs Gloo's headers (Debian: libgloo-dev) and USE_C10D_GLOO"
#endif

namespace difftrain::distributed {

struct WorldOptions {
  /// How long a collective or the rendezvous may wait for the other ranks before the run stops
  /// with a DistributedError. torch's default for Gloo is 30 minutes.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
};

namespace world_detail {
// A variable of the launcher's environment, or nullopt when it is not set.
inline std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

inline std::int64_t env_integer(const char* name, std::int64_t lo, std::int64_t hi) {
  const auto text = env(name);
  if (!text) throw ConfigError("is not set (the launcher sets it; so does torchrun)", name);
  std::size_t used = 0;
  std::int64_t value = 0;
  try {
    value = std::stoll(*text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text->size())
    throw ConfigError("is '" + *text + "', not an integer", name);
  if (value < lo || value > hi)
    throw ConfigError(
        "is " + *text + ", outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", name);
  return value;
}

// c10d reports a failed collective as a c10::Error (DistBackendError, DistNetworkError, ...):
// its first line says what happened without the C++ backtrace.
inline std::string first_line(const c10::Error& e) {
  std::string s = e.what_without_backtrace();
  if (const auto nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
  return s;
}
}  // namespace world_detail

/// One process's place in a data-parallel run, and the group that joins it to the others.
class World {
 public:
  /// A world of one (no group): what a program without the launcher's variables runs as.
  World() = default;

  /// The world the launcher describes in the environment; a world of one when RANK and
  /// WORLD_SIZE are not set. A malformed or contradictory variable is a ConfigError naming it; a
  /// rendezvous that nobody answers within the timeout is a DistributedError.
  static std::shared_ptr<World> from_environment(const WorldOptions& o = {}) {
    using world_detail::env;
    using world_detail::env_integer;
    auto w = std::make_shared<World>();
    w->timeout_ = o.timeout;
    if (o.timeout.count() <= 0) throw ConfigError("must be positive", "WorldOptions::timeout");
    if (!env("WORLD_SIZE") && !env("RANK")) return w;
    w->size_ = env_integer("WORLD_SIZE", 1, 1 << 20);
    w->rank_ = env_integer("RANK", 0, w->size_ - 1);
    w->local_size_ = env("LOCAL_WORLD_SIZE") ? env_integer("LOCAL_WORLD_SIZE", 1, w->size_) : 1;
    w->local_rank_ = env("LOCAL_RANK") ? env_integer("LOCAL_RANK", 0, w->local_size_ - 1) : 0;
    if (w->size_ == 1) return w;
    const std::string host = env("MASTER_ADDR").value_or("");
    if (host.empty()) throw ConfigError("is not set; it names rank 0's host", "MASTER_ADDR");
    const auto port = static_cast<std::uint16_t>(env_integer("MASTER_PORT", 1, 65535));
    const std::string where = "rendezvous at " + host + ":" + std::to_string(port);
    try {
      // torchrun's agent already serves a store at MASTER_PORT; its workers are clients and
      // keep their keys under the restart attempt, as torch.distributed's env:// rendezvous does.
      const bool agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
      c10d::TCPStoreOptions so;
      so.port = port;
      so.isServer = !agent_store && w->rank_ == 0;
      so.numWorkers = static_cast<std::size_t>(w->size_);
      so.waitWorkers = false;
      so.timeout = o.timeout;
      c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(host, so);
      if (agent_store)
        store = c10::make_intrusive<c10d::PrefixStore>(
            "/worker/attempt_" + env("TORCHELASTIC_RESTART_COUNT").value_or("0"), store);
      store = c10::make_intrusive<c10d::PrefixStore>("difftrain/", store);
      auto gloo_options = c10d::ProcessGroupGloo::Options::create_default(o.timeout);
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
          store, static_cast<int>(w->rank_), static_cast<int>(w->size_), gloo_options);
      w->group_ = c10::make_intrusive<c10d::ProcessGroup>(store, static_cast<int>(w->rank_),
                                                          static_cast<int>(w->size_));
      w->group_->setBackend(c10::kCPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
      // Gloo also reduces and broadcasts CUDA tensors (through host memory); its other
      // collectives take CPU tensors only.
      if (at::hasCUDA())
        w->group_->setBackend(c10::kCUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
      w->group_->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
      w->store_ = store;
    } catch (const c10::Error& e) {
      throw DistributedError("rank " + std::to_string(w->rank_) + " of " +
                                 std::to_string(w->size_) + " could not join the group within " +
                                 std::to_string(o.timeout.count()) +
                                 " ms: " + world_detail::first_line(e),
                             where);
    }
    return w;
  }

  [[nodiscard]] std::int64_t rank() const { return rank_; }
  [[nodiscard]] std::int64_t size() const { return size_; }
  [[nodiscard]] std::int64_t local_rank() const { return local_rank_; }
  [[nodiscard]] std::int64_t local_size() const { return local_size_; }
  [[nodiscard]] bool is_main() const { return rank_ == 0; }
  /// True when there is more than one rank (and so a group to talk to).
  [[nodiscard]] bool distributed() const { return group_.defined(); }
  [[nodiscard]] std::chrono::milliseconds timeout() const { return timeout_; }
  [[nodiscard]] const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }

  /// Sums `t` over the ranks, in place.
  void all_reduce_sum(at::Tensor& t) const {
    if (!distributed()) return;
    std::vector<at::Tensor> v{t};
    run("all-reduce", [&] { return group_->allreduce(v); });
  }

  /// The maximum of `t` over the ranks, in place.
  void all_reduce_max(at::Tensor& t) const {
    if (!distributed()) return;
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions ao;
    ao.reduceOp = c10d::ReduceOp::MAX;
    run("all-reduce", [&] { return group_->allreduce(v, ao); });
  }

  /// Replaces `tensors` on every rank by rank `root`'s.
  void broadcast(std::vector<at::Tensor>& tensors, std::int64_t root = 0) const {
    if (!distributed() || tensors.empty()) return;
    c10d::BroadcastOptions bo;
    bo.rootRank = root;
    // One collective per tensor keeps the group's own bookkeeping simple; callers flatten first
    // when there are many.
    for (auto& t : tensors) {
      std::vector<at::Tensor> v{t};
      run("broadcast", [&] { return group_->broadcast(v, bo); });
    }
  }

  /// Every rank's `t` (same shape on every rank), in rank order.
  [[nodiscard]] std::vector<at::Tensor> all_gather(const at::Tensor& t) const {
    if (!distributed()) return {t.clone()};
    std::vector<std::vector<at::Tensor>> out(1);
    for (std::int64_t r = 0; r < size_; ++r) out[0].push_back(at::empty_like(t));
    std::vector<at::Tensor> in{t.contiguous()};
    run("all-gather", [&] { return group_->allgather(out, in); });
    return out[0];
  }

  /// True when `ok` on every rank.
  [[nodiscard]] bool all_true(bool ok) const {
    if (!distributed()) return ok;
    at::Tensor flag = at::full({1}, ok ? 0.0 : 1.0, at::kDouble);
    all_reduce_sum(flag);
    return flag.item<double>() == 0.0;
  }

  /// The mean of `x` over the ranks.
  [[nodiscard]] double mean(double x) const {
    if (!distributed()) return x;
    at::Tensor t = at::full({1}, x, at::kDouble);
    all_reduce_sum(t);
    return t.item<double>() / static_cast<double>(size_);
  }

  /// Rank 0's `ok`, known on every rank (and a barrier: nobody goes on before rank 0 decided).
  [[nodiscard]] bool rank0_decides(bool ok) const {
    if (!distributed()) return ok;
    std::vector<at::Tensor> flag{at::full({1}, ok ? 1.0 : 0.0, at::kDouble)};
    broadcast(flag, 0);
    return flag[0].item<double>() != 0.0;
  }

  /// Waits until every rank is here.
  void barrier() const {
    if (!distributed()) return;
    run("barrier", [&] { return group_->barrier(); });
  }

  /// Runs `f` on rank 0, then on the other ranks once rank 0 has finished (what rank 0 writes,
  /// a cache, the others then find). A rank 0 that fails leaves the others waiting until the
  /// timeout, which ends them with a DistributedError.
  template <class F>
  void rank0_first(F&& f) const {
    if (!is_main()) barrier();
    std::forward<F>(f)();
    if (is_main()) barrier();
  }

  /// Runs `f`; a failure of the group in it (a c10d or Gloo error) becomes a DistributedError
  /// naming `what` and this rank. difftrain's own errors pass through unchanged.
  template <class F>
  void guarded(const std::string& what, F&& f) const {
    try {
      std::forward<F>(f)();
    } catch (const Error&) {
      throw;
    } catch (const c10::Error& e) {
      throw failure(what, world_detail::first_line(e));
    } catch (const std::exception& e) {  // Gloo's own (a peer reset the connection)
      throw failure(what, e.what());
    }
  }

  /// Starts a collective with `start` and waits for it, as `guarded`.
  template <class F>
  void run(const std::string& what, F&& start) const {
    guarded(what, [&] { start()->wait(timeout_); });
  }

  [[nodiscard]] DistributedError failure(const std::string& what, const std::string& why) const {
    return DistributedError(what + " failed (another rank died, hung past the " +
                                std::to_string(timeout_.count()) +
                                " ms timeout, or disagreed): " + why,
                            "rank " + std::to_string(rank_) + " of " + std::to_string(size_));
  }

 private:
  std::int64_t rank_ = 0;
  std::int64_t size_ = 1;
  std::int64_t local_rank_ = 0;
  std::int64_t local_size_ = 1;
  std::chrono::milliseconds timeout_ = std::chrono::minutes(30);
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

}  // namespace difftrain::distributed
