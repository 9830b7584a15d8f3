// The automatic cuts of the units (planner.h, choose_unit_cuts): the
// embedding and the head along the vocabulary, each decoder layer into its
// attention and its MLP, a sparse layer's MLP into groups of experts and a
// dense one's into parts, each chosen only where it is what makes the plan fit.
#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "core/plan/planner.h"

namespace strata {
namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The plan with `in`'s cuts as given.
Result<PlanReport> plan_as_given(PlanInput in) {
  in.vocab_chunks_auto = false;
  in.layer_pieces_auto = false;
  in.expert_groups_auto = false;
  in.mlp_parts_auto = false;
  return plan_memory(in);
}

// The most parts the automatic choice cuts a dense MLP into.
constexpr int64_t kMostMlpParts = 64;

// The count a search of a layer's MLP cut moves: groups of a sparse layer's
// experts (ModelConfig::expert_groups, up to the experts) or parts of a
// dense one (ModelConfig::mlp_parts, up to kMostMlpParts).
struct MlpCutCount {
  bool parts;
  int64_t& of(PlanInput& in) const { return parts ? in.model.mlp_parts : in.model.expert_groups; }
  int64_t of(const PlanInput& in) const {
    return parts ? in.model.mlp_parts : in.model.expert_groups;
  }
  int64_t most(const PlanInput& in) const {
    return parts ? std::min(kMostMlpParts, in.model.intermediate_size) : in.model.num_experts;
  }
};

// The fewest pieces of a layer's MLP (more than `in`'s, layers in pieces)
// for which `fits` holds, `also` shaping each input tried after the count
// is set (by default nothing); that input and its plan, none when no count
// does. More pieces shrink the slots but add units (their working sets,
// the vocabulary cut to their size), so the need is not always monotone in
// the count: double it until one fits, then try each count between the
// last two.
struct CutFit {
  PlanInput input;
  PlanReport report;
};
template <typename Fits, typename Also = void (*)(PlanInput&)>
std::optional<CutFit> fewest_pieces(
    const PlanInput& in, MlpCutCount count, bool cut_vocab, const Fits& fits,
    const Also& also = [](PlanInput&) {}) {
  const int64_t most = count.most(in);
  const int64_t given = count.of(in);
  std::optional<CutFit> fit;
  int64_t fit_count = 0;
  auto fits_in = [&](int64_t pieces) {
    PlanInput cut = in;
    cut.model.layer_pieces = 2;
    count.of(cut) = pieces;
    also(cut);
    if (cut_vocab)
      cut.model.vocab_chunks = std::max(cut.model.vocab_chunks, vocab_chunks_for_layers(cut));
    Result<PlanReport> in_pieces = plan_as_given(cut);
    if (!in_pieces || !fits(*in_pieces)) return false;
    fit = CutFit{std::move(cut), std::move(*in_pieces)};
    fit_count = pieces;
    return true;
  };
  int64_t below = given;  // the largest count tried that does not fit
  for (int64_t g = std::min(most, 2 * given); g > below; g = std::min(most, 2 * g)) {
    if (fits_in(g)) break;
    below = g;
  }
  for (int64_t g = below + 1; fit && g < fit_count; ++g)
    if (fits_in(g)) break;
  return fit;
}

// The parts that cut `in`'s dense MLP pieces no larger than its largest
// piece of a sparse layer's MLP (its router or a group of experts), within
// the most a search takes.
int64_t parts_matching_groups(const PlanInput& in) {
  ModelConfig m = in.model;
  m.layer_pieces = 2;
  m.mlp_parts = 1;
  int64_t sparse = 0, dense = 0;
  for (const UnitShape& unit : model_units(m)) {
    if (unit.piece == LayerPiece::router || unit.piece == LayerPiece::experts)
      sparse = std::max(sparse, unit.numel);
    else if (unit.piece == LayerPiece::mlp && unit.layer >= 0)
      dense = std::max(dense, unit.numel);
  }
  if (sparse <= 0 || dense <= sparse) return 1;
  return std::min(MlpCutCount{true}.most(in), ceil_div(dense, sparse));
}

// What the reasons of an automatic cut of a layer's MLP say: groups of a
// sparse layer's experts, or parts of a dense MLP.
struct MlpCutWords {
  bool parts;
  const char* fits;         // the reason when one piece fits
  const char* needs_pieces; // when the layers were asked whole
  const char* chosen;       // "{count} ... {count} ...": the fewest that fit
  const char* pieces;       // the layer pieces' reason when the cut asked for them
  const char* vocab;        // the vocabulary's, cut to this piece's size
  const char* none;         // "... up to {most} ...": no count fits
};
constexpr MlpCutWords kGroupWords = {
    false,
    "1 (auto: each sparse layer's MLP as one piece fits the budgets)",
    "1 (auto: the plan does not fit the budgets, and groups of experts need --layer-pieces 2)",
    "{0} (auto: the plan does not fit the budgets with each sparse layer's MLP as one piece; its "
    "router and {0} groups of experts, the fewest that fit)",
    "2 (auto: the groups of experts cut each layer's MLP piece)",
    "{} (auto: the embedding and the head cut to a group's size)",
    "1 (auto: the plan does not fit the budgets, and with the experts in groups of any count up "
    "to {} it does not either)"};
constexpr MlpCutWords kPartWords = {
    true,
    "1 (auto: each dense layer's MLP as one piece fits the budgets)",
    "1 (auto: the plan does not fit the budgets, and MLP parts need --layer-pieces 2)",
    "{0} (auto: the plan does not fit the budgets with each dense layer's MLP as one piece; in "
    "{0} parts along its intermediate dimension, the fewest that fit)",
    "2 (auto: the MLP parts cut each layer's MLP piece)",
    "{} (auto: the embedding and the head cut to an MLP part's size)",
    "1 (auto: the plan does not fit the budgets, and with each dense MLP in any count of parts up "
    "to {} it does not either)"};

// The automatic cut of each layer's MLP `words` names, after the cuts
// before it left `in` and its plan `best`: none where `best` fits, else the
// fewest pieces that fit (the layers in pieces, the vocabulary, when
// automatic, cut to a piece's size), said in the reasons.
void choose_mlp_cut(PlanInput& in, PlanReport& best, bool pieces_auto, bool vocab_auto,
                    const MlpCutWords& words) {
  auto reason = [&](PlanInput& p) -> std::string& {
    return words.parts ? p.mlp_parts_reason : p.expert_groups_reason;
  };
  if (best.fits) {
    reason(in) = words.fits;
    return;
  }
  if (in.model.layer_pieces < 2 && !pieces_auto) {
    reason(in) = words.needs_pieces;
    return;
  }
  PlanInput base = in;
  base.model.layer_pieces = 2;
  const MlpCutCount count{words.parts};
  std::optional<CutFit> fit =
      fewest_pieces(base, count, vocab_auto, [](const PlanReport& p) { return p.fits; });
  if (!fit) {
    reason(in) = fmt::format(fmt::runtime(words.none), count.most(in));
    return;
  }
  PlanInput& cut = fit->input;
  reason(cut) = fmt::format(fmt::runtime(words.chosen),
                            words.parts ? cut.model.mlp_parts : cut.model.expert_groups);
  if (in.model.layer_pieces < 2) cut.layer_pieces_reason = words.pieces;
  if (cut.model.vocab_chunks != in.model.vocab_chunks)
    cut.vocab_chunks_reason = fmt::format(fmt::runtime(words.vocab), cut.model.vocab_chunks);
  in = cut;
  best = std::move(fit->report);
}

// Both cuts of the layers' MLPs (a mixture whose dense MLPs and experts
// are both too large for either cut alone): the fewest groups of experts
// for which `fits` holds with the dense MLPs in parts of a group's size
// (parts_matching_groups), then the fewest parts with those groups; none
// when no count of groups does.
template <typename Fits>
std::optional<CutFit> fewest_groups_and_parts(const PlanInput& in, bool cut_vocab,
                                              const Fits& fits) {
  PlanInput base = in;
  base.model.layer_pieces = 2;
  base.model.expert_groups = base.model.mlp_parts = 1;
  std::optional<CutFit> grouped =
      fewest_pieces(base, MlpCutCount{false}, cut_vocab, fits,
                    [](PlanInput& cut) { cut.model.mlp_parts = parts_matching_groups(cut); });
  if (!grouped) return std::nullopt;
  PlanInput with_groups = grouped->input;
  with_groups.model.mlp_parts = 1;
  with_groups.model.vocab_chunks = in.model.vocab_chunks;
  // The search skips counts below a doubling that does not fit, so it may
  // land above the count matched to the groups: take the fewer.
  std::optional<CutFit> parted = fewest_pieces(with_groups, MlpCutCount{true}, cut_vocab, fits);
  return parted && parted->input.model.mlp_parts < grouped->input.model.mlp_parts ? parted
                                                                                  : grouped;
}

// Both cuts where each alone leaves `best` over the budgets, said in both
// reasons; where no count fits, only the groups' reason says so.
void choose_both_mlp_cuts(PlanInput& in, PlanReport& best, bool vocab_auto) {
  std::optional<CutFit> fit =
      fewest_groups_and_parts(in, vocab_auto, [](const PlanReport& p) { return p.fits; });
  if (!fit) {
    std::string& groups_reason = in.expert_groups_reason;
    if (!groups_reason.empty() && groups_reason.back() == ')')
      groups_reason.insert(groups_reason.size() - 1, ", nor with the dense MLPs in parts too");
    return;
  }
  PlanInput& cut = fit->input;
  const int64_t groups = cut.model.expert_groups, parts = cut.model.mlp_parts;
  cut.expert_groups_reason = fmt::format(
      "{} (auto: the plan fits the budgets neither with groups of experts alone nor with MLP "
      "parts alone; the sparse layers' MLPs in {} groups, the fewest that fit with the dense "
      "ones in parts)",
      groups, groups);
  cut.mlp_parts_reason = fmt::format(
      "{} (auto: with the experts in {} groups, each dense layer's MLP in {} parts along its "
      "intermediate dimension, the fewest that fit)",
      parts, groups, parts);
  if (in.model.layer_pieces < 2)
    cut.layer_pieces_reason =
        "2 (auto: the groups of experts and the MLP parts cut each layer's "
        "MLP piece)";
  if (cut.model.vocab_chunks != in.model.vocab_chunks)
    cut.vocab_chunks_reason =
        fmt::format("{} (auto: the embedding and the head cut to the size of a group and a part)",
                    cut.model.vocab_chunks);
  in = cut;
  best = std::move(fit->report);
}

}  // namespace

