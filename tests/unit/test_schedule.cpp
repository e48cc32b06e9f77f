#include <difftrain/schedule/schedule.hpp>

#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>

#include "golden.hpp"

namespace dt = difftrain;
namespace sch = difftrain::schedule;
namespace tst = difftrain::test;

namespace {

// Every golden case built from difftrain's schedules with the reference's arguments.
std::map<std::string, std::function<sch::AnySchedule()>> cases() {
  using sch::AnySchedule;
  return {
      {"cosine_annealing",
       [] { return AnySchedule(sch::CosineAnnealing({.T_max = 100, .eta_min = 0.001})); }},
      {"cosine_warm_restarts",
       [] { return AnySchedule(sch::CosineAnnealingWarmRestarts({.T_0 = 30, .eta_min = 0.002})); }},
      {"cosine_warm_restarts_mult",
       [] { return AnySchedule(sch::CosineAnnealingWarmRestarts({.T_0 = 7, .T_mult = 2})); }},
      {"polynomial_lr",
       [] { return AnySchedule(sch::PolynomialDecay({.total_iters = 150, .power = 1.7})); }},
      {"polynomial_lr_linear",
       [] { return AnySchedule(sch::PolynomialDecay({.total_iters = 40})); }},
      {"polynomial_by_name",
       [] {
         // diffusers' get_scheduler(name, optimizer) divides by the optimizer's default LR (0.1 in
         // the reference), for every group; so does the overload that takes the optimizer.
         torch::optim::SGD sgd(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())},
                               torch::optim::SGDOptions(0.1));
         return sch::get_scheduler(
             "polynomial", sgd, {.num_warmup_steps = 10, .num_training_steps = 250, .power = 3.0});
       }},
      {"constant_lr",
       [] { return AnySchedule(sch::ConstantFactor({.factor = 0.5, .total_iters = 40})); }},
      {"linear_lr",
       [] {
         return AnySchedule(
             sch::LinearFactor({.start_factor = 0.25, .end_factor = 1.0, .total_iters = 40}));
       }},
      {"exponential", [] { return AnySchedule(sch::Exponential({.gamma = 0.98})); }},
      {"step", [] { return AnySchedule(sch::Step({.step_size = 30, .gamma = 0.5})); }},
      {"multistep",
       [] {
         return AnySchedule(sch::MultiStep({.milestones = {50, 120, 120, 200}, .gamma = 0.3}));
       }},
      {"one_cycle", [] { return AnySchedule(sch::OneCycle({.total_steps = 400})); }},
      {"one_cycle_three_phase_linear",
       [] {
         return AnySchedule(sch::OneCycle({.total_steps = 350,
                                           .pct_start = 0.25,
                                           .anneal_strategy = sch::OneCycle::Anneal::linear,
                                           .div_factor = 10.0,
                                           .final_div_factor = 100.0,
                                           .three_phase = true}));
       }},
      {"constant", [] { return sch::get_scheduler("constant"); }},
      {"constant_with_warmup",
       [] { return AnySchedule(sch::ConstantWithWarmup({.num_warmup_steps = 25})); }},
      {"linear",
       [] {
         return sch::get_scheduler("linear", {.num_warmup_steps = 30, .num_training_steps = 300});
       }},
      {"linear_f",
       [] {
         return AnySchedule(sch::Linear(
             {.num_warmup_steps = 30, .num_training_steps = 300, .f_min = 0.1, .f_max = 0.9}));
       }},
      {"cosine",
       [] {
         return sch::get_scheduler("cosine", {.num_warmup_steps = 30, .num_training_steps = 300});
       }},
      {"cosine_cycles",
       [] {
         return AnySchedule(
             sch::Cosine({.num_warmup_steps = 20, .num_training_steps = 300, .num_cycles = 1.5}));
       }},
      {"cosine_with_restarts",
       [] {
         return AnySchedule(sch::CosineWithRestarts(
             {.num_warmup_steps = 20, .num_training_steps = 300, .num_cycles = 3}));
       }},
      {"polynomial",
       [] {
         // diffusers divides by the optimizer's default LR (the first group's), for every group.
         return AnySchedule(sch::Polynomial({.num_warmup_steps = 20,
                                             .num_training_steps = 300,
                                             .lr_end = 1e-4,
                                             .power = 2.0,
                                             .lr_init = 0.1}));
       }},
      {"piecewise_constant",
       [] {
         return sch::get_scheduler("piecewise_constant",
                                   {.step_rules = "1:10,0.1:20,0.01:30,0.005"});
       }},
      {"timm_cosine",
       [] {
         return AnySchedule(sch::timm::Cosine({.t_initial = 100,
                                               .lr_min = 1e-4,
                                               .cycle_mul = 1.5,
                                               .cycle_decay = 0.7,
                                               .cycle_limit = 3,
                                               .warmup_t = 10,
                                               .warmup_lr_init = 1e-5,
                                               .k_decay = 1.2}));
       }},
      {"timm_cosine_prefix",
       [] {
         return AnySchedule(sch::timm::Cosine({.t_initial = 90,
                                               .lr_min = 1e-5,
                                               .cycle_decay = 0.5,
                                               .cycle_limit = 4,
                                               .warmup_t = 15,
                                               .warmup_lr_init = 1e-4,
                                               .warmup_prefix = true}));
       }},
      {"timm_tanh",
       [] {
         return AnySchedule(sch::timm::Tanh({.t_initial = 120,
                                             .lr_min = 1e-5,
                                             .cycle_decay = 0.8,
                                             .cycle_limit = 3,
                                             .warmup_t = 12,
                                             .warmup_lr_init = 1e-4}));
       }},
      {"timm_tanh_prefix",
       [] {
         return AnySchedule(sch::timm::Tanh({.t_initial = 100,
                                             .lb = -6.0,
                                             .ub = 4.0,
                                             .cycle_mul = 2.0,
                                             .cycle_limit = 2,
                                             .warmup_t = 10,
                                             .warmup_prefix = true}));
       }},
      {"timm_poly",
       [] {
         return AnySchedule(sch::timm::Poly({.t_initial = 150,
                                             .power = 2.0,
                                             .lr_min = 1e-5,
                                             .cycle_decay = 0.5,
                                             .cycle_limit = 2,
                                             .warmup_t = 8,
                                             .k_decay = 0.8}));
       }},
      {"timm_step",
       [] {
         return AnySchedule(sch::timm::Step(
             {.decay_t = 30, .decay_rate = 0.5, .warmup_t = 5, .warmup_lr_init = 1e-4}));
       }},
      {"timm_multistep",
       [] {
         return AnySchedule(sch::timm::MultiStep(
             {.decay_t = {40, 90, 150}, .decay_rate = 0.5, .warmup_t = 5, .warmup_lr_init = 1e-4}));
       }},
      {"timm_wsd",
       [] {
         return AnySchedule(sch::timm::WarmupStableDecay({.t_initial = 300,
                                                          .decay_t = 60,
                                                          .lr_min = 1e-5,
                                                          .warmup_t = 20,
                                                          .warmup_lr_init = 1e-6}));
       }},
      {"timm_wsd_rsqrt_cosine",
       [] {
         using W = sch::timm::WarmupStableDecay;
         return AnySchedule(W({.t_initial = 300,
                               .decay_t = 100,
                               .stable_fn = W::StableFn::rsqrt,
                               .decay_fn = W::DecayFn::cosine,
                               .warmup_t = 25}));
       }},
      {"timm_wsd_power_exp",
       [] {
         using W = sch::timm::WarmupStableDecay;
         return AnySchedule(W({.t_initial = 250,
                               .decay_t = 80,
                               .stable_fn = W::StableFn::power,
                               .stable_timescale = 40.0,
                               .stable_power = 0.3,
                               .decay_fn = W::DecayFn::exp,
                               .decay_ratio = 0.05}));
       }},
      {"linear_warmup+cosine_annealing",
       [] {
         return AnySchedule(sch::WithWarmup<sch::LinearWarmup, sch::CosineAnnealing>(
             {.warmup = {.warmup_period = 30}, .schedule = {.T_max = 300}}));
       }},
      {"exponential_warmup+constant",
       [] {
         return AnySchedule(sch::WithWarmup<sch::ExponentialWarmup, sch::Constant>(
             {.warmup = {.warmup_period = 20}}));
       }},
      {"untuned_linear_warmup+constant",
       [] {
         return AnySchedule(
             sch::WithWarmup<sch::UntunedLinearWarmup, sch::Constant>({.warmup = {.beta2 = 0.99}}));
       }},
      {"untuned_exponential_warmup+exponential",
       [] {
         return AnySchedule(sch::WithWarmup<sch::UntunedExponentialWarmup, sch::Exponential>(
             {.warmup = {.beta2 = 0.99}, .schedule = {.gamma = 0.995}}));
       }},
      {"radam_warmup+step",
       [] {
         return AnySchedule(sch::WithWarmup<sch::RAdamWarmup, sch::Step>(
             {.warmup = {.beta2 = 0.999}, .schedule = {.step_size = 100, .gamma = 0.5}}));
       }},
      {"linear_warmup_per_group+cosine_annealing",
       [] {
         return AnySchedule(sch::WithWarmup<sch::LinearWarmup, sch::CosineAnnealing>(
             {.warmup = {.warmup_periods = {30, 75}}, .schedule = {.T_max = 300}}));
       }},
      {"exponential_warmup_per_group+constant",
       [] {
         return AnySchedule(sch::WithWarmup<sch::ExponentialWarmup, sch::Constant>(
             {.warmup = {.warmup_periods = {50, 12}}}));
       }},
      {"untuned_linear_warmup_per_group+constant",
       [] {
         return AnySchedule(sch::WithWarmup<sch::UntunedLinearWarmup, sch::Constant>(
             {.warmup = {.beta2s = {0.99, 0.995}}}));
       }},
      {"untuned_exponential_warmup_per_group+exponential",
       [] {
         // β₂ per group read from the optimizer, as pytorch-warmup reads group["betas"].
         std::vector<torch::optim::OptimizerParamGroup> groups;
         for (double b2 : {0.98, 0.995})
           groups.emplace_back(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())},
                               std::make_unique<torch::optim::AdamOptions>(
                                   torch::optim::AdamOptions(0.1).betas({0.9, b2})));
         torch::optim::Adam adam(groups);
         return AnySchedule(sch::WithWarmup<sch::UntunedExponentialWarmup, sch::Exponential>(
             {.warmup = {.beta2s = sch::adam_beta2s(adam)}, .schedule = {.gamma = 0.995}}));
       }},
      {"radam_warmup_per_group+step",
       [] {
         return AnySchedule(sch::WithWarmup<sch::RAdamWarmup, sch::Step>(
             {.warmup = {.beta2s = {0.999, 0.99}}, .schedule = {.step_size = 100, .gamma = 0.5}}));
       }},
      {"warmup_cosine",
       [] {
         return AnySchedule(sch::WarmupCosine({.warm_up_steps = 50,
                                               .lr_min = 0.01,
                                               .lr_max = 1.0,
                                               .lr_start = 0.001,
                                               .max_decay_steps = 300}));
       }},
      {"warmup_cosine_cycles",
       [] {
         return AnySchedule(sch::WarmupCosineCycles({.warm_up_steps = {20, 10, 0},
                                                     .f_min = {0.1, 0.05, 0.01},
                                                     .f_max = {1.0, 0.8, 0.5},
                                                     .f_start = {0.0, 0.1, 0.5},
                                                     .cycle_lengths = {150, 120, 200}}));
       }},
      {"warmup_linear_cycles",
       [] {
         return AnySchedule(sch::WarmupLinearCycles({.warm_up_steps = {25, 10},
                                                     .f_min = {0.0, 0.1},
                                                     .f_max = {1.0, 0.6},
                                                     .f_start = {0.01, 0.2},
                                                     .cycle_lengths = {200, 200}}));
       }},
      {"step_string",
       [] {
         return AnySchedule(
             sch::StepString({.text = "0.005:100, 1e-5:250, 1e-6", .max_steps = 380}));
       }},
      {"step_string_resumed",
       [] {
         return AnySchedule(sch::StepString(
             {.text = "0.005:100, 1e-5:250, 1e-6:300, 1e-7", .max_steps = 380, .start_step = 150}));
       }},
      {"step_string_accumulated",
       [] {
         return AnySchedule(sch::StepString({.text = "0.1:10, 0.01:10, 0.001:11, 1e-4:30, 5e-5",
                                             .max_steps = 380,
                                             .consults_per_step = 3}));
       }},
      {"step_string_minus_one",
       [] {
         return AnySchedule(
             sch::StepString({.text = "0.02:50, 0.001:-1, 0.5:9999", .max_steps = 380}));
       }},
      {"step_string_past_max",
       [] {
         return AnySchedule(sch::StepString({.text = "0.3:20, 0.2:1000, 0.1", .max_steps = 300}));
       }},
  };
}

