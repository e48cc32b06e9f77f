// The trainer's per-step cost against a hand-written LibTorch loop doing the same work in the same
// run: AdamW with a decay and a no-decay group, a cosine schedule with warm-up, clip_grad_norm_,
// 2 micro-batches of accumulation, EMA (diffusers' warm-up decay) — goal: ratio <= 1.03.
//  - train_step_small: a 3-layer MLP (width 256), where per-step overhead shows most;
//  - train_step_block: a BasicTransformerBlock (dim 256, 256 tokens), where compute dominates.
//  - train_vs_python_eager: train_step_small's step against the same step written in Python and run
//    eagerly (torch, diffusers' scheduler and EMAModel); 1 / ratio is the steps/s speed-up (goal on
//    the GPU: >= 1.5).
//  - train_vs_python_best: the same, against Python's fastest eager settings (AdamW fused=True,
//    EMAModel foreach=True) — goal: ratio <= 1 / 1.5 (1.5x the steps/s).
//  - train_step_small_paired, train_step_block_paired, train_vs_python_eager_paired,
//    train_vs_python_best_paired: the same comparisons with their two sides alternating in short
//    blocks in one run (paired.hpp; the Python loop stays up between its blocks); the ratio is the
//    median over the rounds, printed with its quartiles. These are the figures to quote on a
//    machine whose load moves.
//  - optimizer_step_fused_vs_per_parameter/COUNT/NUMEL: the AdamW step alone, fused kernel against
//    LibTorch's per-parameter AdamW, 100 tensors of 1M and 2,000 of 1,000 parameters;
//    optimizer_step_vs_python_fused: the fused step against Python's AdamW(fused=True);
//    optimizer_step_foreach_vs_per_parameter and optimizer_step_vs_python_foreach: the same for the
//    multi-tensor AdamW and Python's AdamW(foreach=True); sgd_step_foreach_vs_per_parameter: SGD
//    with momentum 0.9, multi-tensor against LibTorch's.
//  - optimizer_kinds_vs_adamw/difftrain/K: one step of each optimizer policy a program names at
//    run time (K: 0 AdamW8bit, 1 Adafactor, 2 CAME, 3 Lion, 4 Prodigy, 5 AdamWScheduleFree) on 24
//    tensors shaped as a UNet's (320×320×3×3, 1280×320, 320), against the fused AdamW step on the
//    same tensors (the baseline). Counters: state_bytes_per_param, and state_vs_adamw, the state's
//    bytes against AdamW's measured in the same run (8-bit AdamW's goal: about 1/4).
//  - clip_norm_multi_tensor_vs_libtorch/COUNT/NUMEL: ClipByNorm's clip_grad_norm_ (a norm and a
//    scale per device and dtype, as Python's) against LibTorch's (a norm and a scale per tensor).
//  - fp16_step_scale_handed_vs_unscaled/COUNT/NUMEL: GradScaler's step on the fused AdamW with
//    the scale handed to the kernel (gradients only checked) against unscale_ then step.
// The trainer and the hand-written loop both use the fused AdamW (the trainer's default).
// On a GPU everything runs there. The hand-written loop reads each loss before its backward, as
// most loops do; the trainer reads the step's losses once, after its backward passes are queued.
// Both read the clipped gradients' norm.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <sys/resource.h>
#include <torch/cuda.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <chrono>
#include <cstdio>
#include <difftrain/nn/blocks/transformer_block.hpp>
#include <difftrain/train/optimizer_by_name.hpp>
#include <difftrain/train/trainer.hpp>
#include <string>
#include <type_traits>

#include "paired.hpp"
#include "python_baseline.hpp"

