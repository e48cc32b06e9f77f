// T5: its tokenizer against transformers' (SentencePiece's Unigram model on the reference
// scripts' folders), its encoder against transformers' T5EncoderModel, and the prompts SD3 and
// Flux encode with it, against diffusers' pipelines.
#include <gtest/gtest.h>
#include <unistd.h>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/clip_text_model.hpp>
#include <difftrain/models/pretrained.hpp>
#include <difftrain/models/t5_encoder.hpp>
#include <difftrain/nn/attention/math.hpp>
#include <difftrain/text/clip_tokenizer.hpp>
#include <difftrain/text/encode_prompt.hpp>
#include <difftrain/text/t5_tokenizer.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "golden.hpp"
#include "text_test_helpers.hpp"

namespace dt = difftrain;
namespace text = difftrain::text;
namespace tst = difftrain::test;
namespace fs = std::filesystem;
namespace models = difftrain::models;
namespace attn = difftrain::nn::attention;
using namespace difftrain::test::text_helpers;

// ---- T5's tokenizer ----------------------------------------------------------------------------

namespace {

fs::path t5_dir(const std::string& variant) {
  return fs::path(DIFFTRAIN_GOLDEN_DIR) / "t5_tokenizer" / variant;
}

}  // namespace

// Every string of the sweep (the CLIP sweep's kinds, with sentinels, "▁" written literally, runs
// of white space and full-width tokens mixed in) gives transformers' ids, for two trained
// SentencePiece models (T5's nmt_nfkc; case-folding nfkc_cf with user-defined and control pieces)
// in each folder layout; so do the added tokens, padded and truncated batches and decoding.
TEST(T5Tokenizer, SweepEqualsTransformers) {
  const auto& g = tst::golden("t5_tokenizer.json");
  const auto strings = g["strings"].get<std::vector<std::string>>();
  ASSERT_GE(strings.size(), 10000U);
  for (const auto& [variant, v] : g["variants"].items()) {
    SCOPED_TRACE(variant);
    const auto tok = text::T5Tokenizer::from_folder(t5_dir(variant));
    EXPECT_EQ(tok.size(), v["size"].get<std::int64_t>());
    EXPECT_EQ(tok.eos_token_id(), v["eos"].get<std::int64_t>());
    EXPECT_EQ(tok.pad_token_id(), v["pad"].get<std::int64_t>());
    EXPECT_EQ(tok.unk_token_id(), v["unk"].get<std::int64_t>());
    EXPECT_EQ(tok.model_max_length(), v["model_max_length"].get<std::int64_t>());
    std::map<std::int64_t, std::pair<std::string, bool>> added;
    for (const auto& a : tok.added_tokens()) added[a.id] = {a.content, a.special};
    ASSERT_EQ(added.size(), v["added"].size());
    for (const auto& a : v["added"]) {
      const auto id = a[0].get<std::int64_t>();
      ASSERT_TRUE(added.contains(id)) << a;
      EXPECT_EQ(added[id].first, a[1].get<std::string>());
      EXPECT_EQ(added[id].second, a[2].get<bool>()) << a;
    }
    const std::size_t count = v["count"].get<std::size_t>();
    std::size_t differ = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const Ids want = v["ids"][i].get<Ids>();
      const Ids got = tok.encode(strings[i]);
      if (got != want && ++differ <= 3)
        ADD_FAILURE() << "string " << i << " " << nlohmann::json(strings[i]).dump() << ": "
                      << nlohmann::json(tok.tokenize(strings[i])).dump() << " "
                      << nlohmann::json(got).dump() << " vs " << nlohmann::json(want).dump();
    }
    EXPECT_EQ(differ, 0U) << "of " << count;

    const std::vector<std::string> first(strings.begin(), strings.begin() + 500);
    text::EncodeOptions o;
    o.max_length = 64;
    const text::BatchEncoding padded = tok(first, o);
    EXPECT_EQ(padded.input_ids, v["batch_ids"].get<IdRows>());
    EXPECT_EQ(padded.attention_mask, v["batch_mask"].get<IdRows>());
    o.padding = text::Padding::longest;
    o.max_length = 40;
    const text::BatchEncoding longest =
        tok(std::vector<std::string>(strings.begin() + 500, strings.begin() + 700), o);
    EXPECT_EQ(longest.input_ids, v["longest_ids"].get<IdRows>());
    EXPECT_EQ(longest.attention_mask, v["longest_mask"].get<IdRows>());
    for (std::size_t i = 0; i < 200; ++i)
      EXPECT_EQ(tok.encode(strings[700 + i], false), v["plain_ids"][i].get<Ids>()) << i;
    for (std::size_t i = 0; i < 500; ++i) {
      const Ids ids = v["ids"][i].get<Ids>();
      EXPECT_EQ(tok.decode(ids), v["decoded"][i].get<std::string>()) << i;
      EXPECT_EQ(tok.decode(ids, true), v["decoded_skip"][i].get<std::string>()) << i;
    }
  }
}

