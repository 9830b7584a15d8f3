// The steps of a tokenizer.json around its model, internal to prep/: the
// normalizer, the pre-tokenizer and the decoder, each read from its JSON and
// applied as `tokenizers` applies it. prep/tokenizer.h lists what is read;
// anything else is refused in one line naming the key and its value.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "io/base/status.h"
#include "prep/tokenizer_text.h"

namespace strata::tokenizer_steps {

using tokenizer_text::AlignedText;

// Errors while reading one tokenizer.json, each naming the file and the key.
struct JsonErrors {
  std::string origin;
  // A tokenizer.json that does not hold what its format says.
  Status error(const std::string& key, const std::string& what) const;
  // A well-formed tokenizer.json asking for what strata does not read.
  Status refused(const std::string& key, const std::string& what) const;
  Status unsupported(const std::string& key, const nlohmann::json& value,
                     const std::string& supported) const;
};

// A Sequence's list under `list_key` (missing or not a list: an error),
// each element handed to `part` with its key ("normalizer.normalizers[1]").
Status parse_sequence(const JsonErrors& errors, const nlohmann::json& json, const std::string& key,
                      const char* list_key,
                      const std::function<Status(const nlohmann::json&, const std::string&)>& part);

// True when `object` lacks `key`, holds null there, or holds `expected`.
bool is_null_or(const nlohmann::json& object, const char* key, const nlohmann::json& expected);

// normalizer: NFC, NFD, NFKC, NFKD and Lowercase (through ICU), Strip,
// Prepend, Replace (a String or Regex pattern), or a Sequence of them.
class Normalizer {
 public:
  static Result<Normalizer> parse(const JsonErrors& errors, const nlohmann::json& json,
                                  const std::string& key);
  bool empty() const { return steps_.empty(); }
  AlignedText apply(AlignedText text) const;

  struct Step;

 private:
  std::vector<std::shared_ptr<const Step>> steps_;
};

// pre_tokenizer: ByteLevel, Metaspace, Split, Digits, Punctuation,
// Whitespace, WhitespaceSplit, or a Sequence of them in any order.
class PreTokenizer {
 public:
  static Result<PreTokenizer> parse(const JsonErrors& errors, const nlohmann::json& json,
                                    const std::string& key);
  // Whether a ByteLevel step maps the pieces' bytes to characters: the model
  // then reads each piece as bytes (pieces come back as the bytes they stand for).
  bool byte_level() const { return byte_level_at_ >= 0; }
  // Calls `each` with the pieces of `text` (a normalized stretch between
  // added tokens), in order.
  void apply(const AlignedText& text, const std::function<void(AlignedText&)>& each) const;

  struct Step;

 private:
  std::vector<std::shared_ptr<const Step>> steps_;
  int byte_level_at_ = -1;  // index of the ByteLevel step
};

// decoder: ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, or a
// Sequence of them; none joins the tokens with spaces, as `tokenizers` does.
class Decoder {
 public:
  static Result<Decoder> parse(const JsonErrors& errors, const nlohmann::json& json,
                               const std::string& key);
  std::string decode(std::vector<std::string> tokens) const;

  struct Step;

 private:
  std::vector<std::shared_ptr<const Step>> steps_;
  bool present_ = false;
};

// ByteLevel's map from a byte to the character that stands for it in the
// vocabulary: printable Latin-1 bytes stand for themselves, the other 68 for
// U+0100 and up, in byte order (GPT-2's bytes_to_unicode).
const std::array<uint32_t, 256>& byte_to_code_point();
// The other way: the character that stands for a byte -> the byte.
const std::unordered_map<uint32_t, char>& code_point_to_byte();

}  // namespace strata::tokenizer_steps
