// Tokenizer throughput: difftrain's CLIPTokenizer against Hugging Face's Rust tokenizers (the
// backend of transformers' CLIPTokenizer) called from Python, both on one core, on the same 2,000
// captions with SD's vocabulary. The ratio is difftrain's time per pass over the captions / the
// baseline's (goal: <= 1).
#include <benchmark/benchmark.h>

#include <difftrain/text/clip_tokenizer.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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

}  // namespace

BENCHMARK(hf_tokenizers)->Name("clip_tokenizer_vs_hf_tokenizers/baseline")->UseManualTime();
BENCHMARK(difftrain_tokenizer)->Name("clip_tokenizer_vs_hf_tokenizers/difftrain")->UseManualTime();
