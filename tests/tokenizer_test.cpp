// The byte-level BPE tokenizer (prep/tokenizer.h) gives the ids of
// Hugging Face `tokenizers`: three small tokenizers of the Llama 3, Qwen2 and
// GPT-2 kinds and the ids `tokenizers` gave for tricky inputs are fixtures in
// tests/fixtures/tokenizers (tests/tokenizer_fixtures.py made them). Also: token
// spans cover the text, the cache changes nothing, unsupported keys are refused.
#include "prep/tokenizer.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "io/file_system.h"

namespace strata {
namespace {

const std::string kFixtures = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/tokenizers";
// One of each shape strata reads (tests/tokenizer_fixtures.py lists them).
const char* const kKinds[] = {"llama3",  "qwen2", "gpt2",   "llama2",
                              "mistral", "spbpe", "smollm", "wordish"};
// Those whose tokens cover all of the text (wordish's normalizer and
// pre-tokenizer drop whitespace).
const char* const kCoveringKinds[] = {"llama3",  "qwen2", "gpt2",  "llama2",
                                      "mistral", "spbpe", "smollm"};

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return nlohmann::json::parse(in);
}

// Built without ICU, strata refuses a tokenizer that normalizes with NFC (the
// Qwen2 kind's); those cases are left out then.
bool loads_here(const std::string& kind) {
  Result<Tokenizer> tokenizer = Tokenizer::load(kFixtures + "/" + kind + "/tokenizer.json");
  if (!tokenizer && tokenizer.status().message().find("without ICU") != std::string::npos) {
    std::printf("%s: left out, this build has no ICU\n", kind.c_str());
    return false;
  }
  return true;
}

Tokenizer load(const std::string& kind) {
  Result<Tokenizer> tokenizer = Tokenizer::load(kFixtures + "/" + kind + "/tokenizer.json");
  EXPECT_TRUE(tokenizer.is_ok()) << tokenizer.status().message();
  return std::move(*tokenizer);
}

TEST(Tokenizer, IdsEqualThoseOfHuggingFaceTokenizersOnTrickyInputs) {
  const nlohmann::json expected = read_json(kFixtures + "/expected_ids.json");
  int compared = 0;
  for (const char* kind : kKinds) {
    if (!loads_here(kind)) continue;
    Tokenizer tokenizer = load(kind);
    ASSERT_TRUE(expected.contains(kind));
    for (const nlohmann::json& entry : expected[kind]) {
      const std::string text = entry["text"];
      EXPECT_EQ(tokenizer.encode(text, true), entry["ids"].get<std::vector<uint32_t>>())
          << kind << " with special tokens: '" << text << "'";
      EXPECT_EQ(tokenizer.encode(text, false),
                entry["ids_without_special"].get<std::vector<uint32_t>>())
          << kind << ": '" << text << "'";
      const std::vector<uint32_t> ids = entry["ids"].get<std::vector<uint32_t>>();
      EXPECT_EQ(tokenizer.decode(ids, false), entry["decoded"].get<std::string>())
          << kind << " decoding the ids of '" << text << "'";
      EXPECT_EQ(tokenizer.decode(ids, true), entry["decoded_without_special"].get<std::string>())
          << kind << " decoding the ids of '" << text << "' without special tokens";
      ++compared;
    }
  }
  EXPECT_GE(compared, (loads_here("qwen2") ? 3 : 2) * 40);
}

TEST(Tokenizer, LlamaKindAddsItsBeginOfTextToken) {
  Tokenizer llama = load("llama3");
  ASSERT_EQ(llama.prefix_tokens().size(), 1u);
  EXPECT_EQ(llama.prefix_tokens()[0], *llama.token_id("<|begin_of_text|>"));
  EXPECT_TRUE(llama.suffix_tokens().empty());
  if (!loads_here("qwen2")) return;
  Tokenizer qwen = load("qwen2");
  EXPECT_TRUE(qwen.prefix_tokens().empty());
  EXPECT_EQ(qwen.vocab_size(), 652);
}

// Random text of the hard kinds: the spans of encode_spans cover the text in
// order without gaps (tokens inside a stretch NFC rewrote share it), and a
// fresh tokenizer (empty cache) and a warm one agree.
TEST(Tokenizer, SpansTileTheTextAndTheCacheChangesNothing) {
  std::random_device device;
  const unsigned seed = device();
  std::mt19937 random(seed);
  const std::vector<std::string> pieces = {
      "the",  " model",     "'s",         "  ", "\n", "\r\n",    "123456", "café", "日本語",
      "🙂", "<|eot_id|>", "<|im_end|>", "\t", "x",  "A\u030a", "!!",     "'LL"};
  for (const char* kind : kCoveringKinds) {
    if (!loads_here(kind)) continue;
    Tokenizer warm = load(kind);
    for (int round = 0; round < 50; ++round) {
      std::string text;
      const int count = int(random() % 60);
      for (int i = 0; i < count; ++i) text += pieces[random() % pieces.size()];
      std::vector<TokenSpan> spans;
      warm.encode_spans(text, false, spans);
      uint64_t position = 0, previous_begin = 0;
      for (const TokenSpan& span : spans) {
        ASSERT_LE(span.begin, position) << kind << " seed " << seed;
        ASSERT_GE(span.begin, previous_begin) << kind << " seed " << seed;
        ASSERT_GT(span.end, span.begin) << kind << " seed " << seed;
        ASSERT_GE(span.end, position) << kind << " seed " << seed;
        previous_begin = span.begin;
        position = span.end;
      }
      EXPECT_EQ(position, text.size()) << kind << " seed " << seed;
      Tokenizer cold = load(kind);
      EXPECT_EQ(cold.encode(text), warm.encode(text)) << kind << " seed " << seed;
    }
  }
}

std::string fixture_with(const std::string& kind,
                         const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json root = read_json(kFixtures + "/" + kind + "/tokenizer.json");
  edit(root);
  return root.dump();
}

TEST(Tokenizer, RefusesWhatItDoesNotReadNamingTheKey) {
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string key;
  };
  const std::vector<Case> cases = {
      {[](nlohmann::json& j) { j["model"]["type"] = "WordPiece"; }, "model.type"},
      {[](nlohmann::json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout"},
      {[](nlohmann::json& j) { j["model"]["continuing_subword_prefix"] = "##"; },
       "model.continuing_subword_prefix"},
      {[](nlohmann::json& j) { j["model"]["unk_token"] = "<not in the vocabulary>"; },
       "model.unk_token"},
      {[](nlohmann::json& j) {
         j["normalizer"] = {{"type", "BertNormalizer"}};
       },
       "normalizer.type"},
      {[](nlohmann::json& j) {
         j["normalizer"] = {
             {"type", "Sequence"},
             {"normalizers", {{{"type", "Prepend"}, {"prepend", "_"}}, {{"type", "Precompiled"}}}}};
       },
       "normalizer.normalizers[1].type"},
      {[](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; },
       "pre_tokenizer.pretokenizers[0].behavior"},
      {[](nlohmann::json& j) {
         j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}};
       },
       "pre_tokenizer.type"},
      {[](nlohmann::json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}, {"prepend_scheme", "sometimes"}};
       },
       "pre_tokenizer.prepend_scheme"},
      {[](nlohmann::json& j) { j["added_tokens"][0]["lstrip"] = "yes"; }, "added_tokens[0].lstrip"},
      {[](nlohmann::json& j) {
         j["post_processor"] = {{"type", "BertProcessing"}};
       },
       "post_processor.type"},
      {[](nlohmann::json& j) {
         j["decoder"] = {{"type", "WordPiece"}};
       },
       "decoder.type"},
      {[](nlohmann::json& j) {
         j["decoder"] = {{"type", "Metaspace"}, {"prepend_scheme", "sometimes"}};
       },
       "decoder.prepend_scheme"},
      {[](nlohmann::json& j) {
         j["truncation"] = {{"max_length", 8}};
       },
       "truncation"},
      {[](nlohmann::json& j) { j["model"]["merges"][0] = "nospace"; }, "model.merges[0]"},
  };
  for (const Case& c : cases) {
    Result<Tokenizer> t = Tokenizer::parse(fixture_with("llama3", c.edit), "x/tokenizer.json");
    ASSERT_FALSE(t.is_ok()) << c.key;
    const std::string& message = t.status().message();
    EXPECT_NE(message.find("x/tokenizer.json: " + c.key), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  Result<Tokenizer> missing = Tokenizer::load(kFixtures + "/absent/tokenizer.json");
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("absent/tokenizer.json"), std::string::npos);
  EXPECT_TRUE(missing.status().is(StatusCode::not_found)) << missing.status().message();
  // A key strata does not read is refused as an argument; a file that is not JSON is corrupt.
  EXPECT_TRUE(Tokenizer::parse(fixture_with("llama3", cases[0].edit), "x/tokenizer.json")
                  .status()
                  .is(StatusCode::invalid_argument));
  EXPECT_TRUE(
      Tokenizer::parse("{\"model\": ", "x/tokenizer.json").status().is(StatusCode::corruption));
}

