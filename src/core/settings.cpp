// The table of commux's environment variables and their one parser (see commux/settings.hpp).
#include "commux/settings.hpp"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "commux/error.hpp"
#include "log.hpp"

namespace commux {

namespace {

constexpr bool kPerComm = true;
constexpr bool kOnce = false;

}  // namespace

const std::vector<Setting>& settings_table() {
  static const std::vector<Setting> table = {
      {"COMMUX_COALESCE", "bool", "off", kPerComm,
       "send a multi-buffer message as one UCX message (IOV) instead of one per buffer; every rank "
       "must agree, and a mismatch is reported as an error on the receiver"},
      {"COMMUX_GROUP", "bool", "off", kPerComm,
       "the torch backend defers the sends and receives of a coalescing window (batch_isend_irecv, "
       "startCoalescing/endCoalescing) and posts them together when it ends, receives first; "
       "wire-compatible with a peer that does not defer"},
      {"COMMUX_SPIN_US", "int", "100", kPerComm,
       "a waiter polls this long before it sleeps on the worker's event fd; the torch backend's "
       "short "
       "collectives and its collective thread poll as long before sleeping"},
      {"COMMUX_TIMEOUT_MS", "int", "300000", kPerComm,
       "default deadline of every wait and of bootstrap lookups"},
      {"COMMUX_SHUTDOWN_TIMEOUT_MS", "int", "3000", kPerComm,
       "bound on closing endpoints at shutdown, and (at most 1 s of it) on a torch group's "
       "wait at destroy for its own calls still running and for its peers to destroy it too"},
      {"COMMUX_WAKEUP", "auto/on/off", "auto", kPerComm,
       "on: the progress thread sleeps on the worker's event fd instead of polling; auto: only "
       "when UCX_TLS excludes shared memory; off: never"},
      {"COMMUX_YIELD", "auto/on/off", "auto", kPerComm,
       "a spinning waiter's polls that find nothing to do yield the CPU (sched_yield): auto: after "
       "a few microseconds (for 100 ms not at all after a yield that took over 200 us: a foreign "
       "task holds the CPU), and at once when the group's ranks on this host outnumber the CPUs "
       "of the process's affinity mask; on: at once; off: never"},
      {"COMMUX_UCX_DEFAULTS", "bool", "on", kPerComm, "off disables commux's UCX defaults below"},
      {"COMMUX_ATEN_REDUCE", "bool", "off", kPerComm,
       "the torch backend's CPU collectives run through the device path's code (scratch, copies "
       "and "
       "reductions by ATen) instead of commux's own kernels; a check of that code without a GPU, "
       "1.03-1.35x slower here (bench/experiments/aten_reduce_ab.py)"},
      {"COMMUX_CALLER_RUNS", "bool", "on", kPerComm,
       "the torch backend's Work.wait() on a CPU collective that has not started runs it (and any "
       "of its group queued before it) on the waiting thread, with no hand-off to the group's "
       "collective thread; off: the collective thread runs every collective"},
      {"COMMUX_SCHEDULE", "bool", "off", kPerComm,
       "the torch backend starts an async CPU collective on the calling thread as a schedule "
       "(coll::Schedule): its first step is posted before the call returns, and later steps run "
       "on whichever thread resumes it (a waiter in Work.wait(), else a collective thread, or the "
       "progress thread with COMMUX_PROGRESS_RESUMES), "
       "holding no thread while it waits (needs COMMUX_CALLER_RUNS); off: a collective thread runs "
       "it whole. Off by default: an async call whose Work is waited at once measures faster "
       "without; code that waits on get_future(), and DDP with small buckets, faster with it "
       "(docs/torch-backend.md)"},
      {"COMMUX_PROGRESS_RESUMES", "bool", "off", kPerComm,
       "with COMMUX_SCHEDULE, the core's progress thread resumes the schedules nobody waits for "
       "(and starts those queued behind them) between its progress calls; off: a collective "
       "thread runs them to their end. Off by default: slower than that up to 256 KiB, measured "
       "on 2 cores (docs/torch-backend.md)"},
      {"COMMUX_INFLIGHT", "auto/int", "auto", kPerComm,
       "the torch backend runs up to this many CPU collectives of one group at once, started in "
       "issue order; one whose tensors overlap a running one's waits for it, and a barrier, a "
       "device collective or a sparse one runs alone; auto: 16 schedules (COMMUX_SCHEDULE), and "
       "of the collectives that hold a thread 2 when the process's affinity mask has more CPUs "
       "than the group has ranks on this host, else 1"},
      {"COMMUX_ALGO_ALLREDUCE", "name", "auto", kOnce,
       "forces the allreduce algorithm (see docs/collectives.md); auto: the selector chooses"},
      {"COMMUX_ALGO_BROADCAST", "name", "auto", kOnce, "forces the broadcast algorithm"},
      {"COMMUX_ALGO_REDUCE", "name", "auto", kOnce, "forces the reduce algorithm"},
      {"COMMUX_ALGO_ALLGATHER", "name", "auto", kOnce,
       "forces the allgather (and allgatherv) algorithm"},
      {"COMMUX_ALGO_REDUCE_SCATTER", "name", "auto", kOnce, "forces the reduce_scatter algorithm"},
      {"COMMUX_ALGO_ALLTOALL", "name", "auto", kOnce,
       "forces the alltoall (and alltoallv) algorithm"},
      {"COMMUX_ALGO_BARRIER", "name", "auto", kOnce, "forces the barrier algorithm"},
      {"COMMUX_ALGO_GATHER", "name", "auto", kOnce, "forces the gather algorithm"},
      {"COMMUX_ALGO_SCATTER", "name", "auto", kOnce, "forces the scatter algorithm"},
      {"COMMUX_EP_ATEN", "bool", "off", kOnce,
       "commux.ep packs and unpacks host tensors with the device path's ATen operations (a check "
       "of "
       "that code without a GPU)"},
      {"COMMUX_STORE_TOKEN", "secret", "-", kOnce,
       "TcpStore: a shared secret every client presents on connecting; the server closes a "
       "connection whose token differs (unset: no check)"},
      {"COMMUX_DEBUG", "level", "off", kOnce,
       "debug log on stderr, NCCL_DEBUG-style, each line prefixed with host, pid and rank: WARN "
       "(problems), INFO (UCX version, transports and memory types, the lanes per peer, the "
       "algorithm per collective and size class at first use), TRACE (every operation posted and "
       "completed, with peer, tag and bytes)"},
      {"COMMUX_DEBUG_FILE", "path", "-", kOnce,
       "write the debug log to this file instead of stderr (appended; %h: host name, %p: pid)"},
      {"COMMUX_TRACE_DUMP", "path", "-", kOnce,
       "the torch backend writes each process's record of recent collectives (JSON) to "
       "<dir>/commux_trace_<rank>.json (a directory) or <prefix><rank>.json when a collective "
       "times out, when another rank's times out, and on SIGUSR1 (unset: no files, SIGUSR1 "
       "untouched)"},
      {"UCXPG_DEVICE", "cpu/cuda", "cpu", kOnce,
       "test_commux: where the driver's messages live (cuda: device memory)"},
      {"COMMUX_BENCH", "bool", "off", kOnce,
       "test_commux: run the V-buffer ping-pong latency benchmark"},
      {"COMMUX_BENCH_V", "int", "1", kOnce, "test_commux: buffers per message of the benchmark"},
      {"COMMUX_BENCH_BYTES", "int", "8", kOnce, "test_commux: bytes per buffer of the benchmark"},
      {"COMMUX_BENCH_ITERS", "int", "20000", kOnce, "test_commux: round trips of the benchmark"},
      {"COMMUX_TEST_TIMEOUT_S", "int", "120", kOnce,
       "test_commux: a rank exits (alarm) after this long"},
      {"COMMUX_CUDART", "path", "-", kOnce,
       "test_commux: the CUDA runtime library to load (else libcudart.so.13, .12, libcudart.so)"},
  };
  return table;
}

namespace {

[[noreturn]] void bad(const Setting& s, const std::string& v, const char* expected) {
  throw Error(Errc::kInvalidArgument,
              std::string("commux settings: ") + s.name + "='" + v + "' is not " + expected);
}

bool parse_bool(const Setting& s, const std::string& v) {
  for (const char* t : {"1", "on", "true", "yes"}) {
    if (v == t) return true;
  }
  for (const char* f : {"0", "off", "false", "no"}) {
    if (v == f) return false;
  }
  bad(s, v, "a boolean (1, on, true, yes or 0, off, false, no)");
}

long parse_int(const Setting& s, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (end == v.c_str() || *end != '\0' || x < 0 || errno == ERANGE)
    bad(s, v, "a non-negative integer");
  return x;
}

// auto / on (1) / off (0), for the enums { kAuto, kOn, kOff }.
template <typename Mode>
Mode parse_mode(const Setting& s, const std::string& v) {
  if (v == "auto") return Mode::kAuto;
  if (v == "on" || v == "1") return Mode::kOn;
  if (v == "off" || v == "0") return Mode::kOff;
  bad(s, v, "auto, on or off");
}

}  // namespace

Settings Settings::parse(const std::function<const char*(const char*)>& lookup) {
  Settings out;
  const auto& table = settings_table();
  out.values.reserve(table.size());
  for (const Setting& s : table) {
    const char* raw = lookup(s.name);
    const bool from_env = raw != nullptr && *raw != '\0';
    const std::string text =
        from_env ? raw : (std::strcmp(s.default_value, "-") == 0 ? "" : s.default_value);
    out.values.push_back(Value{&s, text, from_env});
    const std::string name = s.name;
    // Defaults are parsed like the environment's values, so the table cannot drift from the fields.
    if (std::strcmp(s.type, "bool") == 0) {
      const bool b = parse_bool(s, text);
      if (name == "COMMUX_COALESCE") out.coalesce = b;
      else if (name == "COMMUX_GROUP") out.group = b;
      else if (name == "COMMUX_UCX_DEFAULTS") out.ucx_defaults = b;
      else if (name == "COMMUX_ATEN_REDUCE") out.aten_reduce = b;
      else if (name == "COMMUX_CALLER_RUNS") out.caller_runs = b;
      else if (name == "COMMUX_SCHEDULE") out.schedule = b;
      else if (name == "COMMUX_PROGRESS_RESUMES") out.progress_resumes = b;
      else if (name == "COMMUX_EP_ATEN") out.ep_aten = b;
      else if (name == "COMMUX_BENCH") out.bench = b;
    } else if (std::strcmp(s.type, "int") == 0) {
      const long n = parse_int(s, text);
      if (name == "COMMUX_SPIN_US") out.spin = std::chrono::microseconds(n);
      else if (name == "COMMUX_TIMEOUT_MS") out.timeout = std::chrono::milliseconds(n);
      else if (name == "COMMUX_SHUTDOWN_TIMEOUT_MS")
        out.shutdown_timeout = std::chrono::milliseconds(n);
      else if (name == "COMMUX_BENCH_V") out.bench_v = n;
      else if (name == "COMMUX_BENCH_BYTES") out.bench_bytes = n;
      else if (name == "COMMUX_BENCH_ITERS") out.bench_iters = n;
      else if (name == "COMMUX_TEST_TIMEOUT_S") out.test_timeout_s = n;
    } else if (name == "COMMUX_INFLIGHT") {
      if (text != "auto") {
        const long n = parse_int(s, text);
        if (n < 1 || n > 64) bad(s, text, "auto or an integer from 1 to 64");
        out.inflight = static_cast<int>(n);
      }
    } else if (name == "COMMUX_WAKEUP") {
      out.wakeup = parse_mode<Wakeup>(s, text);
    } else if (name == "COMMUX_YIELD") {
      out.yield = parse_mode<Yield>(s, text);
    } else if (name == "UCXPG_DEVICE") {
      if (text != "cpu" && text != "cuda") bad(s, text, "a device (cpu or cuda)");
      out.device_cuda = text == "cuda";
    } else if (name == "COMMUX_CUDART") {
      out.cudart = text;
    } else if (name == "COMMUX_STORE_TOKEN") {
      out.store_token = text;
    } else if (name == "COMMUX_DEBUG") {
      log::Level l = log::Level::kOff;
      if (!log::parse_level(text, &l)) bad(s, text, "a log level (off, WARN, INFO or TRACE)");
      out.debug = static_cast<int>(l);
    } else if (name == "COMMUX_DEBUG_FILE") {
      out.debug_file = text;
    } else if (name == "COMMUX_TRACE_DUMP") {
      out.trace_dump = text;
    }
    // "name" (COMMUX_ALGO_<OP>): checked by the collectives, which know the algorithms.
  }
  return out;
}

Settings Settings::from_environment() {
  return parse([](const char* name) -> const char* { return std::getenv(name); });
}

const std::string& Settings::text(const char* name) const {
  for (const Value& v : values) {
    if (name != nullptr && std::strcmp(v.setting->name, name) == 0) return v.text;
  }
  throw Error(Errc::kInvalidArgument, std::string("commux settings: '") +
                                          (name != nullptr ? name : "(null)") +
                                          "' is not a commux setting");
}

const Settings& settings() {
  static const Settings s = Settings::from_environment();
  return s;
}

}  // namespace commux
