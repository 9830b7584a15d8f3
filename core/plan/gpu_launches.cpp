// The CUDA units' launches and waits per plan operation (gpu_launches.h).
#include "core/plan/gpu_launches.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/model/model.h"
#include "core/plan/expert_fetch.h"

namespace strata {

double expected_experts_reached(const ModelConfig& m, int64_t tokens, int64_t experts) {
  if (m.num_experts <= 0 || experts <= 0) return 0;
  const double missed_by_one = 1.0 - double(m.num_experts_per_tok) / double(m.num_experts);
  return double(experts) * (1.0 - std::pow(std::max(0.0, missed_by_one), double(tokens)));
}

namespace {

struct LayerCounts {
  double attention_forward = 0, attention_backward = 0;
};

LayerCounts attention_counts(const UnitLayout& unit) {
  const std::string p = "model.layers." + std::to_string(unit.unit.layer) + ".";
  const bool bias = unit.find(p + "self_attn.q_proj.bias") != nullptr;
  const bool qk_norm = unit.find(p + "self_attn.q_norm.weight") != nullptr;
  return {7.0 + (bias ? 1 : 0) + (qk_norm ? 6 : 0), 11.0 + (bias ? 1 : 0) + (qk_norm ? 8 : 0)};
}

// The unit holds its layer's router (whole, MLP piece, router piece) and the
// layer is the model's last sparse one: its backward is a micro-batch's
// first to need the load-balancing gradient.
bool uploads_aux_grad(const TrainingPlan& plan, const UnitShape& unit) {
  const ModelConfig& m = plan.layout.config;
  if (!m.output_router_logits || m.router_aux_loss_coef == 0 || !m.layer_is_sparse(unit.layer))
    return false;
  if (unit.piece == LayerPiece::attention || unit.piece == LayerPiece::experts) return false;
  for (int64_t l = m.num_hidden_layers - 1; l > unit.layer; --l)
    if (m.layer_is_sparse(l)) return false;
  return true;
}

}  // namespace

GpuLaunches gpu_launches(const TrainingPlan& plan, const PlanOp& op) {
  GpuLaunches out;
  if (op.kind != OpKind::forward && op.kind != OpKind::backward && op.kind != OpKind::route)
    return out;
  const ModelConfig& m = plan.layout.config;
  const UnitLayout& layout = plan.layout.units[size_t(op.unit)];
  const UnitShape& unit = layout.unit;
  const bool forward = op.kind == OpKind::forward;
  if (unit.kind == UnitKind::embedding) {
    out.kernels = op.kind == OpKind::route ? 0 : 1;
    return out;
  }
  if (unit.kind == UnitKind::head) {
    out.kernels = op.kind == OpKind::route ? 0 : unit.chunk < 0 ? 8 : 4;
    return out;
  }
  const bool sparse = m.layer_is_sparse(unit.layer);
  const double R =
      expected_experts_reached(m, plan.tokens_per_micro, expert_blocks(plan.layout, op.unit).count);
  // A routed fetch's routing: the norm, the router and the top-k again, or
  // a group's layer's routing read from the chain; then one wait. Its own
  // operation at several ranks, the forward's first step at one.
  const GpuLaunches route{unit.piece == LayerPiece::experts ? 1.0 : 4.0, 1};
  if (op.kind == OpKind::route) return route;
  if (forward && routes_expert_reads(plan, op.unit) && !shares_routing(plan, op.unit)) {
    out.kernels += route.kernels;
    out.waits += route.waits;
  }
  switch (unit.piece) {
    case LayerPiece::router:
      out.kernels += forward ? 12 : 9;
      out.waits += forward ? 1 : 0;
      break;
    case LayerPiece::experts:
      // Each way its layer's routing first (one wait); backward its rows again.
      out.kernels += forward ? 6 + 3 * R : 9 + 8 * R;
      out.waits += 1;
      break;
    case LayerPiece::mlp_part: {
      const double first = unit.mlp_part == 0 ? 2 : 0;
      const double part_forward = 5 + first;
      out.kernels += forward ? part_forward : 9 + first;
      if (!forward && plan.recomputes(op.unit)) out.kernels += part_forward;
      break;
    }
    default: {
      const LayerCounts attention = attention_counts(layout);
      const bool has_attention = unit.piece != LayerPiece::mlp;
      const bool has_mlp = unit.piece != LayerPiece::attention;
      const double mlp_forward = sparse ? 10 + 3 * R : 5;
      const int mlp_waits = has_mlp && sparse ? 1 : 0;
      const double whole_forward =
          (has_attention ? attention.attention_forward : 0) + (has_mlp ? mlp_forward : 0);
      if (forward) {
        out.kernels += whole_forward;
        out.waits += mlp_waits;
        break;
      }
      out.kernels += 1 + (has_attention ? attention.attention_backward : 0) +
                     (has_mlp ? (sparse ? 8 + 5 * R : 8) : 0);
      if (plan.recomputes(op.unit)) {
        out.kernels += whole_forward;
        out.waits += mlp_waits;
      }
      break;
    }
  }
  if (!forward && uploads_aux_grad(plan, unit)) {
    out.kernels += 1;
    out.waits += 1;
  }
  return out;
}

}  // namespace strata
