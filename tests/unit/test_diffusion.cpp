#include <difftrain/diffusion/diffusion.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <difftrain/data/caption_options.hpp>
#include <difftrain/diffusion/loss_options.hpp>
#include <difftrain/diffusion/noise_options.hpp>
#include <difftrain/diffusion/noise_schedule.hpp>
#include <difftrain/io/safetensors.hpp>
#include <map>
#include <string>
#include "golden.hpp"

namespace dt = difftrain;
namespace df = difftrain::diffusion;
namespace tst = difftrain::test;

namespace {

const nlohmann::json& g() { return tst::golden("diffusion.json"); }

at::Tensor initial_sample() {
  return at::sin(at::linspace(-1.5, 1.5, 2 * 3 * 4 * 4, at::kFloat).reshape({2, 3, 4, 4})) * 1.3;
}

at::Tensor fake_model(const at::Tensor& x, double t) { return 0.5 * at::tanh(x) + t * 1e-4; }

df::NoiseSchedule sd_schedule(df::Precision p = df::Precision::float32) {
  return df::NoiseSchedule({.beta_start = 0.00085,
                            .beta_end = 0.012,
                            .beta_schedule = df::BetaSchedule::scaled_linear,
                            .precision = p});
}

void expect_close(const at::Tensor& got, const nlohmann::json& want, double rtol, double atol) {
  const at::Tensor ref = tst::tensor_from(want);
  ASSERT_EQ(got.numel(), ref.numel());
  const at::Tensor d = got.to(at::kDouble).flatten();
  EXPECT_TRUE(at::allclose(d, ref, rtol, atol))
      << "max |diff| " << (d - ref).abs().max().item<double>();
}

at::Generator seeded(std::uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// Runs a DDPM-family sampler over the golden trace: every step within 1e-5.
template <class Sampler>
void check_trace(Sampler& s, std::int64_t steps, const nlohmann::json& ref,
                 std::optional<std::uint64_t> seed) {
  s.set_timesteps(steps);
  ASSERT_EQ(s.timesteps().size(), ref["timesteps"].size());
  for (std::size_t i = 0; i < s.timesteps().size(); ++i)
    ASSERT_EQ(static_cast<double>(s.timesteps()[i]), ref["timesteps"][i].get<double>()) << i;
  at::Tensor x = initial_sample();
  std::optional<at::Generator> gen;
  if (seed) gen = seeded(*seed);
  for (std::size_t i = 0; i < s.timesteps().size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i));
    const auto t = s.timesteps()[i];
    x = s.step(fake_model(x, static_cast<double>(t)), t, x, gen);
    expect_close(x, ref["trace"][i], 1e-5, 1e-5);
  }
}

}  // namespace

TEST(NoiseSchedule, TablesMatchDiffusersInFloat32Mode) {
  for (const auto& [key, ref] : g()["tables"].items()) {
    SCOPED_TRACE(key);
    const auto slash = key.find('/');
    const df::NoiseSchedule s({.beta_start = 0.00085,
                               .beta_end = 0.012,
                               .beta_schedule = df::beta_schedule_from(key.substr(0, slash), key),
                               .rescale_betas_zero_snr = key.substr(slash + 1) == "True",
                               .precision = df::Precision::float32});
    const at::Tensor betas =
        at::tensor(std::vector<double>(s.betas().begin(), s.betas().end()), at::kDouble);
    const at::Tensor cum = at::tensor(
        std::vector<double>(s.alphas_cumprod().begin(), s.alphas_cumprod().end()), at::kDouble);
    // Float32 mode makes diffusers' own torch calls, the zero-SNR rescale included (torch's
    // vectorised float32 sqrt is not always correctly rounded): the tables are equal.
    EXPECT_TRUE(at::equal(betas, tst::tensor_from(ref["betas"])))
        << (betas - tst::tensor_from(ref["betas"])).abs().max().item<double>();
    EXPECT_TRUE(at::equal(cum, tst::tensor_from(ref["alphas_cumprod"])))
        << (cum - tst::tensor_from(ref["alphas_cumprod"])).abs().max().item<double>();
  }
}

TEST(NoiseSchedule, Float64TablesAreTheExactFormulas) {
  const df::NoiseSchedule s({.beta_schedule = df::BetaSchedule::linear});
  EXPECT_DOUBLE_EQ(s.betas()(0), 0.0001);
  EXPECT_DOUBLE_EQ(s.betas()(999), 0.02);
  double prod = 1.0;
  for (std::size_t i = 0; i < 1000; ++i) prod *= 1.0 - s.betas()(i);
  EXPECT_DOUBLE_EQ(s.alphas_cumprod()(999), prod);
  const df::NoiseSchedule z({.rescale_betas_zero_snr = true});
  EXPECT_NEAR(z.alphas_cumprod()(999), 0.0, 1e-15);  // zero terminal SNR
}