int64_t vocab_chunks_for_layers(const PlanInput& in) {
  ModelConfig m = in.model;
  if (m.tie_word_embeddings || m.vocab_size <= 1) return 1;
  m.vocab_chunks = 1;
  int64_t largest_layer = 0;
  for (const UnitShape& unit : model_units(m))
    if (unit.kind == UnitKind::decoder_layer) largest_layer = std::max(largest_layer, unit.numel);
  const int64_t table = m.vocab_size * m.hidden_size;
  if (largest_layer <= 0 || table + m.hidden_size <= largest_layer) return 1;
  // The head's first chunk also holds the final norm.
  return std::min(m.vocab_size, ceil_div(table + m.hidden_size, largest_layer));
}

Result<UnitCutsChoice> choose_unit_cuts(const PlanInput& input) {
  UnitCutsChoice choice{input, std::nullopt};
  PlanInput& in = choice.input;
  const bool vocab_auto = in.vocab_chunks_auto, pieces_auto = in.layer_pieces_auto;
  const bool may_group = in.expert_groups_auto && in.model.is_moe();
  const bool may_part = in.mlp_parts_auto &&
                        in.model.sparse_layer_count() < in.model.num_hidden_layers &&
                        in.model.intermediate_size > 1;
  in.vocab_chunks_auto = in.layer_pieces_auto = in.expert_groups_auto = in.mlp_parts_auto = false;
  if (vocab_auto) in.model.vocab_chunks = 1;
  if (pieces_auto) in.model.layer_pieces = 1;
  const int64_t chunks = vocab_auto ? vocab_chunks_for_layers(in) : 1;
  // Nothing to say where no cut could shrink a unit.
  const bool may_cut_layers = pieces_auto && in.model.num_hidden_layers > 0;
  if (chunks <= 1 && !may_cut_layers && !may_group && !may_part) return choice;
  Result<PlanReport> whole = plan_as_given(in);
  if (!whole) return whole.status();
  PlanReport best = std::move(*whole);
  if (chunks > 1) {
    if (best.fits) {
      in.vocab_chunks_reason = "1 (auto: whole units fit the budgets)";
    } else {
      PlanInput cut = in;
      cut.model.vocab_chunks = chunks;
      Result<PlanReport> cut_plan = plan_as_given(cut);
      if (cut_plan && cut_plan->fits) {
        cut.vocab_chunks_reason = fmt::format(
            "{} (auto: whole, the embedding and the head set the working set and the plan does "
            "not fit the budgets; cut in {}, a layer is the largest unit and it fits)",
            chunks, chunks);
        in = cut;
        best = std::move(*cut_plan);
      } else {
        in.vocab_chunks_reason = fmt::format(
            "1 (auto: whole units do not fit the budgets, and cut in {} they do not either)",
            chunks);
      }
    }
  }
  if (may_cut_layers) {
    if (best.fits) {
      in.layer_pieces_reason = "1 (auto: whole layers fit the budgets)";
    } else {
      // Each layer's attention and MLP; an automatic vocabulary cut to a piece's size.
      PlanInput cut = in;
      cut.model.layer_pieces = 2;
      if (vocab_auto) {
        cut.model.vocab_chunks = 1;
        cut.model.vocab_chunks = vocab_chunks_for_layers(cut);
      }
      Result<PlanReport> cut_plan = plan_as_given(cut);
      if (cut_plan && cut_plan->fits) {
        cut.layer_pieces_reason =
            "2 (auto: whole layers do not fit the budgets; each layer's attention and MLP as "
            "units of their own fit)";
        if (vocab_auto && cut.model.vocab_chunks != in.model.vocab_chunks)
          cut.vocab_chunks_reason =
              fmt::format("{} (auto: the embedding and the head cut to a layer piece's size)",
                          cut.model.vocab_chunks);
        in = cut;
        best = std::move(*cut_plan);
      } else {
        in.layer_pieces_reason =
            "1 (auto: whole layers do not fit the budgets, and in two pieces they do not either)";
      }
    }
  }
  if (may_group) choose_mlp_cut(in, best, pieces_auto, vocab_auto, kGroupWords);
  if (may_part) choose_mlp_cut(in, best, pieces_auto, vocab_auto, kPartWords);
  if (may_group && may_part && !best.fits && (in.model.layer_pieces >= 2 || pieces_auto))
    choose_both_mlp_cuts(in, best, vocab_auto);
  best.input.vocab_chunks_reason = in.vocab_chunks_reason;
  best.input.layer_pieces_reason = in.layer_pieces_reason;
  best.input.expert_groups_reason = in.expert_groups_reason;
  best.input.mlp_parts_reason = in.mlp_parts_reason;
  choice.report = std::move(best);
  return choice;
}

