// Image files as the training scripts open them (PIL: open, exif_transpose, convert("RGB")):
// tests/reference/ref_images.py writes every kind of JPEG, PNG and WebP with Pillow and the pixels
// PIL gives; the decoder must give the same, and refuse hostile files with typed errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <difftrain/data/buckets.hpp>
#include <difftrain/data/image.hpp>
#include <difftrain/data/image_folder.hpp>
#include <difftrain/data/latent_cache.hpp>
#include <difftrain/data/loader.hpp>
#include <difftrain/data/tensor_cache.hpp>
#include <difftrain/data/transforms.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>

#include "../fuzz/image_target.hpp"
#include "golden.hpp"

namespace dt = difftrain;
namespace data = difftrain::data;
namespace tst = difftrain::test;
namespace fs = std::filesystem;

namespace {

fs::path images_dir() { return fs::path(DIFFTRAIN_GOLDEN_DIR) / "images"; }

}  // namespace

// Every file: baseline, progressive, 4:2:0 / 4:2:2 / 4:4:4 and grey JPEGs; RGB, RGBA, grey,
// grey + alpha, palette (with tRNS), 1-bit, 2-bit-valued, 16-bit colour and grey, gAMA PNGs;
// lossless, lossless with alpha and lossy WebPs; EXIF orientations 1 to 8 (JPEG), 6 (PNG eXIf),
// 8 (WebP). Equal to PIL's pixels to the bit; the lossy WebP (libwebp's versions may round
// differently) within 2 levels.
TEST(Images, DecodeAsPilOpensTransposesAndConverts) {
  const auto& g = tst::golden("images.json");
  const auto want = dt::io::load_safetensors(images_dir() / "expected.safetensors", true).tensors;
  ASSERT_GE(want.size(), 30U);
  for (const auto& [name, expected] : want) {
    SCOPED_TRACE(name);
    const data::DecodedImage got = data::read_image(images_dir() / "good" / name);
    ASSERT_EQ(got.pixels.sizes(), expected.sizes());
    ASSERT_EQ(got.pixels.scalar_type(), at::kByte);
    const auto diff = (got.pixels.to(at::kInt) - expected.to(at::kInt)).abs();
    const int worst = diff.max().item<int>();
    if (g["exact"][name].get<bool>())
      EXPECT_EQ(worst, 0) << "at " << diff.argmax().item<std::int64_t>();
    else
      EXPECT_LE(worst, 2);
    if (name.starts_with("orientation_")) {
      const int o = name[12] - '0';
      EXPECT_EQ(got.exif_orientation, o);
      EXPECT_EQ(got.stored_width, 37);
      EXPECT_EQ(got.pixels.size(1), o >= 5 ? 23 : 37);
    }
  }
}

// Damaged, truncated and foreign files, decompression bombs (a header claiming 10^10 pixels) and
// CMYK JPEGs are FormatErrors naming the file and the problem, before any pixel memory is taken.
TEST(Images, HostileFilesAreFormatErrorsSayingWhy) {
  const std::map<std::string, std::string> why = {
      {"truncated.jpg", "is damaged"},
      {"truncated_header.jpg", "missing SOS marker"},
      {"truncated.png", "past the end of the file"},
      {"truncated.webp", "damaged or truncated"},
      {"empty.png", "is empty"},
      {"gif.jpg", "is a GIF"},
      {"bmp.png", "is a BMP"},
      {"text.webp", "unknown kind of file"},
      {"bomb.png", "over the limit"},
      {"bomb.jpg", "over the limit"},
      {"bomb16.png", "bytes of image data can hold"},
      {"cmyk.jpg", "CMYK"},
      {"garbage_after_magic.jpg", "has no pixels"},
  };
  const auto& listed = tst::golden("images.json")["hostile"];
  ASSERT_EQ(listed.size(), why.size());
  for (const auto& [name, message] : why) {
    SCOPED_TRACE(name);
    const fs::path file = images_dir() / "bad" / name;
    try {
      (void)data::read_image(file);
      ADD_FAILURE() << "accepted";
    } catch (const dt::FormatError& e) {
      const std::string text = e.what();
      EXPECT_NE(text.find(message), std::string::npos) << text;
      EXPECT_NE(text.find(name), std::string::npos) << text;
    }
  }
  data::ImageLimits small;
  small.max_pixels = 1000;
  try {
    (void)data::read_image(images_dir() / "good" / "large_odd.jpg", small);
    ADD_FAILURE() << "a 157x301 image under a 1000-pixel limit was accepted";
  } catch (const dt::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("157x301"), std::string::npos) << e.what();
  }
}

// ---- image folders -----------------------------------------------------------------------------

namespace {

struct ScratchFolder {
  fs::path dir;
  explicit ScratchFolder(const std::string& name)
      : dir(fs::temp_directory_path() /
            ("difftrain-data-" + name + "-" + std::to_string(::getpid()))) {
    dt::io::remove_tree(dir);
    fs::create_directories(dir);
  }
  ~ScratchFolder() { dt::io::remove_tree(dir); }
  void image(const fs::path& rel, const std::string& source) const {
    fs::create_directories((dir / rel).parent_path());
    fs::copy_file(images_dir() / "good" / source, dir / rel);
  }
  void text(const fs::path& rel, const std::string& content) const {
    fs::create_directories((dir / rel).parent_path());
    std::ofstream(dir / rel, std::ios::binary) << content;
  }
};

const data::ImageRecord& find(const data::ImageFolder& f, const std::string& name) {
  for (const auto& r : f.images)
    if (r.path.filename() == name) return r;
  throw std::runtime_error("no record for " + name);
}

}  // namespace

// Captions by the rules of each tool: diffusers' metadata.jsonl / metadata.csv (file_name relative
// to the metadata file, the chosen caption column), a sidecar .txt or .caption read whole, the web
// UI's [filewords] (leading digits and dashes dropped; a word regex joined), kohya's "N_words"
// folders (N repeats, the words as the caption when nothing else gives one). Sizes come from the
// headers, after the EXIF orientation; files that are not images are skipped and reported.
// The names the scan reads (and programs that list images themselves use): the four formats, in
// any case; a caption, a metadata file, an unsupported image format or a name without a dot is not.
TEST(ImageFolder, ImageNamesAreTheFourFormatsInAnyCase) {
  for (const char* yes : {"a.jpg", "b.JPG", "c.jpeg", "d.JpEg", "e.png", "f.PNG", "g.webp",
                          "dir.png/h.WebP", "x.tar.png"})
    EXPECT_TRUE(data::is_image_name(yes)) << yes;
  for (const char* no : {"a.txt", "a.caption", "metadata.jsonl", "a.gif", "a.bmp", "a.tiff", "png",
                         "a.png.txt", ".png/a", "a.jpg~"})
    EXPECT_FALSE(data::is_image_name(no)) << no;
}

