// Text conditioning:
//   clip_tokenizer_vs_hf_tokenizers: difftrain's CLIPTokenizer against Hugging Face's Rust
//     tokenizers (the backend of transformers' CLIPTokenizer) called from Python, both on one
//     core, on the same 2,000 captions with SD's vocabulary; difftrain's time per pass / the
//     baseline's (goal <= 1).
//   t5_tokenizer_vs_hf_tokenizers: difftrain's T5Tokenizer against the same Rust library running
//     transformers' T5Tokenizer, one core each, on the same 2,000 captions with a 4,000-piece
//     T5-layout Unigram model trained for the benchmark (goal <= 1).
//   clip_text_encoder_vs_transformers: SD 1.x's CLIP ViT-L/14 text encoder, forward and backward
//     of a (2, 77) batch on the CPU, against transformers' CLIPTextModel in eager mode with the
//     same threads (goal <= 1); _paired alternates blocks of both sides (paired.hpp) and reports
//     the median ratio of the rounds as paired_ratio.
#include <benchmark/benchmark.h>

#include <ATen/Parallel.h>
#include <difftrain/models/clip_text_model.hpp>
#include <difftrain/text/clip_tokenizer.hpp>
#include <difftrain/text/t5_tokenizer.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "paired.hpp"
#include "python_baseline.hpp"

namespace {

const std::filesystem::path& folder() {
  static const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / "difftrain-bench-clip-tokenizer";
  return dir;
}

// The baseline's seconds per pass, measured once (its script also writes the folder and captions).
double baseline_seconds(std::string& why) {
  static std::string reason;
  static const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_tokenizer.py") + " " + folder().string(), &reason);
  why = reason;
  return seconds;
}

void hf_tokenizers(benchmark::State& state) {
  std::string why;
  const double seconds = baseline_seconds(why);
  difftrain::bench::report_baseline(state, seconds, why);
}

void difftrain_tokenizer(benchmark::State& state) {
  std::string why;
  if (baseline_seconds(why) <= 0) {
    state.SkipWithError(("no tokenizer folder: the Python baseline did not run: " + why).c_str());
    return;
  }
  const auto tok = difftrain::text::CLIPTokenizer::from_folder(folder() / "sd15");
  std::ifstream in(folder() / "texts.json");
  const auto texts = nlohmann::json::parse(in).get<std::vector<std::string>>();
  for (const auto& t : texts) benchmark::DoNotOptimize(tok.encode(t));
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    for (const auto& t : texts) benchmark::DoNotOptimize(tok.encode(t));
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}

const std::filesystem::path& t5_folder() {
  static const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / "difftrain-bench-t5-tokenizer";
  return dir;
}

double t5_baseline_seconds(std::string& why) {
  static std::string reason;
  static const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_t5_tokenizer.py") + " " + t5_folder().string(),
      &reason);
  why = reason;
  return seconds;
}

void hf_t5_tokenizer(benchmark::State& state) {
  std::string why;
  difftrain::bench::report_baseline(state, t5_baseline_seconds(why), why);
}

void difftrain_t5_tokenizer(benchmark::State& state) {
  std::string why;
  if (t5_baseline_seconds(why) <= 0) {
    state.SkipWithError(("no tokenizer model: the Python baseline did not run: " + why).c_str());
    return;
  }
  const auto tok = difftrain::text::T5Tokenizer::from_folder(t5_folder() / "t5");
  std::ifstream in(t5_folder() / "texts.json");
  const auto texts = nlohmann::json::parse(in).get<std::vector<std::string>>();
  for (const auto& t : texts) benchmark::DoNotOptimize(tok.encode(t));
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    for (const auto& t : texts) benchmark::DoNotOptimize(tok.encode(t));
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}

void transformers_text_encoder(benchmark::State& state) {
  static std::string why;
  static const double seconds = difftrain::bench::python_seconds_per_step(
      difftrain::bench::python_script("python_text_encoder_step.py") + " 2 " +
          std::to_string(at::get_num_threads()),
      &why);
  difftrain::bench::report_baseline(state, seconds, why);
}

// SD 1.x's text encoder (CLIP ViT-L/14), random weights, and one training step of it.
struct TextEncoderStep {
  difftrain::models::CLIPTextModel<> te{config()};
  at::Tensor ids = at::randint(0, 49406, {2, 77}, at::kLong);
  static difftrain::models::CLIPTextConfig config() {
    difftrain::models::CLIPTextConfig c;
    c.hidden_size = 768;
    c.intermediate_size = 3072;
    c.num_hidden_layers = 12;
    c.num_attention_heads = 12;
    c.projection_dim = 768;
    return c;
  }
  TextEncoderStep() {
    te->train();
    ids.select(1, 76).fill_(49407);
  }
  void operator()() {
    te->zero_grad(true);
    te->forward(ids).last_hidden_state.sum().backward();
  }
};

// The same, paired: the Python side stays up (python_text_encoder_step.py serve) and blocks of 2
// steps alternate with difftrain's, 8 rounds; the median of the rounds' ratios is the result.
void text_encoder_paired(benchmark::State& state) {
  difftrain::bench::PythonServer python(
      difftrain::bench::python_script("python_text_encoder_step.py") + " 2 " +
      std::to_string(at::get_num_threads()) + " serve");
  TextEncoderStep step;
  step();
  step();
  auto python_block = [&] { return python.run(2); };
  auto difftrain_block = [&] {
    return difftrain::bench::seconds_per_step(
        2, [&] { step(); }, [] {});
  };
  difftrain::bench::report_paired(state, difftrain::bench::paired(8, python_block, difftrain_block),
                                  python.why());
}

void difftrain_text_encoder(benchmark::State& state) {
  TextEncoderStep step;
  step();
  step();
  for (auto _ : state) {  // three steps per iteration: one step is about a second on 2 cores
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 3; ++i) step();
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 3);
  }
}

}  // namespace

BENCHMARK(transformers_text_encoder)
    ->Name("clip_text_encoder_vs_transformers/baseline")
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(difftrain_text_encoder)
    ->Name("clip_text_encoder_vs_transformers/difftrain")
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(text_encoder_paired)
    ->Name("clip_text_encoder_vs_transformers_paired")
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(hf_tokenizers)->Name("clip_tokenizer_vs_hf_tokenizers/baseline")->UseManualTime();
BENCHMARK(difftrain_tokenizer)->Name("clip_tokenizer_vs_hf_tokenizers/difftrain")->UseManualTime();
BENCHMARK(hf_t5_tokenizer)->Name("t5_tokenizer_vs_hf_tokenizers/baseline")->UseManualTime();
BENCHMARK(difftrain_t5_tokenizer)->Name("t5_tokenizer_vs_hf_tokenizers/difftrain")->UseManualTime();