bool close(double got, double want) {
  return std::abs(got - want) <= 1e-12 * std::abs(want) + 1e-16;
}

}  // namespace

TEST(Schedule, EveryGoldenCaseMatchesItsReferenceTo1e12) {
  const auto& g = tst::golden("schedule.json");
  const auto bases = g["bases"].get<std::vector<double>>();
  const auto built = cases();
  ASSERT_EQ(built.size(), g["cases"].size());
  for (const auto& [name, curve] : g["cases"].items()) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(built.contains(name));
    const sch::AnySchedule s = built.at(name)();
    const std::int64_t start = name == "step_string_resumed" ? 150 : 0;
    std::int64_t mismatches = 0;
    for (std::size_t t = 0; t < curve.size(); ++t)
      for (std::size_t gi = 0; gi < bases.size(); ++gi) {
        const double want = curve[t][gi].get<double>();
        const double got = s.lr(start + static_cast<std::int64_t>(t), bases[gi], gi);
        if (!close(got, want) && mismatches++ < 3)
          ADD_FAILURE() << "step " << t << " group " << gi << ": got " << got << ", want " << want;
      }
    EXPECT_EQ(mismatches, 0);
  }
}

TEST(Schedule, BoundToAnOptimizerEachGroupKeepsItsBase) {
  // Two groups, as the golden curves have them; the bound scheduler walks the optimizer through
  // the same LRs torch's schedulers set.
  const auto& g = tst::golden("schedule.json");
  const auto curve = g["cases"]["linear_warmup+cosine_annealing"];
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())},
                      std::make_unique<torch::optim::SGDOptions>(0.1));
  groups.emplace_back(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())},
                      std::make_unique<torch::optim::SGDOptions>(0.02));
  torch::optim::SGD opt(groups, torch::optim::SGDOptions(0.1));
  using S = sch::WithWarmup<sch::LinearWarmup, sch::CosineAnnealing>;
  sch::LrScheduler<S> scheduler(opt,
                                S({.warmup = {.warmup_period = 30}, .schedule = {.T_max = 300}}));
  EXPECT_EQ(scheduler.base_lrs(), (std::vector<double>{0.1, 0.02}));
  for (std::size_t t = 0; t < 200; ++t) {
    const auto lrs = scheduler.last_lr();
    ASSERT_TRUE(close(lrs[0], curve[t][0].get<double>())) << t;
    ASSERT_TRUE(close(lrs[1], curve[t][1].get<double>())) << t;
    scheduler.step();
  }
  EXPECT_EQ(S::name, "linear_warmup+cosine_annealing");
}

