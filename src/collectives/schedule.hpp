// How a collective's waits become suspensions (internal to src/collectives).
//
// A coll::Schedule runs its call on a stack of its own (a ucontext fiber). Exchange::wait asks
// current_schedule() whether it runs inside one; if so, and its request is not complete, it
// suspends the call with suspend() instead of blocking the thread: the thread that resumed the
// schedule gets control back, and the schedule is ready() again once that request finishes or
// `wake` (the call's next cross-rank check, or its deadline) comes. The call may then go on on
// another thread: code that runs inside a schedule reads thread_local variables only through
// functions defined out of line (as current_schedule itself), never caching their address across
// a wait.
#pragma once

#include <chrono>

#include "commux/collectives.hpp"
#include "commux/communicator.hpp"

namespace commux::coll::detail {

// The schedule running on this thread, or nullptr.
Schedule::Impl* current_schedule() noexcept;
// Whether `s` was resumed by run_to_end(): its waits block instead of suspending.
bool blocking(const Schedule::Impl* s) noexcept;
// Suspends the running schedule `s` until `on` finishes or `wake` comes (or a thread resumes it
// anyway); returns on the thread that resumes it. `since`: when the call began to wait for `on`
// (a thread sleeping on it spins first only while that wait is young, as a blocking wait does).
void suspend(Schedule::Impl* s, const Request& on, std::chrono::steady_clock::time_point wake,
             std::chrono::steady_clock::time_point since);
// Whether fibers switch by jumps (sigsetjmp(env, 0) / siglongjmp(): no system call) rather than
// by swapcontext(), which sets the signal mask on every switch: true unless the thread runs with
// a shadow stack (schedule.cpp). set_fiber_switch_jumps(false) makes the schedules made from then
// on switch with swapcontext() (the tests run both ways; true where a shadow stack is on changes
// nothing).
bool fiber_switch_jumps() noexcept;
void set_fiber_switch_jumps(bool on) noexcept;
// How long a wait spins before it sleeps only (Exchange::wait's first slice).
inline constexpr std::chrono::milliseconds kSpinningWait{25};

}  // namespace commux::coll::detail
