// util/error.h: the project's error policy in types.
//
//   InvalidInput  bad input from a user or a client (a request field, a CLI flag, a file a user
//                 handed us). Servers turn it into a 4xx whose message names the field and value.
//   NotFound      a named thing does not exist (model, adapter, file); servers answer 404.
//   Conflict      the request contradicts existing state (an adapter name reused); 409.
//   Environment   the machine failed us (I/O, disk full, a network peer). Carries paths/values.
//   Unsupported   a valid input this build or model cannot handle (a config feature, a dtype).
// Broken invariants are not exceptions: LS_CHECK aborts with file:line and context.
//
// Thread-safety: all functions are thread-safe.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace lorasync {

enum class ErrorKind {
  kInvalidInput,
  kNotFound,
  kConflict,
  kEnvironment,
  kUnsupported,
  kInternal,
  kForbidden,     // a path outside the allowed roots; 403
  kUnavailable,   // capacity exhausted (all adapter slots busy, shutting down); 503/507
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message, std::string param = {})
      : std::runtime_error(std::move(message)), kind_(kind), param_(std::move(param)) {}
  ErrorKind kind() const { return kind_; }
  // The request field or setting at fault, when there is one ("max_tokens").
  const std::string& param() const { return param_; }

 private:
  ErrorKind kind_;
  std::string param_;
};

template <typename... Args>
[[noreturn]] void throw_invalid(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(ErrorKind::kInvalidInput, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
[[noreturn]] void throw_env(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(ErrorKind::kEnvironment, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
[[noreturn]] void throw_unsupported(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(ErrorKind::kUnsupported, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
[[noreturn]] void throw_not_found(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(ErrorKind::kNotFound, fmt::format(f, std::forward<Args>(args)...));
}

// "errno text" for the current errno, for Environment errors.
std::string errno_text();

[[noreturn]] void check_failed(const char* file, int line, const char* cond, const std::string& msg);

}  // namespace lorasync

// LS_CHECK(cond, "fmt", args...): invariant check, always on; aborts with context on failure.
#define LS_CHECK(cond, ...)                                                            \
  do {                                                                                 \
    if (!(cond)) [[unlikely]]                                                          \
      ::lorasync::check_failed(__FILE__, __LINE__, #cond, ::fmt::format("" __VA_ARGS__)); \
  } while (0)