TEST(ImageFolder, CaptionsRepeatsAndSizesFollowEachToolsRules) {
  ScratchFolder f("captions");
  f.image("meta/a.jpg", "baseline_420.jpg");
  f.image("meta/sub/b.png", "rgb.png");
  f.text("meta/metadata.jsonl",
         "{\"file_name\": \"a.jpg\", \"text\": \"a photo of a sneaker\", \"other\": 1}\n\n"
         "{\"file_name\": \"sub/b.png\", \"text\": \"a boot, \\\"quoted\\\"\"}\n");
  f.image("csv/c.webp", "lossless.webp");
  f.text("csv/metadata.csv", "file_name,text\nc.webp,\"a shirt, white\nwith a second line\"\n");
  f.image("side/d.jpg", "orientation_6.jpg");
  f.text("side/d.txt", "  a bag, leather\n");
  f.image("side/e.png", "grey.png");
  f.text("side/e.caption", "a coat");
  f.image("names/00012-3 a red dress.png", "palette.png");
  f.image("names/-7-sandal_blue.jpg", "grey.jpg");
  f.image("10_sks dog/f.jpg", "q75_444.jpg");
  f.image("10_sks dog/g.jpg", "q95_422.jpg");
  f.text("10_sks dog/g.txt", "sks dog on a beach");
  f.text("names/notes.txt", "not an image");
  f.text("names/broken.jpg", "not a jpeg at all");
  f.image("names/cmyk.jpg", "../bad/cmyk.jpg");
  f.image("names/cut.jpg", "../bad/truncated.jpg");  // damaged after its header

  const data::ImageFolder folder = data::scan_image_folder(f.dir);
  EXPECT_EQ(folder.images.size(), 9U);
  EXPECT_EQ(find(folder, "a.jpg").caption, "a photo of a sneaker");
  EXPECT_EQ(find(folder, "a.jpg").caption_source, "metadata");
  EXPECT_EQ(find(folder, "b.png").caption, "a boot, \"quoted\"");
  EXPECT_EQ(find(folder, "c.webp").caption, "a shirt, white\nwith a second line");
  EXPECT_EQ(find(folder, "d.jpg").caption, "  a bag, leather\n");  // read whole, as the web UI
  EXPECT_EQ(find(folder, "d.jpg").caption_source, "sidecar");
  EXPECT_EQ(find(folder, "e.png").caption, "a coat");
  EXPECT_EQ(find(folder, "00012-3 a red dress.png").caption, "a red dress");
  EXPECT_EQ(find(folder, "00012-3 a red dress.png").caption_source, "filename");
  EXPECT_EQ(find(folder, "-7-sandal_blue.jpg").caption, "sandal_blue");
  EXPECT_EQ(find(folder, "f.jpg").caption, "sks dog");
  EXPECT_EQ(find(folder, "f.jpg").caption_source, "folder");
  EXPECT_EQ(find(folder, "f.jpg").repeats, 10);
  EXPECT_EQ(find(folder, "g.jpg").caption, "sks dog on a beach");
  EXPECT_EQ(find(folder, "g.jpg").repeats, 10);
  EXPECT_EQ(find(folder, "a.jpg").repeats, 1);
  EXPECT_EQ(folder.epoch_size(), 7 + 20);
  // Sizes after the orientation: orientation 6 turns the 37x23 picture to 23x37.
  EXPECT_EQ(find(folder, "d.jpg").width, 23);
  EXPECT_EQ(find(folder, "d.jpg").height, 37);
  EXPECT_EQ(find(folder, "a.jpg").width, 37);
  ASSERT_EQ(folder.skipped.size(), 3U);
  for (const auto& s : folder.skipped) {
    EXPECT_TRUE(s.path.filename() == "broken.jpg" || s.path.filename() == "cmyk.jpg" ||
                s.path.filename() == "cut.jpg")
        << s.path;
    EXPECT_NE(s.reason.find(s.path.filename().string()), std::string::npos) << s.reason;
  }

  data::ImageFolderOptions headers_only;
  headers_only.verify_pixels = false;  // the damage after the header is found later, by decoding
  EXPECT_EQ(data::scan_image_folder(f.dir, headers_only).skipped.size(), 2U);

  data::ImageFolderOptions words;
  words.filename_word_regex = "[a-z]+";
  words.filename_join = ", ";
  EXPECT_EQ(data::filewords("00012-3 a red dress.png", words), "a, red, dress");
  EXPECT_EQ(data::filewords("-7-sandal_blue.jpg", words), "sandal, blue");
  EXPECT_EQ(data::filewords("2024 12 photo.png"), "12 photo");
}

TEST(ImageFolder, MistakesAreTypedErrorsNamingThem) {
  {
    ScratchFolder f("empty");
    f.text("readme.txt", "no images here");
    try {
      (void)data::scan_image_folder(f.dir);
      ADD_FAILURE() << "an empty folder was accepted";
    } catch (const dt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("no JPEG, PNG or WebP"), std::string::npos) << e.what();
    }
  }
  {
    ScratchFolder f("column");
    f.image("a.jpg", "baseline_420.jpg");
    f.text("metadata.jsonl", "{\"file_name\": \"a.jpg\", \"caption\": \"x\"}\n");
    try {
      (void)data::scan_image_folder(f.dir);
      ADD_FAILURE() << "a missing caption column was accepted";
    } catch (const dt::ConfigError& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find("'text'"), std::string::npos) << w;
      EXPECT_NE(w.find("caption"), std::string::npos) << w;
      EXPECT_NE(w.find("line 1"), std::string::npos) << w;
    }
    data::ImageFolderOptions o;
    o.caption_column = "caption";
    EXPECT_EQ(data::scan_image_folder(f.dir, o).images.at(0).caption, "x");
  }
  // A caption that is not text (null, a number, a list, an object, one nested 100,000 deep) is a
  // FormatError naming the line, never trained on under its JSON spelling.
  for (const std::string& value :
       {std::string("null"), std::string("3"), std::string("[\"a\"]"), std::string("{\"t\": 1}"),
        std::string(100000, '[') + std::string(100000, ']')}) {
    ScratchFolder f("caption-type");
    f.image("a.jpg", "baseline_420.jpg");
    f.text("metadata.jsonl", "{\"file_name\": \"a.jpg\", \"text\": " + value + "}\n");
    try {
      (void)data::scan_image_folder(f.dir);
      ADD_FAILURE() << "the caption " << value.substr(0, 20) << " was accepted";
    } catch (const dt::FormatError& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find("metadata.jsonl line 1"), std::string::npos) << w.substr(0, 300);
      EXPECT_LT(w.size(), 400U) << "a message quotes the value whole";
    }
  }
  {
    ScratchFolder f("csv");
    f.image("a.jpg", "baseline_420.jpg");
    f.text("metadata.csv", "file_name,text\na.jpg,\"unclosed\n");
    try {
      (void)data::scan_image_folder(f.dir);
      ADD_FAILURE() << "an unclosed quote was accepted";
    } catch (const dt::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("metadata.csv"), std::string::npos) << e.what();
    }
  }
  {
    ScratchFolder f("big");
    f.image("a.jpg", "large_odd.jpg");
    f.image("b.jpg", "baseline_420.jpg");
    data::ImageFolderOptions o;
    o.limits.max_pixels = 1000;
    const auto folder = data::scan_image_folder(f.dir, o);
    ASSERT_EQ(folder.images.size(), 1U);
    ASSERT_EQ(folder.skipped.size(), 1U);
    EXPECT_NE(folder.skipped[0].reason.find("over the limit"), std::string::npos);
  }
  EXPECT_THROW((void)data::scan_image_folder("/no/such/folder"), dt::IoError);
}

