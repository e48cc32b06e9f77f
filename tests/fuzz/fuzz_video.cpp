// libFuzzer entry point: see video_target.hpp.
#include "video_target.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  difftrain::fuzz::video_input(data, size);
  return 0;
}
