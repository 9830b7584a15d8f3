#include "prep/tokenizer_steps.h"

#include <fmt/format.h>
#ifdef STRATA_HAVE_ICU
#include <unicode/bytestream.h>
#include <unicode/edits.h>
#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>
#endif

#include <algorithm>
#include <unordered_map>

namespace strata::tokenizer_steps {

using nlohmann::json;
using tokenizer_text::append_utf8;
using tokenizer_text::Match;
using tokenizer_text::next_code_point;
using tokenizer_text::Regex;
using tokenizer_text::SplitBehavior;

Status JsonErrors::error(const std::string& key, const std::string& what) const {
  return Status::corruption(fmt::format("{}: {}: {}", origin, key, what));
}

Status JsonErrors::refused(const std::string& key, const std::string& what) const {
  return Status::invalid_argument(fmt::format("{}: {}: {}", origin, key, what));
}

Status JsonErrors::unsupported(const std::string& key, const json& value,
                               const std::string& supported) const {
  return refused(key, fmt::format("{} is not supported (strata reads {}); this tokenizer cannot "
                                  "be used with strata",
                                  value.dump(), supported));
}

bool is_null_or(const json& object, const char* key, const json& expected) {
  return !object.contains(key) || object[key].is_null() || object[key] == expected;
}

const std::array<uint32_t, 256>& byte_to_code_point() {
  static const std::array<uint32_t, 256> map = [] {
    std::array<uint32_t, 256> m{};
    std::array<bool, 256> printable{};
    for (int b = '!'; b <= '~'; ++b) printable[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) m[b] = printable[b] ? uint32_t(b) : next++;
    return m;
  }();
  return map;
}

const std::unordered_map<uint32_t, char>& code_point_to_byte() {
  static const std::unordered_map<uint32_t, char> map = [] {
    std::unordered_map<uint32_t, char> m;
    for (int b = 0; b < 256; ++b) m[byte_to_code_point()[b]] = char(b);
    return m;
  }();
  return map;
}

namespace {

// GPT-2's pattern, which ByteLevel uses when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Rust's char::is_ascii_punctuation or a Unicode punctuation category (Punctuation).
constexpr const char* kPunctuationPattern = R"([\p{P}\x21-\x2F\x3A-\x40\x5B-\x60\x7B-\x7E])";
constexpr const char* kNumericPattern = R"(\p{N})";            // Rust's char::is_numeric (Digits)
constexpr const char* kWhitespacePattern = R"(\w+|[^\w\s]+)";  // Whitespace, inverted

Result<std::shared_ptr<const Regex>> compile(const JsonErrors& errors, const std::string& key,
                                             const std::string& source) {
  Result<std::shared_ptr<const Regex>> regex = Regex::compile(source);
  if (!regex) return errors.error(key, regex.status().message());
  return regex;
}

// A Split or Replace pattern: {"String": s} or {"Regex": r}.
struct Pattern {
  std::string literal;
  std::shared_ptr<const Regex> regex;
  std::vector<Match> find(std::string_view text) const {
    return regex ? regex->find_matches(text) : tokenizer_text::find_literal(text, literal);
  }
};

Result<Pattern> parse_pattern(const JsonErrors& errors, const json& step, const std::string& key) {
  const json pattern = step.value("pattern", json());
  if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string())
    return Pattern{pattern["String"].get<std::string>(), nullptr};
  if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
    Result<std::shared_ptr<const Regex>> regex =
        compile(errors, key + ".pattern", pattern["Regex"].get<std::string>());
    if (!regex) return regex.status();
    return Pattern{"", *regex};
  }
  return errors.error(key + ".pattern", fmt::format("{} is neither {{\"String\": ...}} nor "
                                                    "{{\"Regex\": ...}}",
                                                    pattern.dump()));
}

// One character given as a string (Metaspace's replacement, Strip's content).
Result<std::string> parse_character(const JsonErrors& errors, const json& step, const char* name,
                                    const std::string& key, const std::string& fallback) {
  const std::string value =
      step.contains(name) && step[name].is_string() ? step[name].get<std::string>() : fallback;
  size_t i = 0;
  if (value.empty() || !next_code_point(value, i) || i != value.size())
    return errors.error(fmt::format("{}.{}", key, name),
                        fmt::format("'{}' is not one character", value));
  return value;
}

