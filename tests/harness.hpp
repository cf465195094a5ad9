// Multi-process test harness: runs one function per rank in forked children.
//
// Every child has an alarm() watchdog that prints its stack (backtrace of the thread that was
// running) and exits with kHangExit; the parent waits with its own deadline and SIGKILLs the
// group. A failing check in a child throws; the child prints the message and exits with
// kFailExit. Nothing here can hang a test run.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "commux/communicator.hpp"
#include "commux/store.hpp"

namespace commux::test {

// Built with AddressSanitizer or ThreadSanitizer: tests of timing or address space skip what
// the sanitizer makes meaningless.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

inline constexpr int kFailExit = 3;
inline constexpr int kHangExit = 124;

inline Options default_test_options() {
  Options o;
  o.timeout = std::chrono::seconds(30);
  o.shutdown_timeout = std::chrono::seconds(2);
  return o;
}

// A port nobody listens on now (the kernel's choice for an ephemeral bind on 127.0.0.1).
int free_port();

// The one temporary-store helper of the C++ suites: a fresh directory under /tmp (for a
// FileStore), removed with everything in it when the TempDir goes.
class TempDir {
 public:
  explicit TempDir(const char* prefix = "commux-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::shared_ptr<FileStore> store() const { return std::make_shared<FileStore>(path_); }

 private:
  std::string path_;
};

struct RunOptions {
  int timeout_s = 60;           // per-child watchdog; the parent allows a few seconds more
  std::set<int> expect_killed;  // ranks that must die by SIGKILL (any exit is a failure)
  Options comm = default_test_options();           // options for the Communicator each rank builds
  std::function<Options(int rank)> comm_for_rank;  // overrides `comm` when set
};

// Runs body(comm) in `size` processes, each with a Communicator over a shared fresh FileStore.
// Fails the current GoogleTest test (ADD_FAILURE) with each failing rank's reason.
void run_ranks(int size, const std::function<void(Communicator&)>& body, RunOptions opts = {});

// Several independent worlds at once (each with its own store), so that cases that mostly wait
// (for a peer's death to be noticed, say) overlap. Failures name the world.
struct World {
  std::string name;  // e.g. "allreduce, 3 ranks, rank 1 killed"
  int size = 2;
  std::function<void(Communicator&)> body;
  RunOptions opts;
};
void run_worlds(const std::vector<World>& worlds);

// Lower level: body(rank, size, store_dir) without a Communicator.
void run_procs(int size, const std::function<void(int, int, const std::string&)>& body,
               RunOptions opts = {});

// Checks that throw, for use inside children (GoogleTest assertions do not cross fork()).
// check_failed and expect_error are defined in checks.cpp, which builds without GoogleTest.
[[noreturn]] void check_failed(const char* file, int line, const std::string& what);

#define CX_CHECK(cond)                                                                 \
  do {                                                                                 \
    if (!(cond)) ::commux::test::check_failed(__FILE__, __LINE__, "CHECK(" #cond ")"); \
  } while (0)

#define CX_CHECK_EQ(a, b)                                                     \
  do {                                                                        \
    const auto& cx_a_ = (a);                                                  \
    const auto& cx_b_ = (b);                                                  \
    if (!(cx_a_ == cx_b_)) {                                                  \
      std::ostringstream cx_os_;                                              \
      cx_os_ << "CHECK_EQ(" #a ", " #b ") with " << cx_a_ << " != " << cx_b_; \
      ::commux::test::check_failed(__FILE__, __LINE__, cx_os_.str());         \
    }                                                                         \
  } while (0)

// Runs fn, which must throw commux::Error with `code`; returns the message.
std::string expect_error(Errc code, const std::function<void()>& fn);

// Contains-check for messages.
#define CX_CHECK_HAS(msg, part)                                                              \
  do {                                                                                       \
    if (std::string(msg).find(part) == std::string::npos)                                    \
      ::commux::test::check_failed(__FILE__, __LINE__,                                       \
                                   std::string("message lacks '") + (part) + "': " + (msg)); \
  } while (0)

// Deterministic byte pattern for message `id`.
inline unsigned char pattern(std::uint64_t id, std::size_t i) {
  return static_cast<unsigned char>((id * 131u + i * 7u + (i >> 8)) & 0xff);
}

}  // namespace commux::test