// Python's strict decoder judges UTF-8 (bytes.decode, UnicodeDecodeError.start): every string of
// one to four bytes from the bytes where the rules change.
TEST(ImageFolder, Utf8IsWhatPythonsDecoderAccepts) {
  const auto& g = tst::golden("utf8.json");
  const auto bytes = g.at("bytes").get<std::vector<int>>();
  const auto& want = g.at("first_invalid");
  std::size_t k = 0, differ = 0;
  const std::size_t b = bytes.size();
  for (std::size_t n = 1; n <= 4; ++n) {
    std::size_t count = 1;
    for (std::size_t i = 0; i < n; ++i) count *= b;
    for (std::size_t c = 0; c < count; ++c, ++k) {
      std::string s(n, '\0');
      std::size_t rest = c;
      for (std::size_t i = n; i-- > 0;) {
        s[i] = static_cast<char>(bytes[rest % b]);
        rest /= b;
      }
      const auto got = dt::io::first_invalid_utf8(s);
      const std::int64_t w = want.at(k).get<std::int64_t>();
      if ((w < 0) != !got.has_value() || (got && static_cast<std::int64_t>(*got) != w)) ++differ;
    }
  }
  EXPECT_EQ(k, want.size());
  EXPECT_EQ(differ, 0U) << "of " << k << " strings";
}

// A caption that is not UTF-8 text is found by the scan and the image skipped, naming where the
// caption came from (a sidecar, a CSV cell, a file name, a kohya folder); UTF-8 captions in other
// scripts are kept. An epoch of images × repeats past kMaxEpochItems, and a metadata line past
// kMaxMetadataLine, are refused before anything is built from them.
TEST(ImageFolder, CaptionsMustBeUtf8AndEpochsAndLinesHaveBounds) {
  {
    ScratchFolder f("utf8");
    f.image("side/a.jpg", "baseline_420.jpg");
    f.text("side/a.txt", "caf\xe9 au lait");  // Latin-1
    f.image("side/b.jpg", "baseline_420.jpg");
    f.text("side/b.txt", "caf\xc3\xa9, \xe7\x8c\xab, \xf0\x9f\x90\x88");  // UTF-8
    f.image("csv/c.jpg", "baseline_420.jpg");
    f.image("csv/d.jpg", "baseline_420.jpg");
    f.text("csv/metadata.csv", "file_name,text\nc.jpg,na\xefve\nd.jpg,fine\n");
    f.image("names/\xe9t\xe9.jpg", "baseline_420.jpg");
    f.image("3_\xe9t\xe9/e.jpg", "baseline_420.jpg");
    const auto folder = data::scan_image_folder(f.dir);
    std::set<std::string> kept;
    for (const auto& r : folder.images) kept.insert(r.path.filename().string());
    EXPECT_EQ(kept, (std::set<std::string>{"b.jpg", "d.jpg"}));
    std::map<std::string, std::string> why;
    for (const auto& s : folder.skipped) why[s.path.filename().string()] = s.reason;
    ASSERT_EQ(why.size(), 4U);
    EXPECT_NE(why["a.jpg"].find("a.txt (byte 3 is 0xE9)"), std::string::npos) << why["a.jpg"];
    EXPECT_NE(why["c.jpg"].find("metadata"), std::string::npos) << why["c.jpg"];
    EXPECT_NE(why["\xe9t\xe9.jpg"].find("file name (byte 0 is 0xE9)"), std::string::npos);
    EXPECT_NE(why["e.jpg"].find("folder's name"), std::string::npos) << why["e.jpg"];
    for (const auto& [name, reason] : why)
      EXPECT_NE(reason.find("not UTF-8"), std::string::npos) << reason;
  }
  {
    ScratchFolder f("repeats");
    f.image("999999999_cat/a.jpg", "baseline_420.jpg");
    f.image("2_dog/b.jpg", "baseline_420.jpg");
    try {
      (void)data::scan_image_folder(f.dir);
      ADD_FAILURE() << "an epoch of 10^9 was accepted";
    } catch (const dt::ConfigError& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find("1000000001"), std::string::npos) << w;
      EXPECT_NE(w.find("'999999999_cat' gives 999999999 repeats"), std::string::npos) << w;
    }
    f.image("67108864_big/c.jpg", "baseline_420.jpg");
    dt::io::remove_tree(f.dir / "999999999_cat");
    EXPECT_THROW((void)data::scan_image_folder(f.dir), dt::ConfigError);
    dt::io::remove_tree(f.dir / "67108864_big");
    f.image("67108862_big/c.jpg", "baseline_420.jpg");
    EXPECT_EQ(data::scan_image_folder(f.dir).epoch_size(), std::int64_t{1} << 26);
  }
  {
    ScratchFolder f("long-line");
    f.image("a.jpg", "baseline_420.jpg");
    f.text("metadata.jsonl", "{\"file_name\": \"a.jpg\", \"text\": \"" +
                                 std::string(data::kMaxMetadataLine, 'x') + "\"}\n");
    try {
      (void)data::scan_image_folder(f.dir);
      ADD_FAILURE() << "a line of more than 1 MiB was accepted";
    } catch (const dt::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("metadata.jsonl line 1"), std::string::npos) << e.what();
    }
    f.text("metadata.jsonl", "{\"file_name\": \"a.jpg\", \"text\": \"" +
                                 std::string(data::kMaxMetadataLine - 40, 'x') + "\"}\n");
    EXPECT_EQ(data::scan_image_folder(f.dir).images.at(0).caption.size(),
              data::kMaxMetadataLine - 40);
  }
}

