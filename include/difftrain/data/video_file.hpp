#pragma once
// Video files in and out through FFmpeg's libraries (libavformat, libavcodec, libswscale: the
// decoders torchvision.io, decord and PyAV wrap): MP4, MOV, WebM, MKV and AVI with whatever video
// codecs the system's FFmpeg decodes (H.264, H.265, VP9, AV1, MPEG-4, ...), 8- and 10-bit, 4:2:0 to
// 4:4:4, converted to 8-bit RGB as PyAV's `frame.to_ndarray(format="rgb24")` converts them
// (bilinear, the frame's own colorspace and range). Validation videos go out as H.264 MP4
// (MPEG-4 Part 2 where the system's FFmpeg has no H.264 encoder).
//
//   data::VideoInfo info = data::probe_video("clip.mp4");       // frames, size, fps, codec
//   data::VideoFrames v = data::read_video("clip.mp4", {.frames = {0, 4, 8}});
//   v.pixels;                                                    // (3, H, W, 3) uint8 RGB
//   data::write_video("sample.mp4", frames, {.fps = 8});         // (T, H, W, 3) uint8
//
// Bounded and typed: a missing file is an IoError; a file FFmpeg cannot open, one without a video
// stream, a size or frame count past the limits, a decoder error and a file that ends before a
// frame asked for are FormatErrors naming the file. Memory holds the kept frames only.

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/display.h>
#include <libavutil/error.h>
#include <libavutil/log.h>
#include <libavutil/opt.h>
#include <libswscale/swscale.h>
}

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/data/file_names.hpp"

