#pragma once
// Caption options of today's LoRA trainers, as kohya's sd-scripts processes a caption each time
// an image is used (BaseDataset.process_caption):
//   caption_prefix / caption_suffix       added with a space
//   caption_dropout_rate                  the whole caption dropped with this probability
//   caption_dropout_every_n_epochs        ... and in every n-th epoch
//   enable_wildcard                       one line of a multi-line caption, and {a|b|c} choices
//                                         ({{ and }} are literal braces); else the first line
//   shuffle_caption, keep_tokens,         the tags (split at caption_separator, trimmed) after
//   keep_tokens_separator                 the first keep_tokens (or before the separator, and
//                                         after a second one) are shuffled
//   caption_tag_dropout_rate              each shuffled tag dropped with this probability
//   token_warmup_min / token_warmup_step  only the first tags early in training
//   secondary_separator                   replaced by caption_separator at the end
// The draws are Python's: random.random() for each probability test, random.shuffle (Fisher-Yates
// from the end, an index below i + 1 for each i) and random.choice (an index below the count). A
// CaptionDraws gives them; the test replays the reference's, a run draws from a seeded engine.

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/core/python_strings.hpp"

namespace difftrain::data {

struct CaptionOptions {
  std::string caption_prefix, caption_suffix;
  double caption_dropout_rate = 0.0;
  std::int64_t caption_dropout_every_n_epochs = 0;
  double caption_tag_dropout_rate = 0.0;
  bool shuffle_caption = false;
  std::int64_t keep_tokens = 0;
  std::string keep_tokens_separator;
  std::string caption_separator = ",";
  std::string secondary_separator;
  bool enable_wildcard = false;
  std::int64_t token_warmup_min = 1;
  double token_warmup_step = 0;  // < 1: a fraction of the run's steps

  /// Every option equal (the dataset config's subsets must agree on them).
  [[nodiscard]] bool operator==(const CaptionOptions&) const = default;

  /// Whether any option changes a caption (a run without them can cache its text encodings).
  [[nodiscard]] bool any() const {
    return !caption_prefix.empty() || !caption_suffix.empty() || caption_dropout_rate > 0 ||
           caption_dropout_every_n_epochs > 0 || caption_tag_dropout_rate > 0 || shuffle_caption ||
           keep_tokens > 0 || !keep_tokens_separator.empty() || !secondary_separator.empty() ||
           enable_wildcard || token_warmup_step > 0;
  }

  /// Throws a ConfigError naming the first flag out of its range.
  void check() const {
    auto rate = [](double v, const char* flag) {
      if (!std::isfinite(v) || v < 0 || v > 1)
        throw ConfigError("must lie in [0, 1], got " + std::to_string(v), flag);
    };
    rate(caption_dropout_rate, "--caption_dropout_rate");
    rate(caption_tag_dropout_rate, "--caption_tag_dropout_rate");
    if (caption_dropout_every_n_epochs < 0)
      throw ConfigError("must be >= 0", "--caption_dropout_every_n_epochs");
    if (keep_tokens < 0) throw ConfigError("must be >= 0", "--keep_tokens");
    if (caption_separator.empty()) throw ConfigError("must not be empty", "--caption_separator");
    if (token_warmup_min < 0) throw ConfigError("must be >= 0", "--token_warmup_min");
    if (!std::isfinite(token_warmup_step) || token_warmup_step < 0)
      throw ConfigError("must be a finite number >= 0", "--token_warmup_step");
  }
};

/// The draws process_caption takes, in Python's terms.
struct CaptionDraws {
  std::function<double()> random;                 // random.random()
  std::function<std::size_t(std::size_t)> below;  // random._randbelow(n): 0 <= k < n