TEST(NoiseSchedule, AddNoiseVelocityAndSnrMatchDiffusers) {
  const auto s = sd_schedule();
  const at::Tensor x0 = tst::tensor_from(g()["x0"]).to(at::kFloat).reshape({2, 3, 4, 4});
  const at::Tensor noise = tst::tensor_from(g()["noise"]).to(at::kFloat).reshape({2, 3, 4, 4});
  const at::Tensor t = at::tensor(g()["timesteps"].get<std::vector<std::int64_t>>(), at::kLong);
  expect_close(s.add_noise(x0, noise, t), g()["add_noise"], 1e-6, 1e-6);
  expect_close(s.get_velocity(x0, noise, t), g()["velocity"], 1e-6, 1e-6);
  expect_close(s.target(df::Prediction::v_prediction, x0, noise, t), g()["velocity"], 1e-6, 1e-6);
  expect_close(s.snr(at::tensor({0, 1, 10, 250, 500, 999}, at::kLong)), g()["snr"], 1e-6, 1e-9);
}

TEST(NoiseSchedule, BadInputIsTyped) {
  const auto s = sd_schedule();
  const at::Tensor x = at::zeros({2, 3});
  EXPECT_THROW((void)s.add_noise(x, x, at::tensor({0, 1000}, at::kLong)), dt::ConfigError);
  EXPECT_THROW((void)s.add_noise(x, x, at::tensor({-1, 3}, at::kLong)), dt::ConfigError);
  EXPECT_THROW((void)s.add_noise(x, at::zeros({2, 4}), at::tensor({0, 1}, at::kLong)),
               dt::ShapeError);
  EXPECT_THROW((void)s.add_noise(x, x, at::tensor({0.5, 1.0})), dt::ConfigError);
  EXPECT_THROW(df::NoiseSchedule({.num_train_timesteps = 0}), dt::ConfigError);
  EXPECT_THROW(df::NoiseSchedule({.beta_start = 0.1, .beta_end = 0.01}), dt::ConfigError);
}

// Timesteps the schedule drew itself are in range and skip the range read-back; written in place
// afterwards (or a different tensor with the same values), they are checked again.
TEST(NoiseSchedule, DrawnTimestepsAreTrustedUntilWritten) {
  const auto s = sd_schedule();
  const at::Tensor x = at::zeros({4096, 2});
  // Seeded: unseeded, 4096 draws from 1000 values miss an end in about 3 % of runs; torch's
  // draws with seed 1 reach both (checked in Python).
  at::Generator seeded = at::detail::createCPUGenerator(1);
  at::Tensor t = s.sample_timesteps(4096, at::TensorOptions(), seeded);
  EXPECT_EQ(t.scalar_type(), at::kLong);
  EXPECT_EQ(t.min().item<std::int64_t>(), 0);
  EXPECT_EQ(t.max().item<std::int64_t>(), 999);
  EXPECT_NO_THROW((void)s.add_noise(x, x, t));
  t.add_(1);  // now 1000 is among them
  EXPECT_THROW((void)s.add_noise(x, x, t), dt::ConfigError);
  at::Generator seeded2 = at::detail::createCPUGenerator(2);  // its draws hold a 0 as well
  at::Tensor u = s.sample_timesteps(4096, at::TensorOptions(), seeded2);
  const at::Tensor view = u.view({64, 64}).view({4096});
  view.sub_(1);  // the view shares the version counter: -1 is caught through either tensor
  EXPECT_THROW((void)s.add_noise(x, x, u), dt::ConfigError);
  EXPECT_THROW((void)s.add_noise(x, x, view), dt::ConfigError);
  // The same draws from a seeded generator as torch.randint with it.
  at::Generator g1 = at::detail::createCPUGenerator(7), g2 = at::detail::createCPUGenerator(7);
  EXPECT_TRUE(at::equal(s.sample_timesteps(16, at::TensorOptions(), g1),
                        at::randint(0, 1000, {16}, g2, at::kLong)));
  // A copied schedule works on its own.
  const auto copy = s;
  EXPECT_NO_THROW((void)copy.add_noise(x, x, copy.sample_timesteps(4096, at::TensorOptions())));
}
TEST(Weighting, MinSnrSd3AndDensityMatchDiffusers) {
  const auto s = sd_schedule();
  const at::Tensor snr = s.snr(at::tensor({0, 10, 500, 999}, at::kLong));
  for (double gamma : {1.0, 5.0}) {
    const std::string k = gamma == 1.0 ? "1.0" : "5.0";
    expect_close(df::min_snr_weights(snr, gamma, df::Prediction::epsilon),
                 g()["min_snr"]["epsilon/" + k], 1e-6, 1e-9);
    expect_close(df::min_snr_weights(snr, gamma, df::Prediction::v_prediction),
                 g()["min_snr"]["v_prediction/" + k], 1e-6, 1e-9);
  }
  const at::Tensor sigmas = at::tensor({0.05F, 0.3F, 0.7F, 0.99F});
  expect_close(df::sd3_loss_weighting(df::Sd3Weighting::sigma_sqrt, sigmas),
               g()["sd3"]["sigma_sqrt"], 1e-6, 1e-9);
  expect_close(df::sd3_loss_weighting(df::Sd3Weighting::cosmap, sigmas), g()["sd3"]["cosmap"], 1e-6,
               1e-9);
  expect_close(df::density_for_timestep_sampling(df::TimestepDensity::uniform, 6, {}, seeded(3)),
               g()["density"]["uniform"], 1e-6, 1e-7);
  expect_close(df::density_for_timestep_sampling(df::TimestepDensity::logit_normal, 6,
                                                 {.logit_mean = 0.2, .logit_std = 1.1}, seeded(4)),
               g()["density"]["logit_normal"], 1e-6, 1e-7);
  expect_close(df::density_for_timestep_sampling(df::TimestepDensity::mode, 6, {.mode_scale = 1.29},
                                                 seeded(5)),
               g()["density"]["mode"], 1e-6, 1e-7);
  EXPECT_THROW((void)df::min_snr_weights(snr, 0.0, df::Prediction::epsilon), dt::ConfigError);
}

