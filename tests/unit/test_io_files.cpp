// torch.save files, PNG-embedded data, CSV logs and atomic writes under a killed writer.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>
#include <difftrain/io/csv_log.hpp>
#include <difftrain/io/embedded_data.hpp>
#include <difftrain/io/idx.hpp>
#include <difftrain/io/json_file.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/sha256.hpp>
#include <difftrain/io/torch_file.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "../fuzz/targets.hpp"
#include "golden.hpp"

namespace dt = difftrain;
namespace io = difftrain::io;
namespace tst = difftrain::test;
namespace fs = std::filesystem;

namespace {

fs::path golden_path(const std::string& name) { return fs::path(DIFFTRAIN_GOLDEN_DIR) / name; }

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("difftrain-io-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir / name;
}

template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no " << typeid(E).name() << " was thrown";
  return {};
}

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << part << "' not in: " << text;
}

// Compares a loaded value with the summary tests/reference/ref_torch_files.py recorded.
void expect_like(const io::TorchValue& v, const nlohmann::json& s) {
  SCOPED_TRACE(v.where());
  if (s.contains("tensor")) {
    const at::Tensor t = v.tensor();
    const std::map<std::string, at::ScalarType> types = {
        {"float32", at::kFloat},     {"float64", at::kDouble}, {"float16", at::kHalf},
        {"bfloat16", at::kBFloat16}, {"int64", at::kLong},     {"int32", at::kInt},
        {"uint8", at::kByte},        {"bool", at::kBool}};
    EXPECT_EQ(t.scalar_type(), types.at(s["tensor"].get<std::string>()));
    EXPECT_EQ(t.sizes().vec(), tst::shape_from(s["shape"]));
    EXPECT_TRUE(at::equal(t.to(at::kDouble).flatten(), tst::tensor_from(s["values"])));
  } else if (s.contains("dict")) {
    const auto items = v.items();
    ASSERT_EQ(items.size(), s["dict"].size());
    for (std::size_t i = 0; i < items.size(); ++i) {
      const auto& [key, want] = std::pair{s["dict"][i][0], s["dict"][i][1]};
      if (key.is_string()) {
        EXPECT_EQ(items[i].first.toStringRef(), key.get<std::string>());
        expect_like(v.at(key.get<std::string>()), want);
      } else {
        EXPECT_EQ(items[i].first.toInt(), key.get<std::int64_t>());
        expect_like(v.at(key.get<std::int64_t>()), want);
      }
    }
  } else if (s.contains("list")) {
    const auto elements = v.elements();
    ASSERT_EQ(elements.size(), s["list"].size());
    for (std::size_t i = 0; i < elements.size(); ++i) expect_like(elements[i], s["list"][i]);
  } else {
    const auto& want = s["value"];
    if (want.is_null())
      EXPECT_TRUE(v.is_none());
    else if (want.is_boolean())
      EXPECT_EQ(v.boolean(), want.get<bool>());
    else if (want.is_number_integer())
      EXPECT_EQ(v.integer(), want.get<std::int64_t>());
    else if (want.is_number())
      EXPECT_EQ(v.number(), want.get<double>());
    else
      EXPECT_EQ(v.string(), want.get<std::string>());
  }
}

}  // namespace

// ---- torch.save files ---------------------------------------------------------------------------

TEST(TorchFile, ReadsWhatPythonTorchSaveWrote) {
  for (const std::string name :
       {"webui_embedding.pt", "webui_hypernetwork.pt", "dtypes.pt", "learned_embeds.bin"}) {
    SCOPED_TRACE(name);
    expect_like(io::load_torch_file(golden_path(name)), tst::golden(name + ".json"));
  }
}

TEST(TorchFile, ErrorsNameThePathInsideTheFile) {
  const io::TorchValue emb = io::load_torch_file(golden_path("webui_embedding.pt"));
  EXPECT_EQ(emb.at("string_to_param").at("*").tensor().sizes().vec(),
            (std::vector<std::int64_t>{3, 16}));
  EXPECT_EQ(emb.at("string_to_token").at("*").integer(), 265);
  const std::string missing =
      error_of<dt::FormatError>([&] { (void)emb.at("string_to_param").at("x"); });
  EXPECT_TRUE(contains(missing, "webui_embedding.pt['string_to_param']: has no key 'x'"));
  const std::string kind = error_of<dt::FormatError>([&] { (void)emb.at("step").string(); });
  EXPECT_TRUE(contains(kind, "['step']: is a int where a str was expected"));
  const io::TorchValue hn = io::load_torch_file(golden_path("webui_hypernetwork.pt"));
  EXPECT_EQ(hn.at(std::int64_t{320}).elements().at(1).tensor_map().at("linear.1.weight").size(0),
            4);
  EXPECT_FALSE(hn.at("sd_checkpoint").optional_string().has_value());
  const std::string no_int = error_of<dt::FormatError>([&] { (void)hn.at(std::int64_t{768}); });
  EXPECT_TRUE(contains(no_int, "has no key 768"));
}

