// Token files: nanoGPT, llm.c (uint16 and uint32) and raw uint32; the sequential
// order of core/data/token_data.h; corrupt files refused with the reason.
#include "core/data/token_data.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "io/file_system.h"
#include "tiers_test_support.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

class TokenData : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("strata-tokens-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  template <typename T>
  std::string write(const std::string& name, const std::vector<T>& tokens,
                    const std::vector<int32_t>& header = {}) {
    const std::string path = (dir_ / name).string();
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), header.size() * 4);
    out.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(T));
    return path;
  }
  static std::vector<int32_t> llmc_header(int32_t magic, int32_t count) {
    std::vector<int32_t> header(256, 0);
    header[0] = magic;
    header[1] = magic == kLlmcMagicUint16 ? 1 : 7;
    header[2] = count;
    return header;
  }

  fs::path dir_;
};

TEST_F(TokenData, NanoGptSequencesFollowTheSequentialOrder) {
  std::vector<uint16_t> tokens(41);
  std::iota(tokens.begin(), tokens.end(), 0);
  Result<TokenFile> file = TokenFile::open(write("train.bin", tokens));
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  EXPECT_EQ(file->format(), TokenFormat::nanogpt_uint16);
  const int64_t T = 4;
  EXPECT_EQ(file->sequence_count(T), 10);  // (41 - 1) / 4
  // World 2, B 2: micro-batch 1 on rank 1 from offset 7 reads sequences 7 + (1*2+1)*2 + b = 13, 14
  // -> 3, 4.
  std::vector<int32_t> inputs(2 * T), targets(2 * T);
  ASSERT_TRUE(
      read_micro_batch(*file, 7, 1, 1, 2, 2, T, 100, inputs.data(), targets.data()).is_ok());
  EXPECT_EQ(inputs, (std::vector<int32_t>{12, 13, 14, 15, 16, 17, 18, 19}));
  EXPECT_EQ(targets, (std::vector<int32_t>{13, 14, 15, 16, 17, 18, 19, 20}));
  EXPECT_EQ(sequence_index(7, 1, 1, 2, 2, 1, 10), 4);
}

TEST_F(TokenData, AShuffledOrderReadsTheSequencesItNames) {
  std::vector<uint16_t> tokens(41);
  std::iota(tokens.begin(), tokens.end(), 0);
  Result<TokenFile> file = TokenFile::open(write("train.bin", tokens));
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  file->expect_random_access();
  const int64_t T = 4;
  const SequenceOrder order = SequenceOrder::shuffled(std::random_device{}());
  std::printf("order %s\n", order.describe().c_str());
  // World 2, B 2, offset 7: micro-batch 1 on rank 1 reads positions 13 and 14,
  // in the second pass over the 10 sequences.
  std::vector<int32_t> inputs(2 * T), targets(2 * T);
  ASSERT_TRUE(
      read_micro_batch(*file, order, 7, 1, 1, 2, 2, T, 100, inputs.data(), targets.data()).is_ok());
  for (int64_t b = 0; b < 2; ++b) {
    const int64_t j = shuffled_sequence(order.seed(), 1, 3 + b, 10);
    EXPECT_EQ(sequence_index(order, 7, 1, 1, 2, 2, b, 10), j);
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(inputs[size_t(b * T + t)], j * T + t);
      EXPECT_EQ(targets[size_t(b * T + t)], j * T + t + 1);
    }
  }
}

TEST_F(TokenData, LlmcShardsOfBothWidthsAndRawUint32) {
  std::vector<uint16_t> small = {5, 6, 7, 8, 9};
  Result<TokenFile> u16 = TokenFile::open(write("a.bin", small, llmc_header(kLlmcMagicUint16, 5)));
  ASSERT_TRUE(u16.is_ok()) << u16.status().message();
  EXPECT_EQ(u16->format(), TokenFormat::llmc);
  EXPECT_EQ(u16->size(), 5);
  EXPECT_EQ(u16->at(4), 9u);
  std::vector<uint32_t> big = {100000, 128000, 3, 4};
  Result<TokenFile> u32 = TokenFile::open(write("b.bin", big, llmc_header(kLlmcMagicUint32, 4)));
  ASSERT_TRUE(u32.is_ok()) << u32.status().message();
  EXPECT_EQ(u32->bytes_per_token(), 4);
  EXPECT_EQ(u32->at(1), 128000u);
  Result<TokenFile> raw = TokenFile::open(write("c.u32", big), TokenFormat::raw_uint32);
  ASSERT_TRUE(raw.is_ok());
  EXPECT_EQ(raw->size(), 4);
  EXPECT_EQ(raw->at(0), 100000u);
}

