// commux/communicator.hpp -- torch-free, MPI-style tagged point-to-point over UCX.
//
// A Communicator joins `size` processes (found through a Store) with one endpoint per peer; the
// Communicators of a process share one UCX worker and progress thread (their group ids, agreed at
// creation, keep their messages apart). isend/irecv are non-blocking and return a Request:
//   * a receive matches exactly on (sender, tag); kAnySource matches any sender and Request::source()
//     reports the real one;
//   * messages on the same (sender, tag) match in posting order; different tags may be posted in
//     any order on either side;
//   * a list of buffers is one logical operation (one Request);
//   * zero-byte messages are fine; a message longer than the posted buffers fails the receive with
//     Errc::kTruncated naming peer, tag and both sizes.
// Operations progress in the background (see docs/progress.md): a rendezvous completes while the
// caller computes, and a blocked wait() sleeps instead of spinning.
//
// Ownership: the caller owns every buffer and must keep it alive and untouched until the Request
// completes (or is cancelled and has completed). The Communicator owns all in-flight UCX requests;
// dropping a Request does not cancel or free anything. All methods are thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "commux/error.hpp"
#include "commux/settings.hpp"
#include "commux/store.hpp"
#include "commux/tag.hpp"

namespace commux {

class Communicator;
class Request;

inline constexpr int kAnySource = -1;

enum class MemoryType : std::uint8_t { kHost, kCuda, kCudaManaged, kRocm, kZe, kUnknown };
const char* memory_type_name(MemoryType m) noexcept;

struct Buffer {
  void* data = nullptr;
  std::size_t size = 0;
  MemoryType mem = MemoryType::kHost;
};

struct Options {
  // Deadline of wait() without an explicit timeout, and of the bootstrap's store lookups.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // A waiter busy-polls the worker this long before it goes to sleep (latency vs. CPU).
  std::chrono::microseconds spin{std::chrono::microseconds(100)};
  // Upper bound on the destructor / shutdown(): endpoint flushes that take longer are forced.
  std::chrono::milliseconds shutdown_timeout{std::chrono::milliseconds(3000)};
  // How multi-buffer messages travel; every rank must agree (a mismatch is detected and reported).
  Packing packing = Packing::kParts;
  // COMMUX_GROUP: the torch backend defers the point-to-point operations issued inside a
  // coalescing window (startCoalescing .. endCoalescing) and posts them together at its end,
  // receives first. Wire-compatible with a peer that does not defer. (Unused by the core itself.)
  bool defer_in_window = false;
  // kOn: the progress thread sleeps on the worker's event fd (UCX's wakeup feature; shared memory
  // stays) instead of polling with an exponential backoff (5 us .. 2 ms while work is in flight).
  // It measured faster only for small messages to callers that sleep at once (spin 0), and up to
  // 2x slower at 1-8 MiB where ranks outnumber CPUs (docs/progress.md). kAuto uses it only when
  // the user's UCX_TLS allows no shared-memory transport (e.g. UCX_TLS=tcp).
  enum class Wakeup : std::uint8_t { kAuto, kOn, kOff };
  Wakeup wakeup = Wakeup::kAuto;
  // When the machine runs more threads than it has CPUs, a spinning waiter takes the CPU from the
  // very rank it waits for. A waiter's poll that finds nothing to do yields the CPU
  // (sched_yield): kAuto: once the wait has spun a few microseconds (but for 100 ms not at all
  // after a yield that took over 200 us: a foreign task held the CPU a whole slice), and from the
  // first poll when this communicator's ranks on this host outnumber the CPUs of this process's
  // affinity mask (options().yield then reports kOn), as MPI's yield-when-idle does; kOn: from
  // the first poll; kOff: never (spin, then sleep). One worker serves the process's
  // communicators: the last one created with kOn (or found oversubscribed) or kOff sets the mode
  // for all of them.
  enum class Yield : std::uint8_t { kAuto, kOn, kOff };
  Yield yield = Yield::kAuto;
  // Group id carried in every tag (0 .. 255): the first one tried. At creation the members agree,
  // through the store, on the first id at or after it that no member process has in use, so the
  // Communicators of a process can share one UCX worker; options().group reports the id taken.
  // Creation fails (kInvalidArgument) when all 256 are in use. Every member must pass the same.
  int group = 0;
  // Keys in the store are "<store_prefix>/...".
  std::string store_prefix = "commux";

