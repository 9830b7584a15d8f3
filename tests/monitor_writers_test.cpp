// The monitors' files: TFRecord framing and CRC-32C (the standard's check
// values), TensorBoard's event records byte for byte as protobuf's wire format
// lays them out (built here by hand, not with protobuf), the file's name and
// its first record, and DeepSpeed's CSV layout (file per event name, header,
// CRLF rows, Python's float text); a failed write or an unusable directory is
// one line naming the path. The same files from a real `strata train` run are
// checked against its metrics by tests/monitor_files_check.py (ctest monitor_files).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "io/file_system.h"
#include "io_test_support.h"
#include "tools/csv_monitor_writer.h"
#include "tools/tensorboard_writer.h"
#include "tools/tfrecord.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;
using io::testing::expect_one_line;
using io::testing::TemporaryDirectory;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string little_endian(uint64_t value, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out.push_back(char((value >> (8 * i)) & 0xff));
  return out;
}

// --- CRC-32C and framing -------------------------------------------------------------

TEST(MonitorTfRecord, Crc32cGivesTheStandardsCheckValues) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);  // the CRC catalogue's check value
  EXPECT_EQ(crc32c(""), 0u);
  // RFC 3720 (iSCSI), appendix B.4.
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending.push_back(char(i));
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  // Continued over pieces, the same as over the whole.
  EXPECT_EQ(crc32c("6789", crc32c("12345")), crc32c("123456789"));
}

TEST(MonitorTfRecord, ARecordIsTheLengthItsCrcTheDataAndItsCrcMaskedAsTensorFlowMasks) {
  const std::string data = "brain";
  const std::string record = tfrecord(data);
  ASSERT_EQ(record.size(), 8 + 4 + data.size() + 4);
  EXPECT_EQ(record.substr(0, 8), little_endian(data.size(), 8));
  auto masked = [](uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; };
  EXPECT_EQ(record.substr(8, 4), little_endian(masked(crc32c(record.substr(0, 8))), 4));
  EXPECT_EQ(record.substr(12, data.size()), data);
  EXPECT_EQ(record.substr(12 + data.size()), little_endian(masked(crc32c(data)), 4));
  EXPECT_EQ(masked_crc32c(data), masked(crc32c(data)));
}

// --- TensorBoard ---------------------------------------------------------------------

#if STRATA_HAS_PROTOBUF

// --- protobuf's wire format, by hand ------------------------------------------------

std::string varint(uint64_t value) {
  std::string out;
  do {
    uint8_t byte = value & 0x7f;
    value >>= 7;
    out.push_back(char(value ? byte | 0x80 : byte));
  } while (value);
  return out;
}

std::string length_delimited(int field, const std::string& bytes) {
  return varint(uint64_t(field) << 3 | 2) + varint(bytes.size()) + bytes;
}

std::string fixed64_double(int field, double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, 8);
  return varint(uint64_t(field) << 3 | 1) + little_endian(bits, 8);
}

std::string fixed32_float(int field, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return varint(uint64_t(field) << 3 | 5) + little_endian(bits, 4);
}

// TensorBoard's Event (wall_time 1, step 2, file_version 3, summary 5,
// source_metadata 10), Summary (value 1) and Summary.Value (tag 1, simple_value 2).
std::string scalar_event_bytes(double wall_time, int64_t step, const std::string& tag,
                               float value) {
  const std::string summary_value = length_delimited(1, tag) + fixed32_float(2, value);
  return fixed64_double(1, wall_time) + varint(2 << 3) + varint(uint64_t(step)) +
         length_delimited(5, length_delimited(1, summary_value));
}

// The records of a TFRecord file, each checked: the length's and the data's masked CRCs.
std::vector<std::string> read_records(const std::string& bytes) {
  std::vector<std::string> records;
  size_t at = 0;
  while (at < bytes.size()) {
    EXPECT_GE(bytes.size() - at, 12u) << "a record header cut short at " << at;
    if (bytes.size() - at < 12) break;
    uint64_t length = 0;
    std::memcpy(&length, bytes.data() + at, 8);
    uint32_t length_crc = 0, data_crc = 0;
    std::memcpy(&length_crc, bytes.data() + at + 8, 4);
    EXPECT_EQ(length_crc, masked_crc32c(bytes.substr(at, 8))) << "at " << at;
    EXPECT_GE(bytes.size() - at - 12, length + 4) << "a record cut short at " << at;
    if (bytes.size() - at - 12 < length + 4) break;
    const std::string data = bytes.substr(at + 12, length);
    std::memcpy(&data_crc, bytes.data() + at + 12 + length, 4);
    EXPECT_EQ(data_crc, masked_crc32c(data)) << "at " << at;
    records.push_back(data);
    at += 12 + length + 4;
  }
  return records;
}

