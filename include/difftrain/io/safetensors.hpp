#pragma once
// safetensors: an 8-byte little-endian header length, a JSON header ({"name": {"dtype", "shape",
// "data_offsets"}, "__metadata__": {str: str}}), then the tensor bytes. Reading applies the
// format's own safety rules — header size cap, offsets in bounds, contiguous and non-overlapping,
// sizes that match dtype × shape (with overflow checks), the exact file length — and rejects
// anything else with a FormatError naming the field. Files are memory-mapped; tensors are views of
// the mapping (copy-on- write, so writing to one never touches the file) unless `copy` is asked
// for.

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/atomic_file.hpp"
#include "difftrain/io/json_parse.hpp"
#include "difftrain/io/read_file.hpp"

namespace difftrain::io {

/// The largest header the reader accepts (the format's own limit).
inline constexpr std::uint64_t kSafetensorsMaxHeader = 100'000'000;
/// A header is three levels deep (tensors, an entry, its shape); this leaves room and no more.
inline constexpr std::size_t kSafetensorsMaxDepth = 64;

namespace safetensors_detail {

struct DtypeInfo {
  const char* name;
  at::ScalarType type;
  std::size_t size;
};

inline const std::vector<DtypeInfo>& dtypes() {
  static const std::vector<DtypeInfo> table = {
      {"F64", at::kDouble, 8},
      {"F32", at::kFloat, 4},
      {"F16", at::kHalf, 2},
      {"BF16", at::kBFloat16, 2},
      {"I64", at::kLong, 8},
      {"I32", at::kInt, 4},
      {"I16", at::kShort, 2},
      {"I8", at::kChar, 1},
      {"U8", at::kByte, 1},
      {"BOOL", at::kBool, 1},
      {"U16", at::kUInt16, 2},
      {"U32", at::kUInt32, 4},
      {"U64", at::kUInt64, 8},
      {"F8_E4M3", at::kFloat8_e4m3fn, 1},
      {"F8_E5M2", at::kFloat8_e5m2, 1},
  };
  return table;
}

inline const DtypeInfo& by_name(const std::string& name, const std::string& where) {
  for (const auto& d : dtypes())
    if (name == d.name) return d;
  std::string known;
  for (const auto& d : dtypes()) known += std::string(known.empty() ? "" : ", ") + d.name;
  throw FormatError("unknown dtype '" + name + "' (known: " + known + ")", where);
}

inline const DtypeInfo& by_type(at::ScalarType t, const std::string& where) {
  for (const auto& d : dtypes())
    if (t == d.type) return d;
  throw FormatError(std::string("dtype ") + c10::toString(t) + " has no safetensors name", where);
}

/// A read-only file mapping shared by every tensor that views it.
struct Mapping {
  void* data = nullptr;
  std::size_t size = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data != nullptr && data != MAP_FAILED) ::munmap(data, size);
  }
};

/// A SAX pass over a header: no value is built; it throws at the first duplicate key within one
/// object or at nesting deeper than kSafetensorsMaxDepth. Time and memory linear in the header.
class HeaderShapeCheck : public JsonDepthCheck<> {
 public:
  explicit HeaderShapeCheck(std::string where)
      : JsonDepthCheck(kSafetensorsMaxDepth, where + ": header", "header "),
        where_(std::move(where)) {}
  bool start_object(std::size_t n) {
    JsonDepthCheck::start_object(n);
    keys_.emplace_back();
    return true;
  }
  bool key(string_t& k) {
    if (!keys_.back().insert(k).second)
      throw FormatError("header has the key '" + k + "' twice", where_ + ": header");
    return true;
  }
  bool end_object() {
    keys_.pop_back();
    return JsonDepthCheck::end_object();
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::json::exception& e) {
    throw FormatError(std::string("header is not valid JSON: ") + e.what(),
                      where_ + ": header byte " + std::to_string(8 + position));
  }

 private:
  std::string where_;
  std::vector<std::unordered_set<std::string>> keys_;  // one set per open object
};

}  // namespace safetensors_detail

struct SafetensorsFile {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

/// One tensor's entry in a validated header.
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin, end;  ///< byte offsets in the data section
};

struct SafetensorsHeader {
  std::uint64_t header_size = 0;  ///< the JSON's length; data starts at 8 + header_size
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
};