TEST(Schedule, StateRoundTripsByNameAndResumesExactly) {
  torch::optim::SGD opt({at::zeros({1}, at::requires_grad())}, torch::optim::SGDOptions(0.1));
  sch::LrScheduler<sch::Cosine> a(opt,
                                  sch::Cosine({.num_warmup_steps = 10, .num_training_steps = 100}));
  for (int i = 0; i < 37; ++i) a.step();
  const nlohmann::json state = a.state();
  EXPECT_EQ(state["name"], "cosine");
  EXPECT_EQ(state["last_epoch"], 37);

  torch::optim::SGD opt2({at::zeros({1}, at::requires_grad())}, torch::optim::SGDOptions(0.5));
  sch::LrScheduler<sch::Cosine> b(opt2,
                                  sch::Cosine({.num_warmup_steps = 10, .num_training_steps = 100}));
  b.load_state(nlohmann::json::parse(state.dump()));
  EXPECT_EQ(b.base_lrs(), a.base_lrs());
  for (int i = 0; i < 20; ++i) {
    a.step();
    b.step();
    EXPECT_EQ(a.last_lr(), b.last_lr());
  }
  // A state from another schedule, or for another number of groups, is refused before anything
  // changes.
  sch::LrScheduler<sch::Linear> other(opt2, sch::Linear({.num_training_steps = 100}));
  const auto before = other.last_lr();
  EXPECT_THROW(other.load_state(state), dt::ConfigError);
  EXPECT_EQ(other.last_lr(), before);
  nlohmann::json two_groups = state;
  two_groups["base_lrs"] = {0.1, 0.2};
  EXPECT_THROW(b.load_state(two_groups), dt::ConfigError);
  nlohmann::json broken = state;
  broken.erase("last_epoch");
  EXPECT_THROW(b.load_state(broken), dt::FormatError);
  broken = state;
  broken["base_lrs"] = {std::nan("")};
  EXPECT_THROW(b.load_state(broken), dt::FormatError);
}

