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
//
// A policy that shards the training state over the ranks (distributed::ShardedDataParallel, ZeRO)
// also has the hooks of `ShardingParallel` below: each rank's optimizer steps only the parameters
// the rank owns, clipping and the fp16 scaler combine what each rank sees, and after the step
// every rank receives the parameters the others updated. Its checkpoints are a set of files, one
// shard of the optimizer state per rank.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "difftrain/train/optimizer.hpp"

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

/// A policy that shards the optimizer state (and maybe gradients) over the ranks:
///   groups_of_rank(groups, r)  the groups with only the parameters rank r's optimizer steps
///                           (same groups in the same order; a group may be empty)
///   owned_params()          those parameters: only their gradients are this rank's to clip,
///                           unscale and check
///   sum_across(t), max_across(t)   combine a small CPU tensor over the ranks, in place
///   after_optimizer_step()  every rank holds every updated parameter again
///   after_skipped_step()    every rank holds every parameter again, the step having changed
///                           none (stage 3 frees parameters during forward and backward)
///   zero_grad()             drops every gradient this rank holds (its optimizer's and others')
///   stage()                 the ZeRO stage, recorded in checkpoints
template <class P>
concept ShardingParallel = ParallelPolicy<P> &&
    requires(P& p, const P& cp, const std::vector<ParamGroup>& groups, at::Tensor& t) {
  { cp.groups_of_rank(groups, std::int64_t{0}) } -> std::same_as<std::vector<ParamGroup>>;
  { cp.owned_params() } -> std::convertible_to<std::vector<at::Tensor>>;
  p.sum_across(t);
  p.max_across(t);
  p.after_optimizer_step();
  p.after_skipped_step();
  p.zero_grad();
  { cp.stage() } -> std::convertible_to<int>;
};

/// A sharding policy that tells who owns each parameter and gathers what the owners hold; the
/// trainer then keeps its EMA per shard (each rank the shadows of what it steps):
///   owner(i)                the rank that steps parameter i (the trainer's order; -1: every rank)
///   master(i)               on the owner, the tensor with parameter i's full-precision value
///   from_owners(mine, take) every rank gets take(i, value) for each parameter, where the owner
///                           gave mine(i) (its shape, in the masters' dtype)
///   whole_needs_every_rank()  whether whole_parameters() communicates (so every rank takes it)
template <class P>
concept OwnerGatheringParallel = ShardingParallel<P> && requires(P& p, const P& cp) {
  { cp.owner(std::size_t{0}) } -> std::convertible_to<std::int64_t>;
  { cp.master(std::size_t{0}) } -> std::convertible_to<at::Tensor>;
  p.from_owners([](std::size_t) { return at::Tensor(); }, [](std::size_t, const at::Tensor&) {});
  { cp.whole_needs_every_rank() } -> std::convertible_to<bool>;
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
