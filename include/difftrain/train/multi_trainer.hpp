#pragma once
// Several models trained side by side, each with its own optimizer, schedule, EMA, scaler and step
// counter (DALLE2's DecoderTrainer, one per U-Net of a cascade): each step trains the model chosen
// for it; sampling swaps in every model's EMA weights at once; one checkpoint holds them all and is
// checked whole before any model changes.
//
// Under a distributed Config::Parallel (DataParallel) every rank holds every model and its own
// reducer; a step trains the same model on every rank (checked: a rank that picks another is a
// ConfigError on all of them, not a hang), a checkpoint is written by rank 0 with every rank's
// generators, and a resume goes on only when every rank could read the file.

#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/core/agreed.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/io/torch_file.hpp"
#include "difftrain/train/checkpoint_header.hpp"
#include "difftrain/train/trainer.hpp"

namespace difftrain::train {

template <class Model, class Config = DefaultConfig>
class MultiTrainer {
 public:
  using TrainerT = Trainer<Model, Config>;
  using Options = typename TrainerT::Options;
  using Batch = typename Model::Batch;
  static_assert(!TrainerT::sharded,
                "difftrain: MultiTrainer writes every model's state into one file, so it takes "
                "DataParallel, not a sharding Config::Parallel (ShardedDataParallel)");

  /// One trainer per model, each with its own options (learning rates, warm-up, EMA...).
  MultiTrainer(const std::vector<Model*>& models, const std::vector<Options>& options) {
    if (models.empty()) throw ConfigError("needs at least one model", "MultiTrainer");
    if (models.size() != options.size())
      throw ConfigError("got " + std::to_string(models.size()) + " models and " +
                            std::to_string(options.size()) + " option sets",
                        "MultiTrainer");
    for (std::size_t i = 0; i < models.size(); ++i)
      trainers_.push_back(std::make_unique<TrainerT>(*models[i], options[i]));
  }

  [[nodiscard]] std::size_t size() const { return trainers_.size(); }

  /// The trainer of model `index` (0-based); an index out of range is a ConfigError.
  [[nodiscard]] TrainerT& at(std::size_t index) {
    if (index >= trainers_.size())
      throw ConfigError("model index " + std::to_string(index) + " is out of range (" +
                            std::to_string(trainers_.size()) + " models)",
                        "MultiTrainer");
    return *trainers_[index];
  }

  /// One optimizer step of model `index`. In a distributed run every rank must name the same
  /// model (one gather of the index per step); otherwise every rank throws the same ConfigError.
  StepInfo step(std::size_t index, const std::vector<Batch>& micro_batches) {
    auto& parallel = *trainers_.front()->parallel_;
    if (parallel.world_size() > 1) {
      const std::vector<at::Tensor> all =
          parallel.gather(at::tensor({static_cast<std::int64_t>(index)}, at::kLong));
      const auto picked = [&](std::size_t r) { return std::to_string(all[r].item().toLong()); };
      for (std::size_t r = 1; r < all.size(); ++r)
        if (!at::equal(all[r], all[0]))
          throw ConfigError("rank 0 steps model " + picked(0) + ", rank " + std::to_string(r) +
                                " model " + picked(r) + "; every rank must step the same model",
                            "MultiTrainer" + trainers_.front()->rank_suffix());
    }
    return at(index).step(micro_batches);
  }

  /// This process's rank and the number of ranks (0 and 1 outside a distributed run).
  [[nodiscard]] std::int64_t rank() const { return trainers_.front()->rank(); }
  [[nodiscard]] std::int64_t world_size() const { return trainers_.front()->world_size(); }

  /// Steps taken by model `index`.
  [[nodiscard]] std::int64_t steps_taken(std::size_t index) { return at(index).global_step(); }

  /// Runs `fn()` with every model's EMA weights swapped in (the live weights come back after,
  /// also on an exception).
  template <class Fn>
  decltype(auto) with_ema_weights(Fn&& fn) {
    at::NoGradGuard no_grad;
    std::vector<std::function<void()>> restore;
    if constexpr (TrainerT::has_ema) {
      for (auto& t : trainers_) {
        t->ema().store();
        t->ema().copy_to();
        restore.emplace_back([&e = t->ema()] { e.restore(); });
      }
    }
    struct Restore {
      std::vector<std::function<void()>>& r;
      ~Restore() {
        for (auto& f : r) f();
      }
    } guard{restore};
    return fn();
  }

  [[nodiscard]] c10::IValue state() {
    auto root = io::torch_dict();
    root.insert("format", std::string("difftrain.multi_checkpoint"));
    root.insert("version", kCheckpointFormatVersion);
    auto list = io::torch_list();
    for (auto& t : trainers_) list.push_back(t->state());
    root.insert("models", list);
    return root;
  }

  /// Writes every model's state atomically. In a distributed run every rank calls it (each
  /// state gathers the ranks' generators); rank 0 writes, and every rank learns whether it could.
  void save_checkpoint(const std::filesystem::path& path) {
    for (std::size_t i = 0; i < trainers_.size(); ++i)
      if (!trainers_[i]->all_finite())
        throw NumericError("model " + std::to_string(i) + " holds non-finite weights; not saving",
                           path.string());
    // Rank 0 writes: the other ranks take part in the states' collectives and copy nothing.
    auto root = io::torch_dict();
    root.insert("format", std::string("difftrain.multi_checkpoint"));
    root.insert("version", kCheckpointFormatVersion);
    auto list = io::torch_list();
    for (auto& t : trainers_) list.push_back(t->state_for_writing());
    root.insert("models", list);
    const c10::IValue st = root;
    agreed(
        [&] {
          if (rank() == 0) io::save_torch_file(path, st);
        },
        [&](bool ok) { return trainers_.front()->parallel_->decide(ok); },
        [&] {
          return IoError("rank 0 could not write the checkpoint (its error says why)",
                         path.string());
        });
  }

  /// Checks every model's state first, then applies them all; in a distributed run only when
  /// every rank could read and check the file (the others' error says another rank refused).
  void load_checkpoint(const std::filesystem::path& path) {
    const std::vector<typename TrainerT::CheckedState> checked =
        agreed([&] { return check_file(path); },
               [&](bool ok) { return trainers_.front()->parallel_->all_ok(ok); },
               [&] {
                 return FormatError("could not be used by another rank (its error says why)",
                                    path.string());
               });
    for (std::size_t i = 0; i < checked.size(); ++i) trainers_[i]->resume_from(checked[i]);
  }

 private:
  std::vector<typename TrainerT::CheckedState> check_file(const std::filesystem::path& path) {
    const io::TorchValue root = io::load_torch_file(path);
    check_checkpoint_format(root, "difftrain.multi_checkpoint", "a multi-model checkpoint");
    const auto models = root.at("models").elements();
    if (models.size() != trainers_.size())
      throw ConfigError("holds " + std::to_string(models.size()) + " models, this trainer has " +
                            std::to_string(trainers_.size()),
                        root.where());
    std::vector<typename TrainerT::CheckedState> checked;
    for (std::size_t i = 0; i < models.size(); ++i)
      checked.push_back(trainers_[i]->checked_naming_file(models[i]));
    return checked;
  }

  std::vector<std::unique_ptr<TrainerT>> trainers_;
};

}  // namespace difftrain::train
