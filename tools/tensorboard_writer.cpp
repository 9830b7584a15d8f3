#include "tools/tensorboard_writer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <utility>

#include "tools/tfrecord.h"

#if STRATA_HAS_PROTOBUF
#include "tools/tensorboard_event.pb.h"
#endif

namespace strata::tools {

#if STRATA_HAS_PROTOBUF
namespace {

// TensorBoard's writers number themselves within a process; so do these,
// which keeps two files opened in one second apart.
std::atomic<int> writers_opened{0};

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

std::string framed(const tensorboard::Event& event) {
  return tfrecord(event.SerializeAsString());
}

std::string file_version_record(double wall_time) {
  tensorboard::Event event;
  event.set_wall_time(wall_time);
  event.set_file_version("brain.Event:2");
  event.mutable_source_metadata()->set_writer("strata");
  return framed(event);
}

std::string scalar_records(const std::vector<ScalarEvent>& events, double wall_time) {
  std::string records;
  for (const ScalarEvent& scalar : events) {
    tensorboard::Event event;
    event.set_wall_time(wall_time);
    event.set_step(scalar.step);
    tensorboard::Summary::Value* value = event.mutable_summary()->add_value();
    value->set_tag(scalar.tag);
    value->set_simple_value(static_cast<float>(scalar.value));
    records += framed(event);
  }
  return records;
}

}  // namespace
#endif

double wall_clock_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

Result<TensorBoardWriter> TensorBoardWriter::open(const std::string& directory, double wall_time,
                                                  io::FileSystem& file_system) {
#if !STRATA_HAS_PROTOBUF
  (void)wall_time;
  (void)file_system;
  return Status::invalid_argument(fmt::format(
      "{}: this strata was built without protobuf, which writes TensorBoard's event files; "
      "install libprotobuf-dev and protobuf-compiler (tools/setup-debian) and rebuild, or use the "
      "csv_monitor block or --metrics",
      directory));
#else
  if (Status made = create_monitor_directory(directory); !made) return made;
  TensorBoardWriter writer;
  writer.file_system_ = &file_system;
  writer.path_ = (std::filesystem::path(directory) /
                  fmt::format("events.out.tfevents.{:010d}.{}.{}.{}", int64_t(wall_time),
                              host_name(), getpid(), writers_opened.fetch_add(1)))
                     .string();
  writer.fd_ = file_system.open(writer.path_, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (writer.fd_ < 0) return io::file_error(writer.path_, "create", -writer.fd_);
  if (Status s = writer.append(file_version_record(wall_time)); !s) return s;
  return writer;
#endif
}

TensorBoardWriter::TensorBoardWriter(TensorBoardWriter&& other) noexcept
    : file_system_(other.file_system_),
      path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      size_(other.size_) {}

TensorBoardWriter& TensorBoardWriter::operator=(TensorBoardWriter&& other) noexcept {
  if (this != &other) {
    close();
    file_system_ = other.file_system_;
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
  }
  return *this;
}

TensorBoardWriter::~TensorBoardWriter() {
  close();
}

void TensorBoardWriter::close() {
  if (fd_ >= 0) (void)file_system_->close(fd_);  // every record is written already
  fd_ = -1;
}

Status TensorBoardWriter::write(const std::vector<ScalarEvent>& events, double wall_time) {
#if STRATA_HAS_PROTOBUF
  if (events.empty()) return Status::ok();
  return append(scalar_records(events, wall_time));
#else
  (void)events;
  (void)wall_time;
  return Status::ok();  // open() refused: there is no writer to call
#endif
}

Status TensorBoardWriter::append(const std::string& records) {
  if (fd_ < 0) return Status::io_error(fmt::format("{}: the event file is closed", path_));
  Status written =
      io::write_fully(*file_system_, fd_, records.data(), records.size(), size_, path_);
  if (!written) return written;
  size_ += records.size();
  return Status::ok();
}

}  // namespace strata::tools
