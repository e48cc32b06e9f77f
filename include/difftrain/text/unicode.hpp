#pragma once
// The Unicode a tokenizer needs, from ICU (Debian's libicu): UTF-8 to code points and back,
// NFC, lower case by code point, and the general categories and White_Space property that CLIP's
// pre-tokenizer regex (`\p{L}`, `\p{N}`, `\s`) tests. Hand-written tables would go stale with every
// Unicode version; ICU is the library the rest of the system already uses for exactly this.

#include <unicode/ubrk.h>
#include <unicode/uchar.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>
#include <unicode/utf16.h>
#include <unicode/utf8.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"

namespace difftrain::text {

/// The code points of UTF-8 `s`; a byte sequence that is not UTF-8 is a FormatError naming its
/// byte offset (`where` says whose text it is).
inline std::u32string utf8_to_u32(std::string_view s, const std::string& where = "text") {
  std::u32string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const std::uint8_t*>(s.data());
  const auto n = static_cast<std::int32_t>(s.size());
  for (std::int32_t i = 0; i < n;) {
    if (p[i] < 0x80) {
      out.push_back(p[i++]);
      continue;
    }
    const std::int32_t at = i;
    UChar32 c = 0;
    U8_NEXT(p, i, n, c);
    if (c < 0)
      throw FormatError("is not valid UTF-8 at byte " + std::to_string(at) +
                            " (tokenizers read UTF-8 text; convert the file or caption)",
                        where);
    out.push_back(static_cast<char32_t>(c));
  }
  return out;
}

/// Appends code point `c` to `out` as UTF-8.
inline void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

inline std::string u32_to_utf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char32_t c : s) append_utf8(out, c);
  return out;
}

/// Canonical composition (NFC), as the tokenizers library's NFC normalizer.
inline std::u32string nfc(std::u32string_view s) {
  bool ascii = true;
  for (const char32_t c : s) ascii = ascii && c < 0x80;
  if (ascii) return std::u32string(s);  // ASCII is always NFC
  UErrorCode status = U_ZERO_ERROR;
  const UNormalizer2* norm = unorm2_getNFCInstance(&status);
  std::u16string in;
  in.reserve(s.size());
  for (const char32_t c : s) {
    if (c < 0x10000) {
      in.push_back(static_cast<char16_t>(c));
    } else {
      in.push_back(static_cast<char16_t>(U16_LEAD(c)));
      in.push_back(static_cast<char16_t>(U16_TRAIL(c)));
    }
  }
  std::u16string out(in.size() + 16, u'\0');
  std::int32_t len = unorm2_normalize(norm, in.data(), static_cast<std::int32_t>(in.size()),
                                      out.data(), static_cast<std::int32_t>(out.size()), &status);
  if (status == U_BUFFER_OVERFLOW_ERROR) {
    status = U_ZERO_ERROR;
    out.assign(static_cast<std::size_t>(len), u'\0');
    len = unorm2_normalize(norm, in.data(), static_cast<std::int32_t>(in.size()), out.data(), len,
                           &status);
  }
  if (U_FAILURE(status))
    throw FormatError(std::string("cannot be put in NFC: ") + u_errorName(status), "text");
  std::u32string result;
  result.reserve(static_cast<std::size_t>(len));
  for (std::int32_t i = 0; i < len;) {
    UChar32 c = 0;
    U16_NEXT(out.data(), i, len, c);
    result.push_back(static_cast<char32_t>(c));
  }
  return result;
}

