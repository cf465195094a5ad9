// coll::Schedule: a collective call on a stack of its own, suspended where it would wait (see
// commux/collectives.hpp and schedule.hpp).
//
// Each schedule runs on a fiber: a stack from a small process-wide cache (mmap'd with a guard
// page below it) and the code that lives on it. A fiber is made once (getcontext() and
// makecontext()), entered once with setcontext(), and from then on switched with
// sigsetjmp(env, 0) / siglongjmp() (the thread's side saved before each resume, the fiber's
// before each suspension): into it to run or resume a call, and back to the resuming thread when
// the call suspends (Exchange::wait, through suspend()) or returns. When its call returns, a
// cached fiber parks itself in its loop (Fiber::loop) instead of ending, and the next schedule
// that takes the stack jumps into it, so a schedule makes no system call of its own. Why not
// swapcontext(), or a context made for every call: glibc's saves and sets the signal mask, a
// system call per switch, and getcontext()/setcontext() each make one too; an 8-byte allreduce
// run as a schedule took 1.11-1.33x as long with swapcontext() on the development VM
// (bench/experiments/fiber_switch.cpp). Where the kernel keeps a shadow stack for the thread
// (x86 CET), a jump between stacks would fault, so every switch stays a swapcontext() there
// (detail::fiber_switch_jumps()).
// A fiber may be resumed by a different thread each time; the sanitizers are told about every
// switch (AddressSanitizer's fiber API, ThreadSanitizer's fibers), so the asan and tsan stages
// check these paths too.
//
// Ownership: the Schedule owns its Impl, the Impl owns the call (and its captures, released
// inside the fiber when it returns), a copy of the Request it waits for, and its Fiber until the
// call returns (the fiber then goes back to the cache, or is unmapped where the cache is full).
// Locks: `busy` lets one thread at a time resume it; `wmu` guards `waiting` (the fiber writes it
// just before it suspends, drivers read it to sleep on it).
#ifdef _FORTIFY_SOURCE
#undef _FORTIFY_SOURCE
#endif
#include "schedule.hpp"

#include <setjmp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "commux/error.hpp"
#include "../core/channel.hpp"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COMMUX_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define COMMUX_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define COMMUX_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define COMMUX_TSAN 1
#endif

#ifdef COMMUX_ASAN
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom,
                                               std::size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                                std::size_t* size_old);
#endif
#ifdef COMMUX_TSAN
extern "C" void* __tsan_get_current_fiber(void);
extern "C" void* __tsan_create_fiber(unsigned flags);
extern "C" void __tsan_destroy_fiber(void* fiber);
extern "C" void __tsan_switch_to_fiber(void* fiber, unsigned flags);
#endif

namespace commux::coll {

namespace {

using Clock = std::chrono::steady_clock;

// A call's stack: the collectives need a few KiB, but the torch backend's calls run ATen
// operators and build error messages with backtraces on it. Pages are touched only as used.
constexpr std::size_t kStackBytes = std::size_t{1} << 20;
constexpr std::size_t kCachedStacks = 32;  // kept fibers of each switching mode

std::size_t page_size() {
  static const std::size_t p = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return p;
}

thread_local Schedule::Impl* t_current = nullptr;

// Whether this thread runs with a shadow stack (x86 CET user shadow stacks, Linux 6.6's
// ARCH_SHSTK_STATUS): then only swapcontext() switches stacks safely (glibc gives each
// makecontext() stack a shadow stack of its own), and a siglongjmp() to another stack faults.
bool shadow_stack_enabled() noexcept {
#if defined(__linux__) && defined(__x86_64__) && defined(SYS_arch_prctl)
  constexpr int kArchShstkStatus = 0x5005;
  unsigned long features = 0;
  if (::syscall(SYS_arch_prctl, kArchShstkStatus, &features) == 0) return (features & 1u) != 0;
#endif
  return false;
}

// Whether schedules made from now on switch by jumps (detail::fiber_switch_jumps()).
std::atomic<bool>& jump_mode() {
  static std::atomic<bool> on{!shadow_stack_enabled()};
  return on;
}

// A stack and the fiber on it. Between calls a kept fiber waits parked in loop(), at its
// switch_out(); its next call starts by a resume like any other.
struct Fiber {
  void* mapping = nullptr;
  char* stack = nullptr;  // the usable part of the mapping
  bool jump = false;      // switches by jumps (fixed when made: the cache keeps the two apart)
  bool started = false;   // entered once (its first entry is a setcontext())
  bool kept = false;      // holds one of the cache's places: parks between calls, never unmapped
  Schedule::Impl* current = nullptr;  // the call it runs (set by the thread that gives it one)
  ucontext_t ctx{};                   // made once; with swapcontext(), where the fiber goes on
  ucontext_t caller{};                // with swapcontext(), where the resuming thread goes on
  // Jump mode: where the suspended fiber and the resuming thread go on.
  sigjmp_buf env{};
  sigjmp_buf caller_env{};
#ifdef COMMUX_ASAN
  void* fake_stack = nullptr;   // the fiber's, while it is switched out
  void* caller_fake = nullptr;  // the resuming thread's, while the fiber runs
  const void* caller_bottom = nullptr;
  std::size_t caller_size = 0;
#endif
#ifdef COMMUX_TSAN
  void* tsan_fiber = nullptr;
  void* tsan_caller = nullptr;
#endif