// A bare spiece.model (what a single file's user has) reads as a folder holding it with T5's
// defaults (100 sentinels, as t5_model's config says): the same ids for the whole sweep, the
// same special and sentinel tokens.
TEST(T5Tokenizer, BareSentencePieceModelEqualsItsFolder) {
  const auto& g = tst::golden("t5_tokenizer.json");
  const auto strings = g["strings"].get<std::vector<std::string>>();
  {
    const char* variant = "t5_model";
    const auto folder = text::T5Tokenizer::from_folder(t5_dir(variant));
    const auto bare = text::T5Tokenizer::from_sentencepiece_model(t5_dir(variant) / "spiece.model");
    EXPECT_EQ(bare.size(), folder.size());
    EXPECT_EQ(bare.eos_token_id(), folder.eos_token_id());
    EXPECT_EQ(bare.pad_token_id(), folder.pad_token_id());
    EXPECT_EQ(bare.unk_token_id(), folder.unk_token_id());
    EXPECT_EQ(bare.token_to_id("<extra_id_0>"), folder.token_to_id("<extra_id_0>"));
    std::size_t differ = 0;
    for (const auto& s : strings) differ += bare.encode(s) != folder.encode(s);
    EXPECT_EQ(differ, 0U) << "of " << strings.size();
  }
  EXPECT_THROW(text::T5Tokenizer::from_sentencepiece_model(t5_dir("t5_model")), dt::IoError);
  EXPECT_THROW(
      text::T5Tokenizer::from_sentencepiece_model(t5_dir("t5_model") / "tokenizer_config.json"),
      dt::FormatError);
}

TEST(T5Tokenizer, BadInputIsNamed) {
  const auto tok = text::T5Tokenizer::from_folder(t5_dir("t5_model"));
  expect_error<dt::FormatError>([&] { (void)tok.encode("caf\xe9"); }, "Latin-1 text",
                                {"UTF-8", "byte 3"});
  const Ids bad{5, 999999, 1};
  expect_error<dt::ConfigError>([&] { (void)tok.decode(bad); }, "id out of range",
                                {"999999", "position 1"});
  text::EncodeOptions o;
  o.max_length = -1;
  o.padding = text::Padding::none;
  expect_error<dt::ConfigError>([&] { (void)tok({"a"}, o); }, "max_length -1", {"max_length"});
}

