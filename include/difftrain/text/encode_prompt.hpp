#pragma once
// Prompts to conditioning as diffusers' pipelines compute it (encode_prompt of
// StableDiffusionPipeline and StableDiffusionXLPipeline, diffusers 0.42):
//
//   SD 1.x / 2.x  ids padded and truncated to the tokenizer's model_max_length; the encoder's
//                 last_hidden_state, or with clip_skip n the hidden state n + 1 from the end
//                 through the final LayerNorm; the negative prompt ("" when none) encoded the
//                 same way but without clip_skip.
//   SDXL          both encoders' hidden states at -2 (or -(clip_skip + 2)), no final LayerNorm,
//                 concatenated along the width; the pooled output is the second encoder's
//                 text_embeds; with no negative prompt and force_zeros_for_empty_prompt the
//                 negative embeddings are zeros, else the negative prompt ("" when none, the
//                 second encoder reading negative_prompt_2 when given) encoded the same way.
//
//   SD3 / Flux    T5's part (_get_t5_prompt_embeds): ids padded and truncated to
//                 max_sequence_length (SD3 256, Flux 512), the encoder's last_hidden_state with
//                 no attention mask.
//   SD3           (StableDiffusion3Pipeline) both CLIP encoders' hidden states at -2 (or
//                 -(clip_skip + 2)) side by side, zero-padded to T5's width and followed by T5's
//                 tokens (zeros of joint_attention_dim when the pipeline has no T5); the pooled
//                 output is both encoders' text_embeds side by side; the negative prompt ("" when
//                 none) the same way without clip_skip.
//
// Each prompt's embeddings are repeated num_images_per_prompt times, consecutively. Prompts naming
// a multi-vector textual-inversion token are expanded first, as diffusers does.

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/clip_text_model.hpp"
#include "difftrain/text/clip_tokenizer.hpp"
#include "difftrain/text/t5_tokenizer.hpp"
#include "difftrain/text/textual_inversion.hpp"

