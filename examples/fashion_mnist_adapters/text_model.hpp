#pragma once
// The adapters example's base model, conditioned as Stable Diffusion is: a caption goes through a
// CLIP tokenizer and a small CLIPTextModel (difftrain's, transformers' parameter names), and the
// UNet reads the encoder's last hidden states only through cross-attention, at 14×14 and in the
// 7×7 middle block; there is no class embedding. A new concept can then only come in through the
// text path: a textual-inversion embedding (token vectors), a hypernetwork (the keys and values
// every cross-attention reads from the text) or LoRA (the attention projections).
//
// No pretrained CLIP is at hand, so the encoder trains together with the UNet on the nine known
// classes' captions and is frozen afterwards, standing in for SD's frozen encoder. Its tokenizer is
// a byte-level BPE built from the captions' words (each word one token, every byte a fallback
// token), written as a transformers tokenizer folder (vocab.json, merges.txt) that
// `CLIPTokenizer.from_pretrained` reads. The held-out class's words are in the vocabulary but in
// no training caption: the UNet never learned what they mean.

#include <difftrain/models/clip_text_model.hpp>
#include <difftrain/text/clip_tokenizer.hpp>
#include <difftrain/text/webui_conditioning.hpp>
#include <difftrain/text/webui_prompt.hpp>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../common/prompt_templates.hpp"
#include "../fashion_mnist/data.hpp"
#include "../fashion_mnist/denoiser.hpp"

namespace fmtext {

namespace dt = difftrain;
using Encoder = dt::models::CLIPTextModel<>;

/// The words a caption uses for class c: "T-shirt/top" → "t-shirt", "Ankle boot" → "ankle boot".
inline std::string class_words(std::int64_t c) {
  std::string w = fmnist::kClassNames[static_cast<std::size_t>(c)];
  w = w.substr(0, w.find('/'));
  for (char& ch : w) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return w;
}

/// The caption templates ("{}" is the class's words): diffusers' imagenet_templates_small, the
/// textual-inversion script's "object" prompts. Training draws one per image; the adjectives give
/// the encoder more words than the class names, as a pretrained encoder has.
inline const std::vector<std::string>& caption_templates() {
  return examples::textual_inversion_templates(false);
}

inline std::string fill_template(const std::string& t, const std::string& words) {
  std::string out = t;
  out.replace(out.find("{}"), 2, words);
  return out;
}

/// CLIP's pre-tokenizer on ASCII text: runs of letters, single digits, runs of other non-space
/// characters (enough for the captions this example writes; the tokenizer class runs the real one).
inline std::vector<std::string> ascii_pieces(const std::string& text) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i < text.size()) {
    const auto kind = [&](std::size_t k) {
      const auto ch = static_cast<unsigned char>(text[k]);
      return std::isspace(ch) ? 0 : std::isalpha(ch) ? 1 : std::isdigit(ch) ? 2 : 3;
    };
    const int k = kind(i);
    std::size_t j = i + 1;
    if (k == 1 || k == 3)
      while (j < text.size() && kind(j) == k) ++j;
    if (k != 0) {
      std::string piece = text.substr(i, j - i);
      for (char& ch : piece) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      out.push_back(piece);
    }
    i = j;
  }
  return out;
}