Result<PlanInput> resolve_unit_cuts(const PlanInput& input) {
  Result<UnitCutsChoice> choice = choose_unit_cuts(input);
  if (!choice) return choice.status();
  return std::move(choice->input);
}

std::string vocabulary_chunks_line(const PlanInput& in) {
  if (!in.vocab_chunks_reason.empty()) return in.vocab_chunks_reason;
  return fmt::format("{} (given)", in.model.vocab_chunks);
}

int64_t expert_groups_that_fit(const PlanInput& leanest) {
  const std::optional<CutFit> fit = fewest_pieces(
      leanest, MlpCutCount{false}, true, [](const PlanReport& p) { return p.verdicts[0].fits(); });
  return fit ? fit->input.model.expert_groups : 0;
}

int64_t mlp_parts_that_fit(const PlanInput& leanest) {
  const std::optional<CutFit> fit = fewest_pieces(
      leanest, MlpCutCount{true}, true, [](const PlanReport& p) { return p.verdicts[0].fits(); });
  return fit ? fit->input.model.mlp_parts : 0;
}

std::pair<int64_t, int64_t> groups_and_parts_that_fit(const PlanInput& leanest) {
  const std::optional<CutFit> fit = fewest_groups_and_parts(
      leanest, true, [](const PlanReport& p) { return p.verdicts[0].fits(); });
  if (!fit) return {0, 0};
  return {fit->input.model.expert_groups, fit->input.model.mlp_parts};
}

std::string mlp_parts_line(const PlanInput& in) {
  if (!in.mlp_parts_reason.empty()) return in.mlp_parts_reason;
  return fmt::format("{} (given)", in.model.mlp_parts);
}

std::string expert_groups_line(const PlanInput& in) {
  if (!in.expert_groups_reason.empty()) return in.expert_groups_reason;
  return fmt::format("{} (given)", in.model.expert_groups);
}

std::string layer_pieces_line(const PlanInput& in) {
  if (!in.layer_pieces_reason.empty()) return in.layer_pieces_reason;
  return fmt::format("{} (given)", in.model.layer_pieces);
}

}  // namespace strata
