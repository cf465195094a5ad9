// The multi-process harness (tests/harness.hpp) itself: it reports every way a rank can fail,
// including a rank that was to be killed and exited normally instead.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>

#include "harness.hpp"

using namespace commux::test;

namespace {

RunOptions killing(int rank) {
  RunOptions o;
  o.timeout_s = 20;
  o.expect_killed = {rank};
  return o;
}

TEST(Harness, RankKilledAsExpectedPasses) {
  run_procs(
      2,
      [](int rank, int, const std::string&) {
        if (rank == 1) ::raise(SIGKILL);
      },
      killing(1));
}

TEST(Harness, RankExpectedKilledThatExitsNormallyFails) {
  EXPECT_NONFATAL_FAILURE(run_procs(
                              2, [](int, int, const std::string&) {}, killing(1)),
                          "rank 1 of 2 was expected to be killed but exited normally");
}

TEST(Harness, RankExpectedKilledThatFailsAChecksFails) {
  EXPECT_NONFATAL_FAILURE(run_procs(
                              2,
                              [](int rank, int, const std::string&) {
                                if (rank == 1) CX_CHECK(rank == 0);
                              },
                              killing(1)),
                          "rank 1 of 2 was expected to be killed but exit code 3");
}

TEST(Harness, FailingRankIsReported) {
  EXPECT_NONFATAL_FAILURE(run_procs(3,
                                    [](int rank, int, const std::string&) {
                                      if (rank == 2) CX_CHECK(rank == 0);
                                    }),
                          "rank 2 of 3: exit code 3");
}

TEST(Harness, RankKilledUnexpectedlyIsReported) {
  EXPECT_NONFATAL_FAILURE(run_procs(2,
                                    [](int rank, int, const std::string&) {
                                      if (rank == 0) ::raise(SIGKILL);
                                    }),
                          "rank 0 of 2: killed by signal");
}

}  // namespace
