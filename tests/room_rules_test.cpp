// The rules of strata's rooms, read from the sources:
//  - every `#include` follows the arrows between rooms (the table below), and
//    each room's README.md states its row of that table;
//  - tiers' string literals name no command-line flag (tiers know bytes and
//    budgets; the caller that read the flag adds it to the message);
//  - no file names a Markdown document that the repository does not hold.
// Each check is a function of a source tree: it runs on the repository and on
// small trees written to a temporary directory, which show that it can fail.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace strata {
namespace {

namespace fs = std::filesystem;

// Who may include whom. A room is a top-level folder, except io/base (the
// ground vocabulary, its own library) and the rooms of core/ ("core/*":
// core/config, core/model, ...), which may include one another. CLI11,
// protobuf, liburing, NCCL, Gloo, Oniguruma and ICU are libraries that one room
// owns: nothing below tools knows the command line or writes protobuf
// messages (TensorBoard's records, tools/tensorboard_writer.h), io/ is the
// only code that calls liburing, comm/ the only code that calls NCCL and Gloo, prep/
// (data preparation, which only the tools use) the only code that calls
// Oniguruma and ICU, so the engine's library links neither. tests/ and benches/ may include
// anything.
struct RoomRule {
  std::string room;
  std::vector<std::string> may_include;
};

const std::vector<RoomRule>& room_rules() {
  static const std::vector<RoomRule> rules = {
      {"io/base", {"io/base"}},
      {"io", {"io", "io/base", "liburing"}},
      {"tiers", {"tiers", "io", "io/base"}},
      {"kernels", {"kernels", "io/base"}},
      {"comm", {"comm", "io/base", "NCCL", "Gloo"}},
      {"core/*", {"core/*", "tiers", "io", "io/base", "kernels", "comm"}},
      {"prep", {"prep", "core/*", "io", "io/base", "Oniguruma", "ICU"}},
      {"tools",
       {"tools", "prep", "core/*", "tiers", "io", "io/base", "kernels", "comm", "CLI11",
        "protobuf"}},
  };
  return rules;
}

// The folders whose sources the include rules cover.
const std::vector<std::string>& ruled_folders() {
  static const std::vector<std::string> folders = {"io",   "tiers", "kernels", "comm",
                                                   "core", "prep",  "tools"};
  return folders;
}

bool is_source(const fs::path& path) {
  const std::string extension = path.extension().string();
  return extension == ".h" || extension == ".cpp" || extension == ".cu" || extension == ".cuh";
}

std::string relative_name(const fs::path& file, const fs::path& root) {
  return file.lexically_relative(root).generic_string();
}

// Regular files under root/folder, sorted so that reports come in a fixed order.
std::vector<fs::path> files_under(const fs::path& root, const std::string& folder) {
  std::vector<fs::path> files;
  std::error_code error;
  if (!fs::is_directory(root / folder, error)) return files;
  for (auto it = fs::recursive_directory_iterator(root / folder, error);
       it != fs::recursive_directory_iterator(); it.increment(error)) {
    if (error) break;
    if (it->is_directory() && it->path().filename() == "__pycache__") {
      it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file()) files.push_back(it->path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<std::string> read_lines(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The room a repository path belongs to: "io/base", "io", "core/model", ...,
// or "" outside the ruled folders.
std::string room_of(const std::string& path) {
  if (path.rfind("io/base/", 0) == 0) return "io/base";
  const size_t slash = path.find('/');
  if (slash == std::string::npos) return "";
  const std::string top = path.substr(0, slash);
  if (top == "core") {
    const size_t second = path.find('/', slash + 1);
    return second == std::string::npos ? "core" : path.substr(0, second);
  }
  for (const std::string& folder : ruled_folders())
    if (top == folder) return top;
  return "";
}

// "core/*" stands for core and every room inside it.
bool room_matches(const std::string& pattern, const std::string& room) {
  if (pattern == "core/*") return room == "core" || room.rfind("core/", 0) == 0;
  return pattern == room;
}

const RoomRule* rule_for(const std::string& room) {
  for (const RoomRule& rule : room_rules())
    if (room_matches(rule.room, room)) return &rule;
  return nullptr;
}

// What an include names: a room, an owned library, or "" (the standard
// library and every other outside header, which the rules leave alone).
std::string included_room(const std::string& header, bool quoted, const fs::path& root,
                          const std::string& including_file) {
  if (header.rfind("CLI/", 0) == 0) return "CLI11";
  if (header.rfind("google/protobuf/", 0) == 0) return "protobuf";
  if (header == "liburing.h" || header.rfind("liburing/", 0) == 0) return "liburing";
  if (header == "nccl.h" || header == "nccl_net.h") return "NCCL";
  if (header.rfind("gloo/", 0) == 0) return "Gloo";
  if (header == "oniguruma.h") return "Oniguruma";
  if (header.rfind("unicode/", 0) == 0) return "ICU";
  if (std::string room = room_of(header); !room.empty()) return room;
  if (!quoted) return "";
  // A quoted name that is not a path from the repository root is looked up
  // next to the including file first, as the compiler does.
  const fs::path beside = (fs::path(including_file).parent_path() / header).lexically_normal();
  std::error_code error;
  if (fs::exists(root / beside, error)) return room_of(beside.generic_string());
  return "";
}

struct IncludeReport {
  std::vector<std::string> offences;         // one line each
  std::map<std::string, int> includes_read;  // strata includes read, by including room
};

// Checks every #include of every source file under the ruled folders of `root`.
IncludeReport check_includes(const fs::path& root) {
  static const std::regex include_line(R"(^\s*#\s*include\s*([<"])([^>"]+)[>"])");
  IncludeReport report;
  for (const std::string& folder : ruled_folders()) {
    for (const fs::path& file : files_under(root, folder)) {
      if (!is_source(file)) continue;
      const std::string name = relative_name(file, root);
      const std::string room = room_of(name);
      const RoomRule* rule = rule_for(room);
      if (rule == nullptr) continue;
      const std::vector<std::string> lines = read_lines(file);
      for (size_t i = 0; i < lines.size(); ++i) {
        std::smatch match;
        if (!std::regex_search(lines[i], match, include_line)) continue;
        const bool quoted = match[1] == "\"";
        const std::string header = match[2];
        const std::string target = included_room(header, quoted, root, name);
        if (target.empty()) continue;
        ++report.includes_read[rule->room];
        const bool allowed =
            std::any_of(rule->may_include.begin(), rule->may_include.end(),
                        [&](const std::string& pattern) { return room_matches(pattern, target); });
        if (allowed) continue;
        std::string rooms;
        for (const std::string& pattern : rule->may_include)
          rooms += (rooms.empty() ? "" : ", ") + pattern;
        const std::string written = quoted ? "\"" + header + "\"" : "<" + header + ">";
        report.offences.push_back(name + ":" + std::to_string(i + 1) + ": " + room +
                                  " may not include " + written + " (" + room +
                                  " may include: " + rooms + ")");
      }
    }
  }
  return report;
}

// The README.md that states a room's row: "| `room` | `room`, `io/base`, ... |".
std::string readme_of(const std::string& room) {
  if (room == "io/base") return "io/README.md";
  if (room == "core/*") return "core/README.md";
  return room + "/README.md";
}

std::string joined(const std::set<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

// Every room whose README.md row does not name, in backticks, exactly the
// rooms the table lets it include (and, in plain words, the libraries).
std::vector<std::string> readme_rows_that_disagree(const fs::path& root) {
  static const std::regex backticked("`([^`]+)`");
  std::vector<std::string> offences;
  for (const RoomRule& rule : room_rules()) {
    const std::string readme = readme_of(rule.room);
    const std::string row_start = "| `" + rule.room + "` |";
    std::optional<std::string> row;
    for (const std::string& line : read_lines(root / readme))
      if (line.rfind(row_start, 0) == 0) row = line.substr(row_start.size());
    if (!row) {
      offences.push_back(readme + ": no row \"" + row_start + " ... |\" stating what " + rule.room +
                         " may include");
      continue;
    }
    std::set<std::string> stated;
    for (auto it = std::sregex_iterator(row->begin(), row->end(), backticked);
         it != std::sregex_iterator(); ++it)
      stated.insert((*it)[1]);
    for (const char* library :
         {"CLI11", "protobuf", "liburing", "NCCL", "Gloo", "Oniguruma", "ICU"})
      if (row->find(library) != std::string::npos) stated.insert(library);
    const std::set<std::string> allowed(rule.may_include.begin(), rule.may_include.end());
    if (stated != allowed)
      offences.push_back(readme + ": the row of " + rule.room + " names " + joined(stated) +
                         "; the rules let it include " + joined(allowed));
  }
  return offences;
}

struct StringLiteral {
  int line = 0;
  std::string text;  // as written between the quotes, escapes untouched
};

// The string literals of C++ source text, outside comments and character
// literals. Raw strings (R"(...)") are returned whole; a digit separator
// (1'000) is not taken for a character literal.
std::vector<StringLiteral> string_literals(const std::string& source) {
  std::vector<StringLiteral> literals;
  int line = 1;
  size_t i = 0;
  auto advance = [&](size_t count) {
    for (size_t k = 0; k < count && i < source.size(); ++k, ++i)
      if (source[i] == '\n') ++line;
  };
  auto identifier_char = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
  };
  while (i < source.size()) {
    const char c = source[i];
    const char next = i + 1 < source.size() ? source[i + 1] : '\0';
    if (c == '/' && next == '/') {
      while (i < source.size() && source[i] != '\n') advance(1);
    } else if (c == '/' && next == '*') {
      advance(2);
      while (i < source.size() &&
             !(source[i] == '*' && i + 1 < source.size() && source[i + 1] == '/'))
        advance(1);
      advance(2);
    } else if (c == 'R' && next == '"' &&
               (i == 0 || !identifier_char(source[i - 1]) || source[i - 1] == '8' ||
                source[i - 1] == 'u' || source[i - 1] == 'U' || source[i - 1] == 'L')) {
      const size_t open = source.find('(', i + 2);
      if (open == std::string::npos) break;
      const std::string close = ")" + source.substr(i + 2, open - i - 2) + "\"";
      const size_t end = source.find(close, open + 1);
      if (end == std::string::npos) break;
      literals.push_back({line, source.substr(open + 1, end - open - 1)});
      advance(end + close.size() - i);
    } else if (c == '"') {
      StringLiteral literal{line, ""};
      advance(1);
      while (i < source.size() && source[i] != '"' && source[i] != '\n') {
        if (source[i] == '\\' && i + 1 < source.size()) {
          literal.text += source.substr(i, 2);
          advance(2);
        } else {
          literal.text += source[i];
          advance(1);
        }
      }
      advance(1);
      literals.push_back(literal);
    } else if (c == '\'' && !(i > 0 && identifier_char(source[i - 1]) &&
                              std::isxdigit(static_cast<unsigned char>(next)))) {
      advance(1);
      while (i < source.size() && source[i] != '\'' && source[i] != '\n')
        advance(source[i] == '\\' ? 2 : 1);
      advance(1);
    } else {
      advance(1);
    }
  }
  return literals;
}

// Every string literal in tiers/ that names a command-line flag ("--name").
std::vector<std::string> flags_in_tier_messages(const fs::path& root) {
  static const std::regex flag(R"(--[a-z][a-z0-9-]*)");
  std::vector<std::string> offences;
  for (const fs::path& file : files_under(root, "tiers")) {
    if (!is_source(file)) continue;
    std::ifstream in(file, std::ios::binary);
    std::stringstream source;
    source << in.rdbuf();
    for (const StringLiteral& literal : string_literals(source.str())) {
      std::smatch match;
      if (!std::regex_search(literal.text, match, flag)) continue;
      offences.push_back(relative_name(file, root) + ":" + std::to_string(literal.line) +
                         ": tiers name the command-line flag " + match.str() +
                         " (name the tier or its budget; the caller adds the flag)");
    }
  }
  return offences;
}

// Every name of a Markdown file (a README, a design note) that the repository
// does not hold, in any text file of the rooms, tests, benches, CI and the
// root. A name is looked up from the repository root and next to the file
// that holds it; names inside URLs are left alone.
std::vector<std::string> missing_markdown_references(const fs::path& root) {
  static const std::regex markdown_name(R"((?:\.\.?/)*[A-Za-z0-9_][A-Za-z0-9_./-]*\.md\b)");
  std::vector<fs::path> files;
  for (const char* folder :
       {"io", "tiers", "kernels", "comm", "core", "tools", "tests", "benches", ".ci"}) {
    std::vector<fs::path> found = files_under(root, folder);
    files.insert(files.end(), found.begin(), found.end());
  }
  std::vector<fs::path> at_root;
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, error))
    if (entry.is_regular_file() && entry.path().filename() != ".git")
      at_root.push_back(entry.path());
  std::sort(at_root.begin(), at_root.end());
  files.insert(files.end(), at_root.begin(), at_root.end());

  std::vector<std::string> offences;
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::stringstream contents;
    contents << in.rdbuf();
    if (contents.str().find('\0') != std::string::npos) continue;  // not text
    const std::string name = relative_name(file, root);
    const std::vector<std::string> lines = read_lines(file);
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string& line = lines[i];
      for (auto it = std::sregex_iterator(line.begin(), line.end(), markdown_name);
           it != std::sregex_iterator(); ++it) {
        const size_t word_start = line.find_last_of(" \t", size_t(it->position())) + 1;
        const size_t word_end = line.find_first_of(" \t", size_t(it->position()));
        if (line.substr(word_start, word_end - word_start).find("://") != std::string::npos)
          continue;
        const std::string reference = it->str();
        const fs::path from_root = fs::path(reference).lexically_normal();
        const fs::path beside = (fs::path(name).parent_path() / reference).lexically_normal();
        auto held = [&](const fs::path& candidate) {
          return candidate.begin() != candidate.end() && *candidate.begin() != ".." &&
                 fs::exists(root / candidate, error);
        };
        if (held(from_root) || held(beside)) continue;
        offences.push_back(name + ":" + std::to_string(i + 1) + ": names " + reference +
                           ", which the repository does not hold (point to the README.md or "
                           "header that states it)");
      }
    }
  }
  return offences;
}

