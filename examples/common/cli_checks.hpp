#pragma once
// What every example does with its command line before any work starts: numbers must be finite
// and inside a range that makes sense (CLI11's own Range lets NaN through), the output folder
// must be creatable and writable, and whatever goes wrong later ends in one line on stderr and a
// non-zero exit status, never an abort.

#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <CLI/CLI.hpp>
#include <difftrain/core/error.hpp>
#include <difftrain/io/atomic_file.hpp>

#include <cmath>
#include <cstdio>
#include <exception>
#include <optional>
#include <sstream>
#include <string>

namespace examples {

/// `v` as a person writes it: 0, 1, 0.5, 10000, 1e+09.
inline std::string short_number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

/// A finite number in [lo, hi] (or (lo, hi] with `open_low`).
inline CLI::Validator number_in(double lo, double hi, bool open_low = false) {
  const std::string range =
      std::string(open_low ? "(" : "[") + short_number(lo) + ", " + short_number(hi) + "]";
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v) || !std::isfinite(v))
          return "must be a finite number, got '" + text + "'";
        if (v < lo || v > hi || (open_low && v == lo))
          return "must lie in " + range + ", got " + text;
        return {};
      },
      "NUMBER in " + range);
}

/// A whole number in [lo, hi].
inline CLI::Validator count_in(long long lo, long long hi) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        long long v = 0;
        if (!CLI::detail::lexical_cast(text, v))
          return "must be a whole number, got '" + text + "'";
        if (v < lo || v > hi)
          return "must lie in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                 text;
        return {};
      },
      "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

/// The device a --device flag names: "cpu", "cuda" or "cuda:N", and CUDA only where there is one.
inline c10::Device device_from(const std::string& name) {
  if (name != "cpu" && name.rfind("cuda", 0) != 0)
    throw difftrain::ConfigError("must be cpu or cuda[:N], got '" + name + "'", "--device");
  c10::Device device(c10::DeviceType::CPU);
  try {
    device = c10::Device(name);
  } catch (const c10::Error&) {
    throw difftrain::ConfigError("is not a device name: '" + name + "'", "--device");
  }
  if (device.is_cuda() && !torch::cuda::is_available())
    throw difftrain::DeviceError("this machine has no CUDA device", "--device " + name);
  if (device.is_cuda() && device.has_index() &&
      device.index() >= static_cast<c10::DeviceIndex>(torch::cuda::device_count()))
    throw difftrain::DeviceError(
        "there are " + std::to_string(torch::cuda::device_count()) + " CUDA devices",
        "--device " + name);
  return device;
}

/// Parses the command line. --help (and --version) print and give 0; a mistake CLI11 finds (an
/// unknown flag, a missing value, a value out of range) is one "error: ..." line naming the flag
/// and exit status 2, as every other mistake a program refuses (CLI11's own exit codes are
/// 105-109 and its text two lines). Returns the status to exit with, or nothing to go on.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    std::fprintf(stderr, "error: %s (--help lists the options)\n", e.what());
    return 2;
  }
}

/// Runs `body` and turns every failure into a message and an exit status: 2 for difftrain's
/// typed errors (they say what and where), 3 for torch's, 4 for anything else.
template <class Body>
int run_reporting_errors(Body&& body) {
  try {
    return body();
  } catch (const difftrain::Error& err) {
    std::fprintf(stderr, "error: %s\n", err.what());
    return 2;
  } catch (const c10::Error& err) {
    std::fprintf(stderr, "error (torch): %s\n", err.what_without_backtrace());
    return 3;
  } catch (const std::exception& err) {
    std::fprintf(stderr, "error (unexpected): %s\n", err.what());
    return 4;
  }
}

}  // namespace examples
