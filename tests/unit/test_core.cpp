#include <difftrain/core/core.hpp>

#include <gtest/gtest.h>

#include <array>
#include <barrier>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>

namespace dt = difftrain;

namespace {

struct Relu {
  static constexpr std::string_view name = "relu";
  static int id() { return 1; }
};
struct Swish {
  static constexpr std::string_view name = "swish";
  static int id() { return 2; }
};
struct Tanh {
  static constexpr std::string_view name = "tanh";
  static int id() { return 3; }
};
using Activations = dt::type_list<Relu, Swish, Tanh>;
constexpr dt::Registry<Activations> activations{"activation"};

template <class E>
std::string message_of(auto&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return {};
}

}  // namespace

TEST(Version, MatchesTheCMakeProjectVersion) {
  EXPECT_STREQ(dt::version_string, DIFFTRAIN_PROJECT_VERSION);
  EXPECT_EQ(std::to_string(dt::version_major) + "." + std::to_string(dt::version_minor) + "." +
                std::to_string(dt::version_patch),
            DIFFTRAIN_PROJECT_VERSION);
}

TEST(Errors, CarryKindWhereAndMessage) {
  const dt::ShapeError e("expected (B, C, H, W), got (3, 4)", "SpatialTransformer input");
  EXPECT_EQ(e.kind(), "difftrain::ShapeError");
  EXPECT_EQ(e.where(), "SpatialTransformer input");
  EXPECT_EQ(e.message(), "expected (B, C, H, W), got (3, 4)");
  EXPECT_STREQ(
      e.what(),
      "difftrain::ShapeError at SpatialTransformer input: expected (B, C, H, W), got (3, 4)");
}

TEST(Errors, FormAOneRootedHierarchy) {
  static_assert(std::is_base_of_v<std::runtime_error, dt::Error>);
  static_assert(std::is_base_of_v<dt::Error, dt::ConfigError>);
  static_assert(std::is_base_of_v<dt::Error, dt::ShapeError>);
  static_assert(std::is_base_of_v<dt::Error, dt::FormatError>);
  static_assert(std::is_base_of_v<dt::Error, dt::NumericError>);
  static_assert(std::is_base_of_v<dt::Error, dt::DeviceError>);
  // Caught through the root, the subclass still says what it is.
  try {
    throw dt::FormatError("header length 9e18 exceeds the file", "model.safetensors: byte 0");
  } catch (const dt::Error& e) {
    EXPECT_EQ(e.kind(), "difftrain::FormatError");
    EXPECT_EQ(e.where(), "model.safetensors: byte 0");
  }
  const dt::NumericError no_where("loss is NaN", "");
  EXPECT_STREQ(no_where.what(), "difftrain::NumericError: loss is NaN");
}

TEST(TypeList, ConcatAndContains) {
  using L = dt::concat_t<dt::type_list<int>, dt::type_list<float, char>>;
  static_assert(std::is_same_v<L, dt::type_list<int, float, char>>);
  static_assert(L::size == 3);
  static_assert(dt::contains_v<float, L>);
  static_assert(!dt::contains_v<double, L>);
}

TEST(Registry, ListsNamesInDeclarationOrder) {
  static_assert(activations.names.size() == 3);
  EXPECT_EQ(activations.names[0], "relu");
  EXPECT_EQ(activations.names[2], "tanh");
  EXPECT_EQ(activations.family(), "activation");
  static_assert(activations.contains("swish"));
  static_assert(!activations.contains("Swish"));
}

TEST(Registry, VisitMapsANameToItsType) {
  for (std::string_view name : activations.names) {
    const int id = activations.visit(name, [](auto tag) {
      using T = typename decltype(tag)::type;
      return T::id();
    });
    EXPECT_EQ(activations.names[static_cast<std::size_t>(id - 1)], name);
  }
  int seen = 0;
  activations.visit("tanh", [&](auto tag) { seen = decltype(tag)::type::id(); });
  EXPECT_EQ(seen, 3);
}

TEST(Registry, UnknownNameIsAConfigErrorListingKnownNames) {
  const std::string msg =
      message_of<dt::ConfigError>([] { activations.visit("xavier_normal", [](auto) {}); });
  // Far from every known name: no suggestion, just the list.
  EXPECT_EQ(msg,
            "difftrain::ConfigError at activation: unknown activation 'xavier_normal'; "
            "known names: relu, swish, tanh");
  const std::string near =
      message_of<dt::ConfigError>([] { activations.visit("gelu", [](auto) {}); });
  EXPECT_EQ(near,
            "difftrain::ConfigError at activation: unknown activation 'gelu'; did you mean "
            "'relu'?; known names: relu, swish, tanh");
}

