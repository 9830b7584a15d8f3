#include "tools/csv_monitor_writer.h"

#include <fcntl.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <utility>

namespace strata::tools {
namespace {

// A field as Python's csv writer (QUOTE_MINIMAL) writes it.
std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\r\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char c : text) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
  return quoted + "\"";
}

std::string csv_row(const std::string& first, const std::string& second) {
  return csv_field(first) + "," + csv_field(second) + "\r\n";
}

// DeepSpeed's file name of an event and its column header.
std::string file_name_of(const std::string& tag) {
  std::string name = tag;
  for (char& c : name)
    if (c == '/' || c == ' ') c = '_';
  return name + ".csv";
}

std::string header_of(const std::string& tag) {
  const size_t slash = tag.rfind('/');
  return slash == std::string::npos ? tag : tag.substr(slash + 1);
}

}  // namespace

std::string python_float_text(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  // The shortest round-trip digits, as d.ddde[+-]x: split into sign, digits
  // and decimal point position (value = 0.digits x 10^point).
  char buffer[64];
  const std::to_chars_result end =
      std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  const std::string text(buffer, end.ptr);
  const size_t e = text.find('e');
  std::string mantissa = text.substr(0, e);
  const int exponent = std::stoi(text.substr(e + 1));
  std::string sign;
  if (mantissa[0] == '-') {
    sign = "-";
    mantissa.erase(0, 1);
  }
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits += c;
  const int point = exponent + 1;
  if (point <= -4 || point > 16) {
    std::string out = sign + digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    return out + fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  }
  if (point <= 0) return sign + "0." + std::string(size_t(-point), '0') + digits;
  if (size_t(point) >= digits.size())
    return sign + digits + std::string(size_t(point) - digits.size(), '0') + ".0";
  return sign + digits.substr(0, size_t(point)) + "." + digits.substr(size_t(point));
}

Result<CsvMonitorWriter> CsvMonitorWriter::open(const std::string& directory,
                                                io::FileSystem& file_system) {
  if (Status made = create_monitor_directory(directory); !made) return made;
  CsvMonitorWriter writer;
  writer.file_system_ = &file_system;
  writer.directory_ = directory;
  return writer;
}

CsvMonitorWriter::CsvMonitorWriter(CsvMonitorWriter&& other) noexcept
    : file_system_(other.file_system_),
      directory_(std::move(other.directory_)),
      files_(std::exchange(other.files_, {})) {}

CsvMonitorWriter& CsvMonitorWriter::operator=(CsvMonitorWriter&& other) noexcept {
  if (this != &other) {
    close();
    file_system_ = other.file_system_;
    directory_ = std::move(other.directory_);
    files_ = std::exchange(other.files_, {});
  }
  return *this;
}

CsvMonitorWriter::~CsvMonitorWriter() {
  close();
}

void CsvMonitorWriter::close() {
  for (auto& [name, file] : files_)
    if (file.fd >= 0) (void)file_system_->close(file.fd);  // every row is written already
  files_.clear();
}

Result<CsvMonitorWriter::File*> CsvMonitorWriter::file_for(const std::string& tag,
                                                           std::string& rows) {
  const std::string name = file_name_of(tag);
  auto found = files_.find(name);
  if (found != files_.end()) return &found->second;
  File file;
  file.path = (std::filesystem::path(directory_) / name).string();
  file.fd = file_system_->open(file.path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (file.fd < 0) return io::file_error(file.path, "open", -file.fd);
  const int64_t size = file_system_->file_size(file.fd);
  if (size < 0) {
    (void)file_system_->close(file.fd);
    return io::file_error(file.path, "stat", int(-size));
  }
  file.size = uint64_t(size);  // DeepSpeed appends ("a+")
  rows = csv_row("step", header_of(tag));
  return &files_.emplace(name, std::move(file)).first->second;
}

Status CsvMonitorWriter::write(const std::vector<ScalarEvent>& events) {
  // The rows of each file, in the order their events come, then one write per file.
  std::vector<std::pair<File*, std::string>> pending;
  for (const ScalarEvent& event : events) {
    std::string header;
    Result<File*> file = file_for(event.tag, header);
    if (!file) return file.status();
    auto entry = std::find_if(pending.begin(), pending.end(),
                              [&](const auto& p) { return p.first == *file; });
    if (entry == pending.end()) entry = pending.insert(pending.end(), {*file, ""});
    entry->second += header + csv_row(std::to_string(event.step), python_float_text(event.value));
  }
  for (auto& [file, rows] : pending) {
    Status written =
        io::write_fully(*file_system_, file->fd, rows.data(), rows.size(), file->size, file->path);
    if (!written) return written;
    file->size += rows.size();
  }
  return Status::ok();
}

}  // namespace strata::tools