std::string one_per_line(const std::vector<std::string>& lines) {
  std::string text;
  for (const std::string& line : lines) text += line + "\n";
  return text;
}

// The real tree.

const fs::path kRepository = STRATA_SOURCE_DIR;

TEST(RoomRules, EveryIncludeFollowsTheArrowsBetweenRooms) {
  const IncludeReport report = check_includes(kRepository);
  EXPECT_TRUE(report.offences.empty()) << one_per_line(report.offences);
  // Every room was read: a scan that found nothing would pass for the wrong reason.
  for (const RoomRule& rule : room_rules())
    EXPECT_GT(report.includes_read.count(rule.room) ? report.includes_read.at(rule.room) : 0, 0)
        << "no strata include read in " << rule.room;
}

TEST(RoomRules, EveryRoomsReadmeStatesItsRowOfTheTable) {
  const std::vector<std::string> offences = readme_rows_that_disagree(kRepository);
  EXPECT_TRUE(offences.empty()) << one_per_line(offences);
}

TEST(RoomRules, TiersMessagesNameNoCommandLineFlag) {
  const std::vector<std::string> offences = flags_in_tier_messages(kRepository);
  EXPECT_TRUE(offences.empty()) << one_per_line(offences);
}

TEST(RoomRules, EveryMarkdownFileNamedIsInTheRepository) {
  const std::vector<std::string> offences = missing_markdown_references(kRepository);
  EXPECT_TRUE(offences.empty()) << one_per_line(offences);
}