TEST(TorchFile, LegacyAndForeignFilesAreClearFormatErrors) {
  EXPECT_TRUE(contains(error_of<dt::FormatError>(
                           [] { (void)io::load_torch_file(golden_path("legacy_embedding.pt")); }),
                       "legacy (pre-zip) torch.save file"));
  EXPECT_TRUE(contains(error_of<dt::FormatError>(
                           [] { (void)io::load_torch_file(golden_path("embedding_text.png")); }),
                       "no zip signature"));
  EXPECT_TRUE(
      contains(error_of<dt::IoError>([] { (void)io::load_torch_file(scratch("no-such-file.pt")); }),
               "cannot open"));
  // A real file cut short, and one with bytes flipped in the middle.
  std::vector<char> bytes = io::read_file(golden_path("webui_embedding.pt"));
  for (std::size_t keep : {bytes.size() / 2, bytes.size() - 30, std::size_t{10}}) {
    const std::vector<char> cut(bytes.begin(), bytes.begin() + static_cast<long>(keep));
    EXPECT_THROW((void)io::parse_torch_file(cut, "cut.pt"), dt::FormatError) << keep;
  }
  for (std::size_t i = 100; i < bytes.size(); i += 97) bytes[i] = static_cast<char>(~bytes[i]);
  EXPECT_THROW((void)io::parse_torch_file(bytes, "flipped.pt"), dt::FormatError);
}

TEST(TorchFile, TensorsReachingOutsideTheirStorageAreRefused) {
  at::Tensor t = at::zeros({4});
  t.unsafeGetTensorImpl()->set_sizes_and_strides(
      c10::IntArrayRef({100}), c10::IntArrayRef({1}));  // what a hostile pickle can declare
  auto d = io::torch_dict();
  d.insert("w", t);
  const std::string msg =
      error_of<dt::FormatError>([&] { io::torch_file_detail::check_value(d, "evil.pt", 0); });
  EXPECT_TRUE(contains(msg, "evil.pt['w']: reaches byte 400 of a storage of 16 bytes"));
  auto deep = io::torch_list();
  for (int i = 0; i < 100; ++i) {
    auto outer = io::torch_list();
    outer.push_back(deep);
    deep = outer;
  }
  EXPECT_TRUE(contains(
      error_of<dt::FormatError>([&] { io::torch_file_detail::check_value(deep, "deep.pt", 0); }),
      "nested more than 64 levels"));
}

TEST(TorchFile, RoundTripsWebUiLayoutsThroughTorchLoad) {
  // A hypernetwork-shaped dict: integer and string keys, lists of state dicts, None, floats.
  auto sd = io::torch_dict();
  sd.insert("linear.0.weight", at::arange(12, at::kFloat).reshape({3, 4}));
  sd.insert("linear.0.bias", at::zeros({3}, at::kBFloat16));
  auto pair = io::torch_list();
  pair.push_back(sd);
  pair.push_back(sd);
  auto structure = io::torch_list();
  for (double x : {0.0, 0.3, 0.0}) structure.push_back(x);
  auto file = io::torch_dict();
  file.insert(std::int64_t{768}, pair);
  file.insert("name", std::string("hn"));
  file.insert("step", std::int64_t{10});
  file.insert("sd_checkpoint", c10::IValue());
  file.insert("use_dropout", true);
  file.insert("dropout_structure", structure);
  const fs::path path = scratch("hypernetwork.pt");
  io::save_torch_file(path, file);
  if (const char* out = std::getenv("DIFFTRAIN_TORCH_FILE_OUT")) io::save_torch_file(out, file);
  const io::TorchValue back = io::load_torch_file(path);
  EXPECT_EQ(back.at(std::int64_t{768}).elements().size(), 2U);
  EXPECT_TRUE(at::equal(back.at(std::int64_t{768}).elements()[1].at("linear.0.weight").tensor(),
                        at::arange(12, at::kFloat).reshape({3, 4})));
  EXPECT_EQ(back.at(std::int64_t{768}).elements()[0].at("linear.0.bias").tensor().scalar_type(),
            at::kBFloat16);
  EXPECT_EQ(back.at("name").string(), "hn");
  EXPECT_TRUE(back.at("sd_checkpoint").is_none());
  EXPECT_TRUE(back.at("use_dropout").boolean());
  EXPECT_EQ(back.at("dropout_structure").elements()[1].number(), 0.3);
}

// ---- PNG-embedded data
// ----------------------------------------------------------------------------

