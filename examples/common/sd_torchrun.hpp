#pragma once
// What the Stable Diffusion programs share under torchrun: the flags (ZeRO's stage, a rank's
// timeout, a change of world size on resume), the world and this rank's device, and the trainer's
// parallel options.

#include <CLI/CLI.hpp>
#include <difftrain/distributed/sharded_data_parallel.hpp>
#include <difftrain/distributed/world.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "cli_checks.hpp"

namespace examples::sd {

/// What a program takes under torchrun: ZeRO's stage, how long a rank waits for the others, and
/// whether a checkpoint of another number of ranks may be resumed.
struct TorchrunFlags {
  std::int64_t sharding = 0;  // 0 replicates (DataParallel)
  double rank_timeout = 1800;
  bool allow_world_size_change = false;
  bool sharded_mixed_precision = false;  // FSDP's MixedPrecisionPolicy at --mixed_precision
  bool offload_optimizer = false;        // each rank's optimizer in host memory (ZeRO-Offload)
  bool offload_params = false;           // stage 3's units too, between uses
};

/// The "torchrun" group of flags; `units` says what stage 3 shares ("each UNet block").
inline CLI::Option_group* add_torchrun_flags(CLI::App& app, TorchrunFlags& f,
                                             const std::string& units) {
  auto* d = app.add_option_group("torchrun");
  d->add_option("--sharding", f.sharding,
                "ZeRO's stage: 0 keeps everything on every rank (DataParallel), 1 shards the "
                "optimizer state, 2 the gradients too, 3 the trained parameters too during "
                "forward and backward (" +
                    units + " a unit)")
      ->check(count_in(0, 3))
      ->capture_default_str();
  d->add_option("--rank_timeout", f.rank_timeout,
                "seconds a rank waits for the others (caching included) before it stops")
      ->check(number_in(1, 1e7))
      ->capture_default_str();
  d->add_flag("--allow_world_size_change", f.allow_world_size_change,
              "resume a checkpoint written by another number of ranks");
  d->add_flag("--sharded_mixed_precision", f.sharded_mixed_precision,
              "with --sharding 1-3 and --mixed_precision bf16|fp16: the trained parameters hold "
              "that dtype in forward, backward and stage 3's gathers (FSDP's mixed precision), "
              "the optimizer steps float32 masters and the gradients are reduced in float32; "
              "checkpoints and outputs keep the masters");
  d->add_flag("--offload_optimizer", f.offload_optimizer,
              "with --sharding 1-3: each rank's optimizer (its float32 copies of the parameters "
              "it steps, their gradients and the optimizer's state) lives in host memory "
              "(DeepSpeed's offload_optimizer, ZeRO-Offload)");
  d->add_flag("--offload_params", f.offload_params,
              "with --sharding 3: between uses the units' parameters live in host memory only, "
              "so the device holds only the units being computed (DeepSpeed's offload_param, "
              "FSDP's CPUOffload); implies --offload_optimizer. Without torchrun too: a model "
              "larger than the one device");
  return d;
}

/// --sharded_mixed_precision needs a stage that shards and a dtype to compute in (Flags: the
/// program's settings, with --mixed_precision).
template <class Flags>
void check_torchrun_flags(const Flags& f) {
  if (f.offload_optimizer && f.sharding < 1)
    throw difftrain::ConfigError(
        "needs --sharding 1, 2 or 3 (each rank then steps only its share, in host memory)",
        "--offload_optimizer");
  if (f.offload_params && f.sharding != 3)
    throw difftrain::ConfigError("needs --sharding 3 (the only stage that frees parameters)",
                                 "--offload_params");
  if (!f.sharded_mixed_precision) return;
  if (f.sharding < 1)
    throw difftrain::ConfigError("needs --sharding 1, 2 or 3 (DataParallel has autocast alone)",
                                 "--sharded_mixed_precision");
  if (f.mixed_precision != "bf16" && f.mixed_precision != "fp16")
    throw difftrain::ConfigError(
        "needs --mixed_precision bf16 or fp16 (the dtype the parameters compute in)",
        "--sharded_mixed_precision");
}

/// The ranks of a torchrun launch (a world of one without it) and this rank's device: with CUDA,
/// each rank of a node its own GPU. The flags are checked first, the same on every rank.
template <class Flags>
std::pair<std::shared_ptr<difftrain::distributed::World>, at::Device> torchrun_world(
    const Flags& f, const std::string& device) {
  check_torchrun_flags(f);
  auto world = difftrain::distributed::World::from_environment(
      {.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(f.rank_timeout * 1000))});
  const at::Device d =
      device == "cuda" && world->distributed()
          ? at::Device(at::kCUDA, static_cast<at::DeviceIndex>(world->local_rank()))
          : at::Device(device);
  return {std::move(world), d};
}

/// The trainer's share of the run: the ranks, the stage, mixed precision, and a world size change
/// if allowed. Stage 3 frees the units' parameters on the ranks that do not own them during
/// forward and backward; between steps every rank holds them whole (reshard_after_step off: no
/// gathering before each validation), unless --offload_params keeps them in host memory then
/// (validation, SampleEvery, takes whole_parameters() on every rank). With
/// --sharded_mixed_precision the parameters hold the --mixed_precision dtype (autocast stays on
/// and casts the inputs); every rank takes trainer.whole_parameters() before rank 0 writes the
/// outputs, which then hold the masters.
template <class Options, class Flags>
void set_parallel(Options& o, const Flags& f,
                  const std::shared_ptr<difftrain::distributed::World>& world) {
  o.parallel.world = world;
  o.parallel.stage = static_cast<int>(f.sharding);
  o.parallel.reshard_after_step = f.offload_params;
  o.parallel.offload_optimizer = f.offload_optimizer;
  o.parallel.offload_parameters = f.offload_params;
  o.allow_world_size_change = f.allow_world_size_change;
  if (f.sharded_mixed_precision) {
    o.parallel.param_dtype = f.mixed_precision == "bf16" ? at::kBFloat16 : at::kHalf;
    o.parallel.reduce_dtype = at::kFloat;
  }
}

}  // namespace examples::sd
