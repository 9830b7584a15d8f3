// Routed expert fetch (TrainingPlan::routed_expert_fetch; core/README.md,
// "Routed expert fetch"): a sparse layer's MLP piece whose parameters are
// homed on NVMe is read in two parts. Its fetch reads ahead everything but
// the experts (the router, the post-attention norm); each of its forward and
// backward computations then reads the experts its micro-batch's tokens are
// routed to that its gather has not read yet, straight into the gathered
// copy, except where the fetch of a backward reads them ahead (below). The
// plan reserves every buffer for the worst case (every expert
// read) and its traffic counts the worst case; given a step's routing,
// routed_parameter_reads counts what the step reads.
//
// Several ranks (shares_routing): each rank holds a shard of the unit, so
// the routing of a micro-batch is the union of the ranks'. Before a routed
// forward, `route` (compute lane) takes this rank's routing and `share` (the
// collectives' lane) joins the ranks' routings (an all-reduce of E numbers),
// reads this rank's part of the experts the union reaches and sends each
// piece from its owner to every rank (broadcasts, in one order every rank
// computes from the union); the forward then reads nothing. A routed unit's
// gather sends only what its fetches read (fetched_elements and the experts
// read ahead), not the whole shard. Backwards read nothing: their fetch read
// their forwards' experts ahead.
//
// Ranges are byte ranges of the unit's compute-precision parameters (the
// unit's coordinates: rank r's shard is [r S, (r + 1) S) of them), aligned to
// the NVMe alignment: an expert's range is widened to whole alignment
// blocks, neighbouring experts read by one computation are one range, and a
// block shared with an expert read earlier is read again. rank_ranges turns
// them into the ranges of one rank's shard.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/plan/training_plan.h"
#include "io/base/status.h"
#include "tiers/tier.h"

namespace strata {

// The experts each micro-batch of a step routed tokens to, per unit:
// routing[u][m][e] != 0 when micro-batch m sent a token to expert e of unit
// u; empty for units that do not route their reads.
using StepRouting = std::vector<std::vector<std::vector<uint8_t>>>;

// Elements [begin, end) of a unit's range (parameters, gradient or optimizer state).
struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;
  bool operator==(const ElementRange&) const = default;
};

// Whether the plan can read experts as routed, and the one line why or why
// not (TrainingPlan::expert_fetch_reason); empty for a dense model.
bool plan_routes_expert_reads(const PlanInput& input, const StateHomes& homes, std::string& why);

// Unit u's experts are read as routed: the plan routes them and u is a
// sparse MLP piece or a piece of experts (false for -1, an operation of no
// unit).
bool routes_expert_reads(const TrainingPlan& plan, int unit);

// Unit u reads its experts as routed at several ranks: its routed forwards
// have a `route` and a `share` before them (above).
bool shares_routing(const TrainingPlan& plan, int unit);

// The part of the unit's byte `ranges` (sorted) in rank `rank`'s shard, as
// offsets in that shard; the ranges themselves at one rank.
std::vector<tiers::ByteRange> rank_ranges(const TrainingPlan& plan, int unit,
                                          const std::vector<tiers::ByteRange>& ranges, int rank);

// The bytes of those ranges in rank `rank`'s shard.
int64_t rank_bytes(const TrainingPlan& plan, int unit, const std::vector<tiers::ByteRange>& ranges,
                   int rank);

// The ranks [first, end) a count that takes a `rank` covers: that rank, or
// for -1 every rank (of which it keeps the most).
struct RankSpan {
  int first = 0;
  int end = 1;
};
RankSpan counted_ranks(const TrainingPlan& plan, int rank);

// The elements of unit u that are not its experts (what its fetch reads
// ahead, exactly), within the padded unit.
std::vector<ElementRange> fetched_elements(const TrainingPlan& plan, int unit);

// The elements of the `needed` experts not yet `loaded` (both [E]), the
// neighbours' merged; marks them loaded.
std::vector<ElementRange> expert_elements(const TrainingPlan& plan, int unit,
                                          const std::vector<uint8_t>& needed,
                                          std::vector<uint8_t>& loaded);

// Unit u's micro-batch gradients are added into their accumulator only
// where the micro-batch's tokens went (the experts they reached and what is
// not an expert; elsewhere the gradient is +0): u reads its experts as
// routed, one rank reduces in fp32 and the accumulator is fp32 host memory.
bool sums_routed_gradients(const TrainingPlan& plan, int unit);

// The ranges unit u's fetch reads ahead: all but the experts.
std::vector<tiers::ByteRange> fetched_ahead(const TrainingPlan& plan, int unit, uint64_t alignment);