TEST(Tokenizer, LoadsThroughTheFileSystemAndReportsAFailedRead) {
  const std::string path = kFixtures + "/gpt2/tokenizer.json";
  io::FaultInjectingFileSystem faults;
  Result<Tokenizer> loaded = Tokenizer::load(path, faults);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().message();
  EXPECT_EQ(loaded->vocab_size(), load("gpt2").vocab_size());
  EXPECT_EQ(faults.calls(io::FileOp::kOpen), 1u);
  EXPECT_EQ(faults.calls(io::FileOp::kClose), 1u);

  faults.add({.op = io::FileOp::kRead,
              .nth_call = faults.calls(io::FileOp::kRead) + 1,
              .error_number = EIO});
  const Status failed = Tokenizer::load(path, faults).status();
  ASSERT_FALSE(failed.is_ok());
  EXPECT_TRUE(failed.is(StatusCode::io_error)) << failed.message();
  EXPECT_NE(failed.message().find(path), std::string::npos) << failed.message();
  EXPECT_EQ(failed.message().find('\n'), std::string::npos) << failed.message();
}

TEST(Tokenizer, FindsInvalidUtf8) {
  EXPECT_FALSE(invalid_utf8_offset("plain café 🙂").has_value());
  EXPECT_EQ(invalid_utf8_offset(std::string("ab\xff") + "c"), 2u);
  EXPECT_EQ(invalid_utf8_offset(std::string("a\xc3")), 1u);         // truncated
  EXPECT_EQ(invalid_utf8_offset(std::string("a\xc0\xaf")), 1u);     // overlong
  EXPECT_EQ(invalid_utf8_offset(std::string("\xed\xa0\x80")), 0u);  // surrogate
}

}  // namespace
}  // namespace strata
