// libFuzzer entry point: see image_target.hpp.
#include "image_target.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  difftrain::fuzz::image_input(data, size);
  return 0;
}
