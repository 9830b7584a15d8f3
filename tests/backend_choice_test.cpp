// Choosing the backend at run time: a CUDA build on a machine without a GPU
// falls back to the CPU with a one-line notice; asking for CUDA there is an error.
#include <gtest/gtest.h>

#include "core/config/backend_choice.h"

namespace strata {
namespace {

TEST(BackendChoice, CpuIsAlwaysAvailable) {
  Result<BackendChoice> choice = choose_backend("cpu");
  ASSERT_TRUE(choice.is_ok());
  EXPECT_EQ(choice->kind, kernels::BackendKind::cpu);
  EXPECT_TRUE(choice->notice.empty());
}

TEST(BackendChoice, AutoPicksTheGpuOrSaysWhyNot) {
  const bool has_gpu = !kernels::query_gpus().devices.empty();
  Result<BackendChoice> choice = choose_backend("auto");
  ASSERT_TRUE(choice.is_ok());
  if (has_gpu) {
    EXPECT_EQ(choice->kind, kernels::BackendKind::cuda);
  } else {
    EXPECT_EQ(choice->kind, kernels::BackendKind::cpu);
    EXPECT_NE(choice->notice.find("using the CPU backend"), std::string::npos) << choice->notice;
    EXPECT_EQ(choice->notice.find('\n'), std::string::npos);
  }
}

TEST(BackendChoice, CudaWithoutAGpuIsAnErrorThatSaysWhatToDo) {
  if (!kernels::query_gpus().devices.empty()) GTEST_SKIP() << "a GPU is present";
  Result<BackendChoice> choice = choose_backend("cuda");
  ASSERT_FALSE(choice.is_ok());
  EXPECT_NE(choice.status().message().find("--backend cpu"), std::string::npos);
}

TEST(BackendChoice, UnknownNamesAreRefused) {
  EXPECT_FALSE(choose_backend("tpu").is_ok());
}

}  // namespace
}  // namespace strata