TEST(Registry, MisspeltNameGetsASuggestionAndTheCallersWhere) {
  const std::string msg = message_of<dt::ConfigError>([] {
    (void)activations.visit(
        "swsh", [](auto) { return 0; }, "hypernetwork activation_func");
  });
  EXPECT_NE(msg.find("at hypernetwork activation_func:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'swish'?"), std::string::npos) << msg;
}

TEST(Registry, EditDistance) {
  EXPECT_EQ(dt::detail::edit_distance("", ""), 0U);
  EXPECT_EQ(dt::detail::edit_distance("kitten", "sitting"), 3U);
  EXPECT_EQ(dt::detail::edit_distance("abc", ""), 3U);
}

// agreed: whatever a process's work did, it joins the collective exactly once; the process that
// failed reports its own error, the others the "another process failed" one, and a result
// arrives only when every process may go on. Swept over work that returns, returns a move-only
// value, returns nothing or throws, and both verdicts of the collective.
TEST(Agreed, EveryOutcomeOfWorkAndVerdict) {
  const auto others = [] { return dt::IoError("another rank failed", "rank 1 of 2"); };
  for (const bool verdict : {true, false}) {
    for (const bool throws : {false, true}) {
      SCOPED_TRACE(std::string("verdict ") + (verdict ? "go on" : "stop") +
                   (throws ? ", work throws" : ", work returns"));
      int calls = 0;
      bool said = false;
      const auto agree = [&](bool ok) {
        ++calls;
        said = ok;
        return verdict;
      };
      const auto work = [&] {
        if (throws) throw dt::ConfigError("bad", "--flag");
        return std::make_unique<int>(7);
      };
      const auto void_work = [&] {
        if (throws) throw dt::ConfigError("bad", "--flag");
      };
      for (const bool void_result : {false, true}) {
        calls = 0;
        try {
          if (void_result) {
            dt::agreed(void_work, agree, others);
          } else {
            const std::unique_ptr<int> r = dt::agreed(work, agree, others);
            EXPECT_EQ(*r, 7);
          }
          EXPECT_FALSE(throws) << "the work's error was swallowed";
          EXPECT_TRUE(verdict) << "went on although the collective said stop";
        } catch (const dt::ConfigError& e) {
          EXPECT_TRUE(throws) << e.what();
          EXPECT_EQ(e.where(), "--flag");
        } catch (const dt::IoError& e) {
          EXPECT_FALSE(throws) << "a failing process must report its own error";
          EXPECT_FALSE(verdict);
          EXPECT_EQ(e.where(), "rank 1 of 2");
        }
        EXPECT_EQ(calls, 1) << "every process joins the collective exactly once";
        EXPECT_EQ(said, !throws);
      }
    }
  }
}

// Two threads stand for two ranks meeting in an all-true collective: whichever fails, neither
// waits for ever, the failing one reports its error and the other the collective's.
TEST(Agreed, TwoRanksNeitherWaitsForTheOther) {
  for (int failing = -1; failing < 2; ++failing) {
    SCOPED_TRACE("failing rank " + std::to_string(failing));
    std::barrier meet(2);
    std::array<bool, 2> oks{};
    std::array<std::string, 2> outcome;
    const auto rank = [&](int r) {
      try {
        const int v = dt::agreed(
            [&] {
              if (r == failing) throw dt::FormatError("damaged", "file " + std::to_string(r));
              return r + 10;
            },
            [&](bool ok) {
              oks[static_cast<std::size_t>(r)] = ok;
              meet.arrive_and_wait();
              const bool all = oks[0] && oks[1];
              meet.arrive_and_wait();
              return all;
            },
            [&] {
              return dt::DistributedError("another rank failed", "rank " + std::to_string(r));
            });
        outcome[static_cast<std::size_t>(r)] = "value " + std::to_string(v);
      } catch (const dt::Error& e) {
        outcome[static_cast<std::size_t>(r)] = e.kind() + " at " + e.where();
      }
    };
    std::thread other(rank, 1);
    rank(0);
    other.join();
    for (int r = 0; r < 2; ++r) {
      const std::string want = failing < 0 ? "value " + std::to_string(r + 10)
                               : r == failing
                                   ? "difftrain::FormatError at file " + std::to_string(r)
                                   : "difftrain::DistributedError at rank " + std::to_string(r);
      EXPECT_EQ(outcome[static_cast<std::size_t>(r)], want);
    }
  }
}
