// commux_coll_bench -- commux's C++ collectives (commux/collectives.hpp) under bench/coll_bench.py:
// every op of the suite sized, timed and checked as mpi_coll and the torch.distributed ranks do
// (coll_common.h).
//
//   commux_coll_bench --np N [--ops LIST] [--sizes LIST] [--reps N] ... [--json FILE]
//
// Like commux_bench, it forks the ranks itself; they meet through a FileStore in a fresh temporary
// directory, each has an alarm() watchdog, and the parent kills whatever is left at the deadline
// (or a few seconds after one rank failed). p2p is a ring of Communicator::irecv + isend; the
// collectives run with a coll::Context whose tag counts up (every rank calls the same sequence).
// A table goes to stderr, JSON to stdout (or --json). Exit status: 0 all data correct, 1 some
// element wrong, 2 the run failed.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <new>
#include <string>
#include <system_error>
#include <vector>

#include "coll_common.h"
#include "commux/collectives.hpp"
#include "commux/communicator.hpp"
#include "commux/store.hpp"

namespace {

using commux::Buffer;
using commux::Communicator;
using commux::DataType;
using commux::ReduceOp;
namespace coll = commux::coll;

constexpr std::int64_t kDataTag = 1;
constexpr int kGraceS = 5;

struct Rank {
  Communicator* comm = nullptr;
  std::uint32_t next_tag = 1;
  std::chrono::steady_clock::time_point deadline;

  coll::Context ctx(const char* op_name) {
    coll::Context c;
    c.comm = comm;
    c.tag = next_tag++;
    c.deadline = deadline;
    c.op_name = op_name;
    return c;
  }
};

void run(void* p, coll_op op, const coll_shape* s, float* in, float* out) {
  Rank& r = *static_cast<Rank*>(p);
  const int me = r.comm->rank(), n = r.comm->size();
  const std::size_t bytes = s->count * sizeof(float), chunk = s->chunk * sizeof(float);
  switch (op) {
    case COLL_P2P: {
      commux::Request rr = r.comm->irecv(Buffer{out, bytes}, (me + n - 1) % n, kDataTag);
      commux::Request sr = r.comm->isend(Buffer{in, bytes}, (me + 1) % n, kDataTag);
      sr.wait();
      rr.wait();
      break;
    }
    case COLL_ALLREDUCE:
      coll::allreduce(r.ctx("allreduce"), in, s->count, DataType::kFloat32, ReduceOp::kSum);
      break;
    case COLL_BROADCAST: coll::broadcast(r.ctx("broadcast"), in, bytes, 0); break;
    case COLL_REDUCE:
      coll::reduce(r.ctx("reduce"), in, s->count, DataType::kFloat32, ReduceOp::kSum, 0);
      break;
    case COLL_ALLGATHER: coll::allgather(r.ctx("allgather"), in, chunk, out); break;
    case COLL_REDUCE_SCATTER: {
      const std::vector<std::size_t> counts(static_cast<std::size_t>(n), s->chunk);
      coll::reduce_scatter(r.ctx("reduce_scatter"), in, out, counts.data(), DataType::kFloat32,
                           ReduceOp::kSum);
      break;
    }
    case COLL_ALLTOALL: {
      std::vector<std::size_t> counts(static_cast<std::size_t>(n), chunk), displs(counts.size());
      for (std::size_t q = 0; q < displs.size(); ++q) displs[q] = q * chunk;
      coll::alltoallv(r.ctx("alltoall"), in, counts.data(), displs.data(), out, counts.data(),
                      displs.data());
      break;
    }
    case COLL_BARRIER:
    case COLL_NOPS: coll::barrier(r.ctx("barrier")); break;
  }
}

void barrier(void* p) { coll::barrier(static_cast<Rank*>(p)->ctx("bench barrier")); }

void share_plan(void* p, long plan[2]) {
  coll::broadcast(static_cast<Rank*>(p)->ctx("bench plan"), plan, 2 * sizeof(long), 0);
}

void gather_results(void* p, double* times, int reps, std::uint64_t* wrong) {
  Rank& r = *static_cast<Rank*>(p);
  std::int64_t w = static_cast<std::int64_t>(*wrong);
  coll::reduce(r.ctx("bench times"), times, static_cast<std::size_t>(reps), DataType::kFloat64,
               ReduceOp::kMax, 0);
  coll::reduce(r.ctx("bench wrong"), &w, 1, DataType::kInt64, ReduceOp::kSum, 0);
  if (r.comm->rank() == 0) *wrong = static_cast<std::uint64_t>(w);
}

struct FreeFloats {
  void operator()(float* p) const { std::free(p); }
};

std::unique_ptr<float, FreeFloats> alloc_floats(std::size_t count) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, std::max<std::size_t>(count, 1) * sizeof(float)) != 0) {
    throw std::bad_alloc();
  }
  return std::unique_ptr<float, FreeFloats>(static_cast<float*>(p));
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

