// Private to src/core: the other ranks -- bootstrap through the Store, one endpoint each, and
// their health: UCX's peer error handling towards other hosts, a process check on this host
// (peer_record.hpp says why), failing what waits on a peer that is gone (docs/progress.md).
//
// Ownership: Peers owns the endpoints (from connect() to close_all_locked()) and the force-close
// requests of dead same-host peers. It uses its Worker (which must outlive it) and the Worker's
// in-flight list, whose Ops it fails (through their Engine) when their peer fails; it owns none
// of them.
// Locks: fields marked [mu] are guarded by the worker mutex (Worker::mutex()).
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "commux/communicator.hpp"
#include "commux/store.hpp"
#include "peer_record.hpp"

namespace commux::detail {

class Engine;
class Peers;
class Worker;
struct Op;

// Progresses `worker` until every request in `requests` has completed or `deadline` passes, and
// frees them all (those still in progress are released by UCX when they complete); empties the
// list. True if all completed. [mu]
bool complete_requests_locked(ucp_worker_h worker, std::vector<void*>& requests,
                              std::chrono::steady_clock::time_point deadline);

struct ErrorTarget;  // below

// The largest message Engine::send_now ever tries (every Peer::send_now_max starts there and is
// only lowered): a larger one is declined before the worker's lock is taken, so that its post does
// not take the lock twice.
inline constexpr std::size_t kSendNowCeiling = 4096;

struct Peer {
  ucp_ep_h ep = nullptr;         // [mu] nullptr before connecting and once closed
  ucs_status_t status = UCS_OK;  // [mu] UCS_OK or why the peer failed
  std::chrono::steady_clock::time_point failed_at{};  // [mu]
  std::string reason;                                 // [mu] why the peer is gone
  ProcessIdentity identity;                           // set in connect(), then read-only
  bool same_host = false;                             // set in connect(), then read-only
  // [mu] The largest message Engine::send_now still tries to this peer: lowered to below a size
  // UCX would not send inside the call (its short protocol ends there, or the transport was full
  // at the time), never below kSendNowFloor bytes, which it always tries.
  std::size_t send_now_max = kSendNowCeiling;
  // The endpoint error callback's argument: nullptr until the endpoint is made.
  ErrorTarget* target = nullptr;
};

// The argument of an endpoint's error callback. UCX may call that callback until the endpoint's
// close has completed, and a close can outlast the Peers: the worker is the process's and lives
// on, and UCX 1.22 was seen calling a force-closed endpoint's handler when its TCP lane failed
// afterwards. So the target is a block of its own: close_all_locked() detaches it (owner =
// nullptr; every callback runs under the worker lock, as progress does) and keeps it to the end
// of the process. The callback of a detached target does nothing.
struct ErrorTarget {
  Peers* owner = nullptr;  // [mu] nullptr once detached
  int rank = -1;
};

class Peers {
 public:
  // `owner`: the Engine whose endpoints these are. The worker's in-flight list holds the Ops of
  // every Engine on it; a peer's failure fails the owner's only (Op::engine).
  Peers(Worker& worker, int rank, int size, const Engine* owner) noexcept
      : worker_(worker), rank_(rank), size_(size), owner_(owner) {}
  ~Peers();
  Peers(const Peers&) = delete;
  Peers& operator=(const Peers&) = delete;

  // Bootstrap: publishes this worker's address and process identity in `store`, then reads every
  // rank's (waiting up to options.timeout for each) and creates an endpoint to it. A same-host
  // peer that left before we could connect is marked gone instead of failing the start. Then
  // wire_up(): returns once every endpoint is wired and so are the same-host peers' to this rank.
  void connect(Store& store, const Options& options);

  // Valid once connect() has run; peer in 0..size-1. The fields say which need the lock.
  Peer& operator[](int peer) noexcept { return peers_[static_cast<std::size_t>(peer)]; }
  const Peer& operator[](int peer) const noexcept { return peers_[static_cast<std::size_t>(peer)]; }

  // Marks `peer` gone (once; later calls keep the first reason); reap_locked() then fails what
  // waits on it. May be called from inside a UCX callback. [mu]
  void fail_locked(int peer, ucs_status_t status, const std::string& reason);
  // Checks whether the same-host peers' processes still live; fails and force-closes the dead
  // ones. Takes the worker mutex; called by the progress thread.
  void check_local();
  // Once a peer is gone, fails every operation that cannot complete, naming the peer: sends to it
  // at once; receives from it, and the group's collective traffic with any peer, once progress is
  // `idle` and a grace period has passed. Any-source receives stay posted (live peers may still
  // send). Cheap unless some peer has failed. Not from inside a UCX callback. [mu]
  void reap_locked(bool idle) {
    if (any_failed_) reap_failed_locked(idle);
  }
  // After an operation with `peer` failed with `status`: true if the peer is gone. A same-host
  // peer's process is checked now (UCX may report the error before the periodic check sees the
  // death), and a connection error marks the peer gone (UCX may fail the request before it calls
  // the endpoint's error handler). Safe inside UCX callbacks. [mu]
  bool check_gone_locked(int peer, ucs_status_t status);
  // A gone peer whose absence fails every collective of the group from now on (one that failed
  // more than the grace period ago, see reap_locked), or -1. [mu]
  int group_broken_locked() const;
  std::string gone(int peer) const;  // "peer 2 is gone (why)" [mu]
  bool any_failed_locked() const noexcept { return any_failed_; }

  // Closes every endpoint (force-closing those to gone peers) and progresses the worker until
  // the closes complete or `deadline` passes; frees what is left. [mu]
  void close_all_locked(std::chrono::steady_clock::time_point deadline);

 private:
  static void ep_error_cb(void* arg, ucp_ep_h ep, ucs_status_t status);
  // The end of connect(): flushes every endpoint (UCX finishes wiring its lanes, which it connects
  // in the background), publishes that in the store, and waits (progressing, so that the peers'
  // wire-up is answered) until every live same-host peer has published it too, or has exited.
  // UCX cannot tear down an endpoint without peer error handling (same-host ones, see connect())
  // whose lane failed to connect: a rank that left at once after init while a peer was still
  // connecting a TCP lane to it made that peer crash in ucp_worker_destroy (SIGSEGV in
  // ucp_ep_purge_lanes; an assertion in UCX debug builds). Throws kTimeout at options.timeout.
  void wire_up(Store& store, const Options& options);
  // An endpoint whose flush failed at start-up: its peer is marked gone, saying so. [mu]
  void fail_unwired_locked(int peer, ucs_status_t status);
  void reap_failed_locked(bool idle);
  // Detaches every endpoint's ErrorTarget: frees them where the worker is gone (no callback can
  // come), else keeps them to the end of the process. [mu]
  void release_targets_locked(bool worker_gone);

  bool mine(const Op& op) const noexcept;  // an Op of this Peers' Engine

  Worker& worker_;
  const int rank_;
  const int size_;
  const Engine* owner_;
  std::vector<Peer> peers_;     // sized once in connect()
  std::vector<void*> closing_;  // [mu] force-close requests of dead peers
  bool any_failed_ = false;     // [mu]
  int first_failed_ = -1;       // [mu] the first peer that failed, once any_failed_
  std::chrono::steady_clock::time_point next_reap_{};  // [mu]
};

}  // namespace commux::detail
