#pragma once
// What the text tests share (test_text.cpp, test_t5_text.cpp, test_webui_prompt.cpp): the reference
// scripts' tokenizer and text-encoder folders, SD 1.x's tokenizer read once, and a check that an
// error has its type and mentions what it should.
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <unistd.h>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/text/clip_tokenizer.hpp>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "test_dirs.hpp"

namespace difftrain::test::text_helpers {

inline std::filesystem::path tokenizer_dir(const std::string& variant) {
  return std::filesystem::path(DIFFTRAIN_GOLDEN_DIR) / "clip_tokenizer" / variant;
}

inline std::filesystem::path encoder_dir(const std::string& name) {
  return std::filesystem::path(DIFFTRAIN_GOLDEN_DIR) / "text_encoders" / name;
}

/// SD 1.x's CLIP tokenizer (the reference scripts' copy), read once.
inline const text::CLIPTokenizer& sd15() {
  static const text::CLIPTokenizer tok = text::CLIPTokenizer::from_folder(tokenizer_dir("sd15"));
  return tok;
}

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

using Ids = std::vector<std::int64_t>;
using IdRows = std::vector<Ids>;

// A scratch copy of the SD 1.x folder, damaged by `damage`, removed afterwards.
struct DamagedFolder {
  std::filesystem::path dir;
  explicit DamagedFolder(const std::string& name,
                         const std::filesystem::path& source = tokenizer_dir("sd15")) {
    dir = std::filesystem::temp_directory_path() /
          ("difftrain-tok-" + name + "-" + std::to_string(::getpid()));
    io::remove_tree(dir);
    std::filesystem::create_directories(dir);
    for (const auto& e : std::filesystem::directory_iterator(source))
      std::filesystem::copy_file(e.path(), dir / e.path().filename());
  }
  ~DamagedFolder() { io::remove_tree(dir); }
  void write(const std::string& file, const std::string& content) const {
    std::ofstream(dir / file, std::ios::binary | std::ios::trunc) << content;
  }
  [[nodiscard]] std::string read(const std::string& file) const {
    std::ifstream in(dir / file, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }
};

// |a - b| relative to b's scale (its largest magnitude; at least 1e-3, for gradients that are
// zero in exact arithmetic, as the key projection's bias, whose values are rounding noise).
inline double scaled_error(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-3);
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / scale;
}

// Every parameter's gradient equals the reference's "grad.<name>" (float64, 1e-10 of its
// scale), and the reference has no gradient the model lacks.
inline void expect_gradients_match(const torch::nn::Module& model,
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

}  // namespace difftrain::test::text_helpers
