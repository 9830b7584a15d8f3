// How `strata` subcommands plug into the command line.
//
// Each subcommand lives in its own tools/<name>_command.cpp and registers itself
// with a static SubcommandRegistration, so adding one touches no other file.
// main() adds every registered subcommand to the CLI11 app, parses, and runs
// the one the user named. run() returns the process exit status; errors are
// printed by the subcommand as one line on stderr, `strata <name>: ...`. A
// command line CLI11 cannot parse never reaches run(): main() reports it the
// same way, with exit status 2, the status of a usage error.
#pragma once

#include <functional>
#include <memory>
#include <vector>

namespace CLI {
class App;
}

namespace strata::tools {

class Subcommand {
 public:
  virtual ~Subcommand() = default;
  // Adds the subcommand and its options to `app`; returns the CLI11 subcommand.
  virtual CLI::App* add_to(CLI::App& app) = 0;
  // Runs after parsing, when this subcommand was named.
  virtual int run() = 0;
};

using SubcommandFactory = std::function<std::unique_ptr<Subcommand>()>;

// The factories registered so far, in registration order.
std::vector<SubcommandFactory>& subcommand_factories();

struct SubcommandRegistration {
  explicit SubcommandRegistration(SubcommandFactory factory) {
    subcommand_factories().push_back(std::move(factory));
  }
};

}  // namespace strata::tools