TEST_F(TokenData, CorruptOrMismatchedFilesAreRefusedWithTheReason) {
  std::vector<uint16_t> five = {1, 2, 3, 4, 5};
  Result<TokenFile> miscount =
      TokenFile::open(write("m.bin", five, llmc_header(kLlmcMagicUint16, 6)));
  ASSERT_FALSE(miscount.is_ok());
  EXPECT_NE(
      miscount.status().message().find("m.bin: corrupt llm.c shard: the header declares 6 tokens"),
      std::string::npos)
      << miscount.status().message();
  Result<TokenFile> not_llmc = TokenFile::open(write("n.bin", five), TokenFormat::llmc);
  ASSERT_FALSE(not_llmc.is_ok());
  EXPECT_NE(not_llmc.status().message().find("not an llm.c token shard"), std::string::npos);
  std::vector<uint8_t> odd = {1, 2, 3};
  Result<TokenFile> odd_file = TokenFile::open(write("odd.bin", odd));
  ASSERT_FALSE(odd_file.is_ok());
  EXPECT_NE(odd_file.status().message().find("not a whole number of 2-byte tokens"),
            std::string::npos);
  EXPECT_TRUE(miscount.status().is(StatusCode::corruption));
  EXPECT_TRUE(not_llmc.status().is(StatusCode::corruption));
  EXPECT_TRUE(odd_file.status().is(StatusCode::corruption));
  EXPECT_TRUE(TokenFile::open(write("empty.bin", std::vector<uint16_t>{}))
                  .status()
                  .is(StatusCode::corruption));
  const Status absent = TokenFile::open((dir_ / "absent.bin").string()).status();
  EXPECT_TRUE(absent.is(StatusCode::not_found)) << absent.message();
  EXPECT_NE(absent.message().find("absent.bin"), std::string::npos) << absent.message();

  // Tokens beyond the vocabulary name the file and the position.
  Result<TokenFile> file = TokenFile::open(write("v.bin", std::vector<uint16_t>{1, 2, 300, 4, 5}));
  ASSERT_TRUE(file.is_ok());
  std::vector<int32_t> inputs(4), targets(4);
  Status s = read_micro_batch(*file, 0, 0, 0, 1, 1, 4, 256, inputs.data(), targets.data());
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("v.bin: token 300 at position 2"), std::string::npos) << s.message();
  EXPECT_TRUE(s.is(StatusCode::invalid_argument)) << s.message();
  // Too short for one sequence.
  Status short_data =
      read_micro_batch(*file, 0, 0, 0, 1, 1, 8, 1000, inputs.data(), targets.data());
  EXPECT_NE(short_data.message().find("fewer than one sequence"), std::string::npos)
      << short_data.message();
  EXPECT_TRUE(parse_token_format("int8").status().is(StatusCode::invalid_argument));
}

TEST_F(TokenData, ATruncatedShardOfRandomTokensIsACorruption) {
  std::mt19937_64 random(tiers::testing::fresh_seed("token_data"));
  std::vector<uint16_t> tokens(2 + random() % 5000);
  for (uint16_t& token : tokens) token = uint16_t(random());
  const std::string path =
      write("shard.bin", tokens, llmc_header(kLlmcMagicUint16, int32_t(tokens.size())));
  Result<TokenFile> whole = TokenFile::open(path);
  ASSERT_TRUE(whole.is_ok()) << whole.status().message();
  for (size_t i = 0; i < tokens.size(); ++i) ASSERT_EQ(whole->at(int64_t(i)), tokens[i]);

  // Cut anywhere past the magic: into the tokens (the header's count
  // disagrees) or into the header.
  const uint64_t size = fs::file_size(path);
  fs::resize_file(path, 4 + random() % (size - 4));
  Result<TokenFile> cut = TokenFile::open(path);
  ASSERT_FALSE(cut.is_ok());
  EXPECT_TRUE(cut.status().is(StatusCode::corruption)) << cut.status().message();
  EXPECT_NE(cut.status().message().find("shard.bin"), std::string::npos) << cut.status().message();
  EXPECT_EQ(cut.status().message().find('\n'), std::string::npos) << cut.status().message();
}

TEST_F(TokenData, OpensSizesAndMapsThroughTheFileSystem) {
  std::mt19937_64 random(tiers::testing::fresh_seed("token_data"));
  std::vector<uint16_t> tokens(2 + random() % 5000);
  for (uint16_t& token : tokens) token = uint16_t(random());
  const std::string path = write("train.bin", tokens);
  io::FaultInjectingFileSystem faults;
  Result<TokenFile> file = TokenFile::open(path, TokenFormat::automatic, faults);
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  EXPECT_EQ(faults.calls(io::FileOp::kOpen), 1u);
  EXPECT_EQ(faults.calls(io::FileOp::kStat), 1u);
  EXPECT_EQ(faults.calls(io::FileOp::kMap), 1u);
  EXPECT_EQ(faults.calls(io::FileOp::kClose), 1u);  // the mapping outlives the descriptor

  struct Case {
    io::FileOp op;
    int error_number;
    StatusCode code;
  };
  for (const Case& c : {Case{io::FileOp::kOpen, EACCES, StatusCode::permission_denied},
                        Case{io::FileOp::kStat, EIO, StatusCode::io_error},
                        Case{io::FileOp::kMap, ENOMEM, StatusCode::no_space}}) {
    faults.add({.op = c.op, .nth_call = faults.calls(c.op) + 1, .error_number = c.error_number});
    const Status status = TokenFile::open(path, TokenFormat::automatic, faults).status();
    ASSERT_FALSE(status.is_ok()) << io::file_op_name(c.op);
    EXPECT_TRUE(status.is(c.code)) << status.message();
    EXPECT_NE(status.message().find("train.bin"), std::string::npos) << status.message();
    EXPECT_NE(status.message().find(errno_text(c.error_number)), std::string::npos)
        << status.message();
  }
  EXPECT_EQ(faults.calls(io::FileOp::kClose), 3u);  // every descriptor opened was closed
}

}  // namespace
}  // namespace strata
