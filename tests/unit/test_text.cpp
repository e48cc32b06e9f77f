// Text conditioning: CLIP's tokenizer against transformers' on Stable Diffusion's vocabulary
// (tests/reference/ref_clip_tokenizer.py writes the folders and the ids), and the typed errors
// of damaged tokenizer folders and bad input.
#include <gtest/gtest.h>
#include <unistd.h>

#include <difftrain/io/remove_tree.hpp>
#include <difftrain/text/clip_tokenizer.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
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
  explicit DamagedFolder(const std::string& name, const std::string& variant = "sd15") {
    dir = fs::temp_directory_path() / ("difftrain-tok-" + name + "-" + std::to_string(::getpid()));
    dt::io::remove_tree(dir);
    fs::create_directories(dir);
    for (const auto& e : fs::directory_iterator(tokenizer_dir(variant)))
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
    expect_error<dt::FormatError>(load(f.dir), "vocab.json cut", {"vocab.json", "not JSON"});
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
    DamagedFolder f("other-normalizer", "json");
    std::string j = f.read("tokenizer.json");
    j.replace(j.find("\"NFC\""), 5, "\"NFKC\"");
    f.write("tokenizer.json", j);
    expect_error<dt::FormatError>(load(f.dir), "an NFKC tokenizer.json",
                                  {"tokenizer.json", "normalizer", "NFKC"});
  }
  {
    DamagedFolder f("wordpiece", "json");
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
}
