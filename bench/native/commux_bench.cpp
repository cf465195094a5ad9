// commux_bench -- point-to-point benchmark of commux in the style of nccl-tests, checking every
// run's data (see bench_common.h for the pattern and which bytes are checked when).
//
//   commux_bench --mode pingpong|stream|memcpy|placement [--sizes LIST] [--reps N] [--window N]
//                [--quick] [--timeout SEC] [--json FILE]
//
// pingpong and stream fork two ranks that meet through a FileStore in a fresh temporary directory;
// the parent waits for them with a deadline and kills them when it passes, and each rank has its
// own alarm() watchdog. memcpy and placement run in the calling process.
//   pingpong   one-way latency (half the round trip): rank 0 send() then recv(), rank 1 the mirror
//   stream     rank 0 keeps a window of isends in flight, rank 1 as many irecvs; time per message
//   memcpy     single-thread memcpy of each size
//   placement  two threads pinned to CPUs 0 and 1 bounce a cache line for 50 ms; one-way ns tell
//              whether the VM's two vCPUs sit close (~50 ns) or far apart (~200 ns)
// A table goes to stderr, JSON to stdout (or --json). Exit status: 0 all data correct, 1 some byte
// wrong, 2 the run failed.
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "commux/communicator.hpp"
#include "commux/store.hpp"

