// Runs `rank_main(dir, rank)` in `n` processes forked from this one, sharing a fresh temporary
// directory for a commux::FileStore; returns 0 when every rank exited 0, 1 otherwise (2: no
// directory). A rank that throws prints the error and fails. For the one-file C++ experiments
// (fiber_switch.cpp, schedule_burst.cpp, gap_cost.cpp), with the median they report.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

namespace commux_bench {

// The middle of `v` (its upper middle for an even count); `v` must not be empty.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename RankMain>
int run_forked_ranks(int n, const char* name, RankMain rank_main) {
  std::string dir =
      (std::filesystem::temp_directory_path() / (std::string(name) + ".XXXXXX")).string();
  if (::mkdtemp(dir.data()) == nullptr) return 2;
  for (int r = 0; r < n; ++r) {
    if (::fork() == 0) {
      int rc = 1;
      try {
        rc = rank_main(dir, r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      std::fflush(stdout);
      ::_exit(rc);
    }
  }
  int status = 0, bad = 0;
  while (::wait(&status) > 0) {
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++bad;
  }
  std::filesystem::remove_all(dir);
  return bad > 0 ? 1 : 0;
}

}  // namespace commux_bench