namespace {
namespace tr = difftrain::train;
namespace ds = difftrain::schedule;

at::Device device() {
  static const at::Device d =
      torch::cuda::is_available() ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  return d;
}

struct Batch {
  at::Tensor x, y;
};

struct MlpImpl : torch::nn::Module {
  using Batch = ::Batch;
  MlpImpl() {
    a = register_module("a", torch::nn::Linear(256, 256));
    b = register_module("b", torch::nn::Linear(256, 256));
    c = register_module("c", torch::nn::Linear(256, 256));
    to(device());
  }
  at::Tensor loss(const Batch& batch) {
    return torch::mse_loss(c(torch::silu(b(torch::silu(a(batch.x))))), batch.y);
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};

struct BlockNet : torch::nn::Module {
  using Batch = ::Batch;
  BlockNet() {
    difftrain::nn::blocks::TransformerBlockOptions o;
    o.dim = 256;
    o.n_heads = 4;
    o.d_head = 64;
    block = register_module("block", difftrain::nn::blocks::BasicTransformerBlock<>(o));
    to(device());
  }
  at::Tensor loss(const Batch& batch) { return torch::mse_loss(block->forward(batch.x), batch.y); }
  difftrain::nn::blocks::BasicTransformerBlock<> block{nullptr};
};

struct Cfg : tr::DefaultConfig {
  using Schedule = ds::Cosine;
  using Ema = difftrain::ema::Ema<difftrain::ema::WarmupDecay>;
};

template <class Net>
std::vector<Batch> batches(bool tokens) {
  std::vector<Batch> out;
  for (int i = 0; i < 2; ++i) {
    const auto shape =
        tokens ? std::vector<std::int64_t>{8, 256, 256} : std::vector<std::int64_t>{64, 256};
    out.push_back({at::randn(shape, at::TensorOptions().device(device())),
                   at::randn(shape, at::TensorOptions().device(device()))});
  }
  return out;
}

// The hand-written loop: the trainer's work for one step, written directly on LibTorch.
template <class Net>
class HandWritten {
 public:
  explicit HandWritten(bool tokens) : data_(batches<Net>(tokens)) {
    std::vector<at::Tensor> decay, no_decay;
    for (auto& p : net_.parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
    torch::optim::AdamWOptions defaults(1e-4);
    defaults.weight_decay(1e-2);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(defaults));
    auto nd = std::make_unique<torch::optim::AdamWOptions>(defaults);
    nd->weight_decay(0.0);
    groups.emplace_back(no_decay, std::move(nd));
    // The trainer's default kernel.
    opt_ = std::make_unique<tr::FusedAdamWOptimizer>(std::move(groups), defaults);
    params_ = net_.parameters();
    for (auto& p : params_) shadow_.push_back(p.detach().clone());
  }

  double step() {
    opt_->zero_grad(true);
    double loss = 0;
    for (const auto& b : data_) {
      at::Tensor l = net_.loss(b);
      loss += l.detach().template item<double>();
      (l * 0.5).backward();
    }
    benchmark::DoNotOptimize(torch::nn::utils::clip_grad_norm_(params_, 1.0));
    opt_->step();
    ++step_;
    for (auto& g : opt_->param_groups()) g.options().set_lr(sched_.lr(step_, 1e-4));
    const double decay_now =
        std::min(0.9999, (1.0 + static_cast<double>(step_)) / (10.0 + static_cast<double>(step_)));
    at::NoGradGuard ng;
    for (std::size_t i = 0; i < params_.size(); ++i) shadow_[i].lerp_(params_[i], 1.0 - decay_now);
    return loss;
  }

 private:
  Net net_;
  std::vector<Batch> data_;
  std::unique_ptr<torch::optim::Optimizer> opt_;
  const ds::Cosine sched_{{100, 100000, 0.5}};
  std::vector<at::Tensor> params_, shadow_;
  std::int64_t step_ = 0;
};

// The same step through the trainer.
template <class Net>
class WithTrainer {
 public:
  explicit WithTrainer(bool tokens) : data_(batches<Net>(tokens)), trainer_(net_, options()) {}
  tr::StepInfo step() { return trainer_.step(data_); }

