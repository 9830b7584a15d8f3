// Driver for tests/model_ref.py: loads a Hugging Face style model directory
// (config.json + safetensors), runs forward and backward of the CPU backend on
// tokens from a raw uint32 token file, and writes what the reference compares:
//   <out>/outputs.safetensors  logits (B, T, V), loss (1) and aux_loss (1), fp32:
//                              a mixture of experts' load-balancing loss (the
//                              mean over the micro-batches), in the loss
//                              times router_aux_loss_coef when the config's
//                              output_router_logits is set
//   <out>/grads/               every parameter gradient under its Hugging Face
//                              name (sharded, to exercise the index)
// Usage: model_ref MODEL_DIR TOKENS_FILE B T MICRO_BATCHES OUT_DIR
#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/model/model.h"
#include "core/checkpoint/safetensors.h"
#include "core/data/token_data.h"

namespace {

int fail(const strata::Status& status) {
  fmt::print(stderr, "model_ref: {}\n", status.message());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace strata;
  if (argc != 7) {
    fmt::print(stderr, "usage: model_ref MODEL_DIR TOKENS_FILE B T MICRO_BATCHES OUT_DIR\n");
    return 2;
  }
  const std::string model_dir = argv[1], tokens_path = argv[2], out_dir = argv[6];
  const int64_t B = std::atoll(argv[3]), T = std::atoll(argv[4]), micro = std::atoll(argv[5]);
  if (micro < 1 || B % micro != 0) {
    fmt::print(stderr, "model_ref: B must be a multiple of MICRO_BATCHES\n");
    return 2;
  }
  Result<ModelConfig> config = load_model_config(model_dir);
  if (!config.is_ok()) return fail(config.status());
  Result<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::open(model_dir);
  if (!checkpoint.is_ok()) return fail(checkpoint.status());
  HostModel model = make_host_model(*config);
  if (Status s = load_host_model(model, *checkpoint); !s) return fail(s);
  Result<TokenFile> tokens = TokenFile::open(tokens_path, TokenFormat::raw_uint32);
  if (!tokens.is_ok()) return fail(tokens.status());

  const int64_t Bm = B / micro, V = config->vocab_size;
  UnitWorkspace workspace(*config, Bm, T);
  std::vector<int32_t> inputs(Bm * T), targets(Bm * T);
  std::vector<float> logits(B * T * V);
  double loss_sum = 0.0, aux_sum = 0.0;
  const bool with_aux = config->is_moe() && config->output_router_logits;
  for (int64_t m = 0; m < micro; ++m) {
    if (Status s = read_micro_batch(*tokens, 0, m, 0, 1, Bm, T, V, inputs.data(), targets.data());
        !s) {
      return fail(s);
    }
    UnitBatch batch{inputs.data(), targets.data(), Bm, T, 1.0f / static_cast<float>(B * T)};
    RouterStats router;
    batch.router = &router;
    if (with_aux) batch.aux_loss_scale = float(config->router_aux_loss_coef / double(micro));
    Result<double> loss =
        model_forward_backward(model, batch, workspace, logits.data() + m * Bm * T * V);
    if (!loss.is_ok()) return fail(loss.status());
    loss_sum += *loss;
    aux_sum += router.aux_loss();
  }
  const float aux_loss = static_cast<float>(aux_sum / double(micro));
  const float loss = static_cast<float>(
      loss_sum / static_cast<double>(B * T) +
      (with_aux ? config->router_aux_loss_coef * aux_sum / double(micro) : 0.0));

  std::filesystem::create_directories(out_dir);
  Result<SafetensorsWriter> writer = SafetensorsWriter::create(
      out_dir + "/outputs.safetensors", {{"logits", {B, T, V}}, {"loss", {1}}, {"aux_loss", {1}}},
      DType::f32);
  if (!writer.is_ok()) return fail(writer.status());
  if (Status s = writer->write("logits", logits.data()); !s) return fail(s);
  if (Status s = writer->write("loss", &loss); !s) return fail(s);
  if (Status s = writer->write("aux_loss", &aux_loss); !s) return fail(s);
  if (Status s = writer->finish(); !s) return fail(s);
  // Small shards so that the gradients exercise the sharded form and its index.
  if (Status s = save_host_model(model, out_dir + "/grads", DType::f32, 64 << 10, true); !s)
    return fail(s);
  fmt::print("model_ref: loss {:.7f}\n", loss);
  return 0;
}
