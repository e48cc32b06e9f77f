#pragma once
// The training folder as every program that trains on one reads and reports it: each skipped file
// and why, one line "N images (M with repeats), K skipped", and when some images have no caption
// of their own, how many and what stands in for them (their file name, their kohya folder's
// words), or, with --require_captions, a refusal naming the first of them.

#include <difftrain/core/error.hpp>
#include <difftrain/data/image_folder.hpp>

#include <cstdint>
#include <cstdio>
#include <string>

namespace examples {

struct TrainingFolderReport {
  bool say = true;                ///< print (rank 0 of a torchrun launch)
  std::int64_t limit = 0;         ///< keep only the first N images (--max_train_samples); 0: all
  bool require_captions = false;  ///< refuse images without a caption of their own
};

inline difftrain::data::ImageFolder scan_training_folder(
    const std::string& dir, const difftrain::data::ImageFolderOptions& fo,
    const TrainingFolderReport& r) {
  namespace data = difftrain::data;
  data::ImageFolder folder = data::scan_image_folder(dir, fo);
  if (r.say)
    for (const auto& skipped : folder.skipped)
      std::fprintf(stderr, "skipped %s: %s\n", skipped.path.string().c_str(),
                   skipped.reason.c_str());
  if (r.limit > 0 && static_cast<std::int64_t>(folder.images.size()) > r.limit)
    folder.images.resize(static_cast<std::size_t>(r.limit));
  std::size_t by_name = 0, by_folder = 0;
  const data::ImageRecord* first = nullptr;
  for (const auto& image : folder.images)
    if (image.caption_source == "filename" || image.caption_source == "folder") {
      (image.caption_source == "filename" ? by_name : by_folder) += 1;
      if (first == nullptr) first = &image;
    }
  if (r.require_captions && first != nullptr)
    throw difftrain::ConfigError(
        std::to_string(by_name + by_folder) + " of " + std::to_string(folder.images.size()) +
            " images have no caption of their own (no metadata row, no .txt or .caption beside "
            "them), " +
            first->path.string() + " first; give them captions or leave out --require_captions",
        dir);
  if (r.say) {
    std::fprintf(stderr, "%zu images (%lld with repeats), %zu skipped\n", folder.images.size(),
                 static_cast<long long>(folder.epoch_size()), folder.skipped.size());
    if (by_name + by_folder > 0)
      std::fprintf(stderr,
                   "%zu images have no caption of their own: %zu train under their file names, "
                   "%zu under their folder's words (--require_captions refuses them)\n",
                   by_name + by_folder, by_name, by_folder);
  }
  return folder;
}

}  // namespace examples
