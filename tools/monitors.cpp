#include "tools/monitors.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

namespace strata::tools {

Status create_monitor_directory(const std::string& directory) {
  namespace fs = std::filesystem;
  std::error_code error;
  fs::create_directories(directory, error);
  if (!error && !fs::is_directory(directory, error) && !error)
    error = std::make_error_code(std::errc::not_a_directory);
  if (error)
    return Status::from_errno(error.value(),
                              fmt::format("{}: cannot create the directory", directory),
                              "name a directory you may write in");
  if (access(directory.c_str(), W_OK | X_OK) != 0)
    return Status::from_errno(errno, fmt::format("{}: cannot write in the directory", directory),
                              "name a directory you may write in");
  return Status::ok();
}

}  // namespace strata::tools
