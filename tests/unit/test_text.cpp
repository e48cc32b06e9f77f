// Text conditioning: CLIP's tokenizer against transformers' on Stable Diffusion's vocabulary
// (tests/reference/ref_clip_tokenizer.py writes the folders and the ids), and the typed errors
// of damaged tokenizer folders and bad input.
#include <gtest/gtest.h>
#include <unistd.h>

#include <difftrain/adapters/text_encoder_adapters.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/models/clip_text_model.hpp>
#include <difftrain/models/pretrained.hpp>
#include <difftrain/nn/attention/math.hpp>
#include <difftrain/text/clip_tokenizer.hpp>
#include <difftrain/text/encode_prompt.hpp>
#include <difftrain/text/textual_inversion.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "golden.hpp"
#include "text_test_helpers.hpp"

namespace dt = difftrain;
namespace text = difftrain::text;
namespace tst = difftrain::test;
namespace fs = std::filesystem;
using namespace difftrain::test::text_helpers;

namespace {

std::vector<std::string> sweep_strings() {
  return tst::golden("clip_tokenizer.json")["strings"].get<std::vector<std::string>>();
}

}  // namespace

// Every string of the sweep (12,000 generated: words, punctuation runs, digits, emoji, CJK,
// accented and combining characters, case oddities, control characters, white-space variants,
// special tokens written literally, texts far past 77 tokens; plus real captions) gives the ids
// transformers gives, for each folder layout users have; so do padded and truncated batches and
// decoding.
TEST(ClipTokenizer, SweepEqualsTransformers) {
  const auto& g = tst::golden("clip_tokenizer.json");
  const auto strings = sweep_strings();
  ASSERT_GE(strings.size(), 10000U);
  for (const auto& [variant, v] : g["variants"].items()) {
    SCOPED_TRACE(variant);
    const auto tok = text::CLIPTokenizer::from_folder(tokenizer_dir(variant));
    EXPECT_EQ(tok.pad_token_id(), v["pad_token_id"].get<std::int64_t>());
    EXPECT_EQ(tok.model_max_length(), v["model_max_length"].get<std::int64_t>());
    EXPECT_EQ(tok.vocab_size(), 49408);
    const std::size_t count = v["count"].get<std::size_t>();
    std::size_t differ = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const Ids want = v["ids"][i].get<Ids>();
      const Ids got = tok.encode(strings[i]);
      if (got != want && ++differ <= 3)
        ADD_FAILURE() << "string " << i << " " << nlohmann::json(strings[i]).dump() << ": "
                      << nlohmann::json(got).dump() << " vs " << nlohmann::json(want).dump();
    }
    EXPECT_EQ(differ, 0U) << "of " << count;

    const std::vector<std::string> first(strings.begin(), strings.begin() + 500);
    const text::BatchEncoding padded = tok(first);
    EXPECT_EQ(padded.input_ids, v["batch_ids"].get<IdRows>());
    EXPECT_EQ(padded.attention_mask, v["batch_mask"].get<IdRows>());
    const std::vector<std::string> next(strings.begin() + 500, strings.begin() + 700);
    text::EncodeOptions o;
    o.padding = text::Padding::longest;
    o.max_length = 40;
    const text::BatchEncoding longest = tok(next, o);
    EXPECT_EQ(longest.input_ids, v["longest_ids"].get<IdRows>());
    EXPECT_EQ(longest.attention_mask, v["longest_mask"].get<IdRows>());

    for (std::size_t i = 0; i < 500; ++i) {
      const Ids ids = v["ids"][i].get<Ids>();
      EXPECT_EQ(tok.decode(ids), v["decoded"][i].get<std::string>()) << i;
      EXPECT_EQ(tok.decode(ids, true), v["decoded_skip"][i].get<std::string>()) << i;
    }
  }
}

// Textual-inversion names added as diffusers' load_textual_inversion adds them: new ids after the
// vocabulary, matched in the lower-cased text before BPE, a name that is already a token keeps
// its id.
TEST(ClipTokenizer, AddedTokensEqualTransformers) {
  const auto& g = tst::golden("clip_tokenizer.json")["added"];
  text::CLIPTokenizer tok = sd15();
  for (const auto& name : g["names"]) tok.add_token({.content = name.get<std::string>()});
  EXPECT_EQ(tok.size(), g["size"].get<std::int64_t>());
  for (const auto& t : g["tokens"]) {
    const auto id = tok.token_to_id(t["content"].get<std::string>());
    ASSERT_TRUE(id.has_value()) << t;
    EXPECT_EQ(*id, t["id"].get<std::int64_t>()) << t;
  }
  const auto prompts = g["prompts"].get<std::vector<std::string>>();
  for (std::size_t i = 0; i < prompts.size(); ++i)
    EXPECT_EQ(tok.encode(prompts[i]), g["ids"][i].get<Ids>()) << prompts[i];
  // The copy it was made from is unchanged.
  EXPECT_EQ(sd15().size(), 49408);
}

