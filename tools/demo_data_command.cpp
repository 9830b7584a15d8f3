// `strata demo-data`: writes a small English-like text, generated from a
// fixed grammar and a seed, as byte tokens (the byte vocabulary of the
// `tiny` and `small` presets) in nanoGPT's uint16 format, so the README's
// first command can train on something without downloading anything.
//
// The text is simple enough that a small model learns it in minutes (words,
// then which word follows which) and regular enough that the loss falls far
// below the 5.55 nats of a uniform byte: a clear curve for a demo.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "io/safe_write.h"
#include "tools/subcommand.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;

const std::vector<std::string> kSubjects = {
    "the old farmer",  "a young girl",   "the small dog",    "my brother",
    "the tired king",  "a grey cat",     "the baker",        "our teacher",
    "the children",    "a quiet sailor", "the red fox",      "her mother",
    "the little bird", "a tall soldier", "the miller's son", "the captain"};
const std::vector<std::string> kVerbs = {
    "found",  "carried", "painted", "followed", "watched", "lost",    "mended", "wanted",
    "opened", "hid",     "sold",    "counted",  "buried",  "cleaned", "drew",   "remembered"};
const std::vector<std::string> kObjects = {
    "a wooden box",       "the silver key",  "an old map",     "the broken cart",
    "a basket of apples", "the blue door",   "a long letter",  "the garden gate",
    "a warm loaf",        "the heavy stone", "a bright lamp",  "the last candle",
    "a pair of boots",    "the green flag",  "a jar of honey", "the little boat"};
const std::vector<std::string> kPlaces = {
    "in the morning",  "near the river",   "by the mill",    "after the storm",
    "at the market",   "under the bridge", "before dinner",  "on the hill",
    "in the dark",     "behind the barn",  "at the harbour", "during the winter",
    "beside the well", "in the forest",    "at noon",        "on the road home"};
const std::vector<std::string> kEndings = {"and smiled.",
                                           "and went home.",
                                           "and said nothing.",
                                           "and sang a song.",
                                           "and began to laugh.",
                                           "and sat down to rest.",
                                           "and told the whole village.",
                                           "and thought about it for a long time."};

std::string capitalised(std::string text) {
  if (!text.empty() && text[0] >= 'a' && text[0] <= 'z') text[0] = char(text[0] - 'a' + 'A');
  return text;
}

// Paragraphs of three to six sentences: "<Subject> <verb> <object> <place> <ending>"
// or "<Subject> <verb> <object> <place>." with a paragraph break after each.
std::string generate_text(uint64_t seed, size_t bytes) {
  std::mt19937_64 random(seed);
  auto pick = [&](const std::vector<std::string>& words) -> const std::string& {
    return words[size_t(random() % words.size())];
  };
  std::string text;
  text.reserve(bytes + 256);
  while (text.size() < bytes) {
    const int sentences = 3 + int(random() % 4);
    for (int s = 0; s < sentences; ++s) {
      std::string sentence = capitalised(pick(kSubjects)) + " " + pick(kVerbs) + " " +
                             pick(kObjects) + " " + pick(kPlaces);
      sentence += random() % 2 == 0 ? " " + pick(kEndings) : ".";
      text += sentence;
      text += s + 1 < sentences ? " " : "\n\n";
    }
  }
  text.resize(bytes);
  return text;
}

// nanoGPT's format: headerless little-endian uint16 tokens; here each token is one byte of text.
Status write_tokens(const std::string& path, const std::string& text) {
  std::string tokens(2 * text.size(), '\0');
  for (size_t i = 0; i < text.size(); ++i) tokens[2 * i] = text[i];
  return io::write_file_atomically(path, tokens);
}

class DemoDataCommand : public Subcommand {
 public:
  CLI::App* add_to(CLI::App& app) override {
    CLI::App* cmd = app.add_subcommand("demo-data",
                                       "Write a generated English-like text as byte tokens "
                                       "(train.bin, val.bin) for demos and tests");
    cmd->add_option("--out", out_,
                    "Directory to write train.bin, val.bin and train.txt into (created if missing)")
        ->required();
    cmd->add_option("--tokens", tokens_, "Tokens (bytes of text) in train.bin (default 2M)");
    cmd->add_option("--val-tokens", val_tokens_, "Tokens in val.bin (default 64K)");
    cmd->add_option("--seed", seed_, "Seed of the generator; val.bin uses seed + 1 (default 1)");
    return cmd;
  }

  int run() override {
    if (tokens_ < 2 || val_tokens_ < 2) {
      fmt::print(stderr, "strata demo-data: --tokens and --val-tokens must be at least 2\n");
      return 2;
    }
    std::error_code ec;
    fs::create_directories(out_, ec);
    if (ec) {
      fmt::print(stderr, "strata demo-data: --out {}: cannot create the directory: {}\n", out_,
                 ec.message());
      return 2;
    }
    const std::string train = generate_text(seed_, size_t(tokens_));
    const std::string val = generate_text(seed_ + 1, size_t(val_tokens_));
    const fs::path dir(out_);
    Status written = write_tokens((dir / "train.bin").string(), train);
    if (written) written = write_tokens((dir / "val.bin").string(), val);
    if (written) written = io::write_file_atomically((dir / "train.txt").string(), train);
    if (!written) {
      fmt::print(stderr, "strata demo-data: {}\n", written.message());
      return 1;
    }
    fmt::print("wrote {} tokens to {}, {} to {} (byte tokens, nanoGPT uint16; text in {})\n",
               tokens_, (dir / "train.bin").string(), val_tokens_, (dir / "val.bin").string(),
               (dir / "train.txt").string());
    return 0;
  }

 private:
  std::string out_;
  int64_t tokens_ = 2 << 20;
  int64_t val_tokens_ = 64 << 10;
  uint64_t seed_ = 1;
};

SubcommandRegistration registration([] { return std::make_unique<DemoDataCommand>(); });

}  // namespace
}  // namespace strata::tools
