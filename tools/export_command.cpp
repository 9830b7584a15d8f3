// `strata export CKPT --out DIR`: a checkpoint written by `strata train --save`
// as a Hugging Face model directory (config.json + safetensors, sharded with
// an index above --max-shard-size), streamed one tensor at a time so that any
// model converts in little memory. `strata train --init DIR` reads it back.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <string>

#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/safetensors.h"
#include "io/base/sizes.h"
#include "tools/subcommand.h"

namespace strata::tools {
namespace {

class ExportCommand : public Subcommand {
 public:
  CLI::App* add_to(CLI::App& app) override {
    CLI::App* cmd = app.add_subcommand(
        "export",
        "Write a checkpoint (from strata train --save) as a Hugging Face model directory");
    cmd->add_option(
           "checkpoint", checkpoint_,
           "A checkpoint directory (step-N), or the --save directory (its newest checkpoint)")
        ->required();
    cmd->add_option("--out", out_, "Directory to write config.json and the safetensors into")
        ->required();
    cmd->add_option("--dtype", dtype_, "fp32 | bf16 | fp16 (default fp32)")
        ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
    cmd->add_option("--max-shard-size", max_shard_,
                    "Largest safetensors file, e.g. 5G (default 5G)");
    return cmd;
  }

  int run() override {
    Result<std::string> found = find_latest_checkpoint(checkpoint_);
    if (!found) return fail(found.status().with_context("checkpoint"), 2);
    if (found->empty())
      return fail(Status::error(fmt::format("{}: no checkpoint in this directory (no step-N with a "
                                            "manifest.json)",
                                            checkpoint_)),
                  2);
    Result<DType> dtype = parse_dtype(dtype_);
    if (!dtype) return fail(dtype.status().with_context("--dtype"), 2);
    Result<uint64_t> shard = parse_size(max_shard_);
    if (!shard) return fail(shard.status().with_context("--max-shard-size"), 2);
    if (Status s = export_checkpoint(*found, out_, *dtype, *shard); !s) return fail(s, 1);
    fmt::print("exported {} ({}) to {}\n", *found, dtype_name(*dtype), out_);
    return 0;
  }

 private:
  static int fail(const Status& status, int code) {
    fmt::print(stderr, "strata export: {}\n", status.message());
    return code;
  }
  std::string checkpoint_;
  std::string out_;
  std::string dtype_ = "fp32";
  std::string max_shard_ = "5G";
};

SubcommandRegistration registration([] { return std::make_unique<ExportCommand>(); });

}  // namespace
}  // namespace strata::tools