// ---- transforms --------------------------------------------------------------------------------

// torchvision.transforms.v2.functional on the same uint8 tensors: resize (nearest, bilinear and
// bicubic, with and without antialiasing, down and up, (h, w), max_size), center crops (odd
// anchors rounded half to even, zero padding), RandomCrop's corners from the same seed, the flip
// and ToTensor + Normalize: equal to the bit.
TEST(Transforms, EqualTorchvisionToTheBit) {
  const auto& g = tst::golden("transforms.json");
  const auto t = dt::io::load_safetensors(images_dir() / "transforms.safetensors", true).tensors;
  for (const auto& c : g["resize"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const std::string mode = c["mode"];
    const auto interp = mode == "nearest"    ? data::Interpolation::nearest
                        : mode == "bilinear" ? data::Interpolation::bilinear
                                             : data::Interpolation::bicubic;
    std::optional<std::int64_t> max_size;
    if (!c["max_size"].is_null()) max_size = c["max_size"].get<std::int64_t>();
    const at::Tensor got = data::resize(t.at("pic." + c["pic"].get<std::string>()),
                                        c["size"].get<std::vector<std::int64_t>>(), interp,
                                        c["antialias"].get<bool>(), max_size);
    const at::Tensor& want = t.at("resize." + name);
    ASSERT_EQ(got.sizes(), want.sizes());
    // The same from the decoded rows' layout (channels last), which the loader passes.
    const at::Tensor rows =
        t.at("pic." + c["pic"].get<std::string>()).permute({1, 2, 0}).contiguous();
    EXPECT_TRUE(data::resize(rows.permute({2, 0, 1}), c["size"].get<std::vector<std::int64_t>>(),
                             interp, c["antialias"].get<bool>(), max_size)
                    .equal(want));
    EXPECT_TRUE(got.equal(want)) << "max difference "
                                 << (got.to(at::kInt) - want.to(at::kInt)).abs().max().item<int>();
  }
  for (const auto& c : g["center_crop"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const at::Tensor got =
        data::center_crop(t.at("pic." + c["pic"].get<std::string>()), c["h"].get<std::int64_t>(),
                          c["w"].get<std::int64_t>());
    EXPECT_TRUE(got.equal(t.at("center." + name)));
  }
  for (const auto& c : g["random_crop"]) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(c["seed"].get<std::uint64_t>());
    data::CropCorner corner;
    const at::Tensor crop = data::random_crop(t.at("pic.noise"), c["h"].get<std::int64_t>(),
                                              c["w"].get<std::int64_t>(), gen, &corner);
    EXPECT_EQ(corner.top, c["top"].get<std::int64_t>()) << c;
    EXPECT_EQ(corner.left, c["left"].get<std::int64_t>()) << c;
    EXPECT_EQ(crop.size(-2), c["h"].get<std::int64_t>());
  }
  EXPECT_TRUE(data::horizontal_flip(t.at("pic.small")).equal(t.at("flip.small")));
  EXPECT_TRUE(data::to_unit_range(t.at("pic.small")).equal(t.at("unit.small")));
}

// Against PIL's resize (what diffusers' scripts run on PIL images): the share of values within
// one level, bilinear and bicubic, to 64 and 128 pixels on the shorter side of a 157x301 JPEG.
// Antialiased resampling in both, with different filters' support and rounding: the goal is
// at least 99 % within 1/255.
TEST(Transforms, ResizeIsWithinOneLevelOfPilAlmostEverywhere) {
  const auto t = dt::io::load_safetensors(images_dir() / "transforms.safetensors", true).tensors;
  for (const char* mode : {"bilinear", "bicubic"})
    for (const int size : {64, 128}) {
      const std::string key = std::string("pil.") + mode + "." + std::to_string(size);
      SCOPED_TRACE(key);
      const at::Tensor pil = t.at(key);
      const at::Tensor got =
          data::resize(t.at("pic.large"), {size},
                       std::string(mode) == "bilinear" ? data::Interpolation::bilinear
                                                       : data::Interpolation::bicubic);
      ASSERT_EQ(got.sizes(), pil.sizes());
      const at::Tensor diff = (got.to(at::kInt) - pil.to(at::kInt)).abs();
      const double within = (diff <= 1).to(at::kDouble).mean().item<double>();
      RecordProperty(key, std::to_string(within));
      std::cout << key << ": " << within * 100 << " % within one level, largest difference "
                << diff.max().item<int>() << "\n";
      EXPECT_GE(within, 0.99);
    }
}

TEST(Transforms, BadArgumentsAreTypedErrors) {
  const at::Tensor img = at::zeros({3, 10, 20}, at::kByte);
  EXPECT_THROW((void)data::resize(img, {}), dt::ConfigError);
  EXPECT_THROW((void)data::resize(img, {0}), dt::ConfigError);
  EXPECT_THROW((void)data::resize(img, {8}, data::Interpolation::bilinear, true, 8),
               dt::ConfigError);
  EXPECT_THROW((void)data::resize(at::zeros({10, 20}, at::kByte), {8}), dt::ShapeError);
  EXPECT_THROW((void)data::center_crop(img, 0, 4), dt::ConfigError);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  EXPECT_THROW((void)data::random_crop(img, 11, 4, gen), dt::ShapeError);
  EXPECT_THROW((void)data::to_unit_range(img.to(at::kFloat)), dt::ShapeError);
  EXPECT_EQ(data::resized_size(10, 20, {5}), (std::array<std::int64_t, 2>{5, 10}));
  EXPECT_EQ(data::resized_size(20, 10, {5}, 8), (std::array<std::int64_t, 2>{8, 4}));
}

// ---- aspect-ratio buckets ----------------------------------------------------------------------

// kohya's bucket tables and choices (tests/reference/ref_buckets.py transcribes sd-scripts'
// make_bucket_resolutions and select_bucket): SD 1.x, SD 2.x, SDXL and 32-pixel-step settings
// with and without no_upscale, on 424 image sizes each (random from 200 to 5000 pixels a side,
// extremes, exact bucket sizes): the same table, bucket, resized size and aspect error.
TEST(Buckets, TablesAndChoicesEqualKohyas) {
  const auto& g = tst::golden("buckets.json");
  for (const auto& c : g["configs"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    data::BucketOptions o;
    o.max_width = c["max_width"];
    o.max_height = c["max_height"];
    o.min_size = c["min_size"];
    o.max_size = c["max_size"];
    o.steps = c["steps"];
    o.no_upscale = c["no_upscale"];
    const data::BucketManager m(o);
    std::vector<data::Bucket> want_table;
    for (const auto& r : c["table"]) want_table.emplace_back(r[0], r[1]);
    EXPECT_EQ(m.table(), want_table);
    const auto& sizes = c["sizes"];
    ASSERT_GE(sizes.size(), 400U);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const data::BucketChoice got = m.select(sizes[i][0], sizes[i][1]);
      const auto& want = c["choices"][i];
      ASSERT_EQ(got.bucket, (data::Bucket{want[0][0], want[0][1]})) << sizes[i];
      EXPECT_EQ(got.resized_width, want[1][0].get<std::int64_t>()) << sizes[i];
      EXPECT_EQ(got.resized_height, want[1][1].get<std::int64_t>()) << sizes[i];
      EXPECT_NEAR(got.aspect_error, want[2].get<double>(), 1e-12) << sizes[i];
      EXPECT_GE(got.resized_width, got.bucket.first) << sizes[i];  // the crop fits
      EXPECT_GE(got.resized_height, got.bucket.second) << sizes[i];
    }
  }
}

// Every batch holds one bucket's images; every image appears its repeats times per epoch; the
// order is fixed by seed and epoch and changes with either.
TEST(Buckets, BatchesHoldOneBucketEachAndFollowTheSeed) {
  std::vector<data::Bucket> buckets;
  std::vector<std::int64_t> repeats;
  for (std::size_t i = 0; i < 53; ++i) {
    buckets.push_back(i % 3 == 0   ? data::Bucket{512, 512}
                      : i % 3 == 1 ? data::Bucket{576, 448}
                                   : data::Bucket{448, 576});
    repeats.push_back(i % 5 == 0 ? 2 : 1);
  }
  const auto a = data::bucket_batches(buckets, repeats, 4, 7, 0);
  std::vector<std::size_t> seen(buckets.size(), 0);
  for (const auto& batch : a) {
    ASSERT_FALSE(batch.empty());
    EXPECT_LE(batch.size(), 4U);
    for (const auto i : batch) {
      EXPECT_EQ(buckets[i], buckets[batch.front()]);
      ++seen[i];
    }
  }
  for (std::size_t i = 0; i < buckets.size(); ++i)
    EXPECT_EQ(seen[i], static_cast<std::size_t>(repeats[i])) << i;
  EXPECT_EQ(a, data::bucket_batches(buckets, repeats, 4, 7, 0));
  EXPECT_NE(a, data::bucket_batches(buckets, repeats, 4, 7, 1));
  EXPECT_NE(a, data::bucket_batches(buckets, repeats, 4, 8, 0));
  const std::string table = data::describe_buckets(buckets, repeats);
  EXPECT_NE(table.find("number of buckets: 3"), std::string::npos) << table;
  EXPECT_NE(table.find("resolution (512, 512), count: 22"), std::string::npos) << table;
  EXPECT_THROW((void)data::bucket_batches(buckets, repeats, 0, 1, 0), dt::ConfigError);
  EXPECT_THROW((void)data::bucket_batches(buckets, {1, 2}, 4, 1, 0), dt::ShapeError);
  data::BucketOptions bad;
  bad.max_size = 256;
  EXPECT_THROW(data::BucketManager{bad}, dt::ConfigError);
  bad = {};
  bad.min_size = 250;
  EXPECT_THROW(data::BucketManager{bad}, dt::ConfigError);
  EXPECT_THROW((void)data::BucketManager({}).select(0, 10), dt::ShapeError);
}

// ---- the loader --------------------------------------------------------------------------------

// Items come in index order whatever the number of workers (and as made on the consumer's thread
// with none); no more than `prefetch` are made ahead; a worker's error reaches the consumer at its
// item, with its type.
TEST(Loader, OrderIsTheIndexOrderAndMemoryIsBounded) {
  auto make = [](std::size_t i) {
    std::this_thread::sleep_for(std::chrono::microseconds((i * 7919) % 300));
    return std::vector<std::size_t>{i, i * i};
  };
  std::vector<std::vector<std::size_t>> first;
  for (const std::size_t workers : {0, 1, 2, 4}) {
    SCOPED_TRACE(workers);
    data::ParallelLoader<std::vector<std::size_t>> loader(60, make, workers, 3);
    std::vector<std::vector<std::size_t>> got;
    while (auto item = loader.next()) got.push_back(*item);
    ASSERT_EQ(got.size(), 60U);
    if (first.empty()) first = got;
    EXPECT_EQ(got, first);
    EXPECT_LE(loader.peak_ahead(), 3U);
  }
  data::ParallelLoader<int> failing(
      10,
      [](std::size_t i) -> int {
        if (i == 5) throw dt::FormatError("is damaged", "image 5");
        return static_cast<int>(i);
      },
      3, 4);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(*failing.next(), i);
  EXPECT_THROW((void)failing.next(), dt::FormatError);
}

// Bucketed batches of a folder of assorted sizes and orientations: each batch is one bucket's
// shape, values in [-1, 1], original sizes and crop corners recorded; the same pixels, captions
// and corners with 1 and 3 workers, and another order in another epoch.
TEST(Loader, ImageBatchesAreTheSameWithAnyNumberOfWorkers) {
  ScratchFolder f("loader");
  const std::vector<std::string> sources = {
      "baseline_420.jpg", "orientation_6.jpg", "rgb.png",     "large_odd.jpg", "lossless.webp",
      "grey.png",         "orientation_3.jpg", "palette.png", "q75_444.jpg"};
  for (std::size_t i = 0; i < sources.size(); ++i) {
    f.image("img" + std::to_string(i) + "_" + sources[i], sources[i]);
    f.text("img" + std::to_string(i) + "_" + fs::path(sources[i]).stem().string() + ".txt",
           "caption " + std::to_string(i));
  }
  const data::ImageFolder folder = data::scan_image_folder(f.dir);
  data::BucketOptions bo;
  bo.max_width = bo.max_height = 64;
  bo.min_size = 32;
  bo.max_size = 128;
  bo.steps = 16;
  const data::BucketManager buckets(bo);
  auto epoch = [&](std::size_t workers, std::uint64_t e) {
    data::ImageBatchOptions o;
    o.batch_size = 2;
    o.random_crop = true;
    o.flip_p = 0.5;
    o.seed = 11;
    o.workers = workers;
    data::ImageBatches batches(folder, buckets, o, e);
    std::vector<data::ImageBatch> out;
    while (auto b = batches.next()) out.push_back(std::move(*b));
    return out;
  };
  const auto one = epoch(1, 0), three = epoch(3, 0), other = epoch(3, 1);
  ASSERT_EQ(one.size(), three.size());
  std::size_t images = 0;
  for (std::size_t b = 0; b < one.size(); ++b) {
    EXPECT_TRUE(one[b].pixels.equal(three[b].pixels)) << b;
    EXPECT_EQ(one[b].indices, three[b].indices);
    EXPECT_EQ(one[b].crop_top_left, three[b].crop_top_left);
    EXPECT_EQ(one[b].captions, three[b].captions);
    const auto& first = folder.images[one[b].indices[0]];
    const auto choice = buckets.select(first.width, first.height);
    EXPECT_EQ(one[b].pixels.size(2), choice.bucket.second);
    EXPECT_EQ(one[b].pixels.size(3), choice.bucket.first);
    EXPECT_LE(one[b].pixels.abs().max().item<float>(), 1.0f);
    for (std::size_t k = 0; k < one[b].indices.size(); ++k) {
      const auto& r = folder.images[one[b].indices[k]];
      EXPECT_EQ(one[b].original_sizes[k], (std::array<std::int64_t, 2>{r.height, r.width}));
      EXPECT_EQ(one[b].captions[k], "caption " + r.path.filename().string().substr(3, 1));
    }
    images += one[b].indices.size();
  }
  EXPECT_EQ(images, sources.size());
  std::vector<std::vector<std::size_t>> order_one, order_other;
  for (const auto& b : one) order_one.push_back(b.indices);
  for (const auto& b : other) order_other.push_back(b.indices);
  EXPECT_NE(order_one, order_other);
}

// With pin_memory the batches are page-locked (on a machine with CUDA; skipped without) and a
// non-blocking copy to the GPU gives the same values.
TEST(Loader, PinnedBatchesCopyToTheGpuWithoutBlocking) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  ScratchFolder f("pinned");
  for (int i = 0; i < 4; ++i)
    f.image("img" + std::to_string(i) + ".jpg", i % 2 == 0 ? "baseline_420.jpg" : "q75_444.jpg");
  const data::ImageFolder folder = data::scan_image_folder(f.dir);
  data::BucketOptions bo;
  bo.max_width = bo.max_height = 32;
  bo.min_size = 16;
  bo.max_size = 64;
  bo.steps = 16;
  const data::BucketManager buckets(bo);
  data::ImageBatchOptions o;
  o.batch_size = 2;
  o.pin_memory = true;
  data::ImageBatches batches(folder, buckets, o, 0);
  while (auto b = batches.next()) {
    EXPECT_TRUE(b->pixels.is_pinned());
    const at::Tensor gpu = b->pixels.to(at::Device(at::kCUDA), /*non_blocking=*/true);
    EXPECT_TRUE(gpu.cpu().equal(b->pixels));
  }
}

