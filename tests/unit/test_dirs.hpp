#pragma once
// Where the unit tests find the golden values and the fuzz corpus. Found at run time (not compiled
// in) so the test sources compile to the same objects in every checkout and a compiler cache
// reuses them: the golden folder is `golden/` beside the test binary (where the reference.generate
// test writes it), the corpus `tests/fuzz/corpus` in the first folder above the binary that has
// one. DIFFTRAIN_GOLDEN_DIR and DIFFTRAIN_FUZZ_CORPUS_DIR in the environment override them.

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace difftrain::test {

inline std::filesystem::path executable_dir() {
  return std::filesystem::read_symlink("/proc/self/exe").parent_path();
}

inline std::string golden_dir() {
  if (const char* env = std::getenv("DIFFTRAIN_GOLDEN_DIR")) return env;
  return (executable_dir() / "golden").string();
}

inline std::string fuzz_corpus_dir() {
  if (const char* env = std::getenv("DIFFTRAIN_FUZZ_CORPUS_DIR")) return env;
  for (auto dir = executable_dir(); !dir.empty(); dir = dir.parent_path()) {
    const auto corpus = dir / "tests" / "fuzz" / "corpus";
    if (std::filesystem::is_directory(corpus / "safetensors")) return corpus.string();
    if (dir == dir.root_path()) break;
  }
  throw std::runtime_error(
      "no tests/fuzz/corpus above the test binary; set DIFFTRAIN_FUZZ_CORPUS_DIR");
}

}  // namespace difftrain::test

#define DIFFTRAIN_GOLDEN_DIR (::difftrain::test::golden_dir())
#define DIFFTRAIN_FUZZ_CORPUS_DIR (::difftrain::test::fuzz_corpus_dir())