 private:
  static typename tr::Trainer<Net, Cfg>::Options options() {
    typename tr::Trainer<Net, Cfg>::Options o;
    o.optimizer.lr = 1e-4;
    o.schedule = {100, 100000, 0.5};
    o.clipping.max_norm = 1.0;
    o.accumulation_steps = 2;
    return o;
  }
  Net net_;
  std::vector<Batch> data_;
  tr::Trainer<Net, Cfg> trainer_;
};

template <class Net>
void hand_written(benchmark::State& state) {
  HandWritten<Net> loop(state.range(0) != 0);
  for (auto _ : state) benchmark::DoNotOptimize(loop.step());
}

template <class Net>
void with_trainer(benchmark::State& state) {
  WithTrainer<Net> loop(state.range(0) != 0);
  for (auto _ : state) benchmark::DoNotOptimize(loop.step());
}

void sync_device() {
  if (device().is_cuda()) torch::cuda::synchronize();
}

// A block of a paired case: `steps` steps of `loop`, its seconds per step.
template <class Loop>
auto block_of(Loop& loop, int steps) {
  return [&loop, steps] {
    return difftrain::bench::seconds_per_step(
        steps, [&] { (void)loop.step(); }, sync_device);
  };
}

// train_step_small and train_step_block, paired: blocks of the hand-written loop and of the
// trainer alternate (paired.hpp); args: steps per block, rounds.
template <class Net>
void train_step_paired(benchmark::State& state) {
  const bool tokens = std::is_same_v<Net, BlockNet>;
  const int block = static_cast<int>(state.range(0));
  const int rounds = static_cast<int>(state.range(1));
  HandWritten<Net> hand(tokens);
  WithTrainer<Net> trainer(tokens);
  for (int i = 0; i < std::max(2, block / 2); ++i) {
    (void)hand.step();
    (void)trainer.step();
  }
  // Page faults per step of each side: memory the C library gave back to the system and takes
  // again (each fault maps and clears a page), a cost of the allocation pattern, not of the work.
  auto faults = [] {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_minflt);
  };
  const double f0 = faults();
  for (int i = 0; i < block; ++i) (void)hand.step();
  const double f1 = faults();
  for (int i = 0; i < block; ++i) (void)trainer.step();
  const double f2 = faults();
  difftrain::bench::report_paired(
      state, difftrain::bench::paired(rounds, block_of(hand, block), block_of(trainer, block)));
  state.counters["baseline_faults"] = (f1 - f0) / block;
  state.counters["difftrain_faults"] = (f2 - f1) / block;
}

// train_vs_python_eager / _best, paired: the Python loop stays up (python_eager_train.py serve)
// and its blocks of 40 steps alternate with the trainer's, 30 rounds. Arg 1: Python's best eager
// settings.
void train_vs_python_paired(benchmark::State& state) {
  const bool best = state.range(0) != 0;
  difftrain::bench::PythonServer python(difftrain::bench::python_script("python_eager_train.py") +
                                        " serve" + (best ? " best" : ""));
  WithTrainer<MlpImpl> trainer(false);
  for (int i = 0; i < 20; ++i) (void)trainer.step();
  const int block = 40;
  auto python_block = [&] { return python.run(block); };
  difftrain::bench::report_paired(
      state, difftrain::bench::paired(30, python_block, block_of(trainer, block)), python.why());
}

// train_step_small's trainer, timed per step like the Python loop (wall clock, synchronised).
void trainer_timed(benchmark::State& state) {
  WithTrainer<MlpImpl> trainer(false);
  for (int i = 0; i < 20; ++i) (void)trainer.step();
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(trainer.step());
    sync_device();
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}

// The same step as train_step_small in Python, eagerly (benchmarks/python_eager_train.py, run once
// by this benchmark); its seconds per step are this case's baseline time. Arg 0: Python's
// defaults; arg 1: its best eager settings (AdamW fused=True, EMAModel foreach=True).
void python_eager(benchmark::State& state) {
  const bool best = state.range(0) != 0;
  static std::string why[2];
  static const double seconds[2] = {
      difftrain::bench::python_seconds_per_step(
          difftrain::bench::python_script("python_eager_train.py") + " 200", &why[0]),
      difftrain::bench::python_seconds_per_step(
          difftrain::bench::python_script("python_eager_train.py") + " 200 best", &why[1])};
  difftrain::bench::report_baseline(state, seconds[best], why[best]);
}

// The optimizer step alone over `count` tensors of `numel` parameters with gradients: LibTorch's
// per-parameter AdamW (baseline) against the fused kernel (difftrain), and the fused kernel
// against Python's AdamW(fused=True) on the same tensors (benchmarks/python_optimizer_step.py).
// `count` tensors of `numel` random parameters, each with a random gradient.
std::vector<at::Tensor> params_with_grads(std::int64_t count, std::int64_t numel) {
  std::vector<at::Tensor> params;
  for (std::int64_t i = 0; i < count; ++i) {
    params.push_back(at::randn({numel}, at::TensorOptions().device(device())).requires_grad_());
    params.back().mutable_grad() = at::randn_like(params.back());
  }
  return params;
}

enum class StepKind { per_parameter, fused, foreach, sgd_per_parameter, sgd_foreach };

template <StepKind Kind>
void optimizer_step(benchmark::State& state) {
  const std::vector<at::Tensor> params = params_with_grads(state.range(0), state.range(1));
  torch::optim::AdamWOptions o(1e-4);
  o.weight_decay(1e-2);
  torch::optim::SGDOptions sgd(1e-3);
  sgd.momentum(0.9);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if constexpr (Kind == StepKind::fused)
    opt = std::make_unique<tr::FusedAdamWOptimizer>(params, o);
  else if constexpr (Kind == StepKind::foreach)
    opt = std::make_unique<tr::ForeachAdamWOptimizer>(params, o);
  else if constexpr (Kind == StepKind::sgd_per_parameter)
    opt = std::make_unique<torch::optim::SGD>(params, sgd);
  else if constexpr (Kind == StepKind::sgd_foreach)
    opt = std::make_unique<tr::ForeachSGDOptimizer>(params, sgd);
  else
    opt = std::make_unique<torch::optim::AdamW>(params, o);
  opt->step();
  for (auto _ : state) {
    opt->step();
    if (device().is_cuda()) torch::cuda::synchronize();
  }
  state.counters["params_per_s"] =
      benchmark::Counter(static_cast<double>(state.range(0) * state.range(1)),
                         benchmark::Counter::kIsIterationInvariantRate);
}

// GradScaler's fp16 step on the fused AdamW: unscale_ then step (baseline) against the scale
// handed to the kernel (difftrain's path without clipping). The scaled gradients are restored
// before each step on both sides, so both see the same values every time.
template <bool Handed>
void fp16_step(benchmark::State& state) {
  const std::vector<at::Tensor> params = params_with_grads(state.range(0), state.range(1));
  std::vector<at::Tensor> grads, scaled;
  for (const auto& p : params) {
    grads.push_back(p.grad());
    scaled.push_back(p.grad() * 1024.0);
  }
  tr::FusedAdamWOptimizer opt(params, torch::optim::AdamWOptions(1e-4).weight_decay(1e-2));
  tr::GradScaler scaler(
      tr::GradScaler::Options{.init_scale = 1024.0, .hand_scale = tr::HandScale::always});
  (void)scaler.scale(at::ones({}, at::TensorOptions().device(device())));  // places the scale
  auto one = [&] {
    at::_foreach_copy_(grads, scaled);
    if constexpr (!Handed) scaler.unscale_(opt);
    (void)scaler.step(opt);
    scaler.update();
  };
  one();
  for (auto _ : state) {
    one();
    if (device().is_cuda()) torch::cuda::synchronize();
  }
}

// Gradient-norm clipping alone. Both sides multiply every gradient by the clamped coefficient
// whether or not it is below 1 (no read-back to decide), so a limit that is never reached costs
// the same work as one that clips, and the gradients keep their values across iterations.
template <bool MultiTensor>
void clip_norm(benchmark::State& state) {
  const std::vector<at::Tensor> params = params_with_grads(state.range(0), state.range(1));
  auto one = [&] {
    if constexpr (MultiTensor)
      return tr::clip_grad_norm_multi_tensor(params, 1e9);
    else
      return torch::nn::utils::clip_grad_norm_(params, 1e9);
  };
  benchmark::DoNotOptimize(one());
  for (auto _ : state) benchmark::DoNotOptimize(one());  // the returned norm synchronises
}

template <bool Foreach>
void python_optimizer_step(benchmark::State& state) {
  std::string why;
  const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_optimizer_step.py") + " " +
          std::to_string(state.range(0)) + " " + std::to_string(state.range(1)) +
          (Foreach ? " foreach" : " fused"),
      &why);
  difftrain::bench::report_baseline(state, seconds, why);
}
template <bool Foreach>
void optimizer_step_timed(benchmark::State& state) {
  const std::vector<at::Tensor> params = params_with_grads(state.range(0), state.range(1));
  const auto o = torch::optim::AdamWOptions(1e-4).weight_decay(1e-2);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if constexpr (Foreach)
    opt = std::make_unique<tr::ForeachAdamWOptimizer>(params, o);
  else
    opt = std::make_unique<tr::FusedAdamWOptimizer>(params, o);
  opt->step();
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    opt->step();
    if (device().is_cuda()) torch::cuda::synchronize();
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}
}  // namespace