namespace {
io::RgbImage golden_cover() {
  const auto& g = tst::golden("embedding_png.json");
  io::RgbImage img(40, 48);
  for (std::size_t i = 0; i < g["cover"].size(); ++i)
    for (std::size_t c = 0; c < 3; ++c)
      img.pixels[i * 3 + c] = g["cover"][i][c].get<std::uint8_t>();
  return img;
}

at::Tensor golden_vec() {
  const auto& g = tst::golden("embedding_png.json");
  return tst::tensor_from(g["vec"], tst::shape_from(g["shape"]));
}

c10::IValue webui_embedding(const at::Tensor& vec) {
  auto token = io::torch_dict();
  token.insert("*", std::int64_t{265});
  auto param = io::torch_dict();
  param.insert("*", vec);
  auto d = io::torch_dict();
  d.insert("string_to_token", token);
  d.insert("string_to_param", param);
  d.insert("name", std::string("cat-toy"));
  d.insert("step", std::int64_t{1500});
  d.insert("sd_checkpoint", c10::IValue());
  return d;
}
}  // namespace

TEST(EmbeddedData, ReadsBothWebUiCarriers) {
  for (const std::string name :
       {"embedding_text.png", "embedding_image.png", "embedding_both.png"}) {
    SCOPED_TRACE(name);
    const auto data = io::read_embedded_data(golden_path(name));
    ASSERT_TRUE(data.has_value());
    EXPECT_EQ(data->at("name").string(), "cat-toy");
    EXPECT_EQ(data->at("step").integer(), 1500);
    EXPECT_EQ(data->at("string_to_token").at("*").integer(), 265);
    const at::Tensor vec = data->at("string_to_param").at("*").tensor();
    EXPECT_EQ(vec.scalar_type(), at::kDouble);
    EXPECT_TRUE(at::equal(vec, golden_vec()));
  }
  // The image-data variant is found from pixels alone, even when a text chunk is also present.
  const io::PngFile both = io::read_png(golden_path("embedding_both.png"));
  EXPECT_TRUE(both.text.contains(io::kEmbeddingTextKey));
  const auto from_pixels = io::extract_image_data(both.image, "both");
  ASSERT_TRUE(from_pixels.has_value());
  EXPECT_TRUE(at::equal(from_pixels->at("string_to_param").at("*").tensor(), golden_vec()));
  // The text-only file keeps the cover's pixels exactly.
  EXPECT_EQ(io::read_png(golden_path("embedding_text.png")).image.pixels, golden_cover().pixels);
}

TEST(EmbeddedData, WritesFilesTheWebUiReads) {
  const at::Tensor vec = golden_vec().to(at::kFloat);
  const c10::IValue data = webui_embedding(vec);
  const char* out_dir = std::getenv("DIFFTRAIN_EMBEDDED_PNG_OUT");
  for (auto [carrier, name] : {std::pair{io::EmbedCarrier::both, "both.png"},
                               std::pair{io::EmbedCarrier::image_data, "image.png"},
                               std::pair{io::EmbedCarrier::text_chunk, "text.png"}}) {
    SCOPED_TRACE(name);
    const fs::path path = scratch(name);
    io::write_embedded_data(path, golden_cover(), data, carrier);
    if (out_dir) io::write_embedded_data(fs::path(out_dir) / name, golden_cover(), data, carrier);
    const auto back = io::read_embedded_data(path);
    ASSERT_TRUE(back.has_value());
    EXPECT_TRUE(at::equal(back->at("string_to_param").at("*").tensor(), vec.to(at::kDouble)));
    EXPECT_TRUE(back->at("sd_checkpoint").is_none());
    const io::PngFile png = io::read_png(path);
    EXPECT_EQ(png.text.contains(io::kEmbeddingTextKey), carrier != io::EmbedCarrier::image_data);
    EXPECT_EQ(io::extract_image_data(png.image, name).has_value(),
              carrier != io::EmbedCarrier::text_chunk);
  }
}

