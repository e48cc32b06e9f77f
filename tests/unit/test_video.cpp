// Video files (data/video_file.hpp) against PyAV (tests/reference/ref_video.py): H.264 4:2:0 in
// MP4, 10-bit H.265 in MKV, VP9 4:4:4 at an odd size in WebM and MPEG-4 in AVI decode to PyAV's
// RGB frames; chosen frames equal the same frames of the whole clip; the probe counts frames
// without decoding; MP4 out (H.264) reads back close to what was written, upright by its display
// matrix; a missing, garbage, truncated or audio-only file is a typed error naming it.
#include <difftrain/data/video_file.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "golden.hpp"

namespace dt = difftrain;
namespace data = difftrain::data;
namespace tst = difftrain::test;
namespace fs = std::filesystem;

namespace {

fs::path clips() { return fs::path(DIFFTRAIN_GOLDEN_DIR) / "video"; }

fs::path scratch() {
  const fs::path d = fs::temp_directory_path() / ("difftrain-video-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

template <class E, class F>
void expect_error(F&& f, const std::string& mention) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error mentioning '" << mention << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(mention), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Video, DecodesAsPyAvDoesAcrossContainersCodecsAndLayouts) {
  const auto& g = tst::golden("video.json");
  const auto want = dt::io::load_safetensors(clips() / "frames.safetensors", true).tensors;
  int checked = 0;
  for (const auto& [name, c] : g.items()) {
    SCOPED_TRACE(name);
    const data::VideoInfo info = data::probe_video(clips() / name);
    EXPECT_EQ(info.frames, c["frames"].get<std::int64_t>());
    EXPECT_EQ(info.width, c["width"].get<std::int64_t>());
    EXPECT_EQ(info.height, c["height"].get<std::int64_t>());
    EXPECT_EQ(info.codec, c["codec"].get<std::string>());
    if (c["fps"].get<double>() > 0) {
      EXPECT_NEAR(info.fps, c["fps"].get<double>(), 1e-6);
    }
    const data::VideoFrames v = data::read_video(clips() / name);
    const at::Tensor& ref = want.at(name);
    ASSERT_EQ(v.pixels.sizes(), ref.sizes());
    const at::Tensor diff = (v.pixels.to(at::kInt) - ref.to(at::kInt)).abs();
    const int worst = diff.max().item<int>();
    const double mean = diff.to(at::kDouble).mean().item<double>();
    // 8-bit sources: the same YUV (the decoders are bit-exact) converted to the same RGB, to the
    // level. 10-bit ones: Debian's FFmpeg 5.1 and PyAV's bundled FFmpeg convert high bit depths
    // differently at sharp chroma edges (FFmpeg 8 rewrote that path); the mean stays small.
    if (c["pix_fmt"].get<std::string>().find("10") == std::string::npos) {
      EXPECT_LE(worst, 1) << "levels from PyAV's RGB";
    } else {
      EXPECT_LE(mean, 4.0) << "mean levels from PyAV's RGB";
    }
    std::printf("%s: %lld frames %lldx%lld, at most %d levels (mean %.2f) from PyAV\n",
                name.c_str(), static_cast<long long>(v.pixels.size(0)),
                static_cast<long long>(v.pixels.size(2)), static_cast<long long>(v.pixels.size(1)),
                worst, mean);
    // Chosen frames, in any order and repeated, are those frames of the whole clip.
    const std::int64_t n = v.pixels.size(0);
    const std::vector<std::int64_t> pick{n - 1, 0, 2, 2};
    const data::VideoFrames some = data::read_video(clips() / name, {.frames = pick});
    ASSERT_EQ(some.pixels.size(0), 4);
    for (std::size_t k = 0; k < pick.size(); ++k)
      EXPECT_TRUE(at::equal(some.pixels[static_cast<std::int64_t>(k)], v.pixels[pick[k]])) << k;
    expect_error<dt::FormatError>(
        [&] { (void)data::read_video(clips() / name, {.frames = {n + 3}}); }, "ends after");
    ++checked;
  }
  EXPECT_EQ(checked, 4);
}

TEST(Video, WritesMp4ThatReadsBackUprightAndRefusesBadFiles) {
  const fs::path dir = scratch();
  // A clip of 9 frames, 34×22 (even), written and read back; then one of odd size, padded.
  at::Tensor frames = at::zeros({9, 22, 34, 3}, at::kByte);
  // Smooth colour (4:2:0 halves the chroma resolution) and a grey square moving right (a luma
  // edge, which it keeps).
  const at::Tensor ys = at::arange(22, at::kFloat).view({22, 1}), xs = at::arange(34, at::kFloat);
  for (std::int64_t t = 0; t < 9; ++t) {
    frames[t].select(2, 0).copy_((10.0 * static_cast<double>(t) + 3 * xs).expand({22, 34}));
    frames[t].select(2, 1).copy_((6 * ys + 40).expand({22, 34}));
    frames[t].select(2, 2).fill_(128);
    frames[t].narrow(0, 5, 8).narrow(1, 3 * t, 8).fill_(230);
  }
  const std::string encoder = data::write_video(dir / "clip.mp4", frames, {.fps = 8});
  EXPECT_TRUE(encoder == "libx264" || encoder == "mpeg4") << encoder;
  EXPECT_FALSE(fs::exists(dir / "clip.mp4.partial.mp4"));
  const data::VideoFrames back = data::read_video(dir / "clip.mp4");
  ASSERT_EQ(back.pixels.sizes(), frames.sizes());
  const double mse =
      (back.pixels.to(at::kFloat) - frames.to(at::kFloat)).square().mean().item<double>();
  const double psnr = 10 * std::log10(255.0 * 255.0 / std::max(mse, 1e-12));
  EXPECT_GT(psnr, 30.0) << encoder;
  std::printf("MP4 (%s) written and read back: PSNR %.1f dB\n", encoder.c_str(), psnr);
  EXPECT_NEAR(data::probe_video(dir / "clip.mp4").fps, 8.0, 1e-6);
  // A display matrix: stored as written, read upright (turned 90° clockwise) unless asked not to.
  data::write_video(dir / "portrait.mp4", frames, {.fps = 8, .rotation = 90});
  const data::VideoInfo info = data::probe_video(dir / "portrait.mp4");
  EXPECT_EQ(info.rotation, 90);
  EXPECT_EQ(info.width, 22);
  EXPECT_EQ(info.height, 34);
  const data::VideoFrames upright = data::read_video(dir / "portrait.mp4");
  const data::VideoFrames stored =
      data::read_video(dir / "portrait.mp4", {.apply_rotation = false});
  ASSERT_EQ(upright.pixels.sizes(), (at::IntArrayRef{9, 34, 22, 3}));
  EXPECT_TRUE(at::equal(upright.pixels, stored.pixels.transpose(1, 2).flip(2)));
  // Odd sizes are padded by the last row and column.
  const at::Tensor odd = frames.narrow(1, 0, 21).narrow(2, 0, 33).contiguous();
  data::write_video(dir / "odd.mp4", odd);
  EXPECT_EQ(data::read_video(dir / "odd.mp4").pixels.sizes(), (at::IntArrayRef{9, 22, 34, 3}));
  // Mistakes and bad files, each typed and naming the file.
  expect_error<dt::ShapeError>([&] { data::write_video(dir / "x.mp4", frames.to(at::kFloat)); },
                               "uint8");
  expect_error<dt::IoError>([&] { (void)data::read_video(dir / "missing.mp4"); }, "missing.mp4");
  { std::ofstream(dir / "garbage.mp4") << "this is not a video"; }
  expect_error<dt::FormatError>([&] { (void)data::read_video(dir / "garbage.mp4"); },
                                "garbage.mp4");
  expect_error<dt::FormatError>([&] { (void)data::read_video(clips() / "audio_only.m4a"); },
                                "no video stream");
  // Truncated to half: the frames before the cut decode, a later frame asked for is an error.
  const auto size = fs::file_size(clips() / "h264_420.mp4");
  {
    std::ifstream in(clips() / "h264_420.mp4", std::ios::binary);
    std::vector<char> bytes(size / 2);
    in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    std::ofstream(dir / "cut.mp4", std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  try {
    (void)data::read_video(dir / "cut.mp4", {.frames = {9}});
    ADD_FAILURE() << "a truncated file gave its last frame";
  } catch (const dt::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("cut.mp4"), std::string::npos) << e.what();
  }
  expect_error<dt::FormatError>(
      [&] { (void)data::probe_video(clips() / "h264_420.mp4", {.max_frames = 4}); },
      "more than 4 frames");
  expect_error<dt::FormatError>(
      [&] { (void)data::read_video(clips() / "h264_420.mp4", {.limits = {.max_pixels = 100}}); },
      "64x48");
  dt::io::remove_tree(dir);
}
