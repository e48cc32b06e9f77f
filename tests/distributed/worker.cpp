// One rank of the distributed tests (tests/distributed/run_checks.py launches it, directly or
// under torchrun). It trains a small regression network on data that is a formula of the step,
// the micro-batch and the example (so every rank, and Python's reference, can make it), takes its
// rank's rows of each global micro-batch, and writes what it ended with as JSON:
//   {"rank", "world_size", "step", "weights": [...], "losses": [...], "skipped_nonfinite",
//    "error": {"type", "message"} | null, "seconds"}
// Faults are injected on request: a rank that exits, one that hangs, a NaN loss on one rank.
// With --multi, two such networks train in turn under one MultiTrainer (model step % 2), saved in
// one multi-model checkpoint; --disagree-at makes rank 1 pick the other model at that step.
// With --sharding 1|2|3 the trainer shards its optimizer state (and gradients, and parameters)
// over the ranks (ShardedDataParallel, ZeRO's stages) instead of replicating it; the result also
// says how many bytes of parameters, gradients and optimizer state this rank held after the last
// step, and at stage 3 how its units' parameters travelled. The --wide hidden layers are units
// (nn::in_unit); fc1 and fc2 lie outside every unit. With --device cuda every rank trains on
// GPU 0 (Gloo reduces CUDA tensors through host memory), its noise drawn by its CUDA generator.
// With --ema RULE_JSON the trainer keeps an EMA (kept per rank under sharding): the result adds
// its weights (gathered on every rank), the bytes of shadows this rank holds, and the loss of the
// EMA's weights on a fixed batch every --sample-every steps (a SampleEvery callback, on rank 0).
// With --consolidate CHECKPOINT it trains nothing: it writes that checkpoint's model (and with
// --consolidate-ema its EMA's weights) to --consolidate-out as one safetensors file, or with
// --consolidate-prefix and --consolidate-config as a model folder, counting the CPU memory it
// allocates.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "../unit/counting_allocator.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/distributed/data_parallel.hpp"
#include "difftrain/distributed/sharded_data_parallel.hpp"
#include "difftrain/ema/by_name.hpp"
#include "difftrain/ema/moving_average.hpp"
#include "difftrain/nn/unit_scope.hpp"
#include "difftrain/train/callbacks.hpp"
#include "difftrain/train/consolidate.hpp"
#include "difftrain/train/multi_trainer.hpp"
#include "difftrain/train/trainer.hpp"

namespace dt = difftrain;

