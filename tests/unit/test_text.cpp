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
#include <difftrain/models/t5_encoder.hpp>
#include <difftrain/nn/attention/math.hpp>
#include <difftrain/text/clip_tokenizer.hpp>
#include <difftrain/text/encode_prompt.hpp>
#include <difftrain/text/t5_tokenizer.hpp>
#include <difftrain/text/textual_inversion.hpp>
#include <difftrain/text/webui_conditioning.hpp>
#include <difftrain/text/webui_prompt.hpp>

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

namespace dt = difftrain;
namespace text = difftrain::text;
namespace tst = difftrain::test;
namespace fs = std::filesystem;

namespace {

using Ids = std::vector<std::int64_t>;
using IdRows = std::vector<Ids>;

fs::path tokenizer_dir(const std::string& variant) {
  return fs::path(DIFFTRAIN_GOLDEN_DIR) / "clip_tokenizer" / variant;
}

const text::CLIPTokenizer& sd15() {
  static const text::CLIPTokenizer tok = text::CLIPTokenizer::from_folder(tokenizer_dir("sd15"));
  return tok;
}

std::vector<std::string> sweep_strings() {
  return tst::golden("clip_tokenizer.json")["strings"].get<std::vector<std::string>>();
}

// A scratch copy of the SD 1.x folder, damaged by `damage`, removed afterwards.
struct DamagedFolder {
  fs::path dir;
  explicit DamagedFolder(const std::string& name, const fs::path& source = tokenizer_dir("sd15")) {
    dir = fs::temp_directory_path() / ("difftrain-tok-" + name + "-" + std::to_string(::getpid()));
    dt::io::remove_tree(dir);
    fs::create_directories(dir);
    for (const auto& e : fs::directory_iterator(source))
      fs::copy_file(e.path(), dir / e.path().filename());
  }
  ~DamagedFolder() { dt::io::remove_tree(dir); }
  void write(const std::string& file, const std::string& content) const {
    std::ofstream(dir / file, std::ios::binary | std::ios::trunc) << content;
  }
  [[nodiscard]] std::string read(const std::string& file) const {
    std::ifstream in(dir / file, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }
};

template <class E>
void expect_error(const std::function<void()>& f, const std::string& what,
                  const std::vector<std::string>& mentions) {
  try {
    f();
    ADD_FAILURE() << what << ": accepted";
  } catch (const E& e) {
    for (const auto& m : mentions)
      EXPECT_NE(std::string(e.what()).find(m), std::string::npos)
          << what << ": '" << e.what() << "' does not mention '" << m << "'";
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": wrong error type: " << e.what();
  }
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

fs::path encoder_dir(const std::string& name) {
  return fs::path(DIFFTRAIN_GOLDEN_DIR) / "text_encoders" / name;
}

// |a - b| relative to b's scale (its largest magnitude; at least 1e-3, for gradients that are
// zero in exact arithmetic, as the key projection's bias, whose values are rounding noise).
double scaled_error(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-3);
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / scale;
}

// Every parameter's gradient equals the reference's "grad.<name>" (float64, 1e-10 of its scale),
// and the reference has no gradient the model lacks.
void expect_gradients_match(const torch::nn::Module& model,
                            const std::map<std::string, at::Tensor>& io) {
  std::size_t compared = 0;
  for (const auto& p : model.named_parameters(true)) {
    const auto it = io.find("grad." + p.key());
    ASSERT_NE(it, io.end()) << "no reference gradient for " << p.key();
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_LT(scaled_error(p.value().grad(), it->second), 1e-10) << p.key();
    ++compared;
  }
  const auto reference_grads = std::count_if(
      io.begin(), io.end(), [](const auto& e) { return e.first.starts_with("grad."); });
  EXPECT_EQ(compared, static_cast<std::size_t>(reference_grads));
}

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

// ---- the web UI's prompt syntax ---------------------------------------------------------------

// The weights the web UI's rules give (modules/prompt_parser.py and its wiki): ( ) ×1.1, [ ] ÷1.1,
// (text:w) ×w, multipliers of nested brackets multiplied in the order the brackets close, \ for
// literal brackets, BREAK only as a word of its own, an unclosed bracket applying to the end, a
// stray closing bracket kept as text, neighbours of equal weight merged. Written from the rules.
TEST(WebuiPrompt, AttentionTable) {
  const double up = 1.1, down = 1 / 1.1;
  struct Row {
    std::string prompt;
    std::vector<text::WeightedText> want;
  };
  const std::vector<Row> table = {
      {"normal text", {{"normal text", 1.0}}},
      {"an (important) word", {{"an ", 1.0}, {"important", up}, {" word", 1.0}}},
      {"(unbalanced", {{"unbalanced", up}}},
      {"\\(literal\\]", {{"(literal]", 1.0}}},
      {"(unnecessary)(parens)", {{"unnecessaryparens", up}}},
      {"a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
       {{"a ", 1.0},
        {"house", 1.3 * up * up},
        {" ", up},
        {"on", up * down},
        {" a ", up},
        {"hill", 0.5 * up},
        {", sun, ", up},
        {"sky", up * up * up * up},
        {".", up}}},
      {"((word))", {{"word", up * up}}},
      {"[word]", {{"word", down}}},
      {"[[word]]", {{"word", down * down}}},
      {"(word:1.3)", {{"word", 1.3}}},
      {"(word:.5)", {{"word", 0.5}}},
      {"(word:+2)", {{"word", 2.0}}},
      {"(word:-1)", {{"word", -1.0}}},
      {"(word:1.)", {{"word", 1.0}}},
      {"((a) b:1.5)", {{"a", up * 1.5}, {" b", 1.5}}},
      {"[a:0.5]", {{"a:0.5", down}}},
      {"(a:b)", {{"a:b", up}}},
      {"x:1.5) y", {{"x:1.5) y", 1.0}}},
      {"(x:1.5", {{"x:1.5", up}}},
      {"(a)b)", {{"a", up}, {"b)", 1.0}}},
      {"a]b", {{"a]b", 1.0}}},
      {"\\\\", {{"\\", 1.0}}},
      {"a\\b", {{"ab", 1.0}}},
      {"", {{"", 1.0}}},
      {"()", {{"", 1.0}}},
      {"a BREAK b", {{"a", 1.0}, {"BREAK", -1.0}, {"b", 1.0}}},
      {"a\n BREAK\tb", {{"a", 1.0}, {"BREAK", -1.0}, {"b", 1.0}}},
      {"aBREAK b", {{"aBREAK b", 1.0}}},
      {"a BREAKb", {{"a BREAKb", 1.0}}},
      {"a break b", {{"a break b", 1.0}}},
      {"BREAK", {{"", 1.0}, {"BREAK", -1.0}, {"", 1.0}}},
      {"(a BREAK b)", {{"a", up}, {"BREAK", -up}, {"b", up}}},
      {"[a BREAK b]", {{"a", down}, {"BREAK", -down}, {"b", down}}},
      {"café (naïve:1.2) 東京", {{"café ", 1.0}, {"naïve", 1.2}, {" 東京", 1.0}}},
  };
  for (const auto& [prompt, want] : table) {
    const auto got = text::parse_prompt_attention(prompt);
    ASSERT_EQ(got.size(), want.size()) << nlohmann::json(prompt).dump();
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].text, want[i].text) << nlohmann::json(prompt).dump() << " part " << i;
      EXPECT_DOUBLE_EQ(got[i].weight, want[i].weight)
          << nlohmann::json(prompt).dump() << " part " << i;
    }
  }
  expect_error<dt::ConfigError>([] { (void)text::parse_prompt_attention("(a:1.2.3)"); },
                                "a weight of two dots", {"1.2.3"});
}

