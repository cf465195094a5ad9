// Threads as ranks: runs one function per rank on threads of this process, for the suites that
// run worlds in one process (tests/test_collectives.cpp over UCX communicators, the loopback
// worlds of tests/loopback_channel.hpp).
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <condition_variable>
#include <string>
#include <thread>
#include <vector>

namespace commux::test {

// Runs body(rank) for rank 0 .. n-1, each on its own thread, and joins them. Returns each rank's
// failure ("" if its body returned; else the exception's what()). Never hangs: ranks still
// running after `limit` make it print which ones and abort the process (a thread cannot be
// stopped safely, and the test run must end).
inline std::vector<std::string> run_threads(
    int n, const std::function<void(int rank)>& body,
    std::chrono::seconds limit = std::chrono::seconds(120)) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::string> errors;
    std::vector<bool> done;
    int left = 0;
  };
  auto sh = std::make_shared<Shared>();
  sh->errors.assign(static_cast<std::size_t>(n), "");
  sh->done.assign(static_cast<std::size_t>(n), false);
  sh->left = n;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([sh, &body, r] {
      std::string err;
      try {
        body(r);
      } catch (const std::exception& e) {
        err = e.what();
        if (err.empty()) err = "(exception with an empty message)";
      } catch (...) {
        err = "(non-standard exception)";
      }
      std::lock_guard<std::mutex> g(sh->mu);
      sh->errors[static_cast<std::size_t>(r)] = err;
      sh->done[static_cast<std::size_t>(r)] = true;
      if (--sh->left == 0) sh->cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lk(sh->mu);
    if (!sh->cv.wait_for(lk, limit, [&] { return sh->left == 0; })) {
      std::string running;
      for (int r = 0; r < n; ++r) {
        if (!sh->done[static_cast<std::size_t>(r)]) running += " " + std::to_string(r);
      }
      std::fprintf(stderr, "run_threads: ranks%s of %d still running after %lld s; aborting\n",
                   running.c_str(), n, static_cast<long long>(limit.count()));
      std::fflush(stderr);
      std::abort();
    }
  }
  for (auto& t : threads) t.join();
  return sh->errors;
}

}  // namespace commux::test