  static void loop(unsigned hi, unsigned lo);
  // `ctx` for loop() on `stack` (getcontext() returns twice to the compiler: kept out of line).
  void make_context();
  // From a thread: runs the fiber until its call suspends or returns (the caller holds the
  // Impl's `busy`).
  void switch_in();
  // From the fiber: back to the resuming thread; returns when a thread resumes it.
  void switch_out();
  // What the sanitizers are told just before each switch.
  void before_switch_in();
  void before_switch_out();
};

struct FiberCache {
  std::mutex mu;
  std::vector<Fiber*> free[2];                // [mu] parked kept fibers, by `jump`
  std::atomic<std::size_t> kept[2] = {0, 0};  // fibers that hold a place, by `jump`
};

FiberCache& fibers() {
  static FiberCache* c = new FiberCache;  // never destroyed: schedules may end during exit
  return *c;
}

Fiber* take_fiber(bool jump) {
  FiberCache& c = fibers();
  {
    std::lock_guard<std::mutex> g(c.mu);
    auto& free = c.free[jump ? 1 : 0];
    if (!free.empty()) {
      Fiber* f = free.back();
      free.pop_back();
      return f;
    }
  }
  auto f = std::make_unique<Fiber>();
  f->jump = jump;
  f->mapping = ::mmap(nullptr, page_size() + kStackBytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
  if (f->mapping == MAP_FAILED) {
    throw Error(Errc::kTransport, "commux schedule: cannot map a stack of " +
                                      std::to_string(kStackBytes) + " bytes for the collective");
  }
  ::mprotect(f->mapping, page_size(), PROT_NONE);  // an overflow faults, not corrupting memory
  f->stack = static_cast<char*>(f->mapping) + page_size();
  f->make_context();
#ifdef COMMUX_TSAN
  f->tsan_fiber = __tsan_create_fiber(0);
#endif
  return f.release();
}

__attribute__((noinline)) void Fiber::make_context() {
  ::getcontext(&ctx);
  ctx.uc_stack.ss_sp = stack;
  ctx.uc_stack.ss_size = kStackBytes;
  ctx.uc_link = nullptr;  // loop() never returns: it switches back itself
  const auto p = reinterpret_cast<std::uintptr_t>(this);
  ::makecontext(&ctx, reinterpret_cast<void (*)()>(&Fiber::loop), 2, static_cast<unsigned>(p >> 32),
                static_cast<unsigned>(p & 0xffffffffu));
}

// After its call returned: a kept fiber (parked) goes back to the cache, another one (ended) is
// unmapped.
void give_fiber(Fiber* f) {
  if (f->kept) {
    FiberCache& c = fibers();
    std::lock_guard<std::mutex> g(c.mu);
    c.free[f->jump ? 1 : 0].push_back(f);
    return;
  }
#ifdef COMMUX_TSAN
  __tsan_destroy_fiber(f->tsan_fiber);
#endif
  ::munmap(f->mapping, page_size() + kStackBytes);
  delete f;
}

// Whether a fiber whose call returned takes one of the cache's places (it then parks).
bool keep_fiber(bool jump) noexcept {
  std::atomic<std::size_t>& kept = fibers().kept[jump ? 1 : 0];
  std::size_t n = kept.load(std::memory_order_relaxed);
  while (n < kCachedStacks) {
    if (kept.compare_exchange_weak(n, n + 1, std::memory_order_relaxed)) return true;
  }
  return false;
}

std::int64_t ticks(Clock::time_point t) { return t.time_since_epoch().count(); }

}  // namespace

struct Schedule::Impl {
  std::function<void()> call;
  Fiber* fiber = nullptr;  // until the call has returned
  // Set by the fiber as the call returns; read by the resuming thread once control is back.
  bool returned = false;
  std::exception_ptr error;
  std::atomic<bool> done{false};
  std::atomic<bool> busy{false};      // a thread is resuming it (or starting it)
  std::atomic<bool> blocking{false};  // resumed by run_to_end(): its waits block
  mutable std::mutex wmu;
  Request waiting;                     // [wmu] what it is suspended on (invalid: nothing)
  std::atomic<std::int64_t> wake{0};   // when it is ready anyway (its next check, its deadline)
  std::atomic<std::int64_t> since{0};  // when the call began to wait for `waiting`