namespace difftrain::data {

struct VideoLimits {
  std::int64_t max_frames = 100'000;        ///< frames in the file (its packets)
  std::int64_t max_pixels = 8192LL * 8192;  ///< width × height of a frame
};

struct VideoInfo {
  std::int64_t frames = 0;  ///< the video stream's packets (one per frame for these codecs)
  std::int64_t width = 0, height = 0;  ///< as displayed (rotation applied)
  double fps = 0;                      ///< average frame rate
  int rotation = 0;  ///< degrees clockwise the display matrix asks (0, 90, 180, 270)
  std::string codec;
};

struct VideoReadOptions {
  /// Frame indices to keep, in display order (any order, repeats allowed); empty: every frame.
  std::vector<std::int64_t> frames{};
  /// Turn frames upright by the file's display matrix (phones' portrait clips), as ffmpeg's
  /// command line does; torchvision, decord and PyAV return the stored orientation.
  bool apply_rotation = true;
  /// Decoder threads. 1 decodes in the calling thread, what a loader reading one clip per worker
  /// wants: at training sizes FFmpeg's frame threads cost more to start and hand frames between
  /// than they save (video_reader_vs_pyav). 0: FFmpeg's choice, for one long high-resolution clip.
  int threads = 1;
  VideoLimits limits{};
};

struct VideoFrames {
  at::Tensor pixels;  ///< (T, H, W, 3) uint8 RGB
  /// Each kept frame's presentation time in seconds (PyAV's frame.time): uneven in a clip of
  /// variable frame rate, where frame indices still count frames as decord's do.
  std::vector<double> times;
  VideoInfo info;
};

namespace video_detail {

inline std::string av_message(int code) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {};
  av_strerror(code, buf, sizeof buf);
  return buf;
}

struct FormatCloser {
  void operator()(AVFormatContext* f) const { avformat_close_input(&f); }
};
struct CodecCloser {
  void operator()(AVCodecContext* c) const { avcodec_free_context(&c); }
};
struct FrameFree {
  void operator()(AVFrame* f) const { av_frame_free(&f); }
};
struct PacketFree {
  void operator()(AVPacket* p) const { av_packet_free(&p); }
};
struct SwsFree {
  void operator()(SwsContext* s) const { sws_freeContext(s); }
};
using Format = std::unique_ptr<AVFormatContext, FormatCloser>;
using Codec = std::unique_ptr<AVCodecContext, CodecCloser>;
using Frame = std::unique_ptr<AVFrame, FrameFree>;
using Packet = std::unique_ptr<AVPacket, PacketFree>;
using Sws = std::unique_ptr<SwsContext, SwsFree>;

/// The opened file and its best video stream.
struct Input {
  Format format;
  int stream = -1;
  const AVCodec* decoder = nullptr;
  int rotation = 0;
};

inline int rotation_of(const AVStream* st) {
#if LIBAVFORMAT_VERSION_MAJOR < 61
  const auto* m = reinterpret_cast<const int32_t*>(
      av_stream_get_side_data(st, AV_PKT_DATA_DISPLAYMATRIX, nullptr));
#else
  const AVPacketSideData* sd = av_packet_side_data_get(
      st->codecpar->coded_side_data, st->codecpar->nb_coded_side_data, AV_PKT_DATA_DISPLAYMATRIX);
  const auto* m = sd != nullptr ? reinterpret_cast<const int32_t*>(sd->data) : nullptr;
#endif
  if (m == nullptr) return 0;
  const double theta = -av_display_rotation_get(m);  // counter-clockwise → clockwise
  if (!std::isfinite(theta)) return 0;
  const int deg = ((static_cast<int>(std::lround(theta / 90.0)) * 90) % 360 + 360) % 360;
  return deg;
}

/// FFmpeg logs every encoder's statistics at its default level: errors only, unless the program
/// chose a level itself.
inline void quiet_logs() {
  if (av_log_get_level() == AV_LOG_INFO) av_log_set_level(AV_LOG_ERROR);
}

inline Input open(const std::filesystem::path& path, const VideoLimits& limits) {
  quiet_logs();
  const std::string where = path.string();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw IoError("does not exist", where);
  AVFormatContext* raw = nullptr;
  if (const int r = avformat_open_input(&raw, where.c_str(), nullptr, nullptr); r < 0)
    throw FormatError("is not a video FFmpeg can open (" + av_message(r) + ")", where);
  Input in;
  in.format.reset(raw);
  if (const int r = avformat_find_stream_info(raw, nullptr); r < 0)
    throw FormatError("has no readable streams (" + av_message(r) + ")", where);
  const AVCodec* decoder = nullptr;
  in.stream = av_find_best_stream(raw, AVMEDIA_TYPE_VIDEO, -1, -1, &decoder, 0);
  if (in.stream == AVERROR_STREAM_NOT_FOUND) throw FormatError("holds no video stream", where);
  if (in.stream < 0 || decoder == nullptr)
    throw FormatError("has a video stream no decoder of this FFmpeg reads (" +
                          av_message(in.stream < 0 ? in.stream : AVERROR_DECODER_NOT_FOUND) + ")",
                      where);
  in.decoder = decoder;
  const AVCodecParameters* par = raw->streams[in.stream]->codecpar;
  if (par->width <= 0 || par->height <= 0)
    throw FormatError("declares no usable frame size (" + std::to_string(par->width) + "x" +
                          std::to_string(par->height) +
                          "; FFmpeg refuses a header it cannot allocate, e.g. 65535x65535)",
                      where);
  if (static_cast<std::int64_t>(par->width) * par->height > limits.max_pixels)
    throw FormatError("declares frames of " + std::to_string(par->width) + "x" +
                          std::to_string(par->height) + " (at most " +
                          std::to_string(limits.max_pixels) + " pixels)",
                      where);
  in.rotation = rotation_of(raw->streams[in.stream]);
  return in;
}

/// PyAV's to_ndarray("rgb24") conversion: bilinear, the frame's colorspace and range. The
/// context is made again only when the frame's size, format, colorspace or range changes (setting
/// the colorspace rebuilds swscale's tables, a cost per frame otherwise).
struct RgbConverter {
  Sws sws;
  std::array<int, 5> made_for{-1, -1, -1, -1, -1};  // width, height, format, colorspace, range

