// `strata plan`: how many bytes each tier needs per rank, whether that fits,
// the smallest change that makes it fit, which link bounds the step, and,
// with a hardware profile (--hardware, --probe, or this machine's cached
// probe), the step time the step-time model predicts (core/plan/step_model.h).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/config/config.h"
#include "core/engine/engine.h"
#include "core/model/model_config.h"
#include "core/plan/expert_update.h"
#include "core/plan/planner.h"
#include "core/plan/step_model.h"
#include "core/plan/training_plan.h"
#include "io/base/sizes.h"
#include "kernels/backend.h"
#include "tools/config_flags.h"
#include "tools/hardware_probe.h"
#include "tools/plan_tune.h"
#include "tools/subcommand.h"
#include "tools/train_report.h"

namespace strata::tools {
namespace {

class PlanCommand : public Subcommand {
 public:
  CLI::App* add_to(CLI::App& app) override {
    CLI::App* cmd =
        app.add_subcommand("plan", "Memory and traffic plan for a model, stage and offload");
    cmd->add_option("--model", model_, "Preset, config.json or Hugging Face model directory");
    cmd->add_option("--params", params_,
                    "A parameter count instead of a model (30e9, 7B): plans a Llama-shaped model "
                    "of about that size, named on the first line");
    flags_.add_to(*cmd, /*with_plan_names=*/true);
    cmd->add_option("--accounting", accounting_,
                    "strata (bytes the engine allocates) or zero (2+2+12 bytes)")
        ->check(CLI::IsMember({"strata", "zero"}));
    cmd->add_flag("--json", json_, "Print a JSON object instead of the table");
    cmd->add_flag("--ops", ops_,
                  "Print the engine's plan of one step (every operation, its lane, bytes and "
                  "dependencies) and its buffers per tier; needs --model");
    cmd->add_option("--backend", backend_,
                    "cpu or cuda, the backend whose buffers the plan lists (default cuda on a CUDA "
                    "build, where a machine without a GPU can plan for one; cpu otherwise)")
        ->check(CLI::IsMember({"cpu", "cuda"}));
    cmd->add_option("--nodes", nodes_,
                    "Nodes the ranks are spread over, each with --host-mem-limit, --nvme-limit "
                    "and its NVMe of its own (default 1; world size = nodes x --gpus-per-node)");
    cmd->add_option("--gpus-per-node,--ranks-per-node", ranks_per_node_,
                    "Ranks (GPUs) on each node (default: the whole world on one node)");
    cmd->add_option("--net-bw", net_bw_,
                    "Bandwidth per rank of the link between the ranks of a node (NVLink, or "
                    "shared memory on the CPU backend), for the collectives' first level "
                    "(default 25GB/s)");
    cmd->add_option("--internode-bw", internode_bw_,
                    "Each rank's share of its node's network to other nodes (one NIC per GPU: "
                    "that NIC's rate; one NIC per node: its rate / --gpus-per-node), for the "
                    "collectives' second level (default 25GB/s)");
    cmd->add_option("--pcie-bw", pcie_bw_, "Host-device bandwidth per direction (default 25GB/s)");
    cmd->add_option("--nvme-bw", nvme_bw_, "NVMe bandwidth of the node (default 6GB/s)");
    cmd->add_option("--nvme-limit", nvme_limit_,
                    "NVMe capacity of the node to plan for, e.g. 4T (default: the free space "
                    "under the NVMe paths)");
    cmd->add_option("--hardware", hardware_,
                    "Predict the step on this machine: a preset (h100-sxm, h200, a100-80gb, "
                    "rtx-4090, l40s, each with /gen4xN or /gen5xN NVMe drives), a profile "
                    "file, or none (default: this machine's cached probe, when there is one)");
    cmd->add_flag("--probe", probe_,
                  "Measure this machine (the CPU backend's units at the model's shapes, or with "
                  "--backend cuda the GPU's matmuls, memory and PCIe; AdamW, host copies, NVMe "
                  "under --nvme-path) into a profile, cache it, and predict with it");
    cmd->add_option("--probe-out", probe_out_,
                    "Where --probe writes the profile (default: the machine's cache, " +
                        cached_profile_path() + ", or " + cached_profile_path(true) +
                        " for --backend cuda)");
    cmd->add_flag("--tune", tune_,
                  "Search micro-batch x accumulation (at the same tokens per step), ZeRO stage, "
                  "offload placements, schedule, activation home and fetch slots for the fastest "
                  "plans that fit, by the step-time model; prints the five fastest with their "
                  "flags and DeepSpeed config (--json: as JSON; needs a hardware profile)");
    cmd->add_flag("--allow-approximate", allow_approximate_,
                  "--tune may also pick bf16 or int8 optimizer state (not bitwise AdamW)");
    cmd->add_option("--routing", routing_,
                    "A mixture's expected NVMe reads: replay each step's routing a strata train "
                    "--metrics FILE recorded (routed expert reads) and print the parameter reads "
                    "and the NVMe bytes per step (with --expert-update deferred, the missed "
                    "steps replayed as the run would) beside the worst case, and the same "
                    "under the other --expert-update; with a hardware profile, each recorded "
                    "step's predicted time too");
    cmd->add_option("--timeline", timeline_,
                    "Write the predicted steps as a Perfetto trace in the form of `strata train "
                    "--trace`, to open beside a measured one");
    return cmd;
  }