// Metaspace's prepend_scheme (pre-tokenizer and decoder alike), or the older
// add_prefix_space (false: never), which must agree with it when both are given.
enum class PrependScheme { always, first, never };
Result<PrependScheme> parse_prepend_scheme(const JsonErrors& errors, const json& json,
                                           const std::string& key) {
  const std::string scheme = json.value("prepend_scheme", "always");
  PrependScheme out = PrependScheme::always;
  if (scheme == "first")
    out = PrependScheme::first;
  else if (scheme == "never")
    out = PrependScheme::never;
  else if (scheme != "always")
    return errors.unsupported(key + ".prepend_scheme", scheme, "always, first or never");
  if (json.contains("add_prefix_space") && json["add_prefix_space"] == false) {
    if (json.contains("prepend_scheme") && scheme != "never")
      return errors.error(key, "add_prefix_space false does not match prepend_scheme " + scheme);
    out = PrependScheme::never;
  }
  return out;
}

}  // namespace

Status parse_sequence(
    const JsonErrors& errors, const nlohmann::json& json, const std::string& key,
    const char* list_key,
    const std::function<Status(const nlohmann::json&, const std::string&)>& part) {
  if (!json.contains(list_key) || !json[list_key].is_array())
    return errors.error(fmt::format("{}.{}", key, list_key), "missing or not a list");
  for (size_t i = 0; i < json[list_key].size(); ++i)
    if (Status s = part(json[list_key][i], fmt::format("{}.{}[{}]", key, list_key, i)); !s)
      return s;
  return Status::ok();
}

// ---------------------------------------------------------------- normalizer

struct Normalizer::Step {
  enum class Kind { nfc, nfd, nfkc, nfkd, lowercase, strip, prepend, replace } kind;
  bool left = false, right = false;  // strip
  std::string content;               // prepend, replace
  Pattern pattern;                   // replace
};

namespace {

#ifdef STRATA_HAVE_ICU
AlignedText unicode_normalize(const AlignedText& text, Normalizer::Step::Kind kind) {
  if (std::all_of(text.text.begin(), text.text.end(), [](char c) { return (c & 0x80) == 0; }))
    return text;  // ASCII is left as it is by every normal form
  UErrorCode status = U_ZERO_ERROR;
  using Kind = Normalizer::Step::Kind;
  const icu::Normalizer2* form = kind == Kind::nfc    ? icu::Normalizer2::getNFCInstance(status)
                                 : kind == Kind::nfd  ? icu::Normalizer2::getNFDInstance(status)
                                 : kind == Kind::nfkc ? icu::Normalizer2::getNFKCInstance(status)
                                                      : icu::Normalizer2::getNFKDInstance(status);
  std::string out;
  icu::Edits edits;
  if (U_SUCCESS(status)) {
    icu::StringByteSink<std::string> sink(&out, int32_t(text.text.size()));
    form->normalizeUTF8(0, icu::StringPiece(text.text.data(), int32_t(text.text.size())), sink,
                        &edits, status);
  }
  // ICU fails only on invalid UTF-8, which callers rule out first; keep the text then.
  if (U_FAILURE(status)) return text;
  std::vector<tokenizer_text::TextEdit> changes;
  icu::Edits::Iterator it = edits.getFineChangesIterator();
  while (it.next(status))
    changes.push_back({size_t(it.sourceIndex()), size_t(it.sourceIndex() + it.oldLength()),
                       size_t(it.destinationIndex()),
                       size_t(it.destinationIndex() + it.newLength())});
  return tokenizer_text::apply_edits(text, std::move(out), changes);
}

// Each character lowercased on its own, as Rust's char::to_lowercase does
// (full mappings, so U+0130 becomes "i" and a combining dot; no final sigma).
AlignedText lowercase(const AlignedText& text) {
  std::string out;
  out.reserve(text.text.size());
  std::vector<tokenizer_text::TextEdit> changes;
  size_t i = 0;
  const std::string& s = text.text;
  while (i < s.size()) {
    const unsigned char byte = static_cast<unsigned char>(s[i]);
    if (byte < 0x80) {
      out.push_back(char(byte >= 'A' && byte <= 'Z' ? byte + 32 : byte));
      ++i;
      continue;
    }
    const size_t at = i;
    const std::optional<uint32_t> cp = next_code_point(s, i);
    if (!cp) {
      out.push_back(s[at]);
      i = at + 1;
      continue;
    }
    icu::UnicodeString character{UChar32(*cp)};
    character.toLower(icu::Locale::getRoot());
    std::string lower;
    character.toUTF8String(lower);
    const size_t output_at = out.size();
    out += lower;
    if (lower != std::string_view(s).substr(at, i - at))
      changes.push_back({at, i, output_at, out.size()});
  }
  if (out == s) return text;
  // ASCII letters change in place, byte for byte: only other changes are edits.
  return tokenizer_text::apply_edits(text, std::move(out), changes);
}
#endif

}  // namespace

