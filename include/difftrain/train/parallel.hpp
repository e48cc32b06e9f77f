#pragma once
// How a Trainer shares a step with other processes: Config::Parallel.
//
// SingleProcess (the default) shares nothing and costs nothing: every hook below is an empty
// inline function. distributed::DataParallel (difftrain/distributed/data_parallel.hpp) averages
// gradients over the ranks of a torchrun launch. The trainer calls, for every forward/backward:
//
//   before_forward(sync)   sync: this backward is the step's last (its gradients are shared)
//   all_ok(ok)             on the last one, before its backward: true only when every rank's
//                          losses of the step were finite (a NaN anywhere skips it everywhere);
//                          also whether every rank could read a checkpoint
//   before_backward(loss)  on the last one, when the step goes on (the loss whose backward shares
//                          gradients: a policy may search its graph for unused parameters)
//   guard(f)               runs the last backward; failures of the group become DistributedError
//
// and once a step: mean(x) (a value averaged over ranks, for what is reported), start() (the
// weights every rank starts from, also after a resume), and, for checkpoints, rank/world_size
// and gather/decide (rank 0 writes, the others learn whether it could).

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <concepts>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace difftrain::train {

template <class P>
concept ParallelPolicy = requires {
  P::name;
  typename P::Options;
}
&&std::constructible_from<P, torch::nn::Module&, const std::vector<at::Tensor>&,
                          const typename P::Options&>&& requires(P& p, const P& cp, bool b,
                                                                 double x, const at::Tensor& t) {
  { cp.rank() } -> std::convertible_to<std::int64_t>;
  { cp.world_size() } -> std::convertible_to<std::int64_t>;
  p.start();
  p.before_forward(b);
  { p.all_ok(b) } -> std::convertible_to<bool>;
  p.before_backward(t);
  p.guard([] {});
  { p.mean(x) } -> std::convertible_to<double>;
  { p.gather(t) } -> std::convertible_to<std::vector<at::Tensor>>;
  { p.decide(b) } -> std::convertible_to<bool>;
};

/// A callback that runs on every rank of a distributed run (`static constexpr bool every_rank =
/// true`); the others run on rank 0 only.
template <class C>
concept EveryRankCallback = requires {
  requires C::every_rank;
};

/// One process: no communication at all.
struct SingleProcess {
  static constexpr std::string_view name = "single-process";
  struct Options {};
  SingleProcess(torch::nn::Module& /*model*/, const std::vector<at::Tensor>& /*params*/,
                const Options& /*options*/) {}
  [[nodiscard]] std::int64_t rank() const { return 0; }
  [[nodiscard]] std::int64_t world_size() const { return 1; }
  void start() {}
  void before_forward(bool /*sync*/) {}
  [[nodiscard]] bool all_ok(bool ok) { return ok; }
  void before_backward(const at::Tensor& /*loss*/) {}
  template <class F>
  void guard(F&& f) {
    std::forward<F>(f)();
  }
  [[nodiscard]] double mean(double x) { return x; }
  [[nodiscard]] std::vector<at::Tensor> gather(const at::Tensor& t) { return {t}; }
  /// Rank 0's `ok`, known on every rank.
  [[nodiscard]] bool decide(bool ok) { return ok; }
};

}  // namespace difftrain::train
