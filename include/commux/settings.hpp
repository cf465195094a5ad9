// The environment variables commux reads, declared once (settings_table()) and parsed in one place
// (Settings::parse). Torch-free and UCX-free.
//
// When they are read:
//   * per communicator (Setting::per_communicator): each time a Communicator -- and so a torch
//     process group -- is created, through Options::from_env(); a program may set one for one group.
//   * once: at the first use of settings() in the process (the selector's COMMUX_ALGO_<OP>, commux.ep,
//     the test driver); later changes of the environment are not seen.
// A value that does not parse throws Error(kInvalidArgument) naming the variable, the value and what
// it accepts; an empty value counts as unset. UCX's own UCX_* variables are UCX's (not listed here).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace commux {

struct Setting {
  const char* name;           // "COMMUX_SPIN_US"
  const char* type;           // "bool", "int", "auto/on/off", "cpu/cuda", "name", "path",
                              // "level" (off, WARN, INFO, TRACE; any case) or "secret" (printed
                              // as "(set)", never shown)
  const char* default_value;  // as documented: "off", "100", "auto"; "-" for none
  bool per_communicator;      // read at each Communicator's creation (else once per process)
  const char* meaning;        // one line, as in the README's settings table
};

// Every variable commux reads, in the README's order.
const std::vector<Setting>& settings_table();

struct Settings {
  enum class Wakeup : std::uint8_t { kAuto, kOn, kOff };
  enum class Yield : std::uint8_t { kAuto, kOn, kOff };

  // Per communicator (Options::from_env()).
  bool coalesce = false;                                       // COMMUX_COALESCE
  bool group = false;                                          // COMMUX_GROUP
  std::chrono::microseconds spin{100};                         // COMMUX_SPIN_US
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // COMMUX_TIMEOUT_MS
  std::chrono::milliseconds shutdown_timeout{3000};            // COMMUX_SHUTDOWN_TIMEOUT_MS
  Wakeup wakeup = Wakeup::kAuto;                               // COMMUX_WAKEUP
  Yield yield = Yield::kAuto;                                  // COMMUX_YIELD
  bool ucx_defaults = true;                                    // COMMUX_UCX_DEFAULTS
  bool aten_reduce = false;                                    // COMMUX_ATEN_REDUCE
  bool caller_runs = true;                                     // COMMUX_CALLER_RUNS
  bool schedule = false;                                       // COMMUX_SCHEDULE
  bool progress_resumes = false;                               // COMMUX_PROGRESS_RESUMES
  int inflight = 0;                                            // COMMUX_INFLIGHT, 0 = auto
  // Once per process.
  bool ep_aten = false;       // COMMUX_EP_ATEN
  std::string store_token;    // COMMUX_STORE_TOKEN, "" = none
  int debug = 0;              // COMMUX_DEBUG: 0 off, 1 WARN, 2 INFO, 3 TRACE (src/core/log.hpp)
  std::string debug_file;     // COMMUX_DEBUG_FILE, "" = stderr
  std::string trace_dump;     // COMMUX_TRACE_DUMP, "" = no dumps (src/c10d/flight_recorder.hpp)
  bool device_cuda = false;   // UCXPG_DEVICE=cuda (test driver)
  bool bench = false;         // COMMUX_BENCH (test driver)
  long bench_v = 1;           // COMMUX_BENCH_V (test driver)
  long bench_bytes = 8;       // COMMUX_BENCH_BYTES (test driver)
  long bench_iters = 20000;   // COMMUX_BENCH_ITERS (test driver)
  long test_timeout_s = 120;  // COMMUX_TEST_TIMEOUT_S (test driver)
  std::string cudart;         // COMMUX_CUDART (test driver), "" = search

  // The value of each row of settings_table(), same order: its text (the environment's, else the
  // default) and where it came from.
  struct Value {
    const Setting* setting;
    std::string text;
    bool from_env;
  };
  std::vector<Value> values;

  // The text of the variable `name` ("" when unset and without a default, e.g. COMMUX_ALGO_<OP>).
  // Throws Error(kInvalidArgument) for a name that is not in settings_table().
  const std::string& text(const char* name) const;

  // Parses what `lookup(name)` returns for each variable (nullptr or "": unset). Throws
  // Error(kInvalidArgument): "commux settings: COMMUX_WAKEUP='x' is not auto, on or off".
  static Settings parse(const std::function<const char*(const char*)>& lookup);
  // parse(std::getenv), now.
  static Settings from_environment();
};

// The process environment, parsed at the first call (thread-safe); a parse error is thrown by that
// call and by every later one.
const Settings& settings();

}  // namespace commux