/// Writes a CLIP tokenizer folder whose vocabulary is the byte-level alphabet (each byte alone and
/// word-final), one token per word of `texts` and CLIP's start and end tokens; the merges join
/// each word left to right, appended after the merges earlier words made, so a word's own chain
/// always completes (a byte-pair encoder applies merges by rank).
inline void write_caption_tokenizer(const std::filesystem::path& dir,
                                    const std::vector<std::string>& texts) {
  const auto alphabet = dt::text::clip_detail::byte_alphabet();
  std::vector<std::string> vocab;
  for (const char32_t c : alphabet) vocab.push_back(dt::text::u32_to_utf8(std::u32string(1, c)));
  for (std::size_t i = 0; i < 256; ++i) vocab.push_back(vocab[i] + "</w>");
  std::vector<std::pair<std::string, std::string>> merges;
  std::map<std::pair<std::string, std::string>, std::size_t> rank;
  std::map<std::string, bool> seen;
  for (const auto& text : texts)
    for (const auto& word : ascii_pieces(text)) {
      if (seen[word]) continue;
      seen[word] = true;
      std::vector<std::string> symbols;  // ASCII letters and marks are their own byte symbols
      for (const char ch : word) symbols.emplace_back(1, ch);
      symbols.back() += "</w>";
      // Byte-pair encoding with the merges so far: the lowest-ranked adjacent pair first.
      for (;;) {
        std::size_t best = merges.size(), at = 0;
        for (std::size_t k = 0; k + 1 < symbols.size(); ++k) {
          const auto it = rank.find({symbols[k], symbols[k + 1]});
          if (it != rank.end() && it->second < best) best = it->second, at = k;
        }
        if (best == merges.size()) break;
        symbols[at] += symbols[at + 1];
        symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(at) + 1);
      }
      while (symbols.size() > 1) {  // then this word's own chain, left to right
        const std::pair<std::string, std::string> m{symbols[0], symbols[1]};
        rank.emplace(m, merges.size());
        merges.push_back(m);
        vocab.push_back(m.first + m.second);
        symbols[0] += symbols[1];
        symbols.erase(symbols.begin() + 1);
      }
    }
  vocab.emplace_back("<|startoftext|>");
  vocab.emplace_back("<|endoftext|>");
  nlohmann::json v = nlohmann::json::object();
  for (std::size_t i = 0; i < vocab.size(); ++i) v[vocab[i]] = i;
  std::string m = "#version: 0.2\n";
  for (const auto& [a, b] : merges) m += a + " " + b + "\n";
  const nlohmann::json config = {{"model_max_length", 77},
                                 {"bos_token", "<|startoftext|>"},
                                 {"eos_token", "<|endoftext|>"},
                                 {"pad_token", "<|endoftext|>"},
                                 {"unk_token", "<|endoftext|>"},
                                 {"do_lower_case", true},
                                 {"tokenizer_class", "CLIPTokenizer"}};
  const nlohmann::json special = {{"bos_token", "<|startoftext|>"},
                                  {"eos_token", "<|endoftext|>"},
                                  {"pad_token", "<|endoftext|>"},
                                  {"unk_token", "<|endoftext|>"}};
  std::filesystem::create_directories(dir);
  const auto write = [&](const char* name, const std::string& text) {
    dt::io::write_file_atomic(dir / name, std::span<const char>(text.data(), text.size()));
  };
  write("vocab.json", v.dump() + "\n");
  write("merges.txt", m);
  write("tokenizer_config.json", config.dump(2) + "\n");
  write("special_tokens_map.json", special.dump(2) + "\n");
}

struct TextModelOptions {
  std::int64_t channels = 16;    ///< UNet width C (14×14: 3C/2, 7×7: 2C)
  std::int64_t text_width = 64;  ///< the encoder's hidden size = cross_attention_dim
  std::int64_t text_layers = 2;  ///< encoder layers
  std::int64_t text_heads = 2;   ///< encoder attention heads
  std::int64_t vocab_size = 0;   ///< the tokenizer's vocabulary
  double p_uncond = 0.1;         ///< chance a training caption becomes the empty prompt
  /// What the UNet predicts, and min-SNR-γ weighting (0: none): the main job's v with γ = 5
  /// reaches in 700 steps what ε reaches in 1,200 (docs/results.md).
  dt::diffusion::Prediction prediction = dt::diffusion::Prediction::v_prediction;
  double snr_gamma = 5.0;
};

/// The UNet of the main job's shape, text-only: transformers at 14×14 and 7×7 that
/// cross-attend to the encoder's states, no class embedding.
inline dt::models::UNet2DConditionConfig text_unet_config(const TextModelOptions& o) {
  dt::models::UNet2DConditionConfig u =
      fmnist::unet_config({.channels = o.channels, .attention_14 = true});
  u.num_class_embeds.reset();
  u.class_embed_type.reset();
  u.projection_class_embeddings_input_dim.reset();
  u.cross_attention_dim.assign(3, o.text_width);
  return u;
}

inline dt::models::CLIPTextConfig text_encoder_config(const TextModelOptions& o, std::int64_t bos,
                                                      std::int64_t eos) {
  dt::models::CLIPTextConfig c;
  c.vocab_size = o.vocab_size;
  c.hidden_size = o.text_width;
  c.intermediate_size = 4 * o.text_width;
  c.projection_dim = o.text_width;
  c.num_hidden_layers = o.text_layers;
  c.num_attention_heads = o.text_heads;
  c.bos_token_id = bos;
  c.eos_token_id = eos;
  c.pad_token_id = eos;
  return c;
}

class TextUNetImpl : public torch::nn::Module {
 public:
  /// Images in [-1, 1] and their captions' token ids (the web UI's chunk of 77).
  struct Batch {
    at::Tensor images;  ///< (B, 1, 28, 28)
    at::Tensor ids;     ///< (B, 77) int64
    [[nodiscard]] std::int64_t size() const { return images.size(0); }
    [[nodiscard]] Batch slice(std::int64_t start, std::int64_t length) const {
      return {images.narrow(0, start, length), ids.narrow(0, start, length)};
    }
  };