TEST(Weighting, DreamMatchesDiffusers) {
  const auto s = sd_schedule();
  const at::Tensor x0 = tst::tensor_from(g()["x0"]).to(at::kFloat).reshape({2, 3, 4, 4});
  const at::Tensor noise = tst::tensor_from(g()["noise"]).to(at::kFloat).reshape({2, 3, 4, 4});
  const at::Tensor t = at::tensor(g()["timesteps"].get<std::vector<std::int64_t>>(), at::kLong);
  const at::Tensor noisy = s.add_noise(x0, noise, t);
  auto model = [](const at::Tensor& x, const at::Tensor& ts) {
    return 0.3 * x + ts.to(at::kFloat).reshape({-1, 1, 1, 1}) * 1e-4;
  };
  const auto [n2, t2] =
      df::dream_update(model, s, t, noise, noisy, noise.clone(), df::Prediction::epsilon, 0.8);
  expect_close(n2, g()["dream"]["noisy"], 1e-5, 1e-6);
  expect_close(t2, g()["dream"]["target"], 1e-5, 1e-6);
  EXPECT_THROW(
      (void)df::dream_update(model, s, t, noise, noisy, noise, df::Prediction::v_prediction),
      dt::ConfigError);
}

TEST(Guidance, CfgAndRescaleMatchDiffusers) {
  const at::Tensor cond = tst::tensor_from(g()["cfg"]["cond"]).to(at::kFloat).reshape({2, 3, 4, 4});
  const at::Tensor uncond =
      tst::tensor_from(g()["cfg"]["uncond"]).to(at::kFloat).reshape({2, 3, 4, 4});
  expect_close(df::classifier_free_guidance(cond, uncond, 7.5), g()["cfg"]["plain"], 1e-6, 1e-6);
  expect_close(df::classifier_free_guidance(cond, uncond, 7.5, 0.7), g()["cfg"]["rescaled"], 1e-5,
               1e-6);
  EXPECT_THROW((void)df::classifier_free_guidance(cond, uncond.narrow(0, 0, 1), 7.5),
               dt::ShapeError);
  const at::Tensor chunks =
      df::in_chunks(10, 3, [](std::int64_t b, std::int64_t e) { return at::arange(b, e); });
  EXPECT_TRUE(at::equal(chunks, at::arange(10)));
}

TEST(Samplers, DdpmMatchesDiffusersStepByStep) {
  const auto s = sd_schedule();
  df::Ddpm ddpm(s, {});
  check_trace(ddpm, 25, g()["samplers"]["ddpm_eps_leading"], 11);
  const df::NoiseSchedule lin({.precision = df::Precision::float32});
  df::Ddpm v(lin, {.prediction_type = df::Prediction::v_prediction,
                   .variance_type = df::Ddpm::Variance::fixed_large,
                   .clipping = {.clip_sample = false},
                   .timestep_spacing = df::TimestepSpacing::trailing});
  check_trace(v, 20, g()["samplers"]["ddpm_v_trailing_large"], 12);
}

