#pragma once
// A folder of captioned images as the fine-tuning tools lay it out, scanned once: every JPEG, PNG
// and WebP below the root (recursively, in name order), each with its caption and repeat count.
//
// Captions, first found wins:
//   metadata   diffusers' imagefolder: a metadata.jsonl ({"file_name": ..., "text": ...} per line)
//              or metadata.csv (a header row naming the columns) in the image's folder or one
//              above it; file_name is relative to that file; the caption column is chosen
//              (diffusers' --caption_column, default "text") and must exist;
//   sidecar    a text file beside the image with the same stem: ".txt" (the web UI), ".caption"
//              (kohya's default), in the order given; read whole, as the web UI reads it;
//   file name  the web UI's [filewords]: the stem without leading digits and dashes
//              (^[-\d]+\s*), optionally the matches of a word regex joined by a string;
//   folder     kohya's "N_words" folders: the words after the repeat count (a class prompt), when
//              nothing else names a caption.
// Repeats: kohya's "N_words" folder names give each image in them N repeats (1 otherwise).
//
// Each image's header is read (its size, after its EXIF orientation; aspect-ratio buckets need
// it) and, unless verify_pixels is off, its pixels decoded once; a file that cannot be read as an
// image is reported once (path and reason), skipped and counted. An empty folder, a caption column
// that does not exist and unreadable metadata are typed errors.

#include <turbojpeg.h>
#include <webp/decode.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/data/file_names.hpp"  // is_image_name
#include "difftrain/data/image.hpp"
#include "difftrain/io/json_parse.hpp"
#include "difftrain/io/read_file.hpp"
#include "difftrain/io/utf8.hpp"

namespace difftrain::data {

struct ImageFolderOptions {
  std::string image_column = "file_name";  ///< diffusers' --image_column for metadata files
  std::string caption_column = "text";     ///< diffusers' --caption_column
  std::vector<std::string> sidecar_extensions = {".txt", ".caption"};
  /// The web UI's dataset_filename_word_regex (ECMAScript syntax); empty: the whole stem.
  std::string filename_word_regex;
  std::string filename_join = " ";  ///< the web UI's dataset_filename_join_string
  bool kohya_repeat_folders = true;
  /// Decode every image once while scanning, so a file damaged after its header is skipped and
  /// reported here rather than failing a batch later (costs one decode per image).
  bool verify_pixels = true;
  ImageLimits limits;
};

struct ImageRecord {
  std::filesystem::path path;
  std::string caption;
  std::string caption_source;  ///< "metadata", "sidecar", "filename" or "folder"
  std::int64_t repeats = 1;
  std::int64_t width = 0, height = 0;  ///< after the EXIF orientation
  ImageFormat format = ImageFormat::png;
  /// A mask image for the loss (kohya's conditioning image: its red channel, 0 to 255 for 0 to
  /// 1), the image's size; empty: none (or the alpha channel, with ImageBatchOptions::alpha_mask).
  std::filesystem::path mask{};
};

struct SkippedFile {
  std::filesystem::path path;
  std::string reason;
};

/// The longest line of a metadata.jsonl difftrain reads (1 MiB).
inline constexpr std::size_t kMaxMetadataLine = std::size_t{1} << 20;

/// The most images × repeats an epoch of a folder may hold (kohya's "N_words" folders): an
/// epoch is a list of that many entries.
inline constexpr std::int64_t kMaxEpochItems = std::int64_t{1} << 26;

struct ImageFolder {
  std::vector<ImageRecord> images;
  std::vector<SkippedFile> skipped;
  /// Images counted with their repeats (an epoch of kohya's).
  [[nodiscard]] std::int64_t epoch_size() const {
    std::int64_t n = 0;
    for (const auto& r : images) n += r.repeats;
    return n;
  }
};

namespace folder_detail {

/// One CSV record per line of `text` (RFC 4180: quoted fields, doubled quotes, quoted newlines).
inline std::vector<std::vector<std::string>> parse_csv(const std::string& text,
                                                       const std::string& where) {
  std::vector<std::vector<std::string>> rows(1);
  std::string field;
  bool quoted = false, any = false;
  std::size_t line = 1;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        field.push_back('"');
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        if (c == '\n') ++line;
        field.push_back(c);
      }
    } else if (c == '"' && field.empty()) {
      quoted = any = true;
    } else if (c == ',') {
      rows.back().push_back(std::move(field));
      field.clear();
      any = true;
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      if (any || !field.empty()) rows.back().push_back(std::move(field));
      field.clear();
      any = false;
      rows.emplace_back();
      ++line;
    } else {
      field.push_back(c);
      any = true;
    }
  }
  if (quoted)
    throw FormatError("a quoted field is not closed (from line " + std::to_string(line) + ")",
                      where);
  if (any || !field.empty()) rows.back().push_back(std::move(field));
  rows.erase(std::remove_if(rows.begin(), rows.end(), [](const auto& r) { return r.empty(); }),
             rows.end());
  return rows;
}

