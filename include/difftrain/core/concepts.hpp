#pragma once
// Requirements shared by every policy family, and the pattern each family follows:
//
//   1. small named concepts, one per requirement (`NamedPolicy`, `HasLrAt`, ...);
//   2. the family concept composes them (`LrSchedule = NamedPolicy<T> && HasLrAt<T>`);
//   3. `diagnose_<family><T>()` static_asserts each requirement with a sentence naming it, so a
//      wrong policy fails at the use site with that sentence instead of a wall of template errors.
//
// Templates that take a policy call the diagnose function in a static_assert in their body:
//   template <class S> class Bound { static_assert(diagnose_lr_schedule<S>()); ... };

#include <concepts>
#include <string_view>

namespace difftrain {

/// A policy reachable by name at run time: `static constexpr std::string_view name = "...";`.
template <class T>
concept NamedPolicy = requires {
  { T::name } -> std::convertible_to<std::string_view>;
};

/// A policy with run-time options: a nested, default-constructible `Options` struct.
template <class T>
concept HasOptions = requires {
  typename T::Options;
}
&&std::default_initializable<typename T::Options>;

/// Checks the requirements every named policy shares. Returns true so it can sit in a
/// `static_assert(diagnose_named_policy<T>())` beside the family's own checks.
template <class T>
consteval bool diagnose_named_policy() {
  static_assert(NamedPolicy<T>,
                "difftrain: this policy has no name; add `static constexpr std::string_view name = "
                "\"...\";` so the registry can find it by name");
  return NamedPolicy<T>;
}

}  // namespace difftrain
