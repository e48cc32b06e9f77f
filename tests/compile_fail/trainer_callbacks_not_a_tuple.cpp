// expect: Config::Callbacks must be a std::tuple of callback objects
// One callback named where the trainer holds a tuple of them.
#include <difftrain/train/callbacks.hpp>
#include <difftrain/train/trainer.hpp>

struct Net : torch::nn::Module {
  struct Batch {};
  at::Tensor loss(const Batch& /*b*/) { return at::zeros({}); }
};

struct Config : difftrain::train::DefaultConfig {
  using Callbacks = difftrain::train::ProgressBar;
};

int main() {
  Net net;
  difftrain::train::Trainer<Net, Config> trainer(net, {});
  return trainer.global_step() == 0 ? 0 : 1;
}
