#pragma once
// DreamBooth's two ways of keeping what the model knows of a class while it learns an instance,
// and kohya's dataset config that names the folders:
//   * diffusers' prior preservation (train_dreambooth_lora.py): --with_prior_preservation,
//     --class_data_dir (images of the class, generated with the model when it holds fewer than
//     --num_class_images), --class_prompt, --prior_loss_weight. Each batch of instance images is
//     followed by as many class images (the instance's index modulo the class images), and the
//     loss is the instance images' mean plus prior_loss_weight times the class images' mean.
//   * kohya's regularization subsets (is_reg = true in --dataset_config): mixed into the batches,
//     repeated to as many as the training images (kohya's rule), each sample's loss weighted by
//     --prior_loss_weight.
// Both reach the loss as per-sample weights w, the loss being the mean of w·loss_i: prior
// preservation's halves weighted 2 and 2·prior_loss_weight give its sum of two means.

#include <CLI/CLI.hpp>
#include <difftrain/core/error.hpp>
#if __has_include(<toml++/toml.h>)
#include <difftrain/data/dataset_config.hpp>
#define DIFFTRAIN_EXAMPLES_HAVE_TOML 1
#endif
#include <difftrain/data/image_folder.hpp>
#include <difftrain/io/atomic_file.hpp>
#include <difftrain/io/image_grid.hpp>
#include <difftrain/io/png.hpp>
#include <difftrain/io/sha256.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "../common/sd_pipeline.hpp"
#include "../common/training_folder.hpp"

namespace examples {

struct DreamBoothFlags {
  std::string dataset_config;  // kohya's dataset.toml
  bool with_prior_preservation = false;
  std::string class_data_dir, class_prompt;
  std::int64_t num_class_images = 100, sample_batch_size = 4;
  double prior_loss_weight = 1.0;
  // kohya's masked loss: each image's alpha channel, or a mask image of the same stem in
  // --conditioning_data_dir (its red channel), weights the loss where the image is.
  bool alpha_mask = false, masked_loss = false;
  std::string conditioning_data_dir;
  [[nodiscard]] bool masks() const { return alpha_mask || masked_loss; }
};

inline void add_dreambooth_flags(CLI::App& app, DreamBoothFlags& f) {
  auto* g = app.add_option_group("DreamBooth and kohya's dataset config");
  g->add_option("--dataset_config", f.dataset_config,
                "kohya's dataset config (.toml): [[datasets.subsets]] with image_dir, "
                "num_repeats, class_tokens, caption_extension, is_reg ... (in place of "
                "--train_data_dir)");
  g->add_flag("--with_prior_preservation", f.with_prior_preservation,
              "diffusers' prior preservation: class images beside every batch");
  g->add_option("--class_data_dir", f.class_data_dir,
                "images of the class (generated with the model when fewer than "
                "--num_class_images)");
  g->add_option("--class_prompt", f.class_prompt, "the class images' prompt");
  g->add_option("--num_class_images", f.num_class_images)
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1'000'000}))
      ->capture_default_str();
  g->add_option("--sample_batch_size", f.sample_batch_size, "class images generated at a time")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{4096}))
      ->capture_default_str();
  g->add_option("--prior_loss_weight", f.prior_loss_weight,
                "the class (regularization) images' loss weight")
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();
  g->add_flag("--alpha_mask", f.alpha_mask,
              "kohya's: the loss weighted by each image's alpha channel (opaque where none)");
  g->add_flag("--masked_loss", f.masked_loss,
              "kohya's: the loss weighted by a mask image per image (--conditioning_data_dir)");
  g->add_option("--conditioning_data_dir", f.conditioning_data_dir,
                "with --masked_loss: mask images named as the training images (red channel: 0 "
                "ignores a pixel, 255 counts it fully)");
}

