#pragma once
// Files that Python's torch.save / torch.load(weights_only=True) exchange with LibTorch: a dict of
// strings to numbers, bools, strings, tensors and nested dicts, in torch's zip pickle format.
// Anything else in a file is a FormatError naming the key, never a crash.

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/atomic_file.hpp"
#include "difftrain/io/pickle_reader.hpp"
#include "difftrain/io/read_file.hpp"

namespace difftrain::io {

/// JSON scalars (and nested objects/arrays of them) as an IValue torch.load understands.
inline c10::IValue to_ivalue(const nlohmann::json& j, const std::string& where) {
  switch (j.type()) {
    case nlohmann::json::value_t::boolean:
      return c10::IValue(j.get<bool>());
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
      return c10::IValue(j.get<std::int64_t>());
    case nlohmann::json::value_t::number_float:
      return c10::IValue(j.get<double>());
    case nlohmann::json::value_t::string:
      return c10::IValue(j.get<std::string>());
    case nlohmann::json::value_t::object: {
      c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
      for (const auto& [k, v] : j.items()) d.insert(k, to_ivalue(v, where + "." + k));
      return c10::IValue(d);
    }
    case nlohmann::json::value_t::array: {
      c10::impl::GenericList l(c10::AnyType::get());
      for (const auto& v : j) l.push_back(to_ivalue(v, where));
      return c10::IValue(l);
    }
    default:
      throw FormatError("cannot be stored (null or binary)", where);
  }
}

/// An IValue read from a file back as JSON; tensors are not JSON and are refused here.
inline nlohmann::json to_json(const c10::IValue& v, const std::string& where) {
  if (v.isBool()) return v.toBool();
  if (v.isInt()) return v.toInt();
  if (v.isDouble()) return v.toDouble();
  if (v.isString()) return v.toStringRef();
  if (v.isNone()) return nullptr;
  if (v.isGenericDict()) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& item : v.toGenericDict()) {
      if (!item.key().isString()) throw FormatError("has a key that is not a string", where);
      out[item.key().toStringRef()] = to_json(item.value(), where + "." + item.key().toStringRef());
    }
    return out;
  }
  if (v.isList()) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& e : v.toListRef()) out.push_back(to_json(e, where));
    return out;
  }
  throw FormatError(
      "holds a " + v.tagKind() + " where a number, bool, string, list or dict was expected", where);
}

/// A dict of named tensors as an IValue.
inline c10::IValue to_ivalue(const std::map<std::string, at::Tensor>& tensors) {
  c10::Dict<std::string, at::Tensor> d;
  for (const auto& [k, t] : tensors) d.insert(k, t.detach().cpu().contiguous());
  return c10::IValue(d);
}

/// A dict IValue of named tensors; anything else (or a non-string key) is a FormatError.
inline std::map<std::string, at::Tensor> to_tensor_map(const c10::IValue& v,
                                                       const std::string& where) {
  if (!v.isGenericDict())
    throw FormatError("must be a dict of name → tensor, got " + v.tagKind(), where);
  std::map<std::string, at::Tensor> out;
  for (const auto& item : v.toGenericDict()) {
    if (!item.key().isString()) throw FormatError("has a key that is not a string", where);
    const std::string& name = item.key().toStringRef();
    if (!item.value().isTensor())
      throw FormatError("entry '" + name + "' is a " + item.value().tagKind() + ", not a tensor",
                        where);
    out.emplace(name, item.value().toTensor());
  }
  return out;
}

/// `value` in torch.save's zip format. Unlike torch::jit::pickle_save this leaves out TorchScript's
/// type tags on dicts and lists, which torch.load(weights_only=True) refuses as unsafe globals.
inline std::vector<char> torch_save_bytes(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* buf, std::size_t size) { pickled.insert(pickled.end(), buf, buf + size); },
      nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, std::size_t size) {
    const auto* bytes = static_cast<const char*>(data);
    out.insert(out.end(), bytes, bytes + size);
    return size;
  });
  std::size_t i = 0;
  for (const at::Tensor& t : pickler.tensorData()) {
    const torch::jit::WriteableTensorData w = torch::jit::getWriteableTensorData(t);
    writer.writeRecord("data/" + std::to_string(i++), w.data(), w.sizeInBytes());
  }
  writer.writeRecord("data.pkl", pickled.data(), pickled.size());
  writer.writeEndOfFile();
  return out;
}

/// Writes `value` as torch.save would, atomically.
inline void save_pickle(const std::filesystem::path& path, const c10::IValue& value) {
  write_file_atomic(path, torch_save_bytes(value));
}

/// Parses torch.save bytes (named `where` in errors) with the weights-only reader of
/// pickle_reader.hpp; anything it does not accept is a FormatError.
inline c10::IValue load_pickle_bytes(
    const std::vector<char>& bytes, const std::string& where,
    pickle_detail::ObjectPolicy objects = pickle_detail::ObjectPolicy::refuse) {
  return read_torch_archive(bytes, where, objects);
}

/// Reads a torch.save file. A file LibTorch cannot parse is a FormatError naming it.
inline c10::IValue load_pickle(const std::filesystem::path& path) {
  return load_pickle_bytes(read_file(path), path.string());
}

}  // namespace difftrain::io