namespace {

using commux::Buffer;
using commux::Communicator;
using commux::Request;

constexpr std::int64_t kDataTag = 1;
constexpr std::int64_t kSyncTag = 2;
constexpr std::int64_t kResultTag = 3;
constexpr std::int64_t kPlanTag = 4;
// stream's default window: 16 messages, but at most 4 MiB in flight. Each message in flight needs
// its own receive buffer (to check it); more than a few MiB of them fall out of the caches, which
// a benchmark that reuses one buffer (ucx_perftest) never does: 16 x 1 MiB ran at half the speed.
constexpr long kDefaultWindow = 16;
constexpr std::size_t kDefaultWindowBytes = std::size_t{4} << 20;
constexpr double kSizeBudgetUs = 1.5e6;  // timed repetitions of one size, together
constexpr long kMinBudgetReps = 3;
constexpr int kGraceS = 5;  // parent: beyond the children's watchdog, and after one rank failed
constexpr double kPlacementChunkUs = 5000;  // placement: 10 chunks of 5 ms
constexpr int kPlacementChunks = 10;

enum class Mode { kPingpong, kStream, kMemcpy, kPlacement };

struct Config {
  bench_args common{};
  Mode mode = Mode::kPingpong;
  long window = 0;  // 0: the default window
};

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kPingpong: return "pingpong";
    case Mode::kStream: return "stream";
    case Mode::kMemcpy: return "memcpy";
    case Mode::kPlacement: return "placement";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Command line

void usage(FILE* f) {
  std::fprintf(f,
               "usage: commux_bench --mode pingpong|stream|memcpy|placement [options]\n"
               "  --window N      stream: messages in flight (default %ld, or fewer to keep\n"
               "                  at most %zu MiB in flight)\n%s",
               kDefaultWindow, kDefaultWindowBytes >> 20, bench_common_usage());
}

bool parse_mode(const char* text, Mode* out) {
  for (Mode m : {Mode::kPingpong, Mode::kStream, Mode::kMemcpy, Mode::kPlacement}) {
    if (std::strcmp(text, mode_name(m)) == 0) {
      *out = m;
      return true;
    }
  }
  return false;
}

// Returns false (after a message) on a bad command line.
bool parse_args(int argc, char** argv, Config* cfg) {
  bench_args_init(&cfg->common);
  for (int i = 1; i < argc; ++i) {
    const int common = bench_parse_common(&cfg->common, argc, argv, &i);
    if (common < 0) return false;
    if (common > 0) continue;
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      usage(stdout);
      std::exit(BENCH_EXIT_OK);
    }
    if ((flag == "--mode" || flag == "--window") && i + 1 < argc) {
      const char* value = argv[++i];
      if (flag == "--window") cfg->window = std::atol(value);
      const bool ok = flag == "--mode" ? parse_mode(value, &cfg->mode) : cfg->window > 0;
      if (!ok) {
        std::fprintf(stderr, "commux_bench: bad %s '%s'\n", flag.c_str(), value);
        return false;
      }
    } else {
      std::fprintf(stderr, "commux_bench: unknown or incomplete flag '%s'\n", flag.c_str());
      usage(stderr);
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Buffers

// `slots` messages of `size` bytes, page aligned.
class Slab {
 public:
  Slab(std::size_t size, long slots) : bytes_(size * static_cast<std::size_t>(slots)) {
    void* p = nullptr;
    if (bytes_ > 0 && posix_memalign(&p, 4096, bytes_) != 0) throw std::bad_alloc();
    mem_.reset(static_cast<std::uint8_t*>(p));
  }
  std::uint8_t* data() { return mem_.get(); }
  std::size_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(std::uint8_t* p) const { std::free(p); }
  };
  std::size_t bytes_;
  std::unique_ptr<std::uint8_t, Free> mem_;
};

// A one-element buffer list, reused so that the timed loops allocate nothing themselves.
struct OneBuffer {
  std::vector<Buffer> list{Buffer{}};
  const std::vector<Buffer>& at(void* data, std::size_t size) {
    list[0] = Buffer{data, size};
    return list;
  }
};

// ---------------------------------------------------------------------------------------------
// Point-to-point repetitions. Each returns rank 0's time per message in µs (0 on rank 1) and adds
// the bytes it found wrong to `wrong`.

// Rank 1 says it is ready (buffers poisoned, receives posted) before rank 0 starts its clock.
void signal_ready(Communicator& c) { c.send(std::vector<Buffer>{}, 0, kSyncTag); }
void wait_ready(Communicator& c) { c.recv(std::vector<Buffer>{}, 1, kSyncTag); }

double pingpong_rank0(Communicator& c, const bench_plan& p, int rep, Slab& out, Slab& back,
                      std::uint64_t& wrong) {
  bench_fill_slab(out.data(), &p, rep);
  bench_poison(back.data(), back.bytes());
  wait_ready(c);
  const bool stamp = p.slots < p.iters;
  OneBuffer b;
  const double t0 = bench_now_us();
  for (long i = 0; i < p.iters; ++i) {
    void* o = bench_slot(out.data(), &p, i);
    if (stamp) bench_stamp(o, p.size, bench_key(rep, i));
    c.send(b.at(o, p.size), 1, kDataTag);
    void* r = bench_slot(back.data(), &p, i);
    c.recv(b.at(r, p.size), 1, kDataTag);
    if (stamp) wrong += bench_check_edges(r, p.size, bench_key(rep, i));
  }
  const double t1 = bench_now_us();
  wrong += bench_check_slab(back.data(), &p, rep);
  return (t1 - t0) / (2.0 * static_cast<double>(p.iters));
}

double pingpong_rank1(Communicator& c, const bench_plan& p, int rep, Slab& in,
                      std::uint64_t& wrong) {
  bench_poison(in.data(), in.bytes());
  signal_ready(c);
  const bool stamp = p.slots < p.iters;
  OneBuffer b;
  for (long i = 0; i < p.iters; ++i) {
    void* m = bench_slot(in.data(), &p, i);
    c.recv(b.at(m, p.size), 0, kDataTag);
    if (stamp) wrong += bench_check_edges(m, p.size, bench_key(rep, i));
    c.send(b.at(m, p.size), 0, kDataTag);  // echo
  }
  wrong += bench_check_slab(in.data(), &p, rep);
  return 0;
}

double stream_rank0(Communicator& c, const bench_plan& p, int rep, Slab& out) {
  bench_fill_slab(out.data(), &p, rep);
  wait_ready(c);
  const bool stamp = p.slots < p.iters;
  std::vector<Request> window(static_cast<std::size_t>(p.window));
  const double t0 = bench_now_us();
  for (long i = 0; i < p.iters; ++i) {
    Request& r = window[static_cast<std::size_t>(i % p.window)];
    if (r.valid()) r.wait();  // frees the slot of iteration i - window (slots >= window)
    void* o = bench_slot(out.data(), &p, i);
    if (stamp) bench_stamp(o, p.size, bench_key(rep, i));
    r = c.isend(Buffer{o, p.size}, 1, kDataTag);
  }
  for (Request& r : window) {
    if (r.valid()) r.wait();
  }
  c.recv(std::vector<Buffer>{}, 1, kSyncTag);  // rank 1 has everything
  const double t1 = bench_now_us();
  return (t1 - t0) / static_cast<double>(p.iters);
}

double stream_rank1(Communicator& c, const bench_plan& p, int rep, Slab& in, std::uint64_t& wrong) {
  bench_poison(in.data(), in.bytes());
  std::vector<Request> window(static_cast<std::size_t>(p.window));
  for (long i = 0; i < p.window; ++i) {
    window[static_cast<std::size_t>(i)] =
        c.irecv(Buffer{bench_slot(in.data(), &p, i), p.size}, 0, kDataTag);
  }
  signal_ready(c);
  const bool stamp = p.slots < p.iters;
  for (long i = 0; i < p.iters; ++i) {
    Request& r = window[static_cast<std::size_t>(i % p.window)];
    r.wait();
    if (stamp) wrong += bench_check_edges(bench_slot(in.data(), &p, i), p.size, bench_key(rep, i));
    if (i + p.window < p.iters) {
      r = c.irecv(Buffer{bench_slot(in.data(), &p, i + p.window), p.size}, 0, kDataTag);
    }
  }
  c.send(std::vector<Buffer>{}, 0, kSyncTag);
  wrong += bench_check_slab(in.data(), &p, rep);
  return 0;
}

double p2p_rep(Communicator& c, Mode mode, const bench_plan& p, int rep, Slab& a, Slab& b,
               std::uint64_t& wrong) {
  const bool rank0 = c.rank() == 0;
  if (mode == Mode::kPingpong) {
    return rank0 ? pingpong_rank0(c, p, rep, a, b, wrong) : pingpong_rank1(c, p, rep, a, wrong);
  }
  return rank0 ? stream_rank0(c, p, rep, a) : stream_rank1(c, p, rep, a, wrong);
}

bench_plan p2p_plan(const Config& cfg, std::size_t size) {
  const long by_bytes = std::max<long>(1, static_cast<long>(kDefaultWindowBytes / size));
  const long window = cfg.mode != Mode::kStream ? 1
                      : cfg.window > 0          ? cfg.window
                                                : std::min(kDefaultWindow, by_bytes);
  return bench_make_plan(&cfg.common, size, BENCH_P2P_REP_BYTES, BENCH_P2P_MAX_ITERS, window);
}

bench_row make_row(Mode mode, const bench_plan& p, std::vector<double>& samples,
                   std::uint64_t wrong) {
  bench_row row{};
  row.mode = mode_name(mode);
  row.size = p.size;
  row.iters = p.iters;
  row.reps = p.reps;
  bench_summarize(samples.data(), static_cast<int>(samples.size()), &row.time_us_median,
                  &row.time_us_min);
  row.gbps = static_cast<double>(p.size) / (row.time_us_median * 1e3);
  row.wrong = wrong;
  return row;
}

// When the warm-up's pace says the timed repetitions would take longer than kSizeBudgetUs (a slow
// transport), rank 0 lowers the iteration count, then the repetitions (to kMinBudgetReps); rank 1
// learns both from rank 0.
void fit_to_budget(Communicator& c, Mode mode, double warm_us_per_msg, bench_plan& p) {
  long plan[2] = {p.iters, p.reps};
  if (c.rank() == 0) {
    const double rep_us = warm_us_per_msg * (mode == Mode::kPingpong ? 2.0 : 1.0);  // per iteration
    const double iters_fit = kSizeBudgetUs / (rep_us * p.reps);
    plan[0] = std::min(p.iters, static_cast<long>(iters_fit));
    const double reps_fit = kSizeBudgetUs / (rep_us * std::max(plan[0], BENCH_MIN_ITERS));
    plan[1] = std::clamp(static_cast<long>(reps_fit), std::min<long>(kMinBudgetReps, p.reps),
                         static_cast<long>(p.reps));
  }
  OneBuffer b;
  if (c.rank() == 0) {
    c.send(b.at(plan, sizeof(plan)), 1, kPlanTag);
  } else {
    c.recv(b.at(plan, sizeof(plan)), 0, kPlanTag);
  }
  bench_limit_iters(&p, plan[0]);
  p.reps = static_cast<int>(plan[1]);
}

// One size: a warm-up repetition (checked, not timed), then p.reps timed ones. Rank 1 reports its
// wrong bytes to rank 0, whose row counts both.
bench_row p2p_size(Communicator& c, const Config& cfg, std::size_t size) {
  bench_plan p = p2p_plan(cfg, size);
  const bool echo_slab = cfg.mode == Mode::kPingpong && c.rank() == 0;
  Slab a(p.size, p.slots);
  Slab b(p.size, echo_slab ? p.slots : 0);
  std::uint64_t wrong = 0;
  fit_to_budget(c, cfg.mode, p2p_rep(c, cfg.mode, p, 0, a, b, wrong), p);
  std::vector<double> samples;
  for (int rep = 1; rep <= p.reps; ++rep) {
    samples.push_back(p2p_rep(c, cfg.mode, p, rep, a, b, wrong));
  }
  OneBuffer w;
  if (c.rank() == 1) {
    c.send(w.at(&wrong, sizeof(wrong)), 0, kResultTag);
    return bench_row{};
  }
  std::uint64_t peer_wrong = 0;
  c.recv(w.at(&peer_wrong, sizeof(peer_wrong)), 1, kResultTag);
  return make_row(cfg.mode, p, samples, wrong + peer_wrong);
}

// ---------------------------------------------------------------------------------------------
// Output

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

std::uint64_t total_wrong(const std::vector<bench_row>& rows) {
  std::uint64_t n = 0;
  for (const bench_row& r : rows) n += r.wrong;
  return n;
}

int report(const Config& cfg, const std::vector<bench_row>& rows,
           const std::vector<bench_kv>& info) {
  if (bench_write_json(cfg.common.json_path, "commux_bench", info.data(),
                       static_cast<int>(info.size()), rows.data(),
                       static_cast<int>(rows.size())) != 0) {
    return BENCH_EXIT_ERROR;
  }
  return total_wrong(rows) > 0 ? BENCH_EXIT_WRONG : BENCH_EXIT_OK;
}

// ---------------------------------------------------------------------------------------------
// Ranks (forked children) and the parent that watches them

int rank_main(const Config& cfg, const std::string& dir, int rank) {
  const std::string who = "commux_bench rank " + std::to_string(rank);
  bench_arm_watchdog(cfg.common.timeout_s, who.c_str());
  try {
    Communicator comm(std::make_shared<commux::FileStore>(dir), rank, 2);
    const commux::RuntimeInfo& ri = comm.runtime_info();
    if (rank == 0) {
      std::fprintf(stderr, "# commux_bench %s: UCX %s, transports %s, UCX settings: %s\n",
                   mode_name(cfg.mode), ri.ucx_version.c_str(), join(ri.transports, ",").c_str(),
                   ri.user_settings.empty() ? "(none)" : join(ri.user_settings, " ").c_str());
      bench_print_header(stderr);
    }
    std::vector<bench_row> rows;
    for (int s = 0; s < cfg.common.nsizes; ++s) {
      rows.push_back(p2p_size(comm, cfg, cfg.common.sizes[s]));
      if (rank == 0) bench_print_row(stderr, &rows.back());
    }
    if (rank != 0) return BENCH_EXIT_OK;
    const std::string transports = join(ri.transports, ",");
    const std::string settings = join(ri.user_settings, " ");
    const std::string defaults = join(ri.applied_defaults, " ");
    return report(cfg, rows,
                  {{"ucx_version", ri.ucx_version.c_str()},
                   {"transports", transports.c_str()},
                   {"ucx_settings", settings.c_str()},
                   {"commux_defaults", defaults.c_str()}});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", who.c_str(), e.what());
    return BENCH_EXIT_ERROR;
  }
}

std::string make_temp_dir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "commux_bench.XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) {
    throw std::system_error(errno, std::generic_category(), "mkdtemp " + pattern);
  }
  return pattern;
}