int rank_main(const coll_args& a, const std::string& dir, int rank) {
  const std::string who = "commux_coll_bench rank " + std::to_string(rank);
  bench_arm_watchdog(a.timeout_s, who.c_str());
  try {
    Communicator comm(std::make_shared<commux::FileStore>(dir), rank, a.np);
    Rank r;
    r.comm = &comm;
    r.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(a.timeout_s);
    std::size_t max_count = 1;
    for (int s = 0; s < a.nsizes; ++s) {
      max_count = std::max({max_count, coll_make_shape(COLL_ALLREDUCE, a.sizes[s], a.np).count,
                            coll_make_shape(COLL_ALLGATHER, a.sizes[s], a.np).count});
    }
    auto in = alloc_floats(max_count);
    auto out = alloc_floats(max_count);
    const coll_backend b = {&r, rank, a.np, run, barrier, share_plan, gather_results};
    std::vector<coll_row> rows;
    std::uint64_t wrong = 0;
    for (int o = 0; o < a.nops; ++o) {
      for (int s = 0; s < a.nsizes; ++s) {
        if (a.ops[o] == COLL_BARRIER && s > 0) break;  // one row: it moves no data
        rows.push_back(coll_run_size(&a, &b, a.ops[o], s, in.get(), out.get()));
        if (rank == 0) coll_print_row(stderr, &rows.back());
        wrong += rows.back().wrong;
      }
    }
    if (rank != 0) return COLL_EXIT_OK;
    const commux::RuntimeInfo& ri = comm.runtime_info();
    const std::string transports = join(ri.transports, ",");
    const std::string settings = join(ri.user_settings, " ");
    const std::string defaults = join(ri.applied_defaults, " ");
    const char* info[] = {"ucx_version",      ri.ucx_version.c_str(), "transports",
                          transports.c_str(), "ucx_settings",         settings.c_str(),
                          "commux_defaults",  defaults.c_str()};
    if (coll_write_json(a.json_path, "commux_coll_bench", "commux-cpp", a.np, info, 4, rows.data(),
                        static_cast<int>(rows.size())) != 0) {
      return COLL_EXIT_ERROR;
    }
    return wrong > 0 ? COLL_EXIT_WRONG : COLL_EXIT_OK;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", who.c_str(), e.what());
    return COLL_EXIT_ERROR;
  }
}

std::string make_temp_dir() {
  std::string pattern =
      (std::filesystem::temp_directory_path() / "commux_coll_bench.XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) {
    throw std::system_error(errno, std::generic_category(), "mkdtemp " + pattern);
  }
  return pattern;
}

int child_status(int rank, int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  std::fprintf(stderr, "commux_coll_bench: rank %d killed by signal %d\n", rank, WTERMSIG(status));
  return COLL_EXIT_ERROR;
}

// Waits for every rank; kills what is left at the deadline, or kGraceS after one rank failed.
int wait_ranks(const std::vector<pid_t>& pids, int timeout_s) {
  std::vector<int> codes(pids.size(), -1);
  double deadline = bench_now_us() + (timeout_s + kGraceS) * 1e6;
  auto pending = [&] { return std::count(codes.begin(), codes.end(), -1) > 0; };
  while (pending()) {
    for (std::size_t r = 0; r < pids.size(); ++r) {
      int status = 0;
      if (codes[r] >= 0 || waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
      codes[r] = child_status(static_cast<int>(r), status);
      if (codes[r] == COLL_EXIT_ERROR)
        deadline = std::min(deadline, bench_now_us() + kGraceS * 1e6);
    }
    if (bench_now_us() > deadline) {
      for (std::size_t r = 0; r < pids.size(); ++r) {
        if (codes[r] >= 0) continue;
        std::fprintf(stderr, "commux_coll_bench: rank %zu did not finish in time, killing it\n", r);
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        codes[r] = COLL_EXIT_ERROR;
      }
    }
    usleep(2000);
  }
  return *std::max_element(codes.begin(), codes.end());
}

int run_ranks(const coll_args& a) {
  const std::string dir = make_temp_dir();
  std::fflush(nullptr);  // nothing buffered may be written twice
  std::vector<pid_t> pids;
  for (int r = 0; r < a.np; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int code = rank_main(a, dir, r);
      std::fflush(nullptr);
      _exit(code);
    }
    if (pid < 0) {
      std::perror("commux_coll_bench: fork");
      for (pid_t p : pids) kill(p, SIGKILL);
      for (pid_t p : pids) waitpid(p, nullptr, 0);
      std::filesystem::remove_all(dir);
      return COLL_EXIT_ERROR;
    }
    pids.push_back(pid);
  }
  const int code = wait_ranks(pids, a.timeout_s);
  std::filesystem::remove_all(dir);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  coll_args a;
  if (coll_parse_args(&a, argc, argv, "commux_coll_bench") != 0) return COLL_EXIT_ERROR;
  if (a.np < 2) {
    std::fprintf(stderr, "commux_coll_bench: --np wants at least 2 ranks\n");
    return COLL_EXIT_ERROR;
  }
  try {
    return run_ranks(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "commux_coll_bench: %s\n", e.what());
  }
  return COLL_EXIT_ERROR;
}
