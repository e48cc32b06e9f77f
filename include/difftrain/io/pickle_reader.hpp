#pragma once
// A reader for torch.save's zip archives that accepts what torch.load(weights_only=True) accepts
// and nothing more. LibTorch's own unpickler turns every `collections.OrderedDict` into None (it
// expects them only as a tensor's empty hook dict), so it cannot read a plain `state_dict()` file;
// this one builds them as dicts. Every length, memo index, argument count and tensor extent is
// checked against the input, so a hostile file ends in a FormatError that names the byte offset.
//
// Nesting is bounded (kMaxNesting levels) and so is the expanded size of the value (kMaxNodes, with
// every memo reuse counted where it lands, so a DAG that shares sub-objects cannot grow
// exponentially); a refused value is taken apart iteratively, so deep nesting cannot overflow the
// stack in its destructors either. The zip container is read by ZipArchive, which checks every
// record's CRC-32.
//
// Allowed Python globals: collections.OrderedDict, torch._utils._rebuild_tensor_v2,
// torch._utils._rebuild_parameter, torch.<Type>Storage, _codecs.encode (protocol-2 bytes).
//
// Training checkpoints (DeepSpeed's `mp_rank_00_model_states.pt`, Lightning's `.ckpt`) also hold
// objects beside the weights: an argparse.Namespace of the run's arguments, numpy random states,
// sets. With ObjectPolicy::inert such an object is read as an inert placeholder (the string
// kInertTag + "module.name"; its constructor arguments and state are dropped, nothing is ever
// called), so the tensors around it can be read; the default refuses them as torch.load
// (weights_only=True) does.

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/zip_archive.hpp"

namespace difftrain::io {

namespace pickle_detail {

inline constexpr int kMaxNesting = 64;               // containers inside containers
inline constexpr std::uint64_t kMaxNodes = 1 << 22;  // values reached, shared ones each time

// Drops `values` without recursion: a container held only here hands its elements to the work
// list before it is released, so no destructor sees more than one level. A value also held
// elsewhere loses one reference; whoever drops the last one does the same.
inline void release_iteratively(std::vector<c10::IValue> work) {
  while (!work.empty()) {
    c10::IValue v = std::move(work.back());
    work.pop_back();
    if (v.use_count() != 1) continue;
    if (v.isTuple()) {
      auto t = std::move(v).toTuple();
      for (const auto& e : t->elements()) work.push_back(e);
      t->setElements(std::vector<c10::IValue>{});
    } else if (v.isList()) {
      auto l = std::move(v).toList();
      for (const auto& e : l) work.push_back(e);
      l.clear();
    } else if (v.isGenericDict()) {
      auto d = std::move(v).toGenericDict();
      for (const auto& item : d) work.push_back(item.value());
      d.clear();
    }
  }
}

// Walks `root` without recursion and refuses nesting deeper than kMaxNesting or more than
// kMaxNodes values reached (a shared value counts every time it is reached).
inline void check_shape_of_value(const c10::IValue& root, const std::string& where) {
  std::vector<std::pair<const c10::IValue*, int>> todo{{&root, 0}};
  std::uint64_t reached = 0;
  while (!todo.empty()) {
    const auto [v, depth] = todo.back();
    todo.pop_back();
    if (++reached > kMaxNodes)
      throw FormatError("pickle expands to more than " + std::to_string(kMaxNodes) +
                            " values (shared sub-objects count each time they are used)",
                        where);
    const bool container = v->isTuple() || v->isList() || v->isGenericDict();
    if (!container) continue;
    if (depth >= kMaxNesting)
      throw FormatError(
          "pickle nests containers more than " + std::to_string(kMaxNesting) + " levels deep",
          where);
    if (v->isTuple()) {
      for (const auto& e : v->toTupleRef().elements()) todo.emplace_back(&e, depth + 1);
    } else if (v->isList()) {
      for (const auto& e : v->toListRef()) todo.emplace_back(&e, depth + 1);
    } else {
      for (const auto& item : v->toGenericDict()) todo.emplace_back(&item.value(), depth + 1);
    }
  }
}

inline std::optional<at::ScalarType> storage_dtype(const std::string& name) {
  static const std::map<std::string, at::ScalarType> kTypes = {
      {"DoubleStorage", at::kDouble},
      {"FloatStorage", at::kFloat},
      {"HalfStorage", at::kHalf},
      {"BFloat16Storage", at::kBFloat16},
      {"LongStorage", at::kLong},
      {"IntStorage", at::kInt},
      {"ShortStorage", at::kShort},
      {"CharStorage", at::kChar},
      {"ByteStorage", at::kByte},
      {"BoolStorage", at::kBool},
      {"ComplexFloatStorage", at::kComplexFloat},
      {"ComplexDoubleStorage", at::kComplexDouble},
      {"Float8_e4m3fnStorage", at::kFloat8_e4m3fn},
      {"Float8_e5m2Storage", at::kFloat8_e5m2},
      {"UntypedStorage", at::kByte}};
  const auto it = kTypes.find(name);
  if (it == kTypes.end()) return std::nullopt;
  return it->second;
}

// One stack entry: a value, a Python global, or a MARK. A global can also be used as a value (a
// storage type inside a persistent id, a dtype such as torch.float32 in a dict): its value is then
// the dotted name, with kStorageTag in front for storage types.
inline constexpr char kStorageTag = '\x01';
inline constexpr char kInertTag = '\x02';  // an object of a class that is not allowed (inert mode)

enum class ObjectPolicy { refuse, inert };
struct Item {
  enum class Kind { value, global, mark } kind = Kind::value;
  c10::IValue value;
  std::string global;  // "module name"
};

class Unpickler {
 public:
  Unpickler(std::string_view data, const ZipArchive& archive, std::string where,
            ObjectPolicy objects = ObjectPolicy::refuse)
      : data_(data), archive_(archive), where_(std::move(where)), objects_(objects) {}
  Unpickler(const Unpickler&) = delete;
  Unpickler& operator=(const Unpickler&) = delete;
  // What a refused file left on the stack and in the memo may be nested arbitrarily deep.
  ~Unpickler() {
    std::vector<c10::IValue> left;
    for (auto& item : stack_) left.push_back(std::move(item.value));
    for (auto& [key, item] : memo_) left.push_back(std::move(item.value));
    stack_.clear();
    memo_.clear();
    release_iteratively(std::move(left));
  }