// A batch position is a place to resume: the epoch made from batch `start` on is the tail of the
// whole epoch, and position() counts from it.
TEST(Loader, ImageBatchesResumeInTheMiddleOfAnEpoch) {
  ScratchFolder f("resume");
  const std::vector<std::string> sources = {"baseline_420.jpg", "rgb.png",     "lossless.webp",
                                            "grey.png",         "q75_444.jpg", "orientation_6.jpg"};
  for (std::size_t i = 0; i < sources.size(); ++i)
    f.image("img" + std::to_string(i) + "_" + sources[i], sources[i]);
  const data::ImageFolder folder = data::scan_image_folder(f.dir);
  data::BucketOptions bo;
  bo.max_width = bo.max_height = 32;
  bo.min_size = 16;
  bo.max_size = 64;
  bo.steps = 16;
  const data::BucketManager buckets(bo);
  data::ImageBatchOptions o;
  o.batch_size = 2;
  o.random_crop = true;
  o.flip_p = 0.5;
  o.seed = 3;
  data::ImageBatches whole(folder, buckets, o, 4);
  std::vector<data::ImageBatch> all;
  while (auto b = whole.next()) all.push_back(std::move(*b));
  ASSERT_GE(all.size(), 3U);
  EXPECT_EQ(whole.position(), all.size());
  data::ImageBatches tail(folder, buckets, o, 4, 2);
  EXPECT_EQ(tail.position(), 2U);
  for (std::size_t b = 2; b < all.size(); ++b) {
    const auto got = tail.next();
    ASSERT_TRUE(got);
    EXPECT_EQ(got->indices, all[b].indices);
    EXPECT_TRUE(got->pixels.equal(all[b].pixels)) << b;
  }
  EXPECT_FALSE(tail.next());
  EXPECT_THROW(data::ImageBatches(folder, buckets, o, 4, all.size() + 1), dt::ConfigError);
}