  SwsContext* operator()(const AVFrame* f) {
    const std::array<int, 5> key{f->width, f->height, f->format, static_cast<int>(f->colorspace),
                                 static_cast<int>(f->color_range)};
    if (sws && key == made_for) return sws.get();
    // FFmpeg 5.1's x86 YUV-to-RGB kernels overrun rows whose width is not a multiple of 16; the
    // accurate path (C) converts those instead.
    const int flags = SWS_BILINEAR | (f->width % 16 != 0 ? SWS_ACCURATE_RND : 0);
    sws.reset(sws_getCachedContext(sws.release(), f->width, f->height,
                                   static_cast<AVPixelFormat>(f->format), f->width, f->height,
                                   AV_PIX_FMT_RGB24, flags, nullptr, nullptr, nullptr));
    if (!sws) return nullptr;
    int cs = SWS_CS_DEFAULT;
    switch (f->colorspace) {
      case AVCOL_SPC_BT709:
        cs = SWS_CS_ITU709;
        break;
      case AVCOL_SPC_FCC:
        cs = SWS_CS_FCC;
        break;
      case AVCOL_SPC_SMPTE240M:
        cs = SWS_CS_SMPTE240M;
        break;
      case AVCOL_SPC_BT2020_NCL:
      case AVCOL_SPC_BT2020_CL:
        cs = SWS_CS_BT2020;
        break;
      default:
        break;
    }
    sws_setColorspaceDetails(sws.get(), sws_getCoefficients(cs),
                             f->color_range == AVCOL_RANGE_JPEG ? 1 : 0,
                             sws_getCoefficients(SWS_CS_DEFAULT), 1, 0, 1 << 16, 1 << 16);
    made_for = key;
    return sws.get();
  }
};

/// A (H, W, 3) frame turned `deg` degrees clockwise.
inline at::Tensor rotated(const at::Tensor& hwc, int deg) {
  if (deg == 90) return hwc.transpose(0, 1).flip(1).contiguous();
  if (deg == 180) return hwc.flip({0, 1}).contiguous();
  if (deg == 270) return hwc.transpose(0, 1).flip(0).contiguous();
  return hwc;
}

/// The stream's rotation, stored size turned by it, average rate and decoder; frames left to count.
inline VideoInfo stream_info(const Input& in) {
  const AVStream* st = in.format->streams[in.stream];
  VideoInfo info;
  info.rotation = in.rotation;
  const bool sideways = in.rotation == 90 || in.rotation == 270;
  info.width = sideways ? st->codecpar->height : st->codecpar->width;
  info.height = sideways ? st->codecpar->width : st->codecpar->height;
  info.fps = st->avg_frame_rate.den > 0 ? av_q2d(st->avg_frame_rate) : 0.0;
  info.codec = in.decoder->name;
  return info;
}

/// The kept frames, decoded straight into one (T, H, W, 3) tensor: no frame is allocated or
/// stacked on its own, and no copy goes through ATen's thread pool (whose spinning workers take
/// a core from the decoder). Without a frame count to size it by, it doubles as frames arrive.
class FrameStore {
 public:
  /// Room for `slots` frames; `grows`: more may arrive (every frame of the file is kept).
  FrameStore(std::int64_t slots, bool grows)
      : slots_(std::max<std::int64_t>(slots, 1)), grows_(grows) {}

  /// Converts `f`, the file's frame `index`, turned `deg` degrees, into slot `k`, making room
  /// first when it grows.
  void put(std::int64_t k, std::int64_t index, const AVFrame* f, int deg, RgbConverter& convert,
           const std::string& where) {
    SwsContext* sws = convert(f);
    if (sws == nullptr) throw FormatError("has frames swscale cannot convert to RGB", where);
    const bool sideways = deg == 90 || deg == 270;
    const std::int64_t h = sideways ? f->width : f->height, w = sideways ? f->height : f->width;
    if (!pixels_.defined()) {
      // At most 1 GiB up front: a header's frame count is not trusted with memory.
      const std::int64_t frame_bytes = h * w * 3;
      if (grows_)
        slots_ = std::clamp<std::int64_t>(slots_, 1,
                                          std::max<std::int64_t>(1, (1LL << 30) / frame_bytes));
      pixels_ = at::empty({slots_, h, w, 3}, at::kByte);
    } else if (h != pixels_.size(1) || w != pixels_.size(2)) {
      throw FormatError("changes its frame size at frame " + std::to_string(index) + " (" +
                            std::to_string(pixels_.size(2)) + "x" +
                            std::to_string(pixels_.size(1)) + " to " + std::to_string(w) + "x" +
                            std::to_string(h) + ")",
                        where);
    }
    if (k >= slots_) grow(k + 1);
    std::uint8_t* slot = pixels_.data_ptr<std::uint8_t>() + k * h * w * 3;
    // swscale's SIMD converters write whole 64-byte vectors: a row of such a length goes straight
    // into its slot; any other row goes through a padded scratch frame and is cut after.
    const int row = 3 * f->width, padded = (row + 63) / 64 * 64;
    if (deg == 0 && row == padded) {
      std::uint8_t* dst[1] = {slot};
      const int stride[1] = {row};
      sws_scale(sws, f->data, f->linesize, 0, f->height, dst, stride);
      return;
    }
    scratch_.resize(static_cast<std::size_t>(padded) * f->height + 64);
    auto* aligned = reinterpret_cast<std::uint8_t*>(
        (reinterpret_cast<std::uintptr_t>(scratch_.data()) + 63) & ~std::uintptr_t{63});
    std::uint8_t* dst[1] = {aligned};
    const int stride[1] = {padded};
    sws_scale(sws, f->data, f->linesize, 0, f->height, dst, stride);
    if (deg == 0) {
      for (int y = 0; y < f->height; ++y)
        std::memcpy(slot + static_cast<std::ptrdiff_t>(y) * row, aligned + y * padded, row);
      return;
    }
    const at::Tensor stored = at::from_blob(aligned, {f->height, f->width, 3}, {padded, 3, 1},
                                            at::TensorOptions(at::kByte));
    pixels_[k].copy_(rotated(stored, deg));
  }