// The tensors of optimizer_kinds_vs_adamw: convolutions, a projection and biases, as a UNet has.
std::vector<at::Tensor> unet_like_params() {
  std::vector<at::Tensor> out;
  for (int i = 0; i < 8; ++i) {
    out.push_back(at::randn({320, 320, 3, 3}, device()).requires_grad_());
    out.push_back(at::randn({1280, 320}, device()).requires_grad_());
    out.push_back(at::randn({320}, device()).requires_grad_());
  }
  for (auto& p : out) p.mutable_grad() = at::randn_like(p) * 1e-2;
  return out;
}

std::int64_t state_bytes(const torch::optim::Optimizer& opt) {
  std::int64_t n = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) n += t.numel() * static_cast<std::int64_t>(t.element_size());
  };
  for (const auto& [key, st] : opt.state()) {
    (void)key;
    if (const auto* a = dynamic_cast<const torch::optim::AdamWParamState*>(st.get())) {
      add(a->exp_avg());
      add(a->exp_avg_sq());
    } else if (const auto* q = dynamic_cast<const tr::AdamW8bitParamState*>(st.get())) {
      n += q->nbytes();
    } else if (const auto* f = dynamic_cast<const tr::FactoredParamState*>(st.get())) {
      n += f->nbytes();
    } else if (const auto* l = dynamic_cast<const tr::LionParamState*>(st.get())) {
      add(l->exp_avg());
    } else if (const auto* pr = dynamic_cast<const tr::ProdigyParamState*>(st.get())) {
      add(pr->exp_avg());
      add(pr->exp_avg_sq());
      add(pr->s());
      add(pr->p0());
    } else if (const auto* z = dynamic_cast<const tr::ScheduleFreeParamState*>(st.get())) {
      add(z->z());
      add(z->exp_avg_sq());
    }
  }
  return n;
}