  c10::IValue run() {
    while (true) {
      const std::size_t at = pos_;
      const auto op = static_cast<unsigned char>(read(1)[0]);
      if (op == '.') break;  // STOP
      step(op, at);
    }
    if (stack_.size() != 1 || stack_.back().kind != Item::Kind::value)
      fail("does not end with exactly one value on the stack", pos_);
    c10::IValue out = std::move(stack_.back().value);
    stack_.pop_back();
    try {
      check_shape_of_value(out, where_);
    } catch (...) {
      std::vector<c10::IValue> refused;  // not a braced list: that would copy, not move
      refused.push_back(std::move(out));
      release_iteratively(std::move(refused));
      throw;
    }
    return out;
  }

 private:
  [[noreturn]] void fail(const std::string& what, std::size_t at) const {
    throw FormatError("pickle " + what + " (byte " + std::to_string(at) + ")", where_);
  }

  std::string_view read(std::size_t n) {
    if (n > data_.size() - pos_) fail("is truncated", pos_);
    const std::string_view out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  template <typename T>
  T read_le() {
    T v{};
    std::memcpy(&v, read(sizeof(T)).data(), sizeof(T));
    return v;
  }
  std::string_view read_line() {
    const auto nl = data_.find('\n', pos_);
    if (nl == std::string_view::npos) fail("is truncated (no end of line)", pos_);
    const std::string_view out = data_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return out;
  }

  Item pop(std::size_t at) {
    if (stack_.empty() || stack_.back().kind == Item::Kind::mark) fail("pops an empty stack", at);
    Item out = std::move(stack_.back());
    stack_.pop_back();
    return out;
  }
  c10::IValue pop_value(std::size_t at) { return pop(at).value; }
  std::vector<c10::IValue> pop_to_mark(std::size_t at) {
    std::size_t m = stack_.size();
    while (m > 0 && stack_[m - 1].kind != Item::Kind::mark) --m;
    if (m == 0) fail("has no MARK to pop to", at);
    std::vector<c10::IValue> out;
    for (std::size_t i = m; i < stack_.size(); ++i) out.push_back(stack_[i].value);
    stack_.resize(m - 1);
    return out;
  }
  void push(c10::IValue v) { stack_.push_back(Item{Item::Kind::value, std::move(v), {}}); }
  Item& top(std::size_t at) {
    if (stack_.empty() || stack_.back().kind == Item::Kind::mark) fail("reads an empty stack", at);
    return stack_.back();
  }

  static c10::IValue tuple(std::vector<c10::IValue> v) {
    return c10::ivalue::Tuple::create(std::move(v));
  }

  void step(unsigned char op, std::size_t at) {
    switch (op) {
      case 0x80:
        read(1);
        break;      // PROTO
      case 0x95: {  // FRAME: the length of the frame that follows, which must be there
        const auto frame = read_le<std::uint64_t>();
        const std::size_t left = data_.size() - pos_;
        if (frame > left)
          fail("has a FRAME of " + std::to_string(frame) + " bytes with " + std::to_string(left) +
                   " bytes of pickle left (Python's unpickler refuses it: pickle exhausted "
                   "before end of frame)",
               at);
        break;
      }
      case '(':
        stack_.push_back(Item{Item::Kind::mark, {}, {}});
        break;
      case '}':
        push(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get()));
        break;
      case ']':
        push(c10::impl::GenericList(c10::AnyType::get()));
        break;
      case ')':
        push(tuple({}));
        break;
      case 'N':
        push(c10::IValue());
        break;
      case 0x88:
        push(true);
        break;
      case 0x89:
        push(false);
        break;
      case 'K':
        push(std::int64_t{static_cast<unsigned char>(read(1)[0])});
        break;
      case 'M':
        push(std::int64_t{read_le<std::uint16_t>()});
        break;
      case 'J':
        push(std::int64_t{read_le<std::int32_t>()});
        break;
      case 0x8a: {  // LONG1: little-endian two's complement
        const auto n = static_cast<unsigned char>(read(1)[0]);
        if (n > 8 && objects_ == ObjectPolicy::inert) {
          read(n);
          push(std::string(1, kInertTag) + "int");
          break;
        }
        if (n > 8) fail("has an integer wider than 64 bits", at);
        const std::string_view b = read(n);
        std::uint64_t v = 0;
        for (std::size_t i = 0; i < n; ++i)
          v |= std::uint64_t{static_cast<unsigned char>(b[i])} << (8 * i);
        if (n > 0 && n < 8 && (static_cast<unsigned char>(b[n - 1]) & 0x80))
          v |= ~std::uint64_t{0} << (8 * n);
        push(static_cast<std::int64_t>(v));
        break;
      }
      case 'G': {  // BINFLOAT: big-endian double
        std::uint64_t bits = 0;
        for (char c : read(8)) bits = (bits << 8) | static_cast<unsigned char>(c);
        push(std::bit_cast<double>(bits));
        break;
      }
      case 'X':
        push(std::string(read(read_le<std::uint32_t>())));
        break;  // BINUNICODE
      case 0x8c:
        push(std::string(read(static_cast<unsigned char>(read(1)[0]))));
        break;  // SHORT_BINUNICODE
      case 0x8d:
        push(std::string(read(checked_size(read_le<std::uint64_t>(), at))));
        break;
      case 'T':
        push(std::string(read(checked_size(read_le<std::uint32_t>(), at))));
        break;  // BINSTRING
      case 'U':
        push(std::string(read(static_cast<unsigned char>(read(1)[0]))));
        break;
      case 'B':
        push(std::string(read(checked_size(read_le<std::uint32_t>(), at))));
        break;  // BINBYTES
      case 'C':
        push(std::string(read(static_cast<unsigned char>(read(1)[0]))));
        break;
      case 'q':
        memo_put(static_cast<unsigned char>(read(1)[0]), at);
        break;  // BINPUT
      case 'r':
        memo_put(read_le<std::uint32_t>(), at);
        break;  // LONG_BINPUT
      case 0x94:
        memo_put(static_cast<std::uint32_t>(memo_.size()), at);
        break;  // MEMOIZE
      case 'h':
        memo_get(static_cast<unsigned char>(read(1)[0]), at);
        break;  // BINGET
      case 'j':
        memo_get(read_le<std::uint32_t>(), at);
        break;  // LONG_BINGET
      case '0':
        pop(at);
        break;  // POP
      case '1':
        pop_to_mark(at);
        break;  // POP_MARK
      case '2':
        stack_.push_back(top(at));
        break;  // DUP
      case 't':
        push(tuple(pop_to_mark(at)));
        break;
      case 0x85: {
        auto a = pop_value(at);
        push(tuple({a}));
        break;
      }
      case 0x86: {
        auto b = pop_value(at);
        auto a = pop_value(at);
        push(tuple({a, b}));
        break;
      }
      case 0x87: {
        auto c = pop_value(at);
        auto b = pop_value(at);
        auto a = pop_value(at);
        push(tuple({a, b, c}));
        break;
      }
      case 'l': {  // LIST
        c10::impl::GenericList l(c10::AnyType::get());
        for (auto& v : pop_to_mark(at)) l.push_back(std::move(v));
        push(l);
        break;
      }
      case 'a': {  // APPEND
        auto v = pop_value(at);
        list_at(at).push_back(std::move(v));
        break;
      }
      case 'e': {  // APPENDS
        auto vs = pop_to_mark(at);
        auto l = list_at(at);
        for (auto& v : vs) l.push_back(std::move(v));
        break;
      }
      case 'd': {  // DICT
        auto kv = pop_to_mark(at);
        push(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get()));
        set_items(kv, at);
        break;
      }
      case 's': {  // SETITEM
        auto v = pop_value(at);
        auto k = pop_value(at);
        set_items({k, v}, at);
        break;
      }
      case 'u':
        set_items(pop_to_mark(at), at);
        break;     // SETITEMS
      case 'c': {  // GLOBAL
        const std::string module(read_line());
        const std::string name(read_line());
        push_global(module, name);
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        auto name = pop_value(at);
        auto module = pop_value(at);
        if (!module.isString() || !name.isString()) fail("has a STACK_GLOBAL without names", at);
        push_global(module.toStringRef(), name.toStringRef());
        break;
      }
      case 'R':
        reduce(at);
        break;
      case 0x81: {  // NEWOBJ: cls.__new__(cls, *args), an object only the inert mode reads
        pop_value(at);
        const Item cls = pop(at);
        push(inert_object(cls, at));
        break;
      }
      case 0x92: {  // NEWOBJ_EX: the same with keyword arguments
        pop_value(at);
        pop_value(at);
        const Item cls = pop(at);
        push(inert_object(cls, at));
        break;
      }
      case 'b': {  // BUILD: only an empty or None state is meaningful for the allowed types,
                   // and the attribute dict a state_dict() OrderedDict carries (its `_metadata`,
                   // module versions), which is dropped as torch.load drops nothing we read
        auto state = pop_value(at);
        const auto& target = top(at).value;
        if (is_inert(target)) break;  // an inert object's state is dropped unread
        bool trivial = state.isNone() || (state.isGenericDict() && state.toGenericDict().empty());
        if (!trivial && target.isGenericDict() && state.isGenericDict()) {
          trivial = true;
          for (const auto& entry : state.toGenericDict())
            trivial = trivial && entry.key().isString() && entry.key().toStringRef() == "_metadata";
        }
        if (!trivial) fail("sets object state, which weights-only files never need", at);
        break;
      }
      case 'Q':
        push(persistent_load(pop_value(at), at));
        break;  // BINPERSID
      default: {
        std::ostringstream hex;
        hex << "0x" << std::hex << int{op};
        fail("uses opcode " + hex.str() + ", which torch.save does not write", at);
      }
    }
  }

