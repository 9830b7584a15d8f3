#include "io/errno_text.h"

#include <fmt/format.h>

#include <cstring>

namespace strata::io {

std::string errno_text(int error_number) {
  const char* name = strerrorname_np(error_number);
  return fmt::format("{} ({})", std::strerror(error_number),
                     name ? name : fmt::format("errno {}", error_number));
}

}  // namespace strata::io
