#pragma once
// The judge: a small CNN trained on the real Fashion-MNIST training set (by the same difftrain
// Trainer), used to label generated samples and to give the feature space of the Fréchet
// distance (its 128-wide penultimate layer). It is cached in a safetensors file whose metadata
// records its test accuracy and the settings that made it; a file made with other settings, or
// one that does not load, is retrained and replaced.

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/nn/module_tensors.hpp>
#include <difftrain/train/callbacks.hpp>
#include <difftrain/train/trainer.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <tuple>

#include "data.hpp"
#include "denoiser.hpp"

namespace fmnist {

class ClassifierImpl : public torch::nn::Module {
 public:
  struct Batch {
    at::Tensor images, labels;
  };
  static constexpr std::int64_t kFeatures = 128;

  ClassifierImpl() {
    using namespace torch::nn;
    conv1 = register_module("conv1", Conv2d(Conv2dOptions(1, 16, 5).padding(2)));
    bn1 = register_module("bn1", BatchNorm2d(16));
    conv2 = register_module("conv2", Conv2d(Conv2dOptions(16, 32, 3).padding(1)));
    bn2 = register_module("bn2", BatchNorm2d(32));
    fc1 = register_module("fc1", Linear(32 * 7 * 7, kFeatures));
    dropout = register_module("dropout", Dropout(0.3));
    fc2 = register_module("fc2", Linear(kFeatures, kClasses));
  }
  /// The penultimate activations (N, 128).
  at::Tensor features(const at::Tensor& x) {
    at::Tensor h = at::max_pool2d(at::relu(bn1(conv1(x))), 2);
    h = at::max_pool2d(at::relu(bn2(conv2(h))), 2);
    return at::relu(fc1(h.flatten(1)));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(dropout(features(x))); }
  at::Tensor loss(const Batch& b) { return at::cross_entropy_loss(forward(b.images), b.labels); }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(Classifier);

struct ClassifierSettings {
  std::int64_t epochs = 4;
  std::int64_t batch_size = 128;
  double lr = 2e-3;
  std::uint64_t seed = 0;
  std::int64_t train_examples = 0;  ///< how many training images it saw per epoch
  bool progress = false;            ///< draw the progress line in place even off a terminal
  [[nodiscard]] std::string key() const {
    return "arch=cnn-16-32-128,epochs=" + std::to_string(epochs) +
           ",batch=" + std::to_string(batch_size) + ",lr=" + std::to_string(lr) +
           ",seed=" + std::to_string(seed) + ",examples=" + std::to_string(train_examples);
  }
};

/// Applies `fn` to `images` in batches under no_grad, concatenating the results.
template <class Fn>
at::Tensor batched(const at::Tensor& images, std::int64_t batch, Fn&& fn) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> parts;
  for (std::int64_t i = 0; i < images.size(0); i += batch)
    parts.push_back(fn(images.slice(0, i, std::min(i + batch, images.size(0)))));
  return at::cat(parts, 0);
}

/// Fraction of `images` the classifier labels as `labels`.
inline double accuracy(Classifier& net, const at::Tensor& images, const at::Tensor& labels) {
  net->eval();
  const at::Tensor pred =
      batched(images, 500, [&](const at::Tensor& x) { return net->forward(x).argmax(1); });
  return pred.eq(labels.to(pred.device())).to(at::kDouble).mean().item<double>();
}

struct TrainedClassifier {
  Classifier net;
  double test_accuracy = 0.0;
  bool from_cache = false;
};

/// Loads the classifier cached at `path` if it was made with `settings`, else trains one on
/// `data.train`, measures it on `data.test` and caches it.
inline TrainedClassifier classifier_for(const Dataset& data, ClassifierSettings settings,
                                        const std::filesystem::path& path, at::Device device) {
  settings.train_examples = data.train.size();
  Classifier net;
  net->to(device);
  to_channels_last(*net);
  if (std::filesystem::exists(path)) {
    try {
      const auto file = dt::io::load_safetensors(path, /*copy=*/true);
      const auto key = file.metadata.find("settings");
      const auto acc = file.metadata.find("test_accuracy");
      if (key != file.metadata.end() && key->second == settings.key() &&
          acc != file.metadata.end()) {
        dt::nn::load_module_tensors(*net, file.tensors, path.string());
        net->eval();
        return {net, std::stod(acc->second), true};
      }
      std::fprintf(stderr, "classifier: %s was made with other settings; retraining\n",
                   path.string().c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "classifier: cannot use %s (%s); retraining\n", path.string().c_str(),
                   e.what());
    }
  }
  struct Config : dt::train::DefaultConfig {
    using Schedule = dt::schedule::Cosine;
    using Callbacks = std::tuple<dt::train::ProgressBar>;
  };
  const std::int64_t n = data.train.size();
  const std::int64_t per_epoch = std::max<std::int64_t>(1, n / settings.batch_size);
  dt::train::Trainer<ClassifierImpl, Config>::Options o;
  o.optimizer.lr = settings.lr;
  o.optimizer.weight_decay = 1e-4;
  o.schedule.num_warmup_steps = std::min<std::int64_t>(100, per_epoch);
  o.schedule.num_training_steps = per_epoch * settings.epochs;
  // Progress as the main training shows it: in place on a terminal, else a line per tenth.
  const std::int64_t total = o.schedule.num_training_steps;
  dt::train::Trainer<ClassifierImpl, Config> trainer(
      *net, o,
      {dt::train::ProgressBar({.total_steps = total,
                               .lines_every = std::max<std::int64_t>(1, total / 10),
                               .force = settings.progress,
                               .label = "classifier"})});
  const at::Tensor images = data.train.images.to(device), labels = data.train.labels.to(device);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(settings.seed ^ 0x5eedULL);
  at::Tensor perm;
  std::int64_t perm_epoch = -1;
  std::fprintf(stderr, "classifier: training on %lld images for %lld epochs\n",
               static_cast<long long>(n), static_cast<long long>(settings.epochs));
  trainer.fit(
      [&](std::int64_t step, std::int64_t /*micro*/) {
        const std::int64_t epoch = step / per_epoch;
        if (epoch != perm_epoch) {
          perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong)).to(device);
          perm_epoch = epoch;
        }
        const at::Tensor idx = perm.narrow(0, (step % per_epoch) * settings.batch_size,
                                           std::min(settings.batch_size, n));
        return ClassifierImpl::Batch{images.index_select(0, idx), labels.index_select(0, idx)};
      },
      o.schedule.num_training_steps);
  const double acc = accuracy(net, data.test.images.to(device), data.test.labels);
  dt::io::save_safetensors(path, dt::nn::module_tensors(*net),
                           {{"settings", settings.key()}, {"test_accuracy", std::to_string(acc)}});
  return {net, acc, false};
}

/// The judging classifier (classifier_for), said on stderr with its accuracy and time; a
/// NumericError when its test accuracy is below `min_accuracy`: scores from it would mean nothing,
/// so a run stops before it trains anything.
inline TrainedClassifier judge_for(const Dataset& data, const ClassifierSettings& settings,
                                   const std::filesystem::path& path, at::Device device,
                                   double min_accuracy) {
  const auto start = std::chrono::steady_clock::now();
  TrainedClassifier judge = classifier_for(data, settings, path, device);
  std::fprintf(stderr, "classifier: %.2f %% test accuracy (%s, %.1f s)\n",
               100 * judge.test_accuracy, judge.from_cache ? "cached" : "trained",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (judge.test_accuracy < min_accuracy)
    throw dt::NumericError("the classifier reached " + std::to_string(judge.test_accuracy) +
                               " test accuracy, below --min-classifier-accuracy " +
                               std::to_string(min_accuracy) + "; raise --classifier-epochs",
                           path.string());
  return judge;
}

}  // namespace fmnist