/// Validates the 8-byte length prefix against the file size and returns the JSON's length.
inline std::uint64_t safetensors_header_length(const char* prefix, std::size_t file_size,
                                               const std::string& where) {
  if (file_size < 8)
    throw FormatError(
        "is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length", where);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(prefix[i]);
  if (n > kSafetensorsMaxHeader)
    throw FormatError("header length " + std::to_string(n) + " exceeds the limit of " +
                          std::to_string(kSafetensorsMaxHeader),
                      where + ": byte 0");
  if (n > file_size - 8)
    throw FormatError("header length " + std::to_string(n) + " runs past the end of the file (" +
                          std::to_string(file_size) + " bytes)",
                      where + ": byte 0");
  return n;
}

/// Parses and validates the JSON header of a file whose data section has `data_size` bytes.
inline SafetensorsHeader parse_safetensors_header(const char* json, std::uint64_t n,
                                                  std::size_t data_size, const std::string& where) {
  using namespace safetensors_detail;
  if (n < 2 || json[0] != '{')
    throw FormatError("header does not start with '{'", where + ": byte 8");
  // Two linear passes: a SAX walk that refuses a duplicate key (the Python reader lets the last one
  // win, silently shadowing a tensor) and nesting deeper than a header needs (a shape nested
  // 100,000 brackets deep would otherwise be built in full) before anything is allocated, then the
  // plain DOM parse. (nlohmann's callback parser, which did both at once, rescans the parent
  // object at every object's end: quadratic in the number of tensors.)
  HeaderShapeCheck shape_check(where);
  try {
    nlohmann::json::sax_parse(json, json + n, &shape_check);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(std::string("header is not valid JSON: ") + e.what(), where + ": header");
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(json, json + n);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(std::string("header is not valid JSON: ") + e.what(), where + ": header");
  }
  if (!header.is_object()) throw FormatError("header is not a JSON object", where + ": header");
  SafetensorsHeader out;
  out.header_size = n;
  for (const auto& [name, entry] : header.items()) {
    const std::string at_name = where + ": tensor '" + name + "'";
    if (name == "__metadata__") {
      if (!entry.is_object())
        throw FormatError("__metadata__ must be an object of strings", where + ": __metadata__");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          throw FormatError("value of '" + k + "' is not a string", where + ": __metadata__");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets"))
      throw FormatError("needs dtype, shape and data_offsets", at_name);
    if (!entry["dtype"].is_string()) throw FormatError("dtype is not a string", at_name + " dtype");
    const DtypeInfo dt = by_name(entry["dtype"].get<std::string>(), at_name + " dtype");
    if (!entry["shape"].is_array()) throw FormatError("shape is not a list", at_name + " shape");
    std::vector<std::int64_t> shape;
    std::uint64_t count = 1;
    std::uint64_t strided = 1;  // product of the non-zero sizes: torch's strides must fit int64
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_unsigned())
        throw FormatError("dimension " + d.dump() + " is not a non-negative integer",
                          at_name + " shape");
      const std::uint64_t v = d.get<std::uint64_t>();
      if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
          (v != 0 && count > std::numeric_limits<std::uint64_t>::max() / v))
        throw FormatError("element count overflows", at_name + " shape");
      count *= v;
      if (v != 0 &&
          strided > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / v)
        throw FormatError("sizes overflow a stride (" + entry["shape"].dump() + ")",
                          at_name + " shape");
      strided *= std::max<std::uint64_t>(v, 1);
      shape.push_back(static_cast<std::int64_t>(v));
    }
    const auto& off = entry["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned())
      throw FormatError("must be [begin, end] with non-negative integers",
                        at_name + " data_offsets");
    const std::uint64_t begin = off[0].get<std::uint64_t>();
    const std::uint64_t end = off[1].get<std::uint64_t>();
    if (begin > end || end > data_size)
      throw FormatError("[" + std::to_string(begin) + ", " + std::to_string(end) +
                            "] is outside the " + std::to_string(data_size) + "-byte data section",
                        at_name + " data_offsets");
    if (count > std::numeric_limits<std::uint64_t>::max() / dt.size)
      throw FormatError("byte size overflows", at_name + " shape");
    if (end - begin != count * dt.size)
      throw FormatError("spans " + std::to_string(end - begin) + " bytes but " +
                            entry["dtype"].get<std::string>() + " × " + entry["shape"].dump() +
                            " needs " + std::to_string(count * dt.size),
                        at_name + " data_offsets");
    out.entries.push_back({name, dt.type, std::move(shape), begin, end});
  }
  // Contiguous, non-overlapping, and covering the whole data section: no hidden bytes.
  std::vector<const SafetensorsEntry*> sorted;
  for (const auto& e : out.entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const auto* a, const auto* b) {
    return a->begin < b->begin || (a->begin == b->begin && a->end < b->end);
  });
  std::uint64_t expected = 0;
  for (const auto* e : sorted) {
    if (e->begin != expected)
      throw FormatError(e->begin < expected ? "overlaps the tensor before it"
                                            : "leaves a gap before it (expected offset " +
                                                  std::to_string(expected) + ")",
                        where + ": tensor '" + e->name + "' data_offsets");
    expected = e->end;
  }
  if (expected != data_size)
    throw FormatError(
        "the data section has " + std::to_string(data_size - expected) + " bytes no tensor claims",
        where + ": end of file");
  return out;
}

