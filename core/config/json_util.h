// Reading JSON files with errors that name the file, the key path and what was
// expected, and with every key that nothing read reported back (never silently
// dropped).
//
// A JsonReader reads one object. Readers made with object() share their
// parent's state, so the first error and the set of consumed keys cover the
// whole document. Not thread-safe; one reader per parse.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "io/base/status.h"
#include "io/file_system.h"

namespace strata {

// Reads (through `file_system`) and parses a JSON file. A file that cannot be
// read gives io::file_error's line and code (not_found for a missing one);
// malformed JSON gives "file:line:column: ..." (invalid_argument).
Result<nlohmann::json> read_json_file(const std::string& path,
                                      io::FileSystem& file_system = io::FileSystem::real());

// Parses JSON text; `origin` names it in errors (malformed: invalid_argument).
Result<nlohmann::json> parse_json_text(const std::string& text, const std::string& origin);

class JsonReader {
 public:
  // `origin` is the file (or "--flag") the object came from; `path` its key path
  // ("" for the root, "zero_optimization.offload_param" below it).
  JsonReader(const nlohmann::json& object, std::string origin, std::string path);

  bool has(const std::string& key) const;
  // Each optional_* returns true when the key was present with a usable value
  // and stores it in `out`; a present value of the wrong type or out of range
  // records an error. Numeric keys given as "auto" (Hugging Face Trainer
  // configs) count as absent, so strata decides them.
  bool optional_int(const std::string& key, int64_t& out,
                    int64_t min = std::numeric_limits<int64_t>::min(),
                    int64_t max = std::numeric_limits<int64_t>::max());
  bool optional_int(const std::string& key, int& out, int min = std::numeric_limits<int>::min(),
                    int max = std::numeric_limits<int>::max());
  bool optional_double(const std::string& key, double& out,
                       double min = -std::numeric_limits<double>::infinity(),
                       double max = std::numeric_limits<double>::infinity());
  bool optional_bool(const std::string& key, bool& out);
  bool optional_string(const std::string& key, std::string& out);
  // A string that must be one of `choices` (compared case-sensitively).
  bool optional_choice(const std::string& key, std::string& out,
                       const std::vector<std::string>& choices);
  bool optional_double_pair(const std::string& key, double& first, double& second);
  // A non-empty list of numbers, each within [min, max].
  bool optional_double_array(const std::string& key, std::vector<double>& out, double min,
                             double max);
  void required_int(const std::string& key, int64_t& out,
                    int64_t min = std::numeric_limits<int64_t>::min());

  // A reader for the object under `key`; an empty object when the key is absent
  // or null. A present non-object value records an error.
  JsonReader object(const std::string& key);

  // Marks `key` as read without reading it (keys accepted with no effect).
  void accept(const std::string& key);
  // Records an error about `key` (the first error is the one reported; its
  // code is invalid_argument).
  void fail(const std::string& key, const std::string& message);

  // The first error, or ok.
  Status status() const;
  // Full key paths present in every object read so far that nothing read.
  std::vector<std::string> unread_keys() const;

  const std::string& path() const { return path_; }
  const std::string& origin() const { return origin_; }

 private:
  struct Shared {
    Status first_error;
    std::set<std::string> read_keys;                  // full key paths
    std::vector<std::pair<std::string, const nlohmann::json*>> objects;  // path -> object read
  };
  JsonReader(const nlohmann::json& object, std::string origin, std::string path,
             std::shared_ptr<Shared> shared);
  std::string key_path(const std::string& key) const;
  const nlohmann::json* find(const std::string& key);  // marks the key read
  void type_error(const std::string& key, const std::string& expected, const nlohmann::json& got);

  const nlohmann::json* object_;
  std::string origin_;
  std::string path_;
  std::shared_ptr<Shared> shared_;
};

// A short rendering of a JSON value for error messages.
std::string json_excerpt(const nlohmann::json& value);

}  // namespace strata