// tests/reference/ref_webui_prompt.py: the web UI's parser on 3,000 random prompts of brackets,
// weights in every script's digits, BREAK beside Python's white space (U+001C-U+001F too).
TEST(WebuiPrompt, AttentionEqualsTheWebUiOnRandomPrompts) {
  const auto& cases = dt::test::golden("webui_prompt.json")["cases"];
  ASSERT_GT(cases.size(), 3000U);
  std::size_t refused = 0, weighted = 0;
  for (const auto& c : cases) {
    const auto prompt = c["prompt"].get<std::string>();
    const std::string shown = nlohmann::json(prompt).dump();
    if (c.contains("refused")) {
      ++refused;
      EXPECT_THROW((void)text::parse_prompt_attention(prompt), dt::ConfigError) << shown;
      continue;
    }
    const auto got = text::parse_prompt_attention(prompt);
    const auto& want = c["parts"];
    ASSERT_EQ(got.size(), want.size()) << shown;
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].text, want[i][0].get<std::string>()) << shown << " part " << i;
      EXPECT_NEAR(got[i].weight, want[i][1].get<double>(), 1e-12) << shown << " part " << i;
      weighted += got[i].weight != 1.0 && got[i].weight != -1.0;
    }
  }
  EXPECT_GT(refused, 10U);
  EXPECT_GT(weighted, 500U);
  // 100,000 colons, or escaped brackets, are one run of text each (merged in linear time).
  for (const std::string unit : {":", "\\("}) {
    std::string many;
    for (int i = 0; i < 100000; ++i) many += unit;
    const auto got = text::parse_prompt_attention(many);
    ASSERT_EQ(got.size(), 1U);
    EXPECT_EQ(got[0].text.size(), 100000U);
  }
}

