#pragma once
// Stage 3's promise, checked in one process: ShardedDataParallel frees a unit's parameters outside
// the unit's forward and backward (nn/unit_scope.hpp). This listener does the one-process
// equivalent: it fills every parameter of a unit with NaN when the unit's forward ends, and puts
// the values back when the unit runs again or backward reaches one of its outputs. A model that
// used a unit's parameter anywhere else would compute NaN and miss its golden values, so the
// golden sweeps of the models run under it.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <difftrain/nn/unit_scope.hpp>

#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace difftrain::test {

class PoisonUnits final : public nn::UnitListener {
 public:
  PoisonUnits() {
    if (!nn::listen_to_units(this)) throw std::logic_error("another unit listener is installed");
  }
  ~PoisonUnits() override {
    nn::stop_listening_to_units(this);
    const std::lock_guard<std::mutex> lock(m_);
    while (!saved_.empty()) restore(saved_.begin()->first);
  }
  PoisonUnits(const PoisonUnits&) = delete;
  PoisonUnits& operator=(const PoisonUnits&) = delete;

  void enter(const torch::nn::Module& unit) override {
    const std::lock_guard<std::mutex> lock(m_);
    restore(&unit);
    ++entered_;
  }
  void leave(const torch::nn::Module& unit, const std::vector<at::Tensor>& outputs) override {
    const std::lock_guard<std::mutex> lock(m_);
    for (const at::Tensor& t : outputs)
      if (t.requires_grad())
        at::Tensor(t).register_hook([this, u = &unit](const at::Tensor& /*grad*/) {
          const std::lock_guard<std::mutex> inner(m_);
          restore(u);
        });
    poison(unit);
  }
  /// Units run so far (each entry counts).
  [[nodiscard]] std::int64_t entered() const { return entered_; }

 private:
  void poison(const torch::nn::Module& unit) {
    if (saved_.contains(&unit)) return;
    const at::NoGradGuard no_grad;
    std::vector<at::Tensor> copies;
    for (const at::Tensor& p : unit.parameters()) {
      copies.push_back(p.detach().clone());
      // Not through autograd: the graph's saved tensors see the NaN, as they would see memory
      // that stage 3 freed.
      p.variable_data().fill_(std::numeric_limits<double>::quiet_NaN());
    }
    saved_.emplace(&unit, std::move(copies));
  }
  void restore(const torch::nn::Module* unit) {
    const auto it = saved_.find(unit);
    if (it == saved_.end()) return;
    const at::NoGradGuard no_grad;
    const std::vector<at::Tensor> params = unit->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) params[i].variable_data().copy_(it->second[i]);
    saved_.erase(it);
  }

  std::mutex m_;
  std::map<const torch::nn::Module*, std::vector<at::Tensor>> saved_;
  std::int64_t entered_ = 0;
};

}  // namespace difftrain::test