Result<Normalizer> Normalizer::parse(const JsonErrors& errors, const json& json,
                                     const std::string& key) {
  Normalizer normalizer;
  if (json.is_null()) return normalizer;
  if (!json.is_object()) return errors.error(key, "not an object");
  const std::string type = json.value("type", "");
  if (type == "Sequence") {
    Status read =
        parse_sequence(errors, json, key, "normalizers",
                       [&](const nlohmann::json& item, const std::string& item_key) {
                         Result<Normalizer> part = parse(errors, item, item_key);
                         if (!part) return part.status();
                         normalizer.steps_.insert(normalizer.steps_.end(), part->steps_.begin(),
                                                  part->steps_.end());
                         return Status::ok();
                       });
    if (!read) return read;
    return normalizer;
  }
  using Kind = Step::Kind;
  static const std::unordered_map<std::string, Kind> kUnicode = {{"NFC", Kind::nfc},
                                                                 {"NFD", Kind::nfd},
                                                                 {"NFKC", Kind::nfkc},
                                                                 {"NFKD", Kind::nfkd},
                                                                 {"Lowercase", Kind::lowercase}};
  auto step = std::make_shared<Step>();
  if (auto found = kUnicode.find(type); found != kUnicode.end()) {
#ifndef STRATA_HAVE_ICU
    return Status::error(fmt::format(
        "{}: {}.type \"{}\": this strata was built without ICU, which normalizes; install "
        "libicu-dev and rebuild",
        errors.origin, key, type));
#endif
    step->kind = found->second;
  } else if (type == "Strip") {
    step->kind = Kind::strip;
    step->left = json.value("strip_left", true);
    step->right = json.value("strip_right", true);
  } else if (type == "Prepend") {
    if (!json.contains("prepend") || !json["prepend"].is_string())
      return errors.error(key + ".prepend", "missing or not a string");
    step->kind = Kind::prepend;
    step->content = json["prepend"].get<std::string>();
  } else if (type == "Replace") {
    Result<Pattern> pattern = parse_pattern(errors, json, key);
    if (!pattern) return pattern.status();
    if (!json.contains("content") || !json["content"].is_string())
      return errors.error(key + ".content", "missing or not a string");
    step->kind = Kind::replace;
    step->pattern = std::move(*pattern);
    step->content = json["content"].get<std::string>();
  } else {
    return errors.unsupported(key + ".type", type,
                              "null, NFC, NFD, NFKC, NFKD, Lowercase, Strip, Prepend, Replace or "
                              "a Sequence of them");
  }
  normalizer.steps_.push_back(std::move(step));
  return normalizer;
}

AlignedText Normalizer::apply(AlignedText text) const {
  using Kind = Step::Kind;
  for (const auto& step : steps_) {
    switch (step->kind) {
      case Kind::nfc:
      case Kind::nfd:
      case Kind::nfkc:
      case Kind::nfkd:
#ifdef STRATA_HAVE_ICU
        text = unicode_normalize(text, step->kind);
#endif
        break;
      case Kind::lowercase:
#ifdef STRATA_HAVE_ICU
        text = lowercase(text);
#endif
        break;
      case Kind::strip:
        text = tokenizer_text::strip_whitespace(text, step->left, step->right);
        break;
      case Kind::prepend:
        text = tokenizer_text::prepend(text, step->content);
        break;
      case Kind::replace:
        text = tokenizer_text::replace_matches(text, step->pattern.find(text.text), step->content);
        break;
    }
  }
  return text;
}

