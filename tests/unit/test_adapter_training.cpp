// The embedding database, `.optim` sidecars (SHA-256, optimizer state in Python's layout) and the
// web UI's adapter training loop, against tests/reference/ref_webui_training.py.
#include <difftrain/adapters/adapters.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/io/sha256.hpp>
#include <difftrain/nn/blocks/cross_attention.hpp>
#include <difftrain/train/torch_optimizer_state.hpp>

#include <gtest/gtest.h>
#include <unistd.h>

#include <barrier>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "golden.hpp"

namespace dt = difftrain;
namespace ad = difftrain::adapters;
namespace fs = std::filesystem;

namespace {

fs::path scratch(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("difftrain-adapters-" + name + "-" + std::to_string(::getpid()));
  if (fs::exists(dir))
    for (const auto& e : fs::recursive_directory_iterator(dir))
      if (e.is_regular_file()) fs::remove(e.path());
  fs::create_directories(dir);
  return dir;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error of the expected type";
  return {};
}

/// Words separated by spaces or '-' → ids from a growing vocabulary.
struct WordTokenizer {
  std::shared_ptr<std::map<std::string, std::int64_t>> vocab =
      std::make_shared<std::map<std::string, std::int64_t>>();
  std::vector<std::int64_t> operator()(const std::string& text) const {
    std::vector<std::int64_t> out;
    std::string word;
    auto flush = [&] {
      if (word.empty()) return;
      auto [it, _] = vocab->emplace(word, static_cast<std::int64_t>(vocab->size()) + 100);
      out.push_back(it->second);
      word.clear();
    };
    for (char c : text) {
      if (c == ' ' || c == '-')
        flush();
      else
        word += c;
    }
    flush();
    return out;
  }
};

ad::Embedding embedding(const std::string& name, std::int64_t vectors, std::int64_t width,
                        double fill) {
  ad::Embedding e;
  e.name = name;
  e.vec = at::full({vectors, width}, fill);
  return e;
}

}  // namespace