// Exit code of one child, with a message for anything but a clean exit.
int child_status(int rank, int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  std::fprintf(stderr, "commux_bench: rank %d killed by signal %d\n", rank, WTERMSIG(status));
  return BENCH_EXIT_ERROR;
}

// Waits for both ranks; kills what is left at the deadline, or kGraceS after one rank failed.
int wait_ranks(const pid_t pids[2], int timeout_s) {
  int codes[2] = {-1, -1};
  double deadline = bench_now_us() + (timeout_s + kGraceS) * 1e6;
  while (codes[0] < 0 || codes[1] < 0) {
    for (int r = 0; r < 2; ++r) {
      int status = 0;
      if (codes[r] >= 0 || waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
      codes[r] = child_status(r, status);
      if (codes[r] == BENCH_EXIT_ERROR) {
        deadline = std::min(deadline, bench_now_us() + kGraceS * 1e6);
      }
    }
    if (bench_now_us() > deadline) {
      for (int r = 0; r < 2; ++r) {
        if (codes[r] >= 0) continue;
        std::fprintf(stderr, "commux_bench: rank %d did not finish in time, killing it\n", r);
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        codes[r] = BENCH_EXIT_ERROR;
      }
    }
    usleep(2000);
  }
  return std::max(codes[0], codes[1]);
}

int run_ranks(const Config& cfg) {
  const std::string dir = make_temp_dir();
  std::fflush(nullptr);  // nothing buffered may be written twice
  pid_t pids[2] = {-1, -1};
  for (int r = 0; r < 2; ++r) {
    pids[r] = fork();
    if (pids[r] == 0) {
      const int code = rank_main(cfg, dir, r);
      std::fflush(nullptr);
      _exit(code);
    }
    if (pids[r] < 0) {
      std::perror("commux_bench: fork");
      if (r == 1) kill(pids[0], SIGKILL);
      std::filesystem::remove_all(dir);
      return BENCH_EXIT_ERROR;
    }
  }
  const int code = wait_ranks(pids, cfg.common.timeout_s);
  std::filesystem::remove_all(dir);
  return code;
}

// ---------------------------------------------------------------------------------------------
// memcpy

double memcpy_rep(const bench_plan& p, int rep, Slab& src, Slab& dst, std::uint64_t& wrong) {
  const std::uint64_t key = bench_key(rep, 0);
  bench_fill(src.data(), p.size, key);
  bench_poison(dst.data(), p.size);
  const double t0 = bench_now_us();
  for (long i = 0; i < p.iters; ++i) {
    std::memcpy(dst.data(), src.data(), p.size);
    __asm__ __volatile__("" : : "r"(dst.data()) : "memory");  // every copy happens
  }
  const double t1 = bench_now_us();
  wrong += bench_check(dst.data(), p.size, key, key);
  return (t1 - t0) / static_cast<double>(p.iters);
}

bench_row memcpy_size(const Config& cfg, std::size_t size) {
  const bench_plan p =
      bench_make_plan(&cfg.common, size, BENCH_COPY_REP_BYTES, BENCH_COPY_MAX_ITERS, 1);
  Slab src(size, 1);
  Slab dst(size, 1);
  std::vector<double> samples;
  std::uint64_t wrong = 0;
  for (int rep = 0; rep <= p.reps; ++rep) {
    const double us = memcpy_rep(p, rep, src, dst, wrong);
    if (rep > 0) samples.push_back(us);
  }
  return make_row(Mode::kMemcpy, p, samples, wrong);
}

int run_memcpy(const Config& cfg) {
  bench_print_header(stderr);
  std::vector<bench_row> rows;
  for (int s = 0; s < cfg.common.nsizes; ++s) {
    rows.push_back(memcpy_size(cfg, cfg.common.sizes[s]));
    bench_print_row(stderr, &rows.back());
  }
  return report(cfg, rows, {});
}

// ---------------------------------------------------------------------------------------------
// placement

void pin(std::thread::native_handle_type thread, int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  const int rc = pthread_setaffinity_np(thread, sizeof(set), &set);
  if (rc != 0) {
    throw std::system_error(rc, std::generic_category(), "pinning to CPU " + std::to_string(cpu));
  }
}

// One cache line bounced between CPU 0 (odd values) and CPU 1 (even values).
struct alignas(64) Line {
  std::atomic<std::uint64_t> value{0};
};

// One-way handoff time in µs over one chunk of kPlacementChunkUs.
double bounce_chunk(Line& line, std::uint64_t& v) {
  const double t0 = bench_now_us();
  long handoffs = 0;
  double t1 = t0;
  while (t1 - t0 < kPlacementChunkUs) {
    for (int k = 0; k < 256; ++k) {
      line.value.store(++v, std::memory_order_release);
      while (line.value.load(std::memory_order_acquire) == v) {
      }
      ++v;
    }
    handoffs += 512;
    t1 = bench_now_us();
  }
  return (t1 - t0) / static_cast<double>(handoffs);
}

int run_placement(const Config& cfg) {
  Line line;
  std::atomic<bool> stop{false};
  std::thread echo([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      const std::uint64_t v = line.value.load(std::memory_order_acquire);
      if (v % 2 == 1) line.value.store(v + 1, std::memory_order_release);
    }
  });
  std::vector<double> samples;
  try {
    pin(echo.native_handle(), 1);
    pin(pthread_self(), 0);
    std::uint64_t v = 0;
    for (int c = 0; c < kPlacementChunks; ++c) samples.push_back(bounce_chunk(line, v));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "commux_bench placement: %s\n", e.what());
  }
  stop.store(true);
  echo.join();
  if (samples.empty()) return BENCH_EXIT_ERROR;
  bench_plan p{};
  p.size = sizeof(Line);
  p.reps = static_cast<int>(samples.size());
  const bench_row row = make_row(Mode::kPlacement, p, samples, 0);
  std::fprintf(stderr,
               "placement: cache-line handoff CPU 0 <-> 1: %.0f ns one-way (median), %.0f ns min\n",
               row.time_us_median * 1e3, row.time_us_min * 1e3);
  return report(cfg, {row}, {});
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  if (!parse_args(argc, argv, &cfg)) return BENCH_EXIT_ERROR;
  try {
    switch (cfg.mode) {
      case Mode::kMemcpy: return run_memcpy(cfg);
      case Mode::kPlacement: return run_placement(cfg);
      case Mode::kPingpong:
      case Mode::kStream: return run_ranks(cfg);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "commux_bench: %s\n", e.what());
  }
  return BENCH_EXIT_ERROR;
}