  void push_global(const std::string& module, const std::string& name) {
    const bool storage = module == "torch" && storage_dtype(name).has_value();
    stack_.push_back(Item{
        Item::Kind::global,
        c10::IValue((storage ? std::string(1, kStorageTag) : std::string()) + module + "." + name),
        module + " " + name});
  }

  std::size_t checked_size(std::uint64_t n, std::size_t at) const {
    if (n > data_.size()) fail("declares a string longer than the file", at);
    return static_cast<std::size_t>(n);
  }

  void memo_put(std::uint32_t key, std::size_t at) { memo_[key] = top(at); }
  void memo_get(std::uint32_t key, std::size_t at) {
    const auto it = memo_.find(key);
    if (it == memo_.end()) fail("reads memo entry " + std::to_string(key) + ", never stored", at);
    stack_.push_back(it->second);
  }

  c10::impl::GenericList list_at(std::size_t at) {
    Item& t = top(at);
    if (t.kind != Item::Kind::value || !t.value.isList())
      fail("appends to something not a list", at);
    return t.value.toList();
  }

  void set_items(const std::vector<c10::IValue>& kv, std::size_t at) {
    if (kv.size() % 2 != 0) fail("sets a dict item without a value", at);
    Item& t = top(at);
    if (t.kind != Item::Kind::value || !t.value.isGenericDict())
      fail("sets items on something not a dict", at);
    auto d = t.value.toGenericDict();
    for (std::size_t i = 0; i < kv.size(); i += 2) {
      const auto& k = kv[i];
      if (!(k.isString() || k.isInt() || k.isDouble() || k.isBool() || k.isNone() || k.isTensor()))
        fail("uses a " + std::string(k.tagKind()) + " as a dict key", at);
      d.insert_or_assign(k, kv[i + 1]);
    }
  }

