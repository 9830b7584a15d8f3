// Errors as values.
//
// A Status is either ok or carries a one-line message that names what failed,
// where (file, key path, offset) and, when the user can fix it, what to do,
// and a code that says what kind of failure it is, so that a caller decides by
// the code and never by searching the message (in the manner of LevelDB's).
// Status::from_errno is the one place an errno becomes a Status.
// Result<T> holds either a T or a non-ok Status. Both are cheap to move and
// are not thread-safe to mutate concurrently (like any value type).
//
// Every room of strata above io/ returns these for errors a user can cause;
// nothing fails silently.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace strata {

enum class StatusCode {
  ok,
  invalid_argument,   // a malformed or contradictory input: a flag, a key, a value
  not_found,          // a file, directory, key or tensor that is not there
  corruption,         // data that does not read back as written: truncated, bad checksum
  io_error,           // the operating system refused a read or write
  no_space,           // a disk (or a budget) is full
  permission_denied,  // a path the process may not read or write (read-only, not owned)
  unavailable,        // a peer or a device that did not answer in time
  unknown,            // anything else (Status::error)
};

// "invalid argument", "not found", ...
const char* status_code_name(StatusCode code);

// An errno value as text for messages: "Input/output error (EIO)".
std::string errno_text(int error_number);

class Status {
 public:
  Status() = default;
  static Status ok() { return Status(); }
  // A failure of no particular kind.
  static Status error(std::string message) {
    return Status(StatusCode::unknown, std::move(message));
  }
  static Status invalid_argument(std::string message) {
    return Status(StatusCode::invalid_argument, std::move(message));
  }
  static Status not_found(std::string message) {
    return Status(StatusCode::not_found, std::move(message));
  }
  static Status corruption(std::string message) {
    return Status(StatusCode::corruption, std::move(message));
  }
  static Status io_error(std::string message) {
    return Status(StatusCode::io_error, std::move(message));
  }
  static Status no_space(std::string message) {
    return Status(StatusCode::no_space, std::move(message));
  }
  static Status permission_denied(std::string message) {
    return Status(StatusCode::permission_denied, std::move(message));
  }
  static Status unavailable(std::string message) {
    return Status(StatusCode::unavailable, std::move(message));
  }
  // "what: <errno_text(err)>", then "; advice" when there is advice, with the
  // code errno implies (ENOENT/ENOTDIR: not_found, ENOSPC/EDQUOT/ENOMEM:
  // no_space, EACCES/EPERM/EROFS: permission_denied, else io_error).
  static Status from_errno(int err, const std::string& what, const std::string& advice = "");

  bool is_ok() const { return code_ == StatusCode::ok; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  bool is(StatusCode code) const { return code_ == code; }
  const std::string& message() const {
    static const std::string kOk = "ok";
    return message_ ? *message_ : kOk;
  }

  // Returns a status whose message is "prefix: message" (for adding context
  // such as the file name on the way up).
  // The code is kept.
  Status with_context(const std::string& prefix) const {
    if (is_ok()) return *this;
    return Status(code_, prefix + ": " + *message_);
  }

 private:
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  StatusCode code_ = StatusCode::ok;
  std::optional<std::string> message_;
};

template <typename T>
class Result {
 public:
  Result(T value) : state_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : state_(std::move(status)) {}  // NOLINT: implicit by design

  bool is_ok() const { return std::holds_alternative<T>(state_); }
  explicit operator bool() const { return is_ok(); }

  const T& value() const& { return std::get<T>(state_); }
  T& value() & { return std::get<T>(state_); }
  T&& value() && { return std::get<T>(std::move(state_)); }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

  // A reference that lives as long as this Result (so status().message() is safe to keep).
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(state_);
  }

 private:
  std::variant<T, Status> state_;
};

}  // namespace strata
