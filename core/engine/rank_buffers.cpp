#include "core/engine/rank_buffers.h"

namespace strata {

Result<RankBuffers> RankBuffers::allocate(const TrainingPlan& plan, BufferOwner owner,
                                          const Allocate& allocate) {
  RankBuffers buffers;
  for (const PlanBuffer& b : plan.buffers) {
    if (b.owner != owner || b.tier == tiers::Tier::nvme) continue;
    std::vector<std::byte*>& copies = buffers.copies_[b.role];
    for (int k = 0; k < b.copies; ++k) {
      Result<std::byte*> block = allocate(b.tier, uint64_t(b.copy_bytes()), b.name);
      if (!block) return block.status();
      copies.push_back(*block);
    }
  }
  return buffers;
}

std::byte* RankBuffers::at(BufferRole role, int copy) const {
  auto found = copies_.find(role);
  if (found == copies_.end() || copy < 0 || copy >= int(found->second.size())) return nullptr;
  return found->second[size_t(copy)];
}

}  // namespace strata
