// The caption, noise and loss options of today's LoRA trainers against kohya's definitions
// (tests/reference/ref_kohya_options.py), with the reference's own draws replayed: 600 captions
// under 15 option sets (shuffling, kept tokens and separators, tag and caption dropout, every-n-
// epoch dropout, wildcards, prefixes, secondary separators, token warm-up) equal to the character;
// noise offsets (plain and adaptive) and pyramid noise over 16 shapes and settings; Huber
// thresholds of every schedule, every loss type, the SNR weights and the masked loss over 18
// cases, to float32 rounding.
#include <difftrain/data/caption_options.hpp>
#include <difftrain/diffusion/loss_options.hpp>
#include <difftrain/diffusion/noise_options.hpp>
#include <difftrain/diffusion/noise_schedule.hpp>
#include <difftrain/io/safetensors.hpp>

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "golden.hpp"

namespace dt = difftrain;
namespace df = difftrain::diffusion;
namespace data = difftrain::data;
namespace tst = difftrain::test;

namespace {

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

df::NoiseSchedule sd_schedule() {
  return df::NoiseSchedule({.beta_start = 0.00085,
                            .beta_end = 0.012,
                            .beta_schedule = df::BetaSchedule::scaled_linear,
                            .precision = df::Precision::float32});
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what,
                  double rtol = 1e-5, double atol = 1e-6) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::allclose(got.to(at::kFloat), want.to(at::kFloat), rtol, atol))
      << what << ": max difference "
      << (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>();
}

}  // namespace

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
