#pragma once
// What the single-file tests (test_single_file.cpp, test_single_file_sd3.cpp) both check with: a
// model read back holds every tensor of the one written (as its rounding to the stored dtype),
// and the text of the typed error a call throws.
#include <ATen/ATen.h>
#include <difftrain/nn/module_tensors.hpp>

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <optional>
#include <string>

namespace difftrain::test {

template <class Holder>
void expect_same(Holder& got, Holder& want, const std::string& what,
                 std::optional<at::ScalarType> stored = std::nullopt) {
  const auto a = nn::module_tensors(*got);
  const auto b = nn::module_tensors(*want);
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : b) {
    const at::Tensor expected = stored ? t.to(*stored).to(t.scalar_type()) : t;
    EXPECT_TRUE(at::equal(a.at(name), expected)) << what << ": " << name;
  }
}

/// The message of the `E` that `f` throws; "wrong error type: ..." for another exception,
/// "accepted" for none.
template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong error type: ") + e.what();
  }
  return "accepted";
}

}  // namespace difftrain::test
