// expect: this policy has no name
// A schedule the trainer is given without a name (the registry and checkpoints need one).
#include <difftrain/train/trainer.hpp>

struct Net : torch::nn::Module {
  struct Batch {};
  at::Tensor loss(const Batch& /*b*/) { return at::zeros({}); }
};

struct Halving {
  struct Options {};
  explicit Halving(const Options& /*o*/) {}
  [[nodiscard]] double lr(std::int64_t step, double base) const { return base / double(1 + step); }
};

struct Config : difftrain::train::DefaultConfig {
  using Schedule = Halving;
};

int main() {
  Net net;
  difftrain::train::Trainer<Net, Config> trainer(net, {});
  return trainer.global_step() == 0 ? 0 : 1;
}
