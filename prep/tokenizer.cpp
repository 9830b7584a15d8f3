#include "prep/tokenizer.h"

#include <fmt/format.h>
// Oniguruma would otherwise define UChar, which ICU declares too.
#define ONIG_ESCAPE_UCHAR_COLLISION
#include <oniguruma.h>
#ifdef STRATA_HAVE_ICU
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#endif

#include <algorithm>
#include <array>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>

namespace strata {
namespace {

using nlohmann::json;

// GPT-2's pattern, which ByteLevel uses when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Words longer than this are not cached (a long run of one character is rare
// and would fill the cache with one-off entries).
constexpr size_t kMaxCachedWordBytes = 128;
constexpr size_t kMaxCacheEntries = 1 << 18;

// ByteLevel's map from a byte to the character that stands for it in the
// vocabulary: printable Latin-1 bytes stand for themselves, the other 68 for
// U+0100 and up, in byte order (GPT-2's bytes_to_unicode).
std::array<uint32_t, 256> byte_to_code_point() {
  std::array<uint32_t, 256> map{};
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) map[b] = printable[b] ? uint32_t(b) : next++;
  return map;
}

// Decodes the code point at text[i], advancing i; nothing on invalid UTF-8.
std::optional<uint32_t> next_code_point(std::string_view text, size_t& i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  if (lead < 0x80) {
    ++i;
    return lead;
  }
  int length = 0;
  uint32_t cp = 0;
  if ((lead & 0xE0) == 0xC0) {
    length = 2;
    cp = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3;
    cp = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4;
    cp = lead & 0x07;
  } else {
    return std::nullopt;
  }
  if (i + length > text.size()) return std::nullopt;
  for (int k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return std::nullopt;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  static constexpr uint32_t kMinimum[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinimum[length] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return std::nullopt;
  i += length;
  return cp;
}

size_t utf8_length_at(std::string_view text, size_t i) {
  const unsigned char lead = static_cast<unsigned char>(text[i]);
  const size_t length = lead < 0x80 ? 1 : (lead & 0xE0) == 0xC0 ? 2 : (lead & 0xF0) == 0xE0 ? 3 : 4;
  return std::min(length, text.size() - i);
}

// An Oniguruma pattern, compiled once and shared by the copies of a tokenizer
// (searching is thread-safe; each search brings its own region).
class Pattern {
 public:
  static Result<std::shared_ptr<Pattern>> compile(const std::string& source) {
    static std::once_flag initialised;
    std::call_once(initialised, [] {
      OnigEncoding encodings[1] = {ONIG_ENCODING_UTF8};
      onig_initialize(encodings, 1);
    });
    auto pattern = std::make_shared<Pattern>();
    OnigErrorInfo info;
    const auto* begin = reinterpret_cast<const OnigUChar*>(source.data());
    const int r = onig_new(&pattern->regex_, begin, begin + source.size(), ONIG_OPTION_NONE,
                           ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT, &info);
    if (r != ONIG_NORMAL) {
      OnigUChar message[ONIG_MAX_ERROR_MESSAGE_LEN];
      onig_error_code_to_str(message, r, &info);
      pattern->regex_ = nullptr;
      return Status::error(fmt::format("the pattern /{}/ does not compile: {}", source,
                                       reinterpret_cast<const char*>(message)));
    }
    return pattern;
  }
  Pattern() = default;
  Pattern(const Pattern&) = delete;
  Pattern& operator=(const Pattern&) = delete;
  ~Pattern() {
    if (regex_ != nullptr) onig_free(regex_);
  }

  // Calls piece(begin, end) for each match of the pattern in `text` and each
  // gap between matches, in order (Split's Isolated behaviour); empty pieces
  // are left out.
  template <typename Piece>
  void split(std::string_view text, Piece&& piece) const {
    OnigRegion* region = onig_region_new();
    const auto* str = reinterpret_cast<const OnigUChar*>(text.data());
    const OnigUChar* end = str + text.size();
    size_t position = 0, last = 0;
    while (position < text.size()) {
      const int r = onig_search(regex_, str, end, str + position, end, region, ONIG_OPTION_NONE);
      if (r < 0) break;  // ONIG_MISMATCH (or an error, which these patterns do not raise)
      const size_t match_begin = size_t(region->beg[0]), match_end = size_t(region->end[0]);
      if (match_end == match_begin) {  // an empty match splits nothing
        position = match_begin + utf8_length_at(text, match_begin);
        continue;
      }
      if (match_begin > last) piece(last, match_begin);
      piece(match_begin, match_end);
      last = position = match_end;
    }
    if (last < text.size()) piece(last, text.size());
    onig_region_free(region, 1);
  }

 private:
  OnigRegex regex_ = nullptr;
};

struct AddedToken {
  std::string content;
  uint32_t id = 0;
  bool normalized = false;
};

// Leftmost-longest matching of a set of strings, as the Aho-Corasick automaton
// of `tokenizers` (MatchKind::LeftmostLongest) does.
class AddedMatcher {
 public:
  void add(const AddedToken& token) {
    if (token.content.empty()) return;
    auto& list = by_first_byte_[static_cast<unsigned char>(token.content[0])];
    list.push_back(token);
    std::stable_sort(list.begin(), list.end(), [](const AddedToken& a, const AddedToken& b) {
      return a.content.size() > b.content.size();
    });
    empty_ = false;
  }
  // The first match at or after `from`: its offset and token.
  std::optional<std::pair<size_t, const AddedToken*>> find(std::string_view text,
                                                           size_t from) const {
    if (empty_) return std::nullopt;
    for (size_t i = from; i < text.size(); ++i) {
      const auto& list = by_first_byte_[static_cast<unsigned char>(text[i])];
      for (const AddedToken& token : list)
        if (text.compare(i, token.content.size(), token.content) == 0)
          return std::make_pair(i, &token);
    }
    return std::nullopt;
  }

 private:
  std::array<std::vector<AddedToken>, 256> by_first_byte_;
  bool empty_ = true;
};

}  // namespace

struct TokenizerTables {
  std::unordered_map<std::string, uint32_t> vocab;  // raw bytes of a vocabulary entry -> id
  std::unordered_map<std::string, uint32_t> ids_by_content;  // as written in the file
  std::array<uint32_t, 256> byte_ids{};
  std::vector<uint32_t> token_bytes;  // (vocab_size) bytes each id stands for; 0 for added tokens
  struct Merge {
    uint32_t rank;
    uint32_t id;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left << 32 | right) -> rank and merged id
  bool ignore_merges = false;
  bool nfc = false;
  std::vector<std::shared_ptr<Pattern>> splits;  // applied in order
  AddedMatcher raw_added;                        // normalized=false, matched on the raw text
  AddedMatcher normalized_added;                 // normalized=true, matched after the normalizer
  AddedMatcher all_added;
  std::vector<uint32_t> prefix, suffix;
  int64_t vocab_size = 0;
};

namespace {

struct Parser {
  std::string origin;
  // A tokenizer.json that does not hold what its format says.
  Status error(const std::string& key, const std::string& what) const {
    return Status::corruption(fmt::format("{}: {}: {}", origin, key, what));
  }
  // A well-formed tokenizer.json asking for what strata does not read.
  Status refused(const std::string& key, const std::string& what) const {
    return Status::invalid_argument(fmt::format("{}: {}: {}", origin, key, what));
  }
  Status unsupported(const std::string& key, const json& value,
                     const std::string& supported) const {
    return refused(key, fmt::format("{} is not supported (strata reads {}); this tokenizer cannot "
                                    "be used with strata",
                                    value.dump(), supported));
  }
};

bool is_null_or(const json& object, const char* key, const json& expected) {
  return !object.contains(key) || object[key].is_null() || object[key] == expected;
}

Status parse_normalizer(const Parser& p, const json& normalizer, const std::string& key,
                        TokenizerTables& t) {
  if (normalizer.is_null()) return Status::ok();
  const std::string type = normalizer.value("type", "");
  if (type == "NFC") {
#ifndef STRATA_HAVE_ICU
    return Status::error(fmt::format(
        "{}.type \"NFC\": this strata was built without ICU, which normalizes; install "
        "libicu-dev and rebuild",
        key));
#endif
    t.nfc = true;
    return Status::ok();
  }
  if (type == "Sequence" && normalizer.contains("normalizers") &&
      normalizer["normalizers"].is_array()) {
    for (size_t i = 0; i < normalizer["normalizers"].size(); ++i)
      if (Status s = parse_normalizer(p, normalizer["normalizers"][i],
                                      fmt::format("{}.normalizers[{}]", key, i), t);
          !s)
        return s;
    return Status::ok();
  }
  return p.unsupported(key + ".type", type, "null or NFC");
}

Status parse_pre_tokenizer(const Parser& p, const json& step, const std::string& key,
                           TokenizerTables& t, bool& byte_level) {
  const std::string type = step.value("type", "");
  if (type == "Sequence") {
    if (!step.contains("pretokenizers") || !step["pretokenizers"].is_array())
      return p.error(key + ".pretokenizers", "missing or not a list");
    for (size_t i = 0; i < step["pretokenizers"].size(); ++i)
      if (Status s =
              parse_pre_tokenizer(p, step["pretokenizers"][i],
                                  fmt::format("{}.pretokenizers[{}]", key, i), t, byte_level);
          !s)
        return s;
    return Status::ok();
  }
  if (type == "ByteLevel") {
    if (!is_null_or(step, "add_prefix_space", false))
      return p.unsupported(key + ".add_prefix_space", step["add_prefix_space"], "false");
    byte_level = true;
    if (step.value("use_regex", true)) {
      Result<std::shared_ptr<Pattern>> pattern = Pattern::compile(kGpt2Pattern);
      if (!pattern) return p.error(key, pattern.status().message());
      t.splits.push_back(*pattern);
    }
    return Status::ok();
  }
  if (type == "Split") {
    if (byte_level)
      return p.refused(key,
                       "a Split after ByteLevel is not supported (strata reads Split steps "
                       "before ByteLevel)");
    const json pattern = step.value("pattern", json());
    if (!pattern.is_object() || !pattern.contains("Regex") || !pattern["Regex"].is_string())
      return p.unsupported(key + ".pattern", pattern, "a {\"Regex\": ...} pattern");
    if (step.value("behavior", "") != "Isolated")
      return p.unsupported(key + ".behavior", step.value("behavior", json()), "Isolated");
    if (!is_null_or(step, "invert", false))
      return p.unsupported(key + ".invert", step["invert"], "false");
    Result<std::shared_ptr<Pattern>> compiled =
        Pattern::compile(pattern["Regex"].get<std::string>());
    if (!compiled) return p.error(key + ".pattern", compiled.status().message());
    t.splits.push_back(*compiled);
    return Status::ok();
  }
  return p.unsupported(key + ".type", type, "ByteLevel, Split or a Sequence of them");
}

Status parse_post_processor(const Parser& p, const json& step, const std::string& key,
                            TokenizerTables& t) {
  if (step.is_null()) return Status::ok();
  const std::string type = step.value("type", "");
  if (type == "ByteLevel") return Status::ok();  // trims offsets; the ids stay
  if (type == "Sequence") {
    if (!step.contains("processors") || !step["processors"].is_array())
      return p.error(key + ".processors", "missing or not a list");
    for (size_t i = 0; i < step["processors"].size(); ++i)
      if (Status s = parse_post_processor(p, step["processors"][i],
                                          fmt::format("{}.processors[{}]", key, i), t);
          !s)
        return s;
    return Status::ok();
  }
  if (type == "TemplateProcessing") {
    const json single = step.value("single", json());
    if (!single.is_array()) return p.error(key + ".single", "missing or not a list");
    const json specials = step.value("special_tokens", json::object());
    bool seen_sequence = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const json& piece = single[i];
      const std::string piece_key = fmt::format("{}.single[{}]", key, i);
      if (piece.contains("Sequence")) {
        if (piece["Sequence"].value("id", "") != "A" || seen_sequence)
          return p.unsupported(piece_key, piece, "one Sequence A");
        seen_sequence = true;
      } else if (piece.contains("SpecialToken")) {
        const std::string name = piece["SpecialToken"].value("id", "");
        if (!specials.contains(name) || !specials[name].contains("ids") ||
            !specials[name]["ids"].is_array())
          return p.error(piece_key,
                         fmt::format("special token '{}' has no ids in special_tokens", name));
        for (const json& id : specials[name]["ids"])
          (seen_sequence ? t.suffix : t.prefix).push_back(id.get<uint32_t>());
      } else {
        return p.unsupported(piece_key, piece, "SpecialToken and Sequence pieces");
      }
    }
    if (!seen_sequence) return p.error(key + ".single", "has no Sequence A");
    return Status::ok();
  }
  return p.unsupported(key + ".type", type, "null, ByteLevel, TemplateProcessing or a Sequence");
}

// A vocabulary entry's bytes: each character stands for one byte (ByteLevel).
std::optional<std::string> byte_level_bytes(std::string_view token,
                                            const std::unordered_map<uint32_t, uint8_t>& bytes) {
  std::string out;
  size_t i = 0;
  while (i < token.size()) {
    std::optional<uint32_t> cp = next_code_point(token, i);
    if (!cp) return std::nullopt;
    auto found = bytes.find(*cp);
    if (found == bytes.end()) return std::nullopt;
    out.push_back(char(found->second));
  }
  return out;
}

Status parse_model(const Parser& p, const json& model, TokenizerTables& t) {
  if (!model.is_object()) return p.error("model", "missing or not an object");
  if (model.value("type", "BPE") != "BPE") return p.unsupported("model.type", model["type"], "BPE");
  if (!is_null_or(model, "dropout", json()))
    return p.unsupported("model.dropout", model["dropout"], "null");
  if (!is_null_or(model, "byte_fallback", false))
    return p.unsupported("model.byte_fallback", model["byte_fallback"], "false");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!is_null_or(model, key, ""))
      return p.unsupported(fmt::format("model.{}", key), model[key], "null");
  if (model.contains("ignore_merges") && model["ignore_merges"].is_boolean())
    t.ignore_merges = model["ignore_merges"].get<bool>();
  if (!model.contains("vocab") || !model["vocab"].is_object())
    return p.error("model.vocab", "missing or not an object");

  std::unordered_map<uint32_t, uint8_t> code_point_bytes;
  const std::array<uint32_t, 256> map = byte_to_code_point();
  for (int b = 0; b < 256; ++b) code_point_bytes[map[b]] = uint8_t(b);

  std::unordered_map<std::string, uint32_t> by_content;
  for (auto it = model["vocab"].begin(); it != model["vocab"].end(); ++it) {
    if (!it.value().is_number_unsigned())
      return p.error(fmt::format("model.vocab[\"{}\"]", it.key()), "the id is not a whole number");
    const uint32_t id = it.value().get<uint32_t>();
    by_content[it.key()] = id;
    t.ids_by_content[it.key()] = id;
    t.vocab_size = std::max<int64_t>(t.vocab_size, int64_t(id) + 1);
    if (std::optional<std::string> bytes = byte_level_bytes(it.key(), code_point_bytes)) {
      if (t.token_bytes.size() <= id) t.token_bytes.resize(id + 1, 0);
      t.token_bytes[id] = uint32_t(bytes->size());
      t.vocab.emplace(std::move(*bytes), id);
    }
  }
  for (int b = 0; b < 256; ++b) {
    auto found = t.vocab.find(std::string(1, char(b)));
    if (found == t.vocab.end())
      return p.error("model.vocab",
                     fmt::format("has no entry for byte 0x{:02x}: not a byte-level vocabulary", b));
    t.byte_ids[b] = found->second;
  }

  if (!model.contains("merges") || !model["merges"].is_array())
    return p.error("model.merges", "missing or not a list");
  const json& merges = model["merges"];
  t.merges.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& merge = merges[rank];
    std::string left, right;
    if (merge.is_string()) {  // "a b"
      const std::string text = merge.get<std::string>();
      const size_t space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos)
        return p.error(fmt::format("model.merges[{}]", rank),
                       fmt::format("'{}' is not two tokens separated by one space", text));
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
               merge[1].is_string()) {  // ["a", "b"]
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    } else {
      return p.error(fmt::format("model.merges[{}]", rank),
                     fmt::format("{} is neither \"a b\" nor [\"a\", \"b\"]", merge.dump()));
    }
    const auto l = by_content.find(left), r = by_content.find(right),
               m = by_content.find(left + right);
    if (l == by_content.end() || r == by_content.end() || m == by_content.end())
      return p.error(fmt::format("model.merges[{}]", rank),
                     fmt::format("'{}' + '{}' names a token the vocabulary lacks", left, right));
    const uint64_t key = (uint64_t(l->second) << 32) | r->second;
    t.merges.emplace(key, TokenizerTables::Merge{uint32_t(rank), m->second});
  }
  return Status::ok();
}

}  // namespace