// ---- caches on disk ----------------------------------------------------------------------------

namespace {

/// A stand-in VAE encoder that works per sample (so batching cannot change a value): the mean is
/// a 4× average pool of the channels' weighted sums, the std a function of it.
std::pair<at::Tensor, at::Tensor> pool_encoder(const at::Tensor& pixels) {
  const at::Tensor w = at::arange(1, 13, at::kFloat).reshape({4, 3, 1, 1}) / 10;
  const at::Tensor mean = at::avg_pool2d(at::conv2d(pixels, w), 4);
  return {mean, 0.05 + 0.1 * at::sigmoid(mean)};
}

struct CacheScene {
  ScratchFolder images{"cache-images"};
  ScratchFolder cache{"cache-store"};
  data::BucketManager buckets{[] {
    data::BucketOptions bo;
    bo.max_width = bo.max_height = 32;
    bo.min_size = 16;
    bo.max_size = 64;
    bo.steps = 16;
    return bo;
  }()};
  data::ImageFolder folder;
  CacheScene() {
    const std::vector<std::string> sources = {
        "baseline_420.jpg", "rgb.png",           "lossless.webp", "grey.png",
        "q75_444.jpg",      "orientation_6.jpg", "large_odd.jpg"};
    for (std::size_t i = 0; i < sources.size(); ++i) {
      images.image("img" + std::to_string(i) + "_" + sources[i], sources[i]);
      images.text("img" + std::to_string(i) + "_" + fs::path(sources[i]).stem().string() + ".txt",
                  "caption " + std::to_string(i));
    }
    folder = data::scan_image_folder(images.dir);
  }
  data::LatentCacheOptions options(std::size_t per_shard = 3) const {
    data::LatentCacheOptions o;
    o.flipped = true;
    o.batch_size = 2;
    o.shards.entries_per_shard = per_shard;
    return o;
  }
  std::vector<fs::path> shards() const {
    std::vector<fs::path> out;
    for (const auto& e : fs::recursive_directory_iterator(cache.dir))
      if (e.path().extension() == ".safetensors") out.push_back(e.path());
    std::sort(out.begin(), out.end());
    return out;
  }
};

}  // namespace