// Threads share the tokenizer (and its word cache) and get the ids one thread gets.
TEST(ClipTokenizer, ThreadsAgree) {
  const auto strings = sweep_strings();
  const text::CLIPTokenizer tok = text::CLIPTokenizer::from_folder(tokenizer_dir("json"));
  IdRows one;
  for (std::size_t i = 0; i < 2000; ++i) one.push_back(tok.encode(strings[i]));
  std::vector<IdRows> per(4);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < per.size(); ++t)
    threads.emplace_back([&, t] {
      for (std::size_t i = 0; i < 2000; ++i)
        per[t].push_back(tok.encode(strings[(i + 500 * t) % 2000]));
    });
  for (auto& th : threads) th.join();
  for (std::size_t t = 0; t < per.size(); ++t)
    for (std::size_t i = 0; i < 2000; ++i) ASSERT_EQ(per[t][i], one[(i + 500 * t) % 2000]);
}

TEST(ClipTokenizer, BadInputIsNamed) {
  const auto& tok = sd15();
  expect_error<dt::FormatError>([&] { (void)tok.encode("caf\xe9 au lait"); }, "Latin-1 text",
                                {"UTF-8", "byte 3"});
  expect_error<dt::FormatError>([&] { (void)tok.encode("ok\xed\xa0\x80"); }, "a UTF-8 surrogate",
                                {"byte 2"});
  const Ids bad{49406, 320, 60000, 49407};
  expect_error<dt::ConfigError>([&] { (void)tok.decode(bad); }, "id out of range",
                                {"60000", "position 2"});
  text::EncodeOptions o;
  o.max_length = 1;
  expect_error<dt::ConfigError>([&] { (void)tok({"a cat"}, o); }, "max_length 1", {"max_length 1"});
  expect_error<dt::ConfigError>([&] { text::CLIPTokenizer(tok).add_token({}); }, "empty token",
                                {"empty"});
}