TEST(EmbeddedData, PlainPicturesCarryNothingAndDamageIsAFormatError) {
  const fs::path plain = scratch("plain.png");
  io::write_png(plain, golden_cover());
  EXPECT_FALSE(io::read_embedded_data(plain).has_value());

  std::vector<char> bytes = io::read_file(golden_path("embedding_both.png"));
  auto reject = [](const std::vector<char>& b) {
    return error_of<dt::FormatError>([&] { (void)io::decode_png(b, "x.png"); });
  };
  EXPECT_TRUE(contains(reject({bytes.begin(), bytes.begin() + 5}), "wrong signature"));
  EXPECT_TRUE(contains(reject({bytes.begin(), bytes.end() - 20}), "past the end of the file"));
  EXPECT_TRUE(contains(reject({bytes.begin(), bytes.begin() + 40}), "truncated (no IEND chunk)"));
  std::vector<char> bad_crc = bytes;
  bad_crc[20] = static_cast<char>(bad_crc[20] ^ 1);  // inside IHDR
  EXPECT_TRUE(contains(reject(bad_crc), "'IHDR' has a wrong CRC"));
  std::vector<char> huge_len = bytes;
  huge_len[8] = static_cast<char>(0x7f);
  EXPECT_TRUE(contains(reject(huge_len), "past the end of the file"));
  io::PngLimits small;
  small.max_pixels = 100;
  EXPECT_TRUE(
      contains(error_of<dt::FormatError>([&] { (void)io::decode_png(bytes, "x.png", small); }),
               "over the limit of 100"));

  // Pixels of the data blocks damaged: the zlib stream no longer inflates.
  io::RgbImage img = io::read_png(golden_path("embedding_image.png")).image;
  for (std::uint32_t y = 0; y < img.height; ++y) img.at(2, y)[0] ^= 0x05;
  EXPECT_TRUE(
      contains(error_of<dt::FormatError>([&] { (void)io::extract_image_data(img, "x.png"); }),
               "x.png (image data)"));
  // Text that is not base64, and base64 of something that is not JSON.
  EXPECT_TRUE(contains(
      error_of<dt::FormatError>([] { (void)io::embedded_detail::base64_decode("ab$c", "t"); }),
      "not base64 at offset 2"));
  EXPECT_TRUE(contains(error_of<dt::FormatError>(
                           [] { (void)io::embedded_detail::parse_json_data("{\"a\": [1,", "t"); }),
                       "is not valid JSON"));
  EXPECT_TRUE(contains(error_of<dt::ShapeError>([] {
                         (void)io::embedded_detail::parse_json_data(
                             R"({"v": {"TORCHTENSOR": [[1, 2], [3]]}})", "t");
                       }),
                       "ragged"));
  EXPECT_EQ(io::embedded_detail::base64_decode(io::embedded_detail::base64_encode("hello!?"), "t"),
            "hello!?");
}

// ---- CSV logs ----------------------------------------------------------------------------------

namespace {
std::string text_of(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
}  // namespace

TEST(CsvLog, AppendsAcrossRunsAndCutsATornRow) {
  const fs::path path = scratch("loss.csv");
  fs::remove(path);
  const std::vector<std::string> cols = {"step", "epoch", "epoch_step", "loss", "learn_rate"};
  {
    io::CsvLog log(path, cols);
    log.row(1, 0, 1, 0.25, 5e-3);
    log.row(2, 0, 2, std::nan(""), 5e-3);
  }
  {
    std::ofstream torn(path, std::ios::app);
    torn << "3,0,3,0.1";  // a row cut short by a crash
  }
  {
    io::CsvLog log(path, cols);
    log.row(3, 0, 3, 0.125f, 0.004);
    log.flush();
  }
  EXPECT_EQ(text_of(path),
            "step,epoch,epoch_step,loss,learn_rate\n1,0,1,0.25,0.005\n2,0,2,nan,0.005\n"
            "3,0,3,0.125,0.004\n");
  EXPECT_TRUE(contains(error_of<dt::FormatError>([&] {
                         io::CsvLog other(path, {"step", "loss"});
                       }),
                       "expected 'step,loss'"));
  // A resumed run writes steps 2 and 3 again: their rows go, the file stays appendable.
  {
    io::CsvLog again(path, cols);
    again.drop_rows_after(1);
    again.row(2, 0, 2, 0.5, 0.005);
  }
  EXPECT_EQ(text_of(path),
            "step,epoch,epoch_step,loss,learn_rate\n1,0,1,0.25,0.005\n"
            "2,0,2,0.5,0.005\n");
  io::CsvLog log(path, cols);
  EXPECT_THROW(log.row(1, 2), dt::ShapeError);
  EXPECT_THROW(log.row(1, 2, 3, 4, std::string("a,b")), dt::ConfigError);
}

// ---- atomic writes
// -------------------------------------------------------------------------------

TEST(AtomicFile, AKilledWriterLeavesTheOldOrTheNewFileNeverAMix) {
  const fs::path path = scratch("atomic.bin");
  constexpr std::size_t kSize = 1 << 20;
  auto version = [&](char v) { return std::vector<char>(kSize, v); };
  io::write_file_atomic(path, version('a'));
  std::mt19937 rng(5);
  for (int round = 0; round < 25; ++round) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {  // rewrite the file with new versions until killed
      try {
        for (char v = 'b';; v = static_cast<char>(v == 'z' ? 'b' : v + 1))
          io::write_file_atomic(path, version(v));
      } catch (...) {
        ::_exit(1);
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    const std::vector<char> now = io::read_file(path);
    ASSERT_EQ(now.size(), kSize) << "round " << round;
    ASSERT_EQ(std::count(now.begin(), now.end(), now.front()), static_cast<long>(kSize))
        << "round " << round << ": a mix of versions";
  }
  // The killed writers' temporary files are recognised as stale, and the next write that
  // succeeds in the folder removes them. One more is made for certain: a dead writer's name.
  const pid_t dead = ::fork();
  ASSERT_GE(dead, 0);
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const fs::path left = path.parent_path() / (".atomic.bin.tmp-" + std::to_string(dead) + "-7");
  std::ofstream(left) << "torn";  // what a killed writer leaves
  const auto stale = io::stale_temporary_files(path.parent_path());
  EXPECT_FALSE(stale.empty());
  for (const fs::path& f : stale)
    EXPECT_NE(f.filename().string().find(".atomic.bin.tmp-"), std::string::npos);
  io::write_file_atomic(path, version('a'));
  EXPECT_TRUE(io::stale_temporary_files(path.parent_path()).empty());
  EXPECT_FALSE(fs::exists(left));
}

TEST(AtomicFile, AFailingDiskIsAnIoErrorAndKeepsThePreviousFile) {
  const fs::path path = scratch("full.bin");
  io::write_file_atomic(path, std::vector<char>(1000, 'a'));
  // A child whose files may not grow past 64 KiB: every larger write fails as on a full disk.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit lim{1 << 16, 1 << 16};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    try {
      io::write_file_atomic(path, std::vector<char>(1 << 20, 'b'));
    } catch (const dt::IoError& e) {
      ::_exit(std::string(e.what()).find("write failed") != std::string::npos ? 7 : 8);
    } catch (...) {
      ::_exit(9);
    }
    ::_exit(10);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 7) << "7: IoError naming the failed write";
  const std::vector<char> now = io::read_file(path);
  EXPECT_EQ(now, std::vector<char>(1000, 'a'));
  EXPECT_TRUE(io::stale_temporary_files(path.parent_path()).empty());  // the writer cleaned up
  for (const auto& e : fs::directory_iterator(path.parent_path()))
    EXPECT_EQ(e.path().filename().string().find(".full.bin.tmp-"), std::string::npos);
}