// Small trees that show each check fails when it should.

class SyntheticTree : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "strata-room-rules-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    if (!root_.empty()) fs::remove_all(root_, ignored);
  }
  void write(const std::string& name, const std::string& contents) {
    fs::create_directories((root_ / name).parent_path());
    std::ofstream(root_ / name, std::ios::binary) << contents;
  }
  fs::path root_;
};

TEST_F(SyntheticTree, AForbiddenIncludeIsReportedAndAnAllowedOneIsNot) {
  write("io/base/status.h", "#pragma once\n#include <string>\n");
  write("io/ring.h", "#pragma once\n#include \"io/base/status.h\"\n");
  write("tiers/tier.h", "#pragma once\n#include \"io/ring.h\"\n#include <hwloc.h>\n");
  write("kernels/cpu/matmul.h",
        "// A kernel that reaches into the tiers.\n#pragma once\n"
        "#include \"io/base/status.h\"\n#include \"tiers/tier.h\"\n");
  write("kernels/cpu/matmul.cpp", "#include \"matmul.h\"\n#include \"../../io/ring.h\"\n");
  write("comm/comm.h", "#pragma once\n  #  include <CLI/CLI.hpp>\n#include <nccl.h>\n");
  write("core/model/model.h",
        "#include \"core/config/config.h\"\n#include \"tiers/tier.h\"\n#include \"comm/comm.h\"\n");
  write("core/config/config.h", "#include \"tools/config_flags.h\"\n#include <liburing.h>\n");
  write("tools/config_flags.h", "#include <CLI/CLI.hpp>\n#include \"core/model/model.h\"\n");
  write("tests/any_test.cpp", "#include \"tools/config_flags.h\"\n#include <CLI/CLI.hpp>\n");

  const IncludeReport report = check_includes(root_);
  const std::vector<std::string> expected = {
      "kernels/cpu/matmul.cpp:2: kernels may not include \"../../io/ring.h\" (kernels may "
      "include: kernels, io/base)",
      "kernels/cpu/matmul.h:4: kernels may not include \"tiers/tier.h\" (kernels may include: "
      "kernels, io/base)",
      "comm/comm.h:2: comm may not include <CLI/CLI.hpp> (comm may include: comm, io/base, NCCL, "
      "Gloo)",
      "core/config/config.h:1: core/config may not include \"tools/config_flags.h\" (core/config "
      "may include: core/*, tiers, io, io/base, kernels, comm)",
      "core/config/config.h:2: core/config may not include <liburing.h> (core/config may "
      "include: core/*, tiers, io, io/base, kernels, comm)",
  };
  EXPECT_EQ(report.offences, expected) << one_per_line(report.offences);
  EXPECT_EQ(report.includes_read.at("tools"), 2);
  EXPECT_EQ(report.includes_read.at("core/*"), 5);
}