Result<Tokenizer> Tokenizer::load(const std::string& path, io::FileSystem& file_system) {
  Result<std::string> text = io::read_whole_file(file_system, path);
  if (!text) return text.status();
  return parse(*text, path);
}

Result<Tokenizer> Tokenizer::parse(std::string_view text, const std::string& origin) {
  const Parser p{origin};
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    return Status::corruption(fmt::format("{}: not valid JSON: {}", origin, e.what()));
  }
  if (!root.is_object()) return Status::corruption(fmt::format("{}: not a JSON object", origin));
  auto tables = std::make_shared<TokenizerTables>();
  TokenizerTables& t = *tables;
  try {
    for (const char* key : {"truncation", "padding"})
      if (!is_null_or(root, key, json()))
        return p.unsupported(key, root[key], "null: strata tokenizes whole documents");
    if (Status s = parse_model(p, root.value("model", json()), t); !s) return s;
    if (Status s = parse_normalizer(p, root.value("normalizer", json()), "normalizer", t); !s)
      return s;
    const json pre = root.value("pre_tokenizer", json());
    bool byte_level = false;
    if (!pre.is_null())
      if (Status s = parse_pre_tokenizer(p, pre, "pre_tokenizer", t, byte_level); !s) return s;
    if (!byte_level)
      return p.refused("pre_tokenizer",
                       "has no ByteLevel step; strata reads byte-level BPE "
                       "tokenizers only (Llama 3, Qwen2, GPT-2 kinds)");
    if (Status s =
            parse_post_processor(p, root.value("post_processor", json()), "post_processor", t);
        !s)
      return s;
    const json added = root.value("added_tokens", json::array());
    if (!added.is_array()) return p.error("added_tokens", "not a list");
    for (size_t i = 0; i < added.size(); ++i) {
      const json& entry = added[i];
      const std::string key = fmt::format("added_tokens[{}]", i);
      if (!entry.contains("content") || !entry["content"].is_string() || !entry.contains("id") ||
          !entry["id"].is_number_unsigned())
        return p.error(key, "needs a string content and a whole-number id");
      for (const char* flag : {"lstrip", "rstrip", "single_word"})
        if (!is_null_or(entry, flag, false))
          return p.unsupported(fmt::format("{}.{}", key, flag), entry[flag], "false");
      AddedToken token{entry["content"].get<std::string>(), entry["id"].get<uint32_t>(),
                       entry.value("normalized", !entry.value("special", false))};
      (token.normalized ? t.normalized_added : t.raw_added).add(token);
      t.all_added.add(token);
      t.ids_by_content[token.content] = token.id;
      t.vocab_size = std::max<int64_t>(t.vocab_size, int64_t(token.id) + 1);
    }
  } catch (const json::exception& e) {
    return Status::corruption(fmt::format("{}: unexpected structure: {}", origin, e.what()));
  }
  t.token_bytes.resize(size_t(t.vocab_size), 0);
  Tokenizer tokenizer;
  tokenizer.tables_ = std::move(tables);
  return tokenizer;
}

