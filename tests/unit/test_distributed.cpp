// Data-parallel building blocks checked in one process: the per-rank shard of the data and the
// world read from the launcher's environment. Ranks talking to each other are checked by
// tests/distributed/run_checks.py, which starts several processes.
#include <gtest/gtest.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <difftrain/distributed/sampler.hpp>
#include <difftrain/distributed/sharded_data_parallel.hpp>
#include <difftrain/distributed/world.hpp>
#include <difftrain/ema/moving_average.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/nn/unit_scope.hpp>
#include <difftrain/train/trainer.hpp>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "golden.hpp"
#include "xy_batch.hpp"

namespace dist = difftrain::distributed;
namespace tst = difftrain::test;

TEST(DistributedSampler, EveryConfigurationGivesTorchsIndices) {
  const auto& cases = tst::golden("distributed_sampler.json")["cases"];
  ASSERT_GT(cases.size(), 1000U);
  for (const auto& c : cases) {
    dist::DistributedSampler s(c["n"].get<std::int64_t>(),
                               {.num_replicas = c["replicas"].get<std::int64_t>(),
                                .rank = c["rank"].get<std::int64_t>(),
                                .shuffle = c["shuffle"].get<bool>(),
                                .seed = c["seed"].get<std::uint64_t>(),
                                .drop_last = c["drop_last"].get<bool>()});
    s.set_epoch(c["epoch"].get<std::int64_t>());
    EXPECT_EQ(s.indices(), c["indices"].get<std::vector<std::int64_t>>()) << c.dump();
    EXPECT_EQ(s.size(), c["len"].get<std::int64_t>()) << c.dump();
  }
}

TEST(DistributedSampler, RanksSplitAnEpochAndBadSettingsAreConfigErrors) {
  // Without drop_last the ranks together cover every index (some twice, as padding).
  std::set<std::int64_t> seen;
  for (std::int64_t r = 0; r < 3; ++r) {
    dist::DistributedSampler s(10, {.num_replicas = 3, .rank = r, .seed = 5});
    s.set_epoch(2);
    for (auto i : s.indices()) seen.insert(i);
  }
  EXPECT_EQ(seen.size(), 10U);
  EXPECT_THROW(dist::DistributedSampler(10, {.num_replicas = 0}), difftrain::ConfigError);
  EXPECT_THROW(dist::DistributedSampler(10, {.num_replicas = 2, .rank = 2}),
               difftrain::ConfigError);
  EXPECT_THROW(dist::DistributedSampler(-1, {}), difftrain::ConfigError);
}

// ---- the launcher's environment --------------------------------------------------------------

namespace {
// Sets the launcher's variables for one test and restores the environment after it.
class LauncherEnv {
 public:
  explicit LauncherEnv(const std::vector<std::pair<const char*, const char*>>& vars) {
    for (const char* k : kNames) {
      const char* v = std::getenv(k);
      saved_.emplace_back(k, v != nullptr ? std::optional<std::string>(v) : std::nullopt);
      ::unsetenv(k);
    }
    for (const auto& [k, v] : vars) ::setenv(k, v, 1);
  }
  ~LauncherEnv() {
    for (const auto& [k, v] : saved_) {
      if (v)
        ::setenv(k, v->c_str(), 1);
      else
        ::unsetenv(k);
    }
  }
  LauncherEnv(const LauncherEnv&) = delete;
  LauncherEnv& operator=(const LauncherEnv&) = delete;