std::unique_ptr<torch::optim::Optimizer> optimizer_of_kind(std::int64_t kind,
                                                           const std::vector<at::Tensor>& params) {
  static const char* names[] = {"AdamW8bit", "Adafactor",         "CAME", "Lion",
                                "Prodigy",   "AdamWScheduleFree", "AdamW"};
  tr::ParamGroup all;
  all.params = params;
  tr::OptimizerByName::Options o;
  o.type = names[kind];
  o.lr = kind == 4 ? 1.0 : 1e-4;
  return tr::OptimizerByName::make({all}, o);
}

void optimizer_kinds(benchmark::State& state, bool baseline) {
  const auto params = unet_like_params();
  std::int64_t numel = 0;
  for (const auto& p : params) numel += p.numel();
  auto adamw = optimizer_of_kind(6, params);
  adamw->step();
  auto opt = baseline ? optimizer_of_kind(6, params) : optimizer_of_kind(state.range(0), params);
  opt->step();
  for (auto _ : state) {
    opt->step();
    if (device().is_cuda()) torch::cuda::synchronize();
  }
  state.counters["state_bytes_per_param"] =
      static_cast<double>(state_bytes(*opt)) / static_cast<double>(numel);
  state.counters["state_vs_adamw"] =
      static_cast<double>(state_bytes(*opt)) / static_cast<double>(state_bytes(*adamw));
}
void optimizer_kinds_baseline(benchmark::State& state) { optimizer_kinds(state, true); }
void optimizer_kinds_difftrain(benchmark::State& state) { optimizer_kinds(state, false); }

BENCHMARK(optimizer_kinds_baseline)
    ->Name("optimizer_kinds_vs_adamw/baseline")
    ->DenseRange(0, 5)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(optimizer_kinds_difftrain)
    ->Name("optimizer_kinds_vs_adamw/difftrain")
    ->DenseRange(0, 5)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(python_eager)->Name("train_vs_python_eager/baseline")->Arg(0)->UseManualTime();