TEST(Schedule, ReduceOnPlateauMatchesTorch) {
  const auto& p = tst::golden("schedule.json")["plateau"];
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())},
                      std::make_unique<torch::optim::SGDOptions>(0.1));
  groups.emplace_back(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())},
                      std::make_unique<torch::optim::SGDOptions>(0.02));
  torch::optim::SGD opt(groups, torch::optim::SGDOptions(0.1));
  sch::ReduceLROnPlateau plateau(
      opt, {.factor = 0.5, .patience = 3, .threshold = 1e-3, .cooldown = 2, .min_lr = {1e-3}});
  const auto metrics = p["metrics"].get<std::vector<double>>();
  for (std::size_t i = 0; i < metrics.size(); ++i) {
    plateau.step(metrics[i]);
    const auto lrs = plateau.last_lr();
    ASSERT_TRUE(close(lrs[0], p["lrs"][i][0].get<double>())) << i;
    ASSERT_TRUE(close(lrs[1], p["lrs"][i][1].get<double>())) << i;
  }
  EXPECT_THROW(plateau.step(std::nan("")), dt::NumericError);
  const auto saved = plateau.state();
  sch::ReduceLROnPlateau again(opt, {.factor = 0.5});
  again.load_state(saved);
  EXPECT_EQ(again.best(), plateau.best());
  EXPECT_THROW(again.load_state({{"name", "cosine"}}), dt::FormatError);
}