TEST(Samplers, DdimMatchesDiffusersStepByStep) {
  const auto s = sd_schedule();
  df::Ddim ddim(s,
                {.clipping = {.clip_sample = false}, .set_alpha_to_one = false, .steps_offset = 1});
  check_trace(ddim, 50, g()["samplers"]["ddim_eps_leading"], std::nullopt);
  const df::NoiseSchedule zero(
      {.rescale_betas_zero_snr = true, .precision = df::Precision::float32});
  df::Ddim eta(zero, {.prediction_type = df::Prediction::v_prediction,
                      .timestep_spacing = df::TimestepSpacing::trailing,
                      .eta = 0.5});
  check_trace(eta, 30, g()["samplers"]["ddim_v_trailing_eta"], 13);
  const df::NoiseSchedule lin({.precision = df::Precision::float32});
  df::Ddim thr(lin, {.prediction_type = df::Prediction::sample,
                     .clipping = {.thresholding = true, .sample_max_value = 1.2},
                     .timestep_spacing = df::TimestepSpacing::linspace});
  check_trace(thr, 15, g()["samplers"]["ddim_sample_linspace_threshold"], std::nullopt);
}

TEST(Samplers, FlowMatchEulerMatchesDiffusers) {
  df::FlowMatchEuler fm({.shift = 3.0});
  const auto& ref = g()["samplers"]["flow_match_shift3"];
  fm.set_timesteps(28);
  ASSERT_EQ(fm.timesteps().size(), ref["timesteps"].size());
  at::Tensor x = initial_sample();
  for (std::size_t i = 0; i < fm.timesteps().size(); ++i) {
    EXPECT_NEAR(fm.timesteps()[i], ref["timesteps"][i].get<double>(), 1e-3) << i;
    x = fm.step(fake_model(x, fm.timesteps()[i]), x);
    expect_close(x, ref["trace"][i], 1e-5, 1e-5);
  }
  EXPECT_THROW((void)fm.step(x, x), dt::ConfigError);  // every step taken
  const at::Tensor idx = at::tensor({0, 10, 500, 999}, at::kLong);
  expect_close(fm.sigmas_for(idx), g()["flow"]["sigmas"], 1e-6, 1e-7);
  expect_close(fm.timesteps_for(idx), g()["flow"]["timesteps"], 1e-6, 1e-4);
  EXPECT_THROW((void)fm.sigmas_for(at::tensor({1000}, at::kLong)), dt::ConfigError);
  const at::Tensor x0 = at::ones({2, 3});
  const at::Tensor n = at::zeros({2, 3});
  EXPECT_TRUE(at::allclose(df::FlowMatchEuler::noisy_input(x0, n, at::tensor({0.25F, 1.0F})),
                           at::tensor({0.75F, 0.0F}).reshape({2, 1}).expand({2, 3})));
  EXPECT_TRUE(at::equal(df::FlowMatchEuler::target(x0, n), -x0));
}

TEST(Samplers, EulerMatchesDiffusers) {
  const auto check = [](df::Euler& e, std::int64_t steps, const nlohmann::json& ref) {
    e.set_timesteps(steps);
    ASSERT_EQ(e.timesteps().size(), ref["timesteps"].size());
    expect_close(at::tensor(e.sigmas()), ref["sigmas"], 1e-5, 1e-6);
    EXPECT_NEAR(e.init_noise_sigma(), ref["init_noise_sigma"].get<double>(), 1e-4);
    at::Tensor x = initial_sample();
    for (std::size_t i = 0; i < e.timesteps().size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(i));
      EXPECT_NEAR(e.timesteps()[i], ref["timesteps"][i].get<double>(), 1e-3);
      x = e.step(fake_model(e.scale_model_input(x), e.timesteps()[i]), x);
      expect_close(x, ref["trace"][i], 1e-5, 1e-5);
    }
    EXPECT_THROW((void)e.step(x, x), dt::ConfigError);
  };
  const auto s = sd_schedule();
  df::Euler eps(s, {});
  check(eps, 30, g()["samplers"]["euler_eps_linspace"]);
  const df::NoiseSchedule lin({.precision = df::Precision::float32});
  df::Euler karras(lin, {.prediction_type = df::Prediction::v_prediction,
                         .timestep_spacing = df::TimestepSpacing::leading,
                         .steps_offset = 1,
                         .use_karras_sigmas = true});
  check(karras, 25, g()["samplers"]["euler_v_karras_leading"]);
}

TEST(Samplers, DpmSolverPP2MMatchesDiffusers) {
  const auto check = [](df::DpmSolverPP2M& d, std::int64_t steps, const nlohmann::json& ref) {
    d.set_timesteps(steps);
    ASSERT_EQ(d.timesteps().size(), ref["timesteps"].size());
    at::Tensor x = initial_sample();
    for (std::size_t i = 0; i < d.timesteps().size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(i));
      ASSERT_EQ(static_cast<double>(d.timesteps()[i]), ref["timesteps"][i].get<double>());
      x = d.step(fake_model(x, static_cast<double>(d.timesteps()[i])), x);
      expect_close(x, ref["trace"][i], 1e-5, 1e-5);
    }
    EXPECT_THROW((void)d.step(x, x), dt::ConfigError);
  };
  const auto s = sd_schedule();
  df::DpmSolverPP2M eps(s, {});
  check(eps, 20, g()["samplers"]["dpm_eps_20"]);
  const df::NoiseSchedule lin({.precision = df::Precision::float32});
  df::DpmSolverPP2M karras(
      lin, {.prediction_type = df::Prediction::v_prediction, .use_karras_sigmas = true});
  check(karras, 12, g()["samplers"]["dpm_v_karras_12"]);
}

