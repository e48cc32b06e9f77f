#pragma once
// A web UI prompt to the text encoder's conditioning, as its CLIP wrapper computes it
// (modules/sd_hijack_clip.py process_tokens, modules/sd_emphasis.py): every chunk of 77 encoded
// on its own (a batch's prompts padded to the same chunk count with empty chunks), embeddings'
// vectors placed into the token embeddings at their fixes, "CLIP skip" taking an earlier layer's
// output through the final LayerNorm, the multipliers applied to the output (the mean of the
// whole batch's chunk restored under the original emphasis), the chunks concatenated along the
// sequence: (B, 77 · chunks, width).

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/models/clip_text_model.hpp"
#include "difftrain/text/webui_prompt.hpp"

namespace difftrain::text {

struct WebuiEncodeOptions {
  Emphasis emphasis = Emphasis::original;
  /// The web UI's "Clip skip" (CLIP_stop_at_last_layers): 1 is the last layer; n > 1 takes the
  /// n-th layer from the end, through the final LayerNorm.
  std::int64_t clip_skip = 1;
  /// The padding id after the end token (SD 2.x's tokenizer pads with "!", id 0); negative: the
  /// end token, as SD 1.x.
  std::int64_t pad_token_id = -1;
};

/// An embedding's vectors (vectors, width) by name, for the chunks' fixes.
using EmbeddingVectors = std::function<at::Tensor(const std::string& name)>;

/// The conditioning of `prompts` (each already tokenized with tokenize_prompt).
template <class Encoder>
at::Tensor encode_webui_prompts(Encoder& encoder, const std::vector<TokenizedPrompt>& prompts,
                                const WebuiEncodeOptions& o = {},
                                const EmbeddingVectors& vectors = {}) {
  const std::string where = "web UI conditioning";
  if (prompts.empty()) throw ConfigError("no prompts", where);
  const auto layers = encoder->config().num_hidden_layers;
  if (o.clip_skip < 1 || o.clip_skip > layers)
    throw ConfigError("clip_skip " + std::to_string(o.clip_skip) + " is outside 1 to " +
                          std::to_string(layers) + " (the encoder's layers)",
                      where);
  std::size_t chunk_count = 0;
  for (const auto& p : prompts) chunk_count = std::max(chunk_count, p.chunks.size());
  const at::Device device = encoder->token_embedding->weight.device();
  std::vector<at::Tensor> zs;
  for (std::size_t i = 0; i < chunk_count; ++i) {
    std::vector<std::int64_t> ids;
    std::vector<double> mults;
    std::vector<const PromptChunk*> batch;
    PromptChunk empty;  // the web UI's empty_chunk: start, then end tokens
    for (const auto& p : prompts) {
      const PromptChunk* c = i < p.chunks.size() ? &p.chunks[i] : nullptr;
      if (c == nullptr) {
        const std::int64_t len = static_cast<std::int64_t>(p.chunks.front().tokens.size());
        empty.tokens.assign(static_cast<std::size_t>(len), p.chunks.front().tokens.back());
        empty.tokens.front() = p.chunks.front().tokens.front();
        empty.multipliers.assign(static_cast<std::size_t>(len), 1.0);
        c = &empty;
      }
      std::vector<std::int64_t> t = c->tokens;
      // SD 2.x: after the first end token, the padding token.
      if (o.pad_token_id >= 0) {
        const std::int64_t end = t.back();
        const auto first_end = std::find(t.begin(), t.end(), end);
        std::fill(first_end + 1, t.end(), o.pad_token_id);
      }
      ids.insert(ids.end(), t.begin(), t.end());
      mults.insert(mults.end(), c->multipliers.begin(), c->multipliers.end());
      batch.push_back(c);
    }
    const auto b = static_cast<std::int64_t>(prompts.size());
    const at::Tensor tokens = at::tensor(ids, at::kLong).view({b, -1}).to(device);
    at::Tensor embeds = encoder->token_embedding(tokens);
    // The fixes replace rows of the looked-up embeddings out of place, so gradients reach the
    // embedding's vectors (textual inversion trains them this way).
    bool any_fix = false;
    for (const auto* c : batch) any_fix = any_fix || !c->fixes.empty();
    if (any_fix) {
      std::vector<at::Tensor> rows;
      for (std::size_t row = 0; row < batch.size(); ++row) {
        at::Tensor r = embeds[static_cast<std::int64_t>(row)];
        for (const ChunkFix& fix : batch[row]->fixes) {
          if (!vectors)
            throw ConfigError(
                "the prompt names embedding '" + fix.name + "' but no embedding vectors were given",
                where);
          const at::Tensor v = vectors(fix.name);
          if (v.dim() != 2 || v.size(1) != r.size(1) || v.size(0) < fix.vectors)
            throw ShapeError("embedding '" + fix.name + "' has shape " + c10::str(v.sizes()) +
                                 "; the encoder needs (" + std::to_string(fix.vectors) + ", " +
                                 std::to_string(r.size(1)) + ")",
                             where);
          const auto at = static_cast<std::int64_t>(fix.offset) + 1;
          r = at::cat(
              {r.slice(0, 0, at), v.slice(0, 0, fix.vectors).to(r.device(), r.scalar_type()),
               r.slice(0, at + fix.vectors)},
              0);
        }
        rows.push_back(r);
      }
      embeds = at::stack(rows);
    }
    const models::CLIPTextOutput out =
        encoder->forward_embeds(embeds, tokens, std::nullopt, o.clip_skip > 1);
    at::Tensor z =
        o.clip_skip > 1
            ? encoder->final_layer_norm(out.hidden_states[out.hidden_states.size() -
                                                          static_cast<std::size_t>(o.clip_skip)])
            : out.last_hidden_state;
    if (o.emphasis == Emphasis::original || o.emphasis == Emphasis::no_norm) {
      const at::Tensor m =
          at::tensor(mults, at::kDouble).view({b, -1, 1}).to(z.device(), z.scalar_type());
      const at::Tensor original_mean = z.mean();
      z = z * m;
      if (o.emphasis == Emphasis::original) {
        // The web UI's original_mean / new_mean, except where both are the same number: then
        // the ratio is 1 (x / x for any other x), where the web UI's 0 / 0 would be NaN. A mean
        // of exactly 0 happens (layer-normed states of a small encoder summed in another order)
        // and would turn the whole batch's conditioning into NaN. Both operands are made safe,
        // not only the result: a division by 0 left in the graph sends NaN back through where.
        // (When they are equal, all multipliers are 1 and the web UI's ratio has no gradient
        // either.)
        const at::Tensor new_mean = z.mean();
        const at::Tensor same = new_mean == original_mean;
        const at::Tensor one = at::ones_like(new_mean);
        z = z * (at::where(same, one, original_mean) / at::where(same, one, new_mean));
      }
    }
    zs.push_back(z);
  }
  return at::cat(zs, 1);
}

}  // namespace difftrain::text
