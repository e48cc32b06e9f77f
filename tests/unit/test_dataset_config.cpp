// kohya's dataset config (data/dataset_config.hpp): values ascend from subset to dataset to
// [general] to the program's flags; every mistake a user makes in the file (a misspelt key at each
// level, a key in the wrong table, a wrong type, invalid TOML, a missing or absent folder, a
// non-square resolution, kohya's keys difftrain does not act on set to something) is a typed
// error naming the file, line and column.
#include <difftrain/data/dataset_config.hpp>
#include <difftrain/data/loader.hpp>
#include <difftrain/io/remove_tree.hpp>

#include <gtest/gtest.h>
#include <png.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace dt = difftrain;
namespace data = difftrain::data;
namespace fs = std::filesystem;

namespace {

struct Folders {
  // One folder per test and process: CTest runs these tests at once, each its own process.
  fs::path root = fs::temp_directory_path() /
                  ("difftrain-dataset-config-" +
                   std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) +
                   "-" + std::to_string(::getpid()));
  Folders() {
    fs::create_directories(root / "a");
    fs::create_directories(root / "b");
  }
  ~Folders() { dt::io::remove_tree(root); }
  Folders(const Folders&) = delete;
  Folders& operator=(const Folders&) = delete;
  fs::path write(const std::string& name, const std::string& text) const {
    const fs::path p = root / name;
    std::ofstream(p) << text;
    return p;
  }
};