namespace {

std::string repeat(const std::string& word, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += word + " ";
  return s;
}

}  // namespace

// Chunks of 75 tokens between a start and an end token, as the web UI cuts them: a long prompt
// continues in a second chunk, BREAK starts one, a full chunk moves the words after a comma at
// most 20 tokens back into the next, an embedding is never split, multipliers follow their
// tokens. Expected chunks written from the rules ("cat" and "," are one token each).
TEST(WebuiPrompt, ChunksTable) {
  const auto& tok = sd15();
  const std::int64_t cat = tok.encode("cat", false).at(0), comma = *tok.token_to_id(",</w>");
  const std::int64_t bos = tok.bos_token_id(), eos = tok.eos_token_id();
  auto chunk = [&](std::vector<std::int64_t> body) {
    body.insert(body.begin(), bos);
    body.resize(76, eos);
    body.push_back(eos);
    return body;
  };
  auto cats = [&](int n) { return std::vector<std::int64_t>(static_cast<std::size_t>(n), cat); };
  auto join = [](std::vector<std::int64_t> a, const std::vector<std::int64_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };

  auto p = text::tokenize_prompt(tok, "a cat");
  ASSERT_EQ(p.chunks.size(), 1U);
  EXPECT_EQ(p.chunks[0].tokens, chunk(tok.encode("a cat", false)));
  EXPECT_EQ(p.token_count, 2);
  EXPECT_EQ(p.chunks[0].multipliers, std::vector<double>(77, 1.0));

  p = text::tokenize_prompt(tok, "");
  ASSERT_EQ(p.chunks.size(), 1U);
  EXPECT_EQ(p.chunks[0].tokens, chunk({}));
  EXPECT_EQ(p.token_count, 0);

  p = text::tokenize_prompt(tok, repeat("cat", 80));
  ASSERT_EQ(p.chunks.size(), 2U);
  EXPECT_EQ(p.chunks[0].tokens, chunk(cats(75)));
  EXPECT_EQ(p.chunks[1].tokens, chunk(cats(5)));
  EXPECT_EQ(p.token_count, 80);

  p = text::tokenize_prompt(tok, repeat("cat", 75));
  ASSERT_EQ(p.chunks.size(), 1U);
  EXPECT_EQ(p.token_count, 75);

  p = text::tokenize_prompt(tok, "cat BREAK cat cat");
  ASSERT_EQ(p.chunks.size(), 2U);
  EXPECT_EQ(p.chunks[0].tokens, chunk(cats(1)));
  EXPECT_EQ(p.chunks[1].tokens, chunk(cats(2)));
  EXPECT_EQ(p.token_count, 77);

  // 70 cats, a comma, 10 cats: the chunk fills 4 cats after the comma (5 back), so those 4 move.
  const std::string comma_prompt = repeat("cat", 70) + ", " + repeat("cat", 10);
  p = text::tokenize_prompt(tok, comma_prompt);
  ASSERT_EQ(p.chunks.size(), 2U);
  EXPECT_EQ(p.chunks[0].tokens, chunk(join(cats(70), {comma})));
  EXPECT_EQ(p.chunks[1].tokens, chunk(cats(10)));
  EXPECT_EQ(p.token_count, 85);
  text::WebuiPromptOptions no_wrap;
  no_wrap.comma_padding_backtrack = 0;
  p = text::tokenize_prompt(tok, comma_prompt, no_wrap);
  EXPECT_EQ(p.chunks[0].tokens, chunk(join(join(cats(70), {comma}), cats(4))));
  EXPECT_EQ(p.chunks[1].tokens, chunk(cats(6)));
  // A comma 30 tokens back is too far: nothing moves.
  p = text::tokenize_prompt(tok, repeat("cat", 45) + ", " + repeat("cat", 40));
  EXPECT_EQ(p.chunks[0].tokens, chunk(join(join(cats(45), {comma}), cats(29))));
  EXPECT_EQ(p.chunks[1].tokens, chunk(cats(11)));

  // Multipliers follow the tokens; the start and end positions stay 1.
  p = text::tokenize_prompt(tok, "(cat:1.5) cat [cat]");
  std::vector<double> want(77, 1.0);
  want[1] = 1.5;
  want[3] = 1 / 1.1;
  EXPECT_EQ(p.chunks[0].multipliers, want);
  // Emphasis off: brackets are text.
  text::WebuiPromptOptions literal;
  literal.emphasis = text::Emphasis::none;
  p = text::tokenize_prompt(tok, "(cat:1.5)", literal);
  EXPECT_EQ(p.chunks[0].tokens, chunk(tok.encode("(cat:1.5)", false)));

  // An embedding named by "sks" takes 3 positions; at 73 tokens it does not fit and starts the
  // next chunk.
  const std::vector<std::int64_t> sks = tok.encode("sks", false);
  const text::EmbeddingFinder finder = [&](const std::vector<std::int64_t>& t, std::size_t at) {
    std::optional<text::FoundEmbedding> f;
    if (at + sks.size() <= t.size() &&
        std::equal(sks.begin(), sks.end(), t.begin() + static_cast<std::ptrdiff_t>(at)))
      f = text::FoundEmbedding{"sks", 3, static_cast<std::int64_t>(sks.size())};
    return f;
  };
  p = text::tokenize_prompt(tok, "a (sks:1.2) cat", {}, finder);
  ASSERT_EQ(p.chunks[0].fixes.size(), 1U);
  EXPECT_EQ(p.chunks[0].fixes[0], (text::ChunkFix{1, "sks", 3}));
  EXPECT_EQ(p.chunks[0].tokens, chunk(join(join(tok.encode("a", false), {0, 0, 0}), cats(1))));
  EXPECT_EQ(
      std::vector<double>(p.chunks[0].multipliers.begin() + 2, p.chunks[0].multipliers.begin() + 5),
      std::vector<double>(3, 1.2));
  p = text::tokenize_prompt(tok, repeat("cat", 73) + "sks", {}, finder);
  ASSERT_EQ(p.chunks.size(), 2U);
  EXPECT_EQ(p.chunks[0].tokens, chunk(cats(73)));
  EXPECT_EQ(p.chunks[1].fixes[0].offset, 0U);
}