  void reduce(std::size_t at) {
    auto args_v = pop_value(at);
    Item fn = pop(at);
    if (fn.kind != Item::Kind::global) fail("calls something that is not a global", at);
    if (!args_v.isTuple()) fail("calls '" + fn.global + "' without an argument tuple", at);
    const std::vector<c10::IValue> args = args_v.toTupleRef().elements().vec();
    if (fn.global == "collections OrderedDict") {
      if (!args.empty()) fail("builds an OrderedDict from arguments", at);
      push(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get()));
    } else if (fn.global == "torch._utils _rebuild_tensor_v2") {
      push(rebuild_tensor(args, at));
    } else if (fn.global == "torch._utils _rebuild_parameter") {
      if (args.size() < 2 || !args[0].isTensor() || !args[1].isBool())
        fail("calls _rebuild_parameter with wrong arguments", at);
      push(args[0].toTensor().set_requires_grad(false));  // parameters load as plain tensors
    } else if (fn.global == "_codecs encode") {
      if (args.empty() || !args[0].isString())
        fail("calls _codecs.encode with wrong arguments", at);
      push(latin1(args[0].toStringRef()));
    } else if (fn.global == "torch Size") {
      if (args.size() != 1 || !args[0].isTuple()) fail("calls torch.Size with wrong arguments", at);
      push(args[0]);
    } else {
      push(inert_object(fn, at));
    }
  }