std::string what_of(const fs::path& file, const data::CaptionOptions& defaults = {}) {
  try {
    (void)data::read_dataset_config(file, defaults);
  } catch (const dt::Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(DatasetConfig, ValuesAscendFromSubsetToDatasetToGeneralToTheFlags) {
  const Folders f;
  const fs::path file = f.write("ok.toml", R"([general]
shuffle_caption = true
caption_extension = ".txt"
keep_tokens = 1
num_repeats = 3
color_aug = false
caption_dropout_rate = 0.25

[[datasets]]
resolution = [64, 64]
batch_size = 2
enable_bucket = true
min_bucket_reso = 32
keep_tokens = 2

  [[datasets.subsets]]
  image_dir = ")" + (f.root / "a").string() + R"("
  class_tokens = "sks dog"
  num_repeats = 10

  [[datasets.subsets]]
  image_dir = ")" + (f.root / "b").string() + R"("
  is_reg = true
  caption_extension = ".caption"
  flip_aug = true
  token_warmup_step = 0.5
)");
  data::CaptionOptions flags;
  flags.caption_prefix = "from the flags";
  flags.keep_tokens = 7;
  const data::DatasetConfig c = data::read_dataset_config(file, flags);
  ASSERT_EQ(c.datasets.size(), 1U);
  const auto& d = c.datasets[0];
  EXPECT_EQ(d.resolution, 64);
  EXPECT_EQ(d.batch_size, 2);
  EXPECT_EQ(d.enable_bucket, true);
  EXPECT_EQ(d.min_bucket_reso, 32);
  EXPECT_FALSE(d.max_bucket_reso.has_value());
  ASSERT_EQ(d.subsets.size(), 2U);
  const auto& a = d.subsets[0];
  const auto& b = d.subsets[1];
  EXPECT_EQ(a.image_dir, f.root / "a");
  EXPECT_EQ(a.class_tokens, "sks dog");
  EXPECT_EQ(a.num_repeats, 10);            // the subset's own
  EXPECT_EQ(b.num_repeats, 3);             // [general]'s
  EXPECT_EQ(a.caption_extension, ".txt");  // [general]'s
  EXPECT_EQ(b.caption_extension, ".caption");
  EXPECT_FALSE(a.is_reg);
  EXPECT_TRUE(b.is_reg);
  EXPECT_FALSE(a.flip_aug);
  EXPECT_TRUE(b.flip_aug);
  for (const auto* s : {&a, &b}) {
    EXPECT_TRUE(s->captions.shuffle_caption);
    EXPECT_EQ(s->captions.keep_tokens, 2);  // the dataset's over [general]'s and the flags'
    EXPECT_EQ(s->captions.caption_dropout_rate, 0.25);
    EXPECT_EQ(s->captions.caption_prefix, "from the flags");  // no key: the flags' value
  }
  EXPECT_EQ(b.captions.token_warmup_step, 0.5);
  EXPECT_EQ(a.captions.token_warmup_step, 0.0);
  // kohya's defaults where nothing is said.
  const fs::path bare = f.write("bare.toml", "[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"" +
                                                 (f.root / "a").string() + "\"\n");
  const auto s = data::read_dataset_config(bare).datasets[0].subsets[0];
  EXPECT_EQ(s.num_repeats, 1);
  EXPECT_EQ(s.caption_extension, ".caption");
  EXPECT_EQ(s.class_tokens, "");
}

TEST(DatasetConfig, EveryMistakeIsATypedErrorWithItsPlace) {
  const Folders f;
  const std::string a = (f.root / "a").string();
  const std::string subset = "[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"" + a + "\"\n";
  struct Case {
    std::string name, text, expect;
  };
  const std::vector<Case> cases = {
      {"misspelt in a subset", subset + "num_repeat = 2\n",
       "4:1: 'num_repeat' is not a key of kohya's dataset config in [[datasets.subsets]]; did you "
       "mean 'num_repeats'?"},
      {"misspelt in a dataset",
       "[[datasets]]\nbatchsize = 2\n[[datasets.subsets]]\nimage_dir = \"" + a + "\"\n",
       "2:1: 'batchsize' is not a key of kohya's dataset config in [[datasets]]; did you mean "
       "'batch_size'?"},
      {"misspelt in general", "[general]\nshufle_caption = true\n" + subset,
       "2:1: 'shufle_caption' is not a key of kohya's dataset config in [general]; did you mean "
       "'shuffle_caption'?"},
      {"far from every key", subset + "learning_rate = 1e-4\n",
       "'learning_rate' is not a key of kohya's dataset config in [[datasets.subsets]]"},
      {"a subset key in a dataset", "[[datasets]]\nimage_dir = \"x\"\n[[datasets.subsets]]\n",
       "2:1: 'image_dir' is kohya's but does not belong in [[datasets]]"},
      {"a dataset key in a subset", subset + "batch_size = 2\n",
       "'batch_size' is kohya's but does not belong in [[datasets.subsets]]"},
      {"an unknown table", "[trainer]\nx = 1\n" + subset, "'trainer' is not a table"},
      {"a wrong type", subset + "num_repeats = \"ten\"\n",
       "4:15: 'num_repeats' must be an integer"},
      {"a bool as a string", subset + "is_reg = \"yes\"\n", "'is_reg' must be true or false"},
      {"invalid TOML", subset + "num_repeats = = 2\n", "is not valid TOML"},
      {"no datasets", "[general]\nnum_repeats = 2\n", "has no [[datasets]]"},
      {"no subsets", "[[datasets]]\nbatch_size = 2\n", "has no [[datasets.subsets]]"},
      {"no image_dir", "[[datasets]]\n[[datasets.subsets]]\nnum_repeats = 2\n",
       "has no 'image_dir'"},
      {"a folder that is not there",
       "[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"" + (f.root / "nowhere").string() +
           "\"\n",
       "nowhere is not a folder"},
      {"a non-square resolution",
       "[[datasets]]\nresolution = [512, 768]\n[[datasets.subsets]]\n"
       "image_dir = \"" +
           a + "\"\n",
       "'resolution' is not square"},
      {"a resolution of three",
       "[[datasets]]\nresolution = [1, 2, 3]\n[[datasets.subsets]]\n"
       "image_dir = \"" +
           a + "\"\n",
       "'resolution' must be an integer or [width, height]"},
      {"no repeats", subset + "num_repeats = 0\n", "'num_repeats' must be >= 1"},
      {"an extension without its dot", subset + "caption_extension = \"txt\"\n",
       "must start with a dot"},
      {"a rate out of range", subset + "caption_dropout_rate = 1.5\n", "must lie in [0, 1]"},
      {"color_aug on", subset + "color_aug = true\n",
       "'color_aug' is kohya's, but difftrain does not act on it"},
      {"a face crop range", subset + "face_crop_aug_range = [2.0, 4.0]\n",
       "'face_crop_aug_range' is kohya's, but difftrain does not act on it"},
      {"a network multiplier",
       "[[datasets]]\nnetwork_multiplier = 0.5\n[[datasets.subsets]]\n"
       "image_dir = \"" +
           a + "\"\n",
       "'network_multiplier' is kohya's, but difftrain does not act on it"},
      {"a batch size of 0",
       "[[datasets]]\nbatch_size = 0\n[[datasets.subsets]]\nimage_dir = \"" + a + "\"\n",
       "'batch_size' must be >= 1"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path file = f.write("case.toml", c.text);
    const std::string what = what_of(file);
    EXPECT_NE(what.find(c.expect), std::string::npos) << what;
    EXPECT_NE(what.find("case.toml"), std::string::npos) << what;
  }
  // Neutral values of kohya's other keys are taken.
  const fs::path neutral =
      f.write("neutral.toml",
              "[[datasets]]\nnetwork_multiplier = 1.0\n[[datasets.subsets]]\nimage_dir = \"" + a +
                  "\"\ncolor_aug = false\ncache_info = false\nface_crop_aug_range = []\n");
  EXPECT_NO_THROW((void)data::read_dataset_config(neutral));
  EXPECT_THROW((void)data::read_dataset_config(f.root / "absent.toml"), dt::IoError);
  EXPECT_THROW((void)data::read_dataset_config(f.write("bad.toml", "a = [")), dt::FormatError);
}

// Loss masks through the loader (kohya's alpha_mask and conditioning images): a mask takes the
// pixels' resize, crop and flip. Each image's colour equals its mask here (alpha, or the mask
// image's red channel), so the loaded pixels must equal the loaded masks exactly, on every
// random crop and flip; a mask of another size is a FormatError naming it.
namespace {
void write_rgba_png(const fs::path& path, std::uint32_t w, std::uint32_t h, bool alpha,
                    const std::function<std::uint8_t(std::uint32_t, std::uint32_t)>& value) {
  std::vector<std::uint8_t> px(std::size_t{w} * h * 4);
  for (std::uint32_t y = 0; y < h; ++y)
    for (std::uint32_t x = 0; x < w; ++x) {
      std::uint8_t* p = px.data() + (std::size_t{y} * w + x) * 4;
      p[0] = p[1] = p[2] = value(x, y);
      p[3] = alpha ? value(x, y) : 255;
    }
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = w;
  img.height = h;
  img.format = alpha ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB;
  std::vector<std::uint8_t> packed;
  if (!alpha)
    for (std::size_t i = 0; i < px.size(); i += 4)
      packed.insert(packed.end(), px.begin() + i, px.begin() + i + 3);
  ASSERT_NE(
      png_image_write_to_file(&img, path.c_str(), 0, alpha ? px.data() : packed.data(), 0, nullptr),
      0);
}
}  // namespace

TEST(DatasetConfig, MasksTakeThePixelsCropsAndFlips) {
  const Folders f;
  write_rgba_png(f.root / "a" / "alpha.png", 48, 32, true, [](std::uint32_t x, std::uint32_t y) {
    return static_cast<std::uint8_t>(x * 5 + y);
  });
  write_rgba_png(f.root / "a" / "plain.png", 40, 56, false, [](std::uint32_t x, std::uint32_t y) {
    return static_cast<std::uint8_t>(y * 4 + x);
  });
  write_rgba_png(f.root / "b" / "plain.png", 40, 56, false, [](std::uint32_t x, std::uint32_t y) {
    return static_cast<std::uint8_t>(y * 4 + x);
  });
  data::ImageFolder folder = data::scan_image_folder(f.root / "a");
  ASSERT_EQ(folder.images.size(), 2U);
  for (auto& r : folder.images)
    if (r.path.filename() == "plain.png") r.mask = f.root / "b" / "plain.png";
  data::BucketOptions bo;
  bo.max_width = bo.max_height = bo.min_size = bo.max_size = 24;
  bo.steps = 8;
  const data::BucketManager buckets(bo);
  int flipped_or_cropped = 0;
  for (std::uint64_t epoch = 0; epoch < 6; ++epoch) {
    data::ImageBatchOptions o;
    o.batch_size = 2;
    o.random_crop = true;
    o.flip_p = 0.5;
    o.seed = 5;
    o.alpha_mask = true;
    data::ImageBatches batches(folder, buckets, o, epoch);
    const data::ImageBatch b = *batches.next();
    ASSERT_TRUE(b.masks.defined());
    ASSERT_EQ(b.masks.sizes(), (at::IntArrayRef{2, 24, 24}));
    const at::Tensor from_pixels = ((b.pixels.select(1, 0) + 1) * 127.5).round();
    EXPECT_TRUE(at::equal(from_pixels, (b.masks * 255).round())) << "epoch " << epoch;
    flipped_or_cropped +=
        static_cast<int>(b.crop_top_left[0][1] != 0 || b.crop_top_left[1][1] != 0);
  }
  EXPECT_GT(flipped_or_cropped, 0);
  // Without alpha_mask, only the record with a mask image has one: a batch must not mix them.
  {
    data::ImageBatchOptions o;
    o.batch_size = 2;
    data::ImageBatches batches(folder, buckets, o, 0);
    EXPECT_THROW((void)batches.next(), dt::ConfigError);
  }
  write_rgba_png(f.root / "b" / "plain.png", 12, 12, false,
                 [](std::uint32_t, std::uint32_t) { return std::uint8_t{9}; });
  data::ImageBatchOptions o;
  o.batch_size = 2;
  o.alpha_mask = true;
  data::ImageBatches batches(folder, buckets, o, 0);
  try {
    (void)batches.next();
    ADD_FAILURE() << "a mask of another size loaded";
  } catch (const dt::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("a mask has its image's size"), std::string::npos)
        << e.what();
  }
}