// The conditioning: each chunk through the encoder, the multipliers applied to its output with
// the batch's mean restored (original), or not (no_norm), or not applied (ignore); CLIP skip takes
// an earlier layer through the final LayerNorm; SD 2's padding id after the end token; an
// embedding's vectors placed at its fix; chunks concatenated.
TEST(WebuiPrompt, ConditioningFollowsTheRules) {
  auto te =
      models::from_pretrained<models::CLIPTextModel<attn::Math>>(encoder_dir("tiny_quick_gelu"));
  te->eval();
  at::NoGradGuard no_grad;
  // A small vocabulary: hand-made chunks (start 97, end 98, length 16 as the model's positions).
  auto make = [](std::vector<std::int64_t> body, std::vector<double> mults) {
    text::PromptChunk c;
    c.tokens = {97};
    c.tokens.insert(c.tokens.end(), body.begin(), body.end());
    c.tokens.resize(16, 98);
    c.multipliers = {1.0};
    c.multipliers.insert(c.multipliers.end(), mults.begin(), mults.end());
    c.multipliers.resize(16, 1.0);
    return c;
  };
  text::TokenizedPrompt a, b;
  a.chunks = {make({5, 6, 7}, {1.0, 1.5, 1.0}), make({8}, {0.5})};
  b.chunks = {make({9, 10}, {1.0, 1.0})};
  const at::Tensor z = text::encode_webui_prompts(te, {a, b});
  ASSERT_EQ(z.sizes(), (std::vector<std::int64_t>{2, 32, 32}));
  for (int chunk_i = 0; chunk_i < 2; ++chunk_i) {
    const auto& ca = a.chunks[static_cast<std::size_t>(chunk_i)];
    const text::PromptChunk cb = chunk_i == 0 ? b.chunks[0] : make({}, {});
    const at::Tensor ids = at::stack({at::tensor(ca.tokens), at::tensor(cb.tokens)});
    const at::Tensor raw = te->forward(ids).last_hidden_state;
    const at::Tensor m = at::stack({at::tensor(ca.multipliers), at::tensor(cb.multipliers)})
                             .to(at::kFloat)
                             .unsqueeze(-1);
    const at::Tensor weighted = raw * m;
    const at::Tensor want = weighted * (raw.mean() / weighted.mean());
    EXPECT_TRUE(at::allclose(z.slice(1, 16 * chunk_i, 16 * (chunk_i + 1)), want, 1e-5, 1e-6))
        << "chunk " << chunk_i;
  }
  text::WebuiEncodeOptions o;
  o.emphasis = text::Emphasis::ignore;
  const at::Tensor plain = text::encode_webui_prompts(te, {b}, o);
  EXPECT_TRUE(at::allclose(
      plain, te->forward(at::tensor(b.chunks[0].tokens).unsqueeze(0)).last_hidden_state));
  o.clip_skip = 2;
  const at::Tensor skipped = text::encode_webui_prompts(te, {b}, o);
  const auto full = te->forward(at::tensor(b.chunks[0].tokens).unsqueeze(0), std::nullopt, true);
  EXPECT_TRUE(at::allclose(skipped, te->final_layer_norm(full.hidden_states[1])));
  o.clip_skip = 1;
  o.pad_token_id = 0;  // SD 2: after the first end token, "!"
  const at::Tensor padded = text::encode_webui_prompts(te, {b}, o);
  std::vector<std::int64_t> sd2 = b.chunks[0].tokens;
  std::fill(sd2.begin() + 4, sd2.end(), 0);
  EXPECT_TRUE(at::allclose(padded, te->forward(at::tensor(sd2).unsqueeze(0)).last_hidden_state));
  // An embedding's two vectors at positions 2 and 3.
  text::TokenizedPrompt e;
  e.chunks = {make({5, 0, 0, 7}, {1, 1, 1, 1})};
  e.chunks[0].fixes = {{1, "emb", 2}};
  const at::Tensor vec = at::randn({2, 32});
  o.emphasis = text::Emphasis::ignore;
  o.pad_token_id = -1;
  const at::Tensor with_emb =
      text::encode_webui_prompts(te, {e}, o, [&](const std::string&) { return vec; });
  const at::Tensor ids = at::tensor(e.chunks[0].tokens).unsqueeze(0);
  at::Tensor embeds = te->token_embedding(ids);
  embeds.index_put_({0, at::indexing::Slice(2, 4)}, vec);
  EXPECT_TRUE(at::allclose(with_emb, te->forward_embeds(embeds, ids).last_hidden_state));
  // Bad input is named.
  o.clip_skip = 5;
  expect_error<dt::ConfigError>([&] { (void)text::encode_webui_prompts(te, {b}, o); },
                                "clip skip 5", {"clip_skip 5"});
  o.clip_skip = 1;
  expect_error<dt::ShapeError>(
      [&] {
        (void)text::encode_webui_prompts(te, {e}, o, [](const std::string&) {
          return at::zeros({2, 7});
        });
      },
      "an embedding of another width", {"emb", "32"});
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
