#pragma once
// Units: the blocks a model runs one after another (a UNet's down, mid and up blocks, each block
// of a transformer). A model runs each of them through `nn::in_unit(block, f)`, which costs one
// atomic load when nothing listens. A policy that keeps only a share of the parameters in each
// process (distributed::ShardedDataParallel at stage 3, as FSDP) listens: it gathers a unit's
// parameters before the unit runs and frees them after, and it is shown the unit's outputs so
// that it can gather them again when backward reaches the unit.
//
// One listener per process (it is process-wide, not per thread, because backward and the
// recompute of gradient checkpointing run on the autograd engine's threads).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <atomic>
#include <exception>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace difftrain::nn {

/// What a model tells about its units. `leave` receives every tensor the unit returned (outputs
/// that do not require gradients included), or none when the unit threw.
class UnitListener {
 public:
  UnitListener() = default;
  UnitListener(const UnitListener&) = delete;
  UnitListener& operator=(const UnitListener&) = delete;
  virtual ~UnitListener() = default;
  virtual void enter(const torch::nn::Module& unit) = 0;
  virtual void leave(const torch::nn::Module& unit, const std::vector<at::Tensor>& outputs) = 0;
};

namespace unit_detail {

inline std::atomic<UnitListener*>& listener() {
  static std::atomic<UnitListener*> current{nullptr};
  return current;
}

inline void collect(const at::Tensor& t, std::vector<at::Tensor>& out) {
  if (t.defined()) out.push_back(t);
}
inline void collect(const std::vector<at::Tensor>& v, std::vector<at::Tensor>& out) {
  for (const at::Tensor& t : v) collect(t, out);
}
template <class A, class B>
void collect(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  collect(p.first, out);
  collect(p.second, out);
}
template <class... T>
void collect(const std::tuple<T...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... x) { (collect(x, out), ...); }, t);
}

}  // namespace unit_detail

/// Makes `l` the process's listener; false when another one listens already.
inline bool listen_to_units(UnitListener* l) {
  UnitListener* none = nullptr;
  return unit_detail::listener().compare_exchange_strong(none, l);
}

/// Stops `l` listening (nothing when it does not).
inline void stop_listening_to_units(UnitListener* l) {
  UnitListener* expected = l;
  unit_detail::listener().compare_exchange_strong(expected, nullptr);
}

/// Runs `f()`, the forward of `unit` (a tensor, a vector of tensors, or a pair or tuple of them),
/// telling the listener, if any, before and after.
template <class F>
requires(!std::is_void_v<std::invoke_result_t<F&&>>) auto in_unit(const torch::nn::Module& unit,
                                                                  F&& f)
    -> std::invoke_result_t<F&&> {
  UnitListener* l = unit_detail::listener().load(std::memory_order_acquire);
  if (l == nullptr) return std::forward<F>(f)();
  l->enter(unit);
  std::invoke_result_t<F&&> result = [&] {
    try {
      return std::forward<F>(f)();
    } catch (...) {
      l->leave(unit, {});
      throw;
    }
  }();
  std::vector<at::Tensor> outputs;
  unit_detail::collect(result, outputs);
  l->leave(unit, outputs);
  return result;
}

}  // namespace difftrain::nn
