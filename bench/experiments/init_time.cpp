// init_time: how long a commux::Communicator takes to start, N ranks forked on this host that meet
// through a FileStore; each rank leaves at once after its start, as a short job's ranks do.
//
//   g++ -O2 -std=c++17 -Iinclude bench/experiments/init_time.cpp -Lbuild -lcommux
//       -Wl,-rpath,$PWD/build -o /tmp/init_time       (one command line)
//   UCX_NET_DEVICES=lo /tmp/init_time RANKS REPETITIONS
//
// Prints the median and the largest over repetitions of the slowest rank's start (construction of
// the Communicator), and how many ranks did not exit cleanly (a crash, or an error at start). For a
// change to the start-up: build the library before and after and run both (absolute times drift
// between runs on a shared machine; compare runs made back to back).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "commux/communicator.hpp"
#include "commux/store.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: init_time RANKS REPETITIONS\n");
    return 2;
  }
  const int np = std::atoi(argv[1]), reps = std::atoi(argv[2]);
  if (np < 1 || reps < 1) return 2;
  std::vector<double> slowest;
  int bad = 0;
  for (int rep = 0; rep < reps; ++rep) {
    std::string dir = (std::filesystem::temp_directory_path() / "commux_init.XXXXXX").string();
    if (::mkdtemp(dir.data()) == nullptr) return 2;
    int fds[2];
    if (::pipe(fds) != 0) return 2;
    for (int r = 0; r < np; ++r) {
      if (::fork() == 0) {
        ::close(fds[0]);
        double ms = -1;
        try {
          const auto t0 = std::chrono::steady_clock::now();
          commux::Communicator comm(std::make_shared<commux::FileStore>(dir), r, np);
          ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                   .count();
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        }
        const bool sent = ::write(fds[1], &ms, sizeof ms) == static_cast<ssize_t>(sizeof ms);
        ::_exit(ms >= 0 && sent ? 0 : 1);
      }
    }
    ::close(fds[1]);
    double worst = 0;
    double ms = 0;
    while (::read(fds[0], &ms, sizeof ms) == static_cast<ssize_t>(sizeof ms)) {
      worst = std::max(worst, ms);
    }
    ::close(fds[0]);
    int status = 0;
    while (::wait(&status) > 0) {
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++bad;
    }
    std::filesystem::remove_all(dir);
    slowest.push_back(worst);
  }
  std::sort(slowest.begin(), slowest.end());
  std::printf("%d ranks: start median %.2f ms, largest %.2f ms over %d; %d rank(s) failed\n", np,
              slowest[slowest.size() / 2], slowest.back(), reps, bad);
  return bad > 0 ? 1 : 0;
}