// Built once from the encoder, read back without it: the batches of cached latents have the
// pixel loader's images, order, flips, crop corners and original sizes (center crop, same seed),
// and each latent is the encoder's posterior of that very sample drawn with the sample's
// generator. A second build encodes nothing.
TEST(LatentCache, CachedBatchesAreThePixelLoadersBatchesEncoded) {
  CacheScene s;
  std::size_t calls = 0, last_done = 0, last_total = 0;
  auto encode = [&](const at::Tensor& px) {
    ++calls;
    return pool_encoder(px);
  };
  auto o = s.options();
  o.progress = [&](std::size_t done, std::size_t total) {
    EXPECT_GT(done, last_done);
    last_done = done;
    last_total = total;
  };
  {
    data::LatentCache cache(s.cache.dir, "vae-a-0123456789abcdef", s.folder, s.buckets, o);
    EXPECT_EQ(cache.missing().size(), 14U);
    const auto report = cache.build(encode);
    EXPECT_EQ(report.entries, 14U);
    EXPECT_EQ(report.encoded, 14U);
    EXPECT_EQ(report.reused, 0U);
    EXPECT_EQ(last_done, 14U);
    EXPECT_EQ(last_total, 14U);
    EXPECT_EQ(cache.store().shards_written(), 5U);  // 14 entries, 3 per shard
  }
  const std::size_t first_calls = calls;
  data::LatentCache cache(s.cache.dir, "vae-a-0123456789abcdef", s.folder, s.buckets, o);
  EXPECT_TRUE(cache.missing().empty());
  const auto again = cache.build(encode);
  EXPECT_EQ(again.reused, 14U);
  EXPECT_EQ(again.encoded, 0U);
  EXPECT_EQ(calls, first_calls);
  EXPECT_TRUE(cache.store().damaged().empty());

  data::ImageBatchOptions io;
  io.batch_size = 2;
  io.flip_p = 0.5;
  io.seed = 21;
  io.workers = 2;
  for (const std::uint64_t epoch : {0U, 1U}) {
    data::ImageBatches pixels(s.folder, s.buckets, io, epoch);
    data::CachedLatentBatches latents(cache, s.folder, 2, 0.5, 21, epoch);
    ASSERT_EQ(latents.size(), pixels.size());
    std::size_t flips = 0;
    for (std::size_t b = 0; b < pixels.size(); ++b) {
      const auto p = pixels.next();
      const auto l = latents.next();
      ASSERT_TRUE(p && l);
      EXPECT_EQ(l->indices, p->indices);
      EXPECT_EQ(l->captions, p->captions);
      EXPECT_EQ(l->original_sizes, p->original_sizes);
      EXPECT_EQ(l->crop_top_left, p->crop_top_left);
      const auto [mean, std] = pool_encoder(p->pixels);
      for (std::size_t k = 0; k < p->indices.size(); ++k) {
        at::Generator gen = data::sample_generator(21, epoch, b, k);
        EXPECT_EQ(data::draw_flip(0.5, gen), static_cast<bool>(l->flipped[k]));
        flips += l->flipped[k] ? 1 : 0;
        const auto i = static_cast<std::int64_t>(k);
        const at::Tensor want = mean[i] + std[i] * at::randn(mean[i].sizes(), gen);
        EXPECT_TRUE(at::allclose(l->latents[i], want, 1e-5, 1e-6)) << b << " " << k;
      }
    }
    EXPECT_FALSE(latents.next());
    EXPECT_GT(flips, 0U);
  }
  // seek: the rest of an epoch from a batch position.
  data::CachedLatentBatches whole(cache, s.folder, 2, 0.5, 21, 3),
      tail(cache, s.folder, 2, 0.5, 21, 3);
  tail.seek(2);
  (void)whole.next(), (void)whole.next();
  while (auto b = whole.next()) EXPECT_TRUE(tail.next()->latents.equal(b->latents));
  EXPECT_THROW(tail.seek(99), dt::ConfigError);
}

// A changed image invalidates its own entries only; another VAE (another fingerprint) and the
// other storage open other folders; `sample` storage keeps one fixed draw.
TEST(LatentCache, ChangedImageOrVaeInvalidatesOnlyTheirEntries) {
  CacheScene s;
  auto o = s.options(100);
  {
    data::LatentCache cache(s.cache.dir, "vae-a-0123456789abcdef", s.folder, s.buckets, o);
    (void)cache.build(pool_encoder);
  }
  const fs::path changed = s.folder.images[2].path;
  fs::copy_file(images_dir() / "good" / "q95_422.jpg", changed,
                fs::copy_options::overwrite_existing);
  const data::ImageFolder rescanned = data::scan_image_folder(s.images.dir);
  {
    data::LatentCache cache(s.cache.dir, "vae-a-0123456789abcdef", rescanned, s.buckets, o);
    const auto missing = cache.missing();
    ASSERT_EQ(missing.size(), 2U);
    EXPECT_EQ(rescanned.images[missing[0].first].path, changed);
    EXPECT_EQ(cache.build(pool_encoder).encoded, 2U);
  }
  data::LatentCache other_vae(s.cache.dir, "vae-b-0123456789abcdef", rescanned, s.buckets, o);
  EXPECT_EQ(other_vae.missing().size(), 14U);
  EXPECT_NE(other_vae.store().folder(),
            data::LatentCache(s.cache.dir, "vae-a-0123456789abcdef", rescanned, s.buckets, o)
                .store()
                .folder());
  auto so = o;
  so.storage = data::LatentStorage::sample;
  data::LatentCache sampled(s.cache.dir, "vae-a-0123456789abcdef", rescanned, s.buckets, so);
  EXPECT_EQ(sampled.missing().size(), 14U);
  (void)sampled.build(pool_encoder);
  at::Generator g1 = data::sample_generator(1, 0, 0, 0), g2 = data::sample_generator(2, 0, 0, 0);
  const auto a = sampled.read(0, false, g1), b = sampled.read(0, false, g2);
  EXPECT_TRUE(a.latent.equal(b.latent));  // one draw, made when cached
  const auto entry = sampled.store().get(sampled.key(0, false));
  EXPECT_EQ(entry.count("mean"), 0U);
  EXPECT_EQ(entry.at("sample").dim(), 3);
  data::LatentCache dist(s.cache.dir, "vae-a-0123456789abcdef", rescanned, s.buckets, o);
  const auto c = dist.read(0, false, g1), d = dist.read(0, false, g2);
  EXPECT_FALSE(c.latent.equal(d.latent));  // a new draw per read
}