  int run() override {
    Result<int> status = plan();
    if (!status.is_ok()) {
      fmt::print(stderr, "strata plan: {}\n", status.status().message());
      return 2;
    }
    return *status;
  }

 private:
  Result<int> plan() {
    if (model_.empty() == params_.empty()) {
      return Status::error("give exactly one of --model PRESET|config.json|DIR and --params N");
    }
    if (Status s = shape_the_world(); !s) return s;
    Result<TrainConfig> config = load_train_config(flags_.config_path, flags_.overrides);
    if (!config.is_ok()) return config.status();
    print_config_warnings(*config);
    Result<int> ranks_per_node = node_ranks(config->world_size);
    if (!ranks_per_node) return ranks_per_node.status();

    ModelConfig model;
    if (!model_.empty()) {
      Result<ModelConfig> loaded = load_model_config(model_);
      if (!loaded.is_ok()) return loaded.status();
      model = *loaded;
    } else {
      Result<int64_t> count = parse_count(params_);
      if (!count.is_ok()) return count.status().with_context("--params");
      if (*count < 1)
        return Status::invalid_argument(
            fmt::format("--params {}: a model needs at least one parameter", params_));
      // A plan is made of a model's units: one of that size, in Llama's proportions.
      model = model_of_size(*count);
    }
    const TrainConfig& c = *config;
    if (backend_.empty()) backend_ = kernels::built_with_cuda() ? "cuda" : "cpu";
    if (backend_ == "cuda" && !kernels::built_with_cuda())
      return Status::error(
          "--backend cuda: this strata was built without CUDA, so it cannot size the GPU's "
          "buffers; plan on a CUDA build");
    PlanInput input =
        plan_input_from_config(c, model, {backend_ == "cuda", false, *ranks_per_node});

    // Budgets: given (plan_input_from_config), else detected on this machine.
    PlanBudgets& budgets = input.budgets;
    if (!budgets.device_per_rank) {
      kernels::GpuQuery gpus = kernels::query_gpus();
      if (!gpus.devices.empty()) {
        budgets.device_per_rank = static_cast<int64_t>(gpus.devices.front().free_bytes);
        budgets.device_source = "free on " + gpus.devices.front().name;
      }
    }
    if (!budgets.host_per_node) {
      if (auto available = detect_host_available_bytes()) {
        budgets.host_per_node = *available;
        budgets.host_source = "available on this machine";
      }
    }
    // --nvme-path is already in the config's stripe set.
    const std::vector<std::string> nvme_paths = c.effective_nvme_paths();
    if (!nvme_limit_.empty()) {
      Result<uint64_t> size = parse_size(nvme_limit_);
      if (!size.is_ok()) return size.status().with_context("--nvme-limit");
      budgets.nvme_per_node = static_cast<int64_t>(*size);
      budgets.nvme_source = "given";
    } else if (auto free_bytes = detect_free_bytes(nvme_paths)) {
      budgets.nvme_per_node = *free_bytes;
      budgets.nvme_source = "free under the NVMe paths";
    } else if (!nvme_paths.empty()) {
      fmt::print(stderr, "warning: cannot read the free space under {}; NVMe not checked\n",
                 nvme_paths.front());
    }
    for (auto [text, target, name] :
         {std::tuple{&net_bw_, &input.links.intra_node, "--net-bw"},
          std::tuple{&internode_bw_, &input.links.inter_node, "--internode-bw"},
          std::tuple{&pcie_bw_, &input.links.pcie, "--pcie-bw"},
          std::tuple{&nvme_bw_, &input.links.nvme, "--nvme-bw"}}) {
      if (text->empty()) continue;
      Result<double> bandwidth = parse_bandwidth(*text);
      if (!bandwidth.is_ok()) return bandwidth.status().with_context(name);
      *target = *bandwidth;
    }
    Status valid = validate_plan_input(input);
    if (!valid.is_ok()) return valid;
    Result<std::optional<HardwareProfile>> hardware = hardware_profile(input, c, model);
    if (!hardware) return hardware.status();
    if (tune_) {
      if (!*hardware)
        return Status::invalid_argument(
            "--tune needs a hardware profile: --probe, --hardware PRESET|FILE, or a cached probe");
      Result<TuneResult> tuned = tune_plan(c, model, {backend_ == "cuda", false, *ranks_per_node},
                                           input.budgets, **hardware, allow_approximate_);
      if (!tuned) return tuned.status();
      if (json_)
        fmt::print("{}\n", tune_result_to_json(*tuned).dump(2));
      else
        fmt::print("{}", format_tune_result(*tuned));
      return tuned->fastest.empty() ? 1 : 0;
    }

    if (ops_) {
      if (model_.empty())
        return Status::invalid_argument(
            "--ops needs --model: the operations are those of a real model's units");
      Result<TrainingPlan> steps = plan_training(input);
      if (!steps.is_ok()) return steps.status();
      std::optional<StepPrediction> prediction;
      if (*hardware) prediction = predict_step(*steps, **hardware);
      if (json_) {
        nlohmann::ordered_json j = training_plan_to_json(*steps);
        if (prediction) j["prediction"] = prediction_to_json(*prediction);
        fmt::print("{}\n", j.dump(2));
      } else {
        fmt::print("{}", format_training_plan(*steps));
        if (prediction) fmt::print("{}", format_prediction(*prediction));
      }
      if (prediction && !timeline_.empty())
        if (Status s = write_timeline(*steps, *prediction); !s) return s;
      return 0;
    }
    return report(input, *hardware);
  }

