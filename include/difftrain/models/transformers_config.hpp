#pragma once
// What transformers' model configs share: the bookkeeping fields every PretrainedConfig may
// carry, and the activations their hidden_act / dense_act_fn name (ACT2FN).

#include <ATen/ATen.h>

#include <string>

#include "difftrain/core/error.hpp"
#include "difftrain/models/config_reader.hpp"

namespace difftrain::models {

/// The fields every transformers config may carry (PretrainedConfig's generation and bookkeeping
/// settings): accepted, no effect on the model.
inline void accept_transformers_common_fields(ConfigReader& r) {
  for (const char* key : {"architectures",
                          "model_type",
                          "transformers_version",
                          "torch_dtype",
                          "dtype",
                          "add_cross_attention",
                          "bad_words_ids",
                          "begin_suppress_tokens",
                          "chunk_size_feed_forward",
                          "cross_attention_hidden_size",
                          "decoder_start_token_id",
                          "diversity_penalty",
                          "do_sample",
                          "early_stopping",
                          "encoder_no_repeat_ngram_size",
                          "finetuning_task",
                          "forced_bos_token_id",
                          "forced_eos_token_id",
                          "id2label",
                          "is_decoder",
                          "is_encoder_decoder",
                          "label2id",
                          "length_penalty",
                          "max_length",
                          "min_length",
                          "no_repeat_ngram_size",
                          "num_beam_groups",
                          "num_beams",
                          "num_return_sequences",
                          "output_attentions",
                          "output_hidden_states",
                          "output_scores",
                          "prefix",
                          "problem_type",
                          "pruned_heads",
                          "remove_invalid_values",
                          "repetition_penalty",
                          "return_dict",
                          "return_dict_in_generate",
                          "sep_token_id",
                          "suppress_tokens",
                          "task_specific_params",
                          "temperature",
                          "tf_legacy_loss",
                          "tie_encoder_decoder",
                          "tie_word_embeddings",
                          "tokenizer_class",
                          "top_k",
                          "top_p",
                          "torchscript",
                          "typical_p",
                          "use_bfloat16",
                          "use_cache",
                          "gradient_checkpointing",
                          "dropout"})
    r.accept(key);
}

enum class HiddenAct { quick_gelu, gelu, gelu_tanh, relu, silu };

/// The activation an ACT2FN name means; `field` and `model` name it in the error.
inline HiddenAct hidden_activation(const std::string& name, const std::string& field,
                                   const std::string& model, const std::string& where) {
  if (name == "quick_gelu") return HiddenAct::quick_gelu;
  if (name == "gelu") return HiddenAct::gelu;
  if (name == "gelu_new" || name == "gelu_pytorch_tanh" || name == "gelu_fast")
    return HiddenAct::gelu_tanh;
  if (name == "relu") return HiddenAct::relu;
  if (name == "silu" || name == "swish") return HiddenAct::silu;
  throw ConfigError("'" + field + "' = \"" + name + "\" is not an activation difftrain's " + model +
                        " has (quick_gelu, gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu, "
                        "silu, swish)",
                    where);
}

inline at::Tensor activate(const at::Tensor& x, HiddenAct act) {
  switch (act) {
    case HiddenAct::quick_gelu:
      return x * at::sigmoid(1.702 * x);
    case HiddenAct::gelu:
      return at::gelu(x);
    case HiddenAct::gelu_tanh:
      return at::gelu(x, "tanh");
    case HiddenAct::relu:
      return at::relu(x);
    case HiddenAct::silu:
      return at::silu(x);
  }
  return x;
}

}  // namespace difftrain::models
