// The C++ test driver: `test_commux RANK SIZE HOST PORT` runs the checks for one rank; rank 0
// serves a TcpStore at HOST:PORT. Launch one process per rank, e.g.
//   for r in 0 1; do ./build/tests/test_commux $r 2 127.0.0.1 29581 & done; wait
// (tests/run_driver.sh does this). Exit status: 0 passed, 1 failed, 2 usage, 77 skipped.
//
// UCXPG_DEVICE selects where the messages live:
//   cpu (or unset)  host memory: the point-to-point checks (all_pairs, out_of_order_tags,
//                   same_tag_order, any_source, multi_buffer).
//   cuda            CUDA device memory (commux::Buffer with MemoryType::kCuda): the same
//                   point-to-point checks, then host-to-device and device-to-host messages
//                   (mixed_memory) and the collectives allreduce, broadcast and allgather on device
//                   buffers (staged through host memory by commux::coll). Data is prepared and
//                   verified on the host and copied to and from the device. The CUDA runtime is
//                   loaded at run time (tests/cuda_shim.hpp: COMMUX_CUDART, else libcudart.so.13/.12
//                   by name); nothing here links CUDA. Device = (LOCAL_RANK, else RANK) % devices.
//                   Where no CUDA runtime or device can be used, or the UCX in use offers no "cuda"
//                   memory type, every rank says what is missing and exits 77 (skipped); the ranks
//                   agree first, so none is left waiting. tests/run_driver_cuda.sh builds and runs
//                   this mode on 2 ranks.
// COMMUX_BENCH=1 turns it into a ping-pong latency benchmark of COMMUX_BENCH_V buffers
// (default 1) of COMMUX_BENCH_BYTES bytes each (default 8), run between ranks 0 and 1, in the
// memory UCXPG_DEVICE selects.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "checks.hpp"
#include "commux/settings.hpp"
#include "cuda_shim.hpp"

using namespace commux;
using namespace commux::test;