  // The plan's table or JSON, with the recorded routing's replay and the
  // step-time prediction where asked for; 1 when the plan does not fit.
  Result<int> report(const PlanInput& input, const std::optional<HardwareProfile>& hardware) {
    Result<PlanReport> planned = plan_with_suggestion(input);
    if (!planned.is_ok()) return planned.status();
    const PlanReport& plan = *planned;
    const bool zero = accounting_ == "zero";
    std::optional<StepPrediction> prediction;
    std::optional<TrainingPlan> steps;
    if ((hardware && plan.fits) || !routing_.empty()) {
      Result<TrainingPlan> built = plan_training(input);
      if (!built) return built.status();
      steps = std::move(*built);
      if (hardware && plan.fits) prediction = predict_step(*steps, *hardware);
    }
    // A mixture read as routed: the worst case above, and what an even routing costs.
    std::optional<RoutedPrediction> even;
    if (prediction && steps->routed_expert_fetch)
      even = predict_routed_steps(*steps, *hardware, even_routings(*steps, kEvenRoutingSteps),
                                  kEvenRoutingWarmup);
    std::optional<RecordedReads> recorded;
    std::optional<RecordedStepBytes> recorded_steps;
    std::optional<RoutedPrediction> recorded_prediction;
    std::optional<OtherUpdate> other;
    if (!routing_.empty()) {
      Result<std::vector<StepRouting>> routings = recorded_routings(*steps);
      if (!routings) return routings.status();
      recorded = recorded_parameter_reads(*steps, *routings);
      recorded_steps = recorded_step_bytes(*steps, *routings);
      if (prediction) recorded_prediction = predict_routed_steps(*steps, *hardware, *routings);
      Result<OtherUpdate> flipped = other_update(input, *steps, hardware, *routings);
      if (!flipped) return flipped.status();
      other = std::move(*flipped);
    }
    if (json_) {
      nlohmann::ordered_json j = plan_to_json(plan, zero);
      if (prediction) j["prediction"] = prediction_to_json(*prediction);
      if (even)
        j["even_routing"] = {{"steps", even->steps},
                             {"predicted_seconds_per_step", prediction_range_json(*even)},
                             {"nvme_read_per_step", even->median.traffic.nvme_read},
                             {"nvme_written_per_step", even->median.traffic.nvme_written}};
      if (recorded) {
        j["recorded_routing"] = recorded_to_json(*recorded, *recorded_steps);
        if (recorded_prediction)
          j["recorded_routing"]["predicted_seconds_per_step"] =
              prediction_range_json(*recorded_prediction);
        j["recorded_routing"]["other_expert_update"] = other_update_json(*other);
      }
      fmt::print("{}\n", j.dump(2));
    } else {
      fmt::print("{}", format_plan_table(plan, zero));
      if (recorded) fmt::print("{}", recorded_line(*recorded, *recorded_steps, *steps));
      if (prediction) fmt::print("{}", format_prediction(*prediction));
      if (even)
        fmt::print(
            "predicted with an even routing (each token's {} experts drawn uniformly, {} steps): "
            "{} per step on average (least {}, most {}), NVMe {} read and {} written per step; "
            "the prediction above is the worst case\n",
            steps->layout.config.num_experts_per_tok, even->steps, seconds_text(even->mean),
            seconds_text(even->least), seconds_text(even->most),
            format_bytes(even->median.traffic.nvme_read),
            format_bytes(even->median.traffic.nvme_written));
      if (recorded_prediction)
        fmt::print(
            "predicted with that routing: {} per step on average (least {}, most {}) over {} "
            "steps, each the step-time model's steady step with that step's NVMe bytes and "
            "AdamW elements; the worst case above\n",
            seconds_text(recorded_prediction->mean), seconds_text(recorded_prediction->least),
            seconds_text(recorded_prediction->most), recorded_prediction->steps);
      if (other) fmt::print("{}", other_update_line(*other, *recorded_steps, recorded_prediction));
      if (!hardware)
        fmt::print(
            "(no step-time prediction: --probe measures this machine, --hardware "
            "PRESET|FILE names one)\n");
      else if (!plan.fits)
        fmt::print("(no step-time prediction: the plan does not fit; predict the change above)\n");
    }
    if (prediction && !timeline_.empty())
      if (Status s = write_timeline(*steps, *prediction); !s) return s;
    return plan.fits ? 0 : 1;
  }

