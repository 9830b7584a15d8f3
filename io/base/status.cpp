#include "io/base/status.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

namespace strata {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::ok:
      return "ok";
    case StatusCode::invalid_argument:
      return "invalid argument";
    case StatusCode::not_found:
      return "not found";
    case StatusCode::corruption:
      return "corruption";
    case StatusCode::io_error:
      return "I/O error";
    case StatusCode::no_space:
      return "no space";
    case StatusCode::permission_denied:
      return "permission denied";
    case StatusCode::unavailable:
      return "unavailable";
    case StatusCode::unknown:
      return "error";
  }
  return "error";
}

std::string errno_text(int error_number) {
  const char* name = strerrorname_np(error_number);
  return fmt::format("{} ({})", std::strerror(error_number),
                     name ? name : fmt::format("errno {}", error_number));
}

Status Status::from_errno(int err, const std::string& what, const std::string& advice) {
  std::string message =
      fmt::format("{}: {}{}{}", what, errno_text(err), advice.empty() ? "" : "; ", advice);
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return not_found(std::move(message));
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
      return no_space(std::move(message));
    case EACCES:
    case EPERM:
    case EROFS:
      return permission_denied(std::move(message));
    default:
      return io_error(std::move(message));
  }
}

}  // namespace strata