TEST(AtomicFile, PathsThatCannotBeReadOrWrittenAreIoErrorsNamingThem) {
  const fs::path dir = scratch("io-paths");
  (void)dt::io::remove_tree(dir);
  fs::create_directories(dir / "a-folder");
  io::write_file_atomic(dir / "a-file", std::vector<char>(4, 'x'));
  auto io_error = [](auto&& f) { return error_of<dt::IoError>(f); };
  EXPECT_TRUE(contains(io_error([&] { (void)io::read_file(dir / "a-folder"); }),
                       "a-folder: is a folder, not a file"));
  EXPECT_TRUE(contains(io_error([&] { (void)io::read_file(dir / "missing"); }),
                       "No such file or directory"));
  EXPECT_TRUE(contains(io_error([&] { (void)io::load_safetensors(dir / "a-folder"); }),
                       "is a folder, not a file"));
  EXPECT_TRUE(contains(
      io_error([&] { io::write_file_atomic(dir / "a-file" / "x.pt", std::vector<char>(1)); }),
      "a-file"));
  EXPECT_TRUE(contains(io_error([&] { io::ensure_writable_folder(""); }), "is empty"));
  EXPECT_TRUE(contains(io_error([&] { io::ensure_writable_folder(dir / "a-file" / "out"); }),
                       "cannot create the folder"));
  EXPECT_TRUE(contains(io_error([&] { io::ensure_writable_folder(dir / "a-file"); }),
                       "a file is in the way"));
  EXPECT_THROW(io::ensure_writable_folder("/proc/difftrain-out"), dt::IoError);
  io::ensure_writable_folder(dir / "new" / "nested");
  EXPECT_TRUE(fs::is_directory(dir / "new" / "nested"));
  EXPECT_TRUE(fs::is_empty(dir / "new" / "nested"));  // the probe is gone
}

// ---- the kept fuzz corpus
// ------------------------------------------------------------------------

namespace {
// What reading a corpus file gives: "" when accepted, else the typed error's text.
std::string verdict(const std::string& target, const std::vector<char>& bytes) {
  try {
    if (target == "safetensors") {
      (void)io::parse_safetensors(bytes.data(), bytes.size(), nullptr, true, "f");
    } else if (target == "torch_file") {
      (void)io::parse_torch_file(bytes, "f");
    } else {
      io::PngLimits limits;
      limits.max_text_bytes = 1 << 24;
      const io::PngFile png = io::decode_png(bytes, "f", limits);
      if (const auto it = png.text.find(io::kEmbeddingTextKey); it != png.text.end())
        (void)io::embedded_detail::parse_json_data(
            io::embedded_detail::base64_decode(it->second, "f"), "f");
      (void)io::extract_image_data(png.image, "f");
    }
  } catch (const dt::Error& e) {
    return std::string(e.kind()) + ": " + e.what();
  }
  return "";
}
}  // namespace