int64_t Tokenizer::vocab_size() const {
  return tables_->vocab_size;
}

std::optional<uint32_t> Tokenizer::token_id(std::string_view content) const {
  auto found = tables_->ids_by_content.find(std::string(content));
  if (found == tables_->ids_by_content.end()) return std::nullopt;
  return found->second;
}

const std::vector<uint32_t>& Tokenizer::prefix_tokens() const {
  return tables_->prefix;
}
const std::vector<uint32_t>& Tokenizer::suffix_tokens() const {
  return tables_->suffix;
}

std::string Tokenizer::normalize(std::string_view text) const {
  if (!tables_->nfc) return std::string(text);
  if (std::all_of(text.begin(), text.end(), [](char c) { return (c & 0x80) == 0; }))
    return std::string(text);  // ASCII is already in NFC
#ifdef STRATA_HAVE_ICU
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
  std::string out;
  if (U_SUCCESS(status)) {
    icu::StringByteSink<std::string> sink(&out, int32_t(text.size()));
    nfc->normalizeUTF8(0, icu::StringPiece(text.data(), int32_t(text.size())), sink, nullptr,
                       status);
  }
  // ICU fails only on invalid UTF-8, which callers rule out first; keep the text then.
  return U_SUCCESS(status) ? out : std::string(text);
#else
  return std::string(text);  // unreachable: an NFC tokenizer is refused without ICU
#endif
}