TEST_F(SyntheticTree, OnlyDataPreparationCallsOnigurumaAndIcuAndTheEngineNeverIncludesIt) {
  write("prep/tokenizer.cpp",
        "#include \"prep/tokenizer.h\"\n#include <oniguruma.h>\n#include <unicode/normalizer2.h>\n"
        "#include \"core/data/token_data.h\"\n#include \"tools/config_flags.h\"\n");
  write("core/data/token_data.h", "#include <oniguruma.h>\n#include \"prep/tokenizer.h\"\n");
  write("tools/prepare_data_command.cpp", "#include \"prep/tokenizer.h\"\n");
  const IncludeReport report = check_includes(root_);
  const std::vector<std::string> expected = {
      "core/data/token_data.h:1: core/data may not include <oniguruma.h> (core/data may include: "
      "core/*, tiers, io, io/base, kernels, comm)",
      "core/data/token_data.h:2: core/data may not include \"prep/tokenizer.h\" (core/data may "
      "include: core/*, tiers, io, io/base, kernels, comm)",
      "prep/tokenizer.cpp:5: prep may not include \"tools/config_flags.h\" (prep may include: "
      "prep, core/*, io, io/base, Oniguruma, ICU)",
  };
  EXPECT_EQ(report.offences, expected) << one_per_line(report.offences);
}