  /// Slot `from`'s frame into slot `to` (a frame asked for twice).
  void repeat(std::int64_t from, std::int64_t to) {
    const std::int64_t bytes = pixels_.size(1) * pixels_.size(2) * 3;
    std::uint8_t* base = pixels_.data_ptr<std::uint8_t>();
    std::memcpy(base + to * bytes, base + from * bytes, static_cast<std::size_t>(bytes));
  }

  /// The first `count` frames, holding no memory beyond them.
  at::Tensor take(std::int64_t count) {
    if (count == pixels_.size(0)) return std::move(pixels_);
    return pixels_.narrow(0, 0, count).clone();
  }

 private:
  void grow(std::int64_t need) {
    std::int64_t slots = slots_;
    while (slots < need) slots *= 2;
    at::Tensor bigger = at::empty({slots, pixels_.size(1), pixels_.size(2), 3}, at::kByte);
    std::memcpy(bigger.data_ptr(), pixels_.data_ptr(), static_cast<std::size_t>(pixels_.nbytes()));
    pixels_ = std::move(bigger);
    slots_ = slots;
  }

  std::int64_t slots_;
  bool grows_;
  at::Tensor pixels_;
  std::vector<std::uint8_t> scratch_;
};

}  // namespace video_detail

/// The file's video stream: its frame count (packets, counted without decoding), size, rate and
/// codec.
inline VideoInfo probe_video(const std::filesystem::path& path, const VideoLimits& limits = {}) {
  using namespace video_detail;
  Input in = open(path, limits);
  VideoInfo info = stream_info(in);
  Packet pkt(av_packet_alloc());
  while (av_read_frame(in.format.get(), pkt.get()) >= 0) {
    if (pkt->stream_index == in.stream && ++info.frames > limits.max_frames)
      throw FormatError("holds more than " + std::to_string(limits.max_frames) + " frames",
                        path.string());
    av_packet_unref(pkt.get());
  }
  return info;
}

/// Decodes the frames `o.frames` names (every frame when empty) as (T, H, W, 3) uint8 RGB.
inline VideoFrames read_video(const std::filesystem::path& path, const VideoReadOptions& o = {}) {
  using namespace video_detail;
  const std::string where = path.string();
  if (o.threads < 0)
    throw ConfigError(
        "decoder threads must be 0 (FFmpeg's choice) or more, not " + std::to_string(o.threads),
        where);
  Input in = open(path, o.limits);
  Codec codec(avcodec_alloc_context3(in.decoder));
  if (!codec) throw FormatError("could not make a decoder", where);
  const AVStream* stream = in.format->streams[in.stream];
  avcodec_parameters_to_context(codec.get(), stream->codecpar);
  codec->thread_count = o.threads;
  if (const int r = avcodec_open2(codec.get(), in.decoder, nullptr); r < 0)
    throw FormatError(
        "could not open its " + std::string(in.decoder->name) + " decoder (" + av_message(r) + ")",
        where);
  // Which output slots each decoded frame fills.
  std::map<std::int64_t, std::vector<std::int64_t>> wanted;
  for (std::size_t k = 0; k < o.frames.size(); ++k) {
    if (o.frames[k] < 0 || o.frames[k] >= o.limits.max_frames)
      throw ConfigError("frame " + std::to_string(o.frames[k]) + " is outside [0, " +
                            std::to_string(o.limits.max_frames) + ")",
                        where);
    wanted[o.frames[k]].push_back(static_cast<std::int64_t>(k));
  }
  const bool keep_all = wanted.empty();
  // Every frame: decoding goes one past the limit, so a longer file is refused, not cut.
  const std::int64_t last = keep_all ? o.limits.max_frames : wanted.rbegin()->first;
  // Every frame: room for the header's count, but never past the limit (one more frame is refused).
  FrameStore store(keep_all
                       ? (stream->nb_frames > 0
                              ? std::min<std::int64_t>(stream->nb_frames, o.limits.max_frames + 1)
                              : 16)
                       : static_cast<std::int64_t>(o.frames.size()),
                   keep_all);
  std::vector<double> times(o.frames.size());
  const AVRational time_base = stream->time_base;
  Packet pkt(av_packet_alloc());
  Frame frame(av_frame_alloc());
  RgbConverter convert;
  std::int64_t index = 0, kept = 0;
  bool done = false;
  const int deg = o.apply_rotation ? in.rotation : 0;
  auto take = [&]() {
    const auto it = wanted.find(index);
    if (keep_all || it != wanted.end()) {
      const std::int64_t pts = frame->best_effort_timestamp;
      const double seconds = pts == AV_NOPTS_VALUE ? std::nan("") : av_q2d(time_base) * pts;
      if (keep_all) {
        store.put(kept++, index, frame.get(), deg, convert, where);
        times.push_back(seconds);
      } else {
        const std::vector<std::int64_t>& slots = it->second;
        store.put(slots.front(), index, frame.get(), deg, convert, where);
        for (const std::int64_t k : slots) {
          if (k != slots.front()) store.repeat(slots.front(), k);
          times[static_cast<std::size_t>(k)] = seconds;
        }
        kept += static_cast<std::int64_t>(slots.size());
      }
    }
    ++index;
    if (index > o.limits.max_frames)
      throw FormatError("holds more than " + std::to_string(o.limits.max_frames) + " frames",
                        where);
    done = index > last;
  };
  auto drain = [&]() {
    while (!done) {
      const int r = avcodec_receive_frame(codec.get(), frame.get());
      if (r == AVERROR(EAGAIN) || r == AVERROR_EOF) return;
      if (r < 0)
        throw FormatError(
            "fails to decode after frame " + std::to_string(index) + " (" + av_message(r) + ")",
            where);
      take();
      av_frame_unref(frame.get());
    }
  };
  while (!done) {
    const int r = av_read_frame(in.format.get(), pkt.get());
    if (r == AVERROR_EOF) break;
    if (r < 0) break;  // a truncated file: what decoded so far counts
    if (pkt->stream_index == in.stream) {
      const int s = avcodec_send_packet(codec.get(), pkt.get());
      av_packet_unref(pkt.get());
      if (s < 0 && s != AVERROR(EAGAIN))
        throw FormatError(
            "fails to decode after frame " + std::to_string(index) + " (" + av_message(s) + ")",
            where);
      drain();
    } else {
      av_packet_unref(pkt.get());
    }
  }
  if (!done) {  // the decoder's last frames
    avcodec_send_packet(codec.get(), nullptr);
    drain();
  }
  VideoFrames v;
  v.info = stream_info(in);
  v.info.frames = index;
  if (keep_all) {
    if (kept == 0) throw FormatError("holds no decodable frame", where);
  } else if (!done) {
    throw FormatError("ends after " + std::to_string(index) + " frames; frame " +
                          std::to_string(last) + " was asked for (a truncated file?)",
                      where);
  }
  v.pixels = store.take(kept);
  v.times = std::move(times);
  v.info.height = v.pixels.size(1);
  v.info.width = v.pixels.size(2);
  return v;
}