/// Each record's mask image: the file of its stem in `dir` (.png, .jpg, .jpeg or .webp); a
/// ConfigError names the first image without one.
inline void attach_masks(difftrain::data::ImageFolder& folder, const std::filesystem::path& dir,
                         const std::string& where) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) throw difftrain::IoError("is not a folder", where);
  std::map<std::string, fs::path> by_stem;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && difftrain::data::is_image_name(e.path()))
      by_stem.emplace(e.path().stem().string(), e.path());
  for (auto& r : folder.images) {
    const auto it = by_stem.find(r.path.stem().string());
    if (it == by_stem.end())
      throw difftrain::ConfigError("has no mask for " + r.path.string() + " (looked for " +
                                       r.path.stem().string() + ".png/.jpg/.webp)",
                                   where);
    r.mask = it->second;
  }
}

/// Refuses combinations that cannot work, naming the flag.
inline void check_dreambooth_flags(const DreamBoothFlags& f, const std::string& data_dir,
                                   bool enable_bucket) {
  using difftrain::ConfigError;
  if (data_dir.empty() && f.dataset_config.empty())
    throw ConfigError("names no images: give a folder or --dataset_config", "--train_data_dir");
  if (!data_dir.empty() && !f.dataset_config.empty())
    throw ConfigError("names the folders itself; leave out --train_data_dir", "--dataset_config");
  if (f.masked_loss && f.conditioning_data_dir.empty() && f.dataset_config.empty())
    throw ConfigError("needs --conditioning_data_dir (the masks)", "--masked_loss");
  if (!f.conditioning_data_dir.empty() && !f.masked_loss)
    throw ConfigError("holds masks; add --masked_loss", "--conditioning_data_dir");
  if (f.with_prior_preservation) {
    if (f.class_data_dir.empty())
      throw ConfigError("needs --class_data_dir (the class images' folder)",
                        "--with_prior_preservation");
    if (f.class_prompt.empty())
      throw ConfigError("needs --class_prompt", "--with_prior_preservation");
    if (enable_bucket)
      throw ConfigError(
          "pairs every instance image with a class image of the same size; it takes one "
          "resolution, not --enable_bucket",
          "--with_prior_preservation");
  } else if (!f.class_data_dir.empty() || !f.class_prompt.empty()) {
    throw ConfigError("goes with --with_prior_preservation",
                      f.class_data_dir.empty() ? "--class_prompt" : "--class_data_dir");
  }
}

/// The training images of a run and each record's loss weight (empty: all 1).
struct TrainingImages {
  difftrain::data::ImageFolder folder;
  std::vector<float> weights;
};

