#pragma once
// Run-time names to compile-time policies. A config file, a command-line flag or a checkpoint's
// metadata names a policy ("swish", "xavier_normal", "cosine"); a registry over a type list maps
// that name to the same type a user could have written as a template argument.

#include <algorithm>
#include <array>
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "difftrain/core/concepts.hpp"
#include "difftrain/core/error.hpp"
#include "difftrain/core/type_list.hpp"

namespace difftrain {

namespace detail {

/// Levenshtein distance, for the "did you mean" hint on a misspelt name.
inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0U : 1U)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

template <std::size_t N>
consteval bool names_unique(const std::array<std::string_view, N>& names) {
  for (std::size_t i = 0; i < N; ++i)
    for (std::size_t j = i + 1; j < N; ++j)
      if (names[i] == names[j]) return false;
  return true;
}

}  // namespace detail

template <class List>
class Registry;

/// A registry of the policies `Ts...`, each with a unique `static constexpr name`.
/// `family` names what they are ("activation", "lr schedule") in error messages.
template <class... Ts>
class Registry<type_list<Ts...>> {
  static_assert((diagnose_named_policy<Ts>() && ...),
                "difftrain::Registry: every policy in the list needs a `name`");

 public:
  static constexpr std::array<std::string_view, sizeof...(Ts)> names{std::string_view{Ts::name}...};
  static_assert(detail::names_unique(names),
                "difftrain::Registry: two policies in the list share a name");

  constexpr explicit Registry(std::string_view family) : family_(family) {}

  [[nodiscard]] constexpr std::string_view family() const noexcept { return family_; }

  [[nodiscard]] constexpr bool contains(std::string_view name) const noexcept {
    return std::find(names.begin(), names.end(), name) != names.end();
  }

  /// Calls `f(std::type_identity<T>{})` for the policy `T` named `name` and returns its result.
  /// All policies must give `f` the same result type. An unknown name throws `ConfigError`
  /// that lists the known names; `where` says where the name came from (default: the family).
  template <class F>
  decltype(auto) visit(std::string_view name, F&& f, std::string_view where = {}) const {
    using R = std::common_type_t<std::invoke_result_t<F&, std::type_identity<Ts>>...>;
    if constexpr (std::is_void_v<R>) {
      const bool found =
          ((name == Ts::name ? (std::invoke(f, std::type_identity<Ts>{}), true) : false) || ...);
      if (!found) throw unknown(name, where);
    } else {
      std::optional<R> result;
      const bool found =
          ((name == Ts::name ? (result.emplace(std::invoke(f, std::type_identity<Ts>{})), true)
                             : false) ||
           ...);
      if (!found) throw unknown(name, where);
      return R(std::move(*result));
    }
  }

  /// The error for a name that is not here; public so callers that pre-validate can throw it.
  [[nodiscard]] ConfigError unknown(std::string_view name, std::string_view where = {}) const {
    std::string message = "unknown " + std::string(family_) + " '" + std::string(name) + "'";
    std::string_view closest;
    std::size_t best = name.size() / 2 + 2;  // only suggest names that are plausibly a typo
    for (std::string_view known : names) {
      const std::size_t d = detail::edit_distance(name, known);
      if (d < best) best = d, closest = known;
    }
    if (!closest.empty()) message += "; did you mean '" + std::string(closest) + "'?";
    message += "; known names: ";
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (i != 0) message += ", ";
      message += names[i];
    }
    return ConfigError(std::move(message), std::string(where.empty() ? family_ : where));
  }

 private:
  std::string_view family_;
};

}  // namespace difftrain
