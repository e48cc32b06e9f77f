// What a training program needs: the trainer header and one Trainer instantiation (AdamW, cosine
// schedule, EMA, clipping) that runs a step.
#include <torch/nn/modules/linear.h>
#include <difftrain/ema/ema.hpp>
#include <difftrain/schedule/schedule.hpp>
#include <difftrain/train/trainer.hpp>

namespace {
struct Batch {
  at::Tensor x;
  [[nodiscard]] std::int64_t size() const { return x.size(0); }
  [[nodiscard]] Batch slice(std::int64_t s, std::int64_t n) const { return {x.narrow(0, s, n)}; }
};
struct NetImpl : torch::nn::Module {
  using Batch = ::Batch;
  NetImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  at::Tensor loss(const Batch& b) { return fc(b.x).pow(2).mean(); }
  torch::nn::Linear fc;
};
struct Config : difftrain::train::DefaultConfig {
  using Schedule = difftrain::schedule::Cosine;
  using Ema = difftrain::ema::Ema<difftrain::ema::WarmupDecay>;
};
}  // namespace

int main() {
  NetImpl net;
  difftrain::train::Trainer<NetImpl, Config>::Options o;
  o.schedule = {1, 2, 0.5};
  difftrain::train::Trainer<NetImpl, Config> trainer(net, o);
  trainer.fit([](std::int64_t, std::int64_t) { return Batch{at::ones({2, 4})}; }, 1);
  return trainer.global_step() == 1 ? 0 : 1;
}
