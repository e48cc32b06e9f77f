#pragma once
// Typed errors. Every error says *what* was wrong and *where* (an option name, a file and
// byte offset, a tensor name, a step), so a user can fix the input without reading our code.

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace difftrain {

/// Root of every error difftrain throws. `what()` reads "<kind> at <where>: <message>".
class Error : public std::runtime_error {
 public:
  Error(std::string message, std::string where)
      : Error("difftrain::Error", std::move(message), std::move(where)) {}

  /// The sentence that says what was wrong, without the location.
  [[nodiscard]] const std::string& message() const noexcept { return message_; }
  /// Where it was wrong: an option, a file (and offset), a tensor name, a step.
  [[nodiscard]] const std::string& where() const noexcept { return where_; }
  /// The class name, e.g. "difftrain::ConfigError".
  [[nodiscard]] const std::string& kind() const noexcept { return kind_; }

 protected:
  Error(std::string kind, std::string message, std::string where)
      : std::runtime_error(compose(kind, message, where)),
        kind_(std::move(kind)),
        message_(std::move(message)),
        where_(std::move(where)) {}

 private:
  static std::string compose(std::string_view kind, std::string_view message,
                             std::string_view where) {
    std::string s(kind);
    if (!where.empty()) {
      s += " at ";
      s += where;
    }
    s += ": ";
    s += message;
    return s;
  }

  std::string kind_;
  std::string message_;
  std::string where_;
};

// The subclasses differ only in name and meaning; one macro keeps them identical otherwise.
#define DIFFTRAIN_DEFINE_ERROR(Name, Doc)                                     \
  /** Doc */                                                                  \
  class Name : public Error {                                                 \
   public:                                                                    \
    Name(std::string message, std::string where)                              \
        : Error("difftrain::" #Name, std::move(message), std::move(where)) {} \
  };

DIFFTRAIN_DEFINE_ERROR(ConfigError, "An option, a name or a combination of options is invalid.")
DIFFTRAIN_DEFINE_ERROR(ShapeError, "A tensor has the wrong shape, rank or size.")
DIFFTRAIN_DEFINE_ERROR(FormatError,
                       "A file or serialised state is malformed or of the wrong version.")
DIFFTRAIN_DEFINE_ERROR(NumericError, "A value is not finite or out of its numeric range.")
DIFFTRAIN_DEFINE_ERROR(DeviceError, "A device or dtype cannot do what was asked.")
DIFFTRAIN_DEFINE_ERROR(IoError,
                       "A file or folder cannot be read or written: missing, a folder where a "
                       "file belongs, no permission, a read-only or full disk.")
DIFFTRAIN_DEFINE_ERROR(DistributedError,
                       "Another process of a distributed run failed, hung or disagreed: a rank "
                       "died, a collective timed out, the rendezvous could not be reached.")

#undef DIFFTRAIN_DEFINE_ERROR

}  // namespace difftrain
