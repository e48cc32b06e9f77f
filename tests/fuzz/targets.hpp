#pragma once
// What each fuzz target does with one input. Shared by the libFuzzer binaries (clang, sanitizers)
// and by the unit test that replays the kept corpus on every build. A typed difftrain::Error is
// the expected way to reject input; anything else escaping (or a sanitizer report) is a bug.

#include <difftrain/adapters/embedding.hpp>
#include <difftrain/adapters/hypernetwork.hpp>
#include <difftrain/io/embedded_data.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/io/torch_file.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::fuzz {

// Touches every value so that views into the input are actually read.
inline void consume(const at::Tensor& t) {
  if (t.defined() && t.numel() > 0) (void)t.to(at::kDouble).sum().item<double>();
}

inline void safetensors_input(const std::uint8_t* data, std::size_t size) {
  try {
    const auto file =
        io::parse_safetensors(reinterpret_cast<const char*>(data), size, nullptr, true, "fuzz");
    for (const auto& [name, t] : file.tensors) consume(t);
  } catch (const Error&) {
  }
}

inline void torch_file_input(const std::uint8_t* data, std::size_t size) {
  try {
    const std::vector<char> bytes(data, data + size);
    const io::TorchValue v = io::parse_torch_file(bytes, "fuzz.pt");
    std::vector<c10::IValue> todo{v.ivalue()};
    for (std::size_t steps = 0; !todo.empty() && steps < 100000; ++steps) {
      const c10::IValue x = todo.back();
      todo.pop_back();
      if (x.isTensor()) consume(x.toTensor());
      if (x.isGenericDict())
        for (const auto& item : x.toGenericDict()) todo.push_back(item.value());
      if (x.isList())
        for (const auto& e : x.toListRef()) todo.push_back(e);
    }
    // What the adapters make of it: each refuses what it cannot use with a typed error.
    try {
      (void)adapters::embedding_from_data(v, "fuzz");
    } catch (const Error&) {
    }
    try {
      (void)adapters::Hypernetwork::from_state(v);
    } catch (const Error&) {
    }
  } catch (const Error&) {
  }
}

inline void embedded_png_input(const std::uint8_t* data, std::size_t size) {
  io::PngLimits limits;
  limits.max_pixels = 1 << 22;
  limits.max_text_bytes = 1 << 24;
  try {
    const io::PngFile png =
        io::decode_png({reinterpret_cast<const char*>(data), size}, "fuzz.png", limits);
    if (const auto it = png.text.find(io::kEmbeddingTextKey); it != png.text.end())
      (void)io::embedded_detail::parse_json_data(
          io::embedded_detail::base64_decode(it->second, "fuzz.png"), "fuzz.png");
    (void)io::extract_image_data(png.image, "fuzz.png", limits.max_text_bytes);
  } catch (const Error&) {
  }
}

}  // namespace difftrain::fuzz