  static bool is_inert(const c10::IValue& v) {
    return v.isString() && !v.toStringRef().empty() && v.toStringRef()[0] == kInertTag;
  }

  // An object of a class that is not allowed: refused, or (inert mode) its placeholder.
  c10::IValue inert_object(const Item& cls, std::size_t at) const {
    const std::string name =
        cls.kind == Item::Kind::global ? cls.global : std::string("an object built from a value");
    if (objects_ != ObjectPolicy::inert)
      fail("calls the Python global '" + name + "', which is not allowed in a weights file", at);
    std::string dotted = name;
    std::replace(dotted.begin(), dotted.end(), ' ', '.');
    return std::string(1, kInertTag) + dotted;
  }

  // Python wrote text as UTF-8 code points below 256 for latin-1 bytes; undo that.
  static std::string latin1(const std::string& utf8) {
    std::string out;
    for (std::size_t i = 0; i < utf8.size(); ++i) {
      const auto c = static_cast<unsigned char>(utf8[i]);
      if (c < 0x80 || i + 1 >= utf8.size()) {
        out += static_cast<char>(c);
      } else {
        out +=
            static_cast<char>(((c & 0x1f) << 6) | (static_cast<unsigned char>(utf8[++i]) & 0x3f));
      }
    }
    return out;
  }

