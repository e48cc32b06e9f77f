// expect: Config::Parallel needs a name, Options, a constructor from \(module, params, options\)
// A parallel policy that only names itself: the trainer cannot share a step through it.
#include <difftrain/train/trainer.hpp>

struct Net : torch::nn::Module {
  struct Batch {};
  at::Tensor loss(const Batch& /*b*/) { return at::zeros({}); }
};

struct Broken {
  static constexpr std::string_view name = "broken";
  struct Options {};
};

struct Config : difftrain::train::DefaultConfig {
  using Parallel = Broken;
};

int main() {
  Net net;
  difftrain::train::Trainer<Net, Config> trainer(net, {});
  return trainer.global_step() == 0 ? 0 : 1;
}
