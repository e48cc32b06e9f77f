#include <difftrain/io/read_file.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/train/weight_shards.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <vector>

#include "golden.hpp"

namespace dt = difftrain;
namespace io = difftrain::io;
namespace tst = difftrain::test;

namespace {

std::filesystem::path golden_path(const char* name) {
  return std::filesystem::path(DIFFTRAIN_GOLDEN_DIR) / name;
}

std::map<std::string, at::Tensor> expected_tensors() {
  std::map<std::string, at::Tensor> out;
  const std::map<std::string, at::ScalarType> types = {{"f64", at::kDouble},
                                                       {"f32", at::kFloat},
                                                       {"f16", at::kHalf},
                                                       {"bf16", at::kBFloat16},
                                                       {"i64", at::kLong},
                                                       {"i32", at::kInt},
                                                       {"i16", at::kShort},
                                                       {"i8", at::kChar},
                                                       {"u8", at::kByte},
                                                       {"bool", at::kBool},
                                                       {"f8_e4m3", at::kFloat8_e4m3fn},
                                                       {"f8_e5m2", at::kFloat8_e5m2},
                                                       {"empty", at::kFloat},
                                                       {"scalar", at::kFloat},
                                                       {"down.blocks.0.to_q.weight", at::kFloat}};
  for (const auto& [name, ref] : tst::golden("safetensors.json").items())
    out[name] = tst::tensor_from(ref["values"], {})
                    .reshape(tst::shape_from(ref["shape"]))
                    .to(types.at(name));
  return out;
}

// A file image with a hand-written header, for the hostile cases.
std::vector<char> image(const std::string& header, std::size_t data_bytes,
                        std::uint64_t declared = 0) {
  std::vector<char> out(8 + header.size() + data_bytes, 0);
  const std::uint64_t n = declared != 0 ? declared : header.size();
  for (int i = 0; i < 8; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

std::string rejection(const std::vector<char>& bytes) {
  try {
    (void)io::parse_safetensors(bytes.data(), bytes.size(), nullptr, true, "t.safetensors");
  } catch (const dt::FormatError& e) {
    return e.what();
  }
  return "accepted";
}

}  // namespace

TEST(Safetensors, ReadsAFileWrittenByPython) {
  const auto file = io::load_safetensors(golden_path("python.safetensors"));
  EXPECT_EQ(file.metadata.at("format"), "pt");
  EXPECT_EQ(file.metadata.at("ss_network_dim"), "4");
  const auto want = expected_tensors();
  ASSERT_EQ(file.tensors.size(), want.size());
  for (const auto& [name, t] : want) {
    SCOPED_TRACE(name);
    const at::Tensor& got = file.tensors.at(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type());
    EXPECT_EQ(got.sizes(), t.sizes());
    EXPECT_TRUE(at::equal(got.to(at::kDouble), t.to(at::kDouble)));
  }
  // Views of a private mapping: writing to one changes neither the file nor a second read.
  at::Tensor view = file.tensors.at("f32");
  view.fill_(0);
  EXPECT_FALSE(
      at::equal(io::load_safetensors(golden_path("python.safetensors")).tensors.at("f32"), view));
}

TEST(Safetensors, RoundTripsEveryDtype) {
  const auto want = expected_tensors();
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"ss_network_dim", "4"}};
  const auto path = std::filesystem::temp_directory_path() / "difftrain_roundtrip.safetensors";
  io::save_safetensors(path, want, meta);
  if (const char* out = std::getenv("DIFFTRAIN_SAFETENSORS_OUT"))
    io::save_safetensors(out, want, meta);
  for (bool copy : {false, true}) {
    const auto back = io::load_safetensors(path, copy);
    EXPECT_EQ(back.metadata, meta);
    for (const auto& [name, t] : want)
      EXPECT_TRUE(at::equal(back.tensors.at(name).to(at::kDouble), t.to(at::kDouble))) << name;
  }
}

// A writer that checksums what it writes (a checkpoint's weights shard) sees the file's bytes,
// every one and in order, so its record matches a read-back of the file.
TEST(Safetensors, WrittenBytesAreTheFileAndAShardRecordMatchesItsFile) {
  auto tensors = expected_tensors();
  tensors.emplace("strided", at::arange(24, at::kFloat).reshape({4, 6}).t());  // not contiguous
  const auto dir = std::filesystem::temp_directory_path() / "difftrain_written_bytes";
  std::filesystem::create_directories(dir);
  std::vector<char> seen;
  std::size_t pieces = 0;
  io::save_safetensors(dir / "a.safetensors", tensors, {{"k", "v"}}, [&](std::span<const char> b) {
    seen.insert(seen.end(), b.begin(), b.end());
    ++pieces;
  });
  EXPECT_EQ(seen, io::read_file(dir / "a.safetensors"));
  EXPECT_GT(pieces, tensors.size());  // streamed: length, header, then a piece per tensor
  for (const std::int64_t rank : {0, 1}) {
    const auto file = dir / ("shard" + std::to_string(rank) + ".safetensors");
    const dt::train::WeightShardRecord r = dt::train::write_weight_shard(file, tensors, 9, rank, 2);
    std::uint64_t size = 0;
    EXPECT_EQ(r.crc32, dt::train::file_crc32(file, &size));
    EXPECT_EQ(r.bytes, size);
    EXPECT_EQ(r.bytes, std::filesystem::file_size(file));
    const auto back = dt::train::read_weight_shard(file, r, 9, rank, 2);  // its own checks pass
    EXPECT_TRUE(at::equal(back.tensors.at("strided"), tensors.at("strided")));
  }
  io::remove_tree(dir);
}

