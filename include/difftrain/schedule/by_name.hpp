#pragma once
// Config::Schedule = schedule::ByName: the schedule chosen at run time, as diffusers' training
// scripts take `--lr_scheduler NAME`: one of get_scheduler's seven names with its arguments, in
// Options or read from JSON (a config file). The schedule a name builds is the static policy of
// that name, so the numbers are the same; the run-time choice costs one indirect call per group
// and step (benchmarks/bench_schedule.cpp: lr_scheduler_step).
//
//   struct Config : train::DefaultConfig { using Schedule = schedule::ByName; };
//   o.schedule = schedule::ByName::from_json(nlohmann::json::parse(R"({"lr_scheduler": "cosine",
//                "num_warmup_steps": 500, "num_training_steps": 20000})"));

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "difftrain/core/error.hpp"
#include "difftrain/schedule/bind.hpp"
#include "difftrain/schedule/registry.hpp"

namespace difftrain::schedule {

class ByName {
 public:
  static constexpr std::string_view name = "by_name";
  struct Options {
    std::string lr_scheduler = "constant";  ///< diffusers' names: linear, cosine, ...
    SchedulerArgs args{};
  };

  /// Builds the named schedule; an unknown name or a missing argument is a ConfigError naming it.
  explicit ByName(const Options& o)
      : chosen_(o.lr_scheduler), s_(get_scheduler(o.lr_scheduler, o.args)) {}

  [[nodiscard]] double lr(std::int64_t step, double base_lr) const { return s_.lr(step, base_lr); }
  [[nodiscard]] double lr(std::int64_t step, double base_lr, std::size_t group) const {
    return s_.lr(step, base_lr, group);
  }
  /// The last step the chosen schedule is defined for (its num_training_steps), for the schedules
  /// that decay to an end; none for the constant ones.
  static std::optional<std::int64_t> horizon(const Options& o) {
    const std::string& n = o.lr_scheduler;
    if (n == "linear" || n == "cosine" || n == "cosine_with_restarts" || n == "polynomial")
      return o.args.num_training_steps;
    return std::nullopt;
  }

  /// The name it was built from.
  [[nodiscard]] const std::string& chosen() const noexcept { return chosen_; }

  /// Options from a JSON object (a config file): "lr_scheduler" and get_scheduler's arguments
  /// under diffusers' names. A key it does not know, or a value of the wrong kind, is a
  /// ConfigError naming the key.
  static Options from_json(const nlohmann::json& j, const std::string& where = "lr schedule") {
    if (!j.is_object()) throw ConfigError("must be a JSON object", where);
    Options o;
    auto integer = [&](const std::string& key) {
      if (!j[key].is_number_integer()) throw ConfigError("must be an integer", where + "." + key);
      return j[key].get<std::int64_t>();
    };
    auto number = [&](const std::string& key) {
      if (!j[key].is_number()) throw ConfigError("must be a number", where + "." + key);
      return j[key].get<double>();
    };
    for (const auto& [key, value] : j.items()) {
      if (key == "lr_scheduler" || key == "step_rules") {
        if (!value.is_string()) throw ConfigError("must be a string", where + "." + key);
        (key == "lr_scheduler" ? o.lr_scheduler : o.args.step_rules.emplace()) =
            value.get<std::string>();
      } else if (key == "num_warmup_steps") {
        o.args.num_warmup_steps = integer(key);
      } else if (key == "num_training_steps") {
        o.args.num_training_steps = integer(key);
      } else if (key == "num_cycles") {
        o.args.num_cycles = integer(key);
      } else if (key == "power") {
        o.args.power = number(key);
      } else if (key == "lr_end") {
        o.args.lr_end = number(key);
      } else if (key == "lr_init") {
        o.args.lr_init = number(key);
      } else {
        throw ConfigError(
            "is not a schedule setting (known: lr_scheduler, num_warmup_steps, "
            "num_training_steps, num_cycles, power, lr_end, lr_init, step_rules)",
            where + "." + key);
      }
    }
    return o;
  }

 private:
  std::string chosen_;
  AnySchedule s_;
};

}  // namespace difftrain::schedule