TEST_F(SyntheticTree, OnlyTheToolsWriteProtobufMessages) {
  write("tools/tensorboard_writer.cpp",
        "#include <google/protobuf/message.h>\n#include \"tools/tensorboard_event.pb.h\"\n");
  write("core/engine/engine.cpp", "#include <google/protobuf/message.h>\n");
  const IncludeReport report = check_includes(root_);
  const std::vector<std::string> expected = {
      "core/engine/engine.cpp:1: core/engine may not include <google/protobuf/message.h> "
      "(core/engine may include: core/*, tiers, io, io/base, kernels, comm)",
  };
  EXPECT_EQ(report.offences, expected) << one_per_line(report.offences);
  EXPECT_EQ(report.includes_read.at("tools"), 2);
}

TEST_F(SyntheticTree, IoBaseMayNotIncludeTheRestOfIo) {
  write("io/base/sizes.h", "#include \"io/base/status.h\"\n#include \"io/io_engine.h\"\n");
  const IncludeReport report = check_includes(root_);
  ASSERT_EQ(report.offences.size(), 1u) << one_per_line(report.offences);
  EXPECT_EQ(report.offences[0],
            "io/base/sizes.h:2: io/base may not include \"io/io_engine.h\" (io/base may "
            "include: io/base)");
}

