// `strata prepare-data`: text files, JSONL documents or chat JSONL turned into
// a token file and its loss mask (prep/prepared_data.h) with the
// tokenizer of a Hugging Face model directory (prep/tokenizer.h), ready
// for `strata train --data`.
//
// Formats: `text` takes each input file as one document; `jsonl` one document
// per line, its text in a field (`text` by default); `chat` one conversation
// per line, `{"messages": [...]}`, rendered with the directory's chat template,
// only the assistant's tokens counting as targets (the pieces ChatTemplate
// marks; see prep/chat_template.h). Text and JSONL documents
// get the tokenizer's post-processor tokens (a BOS like <|begin_of_text|>, as
// `tokenizer(text)` adds them) unless --no-special-tokens; chats take theirs
// from the template, like `apply_chat_template(tokenize=True)`.
//
// Validation: with --val-fraction F, document i goes to val.bin when
// floor((i+1)F) > floor(iF): every 1/F-th document, spread over the input,
// the same on every run.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/data/token_data.h"
#include "io/file_system.h"
#include "prep/chat_template.h"
#include "prep/prepared_data.h"
#include "prep/tokenizer.h"
#include "tools/subcommand.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct UsageError {
  std::string message;
};

// Reports how far a long run is, on stderr, every few seconds: a rewritten
// line on a terminal, one line per report otherwise.
class Progress {
 public:
  explicit Progress(uint64_t total_bytes) : total_(total_bytes), start_(Clock::now()) {}
  void update(uint64_t bytes, int64_t documents, int64_t tokens) {
    const auto now = Clock::now();
    if (now - last_ < std::chrono::seconds(2)) return;
    last_ = now;
    const double seconds = std::chrono::duration<double>(now - start_).count();
    if (seconds < 2) return;
    shown_ = true;
    fmt::print(stderr,
               "{}prepare-data: {:.1f} of {:.1f} MB, {} documents, {} tokens ({:.1f} MB/s){}",
               terminal_ ? "\r" : "", bytes / 1e6, total_ / 1e6, documents, tokens,
               bytes / 1e6 / seconds, terminal_ ? "" : "\n");
    std::fflush(stderr);
  }
  void finish() {
    if (shown_ && terminal_) fmt::print(stderr, "\n");
  }

 private:
  uint64_t total_;
  Clock::time_point start_, last_{};
  bool terminal_ = ::isatty(2) != 0;
  bool shown_ = false;
};

// A string from tokenizer_config.json: "<s>" or {"content": "<s>", ...}.
std::optional<std::string> config_token(const nlohmann::json& config, const char* key) {
  if (!config.contains(key)) return std::nullopt;
  const nlohmann::json& value = config[key];
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string())
    return value["content"].get<std::string>();
  return std::nullopt;
}

class PrepareDataCommand : public Subcommand {
 public:
  CLI::App* add_to(CLI::App& app) override {
    CLI::App* cmd = app.add_subcommand(
        "prepare-data",
        "Tokenize text, JSONL or chat JSONL with a Hugging Face tokenizer into a token file and "
        "loss mask for `strata train --data`");
    cmd->add_option("--model-dir", model_dir_,
                    "Hugging Face model directory: its tokenizer.json (and tokenizer_config.json "
                    "for eos, bos and the chat template)")
        ->required();
    cmd->add_option("--input", inputs_, "Input files, read in the order given")->required();
    cmd->add_option("--format", format_,
                    "text: each file one document | jsonl: one {\"text\": ...} per line | chat: "
                    "one {\"messages\": [...], \"tools\": [...]} per line, rendered with the chat "
                    "template, the assistant's tokens as targets (default text)")
        ->check(CLI::IsMember({"text", "jsonl", "chat"}));
    cmd->add_option("--out", out_,
                    "Directory for train.bin and train.mask (and val.bin, val.mask); created if "
                    "missing")
        ->required();
    cmd->add_option("--val-fraction", val_fraction_,
                    "Share of documents (every 1/F-th) written to val.bin instead (default 0)")
        ->check(CLI::Range(0.0, 0.5));
    cmd->add_flag("--append-eos", append_eos_,
                  "End every document with the eos_token of tokenizer_config.json");
    cmd->add_flag("--no-special-tokens", no_special_tokens_,
                  "text/jsonl: leave out the post-processor's tokens (a BOS) around documents");
    cmd->add_option("--text-field", text_field_,
                    "jsonl: the field holding the text (default text)");
    cmd->add_flag("--stats", stats_,
                  "Print tokens per document (mean, median, 90th percentile, largest), bytes "
                  "per token and the share of unk tokens: a high share says the tokenizer does "
                  "not fit the text");
    return cmd;
  }

