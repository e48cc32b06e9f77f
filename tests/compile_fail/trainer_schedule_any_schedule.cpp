// expect: schedule::AnySchedule is the value a schedule chosen at run time
// becomes.*schedule::ByName A new user's mistake: the type-erased schedule named as the trainer's
// schedule policy, where the policy for a schedule chosen at run time is schedule::ByName.
#include <difftrain/train/trainer.hpp>

struct Net : torch::nn::Module {
  struct Batch {};
  at::Tensor loss(const Batch& /*b*/) { return at::zeros({}); }
};

struct Config : difftrain::train::DefaultConfig {
  using Schedule = difftrain::schedule::AnySchedule;
};

int main() {
  Net net;
  difftrain::train::Trainer<Net, Config> trainer(net, {});
  return trainer.global_step() == 0 ? 0 : 1;
}
