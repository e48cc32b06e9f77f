// consolidate: a training checkpoint's model as one safetensors file, or as a diffusers model
// folder. A sharded set (each rank wrote the parameters it steps beside the checkpoint) streams
// through one tensor at a time, so the model is never whole in memory.
//
//   consolidate CHECKPOINT OUT [--ema] [--prefix unet.] [--config config.json]
//
//   --ema      the EMA's weights (the checkpoint must hold an EMA)
//   --prefix   only the tensors under this name, written without it
//   --config   OUT is a model folder: this config.json and diffusion_pytorch_model.safetensors
//
// Exit codes, as the other programs': 0 written, 2 bad input (a damaged or missing file of the
// set, an unknown prefix, a checkpoint without an EMA: difftrain's typed errors), 3 an error of
// torch's, 4 anything else.

#include <CLI/CLI.hpp>
#include <cstdio>
#include <difftrain/core/error.hpp>
#include <difftrain/io/json_file.hpp>
#include <difftrain/train/consolidate.hpp>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "../common/cli_checks.hpp"

namespace {

int run(const std::filesystem::path& checkpoint, const std::filesystem::path& out,
        const difftrain::train::ConsolidateOptions& o, const std::string& config_path) {
  // With --config (a model folder's config.json, as the user gave it), a diffusers folder.
  const difftrain::train::ConsolidateReport r =
      config_path.empty() ? difftrain::train::consolidate_checkpoint(checkpoint, out, o)
                          : difftrain::train::consolidate_to_folder(
                                checkpoint, out, difftrain::io::read_json_object(config_path), o);
  std::fprintf(
      stderr, "consolidate: step %lld, %s%zu tensors (%.1f MiB) -> %s\n",
      static_cast<long long>(r.step),
      r.sharded ? ("the files of " + std::to_string(r.world_size) + " ranks, ").c_str() : "",
      r.tensors, static_cast<double>(r.bytes) / (1024.0 * 1024.0), out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"a training checkpoint's model as one safetensors file or a diffusers folder"};
  std::string checkpoint, out, config;
  difftrain::train::ConsolidateOptions o;
  app.add_option("checkpoint", checkpoint, "checkpoint-N.pt (a set's other files beside it)")
      ->required();
  app.add_option("out", out, "the safetensors file, or with --config the model folder")->required();
  app.add_flag("--ema", o.ema, "the EMA's weights instead of the trained ones");
  app.add_option("--prefix", o.prefix, "only the tensors under this name, without it (unet.)");
  app.add_option("--config", config, "write a model folder with this config.json");
  if (const auto rc = examples::parse_command_line(app, argc, argv)) return *rc;
  return examples::run_reporting_errors([&] { return run(checkpoint, out, o, config); });
}