  int run() override {
    try {
      return prepare();
    } catch (const UsageError& error) {
      fmt::print(stderr, "strata prepare-data: {}\n", error.message);
      return 2;
    }
  }

 private:
  int prepare() {
    const fs::path dir(model_dir_);
    const fs::path tokenizer_path = dir / "tokenizer.json";
    if (!fs::exists(tokenizer_path))
      throw UsageError{fmt::format(
          "--model-dir {}: no tokenizer.json there; give a Hugging Face model directory that "
          "holds its tokenizer",
          model_dir_)};
    Result<Tokenizer> tokenizer = Tokenizer::load(tokenizer_path.string());
    if (!tokenizer) throw UsageError{tokenizer.status().message()};
    tokenizer_ = std::move(*tokenizer);
    read_tokenizer_config(dir);
    if (append_eos_) eos_id_ = special_token_id("eos_token", "--append-eos");
    if (format_ == "chat") prepare_chat(dir);
    for (const std::string& input : inputs_)
      if (!fs::is_regular_file(input))
        throw UsageError{fmt::format("--input {}: no such file", input)};
    prepare_out_dir();

    uint64_t total = 0;
    for (const std::string& input : inputs_) total += fs::file_size(input);
    Progress progress(total);
    uint64_t done = 0;
    for (const std::string& input : inputs_) {
      // A text file is one document: the tokenizer reports within it.
      auto report = [&](uint64_t bytes) { progress.update(done + bytes, documents(), tokens()); };
      if (format_ == "text") {
        tokenizer_.set_progress(report);
        read_text_file(input);
      } else {
        read_jsonl_file(input, report);
      }
      done += fs::file_size(input);
      progress.update(done, documents(), tokens());
    }
    tokenizer_.set_progress(nullptr);
    progress.finish();

    const fs::path out(out_);
    std::vector<TokenOutput> outputs = {{&train_, (out / "train.bin").string()}};
    if (val_fraction_ > 0) outputs.push_back({&val_, (out / "val.bin").string()});
    const int width = token_width(tokenizer_.vocab_size());
    if (Status s = write_token_outputs(outputs, width); !s) {
      fmt::print(stderr, "strata prepare-data: {}\n", s.message());
      return 1;
    }
    print_summary(outputs, width);
    if (stats_) print_stats(total);
    if (tokenizer_.dropped_bytes() > 0)
      fmt::print(stderr,
                 "strata prepare-data: warning: {} bytes of input became no token (characters "
                 "{} lacks, with no byte fallback or unk token to stand for them)\n",
                 tokenizer_.dropped_bytes(), (fs::path(model_dir_) / "tokenizer.json").string());
    return 0;
  }

  // Tokens per document, bytes per token and unk tokens, over train and val.
  void print_stats(uint64_t input_bytes) {
    std::vector<int64_t> sizes = document_tokens_;
    if (sizes.empty()) {
      fmt::print("prepare-data --stats: no documents\n");
      return;
    }
    std::sort(sizes.begin(), sizes.end());
    int64_t total = 0;
    for (int64_t n : sizes) total += n;
    // The nearest-rank quantile: the smallest size at least a share q of documents reach.
    auto quantile = [&](double q) {
      return sizes[std::max<size_t>(size_t(std::ceil(q * double(sizes.size()))), 1) - 1];
    };
    fmt::print(
        "prepare-data --stats: {} documents; tokens per document: mean {:.1f}, median {}, 90th "
        "percentile {}, smallest {}, largest {}; {:.2f} input bytes per token\n",
        sizes.size(), double(total) / double(sizes.size()), quantile(0.5), quantile(0.9),
        sizes.front(), sizes.back(), total > 0 ? double(input_bytes) / double(total) : 0.0);
    const std::optional<uint32_t> unk = tokenizer_.unk_id();
    if (!unk) {
      fmt::print(
          "prepare-data --stats: the tokenizer has no unk token (byte-level or byte "
          "fallback: every character has tokens)\n");
      return;
    }
    int64_t unks = 0;
    for (const TokenStream* stream : {&train_, &val_})
      unks += std::count(stream->tokens.begin(), stream->tokens.end(), *unk);
    if (eos_id_ == unk) unks -= int64_t(sizes.size());  // --append-eos's, when unk is the eos
    const double share = total > 0 ? 100.0 * double(unks) / double(total) : 0.0;
    fmt::print("prepare-data --stats: {} unk tokens ({}) of {}: {:.3f}%{}\n", unks,
               *tokenizer_.token_content(*unk), total, share,
               share > 1.0 ? "; more than 1% of the text is unknown to this tokenizer, which "
                             "does not fit it"
                           : "");
  }

