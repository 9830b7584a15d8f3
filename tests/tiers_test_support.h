// Shared by the tiers_* tests: a store over a fresh O_DIRECT directory, fresh
// random seeds (printed, and taken from STRATA_TEST_SEED when set), and a
// quiet notice sink that remembers what it was told.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "io/fault_injection.h"
#include "io_test_support.h"
#include "tiers/tiered_store.h"

namespace strata::tiers::testing {

inline uint64_t fresh_seed(const char* test) {
  uint64_t seed = std::random_device{}();
  seed = (seed << 32) ^ std::random_device{}();
  if (const char* given = std::getenv("STRATA_TEST_SEED")) seed = std::strtoull(given, nullptr, 10);
  std::printf("%s: seed %llu (rerun with STRATA_TEST_SEED=%llu)\n", test,
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  return seed;
}

struct Notices {
  std::mutex mutex;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& line) {
      std::lock_guard lock(mutex);
      lines.push_back(line);
    };
  }
};

struct StoreSizes {
  uint64_t device = 4 << 20;
  uint64_t host = 8 << 20;
  uint64_t nvme = 64 << 20;
};

inline Result<std::unique_ptr<TieredStore>> open_test_store(
    const std::string& directory, StoreSizes sizes, Notices& notices,
    std::shared_ptr<io::FaultInjector> injector = nullptr) {
  TieredStoreOptions options;
  options.device_capacity = sizes.device;
  options.host_capacity = sizes.host;
  options.nvme_capacity = sizes.nvme;
  options.io.paths = {directory};
  options.io.block_size = 64 << 10;
  options.io.queue_depth = 8;
  options.io.max_retries = 8;
  options.io.fault_injector = std::move(injector);
  options.use_gpu = false;  // the CPU stand-in: these tests run anywhere
  options.notice = notices.sink();
  return TieredStore::open(options);
}

inline std::vector<std::byte> random_bytes(size_t size, std::mt19937_64& random) {
  std::vector<std::byte> bytes(size);
  io::testing::fill_random(bytes.data(), size, random());
  return bytes;
}

}  // namespace strata::tiers::testing