BENCHMARK(trainer_timed)->Name("train_vs_python_eager/difftrain")->Arg(0)->UseManualTime();
BENCHMARK(python_eager)->Name("train_vs_python_best/baseline")->Arg(1)->UseManualTime();
BENCHMARK(trainer_timed)->Name("train_vs_python_best/difftrain")->Arg(1)->UseManualTime();
BENCHMARK(train_vs_python_paired)
    ->Name("train_vs_python_eager_paired")
    ->Arg(0)
    ->Iterations(1)
    ->UseManualTime();
BENCHMARK(train_vs_python_paired)
    ->Name("train_vs_python_best_paired")
    ->Arg(1)
    ->Iterations(1)
    ->UseManualTime();
BENCHMARK_TEMPLATE(train_step_paired, MlpImpl)
    ->Name("train_step_small_paired")
    ->Args({50, 30})
    ->Iterations(1)
    ->UseManualTime();
BENCHMARK_TEMPLATE(train_step_paired, BlockNet)
    ->Name("train_step_block_paired")
    ->Args({4, 12})
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(optimizer_step, StepKind::per_parameter)
    ->Name("optimizer_step_fused_vs_per_parameter/baseline")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseRealTime();
BENCHMARK_TEMPLATE(optimizer_step, StepKind::fused)
    ->Name("optimizer_step_fused_vs_per_parameter/difftrain")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseRealTime();
BENCHMARK_TEMPLATE(optimizer_step, StepKind::per_parameter)
    ->Name("optimizer_step_foreach_vs_per_parameter/baseline")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseRealTime();
BENCHMARK_TEMPLATE(optimizer_step, StepKind::foreach)
    ->Name("optimizer_step_foreach_vs_per_parameter/difftrain")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseRealTime();
BENCHMARK_TEMPLATE(optimizer_step, StepKind::sgd_per_parameter)
    ->Name("sgd_step_foreach_vs_per_parameter/baseline")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseRealTime();
BENCHMARK_TEMPLATE(optimizer_step, StepKind::sgd_foreach)
    ->Name("sgd_step_foreach_vs_per_parameter/difftrain")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseRealTime();
BENCHMARK_TEMPLATE(clip_norm, false)
    ->Name("clip_norm_multi_tensor_vs_libtorch/baseline")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseRealTime();
BENCHMARK_TEMPLATE(clip_norm, true)
    ->Name("clip_norm_multi_tensor_vs_libtorch/difftrain")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseRealTime();
BENCHMARK_TEMPLATE(fp16_step, false)
    ->Name("fp16_step_scale_handed_vs_unscaled/baseline")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseRealTime();
BENCHMARK_TEMPLATE(fp16_step, true)
    ->Name("fp16_step_scale_handed_vs_unscaled/difftrain")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseRealTime();
BENCHMARK_TEMPLATE(python_optimizer_step, false)
    ->Name("optimizer_step_vs_python_fused/baseline")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseManualTime();
BENCHMARK_TEMPLATE(optimizer_step_timed, false)
    ->Name("optimizer_step_vs_python_fused/difftrain")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseManualTime();
BENCHMARK_TEMPLATE(python_optimizer_step, true)
    ->Name("optimizer_step_vs_python_foreach/baseline")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseManualTime();
BENCHMARK_TEMPLATE(optimizer_step_timed, true)
    ->Name("optimizer_step_vs_python_foreach/difftrain")
    ->Args({100, 1 << 20})
    ->Args({2000, 1000})
    ->UseManualTime();
BENCHMARK_TEMPLATE(hand_written, MlpImpl)->Name("train_step_small/baseline")->Arg(0)->UseRealTime();
BENCHMARK_TEMPLATE(with_trainer, MlpImpl)
    ->Name("train_step_small/difftrain")
    ->Arg(0)
    ->UseRealTime();
BENCHMARK_TEMPLATE(hand_written, BlockNet)
    ->Name("train_step_block/baseline")
    ->Arg(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(with_trainer, BlockNet)
    ->Name("train_step_block/difftrain")
    ->Arg(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