  int64_t documents() const { return train_.documents + val_.documents; }
  int64_t tokens() const { return int64_t(train_.tokens.size() + val_.tokens.size()); }

  void read_tokenizer_config(const fs::path& dir) {
    const fs::path path = dir / "tokenizer_config.json";
    if (!fs::exists(path)) return;
    Result<std::string> text = io::read_whole_file(io::FileSystem::real(), path.string());
    if (!text) throw UsageError{text.status().message()};
    try {
      config_ = nlohmann::json::parse(*text);
    } catch (const nlohmann::json::exception& e) {
      throw UsageError{fmt::format("{}: not valid JSON: {}", path.string(), e.what())};
    }
  }

  uint32_t special_token_id(const char* key, const std::string& flag) {
    const std::string config_path = (fs::path(model_dir_) / "tokenizer_config.json").string();
    std::optional<std::string> content = config_token(config_, key);
    if (!content)
      throw UsageError{fmt::format("{}: {}; {} needs its {}", config_path,
                                   config_.is_null() ? "missing" : fmt::format("names no {}", key),
                                   flag, key)};
    std::optional<uint32_t> id = tokenizer_.token_id(*content);
    if (!id)
      throw UsageError{
          fmt::format("{}: {} '{}' is not a token of tokenizer.json", config_path, key, *content)};
    return *id;
  }

  // The chat template: tokenizer_config.json's chat_template (a string, or a
  // list of {name, template} of which "default"), else chat_template.jinja.
  std::string find_chat_template(const fs::path& dir) {
    if (config_.contains("chat_template")) {
      const nlohmann::json& value = config_["chat_template"];
      if (value.is_string()) return value.get<std::string>();
      if (value.is_array())
        for (const nlohmann::json& named : value)
          if (named.is_object() && named.value("name", "") == "default" &&
              named.contains("template") && named["template"].is_string())
            return named["template"].get<std::string>();
    }
    const fs::path jinja = dir / "chat_template.jinja";
    if (fs::exists(jinja)) {
      Result<std::string> text = io::read_whole_file(io::FileSystem::real(), jinja.string());
      if (!text) throw UsageError{text.status().message()};
      return *text;
    }
    throw UsageError{fmt::format(
        "--format chat: {} has no chat template (chat_template in tokenizer_config.json, a "
        "\"default\" one when it is a list, or chat_template.jinja); add one or use --format jsonl",
        model_dir_)};
  }

  void prepare_chat(const fs::path& dir) {
    Result<ChatTemplate> parsed = ChatTemplate::parse(find_chat_template(dir));
    if (!parsed)
      throw UsageError{fmt::format("--format chat: the chat template of {}: {}", model_dir_,
                                   parsed.status().message())};
    chat_template_.emplace(std::move(*parsed));
    chat_context_.bos_token = config_token(config_, "bos_token").value_or("");
    chat_context_.eos_token = config_token(config_, "eos_token").value_or("");
  }

  // A conversation: rendered, then tokenized as one text with the assistant's
  // pieces as targets (prep/prepared_data.h); its BOS comes from the template.
  void add_chat_document(const nlohmann::ordered_json& document, const std::string& where) {
    if (!document.contains("messages") || !document["messages"].is_array())
      throw UsageError{fmt::format("{}: no \"messages\" field holding a list of messages", where)};
    std::optional<nlohmann::ordered_json> tools;
    if (document.contains("tools") && !document["tools"].is_null()) tools = document["tools"];
    Result<std::vector<ChatPiece>> pieces =
        chat_template_->render(document["messages"], chat_context_, tools);
    if (!pieces) throw UsageError{fmt::format("{}: {}", where, pieces.status().message())};
    std::vector<MarkedText> marked;
    marked.reserve(pieces->size());
    for (ChatPiece& piece : *pieces) {
      if (invalid_utf8_offset(piece.text))
        throw UsageError{fmt::format("{}: the rendered conversation holds invalid UTF-8", where)};
      marked.push_back({std::move(piece.text), piece.target});
    }
    TokenStream& stream = stream_for_next_document();
    const size_t before = stream.tokens.size();
    append_marked_text(tokenizer_, marked, stream);
    document_tokens_.push_back(int64_t(stream.tokens.size() - before) + (eos_id_ ? 1 : 0));
    if (eos_id_) {  // a separator between conversations, not something to learn
      stream.tokens.push_back(*eos_id_);
      stream.mask.push_back(0);
    }
    ++stream.documents;
  }