// ------------------------------------------------------------- pre-tokenizer

struct PreTokenizer::Step {
  enum class Kind { split, whitespace_split, metaspace, byte_level } kind;
  Pattern pattern;  // split
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
  std::string replacement;  // metaspace
  PrependScheme prepend = PrependScheme::always;
  bool split_on_replacement = true;   // metaspace
  bool add_prefix_space = false;      // byte_level
  std::shared_ptr<const Regex> gpt2;  // byte_level with use_regex

  void split(const AlignedText& piece, std::vector<AlignedText>& out) const;
};

void PreTokenizer::Step::split(const AlignedText& piece, std::vector<AlignedText>& out) const {
  switch (kind) {
    case Kind::split:
      tokenizer_text::split_text(piece, pattern.find(piece.text), behavior, invert, out);
      return;
    case Kind::whitespace_split:
      tokenizer_text::split_text(
          piece, tokenizer_text::find_characters(piece.text, tokenizer_text::is_whitespace),
          SplitBehavior::removed, false, out);
      return;
    case Kind::metaspace: {
      AlignedText text = tokenizer_text::replace_matches(
          piece, tokenizer_text::find_literal(piece.text, " "), replacement);
      const bool starts = text.text.compare(0, replacement.size(), replacement) == 0;
      if (!starts && !text.text.empty() &&
          (prepend == PrependScheme::always ||
           (prepend == PrependScheme::first && text.begin_of(0) == 0)))
        text = tokenizer_text::prepend(text, replacement);
      if (split_on_replacement)
        tokenizer_text::split_text(text, tokenizer_text::find_literal(text.text, replacement),
                                   SplitBehavior::merged_with_next, false, out);
      else if (!text.text.empty())
        out.push_back(std::move(text));
      return;
    }
    case Kind::byte_level: {
      const AlignedText text = add_prefix_space && piece.text.compare(0, 1, " ") != 0
                                   ? tokenizer_text::prepend(piece, " ")
                                   : piece;
      if (gpt2)
        tokenizer_text::split_text(text, gpt2->find_matches(text.text), SplitBehavior::isolated,
                                   false, out);
      else if (!text.text.empty())
        out.push_back(text);
      return;
    }
  }
}

namespace {

// Steps after ByteLevel see its characters, not the bytes: these two convert.
AlignedText bytes_to_characters(const AlignedText& piece) {
  AlignedText out;
  out.base = piece.base;
  const auto& map = byte_to_code_point();
  for (size_t i = 0; i < piece.text.size(); ++i) {
    const size_t before = out.text.size();
    append_utf8(out.text, map[static_cast<unsigned char>(piece.text[i])]);
    out.begin.insert(out.begin.end(), out.text.size() - before,
                     uint32_t(piece.begin_of(i) - piece.base));
    out.end.insert(out.end.end(), out.text.size() - before, uint32_t(piece.end_of(i) - piece.base));
  }
  return out;
}

AlignedText characters_to_bytes(const AlignedText& piece) {
  const std::unordered_map<uint32_t, char>& bytes = code_point_to_byte();
  AlignedText out;
  out.base = piece.base;
  size_t i = 0;
  while (i < piece.text.size()) {
    const size_t at = i;
    const std::optional<uint32_t> cp = next_code_point(piece.text, i);
    if (!cp) i = at + 1;
    const uint32_t from = uint32_t(piece.begin_of(at) - piece.base);
    const uint32_t to = uint32_t(piece.end_of(i - 1) - piece.base);
    auto found = cp ? bytes.find(*cp) : bytes.end();
    // A character a later step inserted (a Metaspace "▁") keeps its own bytes.
    const size_t count = found != bytes.end() ? 1 : i - at;
    if (found != bytes.end())
      out.text.push_back(found->second);
    else
      out.text.append(piece.text, at, i - at);
    out.begin.insert(out.begin.end(), count, from);
    out.end.insert(out.end.end(), count, to);
  }
  return out;
}

}  // namespace