/// Parses and validates a complete safetensors image (header + data) of `size` bytes. `keep` is
/// kept alive by every tensor that views `bytes`; with `copy`, tensors own their memory instead.
inline SafetensorsFile parse_safetensors(const char* bytes, std::size_t size,
                                         std::shared_ptr<void> keep, bool copy,
                                         const std::string& where) {
  const std::uint64_t n = safetensors_header_length(bytes, size, where);
  const std::size_t data_size = size - 8 - static_cast<std::size_t>(n);
  SafetensorsHeader h = parse_safetensors_header(bytes + 8, n, data_size, where);
  const char* data = bytes + 8 + n;
  SafetensorsFile out;
  out.metadata = std::move(h.metadata);
  for (auto& e : h.entries) {
    const auto opts = at::TensorOptions().dtype(e.dtype);
    at::Tensor t;
    try {
      if (copy || e.end == e.begin) {
        t = at::empty(e.shape, opts);
        if (e.end != e.begin) std::memcpy(t.data_ptr(), data + e.begin, e.end - e.begin);
      } else {
        t = at::from_blob(
            const_cast<char*>(data + e.begin), e.shape, [keep](void*) {}, opts);
      }
    } catch (const c10::Error& err) {
      throw FormatError(std::string("cannot become a tensor: ") + err.what_without_backtrace(),
                        where + ": tensor '" + e.name + "'");
    }
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

namespace safetensors_detail {
inline void pread_all(int fd, char* dst, std::size_t n, std::uint64_t offset,
                      const std::string& where) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, dst + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw IoError("read failed at byte " + std::to_string(offset + done), where);
    done += static_cast<std::size_t>(r);
  }
}
}  // namespace safetensors_detail