void Tokenizer::set_progress(std::function<void(uint64_t)> progress, uint64_t every) {
  progress_ = std::move(progress);
  progress_every_ = std::max<uint64_t>(every, 1);
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) {
  next_progress_ = progress_every_;
  std::vector<TokenSpan> spans;
  // Added tokens with normalized=false are found in the raw text; the text
  // between them is normalized and searched for the others.
  size_t position = 0;
  while (position <= text.size()) {
    auto match = tables_->raw_added.find(text, position);
    const size_t gap_end = match ? match->first : text.size();
    if (gap_end > position) {
      // The spans' offsets are not returned: `position` as their base keeps
      // progress counting in the raw text.
      const std::string normalized = normalize(text.substr(position, gap_end - position));
      split_on_added(normalized, position, true, spans);
    }
    if (!match) break;
    spans.push_back(
        {match->second->id, match->first, match->first + match->second->content.size()});
    position = match->first + match->second->content.size();
  }
  std::vector<uint32_t> ids;
  ids.reserve(spans.size() + 2);
  if (add_special_tokens) ids = tables_->prefix;
  for (const TokenSpan& span : spans) ids.push_back(span.id);
  if (add_special_tokens) ids.insert(ids.end(), tables_->suffix.begin(), tables_->suffix.end());
  return ids;
}

