// Video files (data/video_file.hpp) against PyAV (tests/reference/ref_video.py): H.264 4:2:0 in
// MP4, 10-bit H.265 in MKV, VP9 4:4:4 at an odd size in WebM, MPEG-4 in AVI and AV1 in MP4 decode
// to PyAV's RGB frames; chosen frames equal the same frames of the whole clip, with 1 decoder
// thread or FFmpeg's frame threads; the probe counts frames without decoding; MP4 out (H.264) reads
// back close to what was written, upright by its display matrix; a missing, garbage, truncated or
// audio-only file is a typed error naming it.
#include <difftrain/data/video_buckets.hpp>
#include <difftrain/data/video_file.hpp>
#include <difftrain/data/video_sampling.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "../fuzz/video_target.hpp"
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
  int expected = 0;
  for (const auto& [name, c] : g.items()) {
    SCOPED_TRACE(name);
    // AV1 where the system's FFmpeg decodes it (Debian's does, through libdav1d).
    if (c["codec"].get<std::string>().find("av1") != std::string::npos &&
        avcodec_find_decoder(AV_CODEC_ID_AV1) == nullptr) {
      std::printf("%s: this FFmpeg has no AV1 decoder; left out\n", name.c_str());
      continue;
    }
    ++expected;
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
  EXPECT_EQ(checked, expected);
  EXPECT_GE(checked, 4);
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

TEST(Video, VariableFrameRateClipKeepsEveryFrameAndItsTime) {
  // Frame durations from 1/30 s to 1/5 s: the probe counts frames and gives the average rate
  // (decord's get_avg_fps, PyAV's average_rate); frames are indexed in order, each with its time.
  const auto& g = tst::golden("video_vfr.json");
  const fs::path clip = clips() / "vfr.mp4";
  const auto want = dt::io::load_safetensors(clips() / "vfr_frames.safetensors", true).tensors;
  const std::vector<double> times = g["times"].get<std::vector<double>>();
  const data::VideoInfo info = data::probe_video(clip);
  EXPECT_EQ(info.frames, static_cast<std::int64_t>(times.size()));
  EXPECT_NEAR(info.fps, g["average_rate"].get<double>(), 1e-9);
  const data::VideoFrames v = data::read_video(clip);
  ASSERT_TRUE(at::equal(v.pixels, want.at("frames")));
  ASSERT_EQ(v.times.size(), times.size());
  for (std::size_t k = 0; k < times.size(); ++k) EXPECT_NEAR(v.times[k], times[k], 1e-9) << k;
  const data::VideoFrames some = data::read_video(clip, {.frames = {4, 0, 4}});
  ASSERT_EQ(some.times.size(), 3U);
  EXPECT_NEAR(some.times[0], times[4], 1e-9);
  EXPECT_NEAR(some.times[1], 0.0, 1e-9);
  EXPECT_TRUE(at::equal(some.pixels[2], want.at("frames")[4]));
}

TEST(VideoSampling, FrameIndicesAreTheTrainingScriptsOverASweep) {
  // train_cogvideox_lora.py's and the SAT SFTDataset's choices (tests/reference/ref_video.py)
  // over clip lengths 1–301, source rates 5–60 fps, training rates 8 and 16, windows 1–49 and
  // skips at either end.
  const auto& g = tst::golden("video_sampling.json");
  int sat = 0, diffusers = 0;
  for (const auto& c : g) {
    const auto count = c["count"].get<std::int64_t>();
    const auto max = c["max_num_frames"].get<std::int64_t>();
    if (c.contains("sat")) {
      const auto got = data::sat_frame_indices(
          count, c["actual_fps"].get<double>(),
          {.max_num_frames = max, .fps = c["fps"].get<double>(), .skip = c["skip"].get<int>()});
      EXPECT_EQ(got, c["sat"].get<std::vector<std::int64_t>>()) << c.dump();
      EXPECT_EQ(static_cast<std::int64_t>(got.size()), max);
      ++sat;
    } else {
      const auto got =
          data::diffusers_frame_indices(count, {.max_num_frames = max,
                                                .skip_start = c["skip_start"].get<std::int64_t>(),
                                                .skip_end = c["skip_end"].get<std::int64_t>()});
      EXPECT_EQ(got, c["diffusers"].get<std::vector<std::int64_t>>()) << c.dump();
      EXPECT_EQ(got.size() % 4, 1U);
      ++diffusers;
    }
  }
  EXPECT_GT(sat, 1000);
  EXPECT_GT(diffusers, 200);
  // A stride of actual / training fps: 30 fps at 8 takes every third frame.
  EXPECT_EQ(data::sat_frame_indices(300, 30, {.max_num_frames = 5, .fps = 8, .skip = 0}),
            (std::vector<std::int64_t>{0, 3, 6, 9, 12}));
  expect_error<dt::ShapeError>([] { (void)data::sat_frame_indices(10, 0.0, {}); }, "frame rate");
  expect_error<dt::ConfigError>([] { (void)data::sat_frame_indices(10, 8, {.max_num_frames = 0}); },
                                "max_num_frames");
  expect_error<dt::ShapeError>([] { (void)data::diffusers_frame_indices(0, {}); }, "0 frames");
}

TEST(VideoSampling, SatResizeCropIsTorchvisionsToTheLevel) {
  // resize_for_rectangle_crop(center) of the SAT data code on the H.264 clip's frames, to sizes
  // wider, taller, smaller and larger than 64×48.
  const auto want = dt::io::load_safetensors(clips() / "sat_crops.safetensors", true).tensors;
  const at::Tensor frames = dt::io::load_safetensors(clips() / "frames.safetensors", true)
                                .tensors.at("h264_420.mp4")
                                .permute({0, 3, 1, 2})
                                .contiguous();
  ASSERT_EQ(want.size(), 6U);
  for (const auto& [size, ref] : want) {
    SCOPED_TRACE(size);
    const at::Tensor got = data::sat_resize_crop(frames, ref.size(2), ref.size(3));
    ASSERT_EQ(got.sizes(), ref.sizes());
    EXPECT_LE((got.to(at::kInt) - ref.to(at::kInt)).abs().max().item<int>(), 0);
  }
  expect_error<dt::ShapeError>([&] { (void)data::sat_resize_crop(frames[0], 8, 8); }, "(T, C");
}

TEST(Video, WritesLoopingGifsInOnePaletteThatReadBackClose) {
  // A GIF of the moving-square clip: one median-cut palette of ≤ 256 colours, every frame at
  // the same size, its frame rate in centiseconds; read back by FFmpeg's GIF decoder.
  const fs::path dir = scratch();
  const auto want = dt::io::load_safetensors(clips() / "frames.safetensors", true).tensors;
  const at::Tensor frames = want.at("vp9_444_odd.webm");  // 33×27: odd sizes stay as they are
  EXPECT_EQ(data::write_video(dir / "clip.gif", frames, {.fps = 10}), "gif");
  EXPECT_FALSE(fs::exists(dir / "clip.gif.partial.gif"));
  const data::VideoInfo info = data::probe_video(dir / "clip.gif");
  EXPECT_EQ(info.codec, "gif");
  EXPECT_EQ(info.frames, frames.size(0));
  const data::VideoFrames back = data::read_video(dir / "clip.gif");
  ASSERT_EQ(back.pixels.sizes(), frames.sizes());
  const double mse =
      (back.pixels.to(at::kFloat) - frames.to(at::kFloat)).square().mean().item<double>();
  const double psnr = 10 * std::log10(255.0 * 255.0 / std::max(mse, 1e-12));
  // A gradient of ~900 colours a frame in 256 entries without dithering: 26.7 dB here.
  EXPECT_GT(psnr, 25.0);
  ASSERT_EQ(back.times.size(), 6U);
  EXPECT_NEAR(back.times[1] - back.times[0], 0.1, 1e-9);
  std::printf("GIF written and read back: PSNR %.1f dB over %lld frames\n", psnr,
              static_cast<long long>(frames.size(0)));
  // Few colours come back exactly.
  at::Tensor flat = at::zeros({3, 8, 8, 3}, at::kByte);
  flat.select(3, 0).fill_(200);
  flat[1].select(2, 1).fill_(90);
  data::write_video(dir / "flat.gif", flat, {.fps = 4});
  EXPECT_TRUE(at::equal(data::read_video(dir / "flat.gif").pixels, flat));
  dt::io::remove_tree(dir);
}

TEST(Video, EveryFrameOfAFileWithoutAFrameCountAndAnyDecoderThreads) {
  // A GIF declares no frame count: the frames land in a store that doubles (16, 32, 64) and is
  // cut to the 41 read. FFmpeg's frame threads decode the same pixels as the calling thread.
  const fs::path dir = scratch();
  at::Tensor frames = at::zeros({41, 12, 20, 3}, at::kByte);
  for (std::int64_t t = 0; t < 41; ++t) {
    frames[t].select(2, 0).fill_(static_cast<int>(6 * t));
    frames[t].select(2, 1).narrow(1, t % 20, 1).fill_(255);
  }
  data::write_video(dir / "long.gif", frames, {.fps = 10});
  ASSERT_EQ(data::probe_video(dir / "long.gif").frames, 41);
  const data::VideoFrames back = data::read_video(dir / "long.gif");
  ASSERT_EQ(back.pixels.sizes(), frames.sizes());
  // 82 colours through the palette's 5-bit histogram: each frame within 3 levels of its own
  // (neighbouring frames are 6 apart in red).
  EXPECT_LE((back.pixels.to(at::kInt) - frames.to(at::kInt)).abs().max().item<int>(), 3);
  EXPECT_EQ(back.times.size(), 41U);
  EXPECT_EQ(back.pixels.storage().nbytes(), frames.nbytes()) << "no slack kept past the frames";
  for (const std::string name : {"h264_420.mp4", "vp9_444_odd.webm"}) {
    SCOPED_TRACE(name);
    const at::Tensor one = data::read_video(clips() / name).pixels;
    for (const int threads : {0, 2, 3})
      EXPECT_TRUE(at::equal(data::read_video(clips() / name, {.threads = threads}).pixels, one))
          << threads << " threads";
  }
  expect_error<dt::ConfigError>(
      [&] { (void)data::read_video(clips() / "h264_420.mp4", {.threads = -1}); }, "threads");
  dt::io::remove_tree(dir);
}

TEST(VideoSampling, VideoBucketsAreFinetrainersChoiceOverASweep) {
  // finetrainers' VideoDatasetWithResizing (tests/reference/ref_video.py): the frame bucket, the
  // frame indices and the nearest size, for 864 clips over four bucket lists.
  const auto& g = tst::golden("video_buckets.json");
  int checked = 0;
  for (const auto& c : g) {
    std::vector<data::VideoShape> buckets;
    for (const auto& b : c["buckets"])
      buckets.push_back(
          {b[0].get<std::int64_t>(), b[1].get<std::int64_t>(), b[2].get<std::int64_t>()});
    const auto got = data::choose_video_bucket(
        c["count"].get<std::int64_t>(), c["height"].get<std::int64_t>(),
        c["width"].get<std::int64_t>(), buckets, c["max_num_frames"].get<std::int64_t>());
    const auto shape = c["shape"].get<std::vector<std::int64_t>>();
    EXPECT_EQ(got.shape, (data::VideoShape{shape[0], shape[1], shape[2]})) << c.dump();
    EXPECT_EQ(got.frames, c["frames"].get<std::vector<std::int64_t>>()) << c.dump();
    ++checked;
  }
  EXPECT_EQ(checked, 864);
  // The strings finetrainers takes, and mistakes in them.
  EXPECT_EQ(data::parse_video_buckets({"49x480x720", "17x32x48"}),
            (std::vector<data::VideoShape>{{49, 480, 720}, {17, 32, 48}}));
  for (const std::string bad :
       {"49x480", "49x480x720x1", "ax480x720", "0x480x720", "49x-1x720", ""})
    expect_error<dt::ConfigError>([&] { (void)data::parse_video_buckets({bad}); }, "FRAMES");
  // Batches hold one shape; the order is the seed's and the epoch's.
  const std::vector<data::VideoShape> shapes{{9, 32, 32}, {5, 32, 32}, {9, 32, 32},
                                             {9, 32, 48}, {5, 32, 32}, {9, 32, 32}};
  const auto batches = data::video_bucket_batches(shapes, 2, 7, 0);
  std::size_t seen = 0;
  for (const auto& b : batches) {
    for (const auto i : b) EXPECT_EQ(shapes[i], shapes[b[0]]);
    seen += b.size();
  }
  EXPECT_EQ(seen, shapes.size());
  EXPECT_EQ(batches, data::video_bucket_batches(shapes, 2, 7, 0));
  EXPECT_NE(data::describe_video_buckets(shapes).find("9x32x32: 3 clips"), std::string::npos);
}

TEST(VideoFuzzCorpus, EveryKeptInputRunsCleanlyAndHostileOnesSayWhy) {
  // Every kept input (tests/fuzz/corpus/video, made by tests/fuzz/make_corpus.py) runs through the
  // fuzz target (typed errors only); the good ones decode under its limits, the bad_ ones are
  // refused by a typed error naming the file, and a clip with its middle zeroed decodes or says so.
  const fs::path corpus = fs::path(DIFFTRAIN_FUZZ_CORPUS_DIR) / "video";
  const data::VideoLimits limits = dt::fuzz::video_limits();
  const bool av1 = avcodec_find_decoder(AV_CODEC_ID_AV1) != nullptr;
  std::size_t files = 0, good = 0, good_files = 0, refused = 0;
  for (const auto& f : fs::directory_iterator(corpus)) {
    const std::string name = f.path().filename().string();
    if (!av1 && name.find("av1") != std::string::npos) continue;  // no decoder to read it with
    const std::vector<char> b = dt::io::read_file(f.path());
    dt::fuzz::video_input(reinterpret_cast<const std::uint8_t*>(b.data()), b.size());
    ++files;
    good_files += name.rfind("good_", 0) == 0 ? 1 : 0;
    SCOPED_TRACE(name);
    try {
      const data::VideoFrames v = data::read_video(f.path(), {.limits = limits});
      EXPECT_EQ(name.rfind("bad_", 0), std::string::npos) << "decoded " << v.pixels.sizes();
      std::printf(
          "%s: %lld frames of %lldx%lld\n", name.c_str(), static_cast<long long>(v.pixels.size(0)),
          static_cast<long long>(v.pixels.size(2)), static_cast<long long>(v.pixels.size(1)));
      good += name.rfind("good_", 0) == 0 ? 1 : 0;
    } catch (const dt::Error& e) {
      EXPECT_EQ(name.rfind("good_", 0), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      refused += name.rfind("bad_", 0) == 0 ? 1 : 0;
      std::printf("%s: %s\n", name.c_str(), e.what());
    }
  }
  EXPECT_GE(files, 14U);
  EXPECT_GE(good_files, 6U);
  EXPECT_EQ(good, good_files);
  EXPECT_GE(refused, 7U);
  // What the limits say, for the two that stand for a 100,000-frame and a 2^31-pixel file.
  expect_error<dt::FormatError>([&] { (void)data::probe_video(corpus / "bad_huge_size.gif"); },
                                "frame size");
  expect_error<dt::FormatError>(
      [&] { (void)data::probe_video(corpus / "bad_too_many_frames.mp4", limits); },
      "more than 64 frames");
  // A size change names the file's frame, not the output slot it was asked into.
  expect_error<dt::FormatError>(
      [&] {
        (void)data::read_video(corpus / "bad_size_change.mkv", {.frames = {1, 0}});
      },
      "changes its frame size at frame 1 (33x27 to 33x26)");
}
