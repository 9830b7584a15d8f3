// Errors as values.
//
// A Status is either ok or carries a one-line message that names what failed,
// where (file, key path, offset) and, when the user can fix it, what to do.
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

class Status {
 public:
  Status() = default;
  static Status ok() { return Status(); }
  static Status error(std::string message) { return Status(std::move(message)); }

  bool is_ok() const { return !message_.has_value(); }
  explicit operator bool() const { return is_ok(); }
  const std::string& message() const {
    static const std::string kOk = "ok";
    return message_ ? *message_ : kOk;
  }

  // Returns a status whose message is "prefix: message" (for adding context
  // such as the file name on the way up).
  Status with_context(const std::string& prefix) const {
    if (is_ok()) return *this;
    return Status(prefix + ": " + *message_);
  }

 private:
  explicit Status(std::string message) : message_(std::move(message)) {}
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