void Tokenizer::encode_normalized(std::string_view normalized, std::vector<TokenSpan>& out) {
  next_progress_ = progress_every_;
  split_on_added(normalized, 0, false, out);
}

void Tokenizer::split_on_added(std::string_view text, uint64_t base, bool normalized_pass,
                               std::vector<TokenSpan>& out) {
  const AddedMatcher& matcher = normalized_pass ? tables_->normalized_added : tables_->all_added;
  size_t position = 0;
  while (position < text.size()) {
    auto match = matcher.find(text, position);
    const size_t gap_end = match ? match->first : text.size();
    if (gap_end > position)
      encode_added_free(text.substr(position, gap_end - position), base + position, out);
    if (!match) break;
    const size_t end = match->first + match->second->content.size();
    out.push_back({match->second->id, base + match->first, base + end});
    position = end;
  }
}

void Tokenizer::encode_added_free(std::string_view text, uint64_t base,
                                  std::vector<TokenSpan>& out) {
  const auto& splits = tables_->splits;
  // Each Split step divides the pieces of the one before; the last pieces are words.
  auto run = [&](auto& self, size_t stage, size_t begin, size_t end) -> void {
    if (stage == splits.size()) {
      encode_word(text.substr(begin, end - begin), base + begin, out);
      return;
    }
    splits[stage]->split(text.substr(begin, end - begin),
                         [&](size_t b, size_t e) { self(self, stage + 1, begin + b, begin + e); });
  };
  run(run, 0, 0, text.size());
}