// A damaged shard (bytes changed, cut short, another producer's, not a shard) is set aside as
// .damaged with the reason, and only its entries are encoded again; an interrupted build keeps
// its finished shards and the next one encodes the rest.
TEST(LatentCache, DamagedShardsAreSetAsideAndInterruptedBuildsResume) {
  CacheScene s;
  const auto o = s.options(2);
  std::size_t calls = 0;
  auto failing = [&](const at::Tensor& px) {
    if (++calls == 4) throw dt::IoError("the encoder ran out of memory", "test");
    return pool_encoder(px);
  };
  {
    data::LatentCache cache(s.cache.dir, "vae-a-0123456789abcdef", s.folder, s.buckets, o);
    EXPECT_THROW((void)cache.build(failing), dt::IoError);
  }
  {
    data::LatentCache cache(s.cache.dir, "vae-a-0123456789abcdef", s.folder, s.buckets, o);
    EXPECT_EQ(cache.missing().size(), 14U - 6U);  // three batches of two: three shards
    EXPECT_EQ(cache.build(pool_encoder).encoded, 8U);
  }
  auto shards = s.shards();
  ASSERT_EQ(shards.size(), 7U);
  {  // a changed byte in the last tensor's data
    std::fstream f(shards[0], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  fs::resize_file(shards[1], fs::file_size(shards[1]) - 10);
  { std::ofstream(shards[2], std::ios::binary | std::ios::trunc) << "not a shard"; }
  const std::map<std::string, at::Tensor> foreign{{"k/mean", at::zeros({2})}};
  dt::io::save_safetensors(shards[3], foreign,
                           {{"format", "difftrain.tensor_cache.v1"},
                            {"fingerprint", "someone else"},
                            {"checksum", data::tensors_fingerprint(foreign)}});
  data::LatentCache cache(s.cache.dir, "vae-a-0123456789abcdef", s.folder, s.buckets, o);
  const auto& damaged = cache.store().damaged();
  ASSERT_EQ(damaged.size(), 4U);
  EXPECT_NE(damaged[0].reason.find("checksum"), std::string::npos) << damaged[0].reason;
  EXPECT_NE(damaged[3].reason.find("another producer"), std::string::npos) << damaged[3].reason;
  for (const auto& d : damaged) {
    EXPECT_FALSE(fs::exists(d.path));
    EXPECT_TRUE(fs::exists(d.path.string() + ".damaged"));
  }
  EXPECT_EQ(cache.missing().size(), 8U);
  EXPECT_EQ(cache.build(pool_encoder).encoded, 8U);
  EXPECT_TRUE(data::LatentCache(s.cache.dir, "vae-a-0123456789abcdef", s.folder, s.buckets, o)
                  .store()
                  .damaged()
                  .empty());
}

// Mistakes: flips from a cache without mirror images, reading before building, an encoder that
// returns the wrong shape, a short fingerprint.
TEST(LatentCache, MistakesAreTypedErrors) {
  CacheScene s;
  auto o = s.options();
  o.flipped = false;
  data::LatentCache cache(s.cache.dir, "vae-a-0123456789abcdef", s.folder, s.buckets, o);
  EXPECT_THROW(data::CachedLatentBatches(cache, s.folder, 2, 0.5, 0, 0), dt::ConfigError);
  at::Generator gen = data::sample_generator(0, 0, 0, 0);
  EXPECT_THROW((void)cache.read(0, false, gen), dt::ConfigError);
  EXPECT_THROW((void)cache.build(
                   [](const at::Tensor& px) { return std::make_pair(px.mean(1), px.mean(1)); }),
               dt::ShapeError);
  EXPECT_THROW(data::TensorCache(s.cache.dir, "short", "x"), dt::ConfigError);
}

// Frozen text encoders' outputs: each distinct text computed once (batched), read back by the
// next run without computing; batched fields of the wrong length are a ShapeError.
TEST(TensorCache, TextEntriesAreComputedOnceAndReadBack) {
  ScratchFolder dir("text-cache");
  std::vector<std::size_t> batch_sizes;
  auto compute = [&](const std::vector<std::string>& texts) {
    batch_sizes.push_back(texts.size());
    std::vector<at::Tensor> rows;
    for (const auto& t : texts) rows.push_back(at::full({3, 2}, static_cast<double>(t.size())));
    return data::TensorCache::Entry{{"hidden", at::stack(rows)},
                                    {"pooled", at::stack(rows).sum(1)}};
  };
  const std::vector<std::string> texts = {
      "a photo of a sneaker", "a bag", "a photo of a sneaker", "", "a coat", "a dress"};
  {
    data::TensorCache cache(dir.dir, "text-encoder-0123456789", "test", {.entries_per_shard = 2});
    const auto got = cache.entries_for_texts(texts, compute, 2);
    ASSERT_EQ(got.size(), texts.size());
    EXPECT_EQ(batch_sizes, (std::vector<std::size_t>{2, 2, 1}));
    for (std::size_t i = 0; i < texts.size(); ++i)
      EXPECT_TRUE(
          got[i].at("hidden").equal(at::full({3, 2}, static_cast<double>(texts[i].size()))));
  }
  data::TensorCache cache(dir.dir, "text-encoder-0123456789", "test");
  EXPECT_EQ(cache.size(), 5U);
  const auto again = cache.entries_for_texts(texts, compute, 2);
  EXPECT_EQ(batch_sizes.size(), 3U);  // nothing computed
  EXPECT_TRUE(again[4].at("pooled").equal(at::full({2}, 18.0)));
  EXPECT_THROW((void)cache.entries_for_texts(
                   {"new"},
                   [](const std::vector<std::string>&) {
                     return data::TensorCache::Entry{{"hidden", at::zeros({3, 2})}};
                   }),
               dt::ShapeError);
  EXPECT_THROW((void)cache.get("absent"), dt::ConfigError);
  EXPECT_THROW(cache.put("a/b", {{"x", at::zeros({1})}}), dt::ConfigError);
}

// ---- the image readers' kept fuzz corpus --------------------------------------------------------

// Every kept input runs through the fuzz target's entry point (typed errors only, nothing escapes),
// and the hostile ones are refused with errors that say what is wrong.
TEST(ImageFuzzCorpus, EveryKeptInputRunsCleanlyAndHostileOnesSayWhy) {
  const fs::path corpus = fs::path(DIFFTRAIN_FUZZ_CORPUS_DIR) / "image";
  std::size_t files = 0, refused = 0;
  for (const auto& f : fs::directory_iterator(corpus)) {
    const std::vector<char> b = dt::io::read_file(f.path());
    dt::fuzz::image_input(reinterpret_cast<const std::uint8_t*>(b.data()), b.size());
    ++files;
    const std::string name = f.path().filename().string();
    if (name.rfind("bad_", 0) != 0) continue;
    data::ImageLimits limits;
    limits.max_pixels = 1 << 22;
    try {
      (void)data::decode_image(b, name, limits);
      ADD_FAILURE() << name << " was decoded";
    } catch (const dt::Error& e) {
      ++refused;
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
  EXPECT_GE(files, 40U);
  EXPECT_GE(refused, 10U);
}