/// kohya's dataset config as one folder of records: each subset scanned with its caption
/// extension, an image without a caption file captioned with the subset's class tokens (empty
/// without them, as kohya), repeated num_repeats times; regularization subsets repeated to as
/// many as the training images (kohya's rule) and weighted by `prior_loss_weight`. The dataset's
/// settings (batch size, resolution, buckets) and the subsets' caption options, flips and crops
/// become the run's (`s`): difftrain trains one dataset with one set of them per run.
template <class Settings>
TrainingImages images_from_dataset_config(Settings& s, const DreamBoothFlags& f, bool say) {
  namespace data = difftrain::data;
  using difftrain::ConfigError;
#ifndef DIFFTRAIN_EXAMPLES_HAVE_TOML
  (void)s, (void)say;
  throw ConfigError("needs toml++ (Debian: libtomlplusplus-dev), which this build lacks",
                    "--dataset_config " + f.dataset_config);
#else
  const data::DatasetConfig config = data::read_dataset_config(f.dataset_config, s.kohya.captions);
  if (config.datasets.size() != 1)
    throw ConfigError("has " + std::to_string(config.datasets.size()) +
                          " [[datasets]]; difftrain trains one per run (put the subsets in one)",
                      f.dataset_config);
  const data::DatasetBlueprint& d = config.datasets.front();
  if (d.batch_size) s.train_batch_size = *d.batch_size;
  if (d.resolution) s.resolution = *d.resolution;
  if (d.enable_bucket) s.enable_bucket = *d.enable_bucket;
  if (d.bucket_no_upscale) s.bucket_no_upscale = *d.bucket_no_upscale;
  if (d.min_bucket_reso) s.min_bucket_reso = *d.min_bucket_reso;
  if (d.max_bucket_reso) s.max_bucket_reso = *d.max_bucket_reso;
  if (d.bucket_reso_steps) s.bucket_reso_steps = *d.bucket_reso_steps;
  const data::DatasetSubsetConfig& first = d.subsets.front();
  for (const auto& sub : d.subsets) {
    if (sub.captions != first.captions)
      throw ConfigError(
          "has other caption options than the first subset; difftrain applies one set per run "
          "(put them in [general] or the dataset)",
          sub.where);
    if (sub.flip_aug != first.flip_aug || sub.random_crop != first.random_crop)
      throw ConfigError("has another flip_aug or random_crop than the first subset", sub.where);
    if (sub.alpha_mask != first.alpha_mask)
      throw ConfigError("has another alpha_mask than the first subset", sub.where);
    if (sub.conditioning_data_dir.empty() != first.conditioning_data_dir.empty())
      throw ConfigError(
          "has conditioning (mask) images where the first subset has none, or none where it has",
          sub.where);
  }
  if (first.alpha_mask) s.alpha_mask = true;
  if (!first.conditioning_data_dir.empty()) s.masked_loss = true;
  s.kohya.captions = first.captions;
  s.random_flip = first.flip_aug;
  s.center_crop = !first.random_crop;  // kohya crops at the center unless random_crop

  TrainingImages out;
  std::vector<data::ImageRecord> regs;
  std::int64_t train_count = 0;
  for (const auto& sub : d.subsets) {
    data::ImageFolderOptions fo;
    fo.sidecar_extensions = {sub.caption_extension};
    fo.kohya_repeat_folders = false;
    data::ImageFolder part = data::scan_image_folder(sub.image_dir, fo);
    if (part.images.empty())
      throw ConfigError("'image_dir' " + sub.image_dir.string() + " holds no images", sub.where);
    if (!sub.conditioning_data_dir.empty())
      attach_masks(part, sub.conditioning_data_dir, sub.where);
    std::size_t by_tokens = 0;
    for (auto& r : part.images) {
      if (r.caption_source == "filename" || r.caption_source == "folder") {
        r.caption = sub.class_tokens;  // kohya's caption for an image without a caption file
        r.caption_source = "class_tokens";
        ++by_tokens;
      }
      r.repeats = sub.num_repeats;
      if (sub.is_reg) {
        regs.push_back(std::move(r));
      } else {
        train_count += r.repeats;
        out.folder.images.push_back(std::move(r));
      }
    }
    if (say) {
      for (const auto& skipped : part.skipped)
        std::fprintf(stderr, "skipped %s: %s\n", skipped.path.string().c_str(),
                     skipped.reason.c_str());
      std::fprintf(stderr, "%s: %zu %simages × %lld, %zu captioned \"%s\" (no %s file)\n",
                   sub.image_dir.string().c_str(), part.images.size(),
                   sub.is_reg ? "regularization " : "", static_cast<long long>(sub.num_repeats),
                   by_tokens, sub.class_tokens.c_str(), sub.caption_extension.c_str());
    }
    out.folder.skipped.insert(out.folder.skipped.end(), part.skipped.begin(), part.skipped.end());
  }
  if (out.folder.images.empty())
    throw ConfigError("has only regularization subsets (is_reg); add the training images",
                      f.dataset_config);
  out.weights.assign(out.folder.images.size(), 1.0F);
  // kohya's DreamBoothDataset: regularization images registered in turn until they count as many
  // as the training images, then one more repeat each in turn.
  std::int64_t n = 0;
  std::size_t registered = 0;
  for (bool first_loop = true; !regs.empty() && n < train_count; first_loop = false) {
    for (std::size_t i = 0; i < regs.size(); ++i) {
      if (first_loop) {
        n += regs[i].repeats;
        registered = i + 1;
      } else {
        regs[i].repeats += 1;
        n += 1;
      }
      if (n >= train_count) break;
    }
  }
  for (std::size_t i = 0; i < registered; ++i) {
    out.folder.images.push_back(regs[i]);
    out.weights.push_back(static_cast<float>(f.prior_loss_weight));
  }
  if (say && !regs.empty())
    std::fprintf(stderr,
                 "%zu regularization images (%lld with repeats) beside %lld training images, "
                 "loss weight %g\n",
                 registered, static_cast<long long>(n), static_cast<long long>(train_count),
                 f.prior_loss_weight);
  return out;
#endif
}