TEST(Schedule, TableIsTheCurveAsXtensor) {
  const sch::Cosine cosine({.num_warmup_steps = 5, .num_training_steps = 50});
  const auto t = sch::table(cosine, 60, 0.3);
  ASSERT_EQ(t.shape(0), 60U);
  for (std::size_t i = 0; i < 60; ++i)
    EXPECT_EQ(t(i), cosine.lr(static_cast<std::int64_t>(i), 0.3));
  EXPECT_THROW((void)sch::table(cosine, -1), dt::ConfigError);
}

TEST(Schedule, BadOptionsAreConfigErrorsNamingTheOption) {
  const auto where_of = [](auto&& make) -> std::string {
    try {
      make();
    } catch (const dt::ConfigError& e) {
      return e.where() + " | " + e.message();
    }
    return "no error";
  };
  EXPECT_EQ(
      where_of([] { sch::Cosine({.num_warmup_steps = 200, .num_training_steps = 100}); }),
      "lr schedule 'cosine' option num_warmup_steps | warm-up (200 steps) is longer than training "
      "(100 steps)");
  EXPECT_NE(where_of([] { sch::CosineAnnealing({.T_max = 0}); }).find("option T_max"),
            std::string::npos);
  EXPECT_NE(where_of([] { sch::Step({.step_size = -3}); }).find("option step_size"),
            std::string::npos);
  // Per-group lists: each entry checked; a group past the list is named.
  EXPECT_THROW(sch::LinearWarmup({.warmup_periods = {10, 0}}), dt::ConfigError);
  EXPECT_THROW(sch::RAdamWarmup({.beta2s = {0.999, 0.5}}), dt::ConfigError);
  EXPECT_NE(where_of([] {
              (void)sch::LinearWarmup({.warmup_periods = {10, 20}}).factor(0, 2);
            }).find("warmup_periods"),
            std::string::npos);
  {
    torch::optim::SGD sgd(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())},
                          torch::optim::SGDOptions(0.1));
    EXPECT_THROW((void)sch::adam_beta2s(sgd), dt::ConfigError);
  }
  EXPECT_NE(where_of([] { sch::LinearWarmup({.warmup_period = 0}); }).find("warmup_period"),
            std::string::npos);
  EXPECT_NE(where_of([] { sch::RAdamWarmup({.beta2 = 0.5}); }).find("beta2"), std::string::npos);
  // β₂ is checked before the untuned period divides by 1 − β₂.
  EXPECT_NE(where_of([] { sch::UntunedLinearWarmup({.beta2 = 1.0}); }).find("option beta2"),
            std::string::npos);
  EXPECT_NE(where_of([] { sch::UntunedExponentialWarmup({.beta2 = 1.5}); }).find("option beta2"),
            std::string::npos);
  EXPECT_NE(where_of([] { sch::timm::Cosine({.t_initial = 0}); }).find("t_initial"),
            std::string::npos);
  EXPECT_NE(where_of([] {
              sch::timm::WarmupStableDecay({.t_initial = 100, .decay_t = 200});
            }).find("decay_t"),
            std::string::npos);
  EXPECT_NE(where_of([] {
              using W = sch::timm::WarmupStableDecay;
              W({.stable_fn = W::StableFn::rsqrt});  // no warm-up, so no default timescale
            }).find("stable_timescale"),
            std::string::npos);
  EXPECT_NE(where_of([] {
              sch::WarmupCosineCycles({.warm_up_steps = {1},
                                       .f_min = {0},
                                       .f_max = {1},
                                       .f_start = {0},
                                       .cycle_lengths = {10, 20}});
            }).find("same length"),
            std::string::npos);
  EXPECT_NE(where_of([] {
              sch::get_scheduler("cosine", {.num_training_steps = 10});
            }).find("num_warmup_steps"),
            std::string::npos);
  EXPECT_NE(where_of([] {
              sch::get_scheduler("cosine", {.num_warmup_steps = 1});
            }).find("num_training_steps"),
            std::string::npos);
  EXPECT_NE(where_of([] { sch::get_scheduler("cosin"); }).find("did you mean 'cosine'"),
            std::string::npos);
  EXPECT_NE(where_of([] {
              sch::PiecewiseConstant({.step_rules = "1:10:5,0.1"});
            }).find("is not 'multiple:step'"),
            std::string::npos);
  EXPECT_NE(
      where_of([] { sch::PiecewiseConstant({.step_rules = "1:10,"}); }).find("is not a number"),
      std::string::npos);
  EXPECT_EQ(where_of([] { sch::PiecewiseConstant({.step_rules = "1:10,0.1"}); }), "no error");
  EXPECT_NE(where_of([] {
              sch::PiecewiseConstant({.step_rules = "1:x,0.1"});
            }).find("'x' is not a whole"),
            std::string::npos);
  EXPECT_NE(where_of([] {
              (void)sch::OneCycle({.total_steps = 10}).lr(11, 0.1);
            }).find("past total_steps"),
            std::string::npos);
}