  // Defaults overridden by the environment, read now (Settings::from_environment(), see
  // commux/settings.hpp): COMMUX_COALESCE (packing = kIov), COMMUX_GROUP (defer_in_window),
  // COMMUX_SPIN_US, COMMUX_TIMEOUT_MS, COMMUX_SHUTDOWN_TIMEOUT_MS, COMMUX_WAKEUP=auto|on|off,
  // COMMUX_YIELD=auto|on|off.
  // Throws Error(kInvalidArgument) naming a variable whose value does not parse.
  static Options from_env();
};

namespace detail {
class RequestState;
class Channel;
Channel& channel(Communicator& comm) noexcept;
std::unique_ptr<Communicator> communicator_over(std::shared_ptr<Channel> channel);
Request make_request(std::shared_ptr<RequestState> state) noexcept;
RequestState* state_of(const Request& request) noexcept;
}  // namespace detail

class Request {
 public:
  Request() = default;
  bool valid() const noexcept { return state_ != nullptr; }
  // Non-blocking: drives progress once and reports whether the operation has finished
  // (successfully or not). Never throws for the operation's own failure; see error().
  bool test();
  // Blocks until done or until the Communicator's default timeout. Throws the operation's
  // commux::Error, or Errc::kTimeout naming op, peer, tag and bytes.
  void wait();
  void wait(std::chrono::milliseconds timeout);
  // True once finished; does not drive progress.
  bool done() const noexcept;
  // Sender of a completed receive (the real one for kAnySource); the peer for a send.
  int source() const;
  // Bytes received (receives) or sent (sends) once complete.
  std::size_t bytes() const;
  // The failure of a finished operation, or nullptr.
  std::exception_ptr error() const;
  // Asks UCX to cancel; the request then finishes with Errc::kCanceled unless it already matched.
  void cancel();

 private:
  friend class Communicator;
  friend Request detail::make_request(std::shared_ptr<detail::RequestState> state) noexcept;
  friend detail::RequestState* detail::state_of(const Request& request) noexcept;
  explicit Request(std::shared_ptr<detail::RequestState> state) noexcept
      : state_(std::move(state)) {}
  std::shared_ptr<detail::RequestState> state_;
};

// Facts about the UCX in use, for diagnostics (`commux_info`, the benchmark, python -m commux.info).
struct RuntimeInfo {
  std::string ucx_version;                    // of the library actually loaded
  std::vector<std::string> transports;        // transports UCX can use in this process
  std::vector<std::string> memory_types;      // memory types the context supports
  std::vector<std::string> applied_defaults;  // commux's UCX settings in effect ("NAME=value")
  std::vector<std::string> user_settings;     // UCX_* variables from the environment (they win)
  bool event_fd = false;                      // waits sleep on the worker's fd (else yielding poll)

  // Whether this UCX can carry memory of type `m` (it is among memory_types, under UCX's own
  // name for it). Host memory always; kUnknown too (UCX detects such a buffer's type itself).
  // The check core's operations make before they post, for callers that want to refuse earlier.
  bool supports(MemoryType m) const;
};

// What UCX offers this process with these options: starts a one-rank communicator on a throw-away
// FileStore and returns its RuntimeInfo (commux_info and `python -m commux.info` print it).
RuntimeInfo probe_runtime(const Options& options = Options::from_env());

class Communicator {
 public:
  Communicator(std::shared_ptr<Store> store, int rank, int size,
               Options options = Options::from_env());
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const noexcept;
  int size() const noexcept;
  const Options& options() const noexcept;
  const RuntimeInfo& runtime_info() const noexcept;

  // User point-to-point. `tag` must be in 0 .. 2^32-1; `peer` in 0 .. size-1 (kAnySource allowed
  // for receives).
  Request isend(const std::vector<Buffer>& buffers, int peer, std::int64_t tag);
  Request irecv(const std::vector<Buffer>& buffers, int peer, std::int64_t tag);
  Request isend(Buffer buffer, int peer, std::int64_t tag) {
    return isend(std::vector<Buffer>{buffer}, peer, tag);
  }
  Request irecv(Buffer buffer, int peer, std::int64_t tag) {
    return irecv(std::vector<Buffer>{buffer}, peer, tag);
  }
  // Blocking forms. On a timeout they cancel the operation before throwing, so nothing stays
  // posted into the caller's buffers. send() asks UCX for fast local completion (eager up to UCX's
  // RNDV_SEND_NBR_THRESH), which is what a caller that waits at once wants.
  void send(const std::vector<Buffer>& buffers, int peer, std::int64_t tag);
  // Returns the completed request, so source() and bytes() can be read.
  Request recv(const std::vector<Buffer>& buffers, int peer, std::int64_t tag);

  // Cancels what is still posted, flushes and closes endpoints; bounded by
  // options().shutdown_timeout. Called by the destructor; safe to call twice.
  void shutdown();

 private:
  // The collectives and the torch adapter post their internal traffic on the channel itself
  // (src/core/channel.hpp, not installed); this class offers user tags only.
  friend detail::Channel& detail::channel(Communicator& comm) noexcept;
  friend std::unique_ptr<Communicator> detail::communicator_over(
      std::shared_ptr<detail::Channel> channel);
  explicit Communicator(std::shared_ptr<detail::Channel> channel);
  void wait_or_cancel(Request& r);
  std::shared_ptr<detail::Channel> channel_;
};

}  // namespace commux
