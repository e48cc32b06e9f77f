// libFuzzer entry point: see targets.hpp.
#include "targets.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  difftrain::fuzz::safetensors_input(data, size);
  return 0;
}