  c10::IValue persistent_load(const c10::IValue& pid, std::size_t at) {
    if (!pid.isTuple()) fail("has a persistent id that is not a tuple", at);
    const std::vector<c10::IValue> e = pid.toTupleRef().elements().vec();
    if (e.size() != 5 || !e[0].isString() || e[0].toStringRef() != "storage" || !e[2].isString() ||
        !e[4].isInt())
      fail("has a persistent id that is not ('storage', type, key, location, numel)", at);
    const std::string& key = e[2].toStringRef();
    const auto cached = storages_.find(key);
    if (cached != storages_.end()) return cached->second;
    const std::string type = e[1].isString() ? e[1].toStringRef() : std::string();
    if (type.empty() || type[0] != kStorageTag)
      fail("has a storage whose type is not a torch storage class", at);
    const auto dtype = storage_dtype(type.substr(type.rfind('.') + 1));
    if (!dtype) fail("has a storage of unknown type '" + type.substr(1) + "'", at);
    const std::int64_t numel = e[4].toInt();
    const std::string record = "data/" + key;
    if (numel < 0) fail("has a storage with negative size", at);
    if (!archive_.contains(record))
      fail("refers to record '" + record + "', missing from the archive", at);
    const auto size = static_cast<std::size_t>(archive_.size_of(record));
    const auto item = static_cast<std::uint64_t>(c10::elementSize(*dtype));
    const bool untyped = type.ends_with("UntypedStorage");
    const std::uint64_t want =
        untyped ? static_cast<std::uint64_t>(numel) : static_cast<std::uint64_t>(numel) * item;
    if (numel > 0 && want / (untyped ? 1 : item) != static_cast<std::uint64_t>(numel))
      fail("has a storage size that overflows", at);
    if (size != want)
      fail("record '" + record + "' holds " + std::to_string(size) + " bytes, the storage needs " +
               std::to_string(want),
           at);
    // The record is read (and its CRC-32 checked) straight into the storage's memory.
    at::DataPtr ptr = c10::GetCPUAllocator()->allocate(size);
    archive_.read_into(record, ptr.get());
    c10::Storage bytes(c10::Storage::use_byte_size_t(), size, std::move(ptr), nullptr, false);
    at::Tensor storage = at::empty({0}, at::TensorOptions().dtype(*dtype))
                             .set_(bytes, 0, {static_cast<std::int64_t>(want / item)}, {1});
    storages_.emplace(key, storage);
    return storage;
  }

  c10::IValue rebuild_tensor(const std::vector<c10::IValue>& args, std::size_t at) {
    if (args.size() < 4 || !args[0].isTensor() || !args[1].isInt() || !args[2].isTuple() ||
        !args[3].isTuple())
      fail("calls _rebuild_tensor_v2 with wrong arguments", at);
    const at::Tensor& storage = args[0].toTensor();
    const std::int64_t offset = args[1].toInt();
    auto ints = [&](const c10::IValue& t) {
      std::vector<std::int64_t> out;
      for (const auto& v : t.toTupleRef().elements()) {
        if (!v.isInt()) fail("has a tensor size or stride that is not an int", at);
        out.push_back(v.toInt());
      }
      return out;
    };
    const auto sizes = ints(args[2]);
    const auto strides = ints(args[3]);
    if (sizes.size() != strides.size())
      fail("has a tensor with sizes and strides of different rank", at);
    // Every element reached must lie inside the storage.
    if (offset < 0) fail("has a negative storage offset", at);
    std::uint64_t last = static_cast<std::uint64_t>(offset);
    bool empty = false;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] < 0 || strides[i] < 0) fail("has a negative tensor size or stride", at);
      empty = empty || sizes[i] == 0;
      std::uint64_t reach = 0;
      if (sizes[i] > 0 && (__builtin_mul_overflow(static_cast<std::uint64_t>(sizes[i] - 1),
                                                  static_cast<std::uint64_t>(strides[i]), &reach) ||
                           __builtin_add_overflow(last, reach, &last)))
        fail("has tensor sizes and strides that overflow", at);
    }
    if (!empty && last >= static_cast<std::uint64_t>(storage.numel()))
      fail("has a tensor (shape " + c10::str(sizes) + ", strides " + c10::str(strides) +
               ", offset " + std::to_string(offset) + ") reaching element " + std::to_string(last) +
               " of a storage of " + std::to_string(storage.numel()),
           at);
    if (empty) return at::empty(sizes, storage.options());
    return storage.as_strided(sizes, strides, offset);
  }

  std::string_view data_;
  std::size_t pos_ = 0;
  const ZipArchive& archive_;
  std::string where_;
  std::vector<Item> stack_;
  std::unordered_map<std::uint32_t, Item> memo_;
  std::unordered_map<std::string, at::Tensor> storages_;
  ObjectPolicy objects_ = ObjectPolicy::refuse;
};

}  // namespace pickle_detail

