// Debug logging in the manner of NCCL_DEBUG (internal; used by src/core, src/collectives and
// src/c10d). COMMUX_DEBUG=WARN|INFO|TRACE chooses how much, COMMUX_DEBUG_FILE where (default
// stderr; "%h" becomes the host name, "%p" the process id). Both are read once per process, at
// the first use (commux::settings()). Every line is one write:
//
//     host:pid [rank 3] commux INFO peer 1: lanes posix/memory (am), cma/memory (rma_bw)
//
// What each level adds:
//   WARN   problems commux works around or a user should know (a same-host peer reached over TCP)
//   INFO   the UCX version, its transports and memory types; the lanes UCX chose per peer; the
//          algorithm of each (collective, size class) the first time it runs
//   TRACE  every operation posted and completed, with its peer, tag and bytes
//
// Off costs one relaxed load and a compare where a line could be written: COMMUX_LOG checks
// enabled() before it evaluates its arguments. Torch-free and UCX-free, so every layer may use it
// (scripts/check_layers.py allows src/collectives this header of src/core).
#pragma once

#include <atomic>
#include <sstream>
#include <string>
#include <utility>

namespace commux::log {

enum class Level : int { kOff = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

namespace detail {
// -1 until the first enabled() reads the setting.
extern std::atomic<int> g_level;
int init_level() noexcept;
}  // namespace detail

// The level COMMUX_DEBUG chose (kOff when unset or when the settings do not parse: the parse error
// is reported by whatever reads the settings next, e.g. the communicator's creation).
inline Level level() noexcept {
  const int l = detail::g_level.load(std::memory_order_relaxed);
  return static_cast<Level>(l >= 0 ? l : detail::init_level());
}
inline bool enabled(Level l) noexcept { return static_cast<int>(l) <= static_cast<int>(level()); }

// "WARN", "INFO", "TRACE" (and "OFF").
const char* level_name(Level l) noexcept;
// Parses a COMMUX_DEBUG value (case-insensitive; "" and "OFF" are kOff); false for anything else.
bool parse_level(const std::string& text, Level* out) noexcept;

// Writes one line "host:pid [rank R] commux LEVEL message" (rank < 0: "[rank -]"), whole, to the
// log's destination. Never throws.
void write(Level l, int rank, const std::string& message) noexcept;

// Redirects the log for tests: the level and the destination path ("" = stderr), as if read from
// the environment. Not thread-safe with concurrent writers.
void reset_for_testing(Level l, const std::string& path);

template <class... T>
std::string cat(T&&... parts) {
  std::ostringstream s;
  (s << ... << std::forward<T>(parts));
  return s.str();
}

}  // namespace commux::log

// COMMUX_LOG(kInfo, rank, "peer ", p, ": lanes ", lanes): the message is built only when the level
// is enabled.
#define COMMUX_LOG(lvl, rank, ...)                                                              \
  do {                                                                                          \
    if (::commux::log::enabled(::commux::log::Level::lvl)) {                                    \
      ::commux::log::write(::commux::log::Level::lvl, (rank), ::commux::log::cat(__VA_ARGS__)); \
    }                                                                                           \
  } while (0)