TEST(Samplers, BadInputIsTyped) {
  const auto s = sd_schedule();
  df::Ddim ddim(s, {});
  EXPECT_THROW(ddim.set_timesteps(1001), dt::ConfigError);
  EXPECT_THROW((void)ddim.step(at::zeros({1}), 999, at::zeros({1})),
               dt::ConfigError);  // no set_timesteps
  ddim.set_timesteps(10);
  EXPECT_THROW((void)ddim.step(at::zeros({1, 2}), 900, at::zeros({1, 3})), dt::ShapeError);
  df::Ddpm ddpm(s, {});
  ddpm.set_timesteps(10);
  EXPECT_THROW((void)ddpm.step(at::zeros({1}), 901, at::zeros({1})),
               dt::ConfigError);  // not a sampler timestep
  EXPECT_THROW(df::spaced_timesteps(1000, 0, df::TimestepSpacing::leading), dt::ConfigError);
}

TEST(Sample, OneLoopForEverySamplerWithGuidanceAndChunks) {
  const auto s = sd_schedule();
  const at::Tensor noise = at::randn({5, 3, 4, 4}, seeded(7));
  const at::Tensor cond = at::arange(5, at::kFloat);
  const at::Tensor uncond = at::zeros({5});
  auto model = [](const at::Tensor& x, const at::Tensor& t, const at::Tensor& c) {
    return 0.5 * at::tanh(x) + t.reshape({-1, 1, 1, 1}) * 1e-4 + c.reshape({-1, 1, 1, 1}) * 0.01;
  };
  // Unguided DDIM through sample() equals the hand-written loop.
  df::Ddim ddim(s, {.clipping = {.clip_sample = false}});
  const at::Tensor got =
      df::sample(ddim, model, noise, {.num_inference_steps = 10, .chunk_size = 2}, cond);
  df::Ddim manual(s, {.clipping = {.clip_sample = false}});
  manual.set_timesteps(10);
  at::Tensor x = noise;
  for (auto t : manual.timesteps())
    x = manual.step(model(x, at::full({5}, static_cast<double>(t)), cond), t, x);
  EXPECT_TRUE(at::allclose(got, x, 1e-6, 1e-6));
  // Guided: cond and uncond in one batched call, combined by CFG; chunking changes nothing.
  df::DpmSolverPP2M dpm(s, {});
  const df::SampleOptions guided{
      .num_inference_steps = 8, .guidance_scale = 3.0, .guidance_rescale = 0.5, .chunk_size = 5};
  const at::Tensor one = df::sample(dpm, model, noise, guided, cond, uncond);
  auto chunked_options = guided;
  chunked_options.chunk_size = 2;
  const at::Tensor chunked = df::sample(dpm, model, noise, chunked_options, cond, uncond);
  EXPECT_TRUE(at::allclose(one, chunked, 1e-6, 1e-6));
  df::DpmSolverPP2M dpm2(s, {});
  dpm2.set_timesteps(8);
  x = noise;
  for (std::size_t i = 0; i < dpm2.timesteps().size(); ++i) {
    const at::Tensor t = at::full({5}, static_cast<double>(dpm2.timesteps()[i]));
    x = dpm2.step(df::classifier_free_guidance(model(x, t, cond), model(x, t, uncond), 3.0, 0.5),
                  x);
  }
  EXPECT_TRUE(at::allclose(one, x, 1e-5, 1e-5));
  // Every sampler runs through the same loop.
  df::Euler euler(s, {});
  df::FlowMatchEuler fm({.shift = 3.0});
  df::Ddpm ddpm(s, {});
  for (const at::Tensor& r :
       {df::sample(euler, model, noise, {.num_inference_steps = 6}, cond),
        df::sample(fm, model, noise, {.num_inference_steps = 6}, cond),
        df::sample(ddpm, model, noise, {.num_inference_steps = 6}, cond, std::nullopt, seeded(1))})
    EXPECT_TRUE(at::isfinite(r).all().item<bool>());
  // Bad input.
  EXPECT_THROW((void)df::sample(ddim, model, noise, {.guidance_scale = 2.0}, cond),
               dt::ConfigError);
  EXPECT_THROW((void)df::sample(ddim, model, noise, {}, at::zeros({4})), dt::ShapeError);
  EXPECT_THROW((void)df::sample(ddim, model, noise, {.guidance_scale = 2.0}, cond, at::zeros({3})),
               dt::ShapeError);
  // An unconditional model takes no cond: the same result as a conditional one ignoring it, with
  // every sampler and chunking; guidance without a conditioning is a ConfigError.
  auto uncond_model = [](const at::Tensor& xs, const at::Tensor& ts) {
    return 0.5 * at::tanh(xs) + ts.reshape({-1, 1, 1, 1}) * 1e-4;
  };
  auto ignoring = [&](const at::Tensor& xs, const at::Tensor& ts, const at::Tensor& /*c*/) {
    return uncond_model(xs, ts);
  };
  for (std::int64_t chunk : {2, 5}) {
    df::Ddim d1(s, {}), d2(s, {});
    const df::SampleOptions so{.num_inference_steps = 7, .chunk_size = chunk};
    EXPECT_TRUE(at::equal(df::sample(d1, uncond_model, noise, so),
                          df::sample(d2, ignoring, noise, so, cond)));
    df::Ddpm p1(s, {}), p2(s, {});
    EXPECT_TRUE(at::equal(df::sample(p1, uncond_model, noise, so, seeded(3)),
                          df::sample(p2, ignoring, noise, so, cond, std::nullopt, seeded(3))));
  }
  EXPECT_THROW((void)df::sample(ddim, uncond_model, noise, {.guidance_scale = 2.0}),
               dt::ConfigError);
  EXPECT_THROW((void)df::sample(ddim, model, noise, {.guidance_scale = 2.0}, at::Tensor(), uncond),
               dt::ConfigError);
}