void Tokenizer::encode_word(std::string_view word, uint64_t base, std::vector<TokenSpan>& out) {
  const TokenizerTables& t = *tables_;
  if (progress_ && base + word.size() >= next_progress_) {
    progress_(base + word.size());
    next_progress_ = base + word.size() + progress_every_;
  }
  auto emit = [&](const std::vector<uint32_t>& ids) {
    uint64_t offset = base;
    for (uint32_t id : ids) {
      const uint64_t bytes = t.token_bytes[id];
      out.push_back({id, offset, offset + bytes});
      offset += bytes;
    }
  };
  const std::string key(word);
  if (auto cached = cache_.find(key); cached != cache_.end()) {
    emit(cached->second);
    return;
  }
  std::vector<uint32_t> ids;
  if (auto whole = t.vocab.find(key); t.ignore_merges && whole != t.vocab.end()) {
    ids.push_back(whole->second);
  } else {
    // Symbols in a linked list; a heap of candidate merges by (rank, position).
    // A popped candidate whose pair has changed since it was pushed is stale.
    const int n = int(word.size());
    std::vector<uint32_t> symbol(n);
    std::vector<int> prev(n), next(n);
    std::vector<bool> alive(n, true);
    for (int i = 0; i < n; ++i) {
      symbol[i] = t.byte_ids[static_cast<unsigned char>(word[i])];
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
    }
    struct Candidate {
      uint32_t rank;
      int position;
      uint32_t left, right;
      bool operator>(const Candidate& o) const {
        return rank != o.rank ? rank > o.rank : position > o.position;
      }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
    auto push = [&](int i) {
      if (i < 0 || next[i] < 0) return;
      auto found = t.merges.find((uint64_t(symbol[i]) << 32) | symbol[next[i]]);
      if (found != t.merges.end()) heap.push({found->second.rank, i, symbol[i], symbol[next[i]]});
    };
    for (int i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      const int i = c.position;
      if (!alive[i] || next[i] < 0 || symbol[i] != c.left || symbol[next[i]] != c.right) continue;
      const int j = next[i];
      symbol[i] = t.merges.at((uint64_t(c.left) << 32) | c.right).id;
      alive[j] = false;
      next[i] = next[j];
      if (next[j] >= 0) prev[next[j]] = i;
      push(prev[i]);
      push(i);
    }
    for (int i = 0; i >= 0 && i < n; i = next[i]) ids.push_back(symbol[i]);
  }
  emit(ids);
  if (word.size() <= kMaxCachedWordBytes) {
    if (cache_.size() >= kMaxCacheEntries) cache_.clear();
    cache_.emplace(key, std::move(ids));
  }
}

std::optional<uint64_t> invalid_utf8_offset(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    if (static_cast<unsigned char>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t at = i;
    if (!next_code_point(text, i)) return at;
  }
  return std::nullopt;
}

}  // namespace strata