/// Captions from one metadata file, keyed by the normalized absolute image path.
inline std::map<std::filesystem::path, std::string> read_metadata(const std::filesystem::path& file,
                                                                  const ImageFolderOptions& o) {
  namespace fs = std::filesystem;
  std::map<fs::path, std::string> out;
  const std::string where = file.string();
  const std::vector<char> bytes = io::read_file(file);
  const std::string_view text(bytes.data(), bytes.size());
  auto add = [&](const std::string& name, const std::string& caption, const std::string& at) {
    if (name.empty()) throw FormatError("has an empty '" + o.image_column + "'", at);
    out[(file.parent_path() / fs::path(name)).lexically_normal()] = caption;
  };
  if (file.extension() == ".jsonl") {
    std::size_t line = 0, start = 0;
    while (start <= text.size()) {
      std::size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      ++line;
      const std::string_view row = text.substr(start, end - start);
      start = end + 1;
      if (row.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string at = where + " line " + std::to_string(line);
      // One image's name and caption: a line past this is not a caption (a 1 GB line took 6.5 GB
      // to read).
      if (row.size() > kMaxMetadataLine)
        throw FormatError("is " + std::to_string(row.size()) +
                              " bytes long; a line names one image and its caption, at most " +
                              std::to_string(kMaxMetadataLine) + " bytes",
                          at);
      const nlohmann::json j = io::parse_json(row, at);
      if (!j.is_object()) throw FormatError("is not a JSON object", at);
      if (!j.contains(o.image_column) || !j[o.image_column].is_string())
        throw FormatError("has no string '" + o.image_column + "' (the image column)", at);
      if (!j.contains(o.caption_column)) {
        std::string have;
        for (const auto& [k, v] : j.items()) have += (have.empty() ? "" : ", ") + k;
        throw ConfigError("the caption column '" + o.caption_column +
                              "' does not exist; the columns are: " + have,
                          at);
      }
      const auto& c = j[o.caption_column];
      // As diffusers' scripts: a caption is text; null, a number or an object is a mistake in
      // the file, not a caption to train on under its JSON spelling.
      if (!c.is_string())
        throw FormatError("has a " + std::string(c.type_name()) + " in the caption column '" +
                              o.caption_column + "' (" + io::json_brief(c) +
                              "), where a caption is text",
                          at);
      add(j[o.image_column].get<std::string>(), c.get<std::string>(), at);
    }
    return out;
  }
  if (bytes.size() > kMaxMetadataLine * 4096)
    throw FormatError("is " + std::to_string(bytes.size()) +
                          " bytes; a metadata.csv holds at most " +
                          std::to_string(kMaxMetadataLine * 4096) + " bytes",
                      where);
  const auto rows = parse_csv(std::string(text), where);
  if (rows.empty()) throw FormatError("is empty (no header row)", where);
  const auto& header = rows[0];
  const auto col = [&](const std::string& name) -> std::optional<std::size_t> {
    for (std::size_t i = 0; i < header.size(); ++i)
      if (header[i] == name) return i;
    return std::nullopt;
  };
  std::string have;
  for (const auto& h : header) have += (have.empty() ? "" : ", ") + h;
  const auto image = col(o.image_column);
  if (!image)
    throw FormatError("has no '" + o.image_column + "' column; the columns are: " + have, where);
  const auto caption = col(o.caption_column);
  if (!caption)
    throw ConfigError(
        "the caption column '" + o.caption_column + "' does not exist; the columns are: " + have,
        where);
  for (std::size_t r = 1; r < rows.size(); ++r) {
    const std::string at = where + " row " + std::to_string(r + 1);
    if (rows[r].size() != header.size())
      throw FormatError("has " + std::to_string(rows[r].size()) + " fields; the header has " +
                            std::to_string(header.size()),
                        at);
    add(rows[r][*image], rows[r][*caption], at);
  }
  return out;
}

/// kohya's "N_words" folder name: N repeats and the words, or nothing.
inline std::optional<std::pair<std::int64_t, std::string>> repeat_folder(const std::string& name) {
  const auto underscore = name.find('_');
  if (underscore == std::string::npos || underscore == 0 || underscore > 9) return std::nullopt;
  std::int64_t n = 0;
  for (std::size_t i = 0; i < underscore; ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return std::nullopt;
    n = n * 10 + (name[i] - '0');
  }
  if (n < 1) return std::nullopt;
  return std::make_pair(n, name.substr(underscore + 1));
}

/// The size of an image from its header (after the EXIF orientation), or why it cannot be read.
inline std::pair<std::int64_t, std::int64_t> probe_size(std::span<const char> bytes,
                                                        ImageFormat format,
                                                        const ImageLimits& limits,
                                                        const std::string& where) {
  using namespace image_detail;
  const std::span<const unsigned char> u(reinterpret_cast<const unsigned char*>(bytes.data()),
                                         bytes.size());
  std::int64_t w = 0, h = 0;
  std::span<const unsigned char> exif;
  if (format == ImageFormat::jpeg) {
    std::unique_ptr<void, int (*)(tjhandle)> tj(tjInitDecompress(), tjDestroy);
    int iw = 0, ih = 0, ss = 0, cs = 0;
    if (!tj || tjDecompressHeader3(tj.get(), u.data(), static_cast<unsigned long>(u.size()), &iw,
                                   &ih, &ss, &cs) != 0)
      throw FormatError(std::string("is not a JPEG TurboJPEG can read: ") +
                            (tj ? tjGetErrorStr2(tj.get()) : "no decompressor"),
                        where);
    if (cs == TJCS_CMYK || cs == TJCS_YCCK)
      throw FormatError("is a CMYK JPEG; difftrain reads greyscale and colour JPEGs", where);
    w = iw;
    h = ih;
    exif = jpeg_exif(u);
  } else if (format == ImageFormat::png) {
    if (bytes.size() < 33 || std::memcmp(u.data() + 12, "IHDR", 4) != 0)
      throw FormatError("is truncated or damaged before its image header", where);
    w = get32(u.data() + 16, false);
    h = get32(u.data() + 20, false);
    exif = png_exif(u);
  } else {
    WebPBitstreamFeatures f;
    if (WebPGetFeatures(u.data(), u.size(), &f) != VP8_STATUS_OK)
      throw FormatError("is not a WebP libwebp can read (damaged header)", where);
    w = f.width;
    h = f.height;
    exif = webp_exif(u);
  }
  check_size(static_cast<std::uint64_t>(w), static_cast<std::uint64_t>(h), limits, where);
  return exif_orientation(exif) >= 5 ? std::make_pair(h, w) : std::make_pair(w, h);
}

}  // namespace folder_detail