TEST(FuzzCorpus, EveryKeptInputRunsCleanlyThroughItsTarget) {
  // The same entry points the libFuzzer binaries call: typed errors only, nothing escapes.
  std::size_t files = 0;
  for (const auto& dir : fs::directory_iterator(DIFFTRAIN_FUZZ_CORPUS_DIR)) {
    for (const auto& f : fs::directory_iterator(dir.path())) {
      const std::vector<char> b = io::read_file(f.path());
      const auto* p = reinterpret_cast<const std::uint8_t*>(b.data());
      const std::string target = dir.path().filename().string();
      if (target == "image") break;  // the data layer's: replayed in test_data.cpp
      if (target == "safetensors")
        difftrain::fuzz::safetensors_input(p, b.size());
      else if (target == "torch_file")
        difftrain::fuzz::torch_file_input(p, b.size());
      else
        difftrain::fuzz::embedded_png_input(p, b.size());
      ++files;
    }
  }
  EXPECT_GE(files, 30U);
}

TEST(FuzzCorpus, HostileCasesAreTypedErrorsNamingTheProblem) {
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"safetensors", "valid", ""},
      {"safetensors", "truncated", "FormatError"},
      {"safetensors", "huge_header_length", "exceeds the limit"},
      {"safetensors", "header_past_end", "runs past the end"},
      {"safetensors", "overlapping_offsets", "FormatError"},
      {"safetensors", "gap_between_tensors", "FormatError"},
      {"safetensors", "offsets_out_of_bounds", "FormatError"},
      {"safetensors", "wrong_dtype_size", "needs 16"},
      {"safetensors", "shape_overflow", "FormatError"},
      {"safetensors", "nan_in_metadata", "not valid JSON"},
      {"safetensors", "number_in_metadata", "__metadata__"},
      {"safetensors", "unknown_dtype", "unknown dtype 'F33'"},
      {"safetensors", "trailing_bytes", "FormatError"},
      {"torch_file", "webui_hypernetwork", ""},
      {"torch_file", "truncated", "FormatError"},
      {"torch_file", "python_global", "calls the Python global '__builtin__ print'"},
      {"torch_file", "storage_too_short", "record 'data/0' holds 8 bytes, the storage needs 192"},
      {"torch_file", "missing_storage", "FormatError"},
      {"torch_file", "pickle_cut", "FormatError"},
      {"torch_file", "big_endian", "'big' byte order"},
      {"torch_file", "not_a_zip", "no end-of-directory record"},
      {"torch_file", "tensor_past_storage", "reaching element"},
      {"torch_file", "deep_tuples", "more than 64 levels deep"},
      {"torch_file", "deep_lists", "more than 64 levels deep"},
      {"torch_file", "dag_tuples", "expands to more than 4194304 values"},
      {"torch_file", "dag_dicts", "expands to more than 4194304 values"},
      // torch.load refuses these before unpickling; a 100 MB version record is refused unread.
      {"torch_file", "version_bomb", "version record of 104857600 bytes"},
      {"torch_file", "version_missing", "has no version record"},
      {"torch_file", "version_garbage", "version record that is not a number"},
      {"torch_file", "version_99", "has format version 99; torch.load reads 1 to 10"},
      {"torch_file", "frame_past_end", "FRAME of 1048576 bytes with 4 bytes of pickle left"},
      {"safetensors", "many_entries", ""},  // 200,000 entries, parsed in linear time
      {"embedded_png", "all_black", ""},    // no data blocks, not blocks of different widths
      {"torch_file", "flipped_tensor_byte", "fails its CRC-32 check"},
      {"torch_file", "deflated_records", ""},
      {"safetensors", "zero_then_huge", "overflow a stride"},
      {"embedded_png", "tiny_huge_image", "8000x8000 pixels, more than its 8 bytes"},
      {"embedded_png", "itxt_bomb", "inflates to more than"},
      {"embedded_png", "torchtensor_u64", "too large for int64"},
      {"embedded_png", "both", ""},
      {"embedded_png", "truncated", "FormatError"},
      {"embedded_png", "bad_crc", "'IHDR' has a wrong CRC"},
      {"embedded_png", "huge_dimensions", "FormatError"},
      {"embedded_png", "ztxt_bomb", "inflates to more than"},
      {"embedded_png", "bad_base64", "not base64"},
  };
  // An all-black picture is read as one with no embedded data, as the web UI reads it.
  EXPECT_FALSE(
      io::read_embedded_data(fs::path(DIFFTRAIN_FUZZ_CORPUS_DIR) / "embedded_png" / "all_black")
          .has_value());
  for (const auto& [target, name, expect] : cases) {
    const std::string got =
        verdict(target, io::read_file(fs::path(DIFFTRAIN_FUZZ_CORPUS_DIR) / target / name));
    if (expect.empty())
      EXPECT_EQ(got, "") << target << "/" << name;
    else
      EXPECT_TRUE(contains(got, expect)) << target << "/" << name;
  }
}

