// expect: Config::Ema names a decay rule, not an EMA: wrap it
// The usual slip: the decay rule where the EMA (rule + engine) belongs.
#include <difftrain/train/trainer.hpp>

struct Net : torch::nn::Module {
  struct Batch {};
  at::Tensor loss(const Batch& /*b*/) { return at::zeros({}); }
};

struct Config : difftrain::train::DefaultConfig {
  using Ema = difftrain::ema::WarmupDecay;
};

int main() {
  Net net;
  difftrain::train::Trainer<Net, Config> trainer(net, {});
  return trainer.global_step() == 0 ? 0 : 1;
}