TEST(MonitorTensorBoardWriter, TheFileIsNamedAsTensorBoardNamesItAndStartsWithItsVersion) {
  TemporaryDirectory temporary;
  const std::string directory = temporary.path() + "/runs/job";  // made when missing
  Result<TensorBoardWriter> writer = TensorBoardWriter::open(directory, 1500000000.25);
  ASSERT_TRUE(writer.is_ok()) << writer.status().message();
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof(host) - 1), 0);
  const std::string name = fs::path(writer->path()).filename().string();
  const std::regex pattern(std::string("events\\.out\\.tfevents\\.1500000000\\.") +
                           std::regex_replace(host, std::regex("\\."), "\\.") + "\\." +
                           std::to_string(getpid()) + "\\.[0-9]+");
  EXPECT_TRUE(std::regex_match(name, pattern)) << name;
  EXPECT_EQ(fs::path(writer->path()).parent_path(), fs::path(directory));

  // Nothing is held back: the first record is in the file before any write.
  const std::vector<std::string> records = read_records(read_file(writer->path()));
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0], fixed64_double(1, 1500000000.25) + length_delimited(3, "brain.Event:2") +
                            length_delimited(10, length_delimited(1, "strata")));

  // A second writer of this process in the same second has a file of its own.
  Result<TensorBoardWriter> second = TensorBoardWriter::open(directory, 1500000000.25);
  ASSERT_TRUE(second.is_ok()) << second.status().message();
  EXPECT_NE(second->path(), writer->path());
}

TEST(MonitorTensorBoardWriter, EachScalarIsAnEventWithItsTagValueAndStep) {
  TemporaryDirectory temporary;
  Result<TensorBoardWriter> writer = TensorBoardWriter::open(temporary.path(), 1e9);
  ASSERT_TRUE(writer.is_ok()) << writer.status().message();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  ASSERT_TRUE(writer
                  ->write({{"Train/Samples/train_loss", 5.566351801156998, 8},
                           {"Train/Samples/lr", 0.0, 8}},
                          1e9 + 0.5)
                  .is_ok());
  ASSERT_TRUE(writer->write({{"Train/Samples/train_loss", nan, 16}}, 1e9 + 1.5).is_ok());
  const std::vector<std::string> records = read_records(read_file(writer->path()));
  ASSERT_EQ(records.size(), 4u);
  EXPECT_EQ(records[1],
            scalar_event_bytes(1e9 + 0.5, 8, "Train/Samples/train_loss", 5.566351801156998f));
  // A value of 0 is written (TensorBoard would read a missing one as 0 too, but the
  // record says it), as protobuf writes a member of a oneof.
  EXPECT_EQ(records[2], scalar_event_bytes(1e9 + 0.5, 8, "Train/Samples/lr", 0.0f));
  EXPECT_EQ(records[3], scalar_event_bytes(1e9 + 1.5, 16, "Train/Samples/train_loss", NAN));
}

TEST(MonitorTensorBoardWriter, ADirectoryThatCannotBeMadeOrAFailedWriteIsOneLineNamingThePath) {
  TemporaryDirectory temporary;
  const std::string file = temporary.path() + "/plain-file";
  std::ofstream(file) << "x";
  Result<TensorBoardWriter> refused = TensorBoardWriter::open(file + "/tb", 1e9);
  expect_one_line(refused.status(), StatusCode::not_found,
                  file + "/tb: cannot create the directory");
  EXPECT_NE(refused.status().message().find("name a directory you may write in"),
            std::string::npos);

  // A directory this user may not write in (an open that fails as it would there).
  io::FaultInjectingFileSystem denied;
  denied.add({io::FileOp::kOpen, 1, io::FileFaultKind::kError, EACCES, 1});
  Result<TensorBoardWriter> unwritable = TensorBoardWriter::open(temporary.path(), 1e9, denied);
  expect_one_line(unwritable.status(), StatusCode::permission_denied,
                  temporary.path() + "/events.out.tfevents.");
  EXPECT_NE(unwritable.status().message().find("make the directory writable"), std::string::npos)
      << unwritable.status().message();

  io::FaultInjectingFileSystem faulty;
  faulty.add({io::FileOp::kWrite, 2, io::FileFaultKind::kError, EIO, 1});
  Result<TensorBoardWriter> writer = TensorBoardWriter::open(temporary.path(), 1e9, faulty);
  ASSERT_TRUE(writer.is_ok()) << writer.status().message();
  Status failed = writer->write({{"Train/Samples/lr", 1e-3, 1}}, 1e9);
  expect_one_line(failed, StatusCode::io_error, writer->path());
}

#else

