#pragma once
// A JSON file read whole and parsed, with the errors every reader of one gives: a file that cannot
// be read is an IoError naming it, text that is not JSON a FormatError naming the file and where
// the parser stopped (parse_json: nesting bounded). Model folders, pipeline indexes, tokenizer
// files, scheduler configs and consolidate's config all read their files through it.

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/json_parse.hpp"
#include "difftrain/io/read_file.hpp"

namespace difftrain::io {

/// `file` parsed as JSON (any value at the top).
inline nlohmann::json read_json(const std::filesystem::path& file) {
  const std::vector<char> bytes = read_file(file);
  return parse_json(std::string_view(bytes.data(), bytes.size()), file.string());
}

/// `file` parsed as JSON whose top is an object (a config, an index): anything else is a
/// FormatError naming the file.
inline nlohmann::json read_json_object(const std::filesystem::path& file) {
  nlohmann::json j = read_json(file);
  if (!j.is_object()) throw FormatError("is not a JSON object", file.string());
  return j;
}

}  // namespace difftrain::io