 private:
  static constexpr const char* kNames[] = {
      "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

// The ConfigError from_environment raises, or "" when it raises none.
std::string world_error(const std::vector<std::pair<const char*, const char*>>& vars) {
  LauncherEnv env(vars);
  try {
    (void)dist::World::from_environment({.timeout = std::chrono::milliseconds(2000)});
  } catch (const difftrain::ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(World, WithoutTheLauncherItIsOneProcessWithNoGroup) {
  LauncherEnv env({});
  const auto w = dist::World::from_environment();
  EXPECT_EQ(w->rank(), 0);
  EXPECT_EQ(w->size(), 1);
  EXPECT_TRUE(w->is_main());
  EXPECT_FALSE(w->distributed());
  // Collectives on a world of one change nothing and need no group.
  at::Tensor t = at::arange(4, at::kDouble);
  w->all_reduce_sum(t);
  EXPECT_TRUE(at::equal(t, at::arange(4, at::kDouble)));
  w->barrier();
  EXPECT_EQ(w->all_gather(t).size(), 1U);
  for (const bool ok : {false, true}) {
    EXPECT_EQ(w->all_true(ok), ok);
    EXPECT_EQ(w->rank0_decides(ok), ok);
  }
  EXPECT_EQ(w->mean(2.5), 2.5);
}

TEST(World, AWorldOfOneFromTorchrunNeedsNoRendezvous) {
  // torchrun --nproc-per-node 1 sets the variables; no store is started or reached.
  const auto w = [] {
    LauncherEnv env({{"RANK", "0"},
                     {"WORLD_SIZE", "1"},
                     {"LOCAL_RANK", "0"},
                     {"LOCAL_WORLD_SIZE", "1"},
                     {"MASTER_ADDR", "no-such-host.invalid"},
                     {"MASTER_PORT", "1"}});
    return dist::World::from_environment();
  }();
  EXPECT_EQ(w->size(), 1);
  EXPECT_FALSE(w->distributed());
}

TEST(World, EveryMalformedVariableIsAConfigErrorNamingIt) {
  struct Case {
    std::vector<std::pair<const char*, const char*>> vars;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{{"RANK", "0"}}, "WORLD_SIZE: is not set"},
      {{{"WORLD_SIZE", "2"}}, "RANK: is not set"},
      {{{"RANK", "zero"}, {"WORLD_SIZE", "2"}}, "RANK: is 'zero', not an integer"},
      {{{"RANK", "1x"}, {"WORLD_SIZE", "2"}}, "RANK: is '1x', not an integer"},
      {{{"RANK", ""}, {"WORLD_SIZE", "2"}}, "RANK: is '', not an integer"},
      {{{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "RANK: is 2, outside [0, 1]"},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK: is -1, outside [0, 1]"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE: is 0, outside"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "99999999999999999999"}}, "WORLD_SIZE: is '9"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}},
       "LOCAL_WORLD_SIZE: is 3, outside [1, 2]"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "1"}},
       "LOCAL_RANK: is 1, outside [0, 0]"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}}, "MASTER_ADDR: is not set"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}},
       "MASTER_PORT: is not set"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "0"}},
       "MASTER_PORT: is 0, outside [1, 65535]"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "70000"}},
       "MASTER_PORT: is 70000, outside [1, 65535]"},
  };
  for (const auto& c : cases) {
    const std::string got = world_error(c.vars);
    EXPECT_NE(got.find("difftrain::ConfigError"), std::string::npos) << c.expect << " / " << got;
    EXPECT_NE(got.find(c.expect), std::string::npos) << c.expect << " / " << got;
  }
  {
    LauncherEnv env({});
    EXPECT_THROW((void)dist::World::from_environment({.timeout = std::chrono::milliseconds(0)}),
                 difftrain::ConfigError);
  }
}

TEST(ShardedDataParallel, WrappingPoliciesPickUnitsByWholeNameOrByType) {
  using Sharded = dist::ShardedDataParallel;
  torch::nn::Linear linear(2, 2);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(1, 1, 3));
  const auto by_name = Sharded::units_named(R"((down|up)_blocks\.\d+|mid_block)");
  EXPECT_TRUE(by_name("down_blocks.0", *linear));
  EXPECT_TRUE(by_name("up_blocks.12", *conv));
  EXPECT_TRUE(by_name("mid_block", *linear));
  EXPECT_FALSE(by_name("down_blocks.0.resnets.1", *linear)) << "the whole name must match";
  EXPECT_FALSE(by_name("conv_in", *linear));
  const auto by_type = Sharded::units_of_type<torch::nn::LinearImpl>();
  EXPECT_TRUE(by_type("any", *linear));
  EXPECT_FALSE(by_type("any", *conv));
  // A stage that does not exist is refused before anything is reached, naming the stages.
  const std::vector<at::Tensor> params = linear->parameters();
  for (const int stage : {-1, 4}) {
    try {
      Sharded bad(*linear, params, {.stage = stage});
      ADD_FAILURE() << "stage " << stage << " accepted";
    } catch (const difftrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("3 (and parameters)"), std::string::npos) << e.what();
    }
  }
}