/// Fills `f.class_data_dir` up to --num_class_images with images of --class_prompt drawn by the
/// model (as diffusers' script does before training: `sample_batch_size` at a time, named
/// "<index>-<hash>.png"); returns how many it drew.
inline std::int64_t generate_class_images(sd::Pipeline& p,
                                          const difftrain::diffusion::NoiseSchedule& schedule,
                                          const DreamBoothFlags& f, std::int64_t resolution,
                                          std::int64_t steps, double guidance, std::uint64_t seed,
                                          at::Device device, bool say) {
  namespace fs = std::filesystem;
  const fs::path dir(f.class_data_dir);
  fs::create_directories(dir);
  std::int64_t have = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && difftrain::data::is_image_name(e.path())) ++have;
  const std::int64_t missing = f.num_class_images - have;
  if (missing <= 0) return 0;
  if (say)
    std::fprintf(stderr, "drawing %lld class images of \"%s\" into %s\n",
                 static_cast<long long>(missing), f.class_prompt.c_str(), dir.string().c_str());
  std::int64_t drawn = 0;
  for (std::int64_t batch = 0; drawn < missing; ++batch) {
    sd::ValidationOptions vo;
    vo.prompts = {f.class_prompt};
    vo.images_per_prompt = std::min(f.sample_batch_size, missing - drawn);
    vo.resolution = resolution;
    vo.num_inference_steps = steps;
    vo.guidance_scale = guidance;
    vo.seed = seed + 1'000'003 * static_cast<std::uint64_t>(batch + 1);
    sd::Validation draw{&vo, &p, &schedule, device};
    const at::Tensor images = draw.images();
    for (std::int64_t i = 0; i < images.size(0); ++i, ++drawn) {
      const auto rgb =
          difftrain::io::image_grid(images[i].unsqueeze(0), {.columns = 1, .padding = 0});
      const std::string hash = difftrain::io::sha256_hex(
          std::string_view(reinterpret_cast<const char*>(rgb.pixels.data()), rgb.pixels.size()));
      difftrain::io::write_png(
          dir / (std::to_string(have + drawn) + "-" + hash.substr(0, 40) + ".png"), rgb);
    }
  }
  return drawn;
}

/// diffusers' class images beside `instances`: record k is class image k mod n (the instance's
/// index modulo the class images, as its DreamBoothDataset pairs them), captioned with the class
/// prompt, with the instance's repeats, so a loader over both folders with the same seed gives
/// each instance batch its class batch.
inline difftrain::data::ImageFolder aligned_class_folder(
    const difftrain::data::ImageFolder& instances, const difftrain::data::ImageFolder& classes,
    const std::string& class_prompt) {
  if (classes.images.empty())
    throw difftrain::ConfigError("holds no class images", "--class_data_dir");
  difftrain::data::ImageFolder out;
  for (std::size_t k = 0; k < instances.images.size(); ++k) {
    difftrain::data::ImageRecord r = classes.images[k % classes.images.size()];
    r.caption = class_prompt;
    r.caption_source = "class_prompt";
    r.repeats = instances.images[k].repeats;
    out.images.push_back(std::move(r));
  }
  return out;
}

}  // namespace examples