TEST(NoiseSchedule, DiffusersNamesParseAndUnknownOnesAreNamed) {
  for (const auto p :
       {df::Prediction::epsilon, df::Prediction::v_prediction, df::Prediction::sample})
    EXPECT_EQ(df::prediction_from(df::to_string(p), "test"), p);
  EXPECT_EQ(df::beta_schedule_from("linear", "t"), df::BetaSchedule::linear);
  EXPECT_EQ(df::beta_schedule_from("scaled_linear", "t"), df::BetaSchedule::scaled_linear);
  EXPECT_EQ(df::beta_schedule_from("squaredcos_cap_v2", "t"), df::BetaSchedule::squaredcos_cap_v2);
  EXPECT_EQ(df::beta_schedule_from("sigmoid", "t"), df::BetaSchedule::sigmoid);
  for (const char* bad : {"eps", "V_PREDICTION", "", "flow"}) {
    try {
      (void)df::prediction_from(bad, "--prediction-type");
      ADD_FAILURE() << bad;
    } catch (const dt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--prediction-type"), std::string::npos);
    }
  }
  EXPECT_THROW((void)df::beta_schedule_from("cosine", "t"), dt::ConfigError);
}

// ---- kohya's caption, noise and loss options ---------------------------------------------------
// The caption, noise and loss options of today's LoRA trainers against kohya's definitions
// (tests/reference/ref_kohya_options.py), with the reference's own draws replayed: 600 captions
// under 15 option sets (shuffling, kept tokens and separators, tag and caption dropout, every-n-
// epoch dropout, wildcards, prefixes, secondary separators, token warm-up) equal to the character;
// noise offsets (plain and adaptive) and pyramid noise over 16 shapes and settings; Huber
// thresholds of every schedule, every loss type, the SNR weights and the masked loss over 18 cases,
// to float32 rounding.

namespace data = difftrain::data;

namespace kohya_test {

const std::map<std::string, at::Tensor>& tensors() {
  static const auto t = dt::io::load_safetensors(std::string(DIFFTRAIN_GOLDEN_DIR) +
                                                 "/kohya_options/tensors.safetensors")
                            .tensors;
  return t;
}
const at::Tensor& T(const std::string& name) { return tensors().at(name); }

/// Python's draws, replayed in order (a kind or bound that differs is a test failure).
data::CaptionDraws replay(const nlohmann::json& log, std::size_t& at) {
  return {[&log, &at] {
            const auto& d = log.at(at++);
            EXPECT_EQ(d[0], "r");
            return d[1].get<double>();
          },
          [&log, &at](std::size_t n) {
            const auto& d = log.at(at++);
            EXPECT_EQ(d[0], "b");
            EXPECT_EQ(d[1].get<std::size_t>(), n);
            return d[2].get<std::size_t>();
          }};
}

data::CaptionOptions options_of(const nlohmann::json& j) {
  data::CaptionOptions o;
  o.caption_prefix = j["caption_prefix"];
  o.caption_suffix = j["caption_suffix"];
  o.caption_dropout_rate = j["caption_dropout_rate"];
  o.caption_dropout_every_n_epochs = j["caption_dropout_every_n_epochs"];
  o.caption_tag_dropout_rate = j["caption_tag_dropout_rate"];
  o.shuffle_caption = j["shuffle_caption"];
  o.keep_tokens = j["keep_tokens"];
  o.keep_tokens_separator = j["keep_tokens_separator"];
  o.caption_separator = j["caption_separator"];
  o.secondary_separator = j["secondary_separator"];
  o.enable_wildcard = j["enable_wildcard"];
  o.token_warmup_min = j["token_warmup_min"];
  o.token_warmup_step = j["token_warmup_step"].get<double>();
  return o;
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what,
                  double rtol = 1e-5, double atol = 1e-6) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::allclose(got.to(at::kFloat), want.to(at::kFloat), rtol, atol))
      << what << ": max difference "
      << (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>();
}

}  // namespace kohya_test
using namespace kohya_test;