  // Runs the call until it suspends or returns (the caller holds `busy`).
  void resume();
};

void Fiber::loop(unsigned hi, unsigned lo) {
  // (Only `f`, never changed, is read after a jump back into this frame.)
  Fiber* const f = reinterpret_cast<Fiber*>((static_cast<std::uintptr_t>(hi) << 32) |
                                            static_cast<std::uintptr_t>(lo));
#ifdef COMMUX_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &f->caller_bottom, &f->caller_size);
#endif
  for (;;) {
    Schedule::Impl* const s = f->current;
    try {
      s->call();
    } catch (...) {
      s->error = std::current_exception();
    }
    s->call = nullptr;  // its captures (tensors, buffers) go now, on the thread that finished it
    s->returned = true;
    if (!f->kept) f->kept = keep_fiber(f->jump);
    if (f->kept) {
      f->switch_out();  // parked until a schedule takes this stack again
      continue;
    }
    // Ended: the resuming thread unmaps the stack.
#ifdef COMMUX_ASAN
    __sanitizer_start_switch_fiber(nullptr, f->caller_bottom, f->caller_size);
#endif
#ifdef COMMUX_TSAN
    __tsan_switch_to_fiber(f->tsan_caller, 0);
#endif
    if (f->jump) ::siglongjmp(f->caller_env, 1);
    ::setcontext(&f->caller);
  }
}

// Always continues on the thread it started on: the fiber switches back to where this thread
// saved itself (`caller_env`, or `caller` with swapcontext()). (Neither switch is inlined: the only
// local of a frame that a jump comes back to is then `this`, never changed.)
__attribute__((noinline)) void Fiber::switch_in() {
  if (!jump) {
    before_switch_in();
    ::swapcontext(&caller, &ctx);
  } else if (sigsetjmp(caller_env, 0) == 0) {
    // (This thread's side is saved before ThreadSanitizer is told: it files a sigsetjmp() under
    // the fiber that makes it, and the jump back comes once the call has switched back to it.)
    before_switch_in();
    if (started) ::siglongjmp(env, 1);
    // The first entry, on the thread that made `ctx` (getcontext(), take_fiber() from the
    // Schedule's constructor): setcontext() sets the signal mask saved there, this thread's own.
    started = true;
    ::setcontext(&ctx);
  }
#ifdef COMMUX_ASAN
  __sanitizer_finish_switch_fiber(caller_fake, nullptr, nullptr);
#endif
}

void Fiber::before_switch_in() {
#ifdef COMMUX_TSAN
  tsan_caller = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(tsan_fiber, 0);
#endif
#ifdef COMMUX_ASAN
  __sanitizer_start_switch_fiber(&caller_fake, stack, kStackBytes);
#endif
}

__attribute__((noinline)) void Fiber::switch_out() {
  if (!jump) {
    before_switch_out();
    ::swapcontext(&ctx, &caller);
  } else if (sigsetjmp(env, 0) == 0) {
    before_switch_out();
    ::siglongjmp(caller_env, 1);
  }
  // Resumed, perhaps by another thread, perhaps for another call.
#ifdef COMMUX_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, &caller_bottom, &caller_size);
#endif
}

void Fiber::before_switch_out() {
#ifdef COMMUX_ASAN
  __sanitizer_start_switch_fiber(&fake_stack, caller_bottom, caller_size);
#endif
#ifdef COMMUX_TSAN
  __tsan_switch_to_fiber(tsan_caller, 0);
#endif
}

void Schedule::Impl::resume() {
  Impl* const outer = t_current;
  t_current = this;
  fiber->switch_in();
  t_current = outer;
  if (returned) {
    give_fiber(fiber);
    fiber = nullptr;
    done.store(true, std::memory_order_release);
  }
}

namespace detail {

bool fiber_switch_jumps() noexcept { return jump_mode().load(std::memory_order_relaxed); }

void set_fiber_switch_jumps(bool on) noexcept {
  jump_mode().store(on && !shadow_stack_enabled(), std::memory_order_relaxed);
}

__attribute__((noinline)) Schedule::Impl* current_schedule() noexcept { return t_current; }

bool blocking(const Schedule::Impl* s) noexcept {
  return s->blocking.load(std::memory_order_acquire);
}

__attribute__((noinline)) void suspend(Schedule::Impl* s, const Request& on, Clock::time_point wake,
                                       Clock::time_point since) {
  {
    std::lock_guard<std::mutex> g(s->wmu);
    s->waiting = on;
  }
  s->wake.store(ticks(wake), std::memory_order_release);
  s->since.store(ticks(since), std::memory_order_release);
  s->fiber->switch_out();
  std::lock_guard<std::mutex> g(s->wmu);
  s->waiting = Request();
}

}  // namespace detail

Schedule::Schedule(std::function<void()> call) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.call = std::move(call);
  s.fiber = take_fiber(detail::fiber_switch_jumps());
  s.fiber->current = &s;
  s.busy.store(true, std::memory_order_relaxed);
  s.resume();
  s.busy.store(false, std::memory_order_release);
}

Schedule::~Schedule() {
  if (!impl_) return;
  // A suspended call still has requests posted into its buffers and scratch: run it to its end
  // (its deadline bounds this; a failure is the owner's to read, and nobody reads it now).
  while (!test()) {
    if (impl_->busy.load(std::memory_order_acquire)) {
      std::this_thread::yield();
    } else {
      await(std::chrono::milliseconds(10));
    }
  }
}

bool Schedule::done() const noexcept { return impl_->done.load(std::memory_order_acquire); }

bool Schedule::ready() const noexcept {
  const Impl& s = *impl_;
  if (s.done.load(std::memory_order_acquire)) return false;
  {
    std::lock_guard<std::mutex> g(s.wmu);
    if (!s.waiting.valid() || s.waiting.done()) return true;
  }
  return ticks(Clock::now()) >= s.wake.load(std::memory_order_acquire);
}

bool Schedule::test() {
  Impl& s = *impl_;
  if (s.done.load(std::memory_order_acquire)) return true;
  if (!ready()) return false;
  bool expected = false;
  if (!s.busy.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) return false;
  if (!s.done.load(std::memory_order_acquire)) s.resume();
  s.busy.store(false, std::memory_order_release);
  return s.done.load(std::memory_order_acquire);
}

bool Schedule::run_to_end() {
  Impl& s = *impl_;
  bool expected = false;
  if (!s.busy.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) return false;
  if (!s.done.load(std::memory_order_acquire)) {
    s.blocking.store(true, std::memory_order_release);
    s.resume();  // returns once the call has returned: no wait suspends it now
  }
  s.busy.store(false, std::memory_order_release);
  return true;
}

bool Schedule::wait(std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  while (!test()) {
    const auto now = Clock::now();
    if (now >= until) return false;
    if (impl_->busy.load(std::memory_order_acquire)) {
      std::this_thread::yield();  // another thread runs a step of it
      continue;
    }
    await(std::chrono::duration_cast<std::chrono::microseconds>(until - now));
  }
  if (impl_->error) std::rethrow_exception(impl_->error);
  return true;
}

void Schedule::await(std::chrono::microseconds max) const noexcept {
  const Impl& s = *impl_;
  Request on;
  {
    std::lock_guard<std::mutex> g(s.wmu);
    on = s.waiting;
  }
  const auto now = Clock::now();
  auto until = now + max;
  const Clock::time_point wake{Clock::duration(s.wake.load(std::memory_order_acquire))};
  if (wake > now) until = std::min(until, wake);
  if (!on.valid() || on.done() || until <= now) return;
  // Spin first only while the wait is young: one blocked for long sleeps at once, so that a
  // thread waiting seconds for a late rank costs little CPU.
  const Clock::time_point since{Clock::duration(s.since.load(std::memory_order_acquire))};
  const bool spin = now - since < detail::kSpinningWait;
  try {
    // (A driver resumes what it slept on next: the transfers still in flight stay its to
    // progress, not the progress thread's: goes_on.)
    ::commux::detail::state_of(on)->await(std::chrono::ceil<std::chrono::milliseconds>(until - now),
                                          spin, /*goes_on=*/true);
  } catch (...) {
    // A test channel's deadlock report: the call itself fails at its next check or deadline.
  }
}

bool Schedule::running() noexcept { return detail::current_schedule() != nullptr; }

std::exception_ptr Schedule::error() const noexcept {
  return done() ? impl_->error : std::exception_ptr();
}

}  // namespace commux::coll
