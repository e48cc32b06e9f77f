#pragma once
// finetune_transformer's training videos: where they are listed, which of their frames train, and
// the frames as tensors. Three layouts of --train_data_dir:
//
//   diffusers'  --caption_column and --video_column name two files in the folder, one caption and
//               one video per line (train_cogvideox_lora.py's local layout);
//   SAT's       videos/ and labels/ with matching stems: videos/1.mp4 and labels/1.txt (the
//               CogVideoX SAT fine-tuning guide's layout);
//   beside      videos with a caption file of the same stem beside each: clip.mp4 + clip.txt.
//
// A video is a video file (MP4, MOV, WebM, MKV, AVI: data/video_file.hpp, with FFmpeg), a folder
// of its frames (JPEG, PNG or WebP, in name order) or one image.

#include <difftrain/data/video_buckets.hpp>
#include <difftrain/data/video_sampling.hpp>
#include <difftrain/io/sha256.hpp>

#include "run_common.hpp"

#if defined(DIFFTRAIN_HAS_VIDEO)
#include <difftrain/data/video_file.hpp>
#endif

namespace {

/// One training video: its source, the frames chosen (image files, or indices into the video
/// file), its caption and the size it trains at (its bucket's, or --height × --width).
struct VideoClip {
  fs::path source;
  std::vector<fs::path> frames;           // a folder's frames or one image
  std::vector<std::int64_t> file_frames;  // a video file's frame indices
  std::string caption;
  std::int64_t height = 0, width = 0;
  [[nodiscard]] data::VideoShape shape() const {
    return {static_cast<std::int64_t>(count()), height, width};
  }
  [[nodiscard]] bool is_file() const { return frames.empty(); }
  [[nodiscard]] std::size_t count() const { return is_file() ? file_frames.size() : frames.size(); }
  void keep_first(std::size_t n) {
    if (is_file())
      file_frames.resize(n);
    else
      frames.resize(n);
  }
};

std::vector<std::string> read_lines(const fs::path& file, const std::string& flag) {
  if (!fs::is_regular_file(file))
    throw dt::IoError(
        "does not exist (" + flag + " names a file of the data folder, one entry per line)",
        file.string());
  const std::vector<char> bytes = dt::io::read_file(file);
  std::vector<std::string> lines;
  std::string line;
  for (const char c : bytes) {
    if (c != '\n') {
      line += c;
      continue;
    }
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(line);
    line.clear();
  }
  if (!line.empty()) lines.push_back(line);
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  return lines;
}

/// A caption file's text, its lines joined by spaces (SAT's labels hold one line).
std::string read_caption(const fs::path& file) {
  std::string text;
  for (const auto& line : read_lines(file, "the caption file"))
    text += (text.empty() ? "" : " ") + line;
  return text;
}

/// The frames of a clip of `count` frames at `fps` (0: a folder of frames, which has no rate)
/// that train: --frame_sampling diffusers (train_cogvideox_lora.py's choice) or sat (the SAT
/// SFTDataset's window at --video_fps, padded with the last frame to --max_num_frames).
std::vector<std::int64_t> chosen_frames(std::int64_t count, double fps, const Settings& s) {
  if (s.frame_sampling == "sat")
    // A folder of frames has no rate of its own: it is taken at the training rate (stride 1).
    return data::sat_frame_indices(
        count, fps > 0 ? fps : s.video_fps,
        {.max_num_frames = s.max_num_frames, .fps = s.video_fps, .skip = s.skip_frames_start});
  return data::diffusers_frame_indices(count, {.max_num_frames = s.max_num_frames,
                                               .skip_start = s.skip_frames_start,
                                               .skip_end = s.skip_frames_end});
}

/// --frame_sampling and the flags it reads, checked before any video is opened.
void check_frame_sampling(const Settings& s) {
  if (s.frame_sampling != "diffusers" && s.frame_sampling != "sat")
    throw ConfigError(
        "must be diffusers (train_cogvideox_lora.py's frame choice) or sat (the SAT "
        "fine-tuning code's: a window at --video_fps)",
        "--frame_sampling " + s.frame_sampling);
  if (s.frame_sampling == "sat" && !s.video_resolution_buckets.empty())
    throw ConfigError(
        "chooses frames and sizes as finetrainers does; --frame_sampling sat "
        "cannot apply as well",
        "--video_resolution_buckets");
  if (s.frame_sampling != "sat") return;
  if ((s.max_num_frames - 1) % 4 != 0)
    throw ConfigError(
        "must be 4k + 1 with --frame_sampling sat (every clip is padded to it, and "
        "the 3-D VAE takes 4k + 1 frames)",
        "--max_num_frames " + std::to_string(s.max_num_frames));
  if (s.skip_frames_end != 0 && s.skip_frames_end != s.skip_frames_start)
    throw ConfigError(
        "SAT's sampling skips --skip_frames_start frames at both ends (its "
        "skip_frms_num); leave --skip_frames_end at 0 or equal to it",
        "--skip_frames_end " + std::to_string(s.skip_frames_end));
}

/// `source` as a clip: its frames, chosen as diffusers chooses them. `where` names it in errors.
VideoClip clip_of(const fs::path& source, std::string caption, const Settings& s,
                  const std::vector<data::VideoShape>& buckets, const std::string& where) {
  VideoClip c{source, {}, {}, std::move(caption), s.height, s.width};
  std::int64_t height = 0, width = 0;  // the source's size (buckets are chosen by it)
  std::int64_t count = 0;
  double fps = 0;  // a video file's average rate
  bool file = false;
  if (fs::is_directory(source)) {
    for (const auto& e : fs::directory_iterator(source))
      if (e.is_regular_file() && data::is_image_name(e.path())) c.frames.push_back(e.path());
    std::sort(c.frames.begin(), c.frames.end());
    if (c.frames.empty())
      throw ConfigError("names " + source.string() + ", a folder without frames", where);
    count = static_cast<std::int64_t>(c.frames.size());
  } else if (fs::is_regular_file(source) && data::is_image_name(source)) {
    c.frames.push_back(source);
    count = 1;
  } else if (fs::is_regular_file(source) && data::is_video_name(source)) {
#if defined(DIFFTRAIN_HAS_VIDEO)
    const data::VideoInfo info = data::probe_video(source);
    count = info.frames;
    fps = info.fps;
    height = info.height;
    width = info.width;
    if (count == 0) throw dt::FormatError("holds no frames", source.string());
    file = true;
#else
    throw ConfigError("names " + source.string() +
                          ", a video file; this build has no FFmpeg (Debian: libavformat-dev "
                          "libavcodec-dev libswscale-dev): decode it to frames first, e.g. "
                          "ffmpeg -i clip.mp4 clip/%04d.png",
                      where);
#endif
  } else {
    throw ConfigError(
        "names " + source.string() + ", which is not a video file, a folder of frames or an image",
        where);
  }
  if (!file && !buckets.empty()) {  // a folder's (or one image's) size is its first frame's
    const at::Tensor first = data::read_image(c.frames.front()).pixels;
    height = first.size(0);
    width = first.size(1);
  }
  std::vector<std::int64_t> chosen;
  if (buckets.empty()) {
    chosen = chosen_frames(count, fps, s);
  } else {  // finetrainers' bucket: its frames and the nearest listed size
    const data::VideoBucketChoice b =
        data::choose_video_bucket(count, height, width, buckets, s.max_num_frames);
    chosen = b.frames;
    c.height = b.shape.height;
    c.width = b.shape.width;
  }
  if (file) {
    c.file_frames = chosen;
  } else {
    std::vector<fs::path> kept;
    for (const std::int64_t k : chosen) kept.push_back(c.frames[static_cast<std::size_t>(k)]);
    c.frames = std::move(kept);
  }
  return c;
}

/// The training videos of --train_data_dir in whichever of the three layouts it has; every clip
/// cut to the shortest clip's frame count so clips batch together, unless video buckets batch
/// clips of one shape together.
std::vector<VideoClip> scan_videos(const Settings& s,
                                   const std::vector<data::VideoShape>& buckets) {
  const fs::path root(s.data_dir);
  if (!fs::is_directory(root))
    throw dt::IoError("is not a folder", "--train_data_dir " + s.data_dir);
  std::vector<std::pair<fs::path, std::string>> listed;  // (video, caption)
  std::vector<std::string> wheres;
  const bool columns =
      fs::is_regular_file(root / s.caption_column) || fs::is_regular_file(root / s.video_column);
  const bool sat = fs::is_directory(root / "videos") && fs::is_directory(root / "labels");
  if (columns || !sat) {
    std::vector<fs::path> beside;  // videos with a caption file beside them
    if (!columns)
      for (const auto& e : fs::directory_iterator(root))
        if (e.is_regular_file() && data::is_video_name(e.path()) &&
            fs::is_regular_file(fs::path(e.path()).replace_extension(".txt")))
          beside.push_back(e.path());
    if (!columns && beside.empty())
      throw ConfigError(
          "holds no videos: list them in --video_column and --caption_column files (" +
              s.video_column + ", " + s.caption_column +
              "), or put them in videos/ with captions in labels/ (SAT's layout), or put each "
              "video beside a .txt caption of the same name",
          "--train_data_dir " + s.data_dir);
    if (!columns) {
      std::sort(beside.begin(), beside.end());
      for (const auto& v : beside) {
        listed.emplace_back(v, read_caption(fs::path(v).replace_extension(".txt")));
        wheres.push_back(v.string());
      }
    } else {
      const auto captions = read_lines(root / s.caption_column, "--caption_column");
      const auto videos = read_lines(root / s.video_column, "--video_column");
      if (captions.size() != videos.size())
        throw ConfigError(std::to_string(captions.size()) + " captions for " +
                              std::to_string(videos.size()) + " videos",
                          (root / s.caption_column).string());
      for (std::size_t i = 0; i < videos.size(); ++i) {
        listed.emplace_back(root / videos[i], captions[i]);
        wheres.push_back((root / s.video_column).string() + " line " + std::to_string(i + 1));
      }
    }
  } else {  // SAT's videos/ + labels/
    std::vector<fs::path> videos;
    for (const auto& e : fs::directory_iterator(root / "videos"))
      if ((e.is_regular_file() &&
           (data::is_video_name(e.path()) || data::is_image_name(e.path()))) ||
          e.is_directory())
        videos.push_back(e.path());
    std::sort(videos.begin(), videos.end());
    for (const auto& v : videos) {
      const fs::path label = root / "labels" / (v.stem().string() + ".txt");
      if (!fs::is_regular_file(label))
        throw ConfigError("has no caption " + label.string() + " (SAT's layout: labels/<stem>.txt)",
                          v.string());
      listed.emplace_back(v, read_caption(label));
      wheres.push_back(v.string());
    }
  }
  if (listed.empty())
    throw ConfigError(
        "holds no videos: list them in --video_column and --caption_column files, or put them in "
        "videos/ with captions in labels/ (SAT's layout), or put each video beside a .txt "
        "caption of the same name",
        "--train_data_dir " + s.data_dir);
  std::vector<VideoClip> clips;
  std::size_t shortest = std::numeric_limits<std::size_t>::max();
  for (std::size_t i = 0; i < listed.size(); ++i) {
    clips.push_back(clip_of(listed[i].first, listed[i].second, s, buckets, wheres[i]));
    shortest = std::min(shortest, clips.back().count());
    if (s.limit > 0 && static_cast<std::int64_t>(clips.size()) >= s.limit) break;
  }
  if (buckets.empty())
    for (auto& c : clips) c.keep_first(shortest);
  return clips;
}

/// A clip's frames (1, 3, F, height, width) in [−1, 1] at the clip's training size, mirrored when
/// asked: resized to it (diffusers' sampling: decord's reader, no crop), resized bicubically to
/// cover it and centre-cropped (SAT's resize_for_rectangle_crop), or in a video bucket resized in
/// float and never rounded (finetrainers' transform of float frames).
at::Tensor load_clip(const VideoClip& c, const Settings& s, bool flip) {
  at::Tensor
      thwc;  // (T, H, W, 3) uint8: as the video reader returns it, or the frame files stacked
  if (c.is_file()) {
#if defined(DIFFTRAIN_HAS_VIDEO)
    thwc = data::read_video(c.source, {.frames = c.file_frames}).pixels;
#endif
  } else {
    std::vector<at::Tensor> hwc;
    for (const auto& f : c.frames) hwc.push_back(data::read_image(f).pixels);
    thwc = at::stack(hwc);
  }
  at::Tensor x;
  if (!s.video_resolution_buckets.empty()) {
    x = thwc.permute({0, 3, 1, 2}).to(at::kFloat);
    if (x.size(2) != c.height || x.size(3) != c.width)
      x = at::_upsample_bilinear2d_aa(x, {c.height, c.width}, false);
    if (flip) x = data::horizontal_flip(x);
    return (x / 255.0 * 2.0 - 1.0).permute({1, 0, 2, 3}).contiguous().unsqueeze(0);
  }
  if (s.frame_sampling == "sat") {
    x = data::sat_resize_crop(thwc.permute({0, 3, 1, 2}), c.height, c.width);
  } else {
    std::vector<at::Tensor> frames;
    for (std::int64_t k = 0; k < thwc.size(0); ++k)
      frames.push_back(data::resize(thwc[k].permute({2, 0, 1}), {c.height, c.width}));
    x = at::stack(frames);
  }
  if (flip) x = data::horizontal_flip(x);
  return data::to_unit_range(x.contiguous()).permute({1, 0, 2, 3}).unsqueeze(0);
}

/// What a clip's latents are computed from, as a key for the latent cache: the bytes of its
/// source (the video file, or each frame file), the frames kept, how they were sized and the flip.
std::string clip_cache_key(const VideoClip& c, const Settings& s, bool flip) {
  std::string what = "video latent v1|";
  if (c.is_file()) {
    what += dt::io::sha256_file(c.source) + "|frames";
    for (const auto k : c.file_frames) what += " " + std::to_string(k);
  } else {
    for (const auto& f : c.frames) what += dt::io::sha256_file(f) + " ";
  }
  what += "|" + (s.video_resolution_buckets.empty() ? s.frame_sampling : std::string("bucket")) +
          "|" + c.shape().str() + (flip ? "|flip" : "");
  return dt::io::sha256_hex(what);
}

}  // namespace
