// What `strata prepare-data` writes (prep/prepared_data.h): a chat's
// pieces tokenized as one text with the mask rule (a token is a target when
// any of its bytes comes from a target piece), and token files that TokenFile
// reads back, uint16 or uint32 by vocabulary, with the mask next to them.
#include "prep/prepared_data.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "core/data/token_data.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

Tokenizer load(const std::string& kind) {
  Result<Tokenizer> tokenizer = Tokenizer::load(
      std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/tokenizers/" + kind + "/tokenizer.json");
  EXPECT_TRUE(tokenizer.is_ok()) << tokenizer.status().message();
  return std::move(*tokenizer);
}

// The expected mask, byte by byte: label each byte with its piece's flag.
std::vector<uint8_t> expected_mask(Tokenizer& tokenizer, const std::vector<MarkedText>& pieces) {
  std::string text;
  std::vector<bool> byte_target;
  for (const MarkedText& piece : pieces) {
    text += piece.text;
    byte_target.insert(byte_target.end(), piece.text.size(), piece.target);
  }
  std::vector<TokenSpan> spans;
  tokenizer.encode_spans(text, false, spans);
  std::vector<uint8_t> mask;
  for (const TokenSpan& span : spans) {
    bool any = false;
    for (uint64_t b = span.begin; b < span.end; ++b) any = any || byte_target[b];
    mask.push_back(any ? 1 : 0);
  }
  return mask;
}

TEST(PreparedData, AChatIsTokenizedAsOneTextNotPieceByPiece) {
  Tokenizer llama = load("llama3");
  const std::vector<MarkedText> pieces = {
      {"<|start_header_id|>user<|end_header_id|>\n\nWhat is 12345 + 1?<|eot_id|>"
       "<|start_header_id|>assistant<|end_header_id|>\n\n",
       false},
      {"It is 12346.<|eot_id|>", true},
      {"<|start_header_id|>user<|end_header_id|>\n\nand the model ", false},
      {"answers 345", true}};
  TokenStream stream;
  append_marked_text(llama, pieces, stream);
  std::string whole;
  for (const MarkedText& piece : pieces) whole += piece.text;
  EXPECT_EQ(stream.tokens, llama.encode(whole, false));
  // Piece by piece, "model " + "answers" would split where the text does not
  // (the text's pre-token is " answers").
  std::vector<uint32_t> piecewise;
  for (const MarkedText& piece : pieces) {
    std::vector<uint32_t> ids = llama.encode(piece.text, false);
    piecewise.insert(piecewise.end(), ids.begin(), ids.end());
  }
  EXPECT_NE(stream.tokens, piecewise);
  EXPECT_EQ(stream.mask, expected_mask(llama, pieces));
  // The assistant's reply and its <|eot_id|> are targets; the headers are not.
  const uint32_t eot = *llama.token_id("<|eot_id|>");
  const uint32_t header = *llama.token_id("<|start_header_id|>");
  int eot_seen = 0;
  for (size_t i = 0; i < stream.tokens.size(); ++i) {
    if (stream.tokens[i] == header) {
      EXPECT_EQ(stream.mask[i], 0) << i;
    }
    if (stream.tokens[i] == eot) {
      EXPECT_EQ(stream.mask[i], eot_seen++ == 1 ? 1 : 0) << i;
    }
  }
  EXPECT_EQ(eot_seen, 2);
  EXPECT_GT(stream.targets(), 0);
  EXPECT_LT(stream.targets(), int64_t(stream.tokens.size()));
}

// Llama 2's normalizer rewrites every space (and prepends "▁" to the text
// between special tokens): the mask still follows the characters the tokens
// came from, so the reply with its leading space and </s> are the targets.
TEST(PreparedData, ASentencePieceChatTargetsTheReplyThroughTheNormalizer) {
  Tokenizer llama2 = load("llama2");
  const std::vector<MarkedText> pieces = {{"<s>[INST] What is 12 + 1? [/INST]", false},
                                          {" It is 13. </s>", true},
                                          {"<s>[INST] and then [/INST]", false},
                                          {" 14 </s>", true}};
  TokenStream stream;
  append_marked_text(llama2, pieces, stream);
  std::string whole;
  for (const MarkedText& piece : pieces) whole += piece.text;
  EXPECT_EQ(stream.tokens, llama2.encode(whole, false));
  EXPECT_EQ(stream.mask, expected_mask(llama2, pieces));
  std::string targets, others;
  for (size_t i = 0; i < stream.tokens.size(); ++i)
    (stream.mask[i] ? targets : others) += llama2.decode({stream.tokens[i]}) + "|";
  const uint32_t bos = *llama2.token_id("<s>"), eos = *llama2.token_id("</s>");
  int eos_targets = 0;
  for (size_t i = 0; i < stream.tokens.size(); ++i) {
    if (stream.tokens[i] == bos) {
      EXPECT_EQ(stream.mask[i], 0) << others;
    }
    if (stream.tokens[i] == eos) eos_targets += stream.mask[i];
  }
  EXPECT_EQ(eos_targets, 2) << targets;
  EXPECT_EQ(others.find("13"), std::string::npos) << others;
  EXPECT_EQ(targets.find("INST"), std::string::npos) << targets;
}

// Random pieces and flags: the mask follows the byte rule and the ids are
// those of the whole text, for each kind (Qwen2's normalizes with NFC).
TEST(PreparedData, RandomPiecesFollowTheByteRule) {
  const unsigned seed = std::random_device{}();
  std::mt19937 random(seed);
  const std::vector<std::string> words = {"the",        " model", "'s",   "  ",   "\n",
                                          "123",        "4567",   "café", "🙂", "<|eot_id|>",
                                          "<|im_end|>", "x",      "!",    " "};
  for (const char* kind : {"llama3", "qwen2", "gpt2", "llama2", "mistral", "spbpe", "smollm"}) {
    // Built without ICU, the NFC and NFKC-normalizing kinds are refused.
    Result<Tokenizer> here = Tokenizer::load(
        std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/tokenizers/" + kind + "/tokenizer.json");
    if (!here && here.status().message().find("without ICU") != std::string::npos) continue;
    Tokenizer tokenizer = load(kind);
    for (int round = 0; round < 100; ++round) {
      std::vector<MarkedText> pieces;
      std::string whole;
      for (int p = int(random() % 6); p >= 0; --p) {
        MarkedText piece;
        for (int w = int(random() % 4); w >= 0; --w) piece.text += words[random() % words.size()];
        piece.target = random() % 2 == 0;
        whole += piece.text;
        pieces.push_back(piece);
      }
      TokenStream stream;
      append_marked_text(tokenizer, pieces, stream);
      EXPECT_EQ(stream.tokens, tokenizer.encode(whole, false)) << kind << " seed " << seed;
      EXPECT_EQ(stream.mask, expected_mask(tokenizer, pieces)) << kind << " seed " << seed;
    }
  }
}

class PreparedFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("strata-prepared-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(PreparedFiles, TokenFilesReadBackWithTheirMasks) {
  EXPECT_EQ(token_width(65536), 2);
  EXPECT_EQ(token_width(65537), 4);
  std::mt19937 random(std::random_device{}());
  for (int width : {2, 4}) {
    TokenStream train, val;
    for (int i = 0; i < 1000; ++i) {
      train.tokens.push_back(uint32_t(random() % (width == 2 ? 65536 : 200000)));
      train.mask.push_back(uint8_t(random() % 2));
    }
    val.tokens = {1, 2, 3};
    val.mask = {1, 1, 0};
    const std::string train_path = (dir_ / "train.bin").string();
    const std::string val_path = (dir_ / "val.bin").string();
    ASSERT_TRUE(write_token_outputs({{&train, train_path}, {&val, val_path}}, width).is_ok());
    Result<TokenFile> file = TokenFile::open(train_path);
    ASSERT_TRUE(file.is_ok()) << file.status().message();
    EXPECT_EQ(file->bytes_per_token(), width);
    ASSERT_EQ(file->size(), 1000);
    for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(file->at(i), train.tokens[size_t(i)]) << i;
    std::ifstream mask(dir_ / "train.mask", std::ios::binary);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(mask)), {});
    EXPECT_EQ(bytes, train.mask);
    EXPECT_EQ(fs::file_size(dir_ / "val.mask"), 3u);
  }
}

TEST_F(PreparedFiles, ARefusedOutputLeavesEveryFileAsItWas) {
  TokenStream good, tiny;
  good.tokens = {5, 6, 7};
  good.mask = {1, 1, 1};
  tiny.tokens = {5};
  tiny.mask = {1};
  const std::string train = (dir_ / "train.bin").string();
  Status s = write_token_outputs({{&good, train}, {&tiny, (dir_ / "val.bin").string()}}, 2);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("val.bin: 1 token(s)"), std::string::npos) << s.message();
  EXPECT_TRUE(fs::is_empty(dir_)) << "nothing renamed into place, no temporary file left";
}

TEST(LossMaskPath, IsTheTokenFileWithTheExtensionMask) {
  EXPECT_EQ(loss_mask_path("data/train.bin"), "data/train.mask");
  EXPECT_EQ(loss_mask_path("train"), "train.mask");
  EXPECT_EQ(loss_mask_path("a.b/shard_000.bin"), "a.b/shard_000.mask");
}

}  // namespace
}  // namespace strata