  void prepare_out_dir() {
    std::error_code error;
    fs::create_directories(out_, error);
    if (error || !fs::is_directory(out_))
      throw UsageError{fmt::format("--out {}: cannot create the directory: {}", out_,
                                   error ? error.message() : "not a directory")};
    if (::access(out_.c_str(), W_OK | X_OK) != 0)
      throw UsageError{fmt::format("--out {}: not writable: {}; give a writable directory", out_,
                                   errno_text(errno))};
  }

  // Document i goes to validation when floor((i+1)F) > floor(iF).
  TokenStream& stream_for_next_document() {
    const int64_t i = documents();
    const bool val = val_fraction_ > 0 && std::floor(double(i + 1) * val_fraction_) >
                                              std::floor(double(i) * val_fraction_);
    return val ? val_ : train_;
  }

  void add_text_document(const std::string& text) {
    TokenStream& stream = stream_for_next_document();
    const std::vector<uint32_t> ids = tokenizer_.encode(text, !no_special_tokens_);
    document_tokens_.push_back(int64_t(ids.size()) + (eos_id_ ? 1 : 0));
    stream.tokens.insert(stream.tokens.end(), ids.begin(), ids.end());
    if (eos_id_) stream.tokens.push_back(*eos_id_);
    stream.mask.resize(stream.tokens.size(), 1);
    ++stream.documents;
  }

  void read_text_file(const std::string& path) {
    Result<std::string> read = io::read_whole_file(io::FileSystem::real(), path);
    if (!read) throw UsageError{"--input " + read.status().message()};
    const std::string& text = *read;
    if (std::optional<uint64_t> bad = invalid_utf8_offset(text))
      throw UsageError{fmt::format(
          "--input {}: invalid UTF-8 at byte {}; convert the file to UTF-8", path, *bad)};
    add_text_document(text);
  }

  template <typename OnProgress>
  void read_jsonl_file(const std::string& path, OnProgress&& on_progress) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw UsageError{fmt::format("--input {}: cannot open: {}", path, errno_text(errno))};
    std::string line;
    uint64_t bytes = 0;
    for (int64_t number = 1; std::getline(in, line); ++number) {
      bytes += line.size() + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines
      // Ordered: a chat template's tojson and items show keys in file order, as Python does.
      nlohmann::ordered_json document;
      try {
        document = nlohmann::ordered_json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        throw UsageError{
            fmt::format("{}:{}: not valid JSON ({}); each line must be one JSON object", path,
                        number, e.what())};
      }
      if (!document.is_object())
        throw UsageError{fmt::format("{}:{}: not a JSON object", path, number)};
      if (chat_template_) {
        add_chat_document(document, fmt::format("{}:{}", path, number));
        if ((number & 1023) == 0) on_progress(bytes);
        continue;
      }
      if (!document.contains(text_field_) || !document[text_field_].is_string())
        throw UsageError{
            fmt::format("{}:{}: no \"{}\" field holding a string{}", path, number, text_field_,
                        text_field_ == "text" ? " (another field: --text-field)" : "")};
      add_text_document(document[text_field_].get<std::string>());
      if ((number & 1023) == 0) on_progress(bytes);
    }
  }

  void print_summary(const std::vector<TokenOutput>& outputs, int width) {
    std::string parts;
    for (const TokenOutput& output : outputs) {
      const TokenStream& s = *output.stream;
      parts += fmt::format("{}{} documents, {} tokens, {:.1f}% targets -> {} + {}",
                           parts.empty() ? "" : "; ", s.documents, s.tokens.size(),
                           100.0 * double(s.targets()) / double(s.tokens.size()), output.path,
                           loss_mask_path(output.path));
    }
    fmt::print("prepare-data: {} ({}, vocabulary {})\n", parts, width == 2 ? "uint16" : "uint32",
               tokenizer_.vocab_size());
  }

  std::string model_dir_;
  std::vector<std::string> inputs_;
  std::string format_ = "text";
  std::string out_;
  double val_fraction_ = 0;
  bool append_eos_ = false;
  bool no_special_tokens_ = false;
  std::string text_field_ = "text";
  bool stats_ = false;

  Tokenizer tokenizer_;
  std::vector<int64_t> document_tokens_;  // --stats: tokens of each document, in order
  nlohmann::json config_;
  std::optional<uint32_t> eos_id_;
  std::optional<ChatTemplate> chat_template_;  // --format chat
  ChatTemplateContext chat_context_;
  TokenStream train_, val_;
};

SubcommandRegistration registration([] { return std::make_unique<PrepareDataCommand>(); });

}  // namespace
}  // namespace strata::tools