// A damaged folder is refused with an error that names the file and what is wrong in it.
TEST(ClipTokenizer, DamagedFoldersAreRefused) {
  auto load = [](const fs::path& dir) {
    return [dir] { (void)text::CLIPTokenizer::from_folder(dir); };
  };
  {
    DamagedFolder f("no-vocab");
    fs::remove(f.dir / "vocab.json");
    expect_error<dt::IoError>(load(f.dir), "missing vocab.json", {"vocab.json"});
  }
  {
    DamagedFolder f("vocab-not-json");
    f.write("vocab.json", "{\"a\": 1,");
    expect_error<dt::FormatError>(load(f.dir), "vocab.json cut", {"vocab.json", "not valid JSON"});
  }
  {
    DamagedFolder f("vocab-id-string");
    std::string v = f.read("vocab.json");
    v.replace(v.find("\"!\": 0"), 6, "\"!\": \"0\"");
    f.write("vocab.json", v);
    expect_error<dt::FormatError>(load(f.dir), "a string id", {"vocab.json", "'!'"});
  }
  {
    DamagedFolder f("merges-three");
    std::string m = f.read("merges.txt");
    m.insert(m.find('\n') + 1, "i n g\n");
    f.write("merges.txt", m);
    expect_error<dt::FormatError>(load(f.dir), "a merge of three symbols",
                                  {"merges.txt line 2", "i n g"});
  }
  {
    DamagedFolder f("merges-unknown");
    std::string m = f.read("merges.txt");
    m.insert(m.find('\n') + 1, "q\xe2\x82\xac zz\n");
    f.write("merges.txt", m);
    expect_error<dt::FormatError>(load(f.dir), "a merge of unknown symbols", {"merge 1", "lacks"});
  }
  {
    DamagedFolder f("merges-empty");
    f.write("merges.txt", "#version: 0.2\n");
    expect_error<dt::FormatError>(load(f.dir), "no merges", {"merges.txt", "no merges"});
  }
  {
    DamagedFolder f("pad-unknown");
    std::string c = f.read("special_tokens_map.json");
    c.replace(c.find("\"pad_token\": \"<|endoftext|>\""), 28, "\"pad_token\": 7");
    f.write("special_tokens_map.json", c);
    expect_error<dt::FormatError>(load(f.dir), "a pad token that is a number", {"pad_token"});
  }
  {
    DamagedFolder f("other-normalizer", tokenizer_dir("json"));
    std::string j = f.read("tokenizer.json");
    j.replace(j.find("\"NFC\""), 5, "\"NFKC\"");
    f.write("tokenizer.json", j);
    expect_error<dt::FormatError>(load(f.dir), "an NFKC tokenizer.json",
                                  {"tokenizer.json", "normalizer", "NFKC"});
  }
  {
    DamagedFolder f("wordpiece", tokenizer_dir("json"));
    std::string j = f.read("tokenizer.json");
    j.replace(j.find("\"type\": \"BPE\""), 13, "\"type\": \"WordPiece\"");
    f.write("tokenizer.json", j);
    expect_error<dt::FormatError>(load(f.dir), "a WordPiece model",
                                  {"tokenizer.json", "WordPiece"});
  }
  {
    DamagedFolder f("config-array");
    f.write("tokenizer_config.json", "[1, 2]");
    expect_error<dt::FormatError>(load(f.dir), "a config that is a list",
                                  {"tokenizer_config.json"});
  }
  // An id far past the vocabulary (1e8, 2^31 - 1, 2^62) would size the id table by itself:
  // refused before anything is allocated, naming the token and the bound.
  for (const char* id : {"100000000", "2147483647", "4611686018427387904"}) {
    DamagedFolder f(std::string("vocab-id-") + id);
    std::string v = f.read("vocab.json");
    v.replace(v.find("\"!\": 0"), 6, std::string("\"!\": ") + id);
    f.write("vocab.json", v);
    expect_error<dt::FormatError>(load(f.dir), std::string("the id ") + id,
                                  {"vocab.json", "'!'", id, "entries"});
  }
  // JSON of the wrong type below the top of tokenizer.json ("model": {"type": 5}, a list where
  // the vocabulary belongs) is a FormatError naming the folder, never nlohmann's own error.
  for (const auto& [from, to] :
       {std::pair<std::string, std::string>{"\"type\": \"BPE\"", "\"type\": 5"},
        {"\"added_tokens\": [", "\"added_tokens\": [5, "}}) {
    DamagedFolder f("json-types", tokenizer_dir("json"));
    std::string j = f.read("tokenizer.json");
    ASSERT_NE(j.find(from), std::string::npos) << from;
    j.replace(j.find(from), from.size(), to);
    f.write("tokenizer.json", j);
    try {
      (void)text::CLIPTokenizer::from_folder(f.dir);
      ADD_FAILURE() << to << " was accepted";
    } catch (const dt::Error& e) {
      EXPECT_NE(std::string(e.what()).find(f.dir.filename().string()), std::string::npos)
          << e.what();
    }
  }
}

// ---- CLIP text encoders ----------------------------------------------------------------------

namespace {

namespace models = difftrain::models;
namespace attn = difftrain::nn::attention;

template <class Backend>
void check_encoder_case(const nlohmann::json& c, bool checkpointing) {
  const std::string name = c["name"].get<std::string>();
  SCOPED_TRACE(name + " " + std::string(Backend::name) + (checkpointing ? " checkpointed" : ""));
  models::LoadOptions lo;
  if (!c["variant"].is_null()) lo.variant = c["variant"].get<std::string>();
  auto model = models::from_pretrained<models::CLIPTextModel<Backend>>(encoder_dir(name), lo);
  model->to(at::kDouble);
  model->train();
  model->set_gradient_checkpointing(checkpointing);
  EXPECT_EQ(model->config().with_projection, c["projection"].get<bool>());
  const auto io =
      dt::io::load_safetensors(encoder_dir(name).string() + ".io.safetensors", true).tensors;
  std::optional<at::Tensor> mask;
  if (io.contains("attention_mask")) mask = io.at("attention_mask");
  const models::CLIPTextOutput out = model->forward(io.at("input_ids"), mask, true);
  EXPECT_LT(scaled_error(out.last_hidden_state, io.at("last_hidden_state")), 1e-10);
  const auto layers = c["layers"].get<std::size_t>();
  ASSERT_EQ(out.hidden_states.size(), layers + 1);
  for (std::size_t i = 0; i <= layers; ++i)
    EXPECT_LT(scaled_error(out.hidden_states[i], io.at("hidden_states." + std::to_string(i))),
              1e-10)
        << "hidden state " << i;
  at::Tensor loss = (out.last_hidden_state * io.at("w_last")).sum() +
                    (out.hidden_states[layers - 1] * io.at("w_hidden")).sum();
  if (c["projection"].get<bool>()) {
    EXPECT_LT(scaled_error(out.text_embeds, io.at("text_embeds")), 1e-10);
    loss = loss + (out.text_embeds * io.at("w_embeds")).sum();
  } else {
    EXPECT_FALSE(out.text_embeds.defined());
    EXPECT_LT(scaled_error(out.pooler_output, io.at("pooler_output")), 1e-10);
    loss = loss + (out.pooler_output * io.at("w_pooled")).sum();
  }
  loss.backward();
  expect_gradients_match(*model, io);
}

}  // namespace

