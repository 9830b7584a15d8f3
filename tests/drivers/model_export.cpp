// Driver: initialises a model from a preset or config.json with a seed and
// writes it as a Hugging Face checkpoint directory, plus the logits it computes
// on a raw uint32 token file, so other programs (transformers) can check both.
// Usage: model_export MODEL SEED DTYPE MAX_SHARD_BYTES TOKENS_FILE T OUT_DIR
#include <fmt/format.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/model/model.h"
#include "core/checkpoint/safetensors.h"
#include "core/data/token_data.h"

int main(int argc, char** argv) {
  using namespace strata;
  if (argc != 8) {
    fmt::print(stderr,
               "usage: model_export MODEL SEED DTYPE MAX_SHARD_BYTES TOKENS_FILE T OUT_DIR\n");
    return 2;
  }
  auto fail = [](const Status& s) {
    fmt::print(stderr, "model_export: {}\n", s.message());
    return 1;
  };
  Result<ModelConfig> config = load_model_config(argv[1]);
  if (!config.is_ok()) return fail(config.status());
  Result<DType> dtype = parse_dtype(argv[3]);
  if (!dtype.is_ok()) return fail(dtype.status());
  const int64_t T = std::atoll(argv[6]);
  const std::string out_dir = argv[7];
  HostModel model = make_host_model(*config);
  init_host_model(model, std::strtoull(argv[2], nullptr, 10));
  if (Status s = save_host_model(model, out_dir, *dtype, std::strtoull(argv[4], nullptr, 10)); !s) {
    return fail(s);
  }
  // Compute with the weights as saved (rounded to the checkpoint's dtype).
  Result<SafetensorsCheckpoint> ckpt = SafetensorsCheckpoint::open(out_dir);
  if (!ckpt.is_ok()) return fail(ckpt.status());
  if (Status s = load_host_model(model, *ckpt); !s) return fail(s);
  Result<TokenFile> tokens = TokenFile::open(argv[5], TokenFormat::raw_uint32);
  if (!tokens.is_ok()) return fail(tokens.status());
  std::vector<int32_t> inputs(T), targets(T);
  if (Status s = read_micro_batch(*tokens, 0, 0, 0, 1, 1, T, config->vocab_size, inputs.data(),
                                  targets.data());
      !s) {
    return fail(s);
  }
  UnitWorkspace ws(*config, 1, T);
  std::vector<float> logits(T * config->vocab_size);
  Result<double> loss =
      model_forward(model, {inputs.data(), targets.data(), 1, T, 1.0f}, ws, logits.data());
  if (!loss.is_ok()) return fail(loss.status());
  const float mean_loss = static_cast<float>(*loss / static_cast<double>(T));
  Result<SafetensorsWriter> writer = SafetensorsWriter::create(
      out_dir + "/../strata_logits.safetensors",
      {{"logits", {1, T, config->vocab_size}}, {"loss", {1}}}, DType::f32);
  if (!writer.is_ok()) return fail(writer.status());
  if (Status s = writer->write("logits", logits.data()); !s) return fail(s);
  if (Status s = writer->write("loss", &mean_loss); !s) return fail(s);
  if (Status s = writer->finish(); !s) return fail(s);
  fmt::print("model_export: {} parameters, loss {:.6f}\n", config->parameter_count(), mean_loss);
  return 0;
}