Result<PreTokenizer> PreTokenizer::parse(const JsonErrors& errors, const json& json,
                                         const std::string& key) {
  PreTokenizer pre;
  if (json.is_null()) return pre;
  if (!json.is_object()) return errors.error(key, "not an object");
  const std::string type = json.value("type", "");
  if (type == "Sequence") {
    Status read = parse_sequence(
        errors, json, key, "pretokenizers",
        [&](const nlohmann::json& item, const std::string& item_key) {
          Result<PreTokenizer> part = parse(errors, item, item_key);
          if (!part) return part.status();
          if (part->byte_level()) {
            if (pre.byte_level())
              return errors.refused(item_key, "a second ByteLevel step is not supported");
            pre.byte_level_at_ = int(pre.steps_.size()) + part->byte_level_at_;
          }
          pre.steps_.insert(pre.steps_.end(), part->steps_.begin(), part->steps_.end());
          return Status::ok();
        });
    if (!read) return read;
    return pre;
  }
  auto step = std::make_shared<Step>();
  auto regex_step = [&](const char* source, SplitBehavior behavior, bool invert) -> Status {
    Result<std::shared_ptr<const Regex>> regex = compile(errors, key, source);
    if (!regex) return regex.status();
    step->kind = Step::Kind::split;
    step->pattern.regex = *regex;
    step->behavior = behavior;
    step->invert = invert;
    return Status::ok();
  };
  auto behavior_of = [&](const char* fallback) -> Result<SplitBehavior> {
    const std::string name = json.value("behavior", fallback);
    std::optional<SplitBehavior> behavior = tokenizer_text::split_behavior_named(name);
    if (!behavior)
      return errors.unsupported(key + ".behavior", name,
                                "Removed, Isolated, MergedWithPrevious, MergedWithNext or "
                                "Contiguous");
    return *behavior;
  };
  if (type == "ByteLevel") {
    step->kind = Step::Kind::byte_level;
    step->add_prefix_space = json.value("add_prefix_space", false);
    if (json.value("use_regex", true)) {
      Result<std::shared_ptr<const Regex>> regex = compile(errors, key, kGpt2Pattern);
      if (!regex) return regex.status();
      step->gpt2 = *regex;
    }
    pre.byte_level_at_ = 0;
  } else if (type == "Split") {
    Result<Pattern> pattern = parse_pattern(errors, json, key);
    if (!pattern) return pattern.status();
    Result<SplitBehavior> behavior = behavior_of("");
    if (!behavior) return behavior.status();
    step->kind = Step::Kind::split;
    step->pattern = std::move(*pattern);
    step->behavior = *behavior;
    step->invert = json.value("invert", false);
  } else if (type == "Digits") {
    const bool individual = json.value("individual_digits", false);
    if (Status s =
            regex_step(kNumericPattern,
                       individual ? SplitBehavior::isolated : SplitBehavior::contiguous, false);
        !s)
      return s;
  } else if (type == "Punctuation") {
    Result<SplitBehavior> behavior = behavior_of("Isolated");
    if (!behavior) return behavior.status();
    if (Status s = regex_step(kPunctuationPattern, *behavior, false); !s) return s;
  } else if (type == "Whitespace") {
    if (Status s = regex_step(kWhitespacePattern, SplitBehavior::removed, true); !s) return s;
  } else if (type == "WhitespaceSplit") {
    step->kind = Step::Kind::whitespace_split;
  } else if (type == "Metaspace") {
    step->kind = Step::Kind::metaspace;
    Result<std::string> replacement = parse_character(errors, json, "replacement", key, "\u2581");
    if (!replacement) return replacement.status();
    step->replacement = *replacement;
    Result<PrependScheme> scheme = parse_prepend_scheme(errors, json, key);
    if (!scheme) return scheme.status();
    step->prepend = *scheme;
    step->split_on_replacement = json.value("split", true);
  } else {
    return errors.unsupported(key + ".type", type,
                              "ByteLevel, Metaspace, Split, Digits, Punctuation, Whitespace, "
                              "WhitespaceSplit or a Sequence of them");
  }
  pre.steps_.push_back(std::move(step));
  return pre;
}

