// src/c10d/flight_recorder.hpp -- the hang report of the "ucx" backend (internal), after NCCL's
// flight recorder.
//
// Each process group keeps a ring of its kCapacity most recent collectives (sequence number = the
// call's first internal tag, op, bytes, state, wall-clock times of issue, start and finish). It
// costs the hot path two uncontended locks, one clock read and a few stores per call: nothing goes
// to the store while calls succeed.
//
// When a collective times out, its rank asks the others, through the group's store, what they last
// issued and completed, and appends the answer to the error:
//
//   "... Hang report (group '0', allreduce #7): rank 2 has not reached this call: it last issued
//    and completed allreduce #5; ranks 0,1 are waiting in allreduce #7"
//
// Protocol (keys under the group's store prefix):
//   commux/trace/ask         a counter: a rank whose call timed out adds 1 (its "generation")
//   commux/trace/answer/<r>  rank r's answer: its state, tagged with the generation it answers
// The asker answers for itself first, then waits up to kAnswerWait for every rank's answer of its
// generation or later. The other ranks answer without their main thread: one thread per process
// checks every group's counter every kPollPeriod (one store request per second per group) while
// any group exists. So a late rank that is busy in Python, sleeping
// or stuck elsewhere still answers; a dead one is named as not answering.
//
// Dumps: with COMMUX_TRACE_DUMP set (a directory, or a file-name prefix), each process writes the
// rings of all its groups as JSON to "<dir>/commux_trace_<rank>.json" (or "<prefix><rank>.json")
// when one of its collectives times out, when it answers such a question (so every rank of a hang
// leaves its ring), and on SIGUSR1 (the handler is installed only then, and chains to the one it
// replaced, e.g. Python's faulthandler).
//
// Threads: issued() runs on the issuing thread, started()/finished() on the group's collective
// thread, poll() on the process's answering thread, dumps on any thread; mu_ guards the ring and
// the counters; answered_ is atomic (poll() and a timeout's report both answer).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>

namespace commux::c10d_detail {

class FlightRecorder {
 public:
  static constexpr std::size_t kCapacity = 64;
  static constexpr std::chrono::milliseconds kPollPeriod{1000};
  static constexpr std::chrono::milliseconds kAnswerWait{3000};

  FlightRecorder(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::string group);
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  // A collective was issued (`op` is a string literal), started on the worker, finished. For a
  // timeout, finished() asks the other ranks (bounded by kAnswerWait), writes the dump where
  // COMMUX_TRACE_DUMP asks for it and returns the error with the hang report appended.
  // `root`: of a rooted collective (broadcast, reduce, gather, scatter); -1 for the others. The
  // hang report compares the waiting ranks' bytes and roots: a call whose ranks disagree on them
  // waits for ever where every rank only receives (each reduce to a root of its own, say).
  // `at`: when it was issued (the caller's clock read, which also set its deadline). `running`:
  // it starts on the issuing thread at once (a blocking call the caller runs, or a schedule whose
  // first step the caller posts), so it is recorded as running from `at`, and started() is not
  // called for it: one clock read and one lock per call fewer on the hot path.
  void issued(std::uint64_t seq, const char* op, std::size_t bytes, int root,
              std::chrono::steady_clock::time_point at, bool running);
  void started(std::uint64_t seq);
  // A call that succeeded is stamped from the coarse clock (one tick, 1-4 ms, late at most, and
  // never before its start): a precise read costs 40-50 ns on a VM, a tenth of the backend's own
  // time in a blocking 8-byte call, and nothing reads a finished call's time finer than that. A
  // failed one reads the precise clock (its hang report says how long it ran).
  std::exception_ptr finished(std::uint64_t seq, std::exception_ptr error);
  // The answering thread's check for a question (see above); never throws.
  void poll();

  // This group's ring as a JSON object.
  std::string json() const;
  // Writes every group's ring of this process where COMMUX_TRACE_DUMP says; false when unset or
  // when the file could not be written. `why` goes into the file.
  static bool dump_all(const std::string& why);

  enum class State : std::uint8_t { kIssued, kRunning, kCompleted, kFailed, kTimedOut };
  struct Entry {
    std::uint64_t seq = 0;
    const char* op = "";
    std::uint64_t bytes = 0;
    State state = State::kIssued;
    // Wall clock (microseconds since the epoch); 0: not yet. Read from the steady clock and
    // shifted by the wall clock's offset at the group's creation, so one clock read serves the
    // call's deadline and its record, and a step of the wall clock later does not reorder them.
    std::int64_t issued_us = 0;
    std::int64_t started_us = 0;
    std::int64_t finished_us = 0;
    int root = -1;
  };

 private:
  Entry* find_locked(std::uint64_t seq);
  std::int64_t wall_us(std::chrono::steady_clock::time_point t) const;
  std::int64_t now_wall_us() const { return wall_us(std::chrono::steady_clock::now()); }
  std::int64_t coarse_wall_us() const;  // CLOCK_MONOTONIC_COARSE: no clock source is read
  std::string answer_locked(std::int64_t gen) const;
  void answer(std::int64_t gen);
  std::string report(std::uint64_t seq, const char* op);
  static void start_poller();

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  std::string group_;
  std::int64_t wall_offset_us_;  // wall clock minus steady clock at construction, in microseconds
  mutable std::mutex mu_;
  std::array<Entry, kCapacity> ring_{};    // [mu_] entry n at n % kCapacity
  std::uint64_t count_ = 0;                // [mu_] entries ever recorded
  Entry last_completed_{};                 // [mu_] valid when any_completed_
  bool any_completed_ = false;             // [mu_]
  std::atomic<std::int64_t> answered_{0};  // the last generation answered
};

}  // namespace commux::c10d_detail
