// Errno values as text for messages: "Input/output error (EIO)".
#pragma once

#include <string>

namespace strata::io {

std::string errno_text(int error_number);

}  // namespace strata::io