void PreTokenizer::apply(const AlignedText& text,
                         const std::function<void(AlignedText&)>& each) const {
  // Depth first, so only the first step's pieces of a long text are held at once.
  auto run = [&](auto& self, size_t stage, AlignedText piece) -> void {
    if (stage == steps_.size()) {
      if (byte_level() && size_t(byte_level_at_) + 1 < steps_.size())
        piece = characters_to_bytes(piece);
      each(piece);
      return;
    }
    if (byte_level() && stage == size_t(byte_level_at_) + 1) piece = bytes_to_characters(piece);
    std::vector<AlignedText> parts;
    steps_[stage]->split(piece, parts);
    for (AlignedText& part : parts) self(self, stage + 1, std::move(part));
  };
  if (!text.text.empty()) run(run, 0, text);
}

// ------------------------------------------------------------------- decoder

struct Decoder::Step {
  enum class Kind { byte_level, metaspace, replace, byte_fallback, fuse, strip } kind;
  std::string replacement;     // metaspace; strip's content
  bool strip_first = true;     // metaspace: prepend_scheme is not never
  Pattern pattern;             // replace
  std::string content;         // replace
  size_t start = 0, stop = 0;  // strip

  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const;
};

namespace {

// A "<0xAB>" byte token's byte.
std::optional<char> byte_token(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return std::nullopt;
  unsigned value = 0;
  for (int k = 3; k < 5; ++k) {
    const char c = token[size_t(k)];
    const int digit = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                             : -1;
    if (digit < 0) return std::nullopt;
    value = value * 16 + unsigned(digit);
  }
  return char(value);
}

std::vector<uint32_t> code_points(const std::string& text) {
  std::vector<uint32_t> out;
  size_t i = 0;
  while (i < text.size()) {
    const size_t at = i;
    std::optional<uint32_t> cp = next_code_point(text, i);
    if (!cp) {
      i = at + 1;
      cp = static_cast<unsigned char>(text[at]);
    }
    out.push_back(*cp);
  }
  return out;
}

}  // namespace

std::vector<std::string> Decoder::Step::decode_chain(std::vector<std::string> tokens) const {
  switch (kind) {
    case Kind::byte_level: {
      const std::unordered_map<uint32_t, char>& bytes = code_point_to_byte();
      std::string all;
      for (const std::string& token : tokens) {
        std::string mapped;
        bool whole = true;
        size_t i = 0;
        while (i < token.size() && whole) {
          std::optional<uint32_t> cp = next_code_point(token, i);
          auto found = cp ? bytes.find(*cp) : bytes.end();
          whole = found != bytes.end();
          if (whole) mapped.push_back(found->second);
        }
        all += whole ? mapped : token;  // a token with other characters stays as it is
      }
      return {tokenizer_text::lossy_utf8(all)};
    }
    case Kind::metaspace:
      for (size_t t = 0; t < tokens.size(); ++t) {
        std::string out;
        for (size_t at = 0; at < tokens[t].size();) {
          if (tokens[t].compare(at, replacement.size(), replacement) == 0) {
            if (t != 0 || !strip_first) out.push_back(' ');
            at += replacement.size();
          } else {
            out.push_back(tokens[t][at++]);
          }
        }
        tokens[t] = std::move(out);
      }
      return tokens;
    case Kind::replace:
      for (std::string& token : tokens) {
        std::string out;
        for (const Match& m : pattern.find(token))
          out += m.is_match ? content : token.substr(m.begin, m.end - m.begin);
        token = std::move(out);
      }
      return tokens;
    case Kind::byte_fallback: {
      std::vector<std::string> out;
      std::string pending;  // bytes of consecutive byte tokens
      auto flush = [&] {
        if (pending.empty()) return;
        size_t i = 0;
        bool valid = true;
        while (i < pending.size() && valid) valid = next_code_point(pending, i).has_value();
        if (valid)
          out.push_back(pending);
        else
          out.insert(out.end(), pending.size(), "\xEF\xBF\xBD");
        pending.clear();
      };
      for (std::string& token : tokens) {
        if (std::optional<char> byte = byte_token(token)) {
          pending.push_back(*byte);
        } else {
          flush();
          out.push_back(std::move(token));
        }
      }
      flush();
      return out;
    }
    case Kind::fuse: {
      std::string all;
      for (const std::string& token : tokens) all += token;
      return {all};
    }
    case Kind::strip: {
      const uint32_t content_cp = code_points(replacement).at(0);
      for (std::string& token : tokens) {
        const std::vector<uint32_t> cps = code_points(token);
        size_t begin = 0, end = cps.size();
        for (size_t i = 0; i < start && i < cps.size() && cps[i] == content_cp; ++i) begin = i + 1;
        for (size_t i = 0; i < stop && i < cps.size() && cps[cps.size() - 1 - i] == content_cp; ++i)
          end = cps.size() - 1 - i;
        std::string out;
        for (size_t i = begin; i < end; ++i) append_utf8(out, cps[i]);
        token = std::move(out);
      }
      return tokens;
    }
  }
  return tokens;
}