  /// Draws from an engine seeded with `seed` (a run seeds it per sample and step, so a resumed
  /// run draws what the uninterrupted one drew).
  static CaptionDraws seeded(std::uint64_t seed) {
    auto engine = std::make_shared<std::mt19937_64>(seed);
    return {[engine] { return std::uniform_real_distribution<double>(0.0, 1.0)(*engine); },
            [engine](std::size_t n) {
              return std::uniform_int_distribution<std::size_t>(0, n - 1)(*engine);
            }};
  }
};

namespace caption_detail {

/// Python's str.strip(): the ASCII white space Python strips, and the Unicode spaces of UTF-8
/// captions are kept (kohya's tags are ASCII-separated).
inline std::string strip(const std::string& s) {
  const char* ws = " \t\n\r\x0b\x0c";
  const auto a = s.find_first_not_of(ws);
  if (a == std::string::npos) return {};
  return s.substr(a, s.find_last_not_of(ws) - a + 1);
}

inline std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

/// The stripped, non-empty pieces of `s` split at `sep`.
inline std::vector<std::string> tags(const std::string& s, const std::string& sep) {
  std::vector<std::string> out;
  for (const auto& t : python_split(s, sep))
    if (auto u = strip(t); !u.empty()) out.push_back(std::move(u));
  return out;
}

}  // namespace caption_detail

/// kohya's process_caption of `caption` in `epoch` (from 1, as kohya counts) at optimizer step
/// `step` of `max_train_steps`.
inline std::string process_caption(std::string caption, const CaptionOptions& o, std::int64_t epoch,
                                   std::int64_t step, std::int64_t max_train_steps,
                                   const CaptionDraws& draws) {
  using namespace caption_detail;
  if (!o.caption_prefix.empty()) caption = o.caption_prefix + " " + caption;
  if (!o.caption_suffix.empty()) caption = caption + " " + o.caption_suffix;
  bool drop = o.caption_dropout_rate > 0 && draws.random() < o.caption_dropout_rate;
  drop = drop ||
         (o.caption_dropout_every_n_epochs > 0 && epoch % o.caption_dropout_every_n_epochs == 0);
  if (drop) return {};
  if (o.enable_wildcard) {
    if (caption.find('\n') != std::string::npos) {
      const auto lines = python_split(caption, "\n");
      caption = lines[draws.below(lines.size())];
    }
    // {a|b|c}: one of the choices; {{ and }} stand for literal braces.
    std::string open = "⦅", close = "⦆";
    while (caption.find(open) != std::string::npos || caption.find(close) != std::string::npos) {
      open += "⦅";
      close += "⦆";
    }
    caption = python_replace(python_replace(caption, "{{", open), "}}", close);
    static const std::regex wildcard(R"(\{([^}]+)\})");
    std::string out;
    auto it = std::sregex_iterator(caption.begin(), caption.end(), wildcard);
    std::size_t last = 0;
    for (; it != std::sregex_iterator(); ++it) {
      out += caption.substr(last, static_cast<std::size_t>(it->position()) - last);
      const auto choices = python_split((*it)[1].str(), "|");
      out += choices[draws.below(choices.size())];
      last = static_cast<std::size_t>(it->position() + it->length());
    }
    out += caption.substr(last);
    caption = python_replace(python_replace(out, open, "{"), close, "}");
  } else {
    caption = python_split(caption, "\n")[0];
  }
  const std::string& sep = o.caption_separator;
  if (o.shuffle_caption || o.token_warmup_step > 0 || o.caption_tag_dropout_rate > 0) {
    std::vector<std::string> fixed, flex, fixed_suffix;
    if (!o.keep_tokens_separator.empty() &&
        caption.find(o.keep_tokens_separator) != std::string::npos) {
      auto parts = python_split(caption, o.keep_tokens_separator, 1);
      std::string flex_part = parts[1];
      if (flex_part.find(o.keep_tokens_separator) != std::string::npos) {
        auto rest = python_split(flex_part, o.keep_tokens_separator, 1);
        flex_part = rest[0];
        fixed_suffix = tags(rest[1], sep);
      }
      fixed = tags(parts[0], sep);
      flex = tags(flex_part, sep);
    } else {
      std::vector<std::string> all;
      for (const auto& t : python_split(strip(caption), sep)) all.push_back(strip(t));
      flex = all;
      if (o.keep_tokens > 0) {
        const auto k = std::min<std::size_t>(static_cast<std::size_t>(o.keep_tokens), all.size());
        fixed.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(k));
        flex.assign(all.begin() + static_cast<std::ptrdiff_t>(k), all.end());
      }
    }
    double warmup = o.token_warmup_step;
    if (warmup < 1) warmup = std::floor(warmup * static_cast<double>(max_train_steps));
    if (warmup > 0 && static_cast<double>(step) < warmup) {
      const double len =
          std::floor(static_cast<double>(step) *
                     ((static_cast<double>(flex.size()) - static_cast<double>(o.token_warmup_min)) /
                      warmup)) +
          static_cast<double>(o.token_warmup_min);
      // Python's slice [:n]: a negative n counts from the end, past the end takes all.
      const auto n = static_cast<std::int64_t>(len);
      const auto size = static_cast<std::int64_t>(flex.size());
      const std::int64_t keep = n < 0 ? std::max<std::int64_t>(0, size + n) : std::min(n, size);
      flex.resize(static_cast<std::size_t>(keep));
    }
    if (o.shuffle_caption)
      for (std::size_t i = flex.size(); i-- > 1;) std::swap(flex[i], flex[draws.below(i + 1)]);
    if (o.caption_tag_dropout_rate > 0) {
      std::vector<std::string> kept;
      for (auto& t : flex)
        if (draws.random() >= o.caption_tag_dropout_rate) kept.push_back(std::move(t));
      flex = std::move(kept);
    }
    std::vector<std::string> all = fixed;
    all.insert(all.end(), flex.begin(), flex.end());
    all.insert(all.end(), fixed_suffix.begin(), fixed_suffix.end());
    caption = join(all, ", ");
  }
  if (!o.secondary_separator.empty()) caption = python_replace(caption, o.secondary_separator, sep);
  return caption;
}

}  // namespace difftrain::data