struct VideoWriteOptions {
  double fps = 8;
  int crf = 18;      ///< H.264's constant rate factor (lower: better); MPEG-4 uses quantiser 2
  int rotation = 0;  ///< degrees clockwise players turn the frames (a display matrix); 0: none
};

namespace video_detail {

/// Sends one frame (nullptr: the end) to the encoder and writes the packets it gives.
inline void encode_and_mux(AVCodecContext* ctx, AVFormatContext* oc, AVStream* st, AVPacket* pkt,
                           AVFrame* f, const std::string& where) {
  if (const int r = avcodec_send_frame(ctx, f); r < 0)
    throw FormatError("the encoder refused a frame (" + av_message(r) + ")", where);
  while (true) {
    const int r = avcodec_receive_packet(ctx, pkt);
    if (r == AVERROR(EAGAIN) || r == AVERROR_EOF) return;
    if (r < 0) throw FormatError("the encoder failed (" + av_message(r) + ")", where);
    // Every frame lasts one frame period: without it MP4's edit list ends before the last one.
    if (pkt->duration <= 0) pkt->duration = 1;
    av_packet_rescale_ts(pkt, ctx->time_base, st->time_base);
    pkt->stream_index = st->index;
    if (const int m = av_interleaved_write_frame(oc, pkt); m < 0)
      throw IoError("could not be written (" + av_message(m) + ")", where);
  }
}

struct OutputCloser {
  void operator()(AVFormatContext* f) const {
    if (f->pb != nullptr) avio_closep(&f->pb);
    avformat_free_context(f);
  }
};
using Output = std::unique_ptr<AVFormatContext, OutputCloser>;

/// A file name that vanishes unless the write finished (then renamed over the target).
struct PartialFile {
  std::filesystem::path file;
  bool done = false;
  ~PartialFile() {
    std::error_code ignored;
    if (!done) std::filesystem::remove(file, ignored);
  }
};

/// A palette of at most 256 colours for all the frames (T, H, W, 3) by median cut over a 5-bit
/// histogram (as PIL's adaptive palette, which diffusers' export_to_gif uses), and the palette
/// index of every 5-bit colour: the nearest entry.
struct GifPalette {
  std::vector<std::uint32_t> argb;  // the palette as the GIF encoder takes it
  std::vector<std::uint8_t> index;  // 32768 entries, by (r >> 3) << 10 | (g >> 3) << 5 | b >> 3
};
inline GifPalette median_cut_palette(const at::Tensor& rgb) {
  constexpr int bins = 1 << 15;
  std::vector<std::int64_t> count(bins, 0);
  std::vector<std::array<std::int64_t, 3>> sum(bins, {0, 0, 0});
  const std::uint8_t* px = rgb.data_ptr<std::uint8_t>();
  for (std::int64_t i = 0, n = rgb.numel() / 3; i < n; ++i, px += 3) {
    const int b = (px[0] >> 3) << 10 | (px[1] >> 3) << 5 | px[2] >> 3;
    ++count[b];
    for (int c = 0; c < 3; ++c) sum[b][c] += px[c];
  }
  auto channel = [](int bin, int c) { return (bin >> (10 - 5 * c)) & 31; };
  std::vector<std::vector<int>> boxes(1);
  for (int b = 0; b < bins; ++b)
    if (count[b] > 0) boxes[0].push_back(b);
  while (boxes.size() < 256) {
    // The box spanning the widest channel range is cut at its median pixel along that channel.
    int best = -1, best_channel = 0, best_range = 0;
    for (std::size_t k = 0; k < boxes.size(); ++k) {
      if (boxes[k].size() < 2) continue;
      for (int c = 0; c < 3; ++c) {
        int lo = 31, hi = 0;
        for (const int b : boxes[k]) {
          lo = std::min(lo, channel(b, c));
          hi = std::max(hi, channel(b, c));
        }
        if (hi - lo > best_range) {
          best = static_cast<int>(k);
          best_channel = c;
          best_range = hi - lo;
        }
      }
    }
    if (best < 0) break;
    std::vector<int>& box = boxes[static_cast<std::size_t>(best)];
    std::sort(box.begin(), box.end(),
              [&](int a, int b) { return channel(a, best_channel) < channel(b, best_channel); });
    std::int64_t total = 0, seen = 0;
    for (const int b : box) total += count[b];
    std::size_t cut = 1;
    for (; cut < box.size(); ++cut) {
      seen += count[box[cut - 1]];
      if (2 * seen >= total) break;
    }
    cut = std::min(cut, box.size() - 1);
    std::vector<int> upper(box.begin() + static_cast<std::ptrdiff_t>(cut), box.end());
    box.resize(cut);
    boxes.push_back(std::move(upper));
  }
  GifPalette p;
  std::vector<std::array<double, 3>> colours;
  for (const auto& box : boxes) {
    std::array<std::int64_t, 3> s{0, 0, 0};
    std::int64_t n = 0;
    for (const int b : box) {
      n += count[b];
      for (int c = 0; c < 3; ++c) s[c] += sum[b][c];
    }
    std::array<double, 3> mean{};
    for (int c = 0; c < 3; ++c)
      mean[c] = n > 0 ? std::round(static_cast<double>(s[c]) / static_cast<double>(n)) : 0.0;
    colours.push_back(mean);
    p.argb.push_back(0xFF000000U | static_cast<std::uint32_t>(mean[0]) << 16 |
                     static_cast<std::uint32_t>(mean[1]) << 8 |
                     static_cast<std::uint32_t>(mean[2]));
  }
  p.index.resize(bins);
  for (int b = 0; b < bins; ++b) {
    std::array<double, 3> x{};
    for (int c = 0; c < 3; ++c)
      x[c] = count[b] > 0 ? static_cast<double>(sum[b][c]) / static_cast<double>(count[b])
                          : channel(b, c) * 8 + 4;
    double nearest = 1e30;
    for (std::size_t k = 0; k < colours.size(); ++k) {
      const double d = (x[0] - colours[k][0]) * (x[0] - colours[k][0]) +
                       (x[1] - colours[k][1]) * (x[1] - colours[k][1]) +
                       (x[2] - colours[k][2]) * (x[2] - colours[k][2]);
      if (d < nearest) {
        nearest = d;
        p.index[static_cast<std::size_t>(b)] = static_cast<std::uint8_t>(k);
      }
    }
  }
  return p;
}

/// Frames (T, H, W, 3) uint8 as an endlessly looping GIF at `fps` (GIF keeps centiseconds).
inline std::string write_gif(const std::filesystem::path& path, const at::Tensor& x, double fps) {
  const std::string where = path.string();
  const int h = static_cast<int>(x.size(1)), w = static_cast<int>(x.size(2));
  PartialFile partial{path.string() + ".partial.gif"};
  AVFormatContext* raw = nullptr;
  if (avformat_alloc_output_context2(&raw, nullptr, "gif", partial.file.string().c_str()) < 0 ||
      raw == nullptr)
    throw FormatError("FFmpeg has no GIF muxer", where);
  Output oc(raw);
  const AVCodec* enc = avcodec_find_encoder(AV_CODEC_ID_GIF);
  if (enc == nullptr) throw FormatError("FFmpeg has no GIF encoder", where);
  AVStream* st = avformat_new_stream(oc.get(), nullptr);
  Codec ctx(avcodec_alloc_context3(enc));
  ctx->width = w;
  ctx->height = h;
  ctx->pix_fmt = AV_PIX_FMT_PAL8;
  ctx->time_base = AVRational{1, 100};
  if (const int r = avcodec_open2(ctx.get(), enc, nullptr); r < 0)
    throw FormatError("could not open the GIF encoder (" + av_message(r) + ")", where);
  avcodec_parameters_from_context(st->codecpar, ctx.get());
  st->time_base = ctx->time_base;
  if (const int r = avio_open(&oc->pb, partial.file.string().c_str(), AVIO_FLAG_WRITE); r < 0)
    throw IoError("cannot be written (" + av_message(r) + ")", where);
  if (const int r = avformat_write_header(oc.get(), nullptr); r < 0)
    throw FormatError("the GIF header could not be written (" + av_message(r) + ")", where);
  const GifPalette palette = median_cut_palette(x);
  Frame frame(av_frame_alloc());
  frame->format = AV_PIX_FMT_PAL8;
  frame->width = w;
  frame->height = h;
  if (av_frame_get_buffer(frame.get(), 0) < 0) throw FormatError("out of memory", where);
  Packet pkt(av_packet_alloc());
  for (std::int64_t t = 0; t < x.size(0); ++t) {
    av_frame_make_writable(frame.get());
    std::memset(frame->data[1], 0, 1024);
    std::memcpy(frame->data[1], palette.argb.data(), palette.argb.size() * 4);
    const std::uint8_t* px = x[t].data_ptr<std::uint8_t>();
    for (int r = 0; r < h; ++r)
      for (int c = 0; c < w; ++c, px += 3)
        frame->data[0][r * frame->linesize[0] + c] = palette.index[static_cast<std::size_t>(
            (px[0] >> 3) << 10 | (px[1] >> 3) << 5 | px[2] >> 3)];
    frame->pts = static_cast<std::int64_t>(std::llround(static_cast<double>(t) * 100.0 / fps));
    encode_and_mux(ctx.get(), oc.get(), st, pkt.get(), frame.get(), where);
  }
  encode_and_mux(ctx.get(), oc.get(), st, pkt.get(), nullptr, where);
  if (const int r = av_write_trailer(oc.get()); r < 0)
    throw IoError("could not be finished (" + av_message(r) + ")", where);
  avio_closep(&oc->pb);
  std::filesystem::rename(partial.file, path);
  partial.done = true;
  return enc->name;
}

}  // namespace video_detail

