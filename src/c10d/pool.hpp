// src/c10d/pool.hpp -- the threads that run the collectives of every ProcessGroupUCX of the
// process (internal).
//
// A group holds a thread only while it has collectives queued: its first queued collective
// submits it here, a thread takes it and runs its queue in order until the queue is empty (or its
// first collective cannot start yet), then lets it go. A group whose next collective may run
// beside the one just started (COMMUX_INFLIGHT) submits itself once more, so it holds up to that
// many threads. Groups with work at the same time each get a thread of their own: a submit hands
// the client to the thread that went idle last, or starts one if none is idle, so a collective
// blocked in one group (waiting for a peer that is itself in another group's collective) never
// keeps another group's collectives from running. A thread idle for kRetireAfter ends: groups
// with nothing queued cost no thread. (Handing work to the last idle thread, rather than to any
// waiting one, lets the threads beyond what the work needs now retire: woken in turn, a burst's
// threads all stayed.)
//
// Ownership: the pool (one per process, never destroyed) owns its threads (detached); it does
// not own the Clients, which must stay alive until their serve() has returned (a group's
// shutdown waits for that). Locks: every field is guarded by mu_.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <vector>

namespace commux::c10d_detail {

class CollectivePool {
 public:
  class Client {
   public:
    virtual ~Client() = default;
    // Runs the client's queued collectives, in order, until none is left that may start.
    virtual void serve() = 0;
  };
  static constexpr std::chrono::milliseconds kRetireAfter{500};

  static CollectivePool& instance();
  // Hands `client` to a thread (the last to go idle, else a new one). A client is submitted
  // again only after its serve() returned (the client tracks that itself).
  void submit(Client* client);
  int threads();  // threads alive now (tests)

 private:
  struct Idle {  // an idle thread, on its own stack
    std::condition_variable cv;
    Client* client = nullptr;  // [mu_] handed to it by submit()
  };
  void loop(Client* first);
  std::mutex mu_;
  std::vector<Idle*> idle_;  // [mu_] idle threads, the last to go idle at the back
  int threads_ = 0;          // [mu_]
};

}  // namespace commux::c10d_detail