/// Reads a safetensors file. By default the file is memory-mapped and tensors view the mapping
/// (private: writing to a tensor never changes the file). With `copy`, every tensor gets its own
/// memory, read straight into it with pread() — no mapping, no second copy.
inline SafetensorsFile load_safetensors(const std::filesystem::path& path, bool copy = false) {
  using namespace safetensors_detail;
  const std::string where = path.string();
  struct stat st {};
  const int fd = open_for_reading(path, st);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  const auto size = static_cast<std::size_t>(st.st_size);
  if (copy) {
    char prefix[8] = {};
    if (size >= 8) pread_all(fd, prefix, 8, 0, where);
    const std::uint64_t n = safetensors_header_length(prefix, size, where);
    std::vector<char> json(static_cast<std::size_t>(n));
    pread_all(fd, json.data(), json.size(), 8, where);
    SafetensorsHeader h =
        parse_safetensors_header(json.data(), n, size - 8 - static_cast<std::size_t>(n), where);
    SafetensorsFile out;
    out.metadata = std::move(h.metadata);
    for (auto& e : h.entries) {
      at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
      if (e.end != e.begin)
        pread_all(fd, static_cast<char*>(t.data_ptr()), e.end - e.begin, 8 + n + e.begin, where);
      out.tensors.emplace(e.name, std::move(t));
    }
    return out;
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->size = size;
  if (size > 0) {
    mapping->data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (mapping->data == MAP_FAILED)
      throw IoError("cannot map the file: " + detail::errno_text(), where);
  }
  return parse_safetensors(static_cast<const char*>(mapping->data), size, mapping, false, where);
}

namespace safetensors_detail {
// The header and the order of the data: sorted by descending element size (so every tensor is
// aligned to its own element size), then by name, as Python's `safetensors` writes.
struct WritePlan {
  std::string header;  // JSON, padded with spaces to a multiple of 8 bytes
  std::vector<std::pair<std::string, at::Tensor>> order;
  std::uint64_t data_bytes = 0;
};

inline WritePlan plan_write(const std::map<std::string, at::Tensor>& tensors,
                            const std::map<std::string, std::string>& metadata) {
  WritePlan plan;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__")
      throw FormatError("'__metadata__' cannot name a tensor", "safetensors writer");
    if (!t.defined()) throw FormatError("is undefined", "safetensors writer tensor '" + name + "'");
    plan.order.emplace_back(name, t.detach());
  }
  std::stable_sort(plan.order.begin(), plan.order.end(), [](const auto& a, const auto& b) {
    const auto sa = a.second.element_size();
    const auto sb = b.second.element_size();
    return sa != sb ? sa > sb : a.first < b.first;
  });
  // The header is assembled entry by entry in the data's order (an ordered_json object looks each
  // key up linearly: quadratic in the number of tensors).
  std::string& header = plan.header;
  header = "{";
  if (!metadata.empty()) header += "\"__metadata__\":" + nlohmann::json(metadata).dump();
  for (const auto& [name, t] : plan.order) {
    const DtypeInfo dt = by_type(t.scalar_type(), "safetensors writer tensor '" + name + "'");
    const auto bytes = static_cast<std::uint64_t>(t.numel()) * dt.size;
    const nlohmann::ordered_json entry = {
        {"dtype", dt.name},
        {"shape", t.sizes().vec()},
        {"data_offsets", {plan.data_bytes, plan.data_bytes + bytes}}};
    if (header.size() > 1) header += ',';
    header += nlohmann::json(name).dump() + ":" + entry.dump();
    plan.data_bytes += bytes;
  }
  header += '}';
  plan.header.append((8 - plan.header.size() % 8) % 8, ' ');
  return plan;
}

inline std::array<char, 8> length_prefix(std::uint64_t n) {
  std::array<char, 8> out{};
  for (std::size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// One tensor's bytes, in memory order: GPU tensors and views are made contiguous on the CPU one
// at a time, so a save never holds a second copy of the whole model.
template <typename Sink>
void emit_tensor_bytes(const at::Tensor& t, Sink&& sink) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  const auto bytes = static_cast<std::size_t>(c.numel()) * c.element_size();
  if (bytes != 0) sink(std::span<const char>(static_cast<const char*>(c.data_ptr()), bytes));
}
}  // namespace safetensors_detail

/// The bytes of a safetensors file holding `tensors` (any device, any strides) and `metadata`.
inline std::vector<char> safetensors_bytes(
    const std::map<std::string, at::Tensor>& tensors,
    const std::map<std::string, std::string>& metadata = {}) {
  using namespace safetensors_detail;
  const WritePlan plan = plan_write(tensors, metadata);
  std::vector<char> out;
  out.reserve(8 + plan.header.size() + plan.data_bytes);
  const auto prefix = length_prefix(plan.header.size());
  out.insert(out.end(), prefix.begin(), prefix.end());
  out.insert(out.end(), plan.header.begin(), plan.header.end());
  for (const auto& [name, t] : plan.order)
    emit_tensor_bytes(t,
                      [&](std::span<const char> b) { out.insert(out.end(), b.begin(), b.end()); });
  return out;
}

/// Sees each piece of a file as it is written, in order (a checksum of what was written, without
/// reading the file back).
using WrittenBytes = std::function<void(std::span<const char>)>;

/// Writes a safetensors file atomically, streaming each tensor to the file (memory stays at one
/// tensor's CPU copy, not the whole file). `written`, if set, sees every byte of the file.
inline void save_safetensors(const std::filesystem::path& path,
                             const std::map<std::string, at::Tensor>& tensors,
                             const std::map<std::string, std::string>& metadata = {},
                             const WrittenBytes& written = {}) {
  using namespace safetensors_detail;
  const WritePlan plan = plan_write(tensors, metadata);
  AtomicFileWriter out(path);
  const auto put = [&](std::span<const char> b) {
    out.write(b);
    if (written) written(b);
  };
  const auto prefix = length_prefix(plan.header.size());
  put(prefix);
  put(plan.header);
  for (const auto& [name, t] : plan.order) emit_tensor_bytes(t, put);
  out.commit();
}

}  // namespace difftrain::io