// ---- mixed precision in one process -------------------------------------------------------------

namespace {
struct MixedNet : torch::nn::Module {
  using Batch = tst::XyBatch;
  MixedNet() { fc = register_module("fc", torch::nn::Linear(4, 3)); }
  at::Tensor loss(const Batch& b) {
    seen = fc->weight.scalar_type();
    return (fc->forward(b.x) - b.y).pow(2).mean().to(at::kFloat);
  }
  torch::nn::Linear fc{nullptr};
  at::ScalarType seen = at::kFloat;
};
struct MixedConfig : difftrain::train::DefaultConfig {
  using Parallel = dist::ShardedDataParallel;
  using Ema = difftrain::ema::Ema<difftrain::ema::WarmupDecay>;
};
using MixedTrainer = difftrain::train::Trainer<MixedNet, MixedConfig>;

MixedTrainer::Options mixed_options(int stage) {
  MixedTrainer::Options o;
  o.parallel.stage = stage;
  o.parallel.param_dtype = at::kBFloat16;
  o.parallel.reduce_dtype = at::kFloat;
  o.optimizer.lr = 1e-2;
  return o;
}
}  // namespace

// The model computes in param_dtype, the optimizer steps float32 masters, and whatever reads the
// model through whole_parameters() (the EMA, checkpoints, a resume) sees the masters exactly.
TEST(ShardedDataParallel, MixedPrecisionComputesInParamDtypeAndKeepsFullPrecisionMasters) {
  at::manual_seed(3);
  const tst::XyBatch batch{at::randn({8, 4}).to(at::kBFloat16),
                           at::randn({8, 3}).to(at::kBFloat16)};
  for (const int stage : {1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    MixedNet net;
    const at::Tensor start = net.fc->weight.detach().clone();
    MixedTrainer trainer(net, mixed_options(stage));
    EXPECT_TRUE(trainer.parallel().mixed_precision());
    EXPECT_EQ(net.fc->weight.scalar_type(), at::kBFloat16);
    EXPECT_EQ(trainer.ema().shadow("fc.weight").scalar_type(), at::kFloat)
        << "the EMA starts from the masters";
    EXPECT_TRUE(at::equal(trainer.ema().shadow("fc.weight"), start));
    for (const auto& g : trainer.optimizer().param_groups())
      for (const auto& p : g.params()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    for (int i = 0; i < 5; ++i) (void)trainer.step({batch});
    EXPECT_EQ(net.seen, at::kBFloat16);
    EXPECT_EQ(net.fc->weight.scalar_type(), at::kBFloat16);
    at::Tensor masters;
    {
      const auto whole = trainer.whole_parameters();
      EXPECT_EQ(net.fc->weight.scalar_type(), at::kFloat);
      masters = net.fc->weight.detach().clone();
      EXPECT_FALSE(at::equal(masters, masters.to(at::kBFloat16).to(at::kFloat)))
          << "the masters hold more than bf16 values";
      {
        const auto nested = trainer.whole_parameters();  // already whole: nothing changes
        EXPECT_EQ(net.fc->weight.scalar_type(), at::kFloat);
      }
      EXPECT_EQ(net.fc->weight.scalar_type(), at::kFloat);
    }
    EXPECT_TRUE(at::equal(net.fc->weight.detach(), masters.to(at::kBFloat16)))
        << "after the scope, the masters rounded";
    // A checkpoint holds the masters, and a new trainer resumes them exactly.
    const auto dir = std::filesystem::temp_directory_path() /
                     ("difftrain-mixed-" + std::to_string(stage) + "-" +
                      std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    std::filesystem::create_directories(dir);
    trainer.save_checkpoint(dir / "c.pt");
    MixedNet other;
    MixedTrainer resumed(other, mixed_options(stage));
    resumed.load_checkpoint(dir / "c.pt");
    {
      const auto whole = resumed.whole_parameters();
      EXPECT_TRUE(at::equal(other.fc->weight, masters));
    }
    const auto a = trainer.step({batch});
    const auto b = resumed.step({batch});
    EXPECT_EQ(a.loss, b.loss);
    {
      const auto w1 = trainer.whole_parameters();
      const auto w2 = resumed.whole_parameters();
      EXPECT_TRUE(at::equal(net.fc->weight, other.fc->weight)) << "resumed bit-identical";
    }
    difftrain::io::remove_tree(dir);
  }
  // A dtype that is not floating point, and stage 0, are refused naming the option.
  MixedNet net;
  auto o = mixed_options(2);
  o.parallel.param_dtype = at::kInt;
  EXPECT_THROW(
      {
        try {
          MixedTrainer t(net, o);
        } catch (const difftrain::ConfigError& e) {
          EXPECT_NE(std::string(e.what()).find("param_dtype"), std::string::npos) << e.what();
          throw;
        }
      },
      difftrain::ConfigError);
  EXPECT_THROW(MixedTrainer(net, mixed_options(0)), difftrain::ConfigError);
}

// ---- parameters offloaded, in a world of one
// ------------------------------------------------------

namespace {
// Two units (each hidden layer) between layers outside every unit.
struct UnitNet : torch::nn::Module {
  using Batch = tst::XyBatch;
  explicit UnitNet(at::ScalarType dtype) {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    for (int i = 0; i < 2; ++i)
      hidden.push_back(register_module("hidden" + std::to_string(i), torch::nn::Linear(8, 8)));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
    to(dtype);
  }
  at::Tensor loss(const Batch& b) {
    at::Tensor h = at::tanh(fc1->forward(b.x));
    for (auto& layer : hidden)
      h = difftrain::nn::in_unit(*layer, [&] { return at::tanh(layer->forward(h)); });
    seen = hidden[0]->weight.scalar_type();
    return (fc2->forward(h) - b.y).pow(2).mean().to(at::kFloat);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  std::vector<torch::nn::Linear> hidden;
  at::ScalarType seen = at::kFloat;
};
struct OffloadConfig : difftrain::train::DefaultConfig {
  using Parallel = dist::ShardedDataParallel;
};
struct PlainConfig : difftrain::train::DefaultConfig {};
using OffloadTrainer = difftrain::train::Trainer<UnitNet, OffloadConfig>;

OffloadTrainer::Options offload_options() {
  OffloadTrainer::Options o;
  o.parallel.stage = 3;
  o.parallel.offload_parameters = true;
  o.optimizer.lr = 1e-2;
  o.accumulation_steps = 2;
  return o;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}
}  // namespace

// FSDP's CPUOffload(offload_params=True) on one device: between steps the units' parameters hold
// no memory (their values live in the optimizer's copies in host memory), and the run equals an
// ordinary one, resumed too; whatever reads the model between steps takes whole_parameters().
TEST(ShardedDataParallel, OffloadedParametersLiveInHostCopiesBetweenUsesInAWorldOfOne) {
  at::manual_seed(5);
  std::vector<tst::XyBatch> batches;
  for (int i = 0; i < 12; ++i)
    batches.push_back({at::randn({6, 4}, at::kDouble), at::randn({6, 3}, at::kDouble)});
  const auto held = [](const torch::nn::Module& m) {
    std::int64_t bytes = 0;
    for (const auto& p : m.parameters()) bytes += static_cast<std::int64_t>(p.storage().nbytes());
    return bytes;
  };
  const auto dir = std::filesystem::temp_directory_path() /
                   ("difftrain-offload-" +
                    std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::filesystem::create_directories(dir);
  double next_loss = 0.0;
  std::vector<at::Tensor> next_weights;
  {  // (one stage-3 trainer listens to units per process at a time)
    UnitNet plain_net(at::kDouble);
    UnitNet net(at::kDouble);
    {
      at::NoGradGuard no_grad;
      for (std::size_t i = 0; i < net.parameters().size(); ++i)
        net.parameters()[i].copy_(plain_net.parameters()[i]);
    }
    difftrain::train::Trainer<UnitNet, PlainConfig>::Options po;
    po.optimizer.lr = 1e-2;
    po.accumulation_steps = 2;
    difftrain::train::Trainer<UnitNet, PlainConfig> plain(plain_net, po);
    OffloadTrainer trainer(net, offload_options());
    for (int i = 0; i < 5; ++i) {
      const auto a = plain.step({batches[2 * i], batches[2 * i + 1]});
      const auto b = trainer.step({batches[2 * i], batches[2 * i + 1]});
      EXPECT_EQ(a.loss, b.loss) << "step " << i;
    }
    EXPECT_EQ(held(*net.hidden[0]) + held(*net.hidden[1]), 0) << "the units live in host memory";
    EXPECT_GT(held(*net.fc1), 0) << "outside every unit: always held";
    const auto stats = trainer.parallel().unit_stats();
    EXPECT_EQ(stats.units, 2);
    EXPECT_GT(stats.gathers, 0);
    EXPECT_GT(stats.releases, 0);
    EXPECT_LE(stats.peak_parameter_bytes, held(*net.fc1) + held(*net.fc2) + 2 * 8 * 9 * 8)
        << "during a pass at most two units are held";
    for (const auto& g : trainer.optimizer().param_groups())
      for (const auto& p : g.params()) EXPECT_GT(p.storage().nbytes(), 0U) << "the copies stay";
    // Reading the model between steps: refused without whole_parameters() (naming it, and not
    // the reshard_after_step way out, which offloading excludes); with it, the plain run's.
    try {
      at::NoGradGuard no_grad;
      (void)net.loss(batches[0]);
      ADD_FAILURE() << "a forward outside a step ran on freed parameters";
    } catch (const difftrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("whole_parameters"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("reshard_after_step"), std::string::npos) << e.what();
    }
    {
      const auto whole = trainer.whole_parameters();
      for (std::size_t i = 0; i < net.parameters().size(); ++i)
        EXPECT_TRUE(at::equal(net.parameters()[i], plain_net.parameters()[i])) << "parameter " << i;
    }
    EXPECT_EQ(held(*net.hidden[0]), 0) << "freed again when the scope ends";
    // A checkpoint holds the host copies; the step after it, for the resumed run to match.
    trainer.save_checkpoint(dir / "c.pt");
    next_loss = trainer.step({batches[10], batches[11]}).loss;
    const auto whole = trainer.whole_parameters();
    next_weights = clones(net.parameters());
  }
  {
    UnitNet other(at::kDouble);
    OffloadTrainer resumed(other, offload_options());
    resumed.load_checkpoint(dir / "c.pt");
    EXPECT_EQ(resumed.step({batches[10], batches[11]}).loss, next_loss);
    const auto whole = resumed.whole_parameters();
    for (std::size_t i = 0; i < next_weights.size(); ++i)
      EXPECT_TRUE(at::equal(other.parameters()[i], next_weights[i])) << "resumed, parameter " << i;
  }
  difftrain::io::remove_tree(dir);
  // Under mixed precision the units are brought in param_dtype from float32 masters.
  {
    UnitNet mixed(at::kFloat);
    auto mo = offload_options();
    mo.parallel.param_dtype = at::kBFloat16;
    mo.parallel.reduce_dtype = at::kFloat;
    OffloadTrainer mt(mixed, mo);
    const tst::XyBatch bf{batches[0].x.to(at::kBFloat16), batches[0].y.to(at::kBFloat16)};
    for (int i = 0; i < 3; ++i) (void)mt.step({bf, bf});
    EXPECT_EQ(mixed.seen, at::kBFloat16);
    EXPECT_EQ(held(*mixed.hidden[1]), 0);
    const auto whole = mt.whole_parameters();
    EXPECT_EQ(mixed.hidden[1]->weight.scalar_type(), at::kFloat);
    EXPECT_FALSE(at::equal(mixed.hidden[1]->weight,
                           mixed.hidden[1]->weight.to(at::kBFloat16).to(at::kFloat)))
        << "the masters hold more than bf16 values";
  }
  // Refused: below stage 3, and without reshard_after_step, naming the option.
  for (const bool stage2 : {true, false}) {
    UnitNet bad(at::kDouble);
    auto o = offload_options();
    if (stage2)
      o.parallel.stage = 2;
    else
      o.parallel.reshard_after_step = false;
    try {
      OffloadTrainer t(bad, o);
      ADD_FAILURE() << "accepted";
    } catch (const difftrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("offload_parameters"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(stage2 ? "stage 3" : "reshard_after_step"),
                std::string::npos)
          << e.what();
    }
  }
}
