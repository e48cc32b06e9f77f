// The Stable Diffusion web UI's prompt syntax (modules/prompt_parser.py, sd_hijack_clip.py): the
// emphasis weights, BREAK and chunking, and the conditioning composed from the encoder's outputs,
// against tables written from the rules and the web UI's own parser on random prompts
// (tests/reference/ref_webui_prompt.py).
#include <gtest/gtest.h>
#include <difftrain/models/clip_text_model.hpp>
#include <difftrain/models/pretrained.hpp>
#include <difftrain/nn/attention/math.hpp>
#include <difftrain/text/webui_conditioning.hpp>
#include <difftrain/text/webui_prompt.hpp>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "golden.hpp"
#include "text_test_helpers.hpp"

namespace dt = difftrain;
namespace text = difftrain::text;
namespace models = difftrain::models;
namespace attn = difftrain::nn::attention;
using namespace difftrain::test::text_helpers;

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
