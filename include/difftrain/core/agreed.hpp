#pragma once
// Work every process of a distributed run must finish before any goes on: each runs its part,
// then all agree on whether every part succeeded, so no process is left waiting in a later
// collective for one that stopped with an error.

#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

namespace difftrain {

/// Runs `work`, then joins the collective `agree(ok)`: every process calls it once, whether its
/// work succeeded or not, and it says whether the run may go on (every process's `ok` with
/// `all_true`, rank 0's with `rank0_decides`). A process whose work threw rethrows its own error
/// after joining; when `agree` says stop, every other throws `others_error()`, an error that says
/// another process failed. Returns what `work` returned.
template <class Work, class Agree, class OthersError>
requires std::is_invocable_v<Work&> && std::is_invocable_r_v<bool, Agree&, bool> &&
    std::is_invocable_v<OthersError&>
decltype(auto) agreed(Work&& work, Agree&& agree, OthersError&& others_error) {
  using Result = std::remove_cvref_t<std::invoke_result_t<Work&>>;
  std::exception_ptr failed;
  const auto settle = [&] {
    const bool go_on = agree(failed == nullptr);
    if (failed) std::rethrow_exception(failed);
    if (!go_on) throw others_error();
  };
  if constexpr (std::is_void_v<Result>) {
    try {
      work();
    } catch (...) {
      failed = std::current_exception();
    }
    settle();
  } else {
    std::optional<Result> result;
    try {
      result.emplace(work());
    } catch (...) {
      failed = std::current_exception();
    }
    settle();  // past it, `work` returned
    return Result(std::move(*result));
  }
}

}  // namespace difftrain