TEST(Schedule, MalformedStepStringsSayWhatIsWrong) {
  const auto message_of = [](const std::string& text) -> std::string {
    try {
      sch::StepString({.text = text, .max_steps = 1000});
    } catch (const dt::ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message_of("0.005:abc").find("'abc' is not a whole number"), std::string::npos);
  EXPECT_NE(message_of("fast:100").find("'fast' is not a number"), std::string::npos);
  EXPECT_NE(message_of("0.1:10:20").find("more than one ':'"), std::string::npos);
  EXPECT_NE(message_of("-0.1:10, 0.1").find("is negative"), std::string::npos);
  EXPECT_NE(message_of("nan").find("not finite"), std::string::npos);
  EXPECT_NE(message_of("inf:10, 1").find("not finite"), std::string::npos);
  EXPECT_NE(message_of(" , ,").find("no entry is in force"), std::string::npos);
  EXPECT_NE(message_of("0.1:1.5").find("'1.5' is not a whole number"), std::string::npos);
  EXPECT_EQ(message_of(" 1e-3 : 100 ,  1e-4 "), "no error");
  // Resuming past every entry leaves nothing to schedule.
  EXPECT_THROW(sch::StepString({.text = "0.1:10, 0.01:20", .max_steps = 100, .start_step = 50}),
               dt::ConfigError);
}

TEST(Schedule, RegistriesKnowEveryScheduleAndWarmup) {
  EXPECT_EQ(sch::schedules.names.size(), 26U);
  EXPECT_TRUE(sch::schedules.contains("timm_wsd"));
  EXPECT_TRUE(sch::schedules.contains("step_string"));
  EXPECT_TRUE(sch::warmups.contains("radam_warmup"));
  // Every registered schedule constructs from default options and gives finite LRs.
  for (std::string_view name : sch::schedules.names) {
    SCOPED_TRACE(name);
    const double lr = sch::schedules.visit(name, [](auto tag) {
      using S = typename decltype(tag)::type;
      if constexpr (std::is_same_v<S, sch::WarmupCosineCycles> ||
                    std::is_same_v<S, sch::WarmupLinearCycles>) {
        return S({.warm_up_steps = {1},
                  .f_min = {0},
                  .f_max = {1},
                  .f_start = {0},
                  .cycle_lengths = {10}})
            .lr(3, 1.0);
      } else {
        return S(typename S::Options{}).lr(3, 1.0);
      }
    });
    EXPECT_TRUE(std::isfinite(lr));
  }
}

TEST(Schedule, PerGroupWarmupBoundToAnOptimizerDampensEachGroupByItsOwnPeriod) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (double lr : {0.1, 0.02})
    groups.emplace_back(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())},
                        std::make_unique<torch::optim::SGDOptions>(lr));
  torch::optim::SGD sgd(groups, torch::optim::SGDOptions(0.1));
  using S = sch::WithWarmup<sch::LinearWarmup, sch::Constant>;
  sch::LrScheduler<S> bound(sgd, S({.warmup = {.warmup_periods = {2, 4}}}));
  EXPECT_DOUBLE_EQ(bound.last_lr()[0], 0.1 * 1 / 2);
  EXPECT_DOUBLE_EQ(bound.last_lr()[1], 0.02 * 1 / 4);
  bound.step();
  EXPECT_DOUBLE_EQ(bound.last_lr()[0], 0.1);
  EXPECT_DOUBLE_EQ(bound.last_lr()[1], 0.02 * 2 / 4);
  // Three groups against a two-entry list: the binding fails and names the option.
  groups.emplace_back(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())},
                      std::make_unique<torch::optim::SGDOptions>(0.3));
  torch::optim::SGD three(groups, torch::optim::SGDOptions(0.1));
  EXPECT_THROW(sch::LrScheduler<S>(three, S({.warmup = {.warmup_periods = {2, 4}}})),
               dt::ConfigError);
}