TEST(KohyaOptions, CaptionsEqualProcessCaptionDrawForDraw) {
  const auto& g = tst::golden("kohya_options/captions.json");
  const auto captions = g["captions"].get<std::vector<std::string>>();
  const std::int64_t max_steps = g["max_train_steps"];
  ASSERT_EQ(g["cases"].size(), 15U);
  for (const auto& c : g["cases"]) {
    SCOPED_TRACE(c["options"].dump());
    const data::CaptionOptions o = options_of(c["options"]);
    o.check();
    std::size_t at = 0;
    const data::CaptionDraws draws = replay(c["draws"], at);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < captions.size(); ++i) {
      const auto epoch = static_cast<std::int64_t>(1 + i % 4);
      const auto step = static_cast<std::int64_t>((i * 7) % 100);
      const std::string got = data::process_caption(captions[i], o, epoch, step, max_steps, draws);
      const std::string want = c["results"][i].get<std::string>();
      if (got != want && ++differ <= 3)
        ADD_FAILURE() << i << ": " << nlohmann::json(captions[i]).dump() << " -> "
                      << nlohmann::json(got).dump() << ", kohya: " << nlohmann::json(want).dump();
    }
    EXPECT_EQ(differ, 0U);
    EXPECT_EQ(at, c["draws"].size()) << "draws left over";
  }
  // Out-of-range options are named.
  data::CaptionOptions bad;
  bad.caption_dropout_rate = 1.5;
  EXPECT_THROW(bad.check(), dt::ConfigError);
  bad = {};
  bad.caption_separator.clear();
  EXPECT_THROW(bad.check(), dt::ConfigError);
}

TEST(KohyaOptions, NoiseOffsetAndPyramidNoiseEqualTheReference) {
  const auto& index = tst::golden("kohya_options/index.json");
  ASSERT_EQ(index["noise"].size(), 16U);
  for (std::size_t i = 0; i < index["noise"].size(); ++i) {
    const auto& c = index["noise"][i];
    const std::string p = "noise." + std::to_string(i) + ".";
    SCOPED_TRACE(p + c.dump());
    std::size_t drawn = 0, uniform = 0;
    df::NoiseDraws draws{[&](at::IntArrayRef shape, const at::TensorOptions&) {
                           const at::Tensor t = T(p + "draw." + std::to_string(drawn++));
                           EXPECT_EQ(t.sizes(), shape);
                           return t;
                         },
                         [&] { return c["uniform"].at(uniform++).get<double>(); }};
    const std::optional<double> adaptive =
        c["adaptive"].is_null() ? std::nullopt : std::optional(c["adaptive"].get<double>());
    expect_close(
        df::apply_noise_offset(T(p + "latents"), T(p + "noise"), c["offset"], adaptive, draws),
        T(p + "offset_out"), "offset");
    expect_close(df::pyramid_noise_like(T(p + "noise"), c["iterations"], c["discount"], draws),
                 T(p + "pyramid_out"), "pyramid", 1e-5, 1e-5);
    EXPECT_EQ(drawn, c["draws"].get<std::size_t>());
    EXPECT_EQ(uniform, c["uniform"].size());
  }
  const df::NoiseDraws none = df::NoiseDraws::torch();
  EXPECT_THROW((void)df::pyramid_noise_like(at::zeros({2, 3}), 2, 0.3, none), dt::ShapeError);
  EXPECT_THROW((void)df::pyramid_noise_like(at::zeros({1, 1, 4, 4}), 2, -1, none), dt::ConfigError);
}