// ---- IDX (Fashion-MNIST)
// ---------------------------------------------------------------------------

TEST(Idx, ReadsDebiansFashionMnistAsNumpyDoes) {
  const fs::path root = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(root)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const at::Tensor images = io::read_idx(root / "t10k-images-idx3-ubyte.gz");
  const at::Tensor labels = io::read_idx(root / "t10k-labels-idx1-ubyte.gz");
  EXPECT_EQ(images.sizes().vec(), (std::vector<std::int64_t>{10000, 28, 28}));
  EXPECT_EQ(images.scalar_type(), at::kByte);
  const auto& g = tst::golden("fashion_mnist_t10k.json");
  EXPECT_EQ(images.to(at::kLong).sum().item<std::int64_t>(), g["pixel_sum"].get<std::int64_t>());
  EXPECT_TRUE(at::equal(labels.to(at::kLong).bincount(),
                        tst::tensor_from(g["label_counts"]).to(at::kLong)));
  EXPECT_TRUE(at::equal(images[0].flatten().to(at::kLong),
                        tst::tensor_from(g["first_pixels"]).to(at::kLong)));
}

namespace {
std::vector<char> gzip(const std::string& data) {
  z_stream z{};
  deflateInit2(&z, 9, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
  std::vector<char> out(deflateBound(&z, data.size()));
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}
}  // namespace

TEST(Idx, GzipBombsStopAtWhatTheHeaderDeclares) {
  const fs::path path = scratch("bomb-idx.gz");
  auto header = [](std::uint32_t n) {
    return std::string{0,
                       0,
                       8,
                       1,
                       static_cast<char>(n >> 24),
                       static_cast<char>(n >> 16),
                       static_cast<char>(n >> 8),
                       static_cast<char>(n)};
  };
  // 10 declared bytes followed by 64 MiB of zeros: inflating stops right after the 18th byte.
  auto bytes = gzip(header(10) + std::string(64 << 20, '\0'));
  io::write_file_atomic(path, bytes);
  EXPECT_TRUE(contains(error_of<dt::FormatError>([&] { (void)io::read_idx(path); }),
                       "inflates to more than 18 bytes"));
  // 2^31 declared bytes from a file of a few dozen: refused before inflating at all.
  bytes = gzip(header(0x80000000U) + "abc");
  io::write_file_atomic(path, bytes);
  EXPECT_TRUE(contains(error_of<dt::FormatError>([&] { (void)io::read_idx(path); }),
                       "gzip bytes can hold"));
  // An honest file still reads.
  bytes = gzip(header(3) + "abc");
  io::write_file_atomic(path, bytes);
  EXPECT_TRUE(at::equal(io::read_idx(path), at::tensor({97, 98, 99}, at::kByte)));
}

TEST(Idx, DamagedFilesAreFormatErrors) {
  auto reject = [](std::vector<unsigned char> b) {
    return error_of<dt::FormatError>([&] { (void)io::parse_idx(b.data(), b.size(), "x.idx"); });
  };
  EXPECT_TRUE(contains(reject({1, 0, 8, 1, 0, 0, 0, 1, 5}), "first two bytes must be zero"));
  EXPECT_TRUE(contains(reject({0, 0, 0x42, 1, 0, 0, 0, 1, 5}), "unknown type code 66"));
  EXPECT_TRUE(contains(reject({0, 0, 8, 2, 0, 0, 0, 2}), "truncated header"));
  EXPECT_TRUE(
      contains(reject({0, 0, 8, 1, 0, 0, 0, 3, 5, 6}), "declares 3 values ([3]) but holds 2"));
  const std::vector<unsigned char> ints = {0, 0, 0x0C, 1, 0,    0,    0,    2,
                                           0, 0, 1,    0, 0xff, 0xff, 0xff, 0xfe};
  EXPECT_TRUE(
      at::equal(io::parse_idx(ints.data(), ints.size(), "i.idx"), at::tensor({256, -2}, at::kInt)));
  const fs::path root = "/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz";
  if (fs::exists(root)) {
    const std::vector<char> gz = io::read_file(root);
    const fs::path cut = scratch("cut.gz");
    io::write_file_atomic(cut, std::span<const char>(gz.data(), gz.size() / 2));
    EXPECT_TRUE(contains(error_of<dt::FormatError>([&] { (void)io::read_idx(cut); }), "truncated"));
  }
}

// A whole tree goes, deepest first, without std::filesystem::remove_all (which can crash in a
// program linked to the torch wheel); a link inside is removed, never followed.
TEST(RemoveTree, RemovesEverythingBelowAndNeverFollowsALink) {
  const fs::path root = scratch("remove-tree");
  const fs::path outside = scratch("remove-tree-outside.txt");
  std::ofstream(outside) << "keep me";
  fs::create_directories(root / "a" / "b" / "c");
  fs::create_directories(root / "empty");
  for (int i = 0; i < 20; ++i) std::ofstream(root / "a" / "b" / ("f" + std::to_string(i))) << i;
  std::ofstream(root / "a" / "b" / "c" / "deep.txt") << "x";
  fs::create_symlink(outside, root / "a" / "link-to-file");
  fs::create_directory_symlink(fs::temp_directory_path(), root / "a" / "link-to-folder");
  // root, a, b, c, empty; 20 files + deep.txt; 2 links
  EXPECT_EQ(io::remove_tree(root), 5U + 21U + 2U);
  EXPECT_FALSE(fs::exists(fs::symlink_status(root)));
  EXPECT_TRUE(fs::exists(outside));  // the link went, not what it pointed to
  EXPECT_TRUE(fs::exists(fs::temp_directory_path()));
  // A missing path is nothing to do; a single file or link is removed alone.
  EXPECT_EQ(io::remove_tree(root), 0U);
  const fs::path lone = scratch("remove-tree-lone.txt");
  std::ofstream(lone) << "x";
  EXPECT_EQ(io::remove_tree(lone), 1U);
  EXPECT_FALSE(fs::exists(lone));
  // What cannot go is an IoError naming it; an empty path is refused.
  const std::string msg = error_of<dt::IoError>([] { (void)io::remove_tree("/proc/self/status"); });
  EXPECT_NE(msg.find("/proc/self/status"), std::string::npos) << msg;
  EXPECT_THROW((void)io::remove_tree(""), dt::IoError);
  (void)io::remove_tree(outside);
}

// Files that are not what they claim, at every reader's door: a FIFO where a file belongs is
// refused at once (opening one for reading would wait forever for a writer), and JSON nested
// beyond any real file's depth is a FormatError before any tree is built (nlohmann's recursive
// copy, compare and dump would overflow the stack on it).
TEST(HostileFiles, FifosAndDeepJsonAreTypedErrors) {
  const fs::path dir = scratch("hostile");
  fs::create_directories(dir);
  const fs::path fifo = dir / "vocab.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_TRUE(contains(error_of<dt::IoError>([&] { (void)dt::io::read_file(fifo); }), "FIFO"));
  EXPECT_TRUE(
      contains(error_of<dt::IoError>([&] { (void)dt::io::read_json(fifo); }), "vocab.json"));
  EXPECT_TRUE(contains(error_of<dt::IoError>([&] { (void)dt::io::sha256_file(fifo); }), "FIFO"));

  // Depth: every nesting the readers refuse, for arrays, objects and their mix; 200,000 levels
  // (far past what overflowed) in a file and in a string.
  for (const std::size_t depth :
       {dt::io::kJsonMaxDepth + 1, std::size_t{100000}, std::size_t{200000}})
    for (const auto& [open, close] : {std::pair{"[", "]"}, std::pair{"{\"a\":", "}"}}) {
      std::string text;
      for (std::size_t i = 0; i < depth; ++i) text += open;
      text += "1";
      for (std::size_t i = 0; i < depth; ++i) text += close;
      EXPECT_TRUE(contains(error_of<dt::FormatError>([&] { (void)dt::io::parse_json(text, "t"); }),
                           "nests deeper than"));
      const fs::path file = dir / "config.json";
      std::ofstream(file) << text;
      EXPECT_TRUE(contains(error_of<dt::FormatError>([&] { (void)dt::io::read_json(file); }),
                           "config.json"));
    }
  // At the limit it reads; ordered_json too.
  std::string ok;
  for (std::size_t i = 0; i < dt::io::kJsonMaxDepth; ++i) ok += "[";
  for (std::size_t i = 0; i < dt::io::kJsonMaxDepth; ++i) ok += "]";
  EXPECT_NO_THROW((void)dt::io::parse_json(ok, "t"));
  EXPECT_NO_THROW((void)dt::io::parse_json<nlohmann::ordered_json>(ok, "t"));
  // A long value is quoted short.
  const std::string brief = dt::io::json_brief(nlohmann::json(std::string(5000, 'x')));
  EXPECT_LT(brief.size(), 120U);
  EXPECT_TRUE(contains(brief, "5002 characters"));
  dt::io::remove_tree(dir);
}