// Four random tiny configurations (quick_gelu, gelu, gelu_new; 1 to 3 layers; 2 to 5 heads; with
// and without the projection; the old eos_token_id = 2 pooling; a padding mask) saved by
// transformers as one file, shards, an fp16 variant and the prefixed names of older files: every
// hidden state, the pooled output or text_embeds, and every parameter's gradient (the token
// table's included) equal transformers' in float64, with the math and SDPA backends and with
// gradient checkpointing.
TEST(ClipTextModel, EqualsTransformersOnTinyConfigs) {
  const auto& g = tst::golden("text_encoders.json");
  ASSERT_GE(g["cases"].size(), 4U);
  for (const auto& c : g["cases"]) {
    check_encoder_case<attn::Math>(c, false);
    check_encoder_case<attn::Sdpa<attn::Auto>>(c, true);
  }
}

// The encoders Stable Diffusion uses, from transformers' own configs: SD 1.x's CLIP ViT-L/14
// (123,060,480 parameters; SDXL's first encoder, and with the projection 123,650,304), SD 2.x's
// OpenCLIP ViT-H/14 (340,387,840) and SDXL's ViT-bigG/14 with its projection (694,659,840): the
// same parameter names, shapes and counts as transformers'. (The golden file also holds ViT-H
// with a projection and bigG without; building those too would double the test's time.)
TEST(ClipTextModel, PublishedConfigsHaveTransformersParameters) {
  const auto& g = tst::golden("text_encoders.json")["published"];
  ASSERT_EQ(g.size(), 6U);
  for (const std::string name : {"clip_vit_l14", "clip_vit_l14_with_projection", "openclip_vit_h14",
                                 "openclip_vit_bigg14_with_projection"}) {
    const auto& p = g.at(name);
    SCOPED_TRACE(name);
    const auto config = models::CLIPTextConfig::from_json(p["config"], name);
    const models::CLIPTextModel<> model(config);
    std::map<std::string, std::vector<std::int64_t>> shapes;
    std::int64_t count = 0;
    for (const auto& t : model->named_parameters(true)) {
      shapes[t.key()] = t.value().sizes().vec();
      count += t.value().numel();
    }
    EXPECT_EQ(count, p["parameters"].get<std::int64_t>());
    EXPECT_EQ(shapes, (p["shapes"].get<std::map<std::string, std::vector<std::int64_t>>>()));
  }
}