// The schedule chosen at run time by diffusers' name: every name gives the numbers of the static
// policy of that name, its options come from JSON with every wrong key or kind named, and a bad
// name or a missing argument is refused when it is built.
TEST(ByName, EveryDiffusersNameEqualsItsStaticPolicyAndJsonIsChecked) {
  sch::SchedulerArgs a;
  a.num_warmup_steps = 10;
  a.num_training_steps = 100;
  a.num_cycles = 2;
  a.power = 2.0;
  a.step_rules = "1:10,0.5:50,0.1";
  const std::vector<std::pair<std::string, std::function<double(std::int64_t)>>> cases = {
      {"constant",
       [](std::int64_t s) { return sch::Constant(sch::Constant::Options{}).lr(s, 0.1); }},
      {"constant_with_warmup",
       [](std::int64_t s) { return sch::ConstantWithWarmup({.num_warmup_steps = 10}).lr(s, 0.1); }},
      {"linear",
       [](std::int64_t s) {
         return sch::Linear({.num_warmup_steps = 10, .num_training_steps = 100}).lr(s, 0.1);
       }},
      {"cosine",
       [](std::int64_t s) {
         return sch::Cosine({.num_warmup_steps = 10, .num_training_steps = 100}).lr(s, 0.1);
       }},
      {"cosine_with_restarts",
       [](std::int64_t s) {
         return sch::CosineWithRestarts(
                    {.num_warmup_steps = 10, .num_training_steps = 100, .num_cycles = 2})
             .lr(s, 0.1);
       }},
      {"polynomial",
       [&](std::int64_t s) { return sch::get_scheduler("polynomial", a).lr(s, 0.1); }},
      {"piecewise_constant",
       [](std::int64_t s) {
         return sch::PiecewiseConstant({.step_rules = "1:10,0.5:50,0.1"}).lr(s, 0.1);
       }},
  };
  for (const auto& [name, want] : cases) {
    const sch::ByName by({.lr_scheduler = name, .args = a});
    EXPECT_EQ(by.chosen(), name);
    for (std::int64_t s = 0; s <= 120; ++s) EXPECT_EQ(by.lr(s, 0.1), want(s)) << name << " " << s;
  }
  // JSON: what a config file holds.
  const auto o = sch::ByName::from_json(nlohmann::json::parse(
      R"({"lr_scheduler": "cosine_with_restarts", "num_warmup_steps": 10,
          "num_training_steps": 100, "num_cycles": 2, "power": 2, "lr_end": 1e-6})"));
  EXPECT_EQ(o.lr_scheduler, "cosine_with_restarts");
  EXPECT_EQ(o.args.num_warmup_steps, 10);
  EXPECT_EQ(o.args.num_training_steps, 100);
  EXPECT_EQ(o.args.num_cycles, 2);
  EXPECT_DOUBLE_EQ(o.args.lr_end, 1e-6);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"lr_schedular": "cosine"})", "lr schedule.lr_schedular"},
      {R"({"num_warmup_steps": 1.5})", "lr schedule.num_warmup_steps"},
      {R"({"num_training_steps": "100"})", "lr schedule.num_training_steps"},
      {R"({"power": "two"})", "lr schedule.power"},
      {R"({"lr_scheduler": 3})", "lr schedule.lr_scheduler"},
      {R"([1, 2])", "lr schedule"},
  };
  for (const auto& [text, where] : bad) {
    try {
      (void)sch::ByName::from_json(nlohmann::json::parse(text));
      ADD_FAILURE() << text << " was accepted";
    } catch (const dt::ConfigError& e) {
      EXPECT_EQ(e.where(), where) << e.what();
    }
  }
  EXPECT_THROW(sch::ByName({.lr_scheduler = "cosine_annealing_typo"}), dt::ConfigError);
  EXPECT_THROW(sch::ByName({.lr_scheduler = "cosine"}), dt::ConfigError);  // no steps given
}