  TextUNetImpl(const TextModelOptions& o, const dt::diffusion::NoiseSchedule& schedule,
               const dt::text::CLIPTokenizer& tokenizer)
      : o_(o), schedule_(&schedule), tokenizer_(&tokenizer) {
    text_encoder = register_module(
        "text_encoder",
        Encoder(text_encoder_config(o, tokenizer.bos_token_id(), tokenizer.eos_token_id())));
    unet = register_module("unet", fmnist::Model(text_unet_config(o), "fmtext::TextUNet"));
    fmnist::zero_residual_branches(*unet);
    null_ids_ = tokens("").view({1, -1});
  }

  [[nodiscard]] const TextModelOptions& options() const { return o_; }

  /// A prompt's token ids as the web UI chunks them (start, up to 75 tokens, end, end padding).
  [[nodiscard]] at::Tensor tokens(const std::string& prompt) const {
    const auto p = dt::text::tokenize_prompt(*tokenizer_, prompt);
    if (p.chunks.size() != 1)
      throw dt::ConfigError("is longer than one chunk of 75 tokens", "prompt '" + prompt + "'");
    return at::tensor(p.chunks.front().tokens, at::kLong);
  }

  /// The conditioning of prompts, as the web UI computes it; `vectors` gives the embeddings that
  /// `finder` places into the prompts.
  at::Tensor encode(const std::vector<std::string>& prompts,
                    const dt::text::EmbeddingFinder& finder = {},
                    const dt::text::EmbeddingVectors& vectors = {}) {
    std::vector<dt::text::TokenizedPrompt> tp;
    for (const auto& p : prompts)
      tp.push_back(dt::text::tokenize_prompt(*tokenizer_, p, {}, finder));
    return dt::text::encode_webui_prompts(text_encoder, tp, {}, vectors);
  }

  /// The prediction for noisy images x at timesteps t (B,) under text states ctx (B, L, width).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& t, const at::Tensor& ctx) {
    if (x.dim() != 4 || x.size(1) != 1 || x.size(2) != 28 || x.size(3) != 28)
      throw dt::ShapeError("expects (B, 1, 28, 28) images, got " + c10::str(x.sizes()), "TextUNet");
    return unet->forward(x, t.to(x.device()), ctx);
  }

  /// The denoising loss of clean images x0 under text states ctx: uniform timesteps, the
  /// prediction type's target, min-SNR-γ weights per sample when γ > 0.
  at::Tensor context_loss(const at::Tensor& x0, const at::Tensor& ctx) {
    const auto dev = at::TensorOptions().device(x0.device());
    const at::Tensor t = schedule_->sample_timesteps(x0.size(0), dev);
    const at::Tensor noise = at::randn_like(x0);
    const at::Tensor xt = schedule_->add_noise(x0, noise, t);
    const at::Tensor pred = forward(xt, t, ctx);
    const at::Tensor target = schedule_->target(o_.prediction, x0, noise, t);
    if (o_.snr_gamma <= 0) return at::mse_loss(pred, target);
    const at::Tensor weights = dt::diffusion::min_snr_weights(
        schedule_->snr(t).to(pred.device(), at::kFloat), o_.snr_gamma, o_.prediction);
    return ((pred - target).square().mean({1, 2, 3}) * weights).mean();
  }

  /// The loss of a captioned batch: captions dropped to the empty prompt with p_uncond, encoded
  /// (the encoder trains when its weights require gradients), then the denoising loss.
  at::Tensor loss(const Batch& batch) {
    at::Tensor ids = batch.ids.to(batch.images.device());
    if (o_.p_uncond > 0) {
      const at::Tensor drop =
          at::rand({ids.size(0), 1}, ids.options().dtype(at::kFloat)) < o_.p_uncond;
      ids = at::where(drop, null_ids_.to(ids.device()), ids);
    }
    return context_loss(batch.images, text_encoder->forward(ids).last_hidden_state);
  }

  void set_p_uncond(double p) { o_.p_uncond = p; }

  Encoder text_encoder{nullptr};
  fmnist::Model unet{nullptr};

 private:
  TextModelOptions o_;
  const dt::diffusion::NoiseSchedule* schedule_;
  const dt::text::CLIPTokenizer* tokenizer_;
  at::Tensor null_ids_;
};
TORCH_MODULE(TextUNet);

}  // namespace fmtext
