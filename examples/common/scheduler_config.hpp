#pragma once
// A diffusers scheduler_config.json as the training programs read it: the noise schedule and the
// prediction type that shape the loss, and the DDIM settings the validation samples use. Fields a
// sampler-only config adds (solver orders, sigmas) are not needed here and pass unread; a field
// with the wrong type, an unknown beta schedule, prediction type or timestep spacing is an error
// naming the file.

#include <difftrain/core/error.hpp>
#include <difftrain/diffusion/ddim.hpp>
#include <difftrain/diffusion/noise_schedule.hpp>
#include <difftrain/io/json_file.hpp>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace examples {

struct SchedulerConfig {
  difftrain::diffusion::NoiseSchedule::Options schedule;
  difftrain::diffusion::Prediction prediction = difftrain::diffusion::Prediction::epsilon;
  difftrain::diffusion::Ddim::Options ddim;
};

/// Reads `file` (empty: Stable Diffusion's schedule, ε-prediction); `prediction_override` (a
/// --prediction_type flag, empty for none) replaces the config's prediction type.
inline SchedulerConfig read_scheduler_config(const std::filesystem::path& file,
                                             const std::string& prediction_override = {}) {
  namespace df = difftrain::diffusion;
  SchedulerConfig c;
  c.schedule.beta_start = 0.00085;
  c.schedule.beta_end = 0.012;
  c.schedule.beta_schedule = df::BetaSchedule::scaled_linear;
  std::string prediction = "epsilon", spacing = "leading";
  const std::string where = file.string();
  if (!file.empty()) {
    const nlohmann::json j = difftrain::io::read_json_object(file);
    try {
      c.schedule.num_train_timesteps =
          j.value("num_train_timesteps", c.schedule.num_train_timesteps);
      c.schedule.beta_start = j.value("beta_start", c.schedule.beta_start);
      c.schedule.beta_end = j.value("beta_end", c.schedule.beta_end);
      c.schedule.rescale_betas_zero_snr = j.value("rescale_betas_zero_snr", false);
      // CogVideoX's schedulers shift the SNR (their field; no other scheduler has it).
      if (j.contains("snr_shift_scale"))
        c.schedule.snr_shift_scale = j.at("snr_shift_scale").get<double>();
      prediction = j.value("prediction_type", prediction);
      spacing = j.value("timestep_spacing", spacing);
      c.ddim.steps_offset = j.value("steps_offset", std::int64_t{0});
      c.ddim.set_alpha_to_one = j.value("set_alpha_to_one", c.ddim.set_alpha_to_one);
      c.schedule.beta_schedule =
          df::beta_schedule_from(j.value("beta_schedule", std::string("scaled_linear")), where);
    } catch (const nlohmann::json::exception& e) {
      throw difftrain::ConfigError(std::string("a field has the wrong type: ") + e.what(), where);
    }
  }
  if (!prediction_override.empty()) prediction = prediction_override;
  c.prediction = df::prediction_from(
      prediction, prediction_override.empty() ? where + ": prediction_type" : "--prediction_type");
  c.ddim.prediction_type = c.prediction;
  if (spacing == "leading")
    c.ddim.timestep_spacing = df::TimestepSpacing::leading;
  else if (spacing == "trailing")
    c.ddim.timestep_spacing = df::TimestepSpacing::trailing;
  else if (spacing == "linspace")
    c.ddim.timestep_spacing = df::TimestepSpacing::linspace;
  else
    throw difftrain::ConfigError(
        "timestep_spacing '" + spacing + "' is not leading, trailing or linspace", where);
  return c;
}

}  // namespace examples