namespace difftrain::text {

struct EncodePromptOptions {
  std::int64_t num_images_per_prompt = 1;
  bool do_classifier_free_guidance = true;
  /// One per prompt, or one for all; none: "" (SD), zeros or "" (SDXL, by
  /// force_zeros_for_empty_prompt).
  std::optional<std::vector<std::string>> negative_prompt;
  std::optional<std::int64_t> clip_skip;
  /// SDXL: what the second tokenizer and encoder read (default: prompt / negative_prompt).
  std::optional<std::vector<std::string>> prompt_2, negative_prompt_2;
  /// SDXL pipelines' config flag (true in SDXL base's model_index.json).
  bool force_zeros_for_empty_prompt = true;
};

/// What encode_prompt returns; the pooled tensors are SDXL's (undefined for SD), the negative
/// ones undefined without guidance.
struct EncodedPrompt {
  at::Tensor prompt_embeds, negative_prompt_embeds;
  at::Tensor pooled_prompt_embeds, negative_pooled_prompt_embeds;
};

namespace encode_detail {

inline std::vector<std::string> negatives(const std::optional<std::vector<std::string>>& given,
                                          std::size_t batch, const char* what) {
  if (!given) return std::vector<std::string>(batch, "");
  if (given->size() == 1) return std::vector<std::string>(batch, given->front());
  if (given->size() != batch)
    throw ConfigError(std::string(what) + " has " + std::to_string(given->size()) +
                          " entries for " + std::to_string(batch) +
                          " prompts (give one, or one per prompt)",
                      "encode_prompt");
  return *given;
}

/// (B, …) → (B · n, …), each row repeated n times in a row.
inline at::Tensor per_image(const at::Tensor& t, std::int64_t n) {
  return n == 1 ? t : t.repeat_interleave(n, 0);
}

template <class Encoder>
at::Tensor ids_for(const CLIPTokenizer& tok, Encoder& encoder,
                   const std::vector<std::string>& texts, std::int64_t max_length) {
  // Checked before anything is padded to it: a tokenizer_config.json's model_max_length of 1e9
  // would otherwise allocate its rows first and fail later in the encoder.
  const std::int64_t positions = encoder->config().max_position_embeddings;
  if (max_length > positions)
    throw ConfigError("prompts padded to " + std::to_string(max_length) +
                          " tokens (the tokenizer's model_max_length) do not fit the text "
                          "encoder's " +
                          std::to_string(positions) + " positions (max_position_embeddings)",
                      "encode_prompt");
  EncodeOptions o;
  o.max_length = max_length;
  // Prompts naming a multi-vector textual-inversion token get all its tokens (diffusers'
  // maybe_convert_prompt, which its pipelines run on every prompt, negatives included).
  std::vector<std::string> converted;
  for (const auto& t : texts) converted.push_back(convert_prompt(tok, t));
  const BatchEncoding b = tok(converted, o);
  std::vector<std::int64_t> flat;
  for (const auto& row : b.input_ids) flat.insert(flat.end(), row.begin(), row.end());
  return at::tensor(flat, at::kLong)
      .view({static_cast<std::int64_t>(texts.size()), -1})
      .to(encoder->token_embedding->weight.device());
}

template <class Encoder>
void check_skip(const std::optional<std::int64_t>& clip_skip, Encoder& encoder,
                std::int64_t extra) {
  if (!clip_skip) return;
  const std::int64_t layers = encoder->config().num_hidden_layers;
  if (*clip_skip < 0 || *clip_skip + extra > layers)
    throw ConfigError("clip_skip " + std::to_string(*clip_skip) + " reaches past the encoder's " +
                          std::to_string(layers) + " layers",
                      "encode_prompt");
}

template <class Encoder>
at::Tensor hidden_from_end(Encoder& encoder, const at::Tensor& ids, std::int64_t from_end,
                           at::Tensor* pooled = nullptr) {
  const models::CLIPTextOutput out = encoder->forward(ids, std::nullopt, true);
  if (pooled != nullptr) *pooled = out.text_embeds;
  return out.hidden_states[out.hidden_states.size() - static_cast<std::size_t>(from_end)];
}

}  // namespace encode_detail

/// SD 1.x / 2.x: one tokenizer and CLIPTextModel.
template <class Encoder>
EncodedPrompt encode_prompt(const CLIPTokenizer& tok, Encoder& encoder,
                            const std::vector<std::string>& prompts,
                            const EncodePromptOptions& o = {}) {
  if (prompts.empty()) throw ConfigError("no prompts", "encode_prompt");
  if (o.num_images_per_prompt < 1)
    throw ConfigError("num_images_per_prompt must be at least 1", "encode_prompt");
  encode_detail::check_skip(o.clip_skip, encoder, 1);
  const std::int64_t max_len = tok.model_max_length();
  EncodedPrompt out;
  const at::Tensor ids = encode_detail::ids_for(tok, encoder, prompts, max_len);
  if (!o.clip_skip) {
    out.prompt_embeds = encoder->forward(ids).last_hidden_state;
  } else {
    out.prompt_embeds =
        encoder->final_layer_norm(encode_detail::hidden_from_end(encoder, ids, *o.clip_skip + 1));
  }
  out.prompt_embeds = encode_detail::per_image(out.prompt_embeds, o.num_images_per_prompt);
  if (o.do_classifier_free_guidance) {
    const auto neg = encode_detail::negatives(o.negative_prompt, prompts.size(), "negative_prompt");
    const at::Tensor neg_ids = encode_detail::ids_for(tok, encoder, neg, out.prompt_embeds.size(1));
    out.negative_prompt_embeds = encode_detail::per_image(
        encoder->forward(neg_ids).last_hidden_state, o.num_images_per_prompt);
  }
  return out;
}

/// SDXL: CLIPTextModel and CLIPTextModelWithProjection, each with its tokenizer.
template <class Encoder1, class Encoder2>
EncodedPrompt encode_prompt_sdxl(const CLIPTokenizer& tok1, Encoder1& enc1,
                                 const CLIPTokenizer& tok2, Encoder2& enc2,
                                 const std::vector<std::string>& prompts,
                                 const EncodePromptOptions& o = {}) {
  if (prompts.empty()) throw ConfigError("no prompts", "encode_prompt_sdxl");
  if (o.num_images_per_prompt < 1)
    throw ConfigError("num_images_per_prompt must be at least 1", "encode_prompt_sdxl");
  if (!enc2->config().with_projection)
    throw ConfigError(
        "the second text encoder must be a CLIPTextModelWithProjection (its "
        "text_embeds are SDXL's pooled conditioning)",
        "encode_prompt_sdxl");
  encode_detail::check_skip(o.clip_skip, enc1, 2);
  encode_detail::check_skip(o.clip_skip, enc2, 2);
  const std::int64_t from_end = o.clip_skip ? *o.clip_skip + 2 : 2;
  const std::vector<std::string> prompts_2 =
      o.prompt_2 ? encode_detail::negatives(o.prompt_2, prompts.size(), "prompt_2") : prompts;
  EncodedPrompt out;
  at::Tensor pooled;
  const at::Tensor h1 = encode_detail::hidden_from_end(
      enc1, encode_detail::ids_for(tok1, enc1, prompts, tok1.model_max_length()), from_end);
  const at::Tensor h2 = encode_detail::hidden_from_end(
      enc2, encode_detail::ids_for(tok2, enc2, prompts_2, tok2.model_max_length()), from_end,
      &pooled);
  if (h1.size(1) != h2.size(1))
    throw ShapeError("the two tokenizers give " + std::to_string(h1.size(1)) + " and " +
                         std::to_string(h2.size(1)) + " positions; they must agree",
                     "encode_prompt_sdxl");
  out.prompt_embeds =
      encode_detail::per_image(at::cat({h1, h2.to(h1.scalar_type())}, -1), o.num_images_per_prompt);
  out.pooled_prompt_embeds = encode_detail::per_image(pooled, o.num_images_per_prompt);
  if (!o.do_classifier_free_guidance) return out;
  if (!o.negative_prompt && o.force_zeros_for_empty_prompt) {
    out.negative_prompt_embeds = at::zeros_like(out.prompt_embeds);
    out.negative_pooled_prompt_embeds = at::zeros_like(out.pooled_prompt_embeds);
    return out;
  }
  const auto neg = encode_detail::negatives(o.negative_prompt, prompts.size(), "negative_prompt");
  const auto neg_2 =
      o.negative_prompt_2
          ? encode_detail::negatives(o.negative_prompt_2, prompts.size(), "negative_prompt_2")
          : neg;
  const std::int64_t len = h1.size(1);
  at::Tensor neg_pooled;
  const at::Tensor n1 =
      encode_detail::hidden_from_end(enc1, encode_detail::ids_for(tok1, enc1, neg, len), 2);
  const at::Tensor n2 = encode_detail::hidden_from_end(
      enc2, encode_detail::ids_for(tok2, enc2, neg_2, len), 2, &neg_pooled);
  out.negative_prompt_embeds =
      encode_detail::per_image(at::cat({n1, n2.to(n1.scalar_type())}, -1), o.num_images_per_prompt);
  out.negative_pooled_prompt_embeds = encode_detail::per_image(neg_pooled, o.num_images_per_prompt);
  return out;
}

/// SD3's three text encoders, as StableDiffusion3Pipeline holds them: two
/// CLIPTextModelWithProjection with their tokenizers and, optionally (null), T5 with its tokenizer.
/// Without T5 its tokens are zeros of the transformer's joint_attention_dim.
template <class ClipL, class ClipG, class T5>
struct SD3TextEncoders {
  const CLIPTokenizer& tokenizer;
  ClipL& text_encoder;
  const CLIPTokenizer& tokenizer_2;
  ClipG& text_encoder_2;
  const T5Tokenizer* tokenizer_3 = nullptr;
  T5* text_encoder_3 = nullptr;
  std::int64_t joint_attention_dim = 4096;
};

struct SD3PromptOptions {
  std::int64_t num_images_per_prompt = 1;
  bool do_classifier_free_guidance = true;
  std::optional<std::int64_t> clip_skip;
  std::int64_t max_sequence_length = 256;  // T5's tokens
  /// What the second CLIP and T5 read (default: the prompts), and the negatives (default "",
  /// the second and third defaulting to the first); one for all or one per prompt.
  std::optional<std::vector<std::string>> prompt_2, prompt_3;
  std::optional<std::vector<std::string>> negative_prompt, negative_prompt_2, negative_prompt_3;
};

/// SD3's and Flux's T5 prompt embeddings (diffusers' _get_t5_prompt_embeds): (B · n,
/// max_sequence_length, d_model), in the encoder's dtype. The pipelines pass no attention mask:
/// the padding is attended to, as the models were trained.
template <class Encoder>
at::Tensor t5_prompt_embeds(const T5Tokenizer& tokenizer, Encoder& encoder,
                            const std::vector<std::string>& prompts,
                            std::int64_t max_sequence_length = 256,
                            std::int64_t num_images_per_prompt = 1) {
  if (prompts.empty()) throw ConfigError("no prompts", "t5_prompt_embeds");
  if (max_sequence_length < 1)
    throw ConfigError(
        "max_sequence_length " + std::to_string(max_sequence_length) + " must be at least 1",
        "t5_prompt_embeds");
  if (num_images_per_prompt < 1)
    throw ConfigError("num_images_per_prompt must be at least 1", "t5_prompt_embeds");
  EncodeOptions o;
  o.max_length = max_sequence_length;
  const BatchEncoding b = tokenizer(prompts, o);
  std::vector<std::int64_t> flat;
  for (const auto& row : b.input_ids) flat.insert(flat.end(), row.begin(), row.end());
  const at::Tensor ids = at::tensor(flat, at::kLong)
                             .view({static_cast<std::int64_t>(prompts.size()), -1})
                             .to(encoder->shared->weight.device());
  return encode_detail::per_image(encoder->forward(ids).last_hidden_state, num_images_per_prompt);
}

/// StableDiffusion3Pipeline.encode_prompt: prompt_embeds (B · n, 77 + max_sequence_length,
/// T5's width) and pooled_prompt_embeds (B · n, both projection widths), and the negatives with
/// guidance.
template <class ClipL, class ClipG, class T5>
EncodedPrompt encode_prompt_sd3(const SD3TextEncoders<ClipL, ClipG, T5>& e,
                                const std::vector<std::string>& prompts,
                                const SD3PromptOptions& o = {}) {
  const std::string where = "encode_prompt_sd3";
  if (prompts.empty()) throw ConfigError("no prompts", where);
  if (o.num_images_per_prompt < 1)
    throw ConfigError("num_images_per_prompt must be at least 1", where);
  if (o.max_sequence_length < 1)
    throw ConfigError(
        "max_sequence_length " + std::to_string(o.max_sequence_length) + " must be at least 1",
        where);
  if (!e.text_encoder->config().with_projection || !e.text_encoder_2->config().with_projection)
    throw ConfigError(
        "both CLIP encoders must be CLIPTextModelWithProjection (their text_embeds "
        "are SD3's pooled conditioning)",
        where);
  if ((e.tokenizer_3 == nullptr) != (e.text_encoder_3 == nullptr))
    throw ConfigError("give T5's tokenizer and encoder together, or neither", where);
  encode_detail::check_skip(o.clip_skip, e.text_encoder, 2);
  encode_detail::check_skip(o.clip_skip, e.text_encoder_2, 2);
  const std::int64_t clip_width =
      e.text_encoder->config().hidden_size + e.text_encoder_2->config().hidden_size;
  const std::int64_t t5_width =
      e.text_encoder_3 != nullptr ? (*e.text_encoder_3)->config().d_model : e.joint_attention_dim;
  if (t5_width < clip_width)
    throw ConfigError("the CLIP encoders' widths add up to " + std::to_string(clip_width) +
                          ", more than T5's " + std::to_string(t5_width) +
                          " (the pipeline pads the CLIP tokens to T5's width)",
                      where);
  const std::size_t batch = prompts.size();
  // One side (the prompts or the negatives): (embeds, pooled) before the per-image repeat.
  auto side = [&](const std::vector<std::string>& p1, const std::vector<std::string>& p2,
                  const std::vector<std::string>& p3, std::int64_t from_end) {
    at::Tensor pooled_1, pooled_2;
    const at::Tensor h1 = encode_detail::hidden_from_end(
        e.text_encoder,
        encode_detail::ids_for(e.tokenizer, e.text_encoder, p1, e.tokenizer.model_max_length()),
        from_end, &pooled_1);
    const at::Tensor h2 =
        encode_detail::hidden_from_end(e.text_encoder_2,
                                       encode_detail::ids_for(e.tokenizer_2, e.text_encoder_2, p2,
                                                              e.tokenizer_2.model_max_length()),
                                       from_end, &pooled_2);
    if (h1.size(1) != h2.size(1))
      throw ShapeError("the two CLIP tokenizers give " + std::to_string(h1.size(1)) + " and " +
                           std::to_string(h2.size(1)) + " positions; they must agree",
                       where);
    const at::Tensor clip = at::cat({h1, h2.to(h1.scalar_type())}, -1);
    at::Tensor t5;
    if (e.text_encoder_3 != nullptr)
      t5 = t5_prompt_embeds(*e.tokenizer_3, *e.text_encoder_3, p3, o.max_sequence_length);
    else
      t5 = at::zeros({static_cast<std::int64_t>(p3.size()), o.max_sequence_length, t5_width},
                     clip.options());
    const at::Tensor padded = at::constant_pad_nd(clip, {0, t5_width - clip_width});
    return std::pair{at::cat({padded, t5.to(padded.scalar_type())}, -2),
                     at::cat({pooled_1, pooled_2.to(pooled_1.scalar_type())}, -1)};
  };
  auto or_prompts = [&](const std::optional<std::vector<std::string>>& v, const char* what) {
    return v ? encode_detail::negatives(v, batch, what) : prompts;
  };
  EncodedPrompt out;
  const std::int64_t from_end = o.clip_skip ? *o.clip_skip + 2 : 2;
  {
    auto [embeds, pooled] = side(prompts, or_prompts(o.prompt_2, "prompt_2"),
                                 or_prompts(o.prompt_3, "prompt_3"), from_end);
    out.prompt_embeds = encode_detail::per_image(embeds, o.num_images_per_prompt);
    out.pooled_prompt_embeds = encode_detail::per_image(pooled, o.num_images_per_prompt);
  }
  if (!o.do_classifier_free_guidance) return out;
  const auto neg = encode_detail::negatives(o.negative_prompt, batch, "negative_prompt");
  const auto neg_2 = o.negative_prompt_2
                         ? encode_detail::negatives(o.negative_prompt_2, batch, "negative_prompt_2")
                         : neg;
  const auto neg_3 = o.negative_prompt_3
                         ? encode_detail::negatives(o.negative_prompt_3, batch, "negative_prompt_3")
                         : neg;
  auto [embeds, pooled] = side(neg, neg_2, neg_3, 2);
  out.negative_prompt_embeds = encode_detail::per_image(embeds, o.num_images_per_prompt);
  out.negative_pooled_prompt_embeds = encode_detail::per_image(pooled, o.num_images_per_prompt);
  return out;
}

struct FluxPromptOptions {
  std::int64_t num_images_per_prompt = 1;
  std::int64_t max_sequence_length = 512;  ///< T5's tokens: dev 512, schnell 256
  /// What T5 reads (default: the prompts); one for all or one per prompt.
  std::optional<std::vector<std::string>> prompt_2;
};

/// FluxPipeline.encode_prompt: prompt_embeds (B · n, max_sequence_length, T5's width) from T5 and
/// pooled_prompt_embeds (B · n, CLIP's width) from CLIPTextModel's pooled output (the end token's
/// last hidden state), the prompts padded to CLIP's 77 tokens. The text ids are zeros
/// (max_sequence_length, 3): FluxPipeline's text_ids.
template <class Clip, class T5>
EncodedPrompt encode_prompt_flux(const CLIPTokenizer& tokenizer, Clip& text_encoder,
                                 const T5Tokenizer& tokenizer_2, T5& text_encoder_2,
                                 const std::vector<std::string>& prompts,
                                 const FluxPromptOptions& o = {}) {
  const std::string where = "encode_prompt_flux";
  if (prompts.empty()) throw ConfigError("no prompts", where);
  if (o.num_images_per_prompt < 1)
    throw ConfigError("num_images_per_prompt must be at least 1", where);
  const std::vector<std::string> prompts_2 =
      o.prompt_2 ? encode_detail::negatives(o.prompt_2, prompts.size(), "prompt_2") : prompts;
  EncodedPrompt out;
  const models::CLIPTextOutput clip = text_encoder->forward(
      encode_detail::ids_for(tokenizer, text_encoder, prompts, tokenizer.model_max_length()));
  out.pooled_prompt_embeds = encode_detail::per_image(clip.pooler_output, o.num_images_per_prompt);
  out.prompt_embeds = t5_prompt_embeds(tokenizer_2, text_encoder_2, prompts_2,
                                       o.max_sequence_length, o.num_images_per_prompt);
  return out;
}

}  // namespace difftrain::text