Result<Decoder> Decoder::parse(const JsonErrors& errors, const json& json, const std::string& key) {
  Decoder decoder;
  if (json.is_null()) return decoder;
  if (!json.is_object()) return errors.error(key, "not an object");
  decoder.present_ = true;
  const std::string type = json.value("type", "");
  if (type == "Sequence") {
    Status read = parse_sequence(errors, json, key, "decoders",
                                 [&](const nlohmann::json& item, const std::string& item_key) {
                                   Result<Decoder> part = parse(errors, item, item_key);
                                   if (!part) return part.status();
                                   decoder.steps_.insert(decoder.steps_.end(), part->steps_.begin(),
                                                         part->steps_.end());
                                   return Status::ok();
                                 });
    if (!read) return read;
    return decoder;
  }
  auto step = std::make_shared<Step>();
  if (type == "ByteLevel") {
    step->kind = Step::Kind::byte_level;
  } else if (type == "Metaspace") {
    step->kind = Step::Kind::metaspace;
    Result<std::string> replacement = parse_character(errors, json, "replacement", key, "\u2581");
    if (!replacement) return replacement.status();
    step->replacement = *replacement;
    Result<PrependScheme> scheme = parse_prepend_scheme(errors, json, key);
    if (!scheme) return scheme.status();
    step->strip_first = *scheme != PrependScheme::never;
  } else if (type == "Replace") {
    Result<Pattern> pattern = parse_pattern(errors, json, key);
    if (!pattern) return pattern.status();
    if (!json.contains("content") || !json["content"].is_string())
      return errors.error(key + ".content", "missing or not a string");
    step->kind = Step::Kind::replace;
    step->pattern = std::move(*pattern);
    step->content = json["content"].get<std::string>();
  } else if (type == "ByteFallback") {
    step->kind = Step::Kind::byte_fallback;
  } else if (type == "Fuse") {
    step->kind = Step::Kind::fuse;
  } else if (type == "Strip") {
    step->kind = Step::Kind::strip;
    Result<std::string> content = parse_character(errors, json, "content", key, " ");
    if (!content) return content.status();
    step->replacement = *content;
    step->start = json.value("start", size_t(0));
    step->stop = json.value("stop", size_t(0));
  } else {
    return errors.unsupported(key + ".type", type,
                              "null, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip or "
                              "a Sequence of them");
  }
  decoder.steps_.push_back(std::move(step));
  return decoder;
}

std::string Decoder::decode(std::vector<std::string> tokens) const {
  std::string out;
  if (!present_) {
    for (size_t i = 0; i < tokens.size(); ++i) out += (i > 0 ? " " : "") + tokens[i];
    return out;
  }
  for (const auto& step : steps_) tokens = step->decode_chain(std::move(tokens));
  for (const std::string& token : tokens) out += token;
  return out;
}

}  // namespace strata::tokenizer_steps