  // --routing FILE against this plan: the plan must read its experts as routed.
  Result<std::vector<StepRouting>> recorded_routings(const TrainingPlan& plan) const {
    if (!plan.routed_expert_fetch)
      return Status::invalid_argument(fmt::format(
          "--routing {}: this plan reads every expert ({}); plan what the run trained", routing_,
          plan.expert_fetch_reason.empty() ? "a dense model" : plan.expert_fetch_reason));
    return read_recorded_routing(plan, routing_);
  }

  static nlohmann::ordered_json prediction_range_json(const RoutedPrediction& p) {
    return {{"mean", p.mean}, {"least", p.least}, {"most", p.most}};
  }

  // The recorded routing replayed under the other expert update
  // (--expert-update flipped, everything else as given): the bytes and time
  // a user weighing the choice needs beside this plan's, from the same
  // replay. `why` is set instead when the flip would not change the plan
  // (the other plan's one line), or cuts its units otherwise.
  struct OtherUpdate {
    std::string name;  // the flag's value: "deferred" or "eager"
    std::string why;
    bool fits = false;
    RecordedStepBytes bytes;
    std::optional<RoutedPrediction> prediction;
  };
  static Result<OtherUpdate> other_update(const PlanInput& input, const TrainingPlan& plan,
                                          const std::optional<HardwareProfile>& hardware,
                                          const std::vector<StepRouting>& routings) {
    OtherUpdate out;
    PlanInput flipped = input;
    flipped.expert_update_deferred = !input.expert_update_deferred;
    out.name = flipped.expert_update_deferred ? "deferred" : "eager";
    Result<TrainingPlan> built = plan_training(flipped);
    if (!built) return built.status();
    if (built->deferred_expert_updates == plan.deferred_expert_updates) {
      out.why = built->expert_update_reason;
      return out;
    }
    const auto names = [](const TrainingPlan& p) {
      std::vector<std::string> n;
      for (const UnitLayout& unit : p.layout.units) n.push_back(unit.unit.name);
      return n;
    };
    if (names(*built) != names(plan)) {
      out.why = "its plan cuts the units otherwise, so the recorded routing is not its own";
      return out;
    }
    Result<PlanReport> memory = plan_memory(flipped);
    if (!memory) return memory.status();
    out.fits = memory->fits;
    out.bytes = recorded_step_bytes(*built, routings);
    if (hardware && out.fits) out.prediction = predict_routed_steps(*built, *hardware, routings);
    return out;
  }