namespace {

constexpr int kSkipExit = 77;

long env_or(const char* name, long fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtol(v, nullptr, 10) : fallback;
}

struct Check {
  const char* name;
  std::function<void(Communicator&)> fn;
};

std::vector<Check> checks_in(Space& s, bool device) {
  std::vector<Check> v = {
      {"all_pairs", [&s](Communicator& c) { check_all_pairs_in(c, s); }},
      {"out_of_order_tags", [&s](Communicator& c) { check_out_of_order_tags_in(c, s); }},
      {"same_tag_order", [&s](Communicator& c) { check_same_tag_order_in(c, s); }},
      {"any_source", [&s](Communicator& c) { check_any_source_in(c, s); }},
      {"multi_buffer", [&s](Communicator& c) { check_multi_buffer_in(c, s); }}};
  if (device) {
    v.push_back({"mixed_memory", [&s](Communicator& c) { check_mixed_memory(c, s); }});
    v.push_back({"allreduce", [&s](Communicator& c) { check_coll_allreduce(c, s); }});
    v.push_back({"broadcast", [&s](Communicator& c) { check_coll_broadcast(c, s); }});
    v.push_back({"allgather", [&s](Communicator& c) { check_coll_allgather(c, s); }});
  }
  return v;
}

// `mode` prefixes each check's name in the report ("" in host memory, "cuda " on the device).
int run_checks(Communicator& c, const std::vector<Check>& checks, const char* mode) {
  int failed = 0;
  for (const Check& ch : checks) {
    try {
      ch.fn(c);
      std::printf("test_commux rank %d: %s%s ok\n", c.rank(), mode, ch.name);
    } catch (const std::exception& e) {
      std::printf("test_commux rank %d: %s%s FAILED: %s\n", c.rank(), mode, ch.name, e.what());
      ++failed;
      break;  // later checks would be out of step with the other ranks
    }
    std::fflush(stdout);
  }
  return failed;
}

int run_bench(Communicator& c, Space& s) {
  if (c.size() < 2) {
    std::fprintf(stderr, "test_commux: COMMUX_BENCH needs at least 2 ranks\n");
    return 2;
  }
  const int v = static_cast<int>(commux::settings().bench_v);
  const auto bytes = static_cast<std::size_t>(commux::settings().bench_bytes);
  const int iters = static_cast<int>(commux::settings().bench_iters);
  if (c.rank() > 1) return 0;
  const int peer = 1 - c.rank();
  std::vector<Msg> data(static_cast<std::size_t>(v));
  std::vector<Buffer> bufs;
  for (int i = 0; i < v; ++i) {
    data[static_cast<std::size_t>(i)] = Msg(s, filled(static_cast<std::uint64_t>(i), bytes));
    bufs.push_back(data[static_cast<std::size_t>(i)].buffer());
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
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    samples.push_back(us / iters / 2);
  }
  for (int i = 0; i < v; ++i) {
    check_filled(data[static_cast<std::size_t>(i)].fetch(), static_cast<std::uint64_t>(i), bytes);
  }
  std::sort(samples.begin(), samples.end());
  if (c.rank() == 0) {
    const std::string memory =
        s.type() == MemoryType::kHost
            ? std::string()
            : std::string("\"memory\": \"") + memory_type_name(s.type()) + "\", ";
    std::printf(
        "{\"bench\": \"pingpong\", %s\"tensors\": %d, \"bytes_each\": %zu, \"coalesce\": %s, "
        "\"one_way_us_median\": %.3f, \"one_way_us_min\": %.3f, \"wrong\": 0}\n",
        memory.c_str(), v, bytes, c.options().packing == Packing::kIov ? "true" : "false",
        samples[2], samples[0]);
  }
  return 0;
}

// True when every rank is ready (rank 0 collects the votes and tells everyone the outcome).
bool all_ranks_ready(Communicator& c, bool ready) {
  std::vector<unsigned char> vote(1, ready ? 1 : 0);
  if (c.rank() == 0) {
    std::vector<unsigned char> other(1);
    for (int p = 1; p < c.size(); ++p) {
      c.recv({buf(other)}, p, 0xFFFE);
      vote[0] = static_cast<unsigned char>(vote[0] & other[0]);
    }
    for (int p = 1; p < c.size(); ++p) c.send({buf(vote)}, p, 0xFFFD);
  } else {
    c.send({buf(vote)}, 0, 0xFFFE);
    c.recv({buf(vote)}, 0, 0xFFFD);
  }
  return vote[0] != 0;
}

bool has(const std::vector<std::string>& v, const char* s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "none" : s;
}

// UCXPG_DEVICE=cuda. `rt` is the runtime loaded before the Communicator (nullptr: `why` says why).
int run_cuda(Communicator& c, CudaRuntime* rt, std::string why) {
  const RuntimeInfo& info = c.runtime_info();
  if (rt == nullptr && why.empty()) why = "no CUDA runtime was loaded";
  if (!has(info.memory_types, "cuda")) {
    why += why.empty() ? "" : "; and ";
    why += "the UCX in use (" + info.ucx_version + ") offers memory types [" +
           joined(info.memory_types) +
           "], not cuda (UCX's CUDA transport needs a UCX built with CUDA, e.g. "
           "COMMUX_UCX_PROVIDER=wheel with libucx-cu13, plus libcuda.so.1 and a visible GPU)";
  }
  if (!all_ranks_ready(c, why.empty())) {
    if (why.empty()) why = "another rank cannot run them (its message says why)";
    std::printf(
        "test_commux rank %d: SKIP (exit %d): UCXPG_DEVICE=cuda, but the CUDA checks cannot "
        "run: %s\n",
        c.rank(), kSkipExit, why.c_str());
    return kSkipExit;
  }
  std::printf("test_commux rank %d: CUDA device %d of %d via %s; UCX %s, memory types [%s]\n",
              c.rank(), rt->device(), rt->device_count(), rt->library().c_str(),
              info.ucx_version.c_str(), joined(info.memory_types).c_str());
  std::fflush(stdout);
  CudaSpace space(*rt);
  if (commux::settings().bench) return run_bench(c, space);
  return run_checks(c, checks_in(space, true), "cuda ") == 0 ? 0 : 1;
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
  bool cuda = false;
  try {
    cuda = commux::settings().device_cuda;  // UCXPG_DEVICE; every variable is checked here
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_commux: %s\n", e.what());
    return 2;
  }
  ::alarm(static_cast<unsigned>(commux::settings().test_timeout_s));  // never hang
  try {
    // CUDA first: its context exists before UCX starts (as UCX advises).
    std::unique_ptr<CudaRuntime> rt;
    std::string cuda_missing;
    if (cuda) rt = CudaRuntime::open(static_cast<int>(env_or("LOCAL_RANK", rank)), &cuda_missing);
    auto store = std::make_shared<TcpStore>(argv[3], port, rank == 0);
    int rc;
    {
      Communicator comm(store, rank, size);
      if (cuda) {
        rc = run_cuda(comm, rt.get(), cuda_missing);
      } else if (commux::settings().bench) {
        rc = run_bench(comm, host_space());
      } else {
        rc = run_checks(comm, checks_in(host_space(), false), "") == 0 ? 0 : 1;
      }
      // Keep rank 0's store up until every rank is done with it.
      std::vector<unsigned char> token(1);
      if (rank == 0) {
        for (int p = 1; p < size; ++p) comm.recv({buf(token)}, kAnySource, 0xFFFF);
      } else {
        comm.send({buf(token)}, 0, 0xFFFF);
      }
    }
    if (rc == 0) std::printf("test_commux rank %d of %d: all checks passed\n", rank, size);
    return rc == 0 || rc == kSkipExit ? rc : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_commux rank %d: %s\n", rank, e.what());
    return 1;
  }
}
