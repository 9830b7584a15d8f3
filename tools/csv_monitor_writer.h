// CsvMonitorWriter: the CSV files of the DeepSpeed config's "csv_monitor"
// block, laid out as DeepSpeed's csvMonitor writes them: in the block's
// directory (output_path/job_name), one file per event name with '/' and ' '
// made '_' ("Train/Samples/train_loss" -> Train_Samples_train_loss.csv),
// appended to, whose rows are "step,value" (Python's csv module: CRLF line
// ends, values as Python prints them) after a header row "step,<the part of
// the name after its last '/'>" written the first time this run writes that
// file (so a resumed run appends a header and its rows, as DeepSpeed's does).
// Each file gets one write per call, nothing held back in this process.
// Files go through an io::FileSystem. Not thread-safe: the training loop is
// the only caller.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "io/base/status.h"
#include "io/file_system.h"
#include "tools/monitors.h"

namespace strata::tools {

class CsvMonitorWriter {
 public:
  // Creates `directory` when missing; the files are made as their events come.
  static Result<CsvMonitorWriter> open(const std::string& directory,
                                       io::FileSystem& file_system = io::FileSystem::real());
  CsvMonitorWriter(CsvMonitorWriter&&) noexcept;
  CsvMonitorWriter& operator=(CsvMonitorWriter&&) noexcept;
  ~CsvMonitorWriter();

  Status write(const std::vector<ScalarEvent>& events);

  const std::string& directory() const { return directory_; }

 private:
  struct File {
    std::string path;
    int fd = -1;
    uint64_t size = 0;  // where the next row goes: the end of the file
  };
  CsvMonitorWriter() = default;
  // The file of `tag`, opened (and its header row added to `rows`) on first use.
  Result<File*> file_for(const std::string& tag, std::string& rows);
  void close();

  io::FileSystem* file_system_ = nullptr;
  std::string directory_;
  std::map<std::string, File> files_;  // by file name
};

// A double as Python's repr() and csv module print it: the shortest digits
// that read back as the same double, in positional notation unless the decimal
// exponent is below -4 or 16 and above ("0.0001", "1e-05", "2.0", "1e+16",
// "inf", "nan").
std::string python_float_text(double value);

}  // namespace strata::tools
