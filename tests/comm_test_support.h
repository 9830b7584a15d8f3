// Shared by the comm_* / gloo_comm / nccl_comm tests: a fresh seed printed
// for reruns, the check every one-line error gets, and a torchrun-style
// launch environment of rank r on 127.0.0.1 at a free port.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "io/base/status.h"

namespace strata::comm::testing {

inline uint32_t fresh_seed() {
  const uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  return seed;
}

// One line, holding every one of `parts`.
inline void expect_one_line_error(const Status& status, const std::vector<std::string>& parts) {
  ASSERT_FALSE(status.is_ok());
  EXPECT_EQ(status.message().find('\n'), std::string::npos) << status.message();
  for (const std::string& part : parts) {
    EXPECT_NE(status.message().find(part), std::string::npos)
        << "'" << part << "' missing from: " << status.message();
  }
}

inline LaunchEnvironment rank_of(int rank, int world, int port) {
  LaunchEnvironment env;
  env.rank = rank;
  env.world_size = world;
  env.local_rank = rank;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  env.source = "torchrun";
  return env;
}

inline int free_port() {
  Result<int> port = find_free_port();
  EXPECT_TRUE(port.is_ok()) << port.status().message();
  return port.is_ok() ? *port : 0;
}

}  // namespace strata::comm::testing
