#include <difftrain/core/core.hpp>

#include <gtest/gtest.h>

#include <string>
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