  static nlohmann::ordered_json other_update_json(const OtherUpdate& o) {
    nlohmann::ordered_json j = {{"expert_update", o.name}, {"changes_plan", o.why.empty()}};
    if (!o.why.empty()) {
      j["reason"] = o.why;
      return j;
    }
    j["fits"] = o.fits;
    j["mean_nvme_read_bytes"] = o.bytes.read_mean;
    j["mean_nvme_written_bytes"] = o.bytes.written_mean;
    j["most_nvme_read_bytes"] = o.bytes.read_most;
    j["most_nvme_written_bytes"] = o.bytes.written_most;
    j["worst_nvme_read_bytes"] = o.bytes.worst_read;
    j["worst_nvme_written_bytes"] = o.bytes.worst_written;
    if (o.prediction) j["predicted_seconds_per_step"] = prediction_range_json(*o.prediction);
    return j;
  }

  static std::string other_update_line(const OtherUpdate& o, const RecordedStepBytes& mine,
                                       const std::optional<RoutedPrediction>& my_time) {
    if (!o.why.empty())
      return fmt::format("--expert-update {} would not change this plan: {}\n", o.name, o.why);
    const int64_t moved = mine.read_mean + mine.written_mean;
    std::string line = fmt::format(
        "with --expert-update {} instead: NVMe per step read mean {} (most {}), written mean {} "
        "(most {}), {:.1f}% of this plan's bytes; the worst step {} / {}",
        o.name, format_bytes(double(o.bytes.read_mean)), format_bytes(double(o.bytes.read_most)),
        format_bytes(double(o.bytes.written_mean)), format_bytes(double(o.bytes.written_most)),
        100.0 * double(o.bytes.read_mean + o.bytes.written_mean) /
            double(std::max<int64_t>(1, moved)),
        format_bytes(double(o.bytes.worst_read)), format_bytes(double(o.bytes.worst_written)));
    if (!o.fits)
      line += fmt::format(
          "; that plan does not fit the budgets (strata plan --expert-update {} says what "
          "does)",
          o.name);
    else if (o.prediction && my_time)
      line += fmt::format("; predicted {} per step on average against this plan's {}",
                          seconds_text(o.prediction->mean), seconds_text(my_time->mean));
    return line + "\n";
  }

