#pragma once
// What the image families of finetune_transformer (SD3, Flux) share: a batch of latents with
// their captions' conditioning, each caption encoded once by the frozen encoders, and the run's
// batches as a function of their place in the run.

#include "run_common.hpp"

namespace {

/// Latents (B, C, h, w) with their captions' text states (B, T, D) and pooled vectors (B, P).
struct TextImageBatch {
  at::Tensor latents, embeds, pooled;
  [[nodiscard]] std::int64_t size() const { return latents.size(0); }
  [[nodiscard]] TextImageBatch slice(std::int64_t start, std::int64_t length) const {
    return {latents.narrow(0, start, length), embeds.narrow(0, start, length),
            pooled.narrow(0, start, length)};
  }
};

/// One caption's (text states, pooled vector), from a family's frozen encoders.
using CaptionEncoder = std::function<std::pair<at::Tensor, at::Tensor>(const std::string&)>;

/// Each caption's conditioning, encoded once (text-encoder output caching, as diffusers' and
/// kohya's --cache_text_encoder_outputs) and kept in host memory.
class CaptionConditioning {
 public:
  explicit CaptionConditioning(CaptionEncoder encode) : encode_(std::move(encode)) {}
  /// (embeds, pooled) for `captions`, stacked, on `device`; kept for the next time unless
  /// `remember` is false (captions that change every step: kohya's shuffling and dropout).
  std::pair<at::Tensor, at::Tensor> operator()(const std::vector<std::string>& captions,
                                               at::Device device, bool remember = true) {
    std::vector<at::Tensor> embeds, pooled;
    for (const auto& c : captions) {
      auto it = known_.find(c);
      std::pair<at::Tensor, at::Tensor> e;
      if (it != known_.end()) {
        e = it->second;
      } else {
        // One caption at a time: a matrix product's last bits depend on the batch it is in, and
        // a resumed run meets its captions in other batches than the uninterrupted one.
        at::NoGradGuard no_grad;
        const auto [states, vector] = encode_(c);
        e = {states.cpu(), vector.cpu()};
        if (remember) known_[c] = e;
      }
      embeds.push_back(e.first);
      pooled.push_back(e.second);
    }
    return {at::stack(embeds).to(device), at::stack(pooled).to(device)};
  }
  [[nodiscard]] std::size_t cached() const { return known_.size(); }

 private:
  CaptionEncoder encode_;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> known_;
};

/// The run's batches as a function of the micro-batch's place in the run (a resumed run sees the
/// batches the uninterrupted one would have).
class BatchStream {
 public:
  BatchStream(const Settings& s, Vae& vae, const data::ImageFolder& folder,
              const data::BucketManager& buckets, CaptionConditioning text, at::Device device)
      : s_(s),
        vae_(vae),
        folder_(folder),
        buckets_(buckets),
        text_(std::move(text)),
        device_(device) {
    std::vector<data::Bucket> assigned;
    std::vector<std::int64_t> repeats;
    for (const auto& r : folder.images) {
      assigned.push_back(buckets.select(r.width, r.height).bucket);
      repeats.push_back(r.repeats);
    }
    per_epoch_ = data::bucket_batches(assigned, repeats,
                                      static_cast<std::size_t>(s.train_batch_size), s.seed, 0)
                     .size();
  }
  [[nodiscard]] std::size_t batches_per_epoch() const { return per_epoch_; }

  TextImageBatch at_place(std::int64_t place) {
    const auto epoch = static_cast<std::uint64_t>(place) / per_epoch_;
    const auto pos = static_cast<std::size_t>(static_cast<std::uint64_t>(place) % per_epoch_);
    if (!pixels_ || epoch != epoch_ || pixels_->position() != pos) {
      data::ImageBatchOptions o;
      o.batch_size = static_cast<std::size_t>(s_.train_batch_size);
      o.random_crop = !s_.center_crop;
      o.flip_p = s_.random_flip ? 0.5 : 0.0;
      o.seed = s_.seed;
      o.workers = static_cast<std::size_t>(s_.dataloader_num_workers);
      o.pin_memory = device_.is_cuda();
      pixels_.emplace(folder_, buckets_, o, epoch, pos);
    }
    epoch_ = epoch;
    data::ImageBatch i = *pixels_->next();
    TextImageBatch b;
    {
      at::NoGradGuard no_grad;
      b.latents = vae_->encode_latents(i.pixels.to(device_, /*non_blocking=*/true));
    }
    // kohya's caption options, each time an image is used (epochs counted from 1, as kohya does).
    const bool varied = s_.kohya.captions.any();
    const std::vector<std::string> captions = examples::processed_captions(
        std::move(i.captions), s_.kohya, static_cast<std::uint64_t>(s_.seed), place,
        static_cast<std::int64_t>(epoch) + 1, place / s_.gradient_accumulation_steps,
        s_.max_train_steps);
    std::tie(b.embeds, b.pooled) = text_(captions, device_, !varied);
    return b;
  }
  CaptionConditioning& text() { return text_; }

 private:
  const Settings& s_;
  Vae& vae_;
  const data::ImageFolder& folder_;
  const data::BucketManager& buckets_;
  CaptionConditioning text_;
  at::Device device_;
  std::size_t per_epoch_ = 1;
  std::uint64_t epoch_ = 0;
  std::optional<data::ImageBatches> pixels_;
};

}  // namespace
