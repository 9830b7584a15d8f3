#include "prep/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_set>

#include "prep/tokenizer_steps.h"

namespace strata {
namespace {

using nlohmann::json;
using tokenizer_steps::is_null_or;
using tokenizer_steps::JsonErrors;
using tokenizer_text::AlignedText;
using tokenizer_text::next_code_point;

// Words longer than this are not cached (a long run of one character is rare
// and would fill the cache with one-off entries).
constexpr size_t kMaxCachedWordBytes = 128;
constexpr size_t kMaxCacheEntries = 1 << 18;
constexpr int64_t kNoId = -1;

struct AddedToken {
  std::string content;        // as written; matched as `match_content`
  std::string match_content;  // the normalized content for normalized tokens
  uint32_t id = 0;
  bool normalized = false, special = false, lstrip = false, rstrip = false, single_word = false;
};

// One stretch of a text: an added token's match (with the whitespace its
// lstrip or rstrip took), or text between matches.
struct Segment {
  const AddedToken* token = nullptr;
  size_t begin = 0, end = 0;
};

// Rust regex's \w, which `tokenizers` tests the characters beside a
// single_word token with.
bool is_word_character(std::string_view text, size_t at) {
  static const std::shared_ptr<const tokenizer_text::Regex> word =
      *tokenizer_text::Regex::compile(R"(\A\w)");
  const auto matches =
      word->find_matches(text.substr(at, tokenizer_text::utf8_length_at(text, at)));
  return !matches.empty() && matches.front().is_match;
}

// The start of the character before `at`.
size_t previous_character(std::string_view text, size_t at) {
  size_t i = at - 1;
  while (i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) --i;
  return i;
}

// `tokenizers`' AddedVocabulary.find_matches over a leftmost-longest set of
// tokens, with their single_word, lstrip and rstrip rules.
class AddedMatcher {
 public:
  void add(const AddedToken* token) {
    if (token->match_content.empty()) return;
    auto& list = by_first_byte_[static_cast<unsigned char>(token->match_content[0])];
    list.push_back(token);
    std::stable_sort(list.begin(), list.end(), [](const AddedToken* a, const AddedToken* b) {
      return a->match_content.size() > b->match_content.size();
    });
    empty_ = false;
  }

  std::vector<Segment> split(std::string_view text) const {
    std::vector<Segment> out;
    size_t start_offset = 0;
    for (size_t i = 0; !empty_ && i < text.size();) {
      const AddedToken* token = longest_at(text, i);
      if (token == nullptr) {
        ++i;
        continue;
      }
      size_t start = i, stop = i + token->match_content.size();
      i = stop;
      if (token->single_word) {
        const bool word_before =
            start > 0 && is_word_character(text, previous_character(text, start));
        const bool word_after = stop < text.size() && is_word_character(text, stop);
        if (word_before || word_after) continue;
      }
      if (token->lstrip) {
        size_t new_start = start;
        while (new_start > 0) {
          const size_t before = previous_character(text, new_start);
          size_t k = before;
          const std::optional<uint32_t> cp = next_code_point(text, k);
          if (!cp || !tokenizer_text::is_whitespace(*cp)) break;
          new_start = before;
        }
        start = std::max(new_start, start_offset);
      }
      if (token->rstrip) {
        while (stop < text.size()) {
          size_t k = stop;
          const std::optional<uint32_t> cp = next_code_point(text, k);
          if (!cp || !tokenizer_text::is_whitespace(*cp)) break;
          stop = k;
        }
      }
      if (start_offset < start) out.push_back({nullptr, start_offset, start});
      out.push_back({token, start, stop});
      start_offset = stop;
    }
    if (start_offset < text.size()) out.push_back({nullptr, start_offset, text.size()});
    return out;
  }

 private:
  const AddedToken* longest_at(std::string_view text, size_t i) const {
    for (const AddedToken* token : by_first_byte_[static_cast<unsigned char>(text[i])])
      if (text.compare(i, token->match_content.size(), token->match_content) == 0) return token;
    return nullptr;
  }