TEST(ClipTextModel, BadConfigsAndInputsAreNamed) {
  const nlohmann::json base = {{"architectures", {"CLIPTextModel"}},
                               {"model_type", "clip_text_model"},
                               {"vocab_size", 50},
                               {"hidden_size", 16},
                               {"intermediate_size", 32},
                               {"num_hidden_layers", 1},
                               {"num_attention_heads", 2},
                               {"max_position_embeddings", 8}};
  auto with = [&](const std::string& key, const nlohmann::json& v) {
    nlohmann::json j = base;
    j[key] = v;
    return [j] { (void)models::CLIPTextConfig::from_json(j, "config.json"); };
  };
  expect_error<dt::ConfigError>(with("num_attention_heads", 3), "heads not dividing",
                                {"hidden_size", "num_attention_heads"});
  expect_error<dt::ConfigError>(with("hidden_act", "mish"), "unknown activation",
                                {"hidden_act", "mish"});
  expect_error<dt::ConfigError>(with("num_hidden_layers", 0), "no layers", {"num_hidden_layers"});
  expect_error<dt::ConfigError>(with("hidden_size", -16), "negative width", {"hidden_size"});
  expect_error<dt::ConfigError>(with("vocab_size", 2.5), "a fractional vocabulary", {"vocab_size"});
  expect_error<dt::ConfigError>(with("rope_theta", 10000), "a field CLIP has not", {"rope_theta"});
  expect_error<dt::ConfigError>(with("model_type", "clip"), "a full CLIP config", {"model_type"});
  expect_error<dt::ConfigError>(with("architectures", {"T5EncoderModel"}), "another model",
                                {"T5EncoderModel"});

  models::CLIPTextModel<attn::Math> model(models::CLIPTextConfig::from_json(base, "config.json"));
  expect_error<dt::ShapeError>(
      [&] {
        (void)model->forward(at::full({2, 4}, 50, at::kLong));
      },
      "an id past the vocabulary", {"token id 50", "(0, 0)"});
  expect_error<dt::ShapeError>(
      [&] {
        (void)model->forward(at::ones({1, 9}, at::kLong));
      },
      "too long", {"length 9", "8 positions"});
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

  // A config that says more layers than the weights hold is refused before the model is built.
  DamagedFolder f("encoder-layers", encoder_dir("tiny_quick_gelu"));
  auto j = nlohmann::json::parse(f.read("config.json"));
  j["num_hidden_layers"] = 200;
  f.write("config.json", j.dump());
  expect_error<dt::ConfigError>(
      [&] { (void)models::from_pretrained<models::CLIPTextModel<>>(f.dir); }, "200 layers",
      {"text_model.encoder.layers.", "200"});
}

// A folder difftrain saves loads back to the same model, in both classes (one as an fp16
// variant); with DIFFTRAIN_TEXT_OUT set the folders and outputs stay there for
// tests/reference/check_cpp_text_encoders.py, which loads them in transformers.
TEST(ClipTextModel, SavedFoldersRoundTrip) {
  const char* keep = std::getenv("DIFFTRAIN_TEXT_OUT");
  const fs::path out = keep != nullptr ? fs::path(keep)
                                       : fs::temp_directory_path() /
                                             ("difftrain-text-save-" + std::to_string(::getpid()));
  std::map<std::string, at::Tensor> outputs;
  for (const std::string name : {"tiny_quick_gelu", "tiny_gelu_projection"}) {
    SCOPED_TRACE(name);
    auto model = models::from_pretrained<models::CLIPTextModel<>>(encoder_dir(name));
    model->eval();
    const bool projection = model->config().with_projection;
    models::SaveOptions so;
    if (projection) {
      so.variant = "fp16";
      so.dtype = at::kHalf;
    }
    models::save_pretrained(model, out / name, so);
    EXPECT_TRUE(
        fs::exists(out / name / (projection ? "model.fp16.safetensors" : "model.safetensors")));
    models::LoadOptions lo;
    lo.variant = so.variant;
    auto back = models::from_pretrained<models::CLIPTextModel<>>(out / name, lo);
    back->eval();
    at::Tensor ids = at::randint(3, model->config().vocab_size - 3, {2, 8}, at::kLong);
    ids.index_put_({at::indexing::Slice(), 7}, model->config().eos_token_id);
    at::NoGradGuard no_grad;
    const auto a = model->forward(ids), b = back->forward(ids);
    const double tol = projection ? 1e-2 : 0.0;  // the fp16 variant rounds the weights
    EXPECT_LE(scaled_error(b.last_hidden_state, a.last_hidden_state), tol);
    outputs[name + ".input_ids"] = ids;
    outputs[name + ".last_hidden_state"] = b.last_hidden_state;
    outputs[name + (projection ? ".text_embeds" : ".pooler_output")] =
        projection ? b.text_embeds : b.pooler_output;
  }
  if (keep != nullptr)
    dt::io::save_safetensors(out / "outputs.safetensors", outputs);
  else
    dt::io::remove_tree(out);
}

// ---- diffusers' encode_prompt ---------------------------------------------------------------