/// torch.load reads the archive's format version first (".data/version", else "version") and
/// refuses an archive without one, with one that is not a number, or with one outside the range
/// its reader knows (caffe2's kMinSupportedFileFormatVersion to kMaxSupportedFileFormatVersion,
/// 1 to 10; torch.save writes 3). A record longer than a number needs is refused unread (torch
/// would inflate it whole first).
inline void check_format_version(const ZipArchive& archive, const std::string& where) {
  const std::string name = archive.contains(".data/version") ? ".data/version" : "version";
  if (!archive.contains(name))
    throw FormatError("has no version record (torch.load refuses such an archive)", where);
  if (archive.size_of(name) > 32)
    throw FormatError("has a " + name + " record of " + std::to_string(archive.size_of(name)) +
                          " bytes; a format version is a short number",
                      where);
  const std::string text = archive.read(name);
  // As caffe2::stoull reads it: leading blanks, then digits; what follows them is ignored.
  std::size_t i = text.find_first_not_of(" \t\n\r");
  std::uint64_t version = 0;
  std::size_t digits = 0;
  for (; i != std::string::npos && i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    version = version * 10 + static_cast<std::uint64_t>(text[i] - '0');
    if (++digits > 18) break;
  }
  if (digits == 0) throw FormatError("has a " + name + " record that is not a number", where);
  constexpr std::uint64_t kMin = 1, kMax = 10;
  if (version < kMin || version > kMax)
    throw FormatError("has format version " + std::to_string(version) + "; torch.load reads " +
                          std::to_string(kMin) + " to " + std::to_string(kMax),
                      where);
}

/// Reads a torch.save zip archive held in memory, with torch.load(weights_only=True)'s rules (or,
/// with ObjectPolicy::inert, with the objects a training checkpoint holds beside its weights read
/// as inert placeholders).
inline c10::IValue read_torch_archive(
    const std::vector<char>& bytes, const std::string& where,
    pickle_detail::ObjectPolicy objects = pickle_detail::ObjectPolicy::refuse) {
  try {
    const ZipArchive archive({bytes.data(), bytes.size()}, where);
    if (archive.contains("byteorder")) {
      if (archive.size_of("byteorder") > 16)
        throw FormatError(
            "has a byteorder record of " + std::to_string(archive.size_of("byteorder")) + " bytes",
            where);
      const std::string order = archive.read("byteorder");
      if (order != "little")
        throw FormatError("stores tensors in '" + order + "' byte order; only little is read",
                          where);
    }
    check_format_version(archive, where);
    if (!archive.contains("data.pkl")) throw FormatError("has no data.pkl record", where);
    if (archive.size_of("data.pkl") > bytes.size())  // pickles are stored, never deflated
      throw FormatError("declares a data.pkl record larger than the file", where);
    const std::string pickle = archive.read("data.pkl");
    return pickle_detail::Unpickler(pickle, archive, where, objects).run();
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw FormatError(std::string("is not a readable torch archive: ") + e.what_without_backtrace(),
                      where);
  } catch (const std::exception& e) {
    throw FormatError(std::string("is not a readable torch archive: ") + e.what(), where);
  }
}

}  // namespace difftrain::io