TEST(MonitorTensorBoardWriter, WithoutProtobufTheWriterIsRefusedInOneLine) {
  TemporaryDirectory temporary;
  Result<TensorBoardWriter> refused = TensorBoardWriter::open(temporary.path(), 1e9);
  expect_one_line(refused.status(), StatusCode::invalid_argument, "without protobuf");
}

#endif

// --- CSV -------------------------------------------------------------------------------

TEST(MonitorCsvWriter, FloatsArePrintedAsPythonPrintsThem) {
  const std::vector<std::pair<double, std::string>> cases = {
      {0.0001, "0.0001"},
      {1e-05, "1e-05"},
      {2.0, "2.0"},
      {1e16, "1e+16"},
      {1e15, "1000000000000000.0"},
      {9999999999999998.0, "9999999999999998.0"},
      {123.456, "123.456"},
      {5.566351801156998, "5.566351801156998"},
      {0.1 + 0.2, "0.30000000000000004"},
      {1e-7, "1e-07"},
      {1.5e300, "1.5e+300"},
      {12345678901234567890.0, "1.2345678901234567e+19"},
      {65536.0, "65536.0"},
      {-2.5e-10, "-2.5e-10"},
      {0.0, "0.0"},
      {-0.0, "-0.0"},
      {std::numeric_limits<double>::infinity(), "inf"},
      {-std::numeric_limits<double>::infinity(), "-inf"},
      {std::numeric_limits<double>::quiet_NaN(), "nan"},
  };
  for (const auto& [value, text] : cases) EXPECT_EQ(python_float_text(value), text) << text;
}

TEST(MonitorCsvWriter, OneFilePerEventNameWithDeepSpeedsHeaderAndRows) {
  TemporaryDirectory temporary;
  const std::string directory = temporary.path() + "/csv/DeepSpeedJobName";
  Result<CsvMonitorWriter> writer = CsvMonitorWriter::open(directory);
  ASSERT_TRUE(writer.is_ok()) << writer.status().message();
  EXPECT_TRUE(fs::is_directory(directory));
  ASSERT_TRUE(writer->write({{"Train/Samples/train_loss", 5.5, 2}, {"Train/Samples/lr", 1e-05, 2}})
                  .is_ok());
  ASSERT_TRUE(
      writer->write({{"Train/Samples/train_loss", 5.25, 4}, {"eval loss", 0.5, 4}}).is_ok());
  EXPECT_EQ(read_file(directory + "/Train_Samples_train_loss.csv"),
            "step,train_loss\r\n2,5.5\r\n4,5.25\r\n");
  EXPECT_EQ(read_file(directory + "/Train_Samples_lr.csv"), "step,lr\r\n2,1e-05\r\n");
  EXPECT_EQ(read_file(directory + "/eval_loss.csv"), "step,eval loss\r\n4,0.5\r\n");

  // A later run (a resume) appends, with the header again, as DeepSpeed's does.
  Result<CsvMonitorWriter> resumed = CsvMonitorWriter::open(directory);
  ASSERT_TRUE(resumed.is_ok()) << resumed.status().message();
  ASSERT_TRUE(resumed->write({{"Train/Samples/lr", 2e-05, 6}}).is_ok());
  EXPECT_EQ(read_file(directory + "/Train_Samples_lr.csv"),
            "step,lr\r\n2,1e-05\r\nstep,lr\r\n6,2e-05\r\n");
}

TEST(MonitorCsvWriter, ADirectoryThatCannotBeMadeOrAFailedWriteIsOneLineNamingThePath) {
  TemporaryDirectory temporary;
  const std::string file = temporary.path() + "/plain-file";
  std::ofstream(file) << "x";
  expect_one_line(CsvMonitorWriter::open(file).status(), StatusCode::not_found,
                  file + ": cannot create the directory");

  io::FaultInjectingFileSystem denied;
  denied.add({io::FileOp::kOpen, 1, io::FileFaultKind::kError, EACCES, 1});
  Result<CsvMonitorWriter> unwritable = CsvMonitorWriter::open(temporary.path(), denied);
  ASSERT_TRUE(unwritable.is_ok()) << unwritable.status().message();
  expect_one_line(unwritable->write({{"Train/Samples/lr", 1e-3, 1}}), StatusCode::permission_denied,
                  temporary.path() + "/Train_Samples_lr.csv");

  io::FaultInjectingFileSystem faulty;
  faulty.add({io::FileOp::kWrite, 1, io::FileFaultKind::kError, ENOSPC, 1});
  Result<CsvMonitorWriter> writer = CsvMonitorWriter::open(temporary.path(), faulty);
  ASSERT_TRUE(writer.is_ok()) << writer.status().message();
  expect_one_line(writer->write({{"Train/Samples/lr", 1e-3, 1}}), StatusCode::no_space,
                  temporary.path() + "/Train_Samples_lr.csv");
}

}  // namespace
}  // namespace strata::tools
