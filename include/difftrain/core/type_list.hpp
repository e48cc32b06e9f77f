#pragma once
// A minimal type list: the registries and policy families are built on it.

#include <cstddef>
#include <type_traits>

namespace difftrain {

template <class... Ts>
struct type_list {
  static constexpr std::size_t size = sizeof...(Ts);
};

namespace detail {
template <class A, class B>
struct concat;
template <class... As, class... Bs>
struct concat<type_list<As...>, type_list<Bs...>> {
  using type = type_list<As..., Bs...>;
};
}  // namespace detail

/// `concat_t<type_list<A>, type_list<B, C>>` is `type_list<A, B, C>`.
template <class A, class B>
using concat_t = typename detail::concat<A, B>::type;

/// True when `T` is one of the list's types.
template <class T, class List>
inline constexpr bool contains_v = false;
template <class T, class... Ts>
inline constexpr bool contains_v<T, type_list<Ts...>> = (std::is_same_v<T, Ts> || ...);

/// For `static_assert(dependent_false<T>, "...")` in a template branch that must not be chosen.
template <class...>
inline constexpr bool dependent_false = false;

}  // namespace difftrain