// The conditioning diffusers' SD and SDXL pipelines compute, on tiny random pipelines with SD's
// vocabulary: short and long (truncated) prompts, guidance with an empty, a given and (SDXL) a
// zeroed negative prompt, clip_skip 1 and 2, two images per prompt, SD 2's "!" padding, SDXL's
// prompt_2.
TEST(EncodePrompt, EqualsDiffusersPipelines) {
  const auto& g = tst::golden("encode_prompt.json");
  const fs::path root = fs::path(DIFFTRAIN_GOLDEN_DIR) / "encode_prompt";
  const auto want = dt::io::load_safetensors(root / "outputs.safetensors", true).tensors;
  auto te1 = models::from_pretrained<models::CLIPTextModel<>>(root / "text_encoder");
  auto te2 = models::from_pretrained<models::CLIPTextModel<>>(root / "text_encoder_2");
  te1->eval();
  te2->eval();
  const auto tok2 = text::CLIPTokenizer::from_folder(tokenizer_dir("sd2"));
  const auto prompts = g["prompts"].get<std::vector<std::string>>();
  at::NoGradGuard no_grad;
  auto list = [](const nlohmann::json& c, const char* key) {
    std::optional<std::vector<std::string>> v;
    if (c.contains(key)) v = c[key].get<std::vector<std::string>>();
    return v;
  };
  for (const auto& c : g["cases"]) {
    const std::string name = c["name"].get<std::string>();
    SCOPED_TRACE(name);
    text::EncodePromptOptions o;
    o.num_images_per_prompt = c["num_images_per_prompt"].get<std::int64_t>();
    o.do_classifier_free_guidance = c["guidance"].get<bool>();
    if (c.contains("clip_skip")) o.clip_skip = c["clip_skip"].get<std::int64_t>();
    o.negative_prompt = list(c, "negative_prompt");
    o.prompt_2 = list(c, "prompt_2");
    const std::string pipe = c["pipeline"].get<std::string>();
    text::EncodedPrompt got;
    if (pipe.starts_with("xl")) {
      o.force_zeros_for_empty_prompt = pipe == "xl";
      got = text::encode_prompt_sdxl(sd15(), te1, tok2, te2, prompts, o);
      EXPECT_LT(scaled_error(got.pooled_prompt_embeds, want.at(name + ".pooled_prompt_embeds")),
                1e-5);
      EXPECT_LT(scaled_error(got.negative_pooled_prompt_embeds,
                             want.at(name + ".negative_pooled_prompt_embeds")),
                1e-5);
    } else {
      got = text::encode_prompt(pipe == "sd2" ? tok2 : sd15(), te1, prompts, o);
      EXPECT_FALSE(got.pooled_prompt_embeds.defined());
    }
    const at::Tensor& w = want.at(name + ".prompt_embeds");
    ASSERT_EQ(got.prompt_embeds.sizes(), w.sizes());
    EXPECT_LT(scaled_error(got.prompt_embeds, w), 1e-5);
    if (want.contains(name + ".negative_prompt_embeds")) {
      EXPECT_LT(scaled_error(got.negative_prompt_embeds, want.at(name + ".negative_prompt_embeds")),
                1e-5);
    } else {
      EXPECT_FALSE(got.negative_prompt_embeds.defined());
    }
  }
  text::EncodePromptOptions bad;
  bad.negative_prompt = std::vector<std::string>{"a", "b", "c"};
  expect_error<dt::ConfigError>([&] { (void)text::encode_prompt(sd15(), te1, prompts, bad); },
                                "three negatives for two prompts", {"negative_prompt", "3"});
  bad = {};
  bad.clip_skip = 3;
  expect_error<dt::ConfigError>([&] { (void)text::encode_prompt(sd15(), te1, prompts, bad); },
                                "clip_skip past the layers", {"clip_skip 3"});
  expect_error<dt::ConfigError>(
      [&] { (void)text::encode_prompt_sdxl(sd15(), te1, tok2, te1, prompts, {}); },
      "no projection on the second encoder", {"CLIPTextModelWithProjection"});
  // A model_max_length past the encoder's positions (1e9 allocated rows of a billion tokens) is
  // refused before anything is padded to it; one equal to them encodes.
  for (const std::string length : {"78", "1000000000", "1e9"}) {
    DamagedFolder d("max-length-" + length);
    nlohmann::json cfg = nlohmann::json::parse(d.read("tokenizer_config.json"));
    cfg["model_max_length"] = nlohmann::json::parse(length);
    d.write("tokenizer_config.json", cfg.dump());
    const auto tok = text::CLIPTokenizer::from_folder(d.dir);
    expect_error<dt::ConfigError>([&] { (void)text::encode_prompt(tok, te1, prompts, {}); },
                                  "model_max_length " + length,
                                  {"model_max_length", "max_position_embeddings"});
  }
}

// ---- textual inversion in the token table -----------------------------------------------------

