// Bootstrap, endpoints and peer health (docs/progress.md, "Failures and shutdown").
#include "peers.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "lanes.hpp"
#include "engine.hpp"
#include "op.hpp"
#include "status.hpp"
#include "worker.hpp"

namespace commux::detail {

namespace {

using Clock = std::chrono::steady_clock;

std::string addr_key(const Options& o, int rank) {
  return o.store_prefix + "/g" + std::to_string(o.group) + "/addr/" + std::to_string(rank);
}

std::string wired_key(const Options& o, int rank) {
  return o.store_prefix + "/g" + std::to_string(o.group) + "/wired/" + std::to_string(rank);
}

// Starts closing `ep`; returns the close request when it is still in progress, else nullptr.
void* start_close(ucp_ep_h ep, bool force) {
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  prm.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* r = ucp_ep_close_nbx(ep, &prm);
  return UCS_PTR_IS_PTR(r) ? r : nullptr;
}

}  // namespace

void Peers::connect(Store& store, const Options& options) {
  ucp_address_t* address = nullptr;
  std::size_t address_len = 0;
  check_status(ucp_worker_get_address(worker_.handle(), &address, &address_len),
               "init: ucp_worker_get_address");
  const auto* a = reinterpret_cast<const std::uint8_t*>(address);
  const ProcessIdentity me = self_identity();
  store.set(addr_key(options, rank_),
            encode_record(PeerRecord{me, std::vector<std::uint8_t>(a, a + address_len)}));
  ucp_worker_release_address(worker_.handle(), address);

  peers_.assign(static_cast<std::size_t>(size_), Peer{});
  for (int p = 0; p < size_; ++p) {
    // Start with the right-hand neighbour so ranks do not all wait on rank 0's key first.
    const int peer = (rank_ + p) % size_;
    std::vector<std::uint8_t> record;
    try {
      record = store.get(addr_key(options, peer), options.timeout);
    } catch (const Error& e) {
      if (e.code() != Errc::kTimeout) throw;
      throw Error(Errc::kTimeout,
                  "commux init: rank " + std::to_string(peer) + " of " + std::to_string(size_) +
                      " has not joined group " + std::to_string(options.group) +
                      ": its address was not in " + "the store within " +
                      std::to_string(options.timeout.count()) + " ms (this is rank " +
                      std::to_string(rank_) + "; " + e.what() + ")");
    }
    const PeerRecord remote = decode_record(record, "rank " + std::to_string(peer));
    Peer& pr = (*this)[peer];
    pr.identity = remote.identity;
    pr.same_host = remote.identity.host == me.host;
    pr.target = new ErrorTarget{this, peer};  // detached and kept by close_all_locked()
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(remote.address.data());
    // Peer error handling would cost same-host peers their shared-memory transports (see
    // peer_record.hpp); those are watched by check_local() instead.
    ep.err_mode = pr.same_host ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Peers::ep_error_cb;
    ep.err_handler.arg = pr.target;
    std::lock_guard<std::mutex> lock(worker_.mutex());
    const ucs_status_t created = ucp_ep_create(worker_.handle(), &ep, &pr.ep);
    if (created != UCS_OK && pr.same_host) {
      // A peer may finish its work (eager sends to us included) and leave before we connect;
      // its shared memory is gone then. That is a peer that left, not a failed start: messages
      // it sent are still delivered, and operations that need it fail naming this reason.
      pr.ep = nullptr;
      fail_locked(peer, created,
                  std::string("could not connect to its process ") +
                      std::to_string(remote.identity.pid) + " on this host (" +
                      ucs_status_string(created) + "): it has probably left already");
      continue;
    }
    check_status(created, "init: connecting to peer " + std::to_string(peer));
    log_peer_lanes(rank_, peer, options.group, pr.same_host, pr.ep);
  }
  wire_up(store, options);
}

void Peers::wire_up(Store& store, const Options& options) {
  const auto deadline = Clock::now() + options.timeout;
  const auto ranks_text = [](const std::vector<int>& ranks) {
    std::string t;
    for (int p : ranks) t += (t.empty() ? "" : ", ") + std::to_string(p);
    return t;
  };
  // 1. Flush every endpoint: UCX completes its wire-up first. 2. Once all are flushed, say so in
  // the store and wait for each live same-host peer to say so too (endpoints to other hosts have
  // peer error handling and survive a peer that leaves). Both progress the worker, with a backoff
  // to 2 ms and without the lock between polls: a peer still waiting in the store for a late
  // rank's address does not answer yet.
  std::vector<std::pair<int, void*>> flushing;
  {
    std::lock_guard<std::mutex> lock(worker_.mutex());
    for (int p = 0; p < size_; ++p) {
      Peer& pr = (*this)[p];
      if (p == rank_ || pr.ep == nullptr || pr.status != UCS_OK) continue;
      ucp_request_param_t prm{};
      void* r = ucp_ep_flush_nbx(pr.ep, &prm);
      if (UCS_PTR_IS_PTR(r)) {
        flushing.emplace_back(p, r);
      } else if (UCS_PTR_IS_ERR(r)) {
        fail_unwired_locked(p, UCS_PTR_STATUS(r));
      }
    }
  }
  bool published = false;
  std::vector<int> waiting;  // same-host peers not yet wired (once published)
  auto pause = std::chrono::microseconds(10);
  for (;;) {
    bool moved = false;
    {
      std::lock_guard<std::mutex> lock(worker_.mutex());
      moved = ucp_worker_progress(worker_.handle()) != 0;
      for (auto it = flushing.begin(); it != flushing.end();) {
        const ucs_status_t st = ucp_request_check_status(it->second);
        if (st == UCS_INPROGRESS) {
          ++it;
          continue;
        }
        ucp_request_free(it->second);
        if (st != UCS_OK) fail_unwired_locked(it->first, st);
        it = flushing.erase(it);
      }
    }
    if (flushing.empty() && !published) {
      store.set(wired_key(options, rank_), std::vector<std::uint8_t>{1});
      published = true;
      for (int p = 0; p < size_; ++p) {
        const Peer& pr = (*this)[p];
        if (p != rank_ && pr.same_host && pr.ep != nullptr && pr.status == UCS_OK) {
          waiting.push_back(p);
        }
      }
    }
    for (auto it = waiting.begin(); it != waiting.end();) {
      if (store.check(wired_key(options, *it))) {
        it = waiting.erase(it);
      } else if (!process_alive((*this)[*it].identity)) {
        std::lock_guard<std::mutex> lock(worker_.mutex());
        fail_locked(*it, UCS_ERR_CONNECTION_RESET,
                    "its process " + std::to_string((*this)[*it].identity.pid) +
                        " on this host exited during start-up");
        it = waiting.erase(it);
      } else {
        ++it;
      }
    }
    if (published && waiting.empty()) return;
    if (Clock::now() >= deadline) {
      std::vector<int> late;
      {
        std::lock_guard<std::mutex> lock(worker_.mutex());
        for (auto& f : flushing) {
          ucp_request_free(f.second);  // released by UCX when it completes
          late.push_back(f.first);
        }
      }
      const std::string what =
          published ? "rank(s) " + ranks_text(waiting) + " on this host did not finish connecting"
                    : "could not finish connecting to rank(s) " + ranks_text(late);
      throw Error(Errc::kTimeout, "commux init: " + what + " within " +
                                      std::to_string(options.timeout.count()) + " ms (group " +
                                      std::to_string(options.group) + ", this is rank " +
                                      std::to_string(rank_) + " of " + std::to_string(size_) + ")");
    }
    pause = moved ? std::chrono::microseconds(10)
                  : std::min<std::chrono::microseconds>(pause * 2, std::chrono::microseconds(2000));
    std::this_thread::sleep_for(pause);
  }
}

void Peers::fail_unwired_locked(int peer, ucs_status_t status) {
  fail_locked(peer, status,
              std::string("could not finish connecting to it (") + ucs_status_string(status) +
                  "): it has probably left already");
}

void Peers::ep_error_cb(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  const auto* target = static_cast<const ErrorTarget*>(arg);
  // Detached: its Peers have shut down (and may be gone), the endpoint is closing.
  if (target->owner == nullptr) return;
  target->owner->fail_locked(target->rank, status, ucs_status_string(status));
}

void Peers::fail_locked(int peer, ucs_status_t status, const std::string& reason) {
  // Only marks the peer: this may run inside a UCX callback (the endpoint's error handler), where
  // requests may not be cancelled. reap_locked() fails what waits on it, at the next progress step.
  Peer& pr = (*this)[peer];
  if (pr.status != UCS_OK) return;
  pr.status = status;
  pr.failed_at = Clock::now();
  pr.reason = reason;
  if (!any_failed_) first_failed_ = peer;
  any_failed_ = true;
  next_reap_ = {};
}

bool Peers::mine(const Op& op) const noexcept {
  return static_cast<const void*>(op.engine.get()) == static_cast<const void*>(owner_);
}

void Peers::check_local() {
  std::vector<int> dead;
  for (int p = 0; p < size_; ++p) {
    const Peer& pr = (*this)[p];
    if (p != rank_ && pr.same_host && !process_alive(pr.identity)) dead.push_back(p);
  }
  if (dead.empty()) return;
  std::lock_guard<std::mutex> lock(worker_.mutex());
  if (worker_.shut_down_locked()) return;
  for (int p : dead) {
    Peer& pr = (*this)[p];
    if (pr.status != UCS_OK) continue;
    fail_locked(p, UCS_ERR_CONNECTION_RESET,
                "its process " + std::to_string(pr.identity.pid) + " on this host has exited");
    // Force-closing completes the sends still queued to it (with an error) and frees them.
    if (void* r = start_close(pr.ep, true)) closing_.push_back(r);
    pr.ep = nullptr;
  }
}

// Receives from a gone peer wait kRecvGrace with progress idle, so that messages it sent before
// it went are delivered first. The group's collectives (internal traffic) cannot complete once any
// member is gone, whoever their own peer is: a survivor may wait on another survivor that has
// already given up, or on a shared-memory queue the dead process left half written. They fail
// after kGroupGrace, which leaves a collective that a member finished just before it exited the
// time to finish on the others. An op of theirs with a live peer that UCX still holds lingers
// (that peer may be reading or writing its buffers in a rendezvous under way, which then
// completes within milliseconds): for kSendLinger (a send) or kRecvLinger (a receive). One still
// held after that is stalled (typically behind a shared-memory queue the dead rank left half
// written) and abandoned: its waits throw, but it is not finished, since that peer could still
// read or write its buffers; it finishes when UCX completes it, at the latest at shutdown.
namespace {
constexpr auto kRecvGrace = std::chrono::milliseconds(100);
constexpr auto kGroupGrace = std::chrono::milliseconds(300);
constexpr auto kSendLinger = std::chrono::milliseconds(300);
constexpr auto kRecvLinger = std::chrono::milliseconds(1000);
}  // namespace

std::string Peers::gone(int peer) const {
  return "peer " + std::to_string(peer) + " is gone (" + (*this)[peer].reason + ")";
}

bool Peers::check_gone_locked(int peer, ucs_status_t status) {
  Peer& pr = (*this)[peer];
  if (pr.status != UCS_OK || peer == rank_) return pr.status != UCS_OK;
  if (pr.same_host && !process_alive(pr.identity)) {
    fail_locked(peer, UCS_ERR_CONNECTION_RESET,
                "its process " + std::to_string(pr.identity.pid) + " on this host has exited");
  } else if (status == UCS_ERR_CONNECTION_RESET || status == UCS_ERR_ENDPOINT_TIMEOUT ||
             status == UCS_ERR_UNREACHABLE) {
    fail_locked(peer, status, ucs_status_string(status));  // the endpoint's error, come first
  }
  return pr.status != UCS_OK;
}

int Peers::group_broken_locked() const {
  if (!any_failed_ || Clock::now() - (*this)[first_failed_].failed_at < kGroupGrace) return -1;
  return first_failed_;
}

void Peers::reap_failed_locked(bool idle) {
  const auto now = Clock::now();
  if (now < next_reap_) return;
  next_reap_ = now + std::chrono::milliseconds(10);
  const bool group_failed = idle && group_broken_locked() >= 0;
  for (const std::shared_ptr<Op>& op : worker_.inflight_snapshot_locked()) {
    if (op->done.load() || !mine(*op)) continue;  // the shared worker holds other groups' ops
    if (op->has_override && op->override_code != Errc::kPeerFailed) continue;  // finishing
    // A receive held behind its gate (Engine::post_after) has not looked for the gone peer's
    // messages yet: one may be waiting in UCX. It is judged once posted.
    if (op->held && op->kind == Op::Kind::kRecv) continue;
    // The peer this op is with: for an any-source receive, its sender once part 0 matched.
    const int with = op->peer != kAnySource ? op->peer
                                            : (op->remaining > 0 && op->parts.size() > 1 &&
                                                       op->parts[0].ucx_req == nullptr
                                                   ? op->source
                                                   : kAnySource);
    const bool with_gone = with != kAnySource && (*this)[with].status != UCS_OK;
    if (op->abandoned.load() && !with_gone) continue;
    Engine& engine = *op->engine;
    if (with_gone && op->kind == Op::Kind::kSend) {
      engine.fail_op_locked(*op, Errc::kPeerFailed, gone(with), false);
    } else if (with_gone && idle && now - (*this)[with].failed_at >= kRecvGrace) {
      engine.fail_op_locked(*op, Errc::kPeerFailed,
                            gone(with) + " and no matching message from it had arrived", false);
    } else if (op->tag_kind == TagKind::kInternal && group_failed) {
      // (With a gone peer of its own it lingers only until the branches above finish it.)
      engine.fail_op_locked(
          *op, Errc::kPeerFailed,
          gone(first_failed_) + ", so this collective of its group cannot complete", true);
      const auto bound = op->kind == Op::Kind::kRecv ? kRecvLinger : kSendLinger;
      if (!op->done.load() && !with_gone && now - op->lingering_since >= bound) {
        engine.abandon_locked(*op);
      }
    }
  }
}

bool complete_requests_locked(ucp_worker_h worker, std::vector<void*>& requests,
                              Clock::time_point deadline) {
  while (!requests.empty() && Clock::now() < deadline) {
    if (ucp_worker_progress(worker) == 0) ::usleep(50);
    requests.erase(std::remove_if(requests.begin(), requests.end(),
                                  [](void* r) {
                                    if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
                                    ucp_request_free(r);
                                    return true;
                                  }),
                   requests.end());
  }
  const bool all = requests.empty();
  for (void* r : requests) ucp_request_free(r);  // released by UCX when they complete
  requests.clear();
  return all;
}

void Peers::close_all_locked(Clock::time_point deadline) {
  std::vector<void*> closing;
  for (Peer& pr : peers_) {  // dead same-host peers are already closed
    if (pr.ep == nullptr) continue;
    if (void* r = start_close(pr.ep, pr.status != UCS_OK)) closing.push_back(r);
    pr.ep = nullptr;
  }
  complete_requests_locked(worker_.handle(), closing, deadline);
  for (void* r : closing_) ucp_request_free(r);
  closing_.clear();
  release_targets_locked(/*worker_gone=*/false);
}

void Peers::release_targets_locked(bool worker_gone) {
  // Never destroyed, so what they hold stays reachable (no leak report) to the end of the
  // process; their own lock, since Peers on different workers may release at once.
  static auto* kept_mu = new std::mutex;
  static auto* kept = new std::vector<std::unique_ptr<ErrorTarget>>;
  std::lock_guard<std::mutex> g(*kept_mu);
  for (Peer& pr : peers_) {
    if (pr.target == nullptr) continue;
    std::unique_ptr<ErrorTarget> t(pr.target);
    pr.target = nullptr;
    t->owner = nullptr;
    // UCX may call a closed endpoint's error handler later still: a force-closed endpoint whose
    // TCP lane then failed did (ASan, Failures.ARankThatLeavesRightAfterStartCrashesNoPeer). So a
    // target is kept to the end of the process (16 bytes per endpoint it ever made).
    if (!worker_gone) kept->push_back(std::move(t));
  }
}

Peers::~Peers() {
  // Normally close_all_locked() has released the targets. Where it has not run (no worker left to
  // call back, or a start that failed before its endpoints), what remains is detached and kept.
  std::lock_guard<std::mutex> lock(worker_.mutex());
  release_targets_locked(/*worker_gone=*/worker_.handle() == nullptr);
}

}  // namespace commux::detail
