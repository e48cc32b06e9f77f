// The samplers over whole configuration spaces, against diffusers (tests/reference/
// ref_sampler_sweeps.py): every spacing at every step count, and every beta schedule x zero
// terminal SNR x prediction x spacing (x Karras σ, solver order, SDE) at 10 and 25 steps.
#include <difftrain/diffusion/diffusion.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <sstream>

#include "golden.hpp"

namespace dt = difftrain;
namespace df = difftrain::diffusion;
namespace tst = difftrain::test;

namespace {

const nlohmann::json& g() { return tst::golden("sampler_sweeps.json"); }

std::vector<std::string> split(const std::string& key) {
  std::vector<std::string> parts;
  std::stringstream in(key);
  for (std::string p; std::getline(in, p, '/');) parts.push_back(p);
  return parts;
}

df::TimestepSpacing spacing_of(const std::string& s) {
  if (s == "leading") return df::TimestepSpacing::leading;
  if (s == "trailing") return df::TimestepSpacing::trailing;
  return df::TimestepSpacing::linspace;
}
df::Prediction prediction_of(const std::string& s) { return df::prediction_from(s, "golden"); }
df::NoiseSchedule schedule_of(const std::string& beta, bool zero_snr, std::int64_t n = 1000) {
  df::NoiseSchedule::Options o{.num_train_timesteps = n, .precision = df::Precision::float32};
  o.rescale_betas_zero_snr = zero_snr;
  o.beta_schedule = df::beta_schedule_from(beta, "golden");
  if (o.beta_schedule == df::BetaSchedule::scaled_linear) {
    o.beta_start = 0.00085;
    o.beta_end = 0.012;
  }
  return df::NoiseSchedule(o);
}

/// Count, first, last and sequential float64 sums of v and of (i + 1)·v, as the script computes.
template <class T>
std::array<double, 5> digest(const std::vector<T>& v) {
  double sum = 0;
  double weighted = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    sum += static_cast<double>(v[i]);
    weighted += static_cast<double>(v[i]) * static_cast<double>(i + 1);
  }
  if (v.empty()) return {0, 0, 0, 0, 0};
  return {static_cast<double>(v.size()), static_cast<double>(v.front()),
          static_cast<double>(v.back()), sum, weighted};
}

void expect_digest(const std::array<double, 5>& got, const nlohmann::json& want, double rtol,
                   const std::string& what) {
  for (std::size_t k = 0; k < 5; ++k) {
    const double w = want[k].get<double>();
    if (rtol == 0) {
      ASSERT_EQ(got[k], w) << what << " digest field " << k;
    } else {
      ASSERT_NEAR(got[k], w, rtol * std::max(1.0, std::abs(w))) << what << " digest field " << k;
    }
  }
}