/// The web UI's [filewords] text of an image file name.
inline std::string filewords(const std::filesystem::path& image, const ImageFolderOptions& o = {}) {
  std::string stem = image.stem().string();
  std::size_t i = 0;
  while (i < stem.size() && (std::isdigit(static_cast<unsigned char>(stem[i])) || stem[i] == '-'))
    ++i;
  if (i > 0)
    while (i < stem.size() && std::isspace(static_cast<unsigned char>(stem[i]))) ++i;
  stem = stem.substr(i);
  if (o.filename_word_regex.empty()) return stem;
  std::regex word;
  try {
    word = std::regex(o.filename_word_regex);
  } catch (const std::regex_error& e) {
    throw ConfigError(
        "filename_word_regex '" + o.filename_word_regex + "' is not a regex: " + e.what(),
        "ImageFolderOptions");
  }
  std::string out;
  bool first = true;
  for (auto it = std::sregex_iterator(stem.begin(), stem.end(), word); it != std::sregex_iterator();
       ++it) {
    if (!first) out += o.filename_join;
    out += it->str();
    first = false;
  }
  return out;
}

/// Scans `root` (see the top of this file). Throws IoError when the root is not a readable folder,
/// ConfigError when it holds no image that can be read or a caption column does not exist,
/// FormatError for damaged metadata.
inline ImageFolder scan_image_folder(const std::filesystem::path& root,
                                     const ImageFolderOptions& o = {}) {
  namespace fs = std::filesystem;
  using namespace folder_detail;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) throw IoError("is not a folder", root.string());
  // Metadata files first (they name images anywhere below them).
  std::vector<fs::path> files;
  for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::none, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
    if (it->is_regular_file(ec)) files.push_back(it->path());
  if (ec) throw IoError("cannot be listed: " + ec.message(), root.string());
  std::sort(files.begin(), files.end());
  std::map<fs::path, std::string> from_metadata;
  for (const auto& f : files)
    if (f.filename() == "metadata.jsonl" || f.filename() == "metadata.csv")
      for (auto& [k, v] : read_metadata(f, o)) from_metadata.emplace(k, std::move(v));

  ImageFolder out;
  for (const auto& f : files) {
    if (!is_image_name(f)) continue;
    ImageRecord r;
    r.path = f;
    try {
      const std::vector<char> bytes = io::read_file(f);
      r.format = detect_image_format(bytes, f.string());
      std::tie(r.width, r.height) = probe_size(bytes, r.format, o.limits, f.string());
      if (o.verify_pixels) (void)decode_image(bytes, f.string(), o.limits);
    } catch (const Error& e) {
      out.skipped.push_back({f, e.what()});
      continue;
    }
    std::optional<std::string> folder_words;
    fs::path caption_file;
    if (o.kohya_repeat_folders) {  // the deepest "N_words" folder between the root and the file
      const fs::path rel = f.parent_path().lexically_relative(root);
      for (const auto& part : rel)
        if (const auto rf = repeat_folder(part.string())) {
          r.repeats = rf->first;
          folder_words = rf->second;
        }
    }
    if (const auto m = from_metadata.find(f.lexically_normal()); m != from_metadata.end()) {
      r.caption = m->second;
      r.caption_source = "metadata";
    } else {
      for (const auto& ext : o.sidecar_extensions) {
        fs::path side = f;
        side.replace_extension(ext);
        if (fs::is_regular_file(side, ec)) {
          const std::vector<char> b = io::read_file(side);
          r.caption.assign(b.begin(), b.end());
          r.caption_source = "sidecar";
          caption_file = side;
          break;
        }
      }
      if (r.caption_source.empty()) {
        if (folder_words && !folder_words->empty()) {
          r.caption = *folder_words;
          r.caption_source = "folder";
        } else {
          r.caption = filewords(f, o);
          r.caption_source = "filename";
        }
      }
    }
    // A caption must be text: one that is not UTF-8 (a Latin-1 sidecar, CSV cell or file name)
    // is reported here at its file, as a damaged image is, not at the batch that tokenizes it.
    if (const std::string why = io::utf8_problem(r.caption); !why.empty()) {
      const std::string from =
          r.caption_source == "metadata"   ? "the caption a metadata file gives it"
          : r.caption_source == "folder"   ? "its folder's name"
          : r.caption_source == "filename" ? "its file name"
                                           : "its caption file " + caption_file.string();
      out.skipped.push_back({f, "not UTF-8 text: " + from + " (" + why + ")"});
      continue;
    }
    out.images.push_back(std::move(r));
  }
  std::int64_t epoch = 0;
  const ImageRecord* most = nullptr;
  for (const auto& r : out.images) {
    epoch += r.repeats;
    if (most == nullptr || r.repeats > most->repeats) most = &r;
  }
  if (epoch > kMaxEpochItems)
    throw ConfigError("makes an epoch of " + std::to_string(epoch) +
                          " images with repeats, more than " + std::to_string(kMaxEpochItems) +
                          " (the folder '" + most->path.parent_path().filename().string() +
                          "' gives " + std::to_string(most->repeats) + " repeats)",
                      root.string());
  if (out.images.empty())
    throw ConfigError("holds no JPEG, PNG or WebP image that can be read (" +
                          std::to_string(out.skipped.size()) + " skipped)",
                      root.string());
  return out;
}

}  // namespace difftrain::data