/// Writes (T, H, W, 3) uint8 RGB frames as an MP4 (H.264 yuv420p, or MPEG-4 Part 2 where there is
/// no H.264 encoder); an odd width or height is padded by repeating the last column or row
/// (4:2:0 needs even sizes). Written to a temporary name and renamed, so a reader never sees half
/// a file. A path ending in .gif gets an endlessly looping GIF instead, in a median-cut palette
/// of 256 colours shared by all frames. Returns the encoder's name.
inline std::string write_video(const std::filesystem::path& path, const at::Tensor& frames,
                               const VideoWriteOptions& o = {}) {
  using namespace video_detail;
  const std::string where = path.string();
  if (frames.dim() != 4 || frames.size(3) != 3 || frames.scalar_type() != at::kByte ||
      frames.size(0) < 1)
    throw ShapeError("frames must be (T, H, W, 3) uint8 with T ≥ 1, got " +
                         c10::str(frames.sizes()) + " " + c10::toString(frames.scalar_type()),
                     where);
  if (!(o.fps > 0 && o.fps <= 1000)) throw ConfigError("fps must be in (0, 1000]", where);
  if (o.rotation % 90 != 0) throw ConfigError("rotation must be a multiple of 90", where);
  at::Tensor x = frames.cpu().contiguous();
  if (lower_extension(path) == ".gif") {
    quiet_logs();
    return write_gif(path, x, o.fps);
  }
  if (x.size(1) % 2 != 0) x = at::cat({x, x.narrow(1, x.size(1) - 1, 1)}, 1);
  if (x.size(2) % 2 != 0) x = at::cat({x, x.narrow(2, x.size(2) - 1, 1)}, 2);
  x = x.contiguous();
  const int h = static_cast<int>(x.size(1)), w = static_cast<int>(x.size(2));
  quiet_logs();
  PartialFile cleanup{path.string() + ".partial.mp4"};  // a failed write leaves nothing behind
  const std::filesystem::path& tmp = cleanup.file;
  AVFormatContext* raw = nullptr;
  if (avformat_alloc_output_context2(&raw, nullptr, "mp4", tmp.string().c_str()) < 0 || !raw)
    throw FormatError("FFmpeg has no MP4 muxer", where);
  Output oc(raw);
  const AVCodec* enc = avcodec_find_encoder_by_name("libx264");
  if (enc == nullptr) enc = avcodec_find_encoder(AV_CODEC_ID_MPEG4);
  if (enc == nullptr) throw FormatError("FFmpeg has neither an H.264 nor an MPEG-4 encoder", where);
  AVStream* st = avformat_new_stream(oc.get(), nullptr);
  Codec ctx(avcodec_alloc_context3(enc));
  const AVRational rate = av_d2q(o.fps, 100000);
  ctx->width = w;
  ctx->height = h;
  ctx->pix_fmt = AV_PIX_FMT_YUV420P;
  ctx->time_base = av_inv_q(rate);
  ctx->framerate = rate;
  ctx->gop_size = 12;
  if (std::string(enc->name) == "libx264") {
    av_opt_set(ctx->priv_data, "crf", std::to_string(o.crf).c_str(), 0);
    av_opt_set(ctx->priv_data, "preset", "medium", 0);
  } else {
    ctx->flags |= AV_CODEC_FLAG_QSCALE;
    ctx->global_quality = FF_QP2LAMBDA * 2;
  }
  if ((oc->oformat->flags & AVFMT_GLOBALHEADER) != 0) ctx->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  if (const int r = avcodec_open2(ctx.get(), enc, nullptr); r < 0)
    throw FormatError(
        "could not open the " + std::string(enc->name) + " encoder (" + av_message(r) + ")", where);
  avcodec_parameters_from_context(st->codecpar, ctx.get());
  st->time_base = ctx->time_base;
  if (o.rotation % 360 != 0) {
    std::vector<int32_t> m(9);
    av_display_rotation_set(m.data(), static_cast<double>(o.rotation));  // clockwise
#if LIBAVFORMAT_VERSION_MAJOR < 61
    uint8_t* sd = av_stream_new_side_data(st, AV_PKT_DATA_DISPLAYMATRIX, 9 * sizeof(int32_t));
    if (sd == nullptr) throw FormatError("out of memory", where);
    std::memcpy(sd, m.data(), 9 * sizeof(int32_t));
#else
    AVPacketSideData* sd =
        av_packet_side_data_new(&st->codecpar->coded_side_data, &st->codecpar->nb_coded_side_data,
                                AV_PKT_DATA_DISPLAYMATRIX, 9 * sizeof(int32_t), 0);
    if (sd == nullptr) throw FormatError("out of memory", where);
    std::memcpy(sd->data, m.data(), 9 * sizeof(int32_t));
#endif
  }
  if (const int r = avio_open(&oc->pb, tmp.string().c_str(), AVIO_FLAG_WRITE); r < 0)
    throw IoError("cannot be written (" + av_message(r) + ")", where);
  if (const int r = avformat_write_header(oc.get(), nullptr); r < 0)
    throw FormatError("the MP4 header could not be written (" + av_message(r) + ")", where);
  Frame frame(av_frame_alloc());
  frame->format = AV_PIX_FMT_YUV420P;
  frame->width = w;
  frame->height = h;
  if (av_frame_get_buffer(frame.get(), 0) < 0) throw FormatError("out of memory", where);
  Sws sws(sws_getContext(w, h, AV_PIX_FMT_RGB24, w, h, AV_PIX_FMT_YUV420P, SWS_BILINEAR, nullptr,
                         nullptr, nullptr));
  Packet pkt(av_packet_alloc());
  auto send = [&](AVFrame* f) { encode_and_mux(ctx.get(), oc.get(), st, pkt.get(), f, where); };
  for (std::int64_t t = 0; t < x.size(0); ++t) {
    av_frame_make_writable(frame.get());
    const uint8_t* src[1] = {x[t].data_ptr<uint8_t>()};
    const int stride[1] = {3 * w};
    sws_scale(sws.get(), src, stride, 0, h, frame->data, frame->linesize);
    frame->pts = t;
    send(frame.get());
  }
  send(nullptr);
  if (const int r = av_write_trailer(oc.get()); r < 0)
    throw IoError("could not be finished (" + av_message(r) + ")", where);
  avio_closep(&oc->pb);
  std::filesystem::rename(tmp, path);
  cleanup.done = true;
  return enc->name;
}

}  // namespace difftrain::data
