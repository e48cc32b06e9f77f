// A training step on a machine that other processes share: the Fashion-MNIST classifier's step
// (two convolutions and two linear layers, batch 128, AdamW) while K other processes (K = 0, 1,
// 2) keep a core busy each, spinning.
//  - baseline: LibTorch's default, one intra-op thread per core;
//  - difftrain: the threads train::threads_for(train::cpu_load()) picks with the spinners running
//    (the cores nobody else keeps busy, at least one).
// With K = 0 both run the same threads (ratio 1). The spinners are forked children that only
// spin, so the kernel schedules them as the other processes of a shared machine.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <unistd.h>
#include <difftrain/train/threads.hpp>

#include <cstdint>
#include <vector>

namespace {

struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl()
      : c1(register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        c2(register_module("c2",
                           torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        f1(register_module("f1", torch::nn::Linear(32 * 7 * 7, 128))),
        f2(register_module("f2", torch::nn::Linear(128, 10))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::max_pool2d(at::relu(c1->forward(x)), 2);
    h = at::max_pool2d(at::relu(c2->forward(h)), 2);
    return f2->forward(at::relu(f1->forward(h.flatten(1))));
  }
  torch::nn::Conv2d c1, c2;
  torch::nn::Linear f1, f2;
};

/// K forked children that spin until destroyed.
class Spinners {
 public:
  explicit Spinners(std::int64_t k) {
    for (std::int64_t i = 0; i < k; ++i) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        volatile std::uint64_t x = 0;
        for (;;) x = x + 1;  // only spins: nothing of the parent's state is touched
      }
      if (pid > 0) pids_.push_back(pid);
    }
  }
  Spinners(const Spinners&) = delete;
  Spinners& operator=(const Spinners&) = delete;
  ~Spinners() {
    for (const pid_t pid : pids_) ::kill(pid, SIGKILL);
    for (const pid_t pid : pids_) ::waitpid(pid, nullptr, 0);
  }

 private:
  std::vector<pid_t> pids_;
};

void shared_machine_step(benchmark::State& state, bool pick) {
  const int cores = difftrain::train::cpu_load(std::chrono::milliseconds(1)).cores;
  const int before = at::get_num_threads();
  Spinners spinners(state.range(0));
  const int threads = pick ? difftrain::train::threads_for(difftrain::train::cpu_load()) : cores;
  at::set_num_threads(threads);
  ConvNetImpl net;
  torch::optim::AdamW opt(net.parameters(), torch::optim::AdamWOptions(1e-3));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const at::Tensor x = at::randn({128, 1, 28, 28}, gen);
  const at::Tensor y = at::randint(0, 10, {128}, gen);
  auto step = [&] {
    opt.zero_grad();
    at::cross_entropy_loss(net.forward(x), y).backward();
    opt.step();
  };
  for (int i = 0; i < 3; ++i) step();  // warm-up: OpenMP's team, the allocator
  for (auto _ : state) step();
  state.counters["threads"] = threads;
  state.counters["busy_processes"] = static_cast<double>(state.range(0));
  at::set_num_threads(before);
}

void default_threads(benchmark::State& state) { shared_machine_step(state, false); }
void picked_threads(benchmark::State& state) { shared_machine_step(state, true); }

}  // namespace

BENCHMARK(default_threads)
    ->Name("train_step_shared_machine/baseline")
    ->ArgName("busy")
    ->DenseRange(0, 2)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0)
    ->UseRealTime();
BENCHMARK(picked_threads)
    ->Name("train_step_shared_machine/difftrain")
    ->ArgName("busy")
    ->DenseRange(0, 2)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0)
    ->UseRealTime();