namespace {

constexpr std::int64_t kGlobalBatch = 16;
constexpr std::int64_t kIn = 8;
constexpr std::int64_t kOut = 4;

struct Settings {
  std::int64_t steps = 50;
  std::int64_t accumulation = 1;
  std::int64_t chunk = 0;  // max_batch_size; 0: none
  std::string dtype = "float64";
  std::string out;
  std::string checkpoint_dir;
  std::int64_t save_every = 0;
  bool resume = false;
  bool noise = false;
  std::int64_t die_at = -1;   // rank 1 exits before this step
  std::int64_t hang_at = -1;  // rank 1 sleeps before this step
  std::int64_t nan_at = -1;   // rank 1's loss is NaN at this step
  std::string on_nan = "skip";
  std::int64_t timeout_ms = 60000;
  bool allow_world_size_change = false;
  bool unused = false;  // a branch used on even steps only, and one frozen layer
  bool multi = false;
  std::int64_t disagree_at = -1;  // --multi: rank 1 steps the other model at this step
  int sharding = 0;               // 0: DataParallel; 1, 2: ShardedDataParallel's stage
  bool sharded_policy = false;    // ShardedDataParallel even at stage 0
  bool offload = false;           // the optimizer in host memory (offload_optimizer)
  bool offload_params = false;    // stage 3's units too, between uses (offload_parameters)
  bool no_overlap = false;        // gradients sent after backward (overlap_backward off)
  bool decay_groups = false;      // two parameter groups (weights; biases without decay)
  std::string optimizer = "adamw";
  double max_norm = 0.5;
  double bucket_cap_mb = 25.0;
  std::int64_t wide = 0;             // hidden 32x32 layers between fc1 and fc2, each a unit
  std::string wrap;                  // stage 3: a name pattern for the units (empty: every one)
  bool no_reshard = false;           // stage 3: reshard_after_forward off
  bool no_prefetch = false;          // stage 3: prefetch off
  bool whole_between = false;        // stage 3: reshard_after_step off
  bool eval_on_rank0 = false;        // rank 0 alone runs the model after every step (a sampler)
  std::int64_t die_in_save_at = -1;  // rank 1 exits as the checkpoint of this step is saved
  std::int64_t budget_kb = -1;       // >= 0: CPU memory counted, and refused past this (0: never)
  std::string device = "cpu";        // cuda: the model and batches on GPU 0 (every rank's)
  std::string param_dtype;           // mixed precision: the dtype parameters compute in
  std::string reduce_dtype;          // and the one gradients are reduced in
  std::string ema;                   // an EMA rule as RuleByName's JSON (empty: no EMA)
  std::int64_t sample_every = 0;     // with --ema: SampleEvery's period (0: never)
  std::string consolidate;           // a checkpoint to write out as one file (nothing trained)
  std::string consolidate_out;
  bool consolidate_ema = false;
  std::string consolidate_prefix;
  std::string consolidate_config;  // JSON: write a model folder with this config
};

std::optional<at::ScalarType> dtype_named(const std::string& name) {
  if (name.empty()) return std::nullopt;
  if (name == "float64") return at::kDouble;
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  return at::kHalf;
}

struct Batch {
  at::Tensor x, y;
  [[nodiscard]] std::int64_t size() const { return x.size(0); }
  [[nodiscard]] Batch slice(std::int64_t start, std::int64_t length) const {
    return {x.narrow(0, start, length), y.narrow(0, start, length)};
  }
};

// The global micro-batch `micro` of step `step`: the same formula in tests/distributed/ddp.py.
std::pair<at::Tensor, at::Tensor> global_batch(std::int64_t step, std::int64_t micro) {
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor x = at::sin(at::arange(kGlobalBatch * kIn, f64) * 0.1 +
                               0.7 * static_cast<double>(step) + 1.3 * static_cast<double>(micro))
                           .reshape({kGlobalBatch, kIn});
  const at::Tensor y = at::cos(at::arange(kGlobalBatch * kOut, f64) * 0.05 +
                               0.3 * static_cast<double>(step) - 0.9 * static_cast<double>(micro))
                           .reshape({kGlobalBatch, kOut});
  return {x, y};
}

struct Net : torch::nn::Module {
  using Batch = ::Batch;
  Net(at::ScalarType dtype, bool noise, bool unused = false, std::int64_t wide = 0)
      : noise_(noise), unused_(unused) {
    const std::int64_t hidden_width = wide > 0 ? 32 : 16;
    fc1 = register_module("fc1", torch::nn::Linear(kIn, hidden_width));
    for (std::int64_t i = 0; i < wide; ++i)
      hidden.push_back(register_module("hidden" + std::to_string(i),
                                       torch::nn::Linear(hidden_width, hidden_width)));
    fc2 = register_module("fc2", torch::nn::Linear(hidden_width, kOut));
    if (unused_) {
      // A conditional branch (its parameters get no gradient on odd steps) and a frozen layer
      // (never trained): DDP's find_unused_parameters case.
      branch = register_module("branch", torch::nn::Linear(kIn, kOut));
      frozen = register_module("frozen", torch::nn::Linear(kOut, kOut));
    }
    scale = register_buffer("scale", at::ones({kOut}, at::kDouble));
    to(dtype);
    // Deterministic weights: the same formula in tests/distributed/ddp.py.
    at::NoGradGuard no_grad;
    std::int64_t k = 0;
    for (auto& p : named_parameters(true)) {
      const at::Tensor v =
          at::sin(at::arange(p.value().numel(), at::kDouble) * 0.37 + static_cast<double>(k++)) *
          0.3;
      p.value().copy_(v.reshape(p.value().sizes()));
    }
    if (unused_)
      for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  at::Tensor loss(const Batch& b) {
    at::Tensor h = at::tanh(fc1->forward(b.x));
    for (auto& layer : hidden)
      h = dt::nn::in_unit(*layer, [&] { return at::tanh(layer->forward(h)); });
    at::Tensor pred = fc2->forward(h) * scale;
    if (unused_) {
      if (step_ % 2 == 0) pred = pred + 0.5 * branch->forward(b.x);
      pred = frozen->forward(pred);
    }
    compute_dtype = fc1->weight.scalar_type();
    at::Tensor y = b.y;
    if (noise_) y = y + 0.01 * at::randn_like(y);
    at::Tensor l = (pred - y).pow(2).mean();
    if (poison_) l = l * std::nan("");
    return l;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, branch{nullptr}, frozen{nullptr};
  std::vector<torch::nn::Linear> hidden;
  at::Tensor scale;
  bool noise_;
  bool unused_;
  bool poison_ = false;
  std::int64_t step_ = 0;
  at::ScalarType compute_dtype = at::kDouble;  // fc1's dtype in the last forward
};

struct Config : dt::train::DefaultConfig {
  using Parallel = dt::distributed::DataParallel;
  using Callbacks = std::tuple<dt::train::CheckpointEvery>;
};
using Trainer = dt::train::Trainer<Net, Config>;

// Rank 1 exits as a checkpoint is about to be saved (before CheckpointEvery, on every rank).
struct DieBeforeSave {
  static constexpr bool every_rank = true;
  std::int64_t at = -1;
  template <class T>
  void on_step_end(T& t, const dt::train::StepInfo& s) {
    if (t.rank() == 1 && s.stepped && s.step == at) std::_Exit(9);
  }
};

struct ShardedAdamW : dt::train::DefaultConfig {
  using Parallel = dt::distributed::ShardedDataParallel;
  using Callbacks = std::tuple<DieBeforeSave, dt::train::CheckpointEvery>;
};
struct ShardedSgd : ShardedAdamW {
  using Optimizer = dt::train::SGD;
};

// The EMA's weights judged on a fixed batch, the way a sampler reads the model between steps.
struct EmaProbe {
  std::vector<double>* losses = nullptr;
  template <class T>
  void operator()(T& t) {
    auto& net = t.model();
    const at::Tensor w = net.fc1->weight;
    auto [x, y] = global_batch(0, 0);
    const Batch b{x.to(w.options()), y.to(w.options())};
    const bool noise = std::exchange(net.noise_, false);
    losses->push_back(net.loss(b).template item<double>());
    net.noise_ = noise;
  }
};
template <class Base>
struct WithEma : Base {
  using Ema = dt::ema::Ema<dt::ema::RuleByName, dt::ema::MultiTensor>;
  using Callbacks =
      std::tuple<DieBeforeSave, dt::train::CheckpointEvery, dt::train::SampleEvery<EmaProbe>>;
};
struct DataParallelEma : Config {
  using Ema = dt::ema::Ema<dt::ema::RuleByName, dt::ema::MultiTensor>;
  using Callbacks =
      std::tuple<DieBeforeSave, dt::train::CheckpointEvery, dt::train::SampleEvery<EmaProbe>>;
};

struct MultiConfig : dt::train::DefaultConfig {
  using Parallel = dt::distributed::DataParallel;
};
using Multi = dt::train::MultiTrainer<Net, MultiConfig>;

// The per-rank rows of the global micro-batches of `step`.
std::vector<Batch> rank_batches(const Settings& s, std::int64_t step, std::int64_t rank,
                                std::int64_t world_size, at::ScalarType dtype) {
  const std::int64_t rows = kGlobalBatch / world_size;
  std::vector<Batch> micro;
  for (std::int64_t m = 0; m < s.accumulation; ++m) {
    auto [x, y] = global_batch(step, m);
    const at::TensorOptions to = at::TensorOptions().dtype(dtype).device(at::Device(s.device));
    micro.push_back({x.narrow(0, rank * rows, rows).to(to), y.narrow(0, rank * rows, rows).to(to)});
  }
  return micro;
}

void append_weights(nlohmann::json& weights, torch::nn::Module& net) {
  for (const auto& p : net.parameters()) {
    const at::Tensor flat = p.detach().to(at::kDouble).reshape({-1}).contiguous();
    for (std::int64_t i = 0; i < flat.numel(); ++i) weights.push_back(flat[i].item<double>());
  }
}

// --multi: two networks (the second starts from other weights) trained in turn.
nlohmann::json run_multi(const Settings& s, std::int64_t& rank_out) {
  const at::ScalarType dtype = s.dtype == "float32" ? at::kFloat : at::kDouble;
  Net a(dtype, s.noise), b(dtype, s.noise);
  {
    at::NoGradGuard no_grad;
    for (auto& p : b.parameters()) p.mul_(-0.5);
  }
  Multi::Options o;
  o.optimizer.lr = 1e-2;
  o.groups.decay_groups = false;
  o.clipping.max_norm = 0.5;
  o.accumulation_steps = s.accumulation;
  if (s.chunk > 0) o.max_batch_size = s.chunk;
  o.parallel.world_options.timeout = std::chrono::milliseconds(s.timeout_ms);
  const auto world = dt::distributed::World::from_environment(o.parallel.world_options);
  o.parallel.world = world;
  rank_out = world->rank();
  at::manual_seed(1234 + static_cast<std::uint64_t>(world->rank()));
  Multi::Options o2 = o;
  o2.optimizer.lr = 5e-3;  // each model its own options
  Multi multi({&a, &b}, {o, o2});
  const std::filesystem::path dir(s.checkpoint_dir.empty() ? "unused" : s.checkpoint_dir);
  const auto file = [&](std::int64_t step) {
    return dir / ("multi-" + std::to_string(step) + ".pt");
  };
  std::int64_t step = 0;
  if (s.resume) {
    std::int64_t last = -1;
    if (std::filesystem::exists(dir))
      for (const auto& e : std::filesystem::directory_iterator(dir)) {
        const std::string n = e.path().stem().string();
        if (n.starts_with("multi-")) last = std::max<std::int64_t>(last, std::stoll(n.substr(6)));
      }
    if (last < 0) throw dt::IoError("no checkpoint to resume from", dir.string());
    multi.load_checkpoint(file(last));
    step = multi.steps_taken(0) + multi.steps_taken(1);
  }
  nlohmann::json losses = nlohmann::json::array();
  for (; step < s.steps;) {
    std::size_t model = static_cast<std::size_t>(step % 2);
    if (world->rank() == 1 && step == s.disagree_at) model = 1 - model;
    a.step_ = b.step_ = step;
    losses.push_back(
        multi.step(model, rank_batches(s, step, world->rank(), world->size(), dtype)).loss);
    ++step;
    if (s.save_every > 0 && step % s.save_every == 0) {
      std::filesystem::create_directories(dir);
      multi.save_checkpoint(file(step));
    }
  }
  nlohmann::json weights = nlohmann::json::array();
  append_weights(weights, a);
  append_weights(weights, b);
  return {{"step", step},       {"world_size", multi.world_size()},
          {"weights", weights}, {"scale", a.scale[0].item<double>()},
          {"losses", losses},   {"skipped_nonfinite", 0}};
}

template <class Cfg>
nlohmann::json run_single(const Settings& s, std::int64_t& rank_out) {
  using TrainerT = dt::train::Trainer<Net, Cfg>;
  const at::ScalarType dtype = s.dtype == "float32" ? at::kFloat : at::kDouble;
  Net net(dtype, s.noise, s.unused, s.wide);
  net.to(at::Device(s.device));
  typename TrainerT::Options o;
  if constexpr (TrainerT::sharded) {
    o.parallel.stage = s.sharding;
    o.parallel.bucket_cap_mb = s.bucket_cap_mb;
    o.parallel.find_unused_parameters = s.unused;
    o.parallel.offload_optimizer = s.offload;
    o.parallel.offload_parameters = s.offload_params;
    o.parallel.overlap_backward = !s.no_overlap;
    if (!s.wrap.empty())
      o.parallel.wrap = dt::distributed::ShardedDataParallel::units_named(s.wrap);
    o.parallel.reshard_after_forward = !s.no_reshard;
    o.parallel.prefetch = !s.no_prefetch;
    o.parallel.reshard_after_step = !s.whole_between;
    o.parallel.param_dtype = dtype_named(s.param_dtype);
    o.parallel.reduce_dtype = dtype_named(s.reduce_dtype);
  } else {
    o.parallel.find_unused_parameters = s.unused;
  }
  o.optimizer.lr = 1e-2;
  if constexpr (requires { o.optimizer.momentum; }) o.optimizer.momentum = 0.9;
  o.groups.decay_groups = s.decay_groups;
  o.clipping.max_norm = s.max_norm;
  o.accumulation_steps = s.accumulation;
  if (s.chunk > 0) o.max_batch_size = s.chunk;
  o.on_nan = s.on_nan == "stop" ? dt::train::NanPolicy::stop : dt::train::NanPolicy::skip;
  o.parallel.world_options.timeout = std::chrono::milliseconds(s.timeout_ms);
  o.allow_world_size_change = s.allow_world_size_change;
  if constexpr (TrainerT::has_ema)
    o.ema.rule = dt::ema::RuleByName::from_json(nlohmann::json::parse(s.ema), "--ema");
  // Before the trainer: rank 1 starts from other weights and buffers, which must become rank 0's.
  const auto world = dt::distributed::World::from_environment(o.parallel.world_options);
  o.parallel.world = world;
  rank_out = world->rank();
  // The World's scalar collectives, on which the trainer's decisions rest (skip a step, save).
  const std::int64_t last = world->size() - 1;
  if (world->all_true(world->rank() != last) || !world->all_true(true) ||
      world->mean(static_cast<double>(world->rank())) != static_cast<double>(last) / 2.0 ||
      !world->rank0_decides(world->rank() == 0) || world->rank0_decides(world->rank() != 0))
    throw std::runtime_error("a scalar collective of World gave a wrong answer");
  if (world->rank() != 0) {
    at::NoGradGuard no_grad;
    for (auto& p : net.parameters()) p.add_(0.5);
    net.scale.fill_(2.0);
  }
  at::manual_seed(1234 + static_cast<std::uint64_t>(world->rank()));
  dt::train::CheckpointEvery::Options co;
  co.dir = std::filesystem::path(s.checkpoint_dir.empty() ? "unused" : s.checkpoint_dir);
  co.every = s.save_every > 0 ? s.save_every : std::numeric_limits<std::int64_t>::max();
  co.keep_last = 100;
  std::vector<double> ema_probe;
  typename Cfg::Callbacks callbacks = [&] {
    if constexpr (std::tuple_size_v<typename Cfg::Callbacks> == 3)
      return typename Cfg::Callbacks{
          DieBeforeSave{s.die_in_save_at}, dt::train::CheckpointEvery(co),
          dt::train::SampleEvery<EmaProbe>(
              s.sample_every > 0 ? s.sample_every : std::numeric_limits<std::int64_t>::max(),
              EmaProbe{&ema_probe})};
    else if constexpr (std::tuple_size_v<typename Cfg::Callbacks> == 2)
      return
          typename Cfg::Callbacks{DieBeforeSave{s.die_in_save_at}, dt::train::CheckpointEvery(co)};
    else
      return typename Cfg::Callbacks{dt::train::CheckpointEvery(co)};
  }();
  TrainerT trainer(net, o, std::move(callbacks));
  std::string resumed_from;
  nlohmann::json skipped_files = nlohmann::json::array();
  if (s.resume) {
    std::vector<std::string> skipped;
    const auto used = dt::train::resume_latest(trainer, co.dir, &skipped);
    if (!used) {
      std::string why;
      for (const auto& e : skipped) why += "; skipped: " + e;
      throw dt::IoError("no checkpoint to resume from" + why, co.dir.string());
    }
    resumed_from = used->filename().string();
    for (const auto& e : skipped) skipped_files.push_back(e);
  }
  // What the resume left in this rank's CPU generator (a checksum of its state): every rank must
  // draw its own noise.
  const at::Tensor rng_state = at::detail::getDefaultCPUGenerator().get_state();
  const double rng_checksum =
      (rng_state.to(at::kDouble) * at::arange(1, rng_state.numel() + 1, at::kDouble))
          .sum()
          .item<double>();
  const std::int64_t world_size = world->size();
  // Under mixed precision the batches come in the parameters' compute dtype (FSDP casts the
  // inputs of its root module so).
  const at::ScalarType batch_dtype = dtype_named(s.param_dtype).value_or(dtype);
  nlohmann::json losses = nlohmann::json::array();
  bool poisoned = false;
  while (trainer.global_step() < s.steps) {
    const std::int64_t step = trainer.global_step();
    if (world->rank() == 1 && step == s.die_at) std::_Exit(9);
    if (world->rank() == 1 && step == s.hang_at) std::this_thread::sleep_for(std::chrono::hours(1));
    // Once: the skipped step is done again, with clean data this time.
    net.step_ = step;
    net.poison_ = world->rank() == 1 && step == s.nan_at && !poisoned;
    poisoned = poisoned || net.poison_;
    const auto info = trainer.step(rank_batches(s, step, world->rank(), world_size, batch_dtype));
    losses.push_back(info.loss);
    if (s.eval_on_rank0 && world->rank() == 0) {
      at::NoGradGuard no_grad;
      (void)net.loss(rank_batches(s, step, 0, world_size, batch_dtype).front());
    }
  }
  std::vector<at::Tensor> params;
  for (const auto& g : trainer.param_groups())
    params.insert(params.end(), g.params.begin(), g.params.end());
  const auto memory = dt::distributed::ShardedDataParallel::memory(params, trainer.optimizer());
  nlohmann::json weights = nlohmann::json::array();
  {
    const auto whole = trainer.whole_parameters();  // stage 3 holds a share between steps
    append_weights(weights, net);
  }
  nlohmann::json ema = nullptr;
  if constexpr (TrainerT::has_ema) {
    std::int64_t held = 0;
    for (const auto& [name, shadow] : trainer.ema().shadows_here())
      held += shadow.numel() * static_cast<std::int64_t>(shadow.element_size());
    nlohmann::json ema_weights = nlohmann::json::array();
    std::string shadow_dtype;
    {
      const auto scope = trainer.ema_weights();  // every rank: the shadows travel
      append_weights(ema_weights, net);
      shadow_dtype = c10::toString(net.fc1->weight.scalar_type());
    }
    nlohmann::json after = nlohmann::json::array();  // the training weights again
    {
      const auto whole = trainer.whole_parameters();
      append_weights(after, net);
    }
    std::string refused;
    try {
      trainer.ema().copy_to();
    } catch (const dt::ConfigError& e) {
      refused = e.what();
    }
    ema = {{"weights", ema_weights},           {"held_bytes", held},
           {"by_rank", trainer.ema_by_rank()}, {"share", trainer.ema().is_share()},
           {"weights_dtype", shadow_dtype},    {"training_weights_back", after == weights},
           {"copy_to_refused", refused},       {"probe", ema_probe}};
  }
  std::int64_t numel = 0;
  for (const auto& q : params) numel += q.numel();
  std::int64_t overlapped = 0;
  nlohmann::json units = nullptr;
  if constexpr (TrainerT::sharded) {
    overlapped = trainer.parallel().buckets_sent_during_backward();
    const auto u = trainer.parallel().unit_stats();
    units = {{"units", u.units},
             {"gathers", u.gathers},
             {"prefetched", u.prefetched},
             {"releases", u.releases},
             {"peak_parameter_bytes", u.peak_parameter_bytes},
             {"largest_unit_bytes", u.largest_unit_bytes}};
  }
  nlohmann::json names = nlohmann::json::array();
  for (const auto& p : net.named_parameters()) names.push_back(p.key());
  return {{"step", trainer.global_step()},
          {"world_size", world_size},
          {"weights", weights},
          {"names", names},
          {"scale", net.scale[0].item<double>()},
          {"losses", losses},
          {"compute_dtype", std::string(c10::toString(net.compute_dtype))},
          {"skipped_nonfinite", trainer.skipped_nonfinite()},
          {"resumed_from", resumed_from},
          {"rng_checksum", rng_checksum},
          {"skipped_checkpoints", skipped_files},
          {"numel", numel},
          {"buckets_sent_during_backward", overlapped},
          {"units", units},
          {"ema", ema},
          {"peak_bytes", dt::test::CountingAllocator::instance() != nullptr
                             ? nlohmann::json(dt::test::CountingAllocator::instance()->peak())
                             : nlohmann::json(nullptr)},
          {"memory",
           {{"parameters", memory.parameters},
            {"gradients", memory.gradients},
            {"optimizer", memory.optimizer}}}};
}

// --consolidate: the checkpoint's model as one file, the CPU bytes allocated meanwhile counted.
nlohmann::json run_consolidate(const Settings& s) {
  const dt::train::ConsolidateOptions o{.ema = s.consolidate_ema,
                                        .prefix = s.consolidate_prefix,
                                        .metadata = {{"written_by", "difftrain_dist_worker"}}};
  const auto report =
      s.consolidate_config.empty()
          ? dt::train::consolidate_checkpoint(s.consolidate, s.consolidate_out, o)
          : dt::train::consolidate_to_folder(s.consolidate, s.consolidate_out,
                                             nlohmann::json::parse(s.consolidate_config), o);
  return {{"step", report.step},
          {"world_size", report.world_size},
          {"sharded", report.sharded},
          {"tensors", report.tensors},
          {"bytes", report.bytes},
          {"peak_bytes", dt::test::CountingAllocator::instance() != nullptr
                             ? nlohmann::json(dt::test::CountingAllocator::instance()->peak())
                             : nlohmann::json(nullptr)}};
}

nlohmann::json run(const Settings& s, std::int64_t& rank_out) {
  if (!s.consolidate.empty()) return run_consolidate(s);
  if (s.multi) return run_multi(s, rank_out);
  if (!s.ema.empty()) {
    if (s.sharding == 0 && !s.sharded_policy) return run_single<DataParallelEma>(s, rank_out);
    return run_single<WithEma<ShardedAdamW>>(s, rank_out);
  }
  if (s.sharding == 0 && !s.sharded_policy) return run_single<Config>(s, rank_out);
  if (s.optimizer == "sgd") return run_single<ShardedSgd>(s, rank_out);
  return run_single<ShardedAdamW>(s, rank_out);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"one rank of difftrain's distributed checks"};
  Settings s;
  app.add_option("--steps", s.steps);
  app.add_option("--accumulation", s.accumulation);
  app.add_option("--chunk", s.chunk);
  app.add_option("--dtype", s.dtype)->check(CLI::IsMember({"float32", "float64"}));
  app.add_option("--out", s.out)->required();
  app.add_option("--device", s.device)->check(CLI::IsMember({"cpu", "cuda"}));
  const auto dtypes = CLI::IsMember({"float64", "float32", "bfloat16", "float16"});
  app.add_option("--param-dtype", s.param_dtype)->check(dtypes);
  app.add_option("--reduce-dtype", s.reduce_dtype)->check(dtypes);
  app.add_option("--checkpoint-dir", s.checkpoint_dir);
  app.add_option("--save-every", s.save_every);
  app.add_flag("--resume", s.resume);
  app.add_flag("--noise", s.noise);
  app.add_option("--die-at", s.die_at);
  app.add_option("--hang-at", s.hang_at);
  app.add_option("--nan-at", s.nan_at);
  app.add_option("--on-nan", s.on_nan)->check(CLI::IsMember({"skip", "stop"}));
  app.add_option("--timeout-ms", s.timeout_ms);
  app.add_flag("--allow-world-size-change", s.allow_world_size_change);
  app.add_flag("--unused", s.unused);
  app.add_flag("--multi", s.multi);
  app.add_option("--disagree-at", s.disagree_at);
  app.add_option("--sharding", s.sharding);
  app.add_flag("--sharded-policy", s.sharded_policy);
  app.add_flag("--offload", s.offload);
  app.add_flag("--offload-params", s.offload_params);
  app.add_flag("--no-overlap", s.no_overlap);
  app.add_flag("--decay-groups", s.decay_groups);
  app.add_option("--optimizer", s.optimizer)->check(CLI::IsMember({"adamw", "sgd"}));
  app.add_option("--max-norm", s.max_norm);
  app.add_option("--bucket-cap-mb", s.bucket_cap_mb);
  app.add_option("--wide", s.wide);
  app.add_option("--wrap", s.wrap);
  app.add_flag("--no-reshard", s.no_reshard);
  app.add_flag("--no-prefetch", s.no_prefetch);
  app.add_flag("--whole-between", s.whole_between);
  app.add_flag("--eval-on-rank0", s.eval_on_rank0);
  app.add_option("--die-in-save-at", s.die_in_save_at);
  app.add_option("--budget-kb", s.budget_kb);
  app.add_option("--ema", s.ema);
  app.add_option("--sample-every", s.sample_every);
  app.add_option("--consolidate", s.consolidate);
  app.add_option("--consolidate-out", s.consolidate_out);
  app.add_flag("--consolidate-ema", s.consolidate_ema);
  app.add_option("--consolidate-prefix", s.consolidate_prefix);
  app.add_option("--consolidate-config", s.consolidate_config);
  CLI11_PARSE(app, argc, argv);
  const auto start = std::chrono::steady_clock::now();
  std::int64_t rank = std::getenv("RANK") != nullptr ? std::atoll(std::getenv("RANK")) : 0;
  if (s.budget_kb >= 0)  // before any tensor: every allocation after it is counted
    dt::test::CountingAllocator::install(static_cast<std::size_t>(s.budget_kb) * 1024);
  nlohmann::json result;
  int rc = 0;
  try {
    result = run(s, rank);
    result["error"] = nullptr;
  } catch (const dt::Error& e) {
    result["error"] = {{"type", e.kind()}, {"message", e.what()}};
    rc = 3;
  } catch (const c10::OutOfMemoryError& e) {
    result["error"] = {{"type", "out of memory"}, {"message", e.what_without_backtrace()}};
    rc = 3;
  }
  result["rank"] = rank;
  result["seconds"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::ofstream(s.out + ".rank" + std::to_string(rank) + ".json") << result.dump() << "\n";
  if (rc != 0) std::cerr << "rank " << rank << ": " << result["error"]["message"] << "\n";
  // Quick exit: with a dead peer, the process group's destructor may wait on its threads.
  std::cout.flush();
  std::_Exit(rc);
}