  std::array<std::vector<const AddedToken*>, 256> by_first_byte_;
  bool empty_ = true;
};

}  // namespace

struct TokenizerTables {
  // A vocabulary entry's key -> id: its bytes for a byte-level vocabulary
  // ("Ġthe" is " the"), its text otherwise ("▁the").
  std::unordered_map<std::string, uint32_t> vocab;
  std::unordered_map<std::string, uint32_t> ids_by_content;  // as written in the file
  std::vector<std::string> content_by_id;                    // (vocab_size) as written
  std::vector<std::string> decode_form;          // (vocab_size) what decode reads; empty: content
  std::array<int64_t, 256> single_byte_ids{};    // key of one byte -> id, or kNoId
  std::array<int64_t, 256> byte_fallback_ids{};  // "<0xAB>" -> id, or kNoId
  struct Merge {
    uint32_t rank;
    uint32_t id;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left << 32 | right) -> rank and merged id
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  std::optional<uint32_t> unk;
  tokenizer_steps::Normalizer normalizer;
  tokenizer_steps::PreTokenizer pre_tokenizer;
  tokenizer_steps::Decoder decoder;
  std::vector<std::unique_ptr<AddedToken>> added;
  AddedMatcher raw_added;         // normalized=false, matched on the raw text
  AddedMatcher normalized_added;  // normalized=true, matched after the normalizer
  std::unordered_set<uint32_t> special_ids;
  std::vector<uint32_t> prefix, suffix;
  int64_t vocab_size = 0;
};

namespace {

Status parse_post_processor(const JsonErrors& p, const json& step, const std::string& key,
                            TokenizerTables& t) {
  if (step.is_null()) return Status::ok();
  const std::string type = step.value("type", "");
  if (type == "ByteLevel") return Status::ok();  // trims offsets; the ids stay
  if (type == "Sequence")
    return tokenizer_steps::parse_sequence(p, step, key, "processors",
                                           [&](const json& item, const std::string& item_key) {
                                             return parse_post_processor(p, item, item_key, t);
                                           });
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

// A byte-level vocabulary entry's bytes: each character stands for one byte.
std::optional<std::string> byte_level_bytes(std::string_view token) {
  const std::unordered_map<uint32_t, char>& bytes = tokenizer_steps::code_point_to_byte();
  std::string out;
  size_t i = 0;
  while (i < token.size()) {
    std::optional<uint32_t> cp = next_code_point(token, i);
    if (!cp) return std::nullopt;
    auto found = bytes.find(*cp);
    if (found == bytes.end()) return std::nullopt;
    out.push_back(found->second);
  }
  return out;
}

Status parse_merges(const JsonErrors& p, const json& merges,
                    const std::unordered_map<std::string, uint32_t>& by_content,
                    TokenizerTables& t) {
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

// The model, once the pre-tokenizer has said whether the vocabulary is byte-level.
Status parse_model(const JsonErrors& p, const json& model, bool byte_level, TokenizerTables& t) {
  if (!model.is_object()) return p.error("model", "missing or not an object");
  if (model.value("type", "BPE") != "BPE") return p.unsupported("model.type", model["type"], "BPE");
  if (!is_null_or(model, "dropout", json()) && !is_null_or(model, "dropout", 0.0))
    return p.unsupported("model.dropout", model["dropout"], "null");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!is_null_or(model, key, ""))
      return p.unsupported(fmt::format("model.{}", key), model[key], "null");
  for (const char* key : {"ignore_merges", "byte_fallback", "fuse_unk"})
    if (model.contains(key) && !model[key].is_null() && !model[key].is_boolean())
      return p.error(fmt::format("model.{}", key), "not true or false");
  t.ignore_merges = model.value("ignore_merges", false);
  t.byte_fallback = model.value("byte_fallback", false);
  t.fuse_unk = model.value("fuse_unk", false);
  if (!model.contains("vocab") || !model["vocab"].is_object())
    return p.error("model.vocab", "missing or not an object");

  std::unordered_map<std::string, uint32_t> by_content;
  for (auto it = model["vocab"].begin(); it != model["vocab"].end(); ++it) {
    if (!it.value().is_number_unsigned())
      return p.error(fmt::format("model.vocab[\"{}\"]", it.key()), "the id is not a whole number");
    const uint32_t id = it.value().get<uint32_t>();
    by_content[it.key()] = id;
    t.ids_by_content[it.key()] = id;
    t.vocab_size = std::max<int64_t>(t.vocab_size, int64_t(id) + 1);
    if (t.content_by_id.size() <= id) t.content_by_id.resize(id + 1);
    t.content_by_id[id] = it.key();
    if (!byte_level) {
      t.vocab.emplace(it.key(), id);
    } else if (std::optional<std::string> bytes = byte_level_bytes(it.key())) {
      t.vocab.emplace(std::move(*bytes), id);
    }
  }
  t.single_byte_ids.fill(kNoId);
  t.byte_fallback_ids.fill(kNoId);
  for (int b = 0; b < 256; ++b) {
    if (auto found = t.vocab.find(std::string(1, char(b))); found != t.vocab.end())
      t.single_byte_ids[b] = found->second;
    if (auto found = by_content.find(fmt::format("<0x{:02X}>", b)); found != by_content.end())
      t.byte_fallback_ids[b] = found->second;
  }
  if (model.contains("unk_token") && !model["unk_token"].is_null()) {
    if (!model["unk_token"].is_string()) return p.error("model.unk_token", "not a string");
    const std::string unk = model["unk_token"].get<std::string>();
    auto found = by_content.find(unk);
    if (found == by_content.end())
      return p.error("model.unk_token",
                     fmt::format("'{}' is not in model.vocab; `tokenizers` would fail on the "
                                 "first character it does not know",
                                 unk));
    t.unk = found->second;
  }
  if (!model.contains("merges") || !model["merges"].is_array())
    return p.error("model.merges", "missing or not a list");
  return parse_merges(p, model["merges"], by_content, t);
}

Status parse_added_tokens(const JsonErrors& p, const json& added, TokenizerTables& t) {
  if (!added.is_array()) return p.error("added_tokens", "not a list");
  for (size_t i = 0; i < added.size(); ++i) {
    const json& entry = added[i];
    const std::string key = fmt::format("added_tokens[{}]", i);
    if (!entry.contains("content") || !entry["content"].is_string() || !entry.contains("id") ||
        !entry["id"].is_number_unsigned())
      return p.error(key, "needs a string content and a whole-number id");
    for (const char* flag : {"lstrip", "rstrip", "single_word", "normalized", "special"})
      if (entry.contains(flag) && !entry[flag].is_null() && !entry[flag].is_boolean())
        return p.error(fmt::format("{}.{}", key, flag), "not true or false");
    auto token = std::make_unique<AddedToken>();
    token->content = entry["content"].get<std::string>();
    token->id = entry["id"].get<uint32_t>();
    token->special = entry.value("special", false);
    token->normalized = entry.value("normalized", !token->special);
    token->lstrip = entry.value("lstrip", false);
    token->rstrip = entry.value("rstrip", false);
    token->single_word = entry.value("single_word", false);
    token->match_content = token->content;
    t.vocab_size = std::max<int64_t>(t.vocab_size, int64_t(token->id) + 1);
    if (t.content_by_id.size() <= token->id) t.content_by_id.resize(token->id + 1);
    if (t.decode_form.size() <= token->id) t.decode_form.resize(token->id + 1);
    t.content_by_id[token->id] = token->content;
    if (token->normalized && !t.normalizer.empty()) {
      // Matched, and decoded, by its normalized form, as `tokenizers` does.
      AlignedText content;
      content.text = token->content;
      token->match_content = t.normalizer.apply(std::move(content)).text;
      if (token->match_content != token->content) t.decode_form[token->id] = token->match_content;
    }
    t.ids_by_content[token->content] = token->id;
    if (token->special) t.special_ids.insert(token->id);
    (token->normalized ? t.normalized_added : t.raw_added).add(token.get());
    t.added.push_back(std::move(token));
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
  const JsonErrors p{origin};
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
    Result<tokenizer_steps::Normalizer> normalizer =
        tokenizer_steps::Normalizer::parse(p, root.value("normalizer", json()), "normalizer");
    if (!normalizer) return normalizer.status();
    t.normalizer = std::move(*normalizer);
    Result<tokenizer_steps::PreTokenizer> pre = tokenizer_steps::PreTokenizer::parse(
        p, root.value("pre_tokenizer", json()), "pre_tokenizer");
    if (!pre) return pre.status();
    t.pre_tokenizer = std::move(*pre);
    Result<tokenizer_steps::Decoder> decoder =
        tokenizer_steps::Decoder::parse(p, root.value("decoder", json()), "decoder");
    if (!decoder) return decoder.status();
    t.decoder = std::move(*decoder);
    if (Status s = parse_model(p, root.value("model", json()), t.pre_tokenizer.byte_level(), t); !s)
      return s;
    if (Status s =
            parse_post_processor(p, root.value("post_processor", json()), "post_processor", t);
        !s)
      return s;
    if (Status s = parse_added_tokens(p, root.value("added_tokens", json::array()), t); !s)
      return s;
  } catch (const json::exception& e) {
    return Status::corruption(fmt::format("{}: unexpected structure: {}", origin, e.what()));
  }
  for (uint32_t id : t.prefix)
    if (int64_t(id) >= t.vocab_size)
      return p.error("post_processor", fmt::format("names id {} beyond the vocabulary", id));
  for (uint32_t id : t.suffix)
    if (int64_t(id) >= t.vocab_size)
      return p.error("post_processor", fmt::format("names id {} beyond the vocabulary", id));
  t.content_by_id.resize(size_t(t.vocab_size));
  t.decode_form.resize(size_t(t.vocab_size));
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

std::optional<std::string> Tokenizer::token_content(uint32_t id) const {
  if (int64_t(id) >= tables_->vocab_size) return std::nullopt;
  const std::string& content = tables_->content_by_id[id];
  if (content.empty()) return std::nullopt;  // a hole in the ids
  return content;
}

std::optional<uint32_t> Tokenizer::unk_id() const {
  return tables_->unk;
}

bool Tokenizer::is_special(uint32_t id) const {
  return tables_->special_ids.count(id) > 0;
}

const std::vector<uint32_t>& Tokenizer::prefix_tokens() const {
  return tables_->prefix;
}
const std::vector<uint32_t>& Tokenizer::suffix_tokens() const {
  return tables_->suffix;
}

void Tokenizer::set_progress(std::function<void(uint64_t)> progress, uint64_t every) {
  progress_ = std::move(progress);
  progress_every_ = std::max<uint64_t>(every, 1);
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) {
  std::vector<TokenSpan> spans;
  encode_spans(text, add_special_tokens, spans);
  std::vector<uint32_t> ids(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) ids[i] = spans[i].id;
  return ids;
}

void Tokenizer::encode_spans(std::string_view text, bool add_special_tokens,
                             std::vector<TokenSpan>& out) {
  const TokenizerTables& t = *tables_;
  next_progress_ = progress_every_;
  if (add_special_tokens)
    for (uint32_t id : t.prefix) out.push_back({id, 0, 0});
  // Added tokens with normalized=false are found in the raw text; the text
  // between them is normalized and searched for the others.
  for (const Segment& segment : t.raw_added.split(text)) {
    if (segment.token != nullptr) {
      out.push_back({segment.token->id, segment.begin, segment.end});
      continue;
    }
    AlignedText gap;
    gap.text = text.substr(segment.begin, segment.end - segment.begin);
    gap.base = segment.begin;
    encode_normalized_gap(t.normalizer.apply(std::move(gap)), out);
  }
  if (add_special_tokens)
    for (uint32_t id : t.suffix) out.push_back({id, text.size(), text.size()});
}

namespace {

// The original bytes [begin, end) that bytes [b, e) of `piece` came from.
std::pair<uint64_t, uint64_t> original_range(const AlignedText& piece, size_t b, size_t e) {
  const uint64_t begin = piece.begin_of(b);
  return {begin, std::max(piece.end_of(e - 1), begin)};
}

}  // namespace

void Tokenizer::encode_normalized_gap(const AlignedText& gap, std::vector<TokenSpan>& out) {
  const TokenizerTables& t = *tables_;
  for (const Segment& segment : t.normalized_added.split(gap.text)) {
    if (segment.token != nullptr) {
      const auto [begin, end] = original_range(gap, segment.begin, segment.end);
      out.push_back({segment.token->id, begin, end});
      continue;
    }
    t.pre_tokenizer.apply(gap.slice(segment.begin, segment.end),
                          [&](AlignedText& piece) { encode_piece(piece, out); });
  }
}

void Tokenizer::encode_piece(const AlignedText& piece, std::vector<TokenSpan>& out) {
  if (progress_) {
    const uint64_t at = piece.end_of(piece.text.size() - 1);
    if (at >= next_progress_) {
      progress_(at);
      next_progress_ = at + progress_every_;
    }
  }
  size_t offset = 0;
  for (const auto& [id, length] : model_tokens(piece.text)) {
    if (length == 0) {  // a byte-fallback token after the first of a character
      const uint64_t at = out.empty() ? piece.begin_of(0) : out.back().end;
      out.push_back({id, at, at});
      continue;
    }
    const auto [begin, end] = original_range(piece, offset, offset + length);
    out.push_back({id, begin, end});
    offset += length;
  }
}

const std::vector<std::pair<uint32_t, uint32_t>>& Tokenizer::model_tokens(const std::string& word) {
  const TokenizerTables& t = *tables_;
  if (auto cached = cache_.find(word); cached != cache_.end()) return cached->second;
  std::vector<std::pair<uint32_t, uint32_t>> tokens;
  if (auto whole = t.vocab.find(word); t.ignore_merges && whole != t.vocab.end()) {
    tokens.push_back({whole->second, uint32_t(word.size())});
  } else {
    // The word's units (its bytes when the vocabulary is byte-level, else its
    // characters) as symbols; what the vocabulary lacks becomes byte tokens or unk.
    const bool byte_level = t.pre_tokenizer.byte_level();
    std::vector<uint32_t> symbol, length;
    symbol.reserve(word.size());
    length.reserve(word.size());
    std::optional<std::pair<uint32_t, uint32_t>> unk;  // pending, with its length
    size_t i = 0;
    while (i < word.size()) {
      const size_t at = i;
      i += byte_level ? 1 : tokenizer_text::utf8_length_at(word, at);
      const uint32_t unit_length = uint32_t(i - at);
      int64_t id = kNoId;
      if (unit_length == 1) {
        id = t.single_byte_ids[static_cast<unsigned char>(word[at])];
      } else if (auto found = t.vocab.find(word.substr(at, unit_length)); found != t.vocab.end()) {
        id = found->second;
      }
      if (id != kNoId) {
        if (unk) {
          symbol.push_back(unk->first);
          length.push_back(unk->second);
          unk.reset();
        }
        symbol.push_back(uint32_t(id));
        length.push_back(unit_length);
        continue;
      }
      if (t.byte_fallback) {
        // The unit's text in the vocabulary's form, as byte tokens.
        std::string form = word.substr(at, unit_length);
        if (byte_level) {
          form.clear();
          tokenizer_text::append_utf8(
              form, tokenizer_steps::byte_to_code_point()[static_cast<unsigned char>(word[at])]);
        }
        const bool all = std::all_of(form.begin(), form.end(), [&](char c) {
          return t.byte_fallback_ids[static_cast<unsigned char>(c)] != kNoId;
        });
        if (all) {
          for (size_t k = 0; k < form.size(); ++k) {
            symbol.push_back(uint32_t(t.byte_fallback_ids[static_cast<unsigned char>(form[k])]));
            // Lengths are in the word's bytes: a byte-level unit is one byte.
            length.push_back(byte_level ? (k == 0 ? 1 : 0) : 1);
          }
          continue;
        }
      }
      if (!t.unk) {
        dropped_bytes_ += unit_length;
        continue;
      }
      if (unk && t.fuse_unk) {
        unk->second += unit_length;
      } else {
        if (unk) {
          symbol.push_back(unk->first);
          length.push_back(unk->second);
        }
        unk = std::make_pair(*t.unk, unit_length);
      }
    }
    if (unk) {
      symbol.push_back(unk->first);
      length.push_back(unk->second);
    }

    // Symbols in a linked list; a heap of candidate merges by (rank, position).
    // A popped candidate whose pair has changed since it was pushed is stale.
    const int n = int(symbol.size());
    std::vector<int> prev(n), next(n);
    std::vector<bool> alive(n, true);
    for (int k = 0; k < n; ++k) {
      prev[k] = k - 1;
      next[k] = k + 1 < n ? k + 1 : -1;
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
    auto push = [&](int k) {
      if (k < 0 || next[k] < 0) return;
      auto found = t.merges.find((uint64_t(symbol[k]) << 32) | symbol[next[k]]);
      if (found != t.merges.end()) heap.push({found->second.rank, k, symbol[k], symbol[next[k]]});
    };
    for (int k = 0; k + 1 < n; ++k) push(k);
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      const int k = c.position;
      if (!alive[k] || next[k] < 0 || symbol[k] != c.left || symbol[next[k]] != c.right) continue;
      const int j = next[k];
      symbol[k] = t.merges.at((uint64_t(c.left) << 32) | c.right).id;
      length[k] += length[j];
      alive[j] = false;
      next[k] = next[j];
      if (next[j] >= 0) prev[next[j]] = k;
      push(prev[k]);
      push(k);
    }
    for (int k = 0; k >= 0 && k < n; k = next[k]) tokens.push_back({symbol[k], length[k]});
  }
  if (word.size() > kMaxCachedWordBytes) {
    uncached_ = std::move(tokens);
    return uncached_;
  }
  if (cache_.size() >= kMaxCacheEntries) cache_.clear();
  return cache_.emplace(word, std::move(tokens)).first->second;
}

std::string Tokenizer::decode(const std::vector<uint32_t>& ids, bool skip_special_tokens) const {
  const TokenizerTables& t = *tables_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (uint32_t id : ids) {
    if (int64_t(id) >= t.vocab_size || t.content_by_id[id].empty()) continue;
    if (skip_special_tokens && t.special_ids.count(id) > 0) continue;
    tokens.push_back(t.decode_form[id].empty() ? t.content_by_id[id] : t.decode_form[id]);
  }
  return t.decoder.decode(std::move(tokens));
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