at::Tensor initial_sample() {
  return at::sin(at::linspace(-1.5, 1.5, 2 * 3 * 4 * 4, at::kFloat).reshape({2, 3, 4, 4})) * 1.3;
}
at::Tensor fake_model(const at::Tensor& x, double t) { return 0.5 * at::tanh(x) + t * 1e-4; }
at::Generator seeded(std::uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

/// The script writes NaN and infinities as "nan", "inf" and "-inf".
at::Tensor values_from(const nlohmann::json& want) {
  std::vector<double> v;
  for (const auto& x : want) {
    if (!x.is_string()) {
      v.push_back(x.get<double>());
    } else if (x == "nan") {
      v.push_back(std::numeric_limits<double>::quiet_NaN());
    } else {
      v.push_back((x == "inf" ? 1 : -1) * std::numeric_limits<double>::infinity());
    }
  }
  return at::tensor(v, at::kDouble);
}

/// Agreement to 1e-5 relative to the run's largest value (norm-wise: these runs are float32 and
/// some are ill-conditioned, e.g. third-order SDE steps whose diffusers result itself moves by 1e-2
/// when its input moves by 1e-7), plus `sigma_atol` for σ-space samplers whose first steps work
/// at σ_max (4096 with zero terminal SNR: one float32 ulp there is 5e-4). NaN and infinities
/// must be where the reference has them.
void expect_close(const at::Tensor& got, const nlohmann::json& want, const std::string& what,
                  double sigma_atol = 0) {
  const at::Tensor ref = values_from(want);
  ASSERT_EQ(got.numel(), ref.numel()) << what;
  const at::Tensor d = got.to(at::kDouble).flatten();
  const at::Tensor finite = at::isfinite(ref);
  ASSERT_TRUE(at::equal(at::isfinite(d), finite)) << what << ": non-finite values differ";
  ASSERT_TRUE(at::equal(at::isnan(d), at::isnan(ref))) << what << ": NaNs differ";
  if (!finite.any().item<bool>()) return;
  const double scale = ref.masked_select(finite).abs().max().item<double>();
  const double err = (d - ref).masked_select(finite).abs().max().item<double>();
  EXPECT_LE(err, 1e-5 * (1 + scale) + sigma_atol)
      << what << ": max |diff| " << err << " (largest value " << scale << ")";
}

/// Runs a sampler whose step takes (output, t, x, generator) and compares first and last samples.
/// Integer timesteps must be equal. Karras σ→t timesteps are fractions computed through numpy's
/// float32 log, which is not correctly rounded (an ulp off for 137 of the 1000 σ of the linear
/// schedule, and dependent on the SIMD path numpy picks); those agree to `timestep_tol`.
template <class S, class Step>
void check_run(S& s, const nlohmann::json& ref, std::int64_t steps, double init_sigma, Step step,
               const std::string& what, double timestep_tol = 0, double sigma_max = 0) {
  s.set_timesteps(steps);
  ASSERT_EQ(s.timesteps().size(), ref["timesteps"].size()) << what;
  for (std::size_t i = 0; i < s.timesteps().size(); ++i)
    ASSERT_NEAR(static_cast<double>(s.timesteps()[i]), ref["timesteps"][i].get<double>(),
                timestep_tol)
        << what << " timestep " << i;
  at::Tensor x = initial_sample() * init_sigma;
  const double sigma_atol = 4e-7 * sigma_max;
  for (std::size_t i = 0; i < s.timesteps().size(); ++i) {
    x = step(s, i, x);
    if (i == 0) expect_close(x, ref["first"], what + " after the first step", sigma_atol);
  }
  expect_close(x, ref["last"], what + " after the last step", sigma_atol);
}

}  // namespace

