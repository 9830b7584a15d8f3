// `strata decode`: token ids back to text with a Hugging Face model
// directory's tokenizer (prep/tokenizer.h, `tokenizers`' decode), so a user
// can read what a token file from `strata prepare-data` holds.
//
// Ids come from a token file (--input, any format TokenFile reads, a range of
// it with --start and --count) or from the command line (--ids). By default
// the text is printed as one piece; --tokens prints one line per token:
// position, id, the loss mask's value when the file has a mask, the token as
// tokenizer.json writes it, and its text. An id the tokenizer lacks is an
// error naming its position (a file written with another tokenizer).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/data/token_data.h"
#include "prep/tokenizer.h"
#include "tools/subcommand.h"
#include "tools/train_run.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;

class DecodeCommand : public Subcommand {
 public:
  CLI::App* add_to(CLI::App& app) override {
    CLI::App* cmd = app.add_subcommand(
        "decode",
        "Turn token ids (a token file or --ids) back into text with a Hugging Face "
        "tokenizer");
    cmd->add_option("--model-dir", model_dir_,
                    "Hugging Face model directory holding the tokenizer.json the ids came from")
        ->required();
    auto* input = cmd->add_option("--input", input_,
                                  "Token file written by `strata prepare-data` (or a nanoGPT / "
                                  "llm.c file); its loss mask is read when present");
    auto* ids = cmd->add_option("--ids", ids_, "Ids to decode instead of a file: 1,2,3 or 1 2 3")
                    ->delimiter(',');
    input->excludes(ids);
    cmd->add_option("--start", start_, "First token of the file to decode (default 0)")
        ->check(CLI::NonNegativeNumber);
    cmd->add_option("--count", count_,
                    "Tokens to decode from --start (default: to the end of the file)")
        ->check(CLI::PositiveNumber);
    cmd->add_flag("--skip-special-tokens", skip_special_,
                  "Leave special tokens (BOS, EOS, chat markers) out of the text");
    cmd->add_flag("--tokens", per_token_,
                  "One line per token: position, id, mask, the token as tokenizer.json writes it "
                  "and its text");
    return cmd;
  }

  int run() override {
    if (input_.empty() && ids_.empty()) return fail("give --input FILE or --ids 1,2,3");
    const std::string tokenizer_path = (fs::path(model_dir_) / "tokenizer.json").string();
    Result<Tokenizer> tokenizer = Tokenizer::load(tokenizer_path);
    if (!tokenizer) return fail(tokenizer.status().message());
    std::vector<uint32_t> ids = ids_;
    std::vector<uint8_t> mask;
    int64_t first = 0;
    if (!input_.empty()) {
      if (Status s = read_file_ids(ids, mask, first); !s) return fail(s.message());
    }
    for (size_t i = 0; i < ids.size(); ++i)
      if (!tokenizer->token_content(ids[i]))
        return fail(fmt::format(
            "{}token {} is id {}, which {} does not have (vocabulary {}); decode with the "
            "tokenizer the ids were written with",
            input_.empty() ? "--ids: " : input_ + ": ", first + int64_t(i), ids[i], tokenizer_path,
            tokenizer->vocab_size()));
    if (!per_token_) {
      const std::string text = tokenizer->decode(ids, skip_special_);
      std::fwrite(text.data(), 1, text.size(), stdout);
      if (!text.empty() && text.back() != '\n') std::fputc('\n', stdout);
      return 0;
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      if (skip_special_ && tokenizer->is_special(ids[i])) continue;
      // JSON strings show control characters and spaces unambiguously.
      fmt::print("{}\t{}\t{}\t{}\t{}\n", first + int64_t(i), ids[i],
                 mask.empty() ? "-" : (mask[i] ? "1" : "0"),
                 nlohmann::json(*tokenizer->token_content(ids[i])).dump(),
                 nlohmann::json(tokenizer->decode({ids[i]}))
                     .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    }
    return 0;
  }

 private:
  int fail(const std::string& message) {
    fmt::print(stderr, "strata decode: {}\n", message);
    return 2;
  }

  Status read_file_ids(std::vector<uint32_t>& ids, std::vector<uint8_t>& mask, int64_t& first) {
    Result<TokenFile> file = TokenFile::open(input_);
    if (!file) return file.status();
    if (start_ >= file->size() && file->size() > 0)
      return Status::invalid_argument(fmt::format(
          "--start {}: {} holds {} tokens; give a start below that", start_, input_, file->size()));
    first = start_;
    const int64_t end = count_ ? std::min(file->size(), start_ + *count_) : file->size();
    ids.reserve(size_t(std::max<int64_t>(end - start_, 0)));
    for (int64_t i = start_; i < end; ++i) ids.push_back(file->at(i));
    const std::string mask_path = loss_mask_path(input_);
    if (fs::exists(mask_path)) {
      Result<std::vector<uint8_t>> whole = read_loss_mask(mask_path, file->size(), mask_path);
      if (!whole) return whole.status();
      mask.assign(whole->begin() + start_, whole->begin() + end);
    }
    return Status::ok();
  }

  std::string model_dir_;
  std::string input_;
  std::vector<uint32_t> ids_;
  int64_t start_ = 0;
  std::optional<int64_t> count_;
  bool skip_special_ = false;
  bool per_token_ = false;
};

SubcommandRegistration registration([] { return std::make_unique<DecodeCommand>(); });

}  // namespace
}  // namespace strata::tools
