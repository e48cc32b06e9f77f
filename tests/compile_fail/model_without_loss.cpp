// expect: a trainable model needs `at::Tensor loss\(const Batch&\)`
// A model the trainer cannot train: it has a Batch type but no loss.
#include <difftrain/train/trainer.hpp>

struct Net : torch::nn::Module {
  struct Batch {};
};

int main() {
  Net net;
  difftrain::train::Trainer<Net> trainer(net, {});
  return trainer.global_step() == 0 ? 0 : 1;
}
