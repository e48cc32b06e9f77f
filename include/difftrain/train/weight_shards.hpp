#pragma once
// The weights of a sharded checkpoint set: beside `checkpoint-K.pt` and each rank's optimizer
// shard `checkpoint-K.pt.shard-R-of-N`, each rank writes the parameters it steps (their masters'
// values) and, when it keeps the EMA of them, their shadows under "ema:<name>", in
// `checkpoint-K.pt.shard-R-of-N.safetensors`. Every rank writes its own in parallel: no rank
// gathers the model to save it. Rank 0's file records each one's size and CRC-32, so a damaged or
// foreign file is refused before anything loads from it, and the names, dtypes and shapes of what
// they hold, so the model can be written out as one file without reading them twice
// (train/consolidate.hpp).

#include <ATen/ATen.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/read_file.hpp"
#include "difftrain/io/safetensors.hpp"

namespace difftrain::train {

/// The prefix of an EMA shadow's name in a weights shard.
inline constexpr std::string_view kEmaPrefix = "ema:";

/// Rank `rank`'s weights beside checkpoint `path`.
[[nodiscard]] inline std::filesystem::path weight_shard_path(const std::filesystem::path& path,
                                                             std::int64_t rank,
                                                             std::int64_t world) {
  return path.string() + ".shard-" + std::to_string(rank) + "-of-" + std::to_string(world) +
         ".safetensors";
}

/// What rank 0's index says of one weights shard.
struct WeightShardRecord {
  std::uint64_t bytes = 0;
  std::uint32_t crc32 = 0;
};

/// CRC-32 of a whole file, read in pieces (the file is not held in memory).
[[nodiscard]] inline std::uint32_t file_crc32(const std::filesystem::path& path,
                                              std::uint64_t* size = nullptr) {
  struct stat st {};
  const int fd = io::open_for_reading(path, st);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  std::vector<Bytef> buffer(std::size_t{4} << 20);
  uLong c = crc32(0L, Z_NULL, 0);
  std::uint64_t at = 0;
  const auto total = static_cast<std::uint64_t>(st.st_size);
  while (at < total) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), total - at));
    io::safetensors_detail::pread_all(fd, reinterpret_cast<char*>(buffer.data()), n, at,
                                      path.string());
    c = crc32(c, buffer.data(), static_cast<uInt>(n));
    at += n;
  }
  if (size != nullptr) *size = total;
  return static_cast<std::uint32_t>(c);
}

/// Writes one rank's weights shard atomically and returns its record for the index.
inline WeightShardRecord write_weight_shard(const std::filesystem::path& file,
                                            const std::map<std::string, at::Tensor>& tensors,
                                            std::int64_t step, std::int64_t rank,
                                            std::int64_t world) {
  // The record's CRC-32 and size are taken from the bytes as they go out: a shard of a large model
  // is not read back after it is written.
  WeightShardRecord r;
  uLong crc = crc32_z(0L, Z_NULL, 0);
  io::save_safetensors(file, tensors,
                       {{"format", "difftrain.weights_shard"},
                        {"step", std::to_string(step)},
                        {"rank", std::to_string(rank)},
                        {"world_size", std::to_string(world)}},
                       [&](std::span<const char> b) {
                         crc = crc32_z(crc, reinterpret_cast<const Bytef*>(b.data()), b.size());
                         r.bytes += b.size();
                       });
  r.crc32 = static_cast<std::uint32_t>(crc);
  return r;
}

/// Reads rank `rank`'s weights shard of the checkpoint of `step` (memory-mapped: a tensor is
/// read when it is used), checked against its record: a missing file is an IoError; another
/// size, a failed CRC-32 or another checkpoint's shard is a FormatError naming the file.
[[nodiscard]] inline io::SafetensorsFile read_weight_shard(const std::filesystem::path& file,
                                                           const WeightShardRecord& want,
                                                           std::int64_t step, std::int64_t rank,
                                                           std::int64_t world) {
  const std::string where = file.string();
  std::uint64_t size = 0;
  const std::uint32_t crc = file_crc32(file, &size);
  if (size != want.bytes)
    throw FormatError("has " + std::to_string(size) + " bytes, the checkpoint's index says " +
                          std::to_string(want.bytes),
                      where);
  if (crc != want.crc32)
    throw FormatError("fails its CRC-32 check against the checkpoint's index", where);
  io::SafetensorsFile f = io::load_safetensors(file);
  const auto meta = [&](const char* key) {
    const auto it = f.metadata.find(key);
    return it == f.metadata.end() ? std::string("(missing)") : it->second;
  };
  if (meta("format") != "difftrain.weights_shard")
    throw FormatError("is not a shard of a checkpoint's weights", where);
  if (meta("step") != std::to_string(step) || meta("rank") != std::to_string(rank) ||
      meta("world_size") != std::to_string(world))
    throw FormatError("belongs to another checkpoint (step " + meta("step") + ", rank " +
                          meta("rank") + " of " + meta("world_size") + "; expected step " +
                          std::to_string(step) + ", rank " + std::to_string(rank) + " of " +
                          std::to_string(world) + ")",
                      where);
  return f;
}

/// The records of a checkpoint index's "weights" entry (one per rank), checked for shape.
[[nodiscard]] inline std::vector<WeightShardRecord> weight_shard_records(
    const nlohmann::json& weights, std::int64_t world, const std::string& where) {
  if (!weights.is_object() || !weights.contains("files") || !weights["files"].is_array() ||
      static_cast<std::int64_t>(weights["files"].size()) != world)
    throw FormatError("does not list one weights file per rank", where);
  std::vector<WeightShardRecord> out;
  for (const auto& f : weights["files"]) {
    if (!f.is_object() || !f.contains("bytes") || !f["bytes"].is_number_unsigned() ||
        !f.contains("crc32") || !f["crc32"].is_number_unsigned())
      throw FormatError("has a weights file without its size and CRC-32", where);
    out.push_back({f["bytes"].get<std::uint64_t>(), f["crc32"].get<std::uint32_t>()});
  }
  return out;
}

/// Every rank's weights file of the set whose rank-0 file is `checkpoint`, as its index (the
/// checkpoint's "sharding" entry) lists them, each checked (read_weight_shard): the parameters
/// go into `model`, their EMA shadows into `shadows` (nullptr: passed over). A name two files
/// hold is a FormatError.
inline void read_weight_shards(const std::filesystem::path& checkpoint, const nlohmann::json& index,
                               std::int64_t step, const std::string& where,
                               std::map<std::string, at::Tensor>& model,
                               std::map<std::string, at::Tensor>* shadows) {
  if (!index.contains("world_size") || !index["world_size"].is_number_integer())
    throw FormatError("has no world size", where + " json sharding");
  const auto world = index["world_size"].get<std::int64_t>();
  const auto records = weight_shard_records(index["weights"], world, where + " json sharding");
  for (std::int64_t r = 0; r < world; ++r) {
    const auto file = weight_shard_path(checkpoint, r, world);
    io::SafetensorsFile f =
        read_weight_shard(file, records[static_cast<std::size_t>(r)], step, r, world);
    for (auto& [name, t] : f.tensors) {
      const bool shadow = name.starts_with(kEmaPrefix);
      if (shadow && shadows == nullptr) continue;
      auto& into = shadow ? *shadows : model;
      if (!into.emplace(shadow ? name.substr(kEmaPrefix.size()) : name, t).second)
        throw FormatError("holds '" + name + "', which another file of the set holds too",
                          file.string());
    }
  }
}

}  // namespace difftrain::train