// diffusers' train_dreambooth_lora.py: loss = F.mse_loss(instance half) + prior_loss_weight ·
// F.mse_loss(class half); the per-sample weights give the same number for every batch size and
// weight swept.
TEST(KohyaOptions, PriorPreservationWeightsGiveDiffusersLoss) {
  for (const std::int64_t n : {1, 2, 3, 8})
    for (const double lambda : {0.0, 0.5, 1.0, 2.5}) {
      SCOPED_TRACE(std::to_string(n) + " " + std::to_string(lambda));
      const at::Tensor pred = at::randn({2 * n, 4, 5, 6}), target = at::randn({2 * n, 4, 5, 6});
      const auto halves_p = pred.chunk(2), halves_t = target.chunk(2);
      const double diffusers = at::mse_loss(halves_p[0], halves_t[0]).item<double>() +
                               lambda * at::mse_loss(halves_p[1], halves_t[1]).item<double>();
      const at::Tensor per_sample = (pred - target).square().mean({1, 2, 3});
      const double ours =
          (per_sample * df::prior_preservation_weights(n, lambda)).mean().item<double>();
      EXPECT_NEAR(ours, diffusers, 1e-5 * std::max(1.0, std::abs(diffusers)));
    }
  EXPECT_THROW((void)df::prior_preservation_weights(0, 1.0), dt::ShapeError);
  EXPECT_THROW((void)df::prior_preservation_weights(2, -1.0), dt::ConfigError);
}

TEST(KohyaOptions, LossTypesThresholdsAndWeightsEqualTheReference) {
  const auto& index = tst::golden("kohya_options/index.json");
  const df::NoiseSchedule schedule = sd_schedule();
  ASSERT_EQ(index["loss"].size(), 18U);
  for (std::size_t i = 0; i < index["loss"].size(); ++i) {
    const auto& c = index["loss"][i];
    const std::string p = "loss." + std::to_string(i) + ".";
    SCOPED_TRACE(p + c.dump());
    const at::Tensor t = T(p + "t");
    const at::Tensor c_t =
        df::huber_threshold(df::huber_schedule_from(c["schedule"].get<std::string>(), "test"),
                            c["huber_c"], c["huber_scale"], t, schedule);
    expect_close(c_t, T(p + "threshold"), "threshold");
    for (const char* kind : {"l2", "l1", "huber", "smooth_l1"})
      expect_close(df::conditional_loss(T(p + "pred"), T(p + "target"),
                                        df::loss_type_from(kind, "test"), c_t),
                   T(p + kind), kind, 1e-5, 1e-5);
    const at::Tensor per_sample =
        df::conditional_loss(T(p + "pred"), T(p + "target"), df::LossType::l2).mean({1, 2, 3});
    const at::Tensor snr = schedule.snr(t);
    expect_close(df::debiased_estimation(per_sample, snr), T(p + "debiased"), "debiased", 1e-5);
    expect_close(df::debiased_estimation(per_sample, snr, true), T(p + "debiased_v"), "debiased_v",
                 1e-5);
    expect_close(df::v_prediction_like_loss(per_sample, snr, 0.1), T(p + "v_like"), "v_like", 1e-5);
    expect_close(df::v_prediction_scaled_like_noise(per_sample, snr), T(p + "v_scaled"), "v_scaled",
                 1e-5);
    expect_close(
        df::masked_loss(df::conditional_loss(T(p + "pred"), T(p + "target"), df::LossType::l2),
                        T(p + "masks")),
        T(p + "masked"), "masked", 1e-5, 1e-5);
  }
  // Flow matching: float timesteps σ·N, constant and exponential; snr has no ᾱ to read.
  ASSERT_EQ(index["flow"].size(), 12U);
  for (std::size_t i = 0; i < index["flow"].size(); ++i) {
    const auto& c = index["flow"][i];
    const std::string p = "flow." + std::to_string(i) + ".";
    SCOPED_TRACE(p + c.dump());
    expect_close(
        df::huber_threshold(df::huber_schedule_from(c["schedule"].get<std::string>(), "test"),
                            c["huber_c"], c["huber_scale"], T(p + "t"), 1000),
        T(p + "threshold"), "flow threshold");
  }
  EXPECT_THROW((void)df::huber_threshold(df::HuberSchedule::snr, 0.1, 1.0, at::zeros({2}), 1000),
               dt::ConfigError);
  EXPECT_THROW((void)df::loss_type_from("huberr", "--loss_type"), dt::ConfigError);
  EXPECT_THROW((void)df::huber_schedule_from("linear", "--huber_schedule"), dt::ConfigError);
  EXPECT_THROW((void)df::huber_threshold(df::HuberSchedule::exponential, 0.0, 1.0,
                                         at::zeros({2}, at::kLong), schedule),
               dt::ConfigError);
  EXPECT_THROW((void)df::conditional_loss(at::zeros({2, 3}), at::zeros({2, 4}), df::LossType::l2),
               dt::ShapeError);
  EXPECT_THROW(
      (void)df::conditional_loss(at::zeros({2, 3}), at::zeros({2, 3}), df::LossType::huber),
      dt::ShapeError);
}