TEST(Sha256, MatchesTheStandardDigests) {
  EXPECT_EQ(dt::io::sha256_hex(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(dt::io::sha256_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(dt::io::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const fs::path file = scratch("sha") / "million_a";
  std::ofstream(file) << std::string(1000000, 'a');
  EXPECT_EQ(dt::io::sha256_file(file),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  EXPECT_EQ(ad::file_shorthash(file), "cdc76e5c99");
  EXPECT_THROW((void)dt::io::sha256_file(file.string() + ".missing"), dt::IoError);
}

TEST(TorchOptimizerState, RoundTripsAdamWAdamAndSgdThroughAFile) {
  const fs::path dir = scratch("optim");
  for (const std::string kind : {"AdamW", "Adam", "SGD"}) {
    auto make = [&](std::vector<at::Tensor> ps) -> std::unique_ptr<torch::optim::Optimizer> {
      if (kind == "AdamW")
        return std::make_unique<torch::optim::AdamW>(
            ps, torch::optim::AdamWOptions(0.01).amsgrad(true));
      if (kind == "Adam") return std::make_unique<torch::optim::Adam>(ps);
      return std::make_unique<torch::optim::SGD>(ps, torch::optim::SGDOptions(0.1).momentum(0.9));
    };
    at::manual_seed(1);
    const at::Tensor a = at::randn({3, 2}).requires_grad_(true),
                     b = at::randn({4}).requires_grad_(true);
    auto opt = make({a, b});
    for (int k = 0; k < 3; ++k) {
      a.mutable_grad() = at::sin(at::arange(6, at::kFloat).view({3, 2}) + k);
      b.mutable_grad() = at::cos(at::arange(4, at::kFloat) * k);
      opt->step();
    }
    EXPECT_EQ(dt::train::torch_optimizer_name(*opt), kind);
    const fs::path file = dir / (kind + ".pt");
    dt::io::save_torch_file(file, dt::train::torch_optimizer_state(*opt));
    const at::Tensor a2 = a.detach().clone().requires_grad_(true),
                     b2 = b.detach().clone().requires_grad_(true);
    auto opt2 = make({a2, b2});
    dt::train::load_torch_optimizer_state(*opt2, dt::io::load_torch_file(file));
    for (auto* o : {opt.get(), opt2.get()}) {
      const auto& ps = o->param_groups()[0].params();
      ps[0].mutable_grad() = at::full({3, 2}, 0.3);
      ps[1].mutable_grad() = at::full({4}, -0.2);
      o->step();
    }
    EXPECT_TRUE(at::equal(a, a2)) << kind;
    EXPECT_TRUE(at::equal(b, b2)) << kind;
    // A state for other parameters is refused and changes nothing.
    const at::Tensor c = at::zeros({5}).requires_grad_(true);
    auto wrong = make({c});
    EXPECT_NE(error_of<dt::ConfigError>([&] {
                dt::train::load_torch_optimizer_state(*wrong, dt::io::load_torch_file(file));
              }).find("group 0 has 2 parameters"),
              std::string::npos);
    EXPECT_TRUE(wrong->state().empty());
    const at::Tensor d = at::zeros({2, 3}).requires_grad_(true),
                     e = at::zeros({4}).requires_grad_(true);
    auto shape = make({d, e});
    EXPECT_NE(error_of<dt::ConfigError>([&] {
                dt::train::load_torch_optimizer_state(*shape, dt::io::load_torch_file(file));
              }).find("the parameter's is [2, 3]"),
              std::string::npos);
    EXPECT_TRUE(shape->state().empty());
  }
}

TEST(EmbeddingDatabase, FindsTheLongestNameFirstAndExpandsPrompts) {
  WordTokenizer tok;
  ad::EmbeddingDatabase db(tok, 4);
  db.register_embedding(embedding("cat", 1, 4, 1.0));
  db.register_embedding(embedding("cat-toy", 2, 4, 2.0));
  db.register_embedding(embedding("dog", 3, 4, 3.0));
  const auto prompt = tok("a cat-toy and a cat or dog");
  const auto m = db.find_embedding_at_position(prompt, 1);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->embedding->name, "cat-toy");
  EXPECT_EQ(m->length, 2);
  EXPECT_EQ(db.find_embedding_at_position(prompt, 5)->embedding->name, "cat");
  EXPECT_FALSE(db.find_embedding_at_position(prompt, 0));
  EXPECT_FALSE(db.find_embedding_at_position(prompt, 99));
  // "cat" at the very end matches although "cat-toy" would run past the prompt.
  EXPECT_EQ(db.find_embedding_at_position(tok("a cat"), 1)->embedding->name, "cat");

  const auto x = db.expand(prompt);
  // a [0 0] and a [0] or [0 0 0]
  const std::vector<std::int64_t> want{prompt[0], 0,         0, prompt[3], prompt[4],
                                       0,         prompt[6], 0, 0,         0};
  EXPECT_EQ(x.tokens, want);
  ASSERT_EQ(x.fixes.size(), 3u);
  EXPECT_EQ(x.fixes[0].first, 1);
  EXPECT_EQ(x.fixes[1].first, 5);
  EXPECT_EQ(x.fixes[2].first, 7);

  // The vectors land after the start token, cut at the sequence's end; gradients reach them.
  ad::Embedding trained = embedding("dog", 3, 4, 0.0);
  trained.vec = at::randn({3, 4}).requires_grad_(true);
  db.register_embedding(trained);  // replaces the earlier "dog"
  EXPECT_EQ(db.word_embeddings().size(), 3u);
  const auto y = db.expand(prompt);
  const at::Tensor base = at::zeros({1, 10, 4});
  const at::Tensor out = ad::apply_embeddings(base, {y.fixes});
  EXPECT_TRUE(at::equal(out[0][2], at::full({4}, 2.0f)));      // cat-toy's first vector at 1 + 1
  EXPECT_TRUE(at::equal(out[0][6], at::full({4}, 1.0f)));      // cat at 5 + 1
  EXPECT_TRUE(at::equal(out[0][8], trained.vec[0].detach()));  // dog at 7 + 1, two of three fit
  EXPECT_TRUE(at::equal(out[0][9], trained.vec[1].detach()));
  EXPECT_TRUE(at::equal(out[0][0], at::zeros({4})));
  out.sum().backward();
  EXPECT_TRUE(at::equal(trained.vec.grad(), at::cat({at::ones({2, 4}), at::zeros({1, 4})})));

  EXPECT_THROW((void)ad::apply_embeddings(at::zeros({1, 10, 5}), {y.fixes}), dt::ShapeError);
  EXPECT_THROW((void)ad::apply_embeddings(at::zeros({2, 10, 4}), {y.fixes}), dt::ShapeError);

  db.unregister("cat-toy");
  EXPECT_EQ(db.find_embedding_at_position(prompt, 1)->embedding->name, "cat");
  EXPECT_EQ(db.names(), (std::vector<std::string>{"cat", "dog"}));
  EXPECT_THROW(db.register_embedding(embedding("", 1, 4, 0.0)), dt::ConfigError);
}

TEST(EmbeddingDatabase, LoadsADirectorySkippingWrongWidthsAndReportingBadFiles) {
  const fs::path dir = scratch("db");
  fs::create_directories(dir / "sub");
  embedding("Good", 2, 8, 0.5).save(dir / "Good.pt");
  embedding("wide", 1, 16, 0.5).save(dir / "sub" / "wide.pt");
  dt::io::save_safetensors(dir / "concept.safetensors", {{"<concept>", at::ones({8})}});
  ad::Embedding xl;
  xl.name = "xl";
  xl.pair = {{"clip_l", at::ones({2, 3})}, {"clip_g", at::ones({2, 6})}};
  xl.save(dir / "xl.safetensors");
  std::ofstream(dir / "empty.pt").close();
  std::ofstream(dir / "broken.pt") << "not a torch file";
  std::ofstream(dir / "notes.txt") << "ignored";
  ad::EmbeddingDatabase db(WordTokenizer{}, 8);
  const auto report = db.load_from_dir(dir);
  EXPECT_EQ(report.loaded, (std::vector<std::string>{"Good", "concept"}));
  EXPECT_EQ(report.skipped, (std::vector<std::string>{"wide", "xl"}));
  ASSERT_EQ(report.errors.size(), 1u);
  EXPECT_EQ(report.errors[0].first.filename(), "broken.pt");
  EXPECT_EQ(db.skipped_embeddings().at("xl")->shape(), 9);  // clip_l 3 + clip_g 6
  EXPECT_EQ(db.names(), (std::vector<std::string>{"concept", "Good"}));
  EXPECT_THROW((void)db.load_from_dir(dir / "missing"), dt::ConfigError);

  // An SDXL database (clip_l 3 + clip_g 6) takes the pair and gives each encoder its vectors.
  ad::EmbeddingDatabase sdxl(WordTokenizer{}, 9);
  ASSERT_TRUE(sdxl.load_from_file(dir / "xl.safetensors"));
  const auto& e = *sdxl.word_embeddings().at("xl");
  EXPECT_EQ(e.vectors_for("clip_l").size(-1), 3);
  EXPECT_EQ(e.vectors_for("clip_g").size(-1), 6);
  EXPECT_THROW((void)e.vectors_for("t5"), dt::ConfigError);
}

namespace {

struct Problem {
  at::Tensor vec, w, a, y;
};
Problem webui_problem() {
  const auto& p = dt::test::golden("webui_training.json")["problem"];
  auto t = [&](const char* k, std::vector<std::int64_t> shape) {
    return dt::test::tensor_from(p[k], shape).to(at::kFloat);
  };
  return {t("vec", {3, 4}), t("w", {4, 5}), t("a", {10, 3}), t("y", {10, 5})};
}

/// An embedding named `name` holding the problem's starting vectors.
ad::Embedding toy_embedding(const Problem& p, const std::string& name) {
  ad::Embedding e;
  e.name = name;
  e.vec = p.vec.clone();
  return e;
}

/// The reference's data: batch j of epoch e holds items (j·bs + k + 3e) mod n.
ad::AdapterData<at::Tensor> webui_data(const Problem& p, ad::Embedding& e, std::int64_t bs,
                                       std::function<bool(int)> nan_at_call = {}) {
  ad::AdapterData<at::Tensor> d;
  d.dataset_size = p.a.size(0);
  d.batch = [bs, n = p.a.size(0)](std::int64_t epoch, std::int64_t j) {
    std::vector<std::int64_t> idx;
    for (std::int64_t k = 0; k < bs; ++k) idx.push_back((j * bs + k + 3 * epoch) % n);
    return at::tensor(idx, at::kLong);
  };
  d.loss = [&p, &e, nan_at_call, calls = std::make_shared<int>(0)](const at::Tensor& idx) {
    const at::Tensor pred = at::matmul(at::matmul(p.a.index_select(0, idx), e.vec), p.w);
    at::Tensor loss = at::mse_loss(pred, p.y.index_select(0, idx));
    if (nan_at_call && nan_at_call((*calls)++)) loss = loss * std::nan("");
    return loss;
  };
  return d;
}

ad::AdapterTrainOptions options_of(const nlohmann::json& c) {
  ad::AdapterTrainOptions o;
  o.learn_rate = c["learn_rate"];
  o.clip_grad_mode = c["clip_mode"];
  o.clip_grad_value = c["clip_value"];
  o.batch_size = c["batch_size"];
  o.gradient_step = c["gradient_step"];
  o.steps = c["steps"];
  o.save_every = 0;
  o.write_csv_every = 0;
  return o;
}

}  // namespace

TEST(WebUiTraining, EmbeddingTrainingMatchesTheWebUiLoop) {
  const Problem p = webui_problem();
  for (const auto& [name, c] : dt::test::golden("webui_training.json")["cases"].items()) {
    ad::Embedding e = toy_embedding(p, "e");
    e.step = c["initial_step"].get<std::int64_t>();
    std::vector<double> losses, lrs;
    const auto r = ad::train_embedding(e, options_of(c), webui_data(p, e, c["batch_size"]),
                                       {.on_step = [&](const ad::AdapterStepInfo& s) {
                                         losses.push_back(s.loss);
                                         lrs.push_back(s.learn_rate);
                                       }});
    EXPECT_EQ(r.final_step, c["final_step"].get<std::int64_t>()) << name;
    EXPECT_EQ(e.step, c["final_step"].get<std::int64_t>()) << name;
    EXPECT_EQ(lrs, c["lrs"].get<std::vector<double>>()) << name;
    const auto want_losses = c["losses"].get<std::vector<double>>();
    ASSERT_EQ(losses.size(), want_losses.size()) << name;
    for (std::size_t i = 0; i < losses.size(); ++i)
      EXPECT_NEAR(losses[i], want_losses[i], 1e-5 * (1 + std::abs(want_losses[i]))) << name << i;
    EXPECT_TRUE(
        at::allclose(e.vec, dt::test::tensor_from(c["final"], {3, 4}).to(at::kFloat), 1e-5, 1e-5))
        << name;
    EXPECT_FALSE(e.vec.requires_grad());
  }
}

TEST(WebUiTraining, WritesCopiesLogAndSidecarsAndResumesBitIdentically) {
  const Problem p = webui_problem();
  const auto& c = dt::test::golden("webui_training.json")["cases"]["norm"];
  const fs::path dir = scratch("train");
  ad::AdapterTrainOptions o = options_of(c);
  o.save_every = 2;
  o.write_csv_every = 1;
  o.log_directory = dir / "log";
  o.output = dir / "emb" / "toy.pt";

  ad::Embedding straight = toy_embedding(p, "toy");
  (void)ad::train_embedding(straight, options_of(c), webui_data(p, straight, 2));

  // Four steps, then a new process would load the file and its sidecar and go on to nine.
  ad::Embedding e = toy_embedding(p, "toy");
  ad::AdapterTrainOptions first = o;
  first.steps = 4;
  auto r = ad::train_embedding(e, first, webui_data(p, e, 2));
  EXPECT_EQ(r.resumed_optimizer, ad::SidecarStatus::missing);
  EXPECT_EQ(r.saved, (std::vector<fs::path>{dir / "log/embeddings/toy-2.pt",
                                            dir / "log/embeddings/toy-4.pt", o.output}));
  const auto copy = ad::load_embedding(dir / "log/embeddings/toy-2.pt");
  EXPECT_EQ(copy->name, "toy-2");
  EXPECT_EQ(copy->step, 2);
  const auto sidecar = dt::io::load_torch_file(dir / "log/embeddings/toy-2.pt.optim");
  EXPECT_EQ(sidecar.at("hash").string(), copy->checksum());
  EXPECT_FALSE(sidecar.contains("optimizer_name"));  // embeddings' sidecars have none

  ad::Embedding loaded = *ad::load_embedding(o.output);
  EXPECT_EQ(loaded.name, "toy");
  EXPECT_EQ(loaded.step, 4);
  r = ad::train_embedding(loaded, o, webui_data(p, loaded, 2));
  EXPECT_EQ(r.resumed_optimizer, ad::SidecarStatus::loaded);
  EXPECT_EQ(loaded.step, 9);
  EXPECT_TRUE(at::equal(loaded.vec, straight.vec));

  // The log: the web UI's columns, a row per step, steps 1-4 then 5-9 after the resume.
  const std::string log = read_text(dir / "log/textual_inversion_loss.csv");
  EXPECT_EQ(log.substr(0, log.find('\n')), "step,epoch,epoch_step,loss,learn_rate");
  EXPECT_NE(log.find("\n5,2,0,"), std::string::npos) << log;
  EXPECT_NE(log.find("\n9,4,0,"), std::string::npos) << log;
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 10);

  // Trained to its steps already: nothing changes. A sidecar of another file is not used.
  ad::Embedding done = *ad::load_embedding(o.output);
  EXPECT_TRUE(ad::train_embedding(done, o, webui_data(p, done, 2)).already_trained);
  ad::Embedding other = *ad::load_embedding(o.output);
  other.vec = other.vec + 1;
  other.step = 0;
  EXPECT_EQ(ad::train_embedding(other, o, webui_data(p, other, 2)).resumed_optimizer,
            ad::SidecarStatus::hash_mismatch);
}

// Data parallelism as webui_train runs it, two ranks as two threads: rank r takes batches r, r + 2,
// ... of the epoch, `average` averages the gradients before clipping, and the pair trains what
// one process trains accumulating both ranks' batches; the second rank writes nothing.
TEST(WebUiTraining, AveragedRanksTrainAsAccumulationAndOnlyTheFirstWrites) {
  const Problem p = webui_problem();
  const auto& c = dt::test::golden("webui_training.json")["cases"]["norm"];
  const fs::path dir = scratch("ranks");
  ad::AdapterTrainOptions one = options_of(c);
  one.batch_size = 1;
  one.gradient_step = 2;
  ad::Embedding whole = toy_embedding(p, "toy");
  std::vector<double> whole_losses;
  (void)ad::train_embedding(
      whole, one, webui_data(p, whole, 1),
      {.on_step = [&](const ad::AdapterStepInfo& s) { whole_losses.push_back(s.loss); }});

  std::array<ad::Embedding, 2> e;
  std::array<std::vector<double>, 2> losses;
  std::array<at::Tensor, 2> grads;
  std::array<double, 2> rank_loss{};
  std::barrier sync(2);
  auto rank = [&](int r) {
    e[r] = toy_embedding(p, "toy");
    ad::AdapterTrainOptions o = one;
    o.gradient_step = 1;
    o.save_every = 2;
    o.write_csv_every = 1;
    o.log_directory = dir / ("log" + std::to_string(r));
    o.output = dir / ("rank" + std::to_string(r)) / "toy.pt";
    o.write_files = r == 0;
    ad::AdapterData<at::Tensor> d = webui_data(p, e[r], 1);
    d.dataset_size /= 2;
    d.batch = [r, all = d.batch](std::int64_t epoch, std::int64_t j) {
      return all(epoch, j * 2 + r);
    };
    ad::AdapterHooks h{
        .on_step = [&, r](const ad::AdapterStepInfo& s) { losses[r].push_back(s.loss); }};
    h.average = [&, r](const std::vector<at::Tensor>& w, double loss) {
      grads[r] = w[0].grad().clone();
      rank_loss[r] = loss;
      sync.arrive_and_wait();
      w[0].mutable_grad().copy_((grads[0] + grads[1]) / 2);
      const double mean = (rank_loss[0] + rank_loss[1]) / 2;
      sync.arrive_and_wait();
      return mean;
    };
    (void)ad::train_embedding(e[r], o, d, h);
  };
  std::thread second(rank, 1);
  rank(0);
  second.join();

  EXPECT_TRUE(at::allclose(e[0].vec, whole.vec, 1e-6, 1e-6)) << e[0].vec - whole.vec;
  EXPECT_TRUE(at::equal(e[0].vec, e[1].vec));
  ASSERT_EQ(losses[0].size(), whole_losses.size());
  for (std::size_t i = 0; i < whole_losses.size(); ++i)
    EXPECT_NEAR(losses[0][i], whole_losses[i], 1e-6 * (1 + whole_losses[i])) << i;
  EXPECT_TRUE(fs::exists(dir / "rank0" / "toy.pt"));
  EXPECT_TRUE(fs::exists(dir / "log0" / "embeddings" / "toy-2.pt"));
  EXPECT_TRUE(fs::exists(dir / "log0" / "textual_inversion_loss.csv"));
  EXPECT_FALSE(fs::exists(dir / "rank1" / "toy.pt"));
  EXPECT_FALSE(fs::exists(dir / "log1"));
}

TEST(WebUiTraining, PreviewsEveryNStepsAndEmbedsTheLastCopyOnce) {
  const Problem p = webui_problem();
  const auto& c = dt::test::golden("webui_training.json")["cases"]["norm"];
  const fs::path dir = scratch("previews");
  ad::AdapterTrainOptions o = options_of(c);
  o.steps = 6;
  o.save_every = 4;
  o.create_image_every = 2;
  o.log_directory = dir / "log";
  ad::Embedding e = toy_embedding(p, "toy");
  std::vector<std::int64_t> asked;
  const auto r = ad::train_embedding(e, o, webui_data(p, e, 2), {.preview = [&](std::int64_t step) {
                                       asked.push_back(step);
                                       ad::AdapterPreview pv{dt::io::RgbImage(8, 6, 40), ""};
                                       pv.infotext =
                                           "toy, Steps: 20, Seed: " + std::to_string(step);
                                       return pv;
                                     }});
  EXPECT_EQ(asked, (std::vector<std::int64_t>{2, 4, 6}));
  EXPECT_EQ(r.previews,
            (std::vector<fs::path>{dir / "log/images/toy-2.png", dir / "log/images/toy-4.png",
                                   dir / "log/images/toy-6.png"}));
  const auto png = dt::io::read_png(dir / "log/images/toy-4.png");
  EXPECT_EQ(png.text.at("parameters"), "toy, Steps: 20, Seed: 4");
  // Only the first preview after the copy at step 4 carries it, as the web UI writes it.
  ASSERT_EQ(r.embedded_previews, (std::vector<fs::path>{dir / "log/image_embeddings/toy-4.png"}));
  const auto embedded = ad::load_embedding(r.embedded_previews[0]);
  ASSERT_TRUE(embedded.has_value());
  const auto copy = ad::load_embedding(dir / "log/embeddings/toy-4.pt");
  EXPECT_EQ(embedded->name, "toy-4");
  EXPECT_EQ(embedded->step, 4);
  EXPECT_TRUE(at::equal(embedded->vec, copy->vec));
  EXPECT_EQ(embedded->checksum(), copy->checksum());

  // A negative interval is refused, as the web UI refuses it.
  ad::AdapterTrainOptions bad = o;
  bad.create_image_every = -1;
  ad::Embedding e2 = toy_embedding(p, "toy");
  EXPECT_THROW((void)ad::train_embedding(e2, bad, webui_data(p, e2, 2)), dt::ConfigError);
}

TEST(WebUiTraining, InputsAreCheckedWithTheWebUiSentences) {
  const Problem p = webui_problem();
  ad::Embedding e = embedding("x", 3, 4, 0.1);
  auto bad = [&](auto change, const std::string& sentence) {
    ad::AdapterTrainOptions o;
    o.log_directory = scratch("inputs");
    o.steps = 3;
    ad::AdapterData<at::Tensor> d = webui_data(p, e, 1);
    change(o, d, e);
    const std::string msg = error_of<dt::ConfigError>([&] { (void)ad::train_embedding(e, o, d); });
    EXPECT_NE(msg.find(sentence), std::string::npos) << sentence << " / " << msg;
    e.name = "x";
    e.step = 0;
  };
  using O = ad::AdapterTrainOptions;
  using D = ad::AdapterData<at::Tensor>;
  bad([](O&, D&, ad::Embedding& x) { x.name.clear(); }, "embedding not selected");
  bad([](O& o, D&, ad::Embedding&) { o.learn_rate = ""; }, "Learning rate is empty or 0");
  bad([](O& o, D&, ad::Embedding&) { o.batch_size = 0; }, "Batch size must be positive");
  bad([](O& o, D&, ad::Embedding&) { o.gradient_step = -1; },
      "Gradient accumulation step must be positive");
  bad([](O&, D& d, ad::Embedding&) { d.dataset_size = 0; }, "Dataset directory is empty");
  bad([](O& o, D&, ad::Embedding&) { o.steps = 0; }, "Max steps must be positive");
  bad([](O& o, D&, ad::Embedding&) { o.save_every = -1; }, "Save embedding must be positive or 0");
  bad([](O& o, D&, ad::Embedding&) { o.log_directory.clear(); }, "Log directory is empty");
  bad([](O& o, D&, ad::Embedding&) { o.clip_grad_mode = "l1"; }, "must be disabled, value or norm");
  bad([](O& o, D&, ad::Embedding&) { o.batch_size = 11; }, "fewer than 1 batches of 11");
  bad([](O& o, D&, ad::Embedding&) { o.learn_rate = "0.1:x"; }, "step string");
}

TEST(WebUiTraining, ANanLossStopsBeforeTheStepAndKeepsTheSavedFiles) {
  const Problem p = webui_problem();
  const fs::path dir = scratch("nan");
  ad::Embedding e = toy_embedding(p, "toy");
  ad::AdapterTrainOptions o;
  o.learn_rate = "0.01";
  o.steps = 10;
  o.save_every = 1;
  o.write_csv_every = 1;
  o.log_directory = dir;
  o.output = dir / "toy.pt";
  at::Tensor before;
  const std::string msg = error_of<dt::NumericError>([&] {
    (void)ad::train_embedding(
        e, o, webui_data(p, e, 2, [](std::int64_t s) { return s == 2; }),
        {.on_step = [&](const ad::AdapterStepInfo&) { before = e.vec.detach().clone(); }});
  });
  EXPECT_NE(msg.find("the loss is NaN at step 3"), std::string::npos) << msg;
  EXPECT_EQ(e.step, 2);
  EXPECT_TRUE(at::equal(e.vec, before));
  EXPECT_FALSE(fs::exists(o.output));
  for (const char* f : {"embeddings/toy-1.pt", "embeddings/toy-2.pt"})
    EXPECT_EQ(ad::load_embedding(dir / f)->name, fs::path(f).stem().string());
}

TEST(WebUiTraining, HypernetworkTrainsThroughItsModulesAndResumesFromItsSidecar) {
  const fs::path dir = scratch("hn");
  at::manual_seed(3);
  const at::Tensor ctx = at::randn({8, 3, 6}), target = at::randn({8, 3, 6});
  ad::Hypernetwork hn("toy-hn", {6}, {.layer_structure = {1, 2, 1}, .activation_func = "relu"});
  ad::AdapterData<at::Tensor> d;
  d.dataset_size = 8;
  d.batch = [](std::int64_t, std::int64_t j) { return at::tensor({2 * j, 2 * j + 1}, at::kLong); };
  d.loss = [&](const at::Tensor& idx) {
    const at::Tensor c = ctx.index_select(0, idx);
    const auto [k, v] = hn.apply(c, c);
    return at::mse_loss(k + v, target.index_select(0, idx));
  };
  ad::AdapterTrainOptions o;
  o.learn_rate = "0.01:5, 0.003";
  o.steps = 5;
  o.batch_size = 2;
  o.clip_grad_mode = "norm";
  o.clip_grad_value = "1.0";
  o.save_every = 0;
  o.log_directory = dir;
  o.output = dir / "toy-hn.pt";
  auto r = ad::train_hypernetwork(hn, o, d);
  EXPECT_EQ(hn.step, 5);
  EXPECT_FALSE(hn.weights()[0].requires_grad());  // back in eval mode
  EXPECT_NE(r.statistics.find("loss:"), std::string::npos);
  const auto sidecar = dt::io::load_torch_file(dir / "toy-hn.pt.optim");
  EXPECT_EQ(sidecar.at("optimizer_name").string(), "AdamW");
  EXPECT_EQ(sidecar.at("hash").string(), ad::file_shorthash(o.output));
  EXPECT_EQ(sidecar.at("optimizer_state_dict").at("param_groups").elements()[0].at("lr").number(),
            0.01);

  ad::Hypernetwork again = ad::Hypernetwork::load(o.output);
  EXPECT_EQ(again.step, 5);
  double first_loss = 0;
  {
    at::NoGradGuard g;
    first_loss = d.loss(at::arange(8)).item<double>();
  }
  ad::AdapterData<at::Tensor> d2 = d;
  d2.loss = [&](const at::Tensor& idx) {
    const at::Tensor c = ctx.index_select(0, idx);
    const auto [k, v] = again.apply(c, c);
    return at::mse_loss(k + v, target.index_select(0, idx));
  };
  o.steps = 40;
  r = ad::train_hypernetwork(again, o, d2);
  EXPECT_EQ(r.resumed_optimizer, ad::SidecarStatus::loaded);
  EXPECT_EQ(again.step, 40);
  {
    at::NoGradGuard g;
    EXPECT_LT(d2.loss(at::arange(8)).item<double>(), first_loss);
  }
  // An Adam sidecar does not go into SGD.
  ad::Hypernetwork third = ad::Hypernetwork::load(o.output);
  torch::optim::SGD sgd(third.weights(), torch::optim::SGDOptions(0.1));
  EXPECT_EQ(ad::load_optim_sidecar(o.output, ad::file_shorthash(o.output), sgd),
            ad::SidecarStatus::other_optimizer);
  EXPECT_EQ(ad::load_optim_sidecar(o.output, "0123456789", sgd), ad::SidecarStatus::hash_mismatch);
}

TEST(AdapterCorpus, HostileAdapterFilesAreTypedErrorsNamingTheProblem) {
  const fs::path corpus(DIFFTRAIN_FUZZ_CORPUS_DIR);
  auto verdict = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const dt::Error& e) {
      return e.kind() + ": " + e.what();
    }
    return "";
  };
  const std::vector<std::tuple<std::string, std::string, std::string>> torch_cases = {
      {"adapter_embedding_two_terms", "embedding", "FormatError: .*multiple terms"},
      {"adapter_embedding_int_vectors", "embedding", "FormatError: .*not floating point"},
      {"adapter_embedding_3d", "embedding", "FormatError: .*not \\(vectors, width\\)"},
      {"adapter_embedding_list", "embedding", "FormatError: .*not an embedding dict"},
      {"adapter_sdxl_mismatched", "embedding", "FormatError: .*different numbers of vectors"},
      {"adapter_hypernetwork_wrong_shape", "hypernetwork", "FormatError: .*\\[8\\]\\[0\\]"},
      {"adapter_hypernetwork_one_module", "hypernetwork", "FormatError: .*two state dicts"},
      {"adapter_hypernetwork_bad_structure", "hypernetwork", "ConfigError: .*start with size 1"},
      {"adapter_hypernetwork_bad_activation", "hypernetwork",
       "ConfigError: .*activation function: evil"},
      {"adapter_hypernetwork_huge_width", "hypernetwork", "FormatError: .*the structure needs"},
      {"adapter_optim_wrong_shapes", "optim", "ConfigError: .*the parameter's is \\[3, 4\\]"},
  };
  for (const auto& [name, kind, expect] : torch_cases) {
    const fs::path file = corpus / "torch_file" / name;
    const std::string got = verdict([&] {
      const auto v = dt::io::load_torch_file(file);
      if (kind == "embedding") (void)ad::embedding_from_data(v, name);
      if (kind == "hypernetwork") (void)ad::Hypernetwork::from_state(v);
      if (kind == "optim") {
        const at::Tensor p = at::zeros({3, 4}).requires_grad_(true);
        torch::optim::AdamW opt({p});
        dt::train::load_torch_optimizer_state(opt, v.at("optimizer_state_dict"));
      }
    });
    EXPECT_TRUE(std::regex_search(got, std::regex(expect))) << name << ": " << got;
  }
  const std::vector<std::pair<std::string, std::string>> lora_cases = {
      {"adapter_lora_missing_B", "only one of the two LoRA matrices"},
      {"adapter_lora_rank_mismatch", "rank"},
      {"adapter_lora_foreign_key", "down_blocks"},
      {"adapter_lora_wrong_width", "to_k"},
  };
  for (const auto& [name, expect] : lora_cases) {
    dt::nn::blocks::CrossAttention<> attn(dt::nn::blocks::CrossAttentionOptions{16, 12, 2, 8, 0.0});
    const std::string got = verdict([&] {
      (void)ad::load_lora_state_dict(
          *attn, dt::io::load_safetensors(corpus / "safetensors" / name, true).tensors,
          {.layout = ad::LoraLayout::peft, .prefix = "unet."}, {.rank = 4});
    });
    EXPECT_NE(got.find(expect), std::string::npos) << name << ": " << got;
    EXPECT_TRUE(ad::lora_layers(*attn).empty() || got.empty()) << name << ": changed the model";
  }
}

// Files for tests/reference/check_cpp_adapters.py (run only when it sets DIFFTRAIN_ADAPTER_OUT):
// an embedding and its sidecar after three AdamW steps with known gradients and the vectors after
// a fourth, a trained hypernetwork with its sidecar, LoRA files in both layouts, an SDXL pair.
TEST(AdapterFiles, WriteFilesForPython) {
  const char* out_env = std::getenv("DIFFTRAIN_ADAPTER_OUT");
  if (!out_env) GTEST_SKIP() << "run by check_cpp_adapters.py";
  const fs::path out(out_env);
  fs::create_directories(out);
  ad::Embedding e;
  e.name = "py-check";
  e.step = 3;
  e.sd_checkpoint = "abcdef0123";
  e.vec = (at::arange(12, at::kFloat).view({3, 4}) / 7).requires_grad_(true);
  torch::optim::AdamW opt({e.vec}, torch::optim::AdamWOptions(0.01).weight_decay(0.0));
  auto grad = [](int k) { return at::sin(at::arange(12, at::kFloat).view({3, 4}) * (k + 1)); };
  for (int k = 0; k < 3; ++k) {
    e.vec.mutable_grad() = grad(k);
    opt.step();
  }
  e.vec = e.vec.detach();
  e.save(out / "py-check.pt");
  ad::save_optim_sidecar(out / "py-check.pt", e.checksum(), opt, false);
  auto& p = opt.param_groups()[0].params()[0];
  p.mutable_grad() = grad(3);
  opt.step();
  dt::io::save_safetensors(out / "after_fourth_step.safetensors", {{"vec", p.detach()}});

  ad::Hypernetwork hn(
      "py-hn", {6, 10},
      {.layer_structure = {1, 2, 1}, .activation_func = "relu", .add_layer_norm = true});
  hn.step = 7;
  hn.save(out / "py-hn.pt");
  auto w = hn.weights();
  torch::optim::AdamW hopt(w);
  for (auto& t : w) t.mutable_grad() = at::ones_like(t);
  hopt.step();
  ad::save_optim_sidecar(out / "py-hn.pt", ad::file_shorthash(out / "py-hn.pt"), hopt, true);

  dt::nn::blocks::CrossAttention<> attn(dt::nn::blocks::CrossAttentionOptions{16, 12, 2, 8, 0.0});
  ad::inject_lora(*attn, {.target_modules = {"to_q", "to_k", "to_v", "to_out.0"}},
                  {.rank = 4, .alpha = 2.0});
  for (const auto layout : {ad::LoraLayout::peft, ad::LoraLayout::kohya}) {
    const bool peft = layout == ad::LoraLayout::peft;
    dt::io::save_safetensors(
        out / (peft ? "lora_peft.safetensors" : "lora_kohya.safetensors"),
        ad::lora_state_dict(*attn, {.layout = layout, .prefix = peft ? "unet." : "lora_unet_"}),
        {{"ss_network_dim", "4"}, {"ss_network_alpha", "2.0"}});
  }
}