TEST_F(SyntheticTree, AReadmeRowThatDisagreesWithTheRulesIsReported) {
  std::map<std::string, std::string> readmes;
  for (const RoomRule& rule : room_rules()) {
    std::string names;
    for (const std::string& name : rule.may_include)
      names += (names.empty() ? "" : ", ") +
               (name == "CLI11" || name == "protobuf" || name == "liburing" || name == "NCCL" ||
                        name == "Gloo" || name == "Oniguruma" || name == "ICU"
                    ? name
                    : "`" + name + "`");
    readmes[readme_of(rule.room)] += "| `" + rule.room + "` | " + names + " |\n";
  }
  for (const auto& [name, contents] : readmes) write(name, contents);
  EXPECT_TRUE(readme_rows_that_disagree(root_).empty())
      << one_per_line(readme_rows_that_disagree(root_));

  write("kernels/README.md", "| `kernels` | `kernels`, `io/base`, `tiers` |\n");
  write("comm/README.md", "| room | may include |\n");
  const std::vector<std::string> expected = {
      "kernels/README.md: the row of kernels names io/base, kernels, tiers; the rules let "
      "it include io/base, kernels",
      "comm/README.md: no row \"| `comm` | ... |\" stating what comm may include",
  };
  EXPECT_EQ(readme_rows_that_disagree(root_), expected);
}

TEST_F(SyntheticTree, AFlagInATierMessageIsReportedAndOneInACommentIsNot) {
  write("tiers/host_tier.cpp",
        "// Callers add --host-mem-limit to these messages.\n"
        "/* and \"--not-a-message\" here */\n"
        "Status full() {\n"
        "  const char quote = '\"';\n"
        "  const long big = 1'000'000;\n"
        "  return Status::error(fmt::format(\"host tier: {} more; raise the host budget\", big));\n"
        "}\n"
        "Status mapped() { return Status::error(\"host tier: mmap failed; lower "
        "--host-mem-limit\"); }\n"
        "const char* hint = R\"(raise --device-mem-limit)\";\n");
  const std::vector<std::string> expected = {
      "tiers/host_tier.cpp:8: tiers name the command-line flag --host-mem-limit (name the tier "
      "or its budget; the caller adds the flag)",
      "tiers/host_tier.cpp:9: tiers name the command-line flag --device-mem-limit (name the "
      "tier or its budget; the caller adds the flag)",
  };
  EXPECT_EQ(flags_in_tier_messages(root_), expected);
}

// Markdown names are built here, so that this file names none that is missing.
std::string markdown(const std::string& stem) {
  return stem + ".md";
}

TEST_F(SyntheticTree, AMarkdownFileTheTreeDoesNotHoldIsReported) {
  write(markdown("README"), "The rooms: see " + markdown("io/README") + ".\n");
  write(markdown("io/README"),
        "Up: " + markdown("../README") + ", beside: " + markdown("NOTES") + "\n");
  write(markdown("io/NOTES"), "\n");
  write("io/ring.h", "// As in " + markdown("DESIGN") + " section 4 and " +
                         markdown("https://example.org/DESIGN") + "\n");
  write("tools/setup", "#!/bin/sh\n# packages: " + markdown("docs/DEPENDENCIES") + "\n");
  write("CMakeLists.txt", "# arrows (" + markdown("io/README") + ")\n");

  const std::vector<std::string> expected = {
      "io/ring.h:1: names " + markdown("DESIGN") +
          ", which the repository does not hold (point to the README.md or header that "
          "states it)",
      "tools/setup:2: names " + markdown("docs/DEPENDENCIES") +
          ", which the repository does not hold (point to the README.md or header that "
          "states it)",
  };
  EXPECT_EQ(missing_markdown_references(root_), expected);
}

}  // namespace
}  // namespace strata