// diffusers' load_textual_inversion: a two-vector embedding as "<cat-toy>" and "<cat-toy>_1", new
// rows of the table, prompts expanded as diffusers expands them (not "<Cat-Toy>": its text
// replacement is case-sensitive); the conditioning equals diffusers'.
TEST(TextualInversion, LoadsAsDiffusers) {
  const auto& g = tst::golden("encode_prompt.json")["textual_inversion"];
  const fs::path root = fs::path(DIFFTRAIN_GOLDEN_DIR) / "encode_prompt";
  const auto want = dt::io::load_safetensors(root / "outputs.safetensors", true).tensors;
  auto te = models::from_pretrained<models::CLIPTextModel<>>(root / "text_encoder");
  te->eval();
  text::CLIPTokenizer tok = sd15();
  const auto ids = text::load_textual_inversion(tok, te, "<cat-toy>", want.at("ti.vectors"));
  EXPECT_EQ(ids, g["token_ids"].get<Ids>());
  EXPECT_EQ(te->token_embedding->weight.size(0), g["table_rows"].get<std::int64_t>());
  EXPECT_EQ(te->config().vocab_size, g["table_rows"].get<std::int64_t>());
  const auto prompts = g["prompts"].get<std::vector<std::string>>();
  std::vector<std::string> converted;
  for (const auto& p : prompts) converted.push_back(text::convert_prompt(tok, p));
  const text::BatchEncoding b = tok(converted);
  EXPECT_EQ(b.input_ids[0],
            (std::vector<std::int64_t>(want.at("ti.input_ids")[0].data_ptr<std::int64_t>(),
                                       want.at("ti.input_ids")[0].data_ptr<std::int64_t>() + 77)));
  EXPECT_EQ(b.input_ids[1],
            (std::vector<std::int64_t>(want.at("ti.input_ids")[1].data_ptr<std::int64_t>(),
                                       want.at("ti.input_ids")[1].data_ptr<std::int64_t>() + 77)));
  text::EncodePromptOptions o;
  o.do_classifier_free_guidance = false;
  at::NoGradGuard no_grad;
  const auto e = text::encode_prompt(tok, te, prompts, o);
  EXPECT_LT(scaled_error(e.prompt_embeds, want.at("ti.prompt_embeds")), 1e-5);
  // A name the tokenizer has, or vectors of another width, change nothing.
  expect_error<dt::ConfigError>(
      [&] { (void)text::load_textual_inversion(tok, te, "<cat-toy>", at::zeros({32})); },
      "the same name again", {"<cat-toy>", "already"});
  expect_error<dt::ShapeError>(
      [&] {
        (void)text::load_textual_inversion(tok, te, "<dog>", at::zeros({2, 31}));
      },
      "another width", {"32"});
  EXPECT_EQ(tok.size(), g["table_rows"].get<std::int64_t>());
  EXPECT_EQ(te->token_embedding->weight.size(0), g["table_rows"].get<std::int64_t>());
}

// Training an embedding against the real encoder changes only its rows: after 12 AdamW steps with
// weight decay, every other row of the table and every encoder weight equal their values before,
// to the bit, while the embedding moved and the loss fell.
TEST(TextualInversion, TrainingChangesOnlyItsRows) {
  const fs::path root = fs::path(DIFFTRAIN_GOLDEN_DIR) / "encode_prompt";
  auto te = models::from_pretrained<models::CLIPTextModel<>>(root / "text_encoder");
  te->train();
  text::CLIPTokenizer tok = sd15();
  const at::Tensor init =
      te->token_embedding->weight.detach().index_select(0, at::tensor(tok.encode("cat", false)));
  const auto ids = text::load_textual_inversion(tok, te, "<sks>", at::cat({init, init}));
  std::vector<std::pair<std::string, at::Tensor>> before;
  for (const auto& p : te->named_parameters(true)) {
    p.value().set_requires_grad(p.key() == "text_model.embeddings.token_embedding.weight");
    before.emplace_back(p.key(), p.value().detach().clone());
  }
  at::Tensor& table = te->token_embedding->weight;
  text::TokenRowsKeeper keeper(table, ids);
  torch::optim::AdamW opt({table}, torch::optim::AdamWOptions(5e-2).weight_decay(1e-2));
  const text::BatchEncoding b = tok({text::convert_prompt(tok, "a photo of <sks>")});
  const at::Tensor input = at::tensor(b.input_ids[0]).unsqueeze(0);
  at::manual_seed(0);
  const at::Tensor target = at::randn({1, 32});
  std::vector<double> losses;
  for (int step = 0; step < 12; ++step) {
    opt.zero_grad();
    const at::Tensor loss = (te->forward(input).pooler_output - target).square().mean();
    loss.backward();
    opt.step();
    keeper.restore();
    losses.push_back(loss.item<double>());
  }
  EXPECT_LT(losses.back(), losses.front());
  std::vector<std::int64_t> other;
  for (std::int64_t r = 0; r < table.size(0); ++r)
    if (std::find(ids.begin(), ids.end(), r) == ids.end()) other.push_back(r);
  const at::Tensor keep = at::tensor(other);
  for (const auto& [name, old] : before) {
    const at::Tensor now = te->named_parameters(true)[name];
    if (name == "text_model.embeddings.token_embedding.weight") {
      EXPECT_TRUE(at::equal(now.index_select(0, keep), old.index_select(0, keep)));
      for (const auto id : ids) EXPECT_FALSE(at::equal(now[id], old[id])) << "row " << id;
    } else {
      EXPECT_TRUE(at::equal(now, old)) << name;
    }
  }
}

