#include "tiers/nvme_tier.h"

#include <fmt/format.h>

#include "io/swap_directory.h"
#include "io/base/sizes.h"

namespace strata::tiers {

NvmeTier::NvmeTier(std::unique_ptr<io::IoEngine> engine, io::FileId file, uint64_t capacity)
    : engine_(std::move(engine)),
      file_(file),
      allocator_(capacity, engine_->alignment(), "nvme tier",
                 "the NVMe budget (free space on the NVMe paths)") {}

Result<std::unique_ptr<NvmeTier>> NvmeTier::open(NvmeTierOptions options) {
  if (options.io.paths.empty())
    return Status::error("nvme tier: no NVMe path given; the tier needs at least one directory");
  Result<std::unique_ptr<io::IoEngine>> engine = io::IoEngine::open(options.io);
  if (!engine) return engine.status().with_context("nvme tier");
  const uint64_t alignment = (*engine)->alignment();
  const uint64_t stripe = (*engine)->options().block_size;
  uint64_t capacity = (options.capacity + stripe - 1) / stripe * stripe;
  if (capacity == 0) capacity = stripe;
  // Striping puts about capacity / paths on each path (one stripe more at most).
  const uint64_t per_path = capacity / options.io.paths.size() + stripe;
  for (const std::string& path : options.io.paths) {
    const uint64_t free = io::free_bytes(path);
    if (free < per_path)
      return Status::error(fmt::format(
          "nvme tier: {} needs {} on each of its {} path(s) but {} has {} free; free space there, "
          "add NVMe paths or lower the state kept on NVMe",
          format_bytes(capacity), format_bytes(per_path), options.io.paths.size(), path,
          format_bytes(free)));
  }
  Result<io::FileId> file = (*engine)->create_file(options.file_name, capacity);
  if (!file) return file.status().with_context("nvme tier");
  (void)alignment;
  return std::unique_ptr<NvmeTier>(new NvmeTier(std::move(*engine), *file, capacity));
}

NvmeTier::~NvmeTier() {
  if (engine_ && file_ >= 0) (void)engine_->remove_file(file_);
}

Result<NvmeExtent> NvmeTier::allocate(uint64_t bytes, std::string_view what) {
  Result<uint64_t> offset = allocator_.allocate(bytes, what);
  if (!offset) return offset.status();
  return NvmeExtent{*offset, bytes};
}

void NvmeTier::free(const NvmeExtent& extent) {
  allocator_.free(extent.offset);
}

io::IoHandle NvmeTier::read(const NvmeExtent& extent, uint64_t offset, void* buffer,
                            uint64_t length) {
  return engine_->read(file_, extent.offset + offset, buffer, length);
}

io::IoHandle NvmeTier::write(const NvmeExtent& extent, uint64_t offset, const void* buffer,
                             uint64_t length) {
  return engine_->write(file_, extent.offset + offset, buffer, length);
}

std::string NvmeTier::description() const {
  const io::IoOptions& options = engine_->options();
  std::string paths;
  for (const std::string& path : options.paths) paths += (paths.empty() ? "" : ", ") + path;
  return fmt::format("{} striped over {} ({} blocks, queue depth {}, {})",
                     format_bytes(usage().capacity), paths,
                     format_bytes(options.block_size), options.queue_depth,
                     engine_->backend_description());
}

}  // namespace strata::tiers