  nlohmann::ordered_json recorded_to_json(const RecordedReads& r,
                                          const RecordedStepBytes& s) const {
    return {{"file", routing_},
            {"steps", r.steps},
            {"worst_parameter_read_bytes", r.worst},
            {"mean_parameter_read_bytes", r.mean},
            {"least_parameter_read_bytes", r.least},
            {"most_parameter_read_bytes", r.most},
            {"mean_nvme_read_bytes", s.read_mean},
            {"mean_nvme_written_bytes", s.written_mean},
            {"most_nvme_read_bytes", s.read_most},
            {"most_nvme_written_bytes", s.written_most},
            {"worst_nvme_read_bytes", s.worst_read},
            {"worst_nvme_written_bytes", s.worst_written}};
  }

  std::string recorded_line(const RecordedReads& r, const RecordedStepBytes& s,
                            const TrainingPlan& plan) const {
    return fmt::format(
               "NVMe parameter reads per step with the routing {} recorded ({} steps): mean {} "
               "(least {}, most {}), {:.1f}% of the worst case {}\n",
               routing_, r.steps, format_bytes(double(r.mean)), format_bytes(double(r.least)),
               format_bytes(double(r.most)),
               100.0 * double(r.mean) / double(std::max<int64_t>(1, r.worst)),
               format_bytes(double(r.worst))) +
           fmt::format(
               "NVMe per step with that routing{}: read mean {} (most {}), written mean {} (most "
               "{}); the worst step {} / {}\n",
               plan.deferred_expert_updates ? " and deferred expert updates" : "",
               format_bytes(double(s.read_mean)), format_bytes(double(s.read_most)),
               format_bytes(double(s.written_mean)), format_bytes(double(s.written_most)),
               format_bytes(double(s.worst_read)), format_bytes(double(s.worst_written)));
  }

  // The profile to predict with: --hardware, a fresh --probe, or this
  // machine's cached probe (for a CPU plan); none for --hardware none, as
  // `strata train` takes it. The link flags override its figures.
  Result<std::optional<HardwareProfile>> hardware_profile(const PlanInput& input,
                                                          const TrainConfig& config,
                                                          const ModelConfig& model) {
    std::optional<HardwareProfile> profile;
    if (probe_ && !hardware_.empty())
      return Status::invalid_argument("give one of --probe and --hardware");
    if (probe_) {
      ProbeOptions options;
      options.gpu = input.gpu;
      options.model = model;
      options.micro_batch = input.micro_batch;
      options.seq_len = input.seq_len;
      options.nvme_paths = config.effective_nvme_paths();
      options.progress = [](const std::string& line) { fmt::print(stderr, "probe: {}\n", line); };
      Result<HardwareProfile> probed = probe_hardware(options);
      if (!probed) return probed.status();
      const std::string path = probe_out_.empty() ? cached_profile_path(input.gpu) : probe_out_;
      if (Status s = write_profile(*probed, path); !s) return s;
      fmt::print(stderr, "probe: wrote {}\n", path);
      profile = std::move(*probed);
    } else if (hardware_ == "none") {
      return profile;
    } else if (!hardware_.empty()) {
      Result<HardwareProfile> loaded = load_hardware_profile(hardware_);
      if (!loaded) return loaded.status().with_context("--hardware");
      profile = std::move(*loaded);
    } else if (std::filesystem::exists(cached_profile_path(input.gpu))) {
      // The cache is only a default: one an older strata wrote, or a damaged
      // one, predicts nothing, and says how to measure again.
      Result<HardwareProfile> cached = read_hardware_profile(cached_profile_path(input.gpu));
      if (!cached) {
        fmt::print(stderr,
                   "warning: the cached probe is unusable ({}); no prediction (--probe measures "
                   "this machine again)\n",
                   cached.status().message());
        return profile;
      }
      profile = std::move(*cached);
    }
    if (!profile) return profile;
    if (profile->gpu != input.gpu)
      return Status::invalid_argument(fmt::format(
          "--hardware {}: a {} profile for a {} plan; add --backend {}", profile->name,
          profile->gpu ? "GPU" : "CPU", input.gpu ? "GPU" : "CPU", profile->gpu ? "cuda" : "cpu"));
    // The link flags override the profile.
    if (!net_bw_.empty()) profile->intra_node_gbps = input.links.intra_node / 1e9;
    if (!internode_bw_.empty()) profile->inter_node_gbps = input.links.inter_node / 1e9;
    if (!pcie_bw_.empty()) profile->pcie_h2d_gbps = profile->pcie_d2h_gbps = input.links.pcie / 1e9;
    if (!nvme_bw_.empty()) {
      const double each =
          input.links.nvme / 1e9 / double(std::max<size_t>(1, profile->nvme.size()));
      if (profile->nvme.empty()) profile->nvme.push_back({});
      // The drives' given bandwidth each way; reads and writes take turns
      // (a mixed rate measured on other drives says nothing of these).
      for (NvmeDrive& d : profile->nvme) {
        d.read_gbps = d.write_gbps = each;
        d.mixed_gbps = 0;
      }
    }
    return profile;
  }

