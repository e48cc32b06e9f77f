#pragma once
// What every reader of a difftrain checkpoint file checks first: the file's format name and
// version, and the JSON text it keeps its settings in. One reader, so that each kind of file (a
// trainer's checkpoint, a multi-model checkpoint, an optimizer shard) and each program that reads
// one (resume, consolidate) refuses the same damage in the same words.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "difftrain/core/error.hpp"
#include "difftrain/io/json_parse.hpp"
#include "difftrain/io/torch_file.hpp"

namespace difftrain::train {

/// The version of the checkpoint files this difftrain writes; it reads this one and older.
inline constexpr std::int64_t kCheckpointFormatVersion = 1;

/// Checks that `root` (a file's top dict) is a `format` file ("difftrain.checkpoint", ...) of a
/// version this difftrain reads. `kind` names the file in the message ("a difftrain checkpoint").
/// Anything else is a FormatError naming the file.
inline void check_checkpoint_format(const io::TorchValue& root, std::string_view format,
                                    std::string_view kind) {
  const std::string found = root.at("format").string();
  if (found != format)
    throw FormatError("is not " + std::string(kind) + " (format '" + found + "')", root.where());
  const std::int64_t version = root.at("version").integer();
  if (version > kCheckpointFormatVersion || version < 1)
    throw FormatError("has format version " + std::to_string(version) +
                          (version < 1 ? ", which no difftrain wrote"
                                       : ", newer than this difftrain reads (" +
                                             std::to_string(kCheckpointFormatVersion) + ")"),
                      root.where());
}

/// The file's "json" entry, parsed; `what` names it in the message ("settings", "names").
[[nodiscard]] inline nlohmann::json checkpoint_json(const io::TorchValue& root,
                                                    std::string_view what) {
  return io::parse_json(root.at("json").string(), root.where() + " " + std::string(what));
}

}  // namespace difftrain::train