TEST(SamplerSweeps, EverySpacingAtEveryStepCountMatchesDiffusers) {
  int checked = 0;
  for (const auto& [key, ref] : g()["timesteps"].items()) {
    const auto parts = split(key);  // sampler/spacing/N
    const std::string& sampler = parts[0];
    const auto spacing = spacing_of(parts[1]);
    const std::int64_t N = std::stoll(parts[2]);
    const df::NoiseSchedule schedule(
        {.num_train_timesteps = N, .precision = df::Precision::float32});
    df::Ddpm ddpm(schedule, {.timestep_spacing = spacing});
    df::Ddim ddim(schedule, {.timestep_spacing = spacing});
    df::Euler euler(schedule, {.timestep_spacing = spacing});
    df::DpmSolverMultistep dpm(schedule, {.timestep_spacing = spacing});
    for (std::int64_t n = 1; n <= N; ++n) {
      const std::string what = key + " at " + std::to_string(n) + " steps";
      const auto& want = ref["timesteps"][static_cast<std::size_t>(n - 1)];
      if (sampler == "ddpm") {
        ddpm.set_timesteps(n);
        expect_digest(digest(ddpm.timesteps()), want, 0, what);
      } else if (sampler == "ddim") {
        ddim.set_timesteps(n);
        expect_digest(digest(ddim.timesteps()), want, 0, what);
      } else if (sampler == "euler") {
        euler.set_timesteps(n);
        expect_digest(digest(euler.timesteps()), want, 0, what);
        expect_digest(digest(euler.sigmas()), ref["sigmas"][static_cast<std::size_t>(n - 1)], 1e-6,
                      what + " sigmas");
      } else {
        dpm.set_timesteps(n);
        expect_digest(digest(dpm.timesteps()), want, 0, what);
        expect_digest(digest(dpm.sigmas()), ref["sigmas"][static_cast<std::size_t>(n - 1)], 1e-6,
                      what + " sigmas");
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 4 * 3 * (1000 + 999));
}

TEST(SamplerSweeps, EveryScheduleSnrPredictionAndSpacingMatchesDiffusers) {
  std::map<std::string, int> checked;
  int diffusers_failed = 0;
  for (const auto& [key, ref] : g()["samplers"].items()) {
    const auto p = split(key);
    const std::string& kind = p[0];
    if (kind == "dpm_option" || kind == "euler_churn" || kind == "euler_option") continue;
    // kind/beta/snr/prediction/spacing/steps[/karras[/order/algorithm]]
    const auto schedule = schedule_of(p[1], p[2] == "True");
    const auto prediction = prediction_of(p[3]);
    const auto spacing = spacing_of(p[4]);
    const std::int64_t steps = std::stoll(p[5]);
    if (ref.contains("error")) {
      // diffusers itself fails here (a repeated first timestep makes it skip a σ and run off the
      // end); difftrain takes every step and stays finite unless the configuration cannot be.
      ++diffusers_failed;
      ASSERT_EQ(kind, "dpm") << key;
      df::DpmSolverMultistep dpm(schedule, {.prediction_type = prediction,
                                            .use_karras_sigmas = p[6] == "True",
                                            .solver_order = std::stoll(p[7]),
                                            .timestep_spacing = spacing});
      at::Tensor x = initial_sample();
      dpm.set_timesteps(steps);
      for (std::size_t i = 0; i < dpm.timesteps().size(); ++i)
        x = dpm.step_at(i, fake_model(x, static_cast<double>(dpm.timesteps()[i])), x, seeded(5));
      if (prediction != df::Prediction::epsilon || p[2] != "True") {
        EXPECT_TRUE(at::isfinite(x).all().item<bool>()) << key;
      }
      continue;
    }
    SCOPED_TRACE(key);
    if (kind == "ddpm") {
      df::Ddpm s(schedule, {.prediction_type = prediction,
                            .clipping = {.clip_sample = false},
                            .timestep_spacing = spacing});
      auto gen = seeded(1);
      check_run(
          s, ref, steps, 1.0,
          [&](df::Ddpm& d, std::size_t i, const at::Tensor& x) {
            const auto t = d.timesteps()[i];
            return d.step(fake_model(x, static_cast<double>(t)), t, x, gen);
          },
          key);
    } else if (kind == "ddim") {
      df::Ddim s(schedule, {.prediction_type = prediction,
                            .clipping = {.clip_sample = false},
                            .timestep_spacing = spacing,
                            .eta = 0.3});
      auto gen = seeded(2);
      check_run(
          s, ref, steps, 1.0,
          [&](df::Ddim& d, std::size_t i, const at::Tensor& x) {
            const auto t = d.timesteps()[i];
            return d.step(fake_model(x, static_cast<double>(t)), t, x, gen);
          },
          key);
    } else if (kind == "euler") {
      df::Euler s(schedule, {.prediction_type = prediction,
                             .timestep_spacing = spacing,
                             .use_karras_sigmas = p[6] == "True"});
      s.set_timesteps(steps);
      auto gen = seeded(3);
      check_run(
          s, ref, steps, s.init_noise_sigma(),
          [&](df::Euler& e, std::size_t i, const at::Tensor& x) {
            return e.step_at(i, fake_model(e.model_input(x), e.timesteps()[i]), x, gen);
          },
          key, p[6] == "True" ? 1e-3 : 0.0, s.sigmas().front());
    } else if (kind == "heun") {
      df::Heun s(schedule, {.prediction_type = prediction,
                            .timestep_spacing = spacing,
                            .use_karras_sigmas = p[6] == "True"});
      s.set_timesteps(steps);
      check_run(
          s, ref, steps, s.init_noise_sigma(),
          [&](df::Heun& h, std::size_t i, const at::Tensor& x) {
            return h.step_at(i, fake_model(h.model_input(x), h.timesteps()[i]), x, std::nullopt);
          },
          key, p[6] == "True" ? 1e-3 : 0.0, s.sigmas().front());
    } else if (kind == "euler_ancestral") {
      df::EulerAncestral s(schedule, {.prediction_type = prediction, .timestep_spacing = spacing});
      s.set_timesteps(steps);
      auto gen = seeded(4);
      check_run(
          s, ref, steps, s.init_noise_sigma(),
          [&](df::EulerAncestral& e, std::size_t i, const at::Tensor& x) {
            return e.step_at(i, fake_model(e.model_input(x), e.timesteps()[i]), x, gen);
          },
          key, 0.0, s.sigmas().front());
    } else if (kind == "dpm") {
      df::DpmSolverMultistep s(
          schedule, {.prediction_type = prediction,
                     .use_karras_sigmas = p[6] == "True",
                     .solver_order = std::stoll(p[7]),
                     .algorithm_type = p[8] == "sde-dpmsolver++"
                                           ? df::DpmSolverMultistep::Algorithm::sde_dpmsolver_pp
                                           : df::DpmSolverMultistep::Algorithm::dpmsolver_pp,
                     .timestep_spacing = spacing});
      auto gen = seeded(5);
      check_run(
          s, ref, steps, 1.0,
          [&](df::DpmSolverMultistep& d, std::size_t i, const at::Tensor& x) {
            return d.step_at(i, fake_model(x, static_cast<double>(d.timesteps()[i])), x, gen);
          },
          key);
    } else {
      FAIL() << "unknown sweep entry " << key;
    }
    ++checked[kind];
  }
  // 3 beta schedules x 2 SNR x 3 predictions x 3 spacings x 2 step counts = 108 per sampler
  // (DDPM also has diffusers' sigmoid betas: 144).
  EXPECT_EQ(checked["ddpm"], 144);
  EXPECT_EQ(checked["ddim"], 108);
  EXPECT_EQ(checked["euler"], 216);
  EXPECT_EQ(checked["euler_ancestral"], 72);
  EXPECT_EQ(checked["heun"], 108);
  EXPECT_EQ(checked["dpm"] + diffusers_failed, 108 * 8);
}

TEST(SamplerSweeps, DpmSolverOptionsMatchDiffusers) {
  int checked = 0;
  for (const auto& [key, ref] : g()["samplers"].items()) {
    const auto p = split(key);
    if (p[0] != "dpm_option") continue;
    SCOPED_TRACE(key);
    const std::string& name = p[1];
    const std::int64_t steps = std::stoll(p[2]);
    df::DpmSolverMultistep::Options o;
    std::string beta = "linear";
    if (name == "sigma_min") o.final_sigmas_type = df::FinalSigmas::sigma_min;
    if (name == "euler_at_final") o.euler_at_final = true;
    if (name == "euler_at_final" || name == "no_lower_order_final") o.solver_order = 3;
    if (name == "no_lower_order_final") o.lower_order_final = false;
    if (name.starts_with("heun")) o.solver_type = df::DpmSolverMultistep::SolverType::heun;
    if (name.starts_with("heun_sde"))
      o.algorithm_type = df::DpmSolverMultistep::Algorithm::sde_dpmsolver_pp;
    if (name == "heun_sde3") o.solver_order = 3;
    if (name.starts_with("lambda_clip")) {
      beta = "squaredcos_cap_v2";
      o.lambda_min_clipped = -5.1;
    }
    if (name == "lambda_clip_trailing") o.timestep_spacing = df::TimestepSpacing::trailing;
    if (name == "leading_offset") {
      o.timestep_spacing = df::TimestepSpacing::leading;
      o.steps_offset = 1;
    }
    if (name == "thresholding") {
      o.prediction_type = df::Prediction::sample;
      o.clipping = {.clip_sample = false, .thresholding = true, .sample_max_value = 1.1};
    }
    const auto schedule = schedule_of(beta, false);
    df::DpmSolverMultistep s(schedule, o);
    auto gen = seeded(6);
    check_run(
        s, ref, steps, 1.0,
        [&](df::DpmSolverMultistep& d, std::size_t i, const at::Tensor& x) {
          return d.step_at(i, fake_model(x, static_cast<double>(d.timesteps()[i])), x, gen);
        },
        key);
    ++checked;
  }
  EXPECT_EQ(checked, 20);
}

TEST(SamplerSweeps, EulerChurnAndFinalSigmaMatchDiffusers) {
  int checked = 0;
  const auto schedule = schedule_of("linear", false);
  for (const auto& [key, ref] : g()["samplers"].items()) {
    const auto p = split(key);
    if (p[0] != "euler_churn" && p[0] != "euler_option") continue;
    SCOPED_TRACE(key);
    df::Euler::Options o;
    std::uint64_t seed = 7;
    if (p[1] == "churn") {
      o.s_churn = 1.5;
      o.s_tmin = 0.2;
      o.s_tmax = 8.0;
    } else if (p[1] == "churn_noise") {
      o.s_churn = 40.0;
      o.s_noise = 1.003;
    } else {
      o.final_sigmas_type = df::FinalSigmas::sigma_min;
      seed = 8;
    }
    df::Euler s(schedule, o);
    const std::int64_t steps = std::stoll(p[2]);
    s.set_timesteps(steps);
    auto gen = seeded(seed);
    check_run(
        s, ref, steps, s.init_noise_sigma(),
        [&](df::Euler& e, std::size_t i, const at::Tensor& x) {
          return e.step_at(i, fake_model(e.model_input(x), e.timesteps()[i]), x, gen);
        },
        key);
    ++checked;
  }
  EXPECT_EQ(checked, 5);
}

TEST(SamplerSweeps, DdpmLearnedVarianceMatchesDiffusers) {
  const auto schedule = schedule_of("linear", false);
  for (const auto* variance : {"learned", "learned_range"}) {
    SCOPED_TRACE(variance);
    const auto& ref = g()["ddpm_learned"][variance];
    const bool range = std::string(variance) == "learned_range";
    df::Ddpm s(schedule, {.variance_type = range ? df::Ddpm::Variance::learned_range
                                                 : df::Ddpm::Variance::learned,
                          .clipping = {.clip_sample = false}});
    s.set_timesteps(12);
    ASSERT_EQ(s.timesteps().size(), ref["timesteps"].size());
    auto gen = seeded(9);
    at::Tensor x = initial_sample();
    for (std::size_t i = 0; i < s.timesteps().size(); ++i) {
      const auto t = s.timesteps()[i];
      const at::Tensor eps = fake_model(x, static_cast<double>(t));
      const at::Tensor var = range ? at::cos(x * 3.0) * 0.9 : 0.01 + 0.02 * at::sigmoid(x);
      x = s.step(at::cat({eps, var}, 1), t, x, gen);
      expect_close(x, ref["trace"][i], std::string(variance) + " step " + std::to_string(i));
    }
    // The model must give the variance channels.
    EXPECT_THROW((void)s.step(x, s.timesteps().front(), x), dt::ShapeError);
  }
}

TEST(SamplerSweeps, RegressionsFromTheParityIssue) {
  // Trailing spacing used to accumulate rounding and throw for about half of all step counts.
  for (std::int64_t n : {3, 6, 9, 15, 24, 28, 975})
    EXPECT_EQ(df::spaced_timesteps(1000, n, df::TimestepSpacing::trailing).size(),
              static_cast<std::size_t>(n));
  // numpy's linspace value for DDIM at 27 steps is 499.49999999999994, which rounds to 499.
  const auto t27 = df::spaced_timesteps(1000, 27, df::TimestepSpacing::linspace);
  EXPECT_EQ(t27[13], 499);
  // Zero terminal SNR: the first σ is 4096 (ᾱ = 2⁻²⁴), not infinite.
  const auto zero = schedule_of("linear", true);
  df::Euler euler(zero, {.timestep_spacing = df::TimestepSpacing::trailing});
  euler.set_timesteps(10);
  EXPECT_NEAR(euler.sigmas().front(), 4096.0, 1e-3);
  df::DpmSolverMultistep dpm(zero, {.prediction_type = df::Prediction::v_prediction,
                                    .timestep_spacing = df::TimestepSpacing::trailing});
  dpm.set_timesteps(10);
  at::Tensor x = initial_sample();
  for (std::size_t i = 0; i < dpm.timesteps().size(); ++i)
    x = dpm.step_at(i, fake_model(x, static_cast<double>(dpm.timesteps()[i])), x, std::nullopt);
  EXPECT_TRUE(at::isfinite(x).all().item<bool>());
  // Bad options are typed.
  const auto lin = schedule_of("linear", false);
  EXPECT_THROW(df::DpmSolverMultistep(lin, {.solver_order = 4}), dt::ConfigError);
  EXPECT_THROW(df::Euler(lin, {.s_churn = -1}), dt::ConfigError);
  EXPECT_THROW(df::EulerAncestral(lin, {.prediction_type = df::Prediction::sample}),
               dt::ConfigError);
  df::DpmSolverMultistep clipped(lin, {.lambda_min_clipped = 1e9});
  EXPECT_THROW(clipped.set_timesteps(10), dt::ConfigError);
}

TEST(SamplerSweeps, FlowMatchingShiftsMatchDiffusers) {
  int checked = 0;
  for (const auto& [key, ref] : g()["flow"].items()) {
    SCOPED_TRACE(key);
    const auto p = split(key);  // name/steps
    const std::string& name = p[0];
    df::FlowMatchEuler::Options o;
    if (name == "shift3" || name == "terminal") o.shift = 3.0;
    if (name == "shift0.7") o.shift = 0.7;
    if (name == "terminal") o.shift_terminal = 0.1;
    if (name.starts_with("dynamic") || name == "given_flux") o.use_dynamic_shifting = true;
    if (name == "given_shift3") o.shift = 3.0;
    if (name == "dynamic_linear") o.time_shift_type = df::FlowMatchEuler::TimeShift::linear;
    if (name == "dynamic_terminal") o.shift_terminal = 0.02;
    if (name == "n999") {
      o.num_train_timesteps = 999;
      o.shift = 2.0;
    }
    df::FlowMatchEuler s(o);
    const std::int64_t steps = std::stoll(p[1]);
    if (name.starts_with("given")) {  // FluxPipeline's linspace(1, 1/n, n)
      std::vector<double> given;
      for (std::int64_t i = 0; i < steps; ++i)
        given.push_back(df::numpy::linspace(1.0, 1.0 / static_cast<double>(steps), steps, i));
      s.set_sigmas(given, ref["mu"].is_null() ? std::nullopt
                                              : std::optional<double>(ref["mu"].get<double>()));
    } else if (ref["mu"].is_null()) {
      s.set_timesteps(steps);
    } else {
      EXPECT_THROW(s.set_timesteps(steps), dt::ConfigError);  // μ is required
      s.set_timesteps(steps, ref["mu"].get<double>());
    }
    ASSERT_EQ(s.timesteps().size(), ref["timesteps"].size());
    ASSERT_EQ(s.sigmas().size(), ref["sigmas"].size());
    for (std::size_t i = 0; i < s.sigmas().size(); ++i)
      ASSERT_EQ(static_cast<double>(s.sigmas()[i]), ref["sigmas"][i].get<double>()) << "σ " << i;
    for (std::size_t i = 0; i < s.timesteps().size(); ++i)
      ASSERT_EQ(static_cast<double>(s.timesteps()[i]), ref["timesteps"][i].get<double>()) << i;
    at::Tensor x = initial_sample();
    for (std::size_t i = 0; i < s.timesteps().size(); ++i) {
      x = s.step_at(i, fake_model(x, s.timesteps()[i]), x, std::nullopt);
      if (i == 0) expect_close(x, ref["first"], key + " after the first step");
    }
    expect_close(x, ref["last"], key + " after the last step");
    ++checked;
  }
  EXPECT_EQ(checked, 11 * 4 - 2);
  EXPECT_THROW(df::FlowMatchEuler({.shift_terminal = 1.0}), dt::ConfigError);
  df::FlowMatchEuler one_step({.shift = 3.0, .shift_terminal = 0.1});
  EXPECT_THROW(one_step.set_timesteps(1), dt::ConfigError);  // diffusers: NaN
  EXPECT_NEAR(df::FlowMatchEuler::calculate_shift(256), 0.5, 1e-15);
  EXPECT_NEAR(df::FlowMatchEuler::calculate_shift(4096), 1.15, 1e-15);
}

namespace {
/// The sum, the absolute sum and three values of a sample: the script's per-step digest.
std::vector<double> step_digest(const at::Tensor& x) {
  const at::Tensor v = x.to(at::kDouble).flatten();
  return {v.sum().item<double>(), v.abs().sum().item<double>(), v[0].item<double>(),
          v[37].item<double>(), v[-1].item<double>()};
}

df::NoiseSchedule cogvideox_schedule(const std::string& beta, bool zero_snr, double shift) {
  df::NoiseSchedule::Options o{.precision = df::Precision::float32};
  o.rescale_betas_zero_snr = zero_snr;
  o.snr_shift_scale = shift;
  o.beta_schedule = df::beta_schedule_from(beta, "golden");
  if (o.beta_schedule == df::BetaSchedule::scaled_linear) {
    o.beta_start = 0.00085;
    o.beta_end = 0.012;
  } else if (o.beta_schedule == df::BetaSchedule::linear) {
    o.beta_start = 0.0001;
    o.beta_end = 0.02;
  }
  return df::NoiseSchedule(o);
}

/// Runs CogVideoX's pipeline loop with `s` and compares every step's digest, the first and the
/// last sample.
template <class S>
void check_cogvideox_run(S& s, const nlohmann::json& ref, std::int64_t steps, std::uint64_t seed,
                         const std::string& what) {
  s.set_timesteps(steps);
  ASSERT_EQ(s.timesteps().size(), ref["timesteps"].size()) << what;
  for (std::size_t i = 0; i < s.timesteps().size(); ++i)
    ASSERT_EQ(s.timesteps()[i], ref["timesteps"][i].get<std::int64_t>()) << what << " step " << i;
  auto gen = seeded(seed);
  at::Tensor x = initial_sample();
  for (std::size_t i = 0; i < s.timesteps().size(); ++i) {
    x = s.step_at(i, fake_model(x, static_cast<double>(s.timesteps()[i])), x, gen);
    if (i == 0) expect_close(x, ref["first"], what + " first step");
    expect_close(at::tensor(step_digest(x), at::kDouble), ref["trace"][i],
                 what + " step " + std::to_string(i));
    if (::testing::Test::HasFailure()) return;
  }
  expect_close(x, ref["last"], what + " last step");
}
}  // namespace

TEST(SamplerSweeps, CogVideoXSchedulesAndSamplersMatchDiffusers) {
  const auto& ref = g()["cogvideox"];
  // The shifted (and rescaled) ᾱ tables.
  for (const auto& [key, table] : ref["tables"].items()) {
    const auto p = split(key);  // beta/snr/shift
    const auto schedule = cogvideox_schedule(p[0], p[1] == "True", std::stod(p[2]));
    ASSERT_EQ(schedule.alphas_cumprod().size(), table.size()) << key;
    double err = 0;
    for (std::size_t i = 0; i < table.size(); ++i)
      err = std::max(err, std::abs(schedule.alphas_cumprod()(i) - table[i].get<double>()));
    EXPECT_LE(err, 1e-7) << key;  // float32 tables (linear, cosine) to their precision
  }
  std::map<std::string, int> checked;
  for (const auto& [key, run] : ref["runs"].items()) {
    SCOPED_TRACE(key);
    const auto p = split(key);
    if (p[0] == "ddim_option" || p[0] == "dpm_option") {
      const bool two_b = p[1] == "cogvideox_2b";
      df::NoiseSchedule::Options o{.beta_start = 0.00085,
                                   .beta_end = 0.012,
                                   .beta_schedule = df::BetaSchedule::scaled_linear,
                                   .rescale_betas_zero_snr = two_b,
                                   .snr_shift_scale = 3.0,
                                   .precision = df::Precision::float32};
      const df::NoiseSchedule schedule(o);
      const auto spacing = two_b ? df::TimestepSpacing::trailing : df::TimestepSpacing::leading;
      if (p[0] == "ddim_option") {
        df::CogVideoXDdim s(schedule, {.prediction_type = df::Prediction::v_prediction,
                                       .set_alpha_to_one = two_b,
                                       .steps_offset = two_b ? 0 : 1,
                                       .timestep_spacing = spacing});
        check_cogvideox_run(s, run, 50, 0, key);
      } else {
        df::CogVideoXDpm s(schedule, {.prediction_type = df::Prediction::v_prediction,
                                      .set_alpha_to_one = two_b,
                                      .steps_offset = two_b ? 0 : 1,
                                      .timestep_spacing = spacing});
        check_cogvideox_run(s, run, 50, 12, key);
      }
      ++checked[p[0]];
      continue;
    }
    // kind/beta/snr/shift/prediction/spacing/steps
    const auto schedule = cogvideox_schedule(p[1], p[2] == "True", std::stod(p[3]));
    const auto prediction = prediction_of(p[4]);
    const auto spacing = spacing_of(p[5]);
    const std::int64_t steps = std::stoll(p[6]);
    if (p[0] == "ddim") {
      df::CogVideoXDdim s(schedule, {.prediction_type = prediction, .timestep_spacing = spacing});
      check_cogvideox_run(s, run, steps, 0, key);
    } else {
      df::CogVideoXDpm s(schedule, {.prediction_type = prediction, .timestep_spacing = spacing});
      check_cogvideox_run(s, run, steps, 11, key);
    }
    ++checked[p[0]];
  }
  // 3 beta schedules x 2 SNR x 3 shifts x 3 predictions x 3 spacings x 2 step counts.
  EXPECT_EQ(checked["ddim"], 324);
  EXPECT_EQ(checked["dpm"], 324);
  EXPECT_EQ(checked["ddim_option"] + checked["dpm_option"], 4);
}

TEST(SamplerSweeps, CogVideoXLossEqualsDiffusersTrainingScript) {
  // train_cogvideox_lora.py's loss on four schedules (SNR shift 1 and 3, zero terminal SNR or not)
  // at timesteps 0, 531 and 999: x_t from add_noise, x̂₀ from get_velocity(output, x_t, t),
  // 1/(1 − ᾱ) weights.
  const auto& cases = g()["cogvideox_loss"];
  ASSERT_EQ(cases.size(), 4U);
  const std::vector<std::int64_t> shape{3, 3, 4, 2, 2};
  auto tensor = [&](const nlohmann::json& v) {
    return at::tensor(v.get<std::vector<double>>(), at::kDouble).to(at::kFloat).view(shape);
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c["snr_shift_scale"].dump() + (c["zero_snr"].get<bool>() ? " zero SNR" : ""));
    const auto schedule = cogvideox_schedule("scaled_linear", c["zero_snr"].get<bool>(),
                                             c["snr_shift_scale"].get<double>());
    const at::Tensor x0 = tensor(c["latents"]), noise = tensor(c["noise"]);
    const at::Tensor t = at::tensor(c["timesteps"].get<std::vector<std::int64_t>>(), at::kLong);
    const at::Tensor noisy = schedule.add_noise(x0, noise, t);
    EXPECT_LE((noisy - tensor(c["noisy"])).abs().max().item<double>(), 1e-6);
    const double loss = df::cogvideox_loss(schedule, df::Prediction::v_prediction,
                                           tensor(c["output"]), noisy, x0, t)
                            .item<double>();
    EXPECT_NEAR(loss, c["loss"].get<double>(), 1e-5 * c["loss"].get<double>());
    // bf16 outputs are taken in float32; mismatched shapes are named.
    EXPECT_NEAR(df::cogvideox_loss(schedule, df::Prediction::v_prediction,
                                   tensor(c["output"]).to(at::kBFloat16), noisy, x0, t)
                    .item<double>(),
                loss, 2e-2 * loss);
    EXPECT_THROW((void)df::cogvideox_loss(schedule, df::Prediction::v_prediction,
                                          tensor(c["output"]).narrow(0, 0, 2), noisy, x0, t),
                 dt::ShapeError);
  }
}

TEST(SamplerSweeps, CogVideoXTrainingTargetsUseTheShiftedSchedule) {
  // add_noise and get_velocity read the shifted ᾱ, as diffusers' CogVideoX training does; the
  // shift lowers the SNR by exactly its factor.
  const auto plain = cogvideox_schedule("scaled_linear", false, 1.0);
  const auto shifted = cogvideox_schedule("scaled_linear", false, 3.0);
  const at::Tensor t = at::tensor({0, 250, 999}, at::kLong);
  const at::Tensor ratio = plain.snr(t) / shifted.snr(t);
  EXPECT_LE((ratio - 3.0).abs().max().item<double>(), 1e-4);
  const at::Tensor x0 = at::randn({3, 2}), noise = at::randn({3, 2});
  const at::Tensor a = shifted.alphas_cumprod_at(t, 2, x0.options());
  EXPECT_TRUE(at::allclose(shifted.add_noise(x0, noise, t), a.sqrt() * x0 + (1 - a).sqrt() * noise,
                           1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(shifted.get_velocity(x0, noise, t),
                           a.sqrt() * noise - (1 - a).sqrt() * x0, 1e-6, 1e-6));
  // Bad shifts and schedules are named.
  df::NoiseSchedule::Options bad{.snr_shift_scale = 0.0};
  EXPECT_THROW(df::NoiseSchedule{bad}, dt::ConfigError);
  bad.snr_shift_scale = 2.0;
  bad.beta_schedule = df::BetaSchedule::sigmoid;
  EXPECT_THROW(df::NoiseSchedule{bad}, dt::ConfigError);
  // A second-order DPM step needs the previous timestep.
  df::CogVideoXDpm dpm(shifted, {});
  dpm.set_timesteps(10);
  EXPECT_THROW((void)dpm.step(at::zeros({2}), at::zeros({2}), 801, std::nullopt, at::zeros({2})),
               dt::ConfigError);
}