  // --nodes with --gpus-per-node fix the world size: a --world-size that
  // disagrees is refused, else it becomes the config's (before the batch
  // triple is checked against it).
  Status shape_the_world() {
    if (nodes_ && *nodes_ < 1)
      return Status::invalid_argument(
          fmt::format("--nodes {}: a plan needs at least one node", *nodes_));
    if (ranks_per_node_ && *ranks_per_node_ < 1)
      return Status::invalid_argument(
          fmt::format("--gpus-per-node {}: a node needs at least one rank", *ranks_per_node_));
    if (!nodes_ || !ranks_per_node_) return Status::ok();
    const int world = *nodes_ * *ranks_per_node_;
    std::optional<int>& given = flags_.overrides.world_size;
    if (given && *given != world)
      return Status::invalid_argument(fmt::format(
          "--world-size {} disagrees with --nodes {} x --gpus-per-node {} = {} ranks; drop "
          "--world-size or make it {}",
          *given, *nodes_, *ranks_per_node_, world, world));
    given = world;
    return Status::ok();
  }

  // The ranks per node for a world size: --gpus-per-node, or the world over
  // --nodes; 0 (one node) with neither.
  Result<int> node_ranks(int world_size) const {
    if (ranks_per_node_) {
      if (world_size % *ranks_per_node_ != 0)
        return Status::invalid_argument(fmt::format(
            "--gpus-per-node {}: world size {} is not a whole number of such nodes; give a "
            "multiple of it (--world-size, or --nodes)",
            *ranks_per_node_, world_size));
      return *ranks_per_node_;
    }
    if (!nodes_) return 0;
    if (world_size % *nodes_ != 0)
      return Status::invalid_argument(fmt::format(
          "--nodes {}: world size {} does not split evenly over them; give --gpus-per-node or "
          "a --world-size that is a multiple of {}",
          *nodes_, world_size, *nodes_));
    return world_size / *nodes_;
  }

  // The simulated steps, each operation at its predicted time, through the
  // writer of `strata train --trace`.
  Status write_timeline(const TrainingPlan& steps, const StepPrediction& prediction) {
    Result<TraceWriter> trace = TraceWriter::open(timeline_, steps);
    if (!trace) return trace.status().with_context("--timeline");
    std::vector<OpTiming> timings;
    for (const SimulatedOp& op : prediction.simulation.ops)
      timings.push_back({0, op.op, op.step, op.start, op.end});
    if (Status s = trace->write(timings); !s) return s;
    return trace->finish();
  }

  std::string model_;
  std::string params_;
  ConfigFlags flags_;
  std::string accounting_ = "strata";
  bool json_ = false;
  bool ops_ = false;
  std::string backend_;                        // empty: cuda on a CUDA build, else cpu
  std::optional<int> nodes_, ranks_per_node_;  // --nodes, --gpus-per-node
  std::string net_bw_, internode_bw_, pcie_bw_, nvme_bw_;
  std::string nvme_limit_;  // --nvme-limit
  std::string hardware_;    // --hardware
  bool probe_ = false;
  std::string probe_out_;
  std::string timeline_;
  std::string routing_;
  bool tune_ = false;
  bool allow_approximate_ = false;
};

SubcommandRegistration registration([] { return std::make_unique<PlanCommand>(); });

}  // namespace
}  // namespace strata::tools