// Reads ahead: a fetch for a backward whose forwards came before it in plan
// order depends on those forwards and reads, besides the rest, the experts
// they routed to. The micro-batches whose routing fetch operation `fetch`
// reads ahead (those of the forwards it depends on); empty when it reads
// only the rest.
std::vector<int> micros_read_ahead(const TrainingPlan& plan, int fetch);

// The experts fetch operation `fetch` reads ahead for `routing` ([unit]
// [micro][E]; null: every expert): the union over micros_read_ahead, [E],
// all 0 when it reads none.
std::vector<uint8_t> experts_read_ahead(const TrainingPlan& plan, int fetch,
                                        const StepRouting* routing);

// The ranges unit u's fetch reads: fetched_ahead and the `experts` ([E])
// read ahead, merged (a block the two share is read once). `apart`: each
// expert's whole blocks and fetched_ahead's as ranges of their own, a block
// they share in each (the counts of the worst case, below).
std::vector<tiers::ByteRange> fetch_ranges(const TrainingPlan& plan, int unit,
                                           const std::vector<uint8_t>& experts, uint64_t alignment,
                                           bool apart = false);

// The ranges a computation reads for the `needed` experts not yet `loaded`
// (both [E]); marks them loaded. Adjacent experts' blocks merge (a block
// two of them share is read once), unless `apart`.
std::vector<tiers::ByteRange> expert_reads(const TrainingPlan& plan, int unit,
                                           const std::vector<uint8_t>& needed,
                                           std::vector<uint8_t>& loaded, uint64_t alignment,
                                           bool apart = false);

// Per operation of plan.ops, the NVMe bytes rank `rank` reads of routed
// experts for `routing`, or for the worst case when null: a computation's
// (one rank) or a share's (several) reads, and a fetch's reads beyond its
// own bytes. A routed fetch's bytes are the fewest any rank's fetch reads
// of the rest (fetched_ahead; at one rank all of it). rank -1: at each
// operation the most any rank reads, as the plan's traffic counts it (at
// several ranks a bound on every rank's sum, not one rank's).
// The worst case: every expert routed, each expert's blocks counted apart.
// Where experts do not fill whole NVMe blocks, a block two experts share
// (or an expert and the fetch's read-ahead) is read once by each when they
// are read at different operations, so a routing that spreads them over a
// gather's micro-batches reads it twice; counted apart, the worst case
// bounds every routing.
std::vector<int64_t> routed_expert_reads_per_op(const TrainingPlan& plan,
                                                const StepRouting* routing, int rank = -1);

// The parameter bytes a step reads from NVMe for `routing`: the fetches'
// and the routed experts', at rank `rank`, or (-1) the most any one rank
// reads. (At several ranks the traffic's count, the most at each
// operation, may be more: ranks read most at different operations.)
int64_t routed_parameter_reads(const TrainingPlan& plan, const StepRouting& routing, int rank = -1);

// The parameter bytes a step reads from NVMe when every expert is routed
// to, at rank `rank`, or (-1) the most any one rank reads.
int64_t worst_parameter_reads(const TrainingPlan& plan, int rank = -1);

// A step's routing as the metrics file records it ("routing"): {unit name:
// [per micro-batch a string of E characters, '1' at e when expert e got a
// token, else '0']}, for the units that route their reads.
nlohmann::ordered_json routing_to_json(const TrainingPlan& plan, const StepRouting& routing);

// The inverse, for `plan`: the record's units must be the plan's routed
// units, each with the plan's micro-batches and experts; errors name `origin`
// and what to change.
Result<StepRouting> routing_from_json(const TrainingPlan& plan, const nlohmann::json& record,
                                      const std::string& origin);

// `steps` steps of an even routing, where no run has recorded one: each
// token of a micro-batch (at several ranks, of every rank's micro-batch:
// the ranks join their routings) picks k of the E experts uniformly, drawn
// from `seed` (the same draws on every machine); every routed unit of a
// layer takes its layer's. The step-time model's expected case
// (predict_routed_steps, core/plan/step_model.h).
std::vector<StepRouting> even_routings(const TrainingPlan& plan, int steps, uint64_t seed = 1);

// The parameter reads of recorded steps' routings (routed_parameter_reads)
// against the worst case: what `strata plan --routing` prints.
struct RecordedReads {
  int64_t steps = 0;
  int64_t worst = 0;  // worst_parameter_reads
  int64_t mean = 0;   // rounded down
  int64_t least = 0;
  int64_t most = 0;
};
RecordedReads recorded_parameter_reads(const TrainingPlan& plan,
                                       const std::vector<StepRouting>& steps);

}  // namespace strata
