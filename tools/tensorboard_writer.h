// TensorBoardWriter: the event file `strata train` writes for TensorBoard (the
// DeepSpeed config's "tensorboard" block, or --tensorboard DIR).
//
// open() creates the directory when missing and a new file in it, named as
// TensorBoard's own writer names them (events.out.tfevents.<seconds>.<host>.
// <pid>.<n>, n counting the writers of this process), whose first record is
// the file_version event "brain.Event:2". write() adds one event per scalar,
// a Summary with its tag and value (a float, TensorBoard's simple_value) at
// its step, as DeepSpeed's SummaryWriter.add_scalar does, framed as TFRecords
// (tools/tfrecord.h). Each call is one write to the file, with nothing held
// back in this process, so a run cut short leaves whole records behind.
// Files go through an io::FileSystem. Built without protobuf, open() refuses
// in one line. Not thread-safe: the training loop is the only caller.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/base/status.h"
#include "io/file_system.h"
#include "tools/monitors.h"

namespace strata::tools {

class TensorBoardWriter {
 public:
  // `wall_time`: seconds since the epoch, for the file's name and first event.
  static Result<TensorBoardWriter> open(const std::string& directory, double wall_time,
                                        io::FileSystem& file_system = io::FileSystem::real());
  TensorBoardWriter(TensorBoardWriter&&) noexcept;
  TensorBoardWriter& operator=(TensorBoardWriter&&) noexcept;
  ~TensorBoardWriter();

  // The events, each stamped with `wall_time` (seconds since the epoch).
  Status write(const std::vector<ScalarEvent>& events, double wall_time);

  const std::string& path() const { return path_; }

 private:
  TensorBoardWriter() = default;
  Status append(const std::string& records);
  void close();

  io::FileSystem* file_system_ = nullptr;
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;  // bytes written so far: where the next record goes
};

// Seconds since the epoch, now: the wall_time of events.
double wall_clock_seconds();

}  // namespace strata::tools