// ---- LoRA on the text encoder -----------------------------------------------------------------

// LoRA on every attention projection and MLP layer of a CLIP text encoder trains (only the
// branches move), and its PEFT ("text_encoder.") and kohya ("lora_te_") files load back onto a
// fresh encoder with the same output; with DIFFTRAIN_TEXT_OUT set the files stay for
// check_cpp_text_encoders.py, which reads them with diffusers' lora_state_dict.
TEST(TextEncoderLora, TrainsAndItsFilesLoadBack) {
  namespace ad = difftrain::adapters;
  const fs::path root = fs::path(DIFFTRAIN_GOLDEN_DIR) / "encode_prompt";
  auto te = models::from_pretrained<models::CLIPTextModel<>>(root / "text_encoder");
  const auto adapted =
      ad::inject_lora(*te, ad::text_encoder_lora_targets(true), {.rank = 4, .alpha = 8.0});
  EXPECT_EQ(adapted.size(), 3U * 6U);  // 3 layers × q, k, v, out, fc1, fc2
  std::vector<at::Tensor> trainable;
  for (const auto& p : te->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  EXPECT_EQ(trainable.size(), adapted.size() * 2);
  const auto b = sd15()({"a photo of a cat", "an oil painting of a castle"});
  std::vector<std::int64_t> flat;
  for (const auto& row : b.input_ids) flat.insert(flat.end(), row.begin(), row.end());
  const at::Tensor ids = at::tensor(flat).view({2, -1});
  at::manual_seed(1);
  const at::Tensor target = at::randn({2, 77, 32});
  torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-2));
  double first = 0, last = 0;
  for (int step = 0; step < 6; ++step) {
    opt.zero_grad();
    const at::Tensor loss = (te->forward(ids).last_hidden_state - target).square().mean();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first);
  te->eval();
  at::NoGradGuard no_grad;
  const at::Tensor out = te->forward(ids).last_hidden_state;
  const auto peft = ad::lora_state_dict(*te, ad::text_encoder_lora_keys(ad::LoraLayout::peft));
  const auto kohya = ad::lora_state_dict(*te, ad::text_encoder_lora_keys(ad::LoraLayout::kohya));
  EXPECT_TRUE(
      peft.contains("text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"));
  EXPECT_TRUE(kohya.contains("lora_te_text_model_encoder_layers_2_mlp_fc2.lora_up.weight"));
  const auto sdxl2 = ad::lora_state_dict(
      *te, ad::text_encoder_lora_keys(ad::LoraLayout::kohya, ad::TextEncoderSlot::second));
  EXPECT_TRUE(sdxl2.contains("lora_te2_text_model_encoder_layers_1_self_attn_out_proj.alpha"));
  for (const auto* file : {&peft, &kohya}) {
    auto fresh = models::from_pretrained<models::CLIPTextModel<>>(root / "text_encoder");
    fresh->eval();
    const auto layout = file == &peft ? ad::LoraLayout::peft : ad::LoraLayout::kohya;
    ad::load_lora_state_dict(*fresh, *file, ad::text_encoder_lora_keys(layout),
                             {.rank = 4, .alpha = 8.0});
    EXPECT_LT(scaled_error(fresh->forward(ids).last_hidden_state, out), 1e-6);
  }
  if (const char* dir = std::getenv("DIFFTRAIN_TEXT_OUT")) {
    const fs::path o = dir;
    fs::create_directories(o);
    dt::io::save_safetensors(o / "te_lora_peft.safetensors", peft);
    dt::io::save_safetensors(o / "te_lora_kohya.safetensors", kohya);
    dt::io::save_safetensors(o / "te_lora_output.safetensors",
                             {{"output", out}, {"input_ids", ids}});
  }
}