TEST(Safetensors, HostileFilesAreFormatErrorsNamingTheField) {
  const auto has = [](const std::string& msg, const char* part) {
    return msg.find(part) != std::string::npos ? ::testing::AssertionSuccess()
                                               : ::testing::AssertionFailure() << msg;
  };
  EXPECT_TRUE(has(rejection({'a', 'b'}), "shorter than the 8-byte header length"));
  EXPECT_TRUE(has(rejection(image("{}", 0, 200'000'000)), "exceeds the limit"));
  EXPECT_TRUE(has(rejection(image("{}", 0, 5000)), "runs past the end"));
  EXPECT_TRUE(has(rejection(image("[1]     ", 0)), "does not start with '{'"));
  EXPECT_TRUE(has(rejection(image("{\"a\": ", 0)), "not valid JSON"));
  EXPECT_TRUE(has(rejection(image(R"({"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", 4)),
                  "unknown dtype 'F33'"));
  EXPECT_TRUE(has(rejection(image(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4)),
                  "tensor 'a' shape"));
  EXPECT_TRUE(has(rejection(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4)),
                  "needs 8"));
  EXPECT_TRUE(has(rejection(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", 4)),
                  "outside the 4-byte"));
  EXPECT_TRUE(has(rejection(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4)),
                  "data_offsets"));
  EXPECT_TRUE(has(
      rejection(image(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
          8)),
      "overlaps"));
  EXPECT_TRUE(
      has(rejection(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)), "gap"));
  EXPECT_TRUE(has(rejection(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 12)),
                  "no tensor claims"));
  EXPECT_TRUE(has(
      rejection(image(
          R"({"a":{"dtype":"U8","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}})", 4)),
      "overflows"));
  EXPECT_TRUE(has(rejection(image(R"({"__metadata__":{"x":1.5}})", 0)), "__metadata__"));
  // Duplicate keys (the Python reader keeps the last, shadowing a tensor) and deep nesting (a
  // shape 100,000 brackets deep used to be built in full and crash on the way down).
  EXPECT_TRUE(has(
      rejection(image(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
          4)),
      "key 'a' twice"));
  EXPECT_TRUE(has(rejection(image(R"({"__metadata__":{"k":"1","k":"2"}})", 0)), "key 'k' twice"));
  const std::string deep = R"({"a":{"dtype":"F32","shape":)" + std::string(100'000, '[') +
                           std::string(100'000, ']') + R"(,"data_offsets":[0,4]}})";
  EXPECT_TRUE(has(rejection(image(deep, 4)), "nests deeper than 64"));
  EXPECT_TRUE(has(rejection(image(R"({"a":{"dtype":"F32","shape":[1]}})", 4)),
                  "needs dtype, shape and data_offsets"));
  EXPECT_THROW((void)io::load_safetensors("/nonexistent/file.safetensors"), dt::IoError);
  EXPECT_THROW(io::save_safetensors(std::filesystem::temp_directory_path() / "x.safetensors",
                                    {{"c", at::zeros({2}, at::kComplexFloat)}}),
               dt::FormatError);
}

TEST(Safetensors, AFailedWriteLeavesTheOldFile) {
  const auto path = std::filesystem::temp_directory_path() / "difftrain_atomic.safetensors";
  io::save_safetensors(path, {{"w", at::ones({3})}});
  // A tensor the writer cannot encode fails before anything is renamed into place.
  EXPECT_THROW(io::save_safetensors(
                   path, {{"w", at::zeros({3})}, {"z", at::zeros({1}, at::kComplexDouble)}}),
               dt::FormatError);
  EXPECT_TRUE(at::equal(io::load_safetensors(path).tensors.at("w"), at::ones({3})));
}

// A header with 200,000 entries (a 13 MB file of empty tensors, and one of one-element tensors
// written by difftrain's own writer) reads in time linear in its size: the reader once rescanned
// the whole object at each entry's end (20,000 entries took 4 s, 200,000 more than 600 s; Python
// reads them in 4). The duplicate-key and depth checks still hold at that size.
TEST(Safetensors, HeadersWithManyEntriesParseInLinearTime) {
  constexpr int kEntries = 200'000;
  std::string header = "{";
  for (int i = 0; i < kEntries; ++i)
    header += (i ? ",\"t" : "\"t") + std::to_string(i) +
              "\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}";
  header += "}";
  const std::vector<char> bytes = image(header, 0);
  const auto file = io::parse_safetensors(bytes.data(), bytes.size(), nullptr, true, "big");
  EXPECT_EQ(file.tensors.size(), static_cast<std::size_t>(kEntries));
  EXPECT_EQ(file.tensors.at("t199999").numel(), 0);

  std::string twice = header;
  twice.back() = ',';
  twice += "\"t7\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}";
  EXPECT_NE(rejection(image(twice, 0)).find("'t7' twice"), std::string::npos);

  std::map<std::string, at::Tensor> many;
  for (int i = 0; i < kEntries; ++i) many["w." + std::to_string(i)] = at::full({1}, float(i));
  const std::vector<char> written = io::safetensors_bytes(many, {{"format", "pt"}});
  const auto back = io::parse_safetensors(written.data(), written.size(), nullptr, true, "written");
  ASSERT_EQ(back.tensors.size(), many.size());
  EXPECT_EQ(back.metadata.at("format"), "pt");
  EXPECT_EQ(back.tensors.at("w.123456").item<float>(), 123456.0f);
}