// A damaged folder or model is refused with an error naming the file and what is wrong; no cut
// or flipped byte of spiece.model gets anything but a loaded tokenizer or a FormatError.
TEST(T5Tokenizer, DamagedFilesAreRefused) {
  auto load = [](const fs::path& dir) {
    return [dir] { (void)text::T5Tokenizer::from_folder(dir); };
  };
  {
    DamagedFolder f("t5-empty", t5_dir("t5_model"));
    fs::remove(f.dir / "spiece.model");
    expect_error<dt::IoError>(load(f.dir), "no model file", {"tokenizer.json", "spiece.model"});
  }
  {
    DamagedFolder f("t5-extra", t5_dir("t5_model"));
    f.write("tokenizer_config.json", R"({"extra_ids": -3})");
    expect_error<dt::FormatError>(load(f.dir), "negative extra_ids", {"extra_ids"});
  }
  {
    DamagedFolder f("t5-bpe", t5_dir("t5_json"));
    std::string j = f.read("tokenizer.json");
    j.replace(j.find("\"Unigram\""), 9, "\"BPE\"");
    f.write("tokenizer.json", j);
    expect_error<dt::FormatError>(load(f.dir), "a BPE tokenizer.json", {"BPE", "Unigram"});
  }
  {
    DamagedFolder f("t5-base64", t5_dir("t5_json"));
    std::string j = f.read("tokenizer.json");
    const auto at = j.find("\"precompiled_charsmap\":");
    j.insert(j.find('"', at + 22) + 1, "*");
    f.write("tokenizer.json", j);
    expect_error<dt::FormatError>(load(f.dir), "bad base64", {"base64", "precompiled_charsmap"});
  }
  {
    DamagedFolder f("t5-vocab", t5_dir("t5_json"));
    std::string j = f.read("tokenizer.json");
    const auto at = j.find("\"<pad>\",", j.find("\"vocab\""));
    j.replace(at, 8, "0,");
    f.write("tokenizer.json", j);
    expect_error<dt::FormatError>(load(f.dir), "a number as piece", {"vocab[0]"});
  }
  DamagedFolder f("t5-cut", t5_dir("t5_model"));
  const std::string model = f.read("spiece.model");
  std::mt19937 rng(5);
  std::size_t refused = 0;
  for (int k = 0; k < 160; ++k) {
    std::string bad = model;
    if (k < 80) {
      bad.resize(std::uniform_int_distribution<std::size_t>(0, model.size() - 1)(rng));
    } else {
      for (int flips = 0; flips < 4; ++flips)
        bad[std::uniform_int_distribution<std::size_t>(0, model.size() - 1)(rng)] ^=
            static_cast<char>(1 << (rng() % 8));
    }
    f.write("spiece.model", bad);
    try {
      const auto tok = text::T5Tokenizer::from_folder(f.dir);
      (void)tok.encode("a photo of a cat ｆｕｌｌ　ｗｉｄｔｈ ①");
    } catch (const dt::FormatError& e) {
      ++refused;
      EXPECT_NE(std::string(e.what()).find("spiece.model"), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "case " << k << ": " << e.what();
    }
  }
  EXPECT_GT(refused, 60U);
}

// ---- T5's encoder ------------------------------------------------------------------------------

namespace {

fs::path t5_encoder_dir(const std::string& name) {
  return fs::path(DIFFTRAIN_GOLDEN_DIR) / "t5_encoders" / name;
}

template <class Backend>
void check_t5_case(const nlohmann::json& c, bool checkpointing) {
  const std::string name = c["name"].get<std::string>();
  SCOPED_TRACE(name + " " + std::string(Backend::name) + (checkpointing ? " checkpointed" : ""));
  models::LoadOptions lo;
  if (!c["variant"].is_null()) lo.variant = c["variant"].get<std::string>();
  auto model = models::from_pretrained<models::T5EncoderModel<Backend>>(t5_encoder_dir(name), lo);
  model->to(at::kDouble);
  model->train();
  model->set_gradient_checkpointing(checkpointing);
  const auto io =
      dt::io::load_safetensors(t5_encoder_dir(name).string() + ".io.safetensors", true).tensors;
  std::optional<at::Tensor> mask;
  if (io.contains("attention_mask")) mask = io.at("attention_mask");
  const models::T5EncoderOutput out = model->forward(io.at("input_ids"), mask, true);
  EXPECT_LT(scaled_error(out.last_hidden_state, io.at("last_hidden_state")), 1e-10);
  ASSERT_EQ(out.hidden_states.size(), c["hidden_states"].get<std::size_t>());
  at::Tensor loss = at::zeros({}, at::kDouble);
  for (std::size_t i = 0; i < out.hidden_states.size(); ++i) {
    const std::string k = std::to_string(i);
    EXPECT_LT(scaled_error(out.hidden_states[i], io.at("hidden_states." + k)), 1e-10) << k;
    loss = loss + (out.hidden_states[i] * io.at("w." + k)).sum();
  }
  loss.backward();
  expect_gradients_match(*model, io);
}

}  // namespace

// Four random tiny configurations (T5 v1.1's gated-gelu, the original relu, gated-silu; 1 to 3
// layers; attention widths other than d_model; sequences past the exact buckets and past
// max_distance; padding masks) saved by transformers as one file, shards, an fp16 variant and
// with the token table under encoder.embed_tokens: every hidden state and every parameter's
// gradient (the relative-position table's and the token table's included) equal transformers' in
// float64, with the math and SDPA backends and with gradient checkpointing.
TEST(T5Encoder, EqualsTransformersOnTinyConfigs) {
  const auto& g = tst::golden("t5_encoders.json");
  ASSERT_GE(g["cases"].size(), 4U);
  for (const auto& c : g["cases"]) {
    check_t5_case<attn::Math>(c, false);
    check_t5_case<attn::Sdpa<attn::Auto>>(c, true);
  }
}

// T5 v1.1 small, base and XXL (SD3's and Flux's T5 encoder, 4,762,310,656 parameters): the
// parameter names, shapes and counts transformers builds, from the config alone (XXL is too large
// to build here), and the built model of the small one has exactly those.
TEST(T5Encoder, PublishedConfigsHaveTransformersParameters) {
  const auto& g = tst::golden("t5_encoders.json")["published"];
  ASSERT_EQ(g.size(), 3U);
  for (const auto& [name, p] : g.items()) {
    SCOPED_TRACE(name);
    const auto config = models::T5EncoderConfig::from_json(p["config"], name);
    const auto shapes = config.parameter_shapes();
    std::int64_t count = 0;
    for (const auto& [k, s] : shapes) {
      std::int64_t n = 1;
      for (const auto d : s) n *= d;
      count += n;
    }
    EXPECT_EQ(count, p["parameters"].get<std::int64_t>());
    EXPECT_EQ(shapes, (p["shapes"].get<std::map<std::string, std::vector<std::int64_t>>>()));
    if (name == "t5_v1_1_small") {
      const models::T5EncoderModel<> model(config);
      std::map<std::string, std::vector<std::int64_t>> built;
      for (const auto& t : model->named_parameters(true)) built[t.key()] = t.value().sizes().vec();
      EXPECT_EQ(built, shapes);
    }
  }
  EXPECT_EQ(g["t5_v1_1_xxl"]["parameters"].get<std::int64_t>(), 4762310656);
}

// Float16 as transformers runs it: the feed-forward output projections stay float32, the output
// is float16 and close to the float32 model's; infinities are clamped to finite values.
TEST(T5Encoder, HalfPrecisionKeepsTheOutputProjectionsInFloat32) {
  auto model =
      models::from_pretrained<models::T5EncoderModel<attn::Math>>(t5_encoder_dir("gated_gelu"));
  model->eval();
  const at::Tensor ids = at::randint(0, 60, {2, 12}, at::kLong);
  at::NoGradGuard no_grad;
  const at::Tensor want = model->forward(ids).last_hidden_state;
  model->to(at::kHalf);
  for (const auto& p : model->named_parameters(true))
    EXPECT_EQ(p.value().scalar_type(),
              p.key().ends_with("DenseReluDense.wo.weight") ? at::kFloat : at::kHalf)
        << p.key();
  const at::Tensor got = model->forward(ids).last_hidden_state;
  EXPECT_EQ(got.scalar_type(), at::kHalf);
  EXPECT_LT(scaled_error(got.to(at::kFloat), want), 2e-2);
  EXPECT_TRUE(at::isfinite(got).all().item<bool>());
}

TEST(T5Encoder, BadConfigsAndInputsAreNamed) {
  const nlohmann::json base = {{"architectures", {"T5EncoderModel"}},
                               {"model_type", "t5"},
                               {"vocab_size", 50},
                               {"d_model", 16},
                               {"d_kv", 4},
                               {"d_ff", 32},
                               {"num_layers", 1},
                               {"num_heads", 2},
                               {"feed_forward_proj", "gated-gelu"}};
  auto with = [&](const std::string& key, const nlohmann::json& v) {
    nlohmann::json j = base;
    j[key] = v;
    return [j] { (void)models::T5EncoderConfig::from_json(j, "config.json"); };
  };
  expect_error<dt::ConfigError>(with("feed_forward_proj", "gated-mish"), "unknown activation",
                                {"feed_forward_proj", "gated-mish"});
  expect_error<dt::ConfigError>(with("feed_forward_proj", "gated-gelu-new"), "three parts",
                                {"feed_forward_proj"});
  expect_error<dt::ConfigError>(with("num_layers", 0), "no layers", {"num_layers"});
  expect_error<dt::ConfigError>(with("relative_attention_num_buckets", 2), "two buckets",
                                {"relative_attention_num_buckets"});
  expect_error<dt::ConfigError>(with("relative_attention_max_distance", 4), "distance too short",
                                {"relative_attention_max_distance"});
  expect_error<dt::ConfigError>(with("model_type", "umt5"), "UMT5", {"model_type", "umt5"});
  expect_error<dt::ConfigError>(with("architectures", {"CLIPTextModel"}), "another model",
                                {"CLIPTextModel"});
  expect_error<dt::ConfigError>(with("is_gated_act", false), "contradiction", {"is_gated_act"});
  expect_error<dt::ConfigError>(with("rope_theta", 1e4), "a field T5 has not", {"rope_theta"});

  models::T5EncoderModel<attn::Math> model(models::T5EncoderConfig::from_json(base, "config.json"));
  expect_error<dt::ShapeError>(
      [&] {
        (void)model->forward(at::full({2, 4}, 50, at::kLong));
      },
      "an id past the vocabulary", {"token id 50", "(0, 0)"});
  expect_error<dt::ShapeError>([&] { (void)model->forward(at::ones({4}, at::kLong)); },
                               "one dimension", {"(batch, length)"});
  expect_error<dt::ShapeError>(
      [&] {
        (void)model->forward(at::ones({1, 4}));
      },
      "float ids", {"integer"});
  expect_error<dt::ShapeError>(
      [&] {
        (void)model->forward(at::ones({1, 4}, at::kLong), at::ones({1, 3}, at::kLong));
      },
      "a mask of another shape", {"attention_mask"});

  DamagedFolder f("t5-layers", t5_encoder_dir("gated_gelu"));
  auto j = nlohmann::json::parse(f.read("config.json"));
  j["num_layers"] = 7;
  f.write("config.json", j.dump());
  expect_error<dt::ConfigError>(
      [&] { (void)models::from_pretrained<models::T5EncoderModel<>>(f.dir); }, "7 layers",
      {"encoder.block.", "7"});
}

// A folder difftrain saves loads back (in difftrain and, with DIFFTRAIN_TEXT_OUT set, in
// transformers: tests/reference/check_cpp_text_encoders.py).
TEST(T5Encoder, SavedFoldersRoundTrip) {
  const char* keep = std::getenv("DIFFTRAIN_TEXT_OUT");
  const fs::path out = keep != nullptr ? fs::path(keep) / "t5"
                                       : fs::temp_directory_path() /
                                             ("difftrain-t5-save-" + std::to_string(::getpid()));
  auto model =
      models::from_pretrained<models::T5EncoderModel<>>(t5_encoder_dir("gated_gelu_embed_tokens"));
  model->eval();
  models::save_pretrained(model, out);
  auto back = models::from_pretrained<models::T5EncoderModel<>>(out);
  back->eval();
  const at::Tensor ids = at::randint(0, 70, {2, 9}, at::kLong);
  at::NoGradGuard no_grad;
  const at::Tensor a = model->forward(ids).last_hidden_state;
  const at::Tensor b = back->forward(ids).last_hidden_state;
  EXPECT_EQ(scaled_error(b, a), 0.0);
  if (keep != nullptr)
    dt::io::save_safetensors(out / "outputs.safetensors",
                             {{"input_ids", ids}, {"last_hidden_state", b}});
  else
    dt::io::remove_tree(out);
}

// SD3's and Flux's T5 prompt embeddings (diffusers' _get_t5_prompt_embeds) with the trained T5
// tokenizer and a tiny T5 v1.1 encoder: short prompts, a sentinel, a prompt past the maximum
// length; SD3's 256 and 77 and Flux's 512 tokens; two images per prompt.
TEST(EncodePrompt, T5PromptEmbedsEqualDiffusers) {
  const auto& g = tst::golden("t5_prompt.json");
  const auto want = dt::io::load_safetensors(t5_dir("t5_prompt_embeds.safetensors"), true).tensors;
  const auto tok = text::T5Tokenizer::from_folder(t5_dir("t5_both"));
  auto encoder = models::from_pretrained<models::T5EncoderModel<>>(t5_dir("t5_prompt_encoder"));
  encoder->eval();
  const auto prompts = g["prompts"].get<std::vector<std::string>>();
  at::NoGradGuard no_grad;
  for (const auto& [name, c] : g["cases"].items()) {
    SCOPED_TRACE(name);
    const at::Tensor got =
        text::t5_prompt_embeds(tok, encoder, prompts, c["max_sequence_length"].get<std::int64_t>(),
                               c["num_images_per_prompt"].get<std::int64_t>());
    ASSERT_EQ(got.sizes(), want.at(name).sizes());
    EXPECT_LT(scaled_error(got, want.at(name)), 1e-5);
  }
  expect_error<dt::ConfigError>([&] { (void)text::t5_prompt_embeds(tok, encoder, {}, 256); },
                                "no prompts", {"no prompts"});
  expect_error<dt::ConfigError>([&] { (void)text::t5_prompt_embeds(tok, encoder, prompts, 0); },
                                "length 0", {"max_sequence_length 0"});
}

// StableDiffusion3Pipeline.encode_prompt on tiny encoders (two CLIPTextModelWithProjection with
// the SD 1.5 and the "!"-padding SD 2 tokenizers, a T5 of the t5 tokenizer's vocabulary): default
// and given negatives (one for all, one per prompt), clip_skip, prompt_2 and prompt_3, two images
// per prompt, T5 lengths 256, 77 and 30, and a pipeline without T5 (zeros).
TEST(EncodePrompt, SD3EqualsDiffusersPipeline) {
  const auto& g = tst::golden("sd3_encode_prompt.json");
  const fs::path root = fs::path(DIFFTRAIN_GOLDEN_DIR) / "sd3_encode_prompt";
  const auto want = dt::io::load_safetensors(root / "outputs.safetensors", true).tensors;
  auto te1 = models::from_pretrained<models::CLIPTextModel<>>(root / "text_encoder");
  auto te2 = models::from_pretrained<models::CLIPTextModel<>>(root / "text_encoder_2");
  auto te3 = models::from_pretrained<models::T5EncoderModel<>>(root / "text_encoder_3");
  te1->eval();
  te2->eval();
  te3->eval();
  const auto tok2 = text::CLIPTokenizer::from_folder(tokenizer_dir("sd2"));
  const auto tok3 = text::T5Tokenizer::from_folder(t5_dir("t5_both"));
  const auto prompts = g["prompts"].get<std::vector<std::string>>();
  at::NoGradGuard no_grad;
  auto list = [](const nlohmann::json& c, const char* key) {
    std::optional<std::vector<std::string>> v;
    if (c.contains(key)) v = c[key].get<std::vector<std::string>>();
    return v;
  };
  using Encoders = text::SD3TextEncoders<models::CLIPTextModel<>, models::CLIPTextModel<>,
                                         models::T5EncoderModel<>>;
  for (const auto& [name, c] : g["cases"].items()) {
    SCOPED_TRACE(name);
    text::SD3PromptOptions o;
    o.num_images_per_prompt = c["num_images_per_prompt"].get<std::int64_t>();
    o.do_classifier_free_guidance = c["guidance"].get<bool>();
    if (c.contains("clip_skip")) o.clip_skip = c["clip_skip"].get<std::int64_t>();
    if (c.contains("max_sequence_length"))
      o.max_sequence_length = c["max_sequence_length"].get<std::int64_t>();
    o.prompt_2 = list(c, "prompt_2");
    o.prompt_3 = list(c, "prompt_3");
    o.negative_prompt = list(c, "negative_prompt");
    o.negative_prompt_2 = list(c, "negative_prompt_2");
    o.negative_prompt_3 = list(c, "negative_prompt_3");
    const bool t5 = c["t5"].get<bool>();
    const Encoders e{sd15(),
                     te1,
                     tok2,
                     te2,
                     t5 ? &tok3 : nullptr,
                     t5 ? &te3 : nullptr,
                     g["joint_attention_dim"].get<std::int64_t>()};
    const text::EncodedPrompt got = text::encode_prompt_sd3(e, prompts, o);
    const std::vector<std::pair<std::string, at::Tensor>> parts{
        {"prompt_embeds", got.prompt_embeds},
        {"pooled_prompt_embeds", got.pooled_prompt_embeds},
        {"negative_prompt_embeds", got.negative_prompt_embeds},
        {"negative_pooled_prompt_embeds", got.negative_pooled_prompt_embeds}};
    for (const auto& [part, mine] : parts) {
      const auto it = want.find(name + "." + part);
      if (it == want.end()) {
        EXPECT_FALSE(mine.defined()) << part;
        continue;
      }
      ASSERT_TRUE(mine.defined()) << part;
      ASSERT_EQ(mine.sizes(), it->second.sizes()) << part;
      EXPECT_LT(scaled_error(mine, it->second), 1e-5) << part;
    }
  }
  // Mistakes: a CLIP without projection, T5's tokenizer without its encoder, negatives that do
  // not match the prompts, CLIP widths past T5's.
  auto plain = models::from_pretrained<models::CLIPTextModel<>>(fs::path(DIFFTRAIN_GOLDEN_DIR) /
                                                                "encode_prompt" / "text_encoder");
  expect_error<dt::ConfigError>(
      [&] {
        (void)text::encode_prompt_sd3(Encoders{sd15(), plain, tok2, te2, &tok3, &te3}, prompts);
      },
      "a CLIP without projection", {"CLIPTextModelWithProjection"});
  expect_error<dt::ConfigError>(
      [&] {
        (void)text::encode_prompt_sd3(Encoders{sd15(), te1, tok2, te2, &tok3, nullptr}, prompts);
      },
      "T5's tokenizer alone", {"together"});
  text::SD3PromptOptions three;
  three.negative_prompt = std::vector<std::string>{"a", "b", "c"};
  expect_error<dt::ConfigError>(
      [&] {
        (void)text::encode_prompt_sd3(Encoders{sd15(), te1, tok2, te2, &tok3, &te3}, prompts,
                                      three);
      },
      "three negatives for two prompts", {"negative_prompt", "3"});
  expect_error<dt::ConfigError>(
      [&] {
        (void)text::encode_prompt_sd3(Encoders{sd15(), te1, tok2, te2, nullptr, nullptr, 64},
                                      prompts);
      },
      "CLIP wider than the joint width", {"72", "64"});
}

// FluxPipeline.encode_prompt on a tiny CLIPTextModel (its pooled output) with the SD 1.5
// tokenizer and a tiny T5: dev's 512 and schnell's 256 T5 tokens, two images per prompt, prompt_2,
// a prompt past both encoders' lengths; the text ids are FluxPipeline's zeros.
TEST(EncodePrompt, FluxEqualsDiffusersPipeline) {
  const auto& g = tst::golden("flux_encode_prompt.json");
  const fs::path root = fs::path(DIFFTRAIN_GOLDEN_DIR) / "flux_encode_prompt";
  const auto want = dt::io::load_safetensors(root / "outputs.safetensors", true).tensors;
  auto clip = models::from_pretrained<models::CLIPTextModel<>>(root / "text_encoder");
  auto t5 = models::from_pretrained<models::T5EncoderModel<>>(
      fs::path(DIFFTRAIN_GOLDEN_DIR) / "sd3_encode_prompt" / "text_encoder_3");
  clip->eval();
  t5->eval();
  const auto tok2 = text::T5Tokenizer::from_folder(t5_dir("t5_both"));
  const auto prompts = g["prompts"].get<std::vector<std::string>>();
  at::NoGradGuard no_grad;
  for (const auto& [name, c] : g["cases"].items()) {
    SCOPED_TRACE(name);
    text::FluxPromptOptions o;
    o.max_sequence_length = c["max_sequence_length"].get<std::int64_t>();
    if (c.contains("num_images_per_prompt"))
      o.num_images_per_prompt = c["num_images_per_prompt"].get<std::int64_t>();
    if (c.contains("prompt_2")) o.prompt_2 = c["prompt_2"].get<std::vector<std::string>>();
    const auto got = text::encode_prompt_flux(sd15(), clip, tok2, t5, prompts, o);
    ASSERT_EQ(got.prompt_embeds.sizes(), want.at(name + ".prompt_embeds").sizes());
    EXPECT_LT(scaled_error(got.prompt_embeds, want.at(name + ".prompt_embeds")), 1e-5);
    ASSERT_EQ(got.pooled_prompt_embeds.sizes(), want.at(name + ".pooled_prompt_embeds").sizes());
    EXPECT_LT(scaled_error(got.pooled_prompt_embeds, want.at(name + ".pooled_prompt_embeds")),
              1e-5);
    EXPECT_EQ(want.at(name + ".text_ids").sizes(), (at::IntArrayRef{o.max_sequence_length, 3}));
    EXPECT_EQ(want.at(name + ".text_ids").abs().sum().item<double>(), 0.0);
  }
  EXPECT_THROW((void)text::encode_prompt_flux(sd15(), clip, tok2, t5, {}), dt::ConfigError);
}
