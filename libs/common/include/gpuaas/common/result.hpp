#pragma once
// Expected failures are values: Result<T> holds either a T or an Error carrying a gRPC-style
// code, a stable machine reason, a human message, details and whether a retry may succeed.
// Exceptions from libraries (libpqxx, yaml-cpp, ...) are converted at adapter boundaries.
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace gpuaas {

// Numbers match gpuaas.v1.Code (and google.rpc.Code).
enum class Code : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

const char* CodeName(Code code);

// A stable snake_case reason (Status.reason) from a registry: each service lists every reason it
// answers in one header (`<service>_reasons.hpp`, libs/common's in `reasons.hpp`), one
// `inline constexpr Reason kName{"text"};` a line. Errors are made from these constants and
// decisions compare an error's reason with one (`e.Is(reason::kDiskBusy)`), never with free text;
// a client still accepts reasons it does not know (they grow with the product).
class Reason {
 public:
  explicit constexpr Reason(std::string_view text) : text_(text) {}
  constexpr std::string_view text() const { return text_; }
  std::string str() const { return std::string(text_); }
  friend bool operator==(Reason a, Reason b) { return a.text_ == b.text_; }
  friend bool operator==(const std::string& s, Reason r) { return s == r.text_; }

 private:
  std::string_view text_;
};

struct Error {
  Code code = Code::kUnknown;
  std::string reason;   // stable snake_case, e.g. "node_id_invalid" (a registry's Reason)
  std::string message;  // for humans
  std::map<std::string, std::string> details;
  bool retryable = false;

  // Whether this is `r` (whatever the code).
  bool Is(Reason r) const { return reason == r; }

  // An error of any code; `retryable` as the caller says.
  static Error Of(Code code, Reason reason, std::string message,
                  std::map<std::string, std::string> details = {}, bool retryable = false) {
    return {code, reason.str(), std::move(message), std::move(details), retryable};
  }
  static Error InvalidArgument(Reason reason, std::string message,
                               std::map<std::string, std::string> details = {}) {
    return InvalidArgument(reason.str(), std::move(message), std::move(details));
  }
  static Error NotFound(Reason reason, std::string message) {
    return NotFound(reason.str(), std::move(message));
  }
  static Error FailedPrecondition(Reason reason, std::string message) {
    return FailedPrecondition(reason.str(), std::move(message));
  }
  static Error Unavailable(Reason reason, std::string message) {
    return Unavailable(reason.str(), std::move(message));
  }
  static Error Internal(Reason reason, std::string message) {
    return Internal(reason.str(), std::move(message));
  }
  static Error Aborted(Reason reason, std::string message) {
    return Aborted(reason.str(), std::move(message));
  }

  static Error InvalidArgument(std::string reason, std::string message,
                               std::map<std::string, std::string> details = {}) {
    return {Code::kInvalidArgument, std::move(reason), std::move(message), std::move(details),
            false};
  }
  static Error NotFound(std::string reason, std::string message) {
    return {Code::kNotFound, std::move(reason), std::move(message), {}, false};
  }
  static Error FailedPrecondition(std::string reason, std::string message) {
    return {Code::kFailedPrecondition, std::move(reason), std::move(message), {}, false};
  }
  static Error Unavailable(std::string reason, std::string message) {
    return {Code::kUnavailable, std::move(reason), std::move(message), {}, true};
  }
  static Error Internal(std::string reason, std::string message) {
    return {Code::kInternal, std::move(reason), std::move(message), {}, false};
  }
  static Error Aborted(std::string reason, std::string message) {
    return {Code::kAborted, std::move(reason), std::move(message), {}, true};
  }

  // "CODE reason: message {k=v, ...}" for logs and CLI output.
  std::string ToString() const;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}      // NOLINT(google-explicit-constructor)
  Result(Error error) : v_(std::move(error)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  const Error& error() const { return std::get<1>(v_); }
  Error& error() { return std::get<1>(v_); }

 private:
  std::variant<T, Error> v_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)) {}  // NOLINT(google-explicit-constructor)
  bool ok() const { return !error_.has_value(); }
  explicit operator bool() const { return ok(); }
  const Error& error() const { return *error_; }
  Error& error() { return *error_; }

 private:
  std::optional<Error> error_;
};

inline Result<void> Ok() { return {}; }

}  // namespace gpuaas