/// Appends the full lower-case mapping of `c` (one or more code points; U+0130 gives "i̇"), code
/// point by code point without context, as Rust's char::to_lowercase and so the tokenizers
/// library's Lowercase normalizer (Σ is σ everywhere, never the final ς).
inline void append_lower(std::u32string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(c >= U'A' && c <= U'Z' ? c + 32 : c);
    return;
  }
  UChar in[2];
  std::int32_t in_len = 0;
  U16_APPEND_UNSAFE(in, in_len, static_cast<UChar32>(c));
  UChar buf[8];
  UErrorCode status = U_ZERO_ERROR;
  const std::int32_t len = u_strToLower(buf, 8, in, in_len, "", &status);
  if (U_FAILURE(status)) {  // no mapping longer than 3 UTF-16 units exists; keep c
    out.push_back(c);
    return;
  }
  for (std::int32_t i = 0; i < len;) {
    UChar32 l = 0;
    U16_NEXT(buf, i, len, l);
    out.push_back(static_cast<char32_t>(l));
  }
}

/// `\s` of the regex engines the reference tokenizers use: the White_Space property.
inline bool is_space(char32_t c) {
  if (c < 0x80) return c == U' ' || (c >= 0x09 && c <= 0x0D);
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE) != 0;
}

/// `\p{L}`: the letter categories Lu, Ll, Lt, Lm, Lo.
inline bool is_letter(char32_t c) {
  if (c < 0x80) return (c | 32) >= U'a' && (c | 32) <= U'z';
  const auto t = u_charType(static_cast<UChar32>(c));
  return t == U_UPPERCASE_LETTER || t == U_LOWERCASE_LETTER || t == U_TITLECASE_LETTER ||
         t == U_MODIFIER_LETTER || t == U_OTHER_LETTER;
}

/// `\p{N}`: the number categories Nd, Nl, No.
inline bool is_number(char32_t c) {
  if (c < 0x80) return c >= U'0' && c <= U'9';
  const auto t = u_charType(static_cast<UChar32>(c));
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

/// The extended grapheme clusters of `s` (UAX #29, as the unicode-segmentation crate the
/// tokenizers library uses splits them): the code-point offsets where one ends, the last being
/// s.size().
inline std::vector<std::size_t> grapheme_ends(std::u32string_view s) {
  std::vector<std::size_t> ends;
  if (s.empty()) return ends;
  bool ascii = true;
  for (const char32_t c : s) ascii = ascii && c < 0x80;
  if (ascii) {  // every ASCII character is a cluster of its own, except CR LF
    ends.reserve(s.size());
    for (std::size_t i = 0; i < s.size(); ++i)
      if (!(s[i] == U'\r' && i + 1 < s.size() && s[i + 1] == U'\n')) ends.push_back(i + 1);
    return ends;
  }
  std::u16string u16;
  std::vector<std::size_t> cp_at;  // UTF-16 offset -> code-point index
  u16.reserve(s.size());
  cp_at.reserve(s.size() + 1);
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<UChar32>(s[i]);
    cp_at.push_back(i);
    if (c > 0xFFFF) {
      u16.push_back(static_cast<char16_t>(U16_LEAD(c)));
      u16.push_back(static_cast<char16_t>(U16_TRAIL(c)));
      cp_at.push_back(i);
    } else {
      u16.push_back(static_cast<char16_t>(c));
    }
  }
  cp_at.push_back(s.size());
  // One iterator per thread, given new text each call (opening one loads ICU's rules).
  struct Iterator {
    UBreakIterator* it = nullptr;
    ~Iterator() {
      if (it != nullptr) ubrk_close(it);
    }
  };
  thread_local Iterator cached;
  UErrorCode status = U_ZERO_ERROR;
  if (cached.it == nullptr) cached.it = ubrk_open(UBRK_CHARACTER, "", nullptr, 0, &status);
  if (U_SUCCESS(status))
    ubrk_setText(cached.it, reinterpret_cast<const UChar*>(u16.data()),
                 static_cast<int32_t>(u16.size()), &status);
  if (U_FAILURE(status))
    throw IoError(std::string("ICU cannot segment text: ") + u_errorName(status), "text");
  for (int32_t b = ubrk_next(cached.it); b != UBRK_DONE; b = ubrk_next(cached.it))
    ends.push_back(cp_at[static_cast<std::size_t>(b)]);
  return ends;
}

}  // namespace difftrain::text
