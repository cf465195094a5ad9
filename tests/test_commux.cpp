// The C++ test driver: `test_commux RANK SIZE HOST PORT` runs the point-to-point checks for one
// rank; rank 0 serves a TcpStore at HOST:PORT. Launch one process per rank, e.g.
//   for r in 0 1; do ./build/tests/test_commux $r 2 127.0.0.1 29581 & done; wait
// COMMUX_BENCH=1 turns it into a ping-pong latency benchmark of COMMUX_BENCH_V buffers
// (default 1) of COMMUX_BENCH_BYTES bytes each (default 8), run between ranks 0 and 1.
// UCXPG_DEVICE=cuda is reserved for the CUDA checks (not built in this configuration).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "checks.hpp"

using namespace commux;
using namespace commux::test;

namespace {

long env_or(const char* name, long fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtol(v, nullptr, 10) : fallback;
}

int run_checks(Communicator& c) {
  struct Check {
    const char* name;
    void (*fn)(Communicator&);
  };
  const Check checks[] = {{"all_pairs", check_all_pairs},
                          {"out_of_order_tags", check_out_of_order_tags},
                          {"same_tag_order", check_same_tag_order},
                          {"any_source", check_any_source},
                          {"multi_buffer", check_multi_buffer}};
  int failed = 0;
  for (const Check& ch : checks) {
    try {
      ch.fn(c);
      std::printf("test_commux rank %d: %s ok\n", c.rank(), ch.name);
    } catch (const std::exception& e) {
      std::printf("test_commux rank %d: %s FAILED: %s\n", c.rank(), ch.name, e.what());
      ++failed;
      break;  // later checks would be out of step with the other ranks
    }
  }
  return failed;
}

int run_bench(Communicator& c) {
  if (c.size() < 2) {
    std::fprintf(stderr, "test_commux: COMMUX_BENCH needs at least 2 ranks\n");
    return 2;
  }
  const int v = static_cast<int>(env_or("COMMUX_BENCH_V", 1));
  const auto bytes = static_cast<std::size_t>(env_or("COMMUX_BENCH_BYTES", 8));
  const int iters = static_cast<int>(env_or("COMMUX_BENCH_ITERS", 20000));
  if (c.rank() > 1) return 0;
  const int peer = 1 - c.rank();
  std::vector<std::vector<unsigned char>> data(static_cast<std::size_t>(v));
  std::vector<Buffer> bufs;
  for (int i = 0; i < v; ++i) {
    data[static_cast<std::size_t>(i)] = filled(static_cast<std::uint64_t>(i), bytes);
    bufs.push_back(buf(data[static_cast<std::size_t>(i)]));
  }
  std::vector<double> samples;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < iters; ++it) {
      if (c.rank() == 0) {
        c.send(bufs, peer, 1);
        c.recv(bufs, peer, 1);
      } else {
        c.recv(bufs, peer, 1);
        c.send(bufs, peer, 1);
      }
    }
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    samples.push_back(us / iters / 2);
  }
  for (int i = 0; i < v; ++i) check_filled(data[static_cast<std::size_t>(i)], static_cast<std::uint64_t>(i), bytes);
  std::sort(samples.begin(), samples.end());
  if (c.rank() == 0) {
    std::printf("{\"bench\": \"pingpong\", \"tensors\": %d, \"bytes_each\": %zu, \"coalesce\": %s, "
                "\"one_way_us_median\": %.3f, \"one_way_us_min\": %.3f, \"wrong\": 0}\n",
                v, bytes, c.options().packing == Packing::kIov ? "true" : "false", samples[2],
                samples[0]);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s RANK SIZE HOST PORT\n", argv[0]);
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int size = std::atoi(argv[2]);
  const int port = std::atoi(argv[4]);
  const char* device = std::getenv("UCXPG_DEVICE");
  if (device != nullptr && std::strcmp(device, "cpu") != 0) {
    std::fprintf(stderr, "test_commux: UCXPG_DEVICE=%s is not supported by this build (CPU only)\n", device);
    return 2;
  }
  ::alarm(static_cast<unsigned>(env_or("COMMUX_TEST_TIMEOUT_S", 120)));  // never hang
  try {
    auto store = std::make_shared<TcpStore>(argv[3], port, rank == 0);
    int rc;
    {
      Communicator comm(store, rank, size);
      rc = std::getenv("COMMUX_BENCH") != nullptr ? run_bench(comm) : run_checks(comm);
      // Keep rank 0's store up until every rank is done with it.
      std::vector<unsigned char> token(1);
      if (rank == 0) {
        for (int p = 1; p < size; ++p) comm.recv({buf(token)}, kAnySource, 0xFFFF);
      } else {
        comm.send({buf(token)}, 0, 0xFFFF);
      }
    }
    if (rc == 0) std::printf("test_commux rank %d of %d: all checks passed\n", rank, size);
    return rc == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_commux rank %d: %s\n", rank, e.what());
    return 1;
  }
}
